"""One training step's memory: measured (real allocations), predicted (fake tensors) and composed."""

# The functions named like their modules (measure, predict, compose) are not bound here: a package attribute
# would hide the submodule (`import remat.memory.predict as m` would give the function). They are remat.measure,
# remat.predict and remat.memory.compose.compose.
from remat.memory.compose import CompositionError
from remat.memory.measure import MeasureError, record_step
from remat.memory.predict import predict_config, predict_many, trace, trace_rank

__all__ = ["CompositionError", "MeasureError", "predict_config", "predict_many", "record_step", "trace",
           "trace_rank"]
