"""Megatron's flex token dispatcher with HybridEP (remat.models.flex_dispatch, NOTE [the flex dispatcher])."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from moe_fixtures import MOE, Allocations, received_real_and_fake
from torch._subclasses.fake_tensor import FakeTensorMode

from remat.config import ConfigError
from remat.models.deepep_dispatch import deepep_rows, run_experts_deepep
from remat.models.expert_parallel import SimulatedExpertGroup, expert_parallel_group
from remat.models.flex_dispatch import FlexHandle, HybridEPDispatch, hybridep_handle, run_experts_hybridep
from remat.models.moe import GroupedMLP, MoELayer

FLEX = MOE.replace(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep")


def test_the_handle_is_hybrideps_metadata():
    # executor.cu:93-131 for T = 8 tokens, G = 2 ranks, L = 2 local experts: sparse_to_dense_map int32 [8, 2],
    # rdma_to_attn_map bool [16, 1], attn_to_rdma_map [8, 0], local_expert_routing_map bool [16, 2], overflow_flag
    # int32 [1], dense_chunk_layout int32 [1 x 2], dense_to_expert_map int32 [16, 2], tokens_per_expert int32 [2]
    handle = hybridep_handle(8, 2, 2, torch.empty(0))
    assert [(tuple(t.shape), t.dtype) for t in handle] == [
        ((8, 2), torch.int32), ((16, 1), torch.bool), ((8, 0), torch.bool), ((16, 2), torch.bool),
        ((1,), torch.int32), ((2,), torch.int32), ((16, 2), torch.int32), ((2,), torch.int32)]
    assert sum(t.nbytes for t in handle) == 64 + 16 + 0 + 32 + 4 + 8 + 128 + 8


def test_the_dispatch_makes_the_gathered_map_the_handle_and_the_permuted_copies():
    # T = 8 tokens, E = 4 experts, topk 2, G = ep = 2 (this rank 1: experts 2 and 3), balanced: n = 2 x (4 + 4) = 16
    with FakeTensorMode():  # fake: real tensors are filled with in-place copies of slices, which this mode lists
        experts = GroupedMLP(FLEX.replace(moe_grouped_gemm=True), 2)
        tokens = torch.randn(8, 24, requires_grad=True)
        probs = torch.rand(16, requires_grad=True)
        with Allocations() as seen:
            out, received = run_experts_hybridep(experts, tokens, probs, [4, 4, 4, 4], 2, 2, 1)
        out.sum().backward()  # combine backward: [n, h]; dispatch backward: [T, h] and fp32 [T, E]
    assert received == [8, 8] and out.shape == (8, 24)
    made = seen.made
    gathered = made.index(((16, 4), torch.bool))  # the NCCL all-gather of the routing map [G x T, E]
    assert made.index(((8, 4), torch.float32)) < gathered  # the router's dense fp32 probabilities [T, E]
    assert made[gathered + 1:gathered + 9] == [(tuple(t.shape), t.dtype) for t in hybridep_handle(8, 2, 2, tokens)]
    assert made[gathered + 9:gathered + 11] == [((16, 24), torch.float32), ((16,), torch.float32)]  # outputs
    assert made[-1] == ((8, 24), torch.float32)  # the combine's output
    assert tokens.grad.shape == (8, 24) and probs.grad.shape == (16,)


def test_the_handle_is_kept_for_the_backward_and_freed_by_it():
    # fused_a2a.py:437 ctx.handle: the metadata lives from the dispatch to its backward, not beyond
    x = torch.randn(8, 24, requires_grad=True)
    probs = torch.rand(8, 4, requires_grad=True)
    holder = FlexHandle()
    out, out_probs = HybridEPDispatch.apply(x, probs, torch.zeros(8, 4, dtype=torch.bool), holder, 2, 2, 16)
    kept = weakref.ref(holder.tensors[6])  # dense_to_expert_map [G x T, L] int32
    holder.tensors = None  # the manager drops it after the combine
    gc.collect()
    assert kept() is not None
    (out.sum() + out_probs.sum()).backward()
    del out, out_probs
    gc.collect()
    assert kept() is None and probs.grad.shape == (8, 4)


def test_a_moe_layer_runs_the_flex_dispatcher_and_the_fake_trace_matches_real():
    layer, real, fake = received_real_and_fake(FLEX)
    assert layer.flex == ("hybridep", 2, 1)
    assert real == fake == [32, 32]  # 2 ranks x 32 tokens x topk 2 / 4 experts, per local expert


def test_deepep_without_expert_parallelism_is_refused_as_megatron_refuses_it():
    with pytest.raises(ConfigError, match="DeepEP dispatcher requires TPxEP > 1"):
        MoELayer(FLEX.replace(moe_flex_dispatcher_backend="deepep"), 0)


@pytest.mark.parametrize("fusion, experimental", [(False, False), (True, False), (True, True)])
def test_deepep_receives_each_token_once_per_rank_and_permutes_the_copies(fusion, experimental):
    # T = 8 tokens, E = 4 experts, topk 2, G = ep = 2 (rank 1): n = 16 copies; R = 2 x min(8, 8) = 16 rows at most
    with FakeTensorMode():
        experts = GroupedMLP(FLEX.replace(moe_grouped_gemm=True), 2)
        tokens = torch.randn(8, 24, requires_grad=True)
        probs = torch.rand(16, requires_grad=True)
        with Allocations() as seen:
            out, received = run_experts_deepep(experts, tokens, probs, [4, 4, 4, 4], 2, 2, 1, permute_fusion=fusion,
                                               experimental=experimental)
        out.sum().backward()
    assert received == [8, 8] and out.shape == (8, 24) and tokens.grad.shape == (8, 24)
    made = seen.made
    at = made.index(((8, 2), torch.int64))  # torch.topk: fp32 [T, k] probabilities and int64 [T, k] indices
    assert made[at - 1] == ((8, 2), torch.float32)
    # get_dispatch_layout (deep_ep.cpp:391-394), intranode_dispatch (:569-633)
    assert made[at + 1:at + 12] == [((2,), torch.int32), ((4,), torch.int32), ((8, 2), torch.bool),
                                    ((2, 2), torch.int32), ((2, 10), torch.int32), ((16, 24), torch.float32),
                                    ((16,), torch.int32), ((2, 10), torch.int32), ((8, 2), torch.int32),
                                    ((16, 2), torch.int64), ((16, 2), torch.float32)]
    rest = made[at + 12:]
    if experimental:  # the fused multihot conversion: bool map, fp32 probabilities, int32 position map [R, L]
        assert rest[:3] == [((16, 2), torch.bool), ((16, 2), torch.float32), ((16, 2), torch.int32)]
    else:  # _indices_to_multihot: int64 and fp32 [R, L] zeros, the mask [R, k], the valid indices [n], arange [R],
        # mask.sum [R], the rows [n]; the n selected weights; the int64 map's bool copy
        assert rest[:7] == [((16, 2), torch.int64), ((16, 2), torch.float32), ((16, 2), torch.bool),
                            ((16,), torch.int64), ((16,), torch.int64), ((16,), torch.int64), ((16,), torch.int64)]
        assert ((16,), torch.float32) in rest[7:10] and ((16, 2), torch.bool) in rest[7:12]
    # the permutation of the R received rows by the [R, L] map: TE's int32 row_id_map [R, 2L + 1], or the argsort
    # of the [L, R] map, int64 [L x R]
    assert (((16, 5), torch.int32) in rest) == fusion and (((32,), torch.int64) in rest) == (not fusion)
    assert ((16, 24), torch.float32) in rest and made[-1] == ((8, 24), torch.float32)  # the combine


def test_deepep_rows_are_bounded_by_the_copies_and_the_tokens():
    assert deepep_rows([4, 4, 4, 4], 8, 2, 1) == 16   # every copy a token of its own
    assert deepep_rows([1, 1, 1, 1], 8, 2, 0) == 4    # 2 copies from each of 2 ranks
    assert deepep_rows([16] * 4, 8, 2, 0) == 16       # at most the 8 tokens of each source


def test_a_moe_layer_runs_deepep_and_the_fake_trace_matches_real():
    config = FLEX.replace(expert_model_parallel_size=2, moe_flex_dispatcher_backend="deepep")
    with expert_parallel_group(SimulatedExpertGroup(2, 0)):
        layer = MoELayer(config, 0)
    assert layer.flex == ("deepep", 2, 0)
    layer(torch.randn(2, 16, 24)).sum().backward()
    assert layer.last_received == [32, 32]
    with FakeTensorMode():
        with expert_parallel_group(SimulatedExpertGroup(2, 0)):
            fake = MoELayer(config, 0)
        fake(torch.randn(2, 16, 24)).sum().backward()
    assert fake.last_received == [32, 32]
