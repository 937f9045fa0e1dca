"""`remat predict`: predict a config's memory timeline without running it."""

from __future__ import annotations

import argparse
import textwrap
import time
from pathlib import Path
from typing import Any

from remat.analysis.prediction import format_formula_report, format_prediction_table, formula_report, prediction_row
from remat.cli.common import (
    POLICY_LIST_EPILOG,
    ProgressBar,
    Runner,
    Subparsers,
    add_model_source_arguments,
    add_parallel_arguments,
    add_policy_arguments,
    add_subcommand,
    check_writable,
    info,
    json_text,
    model_summary,
    parallel_kwargs,
    resolve_cli_policies,
    resolve_model_config,
    write_out,
)
from remat.cli.job import job_requested, run_predict_job
from remat.cli.job_args import add_job_arguments, add_page_arguments, refuse_page_flags
from remat.cli.job_memory import add_memory_arguments, refuse_memory_flags
from remat.cli.megatron_core import add_megatron_core_argument, run_predict_megatron_core
from remat.cli.pipeline import run_pipeline_predict
from remat.memory import disk_cache
from remat.memory.comparison import predict_policies
from remat.memory.kernels import resolve_kernels
from remat.memory.predict import predict_config
from remat.memory.reserved import REPLAY_NOTE, format_reserved, reserved_figures
from remat.policy import ENGINES
from remat.timeline import Timeline


def predict_command(sub: Subparsers) -> Runner:
    """``remat predict``: each policy's memory timeline, traced under FakeTensorMode (nothing is allocated)."""
    parser = add_subcommand(
        sub, "predict", help="predict peak memory of recompute policies without running the step",
        description="Predict one training step's memory (forward, loss, backward) of the reference GPT under each "
                    "recompute policy, without allocating it: the step runs under FakeTensorMode and a deep stack "
                    "is composed from a shallow trace. Prints each policy's peak, where it is, what is alive there "
                    "and the extra compute, then the published per-layer formulas beside the traced bytes, with the "
                    "reasons they differ.",
        epilog=POLICY_LIST_EPILOG)
    add_model_source_arguments(parser)
    add_parallel_arguments(parser)
    add_policy_arguments(parser)
    add_job_arguments(parser)
    g = parser.add_argument_group("predict")
    g.add_argument("--engine", choices=ENGINES,
                   help="checkpoint implementation for policies without '@engine' (default reentrant, Megatron's)")
    g.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: exact storage bytes; cuda: each storage rounded up to the CUDA caching allocator's "
                        "512-byte blocks (the kernels traced are still the CPU ones) (default cpu)")
    g.add_argument("--adam", action="store_true",
                   help="include Adam: its two moments per parameter (in the parameter dtype) exist through the "
                        "step, and optimizer.step() is traced (one unsharded process; for Megatron's fp32 moments and "
                        "master parameters on any parallel layout use --optimizer adam)")
    g.add_argument("--no-cache", action="store_true",
                   help="neither read nor write the on-disk cache of shallow traces ($REMAT_CACHE_DIR, default "
                        "~/.cache/remat)")
    add_megatron_core_argument(g)
    g.add_argument("--json", action="store_true", help="print the JSON report instead of the table")
    g.add_argument("--out", type=Path, metavar="FILE", help="also write the JSON report to FILE (atomically)")
    add_page_arguments(g, gpu=True)
    add_memory_arguments(g)
    return run_predict


