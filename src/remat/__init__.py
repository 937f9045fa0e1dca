"""remat: see, predict and plan activation recomputation for PyTorch transformer training."""

from remat.apply import AppliedPolicy, ApplyError, applied, apply, find_layer_stack, remove
from remat.config import ConfigError, ModelConfig
from remat.measure import measure
from remat.model import GPT, build_model, sample_batch
from remat.policy import Policy, PolicyError
from remat.timeline import CATEGORIES, Phase, Timeline, TimelineError

__version__ = "0.1.0"

__all__ = [
    "CATEGORIES", "GPT", "AppliedPolicy", "ApplyError", "ConfigError", "ModelConfig", "Phase", "Policy",
    "PolicyError", "Timeline", "TimelineError", "applied", "apply", "build_model", "find_layer_stack",
    "measure", "remove", "sample_batch", "__version__",
]
