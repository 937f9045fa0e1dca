"""Planning a whole Megatron-LM job (:class:`remat.job.Job`): the cheapest recompute plan of every pipeline stage
whose rank fits the budget with *every* part counted, found by the extended planner and checked exactly.

A rank's peak is its model state (parameters, fp32 main grads, master parameters, optimizer state: alive the whole
step, :func:`remat.parallel.job_predict.stage_state`) plus the activations of the microbatches in flight under the
plan, plus communication buffers: exactly :func:`remat.parallel.job_predict.predict_stage`. Every answer reported
as fitting is that prediction, <= the budget (NOTE [the job search]).
"""

from __future__ import annotations

import functools
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from remat.job import Job
from remat.memory import disk_cache
from remat.memory.kernels import use_kernels
from remat.memory.rank_state import RankState
from remat.offload_policy import MIN_OFFLOADED_TENSOR_SIZE
from remat.parallel.job_predict import RankPrediction, check_job, chunk_config, job_kernels, predict_stage, stage_state
from remat.parallel.schedule import ChunkSpec, max_in_flight, schedule_actions
from remat.parallel.stages import chunk_policy, cut_plan
from remat.plan.costs import CostModel, candidate_units
from remat.plan.fine_offload import megatron_offload_policies, price_offload
from remat.plan.job_stages import kind_config, rank_config, stage_chunks, stage_is_moe, stage_kinds
from remat.plan.moe_modules import job_policies, layer_moe_units
from remat.plan.options import PlanOptions
from remat.plan.pipeline import solve_stage
from remat.plan.solver import tidy
from remat.plan.unit_model import UnitModel
from remat.plan.unit_prefetch import cancel_prefetches, prefetch_unit_model
from remat.policy import Policy
from remat.recompute.plan_format import KEEP, Plan, PlanError, Unit
from remat.timeline import Timeline, TimelineError
from remat.units import format_bytes

STATE_PARTS = ("parameters", "gradients", "master_parameters", "optimizer_state")

# NOTE [the job search]: a rank's model state is the same whatever is recomputed, so each stage's recompute is
# planned by the extended planner (remat.plan.solver: per-layer keep / selective sets / checkpoint and offload
# groups of any size, under the cost objective) on the unit model of one tensor-parallel rank's layers (s/cp
# tokens), with the other microbatches in flight keeping the plan's stored bytes each (solve_stage, as
# plan_pipeline does). The unit model is of one process: it counts the traced parameters (which the rank holds
# too) and lets each layer's bf16 .grad accumulate (on the rank Megatron's DDP hook moves it into the fp32
# main-gradient buffer, part of the model state, and drops it). Neither is counted twice: the estimate is
# calibrated per stage on the exact whole-rank prediction of "nothing recomputed" (offset = exact peak - modelled
# peak), which carries the model state, and it is recalibrated on every plan predicted since. The chosen plan is
# then predicted exactly (predict_stage with the plan run by every chunk of the stage, a shorter chunk its first
# layers under an uneven split, NOTE [uneven splits] in remat.plan.job_stages: model state + microbatches
# in flight + communication), and re-solved under the offset raised by the excess when it does not fit; a plan is
# reported as fitting only on that exact prediction. Beside it, the best Megatron setting of each stage (every
# none / full uniform|block K / selective setting, screened cheapest first by the same estimate, then predicted
# exactly) and one Megatron setting for every stage (what Megatron's flags express). The extended plan never costs
# more than the stage's Megatron setting (that one is kept when cheaper).
MAX_SCREENED = 6  # Megatron settings predicted exactly per stage before the search stops looking for a cheaper one


