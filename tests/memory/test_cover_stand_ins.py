"""remat.memory.roles.cover_stand_ins: the shallow traces a sweep makes stand in for every policy, fewer traced
layers than one shallowest stand-in each, and a shared (deeper) stand-in composes the same step as the shallowest."""

from __future__ import annotations

from remat.config import ModelConfig
from remat.memory.compose import compose
from remat.memory.predict import trace
from remat.memory.roles import cover_stand_ins, layer_kinds, policy_family, role_set, shallow_stand_ins_of_kinds
from remat.policy import Policy

# DeepSeek-V3's layer kinds on a tiny model: the first 3 layers dense, then MoE
TINY_DEEPSEEK = ModelConfig(
    num_layers=12, hidden_size=32, num_attention_heads=4, seq_length=16, micro_batch_size=2, vocab_size=64,
    num_moe_experts=4, moe_grouped_gemm=True, activation="swiglu", moe_shared_expert_intermediate_size=16,
    moe_layer_freq=(0,) * 3 + (1,) * 9, moe_router_score_function="sigmoid", multi_latent_attention=True,
    position="rope", normalization="rmsnorm", q_lora_rank=16, kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=4,
    v_head_dim=8, moe_routing_assumption="balanced")


def test_every_policy_has_a_stand_in_of_its_family_and_fewer_layers_are_traced() -> None:
    depth = 61
    kinds = ("dense",) * 3 + ("moe",) * 58
    policies = [Policy(), *(Policy.parse(f"full/{m}/{k}") for m in ("uniform", "block") for k in range(1, 62)),
                Policy.parse("selective/core_attn")]
    chosen = cover_stand_ins(policies, depth, kinds)
    for policy in policies:
        need = role_set(policy, depth, kinds)
        assert any(policy_family(p) == policy_family(policy) and d < depth and need <= role_set(p, d, k)
                   for p, d, k in chosen), policy
    shallowest = {next(shallow_stand_ins_of_kinds(policy, kinds)) for policy in policies}
    assert sum(d for _, d, _ in chosen) < sum(d for _, d, _ in shallowest)
    # block/2 and block/3 share one 7-layer stand-in rather than two 6-layer traces
    assert sum(1 for p, _, _ in chosen if p.granularity == "full" and p.method == "block") < \
        sum(1 for p, _, _ in shallowest if p.granularity == "full" and p.method == "block")


def test_a_shared_deeper_stand_in_composes_the_same_step_as_the_shallowest() -> None:
    kinds = layer_kinds(TINY_DEEPSEEK)
    policy = Policy.parse("full/block/2")
    (small_policy, small_depth, small_kinds), = [c for c in cover_stand_ins(
        [policy, Policy.parse("full/block/3")], TINY_DEEPSEEK.num_layers, kinds)]
    shallowest = next(shallow_stand_ins_of_kinds(policy, kinds))
    assert small_depth > shallowest[1]  # the cover picked a deeper stand-in that serves both policies
    steps = []
    for stand_in, depth, pattern in ((small_policy, small_depth, small_kinds), shallowest):
        small = TINY_DEEPSEEK.with_depth(depth, tuple(k == "moe" for k in pattern))
        steps.append(compose(trace(small, stand_in), stand_in, policy, TINY_DEEPSEEK.num_layers, kinds))
    for name in ("nbytes", "alloc_at", "free_at", "phase_index", "category", "module", "phases", "num_events"):
        assert getattr(steps[0], name) == getattr(steps[1], name), name
    full = trace(TINY_DEEPSEEK, policy)  # and both are the whole stack's trace, event for event
    for name in ("nbytes", "alloc_at", "free_at", "category", "module"):
        assert getattr(steps[0], name) == getattr(full, name), name
    assert steps[0].peak_bytes == full.peak_bytes and steps[0].at_peak == full.at_peak
