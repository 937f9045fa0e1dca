"""megatron-core 0.16.1 bugs met while tracing: refused in one line naming the setting, never a hang. Each test
also shows megatron-core still failing without the refusal (so the entry can go when megatron-core is fixed)."""

from __future__ import annotations

import pytest

from remat.megatron.compat import MegatronSettingError, MegatronUnavailable, require_megatron_core

try:
    require_megatron_core()
except MegatronUnavailable as err:
    pytest.skip(str(err), allow_module_level=True)

import remat.megatron.api as api  # noqa: E402
from remat.megatron import predict_megatron_core  # noqa: E402
from remat.megatron.world import ParallelSizes  # noqa: E402


def trace_unchecked(config, step_shape, monkeypatch):
    """Trace with remat's up-front refusals switched off: what megatron-core itself does."""
    monkeypatch.setattr(api, "check_settings", lambda *args: None)
    shape = api.StepShape(step_shape["seq_length"], step_shape["micro_batch_size"], step_shape["vocab_size"])
    return api.trace_rank(config, None, shape, ParallelSizes(), 0, fake=True)


def test_mlp_recompute_with_biases_recursion_is_bounded(small_config, step_shape, monkeypatch):
    config = small_config(num_layers=2, add_bias_linear=True, recompute_granularity="selective",
                          recompute_modules=["mlp"])
    with pytest.raises(MegatronSettingError, match="recompute_modules=\\['mlp'\\] with add_bias_linear=True"):
        predict_megatron_core(config, **step_shape)
    with pytest.raises(MegatronSettingError, match="re-entered a checkpoint's backward 8 levels deep"):
        trace_unchecked(config, step_shape, monkeypatch)


def test_moe_with_biases_is_refused(small_config, step_shape, monkeypatch):
    config = small_config(num_layers=2, add_bias_linear=True, num_moe_experts=4, moe_router_topk=2)
    with pytest.raises(MegatronSettingError, match="num_moe_experts with add_bias_linear=True"):
        predict_megatron_core(config, **step_shape)
    with pytest.raises(Exception) as raised:
        trace_unchecked(config, step_shape, monkeypatch)
    assert not isinstance(raised.value, MegatronSettingError) or "add_bias_linear" not in str(raised.value)


def test_uniform_groups_must_divide_the_stage(small_config, step_shape, monkeypatch):
    config = small_config(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=3)
    with pytest.raises(MegatronSettingError, match="recompute_num_layers=3, which does not divide the 4 layers"):
        predict_megatron_core(config, **step_shape)
    with pytest.raises(IndexError, match="index 4 is out of range"):
        trace_unchecked(config, step_shape, monkeypatch)


def test_sequence_parallel_with_torch_norm_is_one_line(small_config, step_shape):
    config = small_config(tensor_model_parallel_size=2, sequence_parallel=True)
    with pytest.raises(MegatronSettingError, match="^megatron-core could not build this model here: AssertionError: "
                                                   "sequence parallel not supported by torch LayerNorm"):
        predict_megatron_core(config, **step_shape, tp=2)


def test_job_sizes_must_match_the_config(small_config, step_shape):
    with pytest.raises(MegatronSettingError, match="set tensor_model_parallel_size=... in the config"):
        predict_megatron_core(small_config(), **step_shape, tp=2)
    with pytest.raises(MegatronSettingError, match="ranks='every'"):
        predict_megatron_core(small_config(), **step_shape, ranks="every")
