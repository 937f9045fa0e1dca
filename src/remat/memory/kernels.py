"""Kernel profiles: predict the tensors a training step keeps on a GPU from a fake trace on the CPU.

A fake trace runs the CPU kernels, which keep other tensors than CUDA's: CPU dropout keeps a float noise tensor
where CUDA's fused ``native_dropout`` keeps a 1-byte mask, CPU LayerNorm keeps its statistics in the activation
dtype, CPU ``rms_norm`` is a composite that keeps fp32 copies, CPU attention kernels differ. A profile routes
the functions whose kernels differ to the CUDA kernels' meta implementations while the fake trace runs (:func:`routed`):

* ``cpu``: nothing is routed; exactly the CPU kernels.
* ``cuda``: what PyTorch eager runs on CUDA (:data:`CUDA_ROUTES`, :mod:`remat.memory.cuda_sdpa`).
* ``te``: ``cuda`` plus TransformerEngine's layers as Megatron-LM runs them (:data:`TE_VERSION`,
  :data:`TE_ATTENTION_VERSION`): TE's unfused attention for the reference model's 'math' core attention
  (``--attention-backend unfused``) and for fp32, its fused attention for 'sdpa' and any 16-bit
  ``scaled_dot_product_attention``, and the fused SwiGLU of ``LayerNormMLP``.
* ``local``: ``cuda`` plus Megatron-LM's local layers (``--transformer-impl local``,
  :mod:`remat.memory.local_layers`): its ``DotProductAttention`` for every core attention, the fused SwiGLU.

``docs/kernels.md`` lists every substitution with the source it follows. Operators a profile cannot express
(another library's ops, CPU-only kernels, attention made of separate operators under ``te``) are priced as traced
and named in a :class:`KernelWarning` with their bytes.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
import warnings
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from remat.config import ModelConfig
from remat.memory.cuda_sdpa import HALF, cuda_sdpa
from remat.memory.fp8 import prepare_fp8
from remat.memory.local_layers import AttentionContext, heads_like, local_attention
from remat.memory.tp_overlap import prepare_tp_overlap
from remat.models.gpt import CoreAttention, SelfAttention, SwiGLU
from remat.recompute.layer_offload import mark_offload_base

KERNELS = ("cpu", "cuda", "te", "local")
# the functions a profile replaces, as torch defines them (the replacements call these, never the patched names)
_dropout, _layer_norm = F.dropout, F.layer_norm
TE_VERSION = "TransformerEngine 1.x (layernorm_linear.py / layernorm_mlp.py as of 2024, v1.5-1.7)"
# attention: TE 2.17.1, NVIDIA/TransformerEngine@4329ff84 (Megatron-LM d98e8a6's pin: pyproject.toml, uv.lock),
# transformer_engine/pytorch/attention/dot_product_attention/{backends,softmax,utils}.py
TE_ATTENTION_VERSION = "TransformerEngine 2.17.1 (4329ff84): dot_product_attention/backends.py, softmax.py, utils.py"
aten = torch.ops.aten
_DEVICE_QUERY = torch.ops.prim.device.default


class KernelWarning(UserWarning):
    """An operator the kernel profile cannot translate: it is priced at the bytes the fake trace gave it."""


_ACTIVE: ContextVar[str | None] = ContextVar("remat_kernels", default=None)


def check_kernels(kernels: str) -> str:
    """``kernels`` if it names a profile, else a ValueError naming the field and the choices."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels={kernels!r}: must be one of {', '.join(KERNELS)} (--kernels cpu|cuda|te|local)")
    return kernels


def model_kernels(kernels: str, config: ModelConfig) -> str:
    """The profile a Megatron model's GPU kernels follow: ``'local'`` for ``cuda`` and ``te`` when the model is
    built of Megatron's local layers (``config.transformer_impl``, ``--transformer-impl local``: no TE module runs,
    its attention is ``DotProductAttention``), else ``kernels`` (``cpu`` stays the CPU's kernels)."""
    local = config.transformer_impl == "local" and check_kernels(kernels) in ("cuda", "te")
    return "local" if local else kernels


