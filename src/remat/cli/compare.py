"""`remat compare`: predicted against measured on this machine."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from remat.analysis.prediction import size_cell, table_unit
from remat.analysis.report import format_table
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
    info,
    json_text,
    model_summary,
    parallel_kwargs,
    resolve_cli_policies,
    resolve_model_config,
    write_out,
)
from remat.cli.pipeline import run_pipeline_compare
from remat.memory.measure import measure
from remat.memory.optimizer import adam_steady_state
from remat.memory.predict import predict, predict_config
from remat.models.gpt import build_model, sample_batch
from remat.recompute.apply import apply


# ----------------------------------------------------------------------------------------------- compare
def part_errors(predicted: dict[str, int], measured: dict[str, int], measured_peak: int) -> dict[str, float]:
    """Per at-peak category: (predicted - measured) / measured; a part measured as 0 bytes is taken relative to
    the measured peak instead (0.0 when both are 0), so every error is a finite fraction."""
    out = {}
    for key in measured:
        p, m = predicted.get(key, 0), measured[key]
        out[key] = (p - m) / m if m else ((p - m) / measured_peak if measured_peak else 0.0)
    return out


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


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
    g = parser.add_argument_group("compare")
    g.add_argument("--adam", action="store_true", help="include Adam (states alive through the step) on both sides")
    g.add_argument("--max-error", type=float, metavar="FRACTION",
                   help="exit with code 1 when a peak's |error| exceeds FRACTION (e.g. 0.01)")
    g.add_argument("--json", action="store_true", help="print the rows as a JSON list instead of the table")
    g.add_argument("--out", type=Path, metavar="FILE", help="also write the rows as JSON to FILE (atomically)")
    return run_compare


def run_compare(args: argparse.Namespace) -> int:
    import torch


    if args.pp:

        return run_pipeline_compare(args)
    config = resolve_model_config(args)
    policies = resolve_cli_policies(args, config.num_layers)
    parallel = parallel_kwargs(args)
    if parallel:
        raise ValueError("compare measures one unsharded process: --tp/--sp are for predict (real tensor-parallel "
                         "ranks are measured by remat.parallel.tensor.measure_tensor_parallel)")
    if args.max_error is not None and not args.max_error >= 0:
        raise ValueError(f"--max-error {args.max_error}: must be a fraction >= 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device here; compare measures on this machine, use "
                         "--device cpu")
    device = torch.device(args.device)
    predicted = []
    for policy in policies:
        if args.adam:
            predicted.append(predict(config, policy, optimizer=adam_steady_state, device=args.device, **parallel))
        else:
            predicted.append(predict_config(config, policy, device=args.device, **parallel))
    need = max(tl.peak_bytes for tl in predicted)
    available = _available_memory() if device.type == "cpu" else torch.cuda.mem_get_info(device)[0]
    if available is not None and need > 0.8 * available:
        raise ValueError(f"measuring needs about {need / (1 << 30):,.2f} GiB (the largest predicted peak) but "
                         f"{available / (1 << 30):,.2f} GiB is available on {device}: use a smaller config "
                         "(--layers, --seq, --batch, ...), or 'remat predict' alone")
    batch = sample_batch(config, device)
    rows: list[dict[str, Any]] = []
    bar = ProgressBar("remat compare")
    try:
        for i, (policy, pred) in enumerate(zip(policies, predicted)):
            bar(i, len(policies), str(policy))
            model = build_model(config, device, seed=0)
            apply(model, policy)
            optimizer = adam_steady_state(model.parameters()) if args.adam else None
            torch.manual_seed(0)
            meas = measure(model, batch, optimizer=optimizer)
            del model, optimizer
            errors = part_errors(pred.at_peak, meas.at_peak, meas.peak_bytes)
            worst: str | None = max(errors, key=lambda k: abs(errors[k]))
            worst_error = errors[worst] if worst else 0.0
            if worst_error == 0:
                worst = None
            rows.append({
                "policy": str(policy), "predicted_bytes": pred.peak_bytes, "measured_bytes": meas.peak_bytes,
                "error": (pred.peak_bytes - meas.peak_bytes) / meas.peak_bytes if meas.peak_bytes else 0.0,
                "predicted_phase": pred.peak_phase.label, "measured_phase": meas.peak_phase.label,
                "predicted_at_peak": pred.at_peak, "measured_at_peak": meas.at_peak,
                "part_errors": errors, "worst_part": worst, "worst_part_error": worst_error,
            })
        bar(len(policies), len(policies), "")
    finally:
        bar.close()
    if args.out is not None:
        write_out(args.out, rows)
    if args.json:
        print(json_text(rows))
    else:

        unit, divisor = table_unit(max(r["measured_bytes"] for r in rows))
        size = size_cell(divisor)
        pct = lambda v: f"{100 * v:+.2f}"
        print(f"{model_summary(config)}; measured on {device}" + (", with Adam" if args.adam else "") + "\n")
        print(format_table(rows, [
            ("policy", "policy", str), ("predicted_bytes", f"predicted {unit}", size),
            ("measured_bytes", f"measured {unit}", size), ("error", "error %", pct),
            ("measured_phase", "measured peak in", str), ("worst_part", "worst part", lambda v: v or "-"),
            ("worst_part_error", "part error %", pct)]))
        worst_row = max(rows, key=lambda r: abs(r["error"]))
        print(f"\nworst peak error {100 * worst_row['error']:+.3f}% ({worst_row['policy']}); worst part error "
              f"{100 * max(abs(r['worst_part_error']) for r in rows):.3f}%. error = (predicted - measured) / "
              "measured; a part measured as 0 is taken relative to the peak.")
    if args.out is not None:
        info(f"wrote {args.out}")
    if args.max_error is not None and any(abs(r["error"]) > args.max_error for r in rows):
        info(f"remat compare: a peak error exceeds --max-error {args.max_error}")
        return 1
    return 0
