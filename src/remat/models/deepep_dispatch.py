"""Megatron-LM's flex token dispatcher with its DeepEP backend (``--moe-flex-dispatcher-backend deepep``, Megatron's
default) in the reference MoE layer, over a simulated group.

NOTE [the DeepEP dispatcher]
Megatron-LM d98e8a64 ``transformer/moe/token_dispatcher.py`` ``_DeepepManager`` (1225-1468) and ``fused_a2a.py``
``FusedDispatch`` / ``FusedCombine`` (72-210), with the ``Buffer`` of DeepEP's ``hybrid-ep`` branch at 94a9f8f6 (the
branch whose package holds both ``Buffer`` and ``HybridEPBuffer``, as Megatron imports them: ``deep_ep/buffer.py``,
``csrc/deep_ep.cpp``). G = the ep ranks (etp = 1), T tokens per rank, k = topk, L local experts, n the routed copies
this rank's experts receive, R the tokens it receives (each token once per destination rank).

* ``setup_metadata`` (1294-1304): ``torch.topk`` of the router's dense probabilities [T, E]: ``token_probs`` [T, k]
  (copied to fp32 when the router's dtype is not, 1314-1320) and ``token_indices`` int64 [T, k].
* ``FusedDispatch.forward``: ``get_dispatch_layout`` (deep_ep.cpp:391-394: tokens per rank int32 [G], per expert
  int32 [E], ``is_token_in_rank`` bool [T, G]), then ``intranode_dispatch`` (:569-633: ``rank_prefix_matrix`` int32
  [G, G], ``channel_prefix_matrix`` int32 [G, C], the received tokens [R, h], ``recv_src_idx`` int32 [R],
  ``recv_channel_prefix_matrix`` int32 [G, C], ``send_head`` int32 [T, G], the received top-k indices int64 [R, k]
  and fp32 weights [R, k]; C = Megatron's 20 SMs / 2 channels). ``ctx.handle`` keeps (rank_prefix_matrix,
  channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank, send_head) for the backward
  (``intranode_combine``, :743-767: fp32 [T, k] weights' gradient, then [T, h]).
* ``get_permuted_hidden_states_by_experts`` (1424-1457): the received indices to a multihot routing map bool
  [R, L] and fp32 probabilities [R, L]: under ``--enable-experimental`` and ``--moe-permute-fusion`` Megatron's
  fused ``IndicesToMultihot`` (``fusions/fused_indices_converter.py:205-232``, saving an int32 [R, L] position
  map), else ``_indices_to_multihot`` (1323-1352: int64 and fp32 [R, L] zeros, the mask ``indices != -1`` bool
  [R, k], the n valid indices, ``arange(R).repeat_interleave(mask.sum(1))``, two ``index_put_``; the
  probabilities' ``probs[mask]`` keeps the mask and their ``index_put_`` the two int64 [n] indices for the
  backward; the int64 map gives way to its bool copy); then ``permute`` of the R received tokens by that [R, L]
  map to the n copies [n, h] and their fp32 probabilities [n], as the all-to-all dispatcher permutes (NOTE [the
  permutation maps] in :mod:`remat.models.permute`: the argsort of the [L, R] map kept whole, or with
  ``--moe-permute-fusion`` TE's int32 [R, 2L + 1] row_id_map).
* The experts; ``unpermute`` ([R, h]); ``FusedCombine.forward`` (``intranode_combine``: [T, h]; ``ctx.handle``),
  whose backward dispatches the gradient in cached mode (:620-624: [R, h], and a source index, channel prefix
  matrix and send head it drops).

R depends on which tokens share a destination rank, which remat's routing assumption (tokens per expert) does not
set: remat prices the most a rank can receive with those counts, every routed copy a token of its own from each
source rank (R = G x min(T, the copies a source sends this rank's experts); balanced: min(G x T, T x k)), an upper
bound.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from remat.models.allgather_dispatch import dense_routing
from remat.models.expert_parallel import rank_received
from remat.models.flex_dispatch import FlexHandle, fill_rows, received_copies, run_experts_hybridep
from remat.models.permute import permute_copies, unpermute_copies

DEEPEP_CHANNELS = 10  # Megatron's set_deepep_num_sms(20) (token_dispatcher.py:1287-1292), config.hpp:60 num_sms / 2


class DeepEPDispatch(torch.autograd.Function):
    """``fused_a2a.FusedDispatch`` (NOTE [the DeepEP dispatcher]): tokens [T, h] with their top-k indices and fp32
    weights to the R tokens this rank receives [R, h], their indices [R, k] and weights [R, k]."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, holder: FlexHandle,
                group: int, experts: int, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens, topk = indices.shape
        i32, dev = torch.int32, x.device
        per_rank = torch.empty(group, dtype=i32, device=dev)  # get_dispatch_layout (deep_ep.cpp:391-394)
        per_expert = torch.empty(experts, dtype=i32, device=dev)
        in_rank = torch.empty(tokens, group, dtype=torch.bool, device=dev)
        rank_prefix = torch.empty(group, group, dtype=i32, device=dev)  # intranode_dispatch (:569-633)
        channel_prefix = torch.empty(group, DEEPEP_CHANNELS, dtype=i32, device=dev)
        recv_x = fill_rows(x.new_empty(rows, x.shape[1]), x)
        recv_src = torch.empty(rows, dtype=i32, device=dev)
        recv_channel_prefix = torch.empty(group, DEEPEP_CHANNELS, dtype=i32, device=dev)
        send_head = torch.empty(tokens, group, dtype=i32, device=dev)
        recv_indices = fill_rows(indices.new_empty(rows, topk), indices)
        recv_weights = fill_rows(weights.new_empty(rows, topk), weights)
        del per_rank, per_expert  # FusedDispatch.forward's locals
        holder.tensors = (rank_prefix, channel_prefix, recv_channel_prefix, recv_src, in_rank, send_head)
        ctx.handle, ctx.tokens = holder.tensors, tokens
        ctx.mark_non_differentiable(recv_indices)
        return recv_x, recv_indices, recv_weights

    @staticmethod
    def backward(ctx: Any, grad_x: torch.Tensor, _: Any, grad_weights: torch.Tensor | None) -> tuple[Any, ...]:
        ctx.handle = None  # NOTE [the flex dispatcher]: freed here, not when autograd frees the graph
        combined_weights = None  # intranode_combine (deep_ep.cpp:743-767): the weights' gradient, then the tokens'
        if grad_weights is not None:  # fp32 already (fused_a2a.py:155 .float() copies nothing)
            combined_weights = fill_rows(grad_weights.new_empty(ctx.tokens, grad_weights.shape[1]), grad_weights)
        combined = fill_rows(grad_x.new_empty(ctx.tokens, grad_x.shape[1]), grad_x)
        return combined, None, combined_weights, None, None, None, None


