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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from remat.job import Job
from remat.memory.kernels import use_kernels
from remat.memory.outside_allocator import outside_bytes
from remat.memory.trace_pool import idle_cores, idle_workers, run_forked
from remat.offload_policy import MIN_OFFLOADED_TENSOR_SIZE
from remat.parallel.chunk_trace import keep_shallow_chunks, shallow_chunk_keys, shallow_chunks_since
from remat.parallel.job_predict import (
    RankPrediction,
    check_job,
    chunk_config,
    job_kernels,
    outside_allocator_buffers,
    predict_stage,
    stage_state,
)
from remat.parallel.schedule import ChunkSpec, max_in_flight, schedule_actions
from remat.parallel.stages import chunk_policy, cut_plan
from remat.plan.costs import CostModel, candidate_units
from remat.plan.fine_offload import megatron_offload_policies, price_offload
from remat.plan.job_exact import ExactStages
from remat.plan.job_result import JobPlan, JobStagePlan, StageChoice
from remat.plan.job_stages import kind_config, rank_config, stage_chunks, stage_is_moe, stage_kinds, stage_layer_kinds
from remat.plan.job_uniform import uniform_setting
from remat.plan.megatron_screen import cheapest_fit
from remat.plan.moe_modules import job_policies, layer_moe_units, on_every_layer
from remat.plan.options import PlanOptions
from remat.plan.pipeline import solve_stage
from remat.plan.solver import tidy
from remat.plan.unit_model import UnitModel
from remat.plan.unit_prefetch import cancel_prefetches, prefetch_pending, prefetch_unit_model
from remat.policy import Policy
from remat.recompute.plan_format import KEEP, Plan, PlanError, Unit
from remat.units import format_bytes

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
# none / full uniform|block K / selective setting, in cost order, predicted exactly until the first that fits,
# the estimate only a lower bound that skips what cannot fit: NOTE [the Megatron screen of a stage]) and one
# Megatron setting for every stage (what Megatron's flags express; NOTE [the uniform screen] in
# remat.plan.job_uniform). The extended plan never costs more than the stage's Megatron setting (that one is kept
# when cheaper).


def check_job_options(job: Job, options: PlanOptions) -> None:
    """Refuse, naming the option and why, what a whole-job plan cannot honour."""
    if options.measured_times and (job.tp > 1 or job.cp > 1):
        raise PlanError("PlanOptions.measured_times (--measured-times) times an unsharded layer with all s tokens "
                        f"on this machine, not a rank of tp={job.tp} cp={job.cp}: drop it (the roofline prices "
                        "the rank's own FLOPs and bytes; --objective time)")


