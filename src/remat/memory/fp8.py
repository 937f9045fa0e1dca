"""FP8 training under TransformerEngine (Megatron-LM's ``--fp8-format`` / ``--fp8-recipe
delayed|tensorwise|blockwise|mxfp8``, ``--fp8-param-gather``): what a Hopper or Blackwell rank keeps for each FP8
linear.

NOTE [FP8 linears on Hopper]
Sources: TransformerEngine 2.17.1 (4329ff84, Megatron-LM d98e8a64's pin) ``pytorch/module/linear.py``,
``module/base.py``, ``module/grouped_linear.py``; Megatron-LM d98e8a64 ``megatron/core/fp8_utils.py``,
``megatron/core/extensions/transformer_engine.py``, ``megatron/core/distributed/param_and_grad_buffer.py``.

* Which GEMMs: Megatron enters ``fp8_autocast`` around every transformer layer and MTP layer
  (fp8_utils.py:832 ``get_fp8_context``; transformer_block.py:619-689, multi_token_prediction.py:1388), so every TE
  linear there runs in FP8: qkv / proj / fc1 / fc2, MLA's projections, the shared and routed experts. The
  embedding, the router (a plain GEMM) and the output layer (Megatron's own ``ColumnParallelLinear``) stay in the
  activation dtype; so does core attention (``fp8_dot_product_attention`` off by default).
* Delayed (``Float8Quantizer``) and tensorwise (``Float8CurrentScalingQuantizer``) scaling make ``Float8Tensor``s:
  one byte per element and an fp32 ``scale_inv`` of one element. Hopper's FP8 GEMM takes only the TN layout, so a
  tensor needed transposed has a second, transposed copy (its "columnwise" data, one byte per element).
* A linear's input (linear.py:368-389): quantized with both copies when backward needs it, the row-wise copy
  dropped after the GEMM (linear.py:546-560), so the column-wise copy (1 byte per element) is what is saved. A
  column-parallel linear under sequence parallelism (linear.py:328-363) quantizes its token shard row-wise only
  (FP8 column-wise data cannot be all-gathered), gathers it in FP8 (1 byte per gathered element, freed after the
  GEMM: linear.py:489), and saves the row-wise shard; backward gathers it again and transposes it (linear.py:1088).
* Backward quantizes the output gradient row- and column-wise (linear.py:823, 1130: dgrad and wgrad GEMMs) and
  makes the input gradient in the activation dtype; the weight gradient in the activation dtype too, unless
  gradient-accumulation fusion writes it into ``main_grad``.
* Weights: without ``--fp8-param-gather`` each linear quantizes its weight into a workspace cached on the module
  (``_fp8_workspaces['weight']``: Megatron passes ``is_first_microbatch``, transformer_engine.py:1338, so
  ``cache_name='weight'``, linear.py:1859; base.py:750 ``quantize_weight``), row- and column-wise (linear.py:409-419):
  2 bytes per weight element kept for the whole run beside the bf16 weight. With ``--fp8-param-gather`` the
  weights are ``Float8Tensor`` parameters (``fp8_model_init``): the DDP buffer holds them as uint8
  (param_and_grad_buffer.py:921 ``group_params_for_buffers``: a buffer of their own), and
  ``post_all_gather_processing`` (fp8_utils.py:687) makes their transposes after each all-gather: again 2 bytes
  per element, no workspace.

NOTE [FP8 linears on Blackwell]
Sources: TransformerEngine 2.17.1 (4329ff84) ``pytorch/utils.py:657`` ``is_non_tn_fp8_gemm_supported`` (compute
capability 10.x/11.x or >= 13.0), ``csrc/quantizer.cpp``, ``tensor/storage/float8_tensor_storage.py``,
``tensor/mxfp8_tensor.py``, ``storage/mxfp8_tensor_storage.py``, ``quantization.py``, ``csrc/extensions/gemm.cpp``,
``csrc/extensions/swizzle.cpp``. The mechanisms above, parametrised by the GPU's compute capability (``sm``, from
``--gpu``: :class:`Fp8Recipe`):

* ``Float8Tensor`` (delayed, tensorwise) on Blackwell takes every GEMM layout, so one row-wise copy serves both
  usages: the quantizers make no transpose (quantizer.cpp:288-312 ``with_data = rowwise_usage ||
  is_non_tn_fp8_gemm_supported``, ``with_transpose = columnwise_usage && !is_non_tn...``) and ``update_usage``
  keeps the data and never transposes (float8_tensor_storage.py:241-252). So a linear quantizes its input once (1
  byte per element) and saves that copy; backward quantizes the output gradient once; the gathered input under
  sequence parallelism is used as gathered (distributed.py:1064-1071); the cached weight workspace (or, with
  ``--fp8-param-gather``, the parameter) is the row-wise data alone: 1 byte per weight element and one scale.
* ``blockwise`` (``Float8BlockQuantizer``) keeps Hopper's tensors (no device branch in its quantizer); its GEMM is
  emulated with MXFP8 (gemm.cpp:312-322 ``convert_block_scaling_to_mxfp8_tensor``), which allocates each operand's
  swizzled E8M0 scales, ``[pad(rows, 128), ceil(cols / 128) * 4]`` bytes (swizzle.cpp:303-335), for the GEMM.
* ``mxfp8`` (``MXFP8BlockScaling``; TE refuses it below compute capability 10.0: quantization.py:162-168
  ``check_mxfp8_support``, "Device compute capability 10.0 or higher required for MXFP8 execution"): an
  ``MXFP8Tensor`` keeps row-wise and column-wise data of the tensor's own shape (mxfp8_tensor.py:141
  ``get_columnwise_shape``), 1 byte per element each, with 1-byte E8M0 scales, one per 32 elements along the row
  (row-wise: ``[pad(rows, 128), pad(cols / 32, 4)]``) or the column (column-wise: ``[pad(rows / 32, 4),
  pad(cols, 128)]``: quantizer.cpp:1710-1740 ``MXFP8Quantizer::get_scale_shape``); both dimensions must be
  multiples of 32 (quantizer.cpp:1395). A linear quantizes its input both ways and saves the column-wise copy
  (linear.py:546-560: ``supports_only_rowwise_all_gather`` is False, so also under sequence parallelism, where the
  row-wise shard is gathered for the GEMM and the column-wise shard gathered again in backward, linear.py:883-901);
  backward quantizes the output gradient both ways; the cached weight workspace holds both copies. MXFP8's recipe
  state keeps no amax history. Inputs and output gradients are quantized with GEMM-ready (swizzled) scales
  (linear.py:1985-1996 ``optimize_for_gemm``), so only the cached weight's scales are swizzled into a transient
  copy at each GEMM (swizzle.cpp:47-90 ``swizzle_scales_for_gemm``); the gathered input and the row-parallel
  output gradient under sequence parallelism (not GEMM-ready, linear.py:1986, 1994) likewise.

The trace runs these linears through :func:`fp8_linear` and friends, which allocate what TE allocates (uint8
tensors of the same shapes) around the same GEMM; the persistent weight copies are model state
(:func:`fp8_state_bytes`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from remat.job_flags import JobError
from remat.memory.tp_overlap import UbReduceScatter
from remat.memory.workspaces import gpu_major
from remat.models.moe import GroupedLinear, grouped_mm
from remat.models.tp_layers import (
    ColumnParallelLinear,
    CopyToRegion,
    RowParallelLinear,
    TensorParallelGroup,
    is_te_linear_weight,
)
from remat.units import round_up

SCALE_BYTES = 4  # a Float8Tensor's fp32 scale_inv: one element
MODULE = "transformer_engine.fp8_weights"  # the timeline row of fp8_state_bytes


def check_fp8_gpu(gpu: str | None, recipe: str = "tensorwise", tp_overlap: Sequence[str] = ()) -> int:
    """The compute capability (major) whose FP8 GEMM layouts the job's linears follow on ``gpu`` (9: Hopper, NOTE
    [FP8 linears on Hopper]; 10: Blackwell, NOTE [FP8 linears on Blackwell]; ``gpu=None`` is Hopper); refuses
    Ampere (no FP8 GEMMs: TE refuses) and ``mxfp8`` on Hopper as TE does, naming the fix.

    Example:
        >>> check_fp8_gpu("h100-80g"), check_fp8_gpu("b200", "mxfp8")
        (9, 10)
    """
    major = gpu_major(gpu)
    if major < 9:
        raise JobError(f"gpu={gpu!r} with FP8 (--fp8-format): Ampere has no FP8 GEMMs (TE: 'Device compute "
                       "capability 8.9 or higher required for FP8 execution', quantization.py:153): price the job "
                       "for an h100 or b200 (--gpu), or without --fp8-format")
    if recipe == "mxfp8" and major < 10:
        raise JobError(f"--fp8-recipe mxfp8 on {gpu or 'Hopper (no --gpu)'}: TE refuses it ('Device compute "
                       "capability 10.0 or higher required for MXFP8 execution', quantization.py:162-168): give a "
                       "Blackwell GPU (--gpu b200 or gb200), or use --fp8-recipe tensorwise or blockwise on Hopper")
    if recipe == "mxfp8" and tp_overlap:
        raise JobError("--tp-comm-overlap with --fp8-recipe mxfp8 is not modelled: TE's userbuffers gather the "
                       "row-scaled output gradient and quantize a column-scaled copy apart (linear.py:1093-1110); "
                       "drop --tp-comm-overlap to price the rest")
    return min(major, 10)


class Fp8Recipe(str):
    """An FP8 recipe's name (a ``str``, equal to it) with the compute capability (major) of the GPU whose GEMMs run
    it (``sm``: 9 Hopper, 10 Blackwell): what :func:`prepare_fp8` hands its linears.

    Example:
        >>> r = Fp8Recipe("tensorwise", 10)
        >>> r == "tensorwise", r.sm, two_copies(r), two_copies("tensorwise")
        (True, 10, False, True)
    """

    sm: int

    def __new__(cls, name: str, sm: int = 9) -> Fp8Recipe:
        out = super().__new__(cls, name)
        out.sm = sm
        return out


def two_copies(recipe: str, sm: int | None = None) -> bool:
    """Whether a tensor used both ways (a saved input, an output gradient, a weight) needs column-wise data apart
    from its row-wise data: always for ``blockwise`` and ``mxfp8``, for ``Float8Tensor`` recipes only on Hopper
    (TN-only FP8 GEMMs: its transpose). ``sm``: the compute capability (major), else ``recipe``'s
    (:class:`Fp8Recipe`), else Hopper's."""
    sm = getattr(recipe, "sm", 9) if sm is None else sm
    return recipe in ("blockwise", "mxfp8") or sm < 10