class DeepEPCombine(torch.autograd.Function):
    """``fused_a2a.FusedCombine``: the received tokens [R, h] back to this rank's [T, h]."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, holder: FlexHandle, tokens: int) -> torch.Tensor:
        ctx.handle, ctx.rows = holder.tensors, x.shape[0]
        return fill_rows(x.new_empty(tokens, x.shape[1]), x)  # intranode_combine (deep_ep.cpp:767)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        group = ctx.handle[0].shape[0]
        ctx.handle = None
        out = fill_rows(grad.new_empty(ctx.rows, grad.shape[1]), grad)  # cached intranode_dispatch (:620-624)
        dropped = (torch.empty(ctx.rows, dtype=torch.int32, device=grad.device),
                   torch.empty(group, DEEPEP_CHANNELS, dtype=torch.int32, device=grad.device),
                   torch.empty(grad.shape[0], group, dtype=torch.int32, device=grad.device))
        del dropped  # buffer.dispatch's other outputs, which FusedCombine.backward drops
        return out, None, None


class IndicesToMultihot(torch.autograd.Function):
    """Megatron's fused ``IndicesToMultihot`` (fusions/fused_indices_converter.py:186-279): indices [R, k] and fp32
    weights [R, k] to a bool map and fp32 probabilities [R, L], saving an int32 [R, L] position map."""

    @staticmethod
    def forward(ctx: Any, indices: torch.Tensor, weights: torch.Tensor, local: int) -> tuple[torch.Tensor, ...]:
        rows = indices.shape[0]
        routing_map = torch.empty(rows, local, dtype=torch.bool, device=indices.device)
        probs = fill_rows(weights.new_empty(rows, local), weights)
        position = torch.empty(rows, local, dtype=torch.int32, device=indices.device)
        ctx.save_for_backward(position)
        ctx.topk = indices.shape[1]
        ctx.mark_non_differentiable(routing_map)
        return routing_map, probs

    @staticmethod
    def backward(ctx: Any, _: Any, grad_probs: torch.Tensor) -> tuple[None, torch.Tensor, None]:
        (position,) = ctx.saved_tensors  # the weights' gradient [R, k] (:258)
        return None, fill_rows(grad_probs.new_empty(position.shape[0], ctx.topk), grad_probs), None


def deepep_rows(counts: list[int], tokens: int, group: int, rank: int) -> int:
    """R: the most tokens this rank receives when every rank routes ``tokens`` tokens with ``counts`` copies per
    expert (NOTE [the DeepEP dispatcher]): from each source, at most one token per copy and at most all its tokens.

    Example:
        >>> deepep_rows([4, 4, 4, 4], 8, 2, 1)  # 8 copies for this rank's 2 experts from each of 2 ranks
        16
        >>> deepep_rows([8] * 256, 16, 8, 0)  # top-8 of 256 experts over 8 ranks: every token once per rank
        128
    """
    return min(group * tokens, rank_received(counts, group)[rank])


class SelectedWeights(torch.autograd.Function):
    """``probs[mask]`` of ``_indices_to_multihot`` (token_dispatcher.py:1351): the n received weights whose index is
    not -1, the bool mask [R, k] kept for the backward (of known size here: n, so that fake tensors can run it)."""

    @staticmethod
    def forward(ctx: Any, weights: torch.Tensor, mask: torch.Tensor, copies: int) -> torch.Tensor:
        ctx.save_for_backward(mask)
        ctx.shape = weights.shape
        return fill_rows(weights.new_empty(copies), weights.reshape(-1))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (mask,) = ctx.saved_tensors
        return fill_rows(grad.new_zeros(ctx.shape).view(-1), grad).view(ctx.shape), None, None


def indices_to_multihot(indices: torch.Tensor, weights: torch.Tensor,
                        received: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's unfused ``_DeepepManager._indices_to_multihot`` (token_dispatcher.py:1323-1352, NOTE [the DeepEP
    dispatcher]) of the received indices [R, k] and fp32 weights [R, k]: the bool map and fp32 probabilities
    [R, L]; the int64 row and local expert of each of the n copies (``received[l]`` copies for expert l, copy i
    from row i mod R) are kept by the probabilities' ``index_put_`` for the backward."""
    rows, local, copies, dev = indices.shape[0], len(received), sum(received), indices.device
    routing = torch.zeros(rows, local, dtype=torch.long, device=dev)
    multihot = torch.zeros(rows, local, dtype=torch.float32, device=dev)
    mask = torch.empty(indices.shape, dtype=torch.bool, device=dev)  # indices != -1
    expert_of = torch.empty(copies, dtype=torch.long, device=dev)  # indices[mask]
    arange = torch.empty(rows, dtype=torch.long, device=dev)  # torch.arange(R), then its argument mask.sum(dim=1)
    per_row = torch.empty(rows, dtype=torch.long, device=dev)
    row_of = torch.empty(copies, dtype=torch.long, device=dev)  # arange.repeat_interleave(per_row)
    del arange, per_row
    if not isinstance(indices, FakeTensor):  # real values in place: copy i of expert l from row i mod R
        mask.fill_(True)
        torch.arange(copies, out=row_of).remainder_(max(rows, 1))
        start = 0
        for expert, count in enumerate(received):
            expert_of[start:start + count].fill_(expert)
            start += count
    routing[row_of, expert_of] = 1
    multihot[row_of, expert_of] = SelectedWeights.apply(weights, mask, copies)
    del mask
    routing_map = routing.bool()
    del routing
    return routing_map, multihot


