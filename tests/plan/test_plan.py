"""Tests for remat.plan: budgets, the Plan format, the unit model against traces, the exact dynamic program against
brute force, the guarantee (measured peaks on real CPU tensors), monotonicity, refusal, offload, the CLI."""

from __future__ import annotations

import functools
import itertools
import json
import math
import random
import time

import pytest
import torch
from tiny_models import segmentations

from remat import apply, build_model, measure, sample_batch
from remat.cli import main
from remat.config import ModelConfig
from remat.memory.predict import trace as _trace
from remat.memory.predict import trace_rank
from remat.plan.api import BudgetError, plan
from remat.plan.costs import CostModel, candidate_units
from remat.plan.megatron import megatron_policies, predict_plan, stand_in
from remat.plan.options import ParallelOptions, PlanOptions
from remat.plan.solver import min_peak, solve
from remat.plan.space import SELECTIVE_SETS, contraction_sets, selective_sets
from remat.plan.unit_model import unit_model
from remat.policy import Policy
from remat.recompute.plan_format import KEEP, Plan, PlanError, Segment, Unit
from remat.units import GIB, GPU_PRESETS, MIB, SizeError, parse_budget, parse_bytes

TINY = ModelConfig(num_layers=6, hidden_size=64, num_attention_heads=4, seq_length=32, micro_batch_size=2,
                   vocab_size=128)
SMALL = TINY.replace(num_layers=4)  # what plan() runs on: its Megatron sweep traces every setting
TP2_SP = ParallelOptions(tp=2, sp=True)


@functools.cache
def extremes(config: ModelConfig = SMALL) -> tuple[int, int]:
    """(smallest reachable peak, no-recompute peak) of the model."""
    model = unit_model(config)
    return min_peak(model, config.num_layers, candidate_units(config.num_layers)), model.peak([KEEP] *
                                                                                                config.num_layers)


