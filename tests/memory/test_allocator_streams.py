"""remat.memory.allocator's streams (NOTE [streams' pools]): each stream reuses only the blocks it allocated, and
the FSDP2 rows the reserved replay puts on theirs (remat.memory.reserved.allocation_streams).

Every expected figure is worked out by hand from c10/cuda/CUDACachingAllocator.cpp, as in test_allocator.py.
"""

from __future__ import annotations

import random

import pytest

from remat.job import parse_megatron_args
from remat.memory.allocator import AllocatorConfig, replay, replay_timeline
from remat.memory.reserved import allocation_streams, reserved_figures
from remat.memory.torch_fsdp2 import ALL_GATHER_MODULE, ALLOCATION_STREAMS, SHARDED_GRADS_MODULE
from remat.parallel.job_predict import predict_stage

KiB = 1 << 10
MiB = 1 << 20


def test_a_block_freed_on_one_stream_is_not_reused_by_another():
    # 5 MiB on stream 1 takes a 20 MiB segment and frees it; 5 MiB on the default stream finds no block of its own
    # stream and makes a second segment: 40 MiB reserved. On one stream the second reuses the first's: 20 MiB.
    sizes, alloc_at, free_at = [5 * MiB, 5 * MiB], [0, 2], [1, 3]
    r = replay(sizes, alloc_at, free_at, streams=[1, 0])
    assert (r.peak_reserved, r.segments, r.final_reserved) == (40 * MiB, 2, 40 * MiB)
    for same in ([1, 1], [0, 0], None):
        assert replay(sizes, alloc_at, free_at, streams=same).peak_reserved == 20 * MiB
    # the small pool alike: a 2 MiB segment per stream
    r = replay([KiB, KiB], alloc_at, free_at, streams=[0, 2])
    assert (r.peak_reserved, r.segments) == (4 * MiB, 2)


def test_a_stream_splits_and_merges_its_own_segments():
    # stream 1: A, B = 5 MiB in one 20 MiB segment, both freed (merged back to 20 MiB), then C = 12 MiB splits it
    # (8 MiB left); the default stream's 12 MiB needs its own segment (>= 10 MiB: rounded to 2 MiB, 12 MiB), and
    # stream 1's 8 MiB then takes stream 1's remainder whole
    r = replay([5 * MiB, 5 * MiB, 12 * MiB, 12 * MiB, 8 * MiB], [0, 1, 4, 5, 6], [2, 3, -1, -1, -1],
               streams=[1, 1, 1, 0, 1])
    assert (r.segments, r.final_reserved, r.peak_allocated) == (2, 32 * MiB, 32 * MiB)
    # reserved peaked when stream 0's segment was made: stream 1's 8 MiB remainder was then the largest free block
    assert r.largest_free_block_at_peak == 8 * MiB
    # a sixth row of 8 MiB on stream 0 finds no room in stream 0's segment: a third (20 MiB, for a 1-10 MiB request)
    r = replay([5 * MiB, 5 * MiB, 12 * MiB, 12 * MiB, 8 * MiB], [0, 1, 4, 5, 6], [2, 3, -1, -1, -1],
               streams=[1, 1, 1, 0, 0])
    assert (r.segments, r.final_reserved) == (3, 52 * MiB)


def test_an_oom_releases_every_streams_cache_but_a_streams_own_search_does_not():
    cfg = AllocatorConfig(max_split_size=20 * MiB, capacity_bytes=60 * MiB)
    # A 2 MiB small segment (stream 0) and a 50 MiB segment (stream 1) are cached; 25 MiB on stream 0 needs a 26 MiB
    # segment, and 52 + 26 > 60 MiB. release_available_cached_blocks searches stream 0's blocks only: none, so
    # release_cached_blocks frees both cached segments: 26 MiB reserved at the end.
    sizes, alloc_at, free_at = [KiB, 50 * MiB, 25 * MiB], [0, 2, 4], [1, 3, -1]
    r = replay(sizes, alloc_at, free_at, cfg, streams=[0, 1, 0])
    assert (r.final_reserved, r.peak_reserved, r.segments, r.num_ooms) == (26 * MiB, 52 * MiB, 3, 0)
    # on one stream it finds the oversize 50 MiB block and frees it alone: the small segment stays (28 MiB)
    assert replay(sizes, alloc_at, free_at, cfg).final_reserved == 28 * MiB


def test_an_expandable_segment_serves_only_its_own_stream():
    # 4 MiB on stream 1 maps a 20 MiB page of stream 1's segment and frees it (mapped, cached); 4 MiB on stream 0
    # cannot grow into it: stream 0's own segment maps a second page
    cfg = AllocatorConfig(expandable_segments=True)
    sizes, alloc_at, free_at = [4 * MiB, 4 * MiB], [0, 2], [1, 3]
    r = replay(sizes, alloc_at, free_at, cfg, streams=[1, 0])
    assert (r.peak_reserved, r.segments) == (40 * MiB, 2)
    assert replay(sizes, alloc_at, free_at, cfg).peak_reserved == 20 * MiB


