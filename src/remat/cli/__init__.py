"""The ``remat`` command line. :func:`main` first looks for the command's stored answer
(:mod:`remat.cli.answers`), then parses and runs it (:mod:`remat.cli.commands`); each subcommand lives in a module
of its own. Nothing here imports torch: a stored answer is printed without it."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import gc
import os
import sys
import threading
from collections.abc import Iterator, Sequence

from remat.cli.answers import answer_key, recording, replay, stored_answer


def build_parser() -> argparse.ArgumentParser:
    """The ``remat`` parser with every registered subcommand."""
    from remat.cli.commands import build_parser as build

    return build()


# NOTE [the collector and the imports]: importing torch and remat makes about a million objects that live as long as
# the process, and no garbage; the cycle collector, counting them as they come, ran three full collections over them
# during the imports and walked them again in each full collection after (0.25 s and 0.23 s of a DeepSeek-V3
# predict's critical path, read off gc.callbacks). The console script turns it off while it imports, then freezes
# what the imports made (gc.freeze: out of every later collection) and turns it back on: the command's own garbage
# is collected as before, its youngest generation every 10,000 new objects instead of 700: the command's objects are
# mostly long-lived (traces, fake-cache entries, unit models), and the default threshold ran a job plan's collector
# 340 times, two of them full collections (0.14-0.17 s of its main process, against 0.07 s with 20 collections).
# Recorded steps pause the collector (remat.memory.measure), so when it runs changes no answer. A library user's
# process is left as it is.
YOUNG_GENERATION_THRESHOLD = 10_000


@contextlib.contextmanager
def console_imports() -> Iterator[None]:
    """What the console script sets up around its imports (a library user's process is left as it is): OpenMP's
    spin count, torch._dynamo and the torch packages no command reads deferred (remat.lazy_torch), the collector off
    while importing and what the imports made frozen after (NOTE [the collector and the imports]), and torch's
    lookup of dispatch rules in one call (NOTE [dispatch rules in one call]).
    benchmarks/profile_cli.py imports the same way, to time a command as the console runs it."""
    if "OMP_WAIT_POLICY" not in os.environ:
        # read once, when torch loads libgomp: a waiting OpenMP thread spins 1,000 times before it sleeps (libgomp's
        # own count for threads outnumbering the CPUs; libgomp manual, GOMP_SPINCOUNT), not 300,000: beside another
        # busy process the spinning held the core it needed (remat explain's answer 31 s -> 22 s on 2 cores, and
        # 50 s -> 19 s beside a test run); alone the sleeps cost about 3 s of its 15
        os.environ.setdefault("GOMP_SPINCOUNT", "1000")
    from remat.lazy_torch import defer_torch

    defer_torch()  # the whole compiler only for a command that compiles, and so on (remat.lazy_torch)
    gc.disable()
    try:
        yield
        from remat.memory.dispatch_rules import fast_dispatch_rules

        fast_dispatch_rules()  # before any operator is dispatched (NOTE [dispatch rules in one call])
    finally:
        gc.freeze()
        gc.set_threshold(YOUNG_GENERATION_THRESHOLD, *gc.get_threshold()[1:])
        gc.enable()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``remat`` command line with ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    console = argv is None and os.path.basename(sys.argv[0]) == "remat"
    argv = list(sys.argv[1:] if argv is None else argv)
    key = answer_key(argv)
    answer = stored_answer(key) if key is not None else None
    if answer is not None:
        return replay(answer)
    if console:
        with console_imports():
            from remat.cli.commands import run
    else:
        from remat.cli.commands import run

    with recording(key) as result:
        result["code"] = run(argv, console=console)
    if console:
        exit_now(result["code"])
    return result["code"]


# NOTE [the console's exit]: once a command has returned, the interpreter's teardown clears every module and frees,
# one by one, the million or so objects that torch's import and the command's traces made: 0.15-0.19 s of every cold
# command on a 2-core machine (medians of 6 of a Llama-3-70B CP2 predict, from main's return to the process's end:
# 0.19 s, against 0.04 s without the teardown), none of it the command's. The console script instead flushes its
# output, runs the exit handlers (atexit's: multiprocessing's, logging's, temporary folders' finalizers, a coverage
# tool's) and ends the process with os._exit. Where another thread
# still runs (the teardown would wait for it), an output cannot be flushed (the usual exit reports it) or the
# interpreter has no atexit._run_exitfuncs, it exits as usual.
def exit_now(code: int) -> None:
    """End the console script's process with ``code`` without the interpreter's teardown (NOTE [the console's
    exit]); returns, doing nothing, where that would lose work or output."""
    run_exit_handlers = getattr(atexit, "_run_exitfuncs", None)
    if run_exit_handlers is None or threading.active_count() > 1:
        return
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):  # a closed pipe or stream: the usual exit says so
        return
    run_exit_handlers()
    os._exit(code)
