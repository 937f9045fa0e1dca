"""Independent fake traces made side by side in forked worker processes, one per core (:func:`run_traces`).

A sweep's shallow traces (:func:`remat.memory.predict.prepare_shallow_traces`) do not depend on each other; each is
pure Python under ``FakeTensorMode``, so on a machine with two cores two of them take the time of one. Workers
are forked from this process after everything is imported (no second start-up), run one trace at a time and send
back the timeline's JSON form; the result is the same timeline, byte for byte, as tracing here.
``REMAT_TRACE_WORKERS`` sets the number of workers (``1``: trace in this process). A worker that sends nothing for
``REMAT_TRACE_TIMEOUT`` seconds (default 600: a worker killed by the system, or stuck) ends the pool, and what it
had not sent is traced here: a sweep never waits forever on a worker.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Sequence
from typing import Any

from remat.timeline import Timeline

WORKERS_ENV = "REMAT_TRACE_WORKERS"
TIMEOUT_ENV = "REMAT_TRACE_TIMEOUT"
_TASKS: list[Callable[[], Timeline]] = []  # what the forked workers run (inherited, never pickled)


def available_workers() -> int:
    """How many traces run at once: ``$REMAT_TRACE_WORKERS``, else the cores this process may use; at least 1."""
    text = os.environ.get(WORKERS_ENV, "").strip()
    if text:
        try:
            return max(1, int(text))
        except ValueError:
            raise ValueError(f"{WORKERS_ENV}={text!r}: give a whole number of worker processes (1: none)") from None
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def worker_timeout() -> float:
    """Seconds to wait for a forked worker's next answer: ``$REMAT_TRACE_TIMEOUT``, else 600."""
    text = os.environ.get(TIMEOUT_ENV, "").strip()
    try:
        seconds = float(text) if text else 600.0
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{TIMEOUT_ENV}={text!r}: give the seconds to wait for a trace worker (a positive number)")
    return seconds


def _run(index: int) -> tuple[int, Any, str | None]:
    try:
        return index, _TASKS[index]().to_dict(), None
    except Exception as err:  # reported to the parent, which traces it itself (and raises it there)
        return index, None, f"{type(err).__name__}: {err}"


def _worker_start() -> None:
    import torch

    torch.set_num_threads(1)  # fake tensors compute nothing; never touch an OpenMP pool made before the fork


def run_traces(tasks: Sequence[Callable[[], Timeline]], workers: int | None = None) -> list[Timeline]:
    """Run ``tasks`` (each makes one timeline) and return their timelines in order: in forked workers when there
    are several tasks and several workers (:func:`available_workers`), else here. A task that fails in a worker is
    run again here, so its error is raised as it would be without workers."""
    workers = min(len(tasks), available_workers() if workers is None else workers)
    if workers <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        return [task() for task in tasks]
    _warm_up()
    _TASKS[:] = tasks
    out: list[Timeline | None] = [None] * len(tasks)
    try:
        timeout = worker_timeout()
        with multiprocessing.get_context("fork").Pool(workers, initializer=_worker_start) as pool:
            answers = pool.imap_unordered(_run, range(len(tasks)))
            for _ in range(len(tasks)):
                try:
                    index, data, error = answers.next(timeout)
                except multiprocessing.TimeoutError:  # the pool is ended on leaving; the rest is traced here
                    break
                out[index] = None if error is not None else Timeline.from_dict(data)
    finally:
        _TASKS.clear()
    return [tl if tl is not None else tasks[i]() for i, tl in enumerate(out)]


def _warm_up() -> None:
    """What every trace imports and sets up once (torch._dynamo, the fake mode): done before forking, so the
    workers share it instead of each paying for it."""
    import torch._dynamo  # noqa: F401
    from torch._subclasses.fake_tensor import FakeTensorMode

    FakeTensorMode()