def run_predict(args: argparse.Namespace) -> int:
    check_writable(args, files=("out", "html", "snapshot"))  # before the work, not after it
    disk_cache.set_enabled(not args.no_cache)
    if args.megatron_core:
        refuse_page_flags(args, "--megatron-core runs Megatron's own model on one process")
        refuse_memory_flags(args, "--megatron-core runs Megatron's own model on one process")
        return run_predict_megatron_core(args)
    if job_requested(args):
        return run_predict_job(args)
    refuse_page_flags(args, "this command predicts one process" + (" per pipeline stage" if args.pp else ""))
    cpu_bytes = resolve_kernels(None, args.device) == "cpu" and args.device == "cpu"  # no allocator replay
    refuse_memory_flags(args, "this command predicts one process" + (
        " per pipeline stage" if args.pp else " with the CPU kernels" if cpu_bytes else ""),
        alloc_conf_too=args.pp is not None or cpu_bytes)
    if args.pp is not None:
        if args.adam:
            raise ValueError("--adam with --pp: the pipeline prediction has no optimizer; use --optimizer adam (the "
                             "whole-job prediction: Megatron's fp32 moments and master parameters on every stage)")
        return run_pipeline_predict(args)
    config = resolve_model_config(args)
    policies = resolve_cli_policies(args, config.num_layers, config)
    parallel = parallel_kwargs(args)
    started = time.perf_counter()
    kernels = resolve_kernels(None, args.device)
    replay = kernels != "cpu" or args.device == "cuda"  # GPU bytes: the caching allocator's reserved memory too
    made: dict[int, dict[str, Any]] = {}  # each policy's row, made as soon as its timeline is (beside the tracing)

    def row_of(i: int, timeline: Timeline, seconds: float) -> dict[str, Any]:  # where the timeline is made
        row = prediction_row(policies[i], timeline, seconds)
        if replay:
            row["allocator_replay"] = reserved_figures(timeline, args.alloc_conf)
        return row

    def keep_row(i: int, row: dict[str, Any], seconds: float) -> None:
        made[i] = row

    bar = ProgressBar("remat predict")
    try:  # only the no-recompute timeline is kept (for the formulas): the rows are made from each as it comes
        predicted = predict_policies(config, policies, device=args.device, adam=args.adam, **parallel,
                                     progress=bar if len(policies) > 1 else None, summarize=row_of,
                                     on_predicted=keep_row,
                                     keep=lambda i: policies[i].is_none)
    finally:
        bar.close()
    rows = [made[i] for i in range(len(policies))]
    # the formulas are compared with a no-recompute trace on CPU without optimizer (reused when there is one)
    plain_cpu = next((tl for policy, (tl, _) in zip(policies, predicted) if policy.is_none), None)
    if plain_cpu is None or args.adam or args.device != "cpu" or kernels != "cpu":
        plain_cpu = predict_config(config, "none", device="cpu", kernels="cpu", **parallel)
    formulas = formula_report(config, plain_cpu, **parallel)
    report = {
        "format": "remat.predict", "version": 1, "config": config.to_dict(), "device": args.device, "kernels": kernels,
        "optimizer": "adam (states alive through the step)" if args.adam else None,
        "parallel": parallel, "rows": rows, "formulas": formulas, "seconds": time.perf_counter() - started,
    }
    if args.out is not None:
        write_out(args.out, report)
    if args.json:
        print(json_text(report))
    else:
        notes = ("params/grads/optim: parameters, their gradients, Adam states; inputs: checkpointed group inputs; "
                 "saved act: activations kept for backward; recompute: rebuilt in backward; head/loss: final norm, "
                 "logits, loss and their gradients; other: activation gradients, temporaries, the batch. extra "
                 "compute %: recompute FLOPs over forward + backward FLOPs (torch.utils.flop_counter; it counts 0 "
                 "for CPU fused attention, so sdpa models under-count recomputed attention).")
        if kernels != "cpu":
            notes += (f" kernels={kernels}: dropout, norms and attention keep what the {kernels} kernels keep "
                      "(docs/kernels.md); the formulas below compare the CPU-kernel trace.")
        print(f"{model_summary(config)}; predicted on {args.device}"
              + (", with Adam" if args.adam else "") + "\n")
        print(format_prediction_table(rows))
        if "allocator_replay" in rows[0]:
            print("\n" + textwrap.fill(f"Reserved memory (what runs out on a GPU): {REPLAY_NOTE}.", width=110))
            for row in rows:
                print(f"  {row['policy']}: {format_reserved(row['allocator_replay'])}")
        print("\n" + textwrap.fill(notes, width=110) + "\n")
        print(format_formula_report(formulas, config))
    if args.out is not None:
        info(f"wrote {args.out}")
    return 0
