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

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from remat.version import __version__

# Where each name of the API lives. They are imported on first use (PEP 562), so that `import remat` (every
# `remat` command's first line) costs nothing before the command needs torch.
_EXPORTS = {
    "remat.config": ("ConfigError", "ModelConfig"),
    "remat.memory.measure": ("MeasureError", "measure"),
    "remat.memory.predict": ("predict", "predict_config", "predict_many"),
    "remat.models.gpt": ("GPT", "build_model", "sample_batch"),
    "remat.policy": ("Policy", "PolicyError"),
    "remat.recompute.apply": ("applied", "apply", "find_layer_stack", "remove"),
    "remat.recompute.region": ("AppliedPolicy", "ApplyError"),
    "remat.timeline": ("CATEGORIES", "Phase", "Timeline", "TimelineError"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = [
    "CATEGORIES", "GPT", "AppliedPolicy", "ApplyError", "ConfigError", "MeasureError", "ModelConfig", "Phase", "Policy",
    "PolicyError", "Timeline", "TimelineError", "applied", "apply", "build_model", "find_layer_stack",
    "measure", "predict", "predict_config", "predict_many", "remove", "sample_batch", "__version__",
]

if TYPE_CHECKING:  # what type checkers and the API pages (mkdocstrings) read
    from remat.config import ConfigError, ModelConfig
    from remat.memory.measure import MeasureError, measure
    from remat.memory.predict import predict, predict_config, predict_many
    from remat.models.gpt import GPT, build_model, sample_batch
    from remat.policy import Policy, PolicyError
    from remat.recompute.apply import applied, apply, find_layer_stack, remove
    from remat.recompute.region import AppliedPolicy, ApplyError
    from remat.timeline import CATEGORIES, Phase, Timeline, TimelineError


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'remat' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # imported once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_MODULE_OF))
