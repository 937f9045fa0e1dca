"""Megatron's allgather token dispatcher (remat.models.allgather_dispatch) and the router's fp32 dtype
(remat.models.moe.RouterGatingLinear): the tensors they allocate follow token_dispatcher.py / moe_utils.py."""

from __future__ import annotations

import torch
from moe_fixtures import MOE, Allocations, received_real_and_fake

from remat.job import Job
from remat.memory.workspaces import MODULE_ALLGATHER, allgather_kept_bytes, stage_workspaces
from remat.models.allgather_dispatch import GatherPermute, global_buffer_bytes, run_experts_allgather
from remat.models.moe import GroupedMLP, MoELayer
from remat.models.tp_layers import SimulatedGroup


def test_the_dispatcher_makes_megatrons_gathered_and_permuted_tensors():
    # T = 8 tokens per rank, G = tp x ep = 4 ranks, E = 4 experts, L = 2 local (ep = 2), topk 2: N = 32 gathered
    # tokens, n = G x (the local experts' 4 + 4 copies) = 32 copies
    experts = GroupedMLP(MOE.replace(moe_grouped_gemm=True), 2)
    tokens = torch.randn(8, 24, requires_grad=True)
    probs = torch.rand(16, requires_grad=True)
    with Allocations() as seen:
        out, received = run_experts_allgather(experts, SimulatedGroup(4, 1), tokens, probs, [4, 4, 4, 4], 2, 1, 2)
    assert received == [16, 16] and out.shape == (8, 24)
    made = seen.made
    assert ((32, 4), torch.bool) in made and ((32, 4), torch.float32) in made  # gathered routing map and probs
    assert ((32, 2), torch.bool) in made and ((2, 32), torch.bool) in made    # local_map, its transpose
    assert ((64,), torch.int64) in made                                       # the argsort of L x N
    assert ((32, 24), torch.float32) in made                                  # the permuted copies / unpermute
    assert made[-1] == ((8, 24), torch.float32)                               # the reduce-scatter's output
    assert not any(shape == (32, 24) and i < made.index(((64,), torch.int64)) for i, (shape, _) in enumerate(made))
    out.sum().backward()  # the gathered hidden states come from Megatron's global buffer: no [N, h] before permute
    assert tokens.grad.shape == (8, 24) and probs.grad.shape == (16,)


def test_the_copies_probabilities_keep_what_masked_select_keeps():
    # token_dispatcher.py (d98e8a64) dispatch_postprocess: local_probs.T.contiguous().masked_select(local_map.T
    # .contiguous()) keeps both [L, N] copies for its backward, not the argsort's indices (L = 2, N = 32)
    experts = GroupedMLP(MOE.replace(moe_grouped_gemm=True), 2)
    tokens, probs = torch.randn(8, 24, requires_grad=True), torch.rand(16, requires_grad=True)
    saved: list[tuple[tuple[int, ...], torch.dtype, int]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append((tuple(t.shape), t.dtype, t.untyped_storage().nbytes()))
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, _ = run_experts_allgather(experts, SimulatedGroup(4, 1), tokens, probs, [4, 4, 4, 4], 2, 1, 2)
    assert ((2, 32), torch.float32, 2 * 32 * 4) in saved and ((2, 32), torch.bool, 2 * 32) in saved
    assert not any(nbytes == 64 * 8 for *_, nbytes in saved)  # the [L x N] argsort, freed
    grad_probs, = torch.autograd.grad(out.sum(), probs)
    assert grad_probs.shape == (16,)


def test_gather_permute_backward_is_index_select_then_reduce_scatter():
    tokens = torch.randn(4, 3, requires_grad=True)
    out = GatherPermute.apply(tokens, torch.tensor([0, 5, 6]), SimulatedGroup(2, 0))
    assert torch.equal(out, tokens.detach()[[0, 1, 2]])
    out.backward(torch.ones(3, 3))
    assert tokens.grad[:, 0].tolist() == [1.0, 0.0, 0.0, 0.0]  # rank 0 keeps rows 0..3 of the gathered gradient


def test_a_moe_layer_with_ep_runs_the_allgather_dispatcher_and_the_fake_trace_matches_real():
    layer, real, fake = received_real_and_fake(MOE)
    assert layer.allgather is not None and layer.allgather.size == 2
    assert real == fake == [32, 32]  # 2 ranks x 32 tokens x topk 2 / 4 experts, per local expert


def test_the_kept_bytes_follow_the_global_buffer_and_the_dispatcher_attributes():
    # megatron/core/utils.py GlobalMemoryBuffer: [G x T, h] once; per MoE layer local_map [G x T, L] bool,
    # sorted_indices int64 [n], local_probs [n]
    job = Job.build(MOE.replace(expert_model_parallel_size=2), precision="bf16", ep=2, dp=2)
    tokens, group, local, copies = 32, 2, 2, 2 * 32 * 2 // 2
    expected = group * tokens * 24 * 2 + 1 * (group * tokens * local + copies * (8 + 2))
    assert allgather_kept_bytes(job, 0) == expected == global_buffer_bytes(tokens, 24, 2, group, 1, local, copies, 2)
    assert (MODULE_ALLGATHER, expected) in stage_workspaces(job, 0)
    alltoall = job.replace(model=job.model.replace(moe_token_dispatcher_type="alltoall"))
    assert allgather_kept_bytes(alltoall, 0) == 0


def test_an_fp32_router_makes_fp32_logits_and_casts_the_activation_back():
    layer = MoELayer(MOE.replace(moe_router_dtype="fp32", moe_token_dispatcher_type="alltoall"), 0).to(torch.bfloat16)
    x = torch.randn(2, 16, 24, dtype=torch.bfloat16, requires_grad=True)
    with Allocations() as seen:
        out = layer(x)
    assert ((32, 4), torch.float32) in seen.made and out.dtype == torch.bfloat16
    out.sum().backward()
    assert x.grad.dtype == torch.bfloat16 and layer.router.weight.grad.dtype == torch.bfloat16
