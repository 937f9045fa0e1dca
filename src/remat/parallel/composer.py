"""A stage timeline built from synthesized pipeline buffers and copied chunk-trace segments.

NOTE [the combined 1F1B schedule]
Megatron's ``--overlap-moe-expert-parallel-comm`` (megatron/core/pipeline_parallel/combined_1f1b.py and
megatron/core/models/common/model_chunk_schedule_plan.py at d98e8a64) runs one microbatch's forward and another's
backward as one step, layer by layer, so that each one's expert all-to-all hides behind the other's compute:
the forward's pre-process (embedding), the backward's post-process (the loss and output layer's backward), then
forward layer i beside backward layer n-1-i for each pair, the layers left of either, the forward's post-process
(the head and loss) and the backward's pre-process (the embedding's backward). Inside a pair Megatron runs
combine-backward, attention-forward, MLP-backward, dispatch-forward, dispatch-backward, MLP-forward,
combine-forward, attention-backward; a trace marks layers, not their halves, so :meth:`Composer.combined` lays
out the forward's whole layer before the backward's: at most the smaller MLP half of one layer above Megatron's
order, never below it. The interleaved schedule runs one more warm-up forward with it (schedules.py:966-970) and
pp = 1 starts with a forward alone (combined_1f1b_schedule_for_no_pipelining): remat.parallel.schedule's
``combined`` actions.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from remat.memory.compose import CompositionError
from remat.parallel.chunk_trace import TraceSegment
from remat.parallel.schedule import ChunkSpec
from remat.parallel.stages import parse_phase_detail, phase_detail
from remat.timeline import Phase, Timeline

# NOTE [re-timing reloads]
# A chunk trace's backward brings its offloaded groups back as Megatron does inside one forward's handler (NOTE [when
# offloaded groups come back] in remat.recompute.activation_offload): each start function's backward pops its own
# forward's reload stack, a tensor read earlier comes back alone, and start functions that find the stack empty do
# nothing. Its segments mark where each group committed ('commit'), where each start function ran ('start') and which
# allocation each reloaded tensor is ('reload'). Laying out a backward, the composer does what Megatron's handler queue
# adds: the start functions that found this backward's stack empty bring back, one group each, the top groups of the
# next backward whose chunk opens groups (megatron_runtime's next_backward) if its forward was laid out already
# (pre_reload_last_layer): those tensors get events inserted at those start functions and are allocated there. The
# next backward's own start functions then pop that many groups further down its stack, so a tensor of such a group is
# moved to an event inserted at that earlier start function when the trace brought it back later. Each inserted event
# belongs to the phase that ran when the start function did; the host series moves with the reloads.

# one copied segment: (segment, chunk spec, microbatch, module prefix, 'F' or 'B', key of the tensor kept)
Part = tuple[TraceSegment, ChunkSpec, int, str, str, Any]


class Composer:
    """Builds a stage timeline: synthesized allocations/frees and copied chunk-trace segments."""

    def __init__(self) -> None:
        self.tl = Timeline()
        self.flops: list[int] = []
        self.keys: dict[Any, int] = {}  # runtime-held tensors -> row
        self.forward_rows: dict[tuple[int, int], tuple[Sequence[int], TraceSegment]] = {}
        # fine-grained offloading: [event, host bytes from that event on], and what each module / layer offloaded
        self.host_series: list[list[int]] = []
        self.offloaded: dict[str, int] = {}
        self.offloaded_by_layer: dict[str, int] = {}
        # NOTE [re-timing reloads]: each laid-out forward's reload stack (its groups in commit order), the groups the
        # backward before a forward's backward brought back for it ((chunk, microbatch) -> how many, ordinal ->
        # (event, phase) of each tensor, segment offset -> event of its host change), and the runtime's next backward
        # ((chunk, microbatch) -> (chunk, microbatch) and the backward segment it copies, or None)
        self.offload_stacks: dict[tuple[int, int], list[tuple[str, int]]] = {}
        self.prereloaded: dict[tuple[int, int], tuple[list[int], dict[int, tuple[int, int]], dict[int, int]]] = {}
        self.next_backward: Callable[[tuple[int, int]], tuple[tuple[int, int], TraceSegment] | None] | None = None
        self._layouts: dict[tuple[int, str, tuple[int, ...]], _SegmentLayout] = {}  # by id: each keeps its segment

    def phase(self, kind: str, region: str, detail: str = "", flops: int = 0) -> None:
        tl = self.tl
        if tl.phases and tl.phases[-1].start == tl.num_events:
            tl.phases[-1] = Phase(tl.num_events, kind, region, detail)
            self.flops[-1] = flops
        else:
            tl.phases.append(Phase(tl.num_events, kind, region, detail))
            self.flops.append(flops)

    def _row(self, nbytes: int, alloc_at: int, phase: int, module: str, category: str) -> int:
        tl = self.tl
        tl.nbytes.append(nbytes)
        tl.alloc_at.append(alloc_at)
        tl.free_at.append(-1)
        tl.phase_index.append(phase)
        tl.module.append(module)
        tl.category.append(category)
        return len(tl.nbytes) - 1

    def alloc(self, key: Any, nbytes: int, module: str, category: str = "other") -> None:
        if nbytes <= 0:
            return
        if key in self.keys:
            raise CompositionError(f"pipeline tensor {key} allocated twice")
        self.keys[key] = self._row(nbytes, self.tl.num_events, len(self.tl.phases) - 1, module, category)
        self.tl.num_events += 1

    def free(self, key: Any) -> None:
        row = self.keys.pop(key, None)
        if row is None:
            return
        if self.tl.free_at[row] != -1:
            raise CompositionError(f"pipeline tensor {key} freed twice")
        self.tl.free_at[row] = self.tl.num_events
        self.tl.num_events += 1

    def segment(self, seg: TraceSegment, spec: ChunkSpec, microbatch: int, prefix: str, kind: str,
                keep_key: Any = None) -> None:
        """Copy ``seg`` for ``microbatch`` of ``spec``'s chunk; ``kind`` 'F' or 'B'. Frees of the forward's
        tensors resolve to the same (chunk, microbatch) forward copied before; each is checked."""
        self._lay_out([(seg, spec, microbatch, prefix, kind, keep_key)], [(0, 0, seg.num_events)])

    def combined(self, forward: Part, backward: Part) -> None:
        """One step of Megatron's combined 1F1B schedule: ``forward`` and ``backward`` (each as :meth:`segment`
        takes them) interleaved layer by layer (NOTE [the combined 1F1B schedule])."""
        self._lay_out([forward, backward], combined_blocks(forward[0], backward[0]))

    def _lay_out(self, parts: Sequence[Part], blocks: Sequence[tuple[int, int, int]]) -> None:
        """Copy ``parts`` with their events in ``blocks`` order: (part, first event, end) ranges that cover each
        part's events once, in increasing order within a part."""
        tl = self.tl
        base = cursor = tl.num_events
        marks: list[list[tuple[int, int]]] = [[] for _ in parts]  # (offset, phase id) of each part, in order
        starts: list[list[tuple[int, int]]] = [[] for _ in parts]  # (offset, its event) where each block starts
        inserts = self._reload_plan(parts)
        placed: list[dict[int, tuple[int, int]]] = [{} for _ in parts]  # ordinal -> (event, phase) re-timed
        moved: list[dict[int, int]] = [{} for _ in parts]  # offset of a reload's host change -> its event
        host: list[tuple[int, int, str, int, ChunkSpec]] = []
        for which, lo, hi in blocks:
            seg, spec, microbatch = parts[which][:3]
            cuts = sorted({lo, *(o for o in inserts[which] if lo < o < hi or o == hi == seg.num_events)})
            for a, b in zip(cuts, [*cuts[1:], hi]):  # pieces cut where reloads go in, each reload its own event
                tokens = inserts[which].get(a, ())
                if b > a:  # the phase running at a (its hook fired there) holds the reloads, then a's events
                    phase_count = len(tl.phases)
                    marks[which] += self._block_phases(seg, spec, microbatch, a, b, cursor + len(tokens))
                    if tokens and len(tl.phases) > phase_count and tl.phases[phase_count].start == cursor + len(tokens):
                        tl.phases[phase_count] = dataclasses.replace(tl.phases[phase_count], start=cursor)
                    starts[which].append((a, cursor + len(tokens)))
                phase = len(tl.phases) - 1
                while phase > 0 and tl.phases[phase].start > cursor:
                    phase -= 1
                for token in tokens:
                    where = (cursor, phase)
                    if token[0] == "own":
                        placed[which][token[1]] = where
                        moved[which][token[2]] = cursor
                    else:  # the next backward's group, brought back now (pre_reload_last_layer)
                        _, ahead, ordinal, offset, delta, module = token
                        self.prereloaded[ahead][1][ordinal] = where
                        self.prereloaded[ahead][2][offset] = cursor
                        if delta:
                            host.append((cursor, delta, module, -1, spec))
                    cursor += 1
                cursor += b - a
        for which, part in enumerate(parts):
            seg = part[0]
            if len(starts[which]) == 1 and starts[which][0] == (0, base):
                at: Callable[[int], int] = base.__add__
            else:
                offsets = [o for o, _ in starts[which]]

                def at(offset: int, _offsets: list[int] = offsets, _starts: list[tuple[int, int]] = starts[which],
                       _end: int = seg.num_events) -> int:
                    if offset >= _end:  # from the next segment's first event on
                        return cursor
                    lo, start = _starts[bisect.bisect_right(_offsets, offset) - 1]
                    return start + offset - lo
            first_row = len(tl.nbytes)
            self._copy(part, at, marks[which])
            if part[4] == "F" and seg.marks:
                self.offload_stacks[(part[1].index, part[2])] = [(m, g) for _, k, m, g in seg.marks if k == "commit"]
            done: dict[int, int] = {}  # host changes counted where the backward before brought them back
            if part[4] == "B":
                _, before, done = self.prereloaded.pop((part[1].index, part[2]), (0, {}, {}))
                placed[which].update(before)
            for ordinal, (event, phase) in placed[which].items():
                tl.alloc_at[first_row + ordinal], tl.phase_index[first_row + ordinal] = event, phase
            host += [(moved[which].get(offset, at(offset)) if delta < 0 else at(offset), delta, module, layer, part[1])
                     for offset, delta, module, layer in seg.host if not (delta < 0 and offset in done)]
        for event, delta, module, layer, spec in sorted(host, key=lambda h: h[0]):
            held = (self.host_series[-1][1] if self.host_series else 0) + delta  # each microbatch its own bytes
            self.host_series.append([event, held])
            if delta > 0:
                self.offloaded[module] = self.offloaded.get(module, 0) + delta
                where = str(layer + spec.layer_offset)
                self.offloaded_by_layer[where] = self.offloaded_by_layer.get(where, 0) + delta
        tl.num_events = cursor

    def _reload_plan(self, parts: Sequence[Part]) -> list[dict[int, list[tuple[Any, ...]]]]:
        """Per part, the reloads to insert before a segment offset (NOTE [re-timing reloads]): ('own', ordinal, its
        offset) a tensor of the backward's own group brought back at a start function's backward, ('pre', (chunk,
        microbatch), ordinal, offset) one of the next backward's. Takes the stacks and pre-reloads it uses."""
        ready = set(self.offload_stacks)  # forwards laid out before this step (a combined step's own is not yet)
        out: list[dict[int, list[tuple[Any, ...]]]] = [{} for _ in parts]
        for which, (seg, spec, microbatch, _, kind, _) in enumerate(parts):
            key = (spec.index, microbatch)
            if kind != "B" or not seg.marks:
                continue
            top = self.offload_stacks.pop(key, [])[::-1]
            count, before, _ = self.prereloaded.get(key, ([0], {}, {}))
            rows = _reload_rows(seg)
            spare = []
            for j, start in enumerate(o for o, k, _, _ in seg.marks if k == "start"):
                if count[0] + j >= len(top):
                    spare.append(start)  # its own stack is empty: the next backward's top group
                    continue
                for offset, ordinal in rows.get(top[count[0] + j], ()):  # the trace brought it back later
                    if count[0] and start < offset and ordinal not in before:
                        out[which].setdefault(start, []).append(("own", ordinal, offset))
            ahead = self.next_backward(key) if self.next_backward is not None and spare else None
            if ahead is None or ahead[0] not in ready or ahead[0] in self.prereloaded:
                continue
            stack, ahead_rows = self.offload_stacks[ahead[0]], _reload_rows(ahead[1])
            self.prereloaded[ahead[0]] = ([min(len(spare), len(stack))], {}, {})
            returned = {offset: (delta, module) for offset, delta, module, _ in ahead[1].host if delta < 0}
            for k in range(self.prereloaded[ahead[0]][0][0]):
                for offset, ordinal in ahead_rows.get(stack[-1 - k], ()):
                    out[which].setdefault(spare[k], []).append(("pre", ahead[0], ordinal, offset,
                                                                *returned.get(offset, (0, ""))))
        return out

    def _block_phases(self, seg: TraceSegment, spec: ChunkSpec, microbatch: int, lo: int, hi: int,
                      start: int) -> list[tuple[int, int]]:
        """Append the phases of ``seg``'s events ``lo`` .. ``hi`` - 1, laid out from event ``start``: the one
        running at ``lo`` and those starting inside. Returns (offset, phase id) for each."""
        tl, out = self.tl, []
        for k, (offset, kind, region, inner, flops) in enumerate(seg.phases):
            end = seg.phases[k + 1][0] if k + 1 < len(seg.phases) else seg.num_events
            if end <= lo or offset >= hi:
                continue
            if region.startswith("layer "):
                region = f"layer {int(region[6:]) + spec.layer_offset}"
            first = max(offset, lo)
            phase = Phase(start + first - lo, kind, region, phase_detail(microbatch, spec.index, _parse_inner(inner)))
            counted = flops if offset >= lo else 0  # a phase split between blocks counts once
            if tl.phases and tl.phases[-1].start == phase.start:  # the phase before made no event
                tl.phases[-1] = phase
                self.flops[-1] = counted
            else:
                tl.phases.append(phase)
                self.flops.append(counted)
            out.append((first, len(tl.phases) - 1))
        return out

    def _copy(self, part: Part, at: Callable[[int], int], marks: list[tuple[int, int]]) -> None:
        """The rows, frees and kept tensor of one part, its events placed by ``at``."""
        seg, spec, microbatch, prefix, kind, keep_key = part
        tl = self.tl
        layout = self._layout(seg, prefix, tuple(o for o, _ in marks))
        # one row per allocation of the segment, appended column by column (as _row appends them one by one)
        first = len(tl.nbytes)
        rows = range(first, first + len(seg.nbytes))
        tl.nbytes.extend(seg.nbytes)
        tl.alloc_at.extend(map(at, seg.alloc_offsets))
        free_at = tl.free_at
        free_at.extend([-1] * len(rows))
        tl.phase_index.extend(map([m for _, m in marks].__getitem__, layout.mark_of_row))
        tl.module.extend(layout.modules)
        tl.category.extend(seg.category)
        for ordinal, offset in layout.own_frees:  # each checked once, in _SegmentLayout
            free_at[first + ordinal] = at(offset)
        if kind == "F":
            self.forward_rows[(spec.index, microbatch)] = (rows, seg)
        else:
            source = self.forward_rows.pop((spec.index, microbatch), None)
            if source is None:
                raise CompositionError(f"the backward of microbatch {microbatch} of chunk {spec.index} comes before "
                                       "its forward")
            target_rows, forward = source
            for offset, ordinal, nbytes in layout.forward_frees:
                if ordinal >= len(target_rows) or forward.nbytes[ordinal] != nbytes:
                    raise CompositionError(f"a free in the backward of microbatch {microbatch} of chunk {spec.index} "
                                           "does not find its tensor in that microbatch's forward")
                target = target_rows[ordinal]
                if free_at[target] != -1 or tl.nbytes[target] != nbytes:
                    raise CompositionError(f"a free in the backward of microbatch {microbatch} of chunk "
                                           f"{spec.index} finds another tensor")
                free_at[target] = at(offset)
        if seg.keep is not None and keep_key is not None:
            self.keys[keep_key] = rows[seg.keep]

    def _layout(self, seg: TraceSegment, prefix: str, mark_offsets: tuple[int, ...]) -> _SegmentLayout:
        """What copying ``seg`` under ``prefix`` with phases starting at ``mark_offsets`` takes from it, made once
        (a stage copies each segment once per microbatch)."""
        key = (id(seg), prefix, mark_offsets)
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = _SegmentLayout(seg, prefix, mark_offsets)
        return layout

    def finish(self, meta: dict[str, Any], validate: bool = True) -> Timeline:
        """The timeline with ``meta`` and its FLOPs; its rows checked unless ``validate`` is False (a caller that
        adds rows checks them all after)."""
        tl = self.tl
        tl.meta.update(meta)
        tl.meta["phase_flops"] = self.flops
        flops: dict[str, int] = {}
        for phase, amount in zip(tl.phases, self.flops):
            flops[phase.kind] = flops.get(phase.kind, 0) + amount
        tl.meta["flops"] = flops
        if self.host_series:  # the keys remat.memory.measure.measure writes; layers by global index
            tl.meta["host_memory"] = {"peak_bytes": max(b for _, b in self.host_series),
                                      "offloaded_bytes": self.offloaded, "offloaded_bytes_by_layer":
                                      self.offloaded_by_layer, "series": self.host_series}
        if validate:
            tl.validate()
        return tl


