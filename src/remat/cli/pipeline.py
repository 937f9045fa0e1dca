"""Pipeline-parallel variants of predict, compare, measure and explain: flags in, library call, text out."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from remat.analysis.explain_pipeline import explain_pipeline
from remat.analysis.outputs import MEASURE_FILE, RunFolder, replace_problem
from remat.analysis.report import error_pct, format_sentences, format_table, size_cell, text_cell, write_json
from remat.cli.common import (
    PipelineArgs,
    check_writable,
    config_from_args,
    file_name,
    json_text,
    max_error_status,
    pipeline_args,
    policies_from_args,
    size_flags_given,
    write_out,
    writing,
)
from remat.config import ModelConfig
from remat.memory.comparison import MemoryCheckError
from remat.parallel.launch import DistributedError, cleanup_on_sigterm
from remat.parallel.pipeline_measure import compare_pipeline, measure_pipeline_many, measured_stage_rows
from remat.parallel.pipeline_peaks import stage_peaks
from remat.policy import Policy
from remat.timeline import Timeline
from remat.units import MIB

# ------------------------------------------------------------------------------------------------ formatting
STAGE_MIB = size_cell(MIB, digits=2)  # stages are small: two decimals
STAGE_COLUMNS = [
    ("stage", "stage", text_cell), ("policy", "policy", text_cell), ("peak_bytes", "peak MiB", STAGE_MIB),
    ("peak_phase", "peak in", text_cell), ("max_in_flight", "in flight max", text_cell),
    ("in_flight_at_peak", "in flight @peak", text_cell), ("saved_bytes_at_peak", "saved @peak MiB", STAGE_MIB),
]
COMPARE_COLUMNS = [
    ("stage", "stage", text_cell), ("policy", "policy", text_cell), ("measured_bytes", "measured MiB", STAGE_MIB),
    ("predicted_bytes", "predicted MiB", STAGE_MIB), ("error", "error %", error_pct),
    ("max_in_flight", "in flight max", text_cell), ("in_flight_at_peak", "in flight @peak", text_cell),
]


def _why(rows: Sequence[dict[str, Any]]) -> str:
    return format_sentences([f"[{row['policy']}] {row['why']}" for row in rows])


def _model_line(config: ModelConfig, pipe: PipelineArgs) -> str:
    return (f"{config.num_layers} layers, h={config.hidden_size}, s={config.seq_length}, "
            f"microbatch {config.micro_batch_size}, vocab={config.vocab_size}, {config.dtype}; {pipe.describe()}")


def _save(out: Path | None, kind: str, policy: Policy, timelines: Sequence[Timeline]) -> list[str]:
    """``--timelines DIR``: each stage's timeline as ``<kind>-<policy>-stage<r>.json``."""
    if out is None:
        return []
    names = []
    for tl in timelines:
        stage = tl.meta.get("pipeline", {}).get("stage", 0)
        names.append(str(tl.save(Path(out) / f"{kind}-{file_name(str(policy))}-stage{stage}.json")))
    return names


def _write_report(args: argparse.Namespace, report: Any) -> None:
    """``--out FILE``: the JSON report, written atomically (as ``remat predict``/``compare`` do)."""
    out = getattr(args, "out", None)
    if out is not None:
        write_out(Path(out), report)


def _print(args: argparse.Namespace, report: Any, text: str) -> None:
    print(json_text(report) if getattr(args, "json", False) else text)


# ------------------------------------------------------------------------------------------------ runners
def _real_run(runner: Any) -> Any:
    """A failed or timed-out multi-process run is one line on stderr and exit status 1 (the processes are
    already gone)."""

    @functools.wraps(runner)
    def wrapped(args: argparse.Namespace) -> int:
        try:
            return runner(args)
        except DistributedError as err:
            if getattr(args, "debug", False):
                raise
            print(f"remat: error: {err}", file=sys.stderr)
            return 1
        except MemoryCheckError as err:  # refused before any process started: name the flags that size the run
            raise ValueError(f"{size_flags_given(args) or 'the default model'}: {err}") from None

    return wrapped


def run_pipeline_predict(args: argparse.Namespace) -> int:
    """``remat predict --pp P``: each stage's predicted peak per policy, what is in flight, and why."""
    config = config_from_args(args)
    pipe = pipeline_args(args, config)
    device = getattr(args, "device", "cpu")
    rows = []
    for policy in policies_from_args(args, config, pipe):
        rows += stage_peaks(config, policy, pipe.pp, pipe.microbatches, pipe.schedule, pipe.vpp, pipe.layout,
                            pipe.partial, runtime=pipe.runtime, device=device)
    report = {"command": "predict", "model": config.to_dict(), "pipeline": dataclasses.asdict(pipe),
              "device": device, "stages": rows, "files": []}
    _write_report(args, report)
    text = "\n".join([f"Predicted per-stage memory ({pipe.runtime} runtime): {_model_line(config, pipe)}",
                      format_table(rows, STAGE_COLUMNS), "", _why(rows)])
    _print(args, report, text)
    return 0


