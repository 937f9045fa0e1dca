"""Expert parallelism in the reference model's MoE layers: Megatron-LM's ``--expert-model-parallel-size`` with its
all-to-all token dispatcher (``MoEAlltoAllTokenDispatcher``), over a simulated or a real expert-parallel group.

Each of the ``ep`` ranks holds ``num_moe_experts / ep`` consecutive experts (rank r: experts r*L .. r*L+L-1) and
routes its own tokens. An MoE layer then runs (:func:`run_experts_parallel`, NOTE [the all-to-all dispatcher]):
the routed copies permuted into expert order (hence by destination rank) -> the counts exchanged -> all-to-all
of the copies and of their probabilities -> the received chunks sorted by local expert -> the local experts ->
unsorted -> all-to-all back -> combined into the tokens, as on one rank.

Two groups (the pattern of :mod:`remat.models.tensor_parallel`): :class:`SimulatedExpertGroup` is rank r of ep
without peers, for prediction under fake tensors: every rank is assumed to send what this one sends, so rank r
receives ep x (its local experts' counts) copies; under balanced routing that is tokens x topk copies in all,
under a capacity factor ``num_moe_experts`` x capacity (every expert full from every rank: the worst case), and
with measured counts per expert ep times this rank's share of them. :class:`DistributedExpertGroup` runs the
collectives on a ``torch.distributed`` group (gloo on CPU). Both allocate the same tensors, of the same sizes,
in the same order, so a prediction of a rank is its measurement to the byte when the routing is the same on
every rank (balanced routing forced in both).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from remat.config import ConfigError, ModelConfig, RoutingAssumption
from remat.models.collectives import released, run_collective
from remat.models.permute import sort_chunks_fused


def host_values(values: Sequence[int], dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
    """``values`` (decided in Python) as a tensor on ``like``'s device. Under fake tensors an empty one of the same
    size: ``torch.tensor`` would first make a real constant, which a recorder would count as a second
    allocation that the real run does not have."""
    if isinstance(like, FakeTensor):
        return torch.empty(len(values), dtype=dtype, device=like.device)
    return torch.tensor(values, dtype=dtype, device=like.device)


class ExpertParallelGroup:
    """The collectives one expert-parallel rank needs: an all-to-all of rows with split sizes, and the exchange of
    every rank's tokens per expert."""

    size: int = 1
    rank: int = 0

    def _all_to_all_into(self, out: torch.Tensor, x: torch.Tensor, output_splits: list[int],
                         input_splits: list[int]) -> None:
        raise NotImplementedError

    def _gather_counts(self, gathered: torch.Tensor, local: torch.Tensor, counts: list[int]) -> list[list[int]]:
        raise NotImplementedError

    def all_to_all(self, x: torch.Tensor, output_splits: list[int], input_splits: list[int]) -> torch.Tensor:
        """Send rows ``input_splits[d]`` of ``x`` (in rank order) to rank d; return the rows received, rank by rank
        (``output_splits[s]`` from rank s), as one new tensor (Megatron's ``_AllToAll.forward``)."""
        def exchange() -> torch.Tensor:
            rows = x.contiguous()
            out = rows.new_empty((sum(output_splits), *rows.shape[1:]))
            self._all_to_all_into(out, rows, output_splits, input_splits)
            return out

        return run_collective(exchange)

    def exchange_counts(self, counts: list[int], like: torch.Tensor) -> list[list[int]]:
        """Every rank's tokens per expert, ``[rank][expert]``, from this rank's ``counts``: an all-gather of a long
        tensor (Megatron gathers ``num_local_tokens_per_expert`` over the expert-parallel group)."""
        def exchange() -> list[list[int]]:
            local = host_values(counts, torch.long, like)
            return self._gather_counts(local.new_empty(self.size * len(counts)), local, counts)

        return run_collective(exchange)


class SimulatedExpertGroup(ExpertParallelGroup):
    """Rank ``rank`` of ``size`` without peers: every other rank is assumed to route its tokens as this one does.

    The received rows are this rank's own rows (values are not those of a real run), but every tensor has the
    shape, dtype and lifetime it has on a real rank whose peers route alike, which is all prediction needs.
    """

    def __init__(self, size: int, rank: int = 0):
        if not 0 <= rank < size:
            raise ConfigError(f"expert-parallel rank {rank}: the group has ranks 0..{size - 1}")
        self.size, self.rank = size, rank

    def _all_to_all_into(self, out: torch.Tensor, x: torch.Tensor, output_splits: list[int],
                         input_splits: list[int]) -> None:
        n = min(out.shape[0], x.shape[0])  # views and in-place copies: nothing allocated beyond ``out``
        out[:n].copy_(x[:n])
        out[n:].zero_()

    def _gather_counts(self, gathered: torch.Tensor, local: torch.Tensor, counts: list[int]) -> list[list[int]]:
        return [list(counts) for _ in range(self.size)]


