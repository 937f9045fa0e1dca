"""Megatron-style tensor (and sequence) parallel version of the reference GPT, over a real or simulated group."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from remat.config import ConfigError, ModelConfig
from remat.models.collectives import released
from remat.models.gpt import GPT, MLP, CoreAttention, SelfAttention, SwiGLU, building, norm_layer


class TensorParallelGroup:
    """The collectives one tensor-parallel rank needs; tensors are split or gathered along dim 0."""

    size: int = 1
    rank: int = 0

    def all_reduce_(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        raise NotImplementedError

    def _all_gather_into(self, out: torch.Tensor, x: torch.Tensor) -> None:
        raise NotImplementedError

    def _reduce_scatter_into(self, out: torch.Tensor, x: torch.Tensor) -> None:
        raise NotImplementedError

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_empty((x.shape[0] * self.size, *x.shape[1:]))
        self._all_gather_into(out, x.contiguous())
        return out

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] % self.size:
            raise ValueError(f"cannot split {x.shape[0]} tokens {self.size} ways: micro_batch_size x seq_length "
                             "must be divisible by the tensor-parallel size under sequence parallelism")
        out = x.new_empty((x.shape[0] // self.size, *x.shape[1:]))
        self._reduce_scatter_into(out, x.contiguous())
        return out

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's dim-0 slice of a tensor every rank holds whole (no communication)."""
        n = x.shape[0] // self.size
        return x.narrow(0, self.rank * n, n).clone()


