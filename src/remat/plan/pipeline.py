"""Planning each stage of a pipeline-parallel job under one budget."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from typing import Any

from remat.config import ModelConfig
from remat.memory import disk_cache
from remat.memory.predict import predict_config
from remat.parallel.chunk_trace import trace_chunk
from remat.parallel.pipeline_predict import MAX_COMPOSED_MICROBATCHES, compose_stage, predict_pipeline
from remat.parallel.pipeline_runtime import StagePlan
from remat.parallel.schedule import (
    PipelineError,
    check_schedule,
    checkpointed_forwards,
    max_in_flight,
    partition,
    rank_chunks,
    schedule_actions,
    warmup_forwards,
)
from remat.plan.costs import CostModel, candidate_units
from remat.plan.megatron import Predicted, megatron_policies
from remat.plan.options import ParallelOptions, PlanOptions
from remat.plan.result import compared
from remat.plan.solver import Solution, cost_lower_bound, reuse_tables, solve, tidy
from remat.plan.unit_model import UnitModel, model_to_dict, unit_model
from remat.policy import Policy
from remat.recompute.plan_format import KEEP, Plan, PlanError, Unit
from remat.timeline import Timeline
from remat.units import CUDA_BLOCK, format_bytes, format_seconds


# ------------------------------------------------------------------------------------------------ pipelines
def stage_timeline(config: ModelConfig, rank: int, chunk_plan: Plan | Policy, *, pp: int, microbatches: int,
                   schedule: str = "1f1b", device: str = "cpu", runtime: str = "torch") -> Timeline:
    """The predicted timeline of pipeline stage ``rank`` (one model chunk per stage) running ``chunk_plan`` on its
    own layers, composed by :mod:`remat.parallel` from fake traces of its chunk, exactly as
    :func:`remat.parallel.pipeline_predict.predict_pipeline` composes a uniform policy's stages."""

    schedule = check_schedule(schedule, pp, microbatches, 1, runtime)
    specs = partition(config, pp, 1)
    chunks = rank_chunks(specs, pp, rank)
    actions = schedule_actions(schedule, pp, microbatches, 1, rank, runtime=runtime)
    window = warmup_forwards(schedule, pp, microbatches, 1, rank, "megatron") + 1
    checkpointed = checkpointed_forwards(actions, None, window)
    traces = {(spec.index, True): trace_chunk(config, spec.kind, chunk_plan, device,
                                              batch_in_forward=runtime == "megatron") for spec in chunks}
    stage = StagePlan(config, pp, microbatches, 1, rank, schedule, runtime, chunks, actions, checkpointed, traces,
                          block=CUDA_BLOCK if device == "cuda" else 1)
    return compose_stage(stage, chunk_plan, None)


def check_pipeline_plannable(parallel: ParallelOptions) -> None:
    """Refuse, before any work, a pipeline too long to plan: every stage's plan is checked on its composed stage
    timeline, which :func:`~remat.parallel.pipeline_predict.predict_pipeline` builds for at most
    ``MAX_COMPOSED_MICROBATCHES`` microbatches."""
    m = parallel.num_microbatches if parallel.pp is not None else 0
    if m > MAX_COMPOSED_MICROBATCHES:
        raise PipelineError(f"microbatches={m} (--microbatches): a pipeline plan is checked on each stage's "
                            f"composed timeline, built for at most {MAX_COMPOSED_MICROBATCHES} microbatches; plan "
                            f"with at most {MAX_COMPOSED_MICROBATCHES}")


