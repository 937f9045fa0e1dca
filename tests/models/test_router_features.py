"""Megatron's router options in remat's reference MoE, parsed and written back: ``--moe-router-dtype`` under expert
tensor parallelism (the combine's reduce-scatter in the probabilities' dtype, token_dispatcher.py:829-833),
``--moe-router-pre-softmax``, ``--moe-router-enable-expert-bias``, ``--moe-z-loss-coeff`` and group-limited
routing (router.py, moe_utils.py: what each keeps)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from moe_fixtures import MOE, Allocations

from remat.config import ConfigError, ModelConfig
from remat.job import Job, JobError, parse_megatron_args
from remat.models.moe import MoELayer
from remat.models.tp_layers import SimulatedGroup
from remat.models.tp_moe import TPMoELayer
from remat.parallel.job_predict import predict_stage
from remat.parallel.stages import BUFFERS

BASE = ("--num-layers 2 --hidden-size 24 --num-attention-heads 2 --seq-length 16 --micro-batch-size 2 "
        "--padded-vocab-size 64 --bf16 --num-experts 4 --moe-ffn-hidden-size 16 --disable-bias-linear "
        "--moe-token-dispatcher-type alltoall")
ALLTOALL = MOE.replace(moe_token_dispatcher_type="alltoall", add_bias_linear=False)  # etp > 1 takes no biases


def test_an_fp32_router_sums_the_expert_shards_in_fp32():
    # etp = tp = 2, ep = 1: 8 x 2 = 16 local tokens x topk 2 = 32 copies, gathered over etp to 64 rows of h = 24;
    # combine_preprocess casts the fc2 partial sums to fp32 [64, 24] and reduce-scatters them to fp32 [32, 24]
    layer = TPMoELayer(ALLTOALL.replace(moe_router_dtype="fp32"), 0, SimulatedGroup(2), True).to(torch.bfloat16)
    x = torch.randn(8, 2, 24, dtype=torch.bfloat16, requires_grad=True)
    with Allocations() as seen:
        out = layer(x)
    fp32_rows = {((64, 24), torch.float32), ((32, 24), torch.float32)}
    assert fp32_rows <= set(seen.made)
    assert out.dtype == torch.bfloat16
    with Allocations() as plain:
        TPMoELayer(ALLTOALL, 0, SimulatedGroup(2), True).to(torch.bfloat16)(x)
    assert not fp32_rows & set(plain.made)  # a model-dtype router sums in bf16
    out.sum().backward()
    assert x.grad.dtype == torch.bfloat16


def test_the_router_dtype_flag_sets_the_field_and_round_trips():
    job, ignored = parse_megatron_args(f"{BASE} --moe-router-dtype fp32")
    assert job.model.moe_router_dtype == "fp32" and "--moe-router-dtype" not in ignored
    assert parse_megatron_args(job.to_megatron_args())[0] == job
    assert parse_megatron_args(BASE)[0].model.moe_router_dtype is None


def _saved(config: ModelConfig) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """What one bf16 MoE layer's router keeps for backward (shape, dtype), 2 x 16 = 32 tokens of 4 experts."""
    router = MoELayer(config, 0).to(torch.bfloat16).router
    kept: list[tuple[tuple[int, ...], torch.dtype]] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append((tuple(t.shape), t.dtype)) or t, lambda t: t):
        router(torch.randn(32, 24, dtype=torch.bfloat16, requires_grad=True))
    return kept


def test_pre_softmax_keeps_the_fp32_softmax_over_every_expert():
    # moe_utils.py:877-883: softmax(logits, dtype=fp32) [T, E] saved (its backward and the top-k's); the default
    # fp32 softmax runs on the top-k logits [T, topk], and its output is what it keeps (the logits are not kept:
    # torch.topk saves its indices alone; tests/megatron/test_megatron_router.py checks all against Megatron's)
    pre, default = _saved(ALLTOALL.replace(moe_router_pre_softmax=True)), _saved(ALLTOALL)
    assert ((32, 4), torch.float32) in pre and ((32, 2), torch.float32) not in pre
    assert ((32, 4), torch.float32) not in default and ((32, 2), torch.float32) in default
    assert ((32, 4), torch.bfloat16) not in default


