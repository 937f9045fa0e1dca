"""Korthikanti et al. 2022's per-layer activation bytes, reproduced exactly by a fake trace with CUDA kernels.

A Megatron-style GPT (LayerNorm, GeLU, learned positions, unfused attention, fp16, dropout on) traced with
``kernels='cuda'`` keeps the paper's tensors plus small terms the paper leaves out, each computed here from the
shapes (not taken from remat): the fp32 mean and rstd of the two LayerNorms, the negated causal mask that
``masked_fill`` keeps, and for fused attention its fp32 logsumexp and RNG state.
"""

from __future__ import annotations

import pytest
import torch.nn.functional as F

from remat.analysis.differences import traced_layer_bytes
from remat.config import ModelConfig
from remat.memory.predict import predict, predict_config
from remat.models.gpt import CoreAttention, build_model, sample_batch

S, B, H, A = 32, 2, 64, 4
SBH, AS2B = S * B * H, A * S * S * B
MEGATRON_GPT = ModelConfig(num_layers=2, hidden_size=H, num_attention_heads=A, seq_length=S, micro_batch_size=B,
                           vocab_size=128, dtype="fp16", hidden_dropout=0.1, attention_dropout=0.1)


def norm_statistics(t: int = 1, sp: bool = False) -> int:
    """Two LayerNorms, each keeping an fp32 mean and rstd per token (split by sequence parallelism)."""
    return 2 * 2 * S * B * 4 // (t if sp else 1)


NEGATED_CAUSAL_MASK = S * S  # masked_fill(~mask) keeps the bool ~mask, [1, 1, s, s], made in every layer
FLASH_LOGSUMEXP = 4 * A * S * B  # fp32 [b, a, s]
FLASH_RNG_STATE = 2 * 8 + 8  # the meta kernel's uint64 seed [2] and offset []


def paper(t: int = 1, sp: bool = False, selective: bool = False) -> int:
    """Table 2 of the paper, in exact integers (t divides every dimension here)."""
    scores = 0 if selective else 5 * AS2B // t
    if sp:
        return 34 * SBH // t + scores
    return 10 * SBH + 24 * SBH // t + scores


def traced(policy: str = "none", t: int = 1, sp: bool = False, kernels: str = "cuda",
           config: ModelConfig = MEGATRON_GPT) -> int:
    return traced_layer_bytes(predict_config(config, policy, tp=t, sp=sp, kernels=kernels), 0)


def show(label: str, formula: int, terms: dict[str, int], got: int) -> None:
    named = " + ".join(f"{name} {nbytes:,}" for name, nbytes in terms.items())
    print(f"{label}: formula {formula:,} + {named} = {formula + sum(terms.values()):,}; traced {got:,}")


@pytest.mark.parametrize("t, sp", [(1, False), (2, False), (2, True), (4, True)])
def test_no_recompute_is_the_paper_plus_named_terms(t: int, sp: bool) -> None:
    terms = {"LayerNorm fp32 mean/rstd": norm_statistics(t, sp), "negated causal mask": NEGATED_CAUSAL_MASK}
    got = traced("none", t, sp)
    show(f"none t={t} sp={sp}", paper(t, sp), terms, got)
    assert got == paper(t, sp) + sum(terms.values())


@pytest.mark.parametrize("t, sp", [(1, False), (2, False), (2, True)])
def test_selective_core_attention_removes_exactly_the_scores(t: int, sp: bool) -> None:
    # the recomputed core attention keeps only its inputs: q, k, v are views of the qkv output (the paper's
    # 6sbh/t), the causal mask is shared by all layers; ~mask is rebuilt in backward
    terms = {"LayerNorm fp32 mean/rstd": norm_statistics(t, sp)}
    got = traced("selective/core_attn", t, sp)
    show(f"selective t={t} sp={sp}", paper(t, sp, selective=True), terms, got)
    assert got == paper(t, sp, selective=True) + sum(terms.values())
    assert paper(t, sp, selective=True) == (34 * SBH // t if sp else SBH * 10 + 24 * SBH // t)


class CausalFlashAttention(CoreAttention):
    """Core attention as ``F.scaled_dot_product_attention(is_causal=True)``: CUDA picks the flash kernel."""

    def forward(self, q, k, v, attention_mask):  # type: ignore[override]
        p = self.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)


