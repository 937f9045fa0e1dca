"""torch.compile peers of ``bench_plan.py``: the profiler's peak instrument, torch.compile's
``activation_memory_budget`` search (:class:`CompileSearch`) and remat's plans compiled (``remat.apply(model, plan)``
then ``torch.compile(model)``, NOTE [regions under torch.compile] in ``remat.recompute.region``): planned for the
compiled step (:class:`RematCompiledPlanner`, NOTE [compiled planning] in ``remat.plan.compiled``) or eager plans
at searched targets (:class:`RematCompileSearch`), all with the same backend (``aot_eager``: AOTAutograd's
partitioner, no code generation) and the same FLOP count of the compiled graphs."""

from __future__ import annotations

import gc
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

import remat
from remat import ModelConfig, build_model
from remat.plan.api import BudgetError, PlanOptions, plan
from remat.plan.compiled import plan_compiled
from remat.plan.costs import CostModel
from remat.plan.space import SELECTIVE_SETS
from remat.recompute.plan_format import Plan


# ------------------------------------------------------------------------------------------------ instruments
def storage_bytes(tensors: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def step(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor], seed: int = 1234) -> None:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model(*batch)
    loss.backward()


def profiler_peak(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> int:
    """Peak CPU bytes of one step by the profiler's memory timeline: parameters, buffers and batch alive before
    the step, plus the highest running sum of every storage created and destroyed during it."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action

    model.zero_grad(set_to_none=True)
    base = storage_bytes(list(model.parameters()) + list(model.buffers()) + list(batch))
    torch.manual_seed(1234)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as p:
        loss = model(*batch)
        loss.backward()
        del loss
    live = peak = 0
    for _, action, _, size in p._memory_profile().timeline:
        if action == Action.CREATE:
            live += size
        elif action == Action.DESTROY:
            live -= size
        peak = max(peak, live)
    return base + peak


# ------------------------------------------------------------------------------------------------ torch.compile
def counting_backend(counts: dict[str, int]) -> Any:
    """``aot_eager`` whose forward and backward graphs' FLOPs (torch.utils.flop_counter formulas on each node's fake
    value) are added to ``counts['fw']`` and ``counts['bw']`` as they are compiled."""
    from torch._dynamo.backends.debugging import aot_eager, boxed_nop

    from remat.memory.measure import FLOP_FORMULAS  # torch.utils.flop_counter formulas, plus CPU flash attention

    def counting(kind: str) -> Any:
        def compiler(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
            total = 0
            for node in gm.graph.nodes:
                target = getattr(node.target, "overloadpacket", None)
                if node.op == "call_function" and target in FLOP_FORMULAS:
                    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
                    total += int(FLOP_FORMULAS[target](*args, **kwargs, out_val=node.meta.get("val")))
            counts[kind] = counts.get(kind, 0) + total
            return boxed_nop(gm, example_inputs)
        return compiler

    return lambda gm, inputs, **kw: aot_eager(gm, inputs, fw_compiler=counting("fw"), bw_compiler=counting("bw"), **kw)


@dataclass
class Compiled:
    ratio: float
    module: Any
    peak: int
    fw_flops: int
    bw_flops: int
    compile_seconds: float


@dataclass
class CompileSearch:
    """torch.compile models, one per activation_memory_budget ratio, compiled on demand and cached."""

    config: ModelConfig
    batch: Any
    cache: dict[float, Compiled] = field(default_factory=dict)

    def backend(self, counts: dict[str, int]) -> Any:
        return counting_backend(counts)

    def get(self, ratio: float) -> Compiled:
        ratio = round(ratio, 6)
        if ratio not in self.cache:
            import torch._functorch.config as functorch_config

            model = build_model(self.config, seed=0)  # its own instance: its own dynamo cache entry
            counts: dict[str, int] = {}
            functorch_config.activation_memory_budget = ratio
            compiled = torch.compile(model, backend=self.backend(counts))
            start = time.perf_counter()
            step(compiled, self.batch)  # compiles
            seconds = time.perf_counter() - start
            functorch_config.activation_memory_budget = 1.0
            self.cache[ratio] = Compiled(ratio, compiled, profiler_peak(compiled, self.batch), counts.get("fw", 0),
                                         counts.get("bw", 0), seconds)
        return self.cache[ratio]

    def fit(self, budget: int, steps: int = 6) -> tuple[Compiled | None, int, int]:
        """(largest-ratio fitting model found, ratios evaluated, fresh compiles) for ``budget``."""
        before = len(self.cache)
        evaluated: list[float] = []

        def fits(r: float) -> bool:
            evaluated.append(r)
            return self.get(r).peak <= budget

        if fits(1.0):
            return self.get(1.0), len(evaluated), len(self.cache) - before
        lo = None
        for r in (0.5, 0.25, 0.75, 0.125, 0.375, 0.625, 0.875, 0.0):
            if fits(r):
                lo = r
                break
        if lo is None:
            return None, len(evaluated), len(self.cache) - before
        hi = min([r for r in evaluated if r > lo and self.get(r).peak > budget] + [1.0])
        for _ in range(steps):
            mid = (lo + hi) / 2
            if fits(mid):
                lo = mid
            else:
                hi = mid
        return self.get(lo), len(evaluated), len(self.cache) - before


# ------------------------------------------------------------------------------------------------ remat + compile
# The selective sets whose layers compile without a graph break (NOTE [regions under torch.compile]): not
# non_matmul with core_attn/mlp (its rule follows module hooks as operators run); keep_ops kinds are left out too
# (operator_sets=0: their indices count an eager forward's operators, so such layers run eagerly under compile).
COMPILABLE_SETS = tuple(s for s in SELECTIVE_SETS if not ("non_matmul" in s and {"core_attn", "mlp"} & set(s)))


@dataclass
class CompiledPlan:
    target: int            # the budget remat.plan was asked for
    plan: str
    module: Any
    peak: int              # profiler peak of the compiled step
    fw_flops: int
    bw_flops: int
    compile_seconds: float


def compile_plan(config: ModelConfig, plan: Plan, batch: Any, target: int, name: str) -> CompiledPlan:
    """``plan`` applied to a fresh model, compiled (aot_eager, FLOPs counted), one step run, its peak measured."""
    model = build_model(config, seed=0)
    remat.apply(model, plan)
    counts: dict[str, int] = {}
    compiled = torch.compile(model, backend=counting_backend(counts))
    start = time.perf_counter()
    step(compiled, batch)
    seconds = time.perf_counter() - start
    return CompiledPlan(target, name, compiled, profiler_peak(compiled, batch), counts.get("fw", 0),
                        counts.get("bw", 0), seconds)


@dataclass
class RematCompileSearch:
    """remat's plans applied, then compiled (``torch.compile(backend=aot_eager)``, activation_memory_budget 1.0: the
    partitioner's default min-cut outside remat's regions), one per plan, cached by plan.

    remat plans against the eager step's peak; compiled, the same plan keeps fewer bytes (outside its regions the
    partitioner recomputes cheap operators, as it does for the plain model), so a plan for the budget itself would
    recompute more than needed. :meth:`fit` asks ``plan()`` for targets between the budget and the eager
    no-recompute peak and keeps the largest target whose compiled step, measured, fits: the same kind of search
    as torch.compile's over its ratio (:meth:`CompileSearch.fit`), with the same instrument."""

    config: ModelConfig
    batch: Any
    options: PlanOptions
    eager_peak: int
    base: Compiled                                  # compiled at ratio 1.0, no recompute
    cache: dict[str, CompiledPlan] = field(default_factory=dict)

    def plan_for(self, target: int) -> Plan | str | None:
        """remat's plan for ``target`` (None: no recompute needed; 'none fits': no plan)."""
        if target >= self.eager_peak:
            return None
        try:
            return plan(self.config, target, self.options).extended.plan
        except BudgetError:
            return "none fits"

    def get(self, target: int) -> CompiledPlan | None:
        found = self.plan_for(target)
        if found == "none fits":
            return None
        key = "keep all" if found is None else str(found)
        if key not in self.cache:
            if found is None:  # no recompute at all: the same model as compile 1.0
                b = self.base
                self.cache[key] = CompiledPlan(target, key, b.module, b.peak, b.fw_flops, b.bw_flops, 0.0)
            else:
                self.cache[key] = compile_plan(self.config, found, self.batch, target, key)
        return self.cache[key]

    def fit(self, budget: int, steps: int = 3) -> tuple[CompiledPlan | None, int, int]:
        """(the fitting compiled plan of the largest target found, targets evaluated, fresh compiles)."""
        before, evaluated = len(self.cache), []

        def fits(target: int) -> CompiledPlan | None:
            evaluated.append(target)
            found = self.get(target)
            return found if found is not None and found.peak <= budget else None

        best, lo, hi = None, budget, self.eager_peak
        # first guess: the budget plus what compiling saves on the plain model
        guess = min(hi, budget + max(0, self.eager_peak - self.base.peak))
        if guess > lo:
            best = fits(guess)
            lo, hi = (guess, hi) if best is not None else (lo, guess)
        for _ in range(steps):
            mid = (lo + hi) // 2
            if mid <= lo or (best is None and mid == budget):
                break
            found = fits(mid)
            if found is not None:
                best, lo = found, mid
            else:
                hi = mid
        if best is None:
            best = fits(budget)
        return best, len(evaluated), len(self.cache) - before


