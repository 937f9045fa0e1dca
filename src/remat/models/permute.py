"""The routed copies permuted into expert order and back, as Megatron's all-to-all dispatcher runs
``moe_utils.permute`` / ``unpermute``: what each keeps for the backward.

NOTE [the permutation maps]
Megatron-LM d98e8a64 ``transformer/moe/token_dispatcher.py`` ``MoEAlltoAllTokenDispatcher.dispatch_preprocess``
(624-680) permutes a rank's T tokens [T, h] by its routing map [T, E] (E: every expert) into the n routed copies
[n, h] and their probabilities [n], and ``combine_postprocess`` (876-900) unpermutes the experts' outputs back to
[T, h] with the map it kept (``reversed_local_input_permutation_mapping``). ``moe_utils.permute`` (344-490):

* unfused, dropless (or dropping by capacity): ``routing_map.bool().T.contiguous()`` (bool [E, T]), its
  ``reshape(-1).argsort(descending=True, stable=True)`` (``flat_sorted``, int64 [E x T]), ``sorted_indices =
  flat_sorted[:n] % T`` (int64 [n]), the probabilities ``probs.T.contiguous().reshape(-1)[flat_sorted[:n]]`` (an
  [E x T] copy, then [n]) and the tokens ``tokens.index_select(0, sorted_indices)``. The probabilities' indexing
  saves its indices for the backward: a view of ``flat_sorted``, so its whole [E x T] int64 storage lives until the
  layer's backward; ``index_select`` saves ``sorted_indices``, which ``unpermute`` (``scatter_add_``) saves again.
* fused (``--moe-permute-fusion``, TransformerEngine at the same date, ``pytorch/permutation.py``
  ``moe_permute_with_probs`` / ``moe_unpermute``): ``triton/permutation.py:24-84 make_row_id_map`` allocates the
  ``row_id_map`` int32 [T, 2E + 1] and a workspace int32 [E, ceil(T / 1024)] (freed on return); the permute writes
  [n, h] and [n] and saves the map (``_moe_permute_mask_map_setup_context``, 514-519), which ``moe_unpermute``
  ([T, h]) saves again; no int64 index is made. Its backward writes [T, h] (and the probabilities' gradient).
* ``--moe-pad-expert-input-to-capacity`` (unfused): per expert the first ``capacity`` of an int8 map's argsort
  (int64 [E x capacity], the n copies) index both the tokens and the probabilities (``index_select``): the
  [n] indices are what they keep, as :func:`permute_copies` without ``argsort`` keeps.

remat's router gives the copies in expert order as indices into its [T x topk] probabilities (``order``; NOTE
[routing under fake tensors] in :mod:`remat.models.moe`); the maps above are allocated at Megatron's sizes and hold
those indices where the backward reads them (the fused map as int32, its first n entries the order and the next n
the tokens), so a real run computes what Megatron computes and allocates, tensor for tensor, what a fake trace does.
With ``--moe-permute-fusion`` the received chunks are also sorted by local expert and back with TE's
``moe_sort_chunks_by_index(_with_probs)`` (``pytorch/permutation.py:1110-1160``; ``triton/permutation.py:381``
``make_chunk_sort_map``: int32 [rows], saved for the backward; ``:419-421`` the sorted tokens and probabilities):
:func:`sort_chunks_fused`, where the unfused sort (``torch.split`` and ``torch.cat``, NOTE [sorting chunks] in
:mod:`remat.models.expert_parallel`) keeps nothing.
The flex dispatcher's DeepEP backend permutes the R tokens it received by their [R, L] multihot map (L local
experts) with the same ``permute`` (token_dispatcher.py:1436-1452; :mod:`remat.models.deepep_dispatch`). Not
modelled here: the sort's own scratch memory on the GPU. The all-to-all dispatcher also keeps the last micro-batch's
map (with its dense probabilities and routing map) until the layer's next forward: counted for the whole step beside
the trace (NOTE [the all-to-all dispatcher's attributes] in :mod:`remat.memory.workspaces`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

ROW_ID_BLOCK = 1024  # triton/permutation.py make_row_id_map's block_size: the workspace's columns


def permute_copies(tokens: torch.Tensor, probs: torch.Tensor, order: torch.Tensor, topk: int, num_experts: int, *,
                   argsort: bool, fused: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The routed copies of ``tokens`` [T, h] and their probabilities, in expert order (NOTE [the permutation
    maps]), and the map :func:`unpermute_copies` takes.

    The map is the copies' token rows, int64 [n]; fused, the int32 token column of TE's row_id_map (a view, so the
    whole map stays alive as long as it does).

    Args:
        tokens: this rank's tokens [T, h].
        probs: the router's probability of each routed copy [T x topk].
        order: the copies in expert order, indices into ``probs`` (int64 [n]).
        topk: the copies of a token in ``probs``' layout (copy i belongs to token i // topk).
        num_experts: E, the routing map's columns.
        argsort: Megatron's dropless unfused permute (an argsort of the [E x T] map, kept whole); False: the
            [n] indices alone (drop-and-pad).
        fused: TransformerEngine's fused permute (``--moe-permute-fusion``): an int32 [T, 2E + 1] map instead.
    """
    if fused:
        permuted, permuted_probs, row_id_map = FusedPermute.apply(tokens, probs, order, topk, num_experts)
        return permuted, permuted_probs, _row_id_slices(row_id_map, order.numel())[1]
    if not argsort:
        token_of = order.div(topk, rounding_mode="floor")
        return tokens.index_select(0, token_of), probs.index_select(0, order), token_of
    count, n = tokens.shape[0], order.numel()
    transposed = torch.empty(num_experts, count, dtype=torch.bool, device=tokens.device)  # routing_map.T
    flat_sorted = torch.empty(num_experts * count, dtype=torch.long, device=tokens.device)  # its argsort
    first = flat_sorted[:n]
    first.copy_(order)
    token_of = first.div(topk, rounding_mode="floor")  # Megatron's sorted_indices = flat_sorted[:n] % T
    probs_t = probs.new_empty(num_experts * count)  # probs.T.contiguous(), indexed then dropped
    # Megatron indexes (probs_t[flat_sorted]); index_select keeps the same indices, flat_sorted's whole storage, to
    # the backward, and makes the same [n] and (backward) [T x topk] tensors
    permuted_probs = probs.index_select(0, first)
    del probs_t
    permuted = tokens.index_select(0, token_of)
    del transposed
    return permuted, permuted_probs, token_of