def run_experts_deepep(experts: nn.Module, tokens: torch.Tensor, probs: torch.Tensor, counts: list[int],
                       topk: int, group: int, rank: int, *, permute_fusion: bool = False,
                       experimental: bool = False, keeps_source: bool = False) -> tuple[torch.Tensor, list[int]]:
    """Megatron's flex dispatcher with DeepEP (NOTE [the DeepEP dispatcher]) for one rank's ``tokens`` [T, h], their
    routed copies' probabilities ``probs`` [T * topk] and ``counts[e]`` copies per expert, every rank of the
    ``group`` (G = ep ranks, this one ``rank``) routing alike; ``permute_fusion``: ``--moe-permute-fusion``,
    ``experimental``: ``--enable-experimental`` (the fused multihot conversion, with the fusion),
    ``keeps_source``: the unfused unpermute under deterministic algorithms (NOTE [the combine's saved source] in
    :mod:`remat.models.permute`). Returns the combined output [T, h] and the copies each local expert received."""
    received = received_copies(counts, group, rank)
    copies, rows, local = sum(received), deepep_rows(counts, tokens.shape[0], group, rank), len(received)
    dense, routing_map = dense_routing(tokens, probs, topk, len(counts))
    del routing_map  # the router's map: DeepEP routes by indices
    token_probs, token_indices = torch.topk(dense, topk, dim=-1)  # token_dispatcher.py:1299
    del dense
    if token_probs.dtype != torch.float32:
        token_probs = token_probs.float()
    holder = FlexHandle()
    recv_x, recv_indices, recv_probs = DeepEPDispatch.apply(tokens.contiguous(), token_indices, token_probs, holder,
                                                            group, len(counts), rows)
    if experimental and permute_fusion:
        routing, multihot_probs = IndicesToMultihot.apply(recv_indices, recv_probs, local)
    else:
        routing, multihot_probs = indices_to_multihot(recv_indices, recv_probs, received)
    del recv_indices, recv_probs
    # the copies in local-expert order, as indices into the flattened [R, L] probabilities (row x L + expert): what
    # remat's permutation reads (remat.models.permute), made here in place of the argsort Megatron runs there
    order = torch.empty(copies, dtype=torch.long, device=tokens.device)
    if not isinstance(tokens, FakeTensor):  # copy i of expert l from row i mod R (as indices_to_multihot), in place
        start = 0
        for expert, count in enumerate(received):
            torch.arange(start, start + count, out=order[start:start + count])
            order[start:start + count].remainder_(max(rows, 1)).mul_(local).add_(expert)
            start += count
    permuted, permuted_probs, mapping = permute_copies(recv_x, multihot_probs.reshape(-1), order, local, local,
                                                       argsort=True, fused=permute_fusion)
    del routing, multihot_probs, order  # the manager's map, kept to the next forward: flex_kept_bytes
    output = experts(permuted, received, permuted_probs)
    del permuted, permuted_probs
    unpermuted = unpermute_copies(output, mapping, recv_x.shape[0], keeps_source=keeps_source)
    del recv_x, output, mapping
    combined = DeepEPCombine.apply(unpermuted, holder, tokens.shape[0])
    holder.tensors = None  # _DeepepManager.combine: self.handle = None (token_dispatcher.py:1387)
    return combined, received


def run_experts_flex(experts: nn.Module, tokens: torch.Tensor, probs: torch.Tensor, counts: list[int], topk: int,
                     backend: str, group: int, rank: int, *, permute_fusion: bool = False,
                     experimental: bool = False, keeps_source: bool = False) -> tuple[torch.Tensor, list[int]]:
    """The flex dispatcher with ``backend`` (``hybridep`` or ``deepep``; ``remat.models.flex_dispatch.flex_group``
    gives the backend, group and rank): :func:`run_experts_hybridep` or :func:`run_experts_deepep` (which reads
    ``permute_fusion``, ``experimental`` and ``keeps_source``; HybridEP's own fused permute changes none of its
    tensors)."""
    if backend == "deepep":
        return run_experts_deepep(experts, tokens, probs, counts, topk, group, rank, permute_fusion=permute_fusion,
                                  experimental=experimental, keeps_source=keeps_source)
    return run_experts_hybridep(experts, tokens, probs, counts, topk, group, rank)
