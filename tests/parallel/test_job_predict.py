"""remat.parallel.job_predict: every distinct rank of a Megatron job, with its model state."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from remat.config import ModelConfig
from remat.job import Job, JobError
from remat.memory.cuda_sdpa import select_backend
from remat.memory.kernels import use_kernels
from remat.memory.rank_state import rank_parameters, rank_state
from remat.parallel.job_predict import (
    LIBRARY_BUFFERS,
    NOT_COUNTED,
    PARTS,
    RESIDENT_PARTS,
    parts_at,
    predict_job,
    predict_stage,
    ring_exchange_bytes,
)
from remat.parallel.pipeline_predict import predict_pipeline
from remat.timeline import Timeline

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
    # the CPU kernels, and the job's model: Megatron's cross-entropy (remat.job_loss)
    stages = predict_pipeline(job.model, "none", 2, 3, runtime="megatron")
    for r in predict_job(job, kernels="cpu").ranks:
        plain = stages[r.stage]
        grads = sum(n for n, c in zip(plain.nbytes, plain.category) if c == "gradients")
        assert grads == r.state.gradients  # fp32 .grad tensors == the unpadded fp32 buffer
        at = plain.forward_end
        assert _without_batch(r.timeline)[at] == plain.live_bytes()[at] + r.state.gradients


def _without_batch(timeline: Timeline) -> np.ndarray:
    """The live curve of ``timeline`` without what Megatron's get_batch adds (NOTE [Megatron's batch on the device]),
    its events dropped too, so that the pipeline composition's events line up."""
    batch = [row for row, module in enumerate(timeline.module) if module.startswith("batch.")]
    assert batch  # the job's first stage holds position ids and the mask, its last the mask and the loss mask
    dropped = sorted({timeline.alloc_at[row] for row in batch} | {timeline.free_at[row] for row in batch} - {-1})
    kept = [row for row in range(len(timeline)) if row not in set(batch)]
    shift = np.searchsorted(np.asarray(dropped), np.arange(timeline.num_events))
    curve = np.zeros(timeline.num_events - len(dropped) + 1, dtype=np.int64)
    for row in kept:
        curve[timeline.alloc_at[row] - shift[timeline.alloc_at[row]]] += timeline.nbytes[row]
        if timeline.free_at[row] >= 0:
            curve[timeline.free_at[row] - shift[timeline.free_at[row]]] -= timeline.nbytes[row]
    return np.cumsum(curve[:-1])


def test_context_parallel_holds_s_over_cp_and_the_ring_buffers():
    one = predict_job(Job.build(MODEL, precision="bf16", num_microbatches=1))
    two = predict_job(Job.build(MODEL, precision="bf16", cp=2, num_microbatches=1))
    assert ring_exchange_bytes(two.job) == 4 * 2 * 2 * 16 * 2 * 16 * 2  # 4 x (K+V) of b x s/cp x groups x d, bf16
    assert two.worst.parts["communication"] == ring_exchange_bytes(two.job)
    assert two.worst.parts["activations"] < one.worst.parts["activations"]
    with pytest.raises(JobError, match="--attention-backend"):
        predict_job(Job.build(MODEL.replace(attention="math"), precision="bf16", cp=2))


# MLA as DeepSeek-V3 has it, small: query/key heads of 16 + 8 (rotary) dims, value heads of 16
MLA = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=2, vocab_size=128, seq_length=64,
                  micro_batch_size=1, attention="sdpa", position="rope", normalization="rmsnorm", activation="swiglu",
                  hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False, multi_latent_attention=True,
                  q_lora_rank=32, kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16)


