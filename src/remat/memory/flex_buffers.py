"""What Megatron's flex token dispatcher keeps on a rank beside a step's activations: HybridEP's (and DeepEP's)
buffers outside PyTorch's allocator, and the manager's attributes each MoE layer keeps until its next forward.

NOTE [HybridEP's buffers]
``fused_a2a.py:285-347, 400-414`` (Megatron-LM d98e8a64) builds one process-wide ``HybridEPBuffer`` at the first
dispatch, with ``max_num_of_tokens_per_rank`` = that dispatch's token count T (a rank's MoE layers and MTP depths
all see the same T = micro-batch x sequence / (tp x cp)) and Megatron's defaults (``use_shared_buffer=True``,
``num_sms_preprocessing_api=108``, transformer_config.py:987). DeepEP's ``hybrid-ep`` branch at 94a9f8f6 sizes it
(``csrc/hybrid_ep/config.cuh:365-391`` Configurer: T' = max(T, 512) rounded up to the 64-token combine chunk; its
``update_template_config`` later only grows it) and allocates, in one NVLink domain of G ranks with L local experts
and h the hidden size, with ``cudaMalloc`` (H100/H200 have no fabric handles: ``allocator.cu:87-98``), outside
PyTorch's allocator:

* the expert token buffer, M = T' x G tokens of h bf16 values (``buffer/intranode.cu:126-129, 255-260``; dispatch
  and combine share it and the probability buffer, ``:204-208``);
* the probability buffer, M x (L x G) fp32 (``:256-261``);
* the FP8 scaling-factor buffer, M x (h / 128) fp32, allocated whatever the dtype (``:201, 213``);
* the routing-map all-gather buffer, (L x G) x T' x G bools (``extension/allgather.cu:142-147``);
* the preprocessing scratch, 108 x (G + L) 8-byte states (``intranode.cu:179-190``), the dispatch and combine chunk
  flags, 2 x (T' / 64) x G uint32 (``:229-231, 277-279``), and the synchronisation flags and the allocator's
  128-int test block (``:216-227, 264-275``, ``allgather.cu:150-164``, ``allocator.cu:62``; rank 0's, the
  largest).
"""

from __future__ import annotations

import math

from remat.config import RoutingAssumption
from remat.job import Job
from remat.memory.outside_allocator import OutsideBuffer
from remat.models.expert_parallel import rank_received
from remat.models.flex_dispatch import HYBRIDEP_CHUNK, hybridep_handle_shapes
from remat.units import round_up

_INTRANODE = "DeepEP hybrid-ep@94a9f8f6 csrc/hybrid_ep/buffer/intranode.cu"
PREPROCESSING_SMS = 108  # Megatron's moe_hybridep_num_sms_preprocessing (transformer_config.py:987)
COMBINE_CHUNK = HYBRIDEP_CHUNK  # config.cuh:383-384: the dispatch and combine chunks, 64 tokens as the preprocessing


def dispatcher_moe_layers(job: Job, stage: int, dispatcher: str) -> int:
    """The MoE layers (MTP depths included) on a rank of ``stage`` when the job runs the token ``dispatcher``
    (``alltoall``, ``allgather``, ``flex``), else 0."""
    m = job.model
    if not m.is_moe or m.moe_token_dispatcher_type != dispatcher:
        return 0
    pattern, start, layers = m.moe_layer_pattern(), 0, 0
    for chunk, count in enumerate(job.chunk_layers):
        layers += sum(pattern[start:start + count]) if chunk % job.pp == stage else 0
        start += count
    if stage == job.pp - 1 and pattern and pattern[-1]:  # MTP depths copy the last layer (gpt.py MTPLayer)
        layers += m.mtp_num_layers or 0
    return layers


def tokens_per_rank(job: Job) -> int:
    """T: the tokens one MoE layer of a rank routes in a micro-batch (sequence-parallel shard)."""
    m = job.model
    return m.micro_batch_size * m.seq_length // (job.tp * job.cp)


