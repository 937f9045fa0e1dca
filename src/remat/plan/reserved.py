"""Plan against reserved memory: the budget holds the caching allocator's segments, not only allocated bytes.

:func:`plan_reserved` runs :func:`remat.plan.plan`, replays the chosen plan's predicted step through the CUDA
caching allocator (:func:`remat.memory.reserved.reserved_figures`) and, while the replayed
``max_memory_reserved`` exceeds the budget, plans again under an allocated budget lowered by the excess.
"""

from __future__ import annotations

from typing import Any

from remat.config import ModelConfig
from remat.memory.alloc_config import AllocatorConfig
from remat.memory.predict import predict_config
from remat.memory.reserved import reserved_figures
from remat.plan.api import plan
from remat.plan.megatron import predict_plan
from remat.plan.result import BudgetError, PlanResult
from remat.recompute.plan_format import Plan

MAX_ROUNDS = 8
PIPELINE_REFUSED = ("--budget-reserved plans one GPU's reserved memory; it is not modelled with --pp: drop "
                    "--budget-reserved or --pp")


def plan_reserved(config: ModelConfig, budget: int | str, options: Any = None, parallel: Any = None,
                  allocator: AllocatorConfig | None = None) -> tuple[PlanResult, dict[str, Any]]:
    """The cheapest plan whose replayed reserved memory fits ``budget``.

    Args:
        config, budget, options, parallel: as for :func:`remat.plan.plan`.
        allocator: the ``PYTORCH_CUDA_ALLOC_CONF`` options replayed; None: PyTorch's defaults.

    Returns:
        ``(result, figures)``: the :class:`PlanResult` (its ``budget_bytes`` is the budget asked for; its
        extended plan's allocated peak is below it by at least the fragmentation) and the plan's reserved
        figures (:func:`~remat.memory.reserved.reserved_figures`, with ``allocated_budget_bytes``: the allocated
        budget the last planning round used).

    Raises:
        BudgetError: no plan's reserved memory fits, after lowering the allocated budget at most
            :data:`MAX_ROUNDS` times, or :func:`plan` refuses the lowered budget.
        ValueError: a pipeline-parallel plan (``--pp``), whose per-stage replay is not modelled.
    """
    if (getattr(parallel, "pp", None) or 1) > 1:  # refused before planning the stages, not after
        raise ValueError(PIPELINE_REFUSED)
    result = plan(config, budget, options, parallel)
    limit = result.budget_bytes
    allocated_budget = limit
    for _ in range(MAX_ROUNDS):
        if result.extended is None or result.pipeline is not None:
            raise ValueError(PIPELINE_REFUSED)
        layout = result.extended.layout  # a Policy with fine-grained offloading (traced in full), else a Plan
        timeline = predict_plan(config, layout, device="cuda", tp=result.tp, sp=result.sp) if isinstance(
            layout, Plan) else predict_config(config, layout, device="cuda", tp=result.tp, sp=result.sp)
        figures = reserved_figures(timeline, allocator)
        figures["allocated_budget_bytes"] = allocated_budget
        excess = figures["max_memory_reserved"] - limit
        if excess <= 0:
            result.budget_bytes = limit
            return result, figures
        # the next plan must allocate less than this one by the excess (segments come in 2 or 20 MiB steps, so
        # lowering the previous budget alone may pick the same plan again)
        allocated_budget = min(allocated_budget, result.extended.peak_bytes) - excess
        result = plan(config, allocated_budget, options, parallel)
    raise BudgetError(f"no plan's reserved memory fits {limit:,} bytes after {MAX_ROUNDS} rounds: the last plan "
                      f"reserves {figures['max_memory_reserved']:,} bytes", budget_bytes=limit,
                      min_peak_bytes=figures["max_memory_reserved"], plan=result.extended)
