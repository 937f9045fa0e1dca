"""``PYTORCH_CUDA_ALLOC_CONF`` (``PYTORCH_ALLOC_CONF``) for the caching-allocator replay
(:mod:`remat.memory.allocator`): :class:`AllocatorConfig`, what it reads from a string or a training process's
environment (:func:`allocator_config_of_env`), and the allocator's size constants and rules (:func:`round_size`,
:func:`allocation_size`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

# Constants of c10/core/AllocatorConfig.h (of CUDACachingAllocator.cpp before PyTorch 2.9).
MIB = 1 << 20
MIN_BLOCK_SIZE = 512        # kMinBlockSize: all sizes are rounded to at least 512 bytes
SMALL_SIZE = 1 * MIB        # kSmallSize: largest "small" allocation
SMALL_BUFFER = 2 * MIB      # kSmallBuffer: "small" allocations are packed in 2 MiB segments (and pages)
MIN_LARGE_ALLOC = 10 * MIB  # kMinLargeAlloc: allocations between 1 and 10 MiB get a large segment
ROUND_LARGE = 2 * MIB       # kRoundLarge: larger allocations are rounded up to 2 MiB
LARGE_BUFFER = 20 * MIB     # kLargeBuffer: default large_segment_size_mb and max_non_split_rounding_mb


def round_size(nbytes: int, divisions: int = 0) -> int:
    """The block size a request asks the pools for (``round_size``, ``roundup_power2_next_division``).

    Args:
        nbytes: bytes requested.
        divisions: ``roundup_power2_divisions`` (0 or 1: off).

    Returns:
        ``nbytes`` up to a multiple of 512 (at least 512) or, if ``divisions > 1`` and ``nbytes > 512 * divisions``,
        up to the next of ``divisions`` equal steps between two powers of two. Idempotent.

    Example::

        >>> round_size(1), round_size(5 * MIB + 1), round_size(5 * MIB + 1, divisions=4)
        (512, 5243392, 6291456)
    """
    if nbytes < MIN_BLOCK_SIZE:
        return MIN_BLOCK_SIZE
    if divisions > 1 and nbytes > MIN_BLOCK_SIZE * divisions and nbytes & (nbytes - 1):
        floor = 1 << (nbytes.bit_length() - 1)
        step = floor >> (divisions.bit_length() - 1)
        if step == 0:
            return floor << 1
        low = nbytes & ~(step - 1)
        return nbytes if low == nbytes else low + step
    return (nbytes + MIN_BLOCK_SIZE - 1) // MIN_BLOCK_SIZE * MIN_BLOCK_SIZE


def allocation_size(size: int, large_segment_size: int = LARGE_BUFFER) -> int:
    """Bytes cudaMalloc'd for a rounded request that no cached block serves (``get_allocation_size``).

    Args:
        size: a rounded request (:func:`round_size`).
        large_segment_size: ``large_segment_size_mb`` in bytes (default 20 MiB).

    Returns:
        2 MiB up to 1 MiB, ``large_segment_size`` below 10 MiB, else ``size`` rounded up to 2 MiB.

    Example::

        >>> allocation_size(512) // MIB, allocation_size(5 * MIB) // MIB, allocation_size(29 * MIB + 1) // MIB
        (2, 20, 30)
    """
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return large_segment_size
    return (size + ROUND_LARGE - 1) // ROUND_LARGE * ROUND_LARGE


# Options PyTorch knows that change nothing in a replay of the device pools: accepted, ignored.
_IGNORED_KEYS = (
    "garbage_collection_threshold", "release_lock_on_cudamalloc", "release_lock_on_hipmalloc",
    "pinned_use_cuda_host_register", "pinned_use_hip_host_register", "pinned_num_register_threads",
    "pinned_use_background_threads", "pinned_reserve_segment_size_mb", "pinned_free_catch_all",
    "pinned_max_round_threshold", "pinned_max_cached_size", "graph_capture_record_stream_reuse",
    "throw_on_cudamalloc_oom")
# MiB options -> (field, least value): AcceleratorAllocatorConfig::parseMaxSplitSize and its siblings.
_MB_KEYS = {"max_split_size_mb": ("max_split_size", LARGE_BUFFER // MIB),
            "max_non_split_rounding_mb": ("max_non_split_rounding_size", LARGE_BUFFER // MIB),
            "large_segment_size_mb": ("large_segment_size", MIN_LARGE_ALLOC // MIB + 1)}
_KEYS = (*_MB_KEYS, "roundup_power2_divisions", "expandable_segments", "backend", *_IGNORED_KEYS)


@dataclass(frozen=True)
class AllocatorConfig:
    """Knobs of ``PYTORCH_CUDA_ALLOC_CONF`` (``PYTORCH_ALLOC_CONF``) the replay honours, and the device capacity.

    Example::

        >>> AllocatorConfig.parse("max_split_size_mb:128,expandable_segments:True").max_split_size // MIB
        128
    """

    max_split_size: int | None = None
    """Bytes (``max_split_size_mb``): blocks this big are never split and serve only requests this big, within
    ``max_non_split_rounding_size``. ``None``: unlimited, the default."""
    expandable_segments: bool = False
    """One growing segment per pool, mapped in pages of 2 MiB (small pool) or ``large_segment_size`` (large)."""
    roundup_power2_divisions: int = 0
    """Round requests up to this many steps per power-of-two interval (0: off); one value for all sizes."""
    capacity_bytes: int | None = None
    """Device memory the segments must fit in: beyond it cached segments are released, then an OOM is counted.
    ``None``: unlimited (no OOM, no release)."""
    max_non_split_rounding_size: int = LARGE_BUFFER
    """Bytes an oversize block may exceed an oversize request by (``max_non_split_rounding_mb``)."""
    large_segment_size: int = LARGE_BUFFER
    """Segment of a 1-10 MiB request and large-pool page of expandable segments (``large_segment_size_mb``)."""

    def __post_init__(self) -> None:
        for name, least in (("max_split_size", LARGE_BUFFER), ("max_non_split_rounding_size", LARGE_BUFFER),
                            ("large_segment_size", MIN_LARGE_ALLOC + 1), ("capacity_bytes", 1)):
            value = getattr(self, name)
            if value is not None and value < least:
                raise ValueError(f"{name} must be at least {least} bytes, got {value}")
        if self.roundup_power2_divisions < 0 or self.roundup_power2_divisions & (self.roundup_power2_divisions - 1):
            raise ValueError(f"roundup_power2_divisions {self.roundup_power2_divisions} must be 0 (off) or a power "
                             "of two")

    @classmethod
    def parse(cls, text: str) -> AllocatorConfig:
        """Read a ``PYTORCH_CUDA_ALLOC_CONF`` string (``AcceleratorAllocatorConfig::parseArgs``).

        Args:
            text: comma-separated ``key:value`` pairs. Options that change nothing here (``pinned_*``,
                ``garbage_collection_threshold``, ``release_lock_on_cudamalloc``, ...) are accepted and ignored.

        Returns:
            The config; ``capacity_bytes`` stays ``None`` (set it with :func:`dataclasses.replace`).

        Raises:
            ValueError: an unknown option, a missing or bad value, or one the replay cannot honour; the message
                names the option and what to write instead.

        Example::

            >>> AllocatorConfig.parse("roundup_power2_divisions:4").roundup_power2_divisions
            4
        """
        fields: dict[str, int | bool] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, colon, value = (word.strip() for word in item.partition(":"))
            if key == "per_process_memory_fraction":
                raise ValueError("per_process_memory_fraction is not read by the replay: set "
                                 "AllocatorConfig.capacity_bytes to that fraction of the device memory instead")
            if key not in _KEYS:
                raise ValueError(f"unknown allocator option {key!r}; known options: {', '.join(_KEYS)}")
            if not colon or not value:
                raise ValueError(f"allocator option {key!r} has no value; write {key}:<value>")
            if value.startswith("["):
                example = "4" if key == "roundup_power2_divisions" else "<value>"
                raise ValueError(f"{key}: a [list] value is not modelled; give one value for all sizes, e.g. "
                                 f"{key}:{example}")
            if key in _MB_KEYS:
                name, least = _MB_KEYS[key]
                if not value.isdigit() or int(value) < least:
                    raise ValueError(f"allocator option {key} must be a whole number of MiB >= {least}, got "
                                     f"{value!r}; e.g. {key}:{max(least, 128)}")
                fields[name] = int(value) * MIB
            elif key == "roundup_power2_divisions":
                n = int(value) if value.isdigit() else 0
                if n == 0 or n & (n - 1):  # parseRoundUpPower2Divisions: llvm::isPowerOf2_64
                    raise ValueError(f"roundup_power2_divisions must be a power of two, got {value!r}; e.g. "
                                     "roundup_power2_divisions:4")
                fields[key] = n
            elif key == "expandable_segments":
                if value not in ("True", "False"):  # ConfigTokenizer::toBool
                    raise ValueError(f"expandable_segments must be True or False (capitalised), got {value!r}")
                fields[key] = value == "True"
            elif key == "backend" and value != "native":
                raise ValueError(f"backend:{value} is not replayed, only the native caching allocator; drop the "
                                 "option or write backend:native")
        return cls(**fields)

    def text(self) -> str:
        """The options that differ from PyTorch's defaults, as ``PYTORCH_CUDA_ALLOC_CONF`` writes them (``''``:
        the defaults; the capacity is no option and is left out).

        Example::

            >>> AllocatorConfig.parse("expandable_segments:True,max_split_size_mb:512").text()
            'max_split_size_mb:512,expandable_segments:True'
        """
        out = [f"{key}:{getattr(self, name) // MIB}" for key, (name, _) in _MB_KEYS.items()
               if getattr(self, name) != getattr(AllocatorConfig, name)]
        if self.roundup_power2_divisions:
            out.append(f"roundup_power2_divisions:{self.roundup_power2_divisions}")
        if self.expandable_segments:
            out.append("expandable_segments:True")
        return ",".join(out)


ENV_NAMES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")  # c10 reads the first, then its older name


def allocator_config_of_env(env: Mapping[str, str] | None) -> tuple[str, AllocatorConfig] | None:
    """The allocator options a training process's environment sets: ``(variable, config)``, or None when neither
    ``PYTORCH_ALLOC_CONF`` nor ``PYTORCH_CUDA_ALLOC_CONF`` is set (``PYTORCH_ALLOC_CONF`` wins, as in c10).

    Raises:
        ValueError: the value is not one :meth:`AllocatorConfig.parse` reads; the message names the variable.

    Example::

        >>> allocator_config_of_env({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})[1].expandable_segments
        True
    """
    for name in ENV_NAMES:
        value = (env or {}).get(name)
        if value is not None:
            try:
                return name, AllocatorConfig.parse(value)
            except ValueError as err:
                raise ValueError(f"{name}={value}: {err}") from None
    return None
