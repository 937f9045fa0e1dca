"""Parallel training: pipeline schedules and their per-stage prediction, tensor-parallel ranks, and the process
launcher that measures both for real on gloo."""

from remat.parallel.launch import DEFAULT_TIMEOUT, DistributedError, launch_job
from remat.parallel.pipeline_measure import compare_pipeline, measure_pipeline, measure_pipeline_many
from remat.parallel.pipeline_predict import predict_pipeline
from remat.parallel.pipeline_report import describe_stage, peak_error, same_step, stage_summary
from remat.parallel.schedule import SCHEDULES, PipelineError, check_schedule, partition
from remat.parallel.tensor import measure_tensor_parallel, measure_tensor_parallel_many

__all__ = ["DEFAULT_TIMEOUT", "SCHEDULES", "DistributedError", "PipelineError", "check_schedule",
           "compare_pipeline", "describe_stage", "launch_job", "measure_pipeline", "measure_pipeline_many",
           "measure_tensor_parallel", "measure_tensor_parallel_many", "partition", "peak_error", "predict_pipeline",
           "same_step", "stage_summary"]
