"""Megatron-LM's allgather token dispatcher (``MoEAllGatherTokenDispatcher``, Megatron's default
``--moe-token-dispatcher-type``) in the reference MoE layer, over a simulated tp x ep group.

NOTE [the allgather dispatcher]
megatron/core/transformer/moe/token_dispatcher.py:233-378 (d98e8a64), with moe_utils.py ``permute`` (344-495,
unfused) and ``unpermute`` (497-626, unfused, ``probs=None``). G = etp x ep ranks (``tp_ep_group``), T tokens per
rank, N = G x T gathered tokens, L local experts (``lo`` the first), n copies routed to them.

* token_dispatch (only when tp or ep > 1): the [T, E] bool routing map all-gathered (no grad) to [N, E]; the
  [T, E] probabilities all-gathered to [N, E] (``gather_from_sequence_parallel_region``: reduce-scatter backward);
  the hidden states [T, h] all-gathered into Megatron's global memory buffer (``use_global_buffer=True``: one
  [N, h] tensor allocated on first use and kept for the run, priced by :func:`global_buffer_bytes` as a
  persistent allocation, so the trace allocates nothing for it).
* dispatch_postprocess: ``local_map`` = routing map[:, lo:lo+L].contiguous() [N, L] bool; ``local_probs`` the same
  slice of the probabilities; permute: ``local_map.T.contiguous()`` [L, N], its flat ``argsort`` (int64 [L*N]),
  ``sorted_indices = flat_sorted[:n] % N`` (int64 [n], kept for backward and for the unpermute), the copies
  ``index_select``-ed from the gathered rows [n, h]; the copies' probabilities
  ``local_probs.T.contiguous().masked_select(local_map.T.contiguous())`` [n], keeping both [L, N] copies
  (:class:`MaskedSelect`: the same output read by ``flat_sorted``, no data-dependent shape under fake tensors).
* The experts run on the n copies.
* combine_preprocess (unpermute): ``torch.zeros([N, h])`` and ``scatter_add_`` of the expert outputs, keeping
  only the indices (``index_add_``, keeping the outputs, under deterministic algorithms: NOTE [the combine's saved
  source] in remat.models.permute; backward: the gradient's rows gathered, [n, h]).
* token_combine: ``.to(local_probs.dtype)`` ([N, h] in fp32 when the router's dtype is fp32), reduce-scatter over
  the group to [T, h] (all-gather backward), ``.to`` back to the hidden dtype.

Not modelled (each under 0.2 MiB per layer in Megatron's H100 tests): the dispatcher's attributes that keep
``local_map``, ``sorted_indices`` and ``local_probs`` until the layer's next forward (priced with the global buffer
by :func:`global_buffer_bytes`), and the second ``torch.zeros`` of the unpermute under deterministic algorithms (a
transient of [N, h]); ``flat_sorted`` [L x N] int64 lives on to the masked_select here, where Megatron's permute
frees it first. Counted over (tests/megatron/test_megatron_combine.py measures Megatron's layer): the scatter of
the dense probabilities keeps its own [T, topk] int64 index (:func:`dense_routing`) where Megatron's reuses the
router's top-k indices.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from remat.config import ConfigError
from remat.models.expert_parallel import host_values
from remat.models.permute import unpermute_copies
from remat.models.tp_layers import GatherFromSequence, ReduceScatterToSequence, SimulatedGroup, TensorParallelGroup


class GatherPermute(torch.autograd.Function):
    """The hidden states' all-gather into Megatron's global buffer, then permute's ``index_select`` of the copies:
    forward allocates only the copies [n, h] (the buffer is priced once, :func:`global_buffer_bytes`); backward is
    ``index_select``'s (zeros [N, h] + ``index_add_``) and the gather's reduce-scatter to [T, h]."""

    @staticmethod
    def forward(ctx: Any, tokens: torch.Tensor, indices: torch.Tensor, group: TensorParallelGroup) -> torch.Tensor:
        ctx.save_for_backward(indices)
        ctx.group, ctx.rows = group, tokens.shape[0] * group.size
        # a simulated group's gathered rows are this rank's, repeated: row i is local row i % T
        local = indices if isinstance(tokens, FakeTensor) else indices.remainder(tokens.shape[0])
        return tokens.index_select(0, local)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (indices,) = ctx.saved_tensors
        gathered = grad.new_zeros(ctx.rows, grad.shape[1]).index_add_(0, indices, grad)
        return ctx.group.reduce_scatter(gathered), None, None


def tp_ep_group(group: Any, size: int, rank: int) -> TensorParallelGroup:
    """The tp x ep group the dispatcher gathers over: simulated (a real run's allgather dispatcher is not
    modelled: remat measures the all-to-all one)."""
    if group is not None and not isinstance(group, SimulatedGroup):
        raise ConfigError("the allgather token dispatcher is modelled on simulated groups only (prediction); "
                          "measure a real run with moe_token_dispatcher_type='alltoall'")
    return SimulatedGroup(size, rank)


class MaskedSelect(torch.autograd.Function):
    """``probs_t.masked_select(mask_t)`` ([L, N] each; the copies in row-major order) with its fixed-shape output
    read by ``order``, the flat positions of the mask's n true entries (a masked_select's output shape depends on
    the mask's values, which fake tensors lack). Like autograd's masked_select it keeps the probabilities and the
    mask, not the order; backward scatters the gradient into zeros [L, N] by the mask."""

    @staticmethod
    def forward(ctx: Any, probs_t: torch.Tensor, mask_t: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(probs_t, mask_t)
        return probs_t.reshape(-1).index_select(0, order)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        probs_t, mask_t = ctx.saved_tensors
        return torch.zeros_like(probs_t).masked_scatter_(mask_t, grad), None, None


def dense_routing(tokens: torch.Tensor, probs: torch.Tensor, topk: int,
                  experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's dense outputs (moe_utils.topk_routing_with_score_function): the routed copies' ``probs``
    ([T * topk]) scattered into probabilities [T, E] (autograd's ``scatter``: only the indices saved) and the bool
    routing map [T, E], both made from a [T, topk] long index."""
    rows = tokens.shape[0]
    slot = host_values([i % experts for i in range(rows * topk)], torch.long, tokens).view(rows, topk)
    dense = torch.zeros(rows, experts, dtype=probs.dtype, device=tokens.device).scatter(1, slot, probs.view(rows, topk))
    routing_map = torch.zeros(rows, experts, dtype=torch.bool, device=tokens.device).scatter_(1, slot, True)
    return dense, routing_map


