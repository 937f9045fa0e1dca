"""Tests for remat.analysis.formulas: the paper's formulas, Megatron's estimator, and the exact per-layer inventory."""

import json
from functools import cache

import pytest

import remat
from remat import ModelConfig
from remat.analysis.differences import explain_differences, traced_layer_bytes, traced_layer_rows
from remat.analysis.formulas import korthikanti_layer_bytes, korthikanti_terms, megatron_estimate
from remat.analysis.inventory import build_inventory as _inventory
from remat.analysis.inventory import corrected_layer_bytes, layer_inventory
from remat.analysis.inventory import paper_layout as _paper_layout

SMALL = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, micro_batch_size=2,
                    vocab_size=128)
NO_DROPOUT = {"hidden_dropout": 0.0, "attention_dropout": 0.0}
LLAMA = {"activation": "swiglu", "normalization": "rmsnorm", "position": "rope", "num_query_groups": 2,
         "add_bias_linear": False, **NO_DROPOUT}

# (name, config) pairs whose traced per-layer bytes the corrected formula must reproduce exactly (CPU).
TRACED = {
    "gpt fp32 dropout math": SMALL,
    "gpt fp32 no dropout": SMALL.replace(**NO_DROPOUT),
    "sdpa no dropout (CPU flash kernel)": SMALL.replace(attention="sdpa", **NO_DROPOUT),
    "sdpa with dropout (CPU math fallback)": SMALL.replace(attention="sdpa"),
    "llama fp32 math": SMALL.replace(**LLAMA),
    "llama fp32 sdpa": SMALL.replace(attention="sdpa", **LLAMA),
    "llama bf16 sdpa": SMALL.replace(dtype="bf16", attention="sdpa", **LLAMA),
    "gpt bf16": SMALL.replace(dtype="bf16"),
    "gpt fp16 sdpa with dropout": SMALL.replace(dtype="fp16", attention="sdpa"),
    "gqa no rope sdpa": SMALL.replace(attention="sdpa", num_query_groups=1, **NO_DROPOUT),
    "rope sdpa": SMALL.replace(attention="sdpa", position="rope", **NO_DROPOUT),
    "gelu ffn 96": SMALL.replace(ffn_hidden_size=96, hidden_dropout=0.0),
    "rmsnorm bf16 dropout": SMALL.replace(normalization="rmsnorm", dtype="bf16"),
}


@cache
def trace(config: ModelConfig) -> remat.Timeline:
    model = remat.build_model(config)
    return remat.measure(model, remat.sample_batch(config))


def sbh(c: ModelConfig) -> int:
    return c.seq_length * c.micro_batch_size * c.hidden_size


def as2b(c: ModelConfig) -> int:
    return c.num_attention_heads * c.seq_length ** 2 * c.micro_batch_size


# ------------------------------------------------------------------------ Korthikanti et al. 2022
GPT3 = ModelConfig(num_layers=96, hidden_size=12288, num_attention_heads=96, seq_length=2048, micro_batch_size=1,
                   vocab_size=51200)


def test_gpt3_175b_paper_numbers():
    terms = korthikanti_terms(GPT3)
    assert terms.groups["attention_scores"] / sbh(GPT3) == 80  # 5as/h
    assert terms.groups == {"attention": 11 * sbh(GPT3), "attention_scores": 5 * as2b(GPT3),
                            "mlp": 19 * sbh(GPT3), "norms": 4 * sbh(GPT3)}
    full = korthikanti_layer_bytes(GPT3)
    selective = korthikanti_layer_bytes(GPT3, recompute="selective")
    assert full == sbh(GPT3) * (34 + 80)
    assert 1 - selective / full == pytest.approx(0.70, abs=0.01)  # "selective removes ~70%"
    assert korthikanti_layer_bytes(GPT3, recompute="full") == 2 * sbh(GPT3)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_parallel_formulas_reduce_to_no_parallelism_at_t1(recompute):
    base = korthikanti_layer_bytes(GPT3, recompute=recompute)
    assert korthikanti_layer_bytes(GPT3, tp=1, sp=False, recompute=recompute) == base
    assert korthikanti_layer_bytes(GPT3, tp=1, sp=True, recompute=recompute) == base


