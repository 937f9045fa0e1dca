"""remat.memory.rank_state: a Megatron rank's parameters, main grads, master parameters and optimizer state."""

from __future__ import annotations

import math

import pytest

from remat.config import ModelConfig
from remat.job import Job
from remat.memory.rank_state import ParamInfo, buffer_layout, rank_parameters, rank_state, shard_elements
from remat.models.gpt import build_model
from remat.models.tensor_parallel import SimulatedGroup, build_tp_model
from remat.presets import get_preset

SMALL = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=96, seq_length=16,
                    micro_batch_size=2)


def test_layout_without_distributed_optimizer_is_unpadded():
    layout = buffer_layout([ParamInfo("a", 100), ParamInfo("b", 30)], distributed_optimizer=False, dp_size=4)
    assert (layout.numel, layout.numel_unpadded, layout.buckets) == (130, 130, ((0, 130),))
    assert layout.params == ((0, 30), (30, 130))  # reverse module order, as Megatron lays them out


def test_layout_with_distributed_optimizer_pads_params_and_bucket():
    # b (30) first at 0; a starts at the next multiple of 64; the bucket ends at a multiple of lcm(2, 128)
    layout = buffer_layout([ParamInfo("a", 100), ParamInfo("b", 30)], distributed_optimizer=True, dp_size=2)
    assert layout.params == ((0, 30), (64, 164)) and layout.buckets == ((0, 256),) and layout.numel == 256
    assert [shard_elements(layout, 2, r) for r in range(2)] == [30 + 64, 36]
    busbw = buffer_layout([ParamInfo("a", 100)], distributed_optimizer=True, dp_size=2, pad_for_nccl_busbw=True)
    assert busbw.numel == 2 ** 16
    assert buffer_layout([ParamInfo("a", 100)], distributed_optimizer=True, dp_size=3).numel == math.lcm(3, 128)


def test_shared_embedding_gets_its_own_bucket_and_buckets_split_by_size():
    params = [ParamInfo("emb", 200, shared_embedding=True), ParamInfo("w", 70), ParamInfo("v", 10)]
    layout = buffer_layout(params, distributed_optimizer=True, dp_size=1)
    # v [0,10), w [64,134) -> bucket [0,256); emb in its own bucket [256, 512)
    assert layout.buckets == ((0, 256), (256, 512)) and layout.params[-1] == (256, 456)
    sized = buffer_layout([ParamInfo("w", 70), ParamInfo("v", 10)], distributed_optimizer=True, dp_size=1,
                          bucket_size=5)
    assert sized.buckets == ((0, 128), (128, 256))


def test_rank_parameters_count_the_real_modules():
    real = sum(p.numel() for p in build_model(SMALL).parameters())
    assert sum(p.numel for p in rank_parameters(SMALL, first=True, last=True, num_layers=2)) == real
    shard = sum(p.numel() for p in build_tp_model(SMALL, SimulatedGroup(2)).parameters())
    assert sum(p.numel for p in rank_parameters(SMALL, first=True, last=True, num_layers=2, tp=2, sp=True)) == shard
    tied = SMALL.replace(tie_embeddings=True)
    first = rank_parameters(tied, first=True, last=False, num_layers=1, pipelined=True)
    last = rank_parameters(tied, first=False, last=True, num_layers=1, pipelined=True)
    assert [p.name for p in first if p.shared_embedding] == ["embedding.word_embeddings.weight"]
    assert [p.name for p in last if p.shared_embedding] == ["head.output_layer.weight"]
    assert [p.name for p in first][2:4] == ["layers.0.input_layernorm.weight", "layers.0.input_layernorm.bias"]