def test_expert_bias_is_two_fp32_buffers_and_sigmoid_scores_over_every_expert():
    config = ALLTOALL.replace(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    router = MoELayer(config, 0).router
    assert router.expert_bias is not None and router.local_tokens_per_expert is not None
    assert (router.expert_bias.dtype, tuple(router.expert_bias.shape)) == (torch.float32, (4,))
    assert [n for n, _ in router.named_parameters()] == ["weight"]  # buffers, not parameters: no optimizer state
    assert "local_tokens_per_expert" not in router.state_dict()  # persistent=False, as router.py:181
    # moe_utils.py:890-902: sigmoid(logits.float()) [T, E] fp32 kept; the biased copy only chooses
    assert ((32, 4), torch.float32) in _saved(config)
    with pytest.raises(ConfigError, match="sigmoid"):
        ALLTOALL.replace(moe_router_enable_expert_bias=True)


def test_z_loss_keeps_the_logsumexp():
    # moe_utils.py:170-182: logsumexp(logits) [T] (saved by the square), then the mean x coefficient
    assert ((32,), torch.bfloat16) in _saved(ALLTOALL.replace(moe_z_loss_coeff=1e-3))
    assert ((32,), torch.bfloat16) not in _saved(ALLTOALL)


def test_the_routing_flags_set_the_fields_and_round_trip():
    job, _ = parse_megatron_args(f"{BASE} --moe-router-pre-softmax --moe-z-loss-coeff 1e-3")
    assert (job.model.moe_router_pre_softmax, job.model.moe_z_loss_coeff) == (True, 1e-3)
    biased, _ = parse_megatron_args(f"{BASE} --moe-router-score-function sigmoid --moe-router-enable-expert-bias")
    assert biased.model.moe_router_enable_expert_bias
    for j in (job, biased):
        assert parse_megatron_args(j.to_megatron_args())[0] == j
    with pytest.raises(JobError, match="--moe-router-score-function sigmoid"):
        parse_megatron_args(f"{BASE} --moe-router-enable-expert-bias")


def test_group_limited_routing_keeps_its_expert_mask():
    # moe_utils.py group_limited_topk: masked_fill keeps its bool [T, E] mask; the group scores' top-ks save their
    # indices too, freed on return (that branch's graph reaches no output)
    grouped = ALLTOALL.replace(moe_router_num_groups=2, moe_router_group_topk=1)
    assert Counter(_saved(grouped)) - Counter(_saved(ALLTOALL)) == Counter(
        {((32, 4), torch.bool): 1, ((32, 2, 2), torch.int64): 1, ((32, 1), torch.int64): 1})
    assert not Counter(_saved(ALLTOALL)) - Counter(_saved(grouped))
    job, ignored = parse_megatron_args(f"{BASE} --moe-router-num-groups 2 --moe-router-group-topk 1")
    assert (job.model.moe_router_num_groups, job.model.moe_router_group_topk) == (2, 1)
    assert parse_megatron_args(job.to_megatron_args())[0] == job
    # the groups alone choose nothing (Megatron reads them only with a group top-k)
    alone, _ = parse_megatron_args(f"{BASE} --moe-router-num-groups 2")
    assert alone.model.moe_router_num_groups is None
    with pytest.raises(JobError, match="moe_router_num_groups"):
        parse_megatron_args(f"{BASE} --moe-router-group-topk 1")
    with pytest.raises(JobError, match="split the 4 experts evenly"):
        parse_megatron_args(f"{BASE} --moe-router-num-groups 3 --moe-router-group-topk 1")


def test_router_buffers_stay_resident_beside_the_parameters_megatron_buffers():
    # the recorder names a module's buffers "<module> buffers": Megatron's DDP and distributed optimizer move the
    # parameters into their param_data buffer, never the router's expert_bias / local_tokens_per_expert
    config = ALLTOALL.replace(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                              dtype="bf16", add_bias_linear=False)
    for dist in (False, True):
        job = Job.build(config, precision="bf16", dp=2, distributed_optimizer=dist)
        tl = predict_stage(job, 0, kernels="te", device="cuda").timeline
        rows = [n for n, m, c in zip(tl.nbytes, tl.module, tl.category) if m.endswith(BUFFERS)]
        moe_layers = sum(config.moe_layer_pattern())
        assert rows == [512] * (2 * moe_layers)  # two fp32 [E] tensors per router, a 512-byte block each
