#!/usr/bin/env python
"""Re-time ``bench_plan.py``'s compiled pair with more rounds: from its ``--json`` report, per budget, torch.compile
at the ratio it found and remat's plan + torch.compile as it found it, both compiled again (``aot_eager``), their
peaks measured again on the profiler, and their steps timed interleaved with compiled 1.0 and eager no recompute
(``--rounds`` rounds, random order, one thread). Prints extra step time over compiled 1.0 for both and the paired
per-round ratio remat / torch.compile with a 95% bootstrap interval; with both remat plans in the report (compiled
planning and the eager plans' target search), both, timed in the same rounds.

Usage: ``python benchmarks/recheck_compiled.py report.json --rounds 31``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spin-waiting OpenMP threads collapse on a shared machine

import argparse
import gc
import json
import statistics
import sys

import torch

from remat import ModelConfig, build_model, sample_batch
from remat.recompute.plan_format import Plan

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compile_peers import CompileSearch, compile_plan, profiler_peak, time_steps  # noqa: E402
from step_timing import bootstrap_ci  # noqa: E402

MIB = 1 << 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", help="bench_plan.py --json output")
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--budget", type=float, action="append", default=[],
                        help="only the report's budget(s) within 0.01 MiB of this (MiB, repeatable; default: all)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch._dynamo.config.cache_size_limit = 512
    with open(args.report, encoding="utf-8") as f:
        report = json.load(f)
    config = ModelConfig.from_dict(report["config"])
    batch = sample_batch(config)
    search = CompileSearch(config, batch)
    eager = build_model(config, seed=0)
    base = search.get(1.0).module
    print("budget MiB | remat plan: peak, extra | torch.compile ratio, peak, extra | paired remat/compile "
          "(95% CI) | compiled 1.0 vs eager | winner | plan", flush=True)
    for row in report["rows"]:
        comp = row.get("compile") or {}
        # reports since compiled planning: remat_compiled is it, remat_compiled_eager the eager plans' target search
        mine = [(label, row.get(key) or {}) for key, label in (("remat_compiled", "compiled planning"),
                                                                ("remat_compiled_eager", "eager plan"))]
        mine = [(label if "remat_compiled_eager" in row else "remat plan", rc) for label, rc in mine if "plan" in rc]
        if not mine or "ratio" not in comp:
            continue
        if args.budget and not any(abs(row["budget"] / MIB - b) < 0.01 for b in args.budget):
            continue
        if all(rc["plan"] == "keep all" for _, rc in mine) and comp["ratio"] == 1.0:
            print(f"{row['budget'] / MIB:9.2f} | both the compiled plain model (no recompute): tie", flush=True)
            continue
        found = search.get(comp["ratio"])
        variants = {"eager": eager, "base": base, "compile": found.module}
        peaks = {}
        for label, rc in mine:
            if rc["plan"] == "keep all":
                variants[label], peaks[label] = base, profiler_peak(base, batch)
            else:
                made = compile_plan(config, Plan.parse(rc["plan"]), batch, row["budget"], label)
                variants[label], peaks[label] = made.module, made.peak
        times = {name: t["times"] for name, t in time_steps(variants, batch, args.rounds, {}).items()}

        def ratio(a: str, b: str, times: dict[str, list[float]] = times) -> list[float]:
            return [x / y for x, y in zip(times[a], times[b])]

        for label, rc in mine:
            paired = ratio(label, "compile")
            lo, hi = bootstrap_ci(paired, seed=1)
            p = statistics.median(paired)
            verdict = "remat" if hi < 1.0 else ("torch.compile" if lo > 1.0 else ("remat?" if p < 1.0 else
                                                                               "torch.compile?"))
            peak = peaks[label]
            print(f"{row['budget'] / MIB:9.2f} | {label}: {peak / MIB:7.2f}{'*' if peak > row['budget'] else ' '} "
                  f"{100 * (statistics.median(ratio(label, 'base')) - 1):+6.1f}% | r={comp['ratio']:.4f} "
                  f"{found.peak / MIB:7.2f}{'*' if found.peak > row['budget'] else ' '} "
                  f"{100 * (statistics.median(ratio('compile', 'base')) - 1):+6.1f}% | {p:.3f} ({lo:.3f}-{hi:.3f}) | "
                  f"{statistics.median(ratio('base', 'eager')):.3f} | {verdict} | {rc['plan']}", flush=True)
        del variants
        gc.collect()
    print(f"load average: {os.getloadavg()}")


if __name__ == "__main__":
    main()
