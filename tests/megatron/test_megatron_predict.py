"""Megatron-core models predicted under fake tensors equal the same step measured on CPU, byte for byte."""

from __future__ import annotations

import pytest

from remat.megatron.compat import MegatronSettingError, MegatronUnavailable, require_megatron_core

try:
    require_megatron_core()
except MegatronUnavailable as err:
    pytest.skip(str(err), allow_module_level=True)

from remat.config import ConfigError  # noqa: E402
from remat.config import RoutingAssumption as ConfigRoutingAssumption  # noqa: E402
from remat.megatron import (  # noqa: E402
    RoutingAssumption,
    measure_megatron_core,
    predict_megatron_core,
    routing_assumption,
)

SETTINGS = {
    "none": {},
    "full/uniform/2": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
    "full/uniform/4": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=4),
    "full/block/1": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
    "selective/core_attn": dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
    "selective/mlp": dict(recompute_granularity="selective", recompute_modules=["mlp"]),
    "selective/layernorm": dict(recompute_granularity="selective", recompute_modules=["layernorm"]),
    "selective/core_attn+mlp+layernorm": dict(recompute_granularity="selective",
                                              recompute_modules=["core_attn", "mlp", "layernorm"]),
}


def predicted_and_measured(config, step_shape, **kwargs):
    predicted = predict_megatron_core(config, **step_shape, **kwargs)
    measured = measure_megatron_core(config, **step_shape, **kwargs)
    assert list(predicted) == list(measured) == [0]
    return predicted[0], measured[0]


@pytest.mark.parametrize("policy", list(SETTINGS))
def test_dense_gpt_predicted_equals_measured(small_config, step_shape, policy):
    predicted, measured = predicted_and_measured(small_config(**SETTINGS[policy]), step_shape)
    assert predicted.meta["policy"] == measured.meta["policy"] == policy
    assert predicted.peak_bytes == measured.peak_bytes
    assert predicted.at_peak == measured.at_peak
    recomputed = [p.label for p in predicted.phases if p.kind == "recompute"]
    if policy == "none":
        assert not recomputed and predicted.at_peak["group_inputs"] == 0
    elif policy.startswith("full/uniform/2"):
        assert "recompute layer 0 [group 0 (layers 0-1)]" in recomputed
        assert "recompute layer 3 [group 1 (layers 2-3)]" in recomputed
    elif policy.startswith("selective/"):
        for module in policy.split("/")[1].split("+"):
            assert any(f"[{module} in decoder.layers.0." in label for label in recomputed), recomputed


def test_recompute_saves_memory_where_megatron_says(small_config, step_shape):
    def forward_end_activations(policy):
        tl = predict_megatron_core(small_config(**SETTINGS[policy]), **step_shape)[0]
        parts = tl.breakdown(tl.forward_end)
        return parts["saved_activations"] + parts["group_inputs"]
    none, full = forward_end_activations("none"), forward_end_activations("full/uniform/2")
    assert full < none / 3
    assert forward_end_activations("selective/core_attn") < none


def test_layernorm_outputs_are_released_and_refilled(small_config, step_shape):
    # CheckpointWithoutOutput frees its output with storage.resize_(0): the recorder ends that row at the release
    plain = predict_megatron_core(small_config(), **step_shape)[0]
    discarded = predict_megatron_core(small_config(**SETTINGS["selective/layernorm"]), **step_shape)[0]
    norm_bytes = 32 * 2 * 64 * 4  # one norm's output: tokens x hidden, fp32
    released = [r for r in range(len(discarded)) if discarded.nbytes[r] == norm_bytes
                and discarded.module[r].endswith("layernorm") and 0 <= discarded.free_at[r] <= discarded.forward_end]
    assert len(released) >= 8  # input and pre-MLP norm of 4 layers, freed during the forward
    refilled = [r for r in range(len(discarded)) if discarded.nbytes[r] == norm_bytes
                and "layernorm in decoder.layers" in discarded.phases[discarded.phase_index[r]].detail]
    assert len(refilled) >= 8
    saved = plain.breakdown(plain.forward_end)["saved_activations"]
    assert discarded.breakdown(discarded.forward_end)["saved_activations"] <= saved - 8 * norm_bytes


def test_ddp_main_grad_buffer_and_optimizer_state(small_config, step_shape):
    predicted, measured = predicted_and_measured(small_config(), step_shape, ddp=True, optimizer="adam")
    assert predicted.at_peak == measured.at_peak
    params = predicted.at_peak["parameters"]
    assert predicted.at_peak["gradients"] == params  # fp32 model: one fp32 main-grad buffer alive all step
    assert predicted.at_peak["optimizer_state"] == 2 * params  # fp32 Adam: two moments, no master copy
    assert "ddp.main_grad_buffer" in predicted.module


def test_mla_predicted_equals_measured(step_shape):
    from megatron.core.transformer import MLATransformerConfig

    config = MLATransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
                                  add_bias_linear=False, multi_latent_attention=True, q_lora_rank=32,
                                  kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16,
                                  recompute_granularity="selective", recompute_modules=["core_attn"])
    predicted, measured = predicted_and_measured(config, step_shape)
    assert predicted.peak_bytes == measured.peak_bytes and predicted.at_peak == measured.at_peak
    assert any("linear_kv_up_proj" in m for m in predicted.module)


