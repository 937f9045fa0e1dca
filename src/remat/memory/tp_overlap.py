"""Megatron-LM's ``--tp-comm-overlap``: TransformerEngine's userbuffers, outside PyTorch's allocator, and what they
change in the layer linears' PyTorch tensors.

NOTE [TP communication overlap]
Sources: Megatron-LM d98e8a64 ``megatron/training/initialize.py:194-262`` (``_initialize_tp_communicators``),
``megatron/core/extensions/transformer_engine.py:1176-1221, 1457-1487``; TransformerEngine 2.17.1 (4329ff84)
``pytorch/module/base.py:126-547`` (``initialize_ub``), ``common/comm_gemm_overlap/comm_gemm_overlap.cpp``,
``common/comm_gemm_overlap/userbuffers/userbuffers-host.cpp``, ``pytorch/module/linear.py``,
``pytorch/module/layernorm_linear.py``, ``pytorch/cpp_extensions/gemm.py``, ``pytorch/csrc/extensions/gemm.cpp``.

* The buffers: Megatron calls ``initialize_ub(shape=[seq_length * micro_batch_size / cp, hidden], tp_size,
  quantization_modes=[FP8 or NONE] (+ NONE with bf16 first/last layers), ub_cfgs=the YAML)`` once per process,
  so every rank holds them whatever its pipeline stage. For each mode it makes one communicator object per GEMM
  (12: :data:`remat.job_tp_overlap.UB_NAMES`), each with its own buffer of that shape (bf16: Megatron passes no
  dtype; uint8 for the all-gather GEMMs in FP8 mode). A ``pipeline``/``bulk``/``external`` object
  (``CommOverlapBase``, comm_gemm_overlap.cpp:410-425) holds the whole shape; a ``ring_exchange`` one
  (``CommOverlapP2PBase``, :805-830) holds tp chunks of [rows/tp, hidden] (the whole shape), or 2 tp - 1 of them
  for a reduce-scatter. ``register_user_buffer_collective`` (userbuffers-host.cpp:514-650) maps the peers'
  buffers but allocates only the rank's own, with ``cuMemCreate`` rounded up to the multicast granularity
  (CUDA multicast: the default on NVSwitch Hopper; without it ``cudaMalloc`` of the exact bytes). The one
  communicator (a static, comm_gemm_overlap.h:53) adds its region 0 (``LOCALSIZE``, userbuffers-host.cpp:355,
  rounded likewise), 128 KiB of flags and two small id arrays (:361-377). None of it is PyTorch's: it is reported
  beside the peak and taken off a plan's budget (:mod:`remat.memory.outside_allocator`).
* In the linears (qkv, proj, fc1, fc2 of the decoder layers: Megatron gives only these buffer names, the experts
  run without, transformer_engine.py:1203-1206; the MTP depths' eh_proj turns the overlap off in the shared
  config before their layers are built, :1176-1186):
  - ``ag``: a column-parallel linear gathers its sequence-parallel input into the buffer (linear.py:365-371,
    layernorm_linear.py:277-283), not into a new tensor (the NCCL path's ``gather_along_first_dim``); a
    row-parallel one gathers its output gradient there in backward (base.py:1596-1605).
  - ``bulk_dgrad`` (LayerNormLinear: qkv and the dense fc1 only, the flags Megatron passes, :1457-1459): backward
    gathers the saved input into the dgrad buffer (layernorm_linear.py:735-742), not a new tensor.
  - ``bulk_wgrad`` (the same linears): the dgrad GEMM writes the whole input gradient into the wgrad buffer
    (:799-805, not a new [tokens, in] tensor) and its local chunk is cloned after the wgrad GEMM (:1063): one
    [tokens/tp, in] tensor, as the reduce-scatter's output was.
  - the row-parallel fprop reduce-scatter changes nothing: the GEMM's [tokens, out] output is still created by
    ``createOutputTensor`` (gemm.cpp:201-203) though the GEMM writes into the buffer, and the reduce-scatter output
    is a ``torch.empty`` (linear.py:469-474); ``rs_dgrad`` likewise (the dgrad output and its reduce-scatter output
    both made, layernorm_linear.py:799-802), and it turns the bulk overlaps off.
  The trace runs these linears through :class:`UbGatheredLinear` and :class:`UbReduceScatter`, which allocate what
  TE allocates; a real (non-fake) run still communicates through new tensors (it has no userbuffers).
"""

from __future__ import annotations

