"""Compiled planning (NOTE [compiled planning] in remat.plan.compiled): the bytes a choice saves under torch.compile,
counted on the compiled graphs, the knapsack over layers against brute force, and the measured check's re-solve."""

from __future__ import annotations

import itertools
import random

import pytest

from remat.config import ModelConfig
from remat.plan.compiled import compiled_saved_bytes, plan_compiled, solve_compiled, unit_savings
from remat.plan.costs import CostModel
from remat.recompute.plan_format import KEEP, Plan, PlanError, Unit

TINY = ModelConfig(num_layers=3, hidden_size=32, num_attention_heads=4, seq_length=16, micro_batch_size=2,
                   vocab_size=64, hidden_dropout=0.1, attention_dropout=0.1)
ACT = Unit("selective", 1, ("act",))


def test_activation_checkpoint_saves_the_gelu_output_only_compiled() -> None:
    # eagerly fc2 saves the GELU's output, the region's output: checkpointing the GELU alone frees nothing. Compiled,
    # the partitioner keeps fc1's output and recomputes the GELU: b x s x 4h fp32 elements per layer
    savings = unit_savings(TINY, [KEEP, ACT])
    assert savings == {KEEP: 0, ACT: 2 * 16 * 4 * 32 * 4}
    two = TINY.replace(num_layers=2)
    assert compiled_saved_bytes(two, "selective/act 0, keep 1") == compiled_saved_bytes(two, None) - savings[ACT]


def brute(num_layers: int, need: int, savings: dict[Unit, int], prices: dict[Unit, int]) -> int | None:
    best = None
    for combo in itertools.combinations_with_replacement(list(savings), num_layers):
        if sum(savings[u] for u in combo) >= need:
            cost = sum(prices[u] for u in combo if u != KEEP)
            best = cost if best is None else min(best, cost)
    return best


def test_knapsack_is_the_brute_force_optimum() -> None:
    rng = random.Random(3)
    units = [KEEP] + [Unit("selective", 1, (m,)) for m in ("act", "layernorm", "mlp", "core_attn")]
    for _ in range(40):
        savings = {u: 0 if u == KEEP else rng.randrange(1, 5) * 4096 for u in units}
        prices = {u: 0 if u == KEEP else rng.randrange(1, 50) for u in units}
        layers = rng.randrange(1, 5)
        need = rng.randrange(1, 4 * 5 * 4096)
        found = solve_compiled(layers, need, savings, prices)
        expected = brute(layers, need, savings, prices)
        if expected is None:
            assert found is None
            continue
        assert found is not None
        chosen, cost = found
        assert len(chosen) == layers and cost == expected == sum(prices[u] for u in chosen)
        assert sum(savings[u] for u in chosen) >= need


def test_knapsack_edges() -> None:
    savings, prices = {KEEP: 0, ACT: 100}, {KEEP: 0, ACT: 5}
    assert solve_compiled(3, 0, savings, prices) == ([KEEP] * 3, 0)
    assert solve_compiled(3, 301, savings, prices) is None
    assert solve_compiled(3, 150, savings, prices) == ([ACT, ACT, KEEP], 10)
    with pytest.raises(PlanError, match="num_layers=0"):
        solve_compiled(0, 1, savings, prices)


def test_plan_compiled_resolves_until_the_measured_peak_fits() -> None:
    base = 1_000_000
    seen: list[str] = []

    def measure(p: Plan) -> int:  # the instrument: the prediction, 3000 bytes over on the first plan measured
        seen.append(str(p))
        saved = sum(savings[u] for u in p.units())
        return base - saved + (3000 if len(seen) == 1 else 0)

    savings = unit_savings(TINY, [KEEP, ACT, Unit("checkpoint", 1)])
    budget = base - savings[ACT]  # one GELU's bytes: one act layer is predicted to fit exactly
    found = plan_compiled(TINY, budget, base, measure, CostModel(), [("act",)])
    assert found is not None and found.resolves == 1 and found.measured_peak <= budget
    assert seen[0] == "selective/act 0, keep 1-2" and str(found.plan) == seen[1] == "selective/act 0-1, keep 2"
    with pytest.raises(PlanError, match="budget"):
        plan_compiled(TINY, 0, base, measure, CostModel(), [("act",)])
