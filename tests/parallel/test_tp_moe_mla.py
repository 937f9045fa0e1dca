"""Tensor (and sequence) parallel MoE and MLA layers (remat.models.tp_moe, remat.models.tp_mla): their values and
gradients against the unsplit layers over two thread ranks, one simulated rank's real run against its fake trace
under the MoE/MLA recompute modules, and the refusals."""

from __future__ import annotations

import contextlib

import pytest
import torch
from thread_ranks import Mailbox, ThreadCounts, ThreadTP, run_ranks

from remat.config import ConfigError, ModelConfig
from remat.job import Job, JobError, parse_megatron_args
from remat.memory.measure import measure
from remat.memory.predict import predict_config
from remat.models.expert_parallel import (
    SimulatedExpertGroup,
    expert_parallel_group,
    expert_tensor_parallel_group,
)
from remat.models.gpt import rotary_tables, sample_batch
from remat.models.mla import MLASelfAttention
from remat.models.moe import MoELayer
from remat.models.tensor_parallel import SimulatedGroup, build_tp_model
from remat.models.tp_mla import TPMLASelfAttention
from remat.models.tp_moe import TPMoELayer
from remat.parallel.job_predict import predict_job, stage_state
from remat.recompute.apply import apply

MOE = ModelConfig(num_layers=3, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16,
                  micro_batch_size=2, num_moe_experts=4, moe_ffn_hidden_size=16, moe_layer_freq=(0, 1, 1),
                  moe_shared_expert_intermediate_size=8, activation="swiglu", normalization="rmsnorm",
                  position="rope", add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0)
MLA = MOE.replace(multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=16, qk_head_dim=8,
                  qk_pos_emb_head_dim=4, v_head_dim=8)


# ------------------------------------------------------------------------------------------------ two thread ranks
def _run_ranks(size, fn):
    boxes = [Mailbox(size) for _ in range(2)]
    return run_ranks(size, boxes, lambda r: fn(ThreadTP(boxes[0], r), ThreadCounts(boxes[1], r)))


def _shard(full: torch.Tensor, r: int, t: int, dim: int, gated: bool = False) -> torch.Tensor:
    """Rank r's column/row shard of ``full`` along ``dim``; gated: the gate and the up halves each."""
    halves = full.chunk(2, dim) if gated else (full,)
    return torch.cat([h.chunk(t, dim)[r] for h in halves], dim)


# NOTE [why allclose]: the row-parallel fc2 / output projection gives each rank a partial sum that the reduction
# adds (a + b) where the unsplit layer accumulates inside one matmul, and a replicated weight's gradient is the
# sum of the ranks' token-shard gradients: rounding differs in the last bits, so values are compared with
# allclose; everything else (shapes, which rows, which parameters) is exact.
@pytest.mark.parametrize("grouped", [True, False])
def test_tp2_sp_moe_layer_equals_the_unsplit_layer(grouped):
    config = MOE.replace(moe_grouped_gemm=grouped)
    torch.manual_seed(0)
    full = MoELayer(config, 0)
    x = torch.randn(32, 32, requires_grad=True)
    weight = torch.randn(32, 32)
    out = full(x)
    (out * weight).sum().backward()
    fp = dict(full.named_parameters())

    def rank(tp, counts):
        r = tp.rank
        with expert_tensor_parallel_group(tp, counts):
            layer = TPMoELayer(config, 0, tp, sp=True)
        with torch.no_grad():
            for name, p in layer.named_parameters():
                src = fp[name]
                if name.startswith("experts."):  # fc1 column-parallel (gate and up each), fc2 row-parallel
                    fc1 = "linear_fc1" in name
                    dim = (2 if fc1 else 1) if grouped else (0 if fc1 else 1)
                    src = _shard(src, r, 2, dim, gated=fc1)
                elif name.startswith("shared_experts."):
                    fc1 = "linear_fc1" in name
                    src = _shard(src, r, 2, 0 if fc1 else 1, gated=fc1)
                p.copy_(src)
        xr = x.detach()[16 * r:16 * r + 16].clone().requires_grad_()
        y = layer(xr)
        (y * weight[16 * r:16 * r + 16]).sum().backward()
        return y.detach(), xr.grad, {n: p.grad for n, p in layer.named_parameters()}, layer.last_received

    results = _run_ranks(2, rank)
    counts = full.router.last_counts
    for r, (y, grad, grads, received) in enumerate(results):
        assert received == counts  # every copy of every expert reaches both etp ranks (gathered over etp)
        torch.testing.assert_close(y, out.detach()[16 * r:16 * r + 16])
        torch.testing.assert_close(grad, x.grad[16 * r:16 * r + 16])
        for name, g in grads.items():
            if name.startswith(("experts.", "shared_experts.")):
                fc1 = "linear_fc1" in name
                dim = (2 if fc1 else 1) if grouped and name.startswith("experts.") else (0 if fc1 else 1)
                torch.testing.assert_close(g, _shard(fp[name].grad, r, 2, dim, gated=fc1))
    torch.testing.assert_close(results[0][2]["router.weight"] + results[1][2]["router.weight"],
                               fp["router.weight"].grad)