def test_a_gpu_job_keeps_what_cuda_attention_keeps():
    # a job runs on GPUs: by default its ranks keep what the CUDA kernels keep. With q/k heads of 24 and v heads of
    # 16 flash refuses (one head dim) and memory-efficient attention runs (sdp_utils.cpp: q == k dims, 8-aligned),
    # keeping the output and an fp32 logsumexp; CPU's math attention keeps the [b, heads, s, s] scores.
    q, v = torch.empty(1, 2, 64, 24, dtype=torch.bfloat16), torch.empty(1, 2, 64, 16, dtype=torch.bfloat16)
    assert select_backend(q, q, v, is_causal=True) == "efficient"
    assert select_backend(q, q, q, is_causal=True) == "flash"
    job = Job.build(MLA, precision="bf16", pp=2, num_microbatches=2)
    scores = 1 * 2 * 64 * 64 * 2  # one bf16 [b, heads, s, s] tensor

    def attention_rows(timeline):
        return [n for n, m in zip(timeline.nbytes, timeline.module) if m.endswith("core_attention")]

    gpu, cpu = predict_stage(job, 0), predict_stage(job, 0, kernels="cpu")
    assert gpu.timeline.meta["kernels"] == "cuda" and cpu.timeline.meta["kernels"] == "cpu"
    assert attention_rows(gpu.timeline) and max(attention_rows(gpu.timeline)) < scores
    assert max(attention_rows(cpu.timeline)) >= scores
    assert gpu.parts["activations"] < cpu.parts["activations"] and gpu.state == cpu.state


def test_the_kernel_profile_follows_remat_kernels():
    job = Job.build(MODEL, precision="bf16", pp=2, num_microbatches=2)
    with use_kernels("cpu"):  # remat --kernels cpu
        chosen = predict_job(job)
    assert {r.timeline.meta["kernels"] for r in chosen.ranks} == {"cpu"}
    assert chosen.rows() == predict_job(job, kernels="cpu").rows()
    assert predict_job(job).worst.timeline.meta["kernels"] == "cuda"


def test_the_first_step_peaks_before_adams_moments_exist():
    # FusedAdam creates exp_avg/exp_avg_sq in the first optimizer step: the first step's forward/backward runs
    # without them, and the step ends holding them (Megatron's H100 tests: iteration 1's peak is below iteration 2's
    # by the moments' bytes)
    rank = predict_job(Job.build(MODEL, precision="bf16", pp=2, num_microbatches=2)).worst
    moments = rank.parts["optimizer_state"]
    resident = sum(rank.parts[p] for p in ("parameters", "gradients", "master_parameters", "optimizer_state",
                                            "workspaces"))
    assert moments > 0 and rank.first_step_peak_bytes == max(rank.peak_bytes - moments, resident)
    assert rank.first_step_peak_bytes < rank.peak_bytes
    plain = predict_job(Job.build(MODEL, precision="bf16", pp=2, num_microbatches=2, optimizer="none")).worst
    assert plain.first_step_peak_bytes == plain.peak_bytes


def test_gradient_accumulation_fusion_makes_no_weight_gradient_and_keeps_te_dummies():
    # NOTE [gradient-accumulation fusion]: TE's linears add weight gradients into main_grad (none is made) and return
    # a cached dummy per distinct weight shape; the output layer, embeddings, norms and biases are unchanged
    from remat.memory.wgrad_fusion import MODULE as DUMMY
    from remat.memory.wgrad_fusion import dummy_wgrads, fused_weights
    from remat.parallel.job_predict import stage_parameters

    model = MODEL.replace(num_query_groups=None, activation="gelu", ffn_hidden_size=None)  # h=64, 4 heads, ffn 256
    fused = Job.build(model, precision="bf16", pp=2, num_microbatches=3)
    plain = fused.replace(gradient_accumulation_fusion=False)
    params = [p for chunk in stage_parameters(fused, 1) for p in chunk]
    weights = fused_weights(params)
    assert {p.name.split(".", 2)[2] for p in weights} == {"self_attention.linear_qkv.weight",
                                                           "self_attention.linear_proj.weight",
                                                           "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"}
    # qkv [192, 64], proj [64, 64], fc1 [256, 64], fc2 [64, 256]: four shapes for the stage's two layers, bf16
    assert dummy_wgrads(params, 2) == [((192, 64), 192 * 64 * 2), ((64, 64), 64 * 64 * 2), ((256, 64), 256 * 64 * 2),
                                       ((64, 256), 64 * 256 * 2)]
    a, b = predict_stage(fused, 1, kernels="te"), predict_stage(plain, 1, kernels="te")  # exact bytes (device cpu)
    dummies = [n for n, m in zip(a.timeline.nbytes, a.timeline.module) if m == DUMMY]
    # and the output layer's (megatron-core's ColumnParallelLinear takes TE's cached dummy too: layers.py:738-754)
    head = next(p for p in params if p.name.endswith("output_layer.weight"))
    assert dummies == [n for _, n in dummy_wgrads(params, 2)] + [head.numel * 2]
    assert not any(m == DUMMY for m in b.timeline.module)

    def made(rank):  # bytes allocated in the step (model state and library buffers aside)
        tl = rank.timeline
        return sum(n for n, c, m in zip(tl.nbytes, tl.category, tl.module) if c not in (
            "parameters", "gradients", "optimizer_state") and m not in LIBRARY_BUFFERS)

    # every microbatch's backward made each weight gradient (the output layer's too) unfused; fused, none
    assert made(b) - made(a) == 3 * sum(p.numel * 2 for p in [*weights, head])
    assert fused.to_megatron_args().count("--no-gradient-accumulation-fusion") == 0
    assert Job.from_megatron_args(plain.to_megatron_args()) == plain
    # a CPU job (gloo) cannot fuse: the cpu kernel profile keeps the transients and makes no dummy
    assert predict_stage(fused, 1, kernels="cpu").peak_bytes == predict_stage(plain, 1, kernels="cpu").peak_bytes