def plan_pipeline(config: ModelConfig, budget: int | str, parallel: ParallelOptions,
                  options: PlanOptions | None = None) -> dict[str, Any]:
    """Plan each pipeline stage separately and compare with the best uniform (Megatron) setting.

    Stage r of a 1F1B pipeline holds up to ``min(pp - r, m)`` microbatches' saved tensors at once, so stage 0
    needs the most recompute; one policy for every stage (what Megatron's flags give) recomputes as much on the
    last stage as the first one needs. For each stage this searches the extended space with the unit model of
    the stage's layers plus what the other microbatches in flight keep (``(in flight - 1) x`` the plan's stored
    bytes, over a grid of caps on them) plus a per-stage offset calibrated on the no-recompute stage timeline;
    each stage's plan is then checked with :func:`stage_timeline` (the exact composed stage timeline of
    :mod:`remat.parallel`) and re-solved below the excess if it does not fit. A stage never gets a plan costlier
    than the best uniform setting's (that one is kept when cheaper). The uniform candidates are every Megatron
    setting, each predicted with :func:`remat.parallel.pipeline_predict.predict_pipeline`.

    Step time uses the pipeline's critical path: the slowest stage's time per microbatch, forward + backward FLOPs
    at ``options.flops_per_second`` plus the recompute's predicted seconds (:meth:`CostModel.extra_seconds`: its
    FLOPs and rebuilt bytes, or measured times), times ``microbatches + pp - 1``. Only ``vpp=1`` (one model
    chunk per stage) is planned per stage.

    Args:
        config: the whole model (every stage's layers; :func:`remat.parallel.schedule.partition` splits them).
        budget: one GPU's memory: bytes, or text as :func:`~remat.plan.plan` takes.
        parallel: the pipeline (:class:`ParallelOptions` with ``pp``; ``microbatches``, ``schedule``, ``runtime``).
        options: what to search and how to price it (:class:`PlanOptions`; default ``PlanOptions()``).

    Returns:
        The JSON-able report: ``stages`` (per stage: its ``layers``, ``plan`` and ``plan_json`` for its own
        layers numbered from 0, ``peak_bytes``, ``recompute_flops``, ``seconds_per_microbatch``), ``uniform`` (the
        best Megatron setting for every stage, or None), ``critical_path_seconds``, ``step_time_saving_pct``,
        ``summary`` (text) and ``snippet`` (Python applying each stage's plan to its stage module).

    Example::

        >>> from remat.plan import ParallelOptions, plan_pipeline
        >>> report = plan_pipeline(config, "70GiB", ParallelOptions(pp=4, microbatches=8))  # doctest: +SKIP
        >>> [stage["plan"] for stage in report["stages"]]  # doctest: +SKIP
    """
    options = PlanOptions() if options is None else options
    if not isinstance(options, PlanOptions):
        raise PlanError(f"options={options!r}: give a PlanOptions (remat.plan.PlanOptions(...)) or None")
    if not isinstance(parallel, ParallelOptions) or parallel.pp is None:
        raise PlanError(f"parallel={parallel!r}: give ParallelOptions(pp=<stages>, ...) to plan a pipeline")
    if parallel.vpp != 1:
        raise PlanError(f"ParallelOptions.vpp={parallel.vpp}: per-stage plans need one model chunk per stage; "
                        "set vpp=1")
    budget, _ = options.budget(budget)
    pp, microbatches, schedule, runtime = parallel.pp, parallel.num_microbatches, parallel.schedule, parallel.runtime
    device, engine, offload, max_resolves = options.device, options.engine, options.offload, options.max_resolves
    cost = options.cost_model(config)
    start = time.perf_counter()
    specs = partition(config, pp, 1)
    schedule = check_schedule(schedule, pp, microbatches, 1, runtime)
    check_pipeline_plannable(parallel)
    model = unit_model(config, device=device, engine=engine)
    fps = cost.flops_per_second
    baseline = Predicted.of(predict_config(config.replace(num_layers=1), Policy(engine=engine), device=device))
    head_fwd = baseline.flops.get("forward", 0) - model.layer_forward_flops
    head_bwd = baseline.flops.get("backward", 0) - model.layer_backward_flops
    in_flight = [max_in_flight(schedule_actions(schedule, pp, microbatches, 1, r, runtime=runtime))
                 for r in range(pp)]

    def stage_seconds(rank: int, plan: Plan) -> float:  # forward + backward FLOPs at fps, plus the recompute
        spec = specs[rank]
        flops = spec.num_layers * (model.layer_forward_flops + model.layer_backward_flops)
        if spec.is_last:
            flops += head_fwd + head_bwd
        return flops / fps + sum(cost.extra_seconds(model, u) for u in plan.units())

    # the uniform settings: every Megatron policy that fits the smallest chunk, each stage predicted
    smallest = min(s.num_layers for s in specs)
    uniform: list[tuple[Policy, list[int], int]] = []
    for policy in megatron_policies(smallest, engine):
        tls = predict_pipeline(config, policy, pp, microbatches, schedule, runtime=runtime, device=device)
        flops = sum(model.shape(u).recompute_flops for spec in specs
                    for u in Plan.from_policy(policy, spec.num_layers).units() if u.mode != "keep")
        uniform.append((policy, [tl.peak_bytes for tl in tls], flops))
    none_peaks = uniform[0][1]
    fits = [u for u in uniform if max(u[1]) <= budget]

    def rebuilt(p: Plan) -> int:  # ties in FLOPs (norms count none) go to what rebuilds the fewest bytes
        return sum(model.shape(u).recompute_bytes for u in p.units())

    best_uniform = min(fits, key=lambda u: (u[2], sum(rebuilt(Plan.from_policy(u[0], s.num_layers)) for s in specs),
                                            max(u[1]))) if fits else None

    def stored(us: Sequence[Unit]) -> int:
        return sum(model.shape(u).forward.net for u in us)

    stages: list[dict[str, Any]] = []
    for rank, spec in enumerate(specs):
        Lc, n = spec.num_layers, in_flight[rank]
        units = candidate_units(Lc, offload=offload, engine=engine, selective_sets=options.selective_sets,
                                contractions=model.contractions)
        keep_plan = [KEEP] * Lc
        delta = none_peaks[rank] - (model.peak(keep_plan) + (n - 1) * stored(keep_plan))
        chosen = None
        tries = 0
        while tries <= max_resolves:
            sol = solve_stage(model, Lc, budget - delta, n, cost, units, stored(keep_plan))
            if sol is None:
                break
            d = delta

            def estimate(us: list[Unit], n: int = n, d: int = d) -> int:
                return model.peak(us) + (n - 1) * stored(us) + d

            p = Plan.from_units(tidy(model, sol.units, budget, cost, estimate), engine)
            peak = stage_timeline(config, rank, p, pp=pp, microbatches=microbatches, schedule=schedule,
                                  device=device, runtime=runtime).peak_bytes
            if peak <= budget:
                chosen = (p, peak)
                break
            delta += peak - budget
            tries += 1
        entry: dict[str, Any] = {"stage": rank, "layers": [spec.layer_offset, spec.layer_offset + Lc - 1],
                                 "in_flight": n, "resolves": tries}
        candidates = []
        if chosen is not None:
            candidates.append(("extended", chosen[0], chosen[1]))
        if best_uniform is not None:
            candidates.append(("uniform", Plan.from_policy(best_uniform[0], Lc), best_uniform[1][rank]))
        if not candidates:
            entry.update(plan=None, fits=False)
            stages.append(entry)
            continue
        source, p, peak = min(candidates, key=lambda c: (sum(cost.cost(model, u) for u in c[1].units()),
                                                         rebuilt(c[1]), c[2]))
        flops = sum(model.shape(u).recompute_flops for u in p.units() if u.mode != "keep")
        policy, why = p.megatron_policy()
        entry.update(fits=True, source=source, plan=str(p), plan_json=p.to_dict(), peak_bytes=peak,
                     recompute_flops=flops, seconds_per_microbatch=stage_seconds(rank, p),
                     megatron_policy=None if policy is None else str(policy), why_not_megatron=why)
        stages.append(entry)

    report: dict[str, Any] = {"pp": pp, "microbatches": microbatches, "schedule": schedule, "runtime": runtime,
                              "budget_bytes": budget, "stages": stages}
    if best_uniform is not None:
        per = [stage_seconds(r, Plan.from_policy(best_uniform[0], specs[r].num_layers)) for r in range(pp)]
        report["uniform"] = {"policy": str(best_uniform[0]), "stage_peaks": best_uniform[1],
                             "recompute_flops": best_uniform[2], "seconds_per_microbatch": per,
                             "critical_path_seconds": max(per) * (microbatches + pp - 1),
                             "megatron_args": best_uniform[0].to_megatron_args()}
    else:
        lowest = min(uniform, key=lambda u: max(u[1]))
        report["uniform"] = None
        report["uniform_note"] = f"no uniform setting fits: the lowest is {lowest[0]} at {format_bytes(max(lowest[1]))}"
    if all(st.get("fits") for st in stages):
        per = [st["seconds_per_microbatch"] for st in stages]
        report["critical_path_seconds"] = max(per) * (microbatches + pp - 1)
        if report["uniform"] is not None:
            u = report["uniform"]["critical_path_seconds"]
            report["step_time_saving_pct"] = 100 * (1 - report["critical_path_seconds"] / u) if u else 0.0
    report["seconds"] = time.perf_counter() - start
    report["summary"] = pipeline_summary(report)
    report["snippet"] = stage_snippet(stages)
    return report


