"""Compose a deep model's step timeline from the fake trace of a shallow one (:func:`compose`), so that predicting
an 80-layer model costs a few shallow traces; see the NOTE beside :func:`compose` for how and when it is exact."""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from remat.config import ModelConfig
from remat.memory.roles import (  # the role names are part of this module's interface too
    CompositionError,
    Role,
    config_family,
    cover_stand_ins,
    layer_kinds,
    layer_regions,
    layer_roles,
    policy_family,
    region_bounds,
    role_set,
    shallow_plan,
    shallow_stand_in,
    shallow_stand_ins,
    shallow_stand_ins_of_kinds,
)
from remat.policy import Policy
from remat.recompute.region import RecomputeLayout, group_label
from remat.timeline import Phase, Timeline

OUTER = -1  # "layer index" of phases outside the stack (setup, embedding, head)
__all__ = ["OUTER", "CompositionError", "Role", "ShallowTrace", "compose", "config_family", "cover_stand_ins",
           "layer_kinds", "layer_regions", "layer_roles", "policy_family", "region_bounds", "role_set", "shallow_plan",
           "shallow_stand_in", "shallow_stand_ins", "shallow_stand_ins_of_kinds"]


@dataclass
class _Block:
    """The events of one shallow phase (or one layer's share of setup), ready to be copied for a deep layer."""

    layer: int                 # shallow layer, OUTER for phases outside the stack
    kind: str
    occurrence: int            # how many phases of this (layer, kind) came before
    phase: Phase
    phase_index: int
    num_events: int = 0
    rows: list[int] = field(default_factory=list)           # shallow rows allocated here; ordinal = position
    alloc_offsets: list[int] = field(default_factory=list)
    # (event offset, shallow layer, kind, occurrence, ordinal, shallow row) of each free
    frees: list[tuple[int, int, str, int, int, int]] = field(default_factory=list)
    # filled by ShallowTrace.finish(): the rows' columns, and the frees grouped by the block that allocated them
    nbytes: list[int] = field(default_factory=list)
    category: list[str] = field(default_factory=list)
    module_suffix: list[str | None] = field(default_factory=list)  # after "layers.<j>", or None: not a layer's
    module: list[str] = field(default_factory=list)
    free_groups: list[tuple[int, str, int, list[int], list[int], list[int]]] = field(default_factory=list)
    arrays: tuple[np.ndarray, ...] = ()  # filled by finish()

    def finish(self, tl: Timeline) -> None:
        self.nbytes = [tl.nbytes[r] for r in self.rows]
        # bytes, allocation offsets, offsets one after the other (as setup copies them), and the shallow rows
        self.arrays = (np.asarray(self.nbytes, dtype=np.int64), np.asarray(self.alloc_offsets, dtype=np.int64),
                       np.arange(len(self.rows), dtype=np.int64), np.asarray(self.rows, dtype=np.int64))
        self.category = [tl.category[r] for r in self.rows]
        self.module = [tl.module[r] for r in self.rows]
        prefix = f"layers.{self.layer}"
        self.module_suffix = [m[len(prefix):] if self.layer != OUTER and _LAYER_NAME.match(m)
                              and m.startswith(prefix) else None for m in self.module]
        groups: dict[tuple[int, str, int], tuple[list[int], list[int], list[int]]] = {}
        for offset, j, kind, occurrence, ordinal, row in self.frees:
            ordinals, offsets, rows = groups.setdefault((j, kind, occurrence), ([], [], []))
            ordinals.append(ordinal)
            offsets.append(offset)
            rows.append(row)
        self.free_groups = [(*key, *lists) for key, lists in groups.items()]

    @property
    def key(self) -> tuple[int, str, int]:
        return (self.layer, self.kind, self.occurrence)


def _layer_of(phase: Phase) -> int:
    return int(phase.region[6:]) if phase.region.startswith("layer ") else OUTER


_LAYER_NAME = re.compile(r"^layers\.(\d+)(?=\.|$)")


def _setup_layer(module: str) -> int:
    match = _LAYER_NAME.match(module)
    return int(match.group(1)) if match else OUTER


