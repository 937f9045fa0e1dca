"""Megatron's deferred output-layer weight gradients (--defer-embedding-wgrad-compute, --wgrad-deferral-limit): the
last stage keeps each deferred microbatch's output-layer input and logits gradient until the drain (NOTE [deferred
embedding wgrad] in remat.parallel.deferred_wgrad)."""

from __future__ import annotations

import pytest

from remat.config import ModelConfig
from remat.job import Job, JobError
from remat.memory.workspaces import MODULE_ALLGATHER
from remat.parallel.deferred_wgrad import PHASE_REGION, deferred_microbatches
from remat.parallel.job_predict import predict_stage
from remat.timeline import Timeline

MODEL = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=512, seq_length=32,
                    micro_batch_size=2, attention="sdpa")
FLAGS = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
         "--vocab-size 512 --bf16 --world-size 4 --pipeline-model-parallel-size 2 --tensor-model-parallel-size 2 "
         "--global-batch-size 8")


def test_flags_read_as_megatron_reads_them():
    job = Job.from_megatron_args(FLAGS + " --defer-embedding-wgrad-compute --wgrad-deferral-limit 2")
    assert job.embedding_wgrad_deferral == 2 and Job.from_megatron_args(job.to_megatron_args()) == job
    # model_parallel_config.py:415: the limit defaults to 0 (every microbatch); alone, the limit does nothing
    assert Job.from_megatron_args(FLAGS + " --defer-embedding-wgrad-compute").embedding_wgrad_deferral == 0
    assert Job.from_megatron_args(FLAGS + " --wgrad-deferral-limit 2").embedding_wgrad_deferral is None
    # model_parallel_config.py:545-557: pipeline parallelism and the fusion are required, the limit >= 0
    with pytest.raises(JobError, match="pipeline parallelism"):
        Job.from_megatron_args(FLAGS.replace("--pipeline-model-parallel-size 2", "--pipeline-model-parallel-size 1")
                               + " --defer-embedding-wgrad-compute")
    with pytest.raises(JobError, match="gradient-accumulation fusion"):
        Job.from_megatron_args(FLAGS + " --defer-embedding-wgrad-compute --no-gradient-accumulation-fusion")
    with pytest.raises(JobError, match="--wgrad-deferral-limit"):
        Job.from_megatron_args(FLAGS + " --defer-embedding-wgrad-compute --wgrad-deferral-limit -1")


def _kept(tl: Timeline) -> list[int]:
    """Bytes of the rows the drain frees, in order."""
    drain = next(p.start for p in tl.phases if p.region == PHASE_REGION)
    return [n for n, f in sorted(zip(tl.nbytes, tl.free_at), key=lambda r: r[1]) if f >= drain]


@pytest.mark.parametrize(("limit", "sp"), [(2, False), (0, False), (3, True)])
def test_last_stage_keeps_input_and_logits_gradient_per_deferred_microbatch(limit, sp):
    job = Job.build(MODEL, precision="bf16", tp=2, sp=sp, pp=2, num_microbatches=4, dp=1)
    deferred = job.replace(embedding_wgrad_deferral=limit)
    kept = deferred_microbatches(limit, 4)
    assert kept == list(range(limit or 4))
    b, s, h, v = 2, 32, 64, 512
    act = b * s * h * 2 // (2 if sp else 1)  # input_parallel: the final norm's output (s/tp tokens under SP)
    logits = b * s * (v // 2) * 2  # grad_output: [s, b, vocab/tp] bf16
    a, d = predict_stage(job, 1, kernels="te"), predict_stage(deferred, 1, kernels="te")
    assert _kept(d.timeline) == [act, logits] * len(kept)  # popped pairwise by drain_embedding_wgrad_compute
    assert d.peak_bytes > a.peak_bytes
    # under SP the drain gathers each input into the global buffer's mpu_0 / mpu_1, [s, b, h] each, kept
    gathered = [sum(n for n, m in zip(r.timeline.nbytes, r.timeline.module) if m == MODULE_ALLGATHER) for r in (a, d)]
    assert gathered[1] - gathered[0] == (2 * b * s * h * 2 if sp else 0)
    # the first stage has no output layer: unchanged
    assert predict_stage(deferred, 0, kernels="te").peak_bytes == predict_stage(job, 0, kernels="te").peak_bytes
    # held more at the last backward's start: the deferred pairs of the microbatches whose backward ran (the last
    # one's input is saved for its backward anyway)
    tl_a, tl_d = a.timeline, d.timeline

    def start(tl: Timeline) -> int:
        return next(p.start for p in tl.phases if p.kind == "backward" and "microbatch 3" in p.detail)

    held = len([mb for mb in kept if mb < 3])
    assert tl_d.live_bytes()[start(tl_d)] - tl_a.live_bytes()[start(tl_a)] == held * (act + logits) + \
        gathered[1] - gathered[0]


def test_fused_trace_keeps_the_linears_inputs():
    # TE saves each linear's input for its wgrad GEMM fused or not (linear.py:300): the fusion removes the weight
    # gradients only, so the last forward's saved activations are the same bytes
    job = Job.build(MODEL, precision="bf16", tp=2, pp=2, num_microbatches=4)
    fused, plain = (predict_stage(j, 1, kernels="te").timeline
                    for j in (job, job.replace(gradient_accumulation_fusion=False)))

    def saved(tl: Timeline) -> int:
        end = max(p.start for p in tl.phases if p.kind == "forward" and p.region == "head")
        return sum(tl.nbytes[r] for r in tl.alive_at(end) if tl.category[r] == "saved_activations")

    assert saved(fused) == saved(plain) > 0
