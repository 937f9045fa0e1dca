#!/usr/bin/env python
"""Where one cold run of a ``remat`` command spends its time: issue 23's "profile of the slowest command", made the
same way each time instead of by hand.

- the timeline (default): the command runs once in this process, cold (``--no-cache``), as the console script runs
  it (:func:`remat.cli.console_imports`); printed are when its imports end, each task a forked worker runs
  (:func:`remat.memory.trace_pool.run_forked`'s tasks and a job plan's unit-model builds, timed inside the worker,
  with the modules the task imported), when the command ends, and the CPU seconds of it and its workers. The gaps
  are the parent's own work; a worker's first task carries the imports its first fake dispatch pulls in.
- ``--serial``: the same command in one process (``REMAT_TRACE_WORKERS=1``) under cProfile: the cumulative seconds
  of the stages an answer is made of (traces of a job's chunks or of a single-process model, unit-model traces, step and
  stage composition, model state, the caching allocator's replays, a job's report), nested as they run (a chunk
  trace laid out from a shallow one composes steps: that time is in both).
  cProfile slows Python code by about 1.5-2x: read the shares, not the seconds.

Each run is one sample on a shared machine: compare commands or trees with ``bench_cli_time.py``, side by side.

Usage::

    python benchmarks/profile_cli.py predict --preset deepseek-v3 --pp 16 --microbatches 32 --dp 64 --ep 64 \\
        --distributed-optimizer --decoder-first-pipeline-num-layers 1 --decoder-last-pipeline-num-layers 4 \\
        --policy selective/moe_act
    python benchmarks/profile_cli.py --serial plan --budget 50GiB --preset llama3-70b --tp 8 --sp --pp 4 --dp 8 \\
        --distributed-optimizer
"""

from __future__ import annotations

import time

START = time.time()  # before torch is imported: the imports are part of what a command costs

import contextlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from typing import Any  # noqa: E402

# the stages of an answer, as cProfile names them: (label, file suffix, function)
AREAS = [
    ("chunk traces of a job's stages (laid out too)", "remat/parallel/chunk_trace.py", "trace_chunk"),
    ("model traces (a single-process predict)", "remat/memory/predict.py", "trace"),
    ("unit-model traces (a plan's search)", "remat/plan/unit_trace.py", "marked_trace"),
    ("step composition (also inside chunk traces)", "remat/memory/compose.py", "compose"),
    ("stage composition (a job's schedule)", "remat/parallel/pipeline_predict.py", "compose_stage"),
    ("model state (parameters, grads, optimizer)", "remat/parallel/job_predict.py", "add_model_state"),
    ("caching-allocator replays", "remat/memory/reserved.py", "reserved_figures"),
    ("a job's report (text, JSON)", "remat/cli/job.py", "_emit"),
]


def imported() -> float:
    """Import the command line as the console script does (remat.cli.console_imports: OpenMP's spin count,
    torch._dynamo deferred, the imports frozen); the seconds since this script started."""
    from remat.cli import console_imports

    with console_imports():
        import remat.cli.commands  # noqa: F401
    return time.time() - START


def run_quietly(argv: Sequence[str]) -> int:
    """``remat ARGV --no-cache`` in this process, its output discarded; the exit code."""
    from remat.cli.commands import run

    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
        return run([*argv, "--no-cache"], console=True)


def timed_task(task: Callable[[], Any], label: str, log: str) -> Callable[[], Any]:
    """``task``, appending (pid, label, start, end, modules imported) to ``log`` as one JSON line when it ends."""
    def run() -> Any:
        begin, modules = time.time(), len(sys.modules)
        try:
            return task()
        finally:
            line = json.dumps([os.getpid(), label, begin - START, time.time() - START, len(sys.modules) - modules])
            with open(log, "a") as out:  # one short append: whole, whichever process writes it
                out.write(line + "\n")
    return run


