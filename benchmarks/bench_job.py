#!/usr/bin/env python
"""Every rank of a real Megatron-style job (gloo on CPU, one process per rank) measured vs remat's whole-rank
prediction (:func:`remat.parallel.job_predict.predict_job`).

Seven jobs of a tiny GPT (4 layers, s=32, microbatch 2, vocab 128, bf16 mixed precision: bf16 parameters, the fp32
main-gradient buffer, fp32 master parameters and Adam moments, an optimizer step inside the measured step):

* (a) TP=2 x PP=2 (4 processes), h=64, 4 microbatches, Megatron's 1F1B;
* (b) DP=2 with the distributed optimizer (2 processes), h=48 (so Megatron's 64-element parameter padding
  shows), 2 microbatches: reduce-scatter of the gradient buffer, the sharded Adam step and the parameter
  all-gather inside the measured step;
* (c) EP=2 (2 processes, dp=2) of an MoE GPT (4 experts of ffn 32, top-2, layers 1..3 MoE, 2 local experts per
  rank), distributed optimizer, 2 microbatches, balanced routing forced in run and prediction: Megatron's
  all-to-all dispatcher (counts exchanged, tokens and probabilities all-to-all, chunks sorted by local expert)
  and the separate expert gradient buffer sharded over the expert data-parallel ranks;
* (d) the same EP=2 job with real routing (grouped experts, 1 microbatch), predicted from the token counts the
  run reported: the two ranks' experts receive different counts, each priced from its own trace.
* (e) TP=2 with sequence parallelism (2 processes) of a DeepSeek-style GPT (MLA with q/kv down-projections and
  norms, layers 1..3 MoE with a shared expert, grouped experts split over etp = tp), selective
  moe_act+mla_up_proj recompute, balanced routing: the experts' tokens all-gathered over tp and their partial
  outputs reduce-scattered (remat.models.tp_moe), MLA's heads split over tp (remat.models.tp_mla);
* (f) the same model at TP=2 (SP) x EP=2 (dp=2, 4 processes), distributed optimizer: all-to-all over ep, then
  the gather over etp, counts exchanged over the tp x ep group.
* (g) the same model at TP=2 (SP) x EP=2 with expert tensor parallelism etp=1 (2 processes, dp=1, Megatron's
  ``--expert-tensor-parallel-size 1``): the expert ranks cut across the tensor-parallel pair (expert-parallel
  rank = tp rank), each rank's two experts whole, tokens all-to-all over ep, no gather over etp.

Per rank: stage, tensor-parallel and data-parallel position, predicted and measured peak bytes, error =
(predicted - measured) / measured, the parts alive at the measured peak, and where they differ from the
predicted parts. Target: predicted == measured to the byte on every rank.

Usage::

    python benchmarks/bench_job.py [--json out.json] [--timeout 300] [--only '(e)']
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from remat.config import ModelConfig
from remat.files import write_atomic
from remat.job import Job
from remat.parallel.job_measure import format_rows, measure_job, rank_rows, routing_counts
from remat.policy import Policy

MODEL = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=128, seq_length=32,
                    micro_batch_size=2, attention="sdpa")
MOE = MODEL.replace(num_moe_experts=4, moe_ffn_hidden_size=32, moe_layer_freq=(0, 1, 1, 1))
DEEPSEEK = MOE.replace(moe_grouped_gemm=True, moe_shared_expert_intermediate_size=32, multi_latent_attention=True,
                       q_lora_rank=32, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16,
                       position="rope", activation="swiglu", normalization="rmsnorm", add_bias_linear=False,
                       moe_routing_assumption="balanced")


def given_counts(job: Job, measured: list) -> Job:
    """``job`` predicted with the token counts per expert its real run reported (one list per MoE layer; every
    rank routes the same tokens alike, so rank 0's counts are every rank's)."""
    return job.replace(model=job.model.replace(moe_routing_assumption=routing_counts(measured[0].meta["moe_routing"])))
JOBS = {
    "(a) tp=2 x pp=2, 1f1b, 4 microbatches": Job.build(MODEL, precision="bf16", tp=2, pp=2, num_microbatches=4),
    "(b) dp=2, distributed optimizer, 2 microbatches": Job.build(MODEL.replace(hidden_size=48), precision="bf16",
                                                                 dp=2, distributed_optimizer=True,
                                                                 num_microbatches=2),
    "(c) ep=2 (dp=2) MoE, balanced routing, distributed optimizer": Job.build(
        MOE.replace(moe_routing_assumption="balanced"), precision="bf16", ep=2, dp=2, distributed_optimizer=True,
        num_microbatches=2),
    "(d) ep=2 (dp=2) MoE, real routing, predicted from its counts": Job.build(
        MOE.replace(moe_grouped_gemm=True), precision="bf16", ep=2, dp=2),
    "(e) tp=2 sp MoE + MLA, moe_act+mla_up_proj, balanced routing": Job.build(
        DEEPSEEK, precision="bf16", tp=2, sp=True, num_microbatches=2,
        policy=Policy.parse("selective/moe_act+mla_up_proj")),
    "(f) tp=2 sp x ep=2 (dp=2) MoE + MLA, distributed optimizer": Job.build(
        DEEPSEEK, precision="bf16", tp=2, sp=True, ep=2, dp=2, distributed_optimizer=True,
        policy=Policy.parse("selective/moe_act+mla_up_proj")),
    "(g) tp=2 sp x ep=2, etp=1 MoE + MLA, moe_act+mla_up_proj": Job.build(
        DEEPSEEK, precision="bf16", tp=2, sp=True, ep=2, etp=1, num_microbatches=2,
        policy=Policy.parse("selective/moe_act+mla_up_proj")),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per real run (default 300)")
    parser.add_argument("--only", default="", help="run only the jobs whose name contains this, e.g. '(e)'")
    args = parser.parse_args(argv)
    out = {}
    worst = 0.0
    for name, job in JOBS.items():
        if args.only not in name:
            continue
        start = time.perf_counter()
        measured = measure_job(job, timeout=args.timeout)
        real_routing = job.model.is_moe and job.model.moe_routing_assumption is None
        rows = rank_rows(given_counts(job, measured) if real_routing else job, measured)
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
