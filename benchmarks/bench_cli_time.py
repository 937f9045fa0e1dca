#!/usr/bin/env python
"""End-to-end time of remat's two 70B commands, each a fresh process (imports, traces, report, exit), cold
(``--no-cache``): issue 15's targets, ``remat plan`` of Llama-3-70B at TP=8 SP PP=4 DP=8 (50 GiB) <= 5 s and the
Megatron sweep of Llama-3-70B (168 settings) <= 5 s, on this 2-core machine.

With ``--base DIR`` (another checkout's ``src`` directory, e.g. a ``git worktree`` of an older commit), each round
also runs every command on that tree, right before this one (``PYTHONPATH=DIR``: the same interpreter and
packages), and the per-round ratio new / base is printed with a 95% bootstrap interval: the machine's load moves
absolute times by 10-20%, a ratio measured side by side much less.

Usage::

    python benchmarks/bench_cli_time.py                      # 5 rounds
    python benchmarks/bench_cli_time.py --base /tmp/base/src --rounds 8
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time

from step_timing import bootstrap_ci, median

COMMANDS = {
    "plan 70B pp4 (50 GiB)": "plan --budget 50GiB --preset llama3-70b --tp 8 --sp --pp 4 --microbatches 8 --dp 8 "
                             "--distributed-optimizer --no-cache",
    "sweep 70B (168 settings)": "predict --preset llama3-70b --sweep megatron --no-cache",
}
TARGET_SECONDS = 5.0


def timed(args: str, pythonpath: str | None) -> float:
    """Wall seconds of ``remat ARGS`` in a fresh process (output discarded); raises if it fails."""
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    remat = shutil.which("remat") or os.path.join(os.path.dirname(sys.executable), "remat")
    start = time.perf_counter()
    subprocess.run([remat, *args.split()], env=env, check=True, stdout=subprocess.DEVNULL, timeout=600)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--base", help="another tree's src directory, run side by side as the baseline")
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    base: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for command in COMMANDS.values():  # warm the .pyc files and the page cache: not timed
        if args.base:
            timed(command, args.base)
        timed(command, None)
    for _ in range(args.rounds):
        for name, command in COMMANDS.items():
            if args.base:
                base[name].append(timed(command, args.base))
            times[name].append(timed(command, None))
    load = os.getloadavg()[0]
    print(f"{args.rounds} rounds, cold (--no-cache), load average {load:.1f}, {os.cpu_count()} cores")
    for name in COMMANDS:
        t = times[name]
        verdict = "PASS" if median(t) <= TARGET_SECONDS else "FAIL"
        line = (f"{name:26s} median {median(t):5.2f} s (min {min(t):.2f}, max {max(t):.2f}; "
                f"{sum(x <= TARGET_SECONDS for x in t)}/{len(t)} runs <= {TARGET_SECONDS:g} s): {verdict}")
        if args.base:
            ratios = [n / b for n, b in zip(t, base[name])]
            low, high = bootstrap_ci(ratios)
            line += f"; base median {median(base[name]):.2f} s, new/base {median(ratios):.3f} ({low:.3f}-{high:.3f})"
        print(line)


if __name__ == "__main__":
    main()