@_real_run
def run_pipeline_measure(args: argparse.Namespace) -> int:
    """``remat measure --pp P``: measure each stage in a real multi-process run, next to the prediction."""
    check_writable(args, files=("out",), folders=("timelines",))  # before minutes of measuring, not after
    folder, out = getattr(args, "timelines", None), getattr(args, "out", None)
    if folder is not None:  # replaced whole at the end (as explain's --out): refused now if that would lose files
        inside = out is not None and Path(os.path.realpath(out)).parent == Path(os.path.realpath(folder))
        problem = replace_problem(folder, "remat measure", [Path(out).name] if inside else [], MEASURE_FILE)
        if problem is not None:
            raise ValueError(f"--timelines {folder}: {problem}")
    config = config_from_args(args)
    pipe = pipeline_args(args, config, runtime="torch")
    device = getattr(args, "device", "cpu")
    policies = policies_from_args(args, config, pipe)
    measured = measure_pipeline_many(config, policies, pipe.pp, pipe.microbatches, pipe.schedule, pipe.vpp,
                                     pipe.layout, pipe.partial, device=device, timeout=pipe.timeout)
    rows = measured_stage_rows(config, policies, measured, pipe.pp, pipe.microbatches, pipe.schedule, pipe.vpp,
                               pipe.layout, pipe.partial, device=device)
    report = {"command": "measure", "model": config.to_dict(), "pipeline": dataclasses.asdict(pipe),
              "device": device, "stages": rows, "files": []}
    if folder is None:
        _write_report(args, report)
    else:  # written aside and swapped in whole: a kill or ^C mid-write leaves the previous folder as it was
        with writing("--timelines", folder), cleanup_on_sigterm(), RunFolder(folder) as run:
            for policy, stages in zip(policies, measured):
                report["files"] += [str(Path(folder) / Path(name).name)
                                    for name in _save(run.path(""), "measured", policy, stages)]
            if out is not None:
                with writing("--out", out):
                    write_json(run.outside(out), report)
            run.commit()
    text = "\n".join([f"Measured per-stage memory ({pipe.pp} process{'es' if pipe.pp > 1 else ''}, "
                      f"torch.distributed.pipelining): {_model_line(config, pipe)}",
                      format_table(rows, COMPARE_COLUMNS + [("peak_phase", "peak in", text_cell)]), "", _why(rows)])
    _print(args, report, text)
    return 0


@_real_run
def run_pipeline_compare(args: argparse.Namespace) -> int:
    """``remat compare --pp P --microbatches M --schedule S --policies a,b [--json]``: measured vs predicted peak
    per stage and policy; ``error`` is (predicted - measured) / measured."""
    config = config_from_args(args)
    pipe = pipeline_args(args, config, runtime="torch")
    device = getattr(args, "device", "cpu")
    policies = policies_from_args(args, config, pipe, default=("none", "full/uniform/1"))
    rows = compare_pipeline(config, policies, pipe.pp, pipe.microbatches, pipe.schedule, pipe.vpp, pipe.layout,
                            pipe.partial, device=device, timeout=pipe.timeout)
    _write_report(args, rows)
    worst = max(rows, key=lambda r: abs(r["error"]))
    text = "\n".join([f"Measured vs predicted per-stage peak: {_model_line(config, pipe)}",
                      format_table(rows, COMPARE_COLUMNS),
                      f"largest error: {100 * worst['error']:+.3f}% (stage {worst['stage']}, {worst['policy']})"])
    _print(args, rows, text)
    return max_error_status(args, rows, "a stage's peak")


@_real_run
def run_pipeline_explain(args: argparse.Namespace) -> int:
    """``remat explain --pp P``: per stage, none vs full/uniform/1 vs whole-chunk groups, measured in a real
    multi-process run (with the prediction), and the in-flight effect in words."""
    config = config_from_args(args)
    pipe = pipeline_args(args, config, runtime="torch")
    result = explain_pipeline(config, pipe.pp, pipe.microbatches, pipe.schedule, pipe.vpp, pipe.layout,
                              engine=getattr(args, "engine", None), device=getattr(args, "device", "cpu"),
                              timeout=pipe.timeout)
    report = {"command": "explain", "model": config.to_dict(), "pipeline": dataclasses.asdict(pipe), **result}
    if getattr(args, "out", None) is not None:
        with writing("--out", args.out):
            report["file"] = str(write_json(Path(args.out) / "explain-pipeline.json", report))
    columns = COMPARE_COLUMNS + [("saved_per_microbatch", "saved/mb MiB", STAGE_MIB)]
    text = "\n".join([f"Recompute under pipeline parallelism, measured: {_model_line(config, pipe)}",
                      format_table(result["rows"], columns), "", format_sentences(result["sentences"])])
    _print(args, report, text)
    return 0
