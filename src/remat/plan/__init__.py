"""Planning: the cheapest recompute plan under a memory budget, for one process or each pipeline stage."""

from remat.plan.api import plan
from remat.plan.costs import CostModel, measure_layer_times
from remat.plan.megatron import MEGATRON_MODULES, megatron_policies, megatron_sweep
from remat.plan.options import ParallelOptions, PlanOptions
from remat.plan.pipeline import plan_pipeline
from remat.plan.result import BudgetError, PlanChoice, PlanResult
from remat.plan.space import OBJECTIVES, selective_sets
from remat.plan.unit_model import UnitModel, unit_model
from remat.recompute.plan_format import KEEP, MODES, Plan, PlanError, Segment, Unit

__all__ = ["KEEP", "MEGATRON_MODULES", "MODES", "OBJECTIVES", "BudgetError", "CostModel", "ParallelOptions", "Plan",
           "PlanChoice", "PlanError", "PlanOptions", "PlanResult", "Segment", "Unit", "UnitModel",
           "measure_layer_times", "megatron_policies", "megatron_sweep", "plan", "plan_pipeline", "selective_sets",
           "unit_model"]
