"""The planner's unit model prices every selective set Megatron accepts on an MLA + MoE layer (remat.plan.moe_modules,
NOTE [MoE modules in the search]), core_attn with the MoE/MLA modules included, exactly as measured on CPU, and a plan
picks such a set where it is the cheapest fit."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch

from remat import apply, build_model, measure, sample_batch
from remat.config import ModelConfig
from remat.memory.predict import predict_config
from remat.plan.api import plan
from remat.plan.moe_modules import MOE_MLA, TRACE_BATCH, add_moe_units, job_policies, moe_mla_sets
from remat.plan.unit_model import unit_model
from remat.policy import Policy
from remat.recompute.plan_format import Unit

# sigmoid scores, as DeepSeek-V3's router: the scores choose the experts but get no gradient (top-k passes indices
# on), so a saved-tensor hook that keeps them (mla_up_proj's, once left pushed) kept them for good
MLA_MOE = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, micro_batch_size=2,
                      vocab_size=64, num_moe_experts=2, moe_router_topk=1, moe_ffn_hidden_size=64,
                      moe_router_score_function="sigmoid", moe_routing_assumption="balanced", moe_grouped_gemm=True,
                      activation="swiglu", multi_latent_attention=True, position="rope", q_lora_rank=16,
                      kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8, hidden_dropout=0.0,
                      attention_dropout=0.0)


def _measured(policy: str) -> int:
    model = build_model(MLA_MOE)
    apply(model, policy)
    torch.manual_seed(0)
    return measure(model, sample_batch(MLA_MOE)).peak_bytes


def _saved_tensor_hooks() -> object:
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


@pytest.fixture(autouse=True)
def _no_leftover_hooks() -> Iterator[None]:
    assert _saved_tensor_hooks() is None, "an earlier test left saved-tensor hooks pushed"
    yield
    while _saved_tensor_hooks() is not None:  # a failure here must not change the bytes of later tests
        torch._C._autograd._pop_saved_tensors_default_hooks()


# A measurement or prediction does not depend on what ran before it in the process: a recompute region's saved-tensor
# hooks are all popped when its step is over (remat.recompute.discard.OutputDiscardingRegion). mla_up_proj's consumer
# (core attention) runs again inside its own core_attn checkpoint; the hooks it left pushed once kept DeepSeek-V3's
# sigmoid router scores (2 MiB a layer) in every later trace of the process.
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


def test_every_core_attn_set_on_an_mla_moe_layer_is_priced_as_measured() -> None:
    model = add_moe_units(unit_model(MLA_MOE), MLA_MOE)
    sets = moe_mla_sets(MLA_MOE)  # layernorm, moe_act, moe, mla_up_proj in any subset with core_attn or not
    assert len(sets) == 2 ** 5 - 2 ** 2 and all(Unit("selective", 1, s) in model.shapes for s in sets)
    with_core = [s for s in sets if "core_attn" in s]
    assert ("core_attn", "layernorm", "moe_act", "moe", "mla_up_proj") in with_core and len(with_core) == 14
    for s in with_core:
        policy = str(Policy("selective", modules=s))
        assert _measured(policy) == model.peak([Unit("selective", 1, s)] * MLA_MOE.num_layers), policy
    # with a dense first layer mlp joins the sets, but does nothing on an MoE layer: an MoE stage's search lists
    # each setting once (selective/core_attn, never its twin selective/core_attn+mlp) and never mlp alone
    mixed = MLA_MOE.replace(num_layers=3, moe_layer_freq=(0, 1, 1))
    listed = job_policies(2, "reentrant", mixed, None, [add_moe_units(model, mixed)])
    selective = [p.modules for p in listed if p.granularity == "selective"]
    assert len(selective) == len(sets) + 3 and not any("mlp" in m for m in selective)  # + core_attn, layernorm, both


def test_a_plan_picks_core_attn_with_moe_where_it_is_the_cheapest_fit() -> None:
    # selective/core_attn+moe: 348,888 bytes; every cheaper setting's peak is above (moe_act+mla_up_proj: 351,960)
    budget = 350_000
    result = plan(MLA_MOE, budget)
    assert result.megatron.megatron_policy == "selective/core_attn+moe"
    assert _measured("selective/core_attn+moe") == result.megatron.peak_bytes <= budget
    chosen = result.extended
    model = build_model(MLA_MOE)
    apply(model, chosen.plan)
    torch.manual_seed(0)
    assert measure(model, sample_batch(MLA_MOE)).peak_bytes == chosen.peak_bytes <= budget
    assert chosen.cost <= result.megatron.cost


@pytest.mark.parametrize("workers", ["1", "2"])
def test_moe_units_traced_side_by_side_are_those_traced_here(monkeypatch: pytest.MonkeyPatch, workers: str) -> None:
    # add_moe_units' batches in forked workers (REMAT_TRACE_WORKERS=2) or one after the other here: the same shapes,
    # added in the same order; 28 sets in two batches
    assert len(moe_mla_sets(MLA_MOE)) > TRACE_BATCH

    def fresh():  # the unit model without any MoE/MLA set (unit_model's answer is shared: copied)
        model = copy.deepcopy(unit_model(MLA_MOE))
        model.shapes = {u: s for u, s in model.shapes.items() if not set(u.modules) & MOE_MLA}
        return model
    monkeypatch.setenv("REMAT_TRACE_WORKERS", "1")
    here = add_moe_units(fresh(), MLA_MOE)
    monkeypatch.setenv("REMAT_TRACE_WORKERS", workers)
    there = add_moe_units(fresh(), MLA_MOE)
    assert list(there.shapes.items()) == list(here.shapes.items())
    assert all(Unit("selective", 1, s) in there.shapes for s in moe_mla_sets(MLA_MOE))
