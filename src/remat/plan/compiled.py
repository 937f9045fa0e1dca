"""Plans for a model that runs under ``torch.compile``: what each layer choice saves, measured on the compiled graphs,
a knapsack over the layers, and a measured check of the compiled step's peak (NOTE [compiled planning])."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from remat.config import ModelConfig
from remat.models.gpt import build_model, sample_batch
from remat.plan.costs import CostModel, candidate_units
from remat.plan.unit_model import unit_model
from remat.recompute.apply import apply
from remat.recompute.plan_format import KEEP, Plan, PlanError, Unit

# NOTE [compiled planning]: remat.plan.plan prices a plan by the eager step's peak. Under torch.compile
# (AOTAutograd's min-cut partitioner) the same plan keeps other bytes: outside remat's regions the partitioner
# recomputes cheap operators, and inside a region tagged for recompute it also recomputes what an eager checkpoint
# cannot drop. Checkpointing the activation function alone frees nothing eagerly (fc2 saves the GELU's output,
# which is the region's output), but compiled, the partitioner saves fc1's output and recomputes the GELU in
# backward: 4h x b x s elements per layer for the price of one GELU. So eager peaks both over-state what a
# compiled plan keeps and miss the cheapest compiled choices, and a plan chosen for the eager peak recomputes
# more than needed. Here each per-layer choice (keep, a checkpointed layer, each selective set) is priced in bytes
# by compiling a 2-layer model with both layers so (backend aot_eager, nothing code-generated) and summing the
# distinct storages its forward graphs save for backward (fake values on the graph nodes; storages of the graphs'
# inputs, parameters and batch, are not new bytes): the saving of a choice is the keep model's saved bytes minus
# its own, per layer. A compiled plan's peak is predicted as the compiled no-recompute step's peak (measured by
# the caller) minus the savings of its layers (the compiled step peaks when backward starts, with every layer's
# saved tensors alive), the cheapest plan whose prediction fits is found exactly by a knapsack over the layers
# (:func:`solve_compiled`), and its compiled step's peak is then measured by the caller's instrument: over the
# budget, the knapsack is solved again for a need raised by the excess (the prediction ignores what recomputing in
# backward allocates transiently and the small interactions between layers). The guarantee is the measured one:
# :func:`plan_compiled` returns only a plan whose measured compiled peak is <= the budget. Checkpoint groups of
# more than one layer and keep_ops layers are not offered (a group's saving is not its layers' sum; keep_ops
# indices count an eager forward's operators, such layers run eagerly under compile). The price of a choice is
# the eager one (``CostModel.cost``: measured forward times of what it recomputes, or the roofline), an upper
# bound where the partitioner recomputes less than the region (a checkpointed MLP: fc1 and the GELU, not fc2).


def _storage_key(t: torch.Tensor) -> Any:
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage())


def _nbytes(t: torch.Tensor) -> int:
    n = t.untyped_storage().nbytes()
    return int(n.node.hint) if isinstance(n, torch.SymInt) else int(n)


def forward_saved_bytes(gm: torch.fx.GraphModule) -> int:
    """Bytes of the distinct storages a compiled forward graph returns (its outputs and the tensors saved for
    backward), leaving out storages that alias the graph's inputs (parameters, buffers, batch): from each node's
    fake value, no real tensor needed."""
    inputs = {_storage_key(n.meta["val"]) for n in gm.graph.nodes
              if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)}
    out = next(n for n in gm.graph.nodes if n.op == "output")
    seen, total = set(), 0
    for val in torch.fx.node.map_arg(out.args[0], lambda n: n.meta.get("val")):
        if isinstance(val, torch.Tensor):
            key = _storage_key(val)
            if key not in inputs and key not in seen:
                seen.add(key)
                total += _nbytes(val)
    return total


_SAVED: dict[tuple[ModelConfig, str], int] = {}  # compiled_saved_bytes per (config, plan text), this process


def compiled_saved_bytes(config: ModelConfig, plan: Plan | str | None) -> int:
    """Bytes the forward graphs of ``config``'s model under ``plan`` (None: no recompute) save for backward when
    compiled with ``torch.compile(backend='aot_eager')``: one forward + backward on CPU tensors of
    :func:`~remat.models.gpt.sample_batch`, the bytes counted on the graphs (:func:`forward_saved_bytes`).
    Remembered per config and plan for this process."""
    if plan is not None and not isinstance(plan, Plan):
        plan = Plan.parse(plan)
    key = (config, "none" if plan is None else str(plan))
    if key not in _SAVED:
        _SAVED[key] = _compiled_saved_bytes(config, plan)
    return _SAVED[key]


def _compiled_saved_bytes(config: ModelConfig, plan: Plan | None) -> int:
    from torch._dynamo.backends.debugging import aot_eager, boxed_nop

    total = 0

    def forward(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Any:
        nonlocal total
        total += forward_saved_bytes(gm)
        return boxed_nop(gm, inputs)

    model = build_model(config, seed=0)
    if plan is not None:
        apply(model, plan)
    # every model instance is one more compile of the same forward code: room for them, this call only
    limits = {k: max(getattr(torch._dynamo.config, k), 1 << 12) for k in ("recompile_limit", "cache_size_limit",
                                                                         "accumulated_recompile_limit")
              if hasattr(torch._dynamo.config, k)}
    with torch._dynamo.config.patch(**limits):
        compiled = torch.compile(model, dynamic=False, backend=lambda gm, inputs, **kw: aot_eager(
            gm, inputs, fw_compiler=forward, **kw))
        loss = compiled(*sample_batch(config))
        loss.backward()
    return total


def layer_units(selective_sets: Iterable[Sequence[str]], contractions: Sequence[int] = ()) -> list[Unit]:
    """The per-layer choices compiled planning offers: keep, each selective set (with ``non_matmul`` among them,
    ``non_matmul+matmul_k<K>`` for each contraction size, :func:`~remat.plan.costs.candidate_units`) and a
    checkpointed layer."""
    return candidate_units(1, offload=False, selective_sets=selective_sets, contractions=contractions)


def unit_savings(config: ModelConfig, units: Sequence[Unit]) -> dict[Unit, int]:
    """Bytes each per-layer choice in ``units`` saves per layer under compile (NOTE [compiled planning]): a 2-layer
    model of ``config`` with both layers ``unit`` against both kept, halved; negative savings are kept as
    measured (the solver never picks such a choice for its bytes)."""
    two = config.replace(num_layers=2)
    keep = compiled_saved_bytes(two, None)
    out = {}
    for u in units:
        if u.size != 1 or u.mode not in ("keep", "checkpoint", "selective"):
            raise PlanError(f"compiled planning offers per-layer units only (keep, checkpoint 1, selective), not {u}")
        out[u] = 0 if u == KEEP else (keep - compiled_saved_bytes(two, Plan.from_units([u, u]))) // 2
    return out


def solve_compiled(num_layers: int, need: int, savings: dict[Unit, int],
                   prices: dict[Unit, int], grain: int = 4096) -> tuple[list[Unit], int] | None:
    """The cheapest choice per layer (summed ``prices``) whose summed ``savings`` are >= ``need`` bytes, exactly up
    to the rounding: savings are rounded down and ``need`` up to 1/``grain`` of ``need``, so a returned choice
    saves at least ``need``. Layers are interchangeable under this model; the answer lists the costliest choices
    first (bottom layers); among equally priced answers each layer prefers the cheaper, then the larger-saving
    choice. None when even the largest savings fall short."""
    if num_layers < 1:
        raise PlanError(f"num_layers={num_layers}: give at least 1 layer")
    if need <= 0:
        return [KEEP] * num_layers, 0
    step = max(1, math.ceil(need / grain))
    n = math.ceil(need / step)
    units = [u for u in savings if savings[u] > 0 or u == KEEP]
    if KEEP not in units:
        units.insert(0, KEEP)
    gain = [0 if u == KEEP else min(n, savings[u] // step) for u in units]
    price = [0 if u == KEEP else prices[u] for u in units]
    inf = np.iinfo(np.int64).max // 4
    at = np.arange(n + 1)
    best = np.full(n + 1, inf, dtype=np.int64)  # least price of the layers so far saving >= j steps (j = n: >= n)
    best[0] = 0
    parents = []  # per layer: (unit index, previous j) of each j
    for _ in range(num_layers):
        new = np.full(n + 1, inf, dtype=np.int64)
        unit_of = np.zeros(n + 1, dtype=np.int64)
        prev_of = np.zeros(n + 1, dtype=np.int64)
        # strict improvements only: on a tie the choice met first stays (the cheaper, then the larger saving)
        for i in sorted(range(len(units)), key=lambda i: (price[i], -gain[i])):
            cand, g = best + price[i], gain[i]
            free = n + 1 if g == 0 else n - g  # j + g < n: one j per target
            if free > 0:
                src = at[:free]
                better = cand[src] < new[src + g]
                new[src[better] + g], unit_of[src[better] + g], prev_of[src[better] + g] = cand[src][better], i, \
                    src[better]
            if g > 0:  # j >= n - g all reach n
                j = n - g + int(np.argmin(cand[n - g:]))
                if cand[j] < new[n]:
                    new[n], unit_of[n], prev_of[n] = cand[j], i, j
        best = new
        parents.append((unit_of, prev_of))
    if best[n] >= inf:
        return None
    chosen, j = [], n
    for unit_of, prev_of in reversed(parents):
        chosen.append(units[int(unit_of[j])])
        j = int(prev_of[j])
    chosen.sort(key=lambda u: (-prices.get(u, 0), -savings.get(u, 0)))
    return chosen, int(best[n])


@dataclass
class CompiledPlan:
    """:func:`plan_compiled`'s answer: the plan, its predicted and measured compiled peaks, its price (the cost
    model's unit) and how it was found."""

    plan: Plan
    predicted_peak: int       # the compiled no-recompute peak minus the layers' savings
    measured_peak: int        # the caller's instrument on the compiled step; <= the budget
    cost: int
    resolves: int             # knapsacks solved again after a measured peak over the budget
    seconds: float            # the whole call: savings measured (first call per config), the caller's
    #                           measurements of the candidates, the knapsacks
    savings: dict[Unit, int] = field(default_factory=dict)


