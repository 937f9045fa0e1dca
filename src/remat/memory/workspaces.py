"""The GEMM workspaces a Megatron rank's CUDA libraries allocate once and keep: cuBLAS's (PyTorch) and
TransformerEngine's, both taken from PyTorch's caching allocator, so ``torch.cuda.memory_allocated`` counts them;
and what else a rank keeps beside the model state from its first step on: Megatron's global memory buffer, the MoE
token dispatchers' attributes (NOTE [the all-to-all dispatcher's attributes]) and MLA's rotary tables (NOTE [MLA's
rotary tables]).

NOTE [GEMM workspaces]
* PyTorch (aten/src/ATen/cuda/CublasHandlePool.cpp, torch 2.13): every cuBLAS call sets a workspace for its
  (cuBLAS handle, CUDA stream) pair, allocated on first use from the caching allocator and never freed
  (``setWorkspaceForHandle``). Handles are per thread (``DeviceThreadHandlePool``), so the forward (the Python
  thread) and the backward (autograd's device thread) of the same GEMMs on the same stream hold one workspace each.
  Its size is the sum of ``CUBLAS_WORKSPACE_CONFIG``'s ``:SIZE_KIB:COUNT`` pairs, by default 32 MiB on Hopper and
  Blackwell (``4096 * 8 * 1024``: ``parseChosenWorkspaceSize``'s ``use32mb``, compute capability major 9, 10, 11 or
  12) and ``4096 KiB * 2 + 16 KiB * 8`` elsewhere. cuBLASLt calls
  (GEMMs with a fused bias) take a second, 1 MiB workspace per pair unless ``TORCH_CUBLASLT_UNIFIED_WORKSPACE=1``;
  no torch GEMM of a Megatron GPT has a bias (the output layer, unfused attention's bmm), so none is counted.
* Which torch GEMMs a rank runs: with TransformerEngine's layers every linear (and the MoE router:
  megatron/core/transformer/moe/moe_utils.py ``RouterGatingLinearFunction`` calls ``te_general_gemm``) is TE's; the
  output layer is megatron-core's own ``ColumnParallelLinear`` (``torch.matmul`` in
  ``LinearWithGradAccumulationAndAsyncCommunication``) on the last pipeline stage; TE's unfused attention multiplies
  with ``torch.baddbmm``/``torch.bmm``. So a stage holds two torch workspaces (forward thread, backward thread) when it
  is the last or runs unfused attention, else none.
* TransformerEngine (transformer_engine/pytorch/cpp_extensions/gemm.py, TE >= 2.9): ``get_cublas_workspace`` is an
  ``lru_cache`` per (device, userbuffers, grouped GEMM): one ``torch.empty`` of ``get_cublas_workspace_size_bytes()``
  (32 MiB + 1 KiB on sm90 and later, 4 MiB before) for ordinary GEMMs, and for grouped GEMMs (MoE experts with
  ``--moe-grouped-gemm``) one per compute stream: ``nvte_get_num_compute_streams()`` = 4
  (transformer_engine/common/util/multi_stream.cpp).
* Megatron's local layers (``--transformer-impl local``): every linear is megatron-core's (``torch.matmul``,
  tensor_parallel/layers.py:459, then ``+ bias``: no cuBLASLt bias epilogue) and the local attention multiplies with
  ``torch.baddbmm``/``torch.bmm`` (dot_product_attention.py:194, 239), so every stage holds the two torch
  workspaces, and none of TE's (no TE GEMM runs: ``te_general_gemm`` only for a mixed-dtype output, layers.py:465).
Checked against Megatron-LM's H100 functional tests (benchmarks/bench_megatron_golden.py): with these three 32 MiB
workspaces, remat's resident state of gpt3_mcore_te_tp1_pp1_frozen_resume_torch_dist_dist_optimizer equals
``mem-allocated-bytes`` to 2,560 bytes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

from remat.config import RoutingAssumption
from remat.job import Job, JobError
from remat.memory.flex_buffers import dispatcher_moe_layers, flex_kept_bytes, tokens_per_rank
from remat.memory.local_layers import local_scores_bytes
from remat.models.allgather_dispatch import global_buffer_bytes
from remat.units import CUDA_BLOCK, round_up

MODULE_TORCH = "cuda.cublas_workspace"
MODULE_TE = "transformer_engine.cublas_workspace"
MODULE_ALLGATHER = "megatron.global_memory_buffer"
MODULE_FLEX = "megatron.flex_dispatcher"  # the flex dispatch managers' kept attributes (remat.memory.flex_buffers)
MODULE_ALLTOALL = "megatron.alltoall_dispatcher"  # NOTE [the all-to-all dispatcher's attributes]
MODULE_MLA_ROPE = "megatron.mla_rotary_tables"  # NOTE [MLA's rotary tables]
YARN_ORIGINAL_POSITIONS = 4096  # MLATransformerConfig.original_max_position_embeddings (no flag sets it for MLA)
LRU_ENTRIES = 32  # the rotary embeddings' forward: functools.lru_cache(maxsize=32), one cache for every instance
# Compute capability (major) of the GPU presets remat knows (remat.units.GPU_PRESETS): what sizes the workspaces.
GPU_MAJOR = {"a100": 8, "h100": 9, "h200": 9, "gb200": 10, "b200": 10}
TE_GROUPED_GEMM_STREAMS = 4
TE_UB_STREAMS = 3  # TE cpp_extensions/gemm.py:31 _NUM_MAX_UB_STREAMS: one workspace of 3 for the userbuffer GEMMs
_KIB = 1024


def cublas_workspace_bytes(config: str | None, sm_major: int = 9) -> int:
    """PyTorch's cuBLAS workspace size per (handle, stream): ``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE_KIB:COUNT``
    pairs, summed) or the default for the GPU (NOTE [GEMM workspaces]).

    Example:
        >>> cublas_workspace_bytes(":4096:8"), cublas_workspace_bytes(None, 8)
        (33554432, 8519680)
    """
    if config is None:
        # CublasHandlePool.cpp parseChosenWorkspaceSize: use32mb on majors 9-12 (Hopper, Blackwell)
        return 4096 * 8 * _KIB if 9 <= sm_major <= 12 else 4096 * _KIB * 2 + 16 * _KIB * 8
    pairs = re.findall(r":([0-9]+):([0-9]+)", config)
    if not pairs:  # torch warns and falls back to the default
        return cublas_workspace_bytes(None, sm_major)
    return sum(int(size) * _KIB * int(count) for size, count in pairs)


def te_workspace_bytes(sm_major: int = 9) -> int:
    """TransformerEngine's cuBLAS workspace (``get_cublas_workspace_size_bytes``, TE >= 2.9).

    Example:
        >>> te_workspace_bytes(9), te_workspace_bytes(8)
        (33555456, 4194304)
    """
    return 32 * 1024 * _KIB + 1024 if sm_major >= 9 else 4 * 1024 * _KIB


def gpu_major(gpu: str | None) -> int:
    """The compute capability's major number of a GPU name (``h100-80g``, ``a100``...); None: Hopper, whose
    workspaces are the largest of the GPUs Megatron jobs run on today (never an under-count there)."""
    if gpu is None:
        return 9
    for prefix, major in GPU_MAJOR.items():
        if gpu.lower().startswith(prefix):
            return major
    raise JobError(f"gpu={gpu!r}: remat knows the GEMM workspaces of {', '.join(GPU_MAJOR)} GPUs; give one of them")


def stage_workspaces(job: Job, stage: int, *, env: Mapping[str, str] | None = None, gpu: str | None = None,
                     kernels: str = "te") -> list[tuple[str, int]]:
    """The GEMM workspaces a rank of pipeline stage ``stage`` keeps from its first step on, as ``(module, bytes)``.

    Args:
        job: the Megatron job (TransformerEngine layers, as remat models them).
        stage: the pipeline stage.
        env: the training processes' environment (``CUBLAS_WORKSPACE_CONFIG`` is read); None: none set.
        gpu: the GPU (sizes depend on its architecture); None: Hopper.
        kernels: the kernel profile the rank is predicted with: ``te`` (TransformerEngine's layers), or ``cuda`` /
            ``local`` (every linear a torch GEMM: two torch workspaces on every stage, no TE workspace).

    Example:
        >>> from remat.config import ModelConfig
        >>> job = Job.build(ModelConfig(num_layers=2, attention="sdpa"), precision="bf16")
        >>> [n for _, n in stage_workspaces(job, 0)]
        [33554432, 33554432, 33555456]
    """
    major, env = gpu_major(gpu), env or {}
    local = job.model.transformer_impl == "local" or kernels != "te"  # no TE layer: torch's GEMMs only
    torch_gemm = stage == job.pp - 1 or job.model.attention == "math" or local
    out = [(MODULE_TORCH, cublas_workspace_bytes(env.get("CUBLAS_WORKSPACE_CONFIG"), major))] * (2 * torch_gemm)
    if not local:
        out.append((MODULE_TE, te_workspace_bytes(major)))
    if job.model.is_moe and job.model.moe_grouped_gemm and not local:
        out += [(MODULE_TE, te_workspace_bytes(major))] * TE_GROUPED_GEMM_STREAMS
    if job.tp_comm_overlap is not None and not local:  # the userbuffer GEMMs' own: TE cpp_extensions/gemm.py:43-53
        out.append((MODULE_TE, te_workspace_bytes(major) * TE_UB_STREAMS))
    gathered, attributes = _allgather_parts(job, stage)
    requests = global_buffer_requests(job, stage) + [(("mpu", _dtype_bytes(job)), gathered)] * (gathered > 0)
    kept = global_memory_buffer_bytes(requests) + attributes
    flex, alltoall, rope = flex_kept_bytes(job, stage), alltoall_kept_bytes(job, stage), mla_rope_bytes(job, stage)
    return (out + [(MODULE_ALLGATHER, kept)] * (kept > 0) + [(MODULE_FLEX, flex)] * (flex > 0)
            + [(MODULE_ALLTOALL, alltoall)] * (alltoall > 0) + [(MODULE_MLA_ROPE, rope)] * (rope > 0))


def _stage_layers(job: Job, stage: int) -> int:
    """The decoder layers on a rank of ``stage``: those of its chunks (every pp-th)."""
    return sum(count for chunk, count in enumerate(job.chunk_layers) if chunk % job.pp == stage)


def _dtype_bytes(job: Job) -> int:
    return 4 if job.precision == "fp32" else 2


def global_memory_buffer_bytes(requests: list[tuple[tuple[str, int], int]]) -> int:
    """What Megatron's process-wide ``GlobalMemoryBuffer`` (megatron/core/utils.py:727) holds after ``requests``
    (``((name, dtype), bytes)``): one tensor per (name, dtype), re-allocated whenever a request is larger and never
    freed, so the largest request of each key (the earlier, smaller tensor is freed when replaced: utils.py:746).

    Example:
        >>> global_memory_buffer_bytes([(("mpu", 2), 100), (("mpu", 2), 300), (("mpu", 4), 50)])
        350
    """
    largest: dict[tuple[str, int], int] = {}
    for key, nbytes in requests:
        largest[key] = max(largest.get(key, 0), nbytes)
    return sum(largest.values())


def global_buffer_requests(job: Job, stage: int) -> list[tuple[tuple[str, int], int]]:
    """The dense layers' requests of Megatron's global buffer on a rank of ``stage``, ``((name, dtype bytes),
    bytes)``: the local attention's scores ``[b*np, s, s]`` (dot_product_attention.py:189) when the stage has local
    layers, and under sequence parallelism each megatron-core column-parallel linear's gathered input ``[s, b, h]``
    (tensor_parallel/layers.py:627, forward and backward): the local layers' QKV and fc1, and the output layer on the
    last stage whatever the layers (gpt_model.py builds it as ``tensor_parallel.ColumnParallelLinear``). The MoE
    allgather dispatcher's request is :func:`allgather_kept_bytes`'."""
    m, dtype = job.model, _dtype_bytes(job)
    local = m.transformer_impl == "local"
    layers = _stage_layers(job, stage)
    out: list[tuple[tuple[str, int], int]] = []
    seq = m.seq_length // job.cp
    if local and layers:
        out.append((("mpu", dtype), local_scores_bytes(m.micro_batch_size, m.num_attention_heads // job.tp, seq,
                                                       dtype)))
    if job.sp and ((local and layers) or stage == job.pp - 1):
        out.append((("mpu", dtype), seq * m.micro_batch_size * m.hidden_size * dtype))
    deferred = job.embedding_wgrad_deferral
    if job.sp and deferred is not None and stage == job.pp - 1:
        # the drain's gathered inputs, double-buffered (utils.py:1303, 1336); mpu_1 once two or more are deferred
        n = job.num_microbatches if deferred == 0 else min(deferred, job.num_microbatches)
        out += [((name, dtype), seq * m.micro_batch_size * m.hidden_size * dtype) for name in ("mpu_0", "mpu_1")[:n]]
    return out


def allgather_kept_bytes(job: Job, stage: int) -> int:
    """What the allgather token dispatcher keeps on a rank of ``stage`` from its first MoE forward on (Megatron's
    global buffer of the gathered hidden states and each MoE layer's dispatcher attributes, NOTE [the allgather
    dispatcher]), under balanced routing; 0 without it or without MoE layers on the stage."""
    return sum(_allgather_parts(job, stage))


def _allgather_parts(job: Job, stage: int) -> tuple[int, int]:
    """:func:`allgather_kept_bytes` in two: the global buffer's gathered hidden states and the layers' attributes."""
    m = job.model
    group = job.expert_tp * job.ep
    moe_layers = dispatcher_moe_layers(job, stage, "allgather")
    if group == 1 or not moe_layers:
        return 0, 0
    tokens = m.micro_batch_size * m.seq_length // (job.tp * job.cp)
    local = int(m.num_moe_experts or 1) // job.ep
    copies = group * tokens * m.moe_router_topk // job.ep  # balanced: the local experts' share of G x T x topk
    dtype_bytes = _dtype_bytes(job)
    probs_bytes = {"fp32": 4, "fp64": 8}.get(m.moe_router_dtype or "", dtype_bytes)
    gathered = group * tokens * m.hidden_size * dtype_bytes  # global_buffer_bytes' first term
    kept = global_buffer_bytes(tokens, m.hidden_size, dtype_bytes, group, moe_layers, local, copies, probs_bytes)
    return gathered, kept - gathered


# NOTE [the all-to-all dispatcher's attributes]
# Megatron-LM d98e8a64 transformer/moe/token_dispatcher.py, MoEAlltoAllTokenDispatcher (one per MoE layer and MTP
# depth): ``dispatch_preprocess`` (641-680) stores the router's dense outputs, ``self.probs`` [T, E] (the logits'
# dtype: --moe-router-dtype, else the model's; moe_utils.py:936-956) and ``self.routing_map`` [T, E] bool, which no
# autograd node of remat's trace holds (the permute keeps its own indices: NOTE [the permutation maps] in
# remat.models.permute), and the permutation's map (``reversed_local_input_permutation_mapping``: int64 [n], or with
# --moe-permute-fusion TE's int32 row_id_map [T, 2E + 1]); nothing clears them: each layer holds its latest
# micro-batch's from its first forward to the end of training, the next forward replacing them. With the fusion the
# chunk-sort indices are made on the GPU at start-up (``permute_idx_device``, 431-441: int64 [E x etp], one tensor
# when a rank has one local expert, both views of it, else two) and the counts per local expert stay there
# (``num_global_tokens_per_local_expert``, 606-615: int64 [etp x ep, L], moved to the host only without the fusion,
# 948-953). All are priced for the whole step, like the other dispatchers' attributes: the map is the same tensor
# the trace keeps from the layer's forward to its backward, so while a layer's latest micro-batch is in flight it is
# counted twice (an upper bound by one map a layer: 2 MiB at T = 8,192, E = 32 fused). Not counted: at each router,
# the new dense outputs beside the old ones until the attribute is replaced (one layer's). Where TE's CUDA graphs take
# the router (``moe_router``, remat.parallel.cuda_graphs), a graphed step's attributes are the graph's outputs, in its
# private pool: counted as in the eager steps before the capture (an upper bound by them).
# tests/megatron/test_megatron_alltoall.py runs megatron-core's own dispatcher and reads what it holds.
def alltoall_kept_bytes(job: Job, stage: int) -> int:
    """What the all-to-all token dispatchers of a rank of ``stage`` keep from their first forward on (NOTE [the
    all-to-all dispatcher's attributes]), each tensor in whole CUDA blocks; 0 without that dispatcher or without MoE
    layers on the stage.

    Example:
        >>> from remat.config import ModelConfig
        >>> cfg = ModelConfig(num_layers=2, seq_length=1024, micro_batch_size=2, num_moe_experts=8, moe_router_topk=2,
        ...                   moe_token_dispatcher_type="alltoall", moe_router_dtype="fp32")
        >>> alltoall_kept_bytes(Job.build(cfg, precision="bf16"), 0)  # 2 x (fp32 + bool [2048, 8] + int64 [4096])
        229376
    """
    layers = dispatcher_moe_layers(job, stage, "alltoall")
    if not layers:
        return 0
    m = job.model
    tokens, experts, etp = tokens_per_rank(job), int(m.num_moe_experts or 1), job.expert_tp
    probs_bytes = {"fp32": 4, "fp64": 8}.get(m.moe_router_dtype or "", _dtype_bytes(job))
    per_layer = round_up(tokens * experts * probs_bytes, CUDA_BLOCK) + round_up(tokens * experts, CUDA_BLOCK)
    mapping = tokens * (2 * experts + 1) * 4 if m.moe_permute_fusion else _permuted_copies(job) * 8
    per_layer += round_up(mapping, CUDA_BLOCK)
    if m.moe_permute_fusion:
        local = experts // job.ep
        indices = round_up(experts * etp * 8, CUDA_BLOCK)
        per_layer += indices * (1 if local == 1 else 2)
        if local > 1 or m.moe_pad_expert_input_to_capacity:  # preprocess keeps its counts on the GPU
            per_layer += round_up(experts * etp * 8, CUDA_BLOCK)
    return layers * per_layer


def _permuted_copies(job: Job) -> int:
    """n: the routed copies a rank permutes in one MoE layer, as its trace routes them (NOTE [routing under fake
    tensors] in remat.models.moe): every expert's capacity ceil(T x topk / E x F) when padded to it
    (token_dispatcher.py:517-539), else the routing assumption's counts (T x topk when balanced), the most over the
    MoE layers it lists."""
    m = job.model
    tokens, experts, topk = tokens_per_rank(job), int(m.num_moe_experts or 1), m.moe_router_topk
    if m.moe_pad_expert_input_to_capacity:
        return min(math.ceil(tokens * topk / experts * float(m.moe_expert_capacity_factor or 0)), tokens) * experts
    routing = RoutingAssumption.parse(m.moe_routing_assumption or "balanced")
    return max(sum(routing.tokens_per_expert(tokens, experts, topk, layer=layer))
               for layer in range(max(len(routing.counts), 1)))


# NOTE [MLA's rotary tables]
# Megatron-LM d98e8a64: every MLA attention builds its own rotary embedding (transformer/multi_latent_attention.py:
# 176-200), yarn unless --rope-type rope (MLATransformerConfig.rope_type, argument_utils.py:335-337), on the GPU.
# ``YarnRotaryEmbedding.__init__`` (models/common/embeddings/yarn_rotary_pos_embedding.py:49-104) keeps three fp32
# [d / 2] frequency vectors and registers ``cos_cached`` / ``sin_cached``, fp32 [4096, 1, 1, d] (d =
# qk_pos_emb_head_dim, 4096 = original_max_position_embeddings; ``_set_cos_sin_cache``, :189-206). Its ``forward`` is an
# ``lru_cache(maxsize=32)`` (:159), one cache for every instance, keyed by the instance: the first forward of each
# layer caches its fp32 [s / cp, 1, 1, d] table (``get_emb``, sliced to this context-parallel rank), so a rank
# holds min(its MLA layers, 32) of them from then on (the unfused path calls it at every forward, the fused one once:
# multi_latent_attention.py:700-720). The fused path's ``get_cached_cos_sin`` in the activations' dtype replaces the
# two buffers at the first forward (:208-237) by [s / cp, 1, 1, d] ones in that dtype (unless that dtype is fp32
# and s <= 4096: the init's stay). ``--rope-type rope`` builds a ``RotaryEmbedding`` instead (rotary_pos_embedding.py
# :177-206): one fp32 [d / 2] vector and the cached table. The MTP depths' layers are MLA layers too. Priced for the
# whole step (the tables appear at the first forward): ``tests/megatron/test_megatron_mla_rope.py`` reads them off
# megatron-core's own MLA attention. remat's trace still makes its own per-forward [s, d / 2] cos and sin tables
# for the layers' rotations (remat.models.gpt.rotary_tables), where Megatron reads the cached one.
def mla_rope_bytes(job: Job, stage: int) -> int:
    """What the MLA layers' rotary embeddings of a rank of ``stage`` keep (NOTE [MLA's rotary tables]), each tensor
    in whole CUDA blocks; 0 without MLA.

    Example:
        >>> from remat.config import ModelConfig
        >>> cfg = ModelConfig(num_layers=2, seq_length=4096, multi_latent_attention=True, qk_pos_emb_head_dim=64,
        ...                   apply_rope_fusion=False)
        >>> mla_rope_bytes(Job.build(cfg, precision="bf16"), 0) / 2**20  # 2 x (cos, sin, cached table + 3 x 512 B)
        6.0029296875
    """
    m = job.model
    if not m.multi_latent_attention:
        return 0
    layers = _stage_layers(job, stage) + ((m.mtp_num_layers or 0) if stage == job.pp - 1 else 0)
    d, rows, dtype_bytes = m.qk_pos_emb_head_dim, m.seq_length // job.cp, _dtype_bytes(job)
    cached = min(layers, LRU_ENTRIES) * round_up(rows * d * 4, CUDA_BLOCK)  # the lru_cache's fp32 tables
    if m.mla_rope_type == "rope":
        return layers * round_up(d // 2 * 4, CUDA_BLOCK) + cached
    per_layer = 3 * round_up(d // 2 * 4, CUDA_BLOCK)  # inv_freq_extra, inv_freq_inter, inv_freq
    if m.apply_rope_fusion and (dtype_bytes != 4 or m.seq_length > YARN_ORIGINAL_POSITIONS):
        per_layer += 2 * round_up(rows * d * dtype_bytes, CUDA_BLOCK)  # re-made in the activations' dtype
    else:
        per_layer += 2 * round_up(YARN_ORIGINAL_POSITIONS * d * 4, CUDA_BLOCK)
        if m.apply_rope_fusion:  # fp32 within 4096 positions: the init's kept, forward never called
            cached = 0
    return layers * per_layer + cached
