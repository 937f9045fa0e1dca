"""Compose a deep model's step timeline from the fake trace of a shallow one (:func:`compose`), so that predicting
an 80-layer model costs a few shallow traces; see the NOTE beside :func:`compose` for how and when it is exact."""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from remat.config import ModelConfig
from remat.policy import Policy
from remat.recompute.plan_format import Plan, Unit
from remat.recompute.region import RecomputeLayout, group_label
from remat.timeline import Phase, Timeline

OUTER = -1  # "layer index" of phases outside the stack (setup, embedding, head)


class CompositionError(RuntimeError):
    """The shallow trace cannot be laid out for the deep stack (so trace the deep one in full)."""


@dataclass(frozen=True)
class Role:
    """What determines a layer's events: its mode, whether its neighbours share its checkpoint region, and
    what lies just outside that region (None: the embedding below or the head above). The region's
    surroundings matter because a region's backward frees the gradient that the region above produced."""

    mode: str
    same_region_as_prev: bool
    same_region_as_next: bool
    mode_below_region: str | None
    mode_above_region: str | None
    # 1, 2 or 3+: in a region of two the first and last layers are neighbours, in a longer one they are not
    region_size: int = 1
    # heterogeneous stacks (dense and MoE layers): 'below/own/above' layer kinds ('' when all layers are alike)
    kind: str = ""


def layer_kinds(config: ModelConfig) -> tuple[str, ...] | None:
    """'dense' or 'moe' for each layer of a stack that mixes them (None when every layer is alike)."""
    pattern = config.moe_layer_pattern()
    return None if len(set(pattern)) == 1 else tuple("moe" if p else "dense" for p in pattern)


def layer_regions(policy: RecomputeLayout, depth: int) -> list[tuple[str, int]]:
    """(mode, region id) for each layer: mode is 'full', 'selective:<modules>' or 'plain'."""
    regions: list[tuple[str, int]] = []
    for i in range(depth):
        modules = policy.selective_modules(i)
        regions.append(("selective:" + "+".join(modules) if modules else "plain", -1 - i))
    for g, group in enumerate(policy.layer_groups(depth)):
        for i in group:
            regions[i] = ("full", g)
    return regions


def layer_roles(policy: RecomputeLayout, depth: int, kinds: Sequence[str] | None = None) -> list[Role]:
    """Each layer's :class:`Role` in ``policy`` on ``depth`` layers (``kinds``: see :func:`layer_kinds`)."""
    regions = layer_regions(policy, depth)
    return _roles_of(regions, _bounds_of(regions), None if kinds is None else tuple(kinds))


def _roles_of(regions: list[tuple[str, int]], bounds: list[tuple[int, int]],
              kinds: tuple[str, ...] | None) -> list[Role]:
    depth = len(regions)
    roles = []
    for i, ((mode, _), (first, last)) in enumerate(zip(regions, bounds)):
        kind = "/".join(kinds[j] if 0 <= j < depth else "" for j in (i - 1, i, i + 1)) if kinds else ""
        if first < i < last:  # inside a group, a layer only deals with its two neighbours
            roles.append(Role(mode, True, True, None, None, 3, kind))
            continue
        roles.append(Role(mode, first < i, last > i, regions[first - 1][0] if first > 0 else None,
                          regions[last + 1][0] if last + 1 < depth else None, min(last - first + 1, 3), kind))
    return roles


@functools.lru_cache(maxsize=65536)
def _cached_role_set(policy: RecomputeLayout, depth: int, kinds: tuple[str, ...] | None) -> frozenset[Role]:
    return frozenset(layer_roles(policy, depth, kinds))


def role_set(policy: RecomputeLayout, depth: int, kinds: Sequence[str] | None = None) -> frozenset[Role]:
    """The set of :func:`layer_roles` (memoised: a sweep asks for the same ones many times)."""
    key = None if kinds is None else tuple(kinds)
    try:
        return _cached_role_set(policy, depth, key)
    except TypeError:  # a layout that is not hashable
        return frozenset(layer_roles(policy, depth, key))


def shallow_stand_ins(policy: Policy, depth: int, max_depth: int = 12) -> Iterator[tuple[Policy, int]]:
    """Every (policy, depth) of the same kind, shallowest first, whose layers have every role of
    ``(policy, depth)`` (so its trace can be composed into the deep one)."""
    need = role_set(policy, depth)
    for small_depth in range(1, min(depth, max_depth) + 1):
        if policy.granularity == "full":
            low = 1 if policy.method == "uniform" else 0
            ks = range(low, min(policy.num_layers, small_depth) + 1)
            candidates = [dataclasses.replace(policy, num_layers=k) for k in ks]
        else:
            candidates = [policy]
        for candidate in candidates:
            if need <= role_set(candidate, small_depth):
                yield candidate, small_depth