def plan_compiled(config: ModelConfig, budget: int, base_peak: int, measure_peak: Callable[[Plan], int],
                  cost: CostModel, selective_sets: Iterable[Sequence[str]], *, engine: str = "reentrant",
                  max_resolves: int = 4) -> CompiledPlan | None:
    """The cheapest per-layer plan for ``config`` under ``torch.compile`` whose compiled step's peak, measured by
    ``measure_peak`` (a plan -> bytes: the caller compiles the model under the plan and measures one step), is <=
    ``budget`` (NOTE [compiled planning]). ``base_peak``: the compiled no-recompute step's peak on the same
    instrument. Each choice (keep, a checkpointed layer, each of ``selective_sets``) is priced by ``cost``
    (:meth:`CostModel.cost` on the unit model of ``config``) and its bytes measured once per config on the
    compiled graphs (:func:`unit_savings`). A measured peak over the budget raises the need by the excess and
    solves again, at most ``max_resolves`` times; None when no plan is predicted to fit or none validated."""
    if budget <= 0 or base_peak <= 0:
        raise PlanError(f"budget={budget} and base_peak={base_peak} must be positive byte counts")
    start = time.perf_counter()
    model = unit_model(config, engine=engine)
    units = layer_units(selective_sets, model.contractions)
    savings = unit_savings(config, units)  # (compiled once per config and choice in this process)
    prices = {u: cost.cost(model, u) for u in units}
    need = base_peak - budget
    for resolves in range(max_resolves + 1):
        found = solve_compiled(config.num_layers, need, savings, prices)
        if found is None:
            return None
        chosen, price = found
        p = Plan.from_units(chosen, engine)
        peak = measure_peak(p)
        if peak <= budget:
            predicted = base_peak - sum(savings[u] for u in chosen)
            return CompiledPlan(p, predicted, peak, price, resolves, time.perf_counter() - start, dict(savings))
        need += peak - budget
    return None