@pytest.mark.parametrize(("precision", "optimizer", "momentum", "expected"), [
    ("bf16", "adam", 0.0, {"parameters": 2, "gradients": 4, "master_parameters": 4, "optimizer_state": 8}),
    ("fp16", "sgd", 0.9, {"parameters": 2, "gradients": 2, "master_parameters": 4, "optimizer_state": 4}),
    ("fp32", "adam", 0.0, {"parameters": 4, "gradients": 4, "master_parameters": 0, "optimizer_state": 8}),
    ("bf16", "none", 0.0, {"parameters": 2, "gradients": 4, "master_parameters": 0, "optimizer_state": 0}),
])
def test_bytes_per_parameter_by_precision_and_optimizer(precision, optimizer, momentum, expected):
    job = Job.build(SMALL, precision=precision, optimizer=optimizer, sgd_momentum=momentum)
    state = rank_state(job, [[ParamInfo("w", 1000)]])
    assert state.parts() == {k: v * 1000 for k, v in expected.items()}


def test_distributed_optimizer_prices_the_fullest_shard():
    job = Job.build(SMALL, precision="bf16", dp=2, distributed_optimizer=True)
    state = rank_state(job, [[ParamInfo("a", 100), ParamInfo("b", 30)]])
    assert (state.dp_rank, state.shard_elements) == (0, 94)
    assert state.parts() == {"parameters": 256 * 2, "gradients": 256 * 4, "master_parameters": 94 * 4,
                             "optimizer_state": 94 * 8}


@pytest.mark.parametrize(("dp", "distributed"), [(1, False), (8, False), (8, True), (4, True)])
def test_megatron_theoretical_memory_usage_weights_and_optimizer(dp, distributed, capsys):
    # megatron/training/theoretical_memory_usage.py: 18 bytes/param, or 6 + 12/dp with the distributed optimizer
    model = get_preset("llama3-70b")
    job = Job.build(model, precision="bf16", tp=8, sp=True, pp=4, dp=dp, distributed_optimizer=distributed,
                    num_microbatches=4)
    params = rank_parameters(model, first=True, last=False, num_layers=20, tp=8, sp=True, pipelined=True)
    state = rank_state(job, [params])
    n = sum(p.numel for p in params)
    megatron = n * (6 + 12 / dp if distributed else 18)
    with capsys.disabled():
        print(f"\n70B TP8 PP4 stage 0, dp={dp}, distributed optimizer={distributed}: {n} params; remat "
              f"{state.total} B, Megatron's formula {megatron:.0f} B")
    assert state.total == megatron



# --------------------------------------------------------------------------- MoE and expert parallelism
MOE = ModelConfig(num_layers=2, hidden_size=24, num_attention_heads=2, vocab_size=64, seq_length=16,
                  num_moe_experts=4, moe_ffn_hidden_size=16, moe_layer_freq=(0, 1))


def test_every_layer_is_built_as_itself_and_experts_are_sharded_by_ep():
    h, v, s, f, fm, e = 24, 64, 16, 4 * 24, 16, 4
    embedding = v * h + s * h
    attention = 2 * h + (3 * h * h + 3 * h) + (h * h + h) + 2 * h  # input norm, qkv, proj, pre-MLP norm
    dense_mlp = (h * f + f) + (f * h + h)
    expert = (h * fm + fm) + (fm * h + h)
    head = 2 * h + h * v
    for ep in (1, 2, 4):
        params = rank_parameters(MOE.replace(expert_model_parallel_size=ep), first=True, last=True, num_layers=2)
        local = e // ep * expert
        assert sum(p.numel for p in params) == embedding + attention + dense_mlp + attention + e * h + local + head
        # Megatron marks the routed experts' weights allreduce=False only under expert parallelism
        assert sum(p.numel for p in params if p.expert) == (local if ep > 1 else 0)
        assert {p.name.split(".mlp.")[1].split(".")[0] for p in params if p.expert} <= {"experts"}
    # a chunk of the second layer alone is an MoE layer, named from 0 as in its own module
    tail = rank_parameters(MOE, first=False, last=True, num_layers=1, layer_offset=1, pipelined=True)
    assert [p.name for p in tail][8] == "layers.0.mlp.router.weight"
    built = sum(p.numel() for p in build_model(MOE).parameters())
    assert sum(p.numel for p in rank_parameters(MOE, first=True, last=True, num_layers=2)) == built


