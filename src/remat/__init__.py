"""remat: see, predict and plan activation recomputation for PyTorch transformer training.

The public API, by layer (each package imports only from the ones above it in this list):

- base: :mod:`remat.config` (ModelConfig), :mod:`remat.policy` (Policy), :mod:`remat.timeline` (Timeline),
  :mod:`remat.units`, :mod:`remat.presets`, :mod:`remat.models` (the reference GPT and its tensor-parallel form);
- :mod:`remat.recompute`: ``apply`` a policy or plan to a layer stack;
- :mod:`remat.memory`: ``measure``, ``predict``, ``predict_config``, ``predict_many``, ``compose``;
- :mod:`remat.parallel`: pipeline schedules and prediction, tensor-parallel ranks, real multi-process runs;
- :mod:`remat.plan`: ``plan``, ``plan_pipeline``;
- :mod:`remat.analysis`: explain, formulas, reports;
- :mod:`remat.cli`: the ``remat`` command.
"""

from remat.config import ConfigError, ModelConfig
from remat.memory.measure import MeasureError, measure
from remat.memory.predict import predict, predict_config, predict_many
from remat.models.gpt import GPT, build_model, sample_batch
from remat.policy import Policy, PolicyError
from remat.recompute.apply import applied, apply, find_layer_stack, remove
from remat.recompute.region import AppliedPolicy, ApplyError
from remat.timeline import CATEGORIES, Phase, Timeline, TimelineError
from remat.version import __version__

__all__ = [
    "CATEGORIES", "GPT", "AppliedPolicy", "ApplyError", "ConfigError", "MeasureError", "ModelConfig", "Phase", "Policy",
    "PolicyError", "Timeline", "TimelineError", "applied", "apply", "build_model", "find_layer_stack",
    "measure", "predict", "predict_config", "predict_many", "remove", "sample_batch", "__version__",
]
