"""remat plan on an MoE model searches Megatron's MoE recompute modules (remat.plan.moe_modules): the chosen plan,
applied and measured on CPU (balanced routing forced), fits the budget and is its prediction to the byte."""

from __future__ import annotations

import torch

from remat import apply, build_model, measure, sample_batch
from remat.config import ModelConfig
from remat.plan.api import plan
from remat.plan.job_stages import kind_config
from remat.plan.moe_modules import job_policies, moe_mla_sets, on_every_layer, on_layer
from remat.policy import Policy
from remat.recompute.plan_format import Unit

MOE = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, micro_batch_size=2,
                  vocab_size=64, num_moe_experts=2, moe_router_topk=1, moe_ffn_hidden_size=64,
                  moe_routing_assumption="balanced")


def test_the_search_lists_each_megatron_moe_setting_the_model_has() -> None:
    assert moe_mla_sets(MOE) == (("moe",), ("core_attn", "moe"), ("layernorm", "moe"),
                                 ("core_attn", "layernorm", "moe"))  # no dense layer: mlp acts on nothing
    deepseek = MOE.replace(num_layers=3, moe_layer_freq=(0, 1, 1), moe_grouped_gemm=True, activation="swiglu",
                           moe_shared_expert_intermediate_size=16, multi_latent_attention=True, position="rope",
                           q_lora_rank=16, kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8)
    sets = moe_mla_sets(deepseek)
    # every subset of the 7 modules Megatron accepts here but the 8 of the dense modules alone (the dense sweep's)
    assert len(sets) == len(set(sets)) == 2 ** 7 - 2 ** 3
    assert ("core_attn", "mlp", "layernorm", "moe", "mla_up_proj") in sets
    assert ("moe_act", "shared_experts", "mla_up_proj") in sets and ("moe_act", "moe", "shared_experts") in sets
    assert on_layer(("mlp", "moe", "mla_up_proj"), deepseek.with_depth(1)) == ("mlp", "mla_up_proj")
    # a stage mixing dense and MoE layers takes only units apply accepts on either (act is the dense MLP's)
    kinds = (kind_config(deepseek, False), kind_config(deepseek, True))
    assert on_every_layer(Unit("selective", 1, ("core_attn", "mlp", "mla_up_proj")), kinds)
    assert not any(on_every_layer(Unit("selective", 1, (m,)), kinds) for m in ("act", "moe", "moe_act"))
    assert Policy.parse("selective/mla_up_proj+moe") in job_policies(4, "reentrant", deepseek)
    dense = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=64)
    assert job_policies(4, "reentrant", None) == job_policies(4, "reentrant", dense)


def test_the_chosen_moe_plan_measures_as_predicted_within_the_budget() -> None:
    budget = 340_000  # between selective/moe's peak and nothing recomputed's (359,560 bytes)
    result = plan(MOE, budget)
    assert str(result.megatron.policy or result.megatron.plan.megatron_policy()[0]) == "selective/moe"
    chosen = result.extended
    assert "moe" in str(chosen.plan) and chosen.cost <= result.megatron.cost
    model = build_model(MOE)
    apply(model, chosen.plan)
    torch.manual_seed(0)
    real = measure(model, sample_batch(MOE))
    assert real.peak_bytes == chosen.peak_bytes <= budget
