"""Closed-form activation-memory estimates, and why each one differs from what remat traces.

Three estimates of the bytes one transformer layer keeps for backward (no recompute) are computed here:

* :func:`korthikanti_layer_bytes` / :func:`korthikanti_terms`: Korthikanti et al. 2022 ("Reducing Activation
  Recomputation in Large Transformer Models"), Table 2: ``sbh(34 + 5as/h)`` with 16-bit activations, 1-byte
  dropout masks and a GeLU MLP of width 4h, and its tensor/sequence-parallel and recompute variants.
* :func:`megatron_estimate`: what Megatron-LM's ``megatron/training/theoretical_memory_usage.py`` reports for
  activations (all layers, embedding, output layer, pipeline in-flight factor), reproduced term by term.
* :func:`layer_inventory` / :func:`corrected_layer_bytes`: the exact list of tensors one layer of remat's
  reference GPT (:mod:`remat.model`) leaves alive for backward, from which :func:`explain_differences`
  derives, reason by reason, the difference between each published formula and the traced bytes.

What "one layer's traced bytes" means: the storages allocated while layer ``i`` ran its forward and still
alive when backward starts (:func:`traced_layer_bytes`). The layer's *input* was allocated by the previous
layer (or the embedding), so it is not counted; the layer's *output*, which the next layer's input norm keeps,
is counted instead. Both are ``[b, s, h]`` in the activation dtype, so this equals the paper's convention of
counting a layer's input norm input.

Inventory of one layer (reference GPT, fp32, ``attention='math'``, dropout 0.1, GeLU, LayerNorm, on CPU)
-----------------------------------------------------------------------------------------------------
s = seq_length, b = micro_batch_size, h = hidden, a = heads, d = h/a, f = ffn_hidden_size (4h), e = 4 bytes.
Each row is one storage (views count once); "kept by" is the autograd node that saves it.

====  ==========================================  ===============  ======  ==============================
 #    tensor (module that makes it)                shape            dtype   kept by / why
====  ==========================================  ===============  ======  ==============================
 1    input_layernorm mean                         [b, s, 1]        fp32    NativeLayerNormBackward0: the
                                                                           input gradient needs the
                                                                           per-token mean (*)
 2    input_layernorm rstd                         [b, s, 1]        fp32    same, 1/sqrt(var + eps) (*)
 3    input_layernorm output                       [b, s, h]        fp32    linear_qkv (addmm): weight
                                                                           gradient = grad^T @ input
 4    q, copied contiguous by matmul               [b, a, s, d]     fp32    BmmBackward0 (q @ k^T): q is a
                                                                           transposed view of the qkv
                                                                           output, so matmul's reshape
                                                                           copies it, and keeps the copy
 5    k^T, copied the same way                     [b, a, d, s]     fp32    BmmBackward0 (q @ k^T)
 6    ~attention_mask                              [1, 1, s, s]     bool    MaskedFillBackward0: the
                                                                           negated causal mask is a new
                                                                           tensor in every layer (s^2 B)
 7    softmax output (probabilities)               [b, a, s, s]     fp32    SoftmaxBackward0 (result)
 8    attention-dropout noise                      [b, a, s, s]     fp32    MulBackward0: CPU dropout is
                                                                           input * noise with a float
                                                                           noise tensor (CUDA keeps a
                                                                           1-byte bool mask)
 9    dropped probabilities                        [b, a, s, s]     fp32    BmmBackward0 (probs @ v)
 10   v, copied contiguous by matmul               [b, a, s, d]     fp32    BmmBackward0 (probs @ v)
 11   context.transpose(1, 2).reshape copy         [b, s, h]        fp32    linear_proj (addmm) input
 12   hidden-dropout noise after attention         [b, s, h]        fp32    MulBackward0 (float noise)
 13   residual hidden + dropout(attn)              [b, s, h]        fp32    pre_mlp_layernorm input
 14   pre_mlp_layernorm mean, rstd                 2 x [b, s, 1]    fp32    NativeLayerNormBackward0 (*)
 15   pre_mlp_layernorm output                     [b, s, h]        fp32    linear_fc1 (addmm) input
 16   linear_fc1 output                            [b, s, f]        fp32    GeluBackward0 (its input)
 17   GeLU output                                  [b, s, f]        fp32    linear_fc2 (addmm) input
 18   hidden-dropout noise after the MLP           [b, s, h]        fp32    MulBackward0 (float noise)
 19   layer output hidden + dropout(mlp)           [b, s, h]        fp32    next layer's input_layernorm
====  ==========================================  ===============  ======  ==============================

(*) on CPU LayerNorm's statistics are in the activation dtype; on CUDA they are fp32 whatever the dtype.

Total: ``16·sbh·e + 2·sbh·e_mask + as²b·(2e + e_mask) + 4·sb·e_stat + s²`` bytes, which for s=32, b=2, h=64,
a=4 is 395,264 bytes, exactly what remat traces; Korthikanti's ``sbh(34 + 5as/h)`` is 180,224.
Not kept: the qkv projection output (its q/k/v views are copied by matmul), the raw scores and the masked /
scaled scores (softmax keeps its output, mul by a constant and masked_fill keep no input), the attention
output of linear_proj and of linear_fc2 (dropout keeps only its noise, the add keeps nothing), biases (their
gradient is a sum of the output gradient). The causal mask itself and the rotary cos/sin tables are made once
by ``GPT.forward`` outside the layers and shared, so no layer counts them.

Variants (all traced in tests/test_formulas.py):

* dropout 0: F.dropout returns its input; rows 8, 12, 18 disappear and row 9 *is* row 7.
* ``attention='sdpa'`` on CPU, attention dropout 0: ``_scaled_dot_product_flash_attention_for_cpu`` keeps
  q, k, v (views of the qkv output, so the whole ``[b, s, (a+2g)d]`` qkv output is kept), the bool mask
  converted to a float additive mask ``[1, 1, s, s]`` in the activation dtype, its output (whose layout follows
  q: with q a transposed view, linear_proj's input is a view of it; with a contiguous q (rotary) linear_proj
  gets a copy) and the logsumexp ``[b, a, s]`` fp32 (4·a·s·b bytes). No s x s tensor.
* ``attention='sdpa'`` on CPU with attention dropout > 0: the flash kernel refuses dropout and the math
  fallback runs; it keeps the same q, k, probabilities, noise, dropped probabilities and v as rows 4-10 but no
  mask, and computes them in fp32 even for bf16/fp16 activations (torch upcasts the math kernel unless
  ``allow_fp16_bf16_reduction_math_sdp(True)``).
* SwiGLU: linear_fc1 makes ``[b, s, 2f]`` (gate and up, kept whole: silu keeps the gate view, the gating
  multiply keeps the up view), silu(gate) ``[b, s, f]`` (kept by the multiply) and the product ``[b, s, f]``
  (linear_fc2's input): 4f·sb elements instead of GeLU's 2f·sb.
* RMSNorm (torch's composite ``rms_norm`` on CPU): keeps the fp32 rstd ``[b, s, 1]`` and the fp32 normalised
  ``x·rstd`` ``[b, s, h]`` (for the weight multiply); when activations are not fp32 it keeps the fp32 upcast of
  its input ``[b, s, h]`` *instead of* the input, so the residual (row 13) and the layer output (row 19) are
  freed. On CUDA torch 2.13 runs ``_fused_rms_norm``, which keeps its input and the rstd.
* GQA: K and V are projected for g groups but repeated to a heads (``repeat_interleave``) before attention;
  the repeated copies are what is kept, so the saved K, V stay 2·sbh elements.
* Rotary: the rotated q and k (``torch.cat`` outputs, contiguous) are kept by the matmul instead of copies;
  the cos/sin multiplies keep only the (shared) tables.

The CUDA branch (``device='cuda'``) applies what differs on CUDA - 1-byte bool dropout masks, fp32 LayerNorm
statistics, the fused RMSNorm, the memory-efficient SDPA kernel, 512-byte allocator blocks - and is marked
unverified: it has not been checked against a CUDA trace here.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from remat.config import ModelConfig
from remat.timeline import Timeline

__all__ = [
    "DTYPE_BYTES", "Difference", "KorthikantiTerm", "KorthikantiTerms", "Reason", "SavedTensor",
    "corrected_layer_bytes", "explain_differences", "korthikanti_layer_bytes", "korthikanti_terms",
    "layer_inventory", "megatron_estimate", "traced_layer_bytes", "traced_layer_rows",
]

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
RECOMPUTE = ("none", "selective", "full")
DEVICES = ("cpu", "cuda")
CUDA_BLOCK = 512  # remat.measure rounds every CUDA storage up to the caching allocator's 512-byte blocks


# =====================================================================================================
# Korthikanti et al. 2022, Table 2
# =====================================================================================================
@dataclass(frozen=True)
class KorthikantiTerm:
    """One tensor (or tensor group) the paper counts, in bytes per layer on one tensor-parallel rank.

    ``split`` says how tensor/sequence parallelism divides it: ``'tp'`` (heads or FFN columns: /t),
    ``'sp'`` (replicated under plain TP, /t under sequence parallelism).
    """

    group: str     # "attention", "attention_scores", "mlp", "norms" or "layer_input" (full recompute)
    name: str
    formula: str   # in the paper's symbols, before the /t of parallelism
    split: str     # "tp" or "sp"
    nbytes: int    # rounded to a whole byte (exact whenever t divides the dimensions)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class KorthikantiTerms:
    """The paper's per-layer terms for one setting, their groups and their total."""

    s: int
    b: int
    h: int
    a: int
    tp: int
    sp: bool
    recompute: str
    terms: tuple[KorthikantiTerm, ...]
    total: int   # sum of the exact (fractional) terms, rounded once

    @property
    def groups(self) -> dict[str, int]:
        """Bytes by group: attention (11sbh), attention_scores (5as²b), mlp (19sbh), norms (4sbh) at t=1."""
        out: dict[str, int] = {}
        for term in self.terms:
            out[term.group] = out.get(term.group, 0) + term.nbytes
        return out

    @property
    def formula(self) -> str:
        if self.recompute == "full":
            return "2sbh/t" if self.sp and self.tp > 1 else "2sbh"
        scores = "" if self.recompute == "selective" else " + 5as/h"
        if self.tp == 1:
            return f"sbh(34{scores})"
        if self.sp:
            return f"(sbh/t)(34{scores})" if scores else "34sbh/t"
        return f"sbh(10 + 24/t{scores.replace('5as/h', '5as/(ht)')})"

    def to_dict(self) -> dict[str, Any]:
        return {"s": self.s, "b": self.b, "h": self.h, "a": self.a, "tp": self.tp, "sp": self.sp,
                "recompute": self.recompute, "formula": self.formula, "total_bytes": self.total,
                "groups": self.groups, "terms": [t.to_dict() for t in self.terms]}


