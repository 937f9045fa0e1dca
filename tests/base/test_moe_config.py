"""MoE and MLA in the base layer: ModelConfig's Megatron-named fields, the routing assumption, the MoE/MLA presets,
and the Megatron recompute modules for them in Policy (text and flags, both ways)."""

from __future__ import annotations

import pytest

from remat.config import ConfigError, ModelConfig, RoutingAssumption
from remat.policy import Policy, PolicyError
from remat.presets import config_from_mapping, get_preset

MOE = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, num_moe_experts=4)


def test_layer_pattern_follows_megatron_moe_layer_freq() -> None:
    assert MOE.moe_layer_pattern() == (True,) * 4
    assert MOE.replace(moe_layer_freq=2).moe_layer_pattern() == (True, False, True, False)
    assert MOE.replace(moe_layer_freq=[0, 1, 1, 1]).moe_layer_freq == (0, 1, 1, 1)
    assert MOE.replace(moe_layer_freq="([0]*1+[1]*3)").moe_layer_pattern() == (False, True, True, True)
    assert ModelConfig(num_layers=2).moe_layer_pattern() == (False, False)
    with pytest.raises(ConfigError, match=r"moe_layer_freq=.*one 0 \(dense\) or 1 \(MoE\) per layer, 4 in all"):
        MOE.replace(moe_layer_freq=(0, 1))
    with pytest.raises(ConfigError, match=r"moe_layer_freq='\[0\]\*x'"):
        MOE.replace(moe_layer_freq="[0]*x")


def test_moe_fields_are_checked_by_name() -> None:
    with pytest.raises(ConfigError, match="moe_router_topk=5 exceeds num_moe_experts=4"):
        MOE.replace(moe_router_topk=5)
    with pytest.raises(ConfigError, match="moe_grouped_gemm=True needs experts: set num_moe_experts"):
        ModelConfig(moe_grouped_gemm=True)
    with pytest.raises(ConfigError, match="moe_router_score_function='relu'"):
        MOE.replace(moe_router_score_function="relu")
    with pytest.raises(ConfigError, match="expert_model_parallel_size=3"):
        MOE.replace(expert_model_parallel_size=3)
    with pytest.raises(ConfigError, match="moe_routing_assumption='counts:1,2': 2 counts for 4 experts"):
        MOE.replace(moe_routing_assumption="counts:1,2")
    with pytest.raises(ConfigError, match="moe_routing_assumption='skewed': write 'balanced'"):
        MOE.replace(moe_routing_assumption="skewed")
    with pytest.raises(ConfigError, match="qk_layernorm='yes'"):
        ModelConfig(qk_layernorm="yes")


def test_mla_rotates_its_own_dimensions_beside_learned_positions() -> None:
    # Megatron's MLA builds its own RotaryEmbedding; GPTModel adds the learned table for learned_absolute
    from remat.models.gpt import build_model, rotary_tables

    mla = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=2, kv_lora_rank=16, qk_head_dim=16,
                      qk_pos_emb_head_dim=8, v_head_dim=16, multi_latent_attention=True, seq_length=16)
    assert mla.position == "learned" and rotary_tables(mla, 16, "cpu")[0].shape == (16, 4)
    assert rotary_tables(mla.replace(multi_latent_attention=False), 16, "cpu") is None
    model = build_model(mla)
    assert model.embedding.position_embeddings is not None
    assert mla.has_qk_norms and not mla.replace(multi_latent_attention=False).has_qk_norms
    plain = build_model(mla.replace(qk_layernorm=False))  # Megatron's MLA without --qk-layernorm: IdentityOp
    names = {n for n, _ in model.named_parameters()} - {n for n, _ in plain.named_parameters()}
    # q_lora_rank None: no q down-projection, so only the kv norm goes
    assert names == {"layers.0.self_attention.kv_layernorm.weight", "layers.0.self_attention.kv_layernorm.bias"}


def test_config_round_trips_through_a_mapping() -> None:
    config = MOE.replace(moe_layer_freq=(0, 1, 1, 1), moe_routing_assumption=" Capacity:1.50 ")
    assert config.moe_routing_assumption == "capacity:1.5"
    assert ModelConfig.from_dict(config.to_dict()) == config
    from_yaml = config_from_mapping({"preset": "mixtral-8x7b", "moe-expert-capacity-factor": 1.0, "num-layers": 2})
    assert from_yaml.moe_expert_capacity_factor == 1.0 and from_yaml.num_layers == 2


