"""remat.plan.job_exact.predict_policies: a job's stages predicted side by side, alike stages handed to the same
forked workers once their shallow traces have come back, with their caching-allocator replays (NOTE [alike stages
ahead]), the same as one after the other."""

from __future__ import annotations

import multiprocessing
import os

import pytest

import remat.memory.replay_pool as replay_pool
import remat.parallel.chunk_trace as chunk_trace
import remat.plan.job_exact as job_exact
from remat.config import ModelConfig
from remat.job import Job
from remat.memory.trace_pool import WORKERS_ENV
from remat.policy import Policy

CONFIG = ModelConfig(num_layers=12, hidden_size=64, num_attention_heads=4, seq_length=64, micro_batch_size=2,
                     vocab_size=128, attention="sdpa")
# stages 1-4 hold alike chunks: one of them is predicted in the first round, three per policy in the second
JOB = Job.build(CONFIG, precision="bf16", pp=6, num_microbatches=8, dp=2, distributed_optimizer=True)
POLICIES = [Policy(), Policy("full", "uniform", 1)]


def _figures(predictions):
    return [[(r.stage, r.timeline.to_dict(), r.reserved) for r in p.ranks] for p in predictions]


def test_alike_stages_predicted_and_replayed_in_workers_are_those_made_here(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(WORKERS_ENV, "1")
    here = job_exact.predict_policies(JOB, POLICIES)
    assert all(r.reserved is not None for p in here for r in p.ranks)  # GPU kernels: every rank replayed

    rounds, run_forked, parent = [], job_exact.run_forked, os.getpid()
    real_figures = replay_pool.reserved_figures

    def forked(tasks, workers=None, on_result=None, **waiting):
        rounds.append(len(tasks))
        return run_forked(tasks, workers, on_result, **waiting)

    def replayed_in_a_worker(timeline, allocator=None):  # every replay is made beside its prediction
        assert os.getpid() != parent, "a rank was replayed in the parent, not in the worker that predicted it"
        return real_figures(timeline, allocator)

    monkeypatch.setattr(job_exact, "run_forked", forked)
    monkeypatch.setattr(replay_pool, "reserved_figures", replayed_in_a_worker)
    monkeypatch.setenv(WORKERS_ENV, "2")
    side_by_side = job_exact.predict_policies(JOB, POLICIES)
    assert rounds == [12]  # first, one middle, last stage per policy, and the other middle stages: one fork
    assert _figures(side_by_side) == _figures(here)


def test_alike_stages_lay_out_the_shallow_traces_their_group_made(monkeypatch: pytest.MonkeyPatch) -> None:
    # four layers a stage: each chunk is laid out from a shallow trace of three (NOTE [composing a chunk trace]); a
    # width of its own, so that no trace kept from another test stands in
    job = Job.build(CONFIG.replace(num_layers=24, hidden_size=80), precision="bf16", pp=6, num_microbatches=8, dp=2,
                    distributed_optimizer=True)
    traced = multiprocessing.Value("i", 0)  # shared with the forked workers
    build = chunk_trace.build_stage_module

    def counted(*args, **kwargs):  # each chunk trace builds its module once
        with traced.get_lock():
            traced.value += 1
        return build(*args, **kwargs)

    monkeypatch.setattr(chunk_trace, "build_stage_module", counted)
    monkeypatch.setenv(WORKERS_ENV, "2")
    side_by_side = job_exact.predict_policies(job, POLICIES)
    # per policy the first, one middle and the last stage trace their shallow chunks; the three other middle stages,
    # whichever worker takes them, lay out the middle one's (sent along), tracing nothing
    assert traced.value == 6
    monkeypatch.setenv(WORKERS_ENV, "1")
    assert _figures(side_by_side) == _figures(job_exact.predict_policies(job, POLICIES))
