"""Whole-job prediction of Llama-3-70B at TP=8 (SP) PP=4 CP=2 DP=8 with the distributed optimizer: time and per-rank
parts, plus Megatron's theoretical_memory_usage weight+optimizer formula (with its 12/dp taken over the dp x cp
ranks the distributed optimizer really shards over) beside remat's bytes for each stage.

Run: ``python benchmarks/bench_job_70b.py`` (prints a table; no files written)."""

from __future__ import annotations

import time

from remat.job import Job
from remat.parallel.job_predict import NOT_COUNTED, predict_job
from remat.presets import get_preset

GIB = 2 ** 30


def main() -> None:
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
          f"optimizer: {cold:.2f} s cold, {warm:.2f} s with the chunk traces cached")
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
