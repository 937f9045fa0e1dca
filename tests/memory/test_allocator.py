"""remat.memory.allocator: one CUDA caching-allocator rule per test, on hand-made event sequences.

Every expected figure is worked out by hand in the comments from the rules of c10/cuda/CUDACachingAllocator.cpp,
not read back from the module. ``MiB`` sizes keep the arithmetic readable.
"""

import dataclasses
import random
from types import SimpleNamespace

import numpy as np
import pytest

from remat.memory.allocator import AllocatorConfig, ReplayResult, event_order, replay, replay_timeline

KiB = 1 << 10
MiB = 1 << 20


def run(sizes, config=None, frees=None):
    """Allocate ``sizes`` at events 0, 1, ...; ``frees`` maps a row to the event it is freed at."""
    frees = frees or {}
    alloc_at, free_at, event = [], [], 0
    for row in range(len(sizes)):
        while event in frees.values():
            event += 1
        alloc_at.append(event)
        free_at.append(frees.get(row, -1))
        event += 1
    return replay(sizes, alloc_at, free_at, config)


# -- round_size -------------------------------------------------------------------------------------------------
def test_rounding_to_512_bytes():
    # round_size: below kMinBlockSize -> 512; else up to a multiple of 512. One small 2 MiB segment holds it.
    r = replay([1], [0], [-1])
    assert (r.peak_allocated, r.peak_reserved, r.segments) == (512, 2 * MiB, 1)
    assert r.fragmentation_at_peak == r.largest_free_block_at_peak == 2 * MiB - 512
    # 513 -> 1024, 1024 stays 1024 (idempotent, as for the Timeline's already-rounded figures): 2048 allocated.
    assert replay([513, 1024], [0, 1], [-1, -1]).peak_allocated == 2048


def test_roundup_power2_divisions():
    # 5 MiB + 1 with 4 divisions: between 4 and 8 MiB the steps are 1 MiB -> 6 MiB; without: 5 MiB + 512.
    # Both are 1-10 MiB requests: a 20 MiB segment split (remainder > 1 MiB), so allocated is the rounded size.
    assert run([5 * MiB + 1]).peak_allocated == 5 * MiB + 512
    assert run([5 * MiB + 1], AllocatorConfig(roundup_power2_divisions=4)).peak_allocated == 6 * MiB
    # A power of two is kept; 1200 bytes is not above 512 * 4, so plain 512-rounding (1536) applies.
    assert run([4 * MiB], AllocatorConfig(roundup_power2_divisions=4)).peak_allocated == 4 * MiB
    assert run([1200], AllocatorConfig(roundup_power2_divisions=4)).peak_allocated == 1536


# -- pools and get_allocation_size -----------------------------------------------------------------------------
def test_small_pool_shares_2mib_segments():
    # <= 1 MiB is small: a 2 MiB segment; the first 1 MiB splits it, the second takes the 1 MiB remainder whole,
    # the third request (512 B) finds nothing free and gets a second 2 MiB segment.
    r = run([MiB, MiB, 512])
    assert (r.peak_reserved, r.segments, r.peak_allocated) == (4 * MiB, 2, 2 * MiB + 512)
    # Small pool splits whenever >= 512 bytes remain: 1 MiB - 512 leaves exactly 512, which the last 512 B takes.
    r = run([MiB, MiB - 512, 512])
    assert (r.peak_reserved, r.segments, r.peak_allocated) == (2 * MiB, 1, 2 * MiB)
    # 1 MiB + 1 rounds to 1 MiB + 512: large pool, a 20 MiB segment.
    assert run([MiB + 1]).peak_reserved == 20 * MiB