def test_expert_parameters_have_their_own_buffer_sharded_over_the_expert_data_parallel_ranks():
    # dp=4, ep=2: the dense buffer is sharded 4 ways, the experts' 2 ways (tp x cp x dp / ep); rank g holds dense
    # shard g and expert shard g // 2 (NOTE [expert parameters])
    job = Job.build(MOE, precision="bf16", ep=2, dp=4, distributed_optimizer=True)
    assert job.expert_data_parallel == 2
    params = rank_parameters(job.model, first=True, last=True, num_layers=2)
    state = rank_state(job, [params])
    dense, expert = state.layouts
    assert (dense.expert, expert.expert) == (False, True)
    assert dense == buffer_layout([p for p in params if not p.expert], distributed_optimizer=True, dp_size=4)
    assert expert.numel == buffer_layout([p for p in params if p.expert], distributed_optimizer=True,
                                         dp_size=2).numel
    per_rank = [shard_elements(dense, 4, g) + shard_elements(expert, 2, g // 2) for g in range(4)]
    assert state.shard_elements == max(per_rank) and state.dp_rank == per_rank.index(max(per_rank))
    assert (state.ep_rank, state.expert_dp_rank) == (state.dp_rank % 2, state.dp_rank // 2)
    assert state.gradients == 4 * (dense.numel + expert.numel)
    assert state.master_parameters == 4 * state.shard_elements and state.optimizer_state == 8 * state.shard_elements
    # with ep = 1 the experts stay in the dense buffer, as in Megatron
    assert len(rank_state(Job.build(MOE, precision="bf16", dp=4, distributed_optimizer=True),
                          [rank_parameters(MOE, first=True, last=True, num_layers=2)]).layouts) == 1


def test_deepseek_v3_per_rank_state_at_ep64():
    # the published size (671B), and a middle pipeline stage of 4 MoE layers at ep=64, dp=64: each rank holds 4 of
    # the 256 routed experts per layer and the whole MLA attention, shared expert and router
    model = get_preset("deepseek-v3")
    assert round(sum(p.numel for p in rank_parameters(model, first=True, last=True, num_layers=61)) / 1e9) == 671
    job = Job.build(model, precision="bf16", ep=64, dp=64, distributed_optimizer=True)
    params = rank_parameters(job.model, first=False, last=False, num_layers=4, layer_offset=20, pipelined=True)
    h, f = 7168, 2048
    mla = h * 1536 + 1536 + 1536 * 128 * 192 + h * 576 + 512 + 512 * 128 * 256 + 128 * 128 * h
    layer = 2 * h + mla + 256 * h + 3 * h * f + 4 * 3 * h * f  # norms, MLA, router, shared expert, 4 experts
    assert sum(p.numel for p in params) == 4 * layer
    assert sum(p.numel for p in params if p.expert) == 4 * 4 * 3 * h * f
    state = rank_state(job, [params])
    assert 17 * 2 ** 30 < state.total < 17.5 * 2 ** 30  # 2 + 4 bytes per parameter, 12 per sharded element


def test_distributed_optimizer_instances_shard_over_the_intra_instance_group():
    # megatron/core/parallel_state.py: dp x cp ranks split into `instances` consecutive groups, each holding a whole
    # sharded optimizer; buffers are laid out (and padded) over the intra-instance group
    params = [ParamInfo("w", 1000), ParamInfo("b", 24)]
    one = Job.build(ModelConfig(), precision="bf16", dp=4, distributed_optimizer=True)
    two = one.replace(distributed_optimizer_instances=2)
    assert (one.optimizer_shards, two.optimizer_shards) == (4, 2)
    a, b = rank_state(one, [params]), rank_state(two, [params])
    layout = buffer_layout(params, distributed_optimizer=True, dp_size=2)
    assert b.gradients == layout.numel * 4 and b.shard_elements == max(shard_elements(layout, 2, r) for r in (0, 1))
    assert b.master_parameters == 4 * b.shard_elements > a.master_parameters
    assert two.to_megatron_args().count("--num-distributed-optimizer-instances") == 1
    assert Job.from_megatron_args(two.to_megatron_args()) == two
    with pytest.raises(ValueError, match="--num-distributed-optimizer-instances"):
        one.replace(distributed_optimizer_instances=3)
