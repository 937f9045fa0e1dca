"""Planning a whole Megatron-LM job (:class:`remat.job.Job`): the cheapest recompute plan of every pipeline stage
whose rank fits the budget with *every* part counted, found by the extended planner and checked exactly.

A rank's peak is its model state (parameters, fp32 main grads, master parameters, optimizer state: alive the whole
step, :func:`remat.parallel.job_predict.stage_state`) plus the activations of the microbatches in flight under the
plan, plus communication buffers: exactly :func:`remat.parallel.job_predict.predict_stage`. Every answer reported
as fitting is that prediction, <= the budget (NOTE [the job search]).
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from remat.config import ModelConfig
from remat.job import Job
from remat.memory import disk_cache
from remat.memory.kernels import use_kernels
from remat.memory.rank_state import RankState
from remat.parallel.job_predict import RankPrediction, check_job, job_kernels, predict_stage, stage_state
from remat.parallel.schedule import max_in_flight, partition, rank_chunks, schedule_actions
from remat.plan.costs import CostModel, candidate_units
from remat.plan.megatron import megatron_policies
from remat.plan.options import PlanOptions
from remat.plan.pipeline import solve_stage
from remat.plan.solver import tidy
from remat.plan.unit_model import UnitModel, unit_model
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
# then predicted exactly (predict_stage with the plan run by every chunk of the stage: model state + microbatches
# in flight + communication), and re-solved under the offset raised by the excess when it does not fit; a plan is
# reported as fitting only on that exact prediction. Beside it, the best Megatron setting of each stage (every
# none / full uniform|block K / selective setting, screened cheapest first by the same estimate, then predicted
# exactly) and one Megatron setting for every stage (what Megatron's flags express). The extended plan never costs
# more than the stage's Megatron setting (that one is kept when cheaper).
MAX_SCREENED = 6  # Megatron settings predicted exactly per stage before the search stops looking for a cheaper one


@dataclass
class StageChoice:
    """One answer for one stage: the plan every chunk of the stage runs and its exact whole-rank prediction."""

    plan: Plan  # of one model chunk's layers, numbered from 0
    source: str  # 'extended' or 'megatron'
    prediction: RankPrediction
    cost: int  # the objective's value per microbatch, summed over the stage's chunks
    recompute_flops: int  # per microbatch, summed over the stage's chunks
    extra_seconds: float  # predicted seconds the recompute adds per microbatch (CostModel.extra_seconds)
    extra_compute_pct: float  # recompute FLOPs / the stage's layers' forward + backward FLOPs

    @property
    def policy(self) -> Policy | None:
        """The Megatron setting this plan is, or None."""
        return self.plan.megatron_policy()[0]

    def to_dict(self) -> dict[str, Any]:
        policy, why = self.plan.megatron_policy()
        p = self.prediction
        return {"plan": str(self.plan), "plan_json": self.plan.to_dict(), "source": self.source,
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
    layers: tuple[int, int] = (0, 0)  # the stage's first and last layer (of its first chunk)
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
                "layers": list(s.layers), "in_flight": s.in_flight, "resolves": s.resolves, "note": s.note,
                "extended": None if s.extended is None else s.extended.to_dict(),
                "megatron": None if s.megatron is None else s.megatron.to_dict()}
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


def rank_config(job: Job) -> ModelConfig:
    """The model as one rank of ``job`` runs it: s/cp tokens per sequence, an untied embedding when pipelined."""
    config = job.model.replace(seq_length=job.model.seq_length // job.cp)
    if job.pp * (job.vpp or 1) > 1 and config.tie_embeddings:
        config = config.replace(tie_embeddings=False)
    return config


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

    def __call__(self, stage: int, plan: Plan) -> RankPrediction:
        policy, _ = plan.megatron_policy()
        key = (stage, str(policy) if policy is not None else f"plan {plan}@{plan.engine}")
        if key not in self.done:
            self.done[key] = self._predict(stage, plan, policy, key[1])
        return self.done[key]

    def _predict(self, stage: int, plan: Plan, policy: Policy | None, layout: str) -> RankPrediction:
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

    model: UnitModel
    cost: CostModel
    num_layers: int  # of each chunk
    chunks: int  # per rank (vpp)
    in_flight: int
    offset: int = 0

    def stored(self, units: Sequence[Unit]) -> int:
        return sum(self.model.shape(u).forward.net for u in units)

    def modelled(self, units: Sequence[Unit]) -> int:
        return self.model.peak(units) + (self.in_flight - 1) * self.stored(units)

    def estimate(self, units: Sequence[Unit]) -> int:
        return self.modelled(units) + self.offset

    def calibrate(self, plan: Plan, exact: int) -> None:
        self.offset = exact - self.modelled(plan.units())

    def choice(self, plan: Plan, source: str, prediction: RankPrediction) -> StageChoice:
        units = plan.units()
        m, c = self.model, self.chunks
        flops = c * sum(m.shape(u).recompute_flops for u in units if u.mode != "keep")
        base = c * self.num_layers * (m.layer_forward_flops + m.layer_backward_flops)
        return StageChoice(plan, source, prediction, c * sum(self.cost.cost(m, u) for u in units), flops,
                           c * sum(self.cost.extra_seconds(m, u) for u in units),
                           100.0 * flops / base if base else 0.0)


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
    keep = Plan.from_policy(Policy(engine=engine), job.layers_per_chunk)
    plain = [exact(stage, keep) for stage in range(job.pp)]
    for st, pred in zip(result.stages, plain):
        _stage_layout(job, st)
        st.tried[str(keep)] = pred.peak_bytes
    if all(p.peak_bytes <= budget_bytes for p in plain):  # nothing recomputed fits: nothing is cheaper, no search
        for st, pred in zip(result.stages, plain):
            st.megatron = st.extended = StageChoice(keep, "megatron", pred, 0, 0, 0.0, 0.0)
            st.policy, st.prediction = keep.megatron_policy()[0], pred
        result.uniform = keep.megatron_policy()[0]
        result.uniform_ranks = sorted(plain, key=lambda r: (-r.peak_bytes, r.stage))
    else:
        config = rank_config(job)
        model = unit_model(config, device=options.device, engine=engine, tp=job.tp, sp=job.sp)
        cost = options.cost_model(config)
        result.stats["unit_model_build_seconds"] = model.build_seconds
        stage_models = []
        for st, pred in zip(result.stages, plain):
            sm = _StageModel(model, cost, job.layers_per_chunk, job.vpp or 1, st.in_flight)
            sm.calibrate(keep, pred.peak_bytes)
            stage_models.append(sm)
            _megatron_stage(st, sm, exact, budget_bytes, engine)
            _extended_stage(st, sm, exact, budget_bytes, options)
        _uniform(result, stage_models, exact, engine)
    result.stats.update(seconds=time.perf_counter() - started, exact_predictions=exact.count)
    return result


def _stage_layout(job: Job, st: JobStagePlan) -> None:
    """The stage's first chunk's layers and the most microbatch-chunks it holds at once."""
    vpp = job.vpp or 1
    specs = rank_chunks(partition(rank_config(job), job.pp, vpp), job.pp, st.stage)
    actions = schedule_actions(job.schedule, job.pp, job.num_microbatches, vpp, st.stage, runtime="megatron")
    st.in_flight = max_in_flight(actions)
    st.layers = (specs[0].layer_offset, specs[0].layer_offset + specs[0].num_layers - 1)


def _megatron_stage(st: JobStagePlan, sm: _StageModel, exact: Callable[[int, Plan], RankPrediction], budget: int,
                    engine: str) -> None:
    """The cheapest Megatron setting of the stage that fits, predicted exactly (NOTE [the job search])."""
    m, L = sm.model, sm.num_layers
    # the estimate may be off by a layer stack's .grad bytes and the side inputs (NOTE [the unit model]) either way
    slack = L * m.grad_per_layer + sum(m.side.values())
    rows = []
    for policy in megatron_policies(L, engine):
        plan = Plan.from_policy(policy, L)
        units = plan.units()
        rows.append((sum(sm.cost.cost(m, u) for u in units), sum(m.shape(u).recompute_bytes for u in units),
                     sm.modelled(units), policy, plan))
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


def _extended_stage(st: JobStagePlan, sm: _StageModel, exact: Callable[[int, Plan], RankPrediction], budget: int,
                    options: PlanOptions) -> None:
    """The cheapest plan of the extended space whose exact whole-rank peak fits (NOTE [the job search])."""
    m, L, engine = sm.model, sm.num_layers, options.engine
    units = candidate_units(L, offload=options.offload, engine=engine, selective_sets=options.selective_sets,
                            contractions=m.contractions)
    full_stored = sm.stored([KEEP] * L)
    fitting: list[StageChoice] = []
    seen: set[Plan] = set()
    for _ in range(options.max_resolves + 1):
        sol = solve_stage(m, L, budget - sm.offset, sm.in_flight, sm.cost, units, full_stored)
        if sol is None:
            break
        plan = Plan.from_units(tidy(m, sol.units, budget, sm.cost, sm.estimate), engine)
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


def _uniform(result: JobPlan, stage_models: Sequence[_StageModel], exact: Callable[[int, Plan], RankPrediction],
             engine: str) -> None:
    """The cheapest Megatron setting that fits every stage (what Megatron's flags express), each stage exact."""
    budget = result.budget_bytes
    needed = [s.megatron for s in result.stages]
    if any(c is None for c in needed):
        return
    L = stage_models[0].num_layers
    m = stage_models[0].model
    least = max(c.cost for c in needed if c is not None)  # no setting cheaper than a stage's own best fits it
    rows = []
    for policy in megatron_policies(L, engine):
        plan = Plan.from_policy(policy, L)
        units = plan.units()
        c = sum(stage_models[0].cost.cost(m, u) for u in units)
        if c >= least:
            rows.append((c, sum(m.shape(u).recompute_bytes for u in units), max(sm.estimate(units) for sm in
                                                                                  stage_models), plan))
    rows.sort(key=lambda r: r[:3])
    slack = L * m.grad_per_layer + sum(m.side.values())
    screened = 0
    for *_, estimate, plan in rows:
        if estimate - slack > budget:
            continue
        if screened >= MAX_SCREENED:
            return
        screened += 1
        preds = []
        for st in result.stages:
            pred = exact(st.stage, plan)
            st.tried[str(plan.megatron_policy()[0])] = pred.peak_bytes
            preds.append(pred)
            if pred.peak_bytes > budget:
                break
        else:
            result.uniform = plan.megatron_policy()[0]
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
