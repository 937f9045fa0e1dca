"""Closed-form activation-memory estimates of one transformer layer: Korthikanti et al. 2022 (Table 2, with its
tensor/sequence-parallel and recompute variants) and Megatron-LM's ``theoretical_memory_usage``, term by term.
What remat actually traces is in :mod:`remat.analysis.inventory`; the reasons they differ in
:mod:`remat.analysis.differences`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from remat.config import ModelConfig
from remat.units import round_up

__all__ = ["DTYPE_BYTES", "KorthikantiTerm", "KorthikantiTerms", "korthikanti_layer_bytes", "korthikanti_terms",
           "megatron_estimate"]
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
RECOMPUTE = ("none", "selective", "full")
DEVICES = ("cpu", "cuda")


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


def check_parallel(tp: int, sp: bool) -> None:
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
    check_parallel(tp, sp)
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
    return round_up(vocab, multiple)


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
    check_parallel(tp, sp)
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
