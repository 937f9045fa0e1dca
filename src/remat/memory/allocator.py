"""A replay of PyTorch's CUDA caching allocator (``c10/cuda/CUDACachingAllocator.cpp``, PyTorch 2.13).

:func:`replay` runs a sequence of allocations and frees through the allocator's rules - request rounding, small
and large pools, best fit, splitting, merging, new segments, cache release on OOM, expandable segments, the
streams' own pools - and returns what ``torch.cuda.max_memory_reserved()`` and friends would report, without a
GPU. Comments name the C++ function of each rule (``DeviceCachingAllocator``, ``c10/core/AllocatorConfig``).

NOTE [streams' pools]: a block belongs to the stream that was current when it was allocated (``Block::stream``).
``get_free_block`` and ``release_available_cached_blocks`` search a pool's blocks ordered by (stream, size,
address) from ``(stream, size)`` on and stop at another stream's, and an expandable segment serves only its own
stream (``find_expandable_block``): one stream never reuses a block another freed, so each stream here has its own
small and large pools. Only ``release_cached_blocks`` (the last try before an OOM) frees every stream's cached
segments. A block freed while another stream still uses it waits for that stream's event (``record_stream``):
not modelled (the allocations replayed here are kept alive by their owners instead, as FSDP2's are).
Not modelled either: CUDA graph pools, ``garbage_collection_threshold``, memory fractions.
"""

from __future__ import annotations

import gc
from bisect import bisect_left, insort
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

from remat.memory.alloc_config import (
    MIB as MIB,  # re-exported: the sizes of the examples and tests
)
from remat.memory.alloc_config import (  # the constants of c10/core/AllocatorConfig.h, the options, the sizes
    MIN_BLOCK_SIZE,
    SMALL_BUFFER,
    SMALL_SIZE,
    AllocatorConfig,
    allocation_size,
    round_size,
)
from remat.units import round_up

if TYPE_CHECKING:
    from remat.timeline import Timeline

_SHIFT = 64                 # free-list key: size << _SHIFT | address, one int ordered like (size, address)
_MASK = (1 << _SHIFT) - 1
_NO_LIMIT = 1 << 80         # max_split_size when unset (SIZE_MAX)
_ADDRESS_SPACE = 1 << 50    # an expandable segment's address space when no capacity is given


@dataclass(frozen=True)
class ReplayResult:
    """What the allocator would report after the replayed sequence, in bytes.

    Attributes:
        peak_allocated: ``torch.cuda.max_memory_allocated()``: most bytes in allocated blocks (their sizes:
            rounded requests plus any remainder of a reused block left unsplit).
        peak_reserved: ``torch.cuda.max_memory_reserved()``: most bytes in segments (or mapped pages).
        reserved_at_peak_allocated: reserved bytes when ``peak_allocated`` was first reached.
        fragmentation_at_peak: reserved minus allocated (cached free bytes) after the event that set
            ``peak_reserved``.
        largest_free_block_at_peak: the biggest cached free block after that event.
        segments: cudaMalloc calls, or page-mapping calls with expandable segments (``num_device_alloc``).
        num_ooms: allocations that would raise OutOfMemoryError even after releasing the cache (the replay then
            allocates anyway, past the capacity).
        final_reserved: reserved bytes after the last event (no ``empty_cache``).
    """

    peak_allocated: int
    peak_reserved: int
    reserved_at_peak_allocated: int
    fragmentation_at_peak: int
    largest_free_block_at_peak: int
    segments: int
    num_ooms: int
    final_reserved: int

    def to_dict(self) -> dict[str, int]:
        """The fields as a plain dict (for JSON)."""
        return asdict(self)


class _Pool:
    """``BlockPool``: free mapped blocks by (size, address) (``BlockComparatorSize``, one stream's: NOTE [streams'
    pools]) and, for expandable segments, unmapped blocks by address (``BlockComparatorAddress``)."""

    __slots__ = ("small", "keys", "unmapped")

    def __init__(self, small: bool):
        self.small, self.keys, self.unmapped = small, [], []


