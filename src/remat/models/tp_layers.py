"""The pieces of Megatron-style tensor (and sequence) parallelism the reference model's parallel layers share: the
groups (real or simulated), the mappings between parallel regions, column/row-parallel linears and the TP MLP."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from remat.config import ModelConfig
from remat.models.blocks import MLP, gated_activation
from remat.models.collectives import released, run_collective, run_in_place_collective

# Megatron's TransformerEngine linears, as the reference models name them: every layer's linear_* and the MTP depths'
# eh_proj (a TEColumnParallelLinear); the output layer (Megatron's own linear), embeddings, norms and router are not
_TE_LINEAR_WEIGHT = re.compile(r"(^|\.)(linear_[a-z0-9_]+|eh_proj)\.weight$")


def is_te_linear_weight(name: str) -> bool:
    """Whether the parameter ``name`` (a module path) is the weight of one of Megatron's TransformerEngine linears.

    Example:
        >>> is_te_linear_weight("layers.0.mlp.linear_fc1.weight"), is_te_linear_weight("head.output_layer.weight")
        (True, False)
    """
    return _TE_LINEAR_WEIGHT.search(name) is not None


class TensorParallelGroup:
    """The collectives one tensor-parallel rank needs; tensors are split or gathered along dim 0."""

    size: int = 1
    rank: int = 0

    def all_reduce_(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Sum (``op="max"``: the maximum) of ``x`` over the ranks, written into ``x``; returns ``x``."""
        run_in_place_collective(lambda: self._all_reduce_into(x, op), written=x)
        return x

    def _all_reduce_into(self, x: torch.Tensor, op: str) -> None:
        raise NotImplementedError

    def _all_gather_into(self, out: torch.Tensor, x: torch.Tensor) -> None:
        raise NotImplementedError

    def _reduce_scatter_into(self, out: torch.Tensor, x: torch.Tensor) -> None:
        raise NotImplementedError

    def _into_new(self, x: torch.Tensor, rows: int, fill: Callable[[torch.Tensor, torch.Tensor], None]) -> torch.Tensor:
        """One collective (NOTE [collectives are not operators]) writing ``fill(out, x)`` into a new ``out`` of
        ``rows`` rows shaped as ``x``'s."""
        def collective() -> torch.Tensor:
            out = x.new_empty((rows, *x.shape[1:]))
            fill(out, x.contiguous())
            return out

        return run_collective(collective)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return self._into_new(x, x.shape[0] * self.size, self._all_gather_into)

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] % self.size:
            raise ValueError(f"cannot split {x.shape[0]} tokens {self.size} ways: micro_batch_size x seq_length "
                             "must be divisible by the tensor-parallel size under sequence parallelism")
        return self._into_new(x, x.shape[0] // self.size, self._reduce_scatter_into)

    def all_gather_v(self, x: torch.Tensor, splits: list[int]) -> torch.Tensor:
        """Every rank's rows, ``splits[r]`` of them from rank r, in rank order, as one new tensor (Megatron's
        ``gather_from_sequence_parallel_region`` with ``output_split_sizes``)."""
        if splits[self.rank] != x.shape[0]:
            raise ValueError(f"rank {self.rank} sends {x.shape[0]} rows, but splits={splits} says {splits[self.rank]}")
        if len(set(splits)) == 1:
            return self._into_new(x, sum(splits), self._all_gather_into)
        return self._into_new(x, sum(splits), lambda out, rows: self._all_gather_v_into(out, rows, splits))

    def reduce_scatter_v(self, x: torch.Tensor, splits: list[int]) -> torch.Tensor:
        """Sum ``x`` over the ranks and keep rows ``splits[rank]`` of it (rank order), as one new tensor (Megatron's
        ``reduce_scatter_to_sequence_parallel_region`` with ``input_split_sizes``). ``x``'s storage may be used as
        scratch by the reduction."""
        if sum(splits) != x.shape[0]:
            raise ValueError(f"reduce-scatter of {x.shape[0]} rows into splits={splits}")
        if len(set(splits)) == 1:
            return self.reduce_scatter(x)
        return self._into_new(x, splits[self.rank], lambda out, rows: self._reduce_scatter_v_into(out, rows, splits))

    def _all_gather_v_into(self, out: torch.Tensor, x: torch.Tensor, splits: list[int]) -> None:
        raise NotImplementedError(f"{type(self).__name__}: a gather of unequal splits {splits}")

    def _reduce_scatter_v_into(self, out: torch.Tensor, x: torch.Tensor, splits: list[int]) -> None:
        raise NotImplementedError(f"{type(self).__name__}: a reduce-scatter of unequal splits {splits}")

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's dim-0 slice of a tensor every rank holds whole (no communication)."""
        n = x.shape[0] // self.size
        return x.narrow(0, self.rank * n, n).clone()


class SimulatedGroup(TensorParallelGroup):
    """Rank ``rank`` of ``size`` without peers: every other rank is assumed to hold the same values.

    Sums stay unscaled (the values are not those of a real run), but every tensor has the shape, dtype and
    lifetime it has on a real rank, which is all memory prediction needs. A collective allocates its output and
    nothing else, as NCCL's does (writing the gathered copies through a view of the output, not a materialized
    expand); on fake tensors, which hold no values, it only allocates: the fill is a third of a TP trace's
    collective operators and changes no byte.
    """

    def __init__(self, size: int, rank: int = 0):
        self.size, self.rank = size, rank

    def _all_reduce_into(self, x: torch.Tensor, op: str) -> None:
        pass

    def _all_gather_into(self, out: torch.Tensor, x: torch.Tensor) -> None:
        if not isinstance(x, FakeTensor):
            out.view(self.size, *x.shape).copy_(x.unsqueeze(0).expand(self.size, *x.shape))

    def _reduce_scatter_into(self, out: torch.Tensor, x: torch.Tensor) -> None:
        if not isinstance(x, FakeTensor):
            out.copy_(x.narrow(0, self.rank * out.shape[0], out.shape[0]))


class DistributedGroup(TensorParallelGroup):
    """Collectives on a ``torch.distributed`` process group."""

    def __init__(self, group: Any = None):
        import torch.distributed as dist

        self.dist, self.group = dist, group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def _all_reduce_into(self, x: torch.Tensor, op: str) -> None:
        reduce_op = self.dist.ReduceOp.MAX if op == "max" else self.dist.ReduceOp.SUM
        with released(x):
            self.dist.all_reduce(x, op=reduce_op, group=self.group)

    def _all_gather_into(self, out: torch.Tensor, x: torch.Tensor) -> None:
        with released(out, x):
            self.dist.all_gather_single(out, x, group=self.group)

    def _reduce_scatter_into(self, out: torch.Tensor, x: torch.Tensor) -> None:
        with released(out, x):
            if self.dist.get_backend(self.group) == "gloo":
                # gloo's reduce_scatter_single reduces into a copy of x that its split hands back (an input-sized
                # storage a measurement sees and NCCL never makes); its list form reduces in its own buffers
                chunks = list(x.chunk(self.size))
                self.dist.reduce_scatter(out, chunks, group=self.group)
                del chunks
            else:
                self.dist.reduce_scatter_single(out, x, group=self.group)

    def _global(self, rank: int) -> int:
        return rank if self.group is None else self.dist.get_global_rank(self.group, rank)

    # unequal splits: gloo's all_gather / reduce_scatter take equal sizes only, so one broadcast (reduce) per rank
    # into (from) the rows of ``out`` (``x``); the same tensors as Megatron's all_gather / reduce_scatter lists
    def _all_gather_v_into(self, out: torch.Tensor, x: torch.Tensor, splits: list[int]) -> None:
        with released(out, x):
            chunks = list(out.split(splits))
            chunks[self.rank].copy_(x)
            for src, chunk in enumerate(chunks):
                self.dist.broadcast(chunk, src=self._global(src), group=self.group)
            del chunks

    def _reduce_scatter_v_into(self, out: torch.Tensor, x: torch.Tensor, splits: list[int]) -> None:
        with released(out, x):
            chunks = list(x.split(splits))
            for dst, chunk in enumerate(chunks):
                self.dist.reduce(chunk, dst=self._global(dst), group=self.group)
            out.copy_(chunks[self.rank])
            del chunks


# -- Megatron's mappings between parallel regions ----------------------------------------------------------------
class CopyToRegion(torch.autograd.Function):
    """Identity forward; the input's gradient is summed over the ranks in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TensorParallelGroup) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.group.all_reduce_(grad.contiguous()), None


class ReduceFromRegion(torch.autograd.Function):
    """Sum partial outputs over the ranks; identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TensorParallelGroup) -> torch.Tensor:
        return group.all_reduce_(x.contiguous())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class ReduceScatterToSequence(torch.autograd.Function):
    """Sum partial outputs and keep this rank's token shard; all-gather the gradient back."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TensorParallelGroup) -> torch.Tensor:
        ctx.group = group
        return group.reduce_scatter(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.group.all_gather(grad), None


class GatherFromSequence(torch.autograd.Function):
    """Megatron's ``gather_from_sequence_parallel_region`` (``tensor_parallel_output_grad=True``): gather the
    ranks' rows (``splits``, or equal shares when None) forward, reduce-scatter the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TensorParallelGroup, splits: list[int] | None) -> torch.Tensor:
        ctx.group, ctx.splits = group, splits
        return group.all_gather(x) if splits is None else group.all_gather_v(x, splits)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        group, splits = ctx.group, ctx.splits
        return (group.reduce_scatter(grad) if splits is None else group.reduce_scatter_v(grad, splits)), None, None


