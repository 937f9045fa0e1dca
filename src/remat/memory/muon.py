"""Megatron-LM's Muon optimizer (``--optimizer muon`` / ``dist_muon``): which parameters it owns, and the
layer-wise distributed optimizer's shard-aligned buffer layout.

Facts (NVIDIA/Megatron-LM at d98e8a6; emerging_optimizers 0.3.0, the version its pyproject.toml pins):

* megatron/core/optimizer/emerging_optimizers.py:140-147 (``_is_muon_excluded``): a parameter goes to the scalar
  optimizer (Adam, ``--muon-scalar-optimizer``) when it is not 2-D or is marked ``is_embedding_or_output_parameter``
  (language_module.py:229-236: the word embedding and the output layer only); every other matrix goes to Muon
  (QKV, projections, the router, the learned position embedding, each expert's GEMM weight: TE's GroupedLinear
  registers one 2-D ``weight{i}`` per local expert, where remat builds one 3-D tensor).
* Muon's state (emerging_optimizers/orthogonalized_optimizers/orthogonalized_optimizer.py:145): one
  ``momentum_buffer = zeros_like(p)`` of the fp32 master (bf16) or fp32 parameter: 4 bytes per element, where Adam
  keeps 8. Newton-Schulz runs on one matrix at a time inside ``step()`` (transient, a matrix's size).
* Without the distributed optimizer (optimizer/__init__.py:896-905) each group is wrapped in
  Float16OptimizerWithFloat16Params: unsharded fp32 master copies, the DDP buffers unchanged.
* ``--use-distributed-optimizer`` (or ``dist_muon``) turns Muon's into the layer-wise distributed optimizer
  (training/arguments.py:1725-1736) with its parameter layout (training.py:2262-2268: DDP's buffers become
  distributed-optimizer buffers, the parameters views of param_data): the Muon matrices get buffers of their own
  (``is_managed_by_layer_wise_optimizer``, param_and_grad_buffer.py:926-940), laid out by
  layer_wise_optimizer.py:196-443 so that every matrix lies whole in one of the dp shards
  (:func:`layer_wise_layout`); each rank keeps master copies and momentum of its shard's matrices only
  (layer_wise_optimizer.py:570-590). The scalar parameters stay in distributed-optimizer buffers sharded byte-wise
  by an ordinary DistributedOptimizer (optimizer/__init__.py:907-940).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from remat.units import round_up

EMBEDDING_OR_OUTPUT = ("word_embeddings.weight", "output_layer.weight")
"""Name endings of the parameters Megatron marks ``is_embedding_or_output_parameter`` (language_module.py:229-236)."""


def is_muon_matrix(name: str, shape: Sequence[int]) -> bool:
    """Whether Muon (not the scalar Adam) updates the parameter ``name`` of ``shape`` (as remat builds it).

    Example:
        >>> is_muon_matrix("layers.0.self_attention.linear_qkv.weight", (1536, 512))
        True
        >>> is_muon_matrix("embedding.word_embeddings.weight", (50304, 512)), is_muon_matrix("x.bias", (512,))
        (False, False)
    """
    if name.endswith(EMBEDDING_OR_OUTPUT):
        return False
    # remat's grouped experts are one (experts, in, out) tensor: Megatron's are one 2-D weight per expert
    return len(shape) == 2 or (len(shape) == 3 and ".experts." in name)


def matrices(name: str, shape: Sequence[int]) -> list[tuple[int, int]]:
    """``(numel, Newton-Schulz cost)`` of each Muon matrix in the parameter (one per expert of a 3-D expert tensor),
    in Megatron's registration order; the cost is layer_wise_optimizer.py:251-268's ``max(m, n) * min(m, n)**2``.

    Example:
        >>> matrices("layers.0.mlp.experts.linear_fc1.weight", (2, 512, 1024))
        [(524288, 268435456), (524288, 268435456)]
    """
    *experts, m, n = shape
    count = experts[0] if experts else 1
    return [(m * n, max(m, n) * min(m, n) ** 2)] * count


def layer_wise_layout(params: Sequence[tuple[int, int]], dp_size: int, bucket_size: int | None = None,
                      pad_for_nccl_busbw: bool = False) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """LayerWiseDistributedOptimizer._compute_per_buffer_param_layout (layer_wise_optimizer.py:196-443): Muon's
    matrices bin-packed whole into ``dp_size`` shards of every bucket.

    Args:
        params: ``(numel, Newton-Schulz cost)`` of each matrix, in module (forward) order.
        dp_size: the shards (the data-parallel x cp group, or the expert data-parallel group).
        bucket_size: the soft minimum of elements per bucket (None: one bucket).
        pad_for_nccl_busbw: ``--ddp-pad-buckets-for-high-nccl-busbw``.

    Returns:
        ``(buckets, ranges)``: each bucket's ``[start, end)`` (``dp_size`` equal shards) and each matrix's range,
        every range inside one shard.

    Example:
        >>> layer_wise_layout([(100, 1), (100, 1), (60, 1)], 2)
        ([(0, 384)], [(0, 60), (64, 164), (192, 292)])
    """
    divisor = math.lcm(dp_size, 128, 2 ** 16) if pad_for_nccl_busbw else math.lcm(dp_size, 128)
    shard_divisor = math.lcm(64, divisor // dp_size)  # _shard_divisor (:184-194)
    buckets: list[tuple[int, int]] = []
    ranges: list[tuple[int, int]] = []
    loads = [0] * dp_size  # Newton-Schulz cost per shard, kept across buckets (:229-231)

    def emit(chunk: list[tuple[int, int]]) -> None:  # _emit_bucket (:270-345)
        if not chunk:
            return
        shards: list[list[int]] = [[] for _ in range(dp_size)]
        cursors = [0] * dp_size
        cap = sum(numel for numel, _ in chunk) / dp_size * 1.3  # _NUMEL_EPSILON = 0.3 (:313)
        for numel, cost in sorted(chunk, key=lambda p: -p[1]):  # stable: ties keep backprop order
            fits = [s for s in range(dp_size) if round_up(cursors[s], 64) + numel <= cap]
            shard = (min(fits, key=lambda s: loads[s]) if fits else min(range(dp_size), key=lambda s: cursors[s]))
            shards[shard].append(numel)
            cursors[shard] = round_up(cursors[shard], 64) + numel
            loads[shard] += cost
        size = round_up(max(cursors), shard_divisor)
        start = buckets[-1][1] if buckets else 0
        for shard, numels in enumerate(shards):
            cursor = start + shard * size
            for numel in numels:
                cursor = round_up(cursor, 64)
                ranges.append((cursor, cursor + numel))
                cursor += numel
        buckets.append((start, start + dp_size * size))

    # the walk in backprop order (:365-421): close a bucket once it holds bucket_size elements (or 0.9 x dp x its
    # largest matrix) and the next matrix would grow it
    chunk: list[tuple[int, int]] = []
    estimate = [0] * dp_size
    for numel, cost in reversed(params):
        if bucket_size is not None and chunk:
            threshold = max(bucket_size, int(dp_size * max(n for n, _ in chunk) * 0.9))
            absorbs = round_up(min(estimate), 64) + numel <= round_up(max(estimate), shard_divisor)
            if sum(n for n, _ in chunk) >= threshold and not absorbs:
                emit(chunk)
                chunk, estimate = [], [0] * dp_size
        least = min(range(dp_size), key=lambda s: estimate[s])
        estimate[least] = round_up(estimate[least], 64) + numel
        chunk.append((numel, cost))
    emit(chunk)
    return buckets, ranges