def hybridep_buffers(tokens: int, hidden: int, group: int, local: int) -> tuple[OutsideBuffer, ...]:
    """HybridEP's buffers (NOTE [HybridEP's buffers]) for ``tokens`` per rank, ``hidden`` the hidden size, ``group``
    ranks in one NVLink domain with ``local`` experts each.

    Example:
        >>> [b.nbytes for b in hybridep_buffers(4096, 1024, 4, 2)]
        [33554432, 524288, 524288, 131072, 7848]
    """
    padded = round_up(max(tokens, 512), COMBINE_CHUNK)
    most = padded * group
    experts = local * group
    chunks = padded // COMBINE_CHUNK * group  # padded is whole chunks
    flags = (PREPROCESSING_SMS * (group + local) * 8 + 2 * chunks * 4
             + 2 * (8 + 8 + 4 + 4) + (8 + 8 + 8 + group * 8) + 128 * 4)
    return (OutsideBuffer("HybridEP expert token buffer (dispatch and combine)", most * hidden * 2,
                          f"{_INTRANODE}:126-129, 204-208, 255-260"),
            OutsideBuffer("HybridEP expert probability buffer", most * experts * 4, f"{_INTRANODE}:256-261"),
            OutsideBuffer("HybridEP FP8 scaling-factor buffer", most * (hidden // 128) * 4, f"{_INTRANODE}:201, 213"),
            OutsideBuffer("HybridEP routing-map all-gather buffer", experts * padded * group,
                          "DeepEP hybrid-ep@94a9f8f6 csrc/hybrid_ep/extension/allgather.cu:142-147"),
            OutsideBuffer("HybridEP scratch and flags", flags, f"{_INTRANODE}:179-231, 264-279; allgather.cu:150-164"))


# DeepEP hybrid-ep@94a9f8f6 deep_ep/buffer.py:240-281: (nvl chunked send, nvl chunked recv) tokens per group size
DEEPEP_CONFIGS = {2: ((24, 256), (10, 256)), 4: ((6, 256), (9, 256)), 8: ((6, 256), (4, 256))}
DEEPEP_SMS = 20  # Megatron's Buffer.set_num_sms(20) when --moe-flex-dispatcher-num-sms is unset (token_dispatcher:1287)


def deepep_buffers(hidden_bytes: int, group: int, num_sms: int = DEEPEP_SMS) -> tuple[OutsideBuffer, ...]:
    """DeepEP's intranode ``Buffer`` as Megatron's ``get_buffer`` makes it (fused_a2a.py:36-69: the larger of the
    dispatch and combine configs' ``get_nvl_buffer_size_hint``, no RDMA bytes within 8 ranks) for ``hidden_bytes``
    per token (``get_hidden_bytes``: hidden x max(element size, 2)) over ``group`` <= 8 ranks: the NVLink buffer
    with its barrier signals and peer pointers (csrc/deep_ep.cpp:145-174) and the 32 MiB workspace (:187,
    kernels/configs.cuh:5), each ``cudaMalloc``ed; the counters are mapped host memory (:191-205).

    Example:
        >>> [b.nbytes for b in deepep_buffers(2 * 7168, 8)]
        [335709984, 33554432]
    """
    channels, peers = num_sms // 2, min(group, 8)  # csrc/config.hpp:58-60: one RDMA rank within a node
    hint = 0
    for _, recv in DEEPEP_CONFIGS[group]:  # config.hpp:51-73 get_nvl_buffer_size_hint
        per_token = hidden_bytes + 8 + 128 * 8 + 128 * 4 + 128 * 4  # data, SourceMeta, top-k ids/weights, scales
        size = channels * peers * (2 * 1 + 3) * 4 + channels * peers * recv * per_token
        hint = max(hint, round_up(size, 128))
    source = "DeepEP hybrid-ep@94a9f8f6 csrc/config.hpp:51-73, csrc/deep_ep.cpp:145-187"
    return (OutsideBuffer("DeepEP NVLink buffer", hint + 8 * 4 + 8 * 8 + 8 * 8, source),
            OutsideBuffer("DeepEP workspace", 32 << 20, source))


def flex_outside_buffers(job: Job, stage: int) -> tuple[OutsideBuffer, ...]:
    """The flex dispatcher's buffers outside PyTorch's allocator on a rank of ``stage`` (none without the flex
    dispatcher or without MoE layers there: the buffer is made at a rank's first dispatch)."""
    if not dispatcher_moe_layers(job, stage, "flex"):
        return ()
    m = job.model
    if m.moe_flex_dispatcher_backend == "deepep":
        return deepep_buffers(m.hidden_size * (4 if job.precision == "fp32" else 2), job.ep)
    return hybridep_buffers(tokens_per_rank(job), m.hidden_size, job.ep, int(m.num_moe_experts or 1) // job.ep)


def received_copies_at_most(job: Job) -> int:
    """n: the most routed copies an ep rank receives in one MoE layer under the job's routing assumption (T x topk
    when balanced), the largest over the ranks and the MoE layers the assumption lists."""
    m = job.model
    tokens, experts, topk = tokens_per_rank(job), int(m.num_moe_experts or 1), m.moe_router_topk
    routing = RoutingAssumption.parse(m.moe_routing_assumption or "balanced")
    return max(max(rank_received(routing.tokens_per_expert(tokens, experts, topk, layer=layer), job.ep))
               for layer in range(max(len(routing.counts), 1)))


def flex_kept_bytes(job: Job, stage: int) -> int:
    """What each MoE layer's dispatch manager keeps from one forward until its next on a rank of ``stage``, summed
    over the stage's MoE layers (0 without the flex dispatcher), n the most copies a rank receives
(:func:`received_copies_at_most`: T x topk under balanced routing):

    * ``_HybridEPManager`` (token_dispatcher.py:1093-1094, 1168-1176; its combine drops only the handle,
      :1203-1210): the routing map [T, E] bool, the fp32 probabilities [T, E], the dispatched fp32 probabilities [n];
      and the handle autograd keeps to the end of the micro-batch's backward (fused_a2a.py ``ctx.handle``), which
      the trace frees at each layer's backward: one micro-batch's, held for the step (an upper bound: NOTE [the
      flex dispatcher] in remat.models.flex_dispatch);
    * ``_DeepepManager`` (:1299, 1449-1457; its combine drops the handle and the dispatched indices and
      probabilities, :1386-1391): the top-k fp32 probabilities and int64 indices [T, k], the received tokens'
      multihot map bool [R, L] and the permutation's map (``reversed_mapping_for_combine``: int64 indices [n], or
      with --moe-permute-fusion TE's int32 row_id_map [R, 2L + 1]; R: remat.models.deepep_dispatch.deepep_rows).
    """
    layers = dispatcher_moe_layers(job, stage, "flex")
    if not layers:
        return 0
    m = job.model
    tokens, experts, topk = tokens_per_rank(job), int(m.num_moe_experts or 1), m.moe_router_topk
    copies = received_copies_at_most(job)
    if m.moe_flex_dispatcher_backend == "deepep":
        rows, local = min(job.ep * tokens, copies), experts // job.ep  # deepep_rows of the rank receiving the most
        mapping = rows * (2 * local + 1) * 4 if m.moe_permute_fusion else copies * 8
        return layers * (tokens * topk * (4 + 8) + rows * local + mapping)
    local = experts // job.ep
    handles = sum(math.prod(shape) * dtype.itemsize for shape, dtype in hybridep_handle_shapes(tokens, job.ep, local))
    return layers * (tokens * experts * (1 + 4) + copies * 4 + handles)