# (group, name, formula, split, coefficient of sbh, coefficient of as²b) -- bytes at 16-bit, 1-byte masks
_PAPER_TERMS: tuple[tuple[str, str, str, str, int, int], ...] = (
    ("attention", "QKV input (input_layernorm output)", "2sbh", "sp", 2, 0),
    ("attention", "Q and K (for QK^T)", "4sbh", "tp", 4, 0),
    ("attention_scores", "softmax output", "2as²b", "tp", 0, 2),
    ("attention_scores", "attention-dropout mask", "as²b", "tp", 0, 1),
    ("attention_scores", "attention-dropout output (for attention over V)", "2as²b", "tp", 0, 2),
    ("attention", "V (for attention over V)", "2sbh", "tp", 2, 0),
    ("attention", "output-projection input", "2sbh", "tp", 2, 0),
    ("attention", "dropout mask after attention", "sbh", "sp", 1, 0),
    ("mlp", "linear_fc1 input", "2sbh", "sp", 2, 0),
    ("mlp", "GeLU input (4h)", "8sbh", "tp", 8, 0),
    ("mlp", "linear_fc2 input (GeLU output, 4h)", "8sbh", "tp", 8, 0),
    ("mlp", "dropout mask after the MLP", "sbh", "sp", 1, 0),
    ("norms", "input_layernorm input", "2sbh", "sp", 2, 0),
    ("norms", "pre_mlp_layernorm input", "2sbh", "sp", 2, 0),
)


def _check_parallel(tp: int, sp: bool) -> None:
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp={tp!r}: the tensor-parallel size must be a positive integer")
    if sp and tp == 1:
        pass  # sequence parallelism over one rank is the no-parallelism case; the paper's formulas agree


def _round(x: Fraction) -> int:
    return int(x.numerator * 2 + x.denominator) // (2 * x.denominator) if x >= 0 else -_round(-x)


