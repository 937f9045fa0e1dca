"""The ``remat`` command line. :func:`main` first looks for the command's stored answer
(:mod:`remat.cli.answers`), then parses and runs it (:mod:`remat.cli.commands`); each subcommand lives in a module
of its own. Nothing here imports torch: a stored answer is printed without it."""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
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
# is collected as before. A library user's process is left as it is.
@contextlib.contextmanager
def console_imports() -> Iterator[None]:
    """What the console script sets up around its imports (a library user's process is left as it is): OpenMP's
    spin count, torch._dynamo deferred, the collector off while importing and what the imports made frozen after
    (NOTE [the collector and the imports]). benchmarks/profile_cli.py imports the same way, to time a command as
    the console runs it."""
    if "OMP_WAIT_POLICY" not in os.environ:
        # read once, when torch loads libgomp: a waiting OpenMP thread spins 1,000 times before it sleeps (libgomp's
        # own count for threads outnumbering the CPUs; libgomp manual, GOMP_SPINCOUNT), not 300,000: beside another
        # busy process the spinning held the core it needed (remat explain's answer 31 s -> 22 s on 2 cores, and
        # 50 s -> 19 s beside a test run); alone the sleeps cost about 3 s of its 15
        os.environ.setdefault("GOMP_SPINCOUNT", "1000")
    from remat.lazy_dynamo import defer_dynamo

    defer_dynamo()  # the whole compiler only for a command that compiles (remat.lazy_dynamo)
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
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
    return result["code"]
