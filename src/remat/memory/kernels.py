"""Kernel profiles: predict the tensors a training step keeps on a GPU from a fake trace on the CPU.

A fake trace runs the CPU kernels, which keep other tensors than CUDA's: CPU dropout keeps a float noise tensor
where CUDA's fused ``native_dropout`` keeps a 1-byte mask, CPU LayerNorm keeps its statistics in the activation
dtype, CPU ``rms_norm`` is a composite that keeps fp32 copies, CPU attention kernels differ. A profile routes
the functions whose kernels differ to the CUDA kernels' meta implementations while the fake trace runs (:func:`routed`):

* ``cpu``: nothing is routed; exactly the CPU kernels.
* ``cuda``: what PyTorch eager runs on CUDA (:data:`CUDA_ROUTES`, :mod:`remat.memory.cuda_sdpa`).
* ``te``: ``cuda`` plus TransformerEngine's fused layers as Megatron-LM runs them (:data:`TE_VERSION`):
  fused attention for the reference model's core attention and any ``scaled_dot_product_attention``, and the
  fused SwiGLU of ``LayerNormMLP``.

``docs/kernels.md`` lists every substitution with the source it follows. Operators a profile cannot express
(another library's ops, CPU-only kernels, attention made of separate operators under ``te``) are priced as traced
and named in a :class:`KernelWarning` with their bytes.
"""

from __future__ import annotations

import contextlib
import functools
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

from remat.memory.cuda_sdpa import HALF, cuda_sdpa
from remat.models.gpt import CoreAttention, SwiGLU

KERNELS = ("cpu", "cuda", "te")
# the functions a profile replaces, as torch defines them (the replacements call these, never the patched names)
_dropout, _layer_norm = F.dropout, F.layer_norm
TE_VERSION = "TransformerEngine 1.x (layernorm_linear.py / layernorm_mlp.py / attention.py as of 2024, v1.5-1.7)"
aten = torch.ops.aten
_DEVICE_QUERY = torch.ops.prim.device.default


class KernelWarning(UserWarning):
    """An operator the kernel profile cannot translate: it is priced at the bytes the fake trace gave it."""


_ACTIVE: ContextVar[str | None] = ContextVar("remat_kernels", default=None)


def check_kernels(kernels: str) -> str:
    """``kernels`` if it names a profile, else a ValueError naming the field and the choices."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels={kernels!r}: must be one of {', '.join(KERNELS)} (--kernels cpu|cuda|te)")
    return kernels


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
# TransformerEngine's fused layers
# ---------------------------------------------------------------------------------------------------------
def te_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
                 dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                 enable_gqa: bool = False) -> torch.Tensor:
    """TE ``DotProductAttention`` with its fused backend (flash-attn / cuDNN FusedAttention) for 16-bit inputs:
    keeps q, k, v (un-repeated under GQA), the output, an fp32 softmax statistic [b, a, s] and the RNG state;
    a mask is TE's mask type (causal), never a tensor. fp32 inputs take TE's unfused path (the CUDA composite).
    """
    if query.dtype not in HALF:
        return cuda_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    causal = is_causal or attn_mask is not None
    return aten._scaled_dot_product_flash_attention.default(query, key, value, dropout_p, causal, False,
                                                           scale=scale)[0]


def _te_core_attention(module: CoreAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       attention_mask: torch.Tensor) -> torch.Tensor:
    """The reference model's core attention as Megatron's ``TEDotProductAttention`` (causal mask type)."""
    if q.dtype not in HALF:
        return type(module).forward(module, q, k, v, attention_mask)
    p = module.dropout if module.training else 0.0
    return aten._scaled_dot_product_flash_attention.default(q, k, v, p, True, False, scale=module.scale)[0]


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


TE_ROUTES: dict[tuple[Any, str], Callable[..., Any]] = {
    **CUDA_ROUTES, (F, "scaled_dot_product_attention"): te_attention}


def prepare_model(model: nn.Module, kernels: str) -> int:
    """Give the reference model's modules the forward their ``kernels`` profile runs; returns how many changed.

    Under ``te`` every :class:`~remat.models.gpt.CoreAttention` becomes TE's fused attention and every
    :class:`~remat.models.gpt.SwiGLU` TE's fused SwiGLU (instance attributes: recompute regions installed later
    wrap them). Other profiles change nothing. Call it on the fake model, before :func:`remat.apply`.
    """
    if check_kernels(kernels) != "te":
        return 0
    changed = 0
    for module in model.modules():
        if isinstance(module, CoreAttention):
            module.__dict__["forward"] = functools.partial(_te_core_attention, module)
        elif isinstance(module, SwiGLU):
            module.__dict__["forward"] = functools.partial(_te_swiglu, module)
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
