"""The building blocks the reference model's dense, MoE and MLA layers share: norms, rotary positions, the
attention core and SwiGLU."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from remat.config import ModelConfig


def norm_layer(config: ModelConfig, size: int | None = None) -> nn.Module:
    """The model's norm (``config.normalization``) over ``size`` features (default ``hidden_size``)."""
    if config.normalization == "rmsnorm":
        return nn.RMSNorm(size or config.hidden_size, eps=1e-5)
    return nn.LayerNorm(size or config.hidden_size, eps=1e-5)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (first half, second half) of the head dimension; x is [b, heads, s, d]. The multiplies keep
    only the shared tables, as the fused kernels keep only theirs (NOTE [unfused rope])."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


# NOTE [unfused rope]
# Megatron applies rotary positions with TransformerEngine's fused kernel (apply_rope_fusion, the default) or, with
# --no-rope-fusion, with _apply_rotary_pos_emb_bshd (megatron/core/models/common/embeddings/rope_utils.py:92-156 at
# d98e8a64). The fused kernels keep the tables made once per forward (freqs; MLA's cached cos/sin), shared by every
# layer, as apply_rotary's shared tables are. The unfused function makes its own at each application:
# cos_ = (torch.cos(freqs) * mscale).to(t.dtype), likewise sin_ ([s, 1, 1, d], d the rotated dimensions), and
# t * cos_ + rotate_half(t) * sin_ keeps both (a multiply by a tensor that needs no gradient keeps that tensor):
# 2 x s x d elements of the activations' dtype per application, two applications per layer (q and k; MLA: its
# rotary query and key), made again by a recompute. MLA's interleaving (mla_rotary_interleaved) first copies t
# into (even, odd) order; the result is copied once more by torch.cat((t, t_pass)), t_pass empty here.
def apply_rotary_unfused(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                         mla_interleaved: bool = False) -> torch.Tensor:
    """Megatron's unfused rotary embedding (NOTE [unfused rope]) on x [b, heads, s, d], from the shared half
    tables ``cos``, ``sin`` [s, d / 2]: the same result as :func:`apply_rotary` (after MLA's interleaving), with the
    allocations and saved tensors of Megatron's operators."""
    if mla_interleaved:
        x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
    cos_, sin_ = _unfused_table(cos, x.dtype), _unfused_table(sin, x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = x * cos_ + torch.cat((-x2, x1), dim=-1) * sin_
    return torch.cat((rotated, x[..., x.shape[-1]:]), dim=-1)


def _unfused_table(half: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(torch.cos(freqs) * mscale).to(dtype) from a shared half table [s, d / 2]: the same allocations (fp32 [s, d],
    its product by mscale, whose value is 1 here, then the table in ``dtype``; no copy where it is fp32)."""
    s, h = half.shape
    full = torch.empty(s, 2 * h, dtype=torch.float32, device=half.device)  # as torch.cos(freqs) makes it
    full[:, :h] = half
    full[:, h:] = half
    return (full * 1.0).to(dtype)


def rotate(x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], fused: bool, *,
           mla_interleaved: bool = False) -> torch.Tensor:
    """``x`` rotated by the shared tables ``rotary`` (cos, sin) as Megatron's fused kernel (``fused``) or its
    unfused function does (:func:`apply_rotary`, :func:`apply_rotary_unfused`)."""
    if fused:
        return apply_rotary(x, *rotary)
    return apply_rotary_unfused(x, *rotary, mla_interleaved=mla_interleaved)


class CoreAttention(nn.Module):
    """softmax(q k^T / sqrt(d) + mask) v with dropout on the probabilities: Megatron's ``core_attn``.

    ``heads`` (this rank's query heads) and ``layer`` (0-based) matter for NOTE [gpt-oss layers]: the sink's
    per-head offset and whether the layer attends within ``config.window_size``."""

    def __init__(self, config: ModelConfig, head_dim: int | None = None, heads: int | None = None,
                 layer: int = 0):
        super().__init__()
        self.kind = config.attention
        self.dropout = config.attention_dropout
        self.scale = 1.0 / math.sqrt(head_dim or config.head_dim)
        self.window = config.window_size if config.window_attention(layer) else None
        self.softmax_type = config.softmax_type
        heads = heads or config.num_attention_heads
        if config.softmax_type == "learnable":  # TE dot_product_attention.py:488: a parameter, zeros(heads / tp)
            self.softmax_offset: torch.Tensor | None = nn.Parameter(torch.zeros(heads))
        elif config.softmax_type == "off-by-one":  # :484: a plain fp32 tensor (not a buffer: never cast)
            self.softmax_offset = torch.zeros(heads, dtype=torch.float32)
        else:
            self.softmax_offset = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                attention_mask: torch.Tensor) -> torch.Tensor:
        if k.shape[1] != q.shape[1]:  # grouped-query attention: each key/value head serves several queries
            repeat = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(repeat, dim=1)
            v = v.repeat_interleave(repeat, dim=1)
        p = self.dropout if self.training else 0.0
        if self.window is not None:  # TE utils.py:1753-1759 get_full_mask: keep j in [i - left, i + right]
            sq, sk = q.shape[-2], k.shape[-2]
            diff = torch.arange(sq, device=q.device).view(sq, 1) - torch.arange(sk, device=q.device).view(1, sk)
            left, right = (sk if self.window[0] == -1 else self.window[0]), (sq if self.window[1] == -1
                                                                             else self.window[1])
            attention_mask = attention_mask & (diff <= left) & (diff >= -right)
        if self.kind == "sdpa" and self.softmax_offset is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, dropout_p=p)
        scores = (q @ k.transpose(-2, -1)) * self.scale
        scores = scores.masked_fill(~attention_mask, float("-inf"))
        if self.softmax_offset is None:
            probs = scores.softmax(dim=-1)
        else:  # the sink: one more column of logits, the head's offset, dropped after the softmax
            sink = self.softmax_offset.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
            probs = torch.cat((scores, sink), -1).softmax(dim=-1)[..., :-1]
        return F.dropout(probs, p=p, training=self.training) @ v


# NOTE [gpt-oss layers]
# Megatron-LM d98e8a6's gpt-oss options. --quick-geglu (training/argument_utils.py:323: gated_linear_unit, activation
# quick_gelu) runs, without bias_activation_fusion (--no-bias-gelu-fusion), the eager glu of mlp.py:325-334 and
# moe/experts.py:994-1010: chunk, clamp each half when --activation-func-clamp-value is set, quick_gelu(x_glu) *
# (x_linear + --glu-linear-offset); quick_gelu (fusions/fused_bias_geglu.py:191) is @jit_fuser, torch.compile
# (core/jit.py), whose graph keeps its input only (AOTAutograd's partitioner recomputes the sigmoid; seen on torch
# 2.13). With the fusion, experts run weighted_bias_quick_geglu_impl (:410): the clamped halves concatenated, and
# WeightedQuickGeGLUFunction (:303) keeps that input, the probabilities and the offset as a tensor (the dense MLP
# has no fused quick-geglu: mlp.py:297 raises). --softmax-type off-by-one / learnable (TE attention sinks): a
# per-head offset (learnable: a parameter of heads / tp) as one more logit column; --window-size (left, right)
# with --window-attn-skip-freq: which layers attend within the window (CoreAttention.window). What TE's backends
# keep for them is remat.memory.kernels' (te profile).
class QuickGelu(torch.autograd.Function):
    """Megatron's ``quick_gelu`` (``y * sigmoid(1.702 y)``) as torch.compile runs it: keeps its input only."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(y)
        return torch.mul(y, 1.702).sigmoid_().mul_(y)  # one output, as the compiled kernel writes

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors
        s = torch.sigmoid(1.702 * y)
        return grad * s * (1 + 1.702 * y * (1 - s))


class WeightedQuickGeGLU(torch.autograd.Function):
    """``WeightedQuickGeGLUFunction`` (fused_bias_geglu.py:303): keeps its [.., 2f] input, the [.., 1] weights and
    the offset tensor; returns ``quick_geglu(input) * weights`` in the input's dtype."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weights: torch.Tensor, offset: torch.Tensor, value: float) -> torch.Tensor:
        ctx.save_for_backward(x, weights, offset)
        x_glu, x_linear = x.chunk(2, -1)
        out = torch.mul(x_glu, 1.702).sigmoid_().mul_(x_glu)  # quick_gelu, in the one output the kernel writes
        if value == 0:
            out.mul_(x_linear)
        else:  # out * (x_linear + offset) in place
            out.addcmul_(out, x_linear, value=1 / value).mul_(value)
        return out.mul_(weights)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        x, weights, offset = ctx.saved_tensors
        x_glu, x_linear = x.chunk(2, -1)
        s = torch.sigmoid(1.702 * x_glu)
        g = grad * weights
        grad_x = torch.cat((g * s * (1 + 1.702 * x_glu * (1 - s)) * (x_linear + offset), g * x_glu * s), -1)
        grad_w = (x_glu * s * (x_linear + offset) * grad).sum(-1, keepdim=True).to(weights.dtype)
        return grad_x.to(x.dtype), grad_w, None, None


class QuickGeGLU(nn.Module):
    """``--quick-geglu`` (NOTE [gpt-oss layers]): the eager glu; :meth:`weighted` is the experts' fused kernel."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.offset, self.clamp = config.glu_linear_offset, config.activation_func_clamp_value
        self.fused = config.bias_activation_fusion

    def clamped(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x_glu, x_linear = torch.chunk(x, 2, dim=-1)
        if self.clamp is not None:
            x_glu, x_linear = x_glu.clamp(min=None, max=self.clamp), x_linear.clamp(min=-self.clamp, max=self.clamp)
        return x_glu, x_linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_glu, x_linear = self.clamped(x)
        return QuickGelu.apply(x_glu) * (x_linear + self.offset)

    def weighted(self, x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """``weighted_bias_quick_geglu_impl`` without bias (fused_bias_geglu.py:410): probs [T] per row."""
        if self.clamp is not None:
            x = torch.cat(self.clamped(x), -1)
        offset = torch.tensor(self.offset, dtype=x.dtype, device=x.device)
        return WeightedQuickGeGLU.apply(x.view(-1, x.shape[-1]), probs.unsqueeze(-1), offset, float(self.offset))


def gated_activation(config: ModelConfig) -> nn.Module:
    """The MLP's activation: SwiGLU, QuickGeGLU (NOTE [gpt-oss layers]) or GeLU."""
    if config.activation == "swiglu":
        return SwiGLU()
    return QuickGeGLU(config) if config.activation == "quick_geglu" else nn.GELU()


class SwiGLU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        fc1_out = config.ffn_size * (2 if config.gated else 1)
        self.linear_fc1 = nn.Linear(config.hidden_size, fc1_out, bias=config.add_bias_linear)
        self.activation = gated_activation(config)
        self.linear_fc2 = nn.Linear(config.ffn_size, config.hidden_size, bias=config.add_bias_linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.activation(self.linear_fc1(x)))


class LossAutoScaler(torch.autograd.Function):
    """Megatron's ``MoEAuxLossAutoScaler`` (moe/moe_utils.py) and ``MTPLossAutoScaler`` (multi_token_prediction.py):
    identity on ``output``; keeps ``loss`` and, when ``output``'s gradient arrives, gives it
    ``torch.ones_like(loss) * backward_scale`` (1 here), so the loss need not be added to the model's."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(loss)
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (loss,) = ctx.saved_tensors
        return grad_output, torch.ones_like(loss) * 1.0