@dataclass
class _StageModel:
    """The calibrated estimate of one stage's exact peak: unit model + (in flight - 1) x stored + offset."""

    model: UnitModel  # of the stage's layer kind (NOTE [uneven splits])
    cost: CostModel
    depths: tuple[int, ...]  # the layers of each of the stage's chunks (vpp of them), at least one > 0
    in_flight: int
    offset: int = 0
    kinds: tuple[Any, ...] = ()  # the kinds of the stage's layers (ModelConfigs), when it mixes dense and MoE
    # the Megatron settings' figures that do not depend on the microbatches in flight or the offset, shared by the
    # stages of one plan: stages of one layer kind and depth read the same (_screen_rows)
    settings: dict[tuple[Any, ...], list[tuple[Any, ...]]] = field(default_factory=dict)

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
        return self.in_flight_peak(self.model.peak(units), self.stored(units))

    def in_flight_peak(self, peak: int, stored: int) -> int:
        """The unit model's ``peak`` of a plan with the other microbatches in flight keeping its ``stored`` bytes."""
        return peak + (self.in_flight - 1) * stored

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
def plan_job(job: Job, budget: int | str, options: PlanOptions | None = None, *,
             outside_counted: bool = False) -> JobPlan:
    """The cheapest recompute plan of every pipeline stage of ``job`` whose whole rank fits ``budget``.

    Args:
        job: the training job; its own policy is ignored (the plan chooses it).
        budget: one GPU's memory: bytes, or text as :func:`remat.plan.plan` takes (``'70GiB'``, ``'h100-80g'``
            minus ``options.reserve``).
        options: what to search and how to price it (:class:`PlanOptions`: objective, engine, device, offload,
            selective sets, measured times (tp = cp = 1 only), throughput, bandwidths, max_resolves).
        outside_counted: ``budget`` already leaves out the library buffers the job holds outside PyTorch's
            allocator (:mod:`remat.memory.outside_allocator`); by default they are taken off it here.

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
    if job.model.fp8_recipe == "mxfp8":  # its predictions need a Blackwell GPU (remat.memory.fp8.check_fp8_gpu)
        raise PlanError("--fp8-recipe mxfp8 runs on Blackwell GPUs only, and remat plan prices Hopper's (it has no "
                        "--gpu): price each setting with remat predict --gpu b200 --policy ..., or plan another "
                        "--fp8-recipe")
    outside = 0 if outside_counted else max(outside_bytes(outside_allocator_buffers(job, s)) for s in range(job.pp))
    if outside:  # held for the whole run beside every allocation: what the allocator may use is the rest
        if outside >= budget_bytes:
            raise PlanError(f"budget {budget_text}: the job's library buffers outside PyTorch's allocator alone take "
                            f"{format_bytes(outside)}; give a larger --budget")
        budget_bytes -= outside
        budget_text += f" minus {format_bytes(outside)} of library buffers outside PyTorch's allocator"
    check_job_options(job, options)
    engine = options.engine
    states = [stage_state(job, stage) for stage in range(job.pp)]
    result = JobPlan(job, budget_bytes, budget_text, [JobStagePlan(i, st, None, None) for i, st in enumerate(states)],
                     objective=options.objective if not options.measured_times else "time")
    if any(state.total > budget_bytes for state in states):  # no plan can help: trace nothing
        result.stats["seconds"] = time.perf_counter() - started
        return result
    exact = ExactStages(job, options.device, engine, states)
    none = Policy(engine=engine)
    # the first stage's unit model is traced on another core while the stages are predicted (remat.plan.unit_prefetch)
    first_kind = kind_config(rank_config(job), stage_is_moe(rank_config(job), job, 0))
    prefetch_unit_model(first_kind, device=options.device, engine=engine, tp=job.tp, sp=job.sp)
    plain = [exact(stage, none) for stage in range(job.pp)]
    exact.side_by_side = exact.count > 0  # all read back from disk: so will the rest be, forking would cost more
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
        _while_the_unit_model_is_built(job, [st for st, keep in zip(result.stages, keeps) if keep is not None],
                                       first_kind, options)
        kinds = stage_kinds(job, options, [st.stage for st, keep in zip(result.stages, keeps) if keep is not None])
        stage_models: list[_StageModel | None] = []
        settings: dict[tuple[Any, ...], list[tuple[Any, ...]]] = {}  # shared by the stages (_screen_rows)
        for st, pred, keep in zip(result.stages, plain, keeps):
            if keep is None:  # no decoder layer (an embedding- or loss-only stage): recompute cannot lower it
                stage_models.append(None)
                _bare_stage(st, pred, budget_bytes)
                continue
            sm = _StageModel(*kinds[stage_is_moe(config, job, st.stage)], st.chunk_layers, st.in_flight,
                             kinds=stage_layer_kinds(config, job, st.stage), settings=settings)
            sm.calibrate(keep, pred.peak_bytes)
            stage_models.append(sm)
        _search_stages(job, [(st, sm) for st, sm in zip(result.stages, stage_models) if sm is not None], exact,
                       budget_bytes, options, config)
        result.stats["unit_model_build_seconds"] = sum(m.build_seconds for m, _ in kinds.values())
        # stages whose Megatron screen the time cap cut: their setting may not be the cheapest that fits
        result.stats["megatron_search_cut"] = [st.stage for st in result.stages if st.megatron_search_cut]
        uniform_setting(result, stage_models, exact, engine)
    result.stats.update(seconds=time.perf_counter() - started, exact_predictions=exact.count)
    return result


# NOTE [stages side by side]: a stage's Megatron screen (with its fine-grained offloading) and its extended search
# read nothing the other writes (the extended search starts from the stage's calibration on "nothing recomputed"
# and meets the Megatron setting only when it chooses between the two at the end), and stages read nothing of each
# other, so with several cores they run side by side in forked workers (remat.memory.trace_pool.run_forked), the
# longer extended searches first. Each sends back what it set on its stage and the exact predictions it made; they
# are merged here into what one process running them in order (Megatron screen, offloading, extended search, stage
# by stage) holds: the same plans, predictions and ``tried`` order, each prediction counted once. Without
# offloading, a screen is its exact predictions, made one after the other: those it will likely make (the
# candidates the lower bound lets through, up to the first the estimate says fits, at most MAX_AHEAD a stage), and
# the costliest of those first fits on every stage (what the setting for every stage, remat.plan.job_uniform, then
# likely predicts), are made by workers beside the extended searches instead (alike stages by the worker that
# predicts the first of them, laid out from the shallow traces it made: ExactStages.groups), and the screens run here
# after them, each prediction taken (kept, counted) only when asked for (ExactStages.keep_ahead): the same answers,
# on 2 cores.
MAX_AHEAD = 4


def _search_stages(job: Job, searched: Sequence[tuple[JobStagePlan, _StageModel]], exact: ExactStages, budget: int,
                   options: PlanOptions, config: Any) -> None:
    """Each searched stage's best Megatron setting (:func:`_megatron_stage`, :func:`_offload_stage`) and extended
    plan (:func:`_extended_stage`), side by side where there are cores (NOTE [stages side by side])."""
    engine = options.engine
    workers = min(idle_workers(), 2 * len(searched)) if exact.side_by_side else 1
    if workers <= 1:  # one free core (or the disk cache answers): in order, in this process
        for st, sm in searched:
            _megatron_stage(st, sm, exact, budget, engine, config)
            if options.fine_grained_offload:
                _offload_stage(job, st, sm, exact, budget, options)
            _extended_stage(st, sm, exact, budget, options)
        return
    known, known_chunks = frozenset(exact.done), shallow_chunk_keys()
    tried, offsets = [dict(st.tried) for st, _ in searched], [sm.offset for _, sm in searched]
    # without offloading the screens are quick once their predictions are made: those they will likely make are
    # made ahead beside the extended searches, and the screens run here after them
    wanted: list[tuple[int, Plan | Policy]] = []
    likely: list[tuple[int, Policy]] = []  # each stage's setting the estimate says fits first, with its cost
    for st, sm in [] if options.fine_grained_offload else searched:
        plans, fit = _screen_ahead(sm, budget, engine, config, lambda p, s=st.stage: exact.key(s, p)[0] in known)
        wanted += [(st.stage, plan) for plan in plans]
        if fit is not None:
            likely.append((sm.plan_cost(fit), fit.megatron_policy()[0]))
    if likely:  # the setting for every stage (remat.plan.job_uniform) is likely the costliest stage's own
        wanted += [(st.stage, max(likely, key=lambda c: c[0])[1]) for st, _ in searched]
    # each group of alike stages in one task: the others are laid out from the shallow traces its first makes
    ahead = [_in_order([exact.ahead(*first), *(exact.ahead(*other) for other in others)])
             for first, others in exact.groups(wanted)]

    def megatron(i: int) -> Callable[[], Any]:
        def task() -> Any:
            st, sm = searched[i]
            st.tried = dict(tried[i])  # the stage as before its search (a task run again here finds it so)
            _megatron_stage(st, sm, exact, budget, engine, config)
            if options.fine_grained_offload:
                _offload_stage(job, st, sm, exact, budget, options)
            return (st.tried, st.policy, st.prediction, st.megatron, st.megatron_without_offload,
                    st.offload_options, st.megatron_search_cut, exact.made_since(known),
                    shallow_chunks_since(known_chunks))
        return task

    def extended(i: int) -> Callable[[], Any]:
        def task() -> Any:
            st, sm = searched[i]
            st.tried, st.resolves, sm.offset = dict(tried[i]), 0, offsets[i]
            fitting = _extended_search(st, sm, exact, budget, options)
            found = (st.tried, st.resolves, sm.offset, fitting, exact.made_since(known),
                     shallow_chunks_since(known_chunks))
            sm.offset = offsets[i]  # as the Megatron screen expects it, should it run here too
            return found
        return task
    n = len(searched)
    screens = [] if ahead else [megatron(i) for i in range(n)]
    answers = run_forked([extended(i) for i in range(n)] + screens + ahead, min(workers, n + len(screens + ahead)))
    if ahead:  # the screens (here) find what the extended searches and the tasks ahead predicted
        exact.keep_ahead([answer for group in answers[n:] for answer in group])
        for *_, e_made, e_chunks in answers[:n]:
            exact.adopt(e_made)
            keep_shallow_chunks(e_chunks)
    for i, (st, sm) in enumerate(searched):
        e_tried, st.resolves, e_offset, fitting, e_made, e_chunks = answers[i]
        if ahead:
            sm.offset = offsets[i]
            (m_tried, st.policy, st.prediction, st.megatron, st.megatron_without_offload, st.offload_options,
             st.megatron_search_cut, m_made, m_chunks) = megatron(i)()
        else:
            (m_tried, st.policy, st.prediction, st.megatron, st.megatron_without_offload, st.offload_options,
             st.megatron_search_cut, m_made, m_chunks) = answers[n + i]
            exact.adopt(m_made)
        sm.offset = e_offset
        exact.adopt(e_made)
        keep_shallow_chunks(m_chunks + e_chunks)  # for the Megatron setting of every stage, predicted here next
        st.tried = {**m_tried, **e_tried}  # the Megatron screen's entries first, as in one process
        # a worker sends back its own copy of a prediction made before it was forked: this process's is the same
        # (ExactStages.adopt), and one object is replayed once (the report's caching-allocator figures)
        st.megatron, st.megatron_without_offload = (_held(exact, st.stage, c)
                                                    for c in (st.megatron, st.megatron_without_offload))
        if st.policy is not None and st.prediction is not None:
            st.prediction = exact.done.get(exact.key(st.stage, st.policy)[0], st.prediction)
        _choose(st, [c for c in (_held(exact, st.stage, c) for c in fitting) if c is not None])


def _in_order(tasks: Sequence[Callable[[], Any]]) -> Callable[[], list[Any]]:
    """One task running ``tasks`` one after the other, its answer theirs in order."""
    return lambda: [task() for task in tasks]


def _held(exact: ExactStages, stage: int, choice: StageChoice | None) -> StageChoice | None:
    """``choice`` with the prediction ``exact`` holds for its setting, when it holds one."""
    if choice is None:
        return None
    pred = exact.done.get(exact.key(stage, choice.layout)[0])
    return choice if pred is None or pred is choice.prediction else replace(choice, prediction=pred)


# NOTE [tracing ahead]: when every stage does not fit with nothing recomputed, the stages' searches need the unit
# model, which another core is still building when the stages' "nothing recomputed" predictions are done; the
# wait is spent tracing, per kind of stage, the shallow chunks of selective/core_attn (often the cheapest setting
# that fits a large model: what a stage's screen and the setting for every stage then predict), then the one that
# every Megatron full/block setting of 3 to L-1 layers of it is laid out from, until the unit model is sent. The
# answers do not change: a chunk laid out from a shallow trace is the same whichever one it is (NOTE [composing
# a chunk trace]); only dense, non-MLA models (whose unit models do not depend on what was traced before them in
# the process).
def _while_the_unit_model_is_built(job: Job, stages: Sequence[JobStagePlan], kind: Any, options: PlanOptions) -> None:
    """Trace ahead what the stages' searches will likely predict while the unit model is built (NOTE [tracing
    ahead])."""
    if job.model.is_moe or job.model.multi_latent_attention or not prefetch_pending(
            kind, device=options.device, engine=options.engine, tp=job.tp, sp=job.sp) or (idle_cores() or 0.0) < 0.75:
        return  # (no core free beside the unit model's: tracing here would only slow it down)
    seen: set[tuple[Any, ...]] = set()
    for st, core in [(st, True) for st in stages] + [(st, False) for st in stages]:
        layers = max(st.chunk_layers)
        chunks = (core, tuple(c.kind for c in stage_chunks(job, st.stage)))
        if (not core and layers < 5) or chunks in seen:
            continue
        seen.add(chunks)
        if not prefetch_pending(kind, device=options.device, engine=options.engine, tp=job.tp, sp=job.sp):
            return
        policy = Policy("selective", modules=("core_attn",), engine=options.engine) if core else Policy(
            "full", "block", layers - 2, engine=options.engine)
        try:  # the prediction is not kept: only the traces it leaves in this process's caches are wanted
            predict_stage(job.replace(policy=policy), st.stage, device=options.device)
        except Exception:  # a trace made ahead is never needed for the answer: whatever fails, stop
            return


def _deepest(job: Job, stage: int) -> ChunkSpec:
    return max(stage_chunks(job, stage), key=lambda c: c.num_layers)  # the first of the deepest


def _stage_layout(job: Job, st: JobStagePlan) -> None:
    """The stage's chunks' layers, its deepest chunk's layers and the most microbatch-chunks it holds at once."""
    vpp = job.vpp or 1
    specs = stage_chunks(job, st.stage)
    actions = schedule_actions(job.schedule, job.pp, job.num_microbatches, vpp, st.stage, runtime="megatron",
                               group=job.microbatch_group_size)
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