class _SegmentLayout:
    """A segment's rows as :meth:`Composer._copy` lays them out for any microbatch: each row's module name under a
    prefix, the phase mark it falls in, the frees of its own rows (checked here once: each row freed once, by its own
    size) and those of its forward's, (offset, ordinal, bytes)."""

    def __init__(self, seg: TraceSegment, prefix: str, mark_offsets: tuple[int, ...]):
        self.seg = seg  # kept alive while the composer keys this layout by its id
        self.modules = [prefix + module for module in seg.module]
        self.mark_of_row = [max(0, bisect.bisect_right(mark_offsets, offset) - 1) for offset in seg.alloc_offsets]
        self.own_frees: list[tuple[int, int]] = []
        self.forward_frees: list[tuple[int, int, int]] = []
        freed: set[int] = set()
        for offset, where, ordinal, nbytes in seg.frees:
            if where != "self":
                self.forward_frees.append((offset, ordinal, nbytes))
            elif ordinal in freed or seg.nbytes[ordinal] != nbytes:
                raise CompositionError("a free in a chunk trace's segment finds another tensor of its own")
            else:
                freed.add(ordinal)
                self.own_frees.append((ordinal, offset))


def _reload_rows(seg: TraceSegment) -> dict[tuple[str, int], list[tuple[int, int]]]:
    """A backward segment's reloaded tensors by group (offload module, chunk layer): (offset, allocation ordinal) of
    each, in order (a reload's allocation is the event its mark names)."""
    ordinal_at = {offset: k for k, offset in enumerate(seg.alloc_offsets)}
    rows: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for offset, kind, module, layer in seg.marks:
        if kind == "reload" and offset in ordinal_at:
            rows.setdefault((module, layer), []).append((offset, ordinal_at[offset]))
    return rows


