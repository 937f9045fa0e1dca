"""remat's Megatron-core front end: predict (fake tensors) and measure (CPU) the user's own megatron-core model,
rank by rank, with Megatron's own recompute settings. Needs the optional extra ``remat[megatron]``."""

from remat.config import RoutingAssumption
from remat.megatron.api import measure_megatron_core, policy_of, predict_megatron_core
from remat.megatron.args import config_from_args, predict_from_args
from remat.megatron.compat import MegatronSettingError, MegatronUnavailable, require_megatron_core
from remat.megatron.cpu_patches import WORKAROUNDS, megatron_on_cpu
from remat.megatron.multiprocess import measure_megatron_core_distributed
from remat.megatron.routing import routing_assumption
from remat.megatron.world import ParallelSizes

__all__ = ["WORKAROUNDS", "MegatronSettingError", "MegatronUnavailable", "ParallelSizes", "RoutingAssumption",
           "config_from_args", "measure_megatron_core", "measure_megatron_core_distributed", "megatron_on_cpu",
           "policy_of", "predict_from_args", "predict_megatron_core", "require_megatron_core", "routing_assumption"]
