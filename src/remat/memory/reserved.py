"""Reserved memory beside allocated memory: the caching-allocator replay of a predicted timeline, for reports.

What runs out of memory on a GPU is reserved memory (the allocator's segments), not the allocated peak a trace
gives. :func:`reserved_figures` replays a timeline through :mod:`remat.memory.allocator` and returns the figures
``predict``, ``explain`` and ``plan`` print beside the allocated peak.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict
from typing import Any

import numpy as np

from remat.config import ModelConfig
from remat.memory import disk_cache
from remat.memory.allocator import AllocatorConfig, ReplayResult, replay_timeline
from remat.memory.kernels import resolve_kernels
from remat.memory.predict import predict_config
from remat.memory.torch_fsdp2 import ALLOCATION_STREAMS
from remat.timeline import Timeline
from remat.units import format_bytes

CACHE_KIND = "allocator_replay"
REPLAY_NOTE = ("a replay of PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp rules: 512-byte "
               "rounding, 2 MiB small-pool and 20 MiB large segments, best-fit block splitting, each stream's own "
               "pools (FSDP2's all-gather and reduce-scatter outputs on theirs), no empty_cache) over the predicted "
               "allocations; not a GPU measurement")
# the side streams a predicted row may be allocated on, numbered for the replay (0: the default stream)
_STREAM_NUMBERS = {name: i + 1 for i, name in enumerate(sorted(set(ALLOCATION_STREAMS.values())))}


def reserved_figures(timeline: Timeline, config: AllocatorConfig | None = None) -> dict[str, Any]:
    """What ``torch.cuda.max_memory_reserved()`` and friends would report for ``timeline``'s step.

    Args:
        timeline: a predicted (or measured) step; its rows are replayed in event order.
        config: ``PYTORCH_CUDA_ALLOC_CONF`` options (default: PyTorch's defaults).

    Returns:
        A JSON-ready dict: ``allocated_peak_bytes`` (the timeline's), ``max_memory_allocated`` and
        ``max_memory_reserved`` (the replay's), ``overhead_bytes`` (``max_memory_reserved`` minus
        ``allocated_peak_bytes``: what the allocator adds to the allocated peak), ``fragmentation_at_peak_bytes``
        (reserved minus allocated when reserved peaked), ``largest_free_block_bytes`` (at that moment),
        ``segments`` (cudaMalloc calls), ``alloc_conf`` (the options replayed, as ``PYTORCH_CUDA_ALLOC_CONF``
        writes them; ``''``: PyTorch's defaults) and ``note`` (what the figures are).

    Example::

        >>> from types import SimpleNamespace
        >>> tl = SimpleNamespace(nbytes=[3 << 20], alloc_at=[0], free_at=[-1], peak_bytes=3 << 20)
        >>> reserved_figures(tl)["max_memory_reserved"] >> 20  # a 3 MiB block takes a 20 MiB segment
        20
    """
    return _figures(timeline, cached_replay(timeline, config), config)


def stored_figures(timeline: Timeline, config: AllocatorConfig | None = None) -> dict[str, Any] | None:
    """:func:`reserved_figures` when the disk cache holds the replay already (:func:`cached_replay`), else None:
    nothing is replayed."""
    if not disk_cache.enabled():  # --no-cache: nothing stored, and no digest of the rows to make
        return None
    result = _stored(_cache_key(timeline, config, allocation_streams(timeline)))
    return None if result is None else _figures(timeline, result, config)


def _figures(timeline: Timeline, result: ReplayResult, config: AllocatorConfig | None) -> dict[str, Any]:
    allocated = int(timeline.peak_bytes)
    return {
        "allocated_peak_bytes": allocated,
        "max_memory_allocated": result.peak_allocated,
        "max_memory_reserved": result.peak_reserved,
        "overhead_bytes": result.peak_reserved - allocated,
        "fragmentation_at_peak_bytes": result.fragmentation_at_peak,
        "largest_free_block_bytes": result.largest_free_block_at_peak,
        "segments": result.segments,
        "alloc_conf": (config or AllocatorConfig()).text(),
        "note": REPLAY_NOTE,
    }


def cached_replay(timeline: Timeline, config: AllocatorConfig | None = None) -> ReplayResult:
    """:func:`~remat.memory.allocator.replay_timeline`, kept in the disk cache (:mod:`remat.memory.disk_cache`) under
    a digest of the timeline's rows and the options: a job's ranks take a second or so to replay, and a command run
    again predicts the same timelines."""
    streams = allocation_streams(timeline)
    if not disk_cache.enabled():  # --no-cache: no digest of the rows to make (a few ms a rank)
        return replay_timeline(timeline, config, streams)
    key = _cache_key(timeline, config, streams)
    result = _stored(key)
    if result is None:
        result = replay_timeline(timeline, config, streams)
        disk_cache.store(CACHE_KIND, key, result.to_dict())
    return result


def allocation_streams(timeline: Timeline) -> list[int] | None:
    """The stream each of ``timeline``'s rows is allocated on, for the replay (NOTE [streams' pools] in
    :mod:`remat.memory.allocator`), by the module that allocates it (:data:`remat.memory.torch_fsdp2.
    ALLOCATION_STREAMS`); None when every row is the default stream's (or the timeline names no modules).

    Example::

        >>> from types import SimpleNamespace
        >>> allocation_streams(SimpleNamespace(module=["layers.0", "torch_fsdp2.all_gather_output"]))
        [0, 1]
    """
    modules = getattr(timeline, "module", None) or ()
    if ALLOCATION_STREAMS.keys().isdisjoint(modules):  # the usual case, without a Python step per row
        return None
    return [_STREAM_NUMBERS.get(ALLOCATION_STREAMS.get(m, ""), 0) for m in modules]


def _cache_key(timeline: Timeline, config: AllocatorConfig | None,
               streams: list[int] | None = None) -> dict[str, Any]:
    digest = hashlib.sha256()
    for values in (timeline.nbytes, timeline.alloc_at, timeline.free_at, *([streams] if streams else [])):
        digest.update(np.asarray(values, dtype=np.int64).tobytes())
        digest.update(b"|")
    return {"rows": digest.hexdigest(), "options": asdict(config or AllocatorConfig())}


def _stored(key: dict[str, Any]) -> ReplayResult | None:
    stored = disk_cache.load(CACHE_KIND, key)
    if isinstance(stored, dict):
        try:
            return ReplayResult(**stored)
        except TypeError:  # an entry of another layout: replayed again
            pass
    return None


def format_reserved(figures: dict[str, Any]) -> str:
    """One line for text reports: reserved peak, its excess over allocated, fragmentation, largest free block."""
    allocated, reserved = figures["max_memory_allocated"], figures["max_memory_reserved"]
    extra = f"+{100 * (reserved - allocated) / allocated:.1f}%" if allocated else "n/a"
    return (f"reserved {format_bytes(reserved)} ({extra} over its max_memory_allocated {format_bytes(allocated)}), "
            f"fragmentation "
            f"at the reserved peak {format_bytes(figures['fragmentation_at_peak_bytes'])}, largest free block "
            f"{format_bytes(figures['largest_free_block_bytes'])}, {figures['segments']} segments")


def explain_reserved(config: ModelConfig, timelines: dict[str, Timeline], device: str,
                     kernels: str | None = None) -> dict[str, dict[str, Any]]:
    """Reserved figures for ``remat explain``: of each measured timeline on a CUDA device, else of each policy's
    prediction with the CUDA kernels (``kernels``, default the active profile or ``'cuda'``) in 512-byte blocks.

    Args:
        config: the model ``timelines`` were measured on.
        timelines: policy text -> measured :class:`Timeline`.
        device: where they were measured (``'cpu'`` or ``'cuda'``).
        kernels: the kernel profile of the predictions (``'cpu'`` is refused: CPU kernels are not GPU bytes).

    Returns:
        policy text -> :func:`reserved_figures`, each with ``source`` (``'measured'`` or ``'predicted'``).
    """
    if device == "cuda":
        return {name: {**reserved_figures(tl), "source": "measured"} for name, tl in timelines.items()}
    profile = kernels or resolve_kernels(None, "cuda")
    if profile == "cpu":
        raise ValueError("reserved memory is a GPU figure: use --kernels cuda or te (or --device cuda), not cpu")
    return {name: {**reserved_figures(predict_config(config, name, device="cuda", kernels=profile)),
                   "source": f"predicted, kernels={profile}"} for name in timelines}
