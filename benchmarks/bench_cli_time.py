#!/usr/bin/env python
"""End-to-end time of remat's whole-job answers, each a fresh process (imports, traces, report, exit): issue 23's
targets on a 2-core machine where ``import torch`` takes 1.0 s.

- cold (``--no-cache``: no stored answer, no disk cache): the README's whole-job predictions (Llama-3-70B with CP,
  Mixtral, DeepSeek-V3 on 1,024 ranks) and the 70B plan and Megatron sweep <= 3 s each; the DeepSeek-V3 plan
  (TP8 SP PP8 EP8 DP32, 45 GiB) <= 15 s (``--deepseek-plan``: minutes per run);
- warm (the disk cache filled by one untimed run, then the same command): each <= 1 s.

With ``--base DIR`` (another checkout's ``src`` directory, e.g. a ``git worktree`` of an older commit), each round
also runs every command on that tree, right before this one (``PYTHONPATH=DIR``: the same interpreter and
packages), and the per-round ratio new / base is printed with a 95% bootstrap interval: the machine's load moves
absolute times by 10-20%, a ratio measured side by side much less. Each tree gets its own cache folder.

The targets are set on a machine where ``import torch`` takes 1.0 s; this one's speed moves with its load. Each
cold run of a command (this tree) is preceded by ``import torch`` timed in a fresh process (the same interpreter),
and each cold command is printed as a multiple of it (the median of those paired ratios, with its interval: the
machine's speed moves within a round): that multiple, in seconds, is what the command would take where ``import
torch`` takes 1.0 s if the whole command slowed down as much as the import (it is all CPU-bound Python) -- an
estimate beside the measured seconds, never instead of them.

Usage::

    python benchmarks/bench_cli_time.py                      # 5 rounds, cold and warm
    python benchmarks/bench_cli_time.py --base /tmp/base/src --rounds 8 --only 70b
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

from step_timing import bootstrap_ci, median, paired_ratio

COMMANDS = {
    "predict 70B cp2": "predict --preset llama3-70b --tp 8 --sp --pp 4 --cp 2 --dp 8 --distributed-optimizer",
    "predict Mixtral": "predict --preset mixtral-8x7b --pp 4 --microbatches 8 --dp 8 --ep 8 --distributed-optimizer",
    "predict DeepSeek-V3 1024": "predict --preset deepseek-v3 --pp 16 --microbatches 32 --dp 64 --ep 64 "
                                "--distributed-optimizer --decoder-first-pipeline-num-layers 1 "
                                "--decoder-last-pipeline-num-layers 4 --policy selective/moe_act",
    "plan 70B pp4 (50 GiB)": "plan --budget 50GiB --preset llama3-70b --tp 8 --sp --pp 4 --microbatches 8 --dp 8 "
                             "--distributed-optimizer",
    "sweep 70B (168 settings)": "predict --preset llama3-70b --sweep megatron",
}
DEEPSEEK_PLAN = {
    "plan DeepSeek-V3 (45 GiB)": "plan --budget 45GiB --preset deepseek-v3 --tp 8 --sp --pp 8 --ep 8 "
                                 "--microbatches 16 --dp 32 --distributed-optimizer "
                                 "--decoder-first-pipeline-num-layers 5",
}
COLD_TARGET, DEEPSEEK_TARGET, WARM_TARGET = 3.0, 15.0, 1.0


def timed(args: str, pythonpath: str | None, cache: str | None) -> tuple[float, float]:
    """Wall seconds and CPU seconds (user + system, of the process and the workers it forked and waited for) of
    ``remat ARGS`` in a fresh process (output discarded); cold (``--no-cache``) when ``cache`` is None, else with
    that cache folder. Raises if it fails. CPU seconds are steadier than wall seconds on a shared host: they say
    whether a change does less work, wall seconds whether it ends sooner."""
    env = dict(os.environ)
    env.pop("REMAT_NO_CACHE", None)
    # what a user runs has remat's bytecode (pip compiles it at install; a source tree writes __pycache__ on first
    # import): an environment that sets PYTHONDONTWRITEBYTECODE (this project's machines do) would have every timed
    # run compile remat's ~180 modules again, about 0.5 s of a 2-core machine's start
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    argv = args.split()
    if cache is None:
        argv.append("--no-cache")
    else:
        env["REMAT_CACHE_DIR"] = cache
    remat = shutil.which("remat") or os.path.join(os.path.dirname(sys.executable), "remat")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([remat, *argv], env=env, check=True, stdout=subprocess.DEVNULL, timeout=1800)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def torch_import_seconds() -> float:
    """Wall seconds of ``import torch`` in a fresh process of this interpreter: the machine's speed this round."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], env=env, check=True, timeout=600)
    return time.perf_counter() - start