@contextlib.contextmanager
def use_kernels(kernels: str | None) -> Iterator[None]:
    """Make ``kernels`` the profile of every prediction traced inside the block (None: keep the current one).

    Example::

        >>> from remat.config import ModelConfig
        >>> from remat.memory.predict import predict_config
        >>> with use_kernels("cuda"):
        ...     timeline = predict_config(ModelConfig(num_layers=2, hidden_size=64, seq_length=32), "none")
        >>> timeline.meta["kernels"]
        'cuda'
    """
    token = _ACTIVE.set(check_kernels(kernels) if kernels is not None else _ACTIVE.get())
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def resolve_kernels(kernels: str | None = None, device: str = "cpu") -> str:
    """The profile a trace uses: ``kernels`` if given, else the one :func:`use_kernels` set, else ``'cuda'`` for
    ``device='cuda'`` and ``'cpu'`` otherwise."""
    if kernels is not None:
        return check_kernels(kernels)
    return _ACTIVE.get() or ("cuda" if device == "cuda" else "cpu")


# ---------------------------------------------------------------------------------------------------------
# CUDA kernels whose saved tensors differ from the CPU ones
# ---------------------------------------------------------------------------------------------------------
def _stat_shape(x: torch.Tensor, normalized: tuple[int, ...]) -> tuple[int, ...]:
    return (*x.shape[:x.dim() - len(normalized)], *([1] * len(normalized)))


class _CudaLayerNorm(torch.autograd.Function):
    """``layer_norm_cuda``: output in the input dtype, mean and rstd in fp32 (the accumulation type)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, shape: tuple[int, ...], weight: torch.Tensor | None,
                bias: torch.Tensor | None, eps: float) -> torch.Tensor:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        mean = x.new_empty(_stat_shape(x, shape), dtype=torch.float32)
        rstd = x.new_empty(_stat_shape(x, shape), dtype=torch.float32)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.shape = list(shape)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, bias, mean, rstd = ctx.saved_tensors
        mask = [ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[2],
                bias is not None and ctx.needs_input_grad[3]]
        gx, gw, gb = aten.native_layer_norm_backward.default(grad, x, ctx.shape, mean, rstd, weight, bias, mask)
        return gx, None, gw, gb, None


class _CudaRMSNorm(torch.autograd.Function):
    """``_fused_rms_norm`` (what ``rms_norm`` runs on CUDA): keeps its input and an fp32 rstd."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, shape: tuple[int, ...], weight: torch.Tensor | None,
                eps: float | None) -> torch.Tensor:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        rstd = x.new_empty(_stat_shape(x, shape), dtype=torch.float32)
        ctx.save_for_backward(x, weight, rstd)
        ctx.shape = list(shape)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, rstd = ctx.saved_tensors
        mask = [ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[2]]
        gx, gw = aten._fused_rms_norm_backward.default(grad, x, ctx.shape, rstd, weight, mask)
        return gx, None, gw, None


def cuda_dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
    """``at::native::dropout`` on CUDA: the fused ``native_dropout`` (1-byte mask) when ``0 < p < 1``; in-place
    dropout stays the composite (``dropout_`` is never fused), as does anything ``F.dropout`` returns as is."""
    if training and 0.0 < p < 1.0 and input.numel() > 0 and not inplace:
        return aten.native_dropout.default(input, p, True)[0]
    return _dropout(input, p, training, inplace)


