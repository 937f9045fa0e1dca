"""Megatron's combined 1F1B schedule (--overlap-moe-expert-parallel-comm; NOTE [the combined 1F1B schedule] in
remat.parallel.composer): one more warm-up forward, and each forward followed by a backward laid out with it layer by
layer, as model_chunk_schedule_plan.py runs them."""

from __future__ import annotations

import pytest

from remat.config import ModelConfig
from remat.job import Job, JobError, parse_megatron_args
from remat.parallel.job_predict import predict_stage
from remat.parallel.schedule import PipelineError, schedule_actions, warmup_forwards

MOE = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=128, seq_length=32,
                  micro_batch_size=2, num_moe_experts=4, moe_router_topk=2, moe_grouped_gemm=True,
                  activation="swiglu", normalization="rmsnorm", position="rope", add_bias_linear=False,
                  hidden_dropout=0.0, attention_dropout=0.0, moe_routing_assumption="balanced")


def test_one_more_warm_up_forward():
    # schedules.py:966-970: the interleaved warm-up plus one; pp = 1 runs the first forward alone
    assert warmup_forwards("interleaved", 2, 4, 2, 1, "megatron", combined=True) == \
        warmup_forwards("interleaved", 2, 4, 2, 1, "megatron") + 1
    assert warmup_forwards("1f1b", 1, 4, 1, 0, "megatron", combined=True) == 1
    actions = schedule_actions("1f1b", 1, 3, runtime="megatron", combined=True)
    assert [a.kind + str(a.microbatch) for a in actions] == ["F0", "F1", "B0", "F2", "B1", "B2"]
    with pytest.raises(PipelineError, match="interleaved"):
        warmup_forwards("1f1b", 2, 4, 1, 0, "megatron", combined=True)


def _job(**fields) -> Job:
    return Job.build(MOE, precision="bf16", dp=2, ep=2, **{"num_microbatches": 3, **fields})


def test_the_forward_of_one_microbatch_runs_layer_by_layer_with_the_backward_of_another():
    combined = predict_stage(_job(overlap_moe_expert_parallel_comm=True), 0, kernels="cpu").timeline
    plain = predict_stage(_job(), 0, kernels="cpu").timeline
    step = [p.label.split(" [")[0] for p in combined.phases if "layer" in p.region and (
        p.kind == "forward" and "microbatch 1," in p.label or p.kind == "backward" and "microbatch 0," in p.label)]
    # forward 1 beside backward 0: forward layer i, then backward layer 3 - i (model_chunk_schedule_plan.py)
    assert [label for k, label in enumerate(step) if k == 0 or label != step[k - 1]] == [
        "forward layer 0", "backward layer 3", "forward layer 1", "backward layer 2",
        "forward layer 2", "backward layer 1", "forward layer 3", "backward layer 0"]
    assert sorted(plain.nbytes) == sorted(combined.nbytes)  # the same tensors, laid out in another order
    # a forward's layers pile up beside the backward's: above the plain schedule's peak, below two microbatches'
    one = max(combined.live_bytes()) - plain.live_bytes()[0]
    assert plain.peak_bytes < combined.peak_bytes < plain.peak_bytes + one


def test_one_microbatch_runs_its_forward_then_its_backward_alone():
    # combined_1f1b.py:77-135: pp = 1 runs the first forward alone and the last backward alone; with one microbatch
    # they are the same microbatch's, never one combined step
    combined = predict_stage(_job(overlap_moe_expert_parallel_comm=True, num_microbatches=1), 0, kernels="cpu")
    plain = predict_stage(_job(num_microbatches=1), 0, kernels="cpu")
    kinds = [p.kind for p in combined.timeline.phases if "layer" in p.region]
    assert kinds == sorted(kinds, reverse=True) and kinds.count("backward") == 4  # every forward, then backward
    assert combined.peak_bytes == plain.peak_bytes


def test_megatrons_rules_for_the_flag():
    base = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
            "--padded-vocab-size 128 --num-experts 4 --moe-grouped-gemm --swiglu --disable-bias-linear --bf16 "
            "--moe-token-dispatcher-type alltoall --overlap-moe-expert-parallel-comm ")
    job, _ = parse_megatron_args(base + "--expert-model-parallel-size 2 --world-size 2")
    assert job.overlap_moe_expert_parallel_comm and "--overlap-moe-expert-parallel-comm" in job.to_megatron_args()
    assert Job.from_megatron_args(job.to_megatron_args()) == job
    for extra, fragment in (("--world-size 2", "expert parallelism"),
                            ("--expert-model-parallel-size 2 --pipeline-model-parallel-size 2 --world-size 4",
                             "interleaved schedule"),
                            ("--expert-model-parallel-size 2 --world-size 2 --recompute-granularity full "
                             "--recompute-method uniform --recompute-num-layers 1", "full recompute"),
                            ("--expert-model-parallel-size 2 --world-size 2 --recompute-granularity selective "
                             "--recompute-modules moe", "'moe'")):
        with pytest.raises(JobError, match=fragment):
            parse_megatron_args(base + extra)