def line(name: str, new: list[float], base: list[float], target: float, yardstick: list[float] | None = None,
         cpu: tuple[list[float], list[float]] = ([], [])) -> str:
    verdict = "PASS" if median(new) <= target else "FAIL"
    text = (f"{name:34s} median {median(new):6.2f} s (min {min(new):.2f}, max {max(new):.2f}; "
            f"{sum(x <= target for x in new)}/{len(new)} runs <= {target:g} s): {verdict}")
    if yardstick:
        ratios = [t / y for t, y in zip(new, yardstick)]
        low, high = bootstrap_ci(ratios)
        text += f"; {median(ratios):.2f} x import torch ({low:.2f}-{high:.2f})"
    if base:
        text += f"; base median {median(base):.2f} s, {paired_ratio(new, base)}"
    new_cpu, base_cpu = cpu
    if new_cpu:
        text += f"; CPU median {median(new_cpu):.2f} s"
        if base_cpu:
            text += f" (base {median(base_cpu):.2f} s, {paired_ratio(new_cpu, base_cpu)})"
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--base", help="another tree's src directory, run side by side as the baseline")
    parser.add_argument("--new", help="the measured tree's src directory (default: the installed remat)")
    parser.add_argument("--only", default="", help="commands whose name contains this (case-insensitive)")
    parser.add_argument("--deepseek-plan", action="store_true", help="also the DeepSeek-V3 plan (minutes a run)")
    parser.add_argument("--no-warm", action="store_true", help="cold runs only")
    args = parser.parse_args()
    commands = {**COMMANDS, **(DEEPSEEK_PLAN if args.deepseek_plan else {})}
    commands = {n: c for n, c in commands.items() if args.only.lower() in n.lower()}
    trees = ([("base", args.base)] if args.base else []) + [("new", args.new)]
    folders = {tree: tempfile.mkdtemp(prefix=f"remat-bench-{tree}-") for tree, _ in trees}
    times: dict[tuple[str, str, str], list[float]] = {}
    cpu: dict[tuple[str, str, str], list[float]] = {}
    imports: list[float] = []  # import torch, each time it is timed
    yardsticks: dict[str, list[float]] = {}  # import torch timed right before each cold run of a command (new tree)
    try:
        for command in commands.values():  # the .pyc files, the page cache and each tree's warm cache: not timed
            for tree, path in trees:
                timed(command, path, folders[tree])
        for _ in range(args.rounds):
            for name, command in commands.items():
                for mode in ("cold",) + (() if args.no_warm else ("warm",)):
                    for tree, path in trees:
                        if mode == "cold" and tree == "new":  # the machine's speed at that moment, not the round's
                            imports.append(torch_import_seconds())
                            yardsticks.setdefault(name, []).append(imports[-1])
                        seconds, cpu_seconds = timed(command, path, None if mode == "cold" else folders[tree])
                        times.setdefault((name, mode, tree), []).append(seconds)
                        cpu.setdefault((name, mode, tree), []).append(cpu_seconds)
    finally:
        for folder in folders.values():
            shutil.rmtree(folder, ignore_errors=True)
    load = os.getloadavg()[0]
    print(f"{args.rounds} rounds, load average {load:.1f}, {os.cpu_count()} cores; import torch median "
          f"{median(imports):.2f} s (min {min(imports):.2f}, max {max(imports):.2f}; the targets' machine: 1.0 s)")
    for name in commands:
        for mode in ("cold",) + (() if args.no_warm else ("warm",)):
            target = WARM_TARGET if mode == "warm" else DEEPSEEK_TARGET if name in DEEPSEEK_PLAN else COLD_TARGET
            print(line(f"{name} {mode}", times[(name, mode, "new")], times.get((name, mode, "base"), []), target,
                       yardsticks[name] if mode == "cold" else None,
                       (cpu[(name, mode, "new")], cpu.get((name, mode, "base"), []))))


if __name__ == "__main__":
    main()