class DistributedExpertGroup(ExpertParallelGroup):
    """The collectives on a ``torch.distributed`` process group (gloo on CPU)."""

    def __init__(self, group: Any = None):
        import torch.distributed as dist

        self.dist, self.group = dist, group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def _all_to_all_into(self, out: torch.Tensor, x: torch.Tensor, output_splits: list[int],
                         input_splits: list[int]) -> None:
        with released(out, x):
            self.dist.all_to_all_single(out, x, output_split_sizes=output_splits, input_split_sizes=input_splits,
                                        group=self.group)

    def _gather_counts(self, gathered: torch.Tensor, local: torch.Tensor, counts: list[int]) -> list[list[int]]:
        with released(gathered, local):
            self.dist.all_gather_single(gathered, local, group=self.group)
        return gathered.view(self.size, -1).tolist()


class AllToAll(torch.autograd.Function):
    """Megatron's ``_AllToAll``: the all-to-all forward, the reverse all-to-all of the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ExpertParallelGroup, output_splits: list[int],
                input_splits: list[int]) -> torch.Tensor:
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        return group.all_to_all(x, output_splits, input_splits)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return ctx.group.all_to_all(grad, ctx.input_splits, ctx.output_splits), None, None, None


def sort_chunks(x: torch.Tensor, sizes: Sequence[int], order: Sequence[int]) -> torch.Tensor:
    """Megatron's ``sort_chunks_by_idxs`` (unfused): split ``x`` into rows of ``sizes``, concatenate in ``order``
    (NOTE [sorting chunks])."""
    return _SortChunks.apply(x, list(sizes), list(order))


# NOTE [sorting chunks]: Megatron's unfused sort_chunks_by_idxs (megatron/core/transformer/moe/moe_utils.py:663-668
# at d98e8a6) is torch.split then torch.cat: in forward one split_with_sizes (views: no allocation) and one cat (the
# one new tensor, x's size), the same two operators here (operator-level checkpoints count operators: NOTE [kept
# operators by index]). Its backward as autograd runs it (CatBackward0: a narrow view of the output's gradient per
# chunk; SplitWithSizesBackward0: split_with_sizes_backward in torch/csrc/autograd/FunctionsManual.cpp, at::cat of
# them) allocates one tensor, the input's gradient, then lets the output's gradient go. Under fake tensors (no values)
# a DeepSeek-V3 layer at ep 8 sorts 256 chunks three times, each chunk a fake view (~70 us of dispatch in forward,
# ~170 us in backward): here the forward splits off one chunk of all the rows and cats it (the same two operators,
# the same new tensor), the backward makes the input's gradient as one empty tensor of its shape: the same
# allocations and frees in the same order, a trace's events unchanged (tests/parallel/test_expert_parallel.py). Real
# tensors are sorted chunk by chunk, forward and backward (the inverse sort of the gradient).
class _SortChunks(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, sizes: list[int], order: list[int]) -> torch.Tensor:
        ctx.set_materialize_grads(False)
        ctx.sizes, ctx.order = sizes, order
        if sum(sizes) != x.shape[0] or sorted(order) != list(range(len(sizes))):
            raise ValueError(f"sort_chunks: chunks of {sum(sizes)} rows in the order {order} do not sort the "
                             f"{x.shape[0]} rows of the tensor (each of the {len(sizes)} chunks once)")
        if isinstance(x, FakeTensor):  # no values to move: one chunk of every row (NOTE [sorting chunks])
            return torch.cat(x.split([x.shape[0]]))
        chunks = x.split(sizes)
        return torch.cat([chunks[i] for i in order])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> tuple[torch.Tensor | None, None, None]:
        if grad is None:
            return None, None, None
        if isinstance(grad, FakeTensor):
            return grad.new_empty(grad.shape), None, None
        chunks = grad.split([ctx.sizes[i] for i in ctx.order])
        where = {chunk: at for at, chunk in enumerate(ctx.order)}
        return torch.cat([chunks[where[i]] for i in range(len(ctx.sizes))]), None, None


# NOTE [the all-to-all dispatcher]
# megatron/core/transformer/moe/token_dispatcher.py::MoEAlltoAllTokenDispatcher (tp = 1): the copies arrive here
# already permuted into expert order (MoELayer's dispatch; experts of rank d are consecutive, so this is also
# destination order). preprocess: input_splits[d] = the copies for rank d's experts; every rank's counts are
# all-gathered, so output_splits[s] = the copies rank s sends to this rank's experts. token_dispatch: all-to-all
# of the copies, then of their probabilities. dispatch_postprocess: with more than one local expert the received
# chunks, in [source rank][local expert] order, are sorted to [local expert][source rank] (sort_chunks_by_idxs).
# The experts run; combine_preprocess sorts back; token_combine is the reverse all-to-all. The tensors each step
# makes are new (the all-to-all outputs, the sorted copies), and the variables are rebound as in Megatron, so the
# received copies are freed once sorted, and the sorted ones once the experts have used them (autograd keeps what
# backward needs).
def run_experts_parallel(experts: nn.Module, group: ExpertParallelGroup, permuted: torch.Tensor,
                         permuted_probs: torch.Tensor, counts: list[int], *,
                         fused: bool = False) -> tuple[torch.Tensor, list[int]]:
    """Dispatch this rank's routed copies (``permuted``, in expert order, ``counts[e]`` for expert e of all
    ``num_moe_experts``) to the ranks holding their experts, run the local ``experts`` on what this rank
    receives, and bring the outputs back in ``permuted``'s order; ``fused``: the chunks sorted by TE's fused
    kernels (``--moe-permute-fusion``, :func:`remat.models.permute.sort_chunks_fused`).

    Returns:
        The outputs, one row per row of ``permuted``, and the copies each local expert received.
    """
    ep = group.size
    local = len(counts) // ep
    input_splits = [sum(counts[d * local:(d + 1) * local]) for d in range(ep)]
    every = group.exchange_counts(counts, permuted)
    mine = [row[group.rank * local:(group.rank + 1) * local] for row in every]  # [source rank][local expert]
    output_splits = [sum(row) for row in mine]
    tokens = AllToAll.apply(permuted, group, output_splits, input_splits)
    probs = AllToAll.apply(permuted_probs, group, output_splits, input_splits)
    del permuted, permuted_probs  # sent: Megatron rebinds its variables to what arrived (pass them as temporaries)
    received = [sum(row[e] for row in mine) for e in range(local)]
    if local > 1:  # [source][local expert] -> [local expert][source]
        by_source = [c for row in mine for c in row]
        to_experts = [s * local + e for e in range(local) for s in range(ep)]
        tokens, probs = sort_by_chunks(tokens, probs, by_source, to_experts, fused)
    output = experts(tokens, received, probs)
    del tokens, probs
    if local > 1:  # back to [source][local expert]
        by_expert = [mine[s][e] for e in range(local) for s in range(ep)]
        to_sources = [e * ep + s for s in range(ep) for e in range(local)]
        output = sort_by_chunks(output, None, by_expert, to_sources, fused)[0]
    return AllToAll.apply(output, group, input_splits, output_splits), received


def sort_by_chunks(tokens: torch.Tensor, probs: torch.Tensor | None, sizes: list[int], order: list[int],
                   fused: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows (and their probabilities, unless None) split into chunks of ``sizes`` rows, in ``order``: one fused
    kernel (``--moe-permute-fusion``) or Megatron's unfused ``sort_chunks_by_idxs`` of each."""
    if fused:
        return sort_chunks_fused(tokens, probs, sizes, order)
    return sort_chunks(tokens, sizes, order), None if probs is None else sort_chunks(probs, sizes, order)


