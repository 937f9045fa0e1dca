"""The public planner: :func:`plan`, the cheapest recompute plan for one GPU (or one tensor-parallel rank, or each
pipeline stage) whose traced peak memory fits a budget. Its parts: the plan space (:mod:`.space`), the unit model
(:mod:`.unit_model`), costs (:mod:`.costs`), the solver (:mod:`.solver`), Megatron's settings (:mod:`.megatron`),
pipelines (:mod:`.pipeline`), options (:mod:`.options`) and the result (:mod:`.result`)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from remat.config import ConfigError, ModelConfig
from remat.memory.trace_pool import idle_workers
from remat.offload_policy import MIN_OFFLOADED_TENSOR_SIZE
from remat.plan.costs import CostModel, candidate_units
from remat.plan.fine_offload import MegatronRow, OffloadOption, choose_offload
from remat.plan.megatron import Predicted, predicted
from remat.plan.moe_modules import add_moe_units, job_policies, layer_moe_units, layer_price
from remat.plan.operator_space import layer_operators, operator_kinds
from remat.plan.options import ParallelOptions, PlanOptions
from remat.plan.pipeline import check_pipeline_plannable, plan_pipeline
from remat.plan.result import BudgetError, PlanChoice, PlanResult
from remat.plan.solver import Solution, min_peak, solve, tidy
from remat.plan.unit_model import UnitModel, add_traced_units, unit_model
from remat.plan.unit_prefetch import prefetch_unit_model
from remat.policy import Policy, PolicyError
from remat.recompute.plan_format import Plan, PlanError, Unit, kept_operators
from remat.units import format_bytes

__all__ = ["BudgetError", "ParallelOptions", "PlanChoice", "PlanOptions", "PlanResult", "plan"]


def plan(config: ModelConfig, budget: int | str, options: PlanOptions | None = None,
         parallel: ParallelOptions | None = None) -> PlanResult:
    """Find the cheapest recompute plans for ``config`` whose predicted peak memory is <= ``budget``.

    Two answers: the best Megatron-LM setting (every ``none``/``full/uniform/K``/``full/block/K``/``selective``
    setting, predicted) and the best extended plan (per-layer keep / selective modules / kept operators
    (``keep_ops``, NOTE [operator kinds] in :mod:`.operator_space`) / checkpoint groups of any size / offloaded
    groups, found by an exact dynamic program; see NOTE [the extended search] in :mod:`.solver`), by default the
    one of least predicted step time (``PlanOptions.objective``). The
    extended plan's peak is checked with the real (fake-tensor) trace, never only modelled (NOTE [the guarantee]),
    and it never costs more than the Megatron answer. With ``options.fine_grained_offload`` the Megatron answer
    may be a setting with Megatron's fine-grained activation offloading (recompute cost plus the transfers charged,
    NOTE [choosing an offload variant] in :mod:`.fine_offload`), which the extended answer then takes when cheaper:
    apply ``extended.layout`` (a :class:`~remat.policy.Policy` then, a :class:`Plan` otherwise).

    Args:
        config: the reference GPT's shape (:class:`~remat.config.ModelConfig`); any depth.
        budget: device memory for the step: bytes (an int) or text, ``'70GiB'``, ``'75GB'`` or a GPU preset
            (``'h100-80g'``: its memory minus ``options.reserve``).
        options: what to search and how to price it (:class:`PlanOptions`: objective, engine, device, offload,
            selective sets, measured times, throughput and bandwidths). Default: ``PlanOptions()``.
        parallel: one tensor-parallel rank (``tp``, ``sp``: planned for that rank, leaving room for one unsharded
            hidden-states tensor, ``stats['collective_margin_bytes']``) or pipeline stages (``pp``,
            ``microbatches``, ``schedule``: each stage is also planned, :func:`~remat.plan.plan_pipeline`, its
            report in ``PlanResult.pipeline``). Default: one unsharded GPU.

    Returns:
        A :class:`PlanResult`: ``extended`` (traced peak <= budget), ``megatron`` (None when no setting fits, the
        reason in ``megatron_note``), ``megatron_without_offload`` (the best recompute-only setting when an offload
        variant won), the no-recompute ``baseline``, timing ``stats``; ``format()`` is the report
        ``remat plan`` prints and ``to_dict()`` its JSON.

    Raises:
        BudgetError: no plan fits; it carries the smallest reachable peak (``min_peak_bytes``) and its plan.
        PlanError: bad options or budget (the message names the field and the fix).
        ConfigError: ``config`` not a :class:`~remat.config.ModelConfig`.

    Example::

        >>> import remat
        >>> from remat.config import ModelConfig
        >>> from remat.plan import PlanOptions, plan
        >>> config = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32,
        ...                      micro_batch_size=2, vocab_size=128)
        >>> result = plan(config, "2.2MiB")  # least predicted step time (PlanOptions(objective="time"))
        >>> result.extended.peak_bytes <= result.budget_bytes
        True
        >>> model = remat.build_model(config)
        >>> applied = remat.apply(model, result.extended.layout)  # then train model as usual
    """
    t_start = time.perf_counter()
    if not isinstance(config, ModelConfig):
        raise ConfigError(f"config={config!r:.40}: give a remat.ModelConfig (the model to plan), e.g. "
                          "remat.presets.get_preset('gpt-small')")
    options = PlanOptions() if options is None else options
    parallel = ParallelOptions() if parallel is None else parallel
    for name, value, kind in (("options", options, PlanOptions), ("parallel", parallel, ParallelOptions)):
        if not isinstance(value, kind):
            raise PlanError(f"{name}={value!r}: give a {kind.__name__} (remat.plan.{kind.__name__}(...)) or None")
    budget_bytes, budget_text = options.budget(budget)
    check_pipeline_plannable(parallel)  # before the single-GPU plan's work, not after it
    tp, sp, engine, device = parallel.tp, parallel.sp, options.engine, options.device
    if parallel.tensor_parallel and options.measured_times:
        raise PlanError("PlanOptions.measured_times times an unsharded layer on this machine, not a tensor-parallel "
                        "rank: drop measured_times with ParallelOptions.tp > 1")
    L = config.num_layers
    stats: dict[str, Any] = {}
    t = time.perf_counter()
    # the unit model is traced on another core (remat.plan.unit_prefetch) while the baseline is predicted here
    if idle_workers() > 1 and prefetch_unit_model(config, device=device, engine=engine, tp=tp, sp=sp):
        predicted(config, Policy(engine=engine), device=device, tp=tp, sp=sp)
    model = add_moe_units(unit_model(config, device=device, engine=engine, tp=tp, sp=sp), config)
    stats["model_seconds"] = time.perf_counter() - t  # 0 when cached; building it took model.build_seconds
    stats["model_build_seconds"] = model.build_seconds
    cost = options.cost_model(config)
    # (an MoE layer has no dense 'act' to recompute: the unit model holds only the sets the layer has)
    units = [u for u in candidate_units(L, offload=options.offload, engine=engine, selective_sets=(
        options.selective_sets), contractions=model.contractions) if u.mode != "selective" or u in model.shapes]
    units += layer_moe_units(model, options)
    # NOTE [operator kinds] (remat.plan.operator_space): per layer, which operators' outputs it keeps, in kinds
    # ordered by recompute price per byte freed, traced into the unit model (cached on disk) like every kind. Not
    # for MoE models: how many operators an MoE layer runs depends on the routing, so indices would not carry over
    t = time.perf_counter()
    if options.operator_sets != 0 and options.selective_sets is None and config.num_moe_experts is None:
        kinds = operator_kinds(layer_operators(config, tp, sp), cost.operator_price(), most=options.operator_sets)
        units += add_traced_units(model, [Unit("selective", 1, k) for k in kinds])
    stats["operator_kinds"] = sum(1 for u in units if kept_operators(u.modules) is not None)
    stats["operator_seconds"] = time.perf_counter() - t
    if cost.measured is not None:
        stats["measured_times"] = dict(cost.measured)
        options = dataclasses.replace(options, measured_times=dict(cost.measured))  # measured once, for pp too

    # NOTE [the Megatron screen]: the Megatron settings are priced and screened with the unit model (exact where the
    # tests say so; it can only over-estimate, by the side inputs' bytes), cheapest first, and only the settings that
    # may fit are traced (predicted(): composed from cached shallow traces) until one's traced peak fits. The answer
    # is the one the full sweep of traced peaks gave, for one or two traces instead of ~20 shallow ones.
    t = time.perf_counter()
    baseline = predicted(config, Policy(engine=engine), device=device, tp=tp, sp=sp)
    meg: list[tuple[Policy, Plan, int, int, int]] = []  # policy, plan, cost, model peak, rebuilt bytes
    for policy in job_policies(L, engine, config, cost, [model]):
        p = Plan.from_policy(policy, L)
        us = p.units()
        meg.append((policy, p, sum(cost.cost(model, u) for u in us), model.peak(us),
                    sum(model.shape(u).recompute_bytes for u in us)))
    # NOTE [tensor-parallel room]: with tp (and sp) the unit model, the Megatron sweep and the validation trace are
    # of one rank (remat.models.tensor_parallel's Megatron sharding on a simulated group), so the plan is one GPU's.
    # On real ranks a communication library may let go of a collective's buffer (a reduce-scatter input or
    # all-gather output: one unsharded hidden-states tensor) later than the simulated rank frees it (gloo's worker
    # thread did, in 5% of collectives, until remat's ranks waited for it), so the plans leave one such tensor of
    # room. Megatron's --distribute-saved-activations is not in the search (remat predict --tp predicts it).
    margin = config.micro_batch_size * config.seq_length * config.hidden_size * \
        torch.empty((), dtype=config.torch_dtype).element_size() if tp > 1 else 0
    limit = budget_bytes - margin
    stats["collective_margin_bytes"] = margin
    slack = sum(model.side.values())
    megatron_choice, traced = None, 0
    # ties in cost (FLOP counters price norms at zero) go to the setting that rebuilds the fewest bytes
    for policy, p, *_ in sorted((m for m in meg if m[3] - slack <= limit),
                                key=lambda m: (m[2], m[4], m[3])):
        pred = baseline if policy.is_none else predicted(config, policy, device=device, tp=tp, sp=sp)
        traced += 1
        if pred.peak_bytes <= limit:
            megatron_choice = _choice(config, p, pred, "megatron", cost, model, baseline)
            break
    stats["megatron_seconds"] = time.perf_counter() - t
    stats["megatron_traced"] = traced
    without_offload, offloads = None, []
    if options.fine_grained_offload:
        # NOTE [choosing an offload variant] (remat.plan.fine_offload): Megatron's fine-grained offloading variants,
        # traced and priced in the objective's unit; the cheapest that fits becomes the Megatron answer when it
        # costs less than the best recompute-only setting (which the report then names beside it)
        t = time.perf_counter()
        offloads, won = choose_offload(
            config, cost, model, limit, [MegatronRow(m[0], m[2], m[3]) for m in meg],
            None if megatron_choice is None else megatron_choice.cost, device=device, engine=engine, tp=tp, sp=sp,
            min_size=options.min_offloaded_tensor_size)
        stats["fine_grained_offload"] = [o.to_dict() for o in offloads]
        stats["fine_grained_offload_chosen"] = None if won is None else str(won.policy)
        stats["fine_grained_offload_seconds"] = time.perf_counter() - t
        if won is not None:
            without_offload, megatron_choice = megatron_choice, _offload_choice(config, won, cost, model, baseline)
    note = ""
    if megatron_choice is None:
        lowest = min(meg, key=lambda m: m[3])
        low = predicted(config, lowest[0], device=device, tp=tp, sp=sp)
        note = f"the lowest Megatron peak is {format_bytes(low.peak_bytes)} ({lowest[0]}), above the budget"

    # NOTE [the guarantee]: the unit model is checked, not trusted. The chosen plan is predicted with the real trace
    # (predict_plan: remat.memory.compose from a shallow trace with every layer role of the plan, or the whole
    # stack traced when that is refused) and if its traced peak exceeds the budget the program is re-solved under
    # a budget lowered by the excess (at most max_resolves times; a plan that never validates is not returned), so
    # every returned plan's *traced* peak is <= the budget. Where the model is exact (the tests compare it with
    # full traces on random plans of several model variants; the one known approximation is that the attention
    # mask and rotary tables are taken to be freed at the *end* of their lowest holder's backward, which can only
    # over-estimate by their bytes) re-solving never happens; then a smaller budget never gives a cheaper plan (the
    # feasible set shrinks) and the answer is the exact optimum of the extended space (the tests compare it with
    # brute force over all segmentations of a 6-layer model). A budget below the smallest reachable peak raises
    # BudgetError with that peak and the plan that reaches it.
    model_budget = limit
    chosen: tuple[Plan, Predicted, Solution] | None = None
    dp_seconds, entries, validate_seconds, resolves = 0.0, 0, 0.0, 0
    for _ in range(options.max_resolves + 1):
        incumbent = min((m[2] for m in meg if m[3] <= model_budget), default=None)
        sol = solve(model, L, model_budget, cost, units=units, incumbent=incumbent)
        if sol is None:
            break
        dp_seconds += sol.seconds
        entries = max(entries, sol.entries)
        tidied = tidy(model, sol.units, model_budget, layer_price(model, cost))
        candidate = Plan.from_units(tidied, engine)
        t = time.perf_counter()
        tl = predicted(config, candidate, device=device, tp=tp, sp=sp)
        validate_seconds += time.perf_counter() - t
        if tl.peak_bytes <= limit:
            chosen = (candidate, tl, sol)
            break
        resolves += 1
        model_budget -= max(tl.peak_bytes - limit, 1)
    stats.update(dp_seconds=dp_seconds, entries=entries, validate_seconds=validate_seconds, resolves=resolves)

    extended: PlanChoice | None = None
    if chosen is None and megatron_choice is None:
        refusal = _refusal(config, model, units, cost, budget_bytes, engine, device, baseline, meg, margin)
        lowest_offload = min(offloads, key=lambda o: (o.peak_bytes, o.cost), default=None)
        if lowest_offload is not None and lowest_offload.peak_bytes + margin < refusal.min_peak_bytes:
            # a traced offload variant reaches lower than any recompute plan: the refusal names it
            low = _offload_choice(config, lowest_offload, cost, model, baseline)
            refusal = BudgetError(
                f"no plan fits {format_bytes(budget_bytes)} ({budget_bytes:,} bytes): the smallest peak reached is "
                f"{format_bytes(low.peak_bytes)} ({low.peak_bytes:,} bytes), with Megatron's fine-grained "
                f"offloading {low.policy} (of the offload variants traced; recompute plans reach "
                f"{refusal.min_peak_bytes:,} bytes)", budget_bytes=budget_bytes,
                min_peak_bytes=low.peak_bytes + margin, plan=low)
        if parallel.pp is None:
            raise refusal
        # a pipeline's stages hold fewer layers than the whole model: plan them even when one GPU cannot hold it
        note = str(refusal)
    elif chosen is None:  # no solution validated at this budget: the Megatron answer is a valid plan
        assert megatron_choice is not None
        extended = dataclasses.replace(megatron_choice, source="megatron (no extended plan validated)")
    else:
        extended = _choice(config, chosen[0], chosen[1], "extended", cost, model, baseline)
        if megatron_choice is not None and megatron_choice.cost < extended.cost:
            extended = megatron_choice  # cannot happen when the model is exact; never return the costlier one
    stats["total_seconds"] = time.perf_counter() - t_start
    result = PlanResult(config, budget_bytes, budget_text, cost.objective, cost, extended, megatron_choice, note,
                        baseline, stats, tp=tp, sp=sp, megatron_without_offload=without_offload)
    if parallel.pp is not None:
        result.pipeline = plan_pipeline(config, budget_bytes, parallel, options)
    return result


def _choice(config: ModelConfig, plan_: Plan, pred: Predicted, source: str, cost: CostModel,
            model: UnitModel, baseline: Predicted) -> PlanChoice:
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
    plain = cost.plain_step_seconds(model, config.num_layers, base)
    extra = sum(cost.extra_seconds(model, u) for u in units)
    return PlanChoice(
        plan=plan_, source=source, peak_bytes=pred.peak_bytes, peak_phase=pred.peak_phase, at_peak=pred.at_peak,
        recompute_flops=recompute, extra_compute_pct=100.0 * recompute / base if base else 0.0,
        cost=sum(cost.cost(model, u) for u in units), model_peak_bytes=model.peak(units),
        offload_bytes=offloaded * model.hidden_bytes, offload_seconds=offloaded * cost.offload_seconds(model),
        megatron_policy=None if policy is None else str(policy), megatron_args=args, why_not_megatron=why,
        recompute_bytes=sum(model.shape(u).recompute_bytes for u in units),
        step_time_ratio=1.0 + extra / plain if plain > 0 else 1.0)


def _offload_choice(config: ModelConfig, option: OffloadOption, cost: CostModel, model: UnitModel,
                    baseline: Predicted) -> PlanChoice:
    """A traced fine-grained offload variant as the Megatron answer: its recompute part as ``plan``, the policy
    itself as ``policy`` (NOTE [fine-grained offload charge] for ``offload_seconds``)."""
    policy = option.policy
    twin = Plan.from_policy(dataclasses.replace(policy, offload_modules=(), min_offloaded_tensor_size=(
        MIN_OFFLOADED_TENSOR_SIZE)), config.num_layers)
    base = baseline.flops.get("forward", 0) + baseline.flops.get("backward", 0)
    recompute = option.flops.get("recompute", 0)
    units = twin.units()
    plain = cost.plain_step_seconds(model, config.num_layers, base)
    extra = option.cost * 1e-9 if cost.objective == "time" else \
        sum(cost.extra_seconds(model, u) for u in units) + option.transfer_seconds
    return PlanChoice(
        plan=twin, source="megatron", peak_bytes=option.peak_bytes, peak_phase=option.peak_phase,
        at_peak=dict(option.at_peak), recompute_flops=recompute,
        extra_compute_pct=100.0 * recompute / base if base else 0.0, cost=option.cost,
        offload_bytes=option.offloaded_bytes, offload_seconds=option.transfer_seconds,
        megatron_policy=str(policy), megatron_args=list(option.megatron_args),
        recompute_bytes=sum(model.shape(u).recompute_bytes for u in units),
        step_time_ratio=1.0 + extra / plain if plain > 0 else 1.0, policy=policy,
        host_peak_bytes=option.host_peak_bytes)


def _refusal(config: ModelConfig, model: UnitModel, units: list[Unit], cost: CostModel, budget: int, engine: str,
             device: str, baseline: Predicted, meg: list[tuple[Policy, Plan, int, int, int]],
             margin: int = 0) -> BudgetError:
    """The :class:`BudgetError` for a budget no plan fits: the smallest peak and the cheapest plan reaching it."""
    L = config.num_layers
    lowest = min_peak(model, L, units)
    sol = solve(model, L, lowest, cost, units=units)
    assert sol is not None
    p = Plan.from_units(tidy(model, sol.units, lowest, layer_price(model, cost)), engine)
    tl = predicted(config, p, device=device, tp=model.tp, sp=model.sp)
    choice = _choice(config, p, tl, "extended", cost, model, baseline)
    policy, meg_plan = min(meg, key=lambda m: (m[3], m[2]))[:2]
    meg_pred = predicted(config, policy, device=device, tp=model.tp, sp=model.sp)
    if meg_pred.peak_bytes < choice.peak_bytes:  # only if the model were off: report the lower traced peak
        choice = _choice(config, meg_plan, meg_pred, "megatron", cost, model, baseline)
    room = f" plus {margin:,} bytes of room for the collectives' buffers on real tensor-parallel ranks" if margin \
        else ""
    return BudgetError(
        f"no plan fits {format_bytes(budget)} ({budget:,} bytes): the smallest reachable peak is "
        f"{format_bytes(choice.peak_bytes)} ({choice.peak_bytes:,} bytes){room}, with plan {choice.plan}",
        budget_bytes=budget, min_peak_bytes=choice.peak_bytes + margin, plan=choice)