@dataclass
class RematCompiledPlanner:
    """remat's compiled planning (:func:`remat.plan.compiled.plan_compiled`, NOTE [compiled planning]): per-layer
    choices priced in bytes on the compiled graphs, the cheapest that fits by a knapsack, and each candidate's
    compiled step measured here on the profiler (the instrument torch.compile's fit is judged on); the compiled
    models are cached by plan, so the one timed is the one measured."""

    config: ModelConfig
    batch: Any
    cost: CostModel
    base: Compiled                                  # compiled at ratio 1.0, no recompute
    selective_sets: tuple[tuple[str, ...], ...] = COMPILABLE_SETS
    cache: dict[str, CompiledPlan] = field(default_factory=dict)

    def get(self, p: Plan) -> CompiledPlan:
        key = str(p)
        if all(u.mode == "keep" for u in p.units()):
            b = self.base
            return CompiledPlan(0, "keep all", b.module, b.peak, b.fw_flops, b.bw_flops, 0.0)
        if key not in self.cache:
            self.cache[key] = compile_plan(self.config, p, self.batch, 0, key)
        return self.cache[key]

    def fit(self, budget: int) -> tuple[CompiledPlan | None, dict[str, Any]]:
        """(the compiled plan whose measured peak fits, or None; how it was found: predicted peak, price, resolves,
        plan seconds incl. the measuring compiles, fresh compiles)."""
        before = len(self.cache)
        start = time.perf_counter()
        found = plan_compiled(self.config, budget, self.base.peak, lambda p: self.get(p).peak, self.cost,
                              self.selective_sets)
        info: dict[str, Any] = {"plan_seconds": time.perf_counter() - start, "fresh_compiles": len(self.cache) - before}
        if found is None:
            return None, info
        info.update(predicted_peak=found.predicted_peak, price=found.cost, resolves=found.resolves)
        mine = self.get(found.plan)
        mine.target = budget
        return mine, info


def time_steps(variants: dict[str, Any], batch: Any, rounds: int, baselines: dict[str, str]) -> dict[str, dict]:
    """Median step seconds per variant and the median per-round ratio to its baseline variant."""
    for fn in variants.values():
        step(fn, batch)  # warm-up
    times: dict[str, list[float]] = {k: [] for k in variants}
    rng = random.Random(0)
    gc.disable()
    try:
        for _ in range(rounds):
            order = list(variants)
            rng.shuffle(order)
            for name in order:
                start = time.perf_counter()
                step(variants[name], batch)
                times[name].append(time.perf_counter() - start)
    finally:
        gc.enable()
    out = {}
    for name, ts in times.items():
        base = baselines.get(name)
        ratios = [a / b for a, b in zip(ts, times[base])] if base else []
        out[name] = {"seconds": statistics.median(ts), "ratio": statistics.median(ratios) if ratios else None,
                     "times": ts}
    return out
