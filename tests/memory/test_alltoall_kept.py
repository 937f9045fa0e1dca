"""What the all-to-all dispatchers of a rank keep from their first forward on (NOTE [the all-to-all dispatcher's
attributes] in remat.memory.workspaces): per MoE layer and MTP depth of the stage, in whole CUDA blocks; megatron-core's
own dispatcher is read in tests/megatron/test_megatron_alltoall.py."""

from __future__ import annotations

from remat.config import ModelConfig
from remat.job import Job
from remat.memory.workspaces import MODULE_ALLTOALL, alltoall_kept_bytes, stage_workspaces
from remat.parallel.job_predict import predict_job
from remat.units import round_up

ALLTOALL = ModelConfig(num_layers=4, hidden_size=256, num_attention_heads=4, vocab_size=128, seq_length=512,
                       position="rope", micro_batch_size=2, num_moe_experts=8, moe_ffn_hidden_size=64,
                       moe_router_topk=2, moe_layer_freq=(0, 0, 1, 1), attention="sdpa", moe_grouped_gemm=True,
                       moe_token_dispatcher_type="alltoall", expert_model_parallel_size=2)
T, E = 1024, 8  # tokens a rank routes (2 x 512), experts


def test_each_moe_layer_keeps_its_dense_probabilities_and_routing_map_on_its_stage_only():
    job = Job.build(ALLTOALL, precision="bf16", ep=2, dp=2, pp=2, num_microbatches=2)
    assert alltoall_kept_bytes(job, 0) == 0  # stage 0's layers are dense
    per_layer = T * E * 2 + T * E + T * 2 * 8  # bf16 probabilities (the logits' dtype), bool map, int64 [T x topk]
    assert alltoall_kept_bytes(job, 1) == 2 * per_layer
    assert (MODULE_ALLTOALL, 2 * per_layer) in stage_workspaces(job, 1)
    fp32_router = job.replace(model=job.model.replace(moe_router_dtype="fp32"))
    assert alltoall_kept_bytes(fp32_router, 1) == 2 * (T * E * 4 + T * E + T * 2 * 8)
    # the copies its trace permutes: every expert's capacity when padded to it, ceil(1024 x 2 / 8 x 0.5) = 128; else
    # the routing assumption's
    padded = job.replace(model=job.model.replace(moe_expert_capacity_factor=0.5, moe_pad_expert_input_to_capacity=True))
    assert alltoall_kept_bytes(padded, 1) == 2 * (T * E * 2 + T * E + 128 * 8 * 8)
    skewed = job.replace(model=job.model.replace(moe_routing_assumption="capacity:1.5"))  # 384 a expert
    assert alltoall_kept_bytes(skewed, 1) == 2 * (T * E * 2 + T * E + 384 * 8 * 8)
    # the predicted rank counts them among the buffers kept from the first step on
    rank = next(r for r in predict_job(job).ranks if r.stage == 1)
    kept = [n for n, module in zip(rank.timeline.nbytes, rank.timeline.module) if module == MODULE_ALLTOALL]
    assert kept == [2 * per_layer]

def test_permute_fusion_keeps_the_chunk_sort_indices_and_counts_on_the_gpu():
    # token_dispatcher.py:431-441: arange(E x etp) on the GPU, sorted and restored by local expert (two int64 copies;
    # one shared storage with one local expert); :606-615: the counts per local expert, int64 [etp x ep, L]
    fused = Job.build(ALLTOALL.replace(moe_permute_fusion=True), precision="bf16", ep=2, dp=2)
    plain = Job.build(ALLTOALL, precision="bf16", ep=2, dp=2)
    block = 512  # E x 8 = 64 bytes, one CUDA block each
    # TE's row_id_map int32 [T, 2E + 1] instead of the int64 [T x topk] map
    maps = 2 * (round_up(T * (2 * E + 1) * 4, block) - T * 2 * 8)
    assert alltoall_kept_bytes(fused, 0) - alltoall_kept_bytes(plain, 0) == maps + 2 * (2 * block + block)
    one_local = Job.build(ALLTOALL.replace(moe_permute_fusion=True, expert_model_parallel_size=8), precision="bf16",
                          ep=8, dp=8)
    plain_one = Job.build(ALLTOALL.replace(expert_model_parallel_size=8), precision="bf16", ep=8, dp=8)
    assert alltoall_kept_bytes(one_local, 0) - alltoall_kept_bytes(plain_one, 0) == maps + 2 * block
