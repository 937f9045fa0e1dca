"""The reference model's multi-latent attention (DeepSeek's MLA, Megatron-LM's ``MLASelfAttention``): queries and
keys/values through low-rank down-projections and norms, then up-projections with decoupled rotary dimensions."""

from __future__ import annotations

import torch
from torch import nn

from remat.config import ModelConfig
from remat.models.blocks import CoreAttention, norm_layer, rotate


class MLAUpProjection(nn.Module):
    """The up-projections and the rotary part of MLA (Megatron's ``qkv_up_proj_and_rope_apply``): what
    ``mla_up_proj`` recomputes. Returns contiguous query, key [b, heads, s, qk_head_dim + qk_pos_emb_head_dim]
    and value [b, heads, s, v_head_dim]."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.heads = config.num_attention_heads
        self.qk_dim, self.pos_dim, self.v_dim = config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim
        self.rope_fused = config.apply_rope_fusion  # NOTE [unfused rope] in remat.models.blocks
        q_in = config.q_lora_rank or config.hidden_size
        q_out = self.heads * (self.qk_dim + self.pos_dim)
        bias = config.add_bias_linear
        if config.q_lora_rank is not None:
            self.linear_q_up_proj = nn.Linear(q_in, q_out, bias=bias)
        else:  # no query compression: one projection from the hidden states (Megatron's linear_q_proj)
            self.linear_q_proj = nn.Linear(q_in, q_out, bias=bias)
        self.linear_kv_up_proj = nn.Linear(config.kv_lora_rank, self.heads * (self.qk_dim + self.v_dim), bias=bias)

    def batch_shape(self, kv_compressed: torch.Tensor) -> tuple[int, int]:
        """(b, s) of the tokens: ``kv_compressed`` is [b, s, kv_lora_rank]."""
        return kv_compressed.shape[0], kv_compressed.shape[1]

    def forward(self, q_compressed: torch.Tensor, kv_compressed: torch.Tensor, k_pos_emb: torch.Tensor,
                rotary: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, s = self.batch_shape(kv_compressed)
        q_proj = self.linear_q_up_proj if hasattr(self, "linear_q_up_proj") else self.linear_q_proj
        q = q_proj(q_compressed).view(b, s, self.heads, -1).transpose(1, 2)
        q_no_pe, q_pos_emb = q.split([self.qk_dim, self.pos_dim], dim=-1)
        kv = self.linear_kv_up_proj(kv_compressed).view(b, s, self.heads, -1).transpose(1, 2)
        k_no_pe, value = kv.split([self.qk_dim, self.v_dim], dim=-1)
        q_pos_emb = rotate(q_pos_emb, rotary, self.rope_fused, mla_interleaved=True)
        # one rotary key for all heads
        k_pos_emb = rotate(k_pos_emb.view(b, 1, s, self.pos_dim), rotary, self.rope_fused, mla_interleaved=True)
        query = torch.cat([q_no_pe, q_pos_emb], dim=-1)
        key = torch.cat([k_no_pe, k_pos_emb.expand(b, self.heads, s, self.pos_dim)], dim=-1)
        return query, key, value.contiguous()


class MLASelfAttention(nn.Module):
    """hidden -> q down-projection + q norm, kv down-projection (latent + rotary key) + kv norm -> up-projections
    and rotary (:class:`MLAUpProjection`) -> attention core -> output projection."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.heads = config.num_attention_heads
        self.add_down_projections(config)
        self.up_proj = MLAUpProjection(config)
        self.core_attention = CoreAttention(config, head_dim=config.qk_head_dim + config.qk_pos_emb_head_dim)
        self.linear_proj = nn.Linear(self.heads * config.v_head_dim, config.hidden_size, bias=config.add_bias_linear)

    def add_down_projections(self, config: ModelConfig) -> None:
        """The q down-projection and norm (when ``q_lora_rank`` is set) and the kv down-projection (latent and
        rotary key) and norm: whole on every tensor-parallel rank, as Megatron builds them."""
        self.kv_lora_rank, self.pos_dim = config.kv_lora_rank, config.qk_pos_emb_head_dim
        bias = config.add_bias_linear
        if config.q_lora_rank is not None:
            self.linear_q_down_proj = nn.Linear(config.hidden_size, config.q_lora_rank, bias=bias)
            # Megatron's MLA spec builds its q/kv norms only with --qk-layernorm (else IdentityOp)
            self.q_layernorm = norm_layer(config, config.q_lora_rank) if config.has_qk_norms else nn.Identity()
        self.linear_kv_down_proj = nn.Linear(config.hidden_size, config.kv_lora_rank + self.pos_dim, bias=bias)
        self.kv_layernorm = norm_layer(config, config.kv_lora_rank) if config.has_qk_norms else nn.Identity()

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor,
                rotary: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        if rotary is None:
            raise ValueError("MLA needs the rotary tables (position='rope')")
        b, s, _ = x.shape
        q_compressed = self.q_layernorm(self.linear_q_down_proj(x)) if hasattr(self, "linear_q_down_proj") else x
        kv_compressed, k_pos_emb = self.linear_kv_down_proj(x).split([self.kv_lora_rank, self.pos_dim], dim=-1)
        query, key, value = self.up_proj(q_compressed, self.kv_layernorm(kv_compressed), k_pos_emb, rotary)
        context = self.core_attention(query, key, value, attention_mask)
        return self.linear_proj(context.transpose(1, 2).reshape(b, s, -1))