def test_5mib_request_gets_20mib_segment_and_second_reuses_the_split_remainder():
    # 5 MiB < kMinLargeAlloc: a kLargeBuffer (20 MiB) segment, split (15 MiB remainder > 1 MiB); the second
    # 5 MiB takes the front of the 15 MiB free block. Peak reserved is reached at event 0 with 15 MiB free.
    r = run([5 * MiB, 5 * MiB])
    assert (r.peak_reserved, r.segments, r.peak_allocated) == (20 * MiB, 1, 10 * MiB)
    assert r.reserved_at_peak_allocated == 20 * MiB
    assert r.fragmentation_at_peak == r.largest_free_block_at_peak == 15 * MiB


def test_large_requests_round_to_2mib_segments():
    assert run([30 * MiB]).peak_reserved == 30 * MiB
    # 28 MiB + 1 -> 28 MiB + 512 -> a 30 MiB segment; 2 MiB - 512 left is > 1 MiB: split, 28 MiB + 512 allocated.
    r = run([28 * MiB + 1])
    assert (r.peak_reserved, r.peak_allocated) == (30 * MiB, 28 * MiB + 512)
    # 29 MiB + 1 -> a 30 MiB segment with 1 MiB - 512 left: not > kSmallSize, no split, all 30 MiB allocated.
    r = run([29 * MiB + 1])
    assert (r.peak_reserved, r.peak_allocated) == (30 * MiB, 30 * MiB)
    # kMinLargeAlloc boundary: exactly 10 MiB gets a 10 MiB segment, 10 MiB - 512 a 20 MiB one.
    assert run([10 * MiB]).peak_reserved == 10 * MiB
    assert run([10 * MiB - 512]).peak_reserved == 20 * MiB


# -- get_free_block, should_split, free_block -------------------------------------------------------------------
def test_best_fit_takes_the_smallest_fitting_block():
    # Segments of 12, 16 and 14 MiB, all freed. 13 MiB must take the 14 (not the 16 at a lower address),
    # then 15 takes the 16 and 11 the 12: no new segment. (Any other choice leaves 15 MiB without a block.)
    r = run([12 * MiB, 16 * MiB, 14 * MiB, 13 * MiB, 15 * MiB, 11 * MiB], frees={0: 3, 1: 4, 2: 5})
    assert (r.segments, r.peak_reserved, r.final_reserved) == (3, 42 * MiB, 42 * MiB)
    # Each reuse leaves exactly 1 MiB, not > kSmallSize: unsplit, so 14 + 16 + 12 MiB are allocated.
    assert r.peak_allocated == 42 * MiB


def test_large_block_is_split_only_if_more_than_1mib_remains():
    # should_split (large pool): remaining > kSmallSize. 11 MiB in the freed 12 MiB segment leaves exactly 1 MiB:
    # not split, 12 MiB allocated, + a 20 MiB segment = 32 MiB. 11 MiB - 512 leaves 1 MiB + 512: split.
    assert run([12 * MiB, 11 * MiB, 20 * MiB], frees={0: 1}).peak_allocated == 32 * MiB
    assert run([12 * MiB, 11 * MiB - 512, 20 * MiB], frees={0: 1}).peak_allocated == 31 * MiB - 512


