#!/usr/bin/env python
"""The README's first command, ``remat explain`` with no arguments (the built-in 8-layer GPT, every default policy,
the contrast run at vocab 32000, the PNG), each run a fresh process on an empty cache folder, as a first run is:
issue 24's target, the seed question answered (the short answer printed) in <= 30 s on 2 cores, on a quiet
machine and beside a busy one.

Per run it records the wall time until the short answer's first line (``In short``) reaches stdout and until the
process exits. ``--busy`` runs each round beside a CPU-burning process pinned to one core (a Python loop, what a
second job on the machine looks like); ``--modes quiet,busy`` does both. With ``--base DIR`` (another tree's
``src`` directory, e.g. a ``git worktree`` of an older commit) every round also runs that tree (``PYTHONPATH=DIR``:
the same interpreter and packages), the order of the two alternating between rounds, and the per-round ratios
new / base are printed with a 95% bootstrap interval (the machine's load moves absolute times, a ratio measured
side by side much less).

Usage::

    python benchmarks/bench_explain_time.py                                 # 5 rounds, quiet
    python benchmarks/bench_explain_time.py --modes quiet,busy --base /tmp/base_explain/src
    python benchmarks/bench_explain_time.py --args "--repeats 3" --rounds 3 # other flags after `remat explain`
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from step_timing import median, paired_ratio

TARGET_SECONDS = 30.0
ANSWER = "In short"  # the short answer's first line
BURN = "while True: pass"


@dataclass
class Runs:
    """One tree's runs in one mode: seconds to the short answer and to the exit, per round."""

    answer: list[float] = field(default_factory=list)
    total: list[float] = field(default_factory=list)


def run_once(extra: list[str], pythonpath: str | None) -> tuple[float, float]:
    """(seconds until the short answer's first line, seconds until exit) of ``remat explain EXTRA`` in a fresh
    process, writing into a fresh folder with an empty cache folder; raises if it fails or never answers."""
    remat = shutil.which("remat") or os.path.join(os.path.dirname(sys.executable), "remat")
    with tempfile.TemporaryDirectory(prefix="bench-explain-") as tmp:
        env = dict(os.environ, REMAT_CACHE_DIR=os.path.join(tmp, "cache"), PYTHONUNBUFFERED="1")
        if pythonpath:
            env["PYTHONPATH"] = pythonpath
        answer = None
        start = time.perf_counter()
        with subprocess.Popen([remat, "explain", *extra, "--out", os.path.join(tmp, "out")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                if answer is None and line.startswith(ANSWER):
                    answer = time.perf_counter() - start
            code = proc.wait(timeout=900)
        total = time.perf_counter() - start
    if code != 0 or answer is None:
        raise RuntimeError(f"remat explain {' '.join(extra)} (PYTHONPATH={pythonpath}): exit {code}, "
                           f"{'no short answer' if answer is None else 'answered'}")
    return answer, total


@contextlib.contextmanager
def burner(busy: bool) -> Iterator[None]:
    """With ``busy``, a Python loop pinned to the last core runs for the length of the block."""
    if not busy:
        yield
        return
    core = max(os.sched_getaffinity(0))
    proc = subprocess.Popen([sys.executable, "-c", BURN], preexec_fn=lambda: os.sched_setaffinity(0, {core}))
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


def summary(name: str, runs: Runs, base: Runs | None) -> list[str]:
    lines = []
    for what, xs in (("short answer", runs.answer), ("whole run", runs.total)):
        line = (f"  {name:4s} {what:12s} median {median(xs):6.1f} s (min {min(xs):.1f}, max {max(xs):.1f}; "
                f"{sum(x <= TARGET_SECONDS for x in xs)}/{len(xs)} <= {TARGET_SECONDS:g} s)")
        if base is not None:
            ys = base.answer if what == "short answer" else base.total
            line += f"; base median {median(ys):.1f} s (min {min(ys):.1f}, max {max(ys):.1f}), {paired_ratio(xs, ys)}"
        lines.append(line)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--base", help="another tree's src directory, run side by side as the baseline")
    parser.add_argument("--busy", action="store_true", help="run beside a CPU-burning process (--modes busy)")
    parser.add_argument("--modes", help="comma-separated: quiet, busy (default quiet, or busy with --busy)")
    parser.add_argument("--args", default="", help="more flags for `remat explain`, one string")
    args = parser.parse_args()
    modes = args.modes.split(",") if args.modes else ["busy" if args.busy else "quiet"]
    if set(modes) - {"quiet", "busy"}:
        parser.error(f"--modes {args.modes}: quiet and/or busy")
    extra = shlex.split(args.args)
    trees = {"new": None, **({"base": args.base} if args.base else {})}
    results = {(mode, tree): Runs() for mode in modes for tree in trees}
    for path in trees.values():  # the .pyc files and the page cache warm: not timed
        run_once(["--layers", "1", "--policies", "none", "--contrast-vocab", "0", "--no-plot"], path)
    for r in range(args.rounds):
        for mode in modes:
            order = list(trees.items()) if r % 2 == 0 else list(reversed(trees.items()))
            with burner(mode == "busy"):
                for tree, path in order:
                    answer, total = run_once(extra, path)
                    results[mode, tree].answer.append(answer)
                    results[mode, tree].total.append(total)
                    print(f"round {r + 1}/{args.rounds} {mode} {tree}: short answer {answer:.1f} s, whole run "
                          f"{total:.1f} s", file=sys.stderr, flush=True)
    print(f"`remat explain {' '.join(extra)}`".replace(" `", "`") + f", {args.rounds} rounds, fresh processes and "
          f"cache folders, {os.cpu_count()} cores, load average now {os.getloadavg()[0]:.1f}; target: the short "
          f"answer in <= {TARGET_SECONDS:g} s")
    verdicts = []
    for mode in modes:
        print(f"{mode}{' (beside a CPU-burning process on one core)' if mode == 'busy' else ''}:")
        new = results[mode, "new"]
        print("\n".join(summary("new", new, results.get((mode, "base")))))
        verdicts.append(median(new.answer) <= TARGET_SECONDS)
    print("PASS" if all(verdicts) else "FAIL")


if __name__ == "__main__":
    main()
