"""Independent tasks run side by side in forked worker processes, one per core (:func:`run_forked`): fake traces
and a job plan's stage searches.

A sweep's shallow traces (:func:`remat.memory.predict.prepare_shallow_traces`) do not depend on each other; each is
pure Python under ``FakeTensorMode``, so on a machine with two cores two of them take the time of one. Workers
are forked from this process after everything is imported (no second start-up), run one task at a time and send
back its answer pickled; a timeline comes back the same, byte for byte, as traced here. ``REMAT_TRACE_WORKERS``
sets the number of workers (``1``: run in this process). A worker that sends nothing for ``REMAT_TRACE_TIMEOUT``
seconds (default 600: a worker killed by the system, or stuck) is ended, and what it had not sent is run here: a
sweep never waits forever on a worker. :func:`idle_workers` says how many workers are worth forking now.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

WORKERS_ENV = "REMAT_TRACE_WORKERS"
TIMEOUT_ENV = "REMAT_TRACE_TIMEOUT"


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


def idle_workers(window: float = 0.05) -> int:
    """How many processes may work side by side without slowing each other: ``$REMAT_TRACE_WORKERS`` when set,
    else the cores this process may use that stood idle (:func:`idle_cores`; else the one-minute load average), at
    least 1. Forked workers share the CPU time their session gets (Linux's autogroup scheduling): on cores that
    others keep busy they only add their start-up and pickling to the same share, so they are worth it only where a
    core is free."""
    cores = available_workers()
    if os.environ.get(WORKERS_ENV, "").strip() or cores <= 1:
        return cores
    idle = idle_cores(window)
    if idle is None:
        try:
            idle = (os.cpu_count() or cores) - os.getloadavg()[0]
        except OSError:  # no load average either: take the cores to be free
            idle = cores
    return max(1, min(cores, int(idle + 0.5)))


# NOTE [idle cores without waiting]: a sample of /proc/stat's counters and of this process's own CPU time, taken by
# note_cpu() (the command line, once its imports are done) or by the last idle_cores(): a later idle_cores() measures
# from it when it is between ``window`` and MAX_SAMPLE_AGE seconds old, instead of sleeping ``window`` seconds
# (50 ms a call; a job plan asks several times). This process's own work over the span is counted as idle: it waits
# while the workers it forks run. A forked worker does not measure from its parent's sample (its own CPU time starts
# again from zero). The children of this process that ended over the span (a round of forked workers) count as its
# own work: the cores they kept busy are free now, and a span measured across their work had counted them taken (a
# job plan's last replays ran on one core after its search's workers ended: 0.34-0.46 s for its 11 replays,
# 0.24-0.28 s on two, side by side in one process). A job plan (Llama-3-70B, TP8 PP4) first asks 1.4-1.6 s after the
# command line's sample where `import torch` takes 1.2 s, and over 2 s where the machine is slower: up to 5 s old,
# the sample spares a slower machine the wait too, and a span of a few seconds still tells what load the command
# meets.
MAX_SAMPLE_AGE = 5.0
# (monotonic time, total ticks, idle ticks, own CPU seconds, the process that took it, its ended children's CPU seconds)
_SAMPLE: list[tuple[float, int, int, float, int, float]] = []
# the last answer of idle_cores and the time of the sample it ended at (_SAMPLE's): the answer again to a call less
# than ``window`` seconds after that sample (a job plan asked twice within a millisecond, the second waiting 50 ms)
_ANSWER: list[tuple[float, float]] = []


def note_cpu() -> None:
    """Keep a sample of the machine's and this process's CPU counters for the next :func:`idle_cores` (NOTE [idle
    cores without waiting]); nothing where /proc/stat is unreadable."""
    found = _cpu_sample()
    if found is not None:
        _SAMPLE[:] = [found]


def _cpu_sample() -> tuple[float, int, int, float, int, float] | None:
    try:
        with open("/proc/stat", encoding="ascii") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    except (OSError, ValueError):
        return None
    if len(ticks) < 5:
        return None
    own = os.times()
    return (time.monotonic(), sum(ticks), ticks[3] + ticks[4], own.user + own.system, os.getpid(),
            own.children_user + own.children_system)


def idle_cores(window: float = 0.05) -> float | None:
    """Cores of the machine that stood idle, this process's own work counted as idle, from ``/proc/stat``'s
    counters: since the last sample (:func:`note_cpu`, or the last call) when it is ``window`` to
    :data:`MAX_SAMPLE_AGE` seconds old, else over the next ``window`` seconds (this process waiting meanwhile), the
    work of its children that ended meanwhile counted as its own; the last call's answer again when it is less than
    ``window`` seconds old; None where /proc/stat is unreadable (not Linux)."""
    first = _SAMPLE[0] if _SAMPLE and _SAMPLE[0][4] == os.getpid() else None
    if first is not None and time.monotonic() - first[0] < window and _ANSWER and _ANSWER[0][0] == first[0]:
        return _ANSWER[0][1]  # measured by the last call, just now
    if first is None or not window <= time.monotonic() - first[0] <= MAX_SAMPLE_AGE:
        first = _cpu_sample()
        time.sleep(window)
    second = _cpu_sample()
    if first is None or second is None or second[1] <= first[1]:
        return None
    _SAMPLE[:] = [second]
    cores = os.cpu_count() or 1
    # the cores this process, and the children of it that have ended, kept busy meanwhile
    own = (second[3] - first[3] + second[5] - first[5]) / max(second[0] - first[0], 1e-9)
    _ANSWER[:] = [(second[0], float(min(cores, (second[2] - first[2]) / (second[1] - first[1]) * cores + own)))]
    return _ANSWER[0][1]


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


def _worker_start() -> None:
    import torch

    torch.set_num_threads(1)  # fake tensors compute nothing; never touch an OpenMP pool made before the fork


def _made(index: int, answer: Any, on_result: Callable[[int, Any], None] | None) -> Any:
    if on_result is not None:
        on_result(index, answer)
    return answer


def run_forked(tasks: Sequence[Callable[[], Any]], workers: int | None = None,
               on_result: Callable[[int, Any], None] | None = None, *, after: Mapping[int, int] | None = None,
               share: Callable[[Any], Sequence[Any]] | None = None,
               receive: Callable[[Any], None] | None = None) -> list[Any]:
    """Run ``tasks`` (each returns a picklable answer, e.g. a :class:`~remat.timeline.Timeline`) and return their
    answers in order: side by side in forked worker processes when there are several tasks and several workers
    (:func:`available_workers`), else here, one after the other. Each worker takes the next task when it has sent
    its last answer (the longest tasks listed first end soonest). A task that fails in a worker, or that a worker
    silent for :func:`worker_timeout` seconds had not answered, is run again here, so its error is raised as it
    would be without workers. ``on_result(index, answer)`` is called here with each answer as soon as it is made
    (while the workers go on with the others), each once. The workers are not daemons: a task may fork processes of
    its own (remat.plan.unit_prefetch).

    Tasks may build on what earlier ones made (NOTE [tasks that wait for another's answer]): ``after`` maps a task
    to an earlier one it waits for, ``share(answer)`` picks from each answer the items every worker should have
    (e.g. traces), and ``receive(item)`` runs in a worker on each item it has not had yet, before its next task.
    Here, one after the other, the tasks run in order and share nothing (this process holds it all)."""
    for task, first in (after or {}).items():
        if not 0 <= first < task < len(tasks):
            raise ValueError(f"after: task {task} can wait only for an earlier task, not {first}")
    workers = min(len(tasks), available_workers() if workers is None else workers)
    if workers <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        return [_made(i, task(), on_result) for i, task in enumerate(tasks)]
    warm_up()
    ctx = multiprocessing.get_context("fork")
    todo, answers = ctx.SimpleQueue(), ctx.Queue()
    held, waiting, shared = dict(after or {}), list(range(len(tasks))), []  # shared: pickled items, in order
    # forked: the tasks are inherited, never pickled; only the answers, and the shared items, are
    procs = [ctx.Process(target=_serve, args=(tasks, todo, answers, receive)) for _ in range(workers)]
    for proc in procs:
        proc.start()
    out: list[tuple[bool, Any]] = [(False, None)] * len(tasks)
    answered: set[int] = set()

    def hand_out() -> None:  # every task not waiting for an answer still to come, in order; then the ends
        ready = [i for i in waiting if i not in held or held[i] in answered]
        for index in ready:
            waiting.remove(index)
            todo.put((index, shared))
            if not waiting:  # the last task handed out: then each worker's end
                for _ in range(workers):
                    todo.put(None)

    try:
        hand_out()
        timeout, waited = worker_timeout(), 0.0
        while len(answered) < len(tasks) and waited < timeout:
            try:
                index, data = answers.get(timeout=1.0)
            except queue.Empty:  # all workers gone (killed) or one silent too long: the rest run here
                waited += 1.0
                if not any(proc.is_alive() for proc in procs) and answers.empty():
                    break
                continue
            waited = 0.0
            answered.add(index)
            if data is not None:
                out[index] = (True, _made(index, pickle.loads(data), on_result))
                shared += [pickle.dumps(item) for item in (share(out[index][1]) if share is not None else ())]
            hand_out()
    finally:
        for proc in procs:
            proc.join(0.5)
            if proc.is_alive():
                proc.terminate()
                proc.join()
        answers.close()
    return [answer if ok else _made(i, tasks[i](), on_result) for i, (ok, answer) in enumerate(out)]


# NOTE [tasks that wait for another's answer]: the tasks that wait for nothing are queued at once, in order; a task
# held back (``after``) is queued once the task it waits for has answered, with every item shared so far
# (``share``), behind those queued before; a worker receives each item once and skips those it has had. So a waiting
# task goes to whichever worker is free next, and no worker waits on a round of the others: a job's alike stages,
# laid out from the shallow traces one stage's prediction made, are predicted as soon as those traces come back,
# beside the other stages' traces (remat.plan.job_exact.ExactStages.prefetch).
def _serve(tasks: Sequence[Callable[[], Any]], todo: Any, answers: Any,
           receive: Callable[[Any], None] | None) -> None:
    _worker_start()
    had = 0  # shared items received
    while (handed := todo.get()) is not None:
        index, shared = handed
        try:  # pickled here, so that an answer that cannot be sent is a failure the parent hears of
            if receive is not None:
                for item in shared[had:]:
                    receive(pickle.loads(item))
            had = max(had, len(shared))
            data: bytes | None = pickle.dumps(tasks[index]())
        except Exception:  # the parent runs the task itself (and raises its error there)
            data = None
        answers.put((index, data))
    answers.close()
    answers.join_thread()  # every answer sent before the worker ends


def warm_up(dispatch: bool = False) -> None:
    """What every trace imports and sets up once (torch._dynamo, the fake mode): done before forking, so the
    workers share it instead of each paying for it (a process forked to trace calls it first).

    ``dispatch``: the modules a fake dispatch imports on its first cache miss too (FakeTensorMode._dispatch_impl
    imports torch.fx.experimental.symbolic_shapes and with it sympy; torch's C++ argument parser imports
    torch.distributed.tensor on a fake tensor's first view or copy): about 0.4 s of a 2-core machine, paid here once
    instead of in each process forked after. Worth it where several rounds of processes are forked (a job plan: CPU
    6.3 -> 5.2 s, 0.91x the time); before one round of two workers it lengthens the time (medians of 6: a
    DeepSeek-V3 predict 4.50 -> 4.79 s, the Megatron sweep 3.85 -> 4.09 s, the CPU the same)."""
    import torch._dynamo  # noqa: F401
    from torch._subclasses.fake_tensor import FakeTensorMode

    if dispatch:
        import torch.distributed.tensor  # noqa: F401
        import torch.fx.experimental.symbolic_shapes  # noqa: F401
    FakeTensorMode()