@dataclass
class StageChoice:
    """One answer for one stage: the plan every chunk of the stage runs and its exact whole-rank prediction."""

    plan: Plan | None  # of the stage's deepest chunk's layers, from 0 (NOTE [uneven splits]); None: it has no layer
    source: str  # 'extended' or 'megatron'
    prediction: RankPrediction
    cost: int  # the objective's value per microbatch, summed over the stage's chunks
    recompute_flops: int  # per microbatch, summed over the stage's chunks
    extra_seconds: float  # predicted seconds the recompute adds per microbatch (CostModel.extra_seconds)
    extra_compute_pct: float  # recompute FLOPs / the stage's layers' forward + backward FLOPs
    # a Megatron setting with fine-grained offloading (NOTE [offloading in a job]); ``plan`` is its recompute part
    offload_policy: Policy | None = None
    host_bytes: int = 0  # with offload_policy: the most one microbatch-chunk holds on the host (traced)
    transfer_seconds: float = 0.0  # with offload_policy: the transfer time charged per microbatch (in ``cost``)

    @property
    def policy(self) -> Policy | None:
        """The Megatron setting this plan is (with its offloading), or None."""
        if self.plan is None:  # a stage without decoder layers recomputes nothing
            return self.offload_policy or Policy()
        return self.offload_policy or self.plan.megatron_policy()[0]

    @property
    def layout(self) -> Plan | Policy:
        """What each chunk of the stage applies (:func:`remat.apply`): the offload policy, else the plan (a shorter
        chunk its first layers, :func:`remat.parallel.stages.chunk_policy`), else (no layer) nothing."""
        return self.offload_policy or self.plan or Policy()

    def to_dict(self) -> dict[str, Any]:
        policy, why = (self.policy, "") if self.offload_policy is not None or self.plan is None else \
            self.plan.megatron_policy()
        p = self.prediction
        return {"plan": str(self.layout), "plan_json": None if self.offload_policy is not None or self.plan is None
                else self.plan.to_dict(),
                "source": self.source, "host_bytes_per_microbatch": self.host_bytes,
                # the rank's host peak over its microbatches in flight (the stage timeline's host_memory)
                "host_peak_bytes": (p.timeline.meta.get("host_memory") or {}).get("peak_bytes", 0),
                "transfer_seconds": self.transfer_seconds,
                "megatron_policy": None if policy is None else str(policy),
                "megatron_args": None if policy is None else _megatron_args(policy), "why_not_megatron": why,
                "rank": p.rank, "peak_bytes": p.peak_bytes, "peak_phase": p.timeline.peak_phase.label, **p.parts,
                "cost": self.cost, "recompute_flops": self.recompute_flops, "extra_seconds": self.extra_seconds,
                "extra_compute_pct": self.extra_compute_pct}


@dataclass
class JobStagePlan:
    """What one pipeline stage runs, or why nothing fits it: the extended plan and the best Megatron setting."""

    stage: int
    state: RankState
    policy: Policy | None  # the best Megatron setting of the stage; None: none fits
    prediction: RankPrediction | None  # of ``policy``, or the lowest peak predicted when nothing fits
    tried: dict[str, int] = field(default_factory=dict)  # plan or policy -> exact predicted peak
    extended: StageChoice | None = None  # the cheapest plan that fits (None: nothing fits)
    megatron: StageChoice | None = None  # ``policy`` as a choice
    megatron_without_offload: StageChoice | None = None  # the best recompute-only setting, when offloading won
    offload_options: list[dict[str, Any]] = field(default_factory=list)  # fine-grained variants priced
    layers: tuple[int, int] = (0, 0)  # the first and last layer of its deepest chunk (the plan's); last < first: none
    chunk_layers: tuple[int, ...] = ()  # the layers of each of its chunks (an uneven split: not all the same)
    in_flight: int = 1  # the most microbatch-chunks it holds at once
    resolves: int = 0  # extended plans that did not fit when predicted exactly
    note: str = ""

    @property
    def fits(self) -> bool:
        return self.extended is not None


