"""The models remat measures: the reference GPT and its Megatron-style tensor-parallel version."""

from remat.models.gpt import GPT, build_model, building, sample_batch
from remat.models.tensor_parallel import DistributedGroup, SimulatedGroup, build_tp_model, check_tensor_parallel

__all__ = ["GPT", "DistributedGroup", "SimulatedGroup", "build_model", "build_tp_model", "building",
           "check_tensor_parallel", "sample_batch"]
