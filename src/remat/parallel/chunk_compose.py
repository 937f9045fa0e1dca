"""A deep pipeline chunk's trace laid out from the trace of a shallow chunk (NOTE [composing a chunk trace]).

A chunk trace (:func:`remat.parallel.chunk_trace.trace_chunk`) records setup, the forwards of two microbatches,
then their two backwards. :func:`microbatch_step` cuts it into one microbatch's step (setup, its forward, its
backward), which :func:`remat.memory.compose.compose` lays out for a deeper chunk like any step;
:func:`join_microbatches` puts the two composed steps back in the chunk trace's order.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from remat.memory.compose import CompositionError
from remat.parallel.stages import parse_phase_detail, phase_detail
from remat.timeline import Phase, Timeline

# NOTE [composing a chunk trace]
# Each microbatch's forward and backward free only the tensors of that microbatch (the chunk trace's own check,
# remat.parallel.chunk_trace), so "setup + forward m + backward m" is a step of its own: the events of a one-layer
# deeper chunk differ from it exactly as a deeper model's step does, and remat.memory.compose lays it out from a
# shallow chunk's (layer roles, phase order, every copied free checked). The two composed steps are then put back
# in the chunk trace's order (setup, forward 0, forward 1, backward 0, backward 1, the kept outputs and input
# gradients freed at the end); tests/parallel/test_chunk_compose.py checks the result against full chunk traces,
# event for event.


@dataclass
class MicrobatchStep:
    """One microbatch's step cut from a chunk trace: ``timeline`` (setup, forward, backward) and, for each of its
    rows, the chunk trace's row."""

    timeline: Timeline
    rows: list[int]


def microbatch_step(tl: Timeline, bounds: Sequence[int], microbatch: int, meta: dict) -> MicrobatchStep:
    """Setup, the forward and the backward of ``microbatch`` (0 or 1) of the chunk trace ``tl`` cut at ``bounds``
    (setup end, forward 0 end, forward 1 end, backward 0 end, backward 1 end, end) as one step; ``meta`` is added
    to its timeline's (num_layers and config, which :class:`~remat.memory.compose.ShallowTrace` reads).

    Raises:
        CompositionError: a forward or backward that does not start a phase of its own."""
    setup_end, f0, f1, b0, b1, _ = bounds
    ranges = [(0, setup_end), (setup_end, f0) if microbatch == 0 else (f0, f1),
              (f1, b0) if microbatch == 0 else (b0, b1)]
    starts = [p.start for p in tl.phases]
    flops = tl.meta.get("phase_flops", [0] * len(tl.phases))
    out = Timeline(meta={"phase_flops": [], **meta})
    event_of: dict[int, int] = {}
    phase_of: dict[int, int] = {}
    for lo, hi in ranges:
        first = bisect.bisect_left(starts, lo)
        if hi > lo and (first == len(starts) or starts[first] != lo):
            raise CompositionError(f"the chunk trace's events {lo}..{hi - 1} do not start a phase")
        base = out.num_events - lo
        for p in range(first, bisect.bisect_left(starts, hi)):
            phase_of[p] = len(out.phases)
            phase = tl.phases[p]
            out.phases.append(Phase(phase.start + base, phase.kind, phase.region, phase.detail))
            out.meta["phase_flops"].append(flops[p])
        for e in range(lo, hi):
            event_of[e] = e + base
        out.num_events += hi - lo
    rows = [r for r in range(len(tl)) if tl.alloc_at[r] in event_of]
    for r in rows:
        out.nbytes.append(tl.nbytes[r])
        out.alloc_at.append(event_of[tl.alloc_at[r]])
        out.free_at.append(event_of.get(tl.free_at[r], -1))
        out.phase_index.append(phase_of[tl.phase_index[r]])
        out.module.append(tl.module[r])
        out.category.append(tl.category[r])
    return MicrobatchStep(out, rows)


def _label(tl: Timeline, microbatch: int, chunk: int) -> None:
    """Give every phase but setup its 'microbatch m, chunk c' prefix (compose writes group labels and forward
    details without it), as the chunk trace's recorder does."""
    for i, phase in enumerate(tl.phases):
        if phase.kind != "setup" and parse_phase_detail(phase.detail) is None:
            tl.phases[i] = Phase(phase.start, phase.kind, phase.region, phase_detail(microbatch, chunk, phase.detail))


def _forward_end(tl: Timeline) -> int:
    """The first event of the step's backward (its first backward or recompute phase)."""
    return next((p.start for p in tl.phases if p.kind in ("backward", "recompute")), tl.num_events)


def _moved(events: np.ndarray, starts: tuple[int, int, int], shift: dict[tuple[int, int], int],
           step: int) -> np.ndarray:
    """Each of a composed step's ``events`` where the chunk trace has it: moved by the shift of the span it falls in
    (the step's setup, forward or backward, starting at ``starts``), ``shift[(step, span start)]``."""
    span = np.searchsorted(np.asarray(starts[1:]), events, side="right")
    moved = events.copy()
    for i in np.unique(span).tolist():
        moved[span == i] += shift[(step, starts[i])]
    return moved


