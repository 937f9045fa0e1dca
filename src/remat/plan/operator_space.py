"""The operator-level plan space: a layer's operators (what ``keep_ops(...)`` indexes), the items a plan keeps or
recomputes together, and the unit kinds the planner offers for them (a knapsack frontier per layer)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import SAC_IGNORED_OPS

from remat.config import ModelConfig
from remat.memory import disk_cache
from remat.memory.measure import FLOP_FORMULAS, operator_flops
from remat.models.collectives import in_collective
from remat.plan.unit_trace import watch_one_layer
from remat.recompute.plan_format import keep_ops_token


@dataclass(frozen=True)
class LayerOperator:
    """One operator of a layer's forward, as ``keep_ops(...)`` counts them (NOTE [operator sets] in
    :mod:`remat.recompute.plan_format`): its index, aten name, the bytes of the new storages it allocates
    (``new_bytes``: 0 for views and in-place operators), the bytes its tensor outputs span (``out_bytes``: what
    it writes), its FLOPs (``torch.utils.flop_counter`` formulas), and ``item``: the index of the operator it is
    kept or recomputed with (itself; for an in-place operator the one that made the tensor it mutates), or -1
    when keeping it is never useful or never safe (views, which hold their base's storage, and in-place chains
    some other operator reads in between); ``random``: it draws random numbers (dropout's bernoulli_)."""

    index: int
    name: str
    new_bytes: int
    out_bytes: int
    flops: int
    item: int
    random: bool = False


class _Lister(TorchDispatchMode):
    """Lists the operators of one layer's forward as torch's selective checkpointing sees them."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.inside = 0
        self.ops: list[LayerOperator] = []
        self.made_by: dict[int, int] = {}       # storage -> the operator that allocated it
        self.last_read: dict[int, int] = {}     # storage -> the last operator that read it
        self.chain_end: dict[int, int] = {}     # storage -> the last in-place operator on it
        layer.register_forward_pre_hook(lambda m, a: setattr(self, "inside", self.inside + 1))
        layer.register_forward_hook(self._leave)

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        self.inside -= 1
        # what the layer returns lives on in the next layer: keeping it in this layer's cache would make its
        # lifetime depend on the neighbours, so the operators that made it are never kept
        escaping = {t.untyped_storage()._cdata for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)}
        for s in escaping:
            if s in self.made_by:
                self._unkeep(self.ops[self.made_by[s]].item)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.inside or func in SAC_IGNORED_OPS or in_collective():  # NOTE [collectives are not operators]
            return out
        i = len(self.ops)
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        fresh = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in outs
                 if t.untyped_storage()._cdata not in inputs}
        packet = func.overloadpacket
        flops = operator_flops(FLOP_FORMULAS[packet], args, kwargs, out) if packet in FLOP_FORMULAS else 0
        mutable = func._schema.is_mutable
        if fresh:
            item = i
        elif mutable and args and isinstance(args[0], torch.Tensor):
            target = args[0].untyped_storage()._cdata
            root = self.made_by.get(target, -1)
            # the chain root .. this operator must run as one: nobody else may read the tensor in between
            since = self.chain_end.get(target, root)
            item = root if root >= 0 and self.ops[root].item == root and self.last_read.get(target, -1) <= since \
                else -1
            if item < 0 and root >= 0:  # unsafe to keep: the whole chain is recomputed
                self._unkeep(root)
            self.chain_end[target] = i
        else:
            item = -1  # a view (its output shares an input's storage)
        for s in inputs:
            self.last_read[s] = i
        for s in fresh:
            self.made_by[s] = i
        self.ops.append(LayerOperator(i, str(func), sum(fresh.values()),
                                      sum(t.numel() * t.element_size() for t in outs), flops, item,
                                      torch.Tag.nondeterministic_seeded in func.tags))
        return out

    def _unkeep(self, root: int) -> None:
        if root < 0:
            return
        for k, op in enumerate(self.ops):
            if op.item == root:
                self.ops[k] = LayerOperator(op.index, op.name, op.new_bytes, op.out_bytes, op.flops, -1, op.random)


@functools.lru_cache(maxsize=32)
def _listed(config: ModelConfig, tp: int, sp: bool) -> tuple[LayerOperator, ...]:
    key = {"config": config.to_dict(), "tp": tp, "sp": sp}
    stored = disk_cache.load("layer_operators", key)
    try:
        if stored is not None:
            return tuple(LayerOperator(int(i), str(n), int(nb), int(ob), int(f), int(it), bool(r))
                         for i, n, nb, ob, f, it, r in stored)
    except (TypeError, ValueError):
        pass
    ops = _list(config, tp, sp)
    disk_cache.store("layer_operators", key, [[op.index, op.name, op.new_bytes, op.out_bytes, op.flops, op.item,
                                               op.random] for op in ops])
    return ops


def _list(config: ModelConfig, tp: int, sp: bool) -> tuple[LayerOperator, ...]:
    return tuple(watch_one_layer(config, tp, sp, _Lister).ops)


def layer_operators(config: ModelConfig, tp: int = 1, sp: bool = False) -> tuple[LayerOperator, ...]:
    """The operators of one layer's forward of ``config`` (of one tensor-parallel rank with ``tp``/``sp``), in
    the order ``keep_ops(...)`` indexes them (a fake forward; cached in memory and on disk)."""
    return _listed(config.replace(num_layers=1), tp, sp)


@dataclass(frozen=True)
class Item:
    """Operators kept or recomputed together (one operator, or an operator and the in-place operators that
    finish its tensor: the dropout mask's empty_like, bernoulli_ and div_), the bytes keeping them holds and the
    price of recomputing them."""

    indices: tuple[int, ...]
    nbytes: int
    price: float
    random: bool = False


def operator_items(ops: Sequence[LayerOperator], price: Callable[[LayerOperator], float]) -> list[Item]:
    """The keepable items of a layer (every operator with ``item >= 0``, grouped by item), each priced as the sum
    of ``price`` over its operators."""
    groups: dict[int, list[LayerOperator]] = {}
    for op in ops:
        if op.item >= 0:
            groups.setdefault(op.item, []).append(op)
    return [Item(tuple(o.index for o in g), sum(o.new_bytes for o in g), sum(price(o) for o in g),
                 any(o.random for o in g)) for g in groups.values()]


def roofline_price(flops_per_second: float, memory_bandwidth: float) -> Callable[[LayerOperator], float]:
    """Seconds to recompute an operator: its FLOPs at ``flops_per_second`` plus the bytes it writes at
    ``memory_bandwidth`` (the unit model's convention for a recomputed unit, operator by operator)."""
    return lambda op: op.flops / flops_per_second + op.out_bytes / memory_bandwidth


def measured_price(times: Mapping[str, float]) -> Callable[[LayerOperator], float]:
    """Seconds to recompute an operator, measured on this machine (``op_<i>`` keys of
    :func:`remat.plan.costs.measure_layer_times`; 0 for an operator it lacks)."""
    return lambda op: float(times.get(f"op_{op.index}", 0.0))


# NOTE [operator kinds]: per layer, which operators' outputs are kept is priced by the bytes recomputing them frees
# per second it costs. The items (operator_items) are ordered by price per byte, cheapest first (ties: larger
# first), and every prefix of that order is offered as a unit kind keep_ops(<the other items' operators>): the
# vertices of the fractional knapsack's frontier, one layer kind per budget level, as fine as torch's per-module
# discard ratios (sac_milp picks one ratio per module and keeps, by a knapsack over its operators, the best
# memory per time). The solver's dynamic program then picks a kind per layer exactly, and its dominance pruning
# drops the kinds no plan needs. Views are always recomputed (free; keeping one holds its base's storage).
def operator_kinds(ops: Sequence[LayerOperator], price: Callable[[LayerOperator], float], *,
                   most: int | None = None) -> tuple[tuple[str, ...], ...]:
    """The ``keep_ops(...)`` selective sets of the prefixes of the layer's items ordered by price per byte freed
    (NOTE [operator kinds]): from keeping every item but the cheapest to keeping none. With ``most``, at most
    that many, spread evenly over the bytes freed (the last, keep nothing, always included)."""
    items = [it for it in operator_items(ops, price) if it.nbytes > 0]
    items.sort(key=lambda it: (it.price / it.nbytes, -it.nbytes, it.indices))
    # a kept draw of random numbers makes the recomputation skip it, so every later draw must be kept too: random
    # items are recomputed in the order they draw (an earlier one joins the prefix before a later one)
    draws = sorted((it for it in items if it.random), key=lambda it: it.indices)
    ordered: list[Item] = []
    for it in items:
        if it.random:
            ordered += [d for d in draws if d.indices <= it.indices and d not in ordered]
        elif it not in ordered:
            ordered.append(it)
    items = ordered
    kinds: list[tuple[tuple[str, ...], int]] = []
    freed = 0
    for k in range(1, len(items) + 1):
        freed += items[k - 1].nbytes
        kept = [i for it in items[k:] for i in it.indices]
        kinds.append(((keep_ops_token(kept),), freed))
    if most is not None and len(kinds) > most:
        total = kinds[-1][1]
        chosen: list[tuple[str, ...]] = []
        for j in range(1, most + 1):
            target = total * j / most
            pick = next(kind for kind, f in kinds if f >= target - 1e-9)
            if pick not in chosen:
                chosen.append(pick)
        return tuple(chosen)
    return tuple(kind for kind, _ in kinds)