class ReduceScatterToSequenceV(torch.autograd.Function):
    """Megatron's ``reduce_scatter_to_sequence_parallel_region`` with ``input_split_sizes``: sum the ranks' partial
    rows and keep this rank's ``splits[rank]``; all-gather the gradient back."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TensorParallelGroup, splits: list[int]) -> torch.Tensor:
        ctx.group, ctx.splits = group, splits
        return group.reduce_scatter_v(x, splits)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ctx.group.all_gather_v(grad, ctx.splits), None, None


class GatherFromTensorRegion(torch.autograd.Function):
    """Megatron's ``gather_from_tensor_model_parallel_region`` (mappings.py ``_gather_along_last_dim``): the ranks'
    last-dimension shards all-gathered along dim 0 into a new buffer, then concatenated along the last dimension
    (a second new tensor; the buffer goes on return); backward keeps this rank's slice of the gradient (a copy)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TensorParallelGroup) -> torch.Tensor:
        ctx.group = group
        gathered = group.all_gather(x)
        return torch.cat(gathered.chunk(group.size, 0), dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.chunk(ctx.group.size, -1)[ctx.group.rank].contiguous(), None


class ScatterToSequence(torch.autograd.Function):
    """Megatron's ``scatter_to_sequence_parallel_region`` (``_split_along_first_dim``): this rank's rows, a view of
    the whole input (``.contiguous()`` of a dim-0 slice copies nothing, so the input lives as long as the view);
    backward all-gathers the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TensorParallelGroup) -> torch.Tensor:
        ctx.group = group
        rows = x.shape[0] // group.size
        return x[group.rank * rows:(group.rank + 1) * rows]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.group.all_gather(grad), None


class GatheredLinear(torch.autograd.Function):
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
            return GatheredLinear.apply(x, self.weight, self.bias, self.group)
        return F.linear(CopyToRegion.apply(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``in_features / tp`` inputs of a linear layer; partial outputs are summed (reduce-scattered under SP)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group: TensorParallelGroup, sp: bool):
        super().__init__()
        self.group, self.sp = group, sp
        self.weight = nn.Parameter(torch.empty(out_features, in_features // group.size))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce_partial(F.linear(x, self.weight))

    def reduce_partial(self, partial: torch.Tensor) -> torch.Tensor:
        """This rank's partial output summed over the group (reduce-scattered over the tokens under SP), plus the
        bias."""
        if self.sp:
            out = ReduceScatterToSequence.apply(partial.reshape(-1, partial.shape[-1]), self.group)
        else:
            out = ReduceFromRegion.apply(partial, self.group)
        return out + self.bias if self.bias is not None else out


class TPMLP(MLP):
    """The reference MLP (same forward) with this rank's share of the hidden units: ``ffn_size`` of them in all
    (default ``config.ffn_size``; a shared expert's ``moe_shared_expert_intermediate_size``)."""

    def __init__(self, config: ModelConfig, group: TensorParallelGroup, sp: bool, ffn_size: int | None = None):
        nn.Module.__init__(self)  # not MLP.__init__: its full-size linears are replaced, not built
        gated = config.gated
        ffn = config.ffn_size if ffn_size is None else ffn_size
        self.linear_fc1 = ColumnParallelLinear(config.hidden_size, ffn * (2 if gated else 1),
                                               config.add_bias_linear, group, sp)
        self.activation: nn.Module = gated_activation(config)
        self.linear_fc2 = RowParallelLinear(ffn, config.hidden_size, config.add_bias_linear, group, sp)