def test_moe_predicted_equals_measured_under_the_routing_assumption(small_config, step_shape):
    config = small_config(num_layers=2, num_moe_experts=4, moe_router_topk=2)
    predicted, measured = predicted_and_measured(config, step_shape, routing="capacity:1.5")
    assert predicted.peak_bytes == measured.peak_bytes and predicted.at_peak == measured.at_peak
    assert predicted.meta["moe_routing"]["assumption"] == "capacity:1.5"
    balanced = predict_megatron_core(config, **step_shape)[0]
    assert balanced.meta["moe_routing"]["assumption"] == "balanced"
    assert balanced.peak_bytes < predicted.peak_bytes  # capacity 1.5: 1.5x the balanced tokens per expert


def test_routing_assumption_counts():
    assert RoutingAssumption().tokens_per_expert(10, 4, 2) == [5, 5, 5, 5]
    assert RoutingAssumption().tokens_per_expert(9, 4, 2) == [5, 5, 4, 4]
    assert RoutingAssumption.parse("capacity:1.25").tokens_per_expert(64, 4, 2) == [40] * 4
    assert RoutingAssumption.parse("counts:6,2,4,4").tokens_per_expert(8, 4, 2) == [6, 2, 4, 4]
    # the front end's routing= is remat.config's RoutingAssumption, its errors naming routing=
    assert RoutingAssumption is ConfigRoutingAssumption and routing_assumption("capacity:1.25").capacity_factor == 1.25
    with pytest.raises(MegatronSettingError, match="routing='capcity'.*'capacity:1.25'"):
        routing_assumption("capcity")
    with pytest.raises(MegatronSettingError, match="every MoE layer alike"):
        routing_assumption("counts:1,2;2,1")
    with pytest.raises(ConfigError, match="the model has 4"):
        RoutingAssumption.parse("counts:1,2").tokens_per_expert(8, 4, 2)


def test_tensor_parallel_ranks_traced_one_by_one(small_config, step_shape):
    config = small_config(tensor_model_parallel_size=2, **SETTINGS["full/uniform/2"])
    ranks = predict_megatron_core(config, **step_shape, tp=2, ranks="model_parallel")
    assert sorted(ranks) == [0, 1]
    assert ranks[0].peak_bytes == ranks[1].peak_bytes and ranks[0].at_peak == ranks[1].at_peak
    single = predict_megatron_core(small_config(**SETTINGS["full/uniform/2"]), **step_shape)[0]
    # the layers' matrices and the vocabulary are split in two; the norms (weight and bias of 2 per layer and the
    # final one) and the learned position embedding are replicated
    replicated = ((2 * 4 + 1) * 2 * 64 + 32 * 64) * 4
    assert ranks[0].at_peak["parameters"] == (single.at_peak["parameters"] - replicated) // 2 + replicated
    assert ranks[1].meta["rank"] == 1 and ranks[1].meta["parallel"]["tp"] == 2


def test_refilled_layernorm_outputs_are_freed_as_in_the_real_run(small_config, step_shape):
    # the refilled storage is freed after the consuming module's backward, in the fake run as in the real one
    config = small_config(num_layers=2, **SETTINGS["selective/core_attn+mlp+layernorm"])
    predicted, measured = predicted_and_measured(config, step_shape)
    assert predicted.peak_bytes == measured.peak_bytes and predicted.at_peak == measured.at_peak

    def refilled(tl):
        return [(tl.nbytes[r], tl.free_at[r] >= 0) for r in range(len(tl)) if tl.category[r] == "recompute"
                and tl.phases[tl.phase_index[r]].detail.startswith("layernorm in ") and tl.module[r].count(".") == 2]
    assert refilled(predicted) == refilled(measured) == [(32 * 2 * 64 * 4, True)] * 4  # 2 norms x 2 layers


def test_pipeline_stages_predicted(small_config, step_shape):
    import torch

    config = small_config(pipeline_model_parallel_size=2, pipeline_dtype=torch.float32,
                          recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    stages = predict_megatron_core(config, **step_shape, pp=2)
    assert sorted(stages) == [0, 1] and stages[1].meta["parallel"]["pp"] == 2
    assert [t.meta["num_layers"] for t in stages.values()] == [2, 2]
    labels = {r: {p.label for p in t.phases} for r, t in stages.items()}
    assert "forward embedding" in labels[0] and "forward embedding" not in labels[1]
    assert "forward head" in labels[1] and "forward head" not in labels[0]
    # stage 1's groups hold its own layers (global 2 and 3); it receives stage 0's output (tokens x batch x hidden)
    assert "recompute layer 0 [group 0 (layer 2)]" in labels[1] and "recompute layer 1 [group 1 (layer 3)]" in labels[1]
    batches = {r: [t.nbytes[i] for i in range(len(t)) if t.module[i] == "batch"] for r, t in stages.items()}
    assert batches == {0: [512, 256, 512], 1: [512, 256, 512, 32 * 2 * 64 * 4]}
