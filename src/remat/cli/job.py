"""``remat predict``, ``compare`` and ``plan`` for a whole Megatron-LM job (NOTE [the job path] in
:mod:`remat.cli.job_args`): every part of every rank, worst rank first."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import sys
import time
from collections.abc import Callable
from typing import Any

from remat.analysis.job_html import (
    Answer,
    budget_capacity,
    capacity_line,
    gpu_capacity,
    plan_answers,
    prediction_answers,
    write_job_html,
)
from remat.analysis.job_report import (
    describe_job,
    format_job_plan,
    format_job_prediction,
    not_counted_line,
    rank_row,
    reserved_line,
)
from remat.cli.common import emit_report, max_error_status, writing
from remat.cli.job_args import JobSource, job_flags_given, job_from_args, job_policies
from remat.cli.job_memory import budgets_reserved, job_allocator, write_snapshot
from remat.job import Job
from remat.job_flags import JobError
from remat.job_input import routing_line, stamp_report, stamp_text
from remat.memory.replay_pool import BackgroundReplays
from remat.parallel.job_measure import check_measurable, compare_job, format_rows, routing_counts
from remat.parallel.job_predict import job_kernels
from remat.parallel.launch import DEFAULT_TIMEOUT
from remat.plan.job_exact import predict_policies
from remat.plan.job_plan import plan_job
from remat.plan.job_reserved import add_plan_reserved, plan_job_reserved
from remat.plan.options import PlanOptions


def job_requested(args: argparse.Namespace, *, mixed_precision_model: bool = False) -> bool:
    """True when the command describes a whole job: a job flag, tensor parallelism together with a pipeline (only
    the job path combines them), or, for ``plan`` (``mixed_precision_model``), a bf16/fp16 model: it trains in
    Megatron's mixed precision, whose fp32 main grads, master params and Adam moments a plan must count."""
    if job_flags_given(args):
        return True
    if getattr(args, "pp", None) is not None and (getattr(args, "tp", 1) > 1 or getattr(args, "sp", False)):
        return True
    return mixed_precision_model


def _job_dict(source: JobSource) -> dict[str, Any]:
    job = source.job
    out = {f.name: getattr(job, f.name) for f in dataclasses.fields(job) if f.name not in ("model", "policy")}
    out.update({k: dataclasses.asdict(v) for k, v in out.items() if dataclasses.is_dataclass(v)})  # FSDP configs
    out.update(model=job.model.to_dict(), world_size=job.world_size, global_batch_size=job.global_batch_size,
               chunk_layers=list(job.chunk_layers),  # decoder layers of every model chunk, in global order
               bytes_per_param_static=float(job.bytes_per_param_static()))
    try:
        out["megatron_args"] = job.to_megatron_args(include_world_size=False)
    except JobError as err:
        out["megatron_args"], out["megatron_args_note"] = None, str(err)
    return out


def _routing_entry(job: Job) -> dict[str, str]:
    """The JSON report's ``moe_routing_assumed`` (:func:`remat.job_input.routing_line`), for an MoE job."""
    line = routing_line(job)
    return {"moe_routing_assumed": line} if line else {}


def _header(source: JobSource) -> str:
    return "\n".join([*source.first_lines, describe_job(source.job), *source.notes()])


def _emit(args: argparse.Namespace, source: JobSource, report: dict[str, Any], print_text: Callable[[], None]) -> None:
    """:func:`emit_report` with the job's input (``input``: world size, script, what is left out); a lower bound
    (``--allow-unmodelled``) stamped on every text line and JSON row (:mod:`remat.job_input`)."""
    if source.details:
        report["input"] = source.details

    def text() -> None:
        if not source.unmodelled:
            print_text()
            return
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            print_text()
        sys.stdout.write(stamp_text(buffer.getvalue(), source.unmodelled))

    emit_report(args, stamp_report(report, source.unmodelled), text)


def _refuse_adam(args: argparse.Namespace) -> None:
    if getattr(args, "adam", False):
        raise ValueError("--adam with a whole job: --adam traces moments in the parameter dtype on one process; use "
                         "--optimizer adam (Megatron's fp32 moments and master parameters)")


