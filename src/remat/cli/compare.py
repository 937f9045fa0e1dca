"""`remat compare`: predicted against measured on this machine."""

from __future__ import annotations

import argparse
from pathlib import Path

from remat.analysis.report import format_table, size_cell
from remat.cli.common import (
    POLICY_LIST_EPILOG,
    ProgressBar,
    Runner,
    Subparsers,
    add_measure_arguments,
    add_model_source_arguments,
    add_parallel_arguments,
    add_policy_arguments,
    add_subcommand,
    check_writable,
    emit_report,
    max_error_status,
    model_summary,
    non_negative_number,
    parallel_kwargs,
    resolve_cli_policies,
    resolve_model_config,
)
from remat.cli.job import job_requested, run_compare_job
from remat.cli.job_args import add_job_arguments
from remat.cli.megatron_core import add_megatron_core_argument, run_compare_megatron_core
from remat.cli.pipeline import run_pipeline_compare
from remat.memory.comparison import compare_policies
from remat.units import table_unit


def compare_command(sub: Subparsers) -> Runner:
    """``remat compare``: predicted against measured peaks on this machine, policy by policy."""
    parser = add_subcommand(
        sub, "compare", help="predict and measure the same steps here and report the error",
        description="Predict each policy's step (FakeTensorMode) and measure it on this machine with real tensors, "
                    "then report both peaks, the error of the prediction and the worst error among the parts alive "
                    "at the peak. Real tensors are allocated: use a config that fits in this machine's memory.",
        epilog=POLICY_LIST_EPILOG)
    add_model_source_arguments(parser)
    add_parallel_arguments(parser)
    add_policy_arguments(parser)
    add_measure_arguments(parser)
    add_job_arguments(parser)
    g = parser.add_argument_group("compare")
    g.add_argument("--adam", action="store_true", help="include Adam (states alive through the step) on both sides")
    g.add_argument("--max-error", type=non_negative_number, metavar="FRACTION",
                   help="exit with code 1 when a peak's |error| exceeds FRACTION (e.g. 0.01)")
    add_megatron_core_argument(g)
    g.add_argument("--json", action="store_true", help="print the rows as a JSON list instead of the table")
    g.add_argument("--out", type=Path, metavar="FILE", help="also write the rows as JSON to FILE (atomically)")
    return run_compare


def run_compare(args: argparse.Namespace) -> int:
    check_writable(args, files=("out",))  # before anything is measured
    if args.megatron_core:
        return run_compare_megatron_core(args)
    if job_requested(args):
        return run_compare_job(args)
    if args.pp is not None:
        if args.adam:
            raise ValueError("--adam with --pp: the pipeline measurement has no optimizer; use --optimizer adam (the "
                             "whole job, run on gloo: Megatron's fp32 moments and master parameters)")
        return run_pipeline_compare(args)
    config = resolve_model_config(args)
    policies = resolve_cli_policies(args, config.num_layers, config)
    if parallel_kwargs(args):
        raise ValueError("compare measures one unsharded process: --tp/--sp are for predict (real tensor-parallel "
                         "ranks are measured by remat.parallel.tensor.measure_tensor_parallel)")
    bar = ProgressBar("remat compare")
    try:
        rows = compare_policies(config, policies, device=args.device, adam=args.adam, progress=bar)
    finally:
        bar.close()

    def print_text() -> None:
        unit, divisor = table_unit(max(r["measured_bytes"] for r in rows))
        size = size_cell(divisor)
        pct = lambda v: f"{100 * v:+.2f}"
        print(f"{model_summary(config)}; measured on {args.device}" + (", with Adam" if args.adam else "") + "\n")
        print(format_table(rows, [
            ("policy", "policy", str), ("predicted_bytes", f"predicted {unit}", size),
            ("measured_bytes", f"measured {unit}", size), ("error", "error %", pct),
            ("measured_phase", "measured peak in", str), ("worst_part", "worst part", lambda v: v or "-"),
            ("worst_part_error", "part error %", pct)]))
        worst_row = max(rows, key=lambda r: abs(r["error"]))
        print(f"\nworst peak error {100 * worst_row['error']:+.3f}% ({worst_row['policy']}); worst part error "
              f"{100 * max(abs(r['worst_part_error']) for r in rows):.3f}%. error = (predicted - measured) / "
              "measured; a part measured as 0 is taken relative to the peak.")

    emit_report(args, rows, print_text)
    return max_error_status(args, rows)
