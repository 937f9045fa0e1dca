"""Reserved memory of every rank of a job (remat.parallel.job_predict.add_reserved): the caching-allocator replay of
each rank's step, with its model state allocated together at event 0 and its microbatches in flight."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from remat.analysis.job_report import format_job_prediction, rank_row
from remat.config import ModelConfig
from remat.job import Job
from remat.memory.alloc_config import AllocatorConfig
from remat.memory.allocator import MIB
from remat.memory.reserved import reserved_figures
from remat.parallel.job_predict import predict_job

CONFIG = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64, micro_batch_size=2,
                     vocab_size=128, attention="sdpa")
JOB = Job.build(CONFIG, precision="bf16", tp=2, sp=True, pp=2, num_microbatches=4, dp=2, distributed_optimizer=True)
EXPANDABLE = AllocatorConfig(expandable_segments=True)


@pytest.fixture(scope="module")
def prediction():
    return predict_job(JOB)


def _rounded_peak(timeline) -> int:
    """The most bytes alive after any event with every row in whole 512-byte blocks (what the allocator hands out
    when it splits every remainder, as expandable segments do)."""
    rounded = copy.copy(timeline)
    rounded.nbytes = [-(-n // 512) * 512 for n in timeline.nbytes]
    return int(rounded.live_bytes().max())


def test_every_rank_of_a_gpu_job_has_its_reserved_figures(prediction):
    for r in prediction.ranks:
        f = r.reserved
        assert f == reserved_figures(r.timeline)  # the replay of the rank's own timeline, default options
        assert f["allocated_peak_bytes"] == r.peak_bytes
        # bytes that add up: reserved >= allocated >= the timeline's peak; what the allocator adds on top is the
        # overhead; at the reserved peak reserved = allocated + cached free blocks (the largest one among them)
        assert f["max_memory_reserved"] >= f["max_memory_allocated"] >= r.peak_bytes
        assert f["overhead_bytes"] == f["max_memory_reserved"] - r.peak_bytes
        assert f["max_memory_reserved"] - f["max_memory_allocated"] <= f["fragmentation_at_peak_bytes"]
        assert 0 <= f["largest_free_block_bytes"] <= f["fragmentation_at_peak_bytes"]
        assert f["max_memory_reserved"] % (2 * MIB) == 0 and f["alloc_conf"] == ""


def test_the_replay_allocates_a_ranks_rows_in_event_order_with_the_model_state_at_event_0(prediction):
    # the model state shares event 0 with the trace's first row: replayed one after the other. With expandable
    # segments every remainder is split off, so the allocated peak is exactly the timeline's peak in 512-byte blocks
    worst = prediction.worst
    assert np.count_nonzero(np.asarray(worst.timeline.alloc_at) == 0) > 1
    expandable = predict_job(JOB, allocator=EXPANDABLE).worst.reserved
    assert expandable["max_memory_allocated"] == _rounded_peak(worst.timeline)
    assert expandable["alloc_conf"] == "expandable_segments:True"
    assert expandable["max_memory_reserved"] >= expandable["max_memory_allocated"]


def test_a_cpu_prediction_is_not_replayed():
    assert all(r.reserved is None for r in predict_job(JOB, kernels="cpu").ranks)


def test_the_report_rows_and_text_carry_the_reserved_figures(prediction):
    row = rank_row(prediction.worst, policy="none")
    assert row["reserved"] == prediction.worst.reserved and row["reserved"]["max_memory_reserved"] > 0
    text = format_job_prediction(prediction, "none")
    assert "reserved" in text.splitlines()[3] and "most reserved: rank" in text  # a column beside the peak


@pytest.mark.parametrize("background", [False, True], ids=["side by side", "beside the next prediction"])
def test_a_large_jobs_ranks_are_replayed_in_other_processes_alike(monkeypatch, prediction, background):
    import remat.memory.replay_pool as replay_pool

    ranks = copy.deepcopy(prediction.ranks)
    for r in ranks:
        r.reserved = None
    monkeypatch.setattr(replay_pool, "PARALLEL_REPLAY_ROWS", 0)  # every job is large
    monkeypatch.setenv("REMAT_TRACE_WORKERS", "2")  # and two cores stand idle: forked workers
    if background:
        replays = replay_pool.BackgroundReplays()
        replays.add(ranks[:1])
        replays.add(ranks[1:])  # the first child is collected before the second starts
        assert len(replays.pending) == 1 and ranks[0].reserved == prediction.ranks[0].reserved
        replays.wait()
    else:
        replay_pool.replay_now(ranks)
    assert [r.reserved for r in ranks] == [r.reserved for r in prediction.ranks]


def test_the_replays_a_child_does_not_send_are_made_here(monkeypatch, prediction):
    import os

    import remat.memory.replay_pool as replay_pool

    ranks = copy.deepcopy(prediction.ranks)
    assert len(ranks) >= 2
    for r in ranks:
        r.reserved = None
    parent, real, calls = os.getpid(), replay_pool.reserved_figures, []

    def dies_in_the_child_after_one(timeline, allocator=None):  # the child sends its first figures, then dies
        calls.append(timeline)
        if os.getpid() != parent and len(calls) > 1:
            os._exit(1)
        return real(timeline, allocator)

    monkeypatch.setattr(replay_pool, "reserved_figures", dies_in_the_child_after_one)
    monkeypatch.setattr(replay_pool, "PARALLEL_REPLAY_ROWS", 0)
    monkeypatch.setenv("REMAT_TRACE_WORKERS", "2")
    replays = replay_pool.BackgroundReplays()
    replays.add(ranks)
    assert len(replays.pending) == 1
    replays.wait()
    assert not replays.pending and [r.reserved for r in ranks] == [r.reserved for r in prediction.ranks]
