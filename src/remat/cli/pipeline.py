"""Pipeline-parallel variants of predict, compare and explain output."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from remat.analysis.explain_pipeline import explain_pipeline
from remat.analysis.report import cell, error_pct, format_table, text_cell, write_json
from remat.cli.common import PipelineArgs, config_from_args, file_name, pipeline_args, policies_from_args
from remat.config import ModelConfig
from remat.parallel.launch import DistributedError
from remat.parallel.pipeline_measure import compare_pipeline, measure_pipeline_many
from remat.parallel.pipeline_predict import predict_pipeline
from remat.parallel.pipeline_report import peak_error, stage_summary
from remat.policy import Policy
from remat.timeline import Timeline
from remat.units import MIB

# ------------------------------------------------------------------------------------------------ formatting
_mib = cell(lambda value: f"{value / MIB:.2f}")  # stages are small: two decimals
STAGE_COLUMNS = [
    ("stage", "stage", text_cell), ("policy", "policy", text_cell), ("peak_bytes", "peak MiB", _mib),
    ("peak_phase", "peak in", text_cell), ("max_in_flight", "in flight max", text_cell),
    ("in_flight_at_peak", "in flight @peak", text_cell), ("saved_bytes_at_peak", "saved @peak MiB", _mib),
]
COMPARE_COLUMNS = [
    ("stage", "stage", text_cell), ("policy", "policy", text_cell), ("measured_bytes", "measured MiB", _mib),
    ("predicted_bytes", "predicted MiB", _mib), ("error", "error %", error_pct),
    ("max_in_flight", "in flight max", text_cell), ("in_flight_at_peak", "in flight @peak", text_cell),
]


def _table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str, Any]]) -> str:

    return format_table(rows, columns)


def _bullets(sentences: Sequence[str], width: int = 110) -> str:
    return "\n".join(textwrap.fill(s, width=width, initial_indent="- ", subsequent_indent="  ") for s in sentences)


def _model_line(config: ModelConfig, pipe: PipelineArgs) -> str:
    return (f"{config.num_layers} layers, h={config.hidden_size}, s={config.seq_length}, "
            f"microbatch {config.micro_batch_size}, vocab={config.vocab_size}, {config.dtype}; {pipe.describe()}")


def _save(out: Any, kind: str, policy: Policy, timelines: Sequence[Timeline]) -> list[str]:
    if not out:
        return []
    names = []
    for tl in timelines:
        stage = tl.meta.get("pipeline", {}).get("stage", 0)
        path = Path(out) / f"{kind}-{file_name(str(policy))}-stage{stage}.json"
        tl.save(path)
        names.append(str(path))
    return names


def _write_report(args: argparse.Namespace, report: Any) -> None:
    """``--out FILE``: the JSON report, written atomically (as ``remat predict``/``compare`` do)."""
    out = getattr(args, "out", None)
    if out:

        write_json(Path(out), report)


def _print(args: argparse.Namespace, report: dict[str, Any], text: str) -> None:
    if getattr(args, "json", False):
        print(json.dumps(report, indent=2))
    else:
        print(text)


# ------------------------------------------------------------------------------------------------ runners
def _real_run(runner: Any) -> Any:
    """A failed or timed-out multi-process run is one line on stderr and exit status 1 (the processes are
    already gone)."""
    import functools

    @functools.wraps(runner)
    def wrapped(args: argparse.Namespace) -> int:
        try:
            return runner(args)
        except DistributedError as err:
            if getattr(args, "debug", False):
                raise
            print(f"remat: error: {err}", file=sys.stderr)
            return 1

    return wrapped


def run_pipeline_predict(args: argparse.Namespace) -> int:
    """``remat predict --pp P``: each stage's predicted peak per policy, what is in flight, and why."""
    config = config_from_args(args)
    pipe = pipeline_args(args)
    device = getattr(args, "device", None) or "cpu"
    policies = policies_from_args(args, config, pipe)
    rows, whys, files = [], [], []
    for policy in policies:
        stages = predict_pipeline(config, policy, pipe.pp, pipe.microbatches, pipe.schedule, pipe.vpp, pipe.layout,
                                  pipe.partial, runtime=pipe.runtime, device=device)
        files += _save(getattr(args, "timelines", None), "predicted", policy, stages)
        for tl in stages:
            summary = stage_summary(tl)
            rows.append(summary)
            whys.append(f"[{policy}] {summary['why']}")
    report = {"command": "predict", "model": config.to_dict(), "pipeline": dataclasses.asdict(pipe),
              "device": device, "stages": rows, "files": files}
    _write_report(args, report)
    text = "\n".join([f"Predicted per-stage memory ({pipe.runtime} runtime): {_model_line(config, pipe)}",
                      _table(rows, STAGE_COLUMNS), "", _bullets(whys)])
    _print(args, report, text)
    return 0


