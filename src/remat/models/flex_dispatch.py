"""Megatron-LM's flex token dispatcher (``--moe-token-dispatcher-type flex``, ``MoEFlexTokenDispatcher``) with its
HybridEP backend (``--moe-flex-dispatcher-backend hybridep``) in the reference MoE layer, over a simulated group (the
DeepEP backend: :mod:`remat.models.deepep_dispatch`).

NOTE [the flex dispatcher]
Megatron-LM d98e8a64 ``megatron/core/transformer/moe/token_dispatcher.py`` (``_HybridEPManager`` 1001-1222,
``MoEFlexTokenDispatcher`` 1809-2052) and ``fused_a2a.py`` (``HybridEPDispatch`` / ``HybridEPCombine`` 358-515), on
DeepEP's ``hybrid-ep`` branch at 94a9f8f6 (``deep_ep/hybrid_ep_buffer.py``, ``csrc/hybrid_ep/hybrid_ep.cu``,
``executor/executor.cu``). G = the tp x ep group (expert tensor-parallel size x ep; remat models etp = 1, so G =
ep), T tokens per rank, E experts, L = E / ep local experts, n the routed copies this rank's experts receive
(balanced routing: T x topk).

* The router's dense outputs, probabilities and routing map [T, E] (``dense_routing``), are the manager's
  ``token_probs`` and ``routing_map`` (views at tp = 1: ``_initialize_metadata`` 1893-1920); probabilities not in
  fp32 are copied to fp32 (``dispatch`` 1136-1142: HybridEP takes fp32 only).
* ``HybridEPDispatch.forward`` (``dispatch_with_permute``): the routing map is all-gathered with NCCL into a
  [G x T, E] bool tensor (``executor.cu:39-44``; the custom all-gather is off by default), freed once the metadata
  is made; the handle's GPU tensors (``metadata_preprocess_core``, ``executor.cu:93-131``): ``sparse_to_dense_map``
  int32 [T, G], ``rdma_to_attn_map`` bool [ceil16(T), 1], ``attn_to_rdma_map`` [T, 0], ``local_expert_routing_map``
  bool [G x T, L], ``overflow_flag`` int32 [1], ``dense_chunk_layout`` int32 [ceil(T / 64) x G],
  ``dense_to_expert_map`` int32 [G x T, L], ``tokens_per_expert`` int32 [L] (``num_dispatched_tokens_tensor`` and
  ``padded_tokens_per_expert`` are pinned host memory: Megatron passes no ``num_permuted_tokens``, so the call
  blocks, ``fused_a2a.py:417``); then the outputs, the permuted tokens [n, h] and their fp32 probabilities [n]
  (``hybrid_ep.cu:313-317``). ``ctx.handle`` keeps the handle for the backward, which combines the gradients into
  [T, h] and fp32 [T, E] (``hybrid_ep.cu:361-366``).
* The experts run on the [n, h] tokens with the [n] probabilities as they come (``dispatch_postprocess`` is the
  identity: no sort, no permutation maps).
* ``HybridEPCombine.forward``: [T, h] (``combine_with_unpermute``), ``ctx.handle`` again; its backward dispatches
  the gradient: [n, h].

Megatron's ``ctx.handle`` lives until autograd frees the micro-batch's graph (the end of its backward); remat
drops it at each Function's backward, as its chunk traces need (a layer's tensors freed within its backward), and
prices the difference as an upper bound: one micro-batch's handles of every MoE layer of the rank held for the
whole step (:func:`remat.memory.flex_buffers.flex_kept_bytes`).

The manager keeps ``routing_map``, ``token_probs`` and ``dispatched_probs`` until the layer's next forward (priced
by :func:`remat.memory.flex_buffers.flex_kept_bytes`); the buffers HybridEP allocates outside PyTorch's allocator
are :func:`remat.memory.flex_buffers.flex_outside_buffers`'.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from remat.config import ConfigError, ModelConfig
from remat.models.allgather_dispatch import dense_routing
from remat.models.expert_parallel import ExpertParallelGroup, SimulatedExpertGroup

HYBRIDEP_CHUNK = 64  # config.cuh:420 NUM_OF_TOKENS_PER_CHUNK_PREPROCESSING_API's default


def hybridep_handle_shapes(rows: int, group: int, local: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The shapes and dtypes of HybridEP's handle tensors for ``rows`` tokens per rank over ``group`` ranks of one
    NVLink domain with ``local`` experts each, in ``metadata_preprocess_core``'s order (executor.cu:93-131)."""
    i32, b = torch.int32, torch.bool
    chunks = (rows - 1) // HYBRIDEP_CHUNK + 1
    return [((rows, group), i32),                        # sparse_to_dense_map
            (((rows - 1) // 16 * 16 + 16, 1), b),        # rdma_to_attn_map
            ((rows, 0), b),                              # attn_to_rdma_map
            ((rows * group, local), b),                  # local_expert_routing_map
            ((1,), i32),                                 # overflow_flag
            ((chunks * group,), i32),                    # dense_chunk_layout
            ((rows * group, local), i32),                # dense_to_expert_map
            ((local,), i32)]                             # tokens_per_expert


def hybridep_handle(rows: int, group: int, local: int, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """HybridEP's handle tensors (:func:`hybridep_handle_shapes`) on ``like``'s device."""
    return tuple(torch.empty(shape, dtype=dtype, device=like.device)
                 for shape, dtype in hybridep_handle_shapes(rows, group, local))


def fill_rows(out: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Real tensors only: ``out``'s rows from ``src``'s, repeated (a simulated group receives its own rows), with
    in-place copies (nothing allocated beyond ``out``)."""
    if not isinstance(out, FakeTensor):
        flat, source = out.view(out.shape[0], -1), src.reshape(src.shape[0], -1)
        for start in range(0, out.shape[0], max(source.shape[0], 1)):
            part = flat[start:start + source.shape[0]]
            part.copy_(source[:part.shape[0]])
    return out


class FlexHandle:
    """The manager's ``handle`` attribute: set by the dispatch, read by the combine, dropped after it."""

    tensors: tuple[torch.Tensor, ...] | None = None


class HybridEPDispatch(torch.autograd.Function):
    """``fused_a2a.HybridEPDispatch`` (NOTE [the flex dispatcher]): tokens [T, h] and fp32 probabilities [T, E] to
    the local experts' ``n`` copies [n, h] and their probabilities [n]."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor, holder: FlexHandle,
                group: int, local: int, copies: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows, experts = routing_map.shape
        gathered = routing_map.new_empty(rows * group, experts)  # NCCL all_gather_into_tensor (executor.cu:40-44)
        holder.tensors = hybridep_handle(rows, group, local, x)
        del gathered  # a local of HybridEPBuffer::metadata_preprocessing (hybrid_ep.cu:144)
        out = fill_rows(x.new_empty(copies, x.shape[1]), x)
        out_probs = fill_rows(probs.new_empty(copies), probs.reshape(-1))
        ctx.handle, ctx.rows, ctx.experts = holder.tensors, rows, experts
        return out, out_probs

    @staticmethod
    def backward(ctx: Any, grad_x: torch.Tensor, grad_probs: torch.Tensor | None) -> tuple[Any, ...]:
        ctx.handle = None  # NOTE [the flex dispatcher]: freed here, not when autograd frees the graph
        combined = fill_rows(grad_x.new_empty(ctx.rows, grad_x.shape[1]), grad_x)  # combine_with_unpermute
        combined_probs = None
        if grad_probs is not None:
            combined_probs = fill_rows(grad_probs.new_empty(ctx.rows, ctx.experts), grad_probs)
        return combined, combined_probs, None, None, None, None, None


class HybridEPCombine(torch.autograd.Function):
    """``fused_a2a.HybridEPCombine``: the experts' outputs [n, h] back to the tokens [T, h]."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, holder: FlexHandle, rows: int) -> torch.Tensor:
        ctx.handle, ctx.copies = holder.tensors, x.shape[0]
        return fill_rows(x.new_empty(rows, x.shape[1]), x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.handle = None
        return fill_rows(grad.new_empty(ctx.copies, grad.shape[1]), grad), None, None  # dispatch_with_permute


def received_copies(counts: list[int], group: int, rank: int) -> list[int]:
    """The routed copies each of ``rank``'s local experts receives from the ``group`` ranks, every rank routing alike
    (``counts[e]`` copies per expert each)."""
    local = len(counts) // group
    return [group * c for c in counts[rank * local:(rank + 1) * local]]


def run_experts_hybridep(experts: nn.Module, tokens: torch.Tensor, probs: torch.Tensor, counts: list[int],
                         topk: int, group: int, rank: int) -> tuple[torch.Tensor, list[int]]:
    """Megatron's flex dispatcher with HybridEP (NOTE [the flex dispatcher]) for one rank's ``tokens`` [T, h], their
    routed copies' probabilities ``probs`` [T * topk] and ``counts[e]`` copies per expert, every rank of the
    ``group`` (G = ep ranks, this one ``rank``) routing alike. Returns the combined output [T, h] and the copies each
    local expert received."""
    received = received_copies(counts, group, rank)
    dense, routing_map = dense_routing(tokens, probs, topk, len(counts))
    token_probs = dense if dense.dtype == torch.float32 else dense.float()  # token_dispatcher.py:1136-1142
    del dense
    holder = FlexHandle()
    dispatched, dispatched_probs = HybridEPDispatch.apply(tokens.contiguous(), token_probs, routing_map, holder,
                                                          group, len(received), sum(received))
    del token_probs, routing_map
    output = experts(dispatched, received, dispatched_probs)
    del dispatched, dispatched_probs
    combined = HybridEPCombine.apply(output, holder, tokens.shape[0])
    holder.tensors = None  # _HybridEPManager.combine: self.handle = None (token_dispatcher.py:1205)
    return combined, received


def flex_group(config: ModelConfig, ep_group: ExpertParallelGroup | None, etp: int = 1) -> tuple[str, int, int]:
    """(backend, G, rank): the flex dispatcher's backend and group for a layer of ``config`` over ``ep_group`` (None:
    ep = 1) with expert tensor-parallel size ``etp``; refuses what remat does not model, naming the fix."""
    if config.moe_flex_dispatcher_backend == "deepep" and ep_group is None:
        raise ConfigError("the flex token dispatcher with DeepEP needs expert parallelism: Megatron asserts 'DeepEP "
                          "dispatcher requires TPxEP > 1' (token_dispatcher.py:1831); use --expert-model-parallel-size "
                          "> 1, or --moe-flex-dispatcher-backend hybridep")
    if etp != 1:
        raise ConfigError(f"the flex token dispatcher with expert tensor-parallel size {etp}: remat models it with "
                          "--expert-tensor-parallel-size 1 (the group is then the ep ranks)")
    backend = config.moe_flex_dispatcher_backend
    if ep_group is None:
        return backend, 1, 0
    if not isinstance(ep_group, SimulatedExpertGroup):
        raise ConfigError("the flex token dispatcher is modelled on simulated groups only (prediction); measure a "
                          "real run with moe_token_dispatcher_type='alltoall'")
    return backend, ep_group.size, ep_group.rank
