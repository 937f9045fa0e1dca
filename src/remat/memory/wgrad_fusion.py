"""Megatron's gradient-accumulation fusion (on by default; ``--no-gradient-accumulation-fusion`` turns it off) on a
GPU rank: what it removes and what it adds.

NOTE [gradient-accumulation fusion]
* TransformerEngine's linears (``Linear``, ``LayerNormLinear``, ``GroupedLinear``: every ``linear_*`` weight of a
  layer, MLA's projections and the experts' included) run their weight-gradient GEMM with ``beta = 1`` straight into
  the parameter's fp32 ``main_grad`` (``fuse_wgrad_accumulation=gradient_accumulation_fusion``,
  megatron/core/extensions/transformer_engine.py). No weight gradient in the parameter's dtype is ever made, so the
  transient ``.grad`` the unfused path allocates (and Megatron's DDP hook adds into ``main_grad`` and frees) is gone.
* Instead, because Megatron's DDP marks its parameters ``grad_added_to_main_grad``, TE returns a *dummy* weight
  gradient from a process-wide cache (transformer_engine/pytorch/module/base.py ``get_dummy_wgrad``, TE 2.17.1): one
  ``torch.empty`` per distinct (shape, dtype), made at its first backward and kept for the whole run. A grouped GEMM's
  weights share one per shape.
* Megatron's own output layer (``ColumnParallelLinear``, megatron/core/tensor_parallel/layers.py) fuses too but
  returns a fresh ``torch.empty(main_grad.shape, dtype=input.dtype)`` each backward: the same transient as the
  unfused gradient, so nothing changes there; embeddings, norms, biases and the router are not fused.
CPU runs (gloo) cannot fuse (the fused kernels are CUDA's), so a job predicted with the ``cpu`` kernel profile keeps
the unfused transients.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from remat.memory.rank_state import ParamInfo

_FUSED = re.compile(r"(^|\.)linear_[a-z0-9_]+\.weight$")
MODULE = "transformer_engine.dummy_wgrad"


def is_fused_weight(name: str) -> bool:
    """Whether the parameter ``name`` (a module path) is a TE linear's weight, whose gradient the fusion adds into
    ``main_grad`` (see :func:`fused_weights`)."""
    return _FUSED.search(name) is not None


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
