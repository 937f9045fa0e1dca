"""Megatron-style tensor (and sequence) parallel version of the reference GPT, over a real or simulated group.

The groups, mappings and parallel linears live in :mod:`remat.models.tp_layers` (re-exported here); MoE layers
on a rank in :mod:`remat.models.tp_moe`, multi-latent attention in :mod:`remat.models.tp_mla`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from remat.config import ConfigError, ModelConfig
from remat.models.cross_entropy import language_model_loss, token_losses
from remat.models.gpt import GPT, CoreAttention, MTPLayer, SelfAttention, building, norm_layer
from remat.models.tp_layers import (
    TPMLP,
    ColumnParallelLinear,
    DistributedGroup,
    GatherFromTensorRegion,
    ReduceFromRegion,
    ReduceScatterToSequence,
    RowParallelLinear,
    ScatterToSequence,
    SimulatedGroup,
    TensorParallelGroup,
)
from remat.models.tp_mla import TPMLASelfAttention
from remat.models.tp_moe import TPMoELayer, check_tp_moe

__all__ = ["ColumnParallelLinear", "DistributedGroup", "RowParallelLinear", "SimulatedGroup", "TPGPT", "TPMLP",
           "TPEmbedding", "TPHead", "TPMTPLayer", "TPSelfAttention", "TPTransformerLayer", "TensorParallelGroup",
           "build_tp_model", "check_tensor_parallel"]


class TPSelfAttention(SelfAttention):
    """The reference attention (same head split and core) on this rank's heads."""

    def __init__(self, config: ModelConfig, group: TensorParallelGroup, sp: bool, layer: int = 0):
        nn.Module.__init__(self)  # not SelfAttention.__init__: its full-size linears are replaced, not built
        t = group.size
        self.heads, self.groups, self.head_dim = config.num_attention_heads // t, config.query_groups // t, \
            config.head_dim
        qkv = (config.num_attention_heads + 2 * config.query_groups) * config.head_dim
        self.linear_qkv = ColumnParallelLinear(config.hidden_size, qkv, config.qkv_bias, group, sp)
        self.add_qk_norms(config)
        self.rope_fused = config.apply_rope_fusion  # NOTE [unfused rope] in remat.models.blocks
        self.core_attention = CoreAttention(config, heads=self.heads, layer=layer)
        self.linear_proj = RowParallelLinear(config.num_attention_heads * config.head_dim, config.hidden_size,
                                             config.add_bias_linear, group, sp)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None,
                shape: tuple[int, int]) -> torch.Tensor:
        b, s = shape  # under SP, x is a [b*s/tp, h] token shard; the column-parallel qkv gathers all tokens
        return self.linear_proj(self.attend(self.linear_qkv(x).view(b, s, -1), b, s, mask, rotary))


class TPTransformerLayer(nn.Module):
    """One rank's share of a layer. Hidden states are [b, s, h], or [b*s/tp, h] token shards under SP."""

    def __init__(self, config: ModelConfig, group: TensorParallelGroup, sp: bool, layer_number: int = 0):
        super().__init__()
        self.input_layernorm = norm_layer(config)
        self.self_attention: nn.Module = (TPMLASelfAttention(config, group, sp) if config.multi_latent_attention
                                          else TPSelfAttention(config, group, sp, layer_number))
        self.pre_mlp_layernorm = norm_layer(config)
        pattern = config.moe_layer_pattern()  # MoE where moe_layer_freq says so, as the reference layer
        self.mlp: nn.Module = (TPMoELayer(config, sum(pattern[:layer_number]), group, sp) if pattern[layer_number]
                               else TPMLP(config, group, sp))
        self.dropout = config.hidden_dropout
        self.shape = (config.micro_batch_size, config.seq_length)

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor,
                rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        attn = self.self_attention(self.input_layernorm(hidden), attention_mask, rotary, self.shape)
        hidden = hidden + F.dropout(attn.view_as(hidden), p=self.dropout, training=self.training)
        mlp = self.mlp(self.pre_mlp_layernorm(hidden))
        return hidden + F.dropout(mlp.view_as(hidden), p=self.dropout, training=self.training)


class TPEmbedding(nn.Module):
    """Vocab-parallel word embeddings (+ replicated learned positions), summed over the ranks."""

    def __init__(self, config: ModelConfig, group: TensorParallelGroup, sp: bool):
        super().__init__()
        self.group, self.sp = group, sp
        self.vocab_local = config.vocab_size // group.size
        self.word_embeddings = nn.Embedding(self.vocab_local, config.hidden_size)
        self.position_embeddings = (
            nn.Embedding(config.seq_length, config.hidden_size) if config.position == "learned" else None)
        self.dropout = config.hidden_dropout

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        start = self.group.rank * self.vocab_local
        outside = (tokens < start) | (tokens >= start + self.vocab_local)
        partial = self.word_embeddings((tokens - start).masked_fill(outside, 0))
        partial = partial.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.position_embeddings is not None:
            # added once, on rank 0's partial sum, so that the reduction counts it once
            positions = self.position_embeddings(torch.arange(tokens.shape[1], device=tokens.device))
            partial = partial + positions * (1.0 if self.group.rank == 0 else 0.0)
        if self.sp:
            x = ReduceScatterToSequence.apply(partial.reshape(-1, partial.shape[-1]), self.group)
        else:
            x = ReduceFromRegion.apply(partial, self.group)
        return F.dropout(x, p=self.dropout, training=self.training)