def flash_gpt():
    model = build_model(MEGATRON_GPT.replace(attention="sdpa"))
    for layer in model.layers:
        layer.self_attention.core_attention = CausalFlashAttention(MEGATRON_GPT)
    return model


def test_flash_attention_removes_the_scores_and_keeps_its_statistics() -> None:
    timeline = predict(flash_gpt, "none", batch=sample_batch(MEGATRON_GPT), kernels="cuda")
    terms = {"LayerNorm fp32 mean/rstd": norm_statistics(), "flash logsumexp": FLASH_LOGSUMEXP,
             "flash RNG state": FLASH_RNG_STATE}
    got = traced_layer_bytes(timeline, 0)
    show("flash", paper(selective=True), terms, got)
    assert got == 34 * SBH + sum(terms.values())


def test_transformer_engine_attention_is_the_flash_identity() -> None:
    # te, auto backend: TE's FusedAttention keeps fp32 Stats [b, a, s, 1] (the logsumexp's bytes) and an int64
    # rng_state [2] (TE 2.17.1 cpp_extensions/fused_attn.py, csrc/extensions/attention.cpp)
    got = traced(kernels="te", config=MEGATRON_GPT.replace(attention="sdpa"))
    assert got == 34 * SBH + norm_statistics() + FLASH_LOGSUMEXP + 2 * 8


@pytest.mark.parametrize("t, sp", [(1, False), (2, False), (2, True), (4, False)])
def test_transformer_engine_unfused_attention_is_the_paper(t: int, sp: bool) -> None:
    # te, --attention-backend unfused: ScaledMaskedSoftmax's fp16 output, dropout's bool mask and the dropped-out
    # probabilities are the paper's 5as²b/t; no mask is kept. With one head per rank (t=4, b*heads = 2) TE's fused
    # softmax cannot run: its torch softmax keeps fp32 probabilities (+2as²b/t) and masked_fill_'s bool mask (s²)
    fallback = {"fp32 softmax": 2 * AS2B // t, "masked_fill_ mask": S * S} if A // t * B % 4 else {}
    terms = {"LayerNorm fp32 mean/rstd": norm_statistics(t, sp), **fallback}
    got = traced("none", t, sp, kernels="te")
    show(f"te unfused t={t} sp={sp}", paper(t, sp), terms, got)
    assert got == paper(t, sp) + sum(terms.values())


def test_memory_efficient_attention_keeps_the_additive_mask() -> None:
    # attention='sdpa' passes the bool causal mask: flash refuses masks, the memory-efficient kernel runs and
    # keeps the mask converted to fp16 (made per layer), a logsumexp padded to 32 queries and its RNG seed/offset
    got = traced(config=MEGATRON_GPT.replace(attention="sdpa"))
    terms = {"LayerNorm fp32 mean/rstd": norm_statistics(), "fp16 additive mask": 2 * S * S,
             "logsumexp [b, a, 32*ceil(s/32)] fp32": 4 * A * B * 32 * -(-S // 32), "RNG seed/offset": 2 * 8}
    show("memory-efficient", 34 * SBH, terms, got)
    assert got == 34 * SBH + sum(terms.values())


def test_cpu_kernels_differ_by_the_float_dropout_noise() -> None:
    # the CPU trace keeps each dropout's noise in fp16 (2 bytes) where CUDA keeps a bool mask (1 byte), and its
    # LayerNorm statistics in fp16: per layer 2 sbh masks + as²b attention mask bytes more, 4 sb less
    cpu, cuda = traced(kernels="cpu"), traced(kernels="cuda")
    assert cpu - cuda == 2 * SBH + AS2B - 2 * 2 * S * B * (4 - 2)