def test_tensor_and_sequence_parallel_formulas():
    c, t = GPT3, 8
    s_b_h, ratio = sbh(c), 5 * c.num_attention_heads * c.seq_length / c.hidden_size
    assert korthikanti_layer_bytes(c, tp=t) == round(s_b_h * (10 + 24 / t + ratio / t))
    assert korthikanti_layer_bytes(c, tp=t, sp=True) == round(s_b_h / t * (34 + ratio))
    assert korthikanti_layer_bytes(c, tp=t, recompute="selective") == round(s_b_h * (10 + 24 / t))
    assert korthikanti_layer_bytes(c, tp=t, sp=True, recompute="selective") == 34 * s_b_h // t
    assert korthikanti_layer_bytes(c, tp=t, sp=True, recompute="full") == 2 * s_b_h // t
    assert korthikanti_layer_bytes(c, tp=t, recompute="full") == 2 * s_b_h
    split = korthikanti_terms(c, tp=t)
    assert sum(x.nbytes for x in split.terms if x.split == "sp") == 10 * s_b_h  # replicated without SP
    assert split.formula == "sbh(10 + 24/t + 5as/(ht))"
    json.dumps(split.to_dict())


@pytest.mark.parametrize("tp,sp", [(1, False), (2, False), (4, True), (2, True)])
def test_paper_layout_inventory_is_the_paper_formula(tp, sp):
    # the inventory under the paper's assumptions (16-bit, 1-byte masks, GeLU 4h, unfused attention) is Table 2
    for c in (SMALL, GPT3.replace(seq_length=256)):
        inv = _inventory(_paper_layout(c, "cpu"), tp, sp)
        assert sum(x.nbytes for x in inv) == korthikanti_layer_bytes(c, tp=tp, sp=sp)
        assert all(x.paper_term for x in inv)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="recompute"):
        korthikanti_layer_bytes(SMALL, recompute="some")
    with pytest.raises(ValueError, match="tp"):
        korthikanti_layer_bytes(SMALL, tp=0)
    with pytest.raises(ValueError, match="recompute_granularity"):
        megatron_estimate(SMALL, recompute_granularity="block")
    with pytest.raises(ValueError, match="num_attention_heads"):
        layer_inventory(SMALL, tp=3)
    with pytest.raises(ValueError, match="device"):
        layer_inventory(SMALL, device="tpu")


# ------------------------------------------------------------------------ Megatron's estimator
MEG = ModelConfig(num_layers=8, hidden_size=256, num_attention_heads=4, vocab_size=500, seq_length=256,
                  micro_batch_size=4)  # ffn 1024 = 4h; vocab pads to 512


def test_megatron_without_sp_hand_computed():
    # compute_activation_memory_without_sp, t=1, p=1: (L·sbh(10+24) + 8sb + sbh + 2(sbv + sbh)) · 1.05
    s, b, h, v = 256, 4, 256, 512
    expected = (8 * s * b * h * 34 + 8 * s * b + s * b * h + 2 * (s * b * v + s * b * h)) * 1.05
    assert expected == pytest.approx(76803686.4)
    est = megatron_estimate(MEG)
    assert est["function"] == "compute_activation_memory_without_sp"
    assert est["megatron_args"]["padded_vocab_size"] == 512
    assert est["total_bytes"] == round(expected)
    assert est["per_layer_bytes"] == 34 * s * b * h
    json.dumps(est)