def _screen_rows(sm: _StageModel, engine: str, config: Any) -> tuple[int, list[tuple[Any, ...]]]:
    """The stage's slack and its Megatron screen's candidates in cost order: (cost, recomputed bytes, modelled peak,
    policy, plan, bytes held beyond the rank at the modelled peak) each (NOTE [the Megatron screen of a stage]);
    each setting's plan and figures made once for the stages of one layer kind and depth."""
    m, L = sm.model, sm.num_layers
    key = (id(m), id(sm.cost), sm.depths, engine, config)  # (the stages' models and costs live as long as the plan)
    if key not in sm.settings:
        figures = []
        for policy in job_policies(L, engine, config, sm.cost, [m]):
            plan = Plan.from_policy(policy, L)
            units = plan.units()
            figures.append((sm.plan_cost(plan), sum(m.shape(u).recompute_bytes for u in units), m.peak(units),
                            sm.stored(units), policy, plan, m.beyond_rank(units)))
        sm.settings[key] = figures
    rows = [(cost, recomputed, sm.in_flight_peak(peak, stored), policy, plan, beyond)
            for cost, recomputed, peak, stored, policy, plan, beyond in sm.settings[key]]
    rows.sort(key=lambda r: r[:3])
    return m.held_beyond_rank(L), rows