def _microbatches(pp: int) -> int:
    return 2 * pp if pp > 1 else 1


def run_predict_job(args: argparse.Namespace) -> int:
    """``remat predict`` with a job: each policy's every distinct rank, worst first, with its parts."""
    _refuse_adam(args)
    source = job_from_args(args, default_microbatches=_microbatches)
    started = time.perf_counter()
    allocator, alloc_source = job_allocator(args, source)
    replays = BackgroundReplays(allocator)  # each policy's ranks replayed beside the next policy's prediction
    policies = job_policies(args, source)
    predictions = list(zip(policies, predict_policies(source.job, policies, device=args.device,
                                                      gpu=getattr(args, "gpu", None), allocator=allocator,
                                                      replay=replays)))
    replays.wait()
    report = {"format": "remat.predict-job", "version": 1, "job": _job_dict(source), "device": args.device,
              "kernels": job_kernels(),  # --kernels, default cuda: a job runs on GPUs
              "assumed": source.assumed, "ignored_flags": source.ignored, "not_counted": not_counted_line(),
              **_routing_entry(source.job),
              "rows": [rank_row(r, policy=str(p)) for p, pred in predictions for r in pred.ranks],
              "alloc_conf": (allocator.text() if allocator else ""), "alloc_conf_source": alloc_source,
              "seconds": time.perf_counter() - started}
    snapshot = write_snapshot(args, report, predictions[0][1].worst, f"policy {predictions[0][0]}'s worst rank")
    capacity = gpu_capacity(getattr(args, "gpu", None))
    if capacity:
        report["gpu"] = {"name": args.gpu, "capacity_bytes": capacity[-1][1]}
    page = _write_page(args, report, source, prediction_answers([(str(p), pred) for p, pred in predictions]),
                       capacity=capacity, notes=[not_counted_line()])
    def print_text() -> None:
        print(_header(source) + "\n")
        for policy, pred in predictions:
            print(format_job_prediction(pred, str(policy)) + "\n")
        if capacity:
            print(capacity_line(predictions, capacity[-1]))
        if any(r.reserved for _, pred in predictions for r in pred.ranks):
            print(reserved_line(report["alloc_conf"], alloc_source))
        print(not_counted_line())
        if page:
            print(page)
        if snapshot:
            print(snapshot)

    _emit(args, source, report, print_text)
    return 0


def _write_page(args: argparse.Namespace, report: dict[str, Any], source: JobSource, answers: list[Answer],
                **kwargs: Any) -> str | None:
    """``--html FILE``: the job's page (:mod:`remat.analysis.job_html`), written atomically; its path goes into
    the report's ``files``; returns the line the text ends with (None without --html)."""
    path = getattr(args, "html", None)
    if path is None:
        return None
    job = source.job
    header = [*source.first_lines, describe_job(job), *source.notes(),
              f"kernels {job_kernels()} (what they save for backward); device "
              f"{getattr(args, 'device', 'cpu')}; {len(answers)} answer{'s' * (len(answers) != 1)}"]
    with writing("--html", path):
        write_job_html(path, f"Every rank of the job: {job.world_size} ranks, {job.model.num_layers} layers, "
                       f"h={job.model.hidden_size}", header, answers, **kwargs)
    report.setdefault("files", {})["html"] = str(path)
    return f"page: {path} (every distinct rank's parts at its peak, the worst rank through the step)"


