"""Export a :class:`~remat.timeline.Timeline` as a CUDA memory snapshot (the format of
``torch.cuda.memory._snapshot()``), which https://pytorch.org/memory_viz and ``torch.cuda._memory_viz`` read.
Writing is pickle, the viewer's format; remat never reads pickle.
"""

from __future__ import annotations

import bisect
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np

from remat.files import write_atomic
from remat.timeline import Timeline
from remat.units import round_up

BASE_ADDRESS = 0x7F0000000000  # where the made-up segment starts (looks like a device pointer)
ALIGN = 512


class _FirstFit:
    """First-fit placement over one segment that grows at the top when no free range fits."""

    def __init__(self) -> None:
        self.starts: list[int] = []   # free ranges, sorted by start
        self.ends: list[int] = []
        self.top = 0                  # the segment's size so far

    def alloc(self, size: int) -> int:
        size = round_up(size, ALIGN)
        for i, (start, end) in enumerate(zip(self.starts, self.ends)):
            if end - start >= size:
                if end - start == size:
                    del self.starts[i], self.ends[i]
                else:
                    self.starts[i] = start + size
                return start
        if self.ends and self.ends[-1] == self.top:  # the last free range touches the top: extend it
            start = self.starts.pop()
            self.ends.pop()
        else:
            start = self.top
        self.top = start + size
        return start

    def free(self, offset: int, size: int) -> None:
        size = round_up(size, ALIGN)
        start, end = offset, offset + size
        i = bisect.bisect_left(self.starts, start)
        if i > 0 and self.ends[i - 1] == start:  # merge with the range before
            i -= 1
            start = self.starts[i]
            del self.starts[i], self.ends[i]
        if i < len(self.starts) and self.starts[i] == end:  # and with the one after
            end = self.ends[i]
            del self.starts[i], self.ends[i]
        self.starts.insert(i, start)
        self.ends.insert(i, end)


def _frames(tl: Timeline, row: int, policy: str) -> list[dict[str, Any]]:
    phase = tl.phases[tl.phase_index[row]]
    return [
        {"filename": "module", "line": 0, "name": f"{tl.module[row] or '<model>'} ({tl.category[row]})"},
        {"filename": "phase", "line": tl.phase_index[row], "name": phase.label},
        {"filename": "remat", "line": 0, "name": f"policy {policy}"},
    ]


# NOTE [The snapshot's layout]
# The snapshot is a dict:
#
# * ``device_traces[0]``: one event per allocation and free of the timeline, in event order (rows that share an
#   event: its frees, then its allocations): ``alloc`` for an allocation, ``free_requested``
#   then ``free_completed`` for a free (as the caching allocator records them), each with ``addr``, ``size``,
#   ``stream`` 0, ``time_us`` (the timeline's event number) and ``frames``. The frames name, innermost first, the
#   module that made the tensor and its category, the phase (``forward layer 3``, ``recompute layer 4 [group 1
#   (layers 4-7)]``, ...) and the policy, so the viewer's stack pane says where each block comes from.
# * ``segments``: the allocator state at the end of the step: one segment holding every address the trace used,
#   its blocks ``active_allocated`` (alive at the end: parameters, gradients, ...) or ``inactive``.
#
# Addresses are made up: a first-fit allocator over one growing segment places the allocations in event order and
# reuses freed ranges, so the segment's size is the address space such an allocator needs (at least the peak). Block
# sizes are the timeline's bytes (on CUDA already rounded to the allocator's 512-byte blocks, so ``requested_size``
# equals ``size``). Bytes alive after any event of the trace equal :meth:`Timeline.live_bytes` at that event; the
# highest is :attr:`Timeline.peak_bytes`.
#
# Writing is pickle, the viewer's format (:func:`write_memory_snapshot`); remat never reads pickle.
def to_memory_snapshot(tl: Timeline) -> dict[str, Any]:
    """``tl`` as a ``torch.cuda.memory._snapshot()``-style dict (NOTE [The snapshot's layout]), device 0."""
    policy = str(tl.meta.get("policy", "?"))
    n = len(tl.nbytes)
    frames = [_frames(tl, row, policy) for row in range(n)]
    # In event order; rows that share an event (a job's model state, allocated together at event 0) as the
    # allocator replay runs them: the event's frees first, then its allocations, each in row order.
    steps = sorted([(int(tl.alloc_at[row]), 1, row) for row in range(n)]
                   + [(int(tl.free_at[row]), 0, row) for row in range(n) if tl.free_at[row] >= 0])
    heap = _FirstFit()
    offset = [0] * n
    trace: list[dict[str, Any]] = []
    for event, is_alloc, row in steps:
        kind = "alloc" if is_alloc else "free"
        size = int(tl.nbytes[row])
        if kind == "alloc":
            offset[row] = heap.alloc(size)
            actions = ("alloc",)
        else:
            heap.free(offset[row], size)
            actions = ("free_requested", "free_completed")
        for action in actions:
            trace.append({"action": action, "addr": BASE_ADDRESS + offset[row], "size": size, "stream": 0,
                          "time_us": int(event), "frames": frames[row]})
    alive = sorted((offset[row], row) for row in range(n) if tl.free_at[row] < 0)
    blocks: list[dict[str, Any]] = []
    cursor = 0
    for start, row in alive:
        if start > cursor:
            blocks.append({"address": BASE_ADDRESS + cursor, "size": start - cursor, "requested_size": 0,
                           "state": "inactive", "frames": []})
        size = round_up(int(tl.nbytes[row]), ALIGN)
        blocks.append({"address": BASE_ADDRESS + start, "size": size, "requested_size": int(tl.nbytes[row]),
                       "state": "active_allocated", "frames": frames[row]})
        cursor = start + size
    if cursor < heap.top:
        blocks.append({"address": BASE_ADDRESS + cursor, "size": heap.top - cursor, "requested_size": 0,
                       "state": "inactive", "frames": []})
    active = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
    requested = sum(b["requested_size"] for b in blocks if b["state"] == "active_allocated")
    segment = {"device": 0, "address": BASE_ADDRESS, "total_size": heap.top, "allocated_size": active,
               "active_size": active, "requested_size": requested, "stream": 0, "segment_type": "large",
               "is_expandable": False, "frames": [], "blocks": blocks}
    return {"segments": [segment] if heap.top else [], "device_traces": [trace]}


def snapshot_live_bytes(snapshot: dict[str, Any], device: int = 0) -> np.ndarray:
    """Requested bytes alive after each ``alloc``/``free_completed`` event of a snapshot's device trace."""
    sizes = [e["size"] if e["action"] == "alloc" else -e["size"]
             for e in snapshot["device_traces"][device] if e["action"] in ("alloc", "free_completed")]
    return np.cumsum(np.asarray(sizes, dtype=np.int64)) if sizes else np.zeros(0, dtype=np.int64)


def write_memory_snapshot(tl: Timeline, path: str | os.PathLike[str]) -> Path:
    """Write ``tl`` as a pickled memory snapshot that https://pytorch.org/memory_viz opens (drag the file in)."""
    return write_atomic(path, pickle.dumps(to_memory_snapshot(tl), protocol=4))