class _Block:
    """``Block``: a range of a segment. ``seg`` is ``(base, page)`` of its expandable segment, else ``None``."""

    __slots__ = ("addr", "size", "pool", "seg", "prev", "next", "allocated", "mapped")

    def __init__(self, addr: int, size: int, pool: _Pool, seg: tuple[int, int] | None = None, mapped: bool = True):
        self.addr, self.size, self.pool, self.seg, self.mapped = addr, size, pool, seg, mapped
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.allocated = False

    def splice(self, before: _Block | None, after: _Block | None) -> _Block:
        """``Block::splice``: link this block between ``before`` and ``after``."""
        self.prev, self.next = before, after
        if before is not None:
            before.next = self
        if after is not None:
            after.prev = self
        return self


class _Replayer:
    """One device's ``DeviceCachingAllocator``: the default stream's pools, and each other stream's (made when it
    first allocates: NOTE [streams' pools])."""

    def __init__(self, config: AllocatorConfig):
        self.cfg, self.cap, self.expandable = config, config.capacity_bytes, config.expandable_segments
        self.mss = _NO_LIMIT if config.max_split_size is None else config.max_split_size
        self.pools: dict[int, tuple[_Pool, _Pool]] = {0: (_Pool(True), _Pool(False))}  # stream -> (small, large)
        self.at: dict[int, _Block] = {}  # address -> each block in a pool's keys or unmapped list
        self.next_base = SMALL_BUFFER  # addresses in creation order (the driver's real ones are unknowable)
        self.allocated = self.reserved = self.segments = self.num_ooms = 0
        self.peak_allocated = self.reserved_at_peak_allocated = 0
        self.peak_reserved = self.fragmentation = self.largest_free = 0
        self.new_peak = False

    def _insert(self, b: _Block) -> None:  # BlockPool::insert_into_blocks / unmapped.insert
        if b.mapped:
            insort(b.pool.keys, b.size << _SHIFT | b.addr)
        else:
            insort(b.pool.unmapped, b.addr)
        self.at[b.addr] = b

    def _remove(self, b: _Block) -> None:  # blocks.erase / unmapped.erase
        if b.mapped:
            keys = b.pool.keys
            del keys[bisect_left(keys, b.size << _SHIFT | b.addr)]
        else:
            del b.pool.unmapped[bisect_left(b.pool.unmapped, b.addr)]
        del self.at[b.addr]

    def _grow(self, nbytes: int) -> None:  # increase_stat(reserved_bytes); num_device_alloc++
        self.reserved += nbytes
        self.segments += 1
        if self.reserved > self.peak_reserved:
            self.peak_reserved, self.new_peak = self.reserved, True

    def _try_merge(self, dst: _Block, src: _Block | None) -> None:
        """``try_merge_blocks``: absorb a free neighbour in the same mapped state."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return
        self._remove(src)
        if dst.prev is src:
            dst.addr, dst.prev = src.addr, src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size

    def run(self, order: Sequence[int], sizes: Sequence[int], streams: Sequence[int] | None = None) -> None:
        """Replay ``order`` (row ``i``: allocate ``sizes[i]`` on stream ``streams[i]``, default 0; ``~i``: free row
        ``i``'s block). With the default stream alone, and without expandable segments or power-of-two rounding,
        :meth:`malloc` and :meth:`free` are inlined here (the same steps: best fit, split, merge; a new segment
        through :meth:`_alloc_new`), as a job's ranks replay tens of thousands of events each."""
        live: list[_Block] = [None] * len(sizes)  # type: ignore[list-item]  # each row's block, set before its free
        if self.expandable or self.cfg.roundup_power2_divisions > 1 or streams is not None:
            malloc, release = self.malloc, self.free
            for e in order:
                if e >= 0:
                    live[e] = malloc(sizes[e], streams[e] if streams is not None else 0)
                else:
                    release(live[~e])
            return
        (small, large), at = self.pools[0], self.at
        small_keys, large_keys = small.keys, large.keys
        mss, limit = self.mss, self.cfg.max_non_split_rounding_size
        any_fit = mss == _NO_LIMIT  # no max_split_size: the best fit is always taken
        allocated, peak = self.allocated, self.peak_allocated
        for e in order:
            if e >= 0:  # malloc
                size = (sizes[e] + 511) & -MIN_BLOCK_SIZE  # round_size (rows of 0 bytes are left out)
                if size <= SMALL_SIZE:
                    pool, keys = small, small_keys
                else:
                    pool, keys = large, large_keys
                i = bisect_left(keys, size << _SHIFT)
                if i < len(keys) and (any_fit or not (  # _get_free_block: best fit, unless max_split_size keeps it
                        (have := keys[i] >> _SHIFT) >= mss > size or size >= mss and have >= size + limit)):
                    b = at.pop(keys.pop(i) & _MASK)
                    grew = False
                else:
                    b, grew = self._alloc_new(pool, size), True
                remaining = b.size - size
                if remaining >= MIN_BLOCK_SIZE if pool is small else size < mss and remaining > SMALL_SIZE:
                    block = _Block(b.addr, size, pool).splice(b.prev, b)
                    b.addr += size
                    b.size = remaining
                    insort(keys, remaining << _SHIFT | b.addr)
                    at[b.addr] = b
                    b = block
                b.allocated = True
                allocated += b.size
                if allocated > peak:
                    peak, self.reserved_at_peak_allocated = allocated, self.reserved
                if grew and self.new_peak:
                    self.new_peak = False
                    self.fragmentation = self.reserved - allocated
                    self.largest_free = self._largest_free()
                live[e] = b
            else:  # free: merge with free neighbours (_try_merge), back into the pool
                b = live[~e]
                b.allocated = False
                allocated -= b.size
                keys = small_keys if b.pool is small else large_keys
                p = b.prev
                if p is not None and not p.allocated:
                    del keys[bisect_left(keys, p.size << _SHIFT | p.addr)], at[p.addr]
                    b.addr, b.prev = p.addr, p.prev
                    if p.prev is not None:
                        p.prev.next = b
                    b.size += p.size
                p = b.next
                if p is not None and not p.allocated:
                    del keys[bisect_left(keys, p.size << _SHIFT | p.addr)], at[p.addr]
                    b.next = p.next
                    if p.next is not None:
                        p.next.prev = b
                    b.size += p.size
                insort(keys, b.size << _SHIFT | b.addr)
                at[b.addr] = b
        self.allocated, self.peak_allocated = allocated, peak

    def malloc(self, nbytes: int, stream: int = 0) -> _Block:
        """``malloc`` on ``stream``: round, take a cached block of the stream or make a segment, split
        (``alloc_found_block``)."""
        div = self.cfg.roundup_power2_divisions
        size = round_size(nbytes, div) if div > 1 or nbytes < MIN_BLOCK_SIZE else (nbytes + 511) & -MIN_BLOCK_SIZE
        pools = self.pools.get(stream) or self.pools.setdefault(stream, (_Pool(True), _Pool(False)))
        pool = pools[0] if size <= SMALL_SIZE else pools[1]  # get_pool
        b = self._get_free_block(pool, size) or self._alloc_new(pool, size)
        remaining = b.size - size
        # should_split: in the small pool or with expandable segments any remainder >= kMinBlockSize; in the large
        # pool only below max_split_size and if more than kSmallSize remains. The front part is handed out.
        if remaining >= MIN_BLOCK_SIZE if pool.small or self.expandable else (
                size < self.mss and remaining > SMALL_SIZE):
            block = _Block(b.addr, size, pool, b.seg).splice(b.prev, b)
            b.addr += size
            b.size = remaining
            self._insert(b)
            b = block
        b.allocated = True
        self.allocated += b.size
        if self.allocated > self.peak_allocated:
            self.peak_allocated, self.reserved_at_peak_allocated = self.allocated, self.reserved
        if self.new_peak:
            self.new_peak = False
            self.fragmentation = self.reserved - self.allocated
            self.largest_free = self._largest_free()
        return b

    def _largest_free(self) -> int:
        """The largest cached free block of any stream."""
        return max((p.keys[-1] >> _SHIFT for pools in self.pools.values() for p in pools if p.keys), default=0)

    def free(self, b: _Block) -> None:
        """``free`` / ``free_block``: merge with free neighbours, back into the pool."""
        b.allocated = False
        self.allocated -= b.size
        for neighbour in (b.prev, b.next):
            self._try_merge(b, neighbour)
        self._insert(b)

    def _get_free_block(self, pool: _Pool, size: int) -> _Block | None:
        """``get_free_block``: best fit, the smallest (then lowest-address) free block of at least ``size``."""
        keys, at = pool.keys, self.at
        i = bisect_left(keys, size << _SHIFT)
        if i == len(keys):
            return None
        b = at[keys[i] & _MASK]
        if b.seg is not None:
            # Expandable: a block's size for best fit is what it can grow to (plus an unmapped block after it);
            # move on while the next candidate's is smaller.
            grow = b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)
            while i + 1 < len(keys):
                nb = at[keys[i + 1] & _MASK]
                ngrow = nb.size + (nb.next.size if nb.next is not None and not nb.next.mapped else 0)
                if ngrow >= grow:
                    break
                i, b, grow = i + 1, nb, ngrow
        if size < self.mss and b.size >= self.mss:  # no oversized block for a smaller request
            return None
        if size >= self.mss and b.size >= size + self.cfg.max_non_split_rounding_size:  # oversize within a limit
            return None
        del keys[i], at[b.addr]
        return b

    def _alloc_new(self, pool: _Pool, size: int) -> _Block:
        """``malloc``'s fallbacks: alloc_block; release_available_cached_blocks and alloc_block again;
        release_cached_blocks and alloc_block again; else an OOM, counted, and the segment made anyway."""
        alloc_size = allocation_size(size, self.cfg.large_segment_size)
        b = self._alloc_block(pool, size, alloc_size)
        if b is None and self._release_available_cached_blocks(pool, size):
            b = self._alloc_block(pool, size, alloc_size)
        if b is None:
            self._release_cached_blocks()
            b = self._alloc_block(pool, size, alloc_size)
        if b is None:
            self.num_ooms += 1
            b = self._alloc_block(pool, size, alloc_size, force=True)
        assert b is not None
        return b

    def _alloc_block(self, pool: _Pool, size: int, alloc_size: int, force: bool = False) -> _Block | None:
        """``alloc_block``: cudaMalloc ``alloc_size`` (fails past the capacity), or grow an expandable segment."""
        if self.expandable:
            return self._try_allocate_expandable_block(pool, size, force)
        if not force and self.cap is not None and self.reserved + alloc_size > self.cap:
            return None
        b = _Block(self.next_base, alloc_size, pool)
        self.next_base += alloc_size
        self._grow(alloc_size)
        return b

    def _release_block(self, b: _Block) -> None:  # release_block: cudaFree a whole cached segment
        self._remove(b)
        self.reserved -= b.size

    def _release_available_cached_blocks(self, pool: _Pool, size: int) -> bool:
        """``release_available_cached_blocks``: if max_split_size is set, free the smallest cached oversize block
        of at least max(size, max_split_size), else oversize blocks from the largest down until that many bytes."""
        if self.cfg.max_split_size is None:
            return False
        keys, at, target = pool.keys, self.at, max(size, self.mss)
        i = bisect_left(keys, target << _SHIFT)
        if i < len(keys) and at[keys[i] & _MASK].seg is None:
            b = at[keys[i] & _MASK]
            if b.prev is not None or b.next is not None:  # split: not a cudaMalloc pointer, keep it
                return False
            self._release_block(b)
            return True
        released, i = 0, i - 1
        while released < target and i >= 0 and (b := at[keys[i] & _MASK]).size >= self.mss:
            if b.seg is None and b.prev is None and b.next is None:
                self._release_block(b)
                released += b.size
            i -= 1
        return released >= target

    def _release_cached_blocks(self) -> None:
        """``release_cached_blocks`` / ``release_blocks``: free each unsplit cached segment of every stream (large
        pools, then small), unmap the whole free pages of expandable segments and drop segments left wholly
        unmapped."""
        streams = sorted(self.pools)
        for pool in [self.pools[s][1] for s in streams] + [self.pools[s][0] for s in streams]:
            to_unmap = []
            for b in [self.at[key & _MASK] for key in pool.keys]:
                if b.seg is not None:
                    to_unmap.append(b)
                elif b.prev is None and b.next is None:
                    self._release_block(b)
            for b in to_unmap:
                self._unmap_block(b)
                if not b.mapped and b.prev is None and b.next is None:  # release_expandable_segment
                    self._remove(b)

    def _find_expandable_block(self, pool: _Pool, size: int) -> _Block:
        """``find_expandable_block``: the lowest unmapped block, or the free block before it, with ``size`` bytes
        of free or unmapped room from there; else a new segment of 2 MiB (small) or large_segment_size pages."""
        for addr in pool.unmapped:
            c = self.at[addr]
            if c.prev is not None and not c.prev.allocated:
                c = c.prev
            room, x = 0, c
            while room < size and x is not None and not x.allocated:
                room, x = room + x.size, x.next
            if room >= size:
                return c
        page = SMALL_BUFFER if pool.small else self.cfg.large_segment_size
        # ExpandableSegment: address space for 1 1/8 of the device memory, in whole pages.
        space = _ADDRESS_SPACE if self.cap is None else self.cap + self.cap // 8
        space = round_up(space, page)
        c = _Block(self.next_base, space, pool, (self.next_base, page), mapped=False)
        self.next_base += space
        self._insert(c)
        return c

    def _try_allocate_expandable_block(self, pool: _Pool, size: int, force: bool) -> _Block | None:
        """``try_allocate_expandable_block``: map pages until the candidate holds ``size`` bytes."""
        c = self._find_expandable_block(pool, size)
        if not c.mapped and not self._map_block(c, min(c.size, size), force):
            return None
        while c.size < size:
            nc = c.next
            assert nc is not None
            if not self._map_block(nc, min(size - c.size, nc.size), force):
                return None
            c = nc
        self._remove(c)
        return c

    def _map_block(self, b: _Block, size: int, force: bool) -> bool:
        """``map_block`` / ``ExpandableSegment::map``: map the whole pages covering ``size`` bytes, all or none."""
        assert b.seg is not None
        base, page = b.seg
        mapped = round_up(b.addr - base + size, page) - (b.addr - base)
        if not force and self.cap is not None and self.reserved + mapped > self.cap:
            return False
        self._remove(b)
        b.mapped = True
        if mapped < b.size:
            self._insert(_Block(b.addr + mapped, b.size - mapped, b.pool, b.seg, mapped=False).splice(b, b.next))
            b.size = mapped
        self._try_merge(b, b.prev)
        self._try_merge(b, b.next)
        self._insert(b)
        self._grow(mapped)
        return True

    def _unmap_block(self, b: _Block) -> None:
        """``unmap_block`` / ``ExpandableSegment::unmap``: unmap the whole pages inside a free block."""
        assert b.seg is not None
        base, page = b.seg
        first, last = -(-(b.addr - base) // page), (b.addr + b.size - base) // page
        if first >= last:
            return
        self._remove(b)
        start, length = base + first * page, (last - first) * page
        if start > b.addr:
            self._insert(_Block(b.addr, start - b.addr, b.pool, b.seg).splice(b.prev, b))
        if b.addr + b.size > start + length:
            self._insert(_Block(start + length, b.addr + b.size - start - length, b.pool, b.seg).splice(b, b.next))
        b.addr, b.size, b.mapped = start, length, False
        self._try_merge(b, b.prev)
        self._try_merge(b, b.next)
        self._insert(b)
        self.reserved -= length


def replay(nbytes: Sequence[int], alloc_at: Sequence[int], free_at: Sequence[int],
           config: AllocatorConfig | None = None, streams: Sequence[int] | None = None) -> ReplayResult:
    """Replay allocations and frees through the CUDA caching allocator.

    Rows are allocations: row ``i`` asks ``nbytes[i]`` at event ``alloc_at[i]`` and is freed at event
    ``free_at[i]`` (-1: never). Events run in number order, each one alloc or one free (numbers are unique across
    ``alloc_at`` and ``free_at`` but for -1; unused numbers are skipped). 0-byte rows are skipped, as
    ``allocate(0)`` never reaches the caching allocator.

    Args:
        nbytes: bytes requested per row (figures already rounded to 512 are fine: rounding is idempotent).
        alloc_at: event of each row's allocation.
        free_at: event of each row's free, -1 for never.
        config: allocator options and device capacity; default: PyTorch's defaults, unlimited memory.
        streams: the stream each row is allocated on (0: the default stream; others are numbered as the caller
            likes); blocks go back to their stream's own pools (NOTE [streams' pools]). Default: all on stream 0.

    Returns:
        The :class:`ReplayResult`.

    Raises:
        ValueError: rows of different lengths, a negative size or event, an event used twice, a free that is not
            after its allocation, or a negative stream.

    Example::

        >>> r = replay([5 * MIB, 5 * MIB], [0, 1], [2, 3])  # both 5 MiB blocks share one 20 MiB segment
        >>> r.peak_reserved // MIB, r.peak_allocated // MIB, r.segments
        (20, 10, 1)
        >>> replay([5 * MIB, 5 * MIB], [0, 2], [1, 3], streams=[1, 0]).peak_reserved // MIB  # not shared
        40
    """
    sizes, alloc, free = (v.tolist() if hasattr(v, "tolist") else list(v) for v in (nbytes, alloc_at, free_at))
    n = len(sizes)
    if len(alloc) != n or len(free) != n:
        raise ValueError(f"nbytes, alloc_at and free_at need one entry per row; got {n}, {len(alloc)}, {len(free)}")
    stream_list = _checked_streams(streams, n)
    num_events = max(max(alloc, default=-1), max(free, default=-1)) + 1
    order: list[int | None] = [None] * num_events  # row i (alloc), ~i (free); None: no event or a 0-byte row
    used = bytearray(num_events)
    for i in range(n):
        a, f = alloc[i], free[i]
        if sizes[i] < 0 or a < 0:
            raise ValueError(f"row {i}: nbytes {sizes[i]} and alloc_at {a} must not be negative")
        if f != -1 and f <= a:
            raise ValueError(f"row {i}: free_at {f} must be after alloc_at {a} (or -1 for never freed)")
        for e in (a, f) if f != -1 else (a,):
            if used[e]:
                raise ValueError(f"row {i}: event {e} is already used by another alloc or free; give each its own")
            used[e] = 1
        if sizes[i]:
            order[a] = i
            if f != -1:
                order[f] = ~i
    return _run(sizes, [e for e in order if e is not None], config, stream_list)


def _checked_streams(streams: Sequence[int] | None, rows: int) -> list[int] | None:
    """``streams`` as a list of ints, one per row; None when every row is on the default stream."""
    if streams is None:
        return None
    out = [int(s) for s in (streams.tolist() if hasattr(streams, "tolist") else streams)]
    if len(out) != rows:
        raise ValueError(f"streams: give one stream per row ({rows}), got {len(out)}")
    if any(s < 0 for s in out):
        raise ValueError("streams: a row's stream is a number >= 0 (0: the default stream)")
    return out if any(out) else None


def _run(sizes: Sequence[int], order: Sequence[int], config: AllocatorConfig | None,
         streams: list[int] | None = None) -> ReplayResult:
    r = _Replayer(config or AllocatorConfig())
    collecting = gc.isenabled()
    gc.disable()  # the blocks link to each other: the collector would walk them again and again, finding nothing
    try:
        r.run(order, sizes, streams)
    finally:
        if collecting:
            gc.enable()
    return ReplayResult(r.peak_allocated, r.peak_reserved, r.reserved_at_peak_allocated, r.fragmentation,
                        r.largest_free, r.segments, r.num_ooms, r.reserved)


def event_order(nbytes: Sequence[int], alloc_at: Sequence[int], free_at: Sequence[int]) -> tuple[list[int], list[int]]:
    """The allocations and frees of rows that may share an event, in the order a replay runs them.

    A job's rank allocates its model state together at event 0 (:mod:`remat.parallel.job_predict`): rows share
    events there. Events run in number order; within one, its frees first, then its allocations, each in row order
    (so the bytes allocated after each event are the timeline's). 0-byte rows are left out.

    Args:
        nbytes, alloc_at, free_at: as for :func:`replay`, events may be shared.

    Returns:
        ``(sizes, order)``: the rows' bytes as ints, and the steps: ``i`` allocates row ``i``, ``~i`` frees it.

    Raises:
        ValueError: rows of different lengths, a negative size or event, or a free that is not after its allocation.

    Example::

        >>> event_order([512, 1024, 2048], [0, 0, 1], [1, -1, -1])[1]  # row 0 is freed before row 2 is allocated
        [0, 1, -1, 2]
    """
    nb, alloc, free = (np.asarray(v, dtype=np.int64).reshape(-1) for v in (nbytes, alloc_at, free_at))
    n = len(nb)
    if len(alloc) != n or len(free) != n:
        raise ValueError(f"nbytes, alloc_at and free_at need one entry per row; got {n}, {len(alloc)}, {len(free)}")
    bad = np.flatnonzero((nb < 0) | (alloc < 0) | ((free != -1) & (free <= alloc)))
    if len(bad):
        i = int(bad[0])
        raise ValueError(f"row {i}: nbytes {nb[i]} and alloc_at {alloc[i]} must not be negative, and free_at "
                         f"{free[i]} must be after alloc_at (or -1 for never freed)")
    rows = np.flatnonzero(nb > 0)
    freed = rows[free[rows] != -1]
    steps = np.concatenate([rows, ~freed])
    # key: event, then frees (0) before allocations (1), then row
    first = np.lexsort((np.concatenate([rows, freed]), np.concatenate([np.ones_like(rows), np.zeros_like(freed)]),
                        np.concatenate([alloc[rows], free[freed]])))
    return nb.tolist(), steps[first].tolist()


def replay_timeline(timeline: Timeline, config: AllocatorConfig | None = None,
                    streams: Sequence[int] | None = None) -> ReplayResult:
    """Replay a :class:`~remat.timeline.Timeline`, or any object with ``nbytes``, ``alloc_at`` and ``free_at``.

    Args:
        timeline: the allocations, one row each (see :func:`replay`); rows may share an event (:func:`event_order`:
            its frees first, then its allocations).
        config: allocator options and device capacity.
        streams: each row's stream, as for :func:`replay`.

    Returns:
        The :class:`ReplayResult` of :func:`replay` over its rows.

    Example::

        >>> from types import SimpleNamespace
        >>> replay_timeline(SimpleNamespace(nbytes=[1], alloc_at=[0], free_at=[-1])).peak_reserved // MIB
        2
    """
    sizes, order = event_order(timeline.nbytes, timeline.alloc_at, timeline.free_at)
    return _run(sizes, order, config, _checked_streams(streams, len(sizes)))
