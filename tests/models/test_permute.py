"""remat.models.permute (NOTE [the permutation maps]): the all-to-all dispatcher's permutation, unfused (the
argsort of the routing map kept whole), fused (TransformerEngine's int32 row_id_map) and padded to capacity; the
same values and gradients every way, each keeping Megatron's map from the layer's forward to its backward; the
combine keeping the experts' outputs only under deterministic algorithms (NOTE [the combine's saved source]); and
``--moe-permute-fusion`` and ``--deterministic-mode`` read from a job."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from layer_rows import kept_by_layer

from remat.config import ModelConfig
from remat.job import JobError, parse_megatron_args
from remat.memory.measure import measure
from remat.memory.predict import trace
from remat.models.expert_parallel import SimulatedExpertGroup, expert_parallel_group
from remat.models.gpt import build_model, sample_batch
from remat.models.permute import ROW_ID_BLOCK, permute_copies, sort_chunks_fused, unpermute_copies
from remat.timeline import Timeline

# one MoE layer (the second), 8 experts, top-2, 2 x 16 tokens: E x T = 256 copies' worth of map
MOE = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, micro_batch_size=2,
                  vocab_size=64, num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=24, moe_layer_freq=(0, 1),
                  moe_routing_assumption="balanced", moe_token_dispatcher_type="alltoall")
TOKENS, EXPERTS, TOPK = 32, 8, 2


def _step(config: ModelConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = build_model(config, seed=0)
    tokens, labels = sample_batch(config)
    loss = model(tokens, labels)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_every_permutation_computes_the_same_loss_and_gradients_bit_for_bit():
    ref_loss, ref_grads = _step(MOE.replace(moe_token_dispatcher_type="allgather"))  # the [n] indices alone
    for config in (MOE, MOE.replace(moe_permute_fusion=True)):
        loss, grads = _step(config)
        assert torch.equal(loss, ref_loss)
        assert grads.keys() == ref_grads.keys()
        assert all(torch.equal(grads[n], ref_grads[n]) for n in grads), config.moe_permute_fusion


def test_the_functions_permute_and_restore_real_values():
    torch.manual_seed(0)
    tokens = torch.randn(4, 3, requires_grad=True)
    probs = torch.rand(8, requires_grad=True)  # 4 tokens x top-2
    order = torch.tensor([3, 0, 5, 1, 6, 2, 7, 4])  # the copies in expert order
    outputs = []
    for argsort, fused in ((False, False), (True, False), (False, True)):
        permuted, permuted_probs, mapping = permute_copies(tokens, probs, order, 2, 4, argsort=argsort, fused=fused)
        assert torch.equal(permuted, tokens.detach()[order // 2]) and torch.equal(permuted_probs, probs.detach()[order])
        for keeps_source in (False, True):  # scatter_add_ or index_add_ (NOTE [the combine's saved source])
            restored = unpermute_copies(permuted * permuted_probs[:, None], mapping, 4, keeps_source=keeps_source)
            grads = torch.autograd.grad(restored.sum() + (restored ** 2).sum(), (tokens, probs), retain_graph=True)
            outputs.append((restored.detach(), *grads))
    for other in outputs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outputs[0], other))


def _kept(config: ModelConfig) -> Counter[int]:
    """The bytes of each tensor the MoE layer's forward makes and its backward frees."""
    return kept_by_layer(trace(config, "none"))


def test_each_permutation_keeps_its_map_from_the_layers_forward_to_its_backward():
    indices = _kept(MOE.replace(moe_token_dispatcher_type="allgather"))  # at ep = 1: the copies' int64 indices
    n = TOKENS * TOPK
    # unfused: the argsort of the [E x T] map, whole, instead of the router's order of the n copies
    argsort = _kept(MOE)
    assert (argsort - indices, indices - argsort) == (Counter({8 * EXPERTS * TOKENS: 1}), Counter({8 * n: 1}))
    # fused: TE's int32 [T, 2E + 1] row_id_map, and no int64 index at all
    fused = _kept(MOE.replace(moe_permute_fusion=True))
    assert (fused - indices, indices - fused) == (Counter({4 * TOKENS * (2 * EXPERTS + 1): 1}), Counter({8 * n: 2}))


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_the_combine_keeps_the_experts_outputs_only_under_deterministic_algorithms(dispatcher):
    # NOTE [the combine's saved source]: scatter_add_ keeps only its index (the map, kept anyway); index_add_, which
    # Megatron's unfused unpermute runs under --deterministic-mode, keeps its source, the experts' outputs [n, h]
    config = MOE.replace(moe_token_dispatcher_type=dispatcher)
    outputs = TOKENS * TOPK * config.hidden_size * 4  # fp32 [n, h]
    deterministic = _kept(config.replace(deterministic_algorithms=True))
    assert deterministic - _kept(config) == Counter({outputs: 1}) and not _kept(config) - deterministic
    # TE's fused unpermute keeps its row_id_map alone either way
    fused = MOE.replace(moe_permute_fusion=True)
    assert _kept(fused.replace(deterministic_algorithms=True)) == _kept(fused)


