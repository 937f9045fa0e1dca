#!/usr/bin/env python
"""``remat plan`` against its peers: measured peak, extra step time and solve time at budgets from the smallest
reachable peak to the no-recompute peak, on one model, on this machine, in one run.

Methods, at each budget:

* **remat Megatron**: the best Megatron-LM setting (:func:`remat.plan.plan`, ``.megatron``), priced as below;
* **remat (time)**: the best extended plan (``.extended``: per-layer keep / selective modules / kept operators
  (``keep_ops``) / free checkpoint groups / offloaded groups) under ``plan()``'s default objective, the least
  predicted step time, priced by operator times measured on this machine (:func:`remat.plan.measure_layer_times`,
  once): what a CPU user gets. Found by the exact dynamic program and validated by the trace;
* **torch.compile**: ``torch._functorch.config.activation_memory_budget`` with ``backend='aot_eager'`` (the
  min-cut partitioner honours the budget; nothing is code-generated on CPU). The ratio is a fraction of saved
  activation memory, not a peak limit, so it is chosen per budget: probes (0.5, 0.25, 0.75, ...) until one
  fits, then bisection towards 1 (less recompute) between the best fitting ratio and the next one that does
  not. Every distinct ratio is one compile (cached across budgets); both counts are reported. Its recomputed
  FLOPs are counted on the compiled forward and backward graphs (``torch.utils.flop_counter`` formulas on each
  node's fake value) against ratio 1.0;
* **remat plan + torch.compile** (benchmarks/compile_peers.py): ``remat.apply(model, plan)`` then
  ``torch.compile(model)``, the same backend, ratio 1.0 (NOTE [regions under torch.compile] in
  ``remat.recompute.region``: groups, selective modules and non_matmul layers become torch's checkpoint in the graph),
  two ways to choose the plan:
  - **compiled planning** (``remat.plan.compiled.plan_compiled``, NOTE [compiled planning]): each per-layer choice
    (keep, a checkpointed layer, each compilable selective set) priced in bytes by what its compiled forward graphs
    save for backward, priced in time like remat (time), the cheapest set of choices whose predicted compiled peak
    fits found by a knapsack, then measured (profiler) and re-solved while over the budget;
  - **eager plans compiled** (the target search): ``plan()`` priced as remat (time), without offload and keep_ops
    kinds (they would run eagerly under compile), asked for targets between the budget and the eager
    no-recompute peak, keeping the largest target whose compiled step's profiler peak fits (first guess: the budget
    plus what compiling saves on the plain model, then 3 bisection steps). It misses the cheapest compiled choices:
    ``selective/act`` frees nothing eagerly (fc2 saves the GELU's output) but compiled frees the GELU's output.
  Compared like for like with torch.compile: extra times over the same compiled 1.0 step of the same rounds, and
  the paired per-round ratio of the step times (``recheck_compiled.py`` re-times the pairs with more rounds);
* **torch sac_milp** (benchmarks/torch_sac.py): torch's own SAC planner (torch.distributed._tools: MemTracker,
  SACEstimator, sac_milp with PuLP/CBC, then each layer's operator knapsack applied with torch's selective
  checkpoint), its operators priced by the roofline max(FLOPs / 400 TFLOP/s, bytes / 3 TB/s); beside it **remat
  (roofline)**: ``plan()`` with its default options, the time objective priced by the 400 TFLOP/s, 3 TB/s
  roofline (the same price). Needs ``pulp`` and ``pwlf`` (``.venv/bin/pip install pulp pwlf``); without them the
  column is skipped with that reason;
* **rockmate** (PyPI ``rockmate==2.0.0``): imported in-process, or in the interpreter of ``--rockmate-python``
  (a throwaway venv); if it cannot be imported the exact error is reported.

Measurements: remat's plans are measured with :func:`remat.measure` on real CPU tensors (device bytes: an
offloaded input leaves the count, see ``remat.recompute.offload.offload_to_host``). A compiled model cannot be
measured that
way (a TorchDispatchMode makes dynamo run the eager code), so every method is also measured with the profiler's
memory timeline (``torch.profiler`` ``profile_memory=True``, ``_memory_profile()``: every CPU storage created
and destroyed); that instrument is checked against remat.measure on the eager no-recompute step. It counts
what remat.measure does not see: the CPU RNG state each checkpoint keeps (a few KiB, host memory on a GPU) and,
on CPU, the host copies of offloaded inputs (host == device here). torch.compile's fit is judged on that
instrument, remat's on remat.measure (the guarantee's), with the profiler figure shown beside it.

Step time: forward + backward, no optimizer, one thread (``--threads``), all variants of a budget interleaved
in random order over ``--rounds`` rounds with the same dropout seed; a ratio is the median over rounds of the
per-round ratio to the no-recompute step of the same round (eager for remat, compiled at ratio 1.0 for
torch.compile; compiled at 1.0 against eager is shown too, since the partitioner already recomputes there).
Solve time: remat's dynamic program (and its whole ``plan()`` call: unit model, Megatron sweep and validation
trace the first time, cached afterwards), torch.compile's compiles. The dynamic program alone is
also timed on a ``--dp-layers`` (128) deep version of the model.

Usage: ``python benchmarks/bench_plan.py`` (~30-40 min on a shared 2-core machine; ``--quick``: a smoke run;
``--rockmate-python ~/rockmate_venv/bin/python --json out.json``; ``--budget-mib 141.20 --compiled-only``: one
budget of the full run, torch.compile and remat + torch.compile only, a few minutes).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spin-waiting OpenMP threads collapse on a shared machine

import argparse
import gc
import json
import platform
import statistics
import sys
import time
import warnings
from typing import Any

import numpy as np
import torch

import remat
from remat import ModelConfig, build_model, measure, sample_batch
from remat.plan.api import BudgetError, PlanOptions, plan
from remat.plan.costs import CostModel, candidate_units, measure_layer_times
from remat.plan.megatron import megatron_policies
from remat.plan.operator_space import layer_operators, operator_kinds
from remat.plan.solver import min_peak, solve
from remat.plan.unit_model import add_traced_units, unit_model
from remat.recompute.plan_format import Plan

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_sac  # noqa: E402  (benchmarks/torch_sac.py: torch's SAC ILP as a peer)
from compile_peers import (  # noqa: E402  (benchmarks/compile_peers.py: torch.compile and remat + torch.compile)
    COMPILABLE_SETS,
    CompileSearch,
    RematCompiledPlanner,
    RematCompileSearch,
    profiler_peak,
    step,
    time_steps,
)

MIB = 1 << 20
warnings.filterwarnings("ignore", message=".*global hooks on modules.*")


# ------------------------------------------------------------------------------------------------ main
def ratio_text(timing: dict[str, dict], name: str) -> str:
    r = timing.get(name, {}).get("ratio")
    return "-" if r is None else f"{r:.3f}"


def fmt_mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MIB:8.2f}"


def step_flops(model: torch.nn.Module, batch: Any) -> int:
    """FLOPs of one forward + backward step (torch.utils.flop_counter), recomputation included."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        step(model, batch)
    return counter.get_total_flops()