@dataclass
class JobPlan:
    """What :func:`plan_job` found: each stage's cheapest plan (extended search) with its best Megatron setting
    and, when one exists, one Megatron setting for every stage (what Megatron's flags express), all predicted
    exactly on every rank."""

    job: Job
    budget_bytes: int
    budget_text: str
    stages: list[JobStagePlan]
    uniform: Policy | None = None
    uniform_ranks: list[RankPrediction] = field(default_factory=list)  # worst first
    objective: str = "extra_flops"
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        """Every stage has a plan whose exact whole-rank peak is <= the budget."""
        return all(s.fits for s in self.stages)

    @property
    def state_fits(self) -> bool:
        """Every rank's model state alone is within the budget."""
        return all(s.state.total <= self.budget_bytes for s in self.stages)

    def worst_state(self) -> JobStagePlan:
        return max(self.stages, key=lambda s: (s.state.total, -s.stage))

    def ranks(self) -> list[RankPrediction]:
        """The exact prediction of each stage's plan, worst first (empty unless every stage fits)."""
        if not self.fits:
            return []
        return sorted((s.extended.prediction for s in self.stages if s.extended is not None),
                      key=lambda r: (-r.peak_bytes, r.stage))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready. Per stage: ``policy`` (its best Megatron setting) and ``tried``; ``rank``, ``peak_bytes``
        and the parts (:data:`STATE_PARTS`, ``activations``, ``communication``) of the plan it runs (the extended
        one, or the Megatron one when nothing fits); ``extended`` and ``megatron`` (:meth:`StageChoice.to_dict`).
        ``uniform``: the one Megatron setting for every stage with its flags and rows."""
        stages = []
        for s in self.stages:
            row: dict[str, Any] = {"stage": s.stage, "fits": s.fits, "policy": None if s.policy is None else str(
                s.policy), "state": s.state.parts(), "state_bytes": s.state.total, "tried": s.tried,
                "layers": list(s.layers),
                "chunk_layers": list(s.chunk_layers), "in_flight": s.in_flight, "resolves": s.resolves, "note": s.note,
                "extended": None if s.extended is None else s.extended.to_dict(),
                "megatron": None if s.megatron is None else s.megatron.to_dict(),
                "megatron_without_offload": None if s.megatron_without_offload is None else
                s.megatron_without_offload.to_dict(), "fine_grained_offload": s.offload_options}
            shown = s.extended.prediction if s.extended is not None else s.prediction
            if shown is not None:
                row.update(rank=shown.rank, peak_bytes=shown.peak_bytes, **shown.parts)
            else:
                row.update(rank=None, peak_bytes=None)
            stages.append(row)
        uniform = None
        if self.uniform is not None:
            uniform = {"policy": str(self.uniform), "megatron_args": _megatron_args(self.uniform),
                       "rows": [{"rank": r.rank, "stage": r.stage, "peak_bytes": r.peak_bytes, **r.parts}
                                for r in self.uniform_ranks]}
        return {"format": "remat.plan-job", "version": 1, "fits": self.fits, "budget_bytes": self.budget_bytes,
                "budget": self.budget_text, "objective": self.objective, "stages": stages, "uniform": uniform,
                "stats": self.stats}


def _megatron_args(policy: Policy) -> list[str] | None:
    try:
        return policy.to_megatron_args()
    except ValueError:
        return None


def check_job_options(job: Job, options: PlanOptions) -> None:
    """Refuse, naming the option and why, what a whole-job plan cannot honour."""
    if options.measured_times and (job.tp > 1 or job.cp > 1):
        raise PlanError("PlanOptions.measured_times (--measured-times) times an unsharded layer with all s tokens "
                        f"on this machine, not a rank of tp={job.tp} cp={job.cp}: drop it (the roofline prices "
                        "the rank's own FLOPs and bytes; --objective time)")


class _Exact:
    """Exact whole-rank predictions of (stage, plan or policy), each computed once, and kept on disk
    (:mod:`remat.memory.disk_cache`, keyed by the job, the stage and the plan) for the next run."""

    def __init__(self, job: Job, device: str, engine: str, states: Sequence[RankState]):
        self.job, self.device, self.engine, self.states = job, device, engine, states
        self.done: dict[tuple[int, str], RankPrediction] = {}
        self.count = 0  # predictions made (not read from the disk cache)
        self.job_key = repr(job.replace(policy=Policy()))
        self.kernels = job_kernels()  # plan_job's profile (one for the search and every exact prediction)

    def __call__(self, stage: int, plan: Plan | Policy) -> RankPrediction:
        policy = plan if isinstance(plan, Policy) else plan.megatron_policy()[0]  # a Policy: fine-grained offloading
        key = (stage, str(policy) if policy is not None else f"plan {plan}@{plan.engine}")
        if key not in self.done:
            self.done[key] = self._predict(stage, plan, policy, key[1])
        return self.done[key]

    def _predict(self, stage: int, plan: Plan | Policy, policy: Policy | None, layout: str) -> RankPrediction:
        disk_key = {"job": self.job_key, "stage": stage, "layout": layout, "device": self.device,
                    "kernels": self.kernels}
        stored = disk_cache.load("job_stage", disk_key)
        if stored is not None:
            try:
                return RankPrediction(stage, int(stored["rank"]), int(stored["ranks"]), self.states[stage],
                                      Timeline.from_dict(stored["timeline"]))
            except (KeyError, TypeError, ValueError, TimelineError) as err:
                warnings.warn(f"remat cache: a stored stage prediction is malformed ({err}); predicting it again",
                              stacklevel=2)
        self.count += 1
        pred = predict_stage(self.job.replace(policy=policy), stage, device=self.device) if policy is not None \
            else predict_stage(self.job, stage, device=self.device, layout=plan)
        disk_cache.store("job_stage", disk_key, {"rank": pred.rank, "ranks": pred.ranks,
                                                 "timeline": pred.timeline.to_dict()})
        return pred


@dataclass
class _StageModel:
    """The calibrated estimate of one stage's exact peak: unit model + (in flight - 1) x stored + offset."""

    model: UnitModel  # of the stage's layer kind (NOTE [uneven splits])
    cost: CostModel
    depths: tuple[int, ...]  # the layers of each of the stage's chunks (vpp of them), at least one > 0
    in_flight: int
    offset: int = 0

    @property
    def num_layers(self) -> int:
        """The depth of the stage's plan: its deepest chunk's."""
        return max(self.depths)

    @property
    def chunks(self) -> int:
        return len(self.depths)

    def chunk_units(self, plan: Plan) -> list[list[Unit]]:
        """The units each chunk with layers runs of the stage's ``plan`` (a shorter chunk: its first layers)."""
        return [(plan if d == plan.num_layers else cut_plan(plan, d)).units() for d in self.depths if d]

    def policy_plan(self, policy: Policy) -> Plan:
        """What a Megatron setting is on the stage's deepest chunk (Megatron's groups end at a chunk's end)."""
        return Plan.from_policy(chunk_policy(policy, self.model.config, self.num_layers), self.num_layers)

    def plan_cost(self, plan: Plan) -> int:
        """The objective's value per microbatch of ``plan``, summed over the stage's chunks."""
        return sum(self.cost.cost(self.model, u) for units in self.chunk_units(plan) for u in units)

    def stored(self, units: Sequence[Unit]) -> int:
        return sum(self.model.shape(u).forward.net for u in units)

    def modelled(self, units: Sequence[Unit]) -> int:
        return self.model.peak(units) + (self.in_flight - 1) * self.stored(units)

    def estimate(self, units: Sequence[Unit]) -> int:
        return self.modelled(units) + self.offset

    def calibrate(self, plan: Plan, exact: int) -> None:
        self.offset = exact - self.modelled(plan.units())

    def choice(self, plan: Plan, source: str, prediction: RankPrediction) -> StageChoice:
        units = [u for chunk in self.chunk_units(plan) for u in chunk]
        m = self.model
        flops = sum(m.shape(u).recompute_flops for u in units if u.mode != "keep")
        base = sum(self.depths) * (m.layer_forward_flops + m.layer_backward_flops)
        return StageChoice(plan, source, prediction, sum(self.cost.cost(m, u) for u in units), flops,
                           sum(self.cost.extra_seconds(m, u) for u in units), 100.0 * flops / base if base else 0.0)


