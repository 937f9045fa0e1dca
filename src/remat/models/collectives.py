"""What the real (torch.distributed) groups of the reference model's parallel layers share."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import torch


@contextlib.contextmanager
def released(*tensors: torch.Tensor, timeout: float = 1.0) -> Iterator[None]:
    """Around a collective: on leaving, wait until the communication library holds no reference to ``tensors``.

    gloo's worker thread drops its references (to the tensors, or to views of them it made) a moment after a
    synchronous collective has returned (measured: 5% of 300 all-gathers on 2 ranks); a tensor the caller then
    lets go of would be freed at that later, racy moment, and a rank's measured peak would differ from run to run
    (seen under load: +16 and +24 KiB on a 1.1 MiB rank). Waiting until the tensors' and their storages' reference
    counts are back makes every free happen in program order, as on the simulated rank that predicts it."""
    before = reference_counts(tensors)
    yield
    wait_for_counts(tensors, before, timeout)


def reference_counts(tensors: Sequence[torch.Tensor]) -> list[int]:
    """References to each tensor and to its storage (a view a communication library made holds the storage)."""
    return [n for t in tensors for n in (t._use_count(), torch._C._storage_Use_Count(t.untyped_storage()._cdata))]


def wait_for_counts(tensors: Sequence[torch.Tensor], counts: Sequence[int], timeout: float = 1.0) -> None:
    """Wait (at most ``timeout`` seconds) until :func:`reference_counts` of ``tensors`` are down to ``counts``."""
    deadline = time.monotonic() + timeout
    while any(now > then for now, then in zip(reference_counts(tensors), counts)) and time.monotonic() < deadline:
        time.sleep(0)


# NOTE [collectives are not operators]
# A collective of remat's parallel groups (tensor_parallel / expert_parallel: all-gather, reduce-scatter, all-reduce,
# all-to-all, the exchange of expert counts) dispatches different operators on different backends: the simulated
# group that predicts a rank copies (unsqueeze, expand, clone, copy_), gloo dispatches c10d._allgather_base_, or
# c10d._reduce_scatter_base_ then split and copy_, NCCL one c10d operator. Operator-level recompute indexes a layer's
# operators (keep_ops(3,19)), so an index must mean the same operator on every backend: every operator dispatched
# inside run_collective (including the allocation of the collective's output) is not counted and never kept; the
# recomputation runs the collective again, except an in-place one (an all-reduce) on a kept output: that output was
# kept already reduced, and reducing it a second time would change its values, so the recomputation skips it
# (replaying). Every rank keeps the same operators, so every rank skips the same collectives.
class _CollectiveState(threading.local):
    def __init__(self) -> None:
        self.depth = 0
        self.kept: list[Callable[[torch.Tensor], bool]] = []


_STATE = _CollectiveState()
T = TypeVar("T")


def in_collective() -> bool:
    """Whether this thread is inside a collective of remat's parallel groups (NOTE [collectives are not
    operators]): operator-level recompute neither counts nor keeps what it dispatches."""
    return _STATE.depth > 0


def run_collective(body: Callable[[], T]) -> T:
    """Run ``body``, one collective (its output's allocation included): NOTE [collectives are not operators]."""
    _STATE.depth += 1
    try:
        return body()
    finally:
        _STATE.depth -= 1


def run_in_place_collective(body: Callable[[], object], written: torch.Tensor) -> None:
    """:func:`run_collective` for a collective that changes ``written`` in place (an all-reduce), skipped in a
    recomputation replaying kept outputs (:func:`replaying`) that holds ``written`` as a kept output: its kept value
    is already the result."""
    if any(kept(written) for kept in _STATE.kept):
        return
    run_collective(body)


@contextlib.contextmanager
def replaying(kept: Callable[[torch.Tensor], bool]) -> Iterator[None]:
    """Around a recomputation that hands back kept outputs: in-place collectives on a tensor for which ``kept`` is
    true are skipped (:func:`run_collective`)."""
    _STATE.kept.append(kept)
    try:
        yield
    finally:
        _STATE.kept.pop()