def _screen_ahead(sm: _StageModel, budget: int, engine: str, config: Any, known: Callable[[Plan], bool],
                  ) -> tuple[list[Plan], Plan | None]:
    """What the stage's Megatron screen will likely predict (NOTE [stages side by side]): its candidates in order
    that the lower bound lets through, up to the first the estimate says fits (also returned; None: none within
    MAX_AHEAD), at most MAX_AHEAD not ``known`` (predicted already)."""
    _, rows = _screen_rows(sm, engine, config)
    out: list[Plan] = []
    for _, _, modelled, _, plan, held in rows:
        if len(out) == MAX_AHEAD:
            break
        if modelled + sm.offset - held <= budget:
            if not known(plan):
                out.append(plan)
            if modelled + sm.offset <= budget:
                return out, plan
    return out, None


def _megatron_stage(st: JobStagePlan, sm: _StageModel, exact: Callable[[int, Plan], RankPrediction], budget: int,
                    engine: str, config: Any = None) -> None:
    """The cheapest Megatron setting of the stage that fits, predicted exactly (NOTE [the job search])."""
    L = sm.num_layers
    # each candidate's estimate less the bytes its modelled peak holds beyond the rank is a lower bound of its exact
    # peak (NOTE [the Megatron screen of a stage] in remat.plan.megatron_screen); the whole slack when that breaks
    slack, rows = _screen_rows(sm, engine, config)

    def predict(i: int) -> int:
        pred = exact(st.stage, rows[i][4])
        st.tried[str(rows[i][3])] = pred.peak_bytes
        return pred.peak_bytes
    found = cheapest_fit([r[2] for r in rows], sm.offset, slack, budget, predict, held=[r[5] for r in rows])
    st.megatron_search_cut = found.cut
    if found.chosen is not None:
        policy, plan = rows[found.chosen][3:5]
        pred = exact(st.stage, plan)
        st.policy, st.prediction, st.megatron = policy, pred, sm.choice(plan, "megatron", pred)
        return
    lowest = min((exact(st.stage, rows[i][4]) for i in found.peaks), key=lambda p: p.peak_bytes, default=None)
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
    _choose(st, _extended_search(st, sm, exact, budget, options))