def test_unsplit_remainder_counts_as_allocated():
    # 5 MiB in a 20 MiB segment, freed (merges back to 20 MiB); 19.5 MiB takes it, 0.5 MiB left: no split.
    r = run([5 * MiB, 39 * MiB // 2], frees={0: 1})
    assert (r.segments, r.peak_allocated) == (1, 20 * MiB)


def test_freed_neighbours_merge_into_a_block_big_enough_for_a_later_request():
    # A, B, C, D = 5 MiB each tile one 20 MiB segment. Freeing B and C merges them into one 10 MiB block, which
    # serves 9 MiB (a 1-10 MiB request that would otherwise cudaMalloc 20 MiB more).
    r = run([5 * MiB] * 4 + [9 * MiB], frees={1: 4, 2: 5})
    assert (r.segments, r.peak_reserved) == (1, 20 * MiB)
    # Freeing B, D, then C: C merges with both neighbours into 15 MiB, enough for 14 MiB (a 14 MiB cudaMalloc).
    r = run([5 * MiB] * 4 + [14 * MiB], frees={1: 4, 3: 5, 2: 6})
    assert (r.segments, r.peak_reserved, r.peak_allocated) == (1, 20 * MiB, 20 * MiB)


def test_max_split_size_keeps_oversize_blocks_from_small_requests():
    cfg = AllocatorConfig.parse("max_split_size_mb:20")
    # Default: 12 MiB reuses the freed 30 MiB block and splits it (18 MiB left > 1 MiB): one segment.
    r = run([30 * MiB, 12 * MiB], frees={0: 1})
    assert (r.segments, r.peak_reserved) == (1, 30 * MiB)
    # 30 MiB >= max_split_size and 12 MiB < it: get_free_block refuses, a 12 MiB segment is made.
    r = run([30 * MiB, 12 * MiB], cfg, frees={0: 1})
    assert (r.segments, r.peak_reserved) == (2, 42 * MiB)
    # "Oversize" includes a block of exactly max_split_size: a freed 20 MiB segment (made for 5 MiB) is refused
    # to the next 5 MiB request, which gets a second 20 MiB segment.
    assert run([5 * MiB, 5 * MiB], frees={0: 1}).segments == 1
    assert run([5 * MiB, 5 * MiB], cfg, frees={0: 1}).segments == 2


def test_reserved_at_peak_allocated_is_taken_when_the_peak_is_first_reached():
    # 30 MiB (reserved 30) is freed; with max_split_size 20 MiB, 12 and 18 MiB may not use the cached 30 MiB
    # block and get their own segments: allocated is 30 MiB again, but reserved is now 60 MiB.
    r = run([30 * MiB, 12 * MiB, 18 * MiB], AllocatorConfig(max_split_size=20 * MiB), frees={0: 1})
    assert (r.peak_allocated, r.reserved_at_peak_allocated, r.peak_reserved) == (30 * MiB, 30 * MiB, 60 * MiB)


def test_max_split_size_oversize_requests_take_oversize_blocks_whole_within_the_rounding_limit():
    cfg = AllocatorConfig.parse("max_split_size_mb:20")
    # 25 MiB >= max_split_size takes the free 30 MiB block (30 < 25 + 20) and does not split it: the following
    # 4 MiB finds no 5 MiB remainder and cudaMallocs 20 MiB. Without max_split_size the remainder serves it.
    assert run([30 * MiB, 25 * MiB, 4 * MiB], frees={0: 1}).segments == 1
    r = run([30 * MiB, 25 * MiB, 4 * MiB], cfg, frees={0: 1})
    assert (r.segments, r.peak_reserved, r.peak_allocated) == (2, 50 * MiB, 34 * MiB)
    # A 50 MiB block is >= 25 + 20 MiB: refused, 26 MiB is cudaMalloc'd ...
    r = run([50 * MiB, 25 * MiB], cfg, frees={0: 1})
    assert (r.segments, r.peak_reserved) == (2, 76 * MiB)
    # A request of exactly max_split_size is oversize too: 50 MiB >= 20 + 20 MiB is refused.
    assert run([50 * MiB, 20 * MiB], cfg, frees={0: 1}).peak_reserved == 70 * MiB
    # The limit is exclusive: a 44 MiB block is refused to 24 MiB (44 >= 24 + 20), a 42 MiB one is taken.
    assert run([44 * MiB, 24 * MiB], cfg, frees={0: 1}).segments == 2
    assert run([42 * MiB, 24 * MiB], cfg, frees={0: 1}).segments == 1
    # ... unless max_non_split_rounding_mb allows 40 MiB of slack: then it is taken whole (50 MiB allocated).
    r = run([50 * MiB, 25 * MiB], AllocatorConfig.parse("max_split_size_mb:20,max_non_split_rounding_mb:40"),
            frees={0: 1})
    assert (r.segments, r.peak_reserved, r.peak_allocated) == (1, 50 * MiB, 50 * MiB)


# -- OOM: release_available_cached_blocks, release_cached_blocks ------------------------------------------------
def test_capacity_releases_cached_segments_then_succeeds():
    # A cached 30 MiB segment cannot hold 32 MiB; 30 + 32 > 40 MiB, so release_cached_blocks frees it first.
    cap = AllocatorConfig(capacity_bytes=40 * MiB)
    r = run([30 * MiB, 32 * MiB], cap, frees={0: 1})
    assert (r.peak_reserved, r.final_reserved, r.segments, r.num_ooms) == (32 * MiB, 32 * MiB, 2, 0)
    assert run([30 * MiB, 32 * MiB], frees={0: 1}).peak_reserved == 62 * MiB  # no capacity: both kept


def test_capacity_oom_is_counted_when_nothing_cached_can_be_released():
    # 30 MiB live + a new 20 MiB segment > 40 MiB: an OOM; the replay then allocates anyway.
    r = run([30 * MiB, 20 * MiB], AllocatorConfig(capacity_bytes=40 * MiB))
    assert (r.num_ooms, r.peak_reserved) == (1, 50 * MiB)
    # The 15 MiB free remainder of a split 20 MiB segment cannot be released: 20 + 16 > 30 MiB is an OOM.
    r = run([5 * MiB, 16 * MiB], AllocatorConfig(capacity_bytes=30 * MiB))
    assert (r.num_ooms, r.peak_reserved) == (1, 36 * MiB)


def test_release_available_cached_blocks_frees_only_oversize_blocks():
    cfg = AllocatorConfig(max_split_size=20 * MiB, capacity_bytes=60 * MiB)
    # A 2 MiB small segment and a 50 MiB segment are cached (52 MiB). 25 MiB refuses the 50 (>= 25 + 20) and
    # 52 + 26 > 60: the smallest oversize block of >= 25 MiB (the 50) is freed alone; the small one stays.
    r = run([KiB, 50 * MiB, 25 * MiB], cfg, frees={0: 1, 1: 3})
    assert (r.final_reserved, r.peak_reserved, r.segments, r.num_ooms) == (28 * MiB, 52 * MiB, 3, 0)
    # No single cached block holds 40 MiB: oversize blocks are freed from the largest (30, then 24 MiB) until
    # 40 MiB are released; the small segment stays (release_cached_blocks would have freed it: 40 MiB).
    r = run([KiB, 30 * MiB, 24 * MiB, 40 * MiB], cfg, frees={0: 1, 1: 4, 2: 5})
    assert (r.final_reserved, r.peak_reserved, r.segments, r.num_ooms) == (42 * MiB, 56 * MiB, 4, 0)


# -- expandable segments ----------------------------------------------------------------------------------------
def test_expandable_segments_reserve_mapped_pages():
    cfg = AllocatorConfig(expandable_segments=True)
    # Large pool pages are 20 MiB. 5 MiB maps one page and splits it; 30 MiB finds no 30 MiB block, grows the
    # free 15 MiB tail by one more page (35 MiB, split off 5): 40 MiB reserved instead of 20 + 30 MiB.
    r = run([5 * MiB, 30 * MiB], cfg)
    assert (r.peak_reserved, r.segments, r.peak_allocated) == (40 * MiB, 2, 35 * MiB)
    assert r.fragmentation_at_peak == r.largest_free_block_at_peak == 5 * MiB
    assert run([5 * MiB, 30 * MiB]).peak_reserved == 50 * MiB
    # Small pool pages are 2 MiB: five 768 KiB blocks (3.75 MiB) fit two pages; plain 2 MiB segments hold two
    # each (0.5 MiB left over), so three segments.
    r = run([768 * KiB] * 5, cfg)
    assert (r.peak_reserved, r.segments, r.peak_allocated) == (4 * MiB, 2, 3840 * KiB)
    assert run([768 * KiB] * 5).peak_reserved == 6 * MiB


def test_expandable_best_fit_ranks_blocks_by_the_size_they_can_grow_to():
    # One 20 MiB page: A, B, C = 6 MiB at [0,6), [6,12), [12,18), 2 MiB free at [18,20) before the unmapped rest.
    # B is freed. For 2 MiB get_free_block starts at the 2 MiB tail block, whose expandable size (2 MiB + the
    # unmapped space) exceeds the 6 MiB hole's, so it moves on and splits the hole: D = [6,8), 4 MiB free.
    # E = 5 MiB then fits nowhere and maps a second page after the 2 MiB tail: 40 MiB reserved, 2 maps.
    # (Taking the tail for D would have left the 6 MiB hole for E: 20 MiB, 1 map.)
    r = run([6 * MiB] * 3 + [2 * MiB, 5 * MiB], AllocatorConfig(expandable_segments=True), frees={1: 3})
    assert (r.peak_reserved, r.segments, r.peak_allocated) == (40 * MiB, 2, 19 * MiB)


def test_expandable_segments_unmap_free_pages_on_oom():
    # A small page (2 MiB) and three large pages (60 MiB, for 50 MiB) are mapped, then all freed. 70 MiB needs a
    # fourth large page: 62 + 20 > 80 MiB, so every free page is unmapped and 70 MiB maps four pages afresh.
    sizes, frees = [KiB, 50 * MiB, 70 * MiB], {0: 1, 1: 3}
    r = run(sizes, AllocatorConfig(expandable_segments=True, capacity_bytes=80 * MiB), frees=frees)
    assert (r.peak_reserved, r.final_reserved, r.segments, r.num_ooms) == (80 * MiB, 80 * MiB, 3, 0)
    # With 79 MiB even the fresh four pages do not fit: an OOM.
    r = run(sizes, AllocatorConfig(expandable_segments=True, capacity_bytes=79 * MiB), frees=frees)
    assert (r.num_ooms, r.final_reserved) == (1, 80 * MiB)


# -- AllocatorConfig.parse ---------------------------------------------------------------------------------------
def test_parse_reads_pytorch_alloc_conf():
    cfg = AllocatorConfig.parse("max_split_size_mb:128,expandable_segments:True")
    assert cfg == AllocatorConfig(max_split_size=128 * MiB, expandable_segments=True)
    cfg = AllocatorConfig.parse(" roundup_power2_divisions : 4 , garbage_collection_threshold:0.6,backend:native")
    assert cfg == AllocatorConfig(roundup_power2_divisions=4)
    assert AllocatorConfig.parse("") == AllocatorConfig()


@pytest.mark.parametrize(("text", "words"), [
    ("max_split_size_mb:10", ["max_split_size_mb", ">= 20"]),
    ("max_split_size_mb:lots", ["max_split_size_mb", "whole number of MiB"]),
    ("max_spilt_size_mb:128", ["'max_spilt_size_mb'", "known options"]),
    ("max_split_size_mb", ["'max_split_size_mb'", "max_split_size_mb:<value>"]),
    ("expandable_segments:", ["'expandable_segments'", "no value"]),
    ("expandable_segments:true", ["expandable_segments", "True or False"]),
    ("roundup_power2_divisions:3", ["roundup_power2_divisions", "power of two"]),
    ("roundup_power2_divisions:[256:4,>:1]", ["roundup_power2_divisions", "roundup_power2_divisions:4"]),
    ("large_segment_size_mb:8", ["large_segment_size_mb", ">= 11"]),
    ("backend:cudaMallocAsync", ["backend:cudaMallocAsync", "backend:native"]),
    ("per_process_memory_fraction:0.5", ["per_process_memory_fraction", "capacity_bytes"]),
    ("max_split_size_mb:128;expandable_segments:True", ["max_split_size_mb"]),
])
def test_parse_errors_name_the_key_and_the_fix(text, words):
    with pytest.raises(ValueError) as err:
        AllocatorConfig.parse(text)
    for word in words:
        assert word in str(err.value)


def test_config_fields_are_checked():
    with pytest.raises(ValueError, match="max_split_size"):
        AllocatorConfig(max_split_size=MiB)
    with pytest.raises(ValueError, match="roundup_power2_divisions"):
        AllocatorConfig(roundup_power2_divisions=6)
    with pytest.raises(ValueError, match="capacity_bytes"):
        AllocatorConfig(capacity_bytes=0)


# -- events ------------------------------------------------------------------------------------------------------
def test_events_and_inputs():
    # Unused event numbers are skipped; 0-byte rows never reach the allocator; numpy arrays are accepted.
    r = replay(np.array([0, 1]), np.array([0, 5]), np.array([2, -1]))
    assert (r.peak_allocated, r.peak_reserved) == (512, 2 * MiB)
    timeline = SimpleNamespace(nbytes=[5 * MiB, 5 * MiB], alloc_at=[0, 1], free_at=[2, 3])
    assert replay_timeline(timeline) == run([5 * MiB, 5 * MiB], frees={0: 2, 1: 3})
    assert replay([], [], []) == ReplayResult(0, 0, 0, 0, 0, 0, 0, 0)
    assert set(r.to_dict()) == {f.name for f in dataclasses.fields(ReplayResult)}
    with pytest.raises(ValueError, match="event 1 is already used"):
        replay([1, 1], [0, 1], [1, -1])
    with pytest.raises(ValueError, match="must be after alloc_at"):
        replay([1], [3], [2])
    with pytest.raises(ValueError, match="one entry per row"):
        replay([1, 2], [0], [1])


@pytest.mark.parametrize("config", [
    AllocatorConfig(), AllocatorConfig(expandable_segments=True), AllocatorConfig(max_split_size=24 * MiB),
    AllocatorConfig(roundup_power2_divisions=8, capacity_bytes=600 * MiB, max_split_size=40 * MiB),
    AllocatorConfig(expandable_segments=True, capacity_bytes=500 * MiB),
])
def test_random_sequences_keep_the_accounting_consistent(config):
    rnd = random.Random(7)
    sizes, alloc_at, free_at, live = [], [], [], []
    for event in range(4000):
        if live and (len(live) > 40 or rnd.random() < 0.5):
            free_at[live.pop(rnd.randrange(len(live)))] = event
        else:
            sizes.append(rnd.choice([rnd.randint(1, MiB), rnd.randint(MiB, 40 * MiB)]))
            alloc_at.append(event)
            free_at.append(-1)
            live.append(len(sizes) - 1)
    r = replay(sizes, alloc_at, free_at, config)
    # Rounded sizes only grow (splits leave slack, never shrink a block): a lower bound on allocated bytes.
    lower = max(sum(-(-s // 512) * 512 for s, a, f in zip(sizes, alloc_at, free_at) if a <= e and not 0 <= f <= e)
                for e in range(0, 4000, 97))
    assert r.peak_reserved >= r.reserved_at_peak_allocated >= r.peak_allocated >= lower
    assert r.fragmentation_at_peak >= r.largest_free_block_at_peak > 0
    assert r.peak_reserved >= r.final_reserved and r.peak_reserved % (2 * MiB) == 0
    if config.capacity_bytes is not None and r.num_ooms == 0:
        assert r.peak_reserved <= config.capacity_bytes


def test_reserved_figures_report_the_replay_beside_the_allocated_peak() -> None:
    from types import SimpleNamespace

    from remat.memory.allocator import MIB
    from remat.memory.reserved import format_reserved, reserved_figures

    # a 3 MiB block takes a 20 MiB segment (1-10 MiB requests); a 512-byte one a 2 MiB small-pool segment
    tl = SimpleNamespace(nbytes=[3 * MIB, 512], alloc_at=[0, 1], free_at=[-1, -1], peak_bytes=3 * MIB + 512)
    figures = reserved_figures(tl)
    assert (figures["max_memory_reserved"], figures["max_memory_allocated"], figures["segments"]) == (
        22 * MIB, 3 * MIB + 512, 2)
    assert figures["fragmentation_at_peak_bytes"] == 19 * MIB - 512  # reserved minus allocated at that moment
    assert figures["largest_free_block_bytes"] == 17 * MIB
    assert format_reserved(figures).startswith("reserved 22.00 MiB (+633.2% over its max_memory_allocated 3.00 MiB)")


# -- rows that share an event (a job's rank: its model state allocated together at event 0) ---------------------
def test_rows_sharing_an_event_replay_its_frees_first_then_its_allocations():
    # A and B (5 MiB) at event 0 share one 20 MiB segment; C (12 MiB) has its own 12 MiB segment and is freed at
    # event 2, where D (12 MiB) is allocated: the free first, so D takes C's cached block (no third segment).
    timeline = SimpleNamespace(nbytes=[5 * MiB, 5 * MiB, 12 * MiB, 12 * MiB], alloc_at=[0, 0, 1, 2],
                               free_at=[-1, -1, 2, -1])
    assert event_order(timeline.nbytes, timeline.alloc_at, timeline.free_at)[1] == [0, 1, 2, ~2, 3]
    r = replay_timeline(timeline)
    assert (r.peak_reserved, r.segments, r.peak_allocated) == (32 * MiB, 2, 22 * MiB)
    with pytest.raises(ValueError, match="event 0 is already used"):  # replay() itself keeps one step per event
        replay(timeline.nbytes, timeline.alloc_at, timeline.free_at)
    with pytest.raises(ValueError, match="row 1: .*free_at 0 must be after alloc_at"):
        event_order([1, 1], [0, 0], [-1, 0])


def _power_of_two_sequence(seed: int, events: int = 3000):
    """Random allocations and frees of power-of-two sizes (512 B .. 64 MiB): ``roundup_power2_divisions`` keeps
    each size as the plain 512-byte rounding does, but replays through :meth:`malloc`/:meth:`free`."""
    rnd = random.Random(seed)
    sizes, alloc_at, free_at, live = [], [], [], []
    for event in range(events):
        if live and (len(live) > 30 or rnd.random() < 0.45):
            free_at[live.pop(rnd.randrange(len(live)))] = event
        else:
            sizes.append(1 << rnd.randint(9, 26))
            alloc_at.append(event)
            free_at.append(-1)
            live.append(len(sizes) - 1)
    return sizes, alloc_at, free_at


@pytest.mark.parametrize("options", ["", "max_split_size_mb:40", "max_split_size_mb:20,max_non_split_rounding_mb:64",
                                     "large_segment_size_mb:12"])
@pytest.mark.parametrize("capacity", [None, 700 * MiB])
def test_the_inlined_replay_takes_the_same_steps_as_malloc_and_free(options, capacity):
    # the default options replay in the inlined loop (a job's ranks: tens of thousands of events), power-of-two
    # rounding through malloc/free: on power-of-two sizes both round alike, so every figure must be the same
    base = dataclasses.replace(AllocatorConfig.parse(options), capacity_bytes=capacity)
    stepwise = dataclasses.replace(base, roundup_power2_divisions=2)
    for seed in range(3):
        sequence = _power_of_two_sequence(seed)
        assert replay(*sequence, base) == replay(*sequence, stepwise)


def _pipeline_steps(seed: int, microbatches: int = 8, in_flight: int = 4, saved: int = 30):
    """A 1F1B-like step: model state, then each microbatch's forward keeping ``saved`` activations (and a temporary
    each), its backward freeing them in reverse (a gradient temporary each), up to ``in_flight`` forwards ahead."""
    rnd = random.Random(seed)
    acts = [rnd.choice([rnd.randint(1, MiB), rnd.randint(MiB, 10 * MiB), rnd.randint(10 * MiB, 300 * MiB)])
            for _ in range(saved)]
    nbytes, alloc_at, free_at = [700 * MiB, 1400 * MiB, 2800 * MiB], [0, 0, 0], [-1, -1, -1]
    event, kept, forwards, backwards = 1, {}, 0, 0

    def row(size, alive_for=None):
        nonlocal event
        nbytes.append(size)
        alloc_at.append(event)
        free_at.append(-1 if alive_for is None else event + alive_for)
        event += 1 + (alive_for or 0)
        return len(nbytes) - 1
    while backwards < microbatches:
        if forwards < microbatches and forwards - backwards < in_flight:
            kept[forwards] = [(row(s), row(s // 3 + 1, 1))[0] for s in acts]
            forwards += 1
        else:
            for r in reversed(kept.pop(backwards)):
                row(nbytes[r] * 2 // 3 + 1, 1)
                free_at[r] = event
                event += 1
            backwards += 1
    return SimpleNamespace(nbytes=nbytes, alloc_at=alloc_at, free_at=free_at)


@pytest.mark.parametrize("seed", range(4))
def test_expandable_segments_reserve_close_to_the_allocated_peak_of_a_pipelined_step(seed):
    step = _pipeline_steps(seed)
    default = replay_timeline(step)
    expandable = replay_timeline(step, AllocatorConfig(expandable_segments=True))
    # fixed segments cache blocks of the sizes they were cut for: hundreds of MiB above the allocated peak here;
    # one growing segment per pool stays within a few 20 MiB pages of it
    assert default.peak_reserved - default.peak_allocated > 100 * MiB
    assert expandable.peak_allocated <= expandable.peak_reserved <= expandable.peak_allocated + 2 * 20 * MiB + 2 * MiB
    for r in (default, expandable):
        assert r.peak_reserved >= r.reserved_at_peak_allocated >= r.peak_allocated
        assert r.peak_reserved - r.peak_allocated <= r.fragmentation_at_peak


def test_the_options_are_written_back_and_read_from_a_processs_environment():
    import doctest

    import remat.memory.alloc_config as alloc_config
    import remat.memory.allocator as allocator

    for text in ("", "expandable_segments:True", "max_split_size_mb:512,roundup_power2_divisions:4",
                 "large_segment_size_mb:64,max_non_split_rounding_mb:128"):
        config = AllocatorConfig.parse(text)
        assert AllocatorConfig.parse(config.text()) == config
    assert AllocatorConfig.parse("expandable_segments:False,garbage_collection_threshold:0.6").text() == ""
    env = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128", "PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    assert alloc_config.allocator_config_of_env(env) == ("PYTORCH_ALLOC_CONF",
                                                         AllocatorConfig(expandable_segments=True))
    assert alloc_config.allocator_config_of_env({"PATH": "/bin"}) is None
    with pytest.raises(ValueError, match="PYTORCH_CUDA_ALLOC_CONF=foo:1: unknown allocator option 'foo'"):
        alloc_config.allocator_config_of_env({"PYTORCH_CUDA_ALLOC_CONF": "foo:1"})
    for module in (alloc_config, allocator):
        assert doctest.testmod(module).failed == 0


def test_a_replay_is_kept_in_the_disk_cache_under_its_rows_and_options(tmp_path, monkeypatch):
    import remat.memory.reserved as reserved

    monkeypatch.setenv("REMAT_CACHE_DIR", str(tmp_path))
    step = _pipeline_steps(0, microbatches=2, saved=5)
    first = reserved.cached_replay(step)
    assert first == replay_timeline(step)

    def no_replay(*args, **kwargs):
        raise AssertionError("replayed again")

    monkeypatch.setattr(reserved, "replay_timeline", no_replay)
    assert reserved.cached_replay(step) == first  # read back
    with pytest.raises(AssertionError, match="replayed again"):  # other options, other rows: other entries
        reserved.cached_replay(step, AllocatorConfig(expandable_segments=True))
    step.nbytes[-1] += 512
    with pytest.raises(AssertionError, match="replayed again"):
        reserved.cached_replay(step)