def _one_kernel_profile(plan: Callable[..., JobPlan]) -> Callable[..., JobPlan]:
    """Run ``plan`` under the job's kernel profile (:func:`remat.parallel.job_predict.job_kernels`, default cuda):
    the unit model the search prices (traced lazily) and the exact stage predictions keep the same kernels."""
    @functools.wraps(plan)
    def run(*args: Any, **kwargs: Any) -> JobPlan:
        with use_kernels(job_kernels()):
            return plan(*args, **kwargs)
    return run


@_one_kernel_profile
def plan_job(job: Job, budget: int | str, options: PlanOptions | None = None) -> JobPlan:
    """The cheapest recompute plan of every pipeline stage of ``job`` whose whole rank fits ``budget``.

    Args:
        job: the training job; its own policy is ignored (the plan chooses it).
        budget: one GPU's memory: bytes, or text as :func:`remat.plan.plan` takes (``'70GiB'``, ``'h100-80g'``
            minus ``options.reserve``).
        options: what to search and how to price it (:class:`PlanOptions`: objective, engine, device, offload,
            selective sets, measured times (tp = cp = 1 only), throughput, bandwidths, max_resolves).

    Returns:
        A :class:`JobPlan`: per stage the extended plan and the best Megatron setting, and one Megatron setting for
        every stage, each with its exact whole-rank prediction (NOTE [the job search]). A stage whose model state
        alone exceeds the budget is not traced: nothing fits it.

    Example:
        >>> from remat.config import ModelConfig
        >>> job = Job.build(ModelConfig(num_layers=4, attention="sdpa"), precision="bf16", pp=2, num_microbatches=4)
        >>> plan_job(job, "1GiB").fits
        True
    """
    started = time.perf_counter()
    options = PlanOptions() if options is None else options
    if not isinstance(options, PlanOptions):
        raise PlanError(f"options={options!r}: give a PlanOptions (remat.plan.PlanOptions(...)) or None")
    budget_bytes, budget_text = options.budget(budget)
    check_job(job)
    check_job_options(job, options)
    engine = options.engine
    states = [stage_state(job, stage) for stage in range(job.pp)]
    result = JobPlan(job, budget_bytes, budget_text, [JobStagePlan(i, st, None, None) for i, st in enumerate(states)],
                     objective=options.objective if not options.measured_times else "time")
    if any(state.total > budget_bytes for state in states):  # no plan can help: trace nothing
        result.stats["seconds"] = time.perf_counter() - started
        return result
    exact = _Exact(job, options.device, engine, states)
    none = Policy(engine=engine)
    # the first stage's unit model is traced on another core while the stages are predicted (remat.plan.unit_prefetch)
    first_kind = kind_config(rank_config(job), stage_is_moe(rank_config(job), job, 0))
    prefetch_unit_model(first_kind, device=options.device, engine=engine, tp=job.tp, sp=job.sp)
    plain = [exact(stage, none) for stage in range(job.pp)]
    keeps: list[Plan | None] = []
    for st, pred in zip(result.stages, plain):
        _stage_layout(job, st)
        keeps.append(Plan.from_policy(none, max(st.chunk_layers)) if max(st.chunk_layers) else None)
        st.tried[str(keeps[-1] or none)] = pred.peak_bytes
    if all(p.peak_bytes <= budget_bytes for p in plain):  # nothing recomputed fits: nothing is cheaper, no search
        cancel_prefetches()  # no unit model is needed
        for st, pred, keep in zip(result.stages, plain, keeps):
            st.megatron = st.extended = StageChoice(keep, "megatron", pred, 0, 0, 0.0, 0.0)
            st.policy, st.prediction = none, pred
        result.uniform = none
        result.uniform_ranks = sorted(plain, key=lambda r: (-r.peak_bytes, r.stage))
    else:
        config = rank_config(job)
        kinds = stage_kinds(job, options, [st.stage for st, keep in zip(result.stages, keeps) if keep is not None])
        stage_models: list[_StageModel | None] = []
        for st, pred, keep in zip(result.stages, plain, keeps):
            if keep is None:  # no decoder layer (an embedding- or loss-only stage): recompute cannot lower it
                stage_models.append(None)
                _bare_stage(st, pred, budget_bytes)
                continue
            sm = _StageModel(*kinds[stage_is_moe(config, job, st.stage)], st.chunk_layers, st.in_flight)
            sm.calibrate(keep, pred.peak_bytes)
            stage_models.append(sm)
            _megatron_stage(st, sm, exact, budget_bytes, engine, config)
            if options.fine_grained_offload:
                _offload_stage(job, st, sm, exact, budget_bytes, options)
            _extended_stage(st, sm, exact, budget_bytes, options)
        result.stats["unit_model_build_seconds"] = sum(m.build_seconds for m, _ in kinds.values())
        _uniform(result, stage_models, exact, engine)
    result.stats.update(seconds=time.perf_counter() - started, exact_predictions=exact.count)
    return result