def _extended_search(st: JobStagePlan, sm: _StageModel, exact: Callable[[int, Plan], RankPrediction], budget: int,
                     options: PlanOptions) -> list[StageChoice]:
    """The extended plans found and predicted exactly for the stage (re-solved while one does not fit), those that
    fit: what :func:`_choose` picks from with the stage's Megatron setting."""
    m, L, engine = sm.model, sm.num_layers, options.engine
    units = [u for u in candidate_units(L, offload=options.offload, engine=engine, selective_sets=(
        options.selective_sets), contractions=m.contractions) if _traced(m, u)] + layer_moe_units(m, options)
    units = [u for u in units if on_every_layer(u, sm.kinds)]  # a stage mixing kinds: units every layer takes
    full_stored = sm.stored([KEEP] * L)

    def price(u: Unit) -> int:  # tidy tries lighter selective sets: one the layer lacks is never lighter
        return sm.cost.cost(m, u) if _traced(m, u) and on_every_layer(u, sm.kinds) else sys.maxsize
    keep = Plan.from_units([KEEP] * L, engine)
    if all(price(u) > 0 for u in units if u.mode != "keep") and exact(st.stage, keep).peak_bytes <= budget:
        # nothing recomputed fits and every other unit costs something: keep is the one plan the search finds
        return [sm.choice(keep, "extended", exact(st.stage, keep))]
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
    return fitting


def _choose(st: JobStagePlan, fitting: list[StageChoice]) -> None:
    """The stage's answer: the cheapest of the extended plans that fit and its Megatron setting."""
    fitting = list(fitting)
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

