"""`remat predict`: predict a config's memory timeline without running it."""

from __future__ import annotations

import argparse
import textwrap
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
    info,
    json_text,
    model_summary,
    parallel_kwargs,
    resolve_cli_policies,
    resolve_model_config,
    write_out,
)
from remat.cli.pipeline import run_pipeline_predict
from remat.memory.optimizer import adam_steady_state
from remat.memory.predict import predict, predict_config
from remat.policy import ENGINES


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
    g = parser.add_argument_group("predict")
    g.add_argument("--engine", choices=ENGINES,
                   help="checkpoint implementation for policies without '@engine' (default reentrant, Megatron's)")
    g.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: exact storage bytes; cuda: each storage rounded up to the CUDA caching allocator's "
                        "512-byte blocks (the kernels traced are still the CPU ones) (default cpu)")
    g.add_argument("--adam", action="store_true",
                   help="include Adam: its two moments per parameter exist through the step, and optimizer.step() "
                        "is traced (a full trace per policy: slower for deep models)")
    g.add_argument("--json", action="store_true", help="print the JSON report instead of the table")
    g.add_argument("--out", type=Path, metavar="FILE", help="also write the JSON report to FILE (atomically)")
    return run_predict


def run_predict(args: argparse.Namespace) -> int:
    import time


    if args.pp:

        return run_pipeline_predict(args)
    config = resolve_model_config(args)
    policies = resolve_cli_policies(args, config.num_layers)
    parallel = parallel_kwargs(args)
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    plain_cpu = None  # a no-recompute trace on CPU without optimizer: what the formulas are compared with
    bar = ProgressBar("remat predict")
    try:
        for i, policy in enumerate(policies):
            if len(policies) > 1:
                bar(i, len(policies), str(policy))
            t0 = time.perf_counter()
            if args.adam:  # a full trace: composition does not cover optimizer.step() (nor, yet, tp/sp here)
                timeline = predict(config, policy, optimizer=adam_steady_state, device=args.device, **parallel)
            else:
                timeline = predict_config(config, policy, device=args.device, **parallel)
                if policy.is_none and args.device == "cpu":
                    plain_cpu = timeline
            rows.append(prediction_row(policy, timeline, time.perf_counter() - t0))
        if len(policies) > 1:
            bar(len(policies), len(policies), "")
    finally:
        bar.close()
    if plain_cpu is None:
        plain_cpu = predict_config(config, "none", device="cpu", **parallel)
    formulas = formula_report(config, plain_cpu, **parallel)
    report = {
        "format": "remat.predict", "version": 1, "config": config.to_dict(), "device": args.device,
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
        if args.device == "cuda":
            notes += (" --device cuda rounds storages to 512-byte blocks but traces CPU kernels: float dropout "
                      "noise instead of 1-byte masks, LayerNorm statistics in the activation dtype, CPU attention "
                      "kernels.")
        print(f"{model_summary(config)}; predicted on {args.device}"
              + (", with Adam" if args.adam else "") + "\n")
        print(format_prediction_table(rows))
        print("\n" + textwrap.fill(notes, width=110) + "\n")
        print(format_formula_report(formulas, config))
    if args.out is not None:
        info(f"wrote {args.out}")
    return 0