def measured(config: ModelConfig, p: Plan, batch: Any) -> tuple[int, int]:
    model = build_model(config, seed=0)
    remat.apply(model, p)
    return measure(model, batch).peak_bytes, profiler_peak(model, batch)


def eager_methods(cfg: ModelConfig, batch: Any, budget: int, result: Any, peer: Any, base_flops: int,
                  row: dict[str, Any], variants: dict[str, Any], baselines: dict[str, str], start: float) -> None:
    """The eager methods of one budget (remat Megatron, remat (time), remat (roofline), torch sac_milp): their
    plans measured into ``row``, their models added to ``variants`` for timing."""
    row["remat_plan_seconds"] = time.perf_counter() - start
    row["remat_dp_seconds"] = result.stats["dp_seconds"]
    row["remat_megatron_sweep_seconds"] = result.stats["megatron_seconds"]
    row["remat_validate_seconds"] = result.stats["validate_seconds"]
    row["remat_model_seconds"] = result.stats["model_seconds"]
    roofline = plan(cfg, budget)  # the default options: torch SAC's price, the same roofline
    if peer is not None:
        start = time.perf_counter()
        decisions, _, estimate = peer.plan(budget)
        solve_seconds = time.perf_counter() - start
        m = build_model(cfg, seed=0)
        peer.apply(m, decisions)
        peak = measure(m, batch).peak_bytes if decisions or estimate >= 0 else None
        row["torch_sac"] = {"plan": decisions, "estimate": estimate, "measured_peak": peak,
                            "fits": peak is not None and peak <= budget, "solve_seconds": solve_seconds,
                            "recompute_flops": step_flops(m, batch) - base_flops if peak else None}
        if peak is not None:
            row["torch_sac"]["extra_compute_pct"] = 100 * row["torch_sac"]["recompute_flops"] / base_flops
            variants["torch sac"], baselines["torch sac"] = m, "eager none"
    for key, choice in (("megatron", result.megatron), ("extended_time", result.extended),
                        ("extended_roofline", roofline.extended)):
        if choice is None:
            row[key] = None
            continue
        peak, prof = measured(cfg, choice.plan, batch)
        m = build_model(cfg, seed=0)
        remat.apply(m, choice.plan)
        variants[f"remat {key}"] = m
        baselines[f"remat {key}"] = "eager none"
        row[key] = {"plan": str(choice.plan), "predicted_peak": choice.peak_bytes, "measured_peak": peak,
                    "profiler_peak": prof, "fits": peak <= budget, "recompute_flops": choice.recompute_flops,
                    "extra_compute_pct": choice.extra_compute_pct, "step_time_ratio": choice.step_time_ratio,
                    "megatron_args": choice.megatron_args}


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    torch._dynamo.config.cache_size_limit = 512
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = 512
    cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                      seq_length=args.seq, micro_batch_size=args.batch, vocab_size=args.vocab)
    batch = sample_batch(cfg)
    report: dict[str, Any] = {"config": cfg.to_dict(), "machine": {
        "platform": platform.platform(), "torch": torch.__version__, "threads": args.threads,
        "cpus": os.cpu_count(), "load_average": os.getloadavg()}}

    # the range: remat's smallest reachable peak .. the no-recompute peak, both measured
    eager = build_model(cfg, seed=0)
    none_peak = measure(eager, batch).peak_bytes
    none_prof = profiler_peak(eager, batch)
    model = unit_model(cfg)
    lowest = min_peak(model, cfg.num_layers, candidate_units(cfg.num_layers))
    budgets = sorted({int(b) for b in np.linspace(lowest, none_peak, args.budgets)})
    if args.budget_mib:  # the same budgets as a full run when given as its printed MiB (2 decimals)
        budgets = sorted({min((b for b in budgets if abs(b / MIB - x) < 0.005), default=int(x * MIB))
                          for x in args.budget_mib})
    report["compiled_only"] = args.compiled_only
    report["no_recompute"] = {"measure_peak": none_peak, "profiler_peak": none_prof,
                              "instrument_difference": none_prof - none_peak}
    print(f"model: {cfg.num_layers} layers, h={cfg.hidden_size}, s={cfg.seq_length}, b={cfg.micro_batch_size}, "
          f"vocab={cfg.vocab_size}; no-recompute peak {none_peak / MIB:.2f} MiB (profiler {none_prof / MIB:.2f} "
          f"MiB); smallest reachable (remat) {lowest / MIB:.2f} MiB", flush=True)

    layer_times = measure_layer_times(cfg)
    report["layer_times"] = layer_times
    search = CompileSearch(cfg, batch)
    base_compiled = search.get(1.0)
    compiled_options = PlanOptions(measured_times=layer_times, offload=False, operator_sets=0,
                                   selective_sets=COMPILABLE_SETS)
    remat_compiled_eager = RematCompileSearch(cfg, batch, compiled_options, none_peak, base_compiled)
    remat_compiled = RematCompiledPlanner(cfg, batch, compiled_options.cost_model(cfg), base_compiled)
    sac_reason = torch_sac.missing() if not (args.no_sac or args.compiled_only) else "--no-sac"
    peer = None
    if sac_reason is None:
        start = time.perf_counter()
        peer = torch_sac.TorchSAC(lambda: build_model(cfg, seed=0), batch)
        report["torch_sac_stats_seconds"] = time.perf_counter() - start
    report["torch_sac_skipped"] = sac_reason
    base_flops = step_flops(build_model(cfg, seed=0), batch)
    rows = []
    for budget in budgets:
        row: dict[str, Any] = {"budget": budget}
        start = time.perf_counter()
        try:  # the default objective (time), priced by this machine's measured operator times
            result = None if args.compiled_only else plan(cfg, budget, PlanOptions(measured_times=layer_times))
        except BudgetError as err:
            row["remat_error"] = str(err)
            rows.append(row)
            continue
        variants: dict[str, Any] = {"eager none": build_model(cfg, seed=0)}
        baselines = {}
        if result is not None:
            eager_methods(cfg, batch, budget, result, peer, base_flops, row, variants, baselines, start)
        start = time.perf_counter()
        found, evaluated, fresh = search.fit(budget)
        row["compile"] = {"ratios_evaluated": evaluated, "fresh_compiles": fresh,
                          "search_seconds": time.perf_counter() - start}
        if found is not None:
            variants["compile ratio"] = found.module
            variants["compile 1.0"] = base_compiled.module
            baselines["compile ratio"] = "compile 1.0"
            baselines["compile 1.0"] = "eager none"
            flops = (found.fw_flops + found.bw_flops) - (base_compiled.fw_flops + base_compiled.bw_flops)
            row["compile"].update(ratio=found.ratio, profiler_peak=found.peak, fits=found.peak <= budget,
                                  recompute_flops=flops,
                                  extra_compute_pct=100 * flops / (base_compiled.fw_flops + base_compiled.bw_flops),
                                  compile_seconds=found.compile_seconds)
        start = time.perf_counter()
        mine, info = remat_compiled.fit(budget)  # compiled planning (NOTE [compiled planning])
        row["remat_compiled"] = info
        eager_mine, evaluated, fresh = remat_compiled_eager.fit(budget)  # eager plans, compiled: the target search
        row["remat_compiled_eager"] = {"targets_evaluated": evaluated, "fresh_compiles": fresh,
                                       "search_seconds": time.perf_counter() - start - info["plan_seconds"]}
        base_total = base_compiled.fw_flops + base_compiled.bw_flops
        for key, name, got in (("remat_compiled", "remat compiled", mine),
                               ("remat_compiled_eager", "remat compiled eager", eager_mine)):
            if got is None:
                continue
            variants[name], baselines[name] = got.module, "compile 1.0"
            variants["compile 1.0"], baselines["compile 1.0"] = base_compiled.module, "eager none"
            flops = got.fw_flops + got.bw_flops - base_total
            row[key].update(plan=got.plan, target=got.target, profiler_peak=got.peak, fits=got.peak <= budget,
                            recompute_flops=flops, extra_compute_pct=100 * flops / base_total,
                            compile_seconds=got.compile_seconds)
        timing = time_steps(variants, batch, args.rounds, baselines)
        row["timing"] = timing
        rows.append(row)
        if not args.compiled_only:
            meg, comp = row.get("megatron"), row["compile"]
            ext_t = row.get("extended_time")
            print(f"budget {budget / MIB:8.2f} MiB | megatron {fmt_mib(meg and meg['measured_peak'])} "
                  f"x{ratio_text(timing, 'remat megatron')} | remat (time) "
                  f"{fmt_mib(ext_t and ext_t['measured_peak'])} x{ratio_text(timing, 'remat extended_time')} "
                  f"({ext_t and ext_t['plan']}) | compile r={comp.get('ratio', '-')} "
                  f"{fmt_mib(comp.get('profiler_peak'))} x{ratio_text(timing, 'compile ratio')} "
                  f"({comp['ratios_evaluated']} evals, {comp['fresh_compiles']} new compiles)", flush=True)
            sac, ext_r = row.get("torch_sac"), row.get("extended_roofline")
            print(f"    same roofline price: remat {fmt_mib(ext_r and ext_r['measured_peak'])} "
                  f"x{ratio_text(timing, 'remat extended_roofline')} ({ext_r and ext_r['plan']}) | torch sac_milp "
                  f"{fmt_mib(sac and sac['measured_peak'])} x{ratio_text(timing, 'torch sac')} "
                  f"({sac and sac['plan']})", flush=True)
        rc, rce = row["remat_compiled"], row["remat_compiled_eager"]
        print(f"    compiled (vs compile 1.0): remat compiled plan {fmt_mib(rc.get('profiler_peak'))} "
              f"x{ratio_text(timing, 'remat compiled')} ({rc.get('plan')}, predicted "
              f"{fmt_mib(rc.get('predicted_peak'))} MiB, {rc.get('resolves', '-')} re-solves, "
              f"{rc['fresh_compiles']} new compiles) | eager plan {fmt_mib(rce.get('profiler_peak'))} "
              f"x{ratio_text(timing, 'remat compiled eager')} ({rce.get('plan')}, "
              f"target {fmt_mib(rce.get('target'))} MiB, {rce['targets_evaluated']} targets) | torch.compile "
              f"x{ratio_text(timing, 'compile ratio')}", flush=True)
        del variants
        gc.collect()
    report["rows"] = rows
    report["compile_cache"] = {str(r): {"profiler_peak": c.peak, "compile_seconds": c.compile_seconds,
                                        "fw_flops": c.fw_flops, "bw_flops": c.bw_flops}
                               for r, c in sorted(search.cache.items())}
    report["remat_compiled_cache"] = {k: {"profiler_peak": c.peak, "compile_seconds": c.compile_seconds}
                                      for k, c in remat_compiled.cache.items()}
    report["remat_compiled_eager_cache"] = {k: {"target": c.target, "profiler_peak": c.peak, "compile_seconds":
                                                c.compile_seconds} for k, c in remat_compiled_eager.cache.items()}
    if args.compiled_only:
        return report

    # the dynamic program alone, on a deep version of the model
    deep = cfg.replace(num_layers=args.dp_layers)
    dmodel = unit_model(deep)
    cost = CostModel()  # the default objective: time, by the roofline
    kinds = operator_kinds(layer_operators(cfg), cost.operator_price(), most=PlanOptions().operator_sets)
    units = candidate_units(args.dp_layers, contractions=dmodel.contractions) + add_traced_units(
        dmodel, [remat.plan.Unit("selective", 1, k) for k in kinds])
    dlo, dhi = min_peak(dmodel, args.dp_layers, units), dmodel.peak([remat.plan.KEEP] * args.dp_layers)
    meg_units = [Plan.from_policy(p, args.dp_layers).units() for p in megatron_policies(args.dp_layers)]
    meg_costs = [(dmodel.peak(u), sum(cost.cost(dmodel, x) for x in u)) for u in meg_units]
    dp = []
    for b in np.linspace(dlo, dhi, 8):
        b = int(b)
        inc = min((c for pk, c in meg_costs if pk <= b), default=None)
        start, cpu = time.perf_counter(), time.process_time()
        sol = solve(dmodel, args.dp_layers, b, cost, units=units, incumbent=inc)
        with_inc, with_inc_cpu = time.perf_counter() - start, time.process_time() - cpu
        start = time.perf_counter()
        sol2 = solve(dmodel, args.dp_layers, b, cost, units=units)
        without = time.perf_counter() - start
        assert sol is not None and sol2 is not None and sol.cost == sol2.cost
        dp.append({"budget": b, "seconds": with_inc, "cpu_seconds": with_inc_cpu,
                   "seconds_without_incumbent": without, "entries": sol.entries})
    report["dp_deep"] = {"layers": args.dp_layers, "runs": dp, "unit_kinds": len(units)}
    report["rockmate"] = torch_sac.probe_rockmate(args.rockmate_python)
    return report