def test_megatron_with_sp_and_selective_hand_computed():
    # compute_activation_memory: (L·sbh(18 + 4f/h) + 8sbp + sbhp + 4sbh(1 + v/h)) / t
    s, b, h, v, t = 256, 4, 256, 512, 2
    expected = (8 * s * b * h * (18 + 16) + 8 * s * b + s * b * h + 4 * s * b * h * (1 + v / h)) / t
    assert expected == 37359616
    est = megatron_estimate(MEG, tp=t, sp=True, recompute_granularity="selective")
    assert est["function"] == "compute_activation_memory"
    assert est["total_bytes"] == expected
    # swiglu's ffn enters through 4·ffn/h; nothing else about the MLP does
    wide = megatron_estimate(MEG.replace(ffn_hidden_size=2048), tp=t, sp=True, recompute_granularity="selective")
    assert wide["total_bytes"] - est["total_bytes"] == 8 * s * b * h * 4 * (2048 - 1024) / h / t


def test_megatron_pipeline_factors():
    s, b, h = 256, 4, 256
    # non-interleaved: stage 0 holds min(m, p) of p microbatches' worth; no output layer on stage 0
    est = megatron_estimate(MEG, pp=4, num_microbatches=2)
    per_stage = (8 * s * b * h * 34 + 8 * s * b * 4 + s * b * h * 4) * 0.5 * 1.05
    assert est["total_bytes"] == round(per_stage)
    assert est["in_flight_microbatches"] == 2 and est["output_layer_bytes"] == 0
    inter = megatron_estimate(MEG, pp=4, virtual_pp=2, num_microbatches=8)
    assert inter["pipeline_factor"] == 1 + 3 / 8 and inter["in_flight_microbatches"] == 6


def test_megatron_does_not_model_full_recompute():
    for tp in (1, 2):
        full = megatron_estimate(MEG, tp=tp, recompute_granularity="full")
        selective = megatron_estimate(MEG, tp=tp, recompute_granularity="selective")
        none = megatron_estimate(MEG, tp=tp, recompute_granularity=None)
        assert full["total_bytes"] == selective["total_bytes"] == none["total_bytes"]
        assert not full["models_full_recompute"]
    # with sequence parallelism, full recompute even falls back to the larger no-SP formula
    full = megatron_estimate(MEG, tp=2, sp=True, recompute_granularity="full")
    selective = megatron_estimate(MEG, tp=2, sp=True, recompute_granularity="selective")
    assert full["total_bytes"] > selective["total_bytes"]
    # and it never includes the attention scores: per layer it is the paper's selective formula
    assert none["per_layer_bytes"] == korthikanti_layer_bytes(MEG, tp=2, recompute="selective")


# ------------------------------------------------------------------------ traced inventory
@pytest.mark.parametrize("name", list(TRACED))
def test_corrected_formula_equals_trace(name):
    config = TRACED[name]
    tl = trace(config)
    traced = traced_layer_bytes(tl, 0)
    assert traced == traced_layer_bytes(tl, 1)  # every layer keeps the same
    inv = layer_inventory(config)
    assert corrected_layer_bytes(config) == traced
    # tensor by tensor, not just the total
    assert sorted(r["nbytes"] for r in traced_layer_rows(tl, 0)) == sorted(t.nbytes for t in inv)
    for diff in explain_differences(config, traced):
        assert diff.unexplained_bytes == 0
        assert diff.corrected_bytes == traced
        assert diff.estimate_bytes + sum(r.nbytes for r in diff.reasons) == traced
        json.dumps(diff.to_dict())


def test_reference_layer_inventory_matches_docstring():
    c = SMALL
    inv = layer_inventory(c)
    e = 4
    assert sum(t.nbytes for t in inv) == 395264
    assert sum(t.nbytes for t in inv) == (16 * sbh(c) * e + 2 * sbh(c) * e + as2b(c) * 3 * e
                                          + 4 * c.seq_length * c.micro_batch_size * e + c.seq_length ** 2)
    assert korthikanti_layer_bytes(c) == 180224
    keys = [t.key for t in inv]
    assert keys == ["ln1_mean", "ln1_rstd", "ln1_out", "q", "k", "not_mask", "probs", "attn_dropout_mask",
                    "attn_dropout_out", "v", "proj_in", "attn_hidden_dropout_mask", "residual", "ln2_mean",
                    "ln2_rstd", "ln2_out", "fc1_out", "act_out", "mlp_hidden_dropout_mask", "layer_out"]
    assert {t.key: t.dtype for t in inv}["not_mask"] == "bool"


