"""remat's router against Megatron-core's own ``topk_routing_with_score_function``: for every score function, with
and without the expert bias, pre-softmax and group-limited routing, the same experts chosen and the same tensors
saved for the backward (NOTE [routing under fake tensors] in remat.models.moe: remat's router keeps what
Megatron's keeps)."""

from __future__ import annotations

import pytest
import torch

from remat.megatron.compat import MegatronUnavailable, require_megatron_core

try:
    require_megatron_core()
except MegatronUnavailable as err:
    pytest.skip(str(err), allow_module_level=True)

from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function  # noqa: E402

from remat.config import ModelConfig  # noqa: E402
from remat.models.moe import Router  # noqa: E402

TOKENS, EXPERTS = 16, 8


def _saved(route, logits: torch.Tensor) -> tuple[list[tuple[int, torch.dtype]], object]:
    """(bytes and dtype of each storage autograd saves while ``route(logits)`` runs, the routing). Each saved tensor
    is held until the end, so that no storage freed meanwhile lends its address to another (counted once by it)."""
    seen: dict[int, tuple[int, torch.dtype]] = {}
    held: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen.setdefault(storage.data_ptr(), (storage.nbytes(), t.dtype))
        held.append(t)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = route(logits)
    return sorted(seen.values(), key=str), out


CASES = {  # score function, pre-softmax, expert bias, logits dtype, top-k, (groups, groups chosen)
    "softmax": ("softmax", False, False, torch.bfloat16, 2, None),
    "softmax-fp32": ("softmax", False, False, torch.float32, 2, None),
    "pre-softmax": ("softmax", True, False, torch.bfloat16, 2, None),
    "sigmoid": ("sigmoid", False, False, torch.bfloat16, 2, None),
    "sigmoid-bias": ("sigmoid", False, True, torch.bfloat16, 2, None),
    "sigmoid-bias-fp32": ("sigmoid", False, True, torch.float32, 2, None),
    "softmax-groups": ("softmax", False, False, torch.bfloat16, 4, (4, 2)),
    "pre-softmax-groups": ("softmax", True, False, torch.float32, 4, (4, 2)),
    "sigmoid-groups": ("sigmoid", False, False, torch.bfloat16, 4, (4, 2)),
    "sigmoid-bias-groups": ("sigmoid", False, True, torch.float32, 4, (4, 2)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_router_chooses_and_saves_what_megatrons_does(case):
    score, pre, bias, dtype, topk, groups = CASES[case]
    torch.manual_seed(0)
    logits = torch.randn(TOKENS, EXPERTS, dtype=dtype, requires_grad=True)
    expert_bias = torch.randn(EXPERTS) * 0.1 if bias else None
    num_groups, group_topk = groups or (None, None)
    theirs, (_, routing_map) = _saved(lambda x: topk_routing_with_score_function(
        x, topk, use_pre_softmax=pre, score_function=score, expert_bias=expert_bias, num_groups=num_groups,
        group_topk=group_topk), logits)
    router = Router(ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=1, num_moe_experts=EXPERTS,
                                moe_router_topk=topk, moe_router_score_function=score, moe_router_pre_softmax=pre,
                                moe_router_enable_expert_bias=bias, moe_router_num_groups=num_groups,
                                moe_router_group_topk=group_topk), 0)
    if bias:
        router.expert_bias.copy_(expert_bias)
    ours, (_, choice) = _saved(router.top_k, logits)
    assert ours == theirs
    chosen = routing_map.nonzero()[:, 1].view(TOKENS, topk)
    assert torch.equal(chosen, choice.sort(dim=1).values)