def unpermute_copies(expert_output: torch.Tensor, mapping: torch.Tensor, rows: int, *,
                     keeps_source: bool = False) -> torch.Tensor:
    """The experts' outputs [n, h] added back into their tokens' ``rows`` [T, h], by the map :func:`permute_copies`
    gave. ``keeps_source``: as ``index_add_``, which keeps the outputs for its backward (Megatron's unfused unpermute
    under deterministic algorithms); else as ``scatter_add_`` and TE's fused unpermute, which keep only the map
    (NOTE [the combine's saved source])."""
    if keeps_source:
        return expert_output.new_zeros(rows, expert_output.shape[1]).index_add_(0, mapping, expert_output)
    return MapCombine.apply(expert_output, mapping, rows)


class MapCombine(torch.autograd.Function):
    """``scatter_add_`` of the experts' outputs [n, h] into zeros [T, h] (NOTE [the combine's saved source]): its
    backward gathers the gradient's rows by the map, so only the map is kept."""

    @staticmethod
    def forward(ctx: Any, expert_output: torch.Tensor, mapping: torch.Tensor, rows: int) -> torch.Tensor:
        ctx.save_for_backward(mapping)
        return expert_output.new_zeros(rows, expert_output.shape[1]).index_add_(0, mapping, expert_output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (mapping,) = ctx.saved_tensors
        return grad.index_select(0, mapping), None, None


# NOTE [the combine's saved source]
# Megatron's unfused unpermute (moe_utils.py unpermute, 11debfa7b4 :384-402; d98e8a64 :598-611) adds the experts'
# outputs [n, h] back into zeros [T, h] with scatter_add_, whose backward (derivatives.yaml: src: grad.gather(dim,
# index)) keeps only the index, a view of the map the dispatcher keeps anyway; under deterministic algorithms
# (--deterministic-mode: torch.use_deterministic_algorithms(True), training/arguments.py:1112-1120) it uses
# index_add_ instead, whose backward formula reads its source, so autograd keeps the outputs [n, h] to the layer's
# backward. TransformerEngine's fused unpermute without merging probabilities (--moe-permute-fusion; Megatron
# passes none since the probabilities are applied in the experts) keeps only its row_id_map (permutation.py
# _moe_unpermute_mask_map, v2.10 :375-378). Megatron-core's own layer measured on CPU keeps the outputs only under
# deterministic algorithms (tests/megatron/test_megatron_combine.py), where its router's index_put_ also keeps an
# int64 [T, 1] row index (8 bytes a token, not modelled). On the dev cases with the fused unpermute, keeping the
# outputs put the prediction 1-3% over the peak of the steady iterations (fine_grained_offloading +2.8%,
# memory_speed +1.3% of its iterations 3-29); keeping the map alone, -1.4% to +2.1% (NOTE [routing drift] in
# bench_megatron_golden.py).


def _row_id_slices(row_id_map: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the order, the tokens) of the n copies, as the fused map holds them (int32 views)."""
    flat = row_id_map.view(-1)
    return flat[:n], flat[n:2 * n]


class FusedPermute(torch.autograd.Function):
    """TE's ``moe_permute_with_probs`` (NOTE [the permutation maps]): [T, h] tokens and [T x topk] probabilities to
    the n copies [n, h] and [n], with the int32 [T, 2E + 1] ``row_id_map`` it saves."""

    @staticmethod
    def forward(ctx: Any, tokens: torch.Tensor, probs: torch.Tensor, order: torch.Tensor, topk: int,
                num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        count, n = tokens.shape[0], order.numel()
        row_id_map = torch.empty(count, 2 * num_experts + 1, dtype=torch.int32, device=tokens.device)
        workspace = torch.empty(num_experts, -(-count // ROW_ID_BLOCK), dtype=torch.int32, device=tokens.device)
        del workspace  # make_row_id_map's local
        copies, token_of = _row_id_slices(row_id_map, n)
        copies.copy_(order)
        token_of.copy_(order)
        token_of.div_(topk, rounding_mode="floor")  # in place: TE makes no index beside the map
        permuted = tokens.index_select(0, token_of)
        permuted_probs = probs.index_select(0, copies)
        ctx.save_for_backward(row_id_map)
        ctx.n, ctx.token_shape, ctx.probs_numel = n, tokens.shape, probs.numel()
        ctx.mark_non_differentiable(row_id_map)
        return permuted, permuted_probs, row_id_map

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, grad_probs: torch.Tensor | None, _: Any) -> tuple[Any, ...]:
        (row_id_map,) = ctx.saved_tensors
        copies, token_of = _row_id_slices(row_id_map, ctx.n)
        grad_tokens = grad.new_zeros(ctx.token_shape).index_add_(0, token_of, grad)
        grad_p = None if grad_probs is None else grad_probs.new_zeros(ctx.probs_numel).index_add_(0, copies,
                                                                                                  grad_probs)
        return grad_tokens, grad_p, None, None, None


def sort_chunks_fused(x: torch.Tensor, probs: torch.Tensor | None, sizes: list[int],
                      order: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """TE's fused ``moe_sort_chunks_by_index`` (``probs`` None) or ``..._with_probs``: ``x``'s rows (and ``probs``'),
    split into chunks of ``sizes`` rows, in ``order``, with the int32 [rows] map kept for the backward (NOTE [the
    permutation maps])."""
    return FusedSortChunks.apply(x, probs, list(sizes), list(order))


def _move_chunks(out: torch.Tensor, src: torch.Tensor, sizes: list[int], order: list[int], back: bool) -> None:
    """Real tensors only: ``src``'s chunks (of ``sizes`` rows) written into ``out`` in ``order`` (``back``: from
    that order back to the first), in place."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    at = 0
    for i in order:
        source, target = (slice(starts[i], starts[i] + sizes[i]), slice(at, at + sizes[i]))
        out[source if back else target].copy_(src[target if back else source])
        at += sizes[i]


class FusedSortChunks(torch.autograd.Function):
    """:func:`sort_chunks_fused`: the map, then the sorted rows and probabilities (``sort_chunks_by_map``'s order);
    the backward writes the gradients' rows back (and the probabilities')."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, probs: torch.Tensor | None, sizes: list[int],
                order: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        ctx.set_materialize_grads(False)
        row_id_map = torch.empty(x.shape[0], dtype=torch.int32, device=x.device)  # make_chunk_sort_map
        out = x.new_empty(x.shape)
        sorted_probs = None if probs is None else probs.new_empty(probs.shape)
        if not isinstance(x, FakeTensor):
            _move_chunks(out, x, sizes, order, back=False)
            if probs is not None:
                _move_chunks(sorted_probs, probs, sizes, order, back=False)
        ctx.save_for_backward(row_id_map)
        ctx.sizes, ctx.order = sizes, order
        return out, sorted_probs

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None, grad_probs: torch.Tensor | None) -> tuple[Any, ...]:
        grads = []
        for g in (grad, grad_probs):
            out = None if g is None else g.new_empty(g.shape)
            if g is not None and not isinstance(g, FakeTensor):
                _move_chunks(out, g, ctx.sizes, ctx.order, back=True)
            grads.append(out)
        return grads[0], grads[1], None, None