def test_reasons_are_quantified_from_the_config():
    c = SMALL
    traced = traced_layer_bytes(trace(c))
    paper, megatron = explain_differences(c, traced)
    r = {x.key: x.nbytes for x in paper.reasons}
    s, b = c.seq_length, c.micro_batch_size
    assert r["dtype"] == 2 * (16 * sbh(c) + 2 * as2b(c))           # fp32: +2 bytes per non-mask element
    assert r["hidden_dropout"] == 2 * sbh(c) * 3                  # CPU float noise, 4 bytes instead of 1
    assert r["attention_dropout"] == as2b(c) * 3
    assert r["attention"] == s * s                                # ~attention_mask, bool
    assert r["norm"] == 2 * 2 * s * b * 4                         # mean and rstd of both norms
    assert r["bias"] == 0
    assert paper.difference_bytes == traced - 180224
    assert paper.difference_fraction == pytest.approx((traced - 180224) / 180224)
    m = {x.key: x.nbytes for x in megatron.reasons}
    assert m["megatron_formula"] == 5 * as2b(c) == korthikanti_layer_bytes(c) - megatron.estimate_bytes
    assert "4,096 bytes" not in paper.reasons[0].detail  # details carry numbers, not templates
    assert any(ch.startswith("+1.00 KiB ~attention_mask") for x in paper.reasons for ch in x.changes)


def test_fused_and_llama_reasons():
    flash = TRACED["sdpa no dropout (CPU flash kernel)"]
    r = {x.key: x for x in explain_differences(flash, traced_layer_bytes(trace(flash)))[0].reasons}
    s, b, a = flash.seq_length, flash.micro_batch_size, flash.num_attention_heads
    # drops the softmax output (the only s x s tensor left once dropout is off), keeps lse and a float mask
    assert r["attention"].nbytes == -as2b(flash) * 4 + 4 * a * s * b + s * s * 4
    assert any("logsumexp" in ch for ch in r["attention"].changes)
    llama = TRACED["llama fp32 math"]
    f = llama.ffn_size
    r = {x.key: x for x in explain_differences(llama, traced_layer_bytes(trace(llama)))[0].reasons}
    assert r["mlp"].nbytes == (4 * f - 8 * llama.hidden_size) * s * b * 4
    assert r["gqa"].nbytes == 0 and "repeat_interleave" in r["gqa"].detail
    assert "rope" in r and "shared" in r["rope"].detail
    assert r["norm"].nbytes == 2 * (s * b * 4 + sbh(llama) * 4)


def test_cuda_branch_uses_bool_masks_and_fp32_stats():
    # unverified against a CUDA trace; checks only the modelled differences and 512-byte blocks
    cpu = {t.key: t for t in layer_inventory(SMALL.replace(dtype="bf16"))}
    cuda = {t.key: t for t in layer_inventory(SMALL.replace(dtype="bf16"), device="cuda")}
    assert cuda["attn_dropout_mask"].dtype == "bool" and cpu["attn_dropout_mask"].dtype == "bf16"
    assert cuda["ln1_mean"].dtype == "fp32"
    assert all(t.nbytes % 512 == 0 for t in cuda.values())


def test_tensor_parallel_inventory_splits_like_the_paper():
    c = SMALL.replace(num_attention_heads=4, **NO_DROPOUT)
    one = corrected_layer_bytes(c)
    tp2 = layer_inventory(c, tp=2)
    by_key = {t.key: t for t in tp2}
    assert by_key["q"].shape == (2, 2, 32, 16) and by_key["ln1_out"].shape == (2, 32, 64)
    sp2 = {t.key: t for t in layer_inventory(c, tp=2, sp=True)}
    assert sp2["ln1_out"].shape == (2, 16, 64)
    assert sum(t.nbytes for t in sp2.values()) < sum(t.nbytes for t in tp2) < one