@_real_run
def run_pipeline_measure(args: argparse.Namespace) -> int:
    """``remat measure --pp P``: measure each stage in a real multi-process run, next to the prediction."""
    config = config_from_args(args)
    pipe = pipeline_args(args, runtime="torch")
    device = getattr(args, "device", None) or "cpu"
    policies = policies_from_args(args, config, pipe)
    measured = measure_pipeline_many(config, policies, pipe.pp, pipe.microbatches, pipe.schedule, pipe.vpp,
                                     pipe.layout, pipe.partial, device=device, timeout=pipe.timeout)
    rows, whys, files = [], [], []
    for policy, stages in zip(policies, measured):
        predicted = predict_pipeline(config, policy, pipe.pp, pipe.microbatches, pipe.schedule, pipe.vpp,
                                     pipe.layout, pipe.partial, runtime="torch", device=device)
        files += _save(getattr(args, "timelines", None), "measured", policy, stages)
        for real, guess in zip(stages, predicted):
            summary = stage_summary(real)
            summary.update(measured_bytes=real.peak_bytes, predicted_bytes=guess.peak_bytes,
                           error=peak_error(real.peak_bytes, guess.peak_bytes), pid=real.meta.get("pid"))
            rows.append(summary)
            whys.append(f"[{policy}] {summary['why']}")
    report = {"command": "measure", "model": config.to_dict(), "pipeline": dataclasses.asdict(pipe),
              "device": device, "stages": rows, "files": files}
    _write_report(args, report)
    text = "\n".join([f"Measured per-stage memory ({pipe.pp} process{'es' if pipe.pp > 1 else ''}, "
                      f"torch.distributed.pipelining): {_model_line(config, pipe)}",
                      _table(rows, COMPARE_COLUMNS + [("peak_phase", "peak in", text_cell)]), "", _bullets(whys)])
    _print(args, report, text)
    return 0


@_real_run
def run_pipeline_compare(args: argparse.Namespace) -> int:
    """``remat compare --pp P --microbatches M --schedule S --policies a,b [--json]``: measured vs predicted peak
    per stage and policy; ``error`` is (predicted - measured) / measured."""
    config = config_from_args(args)
    pipe = pipeline_args(args, runtime="torch")
    device = getattr(args, "device", None) or "cpu"
    policies = policies_from_args(args, config, pipe, default=("none", "full/uniform/1"))
    rows = compare_pipeline(config, policies, pipe.pp, pipe.microbatches, pipe.schedule, pipe.vpp, pipe.layout,
                            pipe.partial, device=device, timeout=pipe.timeout)
    _write_report(args, rows)
    worst = max(rows, key=lambda r: abs(r["error"]))
    if getattr(args, "json", False):
        print(json.dumps(rows, indent=2))
    else:
        print(f"Measured vs predicted per-stage peak: {_model_line(config, pipe)}")
        print(_table(rows, COMPARE_COLUMNS))
        print(f"largest error: {100 * worst['error']:+.3f}% (stage {worst['stage']}, {worst['policy']})")
    limit = getattr(args, "max_error", None)
    return 1 if limit is not None and abs(worst["error"]) > limit else 0


@_real_run
def run_pipeline_explain(args: argparse.Namespace) -> int:
    """``remat explain --pp P``: per stage, none vs full/uniform/1 vs whole-chunk groups, measured in a real
    multi-process run (with the prediction), and the in-flight effect in words."""
    config = config_from_args(args)
    pipe = pipeline_args(args, runtime="torch")
    result = explain_pipeline(config, pipe.pp, pipe.microbatches, pipe.schedule, pipe.vpp, pipe.layout,
                              engine=getattr(args, "engine", None), device=getattr(args, "device", None) or "cpu",
                              timeout=pipe.timeout)
    report = {"command": "explain", "model": config.to_dict(), "pipeline": dataclasses.asdict(pipe), **result}
    if getattr(args, "out", None):

        report["file"] = str(write_json(Path(args.out) / "explain-pipeline.json", report))
    columns = COMPARE_COLUMNS + [("saved_per_microbatch", "saved/mb MiB", _mib)]
    text = "\n".join([f"Recompute under pipeline parallelism, measured: {_model_line(config, pipe)}",
                      _table(result["rows"], columns), "", _bullets(result["sentences"])])
    _print(args, report, text)
    return 0