def join_microbatches(steps: Sequence[Timeline], sources: Sequence[Sequence[int]], shallow: Timeline,
                      shallow_bounds: Sequence[int], shallow_rows: Sequence[Sequence[int]], kept: Sequence[int | None],
                      chunk: int) -> tuple[Timeline, list[int], list[int | None]]:
    """The deep chunk trace from its two composed microbatch steps.

    Args:
        steps: the composed steps of microbatch 0 and 1 (setup, forward, backward).
        sources: for each step, the shallow step's row that each of its rows copies (compose's ``sources``).
        shallow: the shallow chunk trace; ``shallow_bounds`` its bounds, ``shallow_rows`` the chunk-trace row of
            each row of the two shallow steps (:class:`MicrobatchStep`), ``kept`` its kept rows (outputs of
            microbatch 0 and 1, then their input gradients; None where there is none).
        chunk: the chunk index the phase details name.

    Returns:
        The deep chunk trace, its bounds and its kept rows, as :func:`remat.parallel.chunk_trace.trace_chunk`
        records them.

    Raises:
        CompositionError: the two steps' setups differ, or a kept tensor is not found exactly once.
    """
    for m, step in enumerate(steps):
        _label(step, m, chunk)
    a, b = steps
    setup = next((p.start for p in a.phases if p.kind != "setup"), a.num_events)
    setup_b = next((p.start for p in b.phases if p.kind != "setup"), b.num_events)
    n_setup = sum(1 for e in a.alloc_at if e < setup)
    if setup != setup_b or a.nbytes[:n_setup] != b.nbytes[:n_setup] or a.module[:n_setup] != b.module[:n_setup]:
        raise CompositionError("the two microbatches' composed setups differ")
    fa, fb = _forward_end(a), _forward_end(b)
    # the chunk trace's order: setup, forward 0, forward 1, backward 0, backward 1
    spans = [(a, 0, setup), (a, setup, fa), (b, setup, fb), (a, fa, a.num_events), (b, fb, b.num_events)]
    out = Timeline(meta={})
    flops: list[int] = []
    bounds: list[int] = []
    shift: dict[tuple[int, int], int] = {}  # (step, span start) -> event shift
    for step, lo, hi in spans:
        shift[(id(step), lo)] = out.num_events - lo
        step_flops = step.meta.get("phase_flops", [0] * len(step.phases))
        for p, phase in enumerate(step.phases):
            if lo <= phase.start < hi:
                out.phases.append(Phase(phase.start - lo + out.num_events, phase.kind, phase.region, phase.detail))
                flops.append(step_flops[p])
        out.num_events += hi - lo
        bounds.append(out.num_events)

    phase_starts = np.asarray([p.start for p in out.phases], np.int64)
    row_of = [np.full(len(a), -1, np.int64), np.full(len(b), -1, np.int64)]  # each step's row -> the chunk's row
    for step, lo, hi in spans:
        m = 0 if step is a else 1
        starts = (0, setup, fa if step is a else fb)  # the step's setup, forward and backward
        alloc, free = np.asarray(step.alloc_at, np.int64), np.asarray(step.free_at, np.int64)
        rows = ((alloc >= lo) & (alloc < hi)).nonzero()[0]
        row_of[m][rows] = np.arange(len(out.nbytes), len(out.nbytes) + len(rows))
        new_alloc, new_free = _moved(alloc[rows], starts, shift, id(step)), free[rows]
        new_free[new_free >= 0] = _moved(new_free[new_free >= 0], starts, shift, id(step))
        out.alloc_at += new_alloc.tolist()
        out.free_at += new_free.tolist()
        out.phase_index += (np.searchsorted(phase_starts, new_alloc, side="right") - 1).tolist()
        listed = rows.tolist()
        out.nbytes += [step.nbytes[r] for r in listed]
        out.module += [step.module[r] for r in listed]
        out.category += [step.category[r] for r in listed]
    row_of[1][:n_setup] = row_of[0][:n_setup]  # microbatch 1's setup rows are microbatch 0's

    # the kept outputs and input gradients, found through the rows each step copies
    deep_kept: list[int | None] = []
    for i, row in enumerate(kept):
        m = i % 2
        if row is None:
            deep_kept.append(None)
            continue
        small = shallow_rows[m].index(row) if row in shallow_rows[m] else -1
        found = [r for r, src in enumerate(sources[m]) if src == small]
        if small < 0 or len(found) != 1 or row_of[m][found[0]] < 0:
            raise CompositionError(f"the kept tensor of microbatch {m} is copied {len(found)} times in the deep chunk")
        deep_kept.append(int(row_of[m][found[0]]))
    # what the shallow trace frees after its last backward (kept tensors only), in its order
    b1, end = shallow_bounds[4], shallow_bounds[5]
    end_phase = next((p for p in shallow.phases if p.start == b1), None)
    if end_phase is not None:
        out.phases.append(Phase(out.num_events, end_phase.kind, end_phase.region, end_phase.detail))
        flops.append(0)
    freed_at = {shallow.free_at[r]: r for r in kept if r is not None and shallow.free_at[r] >= b1}
    for e in range(b1, end):
        if e not in freed_at:
            raise CompositionError("the shallow chunk trace makes or frees something else after its last backward")
        out.free_at[deep_kept[kept.index(freed_at[e])]] = out.num_events
        out.num_events += 1
    bounds.append(out.num_events)
    out.meta["phase_flops"] = flops
    return out, bounds, deep_kept