class ShallowTrace:
    """A shallow stack's fake trace, cut into blocks whose events can be copied for deep layers.

    The analysis is done once per shallow trace; :func:`compose` reuses it for every deep policy it stands in for.
    """

    def __init__(self, timeline: Timeline, policy: Policy):
        self.timeline, self.policy = timeline, policy
        self.depth = int(timeline.meta["num_layers"])
        config = timeline.meta.get("config")
        self.kinds = layer_kinds(ModelConfig.from_dict(config)) if isinstance(config, dict) else None
        self.roles = layer_roles(policy, self.depth, self.kinds)
        self.role_set = frozenset(self.roles)
        self.bounds = region_bounds(policy, self.depth)
        tl = timeline
        event_row: list[tuple[bool, int]] = [(False, -1)] * tl.num_events
        for row in range(len(tl)):
            event_row[tl.alloc_at[row]] = (True, row)
            if tl.free_at[row] >= 0:
                event_row[tl.free_at[row]] = (False, row)
        spans = []
        for index, phase in enumerate(tl.phases):
            end = tl.phases[index + 1].start if index + 1 < len(tl.phases) else tl.num_events
            if end > phase.start:
                spans.append((index, phase, event_row[phase.start:end]))
        if not spans or spans[0][1].kind != "setup" or _layer_of(spans[0][1]) != OUTER:
            raise CompositionError("the shallow trace does not start with setup")

        # Setup holds every layer's parameters: one block for what is outside the stack, one per layer.
        setup_index, setup_phase, setup_events = spans[0]
        if any(not is_alloc for is_alloc, _ in setup_events):
            raise CompositionError("the shallow trace frees memory during setup")
        self.setup_layers = {j: _Block(j, "setup", 0, setup_phase, setup_index) for j in range(self.depth)}
        # outside the stack: what precedes the layers' parameters (embedding) and what follows (head, batch)
        self.setup_outer = (_Block(OUTER, "setup", 0, setup_phase, setup_index),
                            _Block(OUTER, "setup", 1, setup_phase, setup_index))
        self.row_key: dict[int, tuple[int, str, int, int]] = {}
        after_layers = False
        for _, row in setup_events:
            j = _setup_layer(tl.module[row])
            if j != OUTER and j not in self.setup_layers:
                raise CompositionError(f"setup row of unknown layer {j}")
            after_layers = after_layers or j != OUTER
            block = self.setup_outer[after_layers] if j == OUTER else self.setup_layers[j]
            self.row_key[row] = (*block.key, len(block.rows))
            block.rows.append(row)

        self.blocks: list[_Block] = []
        counts: dict[tuple[int, str], int] = {}
        for index, phase, events in spans[1:]:
            layer = _layer_of(phase)
            occurrence = counts.get((layer, phase.kind), 0)
            counts[(layer, phase.kind)] = occurrence + 1
            block = _Block(layer, phase.kind, occurrence, phase, index, len(events))
            for offset, (is_alloc, row) in enumerate(events):
                if is_alloc:
                    self.row_key[row] = (*block.key, len(block.rows))
                    block.rows.append(row)
                    block.alloc_offsets.append(offset)
                else:
                    block.frees.append((offset, *self.row_key[row], row))
            self.blocks.append(block)
        for block in [*self.setup_outer, *self.setup_layers.values(), *self.blocks]:
            block.finish(tl)
        self.by_key = {b.key: b for b in self.blocks}
        self.freed = np.asarray(tl.free_at, dtype=np.int64) >= 0  # which shallow rows the shallow step frees
        self.modules: dict[tuple[int, int], list[str]] = {}  # (block, deep layer) -> its rows' module names
        # compose's matched frees, kept for the next policy: runs of (kind, occurrence, ordinals, offsets, count)
        self.matched: dict[tuple[int, int], list[tuple[str, int, np.ndarray, np.ndarray, int]]] = {}
        self.template_of_role: dict[Role, int] = {}
        for j, role in enumerate(self.roles):
            self.template_of_role.setdefault(role, j)

        layer_blocks = [i for i, b in enumerate(self.blocks) if b.layer != OUTER]
        if not layer_blocks:
            raise CompositionError("the shallow trace has no layer phases")
        self.first_layer_block, self.last_layer_block = layer_blocks[0], layer_blocks[-1]
        self.forward_end = self.first_layer_block + self.depth
        forward = self.blocks[self.first_layer_block:self.forward_end]
        if [b.layer for b in forward] != list(range(self.depth)) or any(b.kind != "forward" for b in forward):
            raise CompositionError("the shallow trace's forward is not one phase per layer in order")
        self.backward_start = next(i for i in range(self.forward_end, len(self.blocks))
                                   if self.blocks[i].layer != OUTER)
        backward = self.blocks[self.backward_start:self.last_layer_block + 1]
        if any(b.layer == OUTER for b in backward):
            raise CompositionError("the shallow trace's backward has phases outside the stack between layers")
        if [b.key for b in backward] != self.backward_order(policy, self.depth, list(range(self.depth))):
            raise CompositionError("the shallow trace's backward phases are not in the order the policy implies")
        # what each layer's blocks hand to the rest of the step: a deep layer may copy a template whose neighbours
        # in this trace have other modes or kinds, so a free of a neighbour's tensor is matched by its place in
        # these lists (the head's phases count as above the stack, the embedding's as below it)
        exports: dict[tuple[int, tuple[object, ...]], set[tuple[int, str, int, int]]] = {}
        for index, block in enumerate(self.blocks):
            above_stack = self.forward_end <= index < self.backward_start
            for j, kind, occurrence, ordinals, _, rows in block.free_groups:
                if j != OUTER and j != block.layer:
                    key = (j, self.relation(block.layer, j, above_stack))
                    exports.setdefault(key, set()).update((row, kind, occurrence, o) for row, o in zip(rows, ordinals))
        # in the order they were made: (block kind, occurrence, ordinal)
        self.exports = {key: [t[1:] for t in sorted(found)] for key, found in exports.items()}
        # layers whose blocks allocate the same tensors (bytes, categories) in the same order hand them on alike
        shapes: dict[int, list[tuple[object, ...]]] = {}
        for block in self.blocks:
            if block.layer != OUTER:
                shapes.setdefault(block.layer, []).append((block.key[1:], tuple(block.nbytes), tuple(block.category)))
        self.shape = {j: tuple(shape) for j, shape in shapes.items()}

    def relation(self, layer: int, other: int, above_stack: bool) -> tuple[object, ...]:
        """How shallow ``layer`` (OUTER: a phase outside the stack, above it or not) reaches shallow layer ``other``
        whose tensor it frees, as compose's deep_layer maps it: a neighbour, the first or last layer of its region,
        or a layer outside its region counted from the region's edge."""
        if layer == OUTER:
            return ("outer", above_stack)
        if abs(other - layer) <= 1:
            return ("near", other - layer)
        first, last = self.bounds[layer]
        if other > last:
            return ("above", other - last)
        if other < first:
            return ("below", first - other)
        return ("last",) if other == last else ("first",) if other == first else ("near", other - layer)

    def backward_order(self, policy: RecomputeLayout, depth: int, template: list[int]) -> list[tuple[int, str, int]]:
        """(layer, kind, occurrence) of every backward phase of ``policy`` on ``depth`` layers, top down.

        A full-recompute group recomputes its layers in order, then backpropagates them in reverse; any other
        layer repeats the phases of its template layer's backward (which hold its selective recomputations).
        """
        regions = layer_regions(policy, depth)
        order: list[tuple[int, str, int]] = []
        i = depth - 1
        while i >= 0:
            first = i
            while first > 0 and regions[first - 1][1] == regions[i][1]:
                first -= 1
            if regions[i][0] == "full":
                order += [(j, "recompute", 0) for j in range(first, i + 1)]
                order += [(j, "backward", 0) for j in range(i, first - 1, -1)]
            else:
                order += [(i, b.kind, b.occurrence) for b in self.blocks[self.backward_start:self.last_layer_block + 1]
                          if b.layer == template[i]]
            i = first - 1
        return order