def korthikanti_terms(config: ModelConfig, tp: int = 1, sp: bool = False,
                      recompute: str = "none") -> KorthikantiTerms:
    """The paper's per-layer activation terms for ``config``'s s, b, h, a (Table 2 and Section 4).

    ``recompute``: ``'none'`` (all 34sbh + 5as²b), ``'selective'`` (the 5as²b attention-score terms are
    recomputed, so left out), ``'full'`` (only the layer input, 2sbh, or 2sbh/t when sequence parallelism
    splits it). Under tensor parallelism (``tp`` = t) the attention heads and the MLP columns are split (/t);
    the norms' inputs, the linear inputs after them and the dropout masks (10sbh) are replicated unless ``sp``.
    The paper assumes 16-bit activations, 1-byte dropout masks, dropout on, unfused attention and a GeLU MLP of
    width 4h; ``config``'s dtype, dropout, attention, activation and FFN width are ignored here on purpose
    (:func:`explain_differences` accounts for them).
    """
    _check_parallel(tp, sp)
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r}: must be one of {', '.join(RECOMPUTE)}")
    s, b, h, a = config.seq_length, config.micro_batch_size, config.hidden_size, config.num_attention_heads
    sbh, as2b = s * b * h, a * s * s * b
    exact: list[tuple[KorthikantiTerm, Fraction]] = []
    if recompute == "full":
        value = Fraction(2 * sbh, tp if sp else 1)
        exact.append((KorthikantiTerm("layer_input", "layer input (the checkpoint's only saved tensor)", "2sbh",
                                      "sp", _round(value)), value))
    else:
        for group, name, formula, split, c_sbh, c_as2b in _PAPER_TERMS:
            if recompute == "selective" and group == "attention_scores":
                continue
            divisor = tp if (split == "tp" or sp) else 1
            value = Fraction(c_sbh * sbh + c_as2b * as2b, divisor)
            exact.append((KorthikantiTerm(group, name, formula, split, _round(value)), value))
    total = _round(sum((v for _, v in exact), Fraction(0)))
    return KorthikantiTerms(s, b, h, a, tp, sp, recompute, tuple(t for t, _ in exact), total)


def korthikanti_layer_bytes(config: ModelConfig, tp: int = 1, sp: bool = False, recompute: str = "none") -> int:
    """Korthikanti et al. 2022 Table 2: activation bytes one layer keeps, on one tensor-parallel rank.

    ``sbh(34 + 5as/h)`` without parallelism, ``sbh(10 + 24/t + 5as/(ht))`` with tensor parallelism,
    ``(sbh/t)(34 + 5as/h)`` with sequence parallelism too; ``'selective'`` drops the 5as/h term; ``'full'``
    keeps 2sbh (2sbh/t with ``sp``). See :func:`korthikanti_terms` for the terms and assumptions.
    """
    return korthikanti_terms(config, tp, sp, recompute).total


# =====================================================================================================
# Megatron-LM's theoretical_memory_usage
# =====================================================================================================
def _padded_vocab(vocab: int, tp: int, divisible_by: int) -> int:
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def megatron_estimate(config: ModelConfig, tp: int = 1, sp: bool = False, pp: int = 1,
                      num_microbatches: int | None = 1, recompute_granularity: str | None = None,
                      virtual_pp: int | None = None, make_vocab_size_divisible_by: int = 128) -> dict[str, Any]:
    """The activation bytes Megatron-LM's ``report_theoretical_memory`` computes (first pipeline stage).

    Megatron (``megatron/training/theoretical_memory_usage.py``) picks one of two functions:

    * ``sequence_parallel and recompute_granularity == 'selective'``: ``compute_activation_memory``, the
      paper's SP + selective formula with the MLP scaled to the FFN width, ``sbh(18 + 4·ffn/h)`` per layer,
      times ``num_layers``, plus the embedding input (8 bytes per token: int64 ids) and embedding-dropout mask
      (sbh) for ``pp`` microbatches in flight, times the interleaved-schedule penalty
      ``1 + (p-1)/(p·v)`` or the discount ``min(1, m/p)``, plus (``pp == 1``) the output layer and loss
      ``4sbh(1 + v/h)``; everything divided by t.
    * otherwise: ``compute_activation_memory_without_sp``, ``sbh(10 + 24/t)`` per layer (the TP + selective
      formula, FFN width ignored), the same embedding terms (not divided by t), the same pipeline factor,
      plus (``pp == 1``) ``2(sbv/t + sbh)`` for logits and final-norm output, all times 1.05.

    Either way every layer is priced at a *selective-recompute* formula whatever ``recompute_granularity`` is:
    the 5as²b attention scores are never counted, full recompute is never modelled, and GQA, SwiGLU, the
    activation dtype and dropout settings are ignored. The arguments map to Megatron's: ``tp`` ->
    tensor_model_parallel_size, ``sp`` -> sequence_parallel, ``pp`` -> pipeline_model_parallel_size,
    ``virtual_pp`` -> virtual_pipeline_model_parallel_size; from ``config``: seq_length, micro_batch_size,
    hidden_size, ffn_hidden_size (``config.ffn_size``), num_layers and padded_vocab_size (``vocab_size``
    padded to a multiple of ``make_vocab_size_divisible_by · tp``, as Megatron pads it).
    """
    _check_parallel(tp, sp)
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise ValueError(f"pp={pp!r}: the pipeline-parallel size must be a positive integer")
    if recompute_granularity not in (None, "full", "selective"):
        raise ValueError(f"recompute_granularity={recompute_granularity!r}: must be None, 'full' or 'selective'")
    if virtual_pp is not None and (not isinstance(virtual_pp, int) or virtual_pp < 1):
        raise ValueError(f"virtual_pp={virtual_pp!r}: must be None or a positive integer")
    if num_microbatches is not None and (not isinstance(num_microbatches, int) or num_microbatches < 1):
        raise ValueError(f"num_microbatches={num_microbatches!r}: must be None or a positive integer")
    s, b, h = config.seq_length, config.micro_batch_size, config.hidden_size
    f, layers = config.ffn_size, config.num_layers
    v = _padded_vocab(config.vocab_size, tp, make_vocab_size_divisible_by)
    sbh = s * b * h
    with_sp = bool(sp) and recompute_granularity == "selective"
    args = {
        "seq_length": s, "micro_batch_size": b, "hidden_size": h, "ffn_hidden_size": f, "num_layers": layers,
        "padded_vocab_size": v, "tensor_model_parallel_size": tp, "sequence_parallel": bool(sp),
        "pipeline_model_parallel_size": pp, "virtual_pipeline_model_parallel_size": virtual_pp,
        "recompute_granularity": recompute_granularity, "num_microbatches": num_microbatches,
    }
    if with_sp:
        per_layer_unsplit = sbh * (18 + 4 * (f / h))
        per_layer = per_layer_unsplit / tp
        per_layer_formula = "sbh(18 + 4·ffn/h)/t"
        divisor = tp
    else:
        per_layer_unsplit = sbh * (10 + 24 / tp)
        per_layer = per_layer_unsplit
        per_layer_formula = "sbh(10 + 24/t)"
        divisor = 1
    memory = per_layer_unsplit * layers
    embedding_input = 8 * s * b * pp
    embedding_dropout = s * b * h * pp
    memory += embedding_input + embedding_dropout
    factor = 1.0
    in_flight = pp
    if virtual_pp is not None:
        factor = 1 + (pp - 1) / (pp * virtual_pp)
        in_flight = math.ceil(factor * pp)
    elif pp > 1 and num_microbatches is not None:
        factor = min(1, num_microbatches / pp)
        in_flight = min(num_microbatches, pp)
    memory *= factor
    output_layer = 0.0
    if pp == 1:
        output_layer = sbh * 4 * (1 + v / h) if with_sp else (s * b * v / tp + sbh) * 2
    memory += output_layer
    overhead = 1.0 if with_sp else 1.05
    total = memory / divisor * overhead
    paper_scores = 5 * config.num_attention_heads * s * s * b / tp
    notes = [
        f"every layer is priced at a selective-recompute formula ({per_layer_formula} = {per_layer:,.0f} bytes); "
        f"the attention-score term 5as²b/t = {paper_scores:,.0f} bytes per layer is never counted",
        f"recompute_granularity={recompute_granularity!r} changes only which formula is picked; full recompute, "
        f"which keeps 2sbh{'/t' if sp and tp > 1 else ''} = {2 * sbh / (tp if sp else 1):,.0f} bytes per layer, "
        "is not modelled",
        "activation dtype, dropout, fused attention, GQA, SwiGLU, RMSNorm and rotary are ignored"
        + (" (the FFN width enters only as 4·ffn/h)" if with_sp else " (so is the FFN width)")
        + "; no transient (recompute working set, gradients, logits' softmax) is included",
    ]
    return {
        "function": "compute_activation_memory" if with_sp else "compute_activation_memory_without_sp",
        "megatron_args": args,
        "per_layer_formula": per_layer_formula,
        "per_layer_bytes": int(round(per_layer)),
        "layers_bytes": per_layer_unsplit * layers / divisor,
        "embedding_input_bytes": embedding_input / divisor,
        "embedding_dropout_bytes": embedding_dropout / divisor,
        "pipeline_factor": factor,
        "in_flight_microbatches": in_flight,
        "output_layer_bytes": output_layer / divisor,
        "overhead_factor": overhead,
        "tp_divisor": divisor,
        "total_bytes": int(round(total)),
        "total_mib": total / 2**20,
        "models_full_recompute": False,
        "notes": notes,
    }


