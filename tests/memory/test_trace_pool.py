"""Tests for remat.memory.trace_pool and the shared shallow traces of a sweep (predict_many): traces made side by
side in forked workers are the traces made one by one, byte for byte, and each is handed to on_result once."""

from __future__ import annotations

import pytest
from tiny_models import LLAMA

from remat.memory import predict as predict_module
from remat.memory.predict import predict_many, prepare_shallow_traces
from remat.memory.trace_pool import (
    TIMEOUT_ENV,
    WORKERS_ENV,
    available_workers,
    idle_workers,
    run_forked,
    worker_timeout,
)
from remat.policy import Policy

SWEEP = ["none", "full/uniform/1", "full/uniform/2", "full/uniform/4", "full/block/2", "selective/core_attn"]
FIELDS = ("nbytes", "alloc_at", "free_at", "phase_index", "module", "category", "phases", "num_events")


def _sweep(workers: str, monkeypatch: pytest.MonkeyPatch) -> tuple[int, list]:
    monkeypatch.setenv(WORKERS_ENV, workers)
    predict_module.SHALLOW_TRACES.clear()
    config = LLAMA.replace(num_layers=6)
    policies = [Policy.parse(p) for p in SWEEP]
    traced = prepare_shallow_traces(config, policies)
    return traced, predict_many(config, policies)


def test_a_sweep_traced_side_by_side_equals_one_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    traced, parallel = _sweep("2", monkeypatch)
    assert traced > 1  # the sweep's shallow traces were made by the workers
    assert prepare_shallow_traces(LLAMA.replace(num_layers=6), [Policy()]) == 0  # made already
    _, serial = _sweep("1", monkeypatch)
    for a, b in zip(parallel, serial):
        assert all(getattr(a, f) == getattr(b, f) for f in FIELDS)
        assert a.meta["flops"] == b.meta["flops"] and a.meta.get("composed_from") == b.meta.get("composed_from")


def test_a_failing_task_raises_its_own_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(WORKERS_ENV, "2")

    def boom():
        raise ValueError("the task's own message")

    with pytest.raises(ValueError, match="the task's own message"):
        run_forked([boom, boom])


def test_the_worker_count_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(WORKERS_ENV, "3")
    assert available_workers() == 3
    monkeypatch.setenv(WORKERS_ENV, "many")
    with pytest.raises(ValueError, match="REMAT_TRACE_WORKERS='many'"):
        available_workers()


def test_a_worker_that_sends_nothing_in_time_is_ended_and_its_trace_made_here(monkeypatch: pytest.MonkeyPatch) -> None:
    # a worker killed by the system (or stuck) must not leave the sweep waiting forever
    import os
    import signal

    parent = os.getpid()
    made_here: list[int] = []

    def stuck() -> object:
        if os.getpid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)  # the worker dies without an answer
        made_here.append(1)
        return "traced here"

    monkeypatch.setenv(WORKERS_ENV, "2")
    monkeypatch.setenv(TIMEOUT_ENV, "3")
    assert run_forked([stuck, stuck]) == ["traced here", "traced here"] and made_here == [1, 1]
    monkeypatch.setenv(TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match="REMAT_TRACE_TIMEOUT='soon'"):
        worker_timeout()


