#!/usr/bin/env python
"""GPU check ``streams``: the caching-allocator replay with several streams (NOTE [streams' pools] in
:mod:`remat.memory.allocator`) against the CUDA caching allocator itself.

Each case is a seeded sequence of ``torch.empty`` allocations on the default stream and two side streams (``with
torch.cuda.stream(s)``: the block belongs to ``s``) and frees (the tensor dropped; no kernel runs, so no stream
uses it and its block goes straight back to its stream's pool), sizes from 1 byte to 90 MiB. It runs in a fresh
process per allocator setting (nothing cached before it), and compares ``max_memory_reserved``,
``max_memory_allocated`` and the ``num_device_alloc`` count with :func:`remat.memory.allocator.replay` given each
row's stream: they must be equal to the byte. The same rows on one stream are replayed too, and the case says how
far apart the two replays are (what keeping the streams' pools apart changes). Then an FSDP2-like pattern: per
layer a flat all-gather output on the copy-in stream, freed at the next layer's gather, beside activations on the
default stream.

    python benchmarks/gpu_check_streams.py            # as gpu_check.py runs it: PASS/FAIL lines, exit 1 on a FAIL
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from typing import Any

MIB = 1 << 20
SETTINGS = ("", "expandable_segments:True", "max_split_size_mb:64")
SEEDS = range(6)


def sequence(seed: int, streams: int = 3, steps: int = 400) -> dict[str, list[int]]:
    """Rows (bytes, stream) allocated and freed in a random order: ``alloc_at``/``free_at`` events as
    :func:`remat.memory.allocator.replay` takes them."""
    rnd = random.Random(seed)
    nbytes: list[int] = []
    stream: list[int] = []
    alloc_at: list[int] = []
    free_at: list[int] = []
    live: list[int] = []
    for event in range(steps):
        if live and rnd.random() < 0.45:
            free_at[live.pop(rnd.randrange(len(live)))] = event
            continue
        nbytes.append(rnd.choice([rnd.randint(1, MIB), rnd.randint(MIB, 12 * MIB), rnd.randint(12 * MIB, 90 * MIB)]))
        stream.append(rnd.randrange(streams))
        alloc_at.append(event)
        free_at.append(-1)
        live.append(len(nbytes) - 1)
    return {"nbytes": nbytes, "streams": stream, "alloc_at": alloc_at, "free_at": free_at}


def fsdp2_like(layers: int = 12, flat: int = 48 * MIB, act: int = 37 * MIB) -> dict[str, list[int]]:
    """FSDP2's pattern: each layer's flat all-gather output on stream 1, freed at the next layer's gather, beside
    the layer's activations on stream 0, kept through the forward and freed in reverse by the backward, which
    gathers each layer again."""
    nbytes: list[int] = []
    stream: list[int] = []
    alloc_at: list[int] = []
    free_at: list[int] = []
    event = 0

    def step(row: int | None = None, size: int = 0, on: int = 0) -> int:
        nonlocal event
        if row is None:  # allocate
            nbytes.append(size)
            stream.append(on)
            alloc_at.append(event)
            free_at.append(-1)
            row = len(nbytes) - 1
        else:
            free_at[row] = event
        event += 1
        return row
    gathered: int | None = None
    kept: list[int] = []
    for backward in (False, True):
        for layer in (range(layers - 1, -1, -1) if backward else range(layers)):
            new = step(size=flat + layer * 512, on=1)
            if gathered is not None:
                step(gathered)
            gathered = new
            if backward:
                step(kept.pop())
            else:
                kept.append(step(size=act, on=0))
    step(gathered)
    return {"nbytes": nbytes, "streams": stream, "alloc_at": alloc_at, "free_at": free_at}


def measure(case: dict[str, list[int]]) -> dict[str, int]:
    """Run the case's allocations through the CUDA caching allocator (a fresh one: nothing allocated before)."""
    import torch

    side = [torch.cuda.current_stream()] + [torch.cuda.Stream() for _ in range(max(case["streams"]))]
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_stats()
    events: list[tuple[int, bool, int]] = []
    for row, (a, f) in enumerate(zip(case["alloc_at"], case["free_at"])):
        events.append((a, True, row))
        if f >= 0:
            events.append((f, False, row))
    live: dict[int, Any] = {}
    for _, is_alloc, row in sorted(events):
        if is_alloc:
            with torch.cuda.stream(side[case["streams"][row]]):
                live[row] = torch.empty(case["nbytes"][row], dtype=torch.uint8, device="cuda")
        else:
            del live[row]
    stats = torch.cuda.memory_stats()
    out = {"max_memory_reserved": torch.cuda.max_memory_reserved(),
           "max_memory_allocated": torch.cuda.max_memory_allocated(),
           "segments": stats.get("num_device_alloc", 0) - before.get("num_device_alloc", 0),
           "reserved_before": before.get("reserved_bytes.all.current", 0)}
    live.clear()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return out


def child(setting: str) -> None:
    """Measure every case under the allocator setting this process started with; print them as JSON."""
    cases = {f"random seed {s}": sequence(s) for s in SEEDS}
    cases["fsdp2-like"] = fsdp2_like()
    print(json.dumps({"setting": setting, "cases": {name: {"case": case, "measured": measure(case)}
                                                     for name, case in cases.items()}}))


def check_streams(results: Any, device: str) -> None:
    """The ``streams`` lines: one per case and setting, each run in a fresh process (``results``: gpu_check's
    :class:`Results`)."""
    from remat.memory.allocator import AllocatorConfig, replay

    if device != "cuda":
        results.add("SKIP", "streams", "all cases", "needs CUDA streams (the replay's own tests run on CPU: "
                    "tests/memory/test_allocator_streams.py)")
        return
    for setting in SETTINGS:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
        if setting:
            env["PYTORCH_CUDA_ALLOC_CONF"] = setting
        done = subprocess.run([sys.executable, __file__, "--child", setting], env=env, capture_output=True,
                              text=True, timeout=300)
        if done.returncode != 0:
            results.add("ERROR", "streams", setting or "defaults", done.stderr[-400:])
            continue
        report = json.loads(done.stdout.strip().splitlines()[-1])
        config = AllocatorConfig.parse(setting)
        for name, entry in report["cases"].items():
            case, measured = entry["case"], entry["measured"]
            columns = (case["nbytes"], case["alloc_at"], case["free_at"])
            predicted = replay(*columns, config, streams=case["streams"])
            one_stream = replay(*columns, config)
            got = (measured["max_memory_reserved"], measured["max_memory_allocated"], measured["segments"])
            want = (predicted.peak_reserved, predicted.peak_allocated, predicted.segments)
            results.compare("streams", f"{setting or 'defaults'}, {name}",
                            got == want and measured["reserved_before"] == 0,
                            f"measured reserved/allocated/segments {got}, replayed {want} (one stream: "
                            f"{one_stream.peak_reserved / MIB:,.0f} MiB reserved, {one_stream.segments} segments; "
                            f"reserved before {measured['reserved_before']})")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2] if len(sys.argv) > 2 else "")
        sys.exit(0)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch
    from gpu_check_moe import Results

    results = Results()
    check_streams(results, "cuda" if torch.cuda.is_available() else "cpu")
    sys.exit(1 if results.failed else 0)
