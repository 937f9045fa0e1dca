"""The exact plan solver: dynamic programming over layers under a peak-memory budget."""

# NOTE [the extended search]: every plan made of the four layer modes (NOTE [plan modes] in remat.plan.space), with
# groups of any sizes. The dynamic program (solve) finds the plan of least cost whose *modelled* peak (NOTE [the unit
# model]) is <= the budget. It walks the stack bottom-up over states (layers planned, which side inputs are kept
# below) with Pareto sets of (bytes kept below, cost); a unit's backward bound only needs the bytes kept below it
# and its position, so every constraint is checked exactly when its unit is added. Unit kinds that another kind
# beats on every count are left out, and the best Megatron setting's cost (with a fractional-knapsack lower bound on
# completing a partial plan) prunes the Pareto sets; 128 layers solve in a fraction of a second
# (benchmarks/bench_plan.py times it). FLOP counters give norms and activations no FLOPs, so plans tying on FLOPs
# are then made to recompute as little as the budget allows (tidy; the cost never rises).

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from remat.plan.costs import CostModel, candidate_units
from remat.plan.space import SELECTIVE_SETS
from remat.plan.unit_model import NO_EVENT, UnitModel
from remat.policy import NON_MATMUL_INCLUDES
from remat.recompute.plan_format import KEEP, Unit, kept_operators


@dataclass
class Solution:
    """A solver answer: the plan's units bottom-up, its cost (:meth:`CostModel.cost` summed) and its modelled
    peak; ``entries`` counts the Pareto entries the solver kept."""

    units: list[Unit]
    cost: int
    model_peak: int
    entries: int = 0
    seconds: float = 0.0


class _Tables:
    """The budget-independent numbers the solver needs for one model, depth and unit list."""

    def __init__(self, model: UnitModel, num_layers: int, units: Sequence[Unit], costs: Sequence[int]):
        self.model, self.L = model, num_layers
        self.units = list(units)
        self.costs = list(costs)
        self.shapes = [model.shape(u) for u in units]
        classes = sorted(model.side)
        self.bit = {c: 1 << i for i, c in enumerate(classes)}
        self.all_bits = (1 << len(classes)) - 1
        self.holds = [sum(self.bit[c] for c in model.holds(u)) for u in units]
        self.side_of_bits = [sum(model.side[c] for c in classes if not bits & self.bit[c])
                             for bits in range(self.all_bits + 1)]  # bytes of the side inputs NOT in bits
        self.c0 = model.setup(num_layers) + model.embedding.net
        all_held = frozenset(model.side)
        self.h_all = model.head_forward[all_held].net + model.head_backward.net
        self.g = model.grad_per_layer
        self.head_cap: dict[int, int] = {}
        for bits in range(self.all_bits + 1):
            held = frozenset(c for c in classes if bits & self.bit[c])
            hf = model.head_forward.get(held)
            if hf is not None:
                self.head_cap[bits] = max(self.c0 + hf.high, self.c0 + hf.net + model.head_backward.high)
        # what no plan goes below: setup + the embedding's forward, and the end of the step
        end_level = self.c0 + self.g * num_layers + self.h_all - sum(model.side.values())
        self.floor = max(model.setup(num_layers) + max(model.embedding.high, 0),
                         end_level + (model.tail.high if model.tail.high != NO_EVENT else 0))
        self.fwd_net = [sh.forward.net for sh in self.shapes]
        self.fwd_need = [self.c0 + sh.forward.high for sh in self.shapes]
        self.bwd_base = [self.c0 + sh.forward.net + self.h_all + sh.backward.high for sh in self.shapes]
        self._usable: dict[tuple[int, ...], tuple[list[int], list[int]]] = {}

    def usable(self, budget: int) -> tuple[list[int], list[int]]:
        """The unit kinds a plan under ``budget`` may use (each fits on top of the stack, and no other kind
        dominates it: :func:`_undominated`), and per layer i the least bytes layers i..L-1 can add."""
        L, units = self.L, self.units
        fits = tuple(t for t, u in enumerate(units) if u.size <= L and self.need(t, L - u.size, 0) <= budget)
        found = self._usable.get(fits)
        if found is None:  # the same for every budget that admits the same kinds: made once
            usable = _undominated(self, list(fits))
            min_rest = [0] * (L + 1)
            for i in range(L - 1, -1, -1):
                options = [self.fwd_net[t] + min_rest[i + units[t].size] for t in usable if i + units[t].size <= L]
                min_rest[i] = min(options) if options else 1 << 62
            found = self._usable[fits] = (usable, min_rest)
        return found[0], list(found[1])

    def need(self, t: int, i: int, held: int) -> int:
        """The highest point, minus the bytes S kept below it, that unit t placed at layer i reaches in its
        forward and in its backward: it fits iff S + need <= budget."""
        above = self.L - i - self.units[t].size
        bwd = self.bwd_base[t] + self.g * above - self.side_of_bits[held | self.holds[t]]
        return max(self.fwd_need[t], bwd)


