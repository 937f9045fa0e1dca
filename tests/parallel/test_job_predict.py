"""remat.parallel.job_predict: every distinct rank of a Megatron job, with its model state."""

from __future__ import annotations

import pytest

from remat.config import ModelConfig
from remat.job import Job, JobError
from remat.memory.rank_state import rank_parameters, rank_state
from remat.parallel.job_predict import NOT_COUNTED, PARTS, predict_job, ring_exchange_bytes
from remat.parallel.pipeline_predict import predict_pipeline

MODEL = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=128,
                    seq_length=32, micro_batch_size=2, attention="sdpa", position="rope", normalization="rmsnorm",
                    activation="swiglu", hidden_dropout=0.0, attention_dropout=0.0)


def test_tp_and_pp_together_shard_each_stage():
    job = Job.build(MODEL, precision="bf16", tp=2, sp=True, pp=2, num_microbatches=4, dp=2,
                    distributed_optimizer=True)
    prediction = predict_job(job)
    assert [r.peak_bytes for r in prediction.ranks] == sorted((r.peak_bytes for r in prediction.ranks), reverse=True)
    for r in prediction.ranks:
        assert sum(r.parts.values()) == r.peak_bytes and set(r.parts) == set(PARTS)
        params = rank_parameters(MODEL, first=r.stage == 0, last=r.stage == 1, num_layers=2, tp=2, sp=True,
                                 pipelined=True)
        state = rank_state(job, [params], pipeline_rank=r.stage)
        assert r.state == state
        # the model state is alive at the peak whole; the TP shard is half the unsharded stage's weights
        for part in ("parameters", "master_parameters", "optimizer_state"):
            assert r.parts[part] == state.parts()[part]
        assert r.parts["gradients"] >= state.gradients
        unsharded = rank_parameters(MODEL, first=r.stage == 0, last=r.stage == 1, num_layers=2, pipelined=True)
        assert state.num_parameters < sum(p.numel for p in unsharded)
        assert r.timeline.meta["not_counted"] == NOT_COUNTED
    assert {row["stage"] for row in prediction.rows()} == {0, 1} and prediction.rows()[0]["rank"] in (0, 4)


def test_activations_equal_the_pipeline_prediction_without_state():
    # tp=1: the job's activation timeline is Megatron's pipeline composition; only model state is added, and the
    # traced .grad tensors become transients (the DDP hook moves them into the main-gradient buffer)
    job = Job.build(MODEL, precision="fp32", pp=2, num_microbatches=3, optimizer="none")
    stages = predict_pipeline(MODEL, "none", 2, 3, runtime="megatron")
    for r in predict_job(job).ranks:
        plain = stages[r.stage]
        grads = sum(n for n, c in zip(plain.nbytes, plain.category) if c == "gradients")
        assert grads == r.state.gradients  # fp32 .grad tensors == the unpadded fp32 buffer
        at = plain.forward_end
        assert r.timeline.live_bytes()[at] == plain.live_bytes()[at] + r.state.gradients


def test_context_parallel_holds_s_over_cp_and_the_ring_buffers():
    one = predict_job(Job.build(MODEL, precision="bf16", num_microbatches=1))
    two = predict_job(Job.build(MODEL, precision="bf16", cp=2, num_microbatches=1))
    assert ring_exchange_bytes(two.job) == 4 * 2 * 2 * 16 * 2 * 16 * 2  # 4 x (K+V) of b x s/cp x groups x d, bf16
    assert two.worst.parts["communication"] == ring_exchange_bytes(two.job)
    assert two.worst.parts["activations"] < one.worst.parts["activations"]
    with pytest.raises(JobError, match="--attention-backend"):
        predict_job(Job.build(MODEL.replace(attention="math"), precision="bf16", cp=2))