def run_compare_job(args: argparse.Namespace) -> int:
    """``remat compare`` with a job: every rank run for real on gloo (CPU), measured beside its prediction."""
    _refuse_adam(args)
    if args.device != "cpu":
        raise ValueError(f"--device {args.device} with a whole job: its ranks run as CPU processes on gloo; drop "
                         "--device")
    if getattr(args, "kernels", None) not in (None, "cpu"):
        raise ValueError(f"--kernels {args.kernels} with a whole job: compare runs its ranks as CPU processes on gloo "
                         "and predicts them with the CPU kernels; drop --kernels (remat predict prices the GPU job)")
    source = job_from_args(args, default_microbatches=_microbatches)
    rows = []
    for policy in job_policies(args, source):
        job: Job = source.job.replace(policy=policy)
        check_measurable(job)
        rows += [{"policy": str(policy), **row} for row in compare_job(job, timeout=args.timeout or DEFAULT_TIMEOUT)]
    routing = _routing(source.job, rows)
    report = {"format": "remat.compare-job", "version": 1, "job": _job_dict(source), "kernels": "cpu",
              "assumed": source.assumed, "moe_routing": routing,
              "ignored_flags": source.ignored, "not_counted": not_counted_line(), "rows": rows}
    def print_text() -> None:
        print(_header(source) + "\n")
        for policy in dict.fromkeys(r["policy"] for r in rows):
            print(f"policy {policy}: predicted vs measured per rank (error = (predicted - measured) / measured)")
            print(format_rows([r for r in rows if r["policy"] == policy]) + "\n")
        if routing:
            print(f"MoE routing: predicted with {routing['predicted']}; the run routed (the first rank of each stage, "
                  f"its last microbatch) {routing['measured'].removeprefix('counts:')} tokens per expert per MoE "
                  f"layer: --moe-routing {routing['measured']} predicts those counts")
        print(not_counted_line())

    _emit(args, source, report, print_text)
    return max_error_status(args, rows, "a rank's peak")


def _routing(job: Job, rows: list[dict]) -> dict[str, str] | None:
    """A MoE job's routing: the assumption its prediction used and the one that predicts what the run routed (the
    first policy's run; its stages' MoE layers in order: None with virtual pipeline chunks, whose layers a rank's
    report does not list in model order)."""
    first = [r for r in rows if r["policy"] == rows[0]["policy"]] if rows else []
    reports = [rep for stage in sorted({r["stage"] for r in first})
               for rep in next(r for r in first if r["stage"] == stage).get("moe_routing") or ()]
    if not reports or job.vpp:
        return None
    assumed = job.model.moe_routing_assumption
    return {"predicted": assumed or "balanced (remat's default)", "measured": routing_counts(reports)}


def run_plan_job(args: argparse.Namespace, options: PlanOptions) -> int:
    """``remat plan`` with a job: the cheapest plan per stage (extended search, ``options`` from remat plan's flags)
    and the best Megatron settings, every rank of each predicted exactly with every part counted."""
    reserved = budgets_reserved(args)
    source = job_from_args(args, default_microbatches=lambda pp: pp)
    if source.recompute_given:
        raise ValueError("--recompute-* flags in --megatron-args: remat plan chooses the recompute setting; drop "
                         "them (or use remat predict to price that setting)")
    allocator, alloc_source = job_allocator(args, source)
    if reserved:  # what a GPU runs out of (NOTE [a job's reserved budget])
        result = plan_job_reserved(source.job, args.budget, options, allocator)
    else:
        result = plan_job(source.job, args.budget, options)
        add_plan_reserved(result, allocator)
    report = {**result.to_dict(), "job": _job_dict(source), "kernels": job_kernels(), "assumed": source.assumed,
              "ignored_flags": source.ignored, **_routing_entry(source.job),
              "not_counted": not_counted_line(args.budget, args.reserve),
              "budgeted_memory": "reserved" if reserved else "allocated",
              "alloc_conf": (allocator.text() if allocator else ""), "alloc_conf_source": alloc_source}
    worst = (result.ranks() or sorted((s.prediction for s in result.stages if s.prediction is not None),
                                      key=lambda r: -r.peak_bytes) or [None])[0]
    snapshot = write_snapshot(args, report, worst, "the plan's worst rank" if result.fits else
                              "no plan fits: the worst rank of the lowest peaks predicted" if worst else
                              "no rank was predicted (the model state alone exceeds the budget)")
    answers, entries = plan_answers(result)
    page = _write_page(args, report, source, answers, entries=entries,
                       capacity=budget_capacity(args.budget, result.budget_bytes, result.budget_text),
                       notes=[not_counted_line(args.budget, args.reserve)])
    def print_text() -> None:
        print(_header(source) + "\n")
        print(format_job_plan(result))
        print(reserved_line(report["alloc_conf"], alloc_source))
        print(not_counted_line(args.budget, args.reserve))
        if page:
            print(page)
        if snapshot:
            print(snapshot)

    _emit(args, source, report, print_text)
    return 0 if result.fits else 1

