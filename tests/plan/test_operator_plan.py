"""Tests for the operator-level plan space (remat.plan.operator_space, keep_ops(...) in remat.recompute.plan_format):
the operator list, the plan text, gradients bit for bit, the unit model against traces, the dynamic program against
brute force, the finer space never costing more than the old one, and the guarantee on real CPU tensors."""

from __future__ import annotations

import functools
import json
import random
import time

import pytest
import torch
from tiny_models import segmentations

from remat import apply, build_model, measure, sample_batch
from remat.config import ModelConfig
from remat.memory.predict import trace
from remat.plan.api import plan
from remat.plan.costs import CostModel, candidate_units
from remat.plan.megatron import megatron_policies
from remat.plan.operator_space import layer_operators, operator_items, operator_kinds
from remat.plan.options import MEASURED_KEYS, PlanOptions
from remat.plan.solver import min_peak, solve
from remat.plan.unit_model import add_traced_units, unit_model
from remat.recompute.plan_format import KEEP, Plan, PlanError, Segment, Unit, keep_ops_token, kept_operators
from remat.recompute.region import ApplyError

SMALL = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, micro_batch_size=2,
                    vocab_size=128)
ROOFLINE = CostModel("time")


@functools.cache
def kinds() -> tuple[Unit, ...]:
    """Ten keep_ops kinds of SMALL's layer, ordered by the roofline's price per byte, traced into its unit model."""
    found = operator_kinds(layer_operators(SMALL), ROOFLINE.operator_price(), most=10)
    return tuple(add_traced_units(unit_model(SMALL), [Unit("selective", 1, k) for k in found]))