import functools
import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from remat.job import Job
from remat.job_tp_overlap import quantization_modes, ub_gemms
from remat.memory.outside_allocator import OutsideBuffer
from remat.models.tp_layers import (
    ColumnParallelLinear,
    ReduceScatterToSequence,
    RowParallelLinear,
    TensorParallelGroup,
)
from remat.units import round_up

# the driver's minimum granularity of a cuMemCreate / multicast binding (cuMemGetAllocationGranularity and
# cuMulticastGetGranularity with CU_MULTICAST_GRANULARITY_MINIMUM, userbuffers-host.cpp:536-551): 2 MiB on Hopper
# (assumed, not queried on a GPU here; with UB_SKIPMC=1 TE cudaMallocs the exact bytes instead)
UB_GRANULARITY = 2 << 20
# userbuffers.h:30-57: NVTE_MAX_REGIONS 32, NVTE_MAX_NVLINK 32, NVTE_MAX_SMS 32, NVTE_MAX_OPS 32, NVTE_MAX_PEERS
# 8192, NVTE_REG0_OPFLAGS 1024, userbuffers_op_types 5 (enum req_type), NVTE_REG0_COMMBUFFER 0
_REG0_OFFSET = 2 * 32 * 32 + (2 * 32 * 32 + 32) * 2 + 8192
_REG0_FLAGS = 1024 * 5 + 8192 * 32 * 3
UB_REGION0_BYTES = 4 * (_REG0_OFFSET + _REG0_FLAGS)  # LOCALSIZE, userbuffers-host.cpp:355
SOURCE = ("Megatron-LM initialize.py:223-246; TE 2.17.1 module/base.py:311-547, comm_gemm_overlap.cpp:410-425, "
          "805-830, userbuffers-host.cpp:514-650")
COMM_SOURCE = "TE 2.17.1 userbuffers-host.cpp:355-377, userbuffers.h:30-57"
_LINEAR = re.compile(r"^layers\.\d+\.(self_attention\.linear_(qkv|proj)|mlp\.(shared_experts\.)?linear_fc[12])$")


def userbuffer_parts(job: Job) -> list[OutsideBuffer]:
    """The userbuffers every rank of ``job`` holds outside PyTorch's allocator (NOTE
    [TP communication overlap]): one entry per quantization mode (its 12 GEMM buffers) and one for the
    communicator; empty without ``--tp-comm-overlap``.

    Example:
        >>> from remat.config import ModelConfig
        >>> from remat.job_tp_overlap import TpCommOverlap
        >>> job = Job.build(ModelConfig(hidden_size=4096, num_attention_heads=32, seq_length=8192, micro_batch_size=1),
        ...                 precision="bf16", tp=2, sp=True, tp_comm_overlap=TpCommOverlap())
        >>> [(what.split(":")[0], n >> 20) for what, n, _ in userbuffer_parts(job)]
        [('TE userbuffers (--tp-comm-overlap)', 768), ('TE userbuffers communicator', 4)]
    """
    overlap, m = job.tp_comm_overlap, job.model
    if overlap is None:
        return []
    rows, hidden, tp = m.seq_length * m.micro_batch_size // job.cp, m.hidden_size, job.tp
    parts = []
    for mode in quantization_modes(m.fp8_recipe, m.fp8_layers):
        gemms = ub_gemms(overlap, (mode,))
        total = 0
        for gemm in gemms:
            nbytes = rows * hidden * (1 if gemm.fp8_buf else 2)
            if gemm.method == "ring_exchange" and gemm.is_reduce_scatter:  # 2 tp - 1 chunks (cpp:816-821)
                nbytes = nbytes // tp * (2 * tp - 1)
            total += round_up(nbytes, UB_GRANULARITY)
        uint8 = sum(g.fp8_buf for g in gemms)
        kinds = f"{uint8} uint8, {len(gemms) - uint8} bf16" if uint8 else "bf16"
        parts.append(OutsideBuffer(f"TE userbuffers (--tp-comm-overlap{', FP8' * (mode == 'fp8')}): {len(gemms)} GEMM "
                                   f"buffers [{rows}, {hidden}] ({kinds})", total, SOURCE))
    # region 0, the flags (2 x 64 KiB) and the send / receive ids (nranks and NVTE_MAX_REGIONS x nranks ints)
    parts.append(OutsideBuffer("TE userbuffers communicator: region 0, flags, peer ids",
                               round_up(UB_REGION0_BYTES, UB_GRANULARITY) + 2 * 65536 + 4 * job.world_size * (1 + 32),
                               COMM_SOURCE))
    return parts