def cuda_layer_norm(input: torch.Tensor, normalized_shape: Any, weight: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    """``F.layer_norm`` on CUDA: fp32 statistics whatever the dtype (fp32 inputs run the CPU op, the same)."""
    if input.dtype not in HALF:
        return _layer_norm(input, normalized_shape, weight, bias, eps)
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    return _CudaLayerNorm.apply(input, shape, weight, bias, eps)


def cuda_rms_norm(input: torch.Tensor, normalized_shape: Any, weight: torch.Tensor | None = None,
                  eps: float | None = None) -> torch.Tensor:
    """``F.rms_norm`` on CUDA: the fused kernel, which keeps the input and an fp32 rstd."""
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    return _CudaRMSNorm.apply(input, shape, weight, eps)


def _dropout_positional(input: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    return cuda_dropout(input, p, train)


# (module, function name) -> what replaces it under the cuda (and te) profile
CUDA_ROUTES: dict[tuple[Any, str], Callable[..., Any]] = {
    (F, "dropout"): cuda_dropout,
    (torch, "dropout"): _dropout_positional,
    (F, "layer_norm"): cuda_layer_norm,
    (F, "rms_norm"): cuda_rms_norm,
    (F, "scaled_dot_product_attention"): cuda_sdpa,
}


# ---------------------------------------------------------------------------------------------------------
# TransformerEngine's attention (TE_ATTENTION_VERSION): DotProductAttention's backends as Megatron's
# TEDotProductAttention runs them (causal mask type, sbhd q/k/v that are views of the QKV GEMM's output)
# ---------------------------------------------------------------------------------------------------------
class _TeFusedAttention(torch.autograd.Function):
    """``FusedAttnFunc`` (backends.py:1292) with cuDNN's F16_arbitrary_seqlen sub-backend, what
    ``get_attention_backend`` (utils.py:327) picks for ``auto`` on sm90, 16-bit causal attention with dropout,
    deterministic or not (utils.py:1542: FusedAttention over FlashAttention on Hopper+; FA3/FA4 refuse dropout,
    utils.py:1009). ``ctx.save_for_backward`` keeps q, k, v (un-repeated under GQA), the output and
    ``aux_ctx_tensors`` = softmax Stats fp32 [b, h, sq, 1] + rng_state int64 [2] (cpp_extensions/fused_attn.py:245,
    csrc/extensions/attention.cpp:235). cuDNN's workspaces are not modelled."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                offset: torch.Tensor | None = None) -> torch.Tensor:
        mark_offload_base(q, k, v)  # backends.py:1338-1339 (NOTE [TE's layer offloading])
        b, h, sq, _ = q.shape
        out = heads_like(q, v.shape[-1])
        stats = q.new_empty((b, h, sq, 1), dtype=torch.float32)
        rng_state = q.new_empty((2,), dtype=torch.int64)
        # an attention sink: dot_product_attention.py:1707 passes softmax_offset.reshape(1, -1, 1, 1).to(fp32),
        # kept among aux_ctx_tensors (csrc/extensions/attention.cpp:274, 298)
        sink = () if offset is None else (offset.reshape(1, -1, 1, 1).to(torch.float32),)
        ctx.save_for_backward(q, k, v, out, stats, rng_state, *sink)
        ctx.sink = offset is not None
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, *rest = ctx.saved_tensors
        d_offset = rest[-1].new_empty(rest[-1].shape).view(-1) if ctx.sink else None  # attention.cpp:567
        return heads_like(q), heads_like(k), heads_like(v), d_offset


def _te_full_mask(sq: int, sk: int, mask: torch.Tensor | None, device: torch.device,
                  window: tuple[int, int] | None = None) -> torch.Tensor:
    """``dpa_utils.get_full_mask`` for 'causal' (utils.py:1632), window (-1, 0) -> (sk, 0) or a sliding
    ``window`` (left, 0): int32 [1, 1, sq, sk] position differences and the two window bounds (12 bytes per
    score, transient), their bool comparisons, or'ed with the mask the caller passed (Megatron passes its
    dataloader's [b, 1, s, s]). Alive until the attention returns, never saved."""
    diff = (torch.arange(sq, dtype=torch.int32, device=device).view(1, 1, sq, 1)
            - torch.arange(sk, dtype=torch.int32, device=device).view(1, 1, 1, sk))
    left = sk if window is None or window[0] == -1 else window[0]
    swa_left, swa_right = diff - left, diff + 0
    swa_mask = torch.logical_not((swa_left <= 0) & ~(swa_right < 0))
    return swa_mask if mask is None else torch.logical_or(swa_mask, mask)


class _TeScores(torch.autograd.Function):
    """``torch.baddbmm(matmul_result, q, kᵀ, beta=0.0, alpha=scale)`` (backends.py:498, 567) into a preallocated
    [b*h, sq, sk] ``torch.empty``: a new output (the buffer is freed when rebound), ``BaddbmmBackward0`` keeps q and
    k only. A real bmm of remat's bshd views would copy them to [b*h, s, d]; TE's sbhd views reshape for free."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
        b, h, sq, _ = q.shape
        buffer = q.new_empty((b * h, sq, k.shape[-2]))
        scores = q.new_empty((b, h, sq, k.shape[-2]))  # not a view: fp32's masked_fill_ writes it in place
        del buffer
        ctx.save_for_backward(q, k)
        ctx.scale = scale
        return scores

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k = ctx.saved_tensors
        # derivatives.yaml baddbmm: maybe_multiply(grad.bmm(batch2ᵀ), alpha): a bmm output, then its alpha multiple
        return heads_like(q) * ctx.scale, heads_like(k) * ctx.scale, None


class _TeMaskedSoftmax(torch.autograd.Function):
    """``ScaledMaskedSoftmax`` (softmax.py:93): ``tex.scaled_masked_softmax_forward`` makes the probabilities in the
    input dtype and keeps them (and a host-side scale, no GPU memory); its backward overwrites the incoming gradient
    (csrc/extensions/softmax.cpp: "Produce gradients in place")."""

    @staticmethod
    def forward(ctx: Any, scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        probs = torch.empty_like(scores, memory_format=torch.contiguous_format)
        ctx.save_for_backward(probs)
        return probs

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        ctx.saved_tensors  # noqa: B018  the kernel reads the probabilities (an offloaded copy is reloaded for it)
        return grad.contiguous(), None


def te_softmax_fusable(dtype: torch.dtype, b: int, h: int, sq: int, sk: int, causal: bool = True) -> bool:
    """``FusedScaleMaskSoftmax.is_kernel_available`` (softmax.py:190) for the causal mask type (or 'arbitrary',
    ``causal=False``, with a [1, 1, sq, sk] mask) and NVTE_MASKED_SOFTMAX_FUSION=1 (TE's default; Megatron's
    --no-masked-softmax-fusion does not reach TE)."""
    if dtype not in HALF or not 16 < sk < 16384 or sk % 8 or sq == 1 or (causal and sq != sk):
        return False
    pow2 = 1 << (sk - 1).bit_length()  # get_batch_per_block
    batch_per_block = (128 // min(pow2, 32)) * (2 if pow2 <= 128 else 1)
    return sq % 4 == 0 and (b * h) % 4 == 0 and sq % batch_per_block == 0


def _te_torch_softmax(scores: torch.Tensor, mask: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """``FusedScaleMaskSoftmax.forward_torch_softmax`` (softmax.py:248) for 'causal': fp32 for 16-bit inputs
    (``softmax_in_fp32`` is TE's default True; UnfusedDotProductAttention never changes it), the cached causal
    mask or'ed in, ``masked_fill_`` in place (keeps the or'ed bool mask), softmax (keeps its fp32 output), cast
    back. TE caches the [sq, sk] causal mask for the process; here it is made per call (s² bytes)."""
    x = scores.float() if scores.dtype in HALF else scores
    if causal:  # 'arbitrary' (a window, a sink) takes the full mask as it is (softmax.py:265)
        mask = torch.logical_or(mask, torch.triu(torch.ones(x.shape[-2:], dtype=torch.bool, device=x.device),
                                                 diagonal=1))
    probs = torch.softmax(x.masked_fill_(mask, -10000.0), dim=-1)
    return probs.to(scores.dtype)


def te_unfused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, p: float,
                         scale: float, window: tuple[int, int] | None = None,
                         softmax_offset: torch.Tensor | None = None) -> torch.Tensor:
    """``UnfusedDotProductAttention.forward`` (backends.py:320), causal, no bias, q/k/v [b, heads, s, d]: keeps q and
    k (baddbmm), the softmax output (bf16/fp16 from TE's fused kernel, else fp32), dropout's bool mask, the
    dropped-out probabilities and v (bmm); K and V repeated under GQA. The scores and the full mask stay alive
    until it returns (``matmul_result``, ``attention_mask`` locals). A sliding ``window`` makes the mask type
    'arbitrary' (utils.py:1716); a sink (``softmax_offset``, backends.py:629-656) concatenates one more column of
    logits (a new [b, h, sq, sk + 1]), pads the mask and softmaxes sk + 1 columns (never a fused kernel's multiple
    of 8 when sk is), then drops the column (a view) before the dropout."""
    b, h, sq, _ = q.shape
    full_mask = _te_full_mask(sq, k.shape[-2], mask, q.device, window)
    if k.shape[1] != h:  # GQA: repeat_interleave, the copies kept by the GEMMs
        k, v = (t.repeat_interleave(h // t.shape[1], dim=1) for t in (k, v))
    scores = _TeScores.apply(q, k, scale)
    causal = window is None
    if softmax_offset is not None:
        sink = softmax_offset.to(scores.dtype).view(1, -1, 1, 1).expand(b, -1, sq, -1)
        scores = torch.cat((scores, sink), dim=-1)
        full_mask, causal = F.pad(full_mask, (0, 1), mode="constant", value=False), False
    if te_softmax_fusable(scores.dtype, b, h, sq, scores.shape[-1], causal):
        probs = _TeMaskedSoftmax.apply(scores, full_mask)  # 'causal' with a mask -> ScaledMaskedSoftmax
    else:
        probs = _te_torch_softmax(scores, full_mask, causal)
    if softmax_offset is not None:
        probs = probs[..., :-1]
    return AttentionContext.apply(cuda_dropout(probs, p), v)  # torch.nn.Dropout (backends.py:660) -> native_dropout


def te_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
                 dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                 enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` as TE's ``DotProductAttention`` with the ``auto`` backend: FusedAttention
    for 16-bit inputs (a mask is TE's causal mask type, never a tensor), UnfusedDotProductAttention for fp32 (the
    fused backends need fp16/bf16: utils.py "Filter: Data type")."""
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    if query.dtype not in HALF:
        return te_unfused_attention(query, key, value, attn_mask, dropout_p, scale)
    return _TeFusedAttention.apply(query, key, value)


def _te_core_attention(module: CoreAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       attention_mask: torch.Tensor) -> torch.Tensor:
    """The reference model's core attention as Megatron's ``TEDotProductAttention`` (causal mask type): 'math'
    (``--attention-backend unfused``) and any fp32 model run TE's unfused attention, 'sdpa' (auto, flash, fused)
    the fused one. NOTE [gpt-oss layers] (remat.models.blocks): get_attention_backend (utils.py:1236-1266) turns
    FusedAttention off for a sliding window with dropout, and FlashAttention off for a sink (utils.py:1027), so
    such a layer runs the unfused attention; a window without a sink runs FlashAttention, which keeps what the fused
    one keeps (q, k, v, out, fp32 softmax statistics, rng state); a sink on a full layer runs the fused one."""
    p = module.dropout if module.training else 0.0
    window, offset = module.window, module.softmax_offset
    if module.kind == "math" or q.dtype not in HALF or (window is not None and p > 0 and offset is not None):
        return te_unfused_attention(q, k, v, attention_mask, p, module.scale, window, offset)
    return _TeFusedAttention.apply(q, k, v, offset)


# TransformerEngine's fused SwiGLU (TE_VERSION)
class _TeSwiGLU(torch.autograd.Function):
    """``tex.swiglu`` in ``LayerNormMLP``: keeps the fc1 output [.., 2f] only; output [.., f]."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return torch.empty_like(x)  # tex.dswiglu


def _te_swiglu(module: SwiGLU, x: torch.Tensor) -> torch.Tensor:
    return _TeSwiGLU.apply(x)


def _te_norm(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Megatron's ``TENorm`` (te.pytorch ``LayerNorm`` / ``RMSNorm``: extensions/transformer_engine.py:1080-1092),
    the standard attention's q/k norms under the TE spec (gpt_layer_specs.py:139-152). TE's op keeps
    ``input_.contiguous()`` (TE ops/basic/layer_norm.py:199, 221; rmsnorm.py:182, 202): a copy of the query or key,
    a non-contiguous view of the QKV output (attention.py:1913-1936), kept beside its fp32 statistics."""
    return type(module).forward(module, x.contiguous())


TE_ROUTES: dict[tuple[Any, str], Callable[..., Any]] = {
    **CUDA_ROUTES, (F, "scaled_dot_product_attention"): te_attention}


def _local_core_attention(module: CoreAttention, config: ModelConfig | None, q: torch.Tensor, k: torch.Tensor,
                          v: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The reference model's core attention as Megatron's local ``DotProductAttention`` (both kinds)."""
    p = module.dropout if module.training else 0.0
    if config is None:
        return local_attention(q, k, v, attention_mask, p, module.scale)
    return local_attention(q, k, v, attention_mask, p, module.scale, fusion=config.masked_softmax_fusion,
                           in_fp32=config.attention_softmax_in_fp32, scaled=config.apply_query_key_layer_scaling)


def prepare_model(model: nn.Module, kernels: str) -> int:
    """Give the reference model's modules the forward their ``kernels`` profile runs; returns how many changed.

    Under ``te`` every :class:`~remat.models.gpt.CoreAttention` becomes TE's attention (unfused for 'math' and
    fp32, fused for 'sdpa'), under ``local`` Megatron's ``DotProductAttention`` (:mod:`remat.memory.local_layers`),
    and every :class:`~remat.models.gpt.SwiGLU` TE's fused SwiGLU (Megatron's ``bias_swiglu_impl`` keeps the same
    fc1 output), and under ``te`` the standard attention's q/k norms keep TE's contiguous copy of their input
    (``_te_norm``) (instance attributes: recompute regions installed later wrap them). Other profiles change
    nothing. Under every profile, a model whose ``config`` trains in FP8 (``fp8_recipe``) runs its TE linears
    through :func:`remat.memory.fp8.prepare_fp8`.
    Call it on the fake model, before :func:`remat.apply`.
    """
    config = getattr(model, "config", None)  # the reference models keep theirs (local: the softmax flags)
    # an FP8 model's linears (NOTE [FP8 linears on Hopper]), whatever the profile: TE's FP8 tensors
    fp8 = 0  # and before them, --tp-comm-overlap's userbuffers (NOTE [TP communication overlap]), read by prepare_fp8
    if isinstance(config, ModelConfig) and config.tp_comm_overlap:
        fp8 = prepare_tp_overlap(model, config.tp_comm_overlap)
    if isinstance(config, ModelConfig) and config.fp8_recipe is not None:
        fp8 += prepare_fp8(model, config.fp8_recipe, config.fp8_bf16_layer_indices(), config.fp8_sm)
    if check_kernels(kernels) not in ("te", "local"):
        return fp8
    changed = fp8
    for module in model.modules():
        if isinstance(module, CoreAttention) and kernels == "local":
            module.__dict__["forward"] = functools.partial(
                _local_core_attention, module, config if isinstance(config, ModelConfig) else None)
        elif isinstance(module, CoreAttention):
            module.__dict__["forward"] = functools.partial(_te_core_attention, module)
        elif isinstance(module, SwiGLU):
            module.__dict__["forward"] = functools.partial(_te_swiglu, module)
        elif isinstance(module, SelfAttention) and kernels == "te" and module.q_layernorm is not None:
            for norm in (module.q_layernorm, module.k_layernorm):  # TE's q/k norms (_te_norm)
                norm.__dict__["forward"] = functools.partial(_te_norm, norm)
        else:
            continue
        changed += 1
    return changed


# ---------------------------------------------------------------------------------------------------------
# The modes a trace runs under
# ---------------------------------------------------------------------------------------------------------
# NOTE [routing by patching, not by a TorchFunctionMode]
# The routes replace the torch.nn.functional attributes for the length of a trace. A TorchFunctionMode would do
# the same for the forward, but torch.utils.checkpoint's non-reentrant recomputation runs in backward without the
# function-mode stack (only a DeviceContext is carried over), so recomputed dropout / norms / attention would be
# the CPU kernels and the recomputation would not match the forward. Patched attributes are seen everywhere,
# backward included; they are restored on exit, and the patch is refused while another thread holds it.
_PATCH_LOCK = threading.Lock()


@contextlib.contextmanager
def routed(routes: dict[tuple[Any, str], Callable[..., Any]]) -> Iterator[None]:
    """Replace each ``module.name`` of ``routes`` by its route for the block."""
    if not _PATCH_LOCK.acquire(blocking=False):
        raise RuntimeError("a kernel-profile trace is already running in another thread: trace one at a time")
    saved = [(module, name, getattr(module, name)) for module, name in routes]
    try:
        for (module, name), route in routes.items():
            setattr(module, name, route)
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)
        _PATCH_LOCK.release()


CPU_ONLY_OPS = frozenset(name for name in (
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_fused_attention_overrideable", "mkldnn_rnn_layer", "mkldnn_linear", "_mkldnn_transpose",
) if hasattr(aten, name))


@dataclass
class UntranslatedOp:
    """An operator a profile priced as traced: how often it ran and the bytes of its outputs."""

    op: str
    reason: str
    calls: int = 0
    nbytes: int = 0

    def message(self, kernels: str) -> str:
        return (f"kernels={kernels}: {self.op} ({self.reason}) is priced as the fake trace made it: "
                f"{self.nbytes:,} bytes of outputs in {self.calls} call(s)")


def _output_bytes(out: Any) -> int:
    seen: set[int] = set()
    total = 0
    for leaf in tree_flatten(out)[0]:
        if isinstance(leaf, torch.Tensor):
            storage = leaf.untyped_storage()
            key = id(storage)
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
    return total


@dataclass
class KernelTrace:
    """What :func:`kernel_trace` saw: the profile and each operator it could not translate."""

    kernels: str
    untranslated: dict[str, UntranslatedOp] = field(default_factory=dict)

    def note(self, op: str, reason: str, out: Any) -> None:
        entry = self.untranslated.setdefault(op, UntranslatedOp(op, reason))
        entry.calls += 1
        entry.nbytes += _output_bytes(out)

    @property
    def messages(self) -> list[str]:
        return [u.message(self.kernels) for u in self.untranslated.values()]


class UntranslatedObserver(TorchDispatchMode):
    """Notes operators the profile cannot express (run under the fake mode, below the recorder).

    A :class:`~remat.memory.measure.StepRecorder` entered directly above it takes its place on the mode stack
    for the step and calls :meth:`observe` on each operator itself: one Python dispatch per operator instead
    of two, the same notes."""

    def __init__(self, record: KernelTrace):
        super().__init__()
        self.record = record

    def observe(self, func: Any, args: tuple[Any, ...], out: Any) -> None:
        """Note ``func`` (called with positional ``args``, giving ``out``) if the profile cannot translate it."""
        if func is _DEVICE_QUERY:  # tensor.device, most of a fake step's dispatches: an ATen-level query
            return
        namespace = func.namespace
        if namespace not in ("aten", "prims", "prim"):
            self.record.note(str(func), "not an ATen operator: what its CUDA kernel keeps is unknown", out)
        elif func.overloadpacket.__name__ in CPU_ONLY_OPS:
            self.record.note(str(func), "a CPU-only kernel with no CUDA counterpart in the profile", out)
        elif (self.record.kernels == "te" and func.overloadpacket in (aten._softmax, aten._safe_softmax)
              and isinstance(out, torch.Tensor) and out.dim() == 4 and out.shape[-1] == out.shape[-2]
              and args[0].dtype in HALF):
            self.record.note(str(func), "attention made of separate operators, which TE would fuse; kept as the "
                             "composite keeps it", out)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.observe(func, args, out)
        return out


@contextlib.contextmanager
def kernel_trace(kernels: str) -> Iterator[KernelTrace]:
    """Run the block (a fake trace) with the ``kernels`` profile: enter it inside ``FakeTensorMode`` and before
    the recorder. On exit each untranslated operator is warned about (:class:`KernelWarning`); the yielded
    :class:`KernelTrace` lists them (``messages``). ``'cpu'`` changes nothing.

    Example::

        >>> from torch._subclasses.fake_tensor import FakeTensorMode
        >>> with FakeTensorMode(), kernel_trace("cuda"):
        ...     x = torch.empty(4, 8, dtype=torch.float16, requires_grad=True)
        ...     F.dropout(x, 0.1).grad_fn.name()
        'NativeDropoutBackward0'
    """
    record = KernelTrace(check_kernels(kernels))
    if kernels == "cpu":
        yield record
        return
    with routed(TE_ROUTES if kernels == "te" else CUDA_ROUTES), UntranslatedObserver(record):
        yield record
    for message in record.messages:
        warnings.warn(message, KernelWarning, stacklevel=3)
