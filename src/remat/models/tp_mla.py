"""The reference model's multi-latent attention on one tensor-parallel rank (Megatron-LM's ``MLASelfAttention``
under tensor and sequence parallelism).

Facts from megatron-core 0.16 (transformer/multi_latent_attention.py, models/gpt/gpt_layer_specs.py): the heads
are split over tp: the up-projections (``linear_q_up_proj`` or ``linear_q_proj``, ``linear_kv_up_proj``) are
column-parallel and ``linear_proj`` row-parallel. The down-projections of the Transformer Engine layer spec are
``TELinear(parallel_mode='duplicated')``: replicated weights applied to the rank's own tokens, no communication,
so under sequence parallelism they and the q/kv norms see the [b*s/tp, ...] token shard; the rotary key
(``k_pos_emb``, split off the kv down-projection) is then all-gathered over the sequence
(``gather_from_sequence_parallel_region``) because every rank's heads need all tokens, and the column-parallel
up-projections gather the normed latents as any sequence-parallel linear does. (The local layer spec's
column-parallel down-projections, gathered then scattered again, are not modelled.) Without sequence
parallelism the rotary key's gradient, a partial sum over this rank's heads, is all-reduced (remat's choice, so
that the gradients equal the unsplit layer's: a copy-to-region, no memory).
"""

from __future__ import annotations

import torch
from torch import nn

from remat.config import ModelConfig
from remat.models.blocks import CoreAttention
from remat.models.mla import MLASelfAttention, MLAUpProjection
from remat.models.tp_layers import (
    ColumnParallelLinear,
    CopyToRegion,
    GatherFromSequence,
    RowParallelLinear,
    TensorParallelGroup,
)


class TPMLAUpProjection(MLAUpProjection):
    """The up-projections of this rank's ``num_attention_heads / tp`` heads (column-parallel): what
    ``mla_up_proj`` recomputes; same forward as :class:`MLAUpProjection`."""

    def __init__(self, config: ModelConfig, group: TensorParallelGroup, sp: bool):
        nn.Module.__init__(self)  # not MLAUpProjection.__init__: its full-size linears are replaced, not built
        heads = config.num_attention_heads
        self.heads = heads // group.size
        self.qk_dim, self.pos_dim, self.v_dim = config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim
        self.rope_fused = config.apply_rope_fusion  # NOTE [unfused rope] in remat.models.blocks
        self.shape = (config.micro_batch_size, config.seq_length)
        q_out = heads * (self.qk_dim + self.pos_dim)
        bias = config.add_bias_linear
        if config.q_lora_rank is not None:
            self.linear_q_up_proj = ColumnParallelLinear(config.q_lora_rank, q_out, bias, group, sp)
        else:
            self.linear_q_proj = ColumnParallelLinear(config.hidden_size, q_out, bias, group, sp)
        self.linear_kv_up_proj = ColumnParallelLinear(config.kv_lora_rank, heads * (self.qk_dim + self.v_dim), bias,
                                                      group, sp)

    def batch_shape(self, kv_compressed: torch.Tensor) -> tuple[int, int]:
        return self.shape  # under SP the latents are a [b*s/tp, r] shard; the projections gather all b*s tokens


class TPMLASelfAttention(MLASelfAttention):
    """hidden (a token shard under SP) -> duplicated q/kv down-projections and norms -> rotary key gathered over
    the sequence -> this rank's heads' up-projections and rotary -> attention core -> row-parallel output."""

    def __init__(self, config: ModelConfig, group: TensorParallelGroup, sp: bool):
        nn.Module.__init__(self)  # not MLASelfAttention.__init__: the head-split linears replace its own
        self.group, self.sp = group, sp
        self.heads = config.num_attention_heads // group.size
        self.add_down_projections(config)
        self.up_proj = TPMLAUpProjection(config, group, sp)
        self.core_attention = CoreAttention(config, head_dim=config.qk_head_dim + config.qk_pos_emb_head_dim)
        self.linear_proj = RowParallelLinear(config.num_attention_heads * config.v_head_dim, config.hidden_size,
                                             config.add_bias_linear, group, sp)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor,
                rotary: tuple[torch.Tensor, torch.Tensor] | None, shape: tuple[int, int]) -> torch.Tensor:
        """As :class:`TPSelfAttention`'s: ``x`` is [b, s, h], or a [b*s/tp, h] token shard under SP; ``shape`` is
        (b, s)."""
        if rotary is None:
            raise ValueError("MLA needs the rotary tables (position='rope')")
        q_compressed = self.q_layernorm(self.linear_q_down_proj(x)) if hasattr(self, "linear_q_down_proj") else x
        kv_compressed, k_pos_emb = self.linear_kv_down_proj(x).split([self.kv_lora_rank, self.pos_dim], dim=-1)
        if self.sp:  # every rank's heads need every token's rotary key
            k_pos_emb = GatherFromSequence.apply(k_pos_emb, self.group, None)
        else:
            k_pos_emb = CopyToRegion.apply(k_pos_emb, self.group)
        query, key, value = self.up_proj(q_compressed, self.kv_layernorm(kv_compressed), k_pos_emb, rotary)
        context = self.core_attention(query, key, value, attention_mask)
        b, s = shape
        return self.linear_proj(context.transpose(1, 2).reshape(b, s, -1))