def _deepest(job: Job, stage: int) -> ChunkSpec:
    return max(stage_chunks(job, stage), key=lambda c: c.num_layers)  # the first of the deepest


def _stage_layout(job: Job, st: JobStagePlan) -> None:
    """The stage's chunks' layers, its deepest chunk's layers and the most microbatch-chunks it holds at once."""
    vpp = job.vpp or 1
    specs = stage_chunks(job, st.stage)
    actions = schedule_actions(job.schedule, job.pp, job.num_microbatches, vpp, st.stage, runtime="megatron")
    st.in_flight = max_in_flight(actions)
    deep = _deepest(job, st.stage)
    st.layers = (deep.layer_offset, deep.layer_offset + deep.num_layers - 1)
    st.chunk_layers = tuple(c.num_layers for c in specs)


def _bare_stage(st: JobStagePlan, pred: RankPrediction, budget: int) -> None:
    """A stage without decoder layers: its one answer is to recompute nothing (NOTE [uneven splits])."""
    st.prediction = pred
    if pred.peak_bytes <= budget:
        st.policy, st.megatron = Policy(), StageChoice(None, "megatron", pred, 0, 0, 0.0, 0.0)
        st.extended = st.megatron
    else:
        st.note = "it holds no decoder layer, so no recompute lowers it (its embedding/loss and model state)"