# NOTE [composing a deep step from a shallow trace]
# The layers of a decoder stack are identical, so what a layer allocates and frees in each phase (its forward, its
# recomputation, its backward) depends only on its *role* (remat.memory.roles.Role): its mode, where it sits in its
# checkpoint region (and the region's size up to 3), whether the region sits on the embedding or under the head,
# the mode of the region above its last layer (a checkpoint above keeps that layer's output as its input: the
# category), and in a stack of dense and MoE layers its own kind and the kind below it (a layer frees some of the
# layer below's tensors in its own phases, which ones depending on that kind). A trace of a shallow stack that
# contains every role of the deep one therefore holds, event for event, everything the deep step does; only the
# order of the phases and which layer frees whose tensors must be laid out for the deep stack. compose() does that:
#
# * the phase order follows Megatron's semantics: forward layer 0..L-1, head, then each checkpoint region from
#   the top down: a full-recompute group recomputes its layers in order and backpropagates them in reverse; a
#   plain or selective layer repeats its template's backward phases (which contain the selective
#   recomputations);
# * each phase of layer J copies the events of the same phase of a shallow layer j of the same role; a free names
#   the tensor it frees by (layer, phase, allocation ordinal) in the shallow trace, resolved in the deep stack at
#   the layer that plays that shallow layer's part (a neighbour stays a neighbour; a region's first and last layer
#   and the regions around are counted from the region's edges). That deep layer copies a template too, which may
#   sit in other surroundings in the shallow trace (another kind, another mode around it): the tensor is then the
#   one at the same place in the same phase, or, when the template's phases differ, the one at the same place
#   among what each layer hands to layers in the same relation (ShallowTrace.exports) -- both checked (bytes,
#   category), refused when both fit but differ;
# * every tensor of the deep step is freed at most once, and freed exactly when the shallow tensor it copies is:
#   a template whose surroundings change what it frees shows there. Any failed check raises CompositionError and
#   the caller traces the deep stack in full.
#
# The result is a Timeline like any other: the deep trace's events, peak and at-peak parts (tests/memory/
# test_compose.py and test_moe_predict.py check them against full fake traces, byte for byte).
def compose(shallow: Timeline | ShallowTrace, shallow_policy: RecomputeLayout, policy: RecomputeLayout,
            depth: int, kinds: Sequence[str] | None = None, *, sources: list[int] | None = None) -> Timeline:
    """Lay out the fake trace of a shallow reference stack as the step of a ``depth``-layer stack (see the NOTE
    above).

    Args:
        shallow: the trace of ``shallow_policy`` on a shallow stack (a :class:`ShallowTrace` is reused as is; a
            :class:`~remat.timeline.Timeline` is analysed first), e.g. from :func:`shallow_stand_in`.
        shallow_policy: the policy the shallow trace ran with.
        policy: the deep stack's policy; its layers' roles must all occur in the shallow trace.
        depth: the deep stack's layer count.
        kinds: for a stack that mixes dense and MoE layers, each layer's kind (:func:`layer_kinds`); the shallow
            trace must then mix them too.
        sources: when given, a list that receives, for each row of the result, the shallow row it copies.

    Returns:
        The deep step's :class:`~remat.timeline.Timeline`, with ``meta['composed_from']`` naming the shallow
        policy and depth; its events, live curve, peak and at-peak parts are those of a full trace.

    Raises:
        CompositionError: the shallow trace is not laid out as the policy's semantics say, lacks a role the deep
            stack needs, or a copied free does not find the same tensor in the deep stack (trace in full then).

    Example::

        >>> from remat.config import ModelConfig
        >>> from remat.memory.predict import trace
        >>> config = ModelConfig(num_layers=3, hidden_size=32, num_attention_heads=4, seq_length=16)
        >>> stand_in, small = shallow_stand_in(Policy.parse("full/uniform/2"), 12)
        >>> shallow = trace(config.replace(num_layers=small), stand_in)
        >>> deep = compose(shallow, stand_in, Policy.parse("full/uniform/2"), 12)
        >>> deep.peak_bytes == trace(config.replace(num_layers=12), "full/uniform/2").peak_bytes
        True
    """
    trace = shallow if isinstance(shallow, ShallowTrace) else ShallowTrace(shallow, shallow_policy)
    small = trace.timeline
    small_depth = trace.depth
    roles = layer_roles(policy, depth, kinds)
    try:
        template = [trace.template_of_role[role] for role in roles]
    except KeyError as err:
        raise CompositionError(f"the shallow trace has no layer with role {err.args[0]}") from None
    deep_bounds = region_bounds(policy, depth)
    small_flops = small.meta.get("phase_flops", [0] * len(small.phases))

    out = Timeline(meta=dict(small.meta))
    phase_flops: list[int] = []
    block_start: dict[tuple[int, str, int], tuple[int, _Block]] = {}

    def deep_layer(j: int, other: int, big: int) -> int:
        """The deep layer that plays shallow layer ``other``'s part for deep layer ``big`` (which copies ``j``).

        A neighbour stays a neighbour. A farther layer of the same region is that region's first or last layer
        (e.g. a group's recomputed output, released when the group's backward ends); a layer outside the
        region is counted from the region's edge (e.g. the gradient that the region above produced)."""
        if abs(other - j) <= 1:
            return big + other - j
        first, last = trace.bounds[j]
        deep_first, deep_last = deep_bounds[big]
        if other > last:
            return deep_last + other - last
        if other < first:
            return deep_first - (first - other)
        if other == last:
            return deep_last
        if other == first:
            return deep_first
        return big + other - j

    def anchor(j: int, from_top: bool) -> int:
        """A shallow layer referenced from outside the stack, in the deep stack: the head's phases sit on top of
        the stack and count from its top; the phases before and after the stack count from its bottom."""
        return depth - (small_depth - j) if from_top else j

    def new_phase(block: _Block, layer: int, detail: str, flops: int) -> None:
        region = f"layer {layer}" if layer != OUTER else block.phase.region
        out.phases.append(Phase(out.num_events, block.kind, region, detail))
        phase_flops.append(flops)

    emitted: list[tuple[_Block, int, bool]] = []  # (block, deep layer, setup) of each copy, in order
    starts: list[int] = []  # the event each copy starts at
    phase_ids: list[int] = []
    num_rows = 0  # deep rows laid out so far

    def allocate(block: _Block, layer: int, offsets: list[int] | None) -> None:
        """Append the block's rows as deep rows of ``layer`` (their columns are filled at the end); record where
        they start."""
        nonlocal num_rows
        block_start[(layer, block.kind, block.occurrence)] = (num_rows, block)
        n = len(block.rows)
        emitted.append((block, layer, offsets is None))
        starts.append(out.num_events)
        phase_ids.append(len(out.phases) - 1)
        num_rows += n
        if offsets is None:  # setup: allocations one after the other
            out.num_events += n

    def fill_columns() -> np.ndarray:
        """Every copied row's columns, block by block (numpy where the columns are numbers); returns the shallow
        row each deep row copies."""
        sizes = np.fromiter((len(b.rows) for b, _, _ in emitted), dtype=np.int64, count=len(emitted))
        # the shallow rows' own int objects where a column is copied as is (faster than numpy's tolist)
        out.nbytes = list(itertools.chain.from_iterable(b.nbytes for b, _, _ in emitted))
        offsets = np.concatenate([b.arrays[2] if setup else b.arrays[1] for b, _, setup in emitted])
        out.alloc_at = (offsets + np.repeat(np.asarray(starts, dtype=np.int64), sizes)).tolist()
        out.phase_index = list(itertools.chain.from_iterable(
            itertools.repeat(phase, len(b.rows)) for (b, _, _), phase in zip(emitted, phase_ids)))
        out.category = list(itertools.chain.from_iterable(b.category for b, _, _ in emitted))
        out.module = list(itertools.chain.from_iterable(names(b, layer) for b, layer, _ in emitted))
        return np.concatenate([b.arrays[3] for b, _, _ in emitted])

    def names(block: _Block, layer: int) -> list[str]:
        if layer == OUTER or block.layer == layer:
            return block.module
        found = trace.modules.get((id(block), layer))
        if found is None:
            renamed = f"layers.{layer}"
            found = trace.modules[(id(block), layer)] = [m if suffix is None else renamed + suffix
                                                         for m, suffix in zip(block.module, block.module_suffix)]
        return found

    # (free group, template layer of the deep layer it frees from) -> where the freed tensors are in that template,
    # once found to be the same tensors: runs of (block kind, occurrence, ordinals, event offsets, count)
    matched = trace.matched
    # each run of frees of each copy: (ordinals, offsets, row base, event base, count): the freed rows are run
    # ordinals + row base, their events offsets + event base
    freed: list[tuple[np.ndarray, np.ndarray, int, int, int]] = []

    def release(block: _Block, layer: int, head_side: bool) -> None:
        n0 = out.num_events
        for j, kind, occurrence, ordinals, offsets, rows in block.free_groups:
            if j == OUTER:
                deep = source_layer = OUTER
            else:
                deep = anchor(j, head_side) if block.layer == OUTER else deep_layer(block.layer, j, layer)
                if not 0 <= deep < depth:
                    raise CompositionError(f"a free in {block.phase.label} names deep layer {deep}, outside the stack")
                source_layer = template[deep]
            runs = matched.get((id(ordinals), source_layer))
            if runs is None:
                targets = _match(block, (j, kind, occurrence), ordinals, rows, source_layer, deep, head_side)
                pending: list[tuple[str, int, list[int], list[int]]] = []
                for (target_kind, target_occurrence, ordinal), offset in zip(targets, offsets):
                    if not pending or pending[-1][:2] != (target_kind, target_occurrence):
                        pending.append((target_kind, target_occurrence, [], []))
                    pending[-1][2].append(ordinal)
                    pending[-1][3].append(offset)
                runs = [(k, o, np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64), len(a))
                        for k, o, a, b in pending]
                matched[(id(ordinals), source_layer)] = runs
            for target_kind, target_occurrence, run_ordinals, run_offsets, count in runs:
                found = block_start.get((deep, target_kind, target_occurrence))
                if found is None:
                    raise CompositionError(f"a free in {block.phase.label} does not find its tensor in deep layer "
                                           f"{deep}")
                freed.append((run_ordinals, run_offsets, found[0], n0, count))

    def _match(block: _Block, key: tuple[int, str, int], ordinals: list[int], rows: list[int], source_layer: int,
               deep: int, head_side: bool) -> list[tuple[str, int, int]]:
        """Where the tensors that ``block`` frees from the shallow block ``key`` are in the blocks of shallow layer
        ``source_layer`` (the template of deep layer ``deep``): the same layer, the same places; another layer
        (another role around it, another kind), the tensors at the same places among what each layer hands to the
        layers in the same relation (:meth:`ShallowTrace.relation`: its output to the layer above, its input's
        gradient to the layer below...), or when those lists differ, the same places in its blocks. Each checked
        (bytes, category); the whole step is checked once more at the end."""
        j, kind, occurrence = key
        direct = [(kind, occurrence, o) for o in ordinals]
        if source_layer == j or j == OUTER:
            if not _same_tensors(direct, rows, source_layer, key):
                raise CompositionError(f"a free in {block.phase.label} finds another tensor in deep layer {deep}")
            return direct
        relation = trace.relation(block.layer, j, head_side)
        mine, theirs = trace.exports.get((j, relation), []), trace.exports.get((source_layer, relation), [])
        if len(mine) == len(theirs):
            handed = [theirs[mine.index(t)] for t in direct]
            if _same_tensors(handed, rows, source_layer, key):
                return handed
        if _same_tensors(direct, rows, source_layer, key):
            return direct
        raise CompositionError(f"a free in {block.phase.label} does not find its tensors in deep layer {deep}")

    def _same_tensors(targets: list[tuple[str, int, int]], rows: list[int], source_layer: int,
                      key: tuple[int, str, int]) -> bool:
        for (target_kind, target_occurrence, ordinal), row in zip(targets, rows):
            source = trace.by_key.get(key if source_layer == OUTER else (source_layer, target_kind, target_occurrence))
            twin = source.rows[ordinal] if source is not None and ordinal < len(source.rows) else None
            if twin is None or twin != row and (small.nbytes[twin] != small.nbytes[row]
                                                or small.category[twin] != small.category[row]):
                return False
        return True

    def emit(block: _Block, layer: int, detail: str, head_side: bool = False) -> None:
        new_phase(block, layer, detail, small_flops[block.phase_index])
        allocate(block, layer, block.alloc_offsets)
        release(block, layer, head_side)
        out.num_events += block.num_events

    # setup in module order: what precedes the stack (embedding), each deep layer's parameters, what follows
    before, after = trace.setup_outer
    new_phase(before, OUTER, before.phase.detail, small_flops[before.phase_index])
    allocate(before, OUTER, None)
    for big_layer, j in enumerate(template):
        allocate(trace.setup_layers[j], big_layer, None)
    allocate(after, OUTER, None)

    for k in range(trace.first_layer_block):
        emit(trace.blocks[k], OUTER, trace.blocks[k].phase.detail)
    for big_layer, j in enumerate(template):
        emit(trace.by_key[(j, "forward", 0)], big_layer, "")
    for k in range(trace.forward_end, trace.backward_start):
        emit(trace.blocks[k], OUTER, trace.blocks[k].phase.detail, head_side=True)
    labels = _group_labels(policy, depth)
    for big_layer, kind, occurrence in trace.backward_order(policy, depth, template):
        block = trace.by_key[(template[big_layer], kind, occurrence)]
        if kind == "recompute" and labels.get(big_layer):
            detail = labels.get(big_layer, "")
        else:
            detail = _rename(block.phase.detail, block.layer, big_layer)
        emit(block, big_layer, detail)
    for k in range(trace.last_layer_block + 1, len(trace.blocks)):
        emit(trace.blocks[k], OUTER, trace.blocks[k].phase.detail)

    copied = fill_columns()  # the shallow row each deep row copies
    if sources is not None:
        sources.extend(copied.tolist())
    free_at = np.full(num_rows, -1, dtype=np.int64)
    targets = np.zeros(0, dtype=np.int64)
    if freed:
        freed_ordinals, freed_offsets, row_bases, event_bases, counts = zip(*freed)
        lengths = np.asarray(counts, dtype=np.int64)
        targets = np.concatenate(freed_ordinals) + np.repeat(np.asarray(row_bases, dtype=np.int64), lengths)
        free_at[targets] = np.concatenate(freed_offsets) + np.repeat(np.asarray(event_bases, dtype=np.int64), lengths)
    out.free_at = free_at.tolist()
    # every tensor freed once, and exactly those whose shallow original is freed (a template whose neighbours free
    # differently would show here)
    deep_freed = free_at >= 0
    if len(targets) != int(np.count_nonzero(deep_freed)) or not np.array_equal(
            deep_freed, trace.freed[copied]):
        raise CompositionError("the composed step frees other tensors than the shallow trace's layers do")
    out.meta["phase_flops"] = phase_flops
    flops: dict[str, int] = {}
    for phase, amount in zip(out.phases, phase_flops):
        flops[phase.kind] = flops.get(phase.kind, 0) + amount
    out.meta.update({"flops": flops, "num_layers": depth, "policy": str(policy),
                     "composed_from": {"policy": str(shallow_policy), "num_layers": small_depth}})
    return out


def _rename(text: str, small_layer: int, big_layer: int) -> str:
    if small_layer == OUTER or big_layer == OUTER or small_layer == big_layer:
        return text
    return re.sub(rf"\blayers\.{small_layer}(?=\.|\b)", f"layers.{big_layer}", text)


def _group_labels(policy: RecomputeLayout, depth: int) -> dict[int, str]:
    return {i: group_label(g, group) for g, group in enumerate(policy.layer_groups(depth)) for i in group}