def run_experts_allgather(experts: nn.Module, group: TensorParallelGroup, tokens: torch.Tensor,
                          probs: torch.Tensor, counts: list[int], topk: int, ep_rank: int,
                          local: int, *, keeps_source: bool = False) -> tuple[torch.Tensor, list[int]]:
    """Megatron's allgather dispatcher (NOTE [the allgather dispatcher]) for one rank's ``tokens`` [T, h], their
    routed copies' probabilities ``probs`` [T * topk] and ``counts[e]`` copies per expert (every rank of the
    ``group`` routing alike); ``keeps_source``: the unpermute under deterministic algorithms (NOTE [the combine's
    saved source] in :mod:`remat.models.permute`). Returns the combined output [T, h] and the copies each local
    expert received."""
    rows, hidden = tokens.shape
    experts_n, size = len(counts), group.size
    gathered_rows = size * rows
    lo = ep_rank * local
    received = [size * c for c in counts[lo:lo + local]]
    copies = sum(received)
    dense, routing_map = dense_routing(tokens, probs, topk, experts_n)
    with torch.no_grad():
        gathered_map = group.all_gather(routing_map)                           # [N, E] bool
    gathered_probs = GatherFromSequence.apply(dense, group, None)              # [N, E]
    del dense
    local_map = gathered_map[:, lo:lo + local].contiguous()
    local_probs = gathered_probs[:, lo:lo + local].contiguous()
    del gathered_map, gathered_probs  # dispatch_postprocess: self.routing_map = None, probs rebound
    map_t = local_map.T.contiguous()
    flat_sorted = map_t.reshape(-1).argsort(descending=True, stable=True)[:copies]
    del map_t
    sorted_indices = flat_sorted % gathered_rows
    permuted = GatherPermute.apply(tokens, sorted_indices, group)
    permuted_probs = MaskedSelect.apply(local_probs.T.contiguous(), local_map.T.contiguous(), flat_sorted)
    del flat_sorted, local_probs, local_map
    output = experts(permuted, received, permuted_probs)
    del permuted
    unpermuted = unpermute_copies(output, sorted_indices, gathered_rows, keeps_source=keeps_source)
    del output
    combined = ReduceScatterToSequence.apply(unpermuted.to(permuted_probs.dtype), group)
    return combined.to(tokens.dtype), received


def global_buffer_bytes(tokens: int, hidden: int, dtype_bytes: int, group_size: int, moe_layers: int,
                        local_experts: int, copies_per_layer: int, probs_bytes: int) -> int:
    """Bytes a rank keeps for the allgather dispatcher from its first MoE forward on: Megatron's global memory
    buffer of the gathered hidden states ([G x T, h], megatron/core/utils.py ``GlobalMemoryBuffer``, one for all
    layers), and each MoE layer's dispatcher attributes (``local_map`` [G x T, L] bool, ``reversed_local_input_
    permutation_mapping`` int64 [n], ``local_probs`` [n]), kept until that layer's next forward.

    Example:
        >>> global_buffer_bytes(4096, 512, 2, 8, 12, 1, 8192, 4) / 2**20
        33.5
    """
    if group_size == 1:
        return 0
    rows = group_size * tokens
    per_layer = rows * local_experts + copies_per_layer * (8 + probs_bytes)
    return rows * hidden * dtype_bytes + moe_layers * per_layer