_BIG = np.iinfo(np.int64).max
_REUSE: list[dict[tuple[Any, ...], tuple[UnitModel, _Tables]]] = []  # the open reuse_tables() scopes' tables


@contextmanager
def reuse_tables() -> Iterator[None]:
    """Inside the ``with`` block, :func:`solve` makes the tables of each (model, depth, units, costs) once: a
    pipeline stage's search solves the same stack under many budgets and caps
    (:func:`remat.plan.pipeline.search_stage`). Outside, every call makes its own (a model may change between
    calls)."""
    _REUSE.append({})
    try:
        yield
    finally:
        _REUSE.pop()


def _tables(model: UnitModel, num_layers: int, units: list[Unit], price: Callable[[Unit], int]) -> _Tables:
    """The :class:`_Tables` of (model, depth, units, their costs): made once inside :func:`reuse_tables`."""
    costs = [price(u) for u in units]
    if not _REUSE:
        return _Tables(model, num_layers, units, costs)
    key = (id(model), num_layers, tuple(units), tuple(costs))
    found = _REUSE[-1].get(key)
    if found is not None and found[0] is model:
        return found[1]
    tables = _Tables(model, num_layers, units, costs)
    _REUSE[-1][key] = (model, tables)
    return tables


def solve(model: UnitModel, num_layers: int, budget: int,
          cost: CostModel | Callable[[Unit], int] | None = None, *,
          units: Sequence[Unit] | None = None, incumbent: int | None = None,
          stored_cap: int | None = None) -> Solution | None:
    """The plan of least cost whose modelled peak (:meth:`UnitModel.peak`) is <= ``budget``, or None.

    Ties in cost go to the plan that keeps fewer bytes. Exact dynamic program over the stack, bottom-up: a
    state is (layers planned, which side inputs a unit below keeps); each state keeps the Pareto set of (bytes
    kept below, cost) of the partial plans that reach it and satisfy every bound so far. Adding a unit checks
    its forward and backward bounds, which depend only on the bytes kept below it, its position and the state
    (NOTE [the extended search]); the head's bounds are checked at the end. A unit kind that another kind of the
    same size beats on every count (bytes kept, cost, forward and backward highs, side inputs kept) is never
    needed and is left out. ``incumbent``, the cost of a plan known to fit the model, prunes partial plans whose
    cost plus a lower bound on completing them (:func:`_cost_bound`) exceeds it. ``stored_cap`` also bounds the
    bytes the whole plan keeps (used for pipeline stages, where other microbatches hold that much each).
    """
    start = time.perf_counter()
    units = list(units) if units is not None else candidate_units(num_layers, engine=model.engine,
                                                                  contractions=model.contractions)
    tables = _tables(model, num_layers, units, _pricer(model, cost))
    if tables.floor > budget:
        return None
    L = num_layers
    usable, min_rest = tables.usable(budget)
    limit = budget - min(tables.head_cap.values())
    if stored_cap is not None:
        limit = min(limit, stored_cap)
    inc = _BIG if incumbent is None else incumbent
    bound = _cost_bound(tables, usable, limit) if incumbent is not None else None

    # each state's frontier: arrays S (bytes kept below), C (cost), and where each entry came from (parent state,
    # index there, unit); all frontiers made so far are also kept end to end (flat_s, flat_c) for the merges
    keys: list[tuple[int, int]] = []
    frontiers: list[tuple[np.ndarray, ...]] = []
    kept = 0
    # the usable units' numbers as arrays: each state's transitions are screened at once
    ut = np.asarray(usable, np.int64)
    u_size = np.asarray([units[t].size for t in usable], np.int64)
    u_net = np.asarray([tables.fwd_net[t] for t in usable], np.int64)
    u_cost = np.asarray([tables.costs[t] for t in usable], np.int64)
    u_fneed = np.asarray([tables.fwd_need[t] for t in usable], np.int64)
    u_bbase = np.asarray([tables.bwd_base[t] for t in usable], np.int64)
    u_holds = np.asarray([tables.holds[t] for t in usable], np.int64)
    t_net = np.asarray(tables.fwd_net, np.int64)
    t_cost = np.asarray(tables.costs, np.int64)
    side_of = np.asarray(tables.side_of_bits, np.int64)
    rest_of = np.asarray(min_rest, np.int64)
    # transitions not yet merged, one row each, in the order they were made (source state, then unit): destination
    # layer and side bits, source state, the run [a, b) of its entries, unit
    pending: list[np.ndarray] = []
    empty = np.zeros(0, np.int64)
    left = np.zeros((6, 0), np.int64)
    flat_s, flat_c, base = empty, empty, empty
    for i in range(L + 1):
        rows = np.concatenate([left, *pending], axis=1) if pending else left
        pending = []
        here = rows[0] == i
        left = rows[:, ~here]
        _, dh, dkid, da, db, dt = rows[:, here]
        if len(frontiers) > len(base):  # frontiers made since the last layer join the flat arrays
            new = frontiers[len(base):]
            sizes = np.fromiter((len(f[0]) for f in new), np.int64, len(new))
            base = np.concatenate([base, len(flat_s) + np.cumsum(sizes) - sizes])
            flat_s = np.concatenate([flat_s, *(f[0] for f in new)])
            flat_c = np.concatenate([flat_c, *(f[1] for f in new)])
        groups: list[tuple[int, np.ndarray | None]] = [(0, None)] if i == 0 else []
        if len(dh):
            order = dh.argsort(kind="stable")  # by side bits; each group keeps the order its rows were made
            hs = dh[order]
            cuts = [0, *((hs[1:] != hs[:-1]).nonzero()[0] + 1).tolist(), len(hs)]
            groups += [(int(hs[a]), order[a:b]) for a, b in zip(cuts, cuts[1:])]
        for held, g in groups:
            lower = None if bound is None else (bound[0], bound[1] - bound[2] * i)
            if g is None:  # the start: nothing planned, nothing kept
                merged = _merge_runs(np.zeros(1, np.int64), np.zeros(1, np.int64), np.full(1, -1, np.int64),
                                     np.zeros(1, np.int64), np.full(1, -1, np.int64), np.ones(1, np.int64),
                                     limit - min_rest[i], inc, lower)
            else:
                kid_g, a_g, b_g, t_g = dkid[g], da[g], db[g], dt[g]
                lengths = b_g - a_g
                rep = np.repeat(np.arange(len(g)), lengths)
                starts = np.cumsum(lengths) - lengths
                pos = a_g[rep] + np.arange(len(rep)) - starts[rep]
                at = base[kid_g][rep] + pos
                tr = t_g[rep]
                merged = _merge_runs(flat_s[at] + t_net[tr], flat_c[at] + t_cost[tr], kid_g, pos, t_g, lengths,
                                     limit - min_rest[i], inc, lower, rep)
            S, C = merged[0], merged[1]
            if not len(S):
                continue
            kid = len(keys)
            keys.append((i, held))
            frontiers.append(merged)
            kept += len(S)
            if i == L:
                continue
            # per unit (as _Tables.need): the entries that fit its bounds and leave room for the layers above
            # are a prefix of S; those cheap enough for the incumbent a suffix (C falls as S rises)
            j = np.minimum(i + u_size, L)
            need = np.maximum(u_fneed, u_bbase + tables.g * (L - i - u_size) - side_of[held | u_holds])
            top = np.minimum(budget - need, limit - rest_of[j] - u_net)
            n = S.searchsorted(top, side="right")
            m = np.zeros_like(n) if inc == _BIG else (-C).searchsorted(u_cost - inc, side="left")
            ok = ((i + u_size <= L) & (m < n)).nonzero()[0]
            if len(ok):
                pending.append(np.stack((j[ok], held | u_holds[ok], np.full(len(ok), kid, np.int64), m[ok], n[ok],
                                         ut[ok])))
    best: tuple[int, int, int, int] | None = None  # (cost, S, state, index)
    for kid, key in enumerate(keys):
        if key[0] != L:
            continue
        S, C = frontiers[kid][:2]
        ok = np.nonzero((S <= budget - tables.head_cap.get(key[1], 1 << 62)) & (S <= limit))[0]
        if len(ok):
            j = ok[np.lexsort((S[ok], C[ok]))[0]]
            cand = (int(C[j]), int(S[j]), kid, int(j))
            if best is None or cand[:2] < best[:2]:
                best = cand
    if best is None:
        return None
    chosen: list[Unit] = []
    kid, idx = best[2], best[3]
    while kid >= 0:
        _, _, parent, pidx, unit = frontiers[kid]
        if unit[idx] < 0:
            break
        chosen.append(units[int(unit[idx])])
        kid, idx = int(parent[idx]), int(pidx[idx])
    chosen.reverse()
    return Solution(chosen, best[0], model.peak(chosen), kept, time.perf_counter() - start)