def budgets(n: int) -> list[int]:
    lo, hi = extremes()
    return sorted({lo + (hi - lo) * k // (n - 1) for k in range(n)})


@functools.cache
def planned(budget: int):
    return plan(SMALL, budget)


def measured_peak(config: ModelConfig, p: Plan) -> int:
    model = build_model(config)
    apply(model, p)
    return measure(model, sample_batch(config)).peak_bytes


def grads(config: ModelConfig, layout) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = build_model(config, seed=0)
    if layout is not None:
        apply(model, layout)
    batch = sample_batch(config, seed=1)
    torch.manual_seed(1234)
    loss = model(*batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


# ------------------------------------------------------------------------------------------------ budgets
@pytest.mark.parametrize("text, expected", [
    ("70GiB", 70 * GIB), ("70 GiB", 70 * GIB), ("75GB", 75 * 10**9), ("512MiB", 512 * MIB), ("1.5KiB", 1536),
    ("2kb", 2000), ("123", 123), ("1e9", 10**9), (4096, 4096), ("0.5 TiB", 1 << 39),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "-1GiB", "0", "12XB", "1.2.3GB", "nan"])
def test_parse_bytes_refuses(text):
    with pytest.raises(SizeError):
        parse_bytes(text)


def test_gpu_budget_minus_reserve():
    total = GPU_PRESETS["h100-80g"]
    assert parse_budget("h100-80g")[0] == total - int(total * 0.10)
    assert parse_budget("H100-80G", "5%")[0] == total - int(total * 0.05)
    assert parse_budget("h100-80g", 0.2)[0] == total - int(total * 0.2)
    assert parse_budget("h100-80g", "2GiB")[0] == total - 2 * GIB
    assert parse_budget("a100-40g", None)[0] == GPU_PRESETS["a100-40g"]
    assert parse_budget("70GiB", "50%")[0] == 70 * GIB  # a reserve applies to GPU presets only
    with pytest.raises(SizeError, match="unknown GPU preset"):
        parse_budget("h900")
    with pytest.raises(SizeError):
        parse_budget("h200", "100%")


# ------------------------------------------------------------------------------------------------ the Plan format
def test_plan_text_and_json_round_trip():
    p = Plan.parse("keep 0-1, checkpoint 2-7/2, selective/mlp+core_attn 8, offload 9-11/3, checkpoint 12-14")
    assert p.num_layers == 15
    assert p.layer_groups(15) == [(2, 3), (4, 5), (6, 7), (9, 10, 11), (12, 13, 14)]
    assert p.offload_groups(15) == [(9, 10, 11)]
    assert p.selective_modules(8) == ("core_attn", "mlp") and p.selective_modules(0) == ()
    assert str(p) == "keep 0-1, checkpoint 2-7/2, selective/core_attn+mlp 8, offload 9-11, checkpoint 12-14"
    assert Plan.parse(str(p)) == p
    assert Plan.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    assert Plan.from_json(p.to_json()) == p
    assert Plan.from_units(p.units()) == p
    # adjacent keep / same-selective segments merge; groups never do
    merged = Plan(4, (Segment("keep", 0, 1), Segment("keep", 1, 2), Segment("checkpoint", 2, 3),
                      Segment("checkpoint", 3, 4)))
    assert str(merged) == "keep 0-1, checkpoint 2-3/1"
    nr = Plan.parse("checkpoint 0-1 @non-reentrant")
    assert nr.engine == "non-reentrant" and Plan.parse(str(nr)) == nr


@pytest.mark.parametrize("bad", [
    lambda: Plan(3, (Segment("keep", 0, 2),)),                       # does not cover the stack
    lambda: Plan(3, (Segment("keep", 0, 1), Segment("keep", 2, 3))),  # a gap
    lambda: Segment("selective", 0, 1, ("mlp", "act")),               # act is inside mlp
    lambda: Segment("selective", 0, 1, ("layernorm", "non_matmul")),  # non_matmul recomputes norms already
    lambda: Segment("selective", 0, 1),                               # no module
    lambda: Segment("recompute", 0, 1),                               # unknown mode
    lambda: Plan.parse("checkpoint 0-4/2"),                           # 5 layers are not groups of 2
    lambda: Plan(2, (Segment("offload", 0, 2),), "non-reentrant"),    # offload needs reentrant
    lambda: Plan.from_dict({"format": "something else"}),
])
def test_plan_refusals(bad):
    with pytest.raises(PlanError):
        bad()


def test_plan_depth_is_checked_when_applied():
    with pytest.raises(PlanError, match="for 6 layers"):
        apply(build_model(TINY.replace(num_layers=4)), Plan.parse("keep 0-5"))


@pytest.mark.parametrize("policy", ["none", "full/uniform/1", "full/uniform/4", "full/uniform/6", "full/block/2",
                                    "full/block/6", "selective/core_attn", "selective/core_attn+mlp+layernorm"])
def test_megatron_round_trip(policy):
    p = Plan.from_policy(policy, 6)
    back, why = p.megatron_policy()
    assert why == "" and Plan.from_policy(back, 6) == p  # full/block/6 is the same plan as full/uniform/1
    if policy != "full/block/6":
        assert back == Policy.parse(policy) and p.megatron_args() == Policy.parse(policy).to_megatron_args()


@pytest.mark.parametrize("text, reason", [
    ("offload 0-5/1", "offloads"),
    ("checkpoint 0-1, checkpoint 2-4, checkpoint 5", "sizes"),
    ("keep 0, checkpoint 1-5/1", "block"),
    ("selective/core_attn 0-2, keep 3-5", "mixes"),
    ("selective/core_attn 0-2, selective/mlp 3-5", "different"),
    ("selective/act 0-5", "MoE"),
    ("selective/non_matmul 0-5", "every operator but the matrix multiplies"),
    ("selective/non_matmul+matmul_k16 0-2, selective/non_matmul 3-5", "every operator but the matrix multiplies"),
])
def test_not_megatron_says_why(text, reason):
    p = Plan.parse(text)
    policy, why = p.megatron_policy()
    assert policy is None and reason in why
    with pytest.raises(PlanError, match=reason):
        p.megatron_args()


# ------------------------------------------------------------------------------------------------ the unit model
ALL_UNITS = [KEEP, *(Unit("selective", 1, s) for s in SELECTIVE_SETS),
             *(Unit(m, k) for m in ("checkpoint", "offload") for k in (1, 2, 3, 4, 5))]


def random_units(rng: random.Random, depth: int, kinds: list[Unit]) -> list[Unit]:
    units, n = [], 0
    while n < depth:
        u = rng.choice(kinds)
        if n + u.size <= depth:
            units.append(u)
            n += u.size
    return units


@pytest.mark.parametrize("config, trials", [
    (TINY, 8),
    (TINY.replace(num_layers=3, activation="swiglu", normalization="rmsnorm", position="rope", num_query_groups=2,
                  attention="sdpa", dtype="bf16"), 3),
])
def test_unit_model_equals_full_traces(config, trials):
    """The modelled peak of random plans (groups of 4 and 5 layers are extrapolated from traced groups of 3)
    equals the fake trace of the whole plan, byte for byte."""
    model = unit_model(config)
    rng = random.Random(7)
    for _ in range(trials):
        units = random_units(rng, rng.randint(2, config.num_layers + 2), ALL_UNITS)
        p = Plan.from_units(units)
        assert model.peak(units) == _trace(config.replace(num_layers=p.num_layers), p).peak_bytes, str(p)


def test_unit_model_equals_full_traces_with_operator_level_layers():
    """Plans mixing non_matmul layers (selective activation checkpointing) with every other kind: modelled peak ==
    traced peak, byte for byte; they keep the attention mask like any whole-layer checkpoint."""
    model = unit_model(TINY)
    assert model.contractions == (16, 32, 64, 256)  # head dim, keys (scores.V), hidden, MLP width
    operator_level = [Unit("selective", 1, s) for s in SELECTIVE_SETS + contraction_sets(model.contractions)
                      if "non_matmul" in s]
    assert len(operator_level) == 8
    rng = random.Random(11)
    for trial in range(6):
        units = random_units(rng, rng.randint(2, 6), operator_level + ALL_UNITS[:3] + ALL_UNITS[-10:])
        if trial == 0:
            units = [operator_level[0], KEEP, Unit("checkpoint", 2)]  # the lowest mask holder is a non_matmul layer
        p = Plan.from_units(units)
        assert model.peak(units) == _trace(TINY.replace(num_layers=p.num_layers), p).peak_bytes, str(p)
    assert all(model.holds(u) == frozenset(model.side) for u in operator_level)


def test_composed_prediction_equals_full_trace():
    cfg = TINY.replace(num_layers=14)
    p = Plan.parse("checkpoint 0-4, keep 5, selective/core_attn 6-7, selective/non_matmul 8-9, checkpoint 10-11/1, "
                   "selective/non_matmul+matmul_k16 12, keep 13")
    assert stand_in(p) is not None and stand_in(p).num_layers < 14
    composed, traced = predict_plan(cfg, p), _trace(cfg, p)
    assert "composed_from" in composed.meta
    assert (composed.peak_bytes, composed.at_peak) == (traced.peak_bytes, traced.at_peak)


# ------------------------------------------------------------------------------------------------ the solver
def test_dp_is_exact_against_brute_force():
    """Every segmentation of a 6-layer stack into kept layers, two selective kinds and checkpoint/offload groups of
    any size (23,787 plans): the solver's cost equals the brute-force optimum at every budget tried, its plan's
    modelled peak fits, and the smallest feasible budget is the brute-force smallest peak."""
    model = unit_model(TINY)
    L = 6
    kinds = [KEEP, Unit("selective", 1, ("core_attn",)), Unit("selective", 1, ("core_attn", "mlp"))]
    kinds += [Unit(m, k) for m in ("checkpoint", "offload") for k in range(1, L + 1)]
    cost = CostModel()
    price = {u: cost.cost(model, u) for u in kinds}

    table = [(model.peak(p), sum(price[u] for u in p)) for p in segmentations(kinds, L)]
    assert len(table) == 23787
    peaks = sorted({pk for pk, _ in table})
    assert min_peak(model, L, kinds) == peaks[0]
    assert solve(model, L, peaks[0] - 1, cost, units=kinds) is None
    rng = random.Random(3)
    for budget in sorted(set(rng.sample(peaks, 30) + [peaks[0], peaks[-1], peaks[-1] + 10**6])):
        best = min(c for pk, c in table if pk <= budget)
        sol = solve(model, L, budget, cost, units=kinds)
        assert sol is not None and sol.cost == best and sol.model_peak <= budget, budget
        assert sum(price[u] for u in sol.units) == best


def test_solver_speed_128_layers():
    """The dynamic program alone on 128 layers (the target is 1 s; the bound here is looser for loaded CI hosts;
    benchmarks/bench_plan.py reports the time)."""
    cfg = TINY.replace(num_layers=128)
    model = unit_model(cfg)
    units = candidate_units(128)
    lo, hi = min_peak(model, 128, units), model.peak([KEEP] * 128)
    cost = CostModel()
    megatron = [Plan.from_policy(p, 128).units() for p in megatron_policies(128)]
    worst = 0.0
    for budget in (lo, (lo + hi) // 2, hi):
        incumbent = min(sum(cost.cost(model, u) for u in m) for m in megatron if model.peak(m) <= budget)
        start = time.perf_counter()
        sol = solve(model, 128, budget, cost, units=units, incumbent=incumbent)
        worst = max(worst, time.perf_counter() - start)
        assert sol is not None and sol.model_peak <= budget and sol.cost <= incumbent
    assert worst < 3.0


# ------------------------------------------------------------------------------------------------ the guarantee
@pytest.mark.parametrize("budget", budgets(5))
def test_measured_peak_fits(budget):
    """The plans' peaks measured on real CPU tensors (remat.measure of remat.apply(model, plan)) fit the budget,
    and equal the prediction; the extended plan never costs more than the best Megatron setting."""
    result = planned(budget)
    for choice in (result.extended, result.megatron):
        if choice is None:
            continue
        peak = measured_peak(SMALL, choice.plan)
        assert peak == choice.peak_bytes <= budget, str(choice.plan)
    assert result.extended.model_peak_bytes == result.extended.peak_bytes  # the model was exact: no re-solve
    assert result.stats["resolves"] == 0
    if result.megatron is not None:
        assert result.extended.cost <= result.megatron.cost


def test_monotone_in_budget():
    results = [planned(b) for b in budgets(10)]
    ext = [r.extended.cost for r in results]
    meg = [r.megatron.cost if r.megatron else float("inf") for r in results]
    assert ext == sorted(ext, reverse=True) and meg == sorted(meg, reverse=True)
    assert ext[-1] == 0  # the no-recompute peak needs no recompute
    assert all(e <= m for e, m in zip(ext, meg))


def test_refused_below_the_smallest_peak():
    lo, _ = extremes()
    with pytest.raises(BudgetError) as info:
        plan(SMALL, lo - 1)
    err = info.value
    assert err.min_peak_bytes == lo and err.budget_bytes == lo - 1
    assert err.plan.peak_bytes == lo and measured_peak(SMALL, err.plan.plan) == lo
    assert planned(lo).extended.peak_bytes == lo  # the smallest peak itself is a valid budget


# ------------------------------------------------------------------------------------------------ offload
@pytest.mark.parametrize("text", ["offload 0-1, selective/core_attn 2, checkpoint 3-4, keep 5",
                                  "offload 0-5/1", "offload 0-5"])
def test_gradients_equal_plain_bit_for_bit(text):
    loss0, g0 = grads(TINY, None)
    loss1, g1 = grads(TINY, Plan.parse(text))
    assert torch.equal(loss0, loss1)
    assert g0.keys() == g1.keys() and all(torch.equal(g0[k], g1[k]) for k in g0)


def test_offloaded_inputs_leave_device_memory():
    """When the loss's backward starts, an offloaded plan holds one hidden-states tensor less per group than the
    same plan checkpointed; the inputs come back (and are freed) in each group's recomputation."""
    offloaded, kept = Plan.parse("offload 0-5/2"), Plan.parse("checkpoint 0-5/2")
    hidden = TINY.micro_batch_size * TINY.seq_length * TINY.hidden_size * 4
    at_head = []
    for p in (offloaded, kept):
        model = build_model(TINY)
        apply(model, p)
        tl = measure(model, sample_batch(TINY))
        head = next(ph.start for ph in tl.phases if ph.kind == "backward" and ph.region == "head")
        at_head.append(int(tl.live_bytes()[head - 1]))
        assert tl.breakdown(tl.num_events - 1)["recompute"] == 0
    assert at_head[1] - at_head[0] == 3 * hidden
    assert measured_peak(TINY, offloaded) <= measured_peak(TINY, kept)


def test_offload_needs_the_reentrant_engine():
    class Layout:
        engine = "non-reentrant"

        def layer_groups(self, depth):
            return [(0, 1)]

        def selective_modules(self, layer):
            return ()

        def offload_groups(self, depth):
            return [(0, 1)]

    from remat.recompute.region import ApplyError
    with pytest.raises(ApplyError, match="reentrant"):
        apply(build_model(TINY.replace(num_layers=2)), Layout())


# ------------------------------------------------------------------------------------------------ CLI
def test_cli_end_to_end(tmp_path, capsys):
    budget = budgets(5)[2]
    flags = ["--layers", "4", "--hidden", "64", "--heads", "4", "--seq", "32", "--batch", "2", "--vocab", "128"]
    out = tmp_path / "plan.json"
    assert main(["plan", "--budget", str(budget), *flags, "--json", "--out", str(out)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report == json.loads(out.read_text())
    assert report["fits"] and report["extended"]["peak_bytes"] <= budget
    p = Plan.from_dict(report["extended"]["plan_json"])
    assert measured_peak(SMALL, p) == report["extended"]["peak_bytes"]
    assert "remat.apply(model, plan)" in report["snippet"]

    assert main(["plan", "--budget", f"{budget / MIB}MiB", *flags]) == 0
    text = capsys.readouterr().out
    assert "Best extended plan" in text and "Megatron flags" in text and "Plan.from_dict" in text

    lo, _ = extremes()
    assert main(["plan", "--budget", str(lo - 1), *flags]) == 1
    assert "smallest reachable peak" in capsys.readouterr().out
    assert main(["plan", "--budget", str(budget), *flags, "--json", "--selective-modules", "core_attn,mlp"]) == 0
    units = Plan.from_dict(json.loads(capsys.readouterr().out)["extended"]["plan_json"]).units()
    assert all(set(u.modules) <= {"core_attn", "mlp"} for u in units)
    assert main(["plan", "--budget", "12XB", *flags]) == 2
    assert "unknown unit" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ pipelines
def test_pipeline_stages_fit_and_beat_uniform():
    from remat.parallel.pipeline_predict import predict_pipeline
    from remat.plan.pipeline import plan_pipeline, stage_timeline

    cfg = TINY.replace(num_layers=2)
    none = [tl.peak_bytes for tl in predict_pipeline(cfg, "none", 2, 2, "1f1b")]
    budget = min(none)  # stage 0 (two microbatches in flight) must recompute, stage 1 need not
    report = plan_pipeline(cfg, budget, ParallelOptions(pp=2, microbatches=2))
    assert [s["in_flight"] for s in report["stages"]] == [2, 1]
    for st in report["stages"]:
        p = Plan.from_dict(st["plan_json"])
        assert st["fits"] and st["peak_bytes"] <= budget
        assert stage_timeline(cfg, st["stage"], p, pp=2, microbatches=2).peak_bytes == st["peak_bytes"]
    assert report["stages"][1]["recompute_flops"] == 0
    if report["uniform"] is not None:
        assert report["critical_path_seconds"] <= report["uniform"]["critical_path_seconds"]


# ------------------------------------------------------------------------------------------------ operator level
def test_operator_level_costs():
    """non_matmul recomputes no FLOPs (FLOP objective: free) but writes bytes again (time objective: charged at
    memory_bandwidth); with core_attn it costs module-level core_attn's FLOPs; measured times price it by the
    operator classes measured on this machine."""
    model = unit_model(TINY)
    lean, lean_core = Unit("selective", 1, ("non_matmul",)), Unit("selective", 1, ("core_attn", "non_matmul"))
    core = Unit("selective", 1, ("core_attn",))
    flops, timed = CostModel("extra_flops"), CostModel("time", memory_bandwidth=1e12)
    assert flops.cost(model, lean) == 0 and model.shape(lean).recompute_bytes > 0
    assert flops.cost(model, lean_core) == flops.cost(model, core) > 0
    assert timed.cost(model, lean) == math.ceil(1e9 * model.shape(lean).recompute_bytes / 1e12)
    scores = Unit("selective", 1, ("non_matmul", "matmul_k16"))
    assert 2 * flops.cost(model, scores) == flops.cost(model, lean_core)  # Q.K^T alone: half the core's FLOPs
    assert model.shape(scores).forward.net < model.shape(lean).forward.net
    assert model.shape(lean).forward.net < model.shape(KEEP).forward.net  # what it keeps for backward
    times = {"layer": 1.0, "core_attn": 0.5, "mlp": 0.3, "layernorm": 0.05, "act": 0.05, "non_matmul": 0.4,
             "core_attn_matmuls": 0.1, "mlp_matmuls": 0.2}
    measured = CostModel("time", measured=tuple(sorted(times.items())))
    assert measured.recompute_seconds(model, lean) == 0.4
    times.update(contraction_16=0.01, contraction_32=0.02, contraction_64=0.05)
    measured = CostModel("time", measured=tuple(sorted(times.items())))
    assert measured.recompute_seconds(model, Unit("selective", 1, ("non_matmul", "matmul_k32"))) == \
        pytest.approx(0.43)
    assert measured.recompute_seconds(model, Unit("selective", 1, ("core_attn", "mlp", "non_matmul"))) == \
        pytest.approx(0.7)


def test_operator_level_plan_needs_no_flops_where_module_level_does():
    """At the peak of non_matmul on every layer, the extended plan recomputes no FLOPs and fits when measured;
    restricted to module-level sets (selective_sets) it must recompute matrix multiplies."""
    model = unit_model(SMALL)
    lean = [Unit("selective", 1, ("non_matmul",))] * SMALL.num_layers
    budget = model.peak(lean)
    assert budget < model.peak([KEEP] * SMALL.num_layers)
    result = plan(SMALL, budget, PlanOptions(objective="extra_flops"))
    assert result.extended.recompute_flops == 0 and measured_peak(SMALL, result.extended.plan) <= budget
    assert result.extended.recompute_bytes > 0 and "rebuilt in backward" in result.format()  # the work FLOPs miss
    module_level = plan(SMALL, budget, PlanOptions(objective="extra_flops",
                                                   selective_sets=selective_sets("core_attn,mlp,layernorm,act")))
    assert module_level.extended.recompute_flops > 0
    assert not any("non_matmul" in u.modules for u in module_level.extended.plan.units())
    with pytest.raises(PlanError, match="valid modules are"):
        selective_sets("core_attn,attention")


def test_every_selective_set_is_applicable():
    for s in SELECTIVE_SETS:
        apply(build_model(TINY.replace(num_layers=1)), Plan.from_units([Unit("selective", 1, s)]))
    assert len(SELECTIVE_SETS) == 15 and not any({"mlp", "act"} <= set(s) for s in SELECTIVE_SETS)
    assert [s for s in SELECTIVE_SETS if "non_matmul" in s] == [
        ("non_matmul",), ("core_attn", "non_matmul"), ("mlp", "non_matmul"), ("core_attn", "mlp", "non_matmul")]
    assert len(list(itertools.chain(candidate_units(3)))) == 1 + 15 + 2 * 3


# ------------------------------------------------------------------------------------------------ tensor parallelism
@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_unit_model_of_a_tensor_parallel_rank_equals_full_traces(sp):
    """The unit model of one tensor-parallel rank (simulated group, Megatron sharding) against whole fake traces
    of that rank, on random plans of every unit kind, byte for byte."""
    model = unit_model(SMALL, tp=2, sp=sp)
    kinds = [KEEP, *(Unit("selective", 1, s) for s in SELECTIVE_SETS + contraction_sets(model.contractions)),
             *(Unit(m, k) for m in ("checkpoint", "offload") for k in (1, 2, 3, 4))]
    rng = random.Random(5)
    for _ in range(5):
        units = random_units(rng, rng.randint(2, 6), kinds)
        p = Plan.from_units(units)
        traced = trace_rank(SMALL.replace(num_layers=p.num_layers), p, "cpu", 2, sp)
        assert model.peak(units) == traced.peak_bytes, str(p)


def test_tensor_parallel_plans_fit_on_real_ranks():
    """Plans for one rank of tp=2 with sequence parallelism, measured on two real gloo ranks: every rank's peak is
    within the budget (the plans leave room for a collective's buffer, which gloo may free late)."""
    from remat.parallel.tensor import measure_tensor_parallel

    model = unit_model(SMALL, tp=2, sp=True)
    lo = min_peak(model, 4, candidate_units(4, contractions=model.contractions))
    budget = (lo + model.peak([KEEP] * 4)) // 2
    result = plan(SMALL, budget, parallel=TP2_SP)
    margin = result.stats["collective_margin_bytes"]
    assert margin == SMALL.micro_batch_size * SMALL.seq_length * SMALL.hidden_size * 4 and result.tp == 2
    for choice in (result.extended, result.megatron):
        assert choice is not None and choice.peak_bytes <= budget - margin
        ranks = measure_tensor_parallel(SMALL, choice.plan, tp=2, sp=True, timeout=240)
        assert all(t.peak_bytes <= budget for t in ranks), (str(choice.plan), [t.peak_bytes for t in ranks])
    with pytest.raises(BudgetError) as info:
        plan(SMALL, lo + margin - 1, parallel=TP2_SP)
    assert info.value.min_peak_bytes == lo + margin and "collectives" in str(info.value)
    assert plan(SMALL, lo + margin, parallel=TP2_SP).extended.peak_bytes == lo


def test_tensor_parallel_cli(capsys):
    flags = ["--layers", "4", "--hidden", "64", "--heads", "4", "--seq", "32", "--batch", "2", "--vocab", "128"]
    assert main(["plan", "--budget", "2MiB", *flags, "--tp", "2", "--sp", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["tp"], report["sp"]) == (2, True) and report["fits"]
    assert main(["plan", "--budget", "2MiB", *flags, "--tp", "3"]) == 2
    assert "num_attention_heads=4 is not divisible by the tensor-parallel size tp=3" in capsys.readouterr().err
    # TP with PP is planned as a whole job (remat.cli.job): every rank, Adam's state and the two 32 MiB cuBLAS
    # workspaces (forward and backward threads) every GPU rank keeps counted
    assert main(["plan", "--budget", "80MiB", *flags, "--tp", "2", "--pp", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["format"] == "remat.plan-job" and (report["job"]["tp"], report["job"]["pp"]) == (2, 2)
