"""The tensors a layer saves for backward, by kernel and parallel layout, as a checkable inventory."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from remat.analysis.formulas import DEVICES, DTYPE_BYTES, check_parallel
from remat.config import ModelConfig
from remat.units import CUDA_BLOCK, round_up


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


def paper_layout(config: ModelConfig, device: str) -> _Layout:
    h = config.hidden_size
    a = config.num_attention_heads
    return _Layout(config.seq_length, config.micro_batch_size, h, a, a, 4 * h, "16-bit", 2, 1, "1-byte mask", 1,
                   "1-byte mask", "paper", "paper", 0, "", "gelu", False, device)


def config_layout(config: ModelConfig, device: str) -> _Layout:
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


# NOTE [Inventory of one reference layer]
# What "one layer's traced bytes" means: the storages allocated while layer ``i`` ran its forward and still
# alive when backward starts (:func:`traced_layer_bytes`). The layer's *input* was allocated by the previous
# layer (or the embedding), so it is not counted; the layer's *output*, which the next layer's input norm keeps,
# is counted instead. Both are ``[b, s, h]`` in the activation dtype, so this equals the paper's convention of
# counting a layer's input norm input.
#
# Inventory of one layer (reference GPT, fp32, ``attention='math'``, dropout 0.1, GeLU, LayerNorm, on CPU)
# -----------------------------------------------------------------------------------------------------
# s = seq_length, b = micro_batch_size, h = hidden, a = heads, d = h/a, f = ffn_hidden_size (4h), e = 4 bytes.
# Each row is one storage (views count once); "kept by" is the autograd node that saves it.
#
# ====  ==========================================  ===============  ======  ==============================
#  #    tensor (module that makes it)                shape            dtype   kept by / why
# ====  ==========================================  ===============  ======  ==============================
#  1    input_layernorm mean                         [b, s, 1]        fp32    NativeLayerNormBackward0: the
#                                                                            input gradient needs the
#                                                                            per-token mean (*)
#  2    input_layernorm rstd                         [b, s, 1]        fp32    same, 1/sqrt(var + eps) (*)
#  3    input_layernorm output                       [b, s, h]        fp32    linear_qkv (addmm): weight
#                                                                            gradient = grad^T @ input
#  4    q, copied contiguous by matmul               [b, a, s, d]     fp32    BmmBackward0 (q @ k^T): q is a
#                                                                            transposed view of the qkv
#                                                                            output, so matmul's reshape
#                                                                            copies it, and keeps the copy
#  5    k^T, copied the same way                     [b, a, d, s]     fp32    BmmBackward0 (q @ k^T)
#  6    ~attention_mask                              [1, 1, s, s]     bool    MaskedFillBackward0: the
#                                                                            negated causal mask is a new
#                                                                            tensor in every layer (s^2 B)
#  7    softmax output (probabilities)               [b, a, s, s]     fp32    SoftmaxBackward0 (result)
#  8    attention-dropout noise                      [b, a, s, s]     fp32    MulBackward0: CPU dropout is
#                                                                            input * noise with a float
#                                                                            noise tensor (CUDA keeps a
#                                                                            1-byte bool mask)
#  9    dropped probabilities                        [b, a, s, s]     fp32    BmmBackward0 (probs @ v)
#  10   v, copied contiguous by matmul               [b, a, s, d]     fp32    BmmBackward0 (probs @ v)
#  11   context.transpose(1, 2).reshape copy         [b, s, h]        fp32    linear_proj (addmm) input
#  12   hidden-dropout noise after attention         [b, s, h]        fp32    MulBackward0 (float noise)
#  13   residual hidden + dropout(attn)              [b, s, h]        fp32    pre_mlp_layernorm input
#  14   pre_mlp_layernorm mean, rstd                 2 x [b, s, 1]    fp32    NativeLayerNormBackward0 (*)
#  15   pre_mlp_layernorm output                     [b, s, h]        fp32    linear_fc1 (addmm) input
#  16   linear_fc1 output                            [b, s, f]        fp32    GeluBackward0 (its input)
#  17   GeLU output                                  [b, s, f]        fp32    linear_fc2 (addmm) input
#  18   hidden-dropout noise after the MLP           [b, s, h]        fp32    MulBackward0 (float noise)
#  19   layer output hidden + dropout(mlp)           [b, s, h]        fp32    next layer's input_layernorm
# ====  ==========================================  ===============  ======  ==============================
#
# (*) on CPU LayerNorm's statistics are in the activation dtype; on CUDA they are fp32 whatever the dtype.
#
# Total: ``16·sbh·e + 2·sbh·e_mask + as²b·(2e + e_mask) + 4·sb·e_stat + s²`` bytes, which for s=32, b=2, h=64,
# a=4 is 395,264 bytes, exactly what remat traces; Korthikanti's ``sbh(34 + 5as/h)`` is 180,224.
# Not kept: the qkv projection output (its q/k/v views are copied by matmul), the raw scores and the masked /
# scaled scores (softmax keeps its output, mul by a constant and masked_fill keep no input), the attention
# output of linear_proj and of linear_fc2 (dropout keeps only its noise, the add keeps nothing), biases (their
# gradient is a sum of the output gradient). The causal mask itself and the rotary cos/sin tables are made once
# by ``GPT.forward`` outside the layers and shared, so no layer counts them.
#
# Variants (all traced in tests/analysis/test_formulas.py):
#
# * dropout 0: F.dropout returns its input; rows 8, 12, 18 disappear and row 9 *is* row 7.
# * ``attention='sdpa'`` on CPU, attention dropout 0: ``_scaled_dot_product_flash_attention_for_cpu`` keeps
#   q, k, v (views of the qkv output, so the whole ``[b, s, (a+2g)d]`` qkv output is kept), the bool mask
#   converted to a float additive mask ``[1, 1, s, s]`` in the activation dtype, its output (whose layout follows
#   q: with q a transposed view, linear_proj's input is a view of it; with a contiguous q (rotary) linear_proj
#   gets a copy) and the logsumexp ``[b, a, s]`` fp32 (4·a·s·b bytes). No s x s tensor.
# * ``attention='sdpa'`` on CPU with attention dropout > 0: the flash kernel refuses dropout and the math
#   fallback runs; it keeps the same q, k, probabilities, noise, dropped probabilities and v as rows 4-10 but no
#   mask, and computes them in fp32 even for bf16/fp16 activations (torch upcasts the math kernel unless
#   ``allow_fp16_bf16_reduction_math_sdp(True)``).
# * SwiGLU: linear_fc1 makes ``[b, s, 2f]`` (gate and up, kept whole: silu keeps the gate view, the gating
#   multiply keeps the up view), silu(gate) ``[b, s, f]`` (kept by the multiply) and the product ``[b, s, f]``
#   (linear_fc2's input): 4f·sb elements instead of GeLU's 2f·sb.
# * RMSNorm (torch's composite ``rms_norm`` on CPU): keeps the fp32 rstd ``[b, s, 1]`` and the fp32 normalised
#   ``x·rstd`` ``[b, s, h]`` (for the weight multiply); when activations are not fp32 it keeps the fp32 upcast of
#   its input ``[b, s, h]`` *instead of* the input, so the residual (row 13) and the layer output (row 19) are
#   freed. On CUDA torch 2.13 runs ``_fused_rms_norm``, which keeps its input and the rstd.
# * GQA: K and V are projected for g groups but repeated to a heads (``repeat_interleave``) before attention;
#   the repeated copies are what is kept, so the saved K, V stay 2·sbh elements.
# * Rotary: the rotated q and k (``torch.cat`` outputs, contiguous) are kept by the matmul instead of copies;
#   the cos/sin multiplies keep only the (shared) tables.
#
# The CUDA branch (``device='cuda'``) applies what differs on CUDA - 1-byte bool dropout masks, fp32 LayerNorm
# statistics, the fused RMSNorm, the memory-efficient SDPA kernel, 512-byte allocator blocks - and is marked
# unverified: it has not been checked against a CUDA trace here.
def build_inventory(lay: _Layout, tp: int = 1, sp: bool = False) -> list[SavedTensor]:
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
        items.append(SavedTensor(key, name, module, shape, dtype, round_up(nbytes, block), saved_by, why,
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
        cols = s if lay.attention == "sdpa_flash_cpu" else round_up(s, 16)
        add("float_mask", "causal mask as a float additive bias", mod, (1, 1, s, cols), act, e, node,
            "SDPA converts the bool mask to -inf/0 in the query dtype and keeps it")
        lse_s = s if lay.attention == "sdpa_flash_cpu" else round_up(s, 32)
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


def check_device(device: str) -> None:
    if device not in DEVICES:
        raise ValueError(f"device={device!r}: must be one of {', '.join(DEVICES)}")


def layer_inventory(config: ModelConfig, tp: int = 1, sp: bool = False, device: str = "cpu") -> list[SavedTensor]:
    """Every storage one layer of the reference GPT keeps for backward (no recompute), per TP rank.

    Exact on CPU (checked against remat's traces); ``device='cuda'`` applies the known CUDA differences and is
    unverified. With ``tp > 1`` the shapes are those of a Megatron-style tensor(-and-sequence)-parallel rank.
    """
    check_parallel(tp, sp)
    check_device(device)
    return build_inventory(config_layout(config, device), tp, sp)


def corrected_layer_bytes(config: ModelConfig, tp: int = 1, sp: bool = False, device: str = "cpu") -> int:
    """The corrected formula: Korthikanti's count redone for this model's actual saved tensors."""
    return sum(t.nbytes for t in layer_inventory(config, tp, sp, device))
