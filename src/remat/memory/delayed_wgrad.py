"""Megatron's ``--delay-wgrad-compute``: TransformerEngine's linears leave their weight-gradient GEMM to a later
``backward_dw()``, keeping what it reads until then.

NOTE [delayed weight gradients] (Megatron-LM d98e8a64, TransformerEngine 4329ff84 = TE 2.17.1)
* TE, with ``delay_wgrad_compute`` (megatron/core/extensions/transformer_engine.py:1170-1174, 1441-1445,
  2424-2433 pass it to ``Linear``, ``LayerNormLinear`` and ``GroupedLinear``): the backward computes the input
  gradient only and ``wgrad_store.put([input, grad_output], wgrad_gemm)`` (pytorch/module/linear.py:1202-1213,
  layernorm_linear.py:1022-1033, grouped_linear.py:1118-1119); the tensors stay in the store's queue
  (module/_common.py:198 ``WeightGradStore``) until ``backward_dw()`` pops them, runs the GEMM and sets
  ``weight.grad`` (module/base.py:1845-1863). So each linear's saved input and the gradient of its output live
  from its backward to its module's ``backward_dw``, where without the flag both go when its backward returns.
  Megatron's output layer is not delayed (transformer_engine.py:1784-1839: its ``backward_dw`` is a no-op).
* Megatron asserts the flag only with ``--overlap-moe-expert-parallel-comm`` (transformer_config.py:3073-3077) and
  TE's layers (training/arguments.py:1903-1905). The EP-overlap schedule then calls ``backward_dw`` per layer
  (models/common/model_chunk_schedule_plan.py:236-305 ``TransformerLayerSchedulePlan.run``): the ``mlp`` node's
  right after the MLP's backward (the routed experts of an MoE layer, or the dense MLP's ``linear_fc1`` /
  ``linear_fc2``: gpt/fine_grained_callables.py:272, moe_layer.py:81), before the dispatch's backward; the
  ``pre_dispatch_computation`` node's (attention and shared experts: models/common/utils.py:379-426
  ``_BackwardDWWrapper``) after the attention's backward, at the end of the layer's backward (the first layer's
  after the other layers' backwards and the pipeline send, before the embedding's backward:
  model_chunk_schedule_plan.py:609-621 - with nothing in between at pp = 1).
:func:`delay_wgrads` makes a traced chunk keep the same tensors: each TE linear (a ``linear_*`` weight) stashes its
input and its output's gradient as its backward runs, and the stash of its node is dropped when the backward reaches
that node's input (the experts' input for an MoE layer's ``mlp`` node, the MLP's for a dense layer's, the layer's
for the rest). The weight gradient itself is still made by the linear's backward (a transient in the parameters'
dtype, or none under gradient-accumulation fusion): the same bytes, earlier.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from remat.memory.wgrad_fusion import is_fused_weight

_LINEAR = re.compile(r"^(?P<layer>(?:.*\.)?layers\.\d+)\.(?P<rest>.+)$")


class _Stash(torch.autograd.Function):
    """Identity on a linear's input: its backward (right after the linear's) keeps the input in ``store``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, store: list[torch.Tensor]) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.store = store
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.store.append(ctx.saved_tensors[0])  # wgrad_store.put([input, ...]): kept until backward_dw
        return grad, None


class _OnStore(torch.autograd.Function):
    """Identity that hands its backward the ``store`` (the subclasses say what the backward does with it)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, store: list[torch.Tensor]) -> torch.Tensor:
        ctx.store = store
        return x.view_as(x)


class _StashGrad(_OnStore):
    """Identity on a linear's output: its backward (right before the linear's) keeps the output's gradient."""

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.store.append(grad)  # wgrad_store.put([..., grad_output])
        return grad, None


class _BackwardDw(_OnStore):
    """Identity on a node's input: when the backward reaches it the node's ``backward_dw`` runs, dropping what its
    linears kept."""

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.store.clear()  # WeightGradStore.pop(): the GEMM reads them, then they go
        return grad, None


def delayed_linears(module: nn.Module) -> dict[str, str]:
    """The TE linears of ``module``'s layers whose weight gradient ``--delay-wgrad-compute`` delays, each with the
    module whose input gradient ends its node's backward (NOTE [delayed weight gradients]): ``layers.N.mlp.experts``
    (an MoE layer's routed experts) or ``layers.N.mlp`` (a dense MLP) for the ``mlp`` node, else ``layers.N``.

    Example:
        >>> from remat.config import ModelConfig
        >>> from remat.models.gpt import GPT
        >>> sorted(delayed_linears(GPT(ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=2, seq_length=4,
        ...     vocab_size=16, micro_batch_size=1))).items())[:2]
        [('layers.0.mlp.linear_fc1', 'layers.0.mlp'), ('layers.0.mlp.linear_fc2', 'layers.0.mlp')]
    """
    names = dict(module.named_modules())
    out: dict[str, str] = {}
    for name, _ in module.named_parameters():
        owner, _, leaf = name.rpartition(".")
        m = _LINEAR.match(owner)
        if m is None or not is_fused_weight(name) or leaf != "weight":
            continue
        layer, rest = m.group("layer"), m.group("rest")
        node = layer
        if rest.startswith("mlp.") and not rest.startswith("mlp.shared_experts."):
            node = f"{layer}.mlp.experts" if rest.startswith("mlp.experts.") else f"{layer}.mlp"
        out[owner] = node if node in names else layer
    return out


def delay_wgrads(module: nn.Module) -> None:
    """Make ``module`` (a traced chunk) keep each TE linear's input and output gradient from its backward to its
    node's ``backward_dw`` (NOTE [delayed weight gradients])."""
    names = dict(module.named_modules())
    stores: dict[str, list[torch.Tensor]] = {}
    for linear, node in delayed_linears(module).items():
        store = stores.setdefault(node, [])
        names[linear].register_forward_pre_hook(_wrap_first(_Stash, store))
        names[linear].register_forward_hook(_wrap_output(store))
    for node, store in stores.items():
        names[node].register_forward_pre_hook(_wrap_first(_BackwardDw, store))


def _wrap_first(fn: type[torch.autograd.Function], store: list[torch.Tensor]) -> Any:
    def hook(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if args and isinstance(args[0], torch.Tensor) and args[0].requires_grad and torch.is_grad_enabled():
            return (fn.apply(args[0], store), *args[1:])
        return None
    return hook


def _wrap_output(store: list[torch.Tensor]) -> Any:
    def hook(_: nn.Module, __: tuple[Any, ...], out: Any) -> Any:
        if isinstance(out, torch.Tensor) and out.requires_grad and torch.is_grad_enabled():
            return _StashGrad.apply(out, store)
        return None
    return hook