def _megatron_stage(st: JobStagePlan, sm: _StageModel, exact: Callable[[int, Plan], RankPrediction], budget: int,
                    engine: str, config: Any = None) -> None:
    """The cheapest Megatron setting of the stage that fits, predicted exactly (NOTE [the job search])."""
    m, L = sm.model, sm.num_layers
    # the estimate may be off by a layer stack's .grad bytes and the side inputs (NOTE [the unit model]) either way
    slack = L * m.grad_per_layer + sum(m.side.values())
    rows = []
    for policy in job_policies(L, engine, config, sm.cost, [m]):
        plan = Plan.from_policy(policy, L)
        units = plan.units()
        rows.append((sm.plan_cost(plan), sum(m.shape(u).recompute_bytes for u in units), sm.modelled(units), policy,
                     plan))
    rows.sort(key=lambda r: r[:3])
    lowest: RankPrediction | None = None
    predicted, offset = 0, sm.offset
    for _, _, modelled, policy, plan in rows:
        if modelled + offset - slack > budget:
            continue
        if predicted >= MAX_SCREENED:
            break
        pred = exact(st.stage, plan)
        predicted += 1
        st.tried[str(policy)] = pred.peak_bytes
        if pred.peak_bytes <= budget:
            st.policy, st.prediction, st.megatron = policy, pred, sm.choice(plan, "megatron", pred)
            return
        if lowest is None or pred.peak_bytes < lowest.peak_bytes:
            lowest = pred
        offset = max(offset, pred.peak_bytes - modelled)  # the model under-estimated here: screen the rest harder
    # nothing screened fits: every layer recomputed is Megatron's lowest peak
    full = Plan.from_policy(Policy("full", "uniform", 1, engine=engine), L)
    pred = exact(st.stage, full)
    st.tried[str(full.megatron_policy()[0])] = pred.peak_bytes
    if pred.peak_bytes <= budget:
        st.policy, st.prediction, st.megatron = full.megatron_policy()[0], pred, sm.choice(full, "megatron", pred)
    else:
        st.prediction = pred if lowest is None or pred.peak_bytes < lowest.peak_bytes else lowest


