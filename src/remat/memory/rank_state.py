"""What a Megatron-LM rank holds for the whole training step besides activations, to the byte.

A rank's model state is: its parameters (in the training precision), Megatron DDP's contiguous gradient buffer
("main grads", allocated at start-up and alive all step), and the optimizer's fp32 master parameters and state
(Adam's two moments, SGD's momentum), sharded over the data-parallel (x context-parallel) ranks with the
distributed optimizer. The parameters are counted from the rank's real module (its pipeline chunks, sharded by
tensor parallelism) built under ``FakeTensorMode`` (:func:`rank_parameters`); the buffers follow Megatron's
layout rules (:func:`buffer_layout`), so the padding is exact too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from remat.config import DTYPES, ModelConfig
from remat.job import Job
from remat.models.gpt import Embedding, LMHead, TransformerLayer, building
from remat.models.tensor_parallel import SimulatedGroup
from remat.models.tp_stage import build_tp_stage_module

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


@dataclass(frozen=True)
class ParamInfo:
    """One parameter of a rank's model chunk: its name, element count, and whether it is the tied embedding
    shared between the first and last pipeline stage (Megatron's ``shared_embedding``)."""

    name: str
    numel: int
    shared_embedding: bool = False


@dataclass(frozen=True)
class BufferLayout:
    """One model chunk's gradient (and, with the distributed optimizer, parameter) buffer."""

    numel: int  # padded
    numel_unpadded: int
    buckets: tuple[tuple[int, int], ...]  # [start, end) of each bucket, padded
    params: tuple[tuple[int, int], ...]  # [start, end) of each parameter, in buffer order


@dataclass(frozen=True)
class RankState:
    """A rank's model state for the whole step, in bytes (see the module docstring)."""

    num_parameters: int
    parameters: int
    parameter_padding: int  # the param_data buffer's padding (distributed optimizer only)
    gradients: int  # the main-gradient buffer, padding included
    master_parameters: int
    optimizer_state: int
    dp_rank: int  # the data-parallel shard priced (the one holding the most optimizer elements)
    shard_elements: int  # parameter elements in that shard (all of them without the distributed optimizer)
    layouts: tuple[BufferLayout, ...] = field(default=())

    @property
    def total(self) -> int:
        """All of it: parameters (+ padding), gradients, master parameters and optimizer state."""
        return (self.parameters + self.parameter_padding + self.gradients + self.master_parameters
                + self.optimizer_state)

    def parts(self) -> dict[str, int]:
        """``{"parameters", "gradients", "master_parameters", "optimizer_state"}`` (padding with parameters)."""
        return {"parameters": self.parameters + self.parameter_padding, "gradients": self.gradients,
                "master_parameters": self.master_parameters, "optimizer_state": self.optimizer_state}


def _pad(n: int, divisor: int) -> int:
    return -(-n // divisor) * divisor


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
        padded = _pad(at, divisor) if distributed_optimizer else at
        buckets.append((bucket_start, padded))
        bucket_start, open_bucket = padded, False
        return padded

    for p in reversed(params):
        if distributed_optimizer:
            start = _pad(start, 64)
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


def rank_state(job: Job, chunks: Sequence[Sequence[ParamInfo]], *, pipeline_rank: int = 0) -> RankState:
    """The model state of one rank of ``job`` that holds the model chunks ``chunks`` (one list per chunk).

    Args:
        job: the training job (precision, optimizer, distributed optimizer, dp/cp, bucketing).
        chunks: each model chunk's parameters (:func:`rank_parameters`).
        pipeline_rank: the rank's pipeline stage (buckets exist only on stage 0).

    Returns:
        The :class:`RankState` of the data-parallel shard holding the most optimizer elements.

    Example:
        >>> job = Job.build(ModelConfig(), precision="bf16")
        >>> rank_state(job, [[ParamInfo("w", 1000)]]).total  # 18 bytes per parameter
        18000
    """
    dist = job.distributed_optimizer
    dp_size = job.dp * job.cp
    size = {name: DTYPES[name].itemsize for name in DTYPES}
    layouts = []
    for index, params in enumerate(chunks):
        bucket_size = None
        if job.overlap_grad_reduce and pipeline_rank == 0 and index == 0:
            bucket_size = job.ddp_bucket_size or max(40_000_000, 1_000_000 * job.dp)
        layouts.append(buffer_layout(params, distributed_optimizer=dist, dp_size=dp_size, bucket_size=bucket_size,
                                     pad_for_nccl_busbw=job.pad_buckets_for_high_nccl_busbw))
    n = sum(lay.numel_unpadded for lay in layouts)
    padded = sum(lay.numel for lay in layouts)
    best_rank, elements = 0, n
    if dist:
        counts = [sum(shard_elements(lay, dp_size, r) for lay in layouts) for r in range(dp_size)]
        best_rank = max(range(dp_size), key=lambda r: counts[r])
        elements = counts[best_rank]
    master = 4 if job.precision != "fp32" and job.optimizer != "none" else 0
    state = {"adam": 8, "sgd": 4 if job.sgd_momentum > 0 else 0, "none": 0}[job.optimizer]
    p_size = size[job.param_dtype]
    return RankState(num_parameters=n, parameters=n * p_size, parameter_padding=(padded - n) * p_size if dist else 0,
                     gradients=padded * size[job.main_grad_dtype], master_parameters=master * elements,
                     optimizer_state=state * elements, dp_rank=best_rank, shard_elements=elements,
                     layouts=tuple(layouts))


def module_parameters(module: nn.Module, shared: Sequence[Any] = ()) -> list[ParamInfo]:
    """``module``'s parameters (each once, in ``named_parameters`` order); those in ``shared`` are marked
    ``shared_embedding``."""
    shared_ids = {id(p) for p in shared}
    return [ParamInfo(name, p.numel(), id(p) in shared_ids) for name, p in module.named_parameters()]


class _Chunk(nn.Module):
    def __init__(self, config: ModelConfig, first: bool, last: bool, num_layers: int):
        super().__init__()
        self.embedding = Embedding(config) if first else None
        self.layers = nn.ModuleList(TransformerLayer(config) for _ in range(num_layers))
        self.head = LMHead(config) if last else None
        if config.tie_embeddings and first and last:
            self.head.output_layer.weight = self.embedding.word_embeddings.weight


@dataclass(frozen=True)
class _Spec:
    is_first: bool
    is_last: bool
    num_layers: int
    index: int = 0
    layer_offset: int = 0


def rank_parameters(config: ModelConfig, *, first: bool, last: bool, num_layers: int, tp: int = 1,
                    sp: bool = False, pipelined: bool = False) -> list[ParamInfo]:
    """The parameters of one model chunk of one tensor-parallel rank, counted from the module itself.

    Args:
        config: the whole model.
        first: the chunk holds the embedding.
        last: the chunk holds the final norm and output layer.
        num_layers: its transformer layers.
        tp: the tensor-parallel size (each rank's shard is the same size).
        sp: sequence parallelism (no parameter changes; passed through to the module).
        pipelined: the model is split over several chunks; a tied embedding is then held twice (first and
            last chunk) and marked ``shared_embedding``, as Megatron does.

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
    built = min(num_layers, 1)  # every layer is the same module: build one, list it once per layer
    with FakeTensorMode():
        if tp == 1 and not sp:
            with building(cfg, "cpu"):
                module: nn.Module = _Chunk(cfg, first, last, built)
        else:
            module = build_tp_stage_module(cfg, _Spec(first, last, built), SimulatedGroup(tp), sp, seed=None)
        shared = []
        if pipelined and tied:
            shared = [module.embedding.word_embeddings.weight] if first else []
            shared += [module.head.output_layer.weight] if last else []
        params = module_parameters(module, shared)
    layer = [p for p in params if p.name.startswith("layers.0.")]
    before = [p for p in params if not p.name.startswith("layers.") and p.name.startswith("embedding.")]
    after = [p for p in params if p not in layer and p not in before]
    layers = [ParamInfo(f"layers.{i}." + p.name[len("layers.0."):], p.numel, p.shared_embedding)
              for i in range(num_layers) for p in layer]
    return before + layers + after
