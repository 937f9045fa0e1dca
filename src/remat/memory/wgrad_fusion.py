"""Megatron's gradient-accumulation fusion (on by default; ``--no-gradient-accumulation-fusion`` turns it off) on a
GPU rank: what it removes and what it adds.

NOTE [gradient-accumulation fusion]
* TransformerEngine's linears (``Linear``, ``LayerNormLinear``, ``GroupedLinear``: every ``linear_*`` weight of a
  layer, MLA's projections and the experts' included) run their weight-gradient GEMM with ``beta = 1`` straight into
  the parameter's fp32 ``main_grad`` (``fuse_wgrad_accumulation=gradient_accumulation_fusion``,
  megatron/core/extensions/transformer_engine.py); so does each MTP depth's ``eh_proj``, a ``TEColumnParallelLinear``
  (multi_token_prediction.py:1174-1187). No weight gradient in the parameter's dtype is ever made, so the
  transient ``.grad`` the unfused path allocates (and Megatron's DDP hook adds into ``main_grad`` and frees) is gone.
* Instead, because Megatron's DDP marks its parameters ``grad_added_to_main_grad``, TE returns a *dummy* weight
  gradient from a process-wide cache (transformer_engine/pytorch/module/base.py ``get_dummy_wgrad``, TE 2.17.1): one
  ``torch.empty`` per distinct (shape, dtype), made at its first backward and kept for the whole run. A grouped GEMM's
  weights share one per shape.
* TE still saves each linear's input for its weight-gradient GEMM (transformer_engine/pytorch/module/linear.py:300
  ``backward_needs_input = is_grad_enabled and weight.requires_grad``: Megatron's weights require grad, fused or
  not). The trace runs the fused weights without ``requires_grad`` (so autograd makes no gradient), and
  :func:`keep_fused_inputs` saves each fused linear's input itself, until that linear's backward, as TE does.
* Megatron's own output layer (``ColumnParallelLinear``) fuses too and, with TE installed, returns TE's cached dummy
  of the weight's shape as well (megatron/core/tensor_parallel/layers.py:738-754 ``get_dummy_wgrad``; without TE a
  fresh ``torch.empty``): :func:`output_layer_dummy` adds it to the cached dummies; embeddings, norms, biases and
  the router are not fused.
CPU runs (gloo) cannot fuse (the fused kernels are CUDA's), so a job predicted with the ``cpu`` kernel profile keeps
the unfused transients.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from remat.memory.rank_state import ParamInfo
from remat.models.tp_layers import is_te_linear_weight

# a layer's linear_* and the MTP depths' eh_proj (a TEColumnParallelLinear: multi_token_prediction.py:1174-1187,
# transformer_engine_spec_provider.py:43, transformer_engine.py:1293 fuse_wgrad_accumulation)
OUTPUT_LAYER = re.compile(r"(^|\.)output_layer\.weight$")
MODULE = "transformer_engine.dummy_wgrad"


def is_fused_weight(name: str) -> bool:
    """Whether the parameter ``name`` (a module path) is a TE linear's weight, whose gradient the fusion adds into
    ``main_grad`` (see :func:`fused_weights`)."""
    return is_te_linear_weight(name)


def fused_weights(params: Sequence[ParamInfo]) -> list[ParamInfo]:
    """The parameters whose weight gradient TransformerEngine accumulates into ``main_grad`` (NOTE [gradient-
    accumulation fusion]): every ``linear_*`` weight (the output layer, embeddings, norms, biases and the router are
    not).

    Example:
        >>> [p.name for p in fused_weights([ParamInfo("layers.0.mlp.linear_fc1.weight", 8, shape=(4, 2)),
        ...     ParamInfo("layers.0.mlp.linear_fc1.bias", 4), ParamInfo("head.output_layer.weight", 8)])]
        ['layers.0.mlp.linear_fc1.weight']
    """
    return [p for p in params if is_fused_weight(p.name)]


def dummy_wgrads(params: Sequence[ParamInfo], itemsize: int) -> list[tuple[tuple[int, ...], int]]:
    """TE's cached dummy weight gradients of a rank holding ``params``: ``(shape, bytes)`` per distinct shape of its
    fused weights (a grouped GEMM's [experts, out, in] weight is one [out, in] shape), in the parameters' dtype of
    ``itemsize`` bytes.

    Example:
        >>> dummy_wgrads([ParamInfo("a.linear_fc1.weight", 8, shape=(4, 2)),
        ...               ParamInfo("b.linear_fc1.weight", 8, shape=(4, 2)),
        ...               ParamInfo("b.linear_fc2.weight", 8, shape=(2, 4))], 2)
        [((4, 2), 16), ((2, 4), 16)]
    """
    shapes = dict.fromkeys(p.shape[1:] if len(p.shape) == 3 else p.shape for p in fused_weights(params))
    out = []
    for shape in shapes:
        numel = 1
        for d in shape:
            numel *= d
        out.append((shape, numel * itemsize))
    return out


def output_layer_dummy(params: Sequence[ParamInfo], itemsize: int) -> list[tuple[tuple[int, ...], int]]:
    """TE's cached dummy weight gradient of Megatron's output layer (``ColumnParallelLinear`` with the fusion and TE
    installed, layers.py:738-754), ``(shape, bytes)``, when the rank holds it; [] otherwise or when a fused TE
    linear's dummy has the same shape and dtype (one cached tensor per (shape, dtype): base.py ``get_dummy_wgrad``).

    Example:
        >>> output_layer_dummy([ParamInfo("head.output_layer.weight", 8, shape=(4, 2))], 2)
        [((4, 2), 16)]
    """
    taken = {shape for shape, _ in dummy_wgrads(params, itemsize)}
    out = {p.shape: p.numel * itemsize for p in params if OUTPUT_LAYER.search(p.name) and p.shape not in taken}
    return list(out.items())


class _SaveInput(torch.autograd.Function):
    """Identity that saves its input for backward: TE's linear keeps its input for the weight-gradient GEMM, which the
    fused trace runs without ``requires_grad`` on the weight (so autograd itself would not save it)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        # the weight-gradient GEMM reads the input here: unpacked, as TE does (an offloaded input is reloaded for it)
        ctx.saved_tensors  # noqa: B018
        return grad


def traced_without_grad(name: str) -> bool:
    """Whether a fused trace runs the parameter ``name`` without ``requires_grad``: the fused TE linears' weights
    and the output layer's own weight (its GEMM adds into ``main_grad`` too; a weight tied to the embedding is
    listed under the embedding's name and keeps its gradient)."""
    return is_fused_weight(name) or OUTPUT_LAYER.search(name) is not None


def keep_fused_inputs(module: nn.Module) -> None:
    """Run ``module``'s fused weights without ``requires_grad`` (:func:`traced_without_grad`: autograd makes no weight
    gradient) and have each module owning one save its first tensor input until its backward, as TE's linears and
    Megatron's output layer do whatever the fusion (see NOTE [gradient-accumulation fusion])."""
    fused = {id(p) for name, p in module.named_parameters() if traced_without_grad(name)}
    for sub in module.modules():
        # an FP8 linear (remat.memory.fp8.prepare_fp8) saves its own FP8 copy of the input
        if any(id(p) in fused for p in sub.parameters(recurse=False)) and not getattr(sub, "saves_fp8_input", False):
            sub.register_forward_pre_hook(_save_first_input)
    for p in module.parameters():
        if id(p) in fused:
            p.requires_grad_(False)


def _save_first_input(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    if args and isinstance(args[0], torch.Tensor) and args[0].requires_grad and torch.is_grad_enabled():
        return (_SaveInput.apply(args[0]), *args[1:])
    return None