def hook_workers(log: str) -> None:
    """Time every task a forked worker runs: run_forked's tasks wherever a module imported it, and a job plan's
    unit-model builds (remat.plan.unit_prefetch forks one process for each)."""
    from remat.memory import trace_pool

    original = trace_pool.run_forked
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("remat.") and getattr(module, "run_forked", None) is original:
            module.run_forked = _timed_run_forked(original, module.__name__, log)
    import remat.plan.unit_prefetch as unit_prefetch

    for name in ("base_unit_model", "stack_shapes"):
        setattr(unit_prefetch, name, _timed_builder(getattr(unit_prefetch, name), name, log))


def _timed_run_forked(original: Callable[..., list[Any]], caller: str, log: str) -> Callable[..., list[Any]]:
    def run_forked(tasks: Sequence[Callable[[], Any]], *args: Any, **kwargs: Any) -> list[Any]:
        if len(tasks) < 2:  # run where it is asked (e.g. a stage's replay inside a worker's task): nested
            return original([timed_task(t, f"  inside: {caller}", log) for t in tasks], *args, **kwargs)
        with open(log, "a") as out:
            out.write(json.dumps([os.getpid(), f"run_forked: {len(tasks)} tasks ({caller})", time.time() - START,
                                  None, 0]) + "\n")
        return original([timed_task(t, f"task {i}", log) for i, t in enumerate(tasks)], *args, **kwargs)
    return run_forked


def _timed_builder(build: Callable[..., Any], name: str, log: str) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        return timed_task(lambda: build(*args, **kwargs), f"unit model: {name}", log)()
    return run


def timeline(argv: Sequence[str]) -> None:
    """The default report (module docstring)."""
    import_seconds = imported()
    fd, log = tempfile.mkstemp(prefix="remat-profile-", suffix=".jsonl")
    os.close(fd)
    try:
        hook_workers(log)
        begin = time.time() - START
        code = run_quietly(argv)
        end = time.time() - START
        with open(log) as lines:
            events = [json.loads(line) for line in lines]
    finally:
        os.remove(log)
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"remat {' '.join(argv)} --no-cache (exit {code})")
    print(f"  0.00 - {import_seconds:5.2f}  imports (torch, remat's command line)")
    print(f"{begin:6.2f}          the command starts")
    workers: dict[int, str] = {}
    busy: dict[int, float] = {}
    for pid, label, start, stop, modules in sorted(events, key=lambda e: e[2]):
        if stop is None:
            print(f"{start:6.2f}          {label}")
            continue
        who = workers.setdefault(pid, "this process" if pid == os.getpid() else f"worker {len(workers) + 1}")
        if not label.startswith(" "):  # nested tasks are inside one counted already
            busy[pid] = busy.get(pid, 0.0) + stop - start
        extra = f", +{modules} modules imported" if modules else ""
        print(f"{start:6.2f} - {stop:5.2f}  {who:12s} {label}: {stop - start:.2f} s{extra}")
    print(f"{end:6.2f}          the command ends")
    for pid, who in workers.items():
        print(f"  {who}: tasks {busy.get(pid, 0.0):.2f} s")
    print(f"CPU: this process {own.ru_utime + own.ru_stime:.2f} s, its workers "
          f"{children.ru_utime + children.ru_stime:.2f} s; wall {end:.2f} s")


def serial(argv: Sequence[str]) -> None:
    """The ``--serial`` report (module docstring)."""
    import cProfile
    import pstats

    os.environ["REMAT_TRACE_WORKERS"] = "1"
    import_seconds = imported()
    profile = cProfile.Profile()
    begin = time.perf_counter()
    code = profile.runcall(run_quietly, argv)
    total = time.perf_counter() - begin
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    print(f"remat {' '.join(argv)} --no-cache (exit {code}), one process, under cProfile")
    print(f"  imports (not profiled)                             {import_seconds:6.2f} s")
    print(f"  the command                                        {total:6.2f} s (100%)")
    for label, path, function in AREAS:
        seconds = sum(entry[3] for (file, _, name), entry in stats.items()
                      if name == function and file.replace(os.sep, "/").endswith(path))
        print(f"    {label:48s} {seconds:6.2f} s ({100 * seconds / total:3.0f}%)")


def main() -> None:
    argv = sys.argv[1:]
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return
    if argv[0] == "--serial":
        serial(argv[1:])
    else:
        timeline(argv)


if __name__ == "__main__":
    main()
