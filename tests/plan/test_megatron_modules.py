"""The Megatron sweep of MoE and MLA models (remat.plan.megatron.megatron_modules): each of Megatron's MoE/MLA
recompute modules the model has is listed, alone, in Megatron's rules (moe_act needs grouped-GEMM experts,
shared_experts a shared expert, mla_up_proj MLA, mlp a dense layer); a dense model's sweep is unchanged."""

from __future__ import annotations

from remat.config import ModelConfig
from remat.plan.megatron import MEGATRON_MODULES, megatron_modules, megatron_policies, megatron_sweep

BASE = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=64)
MOE = BASE.replace(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32)


def test_a_dense_model_keeps_the_dense_sweep() -> None:
    assert megatron_modules(BASE) == megatron_modules(None) == (MEGATRON_MODULES, ())
    assert megatron_sweep(4, config=BASE) == megatron_sweep(4)


def test_each_moe_and_mla_module_is_swept_where_the_model_has_it() -> None:
    assert megatron_modules(MOE) == (("core_attn", "layernorm"), ("moe",))  # no dense layer: mlp acts on nothing
    grouped = MOE.replace(moe_grouped_gemm=True, moe_shared_expert_intermediate_size=16, moe_layer_freq=(0, 1, 1, 1))
    assert megatron_modules(grouped) == (MEGATRON_MODULES, ("moe_act", "moe", "shared_experts"))
    mla = grouped.replace(multi_latent_attention=True, position="rope", q_lora_rank=16, kv_lora_rank=8, qk_head_dim=8,
                          qk_pos_emb_head_dim=4, v_head_dim=8)
    assert megatron_modules(mla)[1] == ("moe_act", "moe", "shared_experts", "mla_up_proj")
    names = megatron_sweep(4, config=mla)
    assert names[-4:] == ["selective/moe_act", "selective/moe", "selective/shared_experts", "selective/mla_up_proj"]
    policies = megatron_policies(4, config=mla)
    assert len(policies) == 1 + 2 * 4 + 2 ** 3 - 1 + 4 and len(set(policies)) == len(policies)