# ------------------------------------------------------------------------------------------------ the group in use
_GROUPS: list[ExpertParallelGroup] = []


@contextlib.contextmanager
def expert_parallel_group(group: ExpertParallelGroup) -> Iterator[None]:
    """MoE layers built inside this block run over ``group`` (a real run's :class:`DistributedExpertGroup`, or a
    :class:`SimulatedExpertGroup` of another rank than 0); outside, a layer with
    ``expert_model_parallel_size`` > 1 simulates rank 0."""
    _GROUPS.append(group)
    try:
        yield
    finally:
        _GROUPS.pop()


def expert_group_for(config: ModelConfig) -> ExpertParallelGroup | None:
    """The group a new MoE layer of ``config`` runs over: None without expert parallelism, the group of the
    enclosing :func:`expert_parallel_group`, else a simulated rank 0."""
    ep = config.expert_model_parallel_size
    if ep == 1:
        return None
    if _GROUPS:
        group = _GROUPS[-1]
        if group.size != ep:
            raise ConfigError(f"expert_model_parallel_size={ep}, but the expert-parallel group has {group.size} "
                              "ranks: build the model in a group of that size (or set the field to it)")
        return group
    return SimulatedExpertGroup(ep, 0)


def simulated_expert_rank() -> tuple[int, ...] | None:
    """What a cached trace depends on: (size, rank) of the enclosing simulated expert-parallel group, followed by
    (size, rank) of the enclosing expert tensor-parallel group (:func:`expert_tensor_parallel_group`) when there
    is one; None outside both."""
    key: tuple[int, ...] = ()
    if _GROUPS and isinstance(_GROUPS[-1], SimulatedExpertGroup):
        key = (_GROUPS[-1].size, _GROUPS[-1].rank)
    if _EXPERT_TP:
        key = (*(key or (1, 0)), _EXPERT_TP[-1][0].size, _EXPERT_TP[-1][0].rank)
    return key or None


