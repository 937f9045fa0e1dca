"""One training step's memory: measured (real allocations), predicted (fake tensors) and composed."""

from remat.memory.compose import CompositionError, compose
from remat.memory.measure import measure, record_step
from remat.memory.predict import predict, predict_config, predict_many, trace, trace_rank

__all__ = ["CompositionError", "compose", "measure", "predict", "predict_config", "predict_many", "record_step",
           "trace", "trace_rank"]