# ------------------------------------------------------------------------------------------------- the linears
def _gathered(x: torch.Tensor, group: TensorParallelGroup, in_buffer: bool) -> torch.Tensor:
    """``x``'s rows gathered over ``group``: in a userbuffer (no PyTorch tensor: a one-row stand-in expanded, so
    the GEMM that reads it allocates its own output) on a fake trace, else a new tensor."""
    if in_buffer and isinstance(x, FakeTensor):
        return x.new_empty(1, x.shape[-1]).expand(x.shape[0] * group.size, x.shape[-1])
    return group.all_gather(x)


class UbGatheredLinear(torch.autograd.Function):
    """TE's column-parallel linear under sequence parallelism with userbuffers (NOTE [TP communication overlap]):
    :class:`~remat.models.tp_layers.GatheredLinear` less the gathered input (``ag``: forward; ``bulk_dgrad``:
    backward) and the whole input gradient (``bulk_wgrad``: only its local chunk's clone)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                group: TensorParallelGroup, modes: tuple[str, ...]) -> torch.Tensor:
        ctx.group, ctx.has_bias, ctx.modes = group, bias is not None, modes
        ctx.save_for_backward(x, weight)
        return F.linear(_gathered(x, group, "ag" in modes), weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, weight = ctx.saved_tensors
        group, bulk_wgrad = ctx.group, "bulk_wgrad" in ctx.modes and isinstance(grad, FakeTensor)
        total = _gathered(x, group, "bulk_dgrad" in ctx.modes)
        grad_input = None if bulk_wgrad else group.reduce_scatter(grad.matmul(weight))
        grad_2d = grad.reshape(-1, grad.shape[-1])
        grad_weight = grad_2d.t().matmul(total.reshape(-1, total.shape[-1]))
        grad_bias = grad_2d.sum(0) if ctx.has_bias else None
        if bulk_wgrad:  # layernorm_linear.py:1063: the wgrad buffer's local chunk, cloned after the wgrad GEMM
            grad_input = x.new_empty(x.shape)
        return grad_input, grad_weight, grad_bias, None, None


class UbReduceScatter(ReduceScatterToSequence):
    """A row-parallel linear's reduce-scatter under ``ag``: forward as
    :class:`~remat.models.tp_layers.ReduceScatterToSequence` (inherited); backward's gathered output gradient is in
    the userbuffer (base.py:1596-1605), read by the dgrad and wgrad GEMMs, which allocate their own outputs."""

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gathered(grad.contiguous(), ctx.group, True), None


def _column(module: ColumnParallelLinear, modes: tuple[str, ...], x: torch.Tensor) -> torch.Tensor:
    return UbGatheredLinear.apply(x, module.weight, module.bias, module.group, modes)


def _row(module: RowParallelLinear, x: torch.Tensor) -> torch.Tensor:
    partial = F.linear(x, module.weight)
    out = UbReduceScatter.apply(partial.reshape(-1, partial.shape[-1]), module.group)
    return out + module.bias if module.bias is not None else out


def prepare_tp_overlap(model: nn.Module, modes: tuple[str, ...]) -> int:
    """Run the decoder layers' qkv / proj / fc1 / fc2 linears of ``model`` with userbuffers (``modes``: the model's
    ``tp_comm_overlap``; NOTE [TP communication overlap]); returns how many changed. Each changed module keeps its
    own modes in ``tp_overlap`` (:func:`remat.memory.fp8.prepare_fp8`, which runs after, reads them): a shared
    expert's fc1 is a ``TEColumnParallelLinear``, which Megatron gives no bulk overlap (transformer_engine.py:1189-
    1221), a row-parallel linear only ``ag``."""
    if not modes:
        return 0
    changed = 0
    for name, module in model.named_modules():
        if not _LINEAR.match(name) or not getattr(module, "sp", False):
            continue
        if isinstance(module, ColumnParallelLinear):
            own = modes if "shared_experts" not in name else tuple(m for m in modes if m == "ag")
            forward = functools.partial(_column, module, own)
        elif isinstance(module, RowParallelLinear):
            own = tuple(m for m in modes if m == "ag")
            forward = functools.partial(_row, module)
        else:
            continue
        module.tp_overlap = own
        if own:
            module.__dict__["forward"] = forward
            changed += 1
    return changed