# the expert tensor-parallel group in use: (etp group, tp x ep counts group or None); the etp group is a
# remat.models.tp_layers.TensorParallelGroup (not imported here: tp_layers builds on the reference model)
_EXPERT_TP: list[tuple[Any, ExpertParallelGroup | None]] = []


@contextlib.contextmanager
def expert_tensor_parallel_group(etp: Any, counts: ExpertParallelGroup | None = None) -> Iterator[None]:
    """Tensor-parallel MoE layers (:class:`remat.models.tp_moe.TPMoELayer`) built inside this block split each
    expert over ``etp`` (a ``TensorParallelGroup``: Megatron's expert tensor-parallel group,
    ``--expert-tensor-parallel-size``) and exchange their token counts over ``counts``, the tp x ep group of
    etp x ep ranks, ep-major as Megatron's (None: a simulated one, for a simulated ``etp``). Outside, etp is the
    layer's own tensor-parallel group (Megatron's default, etp = tp)."""
    _EXPERT_TP.append((etp, counts))
    try:
        yield
    finally:
        _EXPERT_TP.pop()


def expert_tensor_group() -> tuple[Any, ExpertParallelGroup | None] | None:
    """The enclosing :func:`expert_tensor_parallel_group`'s (etp, counts), None outside one."""
    return _EXPERT_TP[-1] if _EXPERT_TP else None


def received_per_rank(config: ModelConfig, tokens: int) -> list[int]:
    """Routed copies each expert-parallel rank receives in one micro-batch of ``tokens`` tokens, summed over the
    MoE layers, when every rank routes as the routing assumption says (balanced when none is set): rank r
    receives ep x its experts' counts.

    Example:
        >>> c = ModelConfig(num_layers=1, num_moe_experts=4, moe_router_topk=1, expert_model_parallel_size=2,
        ...                 moe_routing_assumption="counts:3,1,2,2")
        >>> received_per_rank(c, 8)
        [8, 8]
    """
    ep, experts, topk = config.expert_model_parallel_size, config.num_moe_experts or 1, config.moe_router_topk
    routing = RoutingAssumption.parse(config.moe_routing_assumption or "balanced")
    totals = [0] * ep
    for layer in range(sum(config.moe_layer_pattern())):
        for r, copies in enumerate(rank_received(routing.tokens_per_expert(tokens, experts, topk, layer), ep)):
            totals[r] += copies
    return totals


def rank_received(counts: Sequence[int], ep: int) -> list[int]:
    """Routed copies each of ``ep`` expert-parallel ranks receives in one MoE layer whose every rank routes
    ``counts[e]`` copies to expert e: rank r, holding experts r x L .. (r + 1) x L - 1, receives ep x theirs.

    Example:
        >>> rank_received([3, 1, 2, 2], 2)
        [8, 8]
    """
    local = len(counts) // ep
    return [ep * sum(counts[r * local:(r + 1) * local]) for r in range(ep)]
