"""Megatron's MoE and MLA recompute modules in apply: moe_act and mla_up_proj discard their outputs
(CheckpointWithoutOutput), moe and shared_experts checkpoint whole modules; gradients equal the plain model's bit for
bit with dropout on, with both engines; the combinations Megatron refuses are refused with the fix."""

from __future__ import annotations

import pytest
import torch
from tiny_models import train_step

from remat.config import ModelConfig
from remat.memory.measure import measure
from remat.models.gpt import build_model, sample_batch
from remat.recompute.apply import apply
from remat.recompute.region import ApplyError

BASE = ModelConfig(num_layers=3, hidden_size=32, num_attention_heads=4, seq_length=16, micro_batch_size=2,
                   vocab_size=64, hidden_dropout=0.1, attention_dropout=0.1)
# dense layer 0, then MoE layers with grouped experts, a shared expert, the aux loss, sigmoid routing, and MLA
DEEPSEEK_LIKE = BASE.replace(
    num_moe_experts=4, moe_grouped_gemm=True, activation="swiglu", moe_shared_expert_intermediate_size=16,
    moe_layer_freq=(0, 1, 1), moe_aux_loss_coeff=0.01, moe_router_score_function="sigmoid",
    multi_latent_attention=True, position="rope", normalization="rmsnorm", q_lora_rank=16, kv_lora_rank=8,
    qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8)
# every layer MoE, experts as separate MLPs, softmax top-2, standard attention
MIXTRAL_LIKE = BASE.replace(num_moe_experts=4, moe_ffn_hidden_size=24, moe_shared_expert_intermediate_size=8)


CASES = [(DEEPSEEK_LIKE, p) for p in ("selective/moe_act", "selective/mla_up_proj", "selective/moe",
                                      "selective/shared_experts", "selective/moe_act+moe",
                                      "selective/core_attn+mla_up_proj+moe_act+shared_experts+mlp",
                                      "selective/mla_up_proj+moe+non_matmul")]
CASES += [(MIXTRAL_LIKE, p) for p in ("selective/moe", "selective/shared_experts", "selective/core_attn+moe")]


@pytest.mark.parametrize("engine", ["reentrant", "non-reentrant"])
@pytest.mark.parametrize("config,policy", CASES)
def test_gradients_are_bit_identical_to_no_recompute(config: ModelConfig, policy: str, engine: str) -> None:
    plain_loss, plain = train_step(config, "none")
    loss, grads = train_step(config, policy if engine == "reentrant" else f"{policy}@{engine}")
    assert torch.equal(loss, plain_loss)
    assert grads.keys() == plain.keys()
    assert all(grads[n] is not None and torch.equal(grads[n], plain[n]) for n in plain)


def regions(config: ModelConfig, policy: str) -> list[str]:
    return [r.label for r in apply(build_model(config), policy).regions]


def test_regions_follow_megatron_targets() -> None:
    assert regions(DEEPSEEK_LIKE, "selective/mlp") == ["mlp in layers.0.mlp"]  # dense MLPs only, as in Megatron
    assert regions(DEEPSEEK_LIKE, "selective/moe") == ["moe in layers.1.mlp", "moe in layers.2.mlp"]
    assert regions(DEEPSEEK_LIKE, "selective/moe_act") == [
        "moe_act in layers.1.mlp.experts.activation", "moe_act in layers.2.mlp.experts.activation"]
    assert regions(DEEPSEEK_LIKE, "selective/shared_experts")[0] == "shared_experts in layers.1.mlp.shared_experts"
    assert len(regions(DEEPSEEK_LIKE, "selective/mla_up_proj")) == 3
    assert regions(MIXTRAL_LIKE, "selective/mlp") == []  # every layer is MoE: Megatron's mlp does nothing


def test_moe_act_needs_grouped_experts_as_in_megatron() -> None:
    with pytest.raises(ApplyError, match=r"moe_act.*moe_grouped_gemm=False.*Megatron refuses moe_act without "
                                         r"grouped GEMM.*set moe_grouped_gemm=True, or recompute the experts with "
                                         r"selective/moe"):
        apply(build_model(MIXTRAL_LIKE), "selective/moe_act")


