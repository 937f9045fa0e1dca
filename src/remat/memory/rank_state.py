"""What a Megatron-LM rank holds for the whole training step besides activations, to the byte.

A rank's model state is: its parameters (in the training precision), Megatron DDP's contiguous gradient buffer
("main grads", allocated at start-up and alive all step), and the optimizer's fp32 master parameters and state
(Adam's two moments, SGD's momentum), sharded over the data-parallel (x context-parallel) ranks with the
distributed optimizer. The parameters are counted from the rank's real module (its pipeline chunks, every layer
built as itself, sharded by tensor parallelism and its MoE experts by expert parallelism) built on the meta
device (:func:`rank_parameters`); the buffers follow Megatron's layout rules (:func:`buffer_layout`,
NOTE [expert parameters]), so the padding is exact too.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from torch import nn

from remat.config import DTYPES, ModelConfig
from remat.job import Job
from remat.memory import disk_cache, muon
from remat.memory.fp8 import is_fp8_weight
from remat.models.gpt import Embedding, LMHead, MTPLayer, TransformerLayer, building
from remat.models.tensor_parallel import SimulatedGroup
from remat.models.tp_moe import simulated_expert_groups
from remat.models.tp_stage import build_tp_stage_module
from remat.units import round_up

# NOTE [Megatron's gradient buffer layout]
# megatron/core/distributed/param_and_grad_buffer.py::_ParamAndGradBuffer.__init__ (NVIDIA/Megatron-LM, 2026):
# * parameters are laid out in *reverse* module order (roughly backward order), one buffer per (param dtype,
#   grad dtype) and per model chunk (each chunk has its own DDP wrapper);
# * without the distributed optimizer nothing is padded: numel = sum of the parameters' numels, and the
#   parameters stay separate tensors (param_data is None);
# * with it, every parameter starts at a multiple of 64 elements (_pad_start_of_param_if_needed) and every bucket
#   ends at a multiple of lcm(dp_size, 128) (lcm(dp_size, 128, 2**16) with pad_buckets_for_high_nccl_busbw;
#   _pad_end_of_bucket_if_needed), where dp_size is the intra data-parallel group *with* context parallelism;
#   the parameters are re-mapped into a param_data buffer of the same padded numel;
# * a parameter marked ``shared_embedding`` (the tied word embedding / output layer with pp > 1) gets a bucket of
#   its own with the distributed optimizer (_does_param_require_new_bucket);
# * buckets of bucket_size elements exist only with --overlap-grad-reduce, on pipeline rank 0 and the first model
#   chunk (distributed_data_parallel.py: bucket_size None otherwise; training.py: disable_bucketing for
#   model_chunk_idx > 0); the default size is max(40M, 1M x dp) (data-parallel size without CP).
# The distributed optimizer (megatron/core/optimizer/distrib_optimizer.py::_build_model_gbuf_range) gives rank r
# the r-th of dp_size equal slices of every bucket; its fp32 master copies (shard_main_param = a clone of the
# parameter's slice) and Adam's exp_avg/exp_avg_sq cover the parameter elements in that slice, never padding.

# NOTE [expert parameters]
# megatron/core/distributed/distributed_data_parallel.py (megatron-core 0.16): a parameter with
# ``allreduce=False`` goes into separate "expert_parallel_buffers" (one per (param dtype, grad dtype), after the
# dense buffers, same bucket size), laid out over ``intra_expt_dp_group`` instead of ``intra_dp_cp_group``; the
# distributed optimizer (optimizer/__init__.py: a second optimizer over the expert buffers with
# ``data_parallel_group=intra_expt_dp_group``) shards the expert parameters over that group. Only the routed
# experts' weights are marked (transformer/moe/experts.py and tensor_parallel/layers.py: ``allreduce = not
# (is_expert and expert_parallel)``, expert_parallel meaning expert_model_parallel_size > 1): with ep = 1 they sit
# in the dense buffer; the router and the shared expert are dense always. The expert data-parallel group has
# tp x cp x dp / (ep x expert tp) ranks (parallel_state's expert rank generator, order tp-ep-dp-pp over etp, ep,
# edp), so rank g of a stage (tp = etp = 1) is expert-parallel rank g % ep and expert data-parallel rank g // ep,
# and dense data-parallel (x cp) rank g.


@dataclass(frozen=True)
class ParamInfo:
    """One parameter of a rank's model chunk: its name, element count, and whether it is the tied embedding
    shared between the first and last pipeline stage (Megatron's ``shared_embedding``)."""

    name: str
    numel: int
    shared_embedding: bool = False
    expert: bool = False  # a routed expert's weight under expert parallelism (NOTE [expert parameters])
    shape: tuple[int, ...] = ()  # as built (TE's dummy weight gradients are keyed by it: memory.wgrad_fusion)
    fp8: bool = False  # a TE linear's weight in an FP8 layer (remat.memory.fp8: its FP8 copies, FP8 parameters)


@dataclass(frozen=True)
class BufferLayout:
    """One model chunk's gradient (and, with the distributed optimizer, parameter) buffer."""

    numel: int  # padded
    numel_unpadded: int
    buckets: tuple[tuple[int, int], ...]  # [start, end) of each bucket, padded
    params: tuple[tuple[int, int], ...]  # [start, end) of each parameter, in buffer order
    expert: bool = False  # the expert-parallel buffer, sharded over the expert data-parallel ranks
    muon_numel: int = 0  # elements of Muon's matrices in it (remat.memory.muon; the rest: its scalar Adam's)
    fp8: bool = False  # FP8 parameters' buffer (--fp8-param-gather): uint8 param data (remat.memory.fp8)


@dataclass(frozen=True)
class RankState:
    """A rank's model state for the whole step, in bytes (see the module docstring)."""

    num_parameters: int
    parameters: int
    parameter_padding: int  # the param_data buffer's padding (distributed optimizer only)
    gradients: int  # the main-gradient buffer, padding included
    master_parameters: int
    optimizer_state: int
    dp_rank: int  # the data-parallel (x cp) shard priced (the one holding the most optimizer elements)
    shard_elements: int  # parameter elements in that shard (all of them without the distributed optimizer)
    layouts: tuple[BufferLayout, ...] = field(default=())
    ep_rank: int = 0  # the priced rank's expert-parallel rank, and its expert data-parallel shard
    expert_dp_rank: int = 0
    param_buffer: bool = False  # the parameters live in DDP's param_data buffers (the distributed optimizer)
    param_itemsize: int = 0  # bytes per element of the parameters as built (0: parameters / num_parameters)

    @property
    def total(self) -> int:
        """All of it: parameters (+ padding), gradients, master parameters and optimizer state."""
        return (self.parameters + self.parameter_padding + self.gradients + self.master_parameters
                + self.optimizer_state)

    def parts(self) -> dict[str, int]:
        """``{"parameters", "gradients", "master_parameters", "optimizer_state"}`` (padding with parameters)."""
        return {"parameters": self.parameters + self.parameter_padding, "gradients": self.gradients,
                "master_parameters": self.master_parameters, "optimizer_state": self.optimizer_state}

    def parameter_tensor_bytes(self, block: int = 1) -> int:
        """The parameters' bytes as separate tensors, each rounded up to the allocator's ``block`` bytes (what a
        chunk trace records for them: the CUDA caching allocator rounds every tensor to 512 bytes)."""
        size = self._itemsize()
        return sum(round_up((end - start) * size, block) for lay in self.layouts for start, end in lay.params)

    def _itemsize(self) -> int:
        if self.param_itemsize:
            return self.param_itemsize
        return self.parameters // self.num_parameters if self.num_parameters else 0

    def allocated_parameter_bytes(self, block: int = 1) -> int:
        """The parameters' bytes as the rank allocates them, in ``block``-byte allocator blocks: one tensor per
        parameter, or with the distributed optimizer one param_data buffer per layout (padding included, the
        parameters views of it: NOTE [Megatron's gradient buffer layout]); ``parameters + parameter_padding`` when
        ``block`` is 1."""
        if not self.param_buffer:
            return self.parameter_tensor_bytes(block)
        size = self._itemsize()
        return sum(round_up(lay.numel * (1 if lay.fp8 else size), block) for lay in self.layouts)


def buffer_layout(params: Sequence[ParamInfo], *, distributed_optimizer: bool, dp_size: int,
                  bucket_size: int | None = None, pad_for_nccl_busbw: bool = False) -> BufferLayout:
    """Megatron DDP's layout of one model chunk's buffer (see ``NOTE [Megatron's gradient buffer layout]``).

    Args:
        params: the chunk's parameters in module order (``named_parameters``).
        distributed_optimizer: ``--use-distributed-optimizer`` (pads parameters and buckets).
        dp_size: the data-parallel x context-parallel size the buffer is sharded over.
        bucket_size: elements per bucket (None: one bucket).
        pad_for_nccl_busbw: ``--ddp-pad-buckets-for-high-nccl-busbw``.

    Returns:
        The padded numel, the buckets and each parameter's range.

    Example:
        >>> buffer_layout([ParamInfo("w", 100)], distributed_optimizer=True, dp_size=2).numel
        128
    """
    divisor = math.lcm(dp_size, 128, 2 ** 16) if pad_for_nccl_busbw else math.lcm(dp_size, 128)
    buckets: list[tuple[int, int]] = []
    ranges: list[tuple[int, int]] = []
    bucket_start = start = end = 0
    open_bucket = False

    def close(at: int) -> int:
        nonlocal bucket_start, open_bucket
        padded = round_up(at, divisor) if distributed_optimizer else at
        buckets.append((bucket_start, padded))
        bucket_start, open_bucket = padded, False
        return padded

    for p in reversed(params):
        if distributed_optimizer:
            start = round_up(start, 64)
        shared = p.shared_embedding and distributed_optimizer
        if shared and open_bucket:
            start = close(start)
        end = start + p.numel
        ranges.append((start, end))
        open_bucket = True
        if (bucket_size is not None and end - bucket_start >= bucket_size) or shared:
            start = close(end)
        else:
            start = end
    if open_bucket:
        close(end)
    numel = buckets[-1][1] if buckets else 0
    return BufferLayout(numel, sum(p.numel for p in params), tuple(buckets), tuple(ranges))


def shard_elements(layout: BufferLayout, dp_size: int, dp_rank: int) -> int:
    """Parameter elements (no padding) in data-parallel rank ``dp_rank``'s slice of every bucket.

    Example:
        >>> layout = buffer_layout([ParamInfo("w", 100)], distributed_optimizer=True, dp_size=2)
        >>> shard_elements(layout, 2, 0), shard_elements(layout, 2, 1)
        (64, 36)
    """
    total = 0
    for b_start, b_end in layout.buckets:
        size = (b_end - b_start) // dp_size
        lo, hi = b_start + dp_rank * size, b_start + (dp_rank + 1) * size
        total += sum(max(0, min(hi, e) - max(lo, s)) for s, e in layout.params if s < b_end and e > b_start)
    return total


def shard_elements_of(layout: BufferLayout, dp_size: int, dp_ranks: np.ndarray) -> np.ndarray:
    """:func:`shard_elements` of every data-parallel rank in ``dp_ranks`` at once (an int64 array), in time that
    grows with the number of parameters and ranks, not their product (a job may have a million ranks)."""
    ranges = np.array(sorted(layout.params), dtype=np.int64).reshape(-1, 2)
    starts, lengths = ranges[:, 0], ranges[:, 1] - ranges[:, 0]
    if len(ranges) > 1 and np.any(starts[1:] < ranges[:-1, 1]):  # overlapping ranges (never laid out so): one by one
        return np.array([shard_elements(layout, dp_size, int(r)) for r in dp_ranks], dtype=np.int64)
    before = np.concatenate(([0], np.cumsum(lengths)))  # parameter elements of the ranges before range i

    def below(x: np.ndarray) -> np.ndarray:  # parameter elements at positions < x
        i = np.searchsorted(starts, x, side="left")  # ranges starting before x; all but the last end before it
        last = np.clip(i - 1, 0, None)
        partial = np.minimum(x - starts[last], lengths[last]) if len(starts) else np.zeros_like(x)
        return np.where(i > 0, before[last] + partial, 0)

    total = np.zeros(len(dp_ranks), dtype=np.int64)
    for b_start, b_end in layout.buckets:
        size = (b_end - b_start) // dp_size
        lo = b_start + dp_ranks * size
        total += below(lo + size) - below(lo)
    return total


def chunk_layouts(job: Job, params: Sequence[ParamInfo], *, bucketed: bool) -> list[BufferLayout]:
    """One model chunk's buffers: the dense parameters' over the data-parallel (x cp) ranks, then, under expert
    parallelism, the experts' over the expert data-parallel ranks (NOTE [expert parameters]).

    Args:
        job: the job (distributed optimizer, dp/cp/ep, bucketing flags).
        params: the chunk's parameters in module order (:func:`rank_parameters`).
        bucketed: the chunk is split into buckets (``--overlap-grad-reduce`` on pipeline rank 0, first chunk).
    """
    bucket_size = (job.ddp_bucket_size or max(40_000_000, 1_000_000 * job.dp)) if bucketed else None
    out = []
    for expert, shards in ((False, dense_shards(job)), (True, expert_shards(job))):
        group = [p for p in params if p.expert == expert]
        mats = [p for p in group if job.optimizer == "muon" and muon.is_muon_matrix(p.name, p.shape)]
        layer_wise = bool(mats) and job.distributed_optimizer  # Muon's matrices: a buffer of their own after the rest
        if layer_wise:
            group = [p for p in group if not muon.is_muon_matrix(p.name, p.shape)]
        # --fp8-param-gather: FP8 parameters are uint8 in a buffer of their own (param_and_grad_buffer.py:921)
        fp8 = [p for p in group if job.fp8_param_gather and p.fp8]
        if fp8:
            group = [p for p in group if not (job.fp8_param_gather and p.fp8)]
        if group or not (expert or fp8):
            lay = buffer_layout(group, distributed_optimizer=job.distributed_optimizer, dp_size=shards,
                                bucket_size=bucket_size, pad_for_nccl_busbw=job.pad_buckets_for_high_nccl_busbw)
            muon_numel = 0 if layer_wise else sum(p.numel for p in mats)
            out.append(dataclasses.replace(lay, expert=expert, muon_numel=muon_numel))
        if fp8:
            lay = buffer_layout(fp8, distributed_optimizer=job.distributed_optimizer, dp_size=shards,
                                bucket_size=bucket_size, pad_for_nccl_busbw=job.pad_buckets_for_high_nccl_busbw)
            out.append(dataclasses.replace(lay, expert=expert, fp8=True))
        if layer_wise:  # remat.memory.muon: whole matrices in each of the shards
            sizes = [m for p in mats for m in muon.matrices(p.name, p.shape)]
            buckets, ranges = muon.layer_wise_layout(sizes, shards, bucket_size, job.pad_buckets_for_high_nccl_busbw)
            n = sum(numel for numel, _ in sizes)
            out.append(BufferLayout(buckets[-1][1], n, tuple(buckets), tuple(ranges), expert=expert, muon_numel=n))
    return out


def dense_shards(job: Job) -> int:
    """The ranks a dense buffer is laid out (and, with the distributed optimizer, sharded) over: the intra-instance
    data-parallel x cp group, dp x cp / ``--num-distributed-optimizer-instances`` (megatron/core/parallel_state.py
    ``intra_partial_data_parallel_size``; distributed_data_parallel.py lays the buffers over ``intra_dp_cp_group``).
    Consecutive data-parallel ranks form an instance, so data-parallel shard g holds slice g % dense_shards."""
    return job.dp * job.cp // job.distributed_optimizer_instances


def expert_shards(job: Job) -> int:
    """As :func:`dense_shards` for the expert buffers: the intra-instance expert data-parallel group."""
    return job.expert_data_parallel // job.distributed_optimizer_instances


def expert_position(job: Job, stage_rank: int) -> tuple[int, int, int]:
    """(dense data-parallel x cp shard, expert-parallel rank, expert data-parallel shard) of the ``stage_rank``-th
    rank of a pipeline stage (0 .. tp x cp x dp - 1, Megatron's order), tensor-parallel rank 0; see NOTE [expert
    parameters], ordered etp, ep, edp)."""
    dense = stage_rank // job.tp
    expert = stage_rank // job.expert_tp  # the expert ranks run etp-ep-edp through the stage's ranks
    return dense, expert % job.ep, expert // job.ep


def rank_shard_elements(job: Job, layouts: Sequence[BufferLayout], dense_shard: int, expert_shard: int) -> int:
    """Parameter elements a rank's distributed-optimizer shards hold: its slice of every dense buffer (shard
    ``dense_shard`` of dp x cp) and of every expert buffer (shard ``expert_shard`` of the expert data-parallel
    size); all elements without the distributed optimizer."""
    if not job.distributed_optimizer:
        return sum(lay.numel_unpadded for lay in layouts)
    return sum(shard_elements(lay, expert_shards(job), expert_shard % expert_shards(job)) if lay.expert else
               shard_elements(lay, dense_shards(job), dense_shard % dense_shards(job)) for lay in layouts)


def muon_shard_elements(job: Job, layouts: Sequence[BufferLayout], dense_shard: int, expert_shard: int) -> int:
    """Elements of Muon's matrices among a rank's optimizer elements (:func:`rank_shard_elements`): all of them
    without the distributed optimizer, else its shards of the layer-wise buffers (each holds Muon's only)."""
    if not job.distributed_optimizer:
        return sum(lay.muon_numel for lay in layouts)
    return rank_shard_elements(job, [lay for lay in layouts if lay.muon_numel], dense_shard, expert_shard)


def rank_state(job: Job, chunks: Sequence[Sequence[ParamInfo]], *, pipeline_rank: int = 0,
               ep_rank: int | None = None) -> RankState:
    """The model state of one rank of ``job`` that holds the model chunks ``chunks`` (one list per chunk).

    Args:
        job: the training job (precision, optimizer, distributed optimizer, dp/cp/ep, bucketing).
        chunks: each model chunk's parameters (:func:`rank_parameters`).
        pipeline_rank: the rank's pipeline stage (buckets exist only on stage 0).
        ep_rank: price a rank of this expert-parallel rank (None: any).

    Returns:
        The :class:`RankState` of the rank (of the stage, tensor-parallel rank 0) whose distributed-optimizer
        shards hold the most optimizer elements, the dense and expert shards together.

    Example:
        >>> job = Job.build(ModelConfig(), precision="bf16")
        >>> rank_state(job, [[ParamInfo("w", 1000)]]).total  # 18 bytes per parameter
        18000
    """
    dist = job.distributed_optimizer
    size = {name: DTYPES[name].itemsize for name in DTYPES}
    layouts = [lay for index, params in enumerate(chunks)
               for lay in chunk_layouts(job, params, bucketed=job.overlap_grad_reduce and pipeline_rank == 0
                                        and index == 0)]
    n = sum(lay.numel_unpadded for lay in layouts)
    padded = sum(lay.numel for lay in layouts)
    # tp rank 0 of each dense shard; a given ep_rank may sit at another tp rank only (etp < tp: the expert ranks
    # run through the tensor-parallel ones), so then every rank of the stage is a candidate
    # (every candidate at once, as arrays: a job may have a million data-parallel ranks)
    g = np.arange(0, job.tp * job.cp * job.dp, 1 if ep_rank is not None else job.tp, dtype=np.int64)
    dense, expert = g // job.tp, g // job.expert_tp  # expert_position's arithmetic
    ep_of, edp = expert % job.ep, expert // job.ep
    keep = np.flatnonzero(ep_of == ep_rank) if ep_rank is not None else np.arange(len(g))
    keep = keep[:1] if not dist else keep
    dense, ep_of, edp = dense[keep], ep_of[keep], edp[keep]
    master = 4 if job.precision != "fp32" and job.optimizer != "none" else 0
    state = {"adam": 8, "sgd": 4 if job.sgd_momentum > 0 else 0, "muon": 8, "none": 0}[job.optimizer]

    def held(muon_only: bool) -> np.ndarray:  # rank_shard_elements / muon_shard_elements of every candidate
        out = np.zeros(len(keep), dtype=np.int64)
        for lay in layouts:
            if muon_only and not lay.muon_numel:
                continue
            if not dist:
                out += lay.muon_numel if muon_only else lay.numel_unpadded
            else:
                shards = expert_shards(job) if lay.expert else dense_shards(job)
                out += shard_elements_of(lay, shards, (edp if lay.expert else dense) % shards)
        return out

    # Muon keeps 4 bytes (its momentum) where the scalar Adam keeps 8: price the rank with the most state bytes
    # (the first such, in rank order; then the one with the most elements)
    all_elements, all_muon = held(False), held(True)
    key = (master + state) * all_elements - 4 * all_muon
    tied = np.flatnonzero(key == key.max())
    best = int(tied[np.argmax(all_elements[tied])])
    elements, muon_elements = int(all_elements[best]), int(all_muon[best])
    best_rank, best_ep, best_edp = int(dense[best]), int(ep_of[best]), int(edp[best])
    p_size = size[job.param_dtype]
    # FP8 parameters (--fp8-param-gather) are 1 byte per element in their own buffer
    params_bytes = sum(lay.numel_unpadded * (1 if lay.fp8 else p_size) for lay in layouts)
    padding = sum((lay.numel - lay.numel_unpadded) * (1 if lay.fp8 else p_size) for lay in layouts)
    return RankState(num_parameters=n, parameters=params_bytes, parameter_padding=padding if dist else 0,
                     param_itemsize=p_size,
                     gradients=padded * size[job.main_grad_dtype], master_parameters=master * elements,
                     optimizer_state=state * elements - 4 * muon_elements, dp_rank=best_rank, shard_elements=elements,
                     layouts=tuple(layouts), ep_rank=best_ep, expert_dp_rank=best_edp, param_buffer=dist)


def module_parameters(module: nn.Module, shared: Sequence[Any] = ()) -> list[ParamInfo]:
    """``module``'s parameters (each once, in ``named_parameters`` order); those in ``shared`` are marked
    ``shared_embedding``."""
    shared_ids = {id(p) for p in shared}
    return [ParamInfo(name, p.numel(), id(p) in shared_ids, shape=tuple(p.shape))
            for name, p in module.named_parameters()]


class _Chunk(nn.Module):
    """A chunk of the reference GPT holding the embedding / head as asked and the layers ``layer_numbers``."""

    def __init__(self, config: ModelConfig, first: bool, last: bool, layer_numbers: Sequence[int]):
        super().__init__()
        self.embedding = Embedding(config) if first else None
        self.layers = nn.ModuleList(TransformerLayer(config, i) for i in layer_numbers)
        self.head = LMHead(config) if last else None
        if config.tie_embeddings and first and last:
            self.head.output_layer.weight = self.embedding.word_embeddings.weight
        mtp = last and config.mtp_num_layers > 0  # NOTE [multi-token prediction] in remat.models.gpt
        self.mtp = nn.ModuleList(MTPLayer(config) for _ in range(config.mtp_num_layers)) if mtp else None
        self.mtp_embedding = Embedding(config) if mtp and not first else None


@dataclass(frozen=True)
class _Spec:
    is_first: bool
    is_last: bool
    num_layers: int
    index: int = 0
    layer_offset: int = 0


def rank_parameters(config: ModelConfig, *, first: bool, last: bool, num_layers: int, tp: int = 1,
                    sp: bool = False, pipelined: bool = False, layer_offset: int = 0,
                    etp: int | None = None) -> list[ParamInfo]:
    """The parameters of one model chunk of one tensor-parallel (and expert-parallel) rank, counted from the
    module itself.

    Args:
        config: the whole model; ``expert_model_parallel_size`` ep > 1 gives each MoE layer
            ``num_moe_experts / ep`` experts, whose weights are marked ``expert`` (NOTE [expert parameters]).
        first: the chunk holds the embedding.
        last: the chunk holds the final norm and output layer.
        num_layers: its transformer layers.
        tp: the tensor-parallel size (each rank's shard is the same size).
        sp: sequence parallelism (no parameter changes; passed through to the module).
        pipelined: the model is split over several chunks; a tied embedding is then held twice (first and
            last chunk) and marked ``shared_embedding``, as Megatron does.
        layer_offset: the chunk's first layer in the whole model: each layer is built as itself (a dense layer
            or an MoE layer, as ``moe_layer_freq`` says for its number).
        etp: the experts' tensor-parallel size (None: tp).

    Returns:
        One :class:`ParamInfo` per parameter, in module order.

    Example:
        >>> c = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128)
        >>> sum(p.numel for p in rank_parameters(c, first=True, last=True, num_layers=2)) == sum(
        ...     p.numel() for p in __import__("remat.models.gpt").models.gpt.build_model(c).parameters())
        True
    """
    tied = config.tie_embeddings
    cfg = config.replace(tie_embeddings=False) if pipelined and tied else config
    span = range(layer_offset, layer_offset + num_layers)
    pattern = cfg.moe_layer_pattern()
    if span and span[-1] >= len(pattern):
        raise ValueError(f"layers {span[0]}..{span[-1]}: the model has {len(pattern)} layers")
    # layers of the same kind hold the same parameters: build one of each kind, list it once per layer
    built = list(dict.fromkeys({pattern[i]: i for i in reversed(span)}.values()))
    params = _built_parameters(cfg, first, last, built, tp, sp, pipelined and tied, etp)
    expert_parallel = cfg.expert_model_parallel_size > 1
    by_kind = {pattern[i]: [ParamInfo(p.name.split(".", 2)[2], p.numel, p.shared_embedding,
                                      expert_parallel and ".mlp.experts." in p.name, p.shape)
                            for p in params if p.name.startswith(f"layers.{k}.")]
               for k, i in enumerate(built)}
    # the MTP stage's own word embedding is registered first, as GPTModel does (gpt_model.py:173); an MTP layer's
    # routed experts are expert-parallel like the decoder's
    before = [p for p in params if p.name.startswith(("embedding.", "mtp_embedding."))]
    after = [dataclasses.replace(p, expert=expert_parallel and ".mlp.experts." in p.name) for p in params
             if not p.name.startswith(("embedding.", "mtp_embedding.", "layers."))]
    fp8 = cfg.fp8_layers or (1,) * cfg.num_layers  # NOTE [FP8 linears on Hopper]: the MTP layers always FP8
    layers = [ParamInfo(f"layers.{i - layer_offset}." + p.name, p.numel, p.shared_embedding, p.expert, p.shape,
                        fp8=bool(cfg.fp8_recipe and fp8[i] and is_fp8_weight(p.name)))
              for i in span for p in by_kind[pattern[i]]]
    after = [dataclasses.replace(p, fp8=bool(cfg.fp8_recipe and is_fp8_weight(p.name))) for p in after]
    return before + layers + after


_BUILT: dict[str, list[ParamInfo]] = {}  # this process's answers of _built_parameters, by their disk-cache key


def forget_parameters() -> None:
    """Drop this process's memo of built chunk parameters (:func:`rank_parameters` then reads the disk cache or
    builds the fake module again)."""
    _BUILT.clear()


def _built_parameters(cfg: ModelConfig, first: bool, last: bool, built: list[int], tp: int, sp: bool,
                      shares: bool, etp: int | None) -> list[ParamInfo]:
    """The parameters of the chunk module holding the embedding (``first``), the layers ``built`` and the head
    (``last``) of one tensor-parallel rank, built on the meta device; kept in this process and on disk
    (:mod:`remat.memory.disk_cache`): building the module is the slow part."""
    key = {"config": cfg.to_dict(), "first": first, "last": last, "built": list(built), "tp": tp, "sp": sp,
           "shares": shares, "etp": etp, "format": 2}  # 2: with shapes
    text = repr(sorted(key.items()))
    if text in _BUILT:
        return list(_BUILT[text])
    stored = disk_cache.load("rank_parameters", key)
    params: list[ParamInfo] | None = None
    if isinstance(stored, list):
        try:
            params = [ParamInfo(str(n), int(k), bool(s), bool(e), tuple(int(d) for d in shape))
                      for n, k, s, e, shape in stored]
        except (TypeError, ValueError):
            params = None
    if params is None:
        # on the meta device: only the parameters' names and shapes are read (no fake mode: ~4x faster to build)
        if tp == 1 and not sp:
            with building(cfg, "meta"):
                module: nn.Module = _Chunk(cfg, first, last, built)
        else:
            with simulated_expert_groups(tp, 1, etp):  # experts split over etp
                module = build_tp_stage_module(cfg, _Spec(first, last, len(built)), SimulatedGroup(tp), sp,
                                               device="meta", seed=None, layer_numbers=built)
        shared = []
        if shares:
            shared = [module.embedding.word_embeddings.weight] if first else []
            shared += [module.head.output_layer.weight] if last else []
        if module.mtp_embedding is not None:  # language_module.py:278-290: a shared copy, tied or not
            shared.append(module.mtp_embedding.word_embeddings.weight)
        params = module_parameters(module, shared)
        disk_cache.store("rank_parameters", key,
                         [[p.name, p.numel, p.shared_embedding, p.expert, list(p.shape)] for p in params])
    _BUILT[text] = params
    return list(params)
