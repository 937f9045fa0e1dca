#!/usr/bin/env python
"""Every rank of a real Megatron-style job (gloo on CPU, one process per rank) measured vs remat's whole-rank
prediction (:func:`remat.parallel.job_predict.predict_job`).

Two jobs of a tiny GPT (4 layers, s=32, microbatch 2, vocab 128, bf16 mixed precision: bf16 parameters, the fp32
main-gradient buffer, fp32 master parameters and Adam moments, an optimizer step inside the measured step):

* (a) TP=2 x PP=2 (4 processes), h=64, 4 microbatches, Megatron's 1F1B;
* (b) DP=2 with the distributed optimizer (2 processes), h=48 (so Megatron's 64-element parameter padding
  shows), 2 microbatches: reduce-scatter of the gradient buffer, the sharded Adam step and the parameter
  all-gather inside the measured step.

Per rank: stage, tensor-parallel and data-parallel position, predicted and measured peak bytes, error =
(predicted - measured) / measured, the parts alive at the measured peak, and where they differ from the
predicted parts. Target: predicted == measured to the byte on every rank.

Usage::

    python benchmarks/bench_job.py [--json out.json] [--timeout 300]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from remat.config import ModelConfig
from remat.job import Job
from remat.parallel.job_measure import format_rows, measure_job, rank_rows
from remat.timeline import write_atomic

MODEL = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=128, seq_length=32,
                    micro_batch_size=2, attention="sdpa")
JOBS = {
    "(a) tp=2 x pp=2, 1f1b, 4 microbatches": Job.build(MODEL, precision="bf16", tp=2, pp=2, num_microbatches=4),
    "(b) dp=2, distributed optimizer, 2 microbatches": Job.build(MODEL.replace(hidden_size=48), precision="bf16",
                                                                 dp=2, distributed_optimizer=True,
                                                                 num_microbatches=2),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per real run (default 300)")
    args = parser.parse_args(argv)
    out = {}
    worst = 0.0
    for name, job in JOBS.items():
        start = time.perf_counter()
        measured = measure_job(job, timeout=args.timeout)
        rows = rank_rows(job, measured)
        print(f"{name}: {job.world_size} ranks, {time.perf_counter() - start:.1f} s")
        print(format_rows(rows))
        print()
        worst = max([worst] + [abs(r["error"]) for r in rows])
        out[name] = rows
    print(f"largest |error|: {worst * 100:.3f}%")
    if args.json:
        write_atomic(args.json, json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