def peer_table(report: dict[str, Any]) -> list[str]:
    """The side-by-side table: per budget, each method's measured peak (* over budget), extra step time over
    its own no-recompute step (median ratio - 1; torch.compile's over compiled 1.0) and recomputed FLOPs (% of the
    plain step)."""
    rows = [r for r in report["rows"] if "remat_error" not in r]
    cols = [("remat (time)", "extended_time", "remat extended_time"),
            ("remat (roofline)", "extended_roofline", "remat extended_roofline"),
            ("torch sac_milp (roofline)", "torch_sac", "torch sac"), ("torch.compile", "compile", "compile ratio"),
            ("remat plan + torch.compile", "remat_compiled", "remat compiled"),
            ("remat Megatron", "megatron", "remat megatron")]
    head = "budget MiB | " + " | ".join(f"{name:^27}" for name, _, _ in cols)
    lines = ["", "measured peak MiB (* over budget) / extra step time % / recomputed FLOPs % (eager methods: over "
             "eager no recompute, remat.measure; torch.compile and remat plan + torch.compile: over compiled 1.0, "
             "profiler)", head, "-" * len(head)]
    wins = {"time": 0, "peak": 0, "n": 0, "torch_fits": 0}
    for r in rows:
        cells = []
        for _, key, timing_key in cols:
            c = r.get(key) or {}
            peak = c.get("measured_peak", c.get("profiler_peak"))
            ratio = r["timing"].get(timing_key, {}).get("ratio")
            if peak is None or ratio is None:
                cells.append(f"{'-':^27}")
                continue
            over = "*" if peak > r["budget"] else " "
            cells.append(f"{peak / MIB:8.2f}{over} {100 * (ratio - 1):+6.1f}% {c.get('extra_compute_pct', 0):6.2f}%  ")
        lines.append(f"{r['budget'] / MIB:10.2f} | " + " | ".join(cells))
        mine, sac = r.get("extended_roofline"), r.get("torch_sac")
        if mine and sac and sac.get("measured_peak") is not None:
            a = r["timing"].get("remat extended_roofline", {}).get("ratio")
            b = r["timing"].get("torch sac", {}).get("ratio")
            wins["n"] += 1
            wins["time"] += a is not None and b is not None and a <= b + 0.02
            wins["peak"] += mine["measured_peak"] <= r["budget"]
            wins["torch_fits"] += bool(sac.get("fits"))
    if report.get("torch_sac_skipped"):
        lines.append(f"torch sac_milp skipped: {report['torch_sac_skipped']}")
    else:
        lines.append(f"remat (roofline) vs torch sac_milp at the same roofline price: extra step time <= torch's (+2% "
                     f"noise allowance) at {wins['time']}/{wins['n']} budgets where torch's ILP has a plan; remat "
                     f"within budget at {wins['peak']}/{wins['n']}, torch at {wins['torch_fits']}/{wins['n']}; "
                     f"torch's ILP has no plan at {len(rows) - wins['n']}/{len(rows)}")
    return lines


