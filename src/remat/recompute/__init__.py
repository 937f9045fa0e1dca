"""Applying recompute to a model: checkpoint regions over a layer stack, the engines that run them, offloading
and the per-layer Plan format."""

# apply() is not bound here: it would hide the submodule remat.recompute.apply; it is remat.apply.
from remat.recompute.activation_offload import ActivationOffload, installed_offload
from remat.recompute.apply import applied, find_layer_stack, remove
from remat.recompute.offload import offload_to_host, restore_from_host
from remat.recompute.plan_format import KEEP, Plan, PlanError, Segment, Unit
from remat.recompute.region import AppliedPolicy, ApplyError, RecomputeLayout, Region

__all__ = ["KEEP", "ActivationOffload", "AppliedPolicy", "ApplyError", "Plan", "PlanError", "RecomputeLayout",
           "Region", "Segment", "Unit", "applied", "find_layer_stack", "installed_offload", "offload_to_host", "remove",
           "restore_from_host"]