def is_fp8_weight(name: str) -> bool:
    """Whether the parameter ``name`` is the weight of a TE linear Megatron runs in FP8 (NOTE [FP8 linears on
    Hopper]): every TE linear (:func:`remat.models.tp_layers.is_te_linear_weight`) of a transformer or MTP layer.

    Example:
        >>> is_fp8_weight("layers.0.mlp.linear_fc1.weight"), is_fp8_weight("head.output_layer.weight")
        (True, False)
    """
    return is_te_linear_weight(name)


def _gemm_shape(p: Any) -> tuple[int, int, int]:
    """(GEMMs, out, in) of an FP8 weight: a grouped [experts, in, out] weight is one [out, in] weight per expert,
    as TE's ``GroupedLinear`` holds ``weight{i}`` (grouped_linear.py:1346)."""
    if len(p.shape) == 3:
        return p.shape[0], p.shape[2], p.shape[1]
    if len(p.shape) == 2:
        return 1, p.shape[0], p.shape[1]
    return 1, p.numel, 1


def scale_bytes(rows: int, cols: int, recipe: str, *, columnwise: bool, block_dim: int = 1) -> int:
    """The ``scale_inv`` bytes of a [rows, cols] FP8 tensor's row-wise (or column-wise) data: one fp32 scale for
    ``delayed`` / ``tensorwise``; ``blockwise`` one fp32 per 1x128 block (``block_dim=1``, activations and
    gradients) or per 128x128 block (``block_dim=2``, weights), padded as ``Float8BlockQuantizer.get_scale_shape``
    pads them (float8_blockwise_tensor.py:121-170); ``mxfp8`` one byte per 1x32 block (NOTE [FP8 linears on
    Blackwell]).

    Example:
        >>> [scale_bytes(1000, 256, r, columnwise=False) for r in ("tensorwise", "blockwise", "mxfp8")]
        [4, 8000, 8192]
    """
    if recipe == "mxfp8":  # 1-byte E8M0 scales per 1x32 block (quantizer.cpp:1710-1740, weights too)
        if columnwise:
            return round_up(-(-rows // 32), 4) * round_up(cols, 128)
        return round_up(rows, 128) * round_up(-(-cols // 32), 4)
    if recipe != "blockwise":
        return SCALE_BYTES
    blocks = -(-cols // 128), -(-rows // 128)
    if block_dim == 2:
        shape = (blocks[0], round_up(blocks[1], 4)) if columnwise else (blocks[1], round_up(blocks[0], 4))
    else:
        shape = (blocks[1], round_up(cols, 4)) if columnwise else (blocks[0], round_up(rows, 4))
    return 4 * shape[0] * shape[1]


def fp8_state_bytes(params: Sequence[Any], recipe: str, *, param_gather: bool, amax_history: int = 1,
                    block: int = 1, sm: int = 9) -> int:
    """What a rank keeps for its FP8 linears for the whole run, beside parameters, gradients and optimizer state
    (NOTE [FP8 linears on Hopper]), each tensor rounded to the allocator's ``block`` bytes. ``params`` are
    :class:`remat.memory.rank_state.ParamInfo` (which imports this module: not imported here): the FP8 weights
    (``ParamInfo.fp8``: not those of layers run in bf16 under ``--first-last-layers-bf16``).

    * without ``param_gather``: each weight's cached FP8 workspace, row-wise and column-wise data (1 byte per
      element each) with their scales (:func:`scale_bytes`, 128x128 blocks for ``blockwise``); on Blackwell
      (``sm`` 10) a ``Float8Tensor`` workspace is its row-wise data and scale alone (NOTE [FP8 linears on
      Blackwell]);
    * with ``param_gather``: the parameter's row-wise data is in the uint8 param buffer (model state); its
      scales, its column-wise data and their scales are extra;
    * ``delayed`` scaling: each module's recipe state (quantization.py:1426 ``DelayedScalingRecipeState``): forward
      ``scale`` [3n] and ``amax_history`` [amax_history, 3n], backward [2n] and [amax_history, 2n], fp32, for n GEMMs
      (``tensorwise`` and ``blockwise`` quantizers keep none: quantization.py:1456, 1530).

    Example:
        >>> from remat.memory.rank_state import ParamInfo
        >>> w = [ParamInfo("layers.0.mlp.linear_fc1.weight", 1000, shape=(40, 25))]
        >>> fp8_state_bytes(w, "tensorwise", param_gather=False), fp8_state_bytes(w, "tensorwise", param_gather=True)
        (2008, 1008)
        >>> fp8_state_bytes(w, "tensorwise", param_gather=False, sm=10)
        1004
    """
    total = 0
    usages = (False, True) if two_copies(recipe, sm) else (False,)
    for p in params:
        gemms, out, inp = _gemm_shape(p)
        numel = out * inp
        scales = [round_up(scale_bytes(out, inp, recipe, columnwise=c, block_dim=2), block) for c in usages]
        total += gemms * ((len(usages) - param_gather) * round_up(numel, block) + sum(scales))
        if recipe == "delayed":
            total += sum(round_up(4 * n * rows, block) for n in (3 * gemms, 2 * gemms) for rows in (1, amax_history))
    return total


def _quantized(x: torch.Tensor, recipe: str, transposed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 tensor's data (1 byte per element; ``transposed``: the column-wise copy, transposed for
    ``Float8Tensor`` and ``blockwise``, of ``x``'s shape for ``mxfp8``) and its scales (:func:`scale_bytes`, 1x128
    blocks for ``blockwise`` activations and gradients)."""
    cols = x.shape[-1]
    return _fp8_tensor(x.numel() // max(cols, 1), cols, recipe, transposed, x, tuple(x.shape))


def _fp8_tensor(rows: int, cols: int, recipe: str, columnwise: bool, like: torch.Tensor,
                shape: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_quantized` of a [rows, cols] tensor (``shape``: its own, for row-wise or MXFP8 data)."""
    if columnwise and recipe != "mxfp8":
        shape = (cols, rows)
    nbytes = scale_bytes(rows, cols, recipe, columnwise=columnwise)
    scale = (torch.empty(nbytes, dtype=torch.uint8, device=like.device) if recipe == "mxfp8" else
             torch.empty(nbytes // 4, dtype=torch.float32, device=like.device))
    return torch.empty(shape or (rows, cols), dtype=torch.uint8, device=like.device), scale


def _check_mxfp8(recipe: str, rows: int, cols: int) -> None:
    """TE quantizes MXFP8 tensors whose two dimensions are multiples of 32 only (quantizer.cpp:1395)."""
    if recipe == "mxfp8" and (rows % 32 or cols % 32):
        raise JobError(f"--fp8-recipe mxfp8: a linear's [{rows}, {cols}] input (tokens x features) is not made of "
                       "32 x 32 blocks (TE: 'MXFP8 requires tensor dims that are divisible by 32', quantizer.cpp:"
                       "1395): make the tokens per rank (--seq-length x --micro-batch-size / tp) and the hidden "
                       "sizes multiples of 32, or use --fp8-recipe tensorwise")


def _gemm_scales(recipe: str, like: torch.Tensor, gemm: str, rows: int, inp: int, out: int,
                 gathered: bool = False) -> list[torch.Tensor]:
    """The transient scales TE makes for one GEMM (``fprop``, ``dgrad`` or ``wgrad``) of a linear ([rows, inp] input,
    [out, inp] weight) on Blackwell (NOTE [FP8 linears on Blackwell]): each ``blockwise`` operand converted to
    MXFP8, ``[pad(d0, 128), ceil(d1 / 128) * 4]`` bytes for its [d0, d1] data (swizzle.cpp:328-333); for ``mxfp8``
    a swizzled copy of the scales of each operand that are not GEMM-ready (swizzle.cpp:80-82): the cached weight's,
    and the input's when it was gathered (``gathered``: sequence parallelism). None on Hopper."""
    if getattr(recipe, "sm", 9) < 10 or recipe not in ("blockwise", "mxfp8"):
        return []
    weight, x, grad = (out, inp), (rows, inp), (rows, out)  # (rows, cols) of each operand, used row- or column-wise
    ops = {"fprop": [(weight, False), (x, False)], "dgrad": [(weight, True), (grad, False)],
           "wgrad": [(x, True), (grad, True)]}[gemm]
    if recipe == "blockwise":
        data = [(c, r) if colwise else (r, c) for (r, c), colwise in ops]  # the column-wise data is transposed
        sizes = [round_up(d0, 128) * -(-d1 // 128) * 4 for d0, d1 in data]
    else:
        keep = [op for op in ops if op[0] is weight or (gathered and op[0] is x)]
        sizes = [scale_bytes(r, c, recipe, columnwise=colwise) for (r, c), colwise in keep]
    return [torch.empty(n, dtype=torch.uint8, device=like.device) for n in sizes]


def _stand_in(rows: int, cols: int, like: torch.Tensor) -> torch.Tensor:
    """A [rows, cols] operand for a GEMM whose real operand is FP8 data: one row expanded (no copy), so the trace
    counts the GEMM's FLOPs and allocates its output, not a high-precision copy TE never makes (the one row,
    ``cols`` elements, is the only allocation: transient, at most one allocator block)."""
    return like.new_empty(1, cols).expand(rows, cols)


def _weight_grad(grad: torch.Tensor, rows: int, weight: torch.Tensor) -> torch.Tensor:
    """The wgrad GEMM (FP8 output-gradient x FP8 input, out_dtype the activation dtype): [out, in]."""
    grad_2d = grad.reshape(-1, grad.shape[-1])
    return grad_2d.t().mm(_stand_in(rows, weight.shape[1], grad))


def _grad_output_copies(grad: torch.Tensor, recipe: str) -> tuple[torch.Tensor, ...]:
    """Backward's quantized output gradient: row-wise (dgrad) and column-wise (wgrad) copies, linear.py:823 (one
    copy for both on Blackwell's ``Float8Tensor``: NOTE [FP8 linears on Blackwell])."""
    return (*_quantized(grad, recipe), *(_quantized(grad, recipe, transposed=True) if two_copies(recipe) else ()))


class Fp8Linear(torch.autograd.Function):
    """TE's ``_Linear`` in FP8 without an input all-gather: ``x @ weight.T (+ bias)`` keeping the column-wise FP8
    copy of ``x`` (NOTE [FP8 linears on Hopper])."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                recipe: str, ub_tp: int = 1) -> torch.Tensor:
        rows = x.numel() // max(x.shape[-1], 1)
        _check_mxfp8(recipe, rows, x.shape[-1])
        rowwise = _quantized(x, recipe)
        # Blackwell's Float8Tensor: the one row-wise copy is kept (NOTE [FP8 linears on Blackwell])
        saved = _quantized(x, recipe, transposed=True) if two_copies(recipe) else rowwise
        scales = _gemm_scales(recipe, x, "fprop", rows, x.shape[-1], weight.shape[0])
        out = F.linear(x, weight, bias)  # x's bytes are those of its FP8 copy's GEMM: the same output
        del rowwise, scales  # linear.py:560: the row-wise data is dropped before saving
        ctx.save_for_backward(*saved, weight)
        ctx.shape, ctx.has_bias, ctx.recipe, ctx.ub_tp = x.shape, bias is not None, recipe, ub_tp
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        data, scale, weight = ctx.saved_tensors
        if ctx.ub_tp > 1:  # NOTE [TP communication overlap]: the output gradient's shard quantized row-wise into
            # the userbuffer and gathered there (base.py:1614-1633); the column-wise copy is TE's transpose
            grad_2d = grad.reshape(-1, grad.shape[-1])
            copies = (*_quantized(grad_2d[:grad_2d.shape[0] // ctx.ub_tp], ctx.recipe),
                      *(_quantized(grad_2d, ctx.recipe, transposed=True) if two_copies(ctx.recipe) else ()))
        else:
            copies = _grad_output_copies(grad, ctx.recipe)
        rows, (out, inp) = data.numel() // weight.shape[1], weight.shape
        scales = _gemm_scales(ctx.recipe, grad, "dgrad", rows, inp, out) if ctx.needs_input_grad[0] else []
        grad_input = grad.matmul(weight).view(ctx.shape) if ctx.needs_input_grad[0] else None
        del scales
        scales = _gemm_scales(ctx.recipe, grad, "wgrad", rows, inp, out) if ctx.needs_input_grad[1] else []
        grad_weight = _weight_grad(grad, rows, weight) if ctx.needs_input_grad[1] else None
        del scales
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        del copies, data, scale
        return grad_input, grad_weight, grad_bias, None, None


class Fp8GatheredLinear(torch.autograd.Function):
    """TE's column-parallel ``_Linear`` in FP8 under sequence parallelism (``x``: [tokens/tp, in]), linear.py:328-363:
    the token shard is quantized (row-wise only for ``delayed``/``tensorwise``, whose column-wise data cannot be
    all-gathered; both for ``blockwise``), gathered row-wise in FP8 for the GEMM (freed after it, :489), and the
    shard saved: row-wise, or column-wise for ``blockwise`` (:546-560, ``supports_only_rowwise_all_gather``);
    backward gathers the saved shard again (transposing it where it was saved row-wise, :1088)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                group: TensorParallelGroup, recipe: str, overlap: tuple[str, ...] = ()) -> torch.Tensor:
        _check_mxfp8(recipe, x.shape[0], x.shape[-1])
        shard = _quantized(x, recipe)
        kept = _quantized(x, recipe, transposed=True) if recipe in ("blockwise", "mxfp8") else shard
        # NOTE [TP communication overlap]: under 'ag' the shard is gathered into the userbuffer (base.py:622-643)
        total = () if "ag" in overlap else (group.all_gather(shard[0]), group.all_gather(shard[1]))
        rows = x.shape[0] * group.size
        scales = _gemm_scales(recipe, x, "fprop", rows, x.shape[-1], weight.shape[0], gathered=True)
        out = F.linear(_stand_in(rows, x.shape[-1], x), weight, bias)
        del total, shard, scales  # linear.py:489 clear_tensor_data(inputmat_total); the shard's row-wise data if unkept
        ctx.save_for_backward(*kept, weight)
        ctx.group, ctx.has_bias, ctx.recipe, ctx.overlap = group, bias is not None, recipe, overlap
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        data, scale, weight = ctx.saved_tensors
        size, inp = ctx.group.size, weight.shape[1]
        rows = data.numel() // inp * size
        if ctx.recipe == "blockwise":  # the column-wise [in, tokens/tp] shards gathered into [in, tokens]
            gathered = data.new_empty(data.shape[0], data.shape[1] * size), scale.new_empty(scale.numel() * size)
        elif ctx.recipe == "mxfp8":  # the column-wise [tokens/tp, in] shards gathered (distributed.py
            # _all_gather_mxfp8: a [tokens, in] MXFP8 tensor, its scales padded as one)
            gathered = _fp8_tensor(rows, inp, ctx.recipe, True, data)
        else:  # gathered row-wise (into the userbuffer under 'bulk_dgrad'), then update_usage(columnwise_usage=True)
            # transposes it on Hopper; Blackwell's GEMM takes it as gathered (distributed.py:1064-1071)
            total = () if "bulk_dgrad" in ctx.overlap else (ctx.group.all_gather(data), ctx.group.all_gather(scale))
            gathered = (_quantized(total[0] if total else data[:1].expand(rows, -1), ctx.recipe, transposed=True)
                        if two_copies(ctx.recipe) else total)
            del total
        copies = _grad_output_copies(grad, ctx.recipe)
        bulk_wgrad = "bulk_wgrad" in ctx.overlap and ctx.needs_input_grad[0]
        scales = _gemm_scales(ctx.recipe, grad, "dgrad", rows, inp, weight.shape[0]) if ctx.needs_input_grad[0] \
            else []
        grad_input = ctx.group.reduce_scatter(grad.matmul(weight)) if ctx.needs_input_grad[0] and not bulk_wgrad \
            else None
        del scales
        scales = (_gemm_scales(ctx.recipe, grad, "wgrad", rows, inp, weight.shape[0], gathered=True)
                  if ctx.needs_input_grad[1] else [])
        grad_weight = _weight_grad(grad, grad.shape[0], weight) if ctx.needs_input_grad[1] else None
        del scales
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        if bulk_wgrad:  # the whole dgrad in the (bf16) wgrad userbuffer, its local chunk cloned after the wgrad GEMM
            grad_input = grad.new_empty(data.shape[0], weight.shape[1])  # layernorm_linear.py:1063
        del gathered, copies
        return grad_input, grad_weight, grad_bias, None, None, None


class Fp8GroupedMatmul(torch.autograd.Function):
    """TE's ``GroupedLinear`` in FP8: each expert's rows quantized (``split_quantize``), the column-wise copies
    saved; the weight [experts, in, out] as the reference's :class:`~remat.models.moe.GroupedMatmul`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, counts: list[int], recipe: str) -> torch.Tensor:
        rowwise = _quantized(x, recipe)
        saved = _quantized(x, recipe, transposed=True) if two_copies(recipe) else rowwise
        out = grouped_mm(x, weight, counts)
        del rowwise
        ctx.save_for_backward(*saved, weight)
        ctx.shape, ctx.counts, ctx.recipe = x.shape, counts, recipe
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        data, scale, weight = ctx.saved_tensors
        copies = _grad_output_copies(grad, ctx.recipe)
        grad_x = grouped_mm(grad, weight.transpose(1, 2), ctx.counts) if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = weight.new_empty(weight.shape)
            for e, (rows, g) in enumerate(zip(ctx.counts, grad.split(ctx.counts))):
                torch.mm(_stand_in(rows, weight.shape[1], grad).t(), g, out=grad_weight[e])
        del copies, data, scale
        return grad_x, grad_weight, None, None


def _nn_linear(module: nn.Linear, recipe: str, x: torch.Tensor) -> torch.Tensor:
    return Fp8Linear.apply(x, module.weight, module.bias, recipe)


def _column(module: ColumnParallelLinear, recipe: str, x: torch.Tensor) -> torch.Tensor:
    if module.sp:  # with the userbuffers' modes of remat.memory.tp_overlap.prepare_tp_overlap, if any
        return Fp8GatheredLinear.apply(x, module.weight, module.bias, module.group, recipe,
                                       getattr(module, "tp_overlap", ()))
    return Fp8Linear.apply(CopyToRegion.apply(x, module.group), module.weight, module.bias, recipe)


def _row(module: RowParallelLinear, recipe: str, x: torch.Tensor) -> torch.Tensor:
    if "ag" in getattr(module, "tp_overlap", ()):  # the output gradient gathered in the userbuffer
        partial = Fp8Linear.apply(x, module.weight, None, recipe, module.group.size)
        out = UbReduceScatter.apply(partial.reshape(-1, partial.shape[-1]), module.group)
        return out + module.bias if module.bias is not None else out
    return module.reduce_partial(Fp8Linear.apply(x, module.weight, None, recipe))


def _grouped(module: GroupedLinear, recipe: str, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    return Fp8GroupedMatmul.apply(x, module.weight, counts, recipe)


def prepare_fp8(model: nn.Module, recipe: str, bf16_layers: Sequence[int] = (), sm: int = 9) -> int:
    """Run every TE linear of ``model`` (:func:`is_fp8_weight`; NOTE [FP8 linears on Hopper]) in FP8 with ``recipe``
    on a GPU of compute capability ``sm`` (9 Hopper, 10 Blackwell: NOTE [FP8 linears on Blackwell]),
    except in the layers ``model.layers[i]`` for i in ``bf16_layers`` (``--first-last-layers-bf16``): each module's
    forward becomes the FP8 one (an instance attribute, like the kernel profile's: recompute regions installed
    later wrap it). Returns how many modules changed. Each changed module is marked ``saves_fp8_input``
    (:func:`remat.memory.wgrad_fusion.keep_fused_inputs` leaves its input alone: the FP8 forward saves its own copy,
    as TE does whatever the fusion)."""
    skipped = {f"layers.{i}." for i in bf16_layers}
    recipe = Fp8Recipe(recipe, sm)
    changed = 0
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, nn.Parameter) or not is_fp8_weight(f"{name}.weight"):
            continue
        if any(name.startswith(prefix) for prefix in skipped):
            continue
        if isinstance(module, ColumnParallelLinear):
            forward = functools.partial(_column, module, recipe)
        elif isinstance(module, RowParallelLinear):
            forward = functools.partial(_row, module, recipe)
        elif isinstance(module, GroupedLinear):
            forward = functools.partial(_grouped, module, recipe)
        elif isinstance(module, nn.Linear):
            forward = functools.partial(_nn_linear, module, recipe)
        else:
            raise TypeError(f"{name}: {type(module).__name__} holds an FP8 weight but has no FP8 forward in "
                            "remat.memory.fp8; please report this model")
        module.__dict__["forward"] = forward
        module.saves_fp8_input = True
        changed += 1
    return changed
