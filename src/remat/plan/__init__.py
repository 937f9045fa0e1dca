"""Planning: the cheapest recompute plan under a memory budget, for one process or each pipeline stage."""

from remat.plan.api import BudgetError, PlanChoice, PlanResult, plan
from remat.plan.costs import CostModel, measure_layer_times
from remat.plan.megatron import megatron_policies, megatron_sweep
from remat.plan.pipeline import plan_pipeline
from remat.plan.space import OBJECTIVES, selective_sets
from remat.plan.unit_model import UnitModel, unit_model
from remat.recompute.plan_format import KEEP, MODES, Plan, PlanError, Segment, Unit

__all__ = ["KEEP", "MODES", "OBJECTIVES", "BudgetError", "CostModel", "Plan", "PlanChoice", "PlanError",
           "PlanResult", "Segment", "Unit", "UnitModel", "measure_layer_times", "megatron_policies",
           "megatron_sweep", "plan", "plan_pipeline", "selective_sets", "unit_model"]