def combined_blocks(forward: TraceSegment, backward: TraceSegment) -> list[tuple[int, int, int]]:
    """The event ranges of a combined 1F1B step in Megatron's order (NOTE [the combined 1F1B schedule]): part 0 is
    the forward, part 1 the backward; each range is one run of phases of one region (a layer, the head, the rest)."""
    f_pre, f_layers, f_post = _runs(forward, 0)
    b_pre, b_layers, b_post = _runs(backward, 1)
    pairs = [block for i in range(min(len(f_layers), len(b_layers))) for block in (f_layers[i], b_layers[i])]
    left = len(pairs) // 2
    order = [*f_pre, *b_pre, *pairs, *b_layers[left:], *f_layers[left:], *f_post, *b_post]
    return [block for block in order if block[2] > block[1]]


def _runs(seg: TraceSegment, part: int) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]],
                                                  list[tuple[int, int, int]]]:
    """``seg``'s events as (before its first layer, each layer, after its last layer) ranges, tagged with ``part``
    (0 forward, 1 backward)."""
    bounds: list[tuple[int, str]] = []  # (start, region) where the region changes
    for offset, _, region, _, _ in seg.phases:
        if not bounds or bounds[-1][1] != region:
            if bounds and bounds[-1][0] == offset:
                bounds[-1] = (offset, region)
            else:
                bounds.append((offset, region))
    if not bounds or bounds[0][0] > 0:
        bounds.insert(0, (0, ""))
    ranges = [(start, bounds[k + 1][0] if k + 1 < len(bounds) else seg.num_events, region)
              for k, (start, region) in enumerate(bounds)]
    layer_at = [k for k, (_, _, region) in enumerate(ranges) if region.startswith("layer ")]
    if not layer_at:
        return [(part, lo, hi) for lo, hi, _ in ranges], [], []
    first, last = layer_at[0], layer_at[-1]
    return ([(part, lo, hi) for lo, hi, _ in ranges[:first]],
            [(part, lo, hi) for lo, hi, _ in ranges[first:last + 1]],
            [(part, lo, hi) for lo, hi, _ in ranges[last + 1:]])


def _parse_inner(detail: str) -> str:
    """A chunk-trace phase detail without its 'microbatch i, chunk g' prefix."""
    if parse_phase_detail(detail) is None:
        return detail
    _, _, inner = detail.partition(": ")
    return inner