# NOTE [offloading in a job]: with fine_grained_offload each stage also prices Megatron's fine-grained offloading
# variants (remat.plan.fine_offload.megatron_offload_policies of one chunk's layers): the recompute part by the
# unit model, the transfers (NOTE [fine-grained offload charge]) from the offloaded bytes per layer of one
# microbatch-chunk, traced in one process at the chunk's depth (tp/sp rank, the job's kernels), times the stage's
# chunks. The cheapest that costs less than the stage's best recompute-only setting are predicted exactly
# (predict_stage under the policy: every microbatch in flight offloading), at most MAX_OFFLOAD_SCREENED, and the
# first that fits becomes the stage's Megatron setting; the extended plan is then compared with it.
MAX_OFFLOAD_SCREENED = 3


def _offload_stage(job: Job, st: JobStagePlan, sm: _StageModel,
                   exact: Callable[[int, Plan | Policy], RankPrediction], budget: int, options: PlanOptions) -> None:
    """The stage's cheapest fine-grained offloading variant, when it fits and beats its recompute-only setting."""
    config, deep = rank_config(job), _deepest(job, st.stage)
    chunk = chunk_config(config, deep).with_depth(deep.num_layers)  # the stage's plan is of its deepest chunk
    priced = [price_offload(chunk, p, sm.cost, sm.model, budget, device=options.device, tp=job.tp, sp=job.sp)
              for p in megatron_offload_policies(sm.num_layers, config, options.engine,
                                                 options.min_offloaded_tensor_size)]
    priced.sort(key=lambda o: (o.cost, str(o.policy)))
    best = None if st.megatron is None else st.megatron.cost
    screened = 0
    for o in priced:
        row = {"policy": str(o.policy), "cost": sm.chunks * o.cost, "recompute_cost": sm.chunks * o.recompute_cost,
               "transfer_seconds": sm.chunks * o.transfer_seconds, "host_bytes_per_microbatch": o.host_peak_bytes,
               "megatron_args": o.megatron_args, "peak_bytes": None, "fits": None}
        st.offload_options.append(row)
        if (best is not None and sm.chunks * o.cost >= best) or screened >= MAX_OFFLOAD_SCREENED:
            continue  # not predicted: it cannot be cheaper, or the screen is spent
        pred = exact(st.stage, o.policy)
        screened += 1
        st.tried[str(o.policy)] = row["peak_bytes"] = pred.peak_bytes
        row["fits"] = pred.peak_bytes <= budget
        if row["fits"] and (best is None or sm.chunks * o.cost < best):
            twin = Plan.from_policy(replace(o.policy, offload_modules=(), min_offloaded_tensor_size=(
                MIN_OFFLOADED_TENSOR_SIZE)), sm.num_layers)
            base = sm.choice(twin, "megatron", pred)
            choice = replace(base, cost=sm.chunks * o.cost, extra_seconds=base.extra_seconds + row["transfer_seconds"],
                             offload_policy=o.policy, host_bytes=o.host_peak_bytes,
                             transfer_seconds=row["transfer_seconds"])
            st.megatron_without_offload = st.megatron_without_offload or st.megatron
            st.megatron, st.policy, st.prediction, best = choice, o.policy, pred, choice.cost


def _extended_stage(st: JobStagePlan, sm: _StageModel, exact: Callable[[int, Plan], RankPrediction], budget: int,
                    options: PlanOptions) -> None:
    """The cheapest plan of the extended space whose exact whole-rank peak fits (NOTE [the job search])."""
    m, L, engine = sm.model, sm.num_layers, options.engine
    units = [u for u in candidate_units(L, offload=options.offload, engine=engine, selective_sets=(
        options.selective_sets), contractions=m.contractions) if _traced(m, u)] + layer_moe_units(m, options)
    full_stored = sm.stored([KEEP] * L)

    def price(u: Unit) -> int:  # tidy tries lighter selective sets: one the layer lacks is never lighter
        return sm.cost.cost(m, u) if _traced(m, u) else sys.maxsize
    fitting: list[StageChoice] = []
    seen: set[Plan] = set()
    for _ in range(options.max_resolves + 1):
        sol = solve_stage(m, L, budget - sm.offset, sm.in_flight, sm.cost, units, full_stored)
        if sol is None:
            break
        plan = Plan.from_units(tidy(m, sol.units, budget, price, sm.estimate), engine)
        if plan in seen:
            break
        seen.add(plan)
        pred = exact(st.stage, plan)
        st.tried[str(plan)] = pred.peak_bytes
        if pred.peak_bytes <= budget:
            fitting.append(sm.choice(plan, "extended", pred))
        else:
            st.resolves += 1
        # recalibrate on the exact peak just predicted: lower the offset where the model over-estimated (a cheaper
        # plan may fit), raise it by the excess where it under-estimated
        before = sm.offset
        sm.calibrate(plan, pred.peak_bytes)
        if pred.peak_bytes <= budget and sm.offset >= before:
            break
    if st.megatron is not None:
        fitting.append(st.megatron)
    if fitting:
        # ties in cost go to what Megatron's flags express, then to the lower peak
        st.extended = min(fitting, key=lambda c: (c.cost, c.policy is None, c.prediction.peak_bytes))
    elif not st.note:
        st.note = "no plan of the extended space fits when predicted exactly"


