"""Command-line pieces for pipeline parallelism: ``--pp`` flags and the runners behind ``remat ... --pp``.

* :func:`add_pipeline_arguments` adds ``--pp``, ``--microbatches``, ``--schedule``, ``--vpp``, ``--layout``,
  ``--partial-checkpoint-microbatches``, ``--pipeline-runtime`` and ``--timeout`` to a parser.
* :func:`run_pipeline_predict`, :func:`run_pipeline_measure`, :func:`run_pipeline_explain` and
  :func:`run_pipeline_compare` take an ``argparse.Namespace`` with the model flags of
  :func:`remat.cli.add_model_arguments` plus these, and use where present: ``--preset``/``--config``,
  ``--policies``/``--policy``/``--sweep``, ``--engine``, ``--device``, ``--json``, ``--out`` (predict, measure,
  compare: a JSON report FILE; explain: a folder), ``--timelines DIR`` (stage timelines) and ``--max-error``
  (compare: exit 1 above it). They return an exit code; errors a user can fix are raised as ``ValueError``
  subclasses, which :func:`remat.cli.main` prints as one line, and a failed real run prints one line and
  returns 1.
* Importing this module registers ``remat measure`` unless ``remat`` has one already (it had none): it measures
  each stage of a real multi-process run (``--pp 1`` by default: one process) next to the prediction.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from remat.cli import (
    add_measure_arguments,
    add_model_arguments,
    add_subcommand,
    command,
    file_name,
    model_config_from_args,
    parse_policy_list,
)
from remat.config import ModelConfig
from remat.distributed import DEFAULT_TIMEOUT, DistributedError, compare_pipeline, measure_pipeline_many
from remat.pipeline import (
    MIB,
    RUNTIMES,
    SCHEDULES,
    PipelineError,
    check_schedule,
    partition,
    peak_error,
    predict_pipeline,
    stage_summary,
)
from remat.policy import Policy
from remat.report import cell, error_pct, text_cell
from remat.timeline import Timeline

Runner = Any


# ------------------------------------------------------------------------------------------------ flags
def _layout(text: str) -> list[int]:
    pieces = [p for p in re.split(r"[,\s]+", text.strip()) if p]
    try:
        counts = [int(p) for p in pieces]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layout {text!r}: give layer counts per model chunk, e.g. 3,5") from None
    if not counts:
        raise argparse.ArgumentTypeError("--layout is empty: give layer counts per model chunk, e.g. 3,5")
    return counts


def add_pipeline_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the pipeline-parallel flags. ``--pp`` defaults to None (no pipeline: the caller's own path)."""
    g = parser.add_argument_group("pipeline parallelism")
    g.add_argument("--pp", type=int, metavar="P",
                   help="pipeline stages (Megatron's --pipeline-model-parallel-size); per-stage memory")
    g.add_argument("--microbatches", type=int, metavar="M",
                   help="microbatches per step (default 2 x pp); --batch is the microbatch size")
    g.add_argument("--schedule", choices=SCHEDULES, default="1f1b",
                   help="1f1b (default), gpipe, or interleaved (with --vpp model chunks per stage)")
    g.add_argument("--vpp", type=int, default=1, metavar="V",
                   help="model chunks per stage for the interleaved schedule (Megatron's "
                        "--num-layers-per-virtual-pipeline-stage gives layers / (pp x V))")
    g.add_argument("--layout", type=_layout, metavar="L0,L1,...",
                   help="layers of each model chunk in global order (default: even split)")
    g.add_argument("--partial-checkpoint-microbatches", type=int, metavar="N",
                   help="Megatron's --num-microbatches-with-partial-activation-checkpoints: in each window of "
                        "in-flight microbatches the first N keep everything, the rest run the policy")
    g.add_argument("--pipeline-runtime", choices=RUNTIMES, default="torch",
                   help="whose pipeline buffers predict models: torch (torch.distributed.pipelining, what measure "
                        "runs; default) or megatron")
    g.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, metavar="S",
                   help=f"seconds a real multi-process run may take before every rank is killed "
                        f"(default {DEFAULT_TIMEOUT:g})")


@dataclasses.dataclass(frozen=True)
class PipelineArgs:
    """The pipeline settings of a parsed command line, checked."""

    pp: int
    microbatches: int
    schedule: str
    vpp: int
    layout: list[int] | None
    partial: int | None
    runtime: str
    timeout: float

    def describe(self) -> str:
        text = f"pp={self.pp}, {self.microbatches} microbatches, {self.schedule}"
        if self.vpp > 1:
            text += f" x {self.vpp} chunks per stage"
        if self.layout:
            text += f", layout {','.join(map(str, self.layout))}"
        if self.partial is not None:
            text += f", partial checkpointing N={self.partial}"
        return text


