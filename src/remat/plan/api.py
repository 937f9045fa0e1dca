"""``remat plan``: the cheapest recompute plan whose predicted peak memory fits a budget, guaranteed.

A :class:`Plan` says, for every layer of the reference GPT's stack, one of four things:

* ``keep``: the layer keeps every activation its backward needs (no recompute);
* ``selective``: the named submodules of the layer (``core_attn``, ``mlp``, ``layernorm``, ``act``; see
  :mod:`remat.policy`) are checkpointed and recomputed in backward, the rest is kept; or, with ``non_matmul``,
  the layer keeps only its matrix multiplies' outputs and recomputes every other operator (and the matrix
  multiplies of ``core_attn``/``mlp`` when named with it, or, with ``matmul_k<K>``, those whose contraction
  dimension is <= K: the smallest K frees the most bytes per recomputed FLOP); ``non_matmul`` alone recomputes
  no FLOPs and frees most of the layer's bytes. The extended search offers ``matmul_k<K>`` for each contraction
  size of the layer (:func:`layer_contractions`);
* ``checkpoint``: the layer belongs to a group of consecutive layers that is one checkpoint: only the group's
  inputs are kept and the whole group is recomputed in backward (Megatron's full recompute, but the groups may
  have any sizes and may be anywhere);
* ``offload``: a checkpoint group whose kept hidden-states input waits for backward in host memory (pinned on
  CUDA) instead of device memory, and is copied back when the group's backward starts (see
  ``remat.recompute.offload.offload_to_host``). Gradients are the plain model's, bit for bit.

:func:`plan` answers "what is the cheapest way to fit this budget" twice:

(a) **Megatron space**: every setting Megatron-LM's flags can express (``none``, ``full/uniform/K``,
    ``full/block/K`` for K = 1..L, ``selective`` with each set of core_attn/mlp/layernorm), each predicted by
    :func:`remat.memory.predict.predict_many` (exact fake traces, composed for deep stacks); the answer is the setting
    of least extra compute whose predicted peak is <= the budget.
(b) **Extended space**: every plan made of the four layer modes above, with groups of any sizes. An exact dynamic
    program (:func:`solve`) finds the plan of least extra compute whose *modelled* peak is <= the budget. The
    model (:class:`UnitModel`) is built from two fake traces (``FakeTensorMode``, once per model shape): a stack
    that holds each kind of unit once (a kept layer, a selective layer per module set, checkpoint/offload groups
    of 1, 2 and 3 layers; larger groups repeat a middle layer's events), cut at unit boundaries marked by module
    hooks into per-unit forward and backward event blocks (each block's net bytes, its highest point and the
    FLOPs it recomputes), and a plain two-layer stack for the head when no unit keeps the attention mask. A
    step's live bytes are then a sum of blocks in execution order (setup and embedding, each unit's forward
    bottom-up, the head's forward and backward, each unit's backward top-down, the embedding's backward), plus
    two non-local terms handled exactly: parameter gradients accumulate (a fixed amount per layer) and the
    attention mask / rotary tables live until the lowest unit that keeps them has run its backward. The
    dynamic program walks the stack bottom-up over states (layers planned, which side inputs are kept below)
    with Pareto sets of (bytes kept below, extra compute); a unit's backward bound only needs the bytes kept
    below it and its position, so every constraint is checked exactly when its unit is added. Unit kinds that
    another kind beats on every count are left out, and the best Megatron setting's cost (with a
    fractional-knapsack lower bound on completing a partial plan) prunes the Pareto sets; 128 layers solve in
    a fraction of a second (``benchmarks/bench_plan.py`` times it). FLOP counters give norms and activations
    no FLOPs, so plans tying on FLOPs are then made to recompute as little as the budget allows (:func:`tidy`;
    the cost never rises).

**Guarantee.** The model is checked, not trusted: the chosen plan is predicted with the real trace
(:func:`predict_plan`: :func:`remat.memory.compose.compose` from a shallow trace with every layer role of the plan, or
the whole stack traced when that is refused) and if its traced peak exceeds the budget the program is re-solved
under a budget lowered by the excess (at most a few times; a plan that never validates is not returned).
Every returned plan's *traced* peak is <= the budget. Where the model is exact (the tests compare it with full
traces on random plans of several model variants; the one known approximation is that the attention mask and
rotary tables are taken to be freed at the *end* of their lowest holder's backward, which can only over-estimate
by their bytes) re-solving never happens, and then a smaller budget never gives a cheaper plan (the feasible
set shrinks) and the dynamic program's answer is the exact optimum of the extended space (the tests compare it
with brute force over all segmentations of a 6-layer model). A budget below the smallest reachable peak raises
:class:`BudgetError` with that peak (``min_peak_bytes``) and the plan that reaches it (``plan``).

**Cost.** Extra compute is the FLOPs of what is recomputed (``torch.utils.flop_counter`` formulas, read from
the recompute phases of the fake traces: only matrix multiplies count, so ``non_matmul`` recompute is free), or,
with ``objective='time'``, seconds: FLOPs at ``flops_per_second`` plus the recomputed bytes at
``memory_bandwidth``, or, with ``measured_times=True``, the forward times of the recomputed layers, submodules
and operator classes measured on this machine. Offloading adds the transfer time of the group input, bytes /
``bandwidth``: the copy to the host runs on a side stream while the following layers' forward runs, so only
what exceeds one layer's forward time is charged; the copy back is issued when the group's backward starts and
is charged in full (remat restores just in time and does not prefetch, so nothing hides it; a prefetch during
the previous group's backward would hide it but would also hold the input on the device during that backward,
which the memory model would then have to charge). With the FLOP objective, seconds are converted to FLOPs at
``flops_per_second``.

**Tensor parallelism.** With ``tp`` (and ``sp``) the unit model, the Megatron sweep and the validation trace are
of one tensor-parallel rank (:mod:`remat.models.tensor_parallel`'s Megatron sharding on a simulated group), so the
plan is one
GPU's. On real ranks a communication library may free a collective's buffer later than the simulated rank does
(gloo's worker thread did, in 5% of collectives, until remat's ranks waited for it), so the plans leave one
unsharded hidden-states tensor of room. Megatron's ``--distribute-saved-activations`` is not in the search
(``remat predict --tp`` predicts it), and tensor and pipeline parallelism are not planned together yet.

**Pipelines.** :func:`plan_pipeline` plans each pipeline stage separately (stage r holds up to ``pp - r``
microbatches under 1F1B, so stage 0 needs the most recompute), validates each stage with
:mod:`remat.parallel`'s stage timelines, and reports the step time from the pipeline's critical path against the
best uniform (Megatron) setting.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from remat.config import ModelConfig
from remat.plan.costs import CostModel, candidate_units, measure_layer_times
from remat.plan.megatron import Predicted, megatron_table, predict_plan
from remat.plan.pipeline import plan_pipeline
from remat.plan.solver import Solution, min_peak, solve, tidy
from remat.plan.unit_model import UnitModel, unit_model
from remat.policy import Policy, PolicyError
from remat.recompute.plan_format import Plan, PlanError, Unit
from remat.timeline import Timeline
from remat.units import DEFAULT_RESERVE, format_bytes, parse_budget


class BudgetError(ValueError):
    """The budget is below the smallest peak any plan reaches.

    ``min_peak_bytes`` is that smallest (traced) peak, ``plan`` the :class:`PlanChoice` that reaches it (its plan,
    parts and cost), ``budget_bytes`` the budget that was asked for.
    """

    def __init__(self, message: str, *, budget_bytes: int, min_peak_bytes: int, plan: PlanChoice):
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.min_peak_bytes = min_peak_bytes
        self.plan = plan





# ------------------------------------------------------------------------------------------------ unit model
# Side inputs of the reference GPT: tensors made once per step outside the layers and given to every layer. Each
# lives until the lowest unit that keeps it has run its backward (or, when no unit keeps it, the forward's end).


# ------------------------------------------------------------------------------------------------ plan()
@dataclass
class PlanChoice:
    """One answer of :func:`plan`: the plan and what its traced prediction says.

    ``peak_bytes``/``at_peak``/``peak_phase`` come from the real (fake-tensor) trace; ``model_peak_bytes`` from the
    unit model. ``recompute_flops`` are the recomputation's FLOPs (``torch.utils.flop_counter`` formulas) and
    ``extra_compute_pct`` their share of the plain step's forward + backward FLOPs. ``cost`` is the objective's
    value (:class:`CostModel`). ``offload_bytes`` is what moves to the host (and back) per step and
    ``offload_seconds`` the transfer time charged. ``recompute_bytes`` is what the recomputation allocates again
    (unit model): the memory traffic of work FLOP counters do not see (norms, softmax, dropout, activations).
    """

    plan: Plan
    source: str
    peak_bytes: int
    peak_phase: str
    at_peak: dict[str, int]
    recompute_flops: int
    extra_compute_pct: float
    cost: int
    model_peak_bytes: int | None = None
    offload_bytes: int = 0
    offload_seconds: float = 0.0
    megatron_policy: str | None = None
    megatron_args: list[str] | None = None
    why_not_megatron: str = ""
    recompute_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "recompute_bytes": self.recompute_bytes,
            "plan": str(self.plan), "source": self.source, "peak_bytes": self.peak_bytes,
            "peak_phase": self.peak_phase, "at_peak": self.at_peak, "model_peak_bytes": self.model_peak_bytes,
            "recompute_flops": self.recompute_flops, "extra_compute_pct": self.extra_compute_pct,
            "cost": self.cost, "offload_bytes": self.offload_bytes, "offload_seconds": self.offload_seconds,
            "megatron_policy": self.megatron_policy, "megatron_args": self.megatron_args,
            "why_not_megatron": self.why_not_megatron, "plan_json": self.plan.to_dict(),
        }

    def snippet(self) -> str:
        """Python that applies this plan to a model built elsewhere (``model``)."""
        data = json.dumps(self.plan.to_dict(), separators=(",", ":"))
        return ("import remat\nfrom remat.plan import Plan\n\n"
                f"plan = Plan.from_dict({data})\n"
                "remat.apply(model, plan)  # model: your GPT-style model with a layer stack\n")


@dataclass
class PlanResult:
    """What :func:`plan` found: the best Megatron setting and the best extended plan for the budget."""

    config: ModelConfig
    budget_bytes: int
    budget_text: str
    objective: str
    cost_model: CostModel
    extended: PlanChoice
    megatron: PlanChoice | None
    megatron_note: str
    baseline: Predicted
    stats: dict[str, Any] = field(default_factory=dict)
    pipeline: dict[str, Any] | None = None
    tp: int = 1      # planned for one tensor-parallel rank of tp
    sp: bool = False  # ... with sequence parallelism

    def to_dict(self) -> dict[str, Any]:
        """Everything as JSON-able data (format ``remat.plan-result``)."""
        return {
            "format": "remat.plan-result", "version": 1, "config": self.config.to_dict(),
            "budget_bytes": self.budget_bytes, "budget": self.budget_text, "objective": self.objective,
            "tp": self.tp, "sp": self.sp,
            "cost_model": self.cost_model.describe(),
            "baseline": {"policy": "none", "peak_bytes": self.baseline.peak_bytes, "flops": self.baseline.flops},
            "extended": self.extended.to_dict(),
            "megatron": None if self.megatron is None else self.megatron.to_dict(),
            "megatron_note": self.megatron_note, "stats": self.stats, "pipeline": self.pipeline,
            "snippet": self.extended.snippet(),
        }

    def _rank_text(self) -> str:
        if self.tp == 1 and not self.sp:
            return ""
        return f"; one tensor-parallel rank of {self.tp}" + (" with sequence parallelism" if self.sp else "")

    def format(self) -> str:
        """The report ``remat plan`` prints."""
        c = self.config
        lines = [f"remat plan: {c.num_layers} layers, h={c.hidden_size}, s={c.seq_length}, b={c.micro_batch_size}, "
                 f"{c.dtype}{self._rank_text()}; budget {self.budget_text} = {self.budget_bytes:,} bytes",
                 f"no recompute: peak {format_bytes(self.baseline.peak_bytes)} ({self.baseline.peak_phase})",
                 f"objective: {self.cost_model.describe()}", ""]
        for title, choice in (("Best Megatron-LM setting", self.megatron), ("Best extended plan", self.extended)):
            lines.append(f"{title}:")
            if choice is None:
                lines += [f"  none fits: {self.megatron_note}", ""]
                continue
            lines.append(f"  plan:           {choice.plan}")
            lines.append(f"  predicted peak: {format_bytes(choice.peak_bytes)} ({choice.peak_bytes:,} bytes, "
                         f"{100 * choice.peak_bytes / self.budget_bytes:.1f}% of budget) in {choice.peak_phase}")
            parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in choice.at_peak.items() if v)
            lines.append(f"  at the peak:    {parts}")
            moved = (f", offload {format_bytes(choice.offload_bytes)} each way ({1e3 * choice.offload_seconds:.2f} ms "
                     "charged)") if choice.offload_bytes else ""
            lines.append(f"  extra compute:  {choice.extra_compute_pct:.2f}% ({choice.recompute_flops:,} recomputed "
                         f"FLOPs; {format_bytes(choice.recompute_bytes)} rebuilt in backward){moved}")
            if choice.megatron_args is not None:
                lines.append(f"  Megatron flags: {' '.join(choice.megatron_args) or '(none: no recompute flags)'}")
            else:
                lines.append(f"  Megatron flags: none express it: {choice.why_not_megatron}")
            lines.append("")
        if self.megatron is not None and self.megatron.cost:
            saved = 100 * (1 - self.extended.cost / self.megatron.cost)
            lines.append(f"The extended plan costs {saved:.1f}% less extra compute than the best Megatron setting.")
        if self.pipeline is not None:
            lines.append(self.pipeline.get("summary", ""))
        s = self.stats
        lines.append(f"solve: {1e3 * s.get('dp_seconds', 0):.0f} ms dynamic program ({s.get('entries', 0):,} Pareto "
                     f"entries), unit model {s.get('model_seconds', 0):.1f} s, Megatron sweep "
                     f"{s.get('megatron_seconds', 0):.1f} s, validation trace {s.get('validate_seconds', 0):.1f} s, "
                     f"re-solves {s.get('resolves', 0)}")
        lines += ["", "Apply it:", textwrap_indent(self.extended.snippet(), "  ")]
        return "\n".join(lines)


def textwrap_indent(text: str, prefix: str) -> str:
    return "\n".join(prefix + line if line else line for line in text.splitlines())


def _choice(config: ModelConfig, plan_: Plan, tl: Timeline | Predicted, source: str, cost: CostModel,
            model: UnitModel, baseline: Predicted) -> PlanChoice:
    pred = tl if isinstance(tl, Predicted) else Predicted.of(tl)
    base = baseline.flops.get("forward", 0) + baseline.flops.get("backward", 0)
    recompute = pred.flops.get("recompute", 0)
    policy, why = plan_.megatron_policy()
    args = None
    if policy is not None:
        try:
            args = policy.to_megatron_args()
        except PolicyError as err:
            args, why = None, str(err)
    units = plan_.units()
    offloaded = sum(1 for u in units if u.mode == "offload")
    return PlanChoice(
        plan=plan_, source=source, peak_bytes=pred.peak_bytes, peak_phase=pred.peak_phase, at_peak=pred.at_peak,
        recompute_flops=recompute, extra_compute_pct=100.0 * recompute / base if base else 0.0,
        cost=sum(cost.cost(model, u) for u in units), model_peak_bytes=model.peak(units),
        offload_bytes=offloaded * model.hidden_bytes, offload_seconds=offloaded * cost.offload_seconds(model),
        megatron_policy=None if policy is None else str(policy), megatron_args=args, why_not_megatron=why,
        recompute_bytes=sum(model.shape(u).recompute_bytes for u in units))


def plan(config: ModelConfig, budget: int | str, *, objective: str = "extra_flops", engine: str = "reentrant",
         device: str = "cpu", offload: bool = True, bandwidth: float = 25e9, flops_per_second: float = 400e12,
         memory_bandwidth: float = 3e12, measured_times: bool | dict[str, float] = False,
         reserve: str | float | None = DEFAULT_RESERVE, selective_sets: Iterable[Sequence[str]] | None = None,
         max_resolves: int = 4,
         pp: int | None = None, microbatches: int | None = None, schedule: str = "1f1b", vpp: int = 1,
         tp: int = 1, sp: bool = False) -> PlanResult:
    """The cheapest recompute plans for ``config`` whose predicted peak is <= ``budget`` (see the module docstring).

    ``budget``: bytes, or text for :func:`parse_budget` (``'70GiB'``, ``'h100-80g'`` minus ``reserve``).
    ``objective``: ``'extra_flops'`` or ``'time'`` (:class:`CostModel`); ``measured_times=True`` prices recompute
    by forward times measured here (:func:`measure_layer_times`; or pass that dict); ``memory_bandwidth`` (bytes
    per second) prices recomputed bytes under the time objective. ``offload=False`` leaves offload groups out of
    the extended search; ``selective_sets`` limits the selective layers' module sets (:func:`selective_sets`,
    e.g. ``selective_sets('core_attn,mlp,layernorm,act')`` for module-level recompute only; default
    :data:`SELECTIVE_SETS`; where ``non_matmul`` is allowed, ``non_matmul+matmul_k<K>`` for each of the layer's
    contraction sizes K is too). ``device='cuda'`` predicts with CUDA's 512-byte blocks.

    Returns a :class:`PlanResult` whose ``extended`` plan has a traced peak <= budget and costs no more than the
    best Megatron setting (``megatron``; None when no setting fits, with the reason in ``megatron_note``).
    Raises :class:`BudgetError` when no plan fits. With ``pp`` (pipeline stages), ``microbatches`` and
    ``schedule``, :func:`plan_pipeline` also plans each stage; its report is in ``pipeline``. With ``tp`` (and
    ``sp``: sequence parallelism) everything is planned for one tensor-parallel rank
    (:mod:`remat.models.tensor_parallel`'s
    Megatron sharding; the budget is one GPU's), leaving room for one unsharded hidden-states tensor
    (``stats['collective_margin_bytes']``): on real ranks the communication thread may free a collective's buffer
    later than the simulated rank does.
    """
    t_start = time.perf_counter()
    if isinstance(budget, str):
        budget_bytes, budget_text = parse_budget(budget, reserve)
    else:
        if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
            raise PlanError(f"budget={budget!r}: give bytes (a positive int) or text such as '70GiB' or 'h100-80g'")
        budget_bytes, budget_text = budget, format_bytes(budget)
    if engine != "reentrant" and offload:
        offload = False  # offload groups need the reentrant engine
    if (tp > 1 or sp) and pp is not None:
        raise PlanError("plan takes tensor parallelism (tp/sp) or pipeline stages (pp), not both yet: plan a "
                        "pipeline stage's layers with tp, or drop tp")
    if (tp > 1 or sp) and measured_times:
        raise PlanError("measured_times times an unsharded layer on this machine, not a tensor-parallel rank: "
                        "drop measured_times with tp > 1")
    L = config.num_layers
    stats: dict[str, Any] = {}
    t = time.perf_counter()
    model = unit_model(config, device=device, engine=engine, tp=tp, sp=sp)
    stats["model_seconds"] = time.perf_counter() - t  # 0 when cached; building it took model.build_seconds
    stats["model_build_seconds"] = model.build_seconds
    measured = None
    if measured_times:
        here = "cuda" if device == "cuda" and torch.cuda.is_available() else "cpu"
        times = measured_times if isinstance(measured_times, dict) else measure_layer_times(config, device=here)
        measured = tuple(sorted(times.items()))
        stats["measured_times"] = dict(measured)
        if objective == "extra_flops":
            objective = "time"
    cost = CostModel(objective, flops_per_second, bandwidth, measured, memory_bandwidth)
    units = candidate_units(L, offload=offload, engine=engine, selective_sets=selective_sets,
                            contractions=model.contractions)

    t = time.perf_counter()
    table = megatron_table(config, device=device, engine=engine, tp=tp, sp=sp)
    stats["megatron_seconds"] = time.perf_counter() - t
    baseline = table[0][1]
    meg: list[tuple[Policy, Predicted, Plan, int, int]] = []
    for policy, pred in table:
        p = Plan.from_policy(policy, L)
        meg.append((policy, pred, p, sum(cost.cost(model, u) for u in p.units()), model.peak(p.units())))
    # Real tensor-parallel ranks: a communication library may let go of a collective's buffer (a reduce-scatter
    # input or all-gather output: one unsharded hidden-states tensor) later than the simulated rank frees it. remat's
    # gloo ranks wait for that (remat.models.tensor_parallel._released); the plans still leave one such tensor of room.
    margin = config.micro_batch_size * config.seq_length * config.hidden_size * \
        torch.empty((), dtype=config.torch_dtype).element_size() if tp > 1 else 0
    limit = budget_bytes - margin
    stats["collective_margin_bytes"] = margin
    fitting = [m for m in meg if m[1].peak_bytes <= limit]
    megatron_choice = None
    if fitting:
        # ties in cost (FLOP counters price norms at zero) go to the setting that rebuilds the fewest bytes
        policy, pred, p, c, _ = min(fitting, key=lambda m: (
            m[3], sum(model.shape(u).recompute_bytes for u in m[2].units()), m[1].peak_bytes))
        megatron_choice = _choice(config, p, pred, "megatron", cost, model, baseline)
        note = ""
    else:
        lowest = min(meg, key=lambda m: m[1].peak_bytes)
        note = (f"the lowest Megatron peak is {format_bytes(lowest[1].peak_bytes)} ({lowest[0]}), above the budget")

    # the extended search: solve under the model, validate with the trace, re-solve below the excess if needed
    model_budget = limit
    chosen: tuple[Plan, Timeline, Solution] | None = None
    dp_seconds, entries, validate_seconds, resolves = 0.0, 0, 0.0, 0
    for _ in range(max_resolves + 1):
        incumbent = min((m[3] for m in meg if m[4] <= model_budget), default=None)
        sol = solve(model, L, model_budget, cost, units=units, incumbent=incumbent)
        if sol is None:
            break
        dp_seconds += sol.seconds
        entries = max(entries, sol.entries)
        tidied = tidy(model, sol.units, model_budget, cost)
        candidate = Plan.from_units(tidied, engine)
        t = time.perf_counter()
        tl = predict_plan(config, candidate, device=device, tp=tp, sp=sp)
        validate_seconds += time.perf_counter() - t
        if tl.peak_bytes <= limit:
            chosen = (candidate, tl, sol)
            break
        resolves += 1
        model_budget -= max(tl.peak_bytes - limit, 1)
    stats.update(dp_seconds=dp_seconds, entries=entries, validate_seconds=validate_seconds, resolves=resolves)

    if chosen is None and megatron_choice is None:
        raise _refusal(config, model, units, cost, budget_bytes, engine, device, baseline, meg, margin)
    if chosen is None:  # no solution validated at this budget: the Megatron answer is a valid plan
        assert megatron_choice is not None
        extended = dataclasses.replace(megatron_choice, source="megatron (no extended plan validated)")
    else:
        extended = _choice(config, chosen[0], chosen[1], "extended", cost, model, baseline)
        if megatron_choice is not None and megatron_choice.cost < extended.cost:
            extended = megatron_choice  # cannot happen when the model is exact; never return the costlier one
    stats["total_seconds"] = time.perf_counter() - t_start
    result = PlanResult(config, budget_bytes, budget_text, cost.objective, cost, extended, megatron_choice, note,
                        baseline, stats, tp=tp, sp=sp)
    if pp is not None:
        result.pipeline = plan_pipeline(config, budget_bytes, pp=pp, microbatches=microbatches or pp,
                                        schedule=schedule, vpp=vpp, cost=cost, device=device, engine=engine,
                                        offload=offload)
    return result


def _refusal(config: ModelConfig, model: UnitModel, units: list[Unit], cost: CostModel, budget: int, engine: str,
             device: str, baseline: Predicted, meg: list[tuple[Policy, Predicted, Plan, int, int]],
             margin: int = 0) -> BudgetError:
    """The :class:`BudgetError` for a budget no plan fits: the smallest peak and the cheapest plan reaching it."""
    L = config.num_layers
    lowest = min_peak(model, L, units)
    sol = solve(model, L, lowest, cost, units=units)
    assert sol is not None
    p = Plan.from_units(tidy(model, sol.units, lowest, cost), engine)
    tl = predict_plan(config, p, device=device, tp=model.tp, sp=model.sp)
    choice = _choice(config, p, tl, "extended", cost, model, baseline)
    best_meg = min(meg, key=lambda m: (m[1].peak_bytes, m[3]))
    if best_meg[1].peak_bytes < choice.peak_bytes:  # only if the model were off: report the lower traced peak
        choice = _choice(config, best_meg[2], best_meg[1], "megatron", cost, model, baseline)
    room = f" plus {margin:,} bytes of room for the collectives' buffers on real tensor-parallel ranks" if margin \
        else ""
    return BudgetError(
        f"no plan fits {format_bytes(budget)} ({budget:,} bytes): the smallest reachable peak is "
        f"{format_bytes(choice.peak_bytes)} ({choice.peak_bytes:,} bytes){room}, with plan {choice.plan}",
        budget_bytes=budget, min_peak_bytes=choice.peak_bytes + margin, plan=choice)