# =====================================================================================================
# The reference layer's exact inventory
# =====================================================================================================
@dataclass(frozen=True)
class SavedTensor:
    """One storage a layer leaves alive for backward.

    ``shape`` is per tensor-parallel rank; ``nbytes`` is the storage size (rounded to 512-byte blocks for
    ``device='cuda'``, as remat's recorder does). ``paper_term`` names the Korthikanti term it corresponds to
    (None: the paper has no such term).
    """

    key: str
    name: str
    module: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    saved_by: str
    why: str
    paper_term: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class _Layout:
    """Everything that decides which tensors a layer keeps; ``_paper_layout`` is Korthikanti's assumptions."""

    s: int
    b: int
    h: int
    a: int
    g: int
    f: int
    act: str          # activation dtype name ("16-bit" for the paper)
    e: int            # bytes per activation element
    hidden_mask: int  # bytes per hidden-dropout mask element; 0: no hidden dropout
    hidden_mask_dtype: str
    attn_mask: int    # bytes per attention-dropout mask element; 0: no attention dropout
    attn_mask_dtype: str
    attention: str    # "paper" | "math" | "sdpa_math" | "sdpa_flash_cpu" | "sdpa_efficient_cuda"
    norm: str         # "paper" | "layernorm" | "rmsnorm" | "rmsnorm_fused"
    stat: int         # bytes per LayerNorm statistic
    stat_dtype: str
    mlp: str          # "gelu" | "swiglu"
    rope: bool
    device: str

    @property
    def d(self) -> int:
        return self.h // self.a


def _paper_layout(config: ModelConfig, device: str) -> _Layout:
    h = config.hidden_size
    a = config.num_attention_heads
    return _Layout(config.seq_length, config.micro_batch_size, h, a, a, 4 * h, "16-bit", 2, 1, "1-byte mask", 1,
                   "1-byte mask", "paper", "paper", 0, "", "gelu", False, device)


def _config_layout(config: ModelConfig, device: str) -> _Layout:
    e = DTYPE_BYTES[config.dtype]
    cuda = device == "cuda"
    mask, mask_dtype = (1, "bool") if cuda else (e, config.dtype)
    if config.attention == "math":
        attention = "math"
    elif cuda:
        attention = "sdpa_efficient_cuda"
    else:
        attention = "sdpa_math" if config.attention_dropout > 0 else "sdpa_flash_cpu"
    if config.normalization == "layernorm":
        norm = "layernorm"
        stat, stat_dtype = (4, "fp32") if cuda else (e, config.dtype)
    else:
        norm, stat, stat_dtype = ("rmsnorm_fused" if cuda else "rmsnorm"), 4, "fp32"
    return _Layout(
        config.seq_length, config.micro_batch_size, config.hidden_size, config.num_attention_heads,
        config.query_groups, config.ffn_size, config.dtype, e,
        mask if config.hidden_dropout > 0 else 0, mask_dtype,
        mask if config.attention_dropout > 0 else 0, mask_dtype,
        attention, norm, stat, stat_dtype, config.activation, config.position == "rope", device)


def _per_rank(n: int, t: int, what: str) -> int:
    if n % t:
        raise ValueError(f"{what}={n} is not divisible by the tensor-parallel size {t}: Megatron requires it")
    return n // t