class SimulatedGroup(TensorParallelGroup):
    """Rank ``rank`` of ``size`` without peers: every other rank is assumed to hold the same values.

    Sums stay unscaled (the values are not those of a real run), but every tensor has the shape, dtype and
    lifetime it has on a real rank, which is all memory prediction needs.
    """

    def __init__(self, size: int, rank: int = 0):
        self.size, self.rank = size, rank

    def all_reduce_(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return x

    def _all_gather_into(self, out: torch.Tensor, x: torch.Tensor) -> None:
        out.copy_(x.unsqueeze(0).expand(self.size, *x.shape).reshape(out.shape))

    def _reduce_scatter_into(self, out: torch.Tensor, x: torch.Tensor) -> None:
        out.copy_(x.narrow(0, self.rank * out.shape[0], out.shape[0]))


class DistributedGroup(TensorParallelGroup):
    """Collectives on a ``torch.distributed`` process group."""

    def __init__(self, group: Any = None):
        import torch.distributed as dist

        self.dist, self.group = dist, group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def all_reduce_(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        reduce_op = self.dist.ReduceOp.MAX if op == "max" else self.dist.ReduceOp.SUM
        with released(x):
            self.dist.all_reduce(x, op=reduce_op, group=self.group)
        return x

    def _all_gather_into(self, out: torch.Tensor, x: torch.Tensor) -> None:
        with released(out, x):
            self.dist.all_gather_single(out, x, group=self.group)

    def _reduce_scatter_into(self, out: torch.Tensor, x: torch.Tensor) -> None:
        with released(out, x):
            self.dist.reduce_scatter_single(out, x, group=self.group)


# -- Megatron's mappings between parallel regions ----------------------------------------------------------------
class _CopyToRegion(torch.autograd.Function):
    """Identity forward; the input's gradient is summed over the ranks in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TensorParallelGroup) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.group.all_reduce_(grad.contiguous()), None


class _ReduceFromRegion(torch.autograd.Function):
    """Sum partial outputs over the ranks; identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TensorParallelGroup) -> torch.Tensor:
        return group.all_reduce_(x.contiguous())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _ReduceScatterToSequence(torch.autograd.Function):
    """Sum partial outputs and keep this rank's token shard; all-gather the gradient back."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TensorParallelGroup) -> torch.Tensor:
        ctx.group = group
        return group.reduce_scatter(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.group.all_gather(grad), None


class _GatheredLinear(torch.autograd.Function):
    """Column-parallel linear on a sequence-parallel input: gather the tokens, multiply, keep only the shard.

    Backward gathers the shard again for the weight gradient and reduce-scatters the input gradient, so the
    gathered input never outlives the forward (Megatron's sequence-parallel linear)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                group: TensorParallelGroup) -> torch.Tensor:
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)
        total = group.all_gather(x)
        return F.linear(total, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, weight = ctx.saved_tensors
        total = ctx.group.all_gather(x)
        grad_input = ctx.group.reduce_scatter(grad.matmul(weight))
        grad_2d = grad.reshape(-1, grad.shape[-1])
        grad_weight = grad_2d.t().matmul(total.reshape(-1, total.shape[-1]))
        grad_bias = grad_2d.sum(0) if ctx.has_bias else None
        return grad_input, grad_weight, grad_bias, None


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over logits split by vocabulary; keeps one softmax-sized tensor, as Megatron's does."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor, group: TensorParallelGroup) -> torch.Tensor:
        vocab_local = logits.shape[-1]
        start = group.rank * vocab_local
        logits_max = group.all_reduce_(logits.max(dim=-1)[0], op="max")
        shifted = logits - logits_max.unsqueeze(-1)
        outside = (labels < start) | (labels >= start + vocab_local)
        local_labels = (labels - start).masked_fill(outside, 0)
        predicted = shifted.gather(-1, local_labels.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        group.all_reduce_(predicted)
        exp_logits = shifted.exp_()
        sum_exp = group.all_reduce_(exp_logits.sum(dim=-1))
        loss = (sum_exp.log() - predicted).mean()
        exp_logits.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(exp_logits, local_labels, outside)
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        softmax, local_labels, outside = ctx.saved_tensors
        grad_logits = softmax.clone()
        grad_logits.scatter_add_(-1, local_labels.unsqueeze(-1), (outside.to(softmax.dtype) - 1.0).unsqueeze(-1))
        grad_logits.mul_(grad / local_labels.numel())
        return grad_logits, None, None


# -- modules ------------------------------------------------------------------------------------------------------
class ColumnParallelLinear(nn.Module):
    """``out_features / tp`` outputs of a linear layer; the input is whole (or a token shard under SP)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group: TensorParallelGroup, sp: bool):
        super().__init__()
        self.group, self.sp = group, sp
        self.weight = nn.Parameter(torch.empty(out_features // group.size, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features // group.size)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sp:
            return _GatheredLinear.apply(x, self.weight, self.bias, self.group)
        return F.linear(_CopyToRegion.apply(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``in_features / tp`` inputs of a linear layer; partial outputs are summed (reduce-scattered under SP)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group: TensorParallelGroup, sp: bool):
        super().__init__()
        self.group, self.sp = group, sp
        self.weight = nn.Parameter(torch.empty(out_features, in_features // group.size))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)
        if self.sp:
            out = _ReduceScatterToSequence.apply(partial.reshape(-1, partial.shape[-1]), self.group)
        else:
            out = _ReduceFromRegion.apply(partial, self.group)
        return out + self.bias if self.bias is not None else out


class TPSelfAttention(SelfAttention):
    """The reference attention (same head split and core) on this rank's heads."""

    def __init__(self, config: ModelConfig, group: TensorParallelGroup, sp: bool):
        nn.Module.__init__(self)  # not SelfAttention.__init__: its full-size linears are replaced, not built
        t = group.size
        self.heads, self.groups, self.head_dim = config.num_attention_heads // t, config.query_groups // t, \
            config.head_dim
        qkv = (config.num_attention_heads + 2 * config.query_groups) * config.head_dim
        self.linear_qkv = ColumnParallelLinear(config.hidden_size, qkv, config.add_bias_linear, group, sp)
        self.core_attention = CoreAttention(config)
        self.linear_proj = RowParallelLinear(config.num_attention_heads * config.head_dim, config.hidden_size,
                                             config.add_bias_linear, group, sp)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None,
                shape: tuple[int, int]) -> torch.Tensor:
        b, s = shape  # under SP, x is a [b*s/tp, h] token shard; the column-parallel qkv gathers all tokens
        return self.linear_proj(self.attend(self.linear_qkv(x).view(b, s, -1), b, s, mask, rotary))


class TPMLP(MLP):
    """The reference MLP (same forward) with this rank's share of the hidden units."""

    def __init__(self, config: ModelConfig, group: TensorParallelGroup, sp: bool):
        nn.Module.__init__(self)  # not MLP.__init__: its full-size linears are replaced, not built
        gated = config.activation == "swiglu"
        self.linear_fc1 = ColumnParallelLinear(config.hidden_size, config.ffn_size * (2 if gated else 1),
                                               config.add_bias_linear, group, sp)
        self.activation: nn.Module = SwiGLU() if gated else nn.GELU()
        self.linear_fc2 = RowParallelLinear(config.ffn_size, config.hidden_size, config.add_bias_linear, group, sp)


class TPTransformerLayer(nn.Module):
    """One rank's share of a layer. Hidden states are [b, s, h], or [b*s/tp, h] token shards under SP."""

    def __init__(self, config: ModelConfig, group: TensorParallelGroup, sp: bool):
        super().__init__()
        self.input_layernorm = norm_layer(config)
        self.self_attention = TPSelfAttention(config, group, sp)
        self.pre_mlp_layernorm = norm_layer(config)
        self.mlp = TPMLP(config, group, sp)
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
            x = _ReduceScatterToSequence.apply(partial.reshape(-1, partial.shape[-1]), self.group)
        else:
            x = _ReduceFromRegion.apply(partial, self.group)
        return F.dropout(x, p=self.dropout, training=self.training)


class TPHead(nn.Module):
    def __init__(self, config: ModelConfig, group: TensorParallelGroup, sp: bool):
        super().__init__()
        self.group = group
        self.final_layernorm = norm_layer(config)
        self.output_layer = ColumnParallelLinear(config.hidden_size, config.vocab_size, False, group, sp)
        self.shape = (config.micro_batch_size, config.seq_length)

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.output_layer(self.final_layernorm(hidden)).view(*self.shape, -1)
        return _VocabParallelCrossEntropy.apply(logits.float(), labels, self.group)


class TPGPT(nn.Module):
    """One tensor-parallel rank of the reference GPT (same layer names, so policies apply unchanged)."""

    def __init__(self, config: ModelConfig, group: TensorParallelGroup, sp: bool = False):
        super().__init__()
        check_tensor_parallel(config, group.size, sp)
        self.config, self.tp_group, self.sp = config, group, sp
        self.embedding = TPEmbedding(config, group, sp)
        self.layers = nn.ModuleList(TPTransformerLayer(config, group, sp) for _ in range(config.num_layers))
        self.head = TPHead(config, group, sp)
        if config.tie_embeddings:
            self.head.output_layer.weight = self.embedding.word_embeddings.weight

    forward = GPT.forward  # the same step over the rank's modules


def check_tensor_parallel(config: ModelConfig, tp: int, sp: bool) -> None:
    """Refuse a tensor-parallel size that does not divide what it splits, naming the field."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"tp={tp!r}: the tensor-parallel size must be a positive integer")
    if (tp > 1 or sp) and (config.is_moe or config.multi_latent_attention):
        raise ConfigError(f"tp={tp}: the tensor-parallel reference model has no MoE/MLA layers yet "
                          "(num_moe_experts / multi_latent_attention); predict this config with tp=1")
    for name, value in (("num_attention_heads", config.num_attention_heads),
                        ("num_query_groups", config.query_groups), ("ffn_hidden_size", config.ffn_size),
                        ("vocab_size", config.vocab_size)):
        if value % tp:
            raise ConfigError(f"{name}={value} is not divisible by the tensor-parallel size tp={tp}: pick a tp "
                              f"that divides it (or pad {name})")
    if sp and (config.micro_batch_size * config.seq_length) % tp:
        raise ConfigError(f"sequence parallelism splits micro_batch_size*seq_length="
                          f"{config.micro_batch_size * config.seq_length} tokens, not divisible by tp={tp}")
    if sp and tp == 1:
        raise ConfigError("sp=True needs tp > 1: sequence parallelism splits tokens across tensor-parallel ranks")


def build_tp_model(config: ModelConfig, group: TensorParallelGroup, sp: bool = False,
                   device: torch.device | str = "cpu", seed: int | None = 0) -> TPGPT:
    """One rank's share of the reference GPT in ``config.dtype`` on ``device`` (training mode)."""
    if seed is not None:
        torch.manual_seed(seed + group.rank)
    with building(config, device):
        return TPGPT(config, group, sp).train()
