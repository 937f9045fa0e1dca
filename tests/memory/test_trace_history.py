"""A measurement or prediction does not depend on what ran before it in the process: a recompute region's
saved-tensor hooks are all popped when its step is over (remat.recompute.discard.OutputDiscardingRegion), so a step
traced after an MLA layer whose consumer is in a core_attn checkpoint of its own keeps the same bytes as one traced
first (left pushed, the hooks kept DeepSeek-V3's sigmoid router scores, 2 MiB a layer, in every later trace)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from remat import apply, build_model, measure, sample_batch
from remat.config import ModelConfig
from remat.memory.predict import predict_config

# sigmoid scores, as DeepSeek-V3's router: they choose the experts but get no gradient, so only a leftover
# saved-tensor hook keeps them
MLA_MOE = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, micro_batch_size=2,
                      vocab_size=64, num_moe_experts=2, moe_router_topk=1, moe_ffn_hidden_size=64,
                      moe_router_score_function="sigmoid", moe_routing_assumption="balanced", moe_grouped_gemm=True,
                      activation="swiglu", multi_latent_attention=True, position="rope", q_lora_rank=16,
                      kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8)


def _saved_tensor_hooks() -> object:
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


@pytest.fixture(autouse=True)
def _no_leftover_hooks() -> Iterator[None]:
    assert _saved_tensor_hooks() is None, "an earlier test left saved-tensor hooks pushed"
    yield
    while _saved_tensor_hooks() is not None:  # a failure here must not change the bytes of later tests
        torch._C._autograd._pop_saved_tensors_default_hooks()


def _measured(policy: str) -> int:
    model = build_model(MLA_MOE)
    apply(model, policy)
    torch.manual_seed(0)
    return measure(model, sample_batch(MLA_MOE)).peak_bytes


def test_a_measurement_after_an_mla_up_proj_core_attn_step_is_the_same() -> None:
    before = _measured("none")
    _measured("selective/core_attn+mla_up_proj")
    assert _saved_tensor_hooks() is None
    assert _measured("none") == before


def test_a_prediction_after_an_mla_up_proj_core_attn_trace_is_the_same() -> None:
    # traced whole each time (compose_layers=False): a composed one would reuse the first call's shallow trace
    before = predict_config(MLA_MOE, "full/block/1", compose_layers=False).peak_bytes
    predict_config(MLA_MOE, "selective/core_attn+mla_up_proj", compose_layers=False)
    assert _saved_tensor_hooks() is None
    assert predict_config(MLA_MOE, "full/block/1", compose_layers=False).peak_bytes == before
