"""Compose a deep model's step timeline from the fake trace of a shallow one.

The layers of a decoder stack are identical, so what a layer allocates and frees in each phase (its forward,
its recomputation, its backward) depends only on its *role*: whether it is recomputed, and whether its
neighbours are in the same checkpoint region. A trace of a shallow stack that contains every role of the deep
one therefore holds, event for event, everything the deep step does; only the order of the phases and which
layer frees whose tensors must be laid out for the deep stack.

:func:`compose` does that layout:

* the phase order follows Megatron's semantics: forward layer 0..L-1, head, then each checkpoint region from the
  top down: a full-recompute group recomputes its layers in order and backpropagates them in reverse; a plain
  or selective layer repeats its template's backward phases (which contain the selective recomputations);
* each phase of layer J copies the events of the same phase of a shallow layer j of the same role; a free names
  the tensor it frees by (layer offset, phase, allocation ordinal), which is resolved in the deep stack at
  layer J + offset. Every resolved free is checked (bytes and category); a mismatch raises
  :class:`CompositionError` and the caller falls back to a full trace.

The result is a :class:`~remat.timeline.Timeline` like any other: the deep trace's peak and at-peak parts are
reproduced exactly when the layers are homogeneous (the tests check this against full fake traces).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from remat.apply import group_label
from remat.policy import Policy
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


def layer_regions(policy: Policy, depth: int) -> list[tuple[str, int]]:
    """(mode, region id) for each layer: mode is 'full', 'selective' or 'plain'."""
    if policy.granularity == "full":
        regions: list[tuple[str, int]] = [("plain", -1 - i) for i in range(depth)]
        for g, group in enumerate(policy.layer_groups(depth)):
            for i in group:
                regions[i] = ("full", g)
        return regions
    mode = "selective" if policy.granularity == "selective" else "plain"
    return [(mode, -1 - i) for i in range(depth)]


def layer_roles(policy: Policy, depth: int) -> list[Role]:
    regions = layer_regions(policy, depth)
    roles = []
    for i, ((mode, _), (first, last)) in enumerate(zip(regions, _region_bounds(policy, depth))):
        roles.append(Role(mode, first < i, last > i, regions[first - 1][0] if first > 0 else None,
                          regions[last + 1][0] if last + 1 < depth else None))
    return roles


def shallow_stand_in(policy: Policy, depth: int, max_depth: int = 12) -> tuple[Policy, int]:
    """The shallowest (policy, depth) of the same kind whose layers have every role of ``(policy, depth)``."""
    need = set(layer_roles(policy, depth))
    for small_depth in range(1, min(depth, max_depth) + 1):
        if policy.granularity == "full":
            low = 1 if policy.method == "uniform" else 0
            ks = range(low, min(policy.num_layers, small_depth) + 1)
            candidates = [Policy("full", policy.method, k, engine=policy.engine) for k in ks]
        else:
            candidates = [policy]
        for candidate in candidates:
            if need <= set(layer_roles(candidate, small_depth)):
                return candidate, small_depth
    raise CompositionError(f"no stack of at most {max_depth} layers has every layer role of {policy} on {depth}")


@dataclass
class _Run:
    layer: int          # OUTER for phases outside the stack
    phase: Phase
    phase_index: int
    events: list[tuple[bool, int]]  # (is_alloc, row)


def _layer_of(phase: Phase) -> int:
    return int(phase.region[6:]) if phase.region.startswith("layer ") else OUTER


def _runs(tl: Timeline) -> list[_Run]:
    kind_of_event: list[tuple[bool, int]] = [(False, -1)] * tl.num_events
    for row in range(len(tl)):
        kind_of_event[tl.alloc_at[row]] = (True, row)
        if tl.free_at[row] >= 0:
            kind_of_event[tl.free_at[row]] = (False, row)
    spans = []
    for index, phase in enumerate(tl.phases):
        end = tl.phases[index + 1].start if index + 1 < len(tl.phases) else tl.num_events
        if end > phase.start:
            spans.append(_Run(_layer_of(phase), phase, index, kind_of_event[phase.start:end]))
    return spans


_LAYER_NAME = re.compile(r"^layers\.(\d+)(?=\.|$)")


def _setup_layer(module: str) -> int:
    match = _LAYER_NAME.match(module)
    return int(match.group(1)) if match else OUTER


def compose(shallow: Timeline, shallow_policy: Policy, policy: Policy, depth: int) -> Timeline:
    """Lay out ``shallow`` (the trace of ``shallow_policy`` on a shallow reference stack) for ``depth`` layers.

    See the module docstring. Raises :class:`CompositionError` when the shallow trace is not laid out as the
    policy's semantics say, or a copied free does not find the same tensor in the deep stack.
    """
    small_depth = int(shallow.meta["num_layers"])
    small_roles = layer_roles(shallow_policy, small_depth)
    roles = layer_roles(policy, depth)
    template_of_role: dict[Role, int] = {}
    for j, role in enumerate(small_roles):
        template_of_role.setdefault(role, j)
    try:
        template = [template_of_role[role] for role in roles]
    except KeyError as err:
        raise CompositionError(f"the shallow trace has no layer with role {err.args[0]}") from None

    runs = _runs(shallow)
    run_index: dict[tuple[int, str, int], int] = {}
    occurrence: dict[tuple[int, str], int] = {}
    for i, run in enumerate(runs):
        key = (run.layer, run.phase.kind)
        run_index[(run.layer, run.phase.kind, occurrence.get(key, 0))] = i
        occurrence[key] = occurrence.get(key, 0) + 1
    layer_runs = [i for i, run in enumerate(runs) if run.layer != OUTER]
    if not layer_runs:
        raise CompositionError("the shallow trace has no layer phases")
    first_layer_run, last_layer_run = layer_runs[0], layer_runs[-1]
    forward_end = first_layer_run + small_depth
    if [runs[i].layer for i in range(first_layer_run, forward_end)] != list(range(small_depth)) or any(
            runs[i].phase.kind != "forward" for i in range(first_layer_run, forward_end)):
        raise CompositionError("the shallow trace's forward is not one phase per layer in order")
    backward_start = next(i for i in range(forward_end, len(runs)) if runs[i].layer != OUTER)
    if any(runs[i].layer == OUTER for i in range(backward_start, last_layer_run + 1)):
        raise CompositionError("the shallow trace's backward has phases outside the stack between layers")

    # Row identity in the shallow trace: (layer, kind, occurrence, ordinal) of the phase that allocated it.
    row_key: dict[int, tuple[int, str, int, int]] = {}
    seen: dict[tuple[int, str], int] = {}
    for run in runs:
        key = (run.layer, run.phase.kind)
        occ = seen.get(key, 0)
        seen[key] = occ + 1
        ordinal = 0
        for is_alloc, row in run.events:
            if is_alloc:
                if run.phase.kind == "setup" and run.layer == OUTER:
                    layer = _setup_layer(shallow.module[row])
                    row_key[row] = (layer, "setup", 0, ordinal) if layer != OUTER else (OUTER, "setup", occ, ordinal)
                else:
                    row_key[row] = (run.layer, run.phase.kind, occ, ordinal)
                ordinal += 1

    def backward_block(layers: list[int], modes: list[str], templates: list[int]) -> list[tuple[int, str, int]]:
        """Run keys (layer, kind, occurrence) of a region's backward, from its top layer down."""
        if modes[0] == "full":
            return [(j, "recompute", 0) for j in layers] + [(j, "backward", 0) for j in reversed(layers)]
        j, t = layers[0], templates[0]
        pattern = []
        counts: dict[str, int] = {}
        for k in range(backward_start, last_layer_run + 1):
            if runs[k].layer == t and runs[k].phase.kind != "forward":
                kind = runs[k].phase.kind
                pattern.append((j, kind, counts.get(kind, 0)))
                counts[kind] = counts.get(kind, 0) + 1
        return pattern

    def backward_order(pol: Policy, n: int, templates: list[int]) -> list[tuple[int, str, int]]:
        regions = layer_regions(pol, n)
        order: list[tuple[int, str, int]] = []
        i = n - 1
        while i >= 0:
            first = i
            while first > 0 and regions[first - 1][1] == regions[i][1]:
                first -= 1
            members = list(range(first, i + 1))
            order += backward_block(members, [regions[m][0] for m in members], [templates[m] for m in members])
            i = first - 1
        return order

    observed = []
    counts2: dict[tuple[int, str], int] = {}
    for k in range(backward_start, last_layer_run + 1):
        key = (runs[k].layer, runs[k].phase.kind)
        observed.append((runs[k].layer, runs[k].phase.kind, counts2.get(key, 0)))
        counts2[key] = counts2.get(key, 0) + 1
    if observed != backward_order(shallow_policy, small_depth, list(range(small_depth))):
        raise CompositionError("the shallow trace's backward phases are not in the order the policy implies")

    # -- lay out the deep step -------------------------------------------------------------------------------
    out = Timeline(meta=dict(shallow.meta))
    big_row: dict[tuple[int, str, int, int], int] = {}
    small_of_big: list[int] = []

    small_bounds, deep_bounds = _region_bounds(shallow_policy, small_depth), _region_bounds(policy, depth)

    def deep_layer(j: int, other: int, big: int) -> int:
        """The deep layer that plays shallow layer ``other``'s part for deep layer ``big`` (which copies ``j``).

        A neighbour stays a neighbour. A farther layer of the same region is that region's first or last layer
        (e.g. a group's recomputed output, released when the group's backward ends); a layer outside the
        region is counted from the region's edge (e.g. the gradient that the region above produced)."""
        first, last = small_bounds[j]
        deep_first, deep_last = deep_bounds[big]
        if abs(other - j) <= 1:
            return big + other - j
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
        big = depth - (small_depth - j) if from_top else j
        if small_roles[j] != roles[big]:
            raise CompositionError(f"shallow layer {j} and deep layer {big} differ in role")
        return big

    phase_flops: list[int] = []
    small_flops = shallow.meta.get("phase_flops", [0] * len(shallow.phases))

    def emit(run: _Run, layer: int, occ: int, detail: str, events: list[tuple[bool, int]] | None = None,
             new_phase: bool = True, head_side: bool = False) -> None:
        if new_phase:
            out.phases.append(Phase(out.num_events, run.phase.kind, f"layer {layer}" if layer != OUTER
                                    else run.phase.region, detail))
            phase_flops.append(small_flops[run.phase_index] if events is None else 0)
        phase_index = len(out.phases) - 1
        events = run.events if events is None else events
        ordinal_base = 0
        for is_alloc, row in events:
            if is_alloc:
                key = row_key[row]
                if key[0] == OUTER:
                    big_key = key
                elif run.layer == OUTER and key[1] == "setup":
                    big_key = (layer, "setup", 0, key[3]) if layer != OUTER else key
                else:
                    big_key = (layer, key[1], occ, key[3])
                big_row[big_key] = len(out.nbytes)
                small_of_big.append(row)
                out.nbytes.append(shallow.nbytes[row])
                out.alloc_at.append(out.num_events)
                out.free_at.append(-1)
                out.phase_index.append(phase_index)
                out.module.append(_rename(shallow.module[row], key[0], layer if big_key[0] != OUTER else OUTER))
                out.category.append(shallow.category[row])
                ordinal_base += 1
            else:
                key = row_key[row]
                if key[0] == OUTER:
                    target = key
                elif run.layer == OUTER:
                    target = (anchor(key[0], from_top=head_side), *key[1:])
                else:
                    target = (deep_layer(run.layer, key[0], layer), *key[1:])
                big = big_row.get(target)
                if big is None or small_of_big[big] != row and (
                        shallow.nbytes[small_of_big[big]] != shallow.nbytes[row]
                        or shallow.category[small_of_big[big]] != shallow.category[row]):
                    raise CompositionError(f"a free in {run.phase.label} does not find its tensor {target} "
                                           "in the deep stack")
                out.free_at[big] = out.num_events
            out.num_events += 1

    # setup: outer rows once, then each deep layer's parameters from its template layer
    setup = runs[0]
    if setup.phase.kind != "setup" or setup.layer != OUTER:
        raise CompositionError("the shallow trace does not start with setup")
    # in module order: what precedes the stack (embedding), every deep layer's parameters, what follows (head)
    first_layer_event = next((n for n, (a, r) in enumerate(setup.events) if a and row_key[r][0] != OUTER),
                             len(setup.events))
    outer_events = [(a, r) for a, r in setup.events if not a or row_key[r][0] == OUTER]
    before = [e for e in outer_events if setup.events.index(e) < first_layer_event]
    emit(setup, OUTER, 0, setup.phase.detail, before)
    for big_layer, j in enumerate(template):
        layer_events = [(a, r) for a, r in setup.events if a and row_key[r][0] == j]
        emit(setup, big_layer, 0, setup.phase.detail, layer_events, new_phase=False)
    emit(setup, OUTER, 0, setup.phase.detail, outer_events[len(before):], new_phase=False)
    phase_flops[-1] = small_flops[setup.phase_index]
    for k in range(1, first_layer_run):
        emit(runs[k], OUTER, 0, runs[k].phase.detail)
    for big_layer, j in enumerate(template):
        emit(runs[run_index[(j, "forward", 0)]], big_layer, 0, "")
    for k in range(forward_end, backward_start):
        emit(runs[k], OUTER, 0, runs[k].phase.detail, head_side=True)
    labels = _group_labels(policy, depth)
    for big_layer, kind, occ in backward_order(policy, depth, template):
        run = runs[run_index[(template[big_layer], kind, occ)]]
        detail = labels.get(big_layer, "") if kind == "recompute" and policy.granularity == "full" else \
            _rename(run.phase.detail, template[big_layer], big_layer)
        emit(run, big_layer, occ, detail)
    for k in range(last_layer_run + 1, len(runs)):
        emit(runs[k], OUTER, 0, runs[k].phase.detail)

    out.meta["phase_flops"] = phase_flops
    out.meta.update({"num_layers": depth, "policy": str(policy), "composed_from": {
        "policy": str(shallow_policy), "num_layers": small_depth}})
    flops: dict[str, int] = {}
    for phase, amount in zip(out.phases, out.meta["phase_flops"]):
        flops[phase.kind] = flops.get(phase.kind, 0) + amount
    out.meta["flops"] = flops
    return out


def _region_bounds(policy: Policy, depth: int) -> list[tuple[int, int]]:
    """(first layer, last layer) of each layer's checkpoint region (the layer itself outside full groups)."""
    regions = layer_regions(policy, depth)
    bounds = []
    for i in range(depth):
        first = last = i
        while first > 0 and regions[first - 1][1] == regions[i][1]:
            first -= 1
        while last + 1 < depth and regions[last + 1][1] == regions[i][1]:
            last += 1
        bounds.append((first, last))
    return bounds


def _rename(text: str, small_layer: int, big_layer: int) -> str:
    if small_layer == OUTER or big_layer == OUTER or small_layer == big_layer:
        return text
    return re.sub(rf"\blayers\.{small_layer}(?=\.|\b)", f"layers.{big_layer}", text)


def _group_labels(policy: Policy, depth: int) -> dict[int, str]:
    return {i: group_label(g, group) for g, group in enumerate(policy.layer_groups(depth)) for i in group}