def _inventory(lay: _Layout, tp: int = 1, sp: bool = False) -> list[SavedTensor]:
    """The storages one layer keeps, in the order the forward makes them. See the module docstring."""
    s, b, h, e, act = lay.s, lay.b, lay.h, lay.e, lay.act
    a_r = _per_rank(lay.a, tp, "num_attention_heads")
    g_r = _per_rank(lay.g, tp, "num_query_groups")
    f_r = _per_rank(lay.f, tp, "ffn_hidden_size")
    h_r = a_r * lay.d
    s_seq = _per_rank(s, tp, "seq_length") if sp else s  # tokens per rank for replicated-or-SP tensors
    d = lay.d
    block = CUDA_BLOCK if lay.device == "cuda" else 1
    items: list[SavedTensor] = []

    def add(key: str, name: str, module: str, shape: tuple[int, ...], dtype: str, elem: int, saved_by: str,
            why: str, paper_term: str | None = None) -> None:
        nbytes = math.prod(shape) * elem
        items.append(SavedTensor(key, name, module, shape, dtype, -(-nbytes // block) * block, saved_by, why,
                                 paper_term))

    paper = lay.attention == "paper"

    def norm(prefix: str, module: str, consumer: str, paper_input: str) -> None:
        if lay.norm == "layernorm":
            for stat in ("mean", "rstd"):
                add(f"{prefix}_{stat}", f"{module} {stat}", module, (b, s_seq, 1), lay.stat_dtype, lay.stat,
                    "NativeLayerNormBackward0", "the input gradient of LayerNorm needs the per-token "
                    f"{stat} ({'fp32 on CUDA' if lay.device == 'cuda' else 'activation dtype on CPU'})")
        elif lay.norm == "rmsnorm":
            if e != 4:
                add(f"{prefix}_upcast", f"{module} input upcast to fp32", module, (b, s_seq, h), "fp32", 4,
                    "PowBackward0, MulBackward0", "torch's composite rms_norm computes in fp32 and keeps the "
                    "upcast input for x² and x·rstd (and not the input itself)",
                    "norms: input_layernorm input 2sbh" if prefix == "ln1" else "norms: pre_mlp_layernorm input 2sbh")
            add(f"{prefix}_rstd", f"{module} rstd", module, (b, s_seq, 1), "fp32", 4,
                "RsqrtBackward0, MulBackward0", "1/sqrt(mean(x²) + eps), kept for the input gradient")
            add(f"{prefix}_normalized", f"{module} x·rstd (fp32)", module, (b, s_seq, h), "fp32", 4,
                "MulBackward0 (× weight)", "the weight gradient needs the normalised input")
        elif lay.norm == "rmsnorm_fused":
            add(f"{prefix}_rstd", f"{module} rstd", module, (b, s_seq, 1), "fp32", 4, "_FusedRmsNormBackward0",
                "the fused RMSNorm keeps its input (counted elsewhere) and rstd")
        add(f"{prefix}_out", f"{module} output", module, (b, s_seq, h), act, e,
            f"{consumer} (weight gradient)", "a linear layer keeps its input for its weight gradient",
            paper_input)

    norm("ln1", "input_layernorm", "linear_qkv", "attention: QKV input 2sbh")

    heads = (b, a_r, s, d)
    scores = (b, a_r, s, s)
    q_name = ("q after rotary (torch.cat output)" if lay.rope else "q copied contiguous by matmul")
    if lay.g < lay.a:
        k_name, v_name = "k repeated to all heads (repeat_interleave)", "v repeated to all heads"
    else:
        k_name = "k after rotary (torch.cat output)" if lay.rope else "k^T copied contiguous by matmul"
        v_name = "v copied contiguous by matmul"
    if paper:
        q_name, k_name, v_name = "Q", "K", "V"
    mod = "self_attention.core_attention"
    if lay.attention in ("paper", "math", "sdpa_math"):
        c, c_dtype = e, act
        if lay.attention == "sdpa_math" and e < 4:
            c, c_dtype = 4, "fp32"  # torch's math SDPA upcasts half types unless allowed to reduce in them
        if lay.attention == "sdpa_math":
            q_name, k_name, v_name = ("q·sqrt(scale) copied by matmul", "k·sqrt(scale) copied by matmul",
                                      "v (copied by matmul)")
        add("q", q_name, mod, heads, c_dtype, c, "BmmBackward0 (q @ k^T)", "the matmul's gradient for k needs q",
            "attention: Q and K 4sbh")
        add("k", k_name, mod, heads, c_dtype, c, "BmmBackward0 (q @ k^T)", "the matmul's gradient for q needs k",
            "attention: Q and K 4sbh")
        if lay.attention == "math":
            add("not_mask", "~attention_mask", mod, (1, 1, s, s), "bool", 1, "MaskedFillBackward0",
                "masked_fill keeps its mask; the model negates the causal mask in every layer, a new tensor")
        add("probs", "softmax output", mod, scores, c_dtype, c, "SoftmaxBackward0 (result)",
            "softmax's gradient is computed from its output", "attention scores: softmax output 2as²b")
        if lay.attn_mask:
            m, m_dtype = (c, c_dtype) if lay.attention == "sdpa_math" else (lay.attn_mask, lay.attn_mask_dtype)
            add("attn_dropout_mask", "attention-dropout mask", mod, scores, m_dtype, m,
                "MulBackward0 (CPU noise)" if lay.device == "cpu" else "NativeDropoutBackward0 (mask)",
                "dropout's gradient is grad × mask / (1 - p)", "attention scores: dropout mask as²b")
            add("attn_dropout_out", "dropped probabilities", mod, scores, c_dtype, c, "BmmBackward0 (probs @ v)",
                "the matmul's gradient for v needs the probabilities", "attention scores: dropout output 2as²b")
        add("v", v_name, mod, heads, c_dtype, c, "BmmBackward0 (probs @ v)",
            "the matmul's gradient for the probabilities needs v", "attention: V 2sbh")
        add("proj_in", "context transposed to [b, s, h] (copy)", "self_attention", (b, s, h_r), act, e,
            "linear_proj (weight gradient)", "a linear layer keeps its input", "attention: projection input 2sbh")
    else:  # fused SDPA kernels: q, k, v, output, logsumexp, mask; no s x s tensor
        q_sep, k_sep, v_sep = lay.rope, lay.rope or lay.g < lay.a, lay.g < lay.a
        node = ("ScaledDotProductFlashAttentionForCpuBackward0" if lay.attention == "sdpa_flash_cpu"
                else "ScaledDotProductEfficientAttentionBackward0")
        if not (q_sep and k_sep and v_sep):
            views = ", ".join(n for n, sep in (("q", q_sep), ("k", k_sep), ("v", v_sep)) if not sep)
            add("qkv", "linear_qkv output", "self_attention.linear_qkv", (b, s, (a_r + 2 * g_r) * d), act, e,
                node, f"the kernel keeps {views} as views of the qkv output, so the whole storage stays",
                "attention: Q, K, V 6sbh")
        if q_sep:
            add("q", "q after rotary (torch.cat output)", "self_attention", heads, act, e, node,
                "the kernel keeps its query", "attention: Q and K 4sbh")
        if k_sep:
            add("k", k_name, mod if lay.g < lay.a else "self_attention", heads, act, e, node,
                "the kernel keeps its key", "attention: Q and K 4sbh")
        if v_sep:
            add("v", v_name, mod, heads, act, e, node, "the kernel keeps its value", "attention: V 2sbh")
        cols = s if lay.attention == "sdpa_flash_cpu" else -(-s // 16) * 16
        add("float_mask", "causal mask as a float additive bias", mod, (1, 1, s, cols), act, e, node,
            "SDPA converts the bool mask to -inf/0 in the query dtype and keeps it")
        lse_s = s if lay.attention == "sdpa_flash_cpu" else -(-s // 32) * 32
        add("lse", "softmax logsumexp", mod, (b, a_r, lse_s), "fp32", 4, node,
            "the kernel recomputes the probabilities in backward from q, k and these statistics")
        shared = lay.attention == "sdpa_efficient_cuda" or not lay.rope
        add("attn_out", "attention output" + (" (linear_proj's input is a view of it)" if shared else ""), mod,
            heads, act, e, node + (", linear_proj" if shared else ""), "the kernel's backward needs its output",
            "attention: projection input 2sbh" if shared else None)
        if not shared:
            add("proj_in", "context transposed to [b, s, h] (copy)", "self_attention", (b, s, h_r), act, e,
                "linear_proj (weight gradient)", "the output's layout follows the contiguous (rotary) q, so "
                "transpose + reshape copies it", "attention: projection input 2sbh")
        if lay.attention == "sdpa_efficient_cuda" and lay.attn_mask:
            for which in ("seed", "offset"):
                add(f"philox_{which}", f"dropout RNG {which}", mod, (), "int64", 8, node,
                    "in-kernel dropout is replayed in backward from the RNG seed and offset")
    if lay.hidden_mask:
        add("attn_hidden_dropout_mask", "dropout mask after attention", "layer", (b, s_seq, h),
            lay.hidden_mask_dtype, lay.hidden_mask,
            "MulBackward0 (CPU noise)" if lay.device == "cpu" else "NativeDropoutBackward0 (mask)",
            "dropout's gradient is grad × mask / (1 - p)", "attention: dropout mask sbh")
    # A half-precision RMSNorm (composite, CPU) keeps the fp32 upcast of its input instead of the input itself:
    # then neither the residual nor the layer output stays alive (the next norm keeps its own upcast).
    norm_keeps_input = not (lay.norm == "rmsnorm" and e != 4)
    if norm_keeps_input:
        add("residual", "residual after attention", "layer", (b, s_seq, h), act, e, "pre_mlp_layernorm",
            "the norm's gradient needs its input", "norms: pre_mlp_layernorm input 2sbh")
    norm("ln2", "pre_mlp_layernorm", "linear_fc1", "mlp: linear_fc1 input 2sbh")
    if lay.mlp == "gelu":
        add("fc1_out", "linear_fc1 output", "mlp.linear_fc1", (b, s, f_r), act, e, "GeluBackward0",
            "GeLU's gradient needs its input", "mlp: GeLU input 8sbh")
        add("act_out", "GeLU output", "mlp.activation", (b, s, f_r), act, e, "linear_fc2 (weight gradient)",
            "a linear layer keeps its input", "mlp: linear_fc2 input 8sbh")
    else:
        add("fc1_out", "linear_fc1 output (gate and up)", "mlp.linear_fc1", (b, s, 2 * f_r), act, e,
            "SiluBackward0 (gate view), MulBackward0 (up view)", "silu's gradient needs the gate and the gating "
            "multiply's gradient needs up; both are views of one storage")
        add("silu_out", "silu(gate)", "mlp.activation", (b, s, f_r), act, e, "MulBackward0",
            "the gating multiply's gradient for up needs silu(gate)")
        add("act_out", "silu(gate) · up", "mlp.activation", (b, s, f_r), act, e, "linear_fc2 (weight gradient)",
            "a linear layer keeps its input", "mlp: linear_fc2 input 8sbh")
    if lay.hidden_mask:
        add("mlp_hidden_dropout_mask", "dropout mask after the MLP", "layer", (b, s_seq, h), lay.hidden_mask_dtype,
            lay.hidden_mask, "MulBackward0 (CPU noise)" if lay.device == "cpu" else "NativeDropoutBackward0 (mask)",
            "dropout's gradient is grad × mask / (1 - p)", "mlp: dropout mask sbh")
    if norm_keeps_input:
        add("layer_out", "layer output", "layer", (b, s_seq, h), act, e, "next layer's input_layernorm (or the "
            "final norm)", "counted in place of this layer's input, which the previous layer allocated",
            "norms: input_layernorm input 2sbh")
    return items


def _check_device(device: str) -> None:
    if device not in DEVICES:
        raise ValueError(f"device={device!r}: must be one of {', '.join(DEVICES)}")


def layer_inventory(config: ModelConfig, tp: int = 1, sp: bool = False, device: str = "cpu") -> list[SavedTensor]:
    """Every storage one layer of the reference GPT keeps for backward (no recompute), per TP rank.

    Exact on CPU (checked against remat's traces); ``device='cuda'`` applies the known CUDA differences and is
    unverified. With ``tp > 1`` the shapes are those of a Megatron-style tensor(-and-sequence)-parallel rank.
    """
    _check_parallel(tp, sp)
    _check_device(device)
    return _inventory(_config_layout(config, device), tp, sp)


def corrected_layer_bytes(config: ModelConfig, tp: int = 1, sp: bool = False, device: str = "cpu") -> int:
    """The corrected formula: Korthikanti's count redone for this model's actual saved tensors."""
    return sum(t.nbytes for t in layer_inventory(config, tp, sp, device))


# =====================================================================================================
# Explaining the differences
# =====================================================================================================
@dataclass(frozen=True)
class Reason:
    """One cause of a difference: ``nbytes`` is what it adds to the estimate to reach the trace (signed)."""

    key: str
    title: str
    nbytes: int
    detail: str
    changes: tuple[str, ...] = ()   # the tensors it adds, removes or resizes, each with its bytes

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Difference:
    """One published estimate beside the traced bytes of one layer, and the reasons they differ.

    ``difference_bytes = traced_bytes - estimate_bytes``; ``difference_fraction`` is that over the estimate.
    ``corrected_bytes = estimate_bytes + sum(reason bytes)`` (the inventory total); whatever is left,
    ``unexplained_bytes = traced_bytes - corrected_bytes``, is zero when the inventory is exact.
    """

    source: str
    formula: str
    estimate_bytes: int
    traced_bytes: int
    reasons: tuple[Reason, ...] = field(default_factory=tuple)

    @property
    def difference_bytes(self) -> int:
        return self.traced_bytes - self.estimate_bytes

    @property
    def difference_fraction(self) -> float:
        return self.difference_bytes / self.estimate_bytes if self.estimate_bytes else math.inf

    @property
    def explained_bytes(self) -> int:
        return sum(r.nbytes for r in self.reasons)

    @property
    def corrected_bytes(self) -> int:
        return self.estimate_bytes + self.explained_bytes

    @property
    def unexplained_bytes(self) -> int:
        return self.traced_bytes - self.corrected_bytes

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "formula": self.formula, "estimate_bytes": self.estimate_bytes,
                "traced_bytes": self.traced_bytes, "difference_bytes": self.difference_bytes,
                "difference_fraction": self.difference_fraction, "explained_bytes": self.explained_bytes,
                "corrected_bytes": self.corrected_bytes, "unexplained_bytes": self.unexplained_bytes,
                "reasons": [r.to_dict() for r in self.reasons]}


def _fmt(n: int | float) -> str:
    return f"{n:+,.0f}" if n else "0"


def _changes(before: list[SavedTensor], after: list[SavedTensor]) -> tuple[str, ...]:
    old = {t.key: t for t in before}
    new = {t.key: t for t in after}
    out = []
    for t in after:
        if t.key not in old:
            out.append(f"{_fmt(t.nbytes)} {t.name} {list(t.shape)} {t.dtype}")
        elif old[t.key].nbytes != t.nbytes or old[t.key].dtype != t.dtype:
            o = old[t.key]
            was = f"{list(o.shape)} {o.dtype}"
            now = f"{list(t.shape) if t.shape != o.shape else ''} {t.dtype if t.dtype != o.dtype else ''}".strip()
            out.append(f"{_fmt(t.nbytes - o.nbytes)} {t.name} {was} -> {now}")
    out.extend(f"{_fmt(-t.nbytes)} {t.name} {list(t.shape)} {t.dtype} (not kept)" for t in before
               if t.key not in new)
    return tuple(out)


def _step_reasons(config: ModelConfig, tp: int, sp: bool, device: str) -> list[Reason]:
    """Walk from the paper's layout to the model's one change at a time; each step's byte change is a reason.

    The steps are ordered (dtype, dropout, attention kernel, MLP, norms, GQA, rotary, biases), so each is
    priced under the previous ones: e.g. the SwiGLU step uses the model's dtype. They add up exactly to
    ``corrected_layer_bytes - korthikanti_layer_bytes``.
    """
    s, b, h, a = config.seq_length, config.micro_batch_size, config.hidden_size, config.num_attention_heads
    e = DTYPE_BYTES[config.dtype]
    cur = _paper_layout(config, device)
    target = _config_layout(config, device)
    reasons: list[Reason] = []
    t_heads = f"/t={tp}" if tp > 1 else ""

    def step(key: str, title: str, detail: str, **changes: Any) -> None:
        nonlocal cur
        nxt = dataclasses.replace(cur, **changes)
        before, after = _inventory(cur, tp, sp), _inventory(nxt, tp, sp)
        delta = sum(t.nbytes for t in after) - sum(t.nbytes for t in before)
        reasons.append(Reason(key, title, delta, detail, _changes(before, after) if key != "dtype" else ()))
        cur = nxt

    # 1. activation dtype
    paper_inv = _inventory(cur, tp, sp)
    elems = sum(math.prod(t.shape) for t in paper_inv if "mask" not in t.dtype)
    step("dtype", f"activation dtype {config.dtype}",
         (f"{config.dtype} activations take {e} bytes per element where the paper assumes 2: the {elems:,} "
          f"non-mask elements it counts per layer (16sbh + 2as²b{t_heads}, the softmax output included, which "
          f"the model keeps in {config.dtype}) change by {e - 2:+d} bytes each = {_fmt(elems * (e - 2))} bytes")
         if e != 2 else f"{config.dtype} is 2 bytes per element, as the paper assumes: no change",
         act=target.act, e=target.e)
    # 2-3. dropout
    mask_words = ("a float noise tensor in the activation dtype (CPU dropout is input × noise)" if device == "cpu"
                  else "a 1-byte bool mask (native_dropout), as the paper")
    if config.hidden_dropout > 0:
        hd = (f"hidden_dropout={config.hidden_dropout}: each of the two dropouts after attention and MLP keeps "
              f"{mask_words}: 2 × sbh{'/t' if sp and tp > 1 else ''} elements × ({target.hidden_mask} - 1) bytes")
    else:
        hd = ("hidden_dropout=0: F.dropout returns its input and keeps nothing, so the paper's two sbh-element "
              "masks (1 byte each) are absent")
    step("hidden_dropout", "hidden-dropout masks", hd, hidden_mask=target.hidden_mask,
         hidden_mask_dtype=target.hidden_mask_dtype)
    if config.attention_dropout > 0:
        ad = (f"attention_dropout={config.attention_dropout}: the dropout on the probabilities keeps {mask_words}: "
              f"as²b{t_heads} elements × ({target.attn_mask} - 1) bytes")
    else:
        ad = (f"attention_dropout=0: no mask (as²b{t_heads} × 1 byte) and the dropout output is the softmax output "
              f"itself, kept once (as²b{t_heads} × {e} bytes)")
    step("attention_dropout", "attention-dropout mask and output", ad, attn_mask=target.attn_mask,
         attn_mask_dtype=target.attn_mask_dtype)
    # 4. attention kernel
    if target.attention == "math":
        at = (f"attention='math' as the paper, but masked_fill keeps ~attention_mask, a [1, 1, s, s] bool tensor "
              f"made anew in every layer: s² = {s * s:,} bytes; q, k and v are copied contiguous by matmul, "
              "which keeps the copies (the same sbh elements the paper counts)")
    elif target.attention == "sdpa_math":
        at = ("attention='sdpa' with attention dropout on CPU: the flash kernel refuses dropout and torch's math "
              "fallback runs; it keeps the paper's q, k, softmax output, dropout noise, dropped probabilities and v"
              + (f", all in fp32 (upcast from {config.dtype}: the softmax is not kept in the model dtype)"
                 if e < 4 else "") + ", and no mask tensor")
    elif target.attention == "sdpa_flash_cpu":
        at = (f"attention='sdpa' without dropout on CPU runs the flash kernel: no s×s tensor (the paper's "
              f"5as²b{t_heads} terms, here the softmax output, are gone); it keeps the logsumexp statistics "
              f"4·a·s·b{t_heads} = {4 * a * s * b // tp:,} bytes, the bool mask converted to a float additive mask "
              f"s²·{e} = {s * s * e:,} bytes, and q, k, v as views of the qkv output (the same 3sbh{t_heads} "
              "elements); linear_proj's input is a view of the kernel's output")
    else:
        at = ("attention='sdpa' on CUDA (unverified): the memory-efficient kernel keeps q, k, v, its output, "
              "the logsumexp [b, a, ceil(s/32)·32] fp32 and the float mask padded to 16 columns; no s×s tensor")
    step("attention", f"attention kernel ({config.attention})", at, attention=target.attention)
    # 5. MLP
    f = config.ffn_size
    if config.activation == "swiglu":
        step("mlp", "SwiGLU MLP",
             f"SwiGLU with ffn_hidden_size f={f}: linear_fc1 makes [b, s, 2f] (gate and up, kept whole), plus "
             f"silu(gate) and the product, [b, s, f] each: 4f·sb = {4 * f * s * b // tp:,} elements kept, versus "
             f"the paper's GeLU MLP 2·4h·sb = {8 * h * s * b // tp:,} elements, × {e} bytes",
             mlp="swiglu", f=target.f)
    elif f != 4 * h:
        step("mlp", "FFN width", f"ffn_hidden_size={f}, not the paper's 4h={4 * h}: the GeLU input and output are "
             f"2·sb·(f - 4h){t_heads} elements × {e} bytes", f=target.f)
    # 6. norms
    if config.normalization == "layernorm":
        nd = (f"LayerNorm keeps its per-token mean and rstd, [b, s, 1] in {target.stat_dtype}"
              f"{' (CPU keeps them in the activation dtype)' if device == 'cpu' else ''}: 2 norms × 2 × "
              f"sb{'/t' if sp and tp > 1 else ''} × {target.stat} bytes; the paper counts only the norms' inputs")
    elif target.norm == "rmsnorm":
        nd = ("RMSNorm (torch's composite rms_norm on CPU) keeps, per norm, the fp32 rstd [b, s, 1] and the fp32 "
              "normalised x·rstd [b, s, h] for the weight multiply"
              + (f", and the fp32 upcast of its {config.dtype} input [b, s, h] instead of the input itself, so "
                 f"the residual and the layer output ({config.dtype}) are no longer kept" if e != 4 else "")
              + f": 2 norms × (sb·4 + {1 if e == 4 else 2}·sbh·4{f' - sbh·{e}' if e != 4 else ''}) bytes"
              + ("/t" if sp and tp > 1 else ""))
    else:
        nd = "RMSNorm on CUDA (fused, unverified) keeps its fp32 rstd: 2 norms × sb × 4 bytes"
    step("norm", f"{config.normalization} statistics", nd, norm=target.norm, stat=target.stat,
         stat_dtype=target.stat_dtype)
    # 7. GQA
    g = config.query_groups
    if g < a:
        gd = (f"num_query_groups={g} < {a} heads: linear_qkv makes K and V for {g} groups "
              f"(2·sb·{g}·d = {2 * s * b * g * config.head_dim:,} elements instead of 2sbh = {2 * s * b * h:,}), "
              f"but CoreAttention repeats them to {a} heads with repeat_interleave before attention and autograd "
              "keeps the repeated copies, so the saved K and V stay 2sbh elements"
              + (" (the un-repeated K, V views keep the smaller qkv output alive instead of the full one)"
                 if target.attention in ("sdpa_flash_cpu", "sdpa_efficient_cuda") and not target.rope else ""))
        step("gqa", "grouped-query attention", gd, g=target.g)
    # 8. rotary
    if target.rope:
        tables = 2 * s * (config.head_dim // 2) * e
        rd = (f"rotary embedding: q and k are rotated by torch.cat(x1·cos - x2·sin, ...) into new contiguous "
              "tensors, which the attention keeps instead of matmul's copies (same size); the multiplies keep "
              f"only the cos/sin tables ([s, d/2] × 2 = {tables:,} bytes), made once per step by GPT.forward "
              "outside the layers and shared by all of them, so they are not in any layer's bytes")
        if target.attention in ("sdpa_flash_cpu", "sdpa_efficient_cuda"):
            rd += ("; with the fused kernel the rotated q, k are kept beside the qkv output (still alive through "
                   "the v view)" + (" and the output follows the contiguous q, so linear_proj gets a copy"
                                    if target.attention == "sdpa_flash_cpu" else ""))
        step("rope", "rotary position embedding", rd, rope=True)
    # 9. biases (no tensor kept either way)
    step("bias", "linear biases", ("add_bias_linear=True: a bias gradient is the sum of the output gradient, so "
                                   "biases keep no activation (and the paper counts none): 0 bytes")
         if config.add_bias_linear else "add_bias_linear=False: no biases; they would keep nothing anyway: 0 bytes")
    assert cur == target, (cur, target)
    return reasons


def explain_differences(config: ModelConfig, traced_layer_bytes: int, tp: int = 1, sp: bool = False,
                        device: str = "cpu") -> list[Difference]:
    """Korthikanti's and Megatron's per-layer estimates beside remat's traced bytes, with quantified reasons.

    ``traced_layer_bytes``: what one layer allocated and still holds when backward starts, without recompute
    (:func:`traced_layer_bytes` computes it from a :class:`~remat.timeline.Timeline`); with ``tp > 1`` it must
    be one tensor-parallel rank's bytes, as the estimates are per rank. For each source the
    reasons walk from that formula's assumptions to the model's actual tensors (see :func:`layer_inventory`);
    they sum to ``corrected_layer_bytes(config) - estimate``, so any ``unexplained_bytes`` is a tensor the
    inventory does not know. ``device`` is the device the trace ran on (``'cpu'`` is exact).
    """
    _check_parallel(tp, sp)
    _check_device(device)
    paper = korthikanti_terms(config, tp, sp, "none")
    steps = _step_reasons(config, tp, sp, device)
    out = [Difference("Korthikanti", paper.formula, paper.total, traced_layer_bytes, tuple(steps))]
    meg = megatron_estimate(config, tp=tp, sp=sp, recompute_granularity=None)
    meg_bytes = meg["per_layer_bytes"]
    selective = korthikanti_layer_bytes(config, tp, sp, "selective")
    scores = paper.total - selective
    detail = (f"Megatron's theoretical_memory_usage prices each layer at {meg['per_layer_formula']} = "
              f"{meg_bytes:,} bytes (recompute_granularity=None still gets a selective-recompute formula): it "
              f"leaves out the paper's 5as²b{'/t' if tp > 1 else ''} attention-score terms, {scores:,} bytes")
    if meg_bytes != selective:
        why = ("it scales the MLP by ffn/h" if meg["function"] == "compute_activation_memory"
               else "it uses the no-SP formula sbh(10 + 24/t) although sp=True")
        detail += (f"; its selective formula is {_fmt(meg_bytes - selective)} bytes off the paper's "
                   f"{selective:,} ({why})")
    detail += "; its 1.05 overhead factor applies to the model total, not per layer"
    first = Reason("megatron_formula", "Megatron prices layers at the selective formula", paper.total - meg_bytes,
                   detail)
    out.append(Difference("Megatron estimate", meg["per_layer_formula"], meg_bytes, traced_layer_bytes,
                          (first, *steps)))
    return [_with_remainder(d) for d in out]


def _with_remainder(diff: Difference) -> Difference:
    rest = diff.unexplained_bytes
    if not rest:
        return diff
    reason = Reason("unexplained", "not in the inventory", rest,
                    f"{rest:+,} traced bytes match no tensor of layer_inventory(): list the trace's rows with "
                    "traced_layer_rows() and compare with layer_inventory() to name them")
    return dataclasses.replace(diff, reasons=(*diff.reasons, reason))


# =====================================================================================================
# Traced per-layer bytes
# =====================================================================================================
def traced_layer_rows(timeline: Timeline, layer: int = 0) -> list[dict[str, Any]]:
    """Allocations made in ``('forward', f'layer {layer}')`` and alive when backward starts, in order."""
    end = timeline.forward_end
    region = f"layer {layer}"
    rows = []
    for row in timeline.alive_at(end):
        phase = timeline.phases[timeline.phase_index[row]]
        if phase.kind == "forward" and phase.region == region:
            rows.append({"row": int(row), "nbytes": timeline.nbytes[row], "module": timeline.module[row],
                         "alloc_at": timeline.alloc_at[row], "category": timeline.category[row]})
    return sorted(rows, key=lambda r: r["alloc_at"])


def traced_layer_bytes(timeline: Timeline, layer: int = 0) -> int:
    """Bytes layer ``layer`` allocated in its forward and still holds when backward starts (no recompute)."""
    return sum(r["nbytes"] for r in traced_layer_rows(timeline, layer))
