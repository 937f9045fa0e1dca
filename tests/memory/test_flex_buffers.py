"""The flex dispatcher's HybridEP buffers outside PyTorch's allocator and its managers' kept attributes
(remat.memory.flex_buffers, NOTE [HybridEP's buffers])."""

from __future__ import annotations

import pytest

from remat.config import ModelConfig
from remat.job import Job
from remat.memory.flex_buffers import deepep_buffers, flex_kept_bytes, hybridep_buffers
from remat.memory.outside_allocator import outside_bytes
from remat.memory.workspaces import MODULE_FLEX, stage_workspaces
from remat.parallel.job_predict import outside_allocator_buffers, predict_job

FLEX = ModelConfig(num_layers=4, hidden_size=256, num_attention_heads=4, vocab_size=128, seq_length=500,
                   position="rope",
                   micro_batch_size=2, num_moe_experts=8, moe_ffn_hidden_size=64, moe_router_topk=2,
                   moe_layer_freq=(0, 0, 1, 1), attention="sdpa", moe_grouped_gemm=True,
                   moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep")


def test_hybridep_buffers_are_sized_as_the_library_sizes_them():
    # T = 1000 tokens -> T' = 1024 (max(T, 512) rounded up to the 64-token chunk, config.cuh:385-387); G = 2 ranks,
    # L = 4 local experts, h = 256: M = T' x G = 2048 tokens
    sizes = [b.nbytes for b in hybridep_buffers(1000, 256, 2, 4)]
    assert sizes[0] == 2048 * 256 * 2          # expert tokens, bf16 (intranode.cu:255-260)
    assert sizes[1] == 2048 * (4 * 2) * 4      # probabilities, fp32 (:256-261)
    assert sizes[2] == 2048 * (256 // 128) * 4  # FP8 scaling factors, fp32 (:201, 213)
    assert sizes[3] == (4 * 2) * 1024 * 2      # the routing-map all-gather, bool (allgather.cu:142-147)
    # scratch 108 x (G + L) x 8; chunk flags 2 x (1024 / 64) x G x 4; dispatch/combine flags 2 x 24; all-gather
    # flags 24 + G x 8; the allocator's test block 512
    assert sizes[4] == 108 * 6 * 8 + 2 * 16 * 2 * 4 + 48 + 24 + 16 + 512
    assert [b.nbytes for b in hybridep_buffers(100, 256, 2, 4)][0] == 512 * 2 * 256 * 2  # at least 512 tokens


def test_a_flex_job_holds_them_outside_the_allocator_on_its_moe_stages_only():
    job = Job.build(FLEX.replace(expert_model_parallel_size=2), precision="bf16", ep=2, dp=2, pp=2,
                    num_microbatches=2)
    assert outside_allocator_buffers(job, 0) == ()  # stage 0's layers are dense: no dispatch, no buffer
    buffers = outside_allocator_buffers(job, 1)
    # T = 2 x 500 tokens, L = 8 / 2
    assert [(b.name, b.nbytes, b.source) for b in buffers] == list(hybridep_buffers(1000, 256, 2, 4))
    assert predict_job(job).ranks[-1].outside_bytes == outside_bytes(buffers)
    alltoall = job.replace(model=job.model.replace(moe_token_dispatcher_type="alltoall"))
    assert outside_allocator_buffers(alltoall, 1) == ()


def test_each_moe_layers_manager_keeps_its_routing_map_and_probabilities():
    # token_dispatcher.py:1093-1094, 1168-1176: routing map [T, E] bool + fp32 probabilities [T, E] + fp32
    # dispatched probabilities [T x topk], per MoE layer, until its next forward
    job = Job.build(FLEX.replace(expert_model_parallel_size=2), precision="bf16", ep=2, dp=2)
    # and one micro-batch's handle (executor.cu:93-131), held to the end of the step (autograd's ctx.handle): T = 1000
    # tokens, G = 2 ranks, L = 4 local experts: int32 [T, G], bool [1008, 1], bool [G T, L], int32 [1],
    # int32 [16 G], int32 [G T, L], int32 [L]
    handle = 1000 * 2 * 4 + 1008 + 2000 * 4 + 4 + 16 * 2 * 4 + 2000 * 4 * 4 + 4 * 4
    per_layer = 1000 * 8 * (1 + 4) + 1000 * 2 * 4 + handle
    assert flex_kept_bytes(job, 0) == 2 * per_layer
    assert (MODULE_FLEX, 2 * per_layer) in stage_workspaces(job, 0)
    mtp = job.replace(model=job.model.replace(mtp_num_layers=1))  # the MTP depth copies the last (MoE) layer
    assert flex_kept_bytes(mtp, 0) == 3 * per_layer


def test_deepeps_buffer_is_the_larger_config_hint_and_the_workspace():
    # csrc/config.hpp:51-73 with Megatron's 20 SMs (10 channels), 4 ranks, 2 x 1024 hidden bytes; the dispatch config
    # of 4 ranks receives 256-token chunks (buffer.py:242), as the combine's (:270): one hint
    per_token = 2048 + 8 + 128 * 8 + 128 * 4 + 128 * 4  # tokens, SourceMeta, top-k indices, weights, scales
    hint = 10 * 4 * (2 + 3) * 4 + 10 * 4 * 256 * per_token  # 42,025,760 bytes, rounded up to 128: 42,025,856
    nvl, workspace = deepep_buffers(2048, 4)
    assert nvl.nbytes == 42_025_856 + 8 * 4 + 8 * 8 + 8 * 8 and hint == 42_025_760  # + barrier signals, pointers
    assert workspace.nbytes == 32 << 20  # NUM_WORKSPACE_BYTES (kernels/configs.cuh:5)


@pytest.mark.parametrize("fusion", [False, True])
def test_a_deepep_job_is_priced_with_its_buffers_and_its_managers_maps(fusion):
    deepep = FLEX.replace(expert_model_parallel_size=2, moe_flex_dispatcher_backend="deepep",
                          moe_permute_fusion=fusion)
    job = Job.build(deepep, precision="bf16", ep=2, dp=2)
    # T = 1000 tokens, top-2 of 8 experts over 2 ranks: n = 2000 copies to the busiest rank's 4 experts, received
    # as R = min(2 x 1000, 2000) = 2000 rows; per MoE layer (2): the top-k fp32 probabilities and int64 indices
    # [T, 2], the multihot map bool [R, 4] and the permutation map: int64 [n], or fused int32 [R, 2 x 4 + 1]
    mapping = 2000 * 9 * 4 if fusion else 2000 * 8
    assert flex_kept_bytes(job, 0) == 2 * (1000 * 2 * 12 + 2000 * 4 + mapping)
    rank = predict_job(job).ranks[0]
    assert [b.name for b in rank.outside] == ["DeepEP NVLink buffer", "DeepEP workspace"]
    assert rank.peak_bytes > 0


def test_the_kept_probabilities_follow_the_routing_assumption():
    # the dispatched fp32 probabilities [n]: n the copies the busiest ep rank receives (every rank routing alike)
    balanced = Job.build(FLEX.replace(expert_model_parallel_size=2), precision="bf16", ep=2, dp=2)
    skewed = balanced.replace(model=balanced.model.replace(
        moe_routing_assumption="counts:400,400,400,400,100,100,100,100"))  # rank 0's experts: 1600 of 2000 copies
    assert flex_kept_bytes(skewed, 0) - flex_kept_bytes(balanced, 0) == 2 * (2 * 1600 - 2000) * 4
