"""Megatron's interleaved (virtual pipeline) schedule at d98e8a64, against tables derived by hand from
megatron/core/pipeline_parallel/schedules.py: get_pp_rank_microbatches (warm-up count), get_schedule_table (the
order of (microbatch, chunk) forwards) and get_model_chunk_id(k, forward=False) (backward k runs the same
microbatch on the mirrored chunk)."""

from __future__ import annotations

import pytest

from remat.config import ModelConfig
from remat.parallel.pipeline_predict import predict_pipeline
from remat.parallel.pipeline_report import in_flight_at
from remat.parallel.schedule import (
    PipelineError,
    in_flight_profile,
    max_in_flight,
    schedule_actions,
    schedule_table,
    warmup_forwards,
)

TINY = ModelConfig(num_layers=12, hidden_size=64, num_attention_heads=4, seq_length=32, micro_batch_size=2,
                   vocab_size=512, tie_embeddings=False)


def _order(pp: int, m: int, vpp: int, rank: int, group: int | None = None) -> str:
    acts = schedule_actions("interleaved", pp, m, vpp, rank, runtime="megatron", group=group)
    return " ".join(f"{a.kind}{a.microbatch}c{a.chunk}" for a in acts)


def _most_alive(pp: int, m: int, vpp: int, rank: int, chunk: int, group: int | None = None) -> int:
    """The most microbatches of ``chunk`` whose forward has run and backward has not."""
    alive, most = set(), 0
    for a in schedule_actions("interleaved", pp, m, vpp, rank, runtime="megatron", group=group):
        if a.chunk == chunk:
            (alive.add if a.kind == "F" else alive.discard)(a.microbatch)
            most = max(most, len(alive))
    return most


def test_pp4_vpp3_m4_is_megatrons():
    # warm-up (pp - r - 1) * 2 + (vpp - 1) * pp = 14, 12, 10, 8, capped at m * vpp = 12: m == pp no longer runs
    # every forward first (that rule left Megatron with the tunable schedule)
    assert [warmup_forwards("interleaved", 4, 4, 3, r, "megatron") for r in range(4)] == [12, 12, 10, 8]
    assert [max_in_flight(schedule_actions("interleaved", 4, 4, 3, r, runtime="megatron")) for r in range(4)] == [
        12, 12, 11, 9]
    assert _order(4, 4, 3, 3) == (
        "F0c3 F1c3 F2c3 F3c3 F0c7 F1c7 F2c7 F3c7 "
        "F0c11 B0c11 F1c11 B1c11 F2c11 B2c11 F3c11 B3c11 "
        "B0c7 B1c7 B2c7 B3c7 B0c3 B1c3 B2c3 B3c3")
    assert _order(4, 4, 3, 2) == (
        "F0c2 F1c2 F2c2 F3c2 F0c6 F1c6 F2c6 F3c6 F0c10 F1c10 "
        "F2c10 B0c10 F3c10 B1c10 "
        "B2c10 B3c10 B0c6 B1c6 B2c6 B3c6 B0c2 B1c2 B2c2 B3c2")
    assert _most_alive(4, 4, 3, 3, chunk=11) == 1  # the loss chunk holds one microbatch's logits at a time


def test_pp4_vpp2_m8_is_megatrons():
    assert [warmup_forwards("interleaved", 4, 8, 2, r, "megatron") for r in range(4)] == [10, 8, 6, 4]
    assert [max_in_flight(schedule_actions("interleaved", 4, 8, 2, r, runtime="megatron")) for r in range(4)] == [
        11, 9, 7, 5]
    assert _order(4, 8, 2, 3) == (
        "F0c3 F1c3 F2c3 F3c3 "
        "F0c7 B0c7 F1c7 B1c7 F2c7 B2c7 F3c7 B3c7 "
        "F4c3 B0c3 F5c3 B1c3 F6c3 B2c3 F7c3 B3c3 "
        "F4c7 B4c7 F5c7 B5c7 F6c7 B6c7 F7c7 B7c7 "
        "B4c3 B5c3 B6c3 B7c3")
    assert _most_alive(4, 8, 2, 3, chunk=7) == 1


def test_torch_runtime_keeps_its_order():
    # torch's Interleaved1F1B runs the same warm-up (groups of pp); the default group gives the same table
    for rank in range(4):
        assert _order(4, 8, 2, rank) == " ".join(
            f"{a.kind}{a.microbatch}c{a.chunk}" for a in schedule_actions("interleaved", 4, 8, 2, rank))


