"""Traced bytes against the paper's and Megatron's formulas, with every difference explained tensor by tensor."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from remat.analysis.formulas import (
    DTYPE_BYTES,
    check_parallel,
    korthikanti_layer_bytes,
    korthikanti_terms,
    megatron_estimate,
)
from remat.analysis.inventory import SavedTensor, build_inventory, check_device, config_layout, paper_layout
from remat.config import ModelConfig
from remat.timeline import Timeline
from remat.units import format_bytes


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


def _signed(n: int) -> str:
    """A byte change with its sign, e.g. ``'+1.00 KiB'``, ``'-48.00 KiB'``, ``'0 B'``."""
    return ("+" if n > 0 else "") + format_bytes(n)


def _changes(before: list[SavedTensor], after: list[SavedTensor]) -> tuple[str, ...]:
    old = {t.key: t for t in before}
    new = {t.key: t for t in after}
    out = []
    for t in after:
        if t.key not in old:
            out.append(f"{_signed(t.nbytes)} {t.name} {list(t.shape)} {t.dtype}")
        elif old[t.key].nbytes != t.nbytes or old[t.key].dtype != t.dtype:
            o = old[t.key]
            was = f"{list(o.shape)} {o.dtype}"
            now = f"{list(t.shape) if t.shape != o.shape else ''} {t.dtype if t.dtype != o.dtype else ''}".strip()
            out.append(f"{_signed(t.nbytes - o.nbytes)} {t.name} {was} -> {now}")
    out.extend(f"{_signed(-t.nbytes)} {t.name} {list(t.shape)} {t.dtype} (not kept)" for t in before
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
    cur = paper_layout(config, device)
    target = config_layout(config, device)
    reasons: list[Reason] = []
    t_heads = f"/t={tp}" if tp > 1 else ""

    def step(key: str, title: str, detail: str, **changes: Any) -> None:
        nonlocal cur
        nxt = dataclasses.replace(cur, **changes)
        before, after = build_inventory(cur, tp, sp), build_inventory(nxt, tp, sp)
        delta = sum(t.nbytes for t in after) - sum(t.nbytes for t in before)
        reasons.append(Reason(key, title, delta, detail, _changes(before, after) if key != "dtype" else ()))
        cur = nxt

    # 1. activation dtype
    paper_inv = build_inventory(cur, tp, sp)
    elems = sum(math.prod(t.shape) for t in paper_inv if "mask" not in t.dtype)
    step("dtype", f"activation dtype {config.dtype}",
         (f"{config.dtype} activations take {e} bytes per element where the paper assumes 2: the {elems:,} "
          f"non-mask elements it counts per layer (16sbh + 2as²b{t_heads}, the softmax output included, which "
          f"the model keeps in {config.dtype}) change by {e - 2:+d} bytes each = {_signed(elems * (e - 2))}")
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
    check_parallel(tp, sp)
    check_device(device)
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
        detail += (f"; its selective formula is {_signed(meg_bytes - selective)} off the paper's "
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