def solve_stage(model: UnitModel, num_layers: int, budget: int, in_flight: int, cost: CostModel,
                units: list[Unit], max_stored: int) -> Solution | None:
    """:func:`search_stage`, its answer kept on disk (:mod:`remat.memory.disk_cache`, keyed by everything the
    search reads: the unit model's numbers and the candidates' shapes and prices, the depth, budget, microbatches
    in flight and cap), so a later run with the same inputs reads it back instead of solving again."""
    prices = [cost.cost(model, u) for u in units]
    data = model_to_dict(model)
    data.pop("build_seconds", None)
    data["shapes"] = [[*_unit_json(u), *_shape_json(model.shape(u))] for u in units]  # just what is searched
    digest = hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()
    key = {"model": digest, "num_layers": num_layers, "budget": budget, "in_flight": in_flight,
           "units": [_unit_json(u) for u in units], "prices": prices, "max_stored": max_stored}
    stored = disk_cache.load("stage_solution", key)
    if isinstance(stored, dict):
        if stored.get("none"):
            return None
        try:
            return Solution([Unit(str(m), int(k), tuple(str(x) for x in mods)) for m, k, mods in stored["units"]],
                            int(stored["cost"]), int(stored["model_peak"]), int(stored["entries"]),
                            float(stored["seconds"]))
        except (KeyError, TypeError, ValueError):
            pass  # malformed: solved again and overwritten
    sol = search_stage(model, num_layers, budget, in_flight, cost, units, max_stored)
    disk_cache.store("stage_solution", key, {"none": True} if sol is None else {
        "units": [_unit_json(u) for u in sol.units], "cost": int(sol.cost), "model_peak": int(sol.model_peak),
        "entries": int(sol.entries), "seconds": sol.seconds})
    return sol