def shallow_stand_ins_of_kinds(policy: Policy, kinds: Sequence[str], max_depth: int = 16,
                               ) -> Iterator[tuple[Policy, int, tuple[str, ...]]]:
    """:func:`shallow_stand_ins` for a stack of mixed layer kinds (``kinds``, e.g. dense layers then MoE layers):
    each (policy, depth, layer kinds) whose layers have every role, kinds included, of ``(policy, kinds)``."""
    depth = len(kinds)
    need = role_set(policy, depth, kinds)
    names = sorted(set(kinds))
    for small_depth in range(1, min(depth, max_depth) + 1):
        patterns = {tuple(kinds[:small_depth]), tuple(kinds[-small_depth:])}
        patterns |= {(a,) * n + (b,) * (small_depth - n) for a in names for b in names for n in range(small_depth + 1)}
        if policy.granularity == "full":
            low = 1 if policy.method == "uniform" else 0
            candidates = [dataclasses.replace(policy, num_layers=k)
                          for k in range(low, min(policy.num_layers, small_depth) + 1)]
        else:
            candidates = [policy]
        for candidate in candidates:
            for pattern in sorted(patterns):
                if need <= role_set(candidate, small_depth, pattern):
                    yield candidate, small_depth, pattern


def policy_family(policy: Policy) -> tuple[object, ...]:
    """What a stand-in shares with the policy it stands in for: every field but full's layer count."""
    return tuple(getattr(policy, f.name) for f in dataclasses.fields(policy) if f.name != "num_layers")


@functools.lru_cache(maxsize=256)
def config_family(config: ModelConfig) -> tuple[object, ...]:
    """Every field of ``config`` but the depth and the MoE layer pattern: a stand-in's config is ``config`` cut
    shallower (:meth:`~remat.config.ModelConfig.with_depth`)."""
    return tuple(getattr(config, f.name) for f in dataclasses.fields(config)
                 if f.name not in ("num_layers", "moe_layer_freq"))


def shallow_plan(plan: Plan) -> Plan | None:
    """A shallow plan with every layer role (:func:`layer_roles`) of ``plan``, for composing its timeline from a
    shallow trace: groups of more than 3 layers shrink to 3 and runs of more than 3 equal units to 3 (a role sees
    only its neighbours and region sizes up to 3). None when that is not shallower, or when the plan offloads
    (composition does not tell offload groups from checkpoint groups)."""
    if any(s.mode == "offload" for s in plan.segments):
        return None
    small: list[Unit] = []
    for unit in plan.units():
        u = Unit(unit.mode, min(unit.size, 3), unit.modules) if unit.is_group else unit
        if len(small) >= 3 and small[-1] == small[-2] == small[-3] == u:
            continue
        small.append(u)
    shallow = Plan.from_units(small, plan.engine)
    if shallow.num_layers >= plan.num_layers:
        return None
    if not role_set(plan, plan.num_layers) <= role_set(shallow, shallow.num_layers):
        return None
    return shallow