def cost_lower_bound(model: UnitModel, num_layers: int, budget: int,
                     cost: CostModel | Callable[[Unit], int] | None = None, *, units: Sequence[Unit] | None = None,
                     stored_cap: int | None = None) -> float:
    """A number no greater than the cost of :func:`solve`'s plan for the same arguments (``math.inf`` when no plan
    fits for certain, 0 when nothing better is known): the fractional-knapsack bound of :func:`_cost_bound` on
    completing the empty plan, a little below it (for float rounding)."""
    units = list(units) if units is not None else candidate_units(num_layers, engine=model.engine,
                                                                  contractions=model.contractions)
    tables = _tables(model, num_layers, units, _pricer(model, cost))
    if tables.floor > budget:
        return math.inf
    usable, _ = tables.usable(budget)
    limit = budget - min(tables.head_cap.values())
    if stored_cap is not None:
        limit = min(limit, stored_cap)
    bound = _cost_bound(tables, usable, limit)
    if bound is None or any(tables.costs[t] < 0 for t in usable):
        return 0.0
    return bound[0] * max(0, -bound[1]) * (1 - 1e-6)


def _merge_runs(S: np.ndarray, C: np.ndarray, parents: np.ndarray, pos: np.ndarray, units: np.ndarray,
                lengths: np.ndarray, s_limit: int, incumbent: int, lower: tuple[float, int] | None = None,
                rep: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
    """The Pareto set of the entries (S, C) that arrive at one state in runs (one per transition, in the order
    they were made: ``parents``, ``units`` and ``lengths`` per run, ``rep`` the run of each entry, ``pos`` each
    entry's index in its parent's frontier), sorted by S: an entry stays when every entry of smaller or equal S
    costs more (equal S and cost: the first stays). Entries above ``s_limit`` go, and so do entries whose cost
    plus a lower bound on what completing them costs, ``rate * max(0, S - offset)`` with ``lower = (rate,
    offset)``, exceeds ``incumbent``. Returns (S, C, parent, index in the parent, unit) of the survivors."""
    if rep is None:
        rep = np.repeat(np.arange(len(lengths)), lengths)
    # which entries stay is decided on S and C alone; where the survivors came from is looked up afterwards
    keep = (S <= s_limit) & (C <= incumbent)
    if lower is not None and lower[0] > 0:
        need = lower[0] * np.maximum(S - lower[1], 0).astype(np.float64)
        keep &= (C - incumbent).astype(np.float64) + need * (1 - 1e-9) <= 0.5
    sel = keep.nonzero()[0]
    if len(lengths) > 8:
        # most entries come through groups from far below and are dominated: the Pareto set of the runs from the
        # latest source (the layer just below: one-layer units) is found first, and an entry of the others stays
        # only when no entry of that set has smaller or equal S and cost (binary search: the set's cost falls as
        # S rises)
        from_latest = (parents == parents.max())[rep]
        first = _pareto(S, C, sel[from_latest[sel]])
        rest = sel[~from_latest[sel]]
        at = S[first].searchsorted(S[rest], side="right") - 1
        beaten = (at >= 0) & (C[first][np.maximum(at, 0)] <= C[rest])
        sel = np.concatenate([first, rest[~beaten]])
    sel = _pareto(S, C, sel)
    which = rep[sel]
    return S[sel], C[sel], parents[which], pos[sel], units[which]


def _pareto(S: np.ndarray, C: np.ndarray, sel: np.ndarray) -> np.ndarray:
    """The indices among ``sel`` of the Pareto set of (S, C), sorted by S: an entry stays when it costs less than
    every entry of smaller or equal S (equal S and cost: one stays)."""
    if len(sel) <= 1:
        return sel
    # chunks arrive sorted by S, so a stable sort (timsort: merges runs) by S alone is cheap; an entry stays
    # when it costs less than every entry before it, and of a run of equal S only the last (cheapest) stays
    order = sel[S[sel].argsort(kind="stable")]
    c = C[order]
    before = np.empty(len(c), np.int64)
    before[0] = _BIG
    np.minimum.accumulate(c[:-1], out=before[1:])
    order = order[c < before]
    s_sorted = S[order]
    last = np.ones(len(order), bool)
    last[:-1] = s_sorted[1:] != s_sorted[:-1]
    return order[last]


def _cost_bound(tables: _Tables, usable: list[int], limit: int) -> tuple[float, int, int] | None:
    """``(rate, offset0, per_layer)``: completing a partial plan that keeps S bytes below layer i costs at least
    ``rate * max(0, S - (offset0 - per_layer * i))``.

    Why: the head's bound needs the final S <= ``limit``. Keeping every remaining layer would add
    ``keep`` bytes per layer; each unit instead saves ``keep * size - its bytes``. Units that cost nothing save at
    most ``free`` per layer, so the paid units must save the rest, at no less than ``rate`` per byte beyond the
    free share (a fractional-knapsack bound, valid whatever the order and the other bounds).
    """
    keep = next((t for t in usable if tables.units[t] == KEEP), None)
    if keep is None:
        return None
    a = tables.fwd_net[keep]
    saving = {t: a * tables.units[t].size - tables.fwd_net[t] for t in usable}
    free = max([saving[t] / tables.units[t].size for t in usable if tables.costs[t] == 0] + [0.0])
    rates = [tables.costs[t] / (saving[t] - free * tables.units[t].size) for t in usable
             if tables.costs[t] > 0 and saving[t] > free * tables.units[t].size]
    if not rates:
        return None
    # the saving still needed: S + (a - free) (L - i) - limit = S - offset_i, offset_i = limit - (a - free) (L - i);
    # rounding offset_i up keeps the bound valid
    per_layer = a - free
    return min(rates), math.ceil(limit - per_layer * tables.L), -math.ceil(per_layer)


def _undominated(tables: _Tables, usable: list[int]) -> list[int]:
    """``usable`` without the unit kinds that another kind of the same size beats or ties on every count the
    solver uses (bytes added to S, cost, forward need, backward base, side inputs kept; see
    :meth:`_Tables.need`). Replacing a dominated unit by its dominator in any plan keeps every bound and the
    cost, so the optimum is unchanged; of exact ties the first is kept."""
    def key(t: int) -> tuple[int, ...]:
        return (tables.fwd_net[t], tables.costs[t], tables.fwd_need[t], tables.bwd_base[t])

    out = []
    for b in usable:
        kb = key(b)
        dominated = False
        for a in usable:
            if a == b or tables.units[a].size != tables.units[b].size or tables.holds[a] & ~tables.holds[b]:
                continue
            ka = key(a)
            if all(x <= y for x, y in zip(ka, kb)) and (ka != kb or tables.holds[a] != tables.holds[b] or a < b):
                dominated = True
                break
        if not dominated:
            out.append(b)
    return out


def _pricer(model: UnitModel, cost: CostModel | Callable[[Unit], int] | None) -> Callable[[Unit], int]:
    if cost is None:
        cost = CostModel()
    if isinstance(cost, CostModel):
        cm = cost
        return lambda u: cm.cost(model, u)
    return cost


def tidy(model: UnitModel, units: Sequence[Unit], budget: int,
         cost: CostModel | Callable[[Unit], int] | None = None,
         peak: Callable[[list[Unit]], int] | None = None) -> list[Unit]:
    """The plan ``units`` with recomputation that costs nothing removed where the budget allows.

    FLOP counters give norms and activations no FLOPs, so the solver, which breaks cost ties towards fewer bytes
    kept, may recompute them where it need not. From the top down, each selective layer is replaced by the
    lightest subset of its modules (or a kept layer), and each offload group by a checkpoint group, that costs
    no more and keeps the modelled peak (``peak``, default :meth:`UnitModel.peak`) <= ``budget``; repeated until
    nothing changes. The cost never rises.
    """
    price = _pricer(model, cost)
    peak = peak or model.peak
    units = list(units)
    changed = True
    while changed:
        changed = False
        for j in reversed(range(len(units))):
            u = units[j]
            for v in _lighter(u):
                if price(v) > price(u):
                    continue
                trial = units[:j] + [v] + units[j + 1:]
                if peak(trial) <= budget:
                    units = trial
                    changed = True
                    break
    return units


def _recomputed(modules: Iterable[str]) -> frozenset[str]:
    """What a selective set recomputes, in module names: mlp includes act, non_matmul includes layernorm and act."""
    out = set(modules)
    if "mlp" in out:
        out.add("act")
    if "non_matmul" in out:
        out.update(NON_MATMUL_INCLUDES)
    return frozenset(out)


def _lighter(unit: Unit) -> list[Unit]:
    """Units of the same size that recompute less than ``unit``, lightest first."""
    if unit.mode == "selective" and kept_operators(unit.modules) is not None:
        return [KEEP]
    if unit.mode == "selective":
        work = _recomputed(unit.modules)
        lighter = sorted((s for s in SELECTIVE_SETS if _recomputed(s) < work), key=lambda s: len(_recomputed(s)))
        return [KEEP, *(Unit("selective", 1, s) for s in lighter)]
    if unit.mode == "offload":
        return [Unit("checkpoint", unit.size)]
    return []


def feasible(model: UnitModel, num_layers: int, budget: int, units: Sequence[Unit]) -> bool:
    """Whether some plan made of ``units`` has a modelled peak <= ``budget`` (a DP keeping, per state, only the
    least bytes stored below: that is all feasibility needs)."""
    tables = _Tables(model, num_layers, units, [0] * len(units))
    if tables.floor > budget:
        return False
    L = num_layers
    best: dict[tuple[int, int], int] = {(0, 0): 0}
    for i in range(L):
        for key in sorted(k for k in best if k[0] == i):
            S = best.pop(key)
            for t, u in enumerate(units):
                j = i + u.size
                if j > L or S + tables.need(t, i, key[1]) > budget:
                    continue
                dest = (j, key[1] | tables.holds[t])
                value = S + tables.shapes[t].forward.net
                if value < best.get(dest, 1 << 62):
                    best[dest] = value
    return any(S + tables.head_cap.get(key[1], 1 << 62) <= budget for key, S in best.items() if key[0] == L)


def min_peak(model: UnitModel, num_layers: int, units: Sequence[Unit] | None = None) -> int:
    """The smallest modelled peak any plan made of ``units`` reaches (binary search over :func:`feasible`)."""
    units = list(units) if units is not None else candidate_units(num_layers, engine=model.engine,
                                                                  contractions=model.contractions)
    lo = _Tables(model, num_layers, units, [0] * len(units)).floor
    known = [[u] * num_layers for u in (KEEP, Unit("checkpoint", 1)) if u in units]
    hi = max([model.peak(p) for p in known] + [lo]) if known else 1 << 62
    if not feasible(model, num_layers, hi, units):
        raise RuntimeError("remat.plan: no plan fits even its own peak; the unit model is inconsistent")
    while lo < hi:
        mid = (lo + hi) // 2
        if feasible(model, num_layers, mid, units):
            hi = mid
        else:
            lo = mid + 1
    return lo