def test_an_interleaved_stage_ends_the_step_holding_each_chunks_last_input_and_grad():
    # NOTE [the model's last input] in remat.parallel.pipeline_runtime: each model chunk keeps the input of its latest
    # forward (transformer_block.py:463) and its .grad (schedules.py:561, 591) after the step: one [s/tp, b, h] bf16
    # received tensor and its gradient per chunk that receives its input (sequence parallelism shards them)
    job = Job.build(MODEL.replace(num_layers=8), precision="bf16", tp=2, sp=True, pp=2, vpp=2, num_microbatches=4,
                    dp=2, distributed_optimizer=True)
    p2p = MODEL.seq_length // 2 * MODEL.micro_batch_size * MODEL.hidden_size * 2
    for stage, receiving in ((0, 1), (1, 2)):  # stage 0 holds chunks 0 (the embedding's) and 2, stage 1 chunks 1, 3
        rank = predict_stage(job, stage)
        end = parts_at(rank.timeline, rank.timeline.num_events - 1)
        assert end["activations"] == 2 * p2p * receiving
        assert sum(end[p] for p in RESIDENT_PARTS) == rank.state.total + end["workspaces"] + 2 * p2p * receiving


def test_the_mtp_eh_proj_is_a_fused_te_linear():
    # each MTP depth's eh_proj is a TEColumnParallelLinear (multi_token_prediction.py:1174-1187 through
    # transformer_engine_spec_provider.py:43; transformer_engine.py:1293 fuse_wgrad_accumulation): its weight gradient
    # goes into main_grad and TE returns its cached dummy of the weight's shape [h / tp, 2h] (linear.py:1261-1275)
    from remat.memory.wgrad_fusion import MODULE as DUMMY
    from remat.memory.wgrad_fusion import dummy_wgrads, fused_weights
    from remat.parallel.job_predict import stage_parameters

    model = MODEL.replace(num_query_groups=None, activation="gelu", ffn_hidden_size=None, mtp_num_layers=1)
    job = Job.build(model, precision="bf16", tp=2, sp=True, pp=2, num_microbatches=2)
    params = [p for chunk in stage_parameters(job, 1) for p in chunk]
    eh_proj = next(p for p in params if p.name.endswith("eh_proj.weight"))
    assert eh_proj.shape == (32, 128) and eh_proj in fused_weights(params)
    assert ((32, 128), 32 * 128 * 2) in dummy_wgrads(params, 2)
    rank = predict_stage(job, 1, kernels="te")
    dummies = [n for n, m in zip(rank.timeline.nbytes, rank.timeline.module) if m == DUMMY]
    head = next(p for p in params if p.name.endswith("output_layer.weight"))
    assert dummies == [n for _, n in dummy_wgrads(params, 2)] + [head.numel * 2]  # eh_proj's among them