def shallow_stand_in(policy: Policy, depth: int, max_depth: int = 12) -> tuple[Policy, int]:
    """The shallowest stand-in (see :func:`shallow_stand_ins`)."""
    for found in shallow_stand_ins(policy, depth, max_depth):
        return found
    raise CompositionError(f"no stack of at most {max_depth} layers has every layer role of {policy} on {depth}")


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

    def finish(self, tl: Timeline) -> None:
        self.nbytes = [tl.nbytes[r] for r in self.rows]
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
        self.bounds = _region_bounds(policy, self.depth)
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
# recomputation, its backward) depends only on its *role*: whether it is recomputed, and whether its neighbours
# are in the same checkpoint region. A trace of a shallow stack that contains every role of the deep one therefore
# holds, event for event, everything the deep step does; only the order of the phases and which layer frees whose
# tensors must be laid out for the deep stack. compose() does that layout:
#
# * the phase order follows Megatron's semantics: forward layer 0..L-1, head, then each checkpoint region from
#   the top down: a full-recompute group recomputes its layers in order and backpropagates them in reverse; a
#   plain or selective layer repeats its template's backward phases (which contain the selective
#   recomputations);
# * each phase of layer J copies the events of the same phase of a shallow layer j of the same role; a free names
#   the tensor it frees by (layer offset, phase, allocation ordinal), which is resolved in the deep stack at layer
#   J + offset. Every resolved free is checked (bytes and category); a mismatch raises CompositionError and the
#   caller falls back to a full trace.
#
# The result is a Timeline like any other: the deep trace's peak and at-peak parts are reproduced exactly when the
# layers are homogeneous (tests/memory/test_compose.py checks this against full fake traces, byte for byte).
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
    deep_bounds = _region_bounds(policy, depth)
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

    def allocate(block: _Block, layer: int, offsets: list[int] | None) -> None:
        """Append the block's rows as deep rows of ``layer``; record where they start."""
        base = len(out.nbytes)
        block_start[(layer, block.kind, block.occurrence)] = (base, block)
        n0 = out.num_events
        n = len(block.rows)
        out.nbytes.extend(block.nbytes)
        out.category.extend(block.category)
        if sources is not None:
            sources.extend(block.rows)
        out.phase_index.extend([len(out.phases) - 1] * n)
        out.free_at.extend([-1] * n)
        if offsets is None:  # setup: allocations one after the other
            out.alloc_at.extend(range(n0, n0 + n))
            out.num_events += n
        else:
            out.alloc_at.extend([n0 + o for o in offsets])
        if layer == OUTER or block.layer == layer:
            out.module.extend(block.module)
        else:
            renamed = f"layers.{layer}"
            out.module.extend([m if suffix is None else renamed + suffix
                               for m, suffix in zip(block.module, block.module_suffix)])

    checked: set[tuple[int, int, int]] = set()  # (free group, source block) pairs already found to match

    def release(block: _Block, layer: int, head_side: bool) -> None:
        n0 = out.num_events
        free_at = out.free_at
        for j, kind, occurrence, ordinals, offsets, rows in block.free_groups:
            if j == OUTER:
                deep = OUTER
            elif block.layer == OUTER:
                deep = anchor(j, head_side)
            else:
                deep = deep_layer(block.layer, j, layer)
            found = block_start.get((deep, kind, occurrence))
            if found is None:
                raise CompositionError(f"a free in {block.phase.label} does not find its tensor in deep layer {deep}")
            base, source = found
            check = (id(block), id(ordinals), id(source))
            if check not in checked:
                for ordinal, row in zip(ordinals, rows):
                    twin = source.rows[ordinal] if ordinal < len(source.rows) else None
                    if twin is None or twin != row and (small.nbytes[twin] != small.nbytes[row]
                                                        or small.category[twin] != small.category[row]):
                        raise CompositionError(f"a free in {block.phase.label} finds another tensor in deep "
                                               f"layer {deep}")
                checked.add(check)
            for ordinal, offset in zip(ordinals, offsets):
                free_at[base + ordinal] = n0 + offset

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

    out.meta["phase_flops"] = phase_flops
    flops: dict[str, int] = {}
    for phase, amount in zip(out.phases, phase_flops):
        flops[phase.kind] = flops.get(phase.kind, 0) + amount
    out.meta.update({"flops": flops, "num_layers": depth, "policy": str(policy),
                     "composed_from": {"policy": str(shallow_policy), "num_layers": small_depth}})
    return out


def _region_bounds(policy: RecomputeLayout, depth: int) -> list[tuple[int, int]]:
    """(first layer, last layer) of each layer's checkpoint region (the layer itself outside full groups)."""
    return _bounds_of(layer_regions(policy, depth))


def _bounds_of(regions: list[tuple[str, int]]) -> list[tuple[int, int]]:
    """(first, last) of each layer's run of equal region ids (regions are runs of consecutive layers)."""
    bounds: list[tuple[int, int]] = []
    first = 0
    for i in range(1, len(regions) + 1):
        if i == len(regions) or regions[i][1] != regions[first][1]:
            bounds += [(first, i - 1)] * (i - first)
            first = i
    return bounds


def _rename(text: str, small_layer: int, big_layer: int) -> str:
    if small_layer == OUTER or big_layer == OUTER or small_layer == big_layer:
        return text
    return re.sub(rf"\blayers\.{small_layer}(?=\.|\b)", f"layers.{big_layer}", text)


def _group_labels(policy: RecomputeLayout, depth: int) -> dict[int, str]:
    return {i: group_label(g, group) for g, group in enumerate(policy.layer_groups(depth)) for i in group}
