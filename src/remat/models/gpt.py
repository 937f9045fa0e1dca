"""The reference decoder remat measures and predicts: a GPT shaped like Megatron-LM's, readable top to bottom,
built by :func:`build_model` with a matching :func:`sample_batch`."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from remat.config import ModelConfig


def norm_layer(config: ModelConfig) -> nn.Module:
    if config.normalization == "rmsnorm":
        return nn.RMSNorm(config.hidden_size, eps=1e-5)
    return nn.LayerNorm(config.hidden_size, eps=1e-5)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (first half, second half) of the head dimension; x is [b, heads, s, d]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class CoreAttention(nn.Module):
    """softmax(q k^T / sqrt(d) + mask) v with dropout on the probabilities: Megatron's ``core_attn``."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.kind = config.attention
        self.dropout = config.attention_dropout
        self.scale = 1.0 / math.sqrt(config.head_dim)

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


class SelfAttention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.heads = config.num_attention_heads
        self.groups = config.query_groups
        self.head_dim = config.head_dim
        qkv_size = (self.heads + 2 * self.groups) * self.head_dim
        self.linear_qkv = nn.Linear(config.hidden_size, qkv_size, bias=config.add_bias_linear)
        self.core_attention = CoreAttention(config)
        self.linear_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=config.add_bias_linear)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor,
                rotary: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        b, s, _ = x.shape
        return self.linear_proj(self.attend(self.linear_qkv(x), b, s, attention_mask, rotary))

    def attend(self, qkv: torch.Tensor, b: int, s: int, attention_mask: torch.Tensor,
               rotary: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """Split ``qkv`` ([b, s, ...]) into this module's heads, attend, and return [b, s, heads * head_dim]."""
        d = self.head_dim
        q, k, v = qkv.split([self.heads * d, self.groups * d, self.groups * d], dim=-1)
        q = q.view(b, s, self.heads, d).transpose(1, 2)
        k = k.view(b, s, self.groups, d).transpose(1, 2)
        v = v.view(b, s, self.groups, d).transpose(1, 2)
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        context = self.core_attention(q, k, v, attention_mask)
        return context.transpose(1, 2).reshape(b, s, self.heads * d)


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


# NOTE [the reference layer]
# embedding -> layers (each: input_layernorm -> self_attention -> dropout + residual -> pre_mlp_layernorm -> mlp ->
# dropout + residual) -> head (final_layernorm -> output_layer -> cross-entropy in fp32).
# As in Megatron, every layer takes the attention mask and the rotary tables as inputs, so a checkpointed group
# keeps more than the hidden states. Submodule names follow Megatron's (self_attention.core_attention,
# mlp.activation ...), which is what selective recompute targets.
class TransformerLayer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.input_layernorm = norm_layer(config)
        self.self_attention = SelfAttention(config)
        self.pre_mlp_layernorm = norm_layer(config)
        self.mlp = MLP(config)
        self.dropout = config.hidden_dropout

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor,
                rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        attn = self.self_attention(self.input_layernorm(hidden), attention_mask, rotary)
        hidden = hidden + F.dropout(attn, p=self.dropout, training=self.training)
        mlp = self.mlp(self.pre_mlp_layernorm(hidden))
        return hidden + F.dropout(mlp, p=self.dropout, training=self.training)


class Embedding(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = (
            nn.Embedding(config.seq_length, config.hidden_size) if config.position == "learned" else None)
        self.dropout = config.hidden_dropout

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(tokens)
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(torch.arange(tokens.shape[1], device=tokens.device))
        return F.dropout(x, p=self.dropout, training=self.training)


class LMHead(nn.Module):
    """Final norm, output layer and the loss: what lives outside the layer stack."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.final_layernorm = norm_layer(config)
        self.output_layer = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.output_layer(self.final_layernorm(hidden))
        # Megatron computes the cross-entropy in fp32 whatever the model's dtype.
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


class GPT(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embedding = Embedding(config)
        self.layers = nn.ModuleList(TransformerLayer(config) for _ in range(config.num_layers))
        self.head = LMHead(config)
        if config.tie_embeddings:
            self.head.output_layer.weight = self.embedding.word_embeddings.weight

    def rotary_tables(self, seq_length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        return rotary_tables(self.config, seq_length, device)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        causal_mask, rotary = layer_side_inputs(self.config, tokens)
        hidden = self.embedding(tokens)
        for layer in self.layers:
            hidden = layer(hidden, causal_mask, rotary)
        return self.head(hidden, labels)


def layer_side_inputs(config: ModelConfig, tokens: torch.Tensor,
                      ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """What every layer takes besides the hidden states: the causal mask and (with rope) the rotary tables."""
    s, device = tokens.shape[1], tokens.device
    causal_mask = torch.ones(s, s, dtype=torch.bool, device=device).tril_().view(1, 1, s, s)
    return causal_mask, rotary_tables(config, s, device)


def rotary_tables(config: ModelConfig, seq_length: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """cos and sin of the rotary angles, [seq_length, head_dim / 2] in the model's dtype (None without rope)."""
    if config.position != "rope":
        return None
    d = config.head_dim
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
    angles = torch.outer(torch.arange(seq_length, device=device, dtype=torch.float32), inv_freq)
    return angles.cos().to(config.torch_dtype), angles.sin().to(config.torch_dtype)


def build_model(config: ModelConfig, device: torch.device | str = "cpu", seed: int | None = 0) -> GPT:
    """Build the reference GPT with random weights in ``config.dtype`` on ``device`` (training mode)."""
    if seed is not None:
        torch.manual_seed(seed)
    with building(config, device):
        return GPT(config).train()


@contextlib.contextmanager
def building(config: ModelConfig, device: torch.device | str) -> Iterator[None]:
    """Make new parameters in ``config.dtype`` on ``device`` in place: no ``.to()`` afterwards, which also works
    under FakeTensorMode."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(config.torch_dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


def sample_batch(config: ModelConfig, device: torch.device | str = "cpu",
                 seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (tokens, labels) of shape [micro_batch_size, seq_length]; labels are tokens shifted by one."""
    generator = torch.Generator().manual_seed(seed)
    shape = (config.micro_batch_size, config.seq_length + 1)
    ids = torch.randint(0, config.vocab_size, shape, generator=generator).to(device)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