class TPHead(nn.Module):
    def __init__(self, config: ModelConfig, group: TensorParallelGroup, sp: bool):
        super().__init__()
        self.group = group
        self.final_layernorm = norm_layer(config)
        self.output_layer = ColumnParallelLinear(config.hidden_size, config.vocab_size, False, group, sp)
        self.shape = (config.micro_batch_size, config.seq_length)
        # the vocabulary is split: 'torch' (F.cross_entropy over all of it) becomes Megatron's vocab-parallel loss
        self.cross_entropy = "megatron" if config.cross_entropy == "torch" else config.cross_entropy

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss(self.final_layernorm(hidden), labels)

    def loss(self, normed: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return language_model_loss(self.logits(normed), labels, self.cross_entropy, self.group)

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        return self.output_layer(normed).view(*self.shape, -1)

    def token_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The per-token loss [b, s] of ``logits`` (an MTP depth's: remat.models.gpt.multi_token_loss)."""
        return token_losses(logits, labels, self.cross_entropy, self.group)


class TPMTPLayer(MTPLayer):
    """One rank's share of an MTP depth (NOTE [multi-token prediction] in remat.models.gpt): eh_proj column-parallel
    (TE's, gather_output=False), its output gathered along the hidden dimension and, under SP, scattered back to
    this rank's tokens (multi_token_prediction.py:1347-1358)."""

    def __init__(self, config: ModelConfig, group: TensorParallelGroup, sp: bool):
        nn.Module.__init__(self)  # not MTPLayer.__init__: its full-size linears are replaced, not built
        self.group, self.sp = group, sp
        self.enorm, self.hnorm = norm_layer(config), norm_layer(config)
        self.eh_proj = ColumnParallelLinear(2 * config.hidden_size, config.hidden_size, False, group, sp)
        self.mtp_model_layer = TPTransformerLayer(config, group, sp, config.num_layers - 1)
        self.final_layernorm = norm_layer(config)

    def forward(self, hidden: torch.Tensor, decoder_input: torch.Tensor, attention_mask: torch.Tensor,
                rotary: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        x = self.eh_proj(torch.cat((self.enorm(decoder_input), self.hnorm(hidden)), -1))
        x = GatherFromTensorRegion.apply(x.reshape(-1, x.shape[-1]), self.group).view(*x.shape[:-1], -1)
        if self.sp:
            x = ScatterToSequence.apply(x, self.group)
        return self.final_layernorm(self.mtp_model_layer(x, attention_mask, rotary))


class TPGPT(nn.Module):
    """One tensor-parallel rank of the reference GPT (same layer names, so policies apply unchanged)."""

    def __init__(self, config: ModelConfig, group: TensorParallelGroup, sp: bool = False):
        super().__init__()
        check_tensor_parallel(config, group.size, sp)
        self.config, self.tp_group, self.sp = config, group, sp
        self.embedding = TPEmbedding(config, group, sp)
        self.layers = nn.ModuleList(TPTransformerLayer(config, group, sp, i) for i in range(config.num_layers))
        self.head = TPHead(config, group, sp)
        self.mtp = nn.ModuleList(TPMTPLayer(config, group, sp) for _ in range(config.mtp_num_layers)) or None
        if config.tie_embeddings:
            self.head.output_layer.weight = self.embedding.word_embeddings.weight

    forward = GPT.forward  # the same step over the rank's modules


def check_tensor_parallel(config: ModelConfig, tp: int, sp: bool, etp: int | None = None) -> None:
    """Refuse a tensor-parallel size that does not divide what it splits, naming the field; MoE layers also as
    :func:`remat.models.tp_moe.check_tp_moe` says (sequence parallelism needed, ``etp``: the experts'
    tensor-parallel size, None meaning tp)."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"tp={tp!r}: the tensor-parallel size must be a positive integer")
    if sp and tp == 1:
        raise ConfigError("sp=True needs tp > 1: sequence parallelism splits tokens across tensor-parallel ranks")
    checks = [("num_attention_heads", config.num_attention_heads), ("vocab_size", config.vocab_size)]
    if not config.multi_latent_attention:  # MLA's heads each have their own keys and values
        checks.insert(1, ("num_query_groups", config.query_groups))
    if not all(config.moe_layer_pattern()):
        checks.insert(2, ("ffn_hidden_size", config.ffn_size))
    for name, value in checks:
        if value % tp:
            raise ConfigError(f"{name}={value} is not divisible by the tensor-parallel size tp={tp}: pick a tp "
                              f"that divides it (or pad {name})")
    if sp and (config.micro_batch_size * config.seq_length) % tp:
        raise ConfigError(f"sequence parallelism splits micro_batch_size*seq_length="
                          f"{config.micro_batch_size * config.seq_length} tokens, not divisible by tp={tp}")
    if config.is_moe:
        check_tp_moe(config, tp, sp, etp)


def build_tp_model(config: ModelConfig, group: TensorParallelGroup, sp: bool = False,
                   device: torch.device | str = "cpu", seed: int | None = 0) -> TPGPT:
    """One rank's share of the reference GPT in ``config.dtype`` on ``device`` (training mode)."""
    if seed is not None:
        torch.manual_seed(seed + group.rank)
    with building(config, device):
        return TPGPT(config, group, sp).train()
