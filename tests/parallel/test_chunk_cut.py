"""Tests for remat.parallel.chunk_trace.cut_chunk_trace on a chunk trace written by hand: each segment's
allocations in order, its frees (its own tensors, and a backward's of its microbatch's forward) and kept tensors by
ordinal, and the errors that name a free across microbatches or what is made after the last backward."""

from __future__ import annotations

import pytest

from remat.config import ModelConfig
from remat.memory.compose import CompositionError
from remat.parallel.chunk_trace import cut_chunk_trace
from remat.policy import Policy
from remat.timeline import Phase, Timeline

CONFIG = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=16)
KIND = (False, False, 1)
BOUNDS = [2, 4, 6, 10, 14, 18]  # setup end, forward 0 end, forward 1 end, backward 0 end, backward 1 end, end


def chunk(rows: list[tuple[str, int, int, int, str]]) -> Timeline:
    """A chunk trace: (module, bytes, allocated at, freed at, category) per row."""
    phases = [Phase(0, "setup", ""), Phase(2, "forward", "layer 0", "microbatch 0, chunk 0"),
              Phase(4, "forward", "layer 0", "microbatch 1, chunk 0"),
              Phase(6, "backward", "layer 0", "microbatch 0, chunk 0"),
              Phase(10, "backward", "layer 0", "microbatch 1, chunk 0"), Phase(14, "backward", "embedding", "")]
    tl = Timeline(phases=phases, num_events=18)
    for module, nbytes, alloc, free, category in rows:
        tl.add_row(nbytes, alloc, free, module, category)
    return tl


# a parameter and the chunk's input; per microbatch its activation and output (forward), then a temporary, the
# activation freed and the input gradient (backward); the outputs and input gradients freed after the last backward
ROWS = [("w", 64, 0, -1, "parameters"), ("x", 32, 1, -1, "inputs"),
        ("a0", 16, 2, 8, "saved_activations"), ("out0", 8, 3, 14, "outputs"),
        ("a1", 16, 4, 12, "saved_activations"), ("out1", 8, 5, 15, "outputs"),
        ("t0", 4, 6, 7, "temporaries"), ("g0", 32, 9, 16, "gradients"),
        ("t1", 4, 10, 11, "temporaries"), ("g1", 32, 13, 17, "gradients")]
KEPT = [3, 5, 7, 9]


def test_segments_hold_their_allocations_frees_and_kept_tensors_by_ordinal():
    trace = cut_chunk_trace(CONFIG, KIND, Policy(), chunk(ROWS), BOUNDS, 1, KEPT, [0, 5, 5, 7, 7, 0])
    fwd, bwd, bwd_next = trace.forward, trace.backward_first, trace.backward_next
    assert (fwd.nbytes, fwd.module, fwd.alloc_offsets, fwd.frees, fwd.keep) == ([16, 8], ["a0", "out0"], [0, 1], [], 1)
    assert (bwd.nbytes, bwd.module, bwd.alloc_offsets, bwd.keep) == ([4, 32], ["t0", "g0"], [0, 3], 1)
    assert bwd.frees == [(1, "self", 0, 4), (2, "F", 0, 16)]  # its temporary, then its forward's activation
    assert bwd_next.signature() == bwd.signature() and bwd_next.module == ["t1", "g1"]
    assert [p[:2] + p[4:] for p in fwd.phases] == [(0, "forward", 5)] and bwd.num_events == 4
    assert (trace.params, trace.input_bytes, trace.output_bytes) == ([(64, "w", "parameters")], 32, 8)
    assert all(type(v) is int for seg in (fwd, bwd) for v in (*seg.alloc_offsets, *(f[0] for f in seg.frees)))


def test_a_free_of_another_microbatchs_tensor_is_named():
    rows = [r if r[0] not in ("a0", "a1") else (r[0], r[1], r[2], {"a0": 12, "a1": 8}[r[0]], r[4]) for r in ROWS]
    with pytest.raises(CompositionError, match="a free in the backward of microbatch 0 releases a tensor of the "
                                               "forward of microbatch 1"):
        cut_chunk_trace(CONFIG, KIND, Policy(), chunk(rows), BOUNDS, 1, KEPT, [0] * 6)
    rows = [r if r[0] != "w" else ("w", 64, 0, 7, "parameters") for r in ROWS if r[0] != "t0"]
    rows.append(("t0", 4, 6, 11, "temporaries"))  # (the events stay one each: t0 now freed where t1 was)
    rows = [r if r[0] != "t1" else ("t1", 4, 10, 12, "temporaries") for r in rows]
    rows = [r if r[0] != "a1" else ("a1", 16, 4, -1, "saved_activations") for r in rows]
    with pytest.raises(CompositionError, match="releases a tensor of the setup"):
        cut_chunk_trace(CONFIG, KIND, Policy(), chunk(rows), BOUNDS, 1, KEPT, [0] * 6)


def test_what_is_made_or_freed_after_the_last_backward_is_named():
    rows = [r if r[0] != "g1" else ("g1", 32, 13, -1, "gradients") for r in ROWS] + [("late", 2, 17, -1, "other")]
    with pytest.raises(CompositionError, match=r"late \(2 bytes\) is made after the last backward"):
        cut_chunk_trace(CONFIG, KIND, Policy(), chunk(rows), BOUNDS, 1, KEPT, [0] * 6)
    with pytest.raises(CompositionError, match=r"out0 \(8 bytes\) is freed after the last backward"):
        cut_chunk_trace(CONFIG, KIND, Policy(), chunk(ROWS), BOUNDS, 1, [None, 5, 7, 9], [0] * 6)
