#!/usr/bin/env python
"""Per-stage peak memory of pipeline-parallel training: measured in real multi-process runs vs predicted.

For P = 2 and P = 4 pipeline stages (CPU, gloo, one process per stage, ``torch.distributed.pipelining``), the
reference GPT (small by default: 8 layers, h=128, s=64, microbatch 2, vocab 256, fp32) runs one training step
of M = 2P microbatches under each schedule asked for (1F1B by default) and each policy: ``none``,
``full/uniform/1`` and ``full/uniform/<layers per stage>`` (one group per stage). Every stage's step is
recorded (exact storage bytes) and compared with :func:`remat.parallel.pipeline_predict.predict_pipeline` (fake traces
of one
microbatch per chunk, composed for the schedule; nothing allocated).

Columns: measured and predicted peak (MiB), error = (predicted - measured) / measured, the microbatches in flight
at the peak (measured) and the most the stage ever holds, whether the whole allocation table (every storage's
bytes, allocation and free event, category) is the same, and where the peak is. The last line gives the largest
error. Target: within 2% per stage.

Usage::

    python benchmarks/bench_pipeline.py                      # P=2 and P=4, 1F1B, three policies
    python benchmarks/bench_pipeline.py --schedules 1f1b,gpipe,interleaved --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from remat.config import ModelConfig
from remat.parallel.pipeline_measure import measure_pipeline_many
from remat.parallel.pipeline_predict import predict_pipeline
from remat.parallel.pipeline_report import peak_error, same_step
from remat.units import MIB


def run(config: ModelConfig, pp: int, schedule: str, timeout: float) -> list[dict]:
    vpp = 2 if schedule == "interleaved" else 1
    m = 2 * pp
    per_stage = config.num_layers // (pp * vpp)
    policies = ["none", "full/uniform/1"] + ([f"full/uniform/{per_stage}"] if per_stage > 1 else [])
    start = time.perf_counter()
    measured = measure_pipeline_many(config, policies, pp, m, schedule, vpp, timeout=timeout)
    seconds = time.perf_counter() - start
    rows = []
    for policy, stages in zip(policies, measured):
        predicted = predict_pipeline(config, policy, pp, m, schedule, vpp)
        for real, guess in zip(stages, predicted):
            info = real.meta["pipeline"]
            rows.append({
                "pp": pp, "microbatches": m, "schedule": schedule, "vpp": vpp, "stage": info["stage"],
                "policy": policy, "measured_bytes": real.peak_bytes, "predicted_bytes": guess.peak_bytes,
                "error": peak_error(real.peak_bytes, guess.peak_bytes), "in_flight_at_peak": info["peak"]["in_flight"],
                "max_in_flight": info["max_in_flight"], "same_table": same_step(real, guess) is None,
                "order_as_predicted": info["order"] == info["expected_order"], "peak_phase": real.peak_phase.label,
                "launch_seconds": seconds})
    return rows


def table(rows: list[dict]) -> str:
    head = (f"{'P':>2} {'schedule':<11} {'stage':>5}  {'policy':<15} {'measured MiB':>12} {'predicted MiB':>13} "
            f"{'error %':>8} {'in flight':>9} {'max':>3}  {'same table':<10}  peak in (measured)")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['pp']:>2} {r['schedule']:<11} {r['stage']:>5}  {r['policy']:<15} "
                     f"{r['measured_bytes'] / MIB:>12.3f} {r['predicted_bytes'] / MIB:>13.3f} "
                     f"{100 * r['error']:>+8.3f} {r['in_flight_at_peak']:>9} {r['max_in_flight']:>3}  "
                     f"{'yes' if r['same_table'] else 'no':<10}  {r['peak_phase']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", default="2,4", help="pipeline sizes, comma-separated (default 2,4)")
    parser.add_argument("--schedules", default="1f1b", help="comma-separated: 1f1b, gpipe, interleaved")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2, help="microbatch size")
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per launch")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    config = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=4,
                         seq_length=args.seq, micro_batch_size=args.batch, vocab_size=args.vocab)
    print(f"model: {config.num_layers} layers, h={config.hidden_size}, s={config.seq_length}, "
          f"microbatch {config.micro_batch_size}, vocab {config.vocab_size}, {config.dtype}; CPU, gloo; M = 2P")
    rows: list[dict] = []
    for schedule in [s.strip() for s in args.schedules.split(",") if s.strip()]:
        for pp in [int(p) for p in args.pp.split(",")]:
            got = run(config, pp, schedule, args.timeout)
            rows += got
            print(f"\n{schedule}, P={pp}: one launch of {pp} processes, {got[0]['launch_seconds']:.1f} s")
            print(table(got))
    worst = max(rows, key=lambda r: abs(r["error"]))
    print(f"\nlargest error: {100 * worst['error']:+.4f}% (P={worst['pp']}, {worst['schedule']}, stage "
          f"{worst['stage']}, {worst['policy']}); allocation tables identical in {sum(r['same_table'] for r in rows)}"
          f"/{len(rows)} stage runs; target |error| <= 2%: {'PASS' if abs(worst['error']) <= 0.02 else 'FAIL'}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=2)
    return 0 if abs(worst["error"]) <= 0.02 else 1


if __name__ == "__main__":
    sys.exit(main())