def test_routing_assumptions() -> None:
    assert RoutingAssumption.parse("balanced").tokens_per_expert(5, 4, 2, layer=0) == [3, 3, 2, 2]
    assert RoutingAssumption.parse("capacity:1.25").tokens_per_expert(16, 4, 2, layer=0) == [10] * 4
    per_layer = RoutingAssumption.parse("counts:1,2,3,4;4,3,2,1")
    assert per_layer.per_layer and str(per_layer) == "counts:1,2,3,4;4,3,2,1"
    assert per_layer.tokens_per_expert(8, 4, 1, layer=1) == [4, 3, 2, 1]
    with pytest.raises(ConfigError, match="MoE layer 2 has none"):
        per_layer.tokens_per_expert(8, 4, 1, layer=2)
    with pytest.raises(ConfigError, match="an expert would receive 12 tokens, more than the 8"):
        RoutingAssumption.parse("capacity:3").tokens_per_expert(8, 4, 2, layer=0)


def test_with_depth_cuts_or_replaces_the_layer_pattern() -> None:
    config = MOE.replace(moe_layer_freq=(0, 0, 1, 1))
    assert config.with_depth(3).moe_layer_freq == (0, 0, 1)
    assert config.with_depth(2, (True, True)).moe_layer_freq == 1


@pytest.mark.parametrize("name,layers,moe_layers,experts,topk", [
    ("mixtral-8x7b", 32, 32, 8, 2), ("qwen3-30b-a3b", 48, 48, 128, 8), ("deepseek-v3", 61, 58, 256, 8)])
def test_moe_presets_have_their_published_shapes(name: str, layers: int, moe_layers: int, experts: int,
                                                 topk: int) -> None:
    config = get_preset(name)
    assert config.num_layers == layers and sum(config.moe_layer_pattern()) == moe_layers
    assert (config.num_moe_experts, config.moe_router_topk) == (experts, topk)


def test_deepseek_v3_preset_is_mla_with_shared_experts() -> None:
    config = get_preset("deepseek-v3")
    assert config.multi_latent_attention and (config.q_lora_rank, config.kv_lora_rank) == (1536, 512)
    assert (config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim) == (128, 64, 128)
    assert config.moe_layer_pattern()[:4] == (False, False, False, True)
    assert config.moe_shared_expert_intermediate_size == 2048 and config.moe_grouped_gemm
    assert config.rotary_dim == 64


# ----------------------------------------------------------------------------------------------- Policy
@pytest.mark.parametrize("text", ["selective/moe_act", "selective/moe", "selective/shared_experts",
                                  "selective/mla_up_proj", "selective/core_attn+moe_act+shared_experts+mla_up_proj",
                                  "selective/moe@non-reentrant", "selective/moe+non_matmul"])
def test_moe_modules_round_trip_as_text(text: str) -> None:
    assert str(Policy.parse(text)) == text and Policy.parse(str(Policy.parse(text))) == Policy.parse(text)


@pytest.mark.parametrize("text", ["selective/moe_act", "selective/core_attn+moe+shared_experts",
                                  "selective/mla_up_proj+moe_act"])
def test_moe_modules_round_trip_as_megatron_flags(text: str) -> None:
    policy = Policy.parse(text)
    assert Policy.from_megatron_args(policy.to_megatron_args()) == policy
    assert policy.to_megatron_args()[:3] == ["--recompute-granularity", "selective", "--recompute-modules"]


def test_moe_layer_recompute_is_the_deprecated_alias_of_selective_moe() -> None:
    assert str(Policy.from_megatron_args("--moe-layer-recompute")) == "selective/moe"
    assert str(Policy.from_megatron_args("--recompute-activations --moe-layer-recompute")) == "selective/core_attn+moe"
    argv = "--recompute-granularity selective --recompute-modules moe_act --moe-layer-recompute"
    assert str(Policy.from_megatron_args(argv)) == "selective/moe_act+moe"
    with pytest.raises(PolicyError, match="--moe-layer-recompute cannot be combined with --recompute-granularity full"):
        Policy.from_megatron_args("--moe-layer-recompute --recompute-granularity full --recompute-method uniform "
                                  "--recompute-num-layers 1")


def test_non_matmul_already_recomputes_moe_act() -> None:
    with pytest.raises(PolicyError, match="non_matmul already recomputes moe_act"):
        Policy.parse("selective/non_matmul+moe_act")
