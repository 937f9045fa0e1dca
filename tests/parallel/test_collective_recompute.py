"""Operator-level recompute over real collectives (NOTE [collectives are not operators] in
remat.models.collectives): a layer's operator indices are the same on the simulated rank that plans them and on a
rank whose collectives dispatch other operators, and recomputation never runs an in-place collective twice on a kept
output (two thread ranks: the values are real sums)."""

from __future__ import annotations

import pytest
import torch
from thread_ranks import Mailbox, ThreadTP, run_ranks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import SAC_IGNORED_OPS

from remat.config import ModelConfig
from remat.models.collectives import in_collective
from remat.models.gpt import sample_batch
from remat.models.tensor_parallel import build_tp_model
from remat.plan.operator_space import layer_operators, operator_kinds, roofline_price
from remat.recompute.apply import apply
from remat.recompute.plan_format import Plan, Unit

# dropout off: thread ranks share one random generator, so their draws would interleave at random
CONFIG = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128, seq_length=32,
                     micro_batch_size=2, hidden_dropout=0.0, attention_dropout=0.0)


class _Operators(TorchDispatchMode):
    """The operators one layer's forward dispatches, counted as keep_ops(...) counts them."""

    def __init__(self, layer: torch.nn.Module):
        super().__init__()
        self.inside, self.names = 0, []
        layer.register_forward_pre_hook(lambda m, a: setattr(self, "inside", self.inside + 1))
        layer.register_forward_hook(lambda m, a, o: setattr(self, "inside", self.inside - 1))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.inside and func not in SAC_IGNORED_OPS and not in_collective():
            self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _models(sp: bool, policies: list[str], plans: dict | None = None) -> tuple[Mailbox, dict]:
    box = Mailbox(2)  # models built on this thread: their initial values come from one seeded generator
    models = {(r, p): build_tp_model(CONFIG, ThreadTP(box, r), sp, seed=0) for r in range(2) for p in policies}
    for (_, policy), model in models.items():
        if policy != "none":
            apply(model, (plans or {}).get(policy, policy))
    return box, models


@pytest.mark.parametrize("sp", [False, True])
def test_a_real_groups_layer_dispatches_the_planned_operators(sp):
    box, models = _models(sp, ["none"])
    batch = sample_batch(CONFIG)

    def rank(r):
        model = models[r, "none"]
        with _Operators(model.layers[0]) as seen:
            model(*batch)
        return seen.names

    planned = [op.name for op in layer_operators(CONFIG, tp=2, sp=sp)]
    # the thread ranks' collectives run cat, chunk and clone where the simulated rank copies: not counted either way
    assert run_ranks(2, [box], rank) == [planned, planned]


@pytest.mark.parametrize("sp", [False, True])
def test_operator_level_recompute_over_real_collectives_equals_no_recompute(sp):
    kinds = operator_kinds(layer_operators(CONFIG, tp=2, sp=sp), roofline_price(4e14, 3e12), most=3)
    plans = {f"{kind[0]}": Plan.from_units([Unit("selective", 1, kind)] * CONFIG.num_layers) for kind in kinds}
    policies = ["none", "selective/non_matmul", *plans]
    box, models = _models(sp, policies, plans)
    batch = sample_batch(CONFIG)

    def rank(r):
        grads = {}
        for policy in policies:
            model = models[r, policy]
            model(*batch).backward()
            grads[policy] = [p.grad for p in model.parameters()]
        # without sp the row-parallel outputs are all-reduced in place: a kept one is not reduced a second time
        return {p: all(torch.equal(a, b) for a, b in zip(grads["none"], g)) for p, g in grads.items()}

    assert run_ranks(2, [box], rank) == [dict.fromkeys(policies, True)] * 2
