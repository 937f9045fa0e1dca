"""Whole-job prediction of Llama-3-70B at TP=8 (SP) PP=4 CP=2 DP=8 with the distributed optimizer: time (target
<= 5 s cold on 2 cores) and per-rank parts, plus Megatron's theoretical_memory_usage weight+optimizer formula (with
its 12/dp taken over the dp x cp ranks the distributed optimizer really shards over) beside remat's bytes for each
stage. Each 20-layer chunk trace is laid out from a shallow chunk's (remat.parallel.chunk_compose); ``--check``
also traces the chunks whole and checks every stage's timeline equal, event for event.

Run: ``python benchmarks/bench_job_70b.py [--check]`` (prints a table; no files written)."""

from __future__ import annotations

import argparse
import os
import time

from remat.job import Job
from remat.parallel import chunk_trace
from remat.parallel.job_predict import NOT_COUNTED, predict_job
from remat.presets import get_preset

GIB = 2 ** 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="also trace the chunks whole and compare")
    args = parser.parse_args()
    model = get_preset("llama3-70b")
    job = Job.build(model, precision="bf16", tp=8, sp=True, pp=4, cp=2, dp=8, num_microbatches=16,
                    distributed_optimizer=True)
    start = time.perf_counter()
    prediction = predict_job(job)
    cold = time.perf_counter() - start
    start = time.perf_counter()
    predict_job(job)
    warm = time.perf_counter() - start
    print(f"Llama-3-70B TP=8 SP PP=4 CP=2 DP=8 (world {job.world_size}), 16 microbatches, bf16, Adam, distributed "
          f"optimizer: {cold:.2f} s cold (target <= 5 s: {'PASS' if cold <= 5 else 'FAIL'}; load average "
          f"{os.getloadavg()[0]:.1f}), {warm:.2f} s with the chunk traces cached")
    if args.check:
        start = time.perf_counter()
        with chunk_trace.traced_whole():
            whole = {r.stage: r.timeline for r in predict_job(job).ranks}
        for r in prediction.ranks:
            same = all(getattr(whole[r.stage], f) == getattr(r.timeline, f) for f in
                       ("nbytes", "alloc_at", "free_at", "category", "module", "phase_index", "phases"))
            verdict = "the same timeline, event for event" if same else "ANOTHER TIMELINE"
            print(f"stage {r.stage}: chunks traced whole give {verdict}")
        print(f"(with the chunks traced whole: {time.perf_counter() - start:.1f} s)")
    names = ("parameters", "gradients", "master_parameters", "optimizer_state", "activations", "communication")
    print(f"{'stage':>5} {'rank':>5} {'peak GiB':>9} " + " ".join(f"{n[:14]:>14}" for n in names)
          + "   6+12/(dp*cp) B/param (B) vs remat (B)")
    for r in prediction.ranks:
        megatron = r.state.num_parameters * (6 + 12 / (job.dp * job.cp))
        print(f"{r.stage:>5} {r.rank:>5} {r.peak_bytes / GIB:>9.2f} "
              + " ".join(f"{r.parts[n] / GIB:>14.3f}" for n in names)
              + f"   {megatron:.0f} {'==' if megatron == r.state.total else '!='} {r.state.total}")
    print(NOT_COUNTED)


if __name__ == "__main__":
    main()