def grads(config: ModelConfig, layout) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = build_model(config, seed=0)
    if layout is not None:
        apply(model, layout)
    batch = sample_batch(config, seed=1)
    torch.manual_seed(1234)
    loss = model(*batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def same_gradients(config: ModelConfig, layout) -> bool:
    loss0, g0 = grads(config, None)
    loss1, g1 = grads(config, layout)
    return torch.equal(loss0, loss1) and g0.keys() == g1.keys() and all(torch.equal(g0[k], g1[k]) for k in g0)


# ------------------------------------------------------------------------------------------------ the operators
def test_layer_operators_and_their_items():
    """The dropout mask's empty_like, bernoulli_ and div_ are one item (kept or recomputed together); views, and
    what the layer returns, are never kept; the kinds are nested prefixes that recompute random draws in order."""
    ops = layer_operators(SMALL)
    names = [op.name for op in ops]
    draws = [op.index for op in ops if op.random]
    assert len(draws) == 3 and all(names[i] == "aten.bernoulli_.float" for i in draws)
    for i in draws:  # empty_like -> bernoulli_ -> div_: one item rooted at empty_like
        assert names[i - 1] == "aten.empty_like.default" and names[i + 1] == "aten.div_.Scalar"
        assert ops[i - 1].item == ops[i].item == ops[i + 1].item == i - 1 and ops[i].new_bytes == 0
    assert all(op.item == -1 for op in ops if op.name in ("aten.view.default", "aten.t.default"))
    assert ops[-1].name == "aten.add.Tensor" and ops[-1].item == -1  # the layer's output
    items = operator_items(ops, ROOFLINE.operator_price())
    assert sum(it.nbytes for it in items) == sum(op.new_bytes for op in ops if op.item >= 0)
    found = [kept_operators(k) for k in operator_kinds(ops, ROOFLINE.operator_price())]
    assert all(a > b for a, b in zip(found, found[1:])) and found[-1] == frozenset()  # each keeps less
    for kept in found:  # a kept draw means every later draw is kept
        assert [i in kept for i in draws] == sorted(i in kept for i in draws)
    assert len(operator_kinds(ops, ROOFLINE.operator_price(), most=5)) == 5


# ------------------------------------------------------------------------------------------------ the plan text
def test_keep_ops_text_and_json_round_trip():
    token = keep_ops_token([41, 3, 19, 20, 21])
    assert token == "keep_ops(3,19-21,41)" and kept_operators([token]) == frozenset({3, 19, 20, 21, 41})
    p = Plan.parse("keep 0, selective/keep_ops(41,3,19-21) 1-2, selective/keep_ops() 3, checkpoint 4-5")
    assert str(p) == "keep 0, selective/keep_ops(3,19-21,41) 1-2, selective/keep_ops() 3, checkpoint 4-5"
    assert Plan.parse(str(p)) == p and Plan.from_json(p.to_json()) == p
    assert Plan.from_dict(json.loads(json.dumps(p.to_dict()))) == p and Plan.from_units(p.units()) == p
    assert p.selective_modules(1) == ("keep_ops(3,19-21,41)",) and kept_operators(p.selective_modules(3)) == set()
    policy, why = p.megatron_policy()
    assert policy is None and "keep_ops" in why


@pytest.mark.parametrize("bad, message", [
    (lambda: Plan.parse("selective/keep_ops(5-2) 0"), "'5-2' is not an index or a range"),
    (lambda: Segment("selective", 0, 1, ("keep_ops(1)", "core_attn")), "stands alone: drop the other modules"),
    (lambda: Segment("selective", 0, 1, ("keep_ops[1]",)), r"write keep_ops\(<operator indices>\)"),
    (lambda: keep_ops_token([-1]), "integers >= 0"),
])
def test_keep_ops_refusals_name_the_fix(bad, message):
    with pytest.raises(PlanError, match=message):
        bad()


def test_apply_refuses_unsafe_operator_sets():
    """Keeping a tensor that a recomputed in-place operator would mutate again, a random draw before a recomputed
    one (the recomputation would shift its numbers), or an in-place operator without the tensor it changes, is
    refused at the first step, naming the fix."""
    ops = layer_operators(SMALL)
    first, second = [op.index for op in ops if op.random][:2]
    cfg = SMALL.replace(num_layers=1)
    for kept, message in (([first - 1, first], f"keep operator {first + 1} too"),
                          ([first - 1, first, first + 1], f"so operator {second}"),
                          ([first], f"operator {first} .* is kept but changes in place a tensor no kept operator "
                                    "made: keep the operator that made it too")):
        model = build_model(cfg)
        apply(model, Plan.from_units([Unit("selective", 1, (keep_ops_token(kept),))]))
        with pytest.raises(ApplyError, match=message):
            model(*sample_batch(cfg))


# ------------------------------------------------------------------------------------------------ gradients
def test_operator_level_gradients_equal_plain_bit_for_bit():
    """Every traced keep_ops kind (kept dropout masks included), mixed with the other kinds: loss and gradients
    equal the plain model's bit for bit."""
    found = kinds()
    units = [found[0], found[len(found) // 2], Unit("checkpoint", 2), found[-2]]
    assert same_gradients(SMALL.replace(num_layers=5), Plan.from_units(units))
    for k in found[1::3]:
        assert same_gradients(SMALL.replace(num_layers=1), Plan.from_units([k])), str(k)


# ------------------------------------------------------------------------------------------------ the unit model
def test_unit_model_equals_full_traces_with_keep_ops_layers():
    model = unit_model(SMALL)
    pool = [*kinds(), KEEP, Unit("checkpoint", 2), Unit("selective", 1, ("non_matmul",))]
    rng = random.Random(2)
    for trial in range(5):
        units: list[Unit] = []
        while sum(u.size for u in units) < rng.randint(2, 5):
            units.append(rng.choice(pool))
        if trial == 0:
            units = [kinds()[-1], KEEP, kinds()[0]]  # the lowest mask holder keeps operators
        p = Plan.from_units(units)
        assert model.peak(units) == trace(SMALL.replace(num_layers=p.num_layers), p).peak_bytes, str(p)


# ------------------------------------------------------------------------------------------------ the solver
def test_dp_with_operator_kinds_is_exact_against_brute_force():
    model = unit_model(SMALL)
    L = 4
    pool = [KEEP, *kinds()[::3], Unit("selective", 1, ("core_attn",)), *(Unit("checkpoint", k) for k in (1, 2, 4))]
    price = {u: ROOFLINE.cost(model, u) for u in pool}

    table = [(model.peak(p), sum(price[u] for u in p)) for p in segmentations(pool, L)]
    peaks = sorted({pk for pk, _ in table})
    assert min_peak(model, L, pool) == peaks[0] and solve(model, L, peaks[0] - 1, ROOFLINE, units=pool) is None
    for budget in sorted(set(random.Random(4).sample(peaks, 12) + [peaks[0], peaks[-1]])):
        sol = solve(model, L, budget, ROOFLINE, units=pool)
        assert sol is not None and sol.cost == min(c for pk, c in table if pk <= budget) and sol.model_peak <= budget


@pytest.mark.parametrize("objective", ["time", "extra_flops"])
def test_finer_space_never_costs_more(objective):
    """At every budget from the smallest reachable peak to the no-recompute peak, the space with keep_ops kinds
    finds a plan at least as cheap as the old space (module sets, non_matmul, groups); priced by time it is
    cheaper somewhere (by FLOPs, non_matmul+matmul_k<K> already recomputes nothing but matrix multiplies)."""
    model = unit_model(SMALL)
    cost = CostModel(objective)
    old = candidate_units(4, contractions=model.contractions)
    new = old + list(kinds())
    lo, hi = min_peak(model, 4, new), model.peak([KEEP] * 4)
    assert lo <= min_peak(model, 4, old)
    cheaper = 0
    for k in range(13):
        budget = lo + (hi - lo) * k // 12
        a, b = solve(model, 4, budget, cost, units=new), solve(model, 4, budget, cost, units=old)
        assert a is not None and a.model_peak <= budget
        assert b is None or a.cost <= b.cost
        cheaper += b is None or a.cost < b.cost
    assert cheaper > 0 or objective == "extra_flops"


def test_dp_with_operator_kinds_on_128_layers():
    """The dynamic program with every keep_ops kind on 128 layers (the target is well under 1 s; the bound here is
    looser for loaded hosts; benchmarks/bench_plan.py reports the time)."""
    model = unit_model(SMALL)
    units = candidate_units(128, contractions=model.contractions) + list(kinds())
    lo, hi = min_peak(model, 128, units), model.peak([KEEP] * 128)
    megatron = [Plan.from_policy(p, 128).units() for p in megatron_policies(128)]
    worst = 0.0
    for budget in (lo, (lo + hi) // 2, hi - (hi - lo) // 8):
        incumbent = min((sum(ROOFLINE.cost(model, u) for u in m) for m in megatron if model.peak(m) <= budget),
                        default=None)
        start = time.process_time()  # this process's CPU time: other processes on a loaded host do not count
        sol = solve(model, 128, budget, ROOFLINE, units=units, incumbent=incumbent)
        worst = max(worst, time.process_time() - start)
        assert sol is not None and sol.model_peak <= budget and (incumbent is None or sol.cost <= incumbent)
    assert worst < 3.0


# ------------------------------------------------------------------------------------------------ the guarantee
def cpu_like_times() -> dict[str, float]:
    """Measured-times dict shaped as measure_layer_times returns it, with a CPU's proportions (the dropout draw
    is the dearest operator, element-wise ones cost their bytes): fixed, so the plan is deterministic."""
    ops = layer_operators(SMALL)
    times = {k: 1e-3 for k in MEASURED_KEYS}
    times.update(layer=2e-3, layer_step=6e-3, sac_overhead=5e-5, core_attn=8e-4, mlp=6e-4, non_matmul=1.2e-3)
    for op in ops:
        if op.item >= 0:
            times[f"op_{op.index}"] = 2e-4 if op.random else 1e-5 + op.new_bytes * 1e-9 + op.flops * 1e-12
    return times


def test_operator_level_plan_fits_when_measured_and_is_exact():
    """With CPU-like measured prices the planner keeps the dropout masks it would otherwise draw again: the
    chosen plan has keep_ops layers, its peak measured on real tensors equals the prediction and fits, its
    gradients equal the plain model's bit for bit, and the report's step-time ratio is above 1."""
    model = unit_model(SMALL)
    lo, hi = min_peak(model, 4, candidate_units(4, contractions=model.contractions)), model.peak([KEEP] * 4)
    budget = (lo + hi) // 2
    result = plan(SMALL, budget, PlanOptions(measured_times=cpu_like_times()))
    chosen = result.extended
    assert any(kept_operators(u.modules) is not None for u in chosen.plan.units()), str(chosen.plan)
    net = build_model(SMALL)
    apply(net, chosen.plan)
    assert measure(net, sample_batch(SMALL)).peak_bytes == chosen.peak_bytes <= budget
    assert same_gradients(SMALL, chosen.plan)
    assert chosen.step_time_ratio > 1.0 and result.format().splitlines()[1].startswith(
        f"predicted step time: {chosen.step_time_ratio:.4f}x (extended plan)")
    old = plan(SMALL, budget, PlanOptions(measured_times=cpu_like_times(), operator_sets=0))
    assert chosen.cost <= old.extended.cost