@pytest.mark.parametrize("sp", [True, False])
def test_tp2_mla_equals_the_unsplit_attention(sp):
    torch.manual_seed(0)
    full = MLASelfAttention(MLA)
    b, s, h = 2, 16, 32
    x = torch.randn(b, s, h, requires_grad=True)
    weight = torch.randn(b, s, h)
    mask = torch.ones(s, s, dtype=torch.bool).tril_().view(1, 1, s, s)
    rotary = rotary_tables(MLA, s, torch.device("cpu"))
    out = full(x, mask, rotary)
    (out * weight).sum().backward()
    fp = dict(full.named_parameters())
    split = {"up_proj.linear_q_up_proj.weight": 0, "up_proj.linear_kv_up_proj.weight": 0, "linear_proj.weight": 1}

    def rank(tp, _):
        r = tp.rank
        layer = TPMLASelfAttention(MLA, tp, sp)
        with torch.no_grad():
            for name, p in layer.named_parameters():
                p.copy_(_shard(fp[name], r, 2, split[name]) if name in split else fp[name])
        rows = slice(16 * r, 16 * r + 16)
        xr = (x.detach().reshape(b * s, h)[rows] if sp else x.detach()).clone().requires_grad_()
        y = layer(xr, mask, rotary, (b, s))
        (y * (weight.reshape(b * s, h)[rows] if sp else weight)).sum().backward()
        return y.detach(), xr.grad, {n: p.grad for n, p in layer.named_parameters()}

    results = _run_ranks(2, rank)
    for r, (y, grad, grads) in enumerate(results):
        rows = slice(16 * r, 16 * r + 16)
        torch.testing.assert_close(y, out.detach().reshape(b * s, h)[rows] if sp else out.detach())
        torch.testing.assert_close(grad, x.grad.reshape(b * s, h)[rows] if sp else x.grad)
        for name in split:
            torch.testing.assert_close(grads[name], _shard(fp[name].grad, r, 2, split[name]))
    for name in fp:
        if name not in split:  # replicated: under SP each rank's gradient covers its tokens (summed over tp)
            got = results[0][2][name] + results[1][2][name] if sp else results[0][2][name]
            torch.testing.assert_close(got, fp[name].grad)


# ------------------------------------------------------------------------------------------------ simulated rank
@pytest.mark.parametrize("config, ep, policy", [
    (MOE, 1, "selective/moe_act"), (MLA, 1, "selective/mla_up_proj+moe"),
    (MLA, 2, "selective/shared_experts+moe_act+mla_up_proj"),
])
def test_tp2_sp_rank_prediction_equals_its_run(config, ep, policy):
    tp = 2
    config = config.replace(moe_grouped_gemm=True, moe_routing_assumption="balanced", expert_model_parallel_size=ep)

    def run(p):
        with expert_parallel_group(SimulatedExpertGroup(ep, 0)) if ep > 1 else contextlib.nullcontext():
            model = build_tp_model(config, SimulatedGroup(tp), sp=True)
        apply(model, p)
        torch.manual_seed(1)
        return model, measure(model, sample_batch(config))

    plain, _ = run("none")
    model, real = run(policy)
    fake = predict_config(config, policy, tp=tp, sp=True, compose_layers=False)
    assert (fake.nbytes, fake.alloc_at, fake.free_at) == (real.nbytes, real.alloc_at, real.free_at)
    # recompute changes no value: gradients bit-identical to no recompute
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), model.parameters()))
    received = [layer.mlp.routing_report()["received_per_local_expert"] for layer in model.layers[1:]]
    # balanced: b*s/tp * topk / experts copies per expert from each of the etp x ep ranks
    assert received == [[16 * 2 // 4 * tp * ep] * (4 // ep)] * 2


# ------------------------------------------------------------------------------------------------ refusals
def test_moe_under_tp_without_sp_and_bias_with_etp_are_refused():
    with pytest.raises(ConfigError, match="--sequence-parallel"):
        predict_config(MOE, "none", tp=2, sp=False)
    with pytest.raises(ConfigError, match="Bias in Moe is only supported when ETP==1.*--disable-bias-linear"):
        build_tp_model(MOE.replace(add_bias_linear=True), SimulatedGroup(2), sp=True)
    with pytest.raises(ConfigError, match="moe_ffn_hidden_size=6 is not divisible.*etp=4"):
        with expert_tensor_parallel_group(SimulatedGroup(4)):
            TPMoELayer(MOE.replace(moe_ffn_hidden_size=6), 0, SimulatedGroup(2), True)


# ------------------------------------------------------------------------------------------------ whole job
def test_a_tp2_sp_ep2_job_prices_the_rank_it_builds():
    model = MLA.replace(moe_grouped_gemm=True, moe_routing_assumption="balanced", attention="sdpa")
    job = Job.build(model, precision="bf16", tp=2, sp=True, ep=2, dp=2)
    rank = predict_job(job).worst
    with expert_parallel_group(SimulatedExpertGroup(2, 0)):
        built = build_tp_model(job.model, SimulatedGroup(2), sp=True)
    assert rank.state.num_parameters == sum(p.numel() for p in built.parameters())
    # etp=1: the rank's two experts whole instead of halved
    experts = sum(p.numel() for n, p in built.named_parameters() if ".mlp.experts." in n)
    assert stage_state(job.replace(etp=1), 0).num_parameters == rank.state.num_parameters + experts
    assert rank.timeline.meta["job"]["tp"] == 2 and rank.peak_bytes > rank.state.total


def test_megatron_flags_for_moe_under_tp_without_sp_are_refused_naming_the_flag():
    base = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 "
            "--padded-vocab-size 64 --bf16 --num-experts 4 --moe-ffn-hidden-size 16 --disable-bias-linear "
            "--moe-token-dispatcher-type alltoall --tensor-model-parallel-size 2 --world-size 2")
    with pytest.raises(JobError, match="tp \\(--tensor-model-parallel-size\\)=2 with MoE layers needs --sequence"):
        parse_megatron_args(base)
    job, _ = parse_megatron_args(base + " --sequence-parallel --expert-tensor-parallel-size 1")
    assert (job.tp, job.sp, job.expert_tp) == (2, True, 1)
    assert parse_megatron_args(job.to_megatron_args())[0] == job
