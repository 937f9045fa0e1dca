"""Megatron-LM's gpt-oss layer flags, --no-position-embedding and --step-batch-size-schedule read into a Job
(remat.job_model; NOTE [gpt-oss layers] in remat.models.blocks)."""

from __future__ import annotations

import pytest

from remat.config import ConfigError, ModelConfig
from remat.job import JobError, parse_megatron_args

BASE = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 1 "
        "--vocab-size 1000 --bf16")
MOE = "--num-experts 4 --moe-router-topk 2 --moe-grouped-gemm"
GPT_OSS = ("--quick-geglu --glu-linear-offset 1.0 --activation-func-clamp-value 7.0 --no-bias-gelu-fusion "
           "--softmax-type learnable --window-size 127,0 --window-attn-skip-freq 2 --export-force-local-attention "
           "--enable-gpt-oss")


def test_the_gpt_oss_layer_flags_set_the_model_and_the_modelopt_flags_are_ignored():
    job, ignored = parse_megatron_args(f"{BASE} {MOE} {GPT_OSS}")
    m = job.model
    assert (m.activation, m.glu_linear_offset, m.activation_func_clamp_value, m.bias_activation_fusion) == (
        "quick_geglu", 1.0, 7.0, False)
    assert (m.softmax_type, m.window_size, m.window_attn_skip_freq) == ("learnable", (127, 0), 2)
    # utils.py:540: 1-based layer_number % 2 != 0 -> the 1st and 3rd layers slide, the 2nd and 4th attend fully
    assert [m.window_attention(i) for i in range(4)] == [True, False, True, False]
    assert {"--export-force-local-attention", "--enable-gpt-oss", "--no-bias-gelu-fusion"} <= set(ignored)


def test_a_window_list_and_no_skip_frequency_follow_is_layer_window_attention():
    m = parse_megatron_args(f"{BASE} --window-size 8,0 --window-attn-skip-freq ([1]*2+[0]*2)")[0].model
    assert [m.window_attention(i) for i in range(4)] == [True, True, False, False]
    m = parse_megatron_args(f"{BASE} --window-size 8,0")[0].model
    assert all(m.window_attention(i) for i in range(4))
    job, ignored = parse_megatron_args(f"{BASE} --window-attn-skip-freq 2")  # no window: nothing slides
    assert job.model.window_size is None and "--window-attn-skip-freq" in ignored


@pytest.mark.parametrize("extra, message", [
    ("--window-size 127", "two integers >= -1"),
    ("--quick-geglu --swiglu", "argument_utils.py:324"),
    ("--activation-func-clamp-value 7 --swiglu", "for --quick-geglu only"),
    ("--quick-geglu", "transformer/mlp.py:297"),  # a dense MLP with the fused quick-geglu: Megatron raises
    ("--softmax-type learnable --attention-backend flash", "use --attention-backend auto"),
    ("--window-size 8,0 --attention-backend fused", "--attention-dropout 0"),
    ("--softmax-type learnable --deterministic-mode", "utils.py:1431"),
    ("--no-position-embedding", "training/arguments.py:1633"),
    ("--enable-gpt-oss --load ckpt", "ModelOpt's layer spec"),
])
def test_what_megatron_or_te_refuses_is_refused_naming_the_fix(extra, message):
    with pytest.raises(JobError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_megatron_args(f"{BASE} {extra}")


def test_routed_experts_take_the_fused_quick_geglu():  # experts.py:973 weighted_bias_quick_geglu_impl
    assert parse_megatron_args(f"{BASE} {MOE} --quick-geglu")[0].model.bias_activation_fusion
    with pytest.raises(JobError, match="add --no-bias-gelu-fusion"):  # a shared expert is a dense MLP
        parse_megatron_args(f"{BASE} {MOE} --quick-geglu --moe-shared-expert-intermediate-size 64")


def test_no_position_embedding_beside_rope_changes_nothing():
    with_flag, ignored = parse_megatron_args(f"{BASE} --position-embedding-type rope --no-position-embedding")
    assert with_flag == parse_megatron_args(f"{BASE} --position-embedding-type rope")[0]
    assert "--no-position-embedding" in ignored


def test_the_step_batch_size_schedule_prices_its_largest_batch():
    job = parse_megatron_args(f"{BASE} --world-size 8 --step-batch-size-schedule '0:16 2.4B:320 12B:1536'")[0]
    assert job.dp == 8 and job.num_microbatches == 1536 // 8  # num_microbatches_calculator.py:444, 590
    with pytest.raises(JobError, match="Cannot specify both"):
        parse_megatron_args(f"{BASE} --global-batch-size 16 --step-batch-size-schedule 0:16")
    with pytest.raises(JobError, match="unrecognized arguments: 2.4B:320"):  # unquoted: argparse takes one word
        parse_megatron_args(f"{BASE} --step-batch-size-schedule 0:16 2.4B:320")
    with pytest.raises(JobError, match="not divisible by --micro-batch-size 1 x data-parallel size 8"):
        parse_megatron_args(f"{BASE} --world-size 8 --step-batch-size-schedule '0:8 1M:12'")
    with pytest.raises(JobError, match="starting at threshold 0"):
        parse_megatron_args(f"{BASE} --step-batch-size-schedule '5:8 1M:16'")


def test_the_gpt_oss_fields_are_checked_by_name():
    with pytest.raises(ConfigError, match="window_size"):
        ModelConfig(window_size=(4,))
    with pytest.raises(ConfigError, match="window_attn_skip_freq"):
        ModelConfig(num_layers=2, window_size=(4, 0), window_attn_skip_freq=(1,))
    with pytest.raises(ConfigError, match="activation_func_clamp_value"):
        ModelConfig(activation="quick_geglu", activation_func_clamp_value=0.0)
    with pytest.raises(ConfigError, match="activation='quick_geglu' only"):
        ModelConfig(glu_linear_offset=1.0)
    with pytest.raises(ConfigError, match="TransformerEngine's standard attention"):
        ModelConfig(softmax_type="learnable", multi_latent_attention=True)