def pipeline_args(args: argparse.Namespace, runtime: str | None = None) -> PipelineArgs:
    """Read and check the pipeline flags (``--pp`` absent means 1); raises PipelineError naming the fix."""
    pp = getattr(args, "pp", None) or 1
    m = getattr(args, "microbatches", None)
    m = 2 * pp if m is None else m
    schedule = getattr(args, "schedule", None) or "1f1b"
    vpp = getattr(args, "vpp", None) or 1
    runtime = runtime or getattr(args, "pipeline_runtime", None) or "torch"
    timeout = getattr(args, "timeout", None) or DEFAULT_TIMEOUT
    if timeout <= 0:
        raise PipelineError(f"--timeout {timeout:g}: must be a positive number of seconds")
    schedule = check_schedule(schedule, pp, m, vpp, runtime)
    return PipelineArgs(pp, m, schedule, vpp, getattr(args, "layout", None),
                        getattr(args, "partial_checkpoint_microbatches", None), runtime, timeout)


def config_from_args(args: argparse.Namespace) -> ModelConfig:
    """The model: ``--preset``/``--config`` with the model flags applied when the parser has them
    (:func:`remat.cli.resolve_model_config`), else the model flags alone."""
    if hasattr(args, "preset") or hasattr(args, "config"):
        from remat.cli import resolve_model_config

        return resolve_model_config(args)
    return model_config_from_args(args)


def policies_from_args(args: argparse.Namespace, config: ModelConfig, pipe: PipelineArgs,
                       default: Sequence[str] = ("none",)) -> list[Policy]:
    """The policies named by ``--policies`` (a comma list) and/or ``--policy`` (one, a comma list, or a list of
    them when repeated), plus ``--sweep megatron`` (every Megatron setting of the smallest model chunk), with
    ``--engine`` applied to those that do not name their own ``@engine``; ``default`` when none is named.
    Duplicates are dropped, order is kept."""
    texts: list[str] = []
    for name in ("policies", "policy"):
        value = getattr(args, name, None)
        if isinstance(value, str):
            texts.append(value)
        elif value:
            texts.extend(value)
    names = [n for text in texts for n in (parse_policy_list(text) or [])]
    if getattr(args, "sweep", None) == "megatron":
        from remat.cli import megatron_sweep

        names += megatron_sweep(min(s.num_layers for s in partition(config, pipe.pp, pipe.vpp, pipe.layout)))
    engine = getattr(args, "engine", None)
    out: list[Policy] = []
    for name in names or list(default):
        policy = Policy.parse(name)
        if engine and "@" not in name:
            policy = dataclasses.replace(policy, engine=engine)
        if policy not in out:
            out.append(policy)
    return out


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
    from remat.report import format_table

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
        from remat.report import write_json

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


def explain_pipeline(config: ModelConfig, pp: int, microbatches: int, schedule: str = "1f1b", vpp: int = 1,
                     layout: Sequence[int] | None = None, *, engine: str | None = None, device: str = "cpu",
                     timeout: float = DEFAULT_TIMEOUT) -> dict[str, Any]:
    """Measure (and predict) each stage under none, full/uniform/1 and whole-chunk groups (full/uniform/K, K the
    smallest chunk's layer count), and explain the in-flight effect in words. Returns ``{'policies', 'rows',
    'sentences'}``; rows are per stage and policy (measured and predicted peaks, in-flight microbatches, saved
    bytes per in-flight microbatch at the peak)."""
    specs = partition(config, pp, vpp, layout)
    k = min(s.num_layers for s in specs)
    names = ["none", "full/uniform/1"] + ([f"full/uniform/{k}"] if k > 1 else [])
    policies = [Policy.parse(n) for n in names]
    if engine:
        policies = [dataclasses.replace(p, engine=engine) for p in policies]
    measured = measure_pipeline_many(config, policies, pp, microbatches, schedule, vpp, layout, device=device,
                                     timeout=timeout)
    rows = []
    by_stage: dict[int, dict[str, dict[str, Any]]] = {}
    for policy, stages in zip(policies, measured):
        predicted = predict_pipeline(config, policy, pp, microbatches, schedule, vpp, layout, device=device)
        for real, guess in zip(stages, predicted):
            s = stage_summary(real)
            n = s["in_flight_at_peak"] or 0
            row = {"stage": s["stage"], "policy": str(policy), "measured_bytes": real.peak_bytes,
                   "predicted_bytes": guess.peak_bytes, "error": peak_error(real.peak_bytes, guess.peak_bytes),
                   "peak_phase": s["peak_phase"], "max_in_flight": s["max_in_flight"], "in_flight_at_peak": n,
                   "saved_bytes_at_peak": s["saved_bytes_at_peak"],
                   "saved_per_microbatch": s["saved_bytes_at_peak"] / n if n else 0, "why": s["why"]}
            rows.append(row)
            by_stage.setdefault(row["stage"], {})[row["policy"]] = row
    sentences = _explain_sentences(by_stage, [str(p) for p in policies], schedule, pp, k)
    return {"policies": [str(p) for p in policies], "rows": rows, "sentences": sentences}