def test_with_expert_parallelism_the_fused_sorts_keep_their_chunk_maps():
    # ep = 2 (rank 0 of a simulated group): 4 local experts, so the received chunks are sorted by local expert and
    # back; TE's fused sorts keep an int32 [rows] map each (64 rows received under balanced routing), the unfused
    # torch.split/torch.cat nothing
    config = MOE.replace(expert_model_parallel_size=2)
    with expert_parallel_group(SimulatedExpertGroup(2, 0)):
        unfused, fused = _kept(config), _kept(config.replace(moe_permute_fusion=True))
    n = TOKENS * TOPK
    assert fused - unfused == Counter({4 * TOKENS * (2 * EXPERTS + 1): 1, 4 * n: 2})
    assert unfused - fused == Counter({8 * EXPERTS * TOKENS: 1, 8 * n: 1})


def test_the_fused_chunk_sort_moves_real_rows_and_their_gradients():
    x = torch.arange(12.0).reshape(6, 2).requires_grad_()
    probs = torch.arange(6.0, requires_grad=True)
    sizes, order = [1, 2, 3], [2, 0, 1]  # chunks [0], [1, 2], [3, 4, 5] -> [3, 4, 5], [0], [1, 2]
    out, sorted_probs = sort_chunks_fused(x, probs, sizes, order)
    assert sorted_probs.tolist() == [3.0, 4.0, 5.0, 0.0, 1.0, 2.0] and torch.equal(out, x.detach()[[3, 4, 5, 0, 1, 2]])
    weights = torch.arange(6.0)
    grad_x, grad_p = torch.autograd.grad((out.sum(1) * weights).sum() + (sorted_probs * weights).sum(), (x, probs))
    assert grad_p.tolist() == [3.0, 4.0, 5.0, 0.0, 1.0, 2.0] and grad_x[:, 0].tolist() == grad_p.tolist()


def test_the_fused_permute_frees_make_row_id_maps_workspace_in_the_forward():
    tl, plain = trace(MOE.replace(moe_permute_fusion=True), "none"), trace(MOE, "none")
    workspace = 4 * EXPERTS * -(-TOKENS // ROW_ID_BLOCK)  # int32 [E, ceil(T / 1024)]: 32 bytes

    def transient(t: Timeline) -> int:
        return sum(1 for row in range(len(t)) if t.nbytes[row] == workspace and t.free_at[row] >= 0 and
                   t.phase_at(t.free_at[row]) == t.phases[t.phase_index[row]] and
                   t.phases[t.phase_index[row]].region == "layer 1")
    assert transient(tl) == transient(plain) + 1


def test_padding_to_capacity_keeps_the_indices_alone():
    padded = MOE.replace(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True,
                         moe_routing_assumption=None)
    assert _kept(padded) == _kept(padded.replace(moe_token_dispatcher_type="allgather"))


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("policy", ["none", "selective/moe", "full/uniform/1"])
def test_predicted_equals_measured(fused, policy):
    from remat.recompute.apply import apply

    config = MOE.replace(moe_permute_fusion=fused)
    model = build_model(config)
    apply(model, policy)
    real = measure(model, sample_batch(config))
    fake = trace(config, policy)
    for name in ("nbytes", "alloc_at", "free_at", "category", "module"):
        assert getattr(fake, name) == getattr(real, name), name


ARGS = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 "
        "--micro-batch-size 1 --global-batch-size 8 --vocab-size 1000 --bf16 --num-experts 8 --world-size 2 "
        "--expert-model-parallel-size 2 ")


def test_deterministic_mode_is_read_where_the_combine_unpermutes_unfused():
    for dispatcher, fusion in (("alltoall", ""), ("allgather", ""), ("flex", "")):
        job, ignored = parse_megatron_args(ARGS + f"--moe-token-dispatcher-type {dispatcher} {fusion}"
                                           "--deterministic-mode")
        assert job.model.deterministic_algorithms and "--deterministic-mode" not in ignored, dispatcher
        assert "--deterministic-mode" in job.to_megatron_args()
    for extra in ("--moe-token-dispatcher-type alltoall --moe-permute-fusion",  # TE's unpermute: the same tensors
                  "--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep"):  # HybridEP's kernels
        job, ignored = parse_megatron_args(ARGS + extra + " --deterministic-mode")
        assert not job.model.deterministic_algorithms and "--deterministic-mode" in ignored, extra
    dense = ARGS.split("--num-experts")[0] + "--world-size 2 --deterministic-mode"
    job, ignored = parse_megatron_args(dense)
    assert not job.model.deterministic_algorithms and "--deterministic-mode" in ignored


def test_the_flag_is_read_for_the_alltoall_dispatcher_and_refused_for_allgather():
    job, ignored = parse_megatron_args(ARGS + "--moe-token-dispatcher-type alltoall --moe-permute-fusion")
    assert job.model.moe_permute_fusion and "--moe-permute-fusion" not in ignored
    assert "--moe-permute-fusion" in job.to_megatron_args()
    with pytest.raises(JobError, match="--moe-token-dispatcher-type alltoall, or drop --moe-permute-fusion"):
        parse_megatron_args(ARGS + "--moe-token-dispatcher-type allgather --moe-permute-fusion")