@pytest.mark.parametrize("policy,phrase", [
    ("selective/moe", "is for MoE layers, but no layer of the stack has one: set num_moe_experts"),
    ("selective/moe_act", "is for MoE layers"),
    ("selective/mla_up_proj", r"Megatron refuses it without multi_latent_attention\): set multi_latent_attention=True"),
])
def test_modules_a_dense_model_lacks_are_refused(policy: str, phrase: str) -> None:
    with pytest.raises(ApplyError, match=phrase):
        apply(build_model(BASE), policy)


def test_shared_experts_without_a_shared_expert_is_refused() -> None:
    with pytest.raises(ApplyError, match="no shared expert: set moe_shared_expert_intermediate_size"):
        apply(build_model(MIXTRAL_LIKE.replace(moe_shared_expert_intermediate_size=None)), "selective/shared_experts")


def forward_rows_alive_into_backward(config: ModelConfig, policy: str, module: str) -> int:
    """How many storages the forward of ``module`` (a name fragment) made that are still alive when backward
    starts."""
    model = build_model(config.replace(moe_routing_assumption="balanced"))
    apply(model, policy)
    tl = measure(model, sample_batch(config))
    backward = next(p.start for p in tl.phases if p.kind == "backward")
    return sum(1 for row in range(len(tl)) if module in tl.module[row] and tl.phases[tl.phase_index[row]].kind ==
               "forward" and (tl.free_at[row] < 0 or tl.free_at[row] > backward))


@pytest.mark.parametrize("policy,module", [("selective/moe_act", "mlp.experts.activation"),
                                           ("selective/mla_up_proj", "self_attention.up_proj")])
def test_output_discarding_keeps_nothing_of_the_producer(policy: str, module: str) -> None:
    assert forward_rows_alive_into_backward(DEEPSEEK_LIKE, "none", module) > 0
    assert forward_rows_alive_into_backward(DEEPSEEK_LIKE, policy, module) == 0


def discarded_output_bytes(config: ModelConfig, module: str) -> int:
    """The bytes of the outputs the producers of ``module`` (a name fragment) return in one plain forward."""
    model = build_model(config)
    total = [0]

    def count(_: torch.nn.Module, __: object, output: object) -> None:
        outputs = output if isinstance(output, tuple) else (output,)
        total[0] += sum(t.untyped_storage().nbytes() for t in outputs)

    for name, sub in model.named_modules():
        if name.endswith(module):
            sub.register_forward_hook(count)
    with torch.no_grad():
        model(*sample_batch(config))
    return total[0]


@pytest.mark.parametrize("policy,module", [("selective/moe_act", "mlp.experts.activation"),
                                           ("selective/mla_up_proj", "self_attention.up_proj")])
def test_output_discarding_lowers_memory_and_frees_the_kept_inputs(policy: str, module: str) -> None:
    """The forward ends lower by at least the discarded outputs (the kept inputs are tensors the plain model saves
    anyway), each region's kept inputs are gone once its layer's backward is over (no reference cycle keeps them
    into the layers below), and so the step's peak is not above the plain model's."""
    config = DEEPSEEK_LIKE.replace(moe_routing_assumption="balanced")
    timelines = {}
    for name in ("none", policy):
        model = build_model(config)
        apply(model, name)
        timelines[name] = measure(model, sample_batch(config))
    plain, tl = timelines["none"], timelines[policy]
    discarded = discarded_output_bytes(config, module)
    assert discarded > 0
    assert plain.live_bytes()[plain.forward_end] - tl.live_bytes()[tl.forward_end] >= discarded
    kept = [row for row in range(len(tl)) if tl.category[row] == "group_inputs"]  # only these regions keep any
    assert kept
    for row in kept:
        made_in = tl.phases[tl.phase_index[row]].region
        done = max(p.start for p in tl.phases if p.kind == "backward" and p.region == made_in)
        assert 0 <= tl.free_at[row], f"{tl.module[row]}: kept input still alive at the end of the step"
        nxt = [p.start for p in tl.phases if p.start > done and p.region != made_in]
        assert tl.free_at[row] <= min(nxt), f"{tl.module[row]}: kept input outlives the backward of {made_in}"
    assert tl.peak_bytes <= plain.peak_bytes