def compiled_comparison(rows: list[dict[str, Any]]) -> list[str]:
    """remat's plans + torch.compile against torch.compile's activation_memory_budget, like for like: all compiled
    with the same backend, peaks on the profiler, extra times over the same compiled 1.0 step of the same rounds;
    and each round's remat / torch.compile step time, paired. Two remat columns: compiled planning (NOTE [compiled
    planning] in remat.plan.compiled) and eager plans compiled (the target search of RematCompileSearch)."""
    lines = ["", "remat + torch.compile vs torch.compile (activation_memory_budget), all aot_eager, extra over the "
             "same compiled 1.0 step; paired = median over rounds of remat / torch.compile step time",
             "budget MiB | remat compiled planning: peak, extra, FLOP%, plan (predicted MiB) | paired | eager plan "
             "compiled: peak, extra, FLOP%, plan (target MiB) | paired | torch.compile ratio, peak, extra, FLOP%"]
    tally = {k: [0, 0, 0] for k in ("remat compiled", "remat compiled eager")}  # both fit, remat faster, same

    def cell(r: dict[str, Any], key: str, name: str, hint: str) -> tuple[str, str]:
        rc, comp, tm = r.get(key) or {}, r["compile"], r["timing"]
        a, b = tm.get(name, {}).get("ratio"), tm.get("compile ratio", {}).get("ratio")
        if a is None:
            return "no plan fits", "-"
        text = (f"{rc['profiler_peak'] / MIB:7.2f}{'*' if not rc['fits'] else ' '} {100 * (a - 1):+6.1f}% "
                f"{rc['extra_compute_pct']:5.1f}% {rc['plan']} ({rc[hint] / MIB:.2f})")
        if b is None or not (rc["fits"] and comp["fits"]):
            return text, "-"
        t = tally[name]
        t[0] += 1
        if rc["plan"] == "keep all" and comp["ratio"] == 1.0:
            t[2] += 1
            return text, "same model"
        p = statistics.median([x / y for x, y in zip(tm[name]["times"], tm["compile ratio"]["times"])])
        t[1] += p < 1.0
        return text, f"{p:.3f}"

    for r in rows:
        comp, tm = r["compile"], r["timing"]
        b = tm.get("compile ratio", {}).get("ratio")
        right = (f"r={comp['ratio']:.4f} {comp['profiler_peak'] / MIB:7.2f} {100 * (b - 1):+6.1f}% "
                 f"{comp['extra_compute_pct']:5.1f}%" if b is not None else "no ratio fits")
        mine, p1 = cell(r, "remat_compiled", "remat compiled", "predicted_peak")
        eager, p2 = cell(r, "remat_compiled_eager", "remat compiled eager", "target")
        lines.append(f"{r['budget'] / MIB:9.2f} | {mine} | {p1} | {eager} | {p2} | {right}")
    for name, (both, wins, same) in tally.items():
        label = "compiled planning" if name == "remat compiled" else "eager plans compiled (target search)"
        lines.append(f"remat {label}: faster than torch.compile (paired median) at {wins}/{both} budgets where both "
                     f"fit, the same model (neither recomputes) at {same}/{both}, torch.compile faster at "
                     f"{both - wins - same}/{both}")
    lines.append("(recheck_compiled.py re-times each pair with more rounds and a 95% bootstrap interval)")
    return lines


