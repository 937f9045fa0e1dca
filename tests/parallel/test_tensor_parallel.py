"""Tensor/sequence parallelism: per-rank prediction and real gloo runs (the launcher's failure and timeout
handling, shared with pipeline runs, is tested in test_pipeline.py)."""

from __future__ import annotations

import pytest
import torch

from remat import ApplyError, ConfigError, ModelConfig, Policy, apply
from remat.memory.predict import predict_config
from remat.models.tensor_parallel import SimulatedGroup, build_tp_model
from remat.parallel.tensor import measure_tensor_parallel_many

TINY = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, micro_batch_size=2,
                   vocab_size=128)
LLAMA = TINY.replace(activation="swiglu", normalization="rmsnorm", position="rope", num_query_groups=2,
                     attention="sdpa", hidden_dropout=0.0, attention_dropout=0.0)


def _layer_param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.layers.parameters())


@pytest.mark.parametrize("config", [TINY, LLAMA], ids=["gpt", "llama"])
def test_rank_holds_its_share_of_the_weights(config):
    plain = build_tp_model(config, SimulatedGroup(1))
    half = build_tp_model(config, SimulatedGroup(2))
    # norms (and the row-parallel biases) are replicated; every matrix is split in two
    norms = sum(p.numel() * p.element_size() for n, p in plain.layers.named_parameters()
                if "layernorm" in n or n.endswith(("linear_proj.bias", "linear_fc2.bias")))
    assert _layer_param_bytes(half) == (_layer_param_bytes(plain) - norms) // 2 + norms


@pytest.mark.parametrize("tp, sp, policy", [
    (2, False, "none"), (2, True, "full/uniform/3"), (4, True, "full/block/2"),
    (2, True, "selective/core_attn+mlp"), (2, False, "full/uniform/2,distribute"), (4, False, "full/uniform/1"),
    (2, True, "selective/non_matmul"), (2, False, "selective/core_attn+non_matmul"),
])
def test_composed_rank_prediction_equals_full_trace(tp, sp, policy):
    config = TINY.replace(num_layers=10)
    composed = predict_config(config, policy, tp=tp, sp=sp)
    full = predict_config(config, policy, tp=tp, sp=sp, compose_layers=False)
    assert "composition_refused" not in composed.meta
    assert composed.num_events == full.num_events
    assert (composed.live_bytes() == full.live_bytes()).all()
    assert composed.at_peak == full.at_peak


def test_sequence_parallel_and_distribution_keep_a_shard_of_each_group_input():
    config = TINY.replace(num_layers=8, seq_length=64)
    b, s, h, layers = config.micro_batch_size, config.seq_length, config.hidden_size, config.num_layers
    hidden, mask = b * s * h * 4, s * s  # fp32 hidden states; the causal mask is one bool per (query, key)

    def kept(**kwargs) -> int:
        timeline = predict_config(config, kwargs.pop("policy", "full/uniform/1"), tp=2, **kwargs)
        end_of_forward = max(e - 1 for p, _, e in timeline.phase_spans() if p.kind == "forward")
        return timeline.breakdown(end_of_forward)["group_inputs"]

    assert kept() == layers * hidden + mask
    assert kept(sp=True) == layers * hidden // 2 + mask
    assert kept(policy="full/uniform/1,distribute") == layers * hidden // 2 + mask


@pytest.mark.parametrize("field, changes", [
    ("num_attention_heads", dict(num_attention_heads=2, hidden_size=64)),
    ("num_query_groups", dict(num_query_groups=2)),
    ("ffn_hidden_size", dict(ffn_hidden_size=66)),
    ("vocab_size", dict(vocab_size=130)),
])
def test_tp_that_does_not_divide_is_refused_by_field(field, changes):
    with pytest.raises(ConfigError, match=field):
        predict_config(TINY.replace(**changes), "none", tp=4)


def test_sp_and_distribution_refusals():
    with pytest.raises(ConfigError, match="tp > 1"):
        predict_config(TINY, "none", tp=1, sp=True)
    with pytest.raises(ApplyError, match="tp > 1"):
        apply(build_tp_model(TINY, SimulatedGroup(1)), "full/uniform/1,distribute")
    with pytest.raises(ApplyError, match="sequence parallelism"):
        apply(build_tp_model(TINY, SimulatedGroup(2), sp=True), "full/uniform/1,distribute")
    with pytest.raises(ApplyError, match="reentrant"):
        apply(build_tp_model(TINY, SimulatedGroup(2)), Policy.parse("full/uniform/1,distribute@non-reentrant"))


@pytest.mark.parametrize("sp, policies", [(False, ["none", "full/uniform/2,distribute"]),
                                          (True, ["full/uniform/1", "selective/core_attn", "selective/non_matmul"])])
def test_real_two_rank_runs_match_prediction(sp, policies):
    losses = []
    # one launch measures every policy (each rank rebuilds its model for each); the plan path is test_plan.py's
    for policy, ranks in zip(policies, measure_tensor_parallel_many(TINY, policies, tp=2, sp=sp, timeout=240)):
        predicted = predict_config(TINY, policy, tp=2, sp=sp)
        for timeline in ranks:
            assert abs(timeline.peak_bytes / predicted.peak_bytes - 1) <= 0.02
        losses.append([t.meta["loss"] for t in ranks])
    # recompute (and distributing its inputs) changes no value: same loss on every rank and policy
    assert all(rank_losses == losses[0] for rank_losses in losses) and losses[0][0] == losses[0][1]
