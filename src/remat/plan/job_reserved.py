"""Plan a whole Megatron-LM job against reserved memory: every rank's caching-allocator segments, not only its
allocated bytes, within the budget (NOTE [a job's reserved budget]).

What runs out of memory on a GPU is reserved memory (``torch.cuda.max_memory_reserved()``: the caching allocator's
segments), which is above the allocated peak by the fragmentation of the step. :func:`plan_job_reserved` plans the
job (:func:`remat.plan.job_plan.plan_job`), replays the rank of every stage's plan through the allocator
(:func:`remat.parallel.job_predict.add_reserved`) and plans again, under an allocated budget lowered by the excess,
the stages whose reserved memory does not fit.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from remat.job import Job
from remat.memory.alloc_config import AllocatorConfig
from remat.parallel.job_predict import RankPrediction, add_reserved
from remat.plan.job_plan import plan_job
from remat.plan.job_result import JobPlan, JobStagePlan
from remat.plan.options import PlanOptions

MAX_ROUNDS = 8
GRAIN = 1 << 20  # the least step of the allocated budget between two rounds (segments grow by 2 MiB)

# NOTE [a job's reserved budget]: a stage's plan is chosen by its exact allocated peak (plan_job); its rank's step
# is then replayed through the caching allocator (every allocation in order, with the microbatches in flight), and
# the stage is settled when the max_memory_reserved of its plan (and of its best Megatron setting) is within the
# budget. While a stage is not, the job is planned again under a lower allocated budget: each unsettled plan must
# allocate less by its excess of reserved over the budget (below its own allocated peak: segments come in 2 or 20 MiB
# steps, so the same plan would reserve the same), and the next round takes the highest of those budgets, so that no
# stage is asked for more recompute than its own excess needs (the others are settled in later rounds). Each stage
# keeps the plan of the first round that settled it, the cheapest (a higher budget never costs more), and the one
# Megatron setting for every stage is the first whose every rank's reserved memory fits. After MAX_ROUNDS a stage
# still unsettled has no plan that fits: its note says by how much its reserved memory exceeds the budget.


def _reserved(r: RankPrediction) -> int:
    return (r.reserved or {}).get("max_memory_reserved", 0)


def _fits(ranks: Iterable[RankPrediction], limit: int) -> bool:
    return all(_reserved(r) <= limit for r in ranks)


def _stage_ranks(st: JobStagePlan) -> list[RankPrediction]:
    """The predictions a stage's answer shows: its plan's and its best Megatron setting's (when either exists)."""
    return [c.prediction for c in (st.extended, st.megatron) if c is not None]


def _shown(st: JobStagePlan) -> list[RankPrediction]:
    """What a stage's answer shows: its choices' predictions, else the lowest peak predicted (nothing fits)."""
    return _stage_ranks(st) or ([st.prediction] if st.prediction is not None else [])


def plan_job_reserved(job: Job, budget: int | str, options: PlanOptions | None = None,
                      allocator: AllocatorConfig | None = None) -> JobPlan:
    """The cheapest plan of every stage whose rank's *reserved* memory fits ``budget`` (NOTE [a job's reserved
    budget]).

    Args:
        job, budget, options: as for :func:`remat.plan.job_plan.plan_job`.
        allocator: the ``PYTORCH_CUDA_ALLOC_CONF`` options replayed; None: PyTorch's defaults.

    Returns:
        The :class:`JobPlan` (its ``budget_bytes`` the budget asked for); every prediction it shows has its
        ``reserved`` figures; ``stats['memory_budgeted']`` says what was budgeted: ``memory`` ('reserved'),
        ``allocated_budget_bytes`` (the lowest allocated budget planned under), ``rounds`` and ``alloc_conf``.
    """
    result = plan_job(job, budget, options)
    limit, text = result.budget_bytes, result.budget_text
    allocated_budget, rounds = limit, 1
    high, low = limit, 0  # the last budget whose open stages all had a plan; the last one where one had none
    settled: dict[int, JobStagePlan] = {}
    closest: dict[int, RankPrediction] = {}  # an unsettled stage's plan that reserved the least
    uniform: tuple[Any, list[RankPrediction]] | None = None
    while True:
        for st in result.stages:
            add_reserved(_shown(st), allocator)
            if st.stage not in settled and st.extended is not None and _fits(_stage_ranks(st), limit):
                settled[st.stage] = st
            for r in _stage_ranks(st) if st.stage not in settled else ():
                if st.stage not in closest or _reserved(r) < _reserved(closest[st.stage]):
                    closest[st.stage] = r
        add_reserved(result.uniform_ranks, allocator)
        if uniform is None and result.uniform is not None and _fits(result.uniform_ranks, limit):
            uniform = result.uniform, result.uniform_ranks
        open_stages = [st for st in result.stages if st.stage not in settled]
        open_uniform = [] if uniform is not None else result.uniform_ranks  # one exists, its reserved does not fit
        if not open_stages and not open_uniform or rounds == MAX_ROUNDS:
            break
        if any(st.extended is None for st in open_stages):  # too low a budget for one of them: between the two
            low = allocated_budget
            lower = (low + high) // 2
        else:
            # each plan that does not fit must allocate less by its excess of reserved memory over the budget (and
            # at least that much below the budget it was planned under: the same plan would reserve the same); the
            # next round asks the least of them, the highest such budget, and the others the rounds after
            high = allocated_budget
            lower = max(min(r.peak_bytes, allocated_budget) - (_reserved(r) - limit)
                        for r in [*(r for st in open_stages for r in _stage_ranks(st)), *open_uniform]
                        if not _fits([r], limit))
            lower = lower if lower > low else (low + high) // 2
        if not low + GRAIN <= lower <= high - GRAIN:
            break
        allocated_budget, rounds = lower, rounds + 1
        result = plan_job(job, allocated_budget, options, outside_counted=True)
    for st in result.stages:
        if st.stage in settled:
            continue
        if st.stage in closest:  # fits allocated bytes under a lowered budget, not reserved memory under the budget
            st.extended = st.megatron = None
            st.policy, st.prediction = None, closest[st.stage]
            st.note = (f"no plan found whose reserved memory fits in {rounds} rounds: the closest reserves "
                       f"{_reserved(closest[st.stage]) - limit:,} bytes more than the budget")
    result.stages = [settled.get(st.stage, st) for st in result.stages]
    result.uniform, result.uniform_ranks = uniform if uniform is not None else (None, [])
    result.budget_bytes, result.budget_text = limit, text
    result.stats["memory_budgeted"] = {"memory": "reserved", "allocated_budget_bytes": allocated_budget,
                                       "rounds": rounds, "alloc_conf": (allocator or AllocatorConfig()).text()}
    return result


def add_plan_reserved(result: JobPlan, allocator: AllocatorConfig | None = None) -> None:
    """The ``reserved`` figures of every prediction ``result`` shows (a plan that budgeted allocated bytes), and
    ``stats['memory_budgeted']`` saying so."""
    # all at once: a large job's replays side by side on the idle cores (remat.memory.replay_pool.replay_now)
    add_reserved([*(r for st in result.stages for r in _shown(st)), *result.uniform_ranks], allocator)
    result.stats["memory_budgeted"] = {"memory": "allocated", "allocated_budget_bytes": result.budget_bytes,
                                       "rounds": 1, "alloc_conf": (allocator or AllocatorConfig()).text()}