def test_forked_tasks_answer_in_order_and_a_failure_is_raised_here(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    parent = os.getpid()
    monkeypatch.setenv(WORKERS_ENV, "2")
    answers = run_forked([lambda i=i: (i, os.getpid() != parent, {"rows": list(range(i))}) for i in range(5)])
    assert answers == [(i, True, {"rows": list(range(i))}) for i in range(5)]  # made by the workers, in order

    def boom():
        raise ValueError("the task's own message")

    with pytest.raises(ValueError, match="the task's own message"):
        run_forked([lambda: 1, boom])
    monkeypatch.setenv(WORKERS_ENV, "1")
    assert run_forked([lambda: os.getpid()]) == [parent]  # one worker: here
    assert idle_workers() == 1
    monkeypatch.delenv(WORKERS_ENV)
    assert 1 <= idle_workers() <= available_workers()


@pytest.mark.parametrize("workers", ["2", "1"])
def test_each_answer_is_handed_over_once_as_it_comes(workers: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(WORKERS_ENV, workers)
    seen: list[tuple[int, int]] = []
    answers = run_forked([lambda i=i: i * i for i in range(6)], on_result=lambda i, a: seen.append((i, a)))
    assert answers == [i * i for i in range(6)] and sorted(seen) == [(i, i * i) for i in range(6)]


@pytest.mark.parametrize("workers", ["2", "1"])
def test_a_waiting_task_runs_after_the_answer_it_builds_on_has_reached_its_worker(
        workers: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    import time

    monkeypatch.setenv(WORKERS_ENV, workers)
    parent = os.getpid()
    received: list[str] = []  # in each worker: the items shared with it so far

    def first(name: str, seconds: float):
        def task() -> str:
            time.sleep(seconds)  # the later first answers last: its waiting task is handed out after the others
            return name
        return task

    def waiting() -> tuple[str, ...]:
        return tuple(received)

    answers = run_forked([first("a", 0.3), first("b", 0.0), waiting, waiting, waiting], after={2: 0, 3: 1, 4: 1},
                         share=lambda answer: [answer] if isinstance(answer, str) else [], receive=received.append)
    assert answers[:2] == ["a", "b"]
    if workers == "1":  # one after the other here: nothing to send, the tasks run in order
        assert answers[2:] == [(), (), ()] and os.getpid() == parent
    else:  # whichever worker took it, each waiting task had its first's answer (each item received once)
        assert "a" in answers[2] and "b" in answers[3] and "b" in answers[4]
        assert all(len(set(a)) == len(a) for a in answers[2:])
    with pytest.raises(ValueError, match="task 1 can wait only for an earlier task, not 2"):
        run_forked([waiting] * 3, after={1: 2})


def test_warm_up_for_dispatch_imports_what_a_first_fake_cache_miss_would_and_keeps_dynamo_deferred() -> None:
    import json
    import subprocess
    import sys

    script = """
import json, sys
from remat.lazy_torch import NAME, defer
defer([NAME])
import torch
from remat.memory.trace_pool import warm_up
heavy = ("sympy", "torch.fx.experimental.symbolic_shapes", "torch.distributed.tensor")
before = [m in sys.modules for m in heavy]
warm_up(dispatch=True)
after = [m in sys.modules for m in heavy]
deferred = type(sys.modules["torch._dynamo"]).__name__ == "_DeferredDynamo"
from torch._subclasses.fake_tensor import FakeTensorMode
known = set(sys.modules)
with FakeTensorMode():
    x = torch.empty(3, 5, requires_grad=True)
    (x.sin() @ torch.empty(5, 2)).sum().backward()
print(json.dumps({"before": before, "after": after, "deferred": deferred,
                  "imported_by_the_trace": sorted(set(sys.modules) - known)}))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["before"] == [False, False, False] and found["after"] == [True, True, True]
    assert found["deferred"]  # the compiler is still not loaded
    assert [m for m in found["imported_by_the_trace"] if m.split(".")[0] in ("sympy", "torch")] == []


def test_idle_cores_measure_from_the_last_sample_instead_of_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    import time

    from remat.memory import trace_pool

    if trace_pool.idle_cores() is None:
        pytest.skip("no /proc/stat here")
    trace_pool.note_cpu()
    time.sleep(0.06)  # the sample is older than the window
    slept: list[float] = []
    real_sleep = time.sleep
    monkeypatch.setattr(trace_pool.time, "sleep", slept.append)
    idle = trace_pool.idle_cores(window=0.05)
    assert slept == [] and idle is not None and 0 <= idle <= (os.cpu_count() or 1)
    assert trace_pool.idle_cores(window=0.05) == idle and slept == []  # asked again at once: the answer just made
    trace_pool.note_cpu()
    trace_pool.idle_cores(window=0.05)
    assert slept == [0.05]  # a sample just taken, and no answer from it: too recent, so it waits
    monkeypatch.setattr(trace_pool, "MAX_SAMPLE_AGE", 0.0)  # too old: it waits too
    real_sleep(0.06)
    trace_pool.idle_cores(window=0.01)
    assert slept == [0.05, 0.01]
    monkeypatch.setattr(trace_pool, "MAX_SAMPLE_AGE", 60.0)
    trace_pool.note_cpu()
    real_sleep(0.06)  # fresh enough, but taken by another process (a forked worker's parent): it waits
    monkeypatch.setattr(trace_pool.os, "getpid", lambda: -1)
    trace_pool.idle_cores(window=0.02)
    assert slept == [0.05, 0.01, 0.02]


def test_idle_cores_count_the_cores_that_ended_workers_kept_busy_as_free(monkeypatch: pytest.MonkeyPatch) -> None:
    """A span measured across a round of forked workers that have ended since: the cores they kept busy are free
    now (their CPU, in this process's ended children's time, counts as its own), not taken."""
    import io
    import os

    from remat.memory import trace_pool

    if trace_pool.idle_cores() is None:
        pytest.skip("no /proc/stat here")
    now = {"t": 100.0, "total": 1000, "idle": 1000, "own": 1.0, "children": 0.0}

    def proc_stat(path: str, *args: object, **kwargs: object) -> io.StringIO:
        assert path == "/proc/stat"
        return io.StringIO(f"cpu  {now['total'] - now['idle']} 0 0 {now['idle']} 0 0 0 0 0 0\n")

    monkeypatch.setattr(trace_pool, "open", proc_stat, raising=False)
    monkeypatch.setattr(trace_pool.os, "times", lambda: os.times_result((now["own"], 0.0, now["children"], 0.0, 0.0)))
    monkeypatch.setattr(trace_pool.time, "monotonic", lambda: now["t"])
    trace_pool.note_cpu()
    # 0.5 s on 2 cores: every tick busy, this process waiting (0.01 s) while its two workers ran 0.45 s each, joined
    now.update(t=100.5, total=1100, own=1.01, children=0.9)
    slept: list[float] = []
    monkeypatch.setattr(trace_pool.time, "sleep", slept.append)
    assert trace_pool.idle_cores(window=0.05) == pytest.approx(1.82) and slept == []
    monkeypatch.undo()
    trace_pool.note_cpu()  # the sample kept for later calls is a real one again