def summary(report: dict[str, Any]) -> str:
    rows = [r for r in report["rows"] if "remat_error" not in r]
    if report.get("compiled_only"):
        return "\n".join([*compiled_comparison(rows), f"load average during the run: "
                          f"{report['machine']['load_average']} (at the end: {os.getloadavg()})"])
    lines = [*peer_table(report), "", "=" * 150,
             "budget MiB | remat Megatron: measured MiB, step x, FLOP% | remat (time): measured MiB (profiler), "
             "predicted step x, step x, FLOP% | remat (roofline): MiB, step x, FLOP% | torch.compile: ratio, peak "
             "MiB, step x vs compiled 1.0 (1.0 vs eager), FLOP%, compiles",
             "-" * 150]
    for r in rows:
        tm = r["timing"]
        meg, ext, ext_r, comp = r.get("megatron"), r.get("extended_time"), r.get("extended_roofline"), r["compile"]

        def x(name: str, tm: dict = tm) -> str:
            return f"{ratio_text(tm, name):>6}"

        meg_txt = (f"{meg['measured_peak'] / MIB:7.2f} {x('remat megatron')} {meg['extra_compute_pct']:5.1f}%"
                   if meg else "   none fits          ")
        ext_txt = (f"{ext['measured_peak'] / MIB:7.2f} ({ext['profiler_peak'] / MIB:7.2f}) "
                   f"{ext['step_time_ratio']:6.3f} {x('remat extended_time')} {ext['extra_compute_pct']:5.1f}%")
        ext_r_txt = (f"{ext_r['measured_peak'] / MIB:7.2f} {x('remat extended_roofline')} "
                     f"{ext_r['extra_compute_pct']:5.1f}%" if ext_r else "-")
        if "ratio" in comp:
            comp_txt = (f"r={comp['ratio']:.4f} {comp['profiler_peak'] / MIB:7.2f} {x('compile ratio')} "
                        f"({ratio_text(tm, 'compile 1.0')}) {comp['extra_compute_pct']:5.1f}% "
                        f"{comp['ratios_evaluated']:2d}/{comp['fresh_compiles']:2d}")
        else:
            comp_txt = f"no ratio fits ({comp['ratios_evaluated']} evaluated, {comp['fresh_compiles']} compiled)"
        lines.append(f"{r['budget'] / MIB:9.2f} | {meg_txt} | {ext_txt} | {ext_r_txt} | {comp_txt}")
    for r in rows:
        plans = [f"{k}: {r[k]['plan']}" for k in ("megatron", "extended_time", "extended_roofline") if r.get(k)]
        sac = (r.get("torch_sac") or {}).get("plan")
        lines.append(f"{r['budget'] / MIB:9.2f} | " + " | ".join(plans) + (f" | torch sac: {sac}" if sac else ""))
    lines.append("-" * 118)
    lines.append("solve seconds | remat Megatron: predict_many sweep (cached after the first budget) | remat "
                 "(time): unit model, DP, validation trace | torch.compile: ratio search incl. compiles")
    for r in rows:
        megatron_plan = (r.get("megatron") or {}).get("plan")
        lines.append(f"{r['budget'] / MIB:9.2f} | {r['remat_megatron_sweep_seconds']:7.2f} | "
                     f"{r['remat_model_seconds']:6.2f} {r['remat_dp_seconds']:7.4f} {r['remat_validate_seconds']:6.2f} "
                     f"| {r['compile']['search_seconds']:7.2f}  (Megatron plan: {megatron_plan})")
    lines.append("-" * 118)
    plans = [(r["budget"], c) for r in rows for k in ("megatron", "extended_time", "extended_roofline")
             for c in (r.get(k),) if c]
    inside = sum(c["measured_peak"] <= b for b, c in plans)
    lines.append(f"remat plans within budget (remat.measure, real CPU tensors): {inside}/{len(plans)}")
    comp_fit = [r for r in rows if "ratio" in r["compile"]]
    lines.append(f"torch.compile: a fitting ratio found at {len(comp_fit)}/{len(rows)} budgets "
                 f"({sum(r['compile']['fits'] for r in comp_fit)} fit on the profiler); compiles per budget "
                 f"{[r['compile']['ratios_evaluated'] for r in rows]} (evaluated), "
                 f"{sum(r['compile']['fresh_compiles'] for r in rows)} distinct compiles in all")
    for key in ("extended_time", "extended_roofline"):
        own, eager = [], []
        for r in comp_fit:
            tm = r["timing"]
            a = tm.get(f"remat {key}", {}).get("ratio")
            b, base = tm.get("compile ratio", {}).get("ratio"), tm.get("compile 1.0", {}).get("ratio")
            if a is not None and b is not None and base is not None:
                own.append((a - 1) <= (b - 1) + 0.02)
                eager.append(a <= b * base + 0.02)
        name = "remat (time)" if key == "extended_time" else "remat (roofline)"
        lines.append(f"{name} step time: extra over its own no-recompute step <= torch.compile's over compiled 1.0 "
                     f"(+2% noise allowance) at {sum(own)}/{len(own)} budgets where both fit; step time <= "
                     f"torch.compile's, both against eager no-recompute, at {sum(eager)}/{len(eager)}")
    lines += compiled_comparison(rows)
    err = [abs(r["extended_time"]["step_time_ratio"] - r["timing"]["remat extended_time"]["ratio"])
           for r in rows if r.get("extended_time") and r["timing"].get("remat extended_time", {}).get("ratio")]
    if err:
        lines.append(f"remat (time): predicted vs measured step-time ratio, largest difference {max(err):.3f}")
    lt = report["layer_times"]
    lines.append(f"measured layer forward {1e3 * lt['layer']:.2f} ms: non-matmul operators "
                 f"{1e3 * lt['non_matmul']:.2f} ms ({100 * lt['non_matmul'] / lt['layer']:.0f}%), core_attn "
                 f"{1e3 * lt['core_attn']:.2f} ms, mlp {1e3 * lt['mlp']:.2f} ms")
    dp = report["dp_deep"]
    secs = [d["seconds"] for d in dp["runs"]]
    cpu = [d["cpu_seconds"] for d in dp["runs"]]
    lines.append(f"dynamic program alone, {dp['layers']} layers, {dp['unit_kinds']} unit kinds (keep_ops included), "
                 f"time objective, 8 budgets: max {max(secs):.3f} s ({max(cpu):.3f} s of CPU), median "
                 f"{statistics.median(secs):.3f} s (without the Megatron incumbent: max "
                 f"{max(d['seconds_without_incumbent'] for d in dp['runs']):.3f} s)")
    solve_first = rows[0]["remat_plan_seconds"] if rows else 0
    lines.append(f"remat plan() per budget: first {solve_first:.1f} s (unit model + Megatron sweep + validation), "
                 f"then median {statistics.median([r['remat_plan_seconds'] for r in rows[1:]] or [0]):.2f} s; "
                 f"DP median {1e3 * statistics.median([r['remat_dp_seconds'] for r in rows]):.1f} ms")
    for name, probe in report["rockmate"].items():
        lines.append(f"rockmate ({name}: {probe.get('python', '')}): import {probe.get('import')}")
        if "rkgb_files" in probe:
            lines.append(f"    rockmate {probe.get('rockmate_version')} needs rkgb; installed rkgb "
                         f"{probe.get('rkgb_version')} ships only {probe['rkgb_files']}")
    nr = report["no_recompute"]
    lines.append(f"instruments on the eager no-recompute step: remat.measure {nr['measure_peak']:,} B, profiler "
                 f"{nr['profiler_peak']:,} B (difference {nr['instrument_difference']:+,} B)")
    lines.append(f"load average during the run: {report['machine']['load_average']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--budgets", type=int, default=8, help="budgets from the smallest to the no-recompute peak")
    parser.add_argument("--rounds", type=int, default=11, help="timed rounds per budget")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dp-layers", type=int, default=128)
    parser.add_argument("--rockmate-python", default=os.environ.get("ROCKMATE_PYTHON"),
                        help="interpreter of a venv with rockmate installed (pip install rockmate==2.0.0)")
    parser.add_argument("--no-sac", action="store_true", help="leave out torch's SAC ILP (sac_milp)")
    parser.add_argument("--budget-mib", type=float, action="append", default=[],
                        help="run this budget only (MiB, repeatable; a full run's printed budget selects that "
                             "budget to the byte); default: --budgets evenly spaced budgets")
    parser.add_argument("--compiled-only", action="store_true",
                        help="only torch.compile and remat + torch.compile (no eager methods, DP timing, rockmate)")
    parser.add_argument("--quick", action="store_true", help="4 layers, 3 budgets, 2 rounds, 16-layer DP")
    parser.add_argument("--json", help="write the full report here")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.budgets, args.rounds, args.dp_layers = 4, 3, 2, 16
        args.seq, args.hidden = 64, 64
    report = run(args)
    text = summary(report)
    print(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1, default=str)


if __name__ == "__main__":
    main()
