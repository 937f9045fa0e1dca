"""Layer roles (:func:`layer_roles`): what decides a layer's events in a step, and the shallow stacks that have every
role of a deep one (:func:`shallow_stand_ins`), from which :mod:`remat.memory.compose` lays out the deep step."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from remat.config import ModelConfig
from remat.policy import Policy
from remat.recompute.plan_format import Plan, Unit
from remat.recompute.region import RecomputeLayout


class CompositionError(RuntimeError):
    """The shallow trace cannot be laid out for the deep stack (so trace the deep one in full)."""


@dataclass(frozen=True)
class Role:
    """What determines a layer's events: its mode, whether its neighbours share its checkpoint region, whether
    the region's first layer sits on the embedding, and the mode of what follows the region's last layer (the
    category of that layer's output is decided by its consumer: a checkpoint keeps it as its input). What the
    neighbours free of each other is matched when composing (NOTE [composing a deep step from a shallow trace])."""

    mode: str
    same_region_as_prev: bool
    same_region_as_next: bool
    # None: the region sits on the embedding, else 'layer' ('' inside a group of 3+)
    mode_below_region: str | None
    # None: the head is above the region; else the mode of the region above for its last layer, 'layer' for the
    # others ('' inside a group of 3+)
    mode_above_region: str | None
    # 1, 2 or 3+: in a region of two the first and last layers are neighbours, in a longer one they are not
    region_size: int = 1
    # heterogeneous stacks (dense and MoE layers): 'below/own' layer kinds ('' when all layers are alike): a layer
    # may free tensors of the layer below in its own phases, and which depends on that layer's kind
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
        kind = f"{kinds[i - 1] if i else ''}/{kinds[i]}" if kinds else ""
        if first < i < last:  # inside a group, a layer only deals with its two neighbours
            roles.append(Role(mode, True, True, "", "", 3, kind))
            continue
        below = "layer" if first > 0 else None
        above = (regions[last + 1][0] if last == i else "layer") if last + 1 < depth else None
        roles.append(Role(mode, first < i, last > i, below, above, min(last - first + 1, 3), kind))
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
    with_k = _with_group_sizes(policy)
    # a stack of n layers has at most n roles: shallower ones cannot stand in
    for small_depth in range(max(1, len(need)), min(depth, max_depth) + 1):
        for candidate in with_k(small_depth):
            if need <= role_set(candidate, small_depth):
                yield candidate, small_depth


def _with_group_sizes(policy: Policy) -> Callable[[int], list[Policy]]:
    """The candidates of :func:`shallow_stand_ins` on ``n`` layers: ``policy`` itself, or for full recompute
    ``policy`` with each layer count from 1 (uniform) or 0 (block) up to ``min(K, n)``; each made once."""
    if policy.granularity != "full":
        return lambda n: [policy]
    low = 1 if policy.method == "uniform" else 0
    made: list[Policy] = []

    def candidates(n: int) -> list[Policy]:
        top = min(policy.num_layers, n)
        while low + len(made) <= top:
            made.append(dataclasses.replace(policy, num_layers=low + len(made)))
        return made[:max(0, top - low + 1)]
    return candidates


def shallow_stand_ins_of_kinds(policy: Policy, kinds: Sequence[str], max_depth: int = 16,
                               ) -> Iterator[tuple[Policy, int, tuple[str, ...]]]:
    """:func:`shallow_stand_ins` for a stack of mixed layer kinds (``kinds``, e.g. dense layers then MoE layers):
    each (policy, depth, layer kinds) whose layers have every role, kinds included, of ``(policy, kinds)``."""
    depth = len(kinds)
    need = role_set(policy, depth, kinds)
    names = sorted(set(kinds))
    with_k = _with_group_sizes(policy)
    # a stack of n layers has at most n roles: shallower ones cannot stand in
    for small_depth in range(max(1, len(need)), min(depth, max_depth) + 1):
        patterns = {tuple(kinds[:small_depth]), tuple(kinds[-small_depth:])}
        patterns |= {(a,) * n + (b,) * (small_depth - n) for a in names for b in names for n in range(small_depth + 1)}
        for candidate in with_k(small_depth):
            for pattern in sorted(patterns):
                if need <= role_set(candidate, small_depth, pattern):
                    yield candidate, small_depth, pattern


def cover_stand_ins(policies: Sequence[Policy], depth: int, kinds: Sequence[str] | None = None, slack: int = 1,
                    ) -> list[tuple[Policy, int, tuple[str, ...] | None]]:
    """Shallow stand-ins (policy, depth, layer kinds) that together stand in for every one of ``policies`` on
    ``depth`` layers (``kinds``: :func:`layer_kinds`): each policy's roles are all in one of them, of its family
    (:func:`policy_family`). Chosen greedily by traced layers (plus one for the trace's own head and setup) per
    policy newly covered, among each policy's stand-ins (:func:`shallow_stand_ins`, or
    :func:`shallow_stand_ins_of_kinds`) up to ``slack`` layers deeper than its shallowest: a slightly deeper
    stand-in that serves several policies beats one trace each. Policies without a stand-in are left out."""
    key = None if kinds is None else tuple(kinds)
    families: dict[tuple[object, ...], list[Policy]] = {}
    for policy in policies:
        families.setdefault(policy_family(policy), []).append(policy)
    chosen: list[tuple[Policy, int, tuple[str, ...] | None]] = []
    for members in families.values():
        # policies with the same roles and the same stand-in candidates (full: the method and the group size up to
        # the deepest stand-in) are one entry, weighed by how many they are
        groups: dict[tuple[object, ...], list[Policy]] = {}
        for policy in members:
            full = policy.granularity == "full"
            groups.setdefault((policy.method if full else None, min(policy.num_layers, 16) if full else None,
                               role_set(policy, depth, key)), []).append(policy)
        needs = [(need, len(group)) for (*_, need), group in groups.items()]
        candidates: dict[tuple[Policy, int, tuple[str, ...] | None], frozenset[int]] = {}
        for group in groups.values():
            stand_ins = (((p, d, None) for p, d in shallow_stand_ins(group[0], depth)) if key is None
                         else shallow_stand_ins_of_kinds(group[0], key))
            shallowest = None
            for small_policy, small_depth, small_kinds in stand_ins:
                shallowest = small_depth if shallowest is None else shallowest
                if small_depth > shallowest + (slack if len(groups) > 1 else 0) or small_depth >= depth:
                    break
                if (small_policy, small_depth, small_kinds) not in candidates:
                    roles = role_set(small_policy, small_depth, small_kinds)
                    candidates[(small_policy, small_depth, small_kinds)] = frozenset(
                        i for i, (need, _) in enumerate(needs) if need <= roles)
        left = set().union(*candidates.values())
        while left:
            best = min(candidates, key=lambda c: (
                (c[1] + 1) / max(sum(needs[i][1] for i in candidates[c] & left), 1e-9), c[1]))
            chosen.append(best)
            left -= candidates[best]
    return chosen


def policy_family(policy: Policy) -> tuple[object, ...]:
    """What a stand-in shares with the policy it stands in for: every field but full's method and layer count
    (uniform and block groups differ only in where the groups are, which the layer roles say)."""
    return tuple(getattr(policy, f.name) for f in dataclasses.fields(policy)
                 if f.name != "num_layers" and not (f.name == "method" and policy.granularity == "full"))


@functools.lru_cache(maxsize=256)
def config_family(config: ModelConfig) -> tuple[object, ...]:
    """Every field of ``config`` but the depth and the MoE layer pattern: a stand-in's config is ``config`` cut
    shallower (:meth:`~remat.config.ModelConfig.with_depth`)."""
    return tuple(getattr(config, f.name) for f in dataclasses.fields(config)
                 if f.name not in ("num_layers", "moe_layer_freq"))


def shallow_plan(plan: Plan) -> Plan | None:
    """A shallow plan with every layer role (:func:`layer_roles`) of ``plan``, for composing its timeline from a
    shallow trace: groups of more than 3 layers shrink to 3, and each run of equal units to the fewest (3 at most:
    a role sees only its neighbours and region sizes up to 3) that keep every role. None when that is not
    shallower, or when the plan offloads (composition does not tell offload groups from checkpoint groups)."""
    if any(s.mode == "offload" for s in plan.segments):
        return None
    runs: list[list[Unit]] = []  # [unit, count] of each run of equal units, groups shrunk to 3 layers
    for unit in plan.units():
        u = Unit(unit.mode, min(unit.size, 3), unit.modules) if unit.is_group else unit
        if runs and runs[-1][0] == u:
            runs[-1][1] += 1  # type: ignore[operator]
        else:
            runs.append([u, 1])  # type: ignore[list-item]
    need = role_set(plan, plan.num_layers)
    counts = [min(int(n), 3) for _, n in runs]  # type: ignore[call-overload]

    def build(counts: list[int]) -> Plan:
        return Plan.from_units([u for (u, _), n in zip(runs, counts) for _ in range(n)], plan.engine)

    shallow = build(counts)
    if shallow.num_layers >= plan.num_layers or not need <= role_set(shallow, shallow.num_layers):
        return None
    for i in range(len(counts)):  # each run as short as its roles allow (a run's roles are those of its edges)
        for fewer in range(1, counts[i]):
            candidate = build(counts[:i] + [fewer] + counts[i + 1:])
            if need <= role_set(candidate, candidate.num_layers):
                counts[i], shallow = fewer, candidate
                break
    return shallow


def shallow_stand_in(policy: Policy, depth: int, max_depth: int = 12) -> tuple[Policy, int]:
    """The shallowest stand-in (see :func:`shallow_stand_ins`)."""
    for found in shallow_stand_ins(policy, depth, max_depth):
        return found
    raise CompositionError(f"no stack of at most {max_depth} layers has every layer role of {policy} on {depth}")


def region_bounds(policy: RecomputeLayout, depth: int) -> list[tuple[int, int]]:
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