def _unit_json(unit: Unit) -> list[Any]:
    return [unit.mode, unit.size, list(unit.modules)]


def _shape_json(shape: Any) -> list[Any]:
    return [shape.forward.net, shape.forward.high, shape.backward.net, shape.backward.high, shape.recompute_flops,
            shape.recompute_bytes]


def search_stage(model: UnitModel, num_layers: int, budget: int, in_flight: int, cost: CostModel,
                 units: list[Unit], max_stored: int) -> Solution | None:
    """The cheapest plan of a stage's layers when ``in_flight - 1`` other microbatches keep the plan's stored bytes
    each: the least cost over a grid of caps T on the stored bytes of ``solve(budget - (in_flight - 1) T,
    stored_cap=T)``, refined around the best cap (of equal costs, the first cap's plan).

    Caps are solved from the highest down; a cap that cannot give a plan replacing the best so far is not solved
    (a lower bound on the cost at the cap, :func:`~remat.plan.solver.cost_lower_bound`, over the best's cost, or
    equal to it at a cap the tie would not go to), nor is the refinement once a plan costs nothing; when keeping every
    layer fits and every other unit costs something, keeping every layer is the answer (no other plan costs 0)."""
    with reuse_tables():  # the solves below share the tables of (model, depth, units, prices)
        return _search(model, num_layers, budget, in_flight, cost, units, max_stored)


