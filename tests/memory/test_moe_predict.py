"""MoE and MLA models predicted against measured, to the byte on CPU: balanced routing forced in both runs, real
(skewed) routing measured against a prediction given the measured counts, the capacity assumption, and deep stacks
mixing dense and MoE layers composed from shallow traces."""

from __future__ import annotations

import pytest
import torch

from remat.config import ModelConfig
from remat.memory.measure import measure
from remat.memory.predict import predict_config, trace
from remat.models.gpt import build_model, sample_batch
from remat.recompute.apply import apply
from remat.timeline import Timeline

BASE = ModelConfig(num_layers=3, hidden_size=32, num_attention_heads=4, seq_length=16, micro_batch_size=2,
                   vocab_size=64)
DEEPSEEK_LIKE = BASE.replace(
    num_moe_experts=4, moe_grouped_gemm=True, activation="swiglu", moe_shared_expert_intermediate_size=16,
    moe_layer_freq=(0, 1, 1), moe_aux_loss_coeff=0.01, moe_router_score_function="sigmoid",
    multi_latent_attention=True, position="rope", normalization="rmsnorm", q_lora_rank=16, kv_lora_rank=8,
    qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8, moe_routing_assumption="balanced")
MIXTRAL_LIKE = BASE.replace(num_moe_experts=4, moe_ffn_hidden_size=24, num_query_groups=2, dtype="bf16",
                            moe_routing_assumption="balanced")


def assert_same_timeline(predicted: Timeline, measured: Timeline) -> None:
    for name in ("nbytes", "alloc_at", "free_at", "category", "module"):
        assert getattr(predicted, name) == getattr(measured, name), name
    assert predicted.peak_bytes == measured.peak_bytes and predicted.at_peak == measured.at_peak


def measured(config: ModelConfig, policy: str, model: torch.nn.Module | None = None) -> Timeline:
    model = model if model is not None else build_model(config)
    apply(model, policy)
    torch.manual_seed(0)
    return measure(model, sample_batch(config))


@pytest.mark.parametrize("config,policy", [
    (DEEPSEEK_LIKE, "none"), (DEEPSEEK_LIKE, "selective/moe_act"), (DEEPSEEK_LIKE, "selective/mla_up_proj"),
    (DEEPSEEK_LIKE, "selective/moe@non-reentrant"), (DEEPSEEK_LIKE, "selective/shared_experts+core_attn"),
    (DEEPSEEK_LIKE, "full/uniform/2"), (MIXTRAL_LIKE, "none"), (MIXTRAL_LIKE, "selective/moe"),
    (MIXTRAL_LIKE, "full/block/1@non-reentrant")])
def test_predicted_equals_measured_with_balanced_routing(config: ModelConfig, policy: str) -> None:
    real = measured(config, policy)
    fake = trace(config, policy)
    assert_same_timeline(fake, real)
    assert real.meta["moe_routing"] == fake.meta["moe_routing"]
    assert fake.meta["moe_routing"]["assumption"] == "balanced"


def skewed_model(config: ModelConfig) -> torch.nn.Module:
    """Routers that score every expert alike: top-k breaks the ties the same way for every token, so two experts
    take every token and the other two none."""
    model = build_model(config)
    with torch.no_grad():
        for layer in model.layers:
            router = getattr(layer.mlp, "router", None)
            if router is not None:
                router.weight.zero_()
    return model


@pytest.mark.parametrize("policy,capacity_factor,kept", [("none", None, 32), ("selective/moe_act", None, 32),
                                                          ("none", 1.0, 16), ("selective/moe", 1.0, 16)])
def test_skewed_routing_measured_equals_prediction_given_its_counts(policy: str, capacity_factor: float | None,
                                                                    kept: int) -> None:
    config = DEEPSEEK_LIKE.replace(moe_routing_assumption=None, moe_expert_capacity_factor=capacity_factor)
    real = measured(config, policy, skewed_model(config))
    routing = real.meta["moe_routing"]
    assert routing["assumption"] == "measured"
    counts = [routing["tokens_per_expert"][str(i)] for i in (1, 2)]
    # 32 tokens, top-2 (balanced: 16 each); a capacity factor of 1 drops what exceeds 16 per expert
    assert [sorted(c) for c in counts] == [[0, 0, kept, kept]] * 2
    text = "counts:" + ";".join(",".join(map(str, c)) for c in counts)
    fake = predict_config(config.replace(moe_routing_assumption=text), policy)
    assert fake.meta["moe_routing"]["assumption"] == text
    assert_same_timeline(fake, real)
    # On one rank only the total of the counts sets the routed tokens' bytes (one grouped buffer for all experts):
    # the skew alone changes nothing; the tokens it drops do.
    balanced = predict_config(config.replace(moe_routing_assumption="balanced"), policy)
    assert (balanced.nbytes == fake.nbytes) == (kept == 32)


def test_capacity_assumption_fills_every_expert() -> None:
    balanced = trace(DEEPSEEK_LIKE, "none")
    full = trace(DEEPSEEK_LIKE.replace(moe_routing_assumption="capacity:2"), "none")
    assert full.meta["moe_routing"]["tokens_per_expert"]["1"] == [32] * 4  # 32 tokens x top-2 / 4 experts x 2
    assert full.at_peak["saved_activations"] > balanced.at_peak["saved_activations"]


def test_fake_runs_assume_balanced_routing_by_default() -> None:
    config = DEEPSEEK_LIKE.replace(moe_routing_assumption=None)
    assert trace(config, "none").meta["moe_routing"]["tokens_per_expert"]["2"] == [16, 16, 16, 16]


@pytest.mark.parametrize("freq", [(0, 0, 1, 1, 1, 1, 1), 2])
@pytest.mark.parametrize("policy", ["none", "full/uniform/1", "full/block/2", "selective/moe_act+mla_up_proj",
                                    "selective/moe+mlp"])
def test_mixed_dense_and_moe_stacks_compose_exactly(freq: object, policy: str) -> None:
    config = DEEPSEEK_LIKE.replace(num_layers=7, moe_layer_freq=freq)
    composed = predict_config(config, policy)
    # first dense layers: always composed; alternating layers: when a stand-in of at most 16 layers has every role
    assert "composed_from" in composed.meta or (freq == 2 and policy == "full/block/2")
    assert_same_timeline(composed, trace(config, policy))


def test_expert_parallelism_predicts_one_rank_of_the_experts() -> None:
    # remat.models.expert_parallel: a simulated rank holds half the experts (tests/parallel/test_expert_parallel.py
    # checks it against real gloo ranks)
    whole, half = (predict_config(MIXTRAL_LIKE.replace(expert_model_parallel_size=ep), "none") for ep in (1, 2))
    params = [sum(n for n, c in zip(tl.nbytes, tl.category) if c == "parameters") for tl in (whole, half)]
    assert params[1] < params[0]