def _pct_change(new: float, old: float) -> str:
    return f"{100 * (new / old - 1):+.0f}%" if old else "-"


def _explain_sentences(by_stage: dict[int, dict[str, dict[str, Any]]], policies: list[str], schedule: str,
                       pp: int, k: int) -> list[str]:
    """Per stage: the in-flight count, what each policy keeps per in-flight microbatch, and why the peaks
    differ; then which stage gains most. Every claim is computed from the rows."""
    out = []
    none, one = policies[0], policies[1]
    whole = policies[2] if len(policies) > 2 else None
    gains = {}
    for stage, rows in sorted(by_stage.items()):
        plain, r1 = rows[none], rows[one]
        n = plain["max_in_flight"]
        text = (f"Stage {stage} holds up to {n} microbatch{'es' if n != 1 else ''} in flight under {schedule}; "
                f"without recompute it peaks at {plain['measured_bytes'] / MIB:.2f} MiB with "
                f"{plain['in_flight_at_peak']} in flight keeping {plain['saved_per_microbatch'] / MIB:.2f} MiB of "
                f"saved tensors each. {one} keeps {r1['saved_per_microbatch'] / MIB:.2f} MiB per in-flight "
                f"microbatch (each layer's inputs): {r1['measured_bytes'] / MIB:.2f} MiB "
                f"({_pct_change(r1['measured_bytes'], plain['measured_bytes'])}).")
        best = r1
        if whole:
            rw = rows[whole]
            stored_less = r1["saved_bytes_at_peak"] - rw["saved_bytes_at_peak"]
            rest_more = (rw["measured_bytes"] - r1["measured_bytes"]) + stored_less
            verdict = "lower" if rw["measured_bytes"] < r1["measured_bytes"] else "higher"
            text += (f" {whole} (one group per chunk) keeps only the chunk's input, "
                     f"{rw['saved_per_microbatch'] / MIB:.2f} MiB per microbatch: at its peak it stores "
                     f"{stored_less / MIB:.2f} MiB less than {one}, but rebuilding {k} layers of one microbatch at "
                     f"once costs {rest_more / MIB:.2f} MiB more working set, so it ends {verdict}: "
                     f"{rw['measured_bytes'] / MIB:.2f} MiB "
                     f"({_pct_change(rw['measured_bytes'], plain['measured_bytes'])}).")
            best = min((r1, rw), key=lambda r: r["measured_bytes"])
        gains[stage] = (1 - best["measured_bytes"] / plain["measured_bytes"], n, best["policy"])
        out.append(text)
    if len(gains) > 1:
        top = max(gains, key=lambda s: gains[s][0])
        low = min(gains, key=lambda s: gains[s][0])
        out.append(f"The stored-input saving is paid back once per microbatch in flight, the recompute working set "
                   f"only once (for the microbatch whose backward runs): stage {top}, with {gains[top][1]} in "
                   f"flight, gains most ({100 * gains[top][0]:.0f}% with {gains[top][2]}), stage {low}, with "
                   f"{gains[low][1]}, least ({100 * gains[low][0]:.0f}%).")
    return out


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
        from remat.report import write_json

        report["file"] = str(write_json(Path(args.out) / "explain-pipeline.json", report))
    columns = COMPARE_COLUMNS + [("saved_per_microbatch", "saved/mb MiB", _mib)]
    text = "\n".join([f"Recompute under pipeline parallelism, measured: {_model_line(config, pipe)}",
                      _table(result["rows"], columns), "", _bullets(result["sentences"])])
    _print(args, report, text)
    return 0


# ------------------------------------------------------------------------------------------------ remat measure
def measure_command(sub: Any) -> Runner:
    """``remat measure``: measure each pipeline stage in a real multi-process run (``--pp 1``: one process)."""
    parser = add_subcommand(
        sub, "measure", help="measure per-stage memory in a real pipeline-parallel run (one process per stage)",
        description="Run one training step of the reference GPT split into --pp pipeline stages, one process per "
                    "stage (gloo on CPU, NCCL with --device cuda), record every stage's memory, and show each "
                    "stage's measured peak next to the prediction, with what is in flight at the peak.")
    add_model_arguments(parser)
    add_measure_arguments(parser)
    add_pipeline_arguments(parser)
    g = parser.add_argument_group("measure")
    g.add_argument("--policies", metavar="LIST", default="none",
                   help="comma-separated recompute policies, e.g. none,full/uniform/1 (default none)")
    g.add_argument("--json", action="store_true", help="print a JSON report instead of the table")
    g.add_argument("--out", type=Path, metavar="FILE", help="also write the JSON report to FILE (atomically)")
    g.add_argument("--timelines", type=Path, metavar="DIR",
                   help="also write each stage's measured timeline JSON there (measured-<policy>-stage<r>.json)")
    return run_pipeline_measure


command(measure_command)