def _search(model: UnitModel, num_layers: int, budget: int, in_flight: int, cost: CostModel, units: list[Unit],
            max_stored: int) -> Solution | None:
    prices = {u: cost.cost(model, u) for u in units}  # priced once for the many solves below
    price = prices.__getitem__
    if in_flight <= 1:
        return solve(model, num_layers, budget, price, units=units)
    if prices.get(KEEP) == 0 and all(p > 0 for u, p in prices.items() if u != KEEP):
        # the grid's last cap is max_stored, the only one that admits keeping every layer (0 cost, no other plan
        # costs 0): the search below would find exactly this solve's plan there and nothing cheaper after it
        sol = solve(model, num_layers, budget - (in_flight - 1) * max_stored, price, units=units,
                    stored_cap=max_stored)
        if sol is not None and sol.cost == 0:
            return sol
    free = min(prices.values(), default=0) >= 0  # no plan costs less than 0
    best: Solution | None = None
    best_at = (0, 0)  # (pass, index in its grid) of the best
    grid = sorted({int(max_stored * k / 32) for k in range(33)})
    for sweep in range(2):
        # the answer is the cheapest plan, of equal costs the first pass's and then the lowest cap's; the caps are
        # solved from the highest down, where the cheap plans usually are, so the lower bound skips most of the rest
        for at in reversed(range(len(grid))):
            cap = grid[at]
            if best is not None:
                bound = cost_lower_bound(model, num_layers, budget - (in_flight - 1) * cap, price, units=units,
                                         stored_cap=cap)
                if bound > best.cost or (bound >= best.cost and (sweep, at) > best_at):
                    continue  # it cannot give a plan that replaces the best
            sol = solve(model, num_layers, budget - (in_flight - 1) * cap, price, units=units, stored_cap=cap)
            if sol is not None and (best is None or (sol.cost, sweep, at) < (best.cost, *best_at)):
                best, best_at = sol, (sweep, at)
        if best is None:
            return None
        if free and best.cost <= 0:
            return best
        used = sum(model.shape(u).forward.net for u in best.units)
        step = max(1, (grid[1] - grid[0]) if len(grid) > 1 else 1)
        grid = sorted({max(0, used + int(step * k / 16)) for k in range(-16, 17)})
    return best


def pipeline_summary(report: dict[str, Any]) -> str:
    """The text of a :func:`plan_pipeline` report: each stage's plan, the best uniform setting, the critical path."""
    lines = [f"Pipeline ({report['pp']} stages, {report['microbatches']} microbatches, {report['schedule']}): "
             "one plan per stage"]
    for st in report["stages"]:
        if not st.get("fits"):
            lines.append(f"  stage {st['stage']}: nothing fits")
            continue
        lines.append(f"  stage {st['stage']} (layers {st['layers'][0]}-{st['layers'][1]}, {st['in_flight']} in "
                     f"flight): {st['plan']} [{st['source']}], peak {format_bytes(st['peak_bytes'])}, "
                     f"{st['recompute_flops']:,} recomputed FLOPs per microbatch")
    u = report.get("uniform")
    if u is not None:
        lines.append(f"  best uniform setting: {u['policy']} (stage peaks "
                     f"{', '.join(format_bytes(p) for p in u['stage_peaks'])})")
    else:
        lines.append(f"  {report.get('uniform_note', '')}")
    if "critical_path_seconds" in report:
        text = f"  critical path {format_seconds(report['critical_path_seconds'])} per step"
        if "step_time_saving_pct" in report:
            uniform = report["uniform"]
            how = compared(report["critical_path_seconds"], uniform["critical_path_seconds"], "shorter", "longer")
            text += f" vs {format_seconds(uniform['critical_path_seconds'])} with the uniform setting: {how}"
            ours, theirs = sum(st["recompute_flops"] for st in report["stages"]), uniform["recompute_flops"]
            fewer = compared(ours, theirs, "fewer", "more")
            text += f"; recomputed FLOPs per microbatch over all stages: {fewer} ({ours:,} vs {theirs:,})"
        lines.append(text)
    return "\n".join(lines)


def stage_snippet(stages: Sequence[dict[str, Any]]) -> str | None:
    """Python that applies each stage's plan to that stage's module (a model chunk holding only the stage's layers,
    as :func:`remat.parallel.stages.build_stage_module` builds one), or None when a stage has no plan."""
    if not stages or not all(st.get("fits") for st in stages):
        return None
    rows = [f"    Plan.from_dict({json.dumps(st['plan_json'], separators=(',', ':'))}),  # stage {st['stage']}: "
            f"layers {st['layers'][0]}-{st['layers'][1]}" for st in stages]
    return ("import remat\nfrom remat.plan import Plan\n\n"
            "stage_plans = [  # one per pipeline stage; each numbers its stage's own layers from 0\n"
            + "\n".join(rows) + "\n]\n"
            "remat.apply(stage_module, stage_plans[stage])  # stage_module: this rank's pipeline stage (its layers "
            "only); stage: its index\n")
