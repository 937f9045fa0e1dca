#!/usr/bin/env python
"""Re-time ``bench_plan.py``'s compiled pair with more rounds: from its ``--json`` report, per budget, torch.compile
at the ratio it found and remat's plan + torch.compile as it found it, both compiled again (``aot_eager``), their
peaks measured again on the profiler, and their steps timed interleaved with compiled 1.0 and eager no recompute
(``--rounds`` rounds, random order, one thread). Prints extra step time over compiled 1.0 for both and the paired
per-round ratio remat / torch.compile with a 95% bootstrap interval.

Usage: ``python benchmarks/recheck_compiled.py report.json --rounds 31``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spin-waiting OpenMP threads collapse on a shared machine

import argparse
import gc
import json
import random
import statistics
import sys
from typing import Any

import torch

import remat
from remat import ModelConfig, build_model, sample_batch
from remat.recompute.plan_format import Plan

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compile_peers import CompileSearch, counting_backend, profiler_peak, step, time_steps  # noqa: E402

MIB = 1 << 20


def compiled_plan(config: ModelConfig, text: str, batch: Any) -> Any:
    model = build_model(config, seed=0)
    remat.apply(model, Plan.parse(text))
    compiled = torch.compile(model, backend=counting_backend({}))
    step(compiled, batch)
    return compiled


def bootstrap(values: list[float], draws: int = 2000) -> tuple[float, float]:
    rng = random.Random(1)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    return meds[int(0.025 * draws)], meds[int(0.975 * draws) - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", help="bench_plan.py --json output")
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument("--threads", type=int, default=1)
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
    print("budget MiB | remat+compile peak, extra | torch.compile ratio, peak, extra | paired remat/compile "
          "(95% CI) | compiled 1.0 vs eager | winner", flush=True)
    for row in report["rows"]:
        rc, comp = row.get("remat_compiled") or {}, row.get("compile") or {}
        if "plan" not in rc or "ratio" not in comp:
            continue
        if rc["plan"] == "keep all" and comp["ratio"] == 1.0:
            print(f"{row['budget'] / MIB:9.2f} | both the compiled plain model (no recompute): tie", flush=True)
            continue
        found = search.get(comp["ratio"])
        mine = base if rc["plan"] == "keep all" else compiled_plan(config, rc["plan"], batch)
        mine_peak = profiler_peak(mine, batch)
        variants = {"eager": eager, "base": base, "compile": found.module, "remat": mine}
        times = {name: t["times"] for name, t in time_steps(variants, batch, args.rounds, {}).items()}

        def ratio(a: str, b: str, times: dict[str, list[float]] = times) -> list[float]:
            return [x / y for x, y in zip(times[a], times[b])]

        paired = ratio("remat", "compile")
        lo, hi = bootstrap(paired)
        p = statistics.median(paired)
        verdict = "remat" if hi < 1.0 else ("torch.compile" if lo > 1.0 else ("remat?" if p < 1.0 else
                                                                           "torch.compile?"))
        print(f"{row['budget'] / MIB:9.2f} | {mine_peak / MIB:7.2f}{'*' if mine_peak > row['budget'] else ' '} "
              f"{100 * (statistics.median(ratio('remat', 'base')) - 1):+6.1f}% | r={comp['ratio']:.4f} "
              f"{found.peak / MIB:7.2f}{'*' if found.peak > row['budget'] else ' '} "
              f"{100 * (statistics.median(ratio('compile', 'base')) - 1):+6.1f}% | {p:.3f} ({lo:.3f}-{hi:.3f}) | "
              f"{statistics.median(ratio('base', 'eager')):.3f} | {verdict}", flush=True)
        del variants, mine
        gc.collect()
    print(f"load average: {os.getloadavg()}")


if __name__ == "__main__":
    main()
