"""The MoE routing a prediction assumes, applied to megatron-core's router and token dispatcher.

How many tokens each expert receives depends on the router's scores, so under fake tensors (no values) Megatron's
dispatcher cannot run: it counts tokens with ``.cpu()``/``.tolist()`` and permutes them with ``masked_select``,
whose output size is data-dependent. Inside :func:`assume_routing` the router's routing map is replaced by one
with the assumed per-expert counts (expert e takes tokens 0..c_e-1 of this rank), and the all-gather dispatcher's
permutation selects those tokens with fixed-size index operations. The measured run uses the same assumption, so
a prediction and a measurement see the same token counts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from remat.config import ConfigError, RoutingAssumption
from remat.megatron.compat import MegatronSettingError
from remat.megatron.cpu_patches import replaced

ROUTING_FORMS = "'balanced', 'capacity:1.25' or 'counts:6,2,4,4'"


def routing_assumption(routing: RoutingAssumption | str | None) -> RoutingAssumption | None:
    """The ``routing=`` of the megatron-core front end: None (balanced), a :class:`remat.config.RoutingAssumption`
    or its text (``balanced``, ``capacity:<factor>`` or ``counts:<c0>,<c1>,...``).

    megatron-core's router does not say which MoE layer it routes, so one assumption holds for every MoE layer:
    per-layer counts (``;``) are refused. Bad text raises :class:`MegatronSettingError` naming ``routing``."""
    if routing is None:
        return None
    if isinstance(routing, str):
        try:
            routing = RoutingAssumption.parse(routing)
        except ConfigError:
            raise MegatronSettingError(f"routing={routing!r}: write {ROUTING_FORMS}") from None
    if not isinstance(routing, RoutingAssumption):
        raise MegatronSettingError(f"routing={routing!r}: give a RoutingAssumption or its text, {ROUTING_FORMS}")
    if len(routing.counts) > 1:
        raise MegatronSettingError(f"routing={str(routing)!r}: megatron-core routes every MoE layer alike; give one "
                                   "count list for all of them (e.g. 'counts:6,2,4,4')")
    return routing


def _routing(original: Any, assumption: RoutingAssumption) -> Any:
    def routing(self: Any, logits: torch.Tensor, padding_mask: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        probs, routing_map = original(self, logits, padding_mask=padding_mask)  # its allocations, aux losses
        tokens, experts = routing_map.shape
        counts = assumption.tokens_per_expert(tokens, experts, self.topk)
        limits = torch.tensor(counts, device=routing_map.device)
        assumed = torch.arange(tokens, device=routing_map.device).unsqueeze(1) < limits.unsqueeze(0)
        weight = probs.sum(dim=-1, keepdim=True) / self.topk
        return assumed * weight, assumed
    return routing


def _dispatch_postprocess(assumption: RoutingAssumption) -> Any:
    def dispatch_postprocess(self: Any, hidden_states: torch.Tensor, probs: torch.Tensor) -> Any:
        # megatron-core 0.16.1's MoEAllGatherTokenDispatcher.dispatch_postprocess, with the counts known and the
        # token selection done by fixed-size index operations (argsort + slices) instead of masked_select
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        self.hidden_shape_before_permute = hidden_states.shape
        first, last = self.local_expert_indices[0], self.local_expert_indices[-1] + 1
        self.local_map = self.routing_map[:, first:last].contiguous()
        self.local_probs = probs[:, first:last].contiguous()
        gathered = hidden_states.shape[0]
        local_tokens = gathered // (self.tp_size * self.ep_size)
        per_rank = assumption.tokens_per_expert(local_tokens, self.routing_map.shape[1], self.router_topk)
        counts = [per_rank[e] * (self.tp_size * self.ep_size) for e in range(first, last)]
        order = self.local_map.to(torch.int8).T.contiguous().argsort(dim=-1, descending=True, stable=True)
        sorted_indices = torch.cat([order[i, :n] for i, n in enumerate(counts)])
        offsets = torch.cat([order[i, :n] + i * gathered for i, n in enumerate(counts)])
        permuted = hidden_states.index_select(0, sorted_indices)
        self.local_probs = self.local_probs.T.contiguous().view(-1).index_select(0, offsets)
        self.reversed_local_input_permutation_mapping = sorted_indices
        self.routing_map = None
        with unset_fake_temporarily():  # a real CPU tensor, as Megatron's .cpu() makes it (experts call tolist())
            tokens_per_expert = torch.tensor(counts, dtype=torch.long)
        return permuted, tokens_per_expert, self.local_probs
    return dispatch_postprocess


@contextlib.contextmanager
def assume_routing(assumption: RoutingAssumption | None, config: Any) -> Iterator[dict[str, Any] | None]:
    """Apply ``assumption`` (default balanced) to megatron-core's TopKRouter and all-gather dispatcher while
    active; yields what goes into ``Timeline.meta['moe_routing']`` (None for a model without experts)."""
    if not getattr(config, "num_moe_experts", None):
        yield None
        return
    dispatcher = getattr(config, "moe_token_dispatcher_type", "allgather")
    if dispatcher != "allgather":
        raise MegatronSettingError(f"moe_token_dispatcher_type={dispatcher!r}: remat applies its routing assumption "
                                   "to the 'allgather' dispatcher only; use --moe-token-dispatcher-type allgather "
                                   "(the same expert activations, other communication buffers)")
    assumption = assumption or RoutingAssumption()
    if assumption.counts and len(assumption.counts[0]) != config.num_moe_experts:
        raise MegatronSettingError(f"routing={str(assumption)!r}: {len(assumption.counts[0])} counts, but the model "
                                   f"has {config.num_moe_experts} experts (num_moe_experts): give one count per expert")
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    with replaced(TopKRouter, {"routing": _routing(TopKRouter.routing, assumption)}), \
            replaced(MoEAllGatherTokenDispatcher, {"dispatch_postprocess": _dispatch_postprocess(assumption)}):
        yield {"assumption": str(assumption), "dispatcher": dispatcher, "experts": config.num_moe_experts,
               "topk": config.moe_router_topk}
