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