def test_microbatch_groups():
    # schedules.py:989 get_schedule_table: the docstring's PP2 N3 M5 VP2 example
    assert schedule_table(5, 2, 3) == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1), (3, 0), (4, 0), (3, 1), (4, 1)]
    assert schedule_table(9, 2, 5)[10:] == [(5, 0), (6, 0), (7, 0), (8, 0), (5, 1), (6, 1), (7, 1), (8, 1)]
    # Megatron's tunable_overlap test: pp=4, vpp=3, m=5, group 5: the group replaces pp in the warm-up
    assert [warmup_forwards("interleaved", 4, 5, 3, r, "megatron", group=5) for r in range(4)] == [15, 14, 12, 10]
    acts = schedule_actions("interleaved", 4, 5, 3, 3, runtime="megatron", group=5)
    assert " ".join(f"{a.kind}{a.microbatch}c{a.chunk}" for a in acts[:12]) == (
        "F0c3 F1c3 F2c3 F3c3 F4c3 F0c7 F1c7 F2c7 F3c7 F4c7 F0c11 B0c11")
    assert in_flight_profile(acts)[-1] == 0 and max_in_flight(acts) == 11
    assert _most_alive(4, 5, 3, 3, chunk=11, group=5) == 1


@pytest.mark.parametrize("m,group,runtime,words", [
    (8, 3, "megatron", ["[pp, microbatches] = [4, 8]"]),
    (8, 9, "megatron", ["[pp, microbatches] = [4, 8]"]),
    (8, 5, "megatron", ["last group of 3 < pp=4", "microbatches=5 or 10"]),
    (8, 4, "torch", ["runtime='megatron'"]),
])
def test_microbatch_group_refusals(m, group, runtime, words):
    with pytest.raises(PipelineError) as err:
        schedule_actions("interleaved", 4, m, 2, 0, runtime=runtime, group=group)
    for w in words:
        assert w in str(err.value)


@pytest.mark.parametrize("vpp,m", [(3, 4), (2, 8)])
def test_last_stage_peak_holds_one_loss(vpp, m):
    """The composed last stage keeps the loss chunk's saved tensors of one microbatch at its peak (before the fix
    of m == pp it ran every forward first and kept all four)."""
    tl = predict_pipeline(TINY.replace(num_layers=4 * vpp), "none", 4, m, "interleaved", vpp, runtime="megatron")[-1]
    flight, _ = in_flight_at(tl, tl.peak_event)
    last = 4 * vpp - 1
    heads = [mb for (mb, chunk), parts in flight.items() if chunk == last and parts.get("head_loss")]
    assert len(heads) == 1, (tl.meta["pipeline"]["order"], flight)
    assert tl.meta["pipeline"]["warmup_forwards"] == (vpp - 1) * 4



def test_each_chunk_keeps_its_last_input_and_its_grad():
    """NOTE [the model's last input]: every chunk's model keeps the input of its latest forward (set_input_tensor,
    transformer_block.py:463) with its ``.grad`` (schedules.py:561, 591), so after the step each chunk that receives
    its input (all but rank 0's first) still holds one input and one input gradient, and the step starts with the
    previous step's until the chunk's first forward."""
    pp, vpp, m = 4, 3, 4
    act = TINY.micro_batch_size * TINY.seq_length * TINY.hidden_size * TINY.torch_dtype.itemsize
    for rank, tl in enumerate(predict_pipeline(TINY, "none", pp, m, "interleaved", vpp, runtime="megatron")):
        receiving = [c for c in range(rank, pp * vpp, pp) if c != 0]
        # after the step: the parameters' .grad (no DDP here) and, per receiving chunk, its input and input grad
        end = [i for i in tl.alive_at(tl.num_events - 1) if tl.category[i] not in ("parameters", "gradients")]
        inputs = sorted(tl.module[i] for i in end if tl.module[i].endswith(".recv_activation"))
        assert inputs == sorted(f"pipeline.stage{c}.recv_activation" for c in receiving), (rank, inputs)
        grads = sorted(tl.module[i].split(".")[0] for i in end if not tl.module[i].startswith("pipeline."))
        assert grads == sorted(f"chunk{c}" for c in receiving), (rank, grads)
        assert all(tl.nbytes[i] == act for i in end)
        # the previous step's: alive from the start, freed at the chunk's first forward (set_input_tensor)
        stale = [i for i in range(len(tl.nbytes)) if tl.module[i].endswith(".input_grad")]
        assert sorted(tl.module[i] for i in stale) == sorted(f"pipeline.stage{c}.input_grad" for c in receiving)
        for i in stale:
            chunk = int(tl.module[i].split(".")[1].removeprefix("stage"))
            assert tl.phase_at(tl.alloc_at[i]).label == "setup pipeline"  # before the step's first action
            assert tl.phase_at(tl.free_at[i]).label.endswith(f"[microbatch 0, chunk {chunk}]"), (
                rank, chunk, tl.phase_at(tl.free_at[i]).label)
        assert sum(tl.nbytes[i] for i in end) == 2 * act * len(receiving)
