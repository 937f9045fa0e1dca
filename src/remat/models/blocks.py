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
    """Rotate pairs (first half, second half) of the head dimension; x is [b, heads, s, d]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class CoreAttention(nn.Module):
    """softmax(q k^T / sqrt(d) + mask) v with dropout on the probabilities: Megatron's ``core_attn``."""

    def __init__(self, config: ModelConfig, head_dim: int | None = None):
        super().__init__()
        self.kind = config.attention
        self.dropout = config.attention_dropout
        self.scale = 1.0 / math.sqrt(head_dim or config.head_dim)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                attention_mask: torch.Tensor) -> torch.Tensor:
        if k.shape[1] != q.shape[1]:  # grouped-query attention: each key/value head serves several queries
            repeat = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(repeat, dim=1)
            v = v.repeat_interleave(repeat, dim=1)
        p = self.dropout if self.training else 0.0
        if self.kind == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, dropout_p=p)
        scores = (q @ k.transpose(-2, -1)) * self.scale
        scores = scores.masked_fill(~attention_mask, float("-inf"))
        probs = F.dropout(scores.softmax(dim=-1), p=p, training=self.training)
        return probs @ v


class SwiGLU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        gated = config.activation == "swiglu"
        fc1_out = config.ffn_size * (2 if gated else 1)
        self.linear_fc1 = nn.Linear(config.hidden_size, fc1_out, bias=config.add_bias_linear)
        self.activation = SwiGLU() if gated else nn.GELU()
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