@pytest.mark.parametrize("options", ["", "expandable_segments:True", "max_split_size_mb:40"])
def test_two_streams_that_never_meet_reserve_what_each_reserves_alone(options):
    # with no capacity nothing is released: two interleaved sequences on their own streams end with the segments
    # and the reserved bytes of both replayed apart, and allocate at most their sum
    cfg = AllocatorConfig.parse(options)
    rnd = random.Random(7)
    sequences = []
    for _ in range(2):
        live: list[int] = []
        sizes, events = [], []  # events: ("a", row) | ("f", row), in order
        for _ in range(150):
            if live and rnd.random() < 0.45:
                events.append(("f", live.pop(rnd.randrange(len(live)))))
            else:
                sizes.append(rnd.choice([rnd.randint(1, MiB), rnd.randint(MiB, 12 * MiB), rnd.randint(12 * MiB,
                                                                                                    90 * MiB)]))
                live.append(len(sizes) - 1)
                events.append(("a", len(sizes) - 1))
        sequences.append((sizes, events))

    def rows(parts):
        nbytes, alloc_at, free_at, streams, event = [], [], [], [], 0
        offsets = []
        for stream, (sizes, _) in parts:
            offsets.append(len(nbytes))
            nbytes += sizes
            alloc_at += [0] * len(sizes)
            free_at += [-1] * len(sizes)
            streams += [stream] * len(sizes)
        longest = max(len(events) for _, (_, events) in parts)
        for i in range(longest):  # interleaved: one event of each stream in turn
            for part, (_, (_, events)) in enumerate(parts):
                if i < len(events):
                    kind, row = events[i]
                    (alloc_at if kind == "a" else free_at)[offsets[part] + row] = event
                    event += 1
        return nbytes, alloc_at, free_at, streams

    apart = [replay(*rows([(0, seq)])[:3], cfg) for seq in sequences]
    *columns, streams = rows([(0, sequences[0]), (1, sequences[1])])
    together = replay(*columns, cfg, streams=streams)
    assert together.segments == apart[0].segments + apart[1].segments
    assert together.final_reserved == apart[0].final_reserved + apart[1].final_reserved
    assert together.peak_allocated <= apart[0].peak_allocated + apart[1].peak_allocated
    one_stream = replay(*rows([(0, sequences[0]), (0, sequences[1])])[:3], cfg)
    assert together.peak_reserved >= max(a.peak_reserved for a in apart)
    assert one_stream.segments <= together.segments  # one stream reuses what the other freed


@pytest.mark.parametrize("streams, words", [([0], "one stream per row"), ([0, -1], ">= 0")])
def test_bad_streams_are_refused_naming_the_argument(streams, words):
    with pytest.raises(ValueError, match="streams") as err:
        replay([MiB, MiB], [0, 1], [-1, -1], streams=streams)
    assert words in str(err.value)


def test_fsdp2_gathers_and_reduce_scatter_outputs_replay_on_their_streams():
    job = parse_megatron_args("--num-layers 4 --hidden-size 256 --num-attention-heads 4 --ffn-hidden-size 1024 "
                              "--seq-length 256 --micro-batch-size 2 --vocab-size 4000 --bf16 --world-size 4 "
                              "--global-batch-size 16 --no-gradient-accumulation-fusion "
                              "--untie-embeddings-and-output-weights --use-torch-fsdp2")[0]
    tl = predict_stage(job, 0, device="cuda").timeline
    streams = allocation_streams(tl)
    assert streams is not None and len(streams) == len(tl)
    by_module: dict[str, set[int]] = {}
    for module, stream in zip(tl.module, streams):
        by_module.setdefault(module, set()).add(stream)
    # the flat all-gather outputs on the copy-in stream, the sharded gradients on the reduce-scatter stream, the
    # rest (activations, unsharded parameters, the reduce-scatter input) on the default one
    assert len(by_module[ALL_GATHER_MODULE]) == 1 and len(by_module[SHARDED_GRADS_MODULE]) == 1
    assert by_module[ALL_GATHER_MODULE] != by_module[SHARDED_GRADS_MODULE]
    assert {s for m, ss in by_module.items() if m not in ALLOCATION_STREAMS for s in ss} == {0}
    # the reported figure is the replay with those streams, and keeping the pools apart costs segments
    with_streams, one_stream = replay_timeline(tl, streams=streams), replay_timeline(tl)
    assert reserved_figures(tl)["max_memory_reserved"] == with_streams.peak_reserved
    assert with_streams.segments > one_stream.segments and with_streams.peak_reserved > one_stream.peak_reserved
    # a timeline without side-stream rows replays as before
    plain = predict_stage(job.replace(torch_fsdp2=None), 0, device="cuda").timeline
    assert allocation_streams(plain) is None
