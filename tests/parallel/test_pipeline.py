"""Tests for pipeline-parallel memory: remat.parallel (schedules, per-microbatch composition, prediction),
remat.parallel.launch (real multi-process runs on CPU gloo); the pipeline flags of the commands are tested in
tests/cli/.

The real runs launch worker processes (a few seconds each, most of it importing torch); they are few and share
launches: one launch measures several policies.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from remat.config import ModelConfig
from remat.memory.compose import CompositionError
from remat.memory.predict import trace as _trace
from remat.parallel.chunk_trace import trace_chunk
from remat.parallel.launch import DistributedError
from remat.parallel.pipeline_measure import measure_pipeline, measure_pipeline_many
from remat.parallel.pipeline_predict import Composer as _Composer
from remat.parallel.pipeline_predict import predict_pipeline, single_stage_difference
from remat.parallel.pipeline_report import in_flight_at, peak_error, same_step
from remat.parallel.schedule import (
    Action,
    PipelineError,
    checkpointed_forwards,
    chunk_layout,
    in_flight_profile,
    max_in_flight,
    partition,
    schedule_actions,
    warmup_forwards,
)
from remat.parallel.stages import parse_phase_detail
from remat.policy import Policy

SMALL = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, micro_batch_size=2,
                    vocab_size=128)
EIGHT = SMALL.replace(num_layers=8)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# ------------------------------------------------------------------------------------------------ schedules
@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 4), (3, 7)])
def test_1f1b_warmup_and_in_flight(pp, m):
    for rank in range(pp):
        acts = schedule_actions("1f1b", pp, m, rank=rank)
        assert warmup_forwards("1f1b", pp, m, rank=rank) == min(pp - rank - 1, m)
        first_b = next(i for i, a in enumerate(acts) if a.kind == "B")
        assert first_b == min(pp - rank - 1, m) + 1  # warm-ups, then one forward before the first backward
        assert max_in_flight(acts) == min(pp - rank, m)  # stage 0 holds pp microbatches, the last one
        _check_each_once(acts, m, chunks=[rank])


def test_1f1b_megatron_allows_fewer_microbatches_than_stages():
    assert [warmup_forwards("1f1b", 4, 2, rank=r, runtime="megatron") for r in range(4)] == [2, 2, 1, 0]
    assert [max_in_flight(schedule_actions("1f1b", 4, 2, rank=r, runtime="megatron")) for r in range(4)] == [2, 2, 2, 1]


def test_gpipe_holds_every_microbatch():
    acts = schedule_actions("gpipe", 3, 5, rank=1)
    assert [a.kind for a in acts] == ["F"] * 5 + ["B"] * 5
    assert max_in_flight(acts) == 5 and warmup_forwards("gpipe", 3, 5, rank=1) == 5


@pytest.mark.parametrize("pp,vpp,m", [(2, 2, 4), (4, 2, 8), (2, 3, 6), (4, 2, 12)])
def test_interleaved_warmup_is_megatrons(pp, vpp, m):
    for rank in range(pp):
        acts = schedule_actions("interleaved", pp, m, vpp, rank)
        warm = min((pp - rank - 1) * 2 + (vpp - 1) * pp, m * vpp)
        assert warmup_forwards("interleaved", pp, m, vpp, rank) == warm
        assert next(i for i, a in enumerate(acts) if a.kind == "B") == warm + (1 if warm < m * vpp else 0)
        assert max_in_flight(acts) == min(warm + 1, m * vpp)
        _check_each_once(acts, m, chunks=[rank + c * pp for c in range(vpp)])
        # Megatron's virtual microbatch order: groups of pp microbatches per chunk, chunks in order
        forwards = [a for a in acts if a.kind == "F"]
        assert [(a.chunk, a.microbatch) for a in forwards[:pp]] == [(rank, i) for i in range(pp)]
        if vpp > 1:
            assert [(a.chunk, a.microbatch) for a in forwards[pp:2 * pp]] == [(rank + pp, i) for i in range(pp)]
        backwards = [a for a in acts if a.kind == "B"]
        assert backwards[0].chunk == rank + (vpp - 1) * pp  # backward starts from the last chunk


def test_interleaved_warmup_with_microbatches_equal_to_stages_is_the_formula_in_both_runtimes():
    # Megatron at d98e8a64 no longer runs every forward first when m == pp (tests/parallel/test_megatron_interleaved.py)
    assert warmup_forwards("interleaved", 4, 4, 2, 3, runtime="megatron") == 4
    assert warmup_forwards("interleaved", 4, 4, 2, 3, runtime="torch") == 4


def _check_each_once(acts: list[Action], m: int, chunks: list[int]) -> None:
    assert sorted((a.chunk, a.microbatch) for a in acts if a.kind == "F") == [(c, i) for c in chunks for i in range(m)]
    done: set[tuple[int, int]] = set()
    for a in acts:
        if a.kind == "F":
            done.add((a.chunk, a.microbatch))
        else:
            assert (a.chunk, a.microbatch) in done  # a backward follows its forward
    assert in_flight_profile(acts)[-1] == 0


def test_partial_checkpoint_rule_is_megatrons():
    acts = schedule_actions("1f1b", 4, 8, rank=0)
    window = warmup_forwards("1f1b", 4, 8, rank=0) + 1  # max_outstanding_backprops = 4
    ckpt = checkpointed_forwards(acts, 1, window)
    # forward k is checkpointed iff k % window >= N: microbatches 0 and 4 keep everything
    assert [ckpt[(0, i)] for i in range(8)] == [False, True, True, True, False, True, True, True]
    assert all(checkpointed_forwards(acts, None, window).values())
    assert not any(checkpointed_forwards(acts, 4, window).values())


# ------------------------------------------------------------------------------------------------ partition
def test_partition_even_and_layout():
    specs = partition(EIGHT, 2, 2)
    assert [(s.index, s.layer_offset, s.num_layers, s.rank(2)) for s in specs] == [
        (0, 0, 2, 0), (1, 2, 2, 1), (2, 4, 2, 0), (3, 6, 2, 1)]
    assert specs[0].is_first and specs[-1].is_last and not specs[1].is_first
    assert chunk_layout(8, 2, layout=[3, 5]) == [3, 5]


@pytest.mark.parametrize("kwargs,words", [
    ({"num_layers": 6, "pp": 4}, ["not divisible by pp * vpp", "layout"]),
    ({"num_layers": 8, "pp": 2, "layout": [3, 4]}, ["adds up to 7", "num_layers=8"]),
    ({"num_layers": 8, "pp": 2, "layout": [8]}, ["1 entries", "2 model chunks"]),
    ({"num_layers": 8, "pp": 2, "layout": [0, 8]}, ["at least one layer"]),
    ({"num_layers": 8, "pp": 0}, ["pp=0", "positive integer"]),
])
def test_layout_errors_name_the_fix(kwargs, words):
    with pytest.raises(PipelineError) as err:
        chunk_layout(**kwargs)
    for word in words:
        assert word in str(err.value)


def test_tied_embeddings_refused_across_stages():
    with pytest.raises(PipelineError, match="tie_embeddings=False"):
        partition(SMALL.replace(tie_embeddings=True), 2)
    assert len(partition(SMALL.replace(tie_embeddings=True), 1)) == 1


# ------------------------------------------------------------------------------------------------ prediction
@pytest.mark.parametrize("policy", ["none", "full/uniform/1", "full/uniform/2@non-reentrant", "full/block/1",
                                    "selective/core_attn+mlp"])
def test_one_stage_one_microbatch_is_the_plain_step(policy):
    if policy == "full/uniform/1":  # the library's own check (the same comparison as below: once is enough)
        assert single_stage_difference(SMALL, policy) is None
    (composed,) = predict_pipeline(SMALL, policy, 1, 1)
    plain = _trace(SMALL, policy)
    # the pipeline keeps the loss in its loss list until the step ends; the plain trace keeps it past the end
    n = plain.num_events
    trailing = sum(1 for f in composed.free_at if f >= n)
    assert composed.num_events == n + trailing
    assert composed.nbytes == plain.nbytes and composed.alloc_at == plain.alloc_at
    assert [f if f < n else -1 for f in composed.free_at] == plain.free_at
    assert composed.category == plain.category
    assert composed.peak_bytes == plain.peak_bytes and composed.at_peak == plain.at_peak
    assert composed.meta["flops"] == plain.meta["flops"]


def test_phases_name_microbatch_and_chunk():
    stages = predict_pipeline(EIGHT, "full/uniform/2", 2, 4, "interleaved", 2)
    tl = stages[1]
    seen = {parse_phase_detail(p.detail) for p in tl.phases} - {None}
    assert seen == {(mb, c) for mb in range(4) for c in (1, 3)}
    regions = {p.region for p in tl.phases if p.region.startswith("layer ")}
    assert regions == {"layer 2", "layer 3", "layer 6", "layer 7"}  # global layer indices of chunks 1 and 3
    assert any(p.kind == "recompute" and "group 0 (layers 0-1)" in p.detail for p in tl.phases)
    assert tl.meta["pipeline"]["chunks"] == [1, 3] and tl.meta["pipeline"]["stage"] == 1
    tl.validate()


def test_in_flight_at_peak_follows_the_schedule():
    one_f = predict_pipeline(EIGHT, "none", 4, 8, "1f1b")
    assert [t.meta["pipeline"]["peak"]["in_flight"] for t in one_f] == [4, 3, 2, 1]
    assert [t.meta["pipeline"]["max_in_flight"] for t in one_f] == [4, 3, 2, 1]
    gpipe = predict_pipeline(EIGHT, "none", 4, 8, "gpipe")
    assert all(t.meta["pipeline"]["peak"]["in_flight"] == 8 for t in gpipe)
    assert one_f[0].peak_bytes > one_f[-1].peak_bytes - one_f[-1].at_peak["head_loss"]
    assert gpipe[0].peak_bytes > one_f[0].peak_bytes
    why = one_f[0].meta["why"]
    assert "4 microbatches in flight" in why and "1F1B runs 3 warm-up forwards" in why
    alive = one_f[0].meta["pipeline"]["peak"]["alive"]
    assert len({a["microbatch"] for a in alive}) == 4 and all(a["bytes"] > 0 for a in alive)


def test_in_flight_multiplies_the_saved_activations():
    """When its first backward starts, stage r of 1F1B holds pp - r microbatches' saved tensors, each the same
    bytes for identical chunks (stages 1 and 2 of 4 are both middle chunks of two layers)."""
    stages = predict_pipeline(EIGHT, "full/uniform/1", 4, 8, "1f1b")
    held = []
    for tl in stages[1:3]:
        first_backward = next(p.start for p in tl.phases if p.kind == "backward")
        flight, _ = in_flight_at(tl, first_backward - 1)
        per_mb = {sum(v.values()) for v in flight.values()}
        assert len(per_mb) == 1  # every microbatch in flight keeps the same bytes
        held.append((len(flight), per_mb.pop()))
    assert [n for n, _ in held] == [3, 2] and held[0][1] == held[1][1]


def test_partial_checkpointing_sits_between_none_and_the_policy():
    none = predict_pipeline(EIGHT, "none", 4, 8)
    full = predict_pipeline(EIGHT, "full/uniform/1", 4, 8)
    part = predict_pipeline(EIGHT, "full/uniform/1", 4, 8, partial_checkpoint_microbatches=1)
    nothing = predict_pipeline(EIGHT, "full/uniform/1", 4, 8, partial_checkpoint_microbatches=8)
    everything = predict_pipeline(EIGHT, "full/uniform/1", 4, 8, partial_checkpoint_microbatches=0)
    for a, b in zip(nothing, none):
        assert a.peak_bytes == b.peak_bytes
    for a, b in zip(everything, full):
        assert same_step(a, b) is None
    for p, lo, hi in zip(part[:-1], full, none):  # the last stage holds one microbatch: it is never checkpointed
        assert lo.peak_bytes < p.peak_bytes < hi.peak_bytes
    assert part[-1].peak_bytes == none[-1].peak_bytes


def test_megatron_runtime_frees_sent_outputs():
    torch_rt = predict_pipeline(EIGHT, "full/uniform/1", 4, 8, runtime="torch")
    megatron = predict_pipeline(EIGHT, "full/uniform/1", 4, 8, runtime="megatron")
    for a, b in zip(torch_rt, megatron):
        assert a.meta["pipeline"]["max_in_flight"] == b.meta["pipeline"]["max_in_flight"]
        # no receive buffer per microbatch, no batch of all microbatches, no outputs kept by send handles
        assert b.peak_bytes < a.peak_bytes
    assert len(predict_pipeline(EIGHT, "none", 4, 2, runtime="megatron")) == 4  # m < pp is Megatron-legal


def test_composition_checks_its_frees():
    trace = trace_chunk(SMALL, (False, False, 2), Policy.parse("full/uniform/1"))
    spec = partition(SMALL, 2, 2)[1]
    composer = _Composer()
    with pytest.raises(CompositionError, match="comes before its forward"):
        composer.segment(trace.backward_first, spec, 0, "", "B")
    composer = _Composer()
    composer.phase("setup", "")
    composer.segment(trace.forward, spec, 0, "", "F")
    rows, seg = composer.forward_rows[(spec.index, 0)]
    freed = next(ordinal for _, where, ordinal, _ in trace.backward_first.frees if where == "F")
    bad = type(seg)(**{**seg.__dict__, "nbytes": list(seg.nbytes)})
    bad.nbytes[freed] += 4  # the forward made another tensor than the backward frees
    composer.forward_rows[(spec.index, 0)] = (rows, bad)
    with pytest.raises(CompositionError, match="does not find its tensor"):
        composer.segment(trace.backward_first, spec, 0, "", "B")


@pytest.mark.parametrize("call,words", [
    (lambda: predict_pipeline(SMALL, "none", 4, 2, "1f1b"), ["microbatches >= 4", "gpipe"]),
    (lambda: predict_pipeline(EIGHT, "none", 2, 5, "interleaved", 2), ["divisible by pp", "microbatches=4"]),
    (lambda: predict_pipeline(SMALL, "none", 2, 4, "zigzag"), ["unknown pipeline schedule", "1f1b"]),
    (lambda: predict_pipeline(SMALL, "none", 0, 4), ["pp=0"]),
    (lambda: predict_pipeline(SMALL, "none", 3, 4), ["not divisible", "layout"]),
    (lambda: predict_pipeline(SMALL, "none", 2, 4, "1f1b", vpp=2), ["interleaved"]),
    (lambda: predict_pipeline(SMALL, "none", 2, 4, "interleaved", 1), ["vpp >= 2"]),
    (lambda: predict_pipeline(SMALL, "none", 1, 4, "interleaved", 2), ["pp >= 2"]),
    (lambda: predict_pipeline(SMALL, "full/uniform/4", 2, 4), ["chunk 0 has 2 layers", "<= 2"]),
    (lambda: predict_pipeline(SMALL, "none", 2, 4, partial_checkpoint_microbatches=-1), [">= 0"]),
    (lambda: predict_pipeline(SMALL, "none", 2, 4, runtime="jax"), ["unknown pipeline runtime"]),
    (lambda: measure_pipeline(SMALL, "none", 4, 2), ["microbatches >= 4"]),
])
def test_bad_input_is_refused_with_the_fix(call, words):
    with pytest.raises(PipelineError) as err:
        call()
    for word in words:
        assert word in str(err.value)


# ------------------------------------------------------------------------------------------------ real runs
# One launch measures three policies on 2 stages: nothing recomputed, uniform k=1, uniform k = layers per stage.
REAL_POLICIES = ["none", "full/uniform/1", "full/uniform/2"]


@pytest.fixture(scope="module")
def real_runs():
    start = time.monotonic()
    measured = measure_pipeline_many(SMALL, REAL_POLICIES, 2, 4, "1f1b", timeout=120)
    return measured, time.monotonic() - start


@pytest.mark.parametrize("index", range(len(REAL_POLICIES)))
def test_real_two_stage_run_matches_prediction(real_runs, index):
    measured, _ = real_runs
    stages = measured[index]
    predicted = predict_pipeline(SMALL, REAL_POLICIES[index], 2, 4, "1f1b")
    assert len(stages) == 2
    for real, guess in zip(stages, predicted):
        info = real.meta["pipeline"]
        assert info["order"] == info["expected_order"]  # torch ran the order the prediction lays out
        assert real.meta["backend"] == "cpu" and real.meta["policy"] == REAL_POLICIES[index]
        assert abs(peak_error(real.peak_bytes, guess.peak_bytes)) <= 0.02
        # in fact the whole allocation table is the same, receive buffers and send handles included
        assert same_step(real, guess) is None
        assert np.array_equal(real.live_bytes(), guess.live_bytes())
        assert info["peak"]["in_flight"] == guess.meta["pipeline"]["peak"]["in_flight"]
    assert stages[0].meta["pipeline"]["peak"]["in_flight"] == 2 and stages[1].meta["pipeline"]["peak"]["in_flight"] == 1


def test_real_run_leaves_no_process(real_runs):
    measured, _ = real_runs
    pids = {tl.meta["pid"] for stages in measured for tl in stages}
    assert len(pids) == 2 and not any(_alive(pid) for pid in pids)


def test_real_interleaved_run_matches_prediction():
    """Two chunks of one layer per stage; Megatron's partial recompute leaves the first microbatch of each window
    un-checkpointed."""
    (stages,) = measure_pipeline_many(SMALL, ["full/uniform/1"], 2, 2, "interleaved", 2,
                                      partial_checkpoint_microbatches=1, timeout=120)
    predicted = predict_pipeline(SMALL, "full/uniform/1", 2, 2, "interleaved", 2, partial_checkpoint_microbatches=1)
    for real, guess in zip(stages, predicted):
        assert real.meta["pipeline"]["order"] == real.meta["pipeline"]["expected_order"]
        assert same_step(real, guess) is None


def test_failing_rank_stops_the_run_with_its_message():
    timeout = 60
    start = time.monotonic()
    with pytest.raises(DistributedError) as err:
        measure_pipeline(SMALL, "none", 2, 2, timeout=timeout,
                         fault={"rank": 1, "kind": "raise", "message": "rank one broke on purpose"})
    assert time.monotonic() - start < timeout
    assert err.value.rank == 1 and "rank one broke on purpose" in str(err.value)
    assert "rank 1" in str(err.value)
    assert len(err.value.pids) == 2 and not any(_alive(pid) for pid in err.value.pids)


def test_hung_rank_stops_the_run_within_the_timeout():
    start = time.monotonic()
    with pytest.raises(DistributedError, match="did not finish within 4 s") as err:
        measure_pipeline(SMALL, "none", 2, 2, timeout=4, fault={"rank": 0, "kind": "hang", "when": "start"})
    assert time.monotonic() - start < 4 + 10
    # rank 0 is named once its heartbeat shows no progress (a 4 s run may end while the ranks still start)
    assert err.value.rank in (None, 0) and not any(_alive(pid) for pid in err.value.pids)