def _traced(model: UnitModel, unit: Unit) -> bool:
    """Whether the layer has what ``unit`` recomputes (an MoE layer has no dense 'act', :func:`unit_model`)."""
    return unit.mode != "selective" or unit in model.shapes


def _uniform(result: JobPlan, stage_models: Sequence[_StageModel | None],
             exact: Callable[[int, Plan | Policy], RankPrediction], engine: str) -> None:
    """The cheapest Megatron setting that fits every stage (what Megatron's flags express), each stage exact: the
    settings of the job's deepest chunk, each what Megatron runs on every stage's chunks (NOTE [uneven splits])."""
    budget = result.budget_bytes
    needed = [s.megatron for s in result.stages]
    if any(c is None for c in needed):
        return
    models = [sm for sm in stage_models if sm is not None]
    least = max(c.cost for c in needed if c is not None)  # no setting cheaper than a stage's own best fits it
    rows, seen = [], set()
    for policy in job_policies(result.job.layers_per_chunk, engine, rank_config(result.job), models[0].cost,
                               [sm.model for sm in models]):
        plans = tuple(sm.policy_plan(policy) for sm in models)
        if plans in seen:  # the same on every stage as a cheaper-listed setting (e.g. full/block/L, full/uniform/1)
            continue
        seen.add(plans)
        c = max(sm.plan_cost(plan) for sm, plan in zip(models, plans))  # the slowest stage's
        # the estimate may be off by a layer stack's .grad bytes and the side inputs (NOTE [the unit model])
        over = any(sm.estimate(plan.units()) - plan.num_layers * sm.model.grad_per_layer - sum(
            sm.model.side.values()) > budget for sm, plan in zip(models, plans))
        if c >= least and not over:
            rows.append((c, max(sm.estimate(plan.units()) for sm, plan in zip(models, plans)), str(policy), policy))
    rows.sort(key=lambda r: r[:3])
    for *_, policy in rows[:MAX_SCREENED]:
        preds = []
        for st in result.stages:
            pred = exact(st.stage, policy)
            st.tried[str(policy)] = pred.peak_bytes
            preds.append(pred)
            if pred.peak_bytes > budget:
                break
        else:
            result.uniform = policy
            result.uniform_ranks = sorted(preds, key=lambda r: (-r.peak_bytes, r.stage))
            return


def smallest_dp(job: Job, stage: JobStagePlan, budget: int) -> int | None:
    """The data-parallel size at which, with the distributed optimizer, the stage's model state would leave room
    under ``budget`` (None when even an unbounded dp would not: parameters and main grads are not sharded)."""
    s = stage.state
    fixed = s.parameters + s.parameter_padding + s.gradients
    sharded = (s.master_parameters + s.optimizer_state) * (job.optimizer_shards if job.distributed_optimizer else 1)
    if fixed >= budget or not sharded:
        return None
    return -(-sharded // (budget - fixed)) // job.cp or 1


def format_state(state: RankState) -> str:
    """``parameters 16.43 GiB + gradients 32.86 GiB + ...`` of a rank's model state."""
    return " + ".join(f"{k} {format_bytes(v)}" for k, v in state.parts().items() if v) + \
        f" = {format_bytes(state.total)}"
