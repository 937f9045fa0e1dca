"""Megatron's synchronous collectives on a real gloo rank, each returning only once gloo has let go of its tensors.

NOTE [gloo's late release in Megatron's collectives] gloo runs a collective on a worker thread that holds the work,
and so its tensors, until it picks its next job. When the worker is descheduled past the point where the Python
code drops such a tensor, the tensor is freed later in the timeline than in program order, and a rank's measured
peak can exceed its prediction by an all-reduced activation or two (seen under load: +16 KiB and +32 KiB on the
tp=2 test; 20 of 20,000 all-reduces of a loaded process were freed late). remat's own groups wait for the release
(remat.models.collectives.released); Megatron calls torch.distributed itself, so while a real rank of several
processes runs, :func:`collectives_released` wraps torch.distributed's collectives, and the ones megatron-core
bound to names of its own at import, in the same wait; an asynchronous call (``async_op=True``, e.g. the
all-reduce of a column-parallel linear's input gradient, overlapped with its weight gradient) waits for the release
when its caller waits for the work. A world of one process has no gloo at all (NOTE [a world of one process]
in remat.megatron.world).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from remat.models.collectives import reference_counts, released, wait_for_counts

# torch.distributed's collectives that Megatron calls synchronously
COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "_all_gather_base",
               "_reduce_scatter_base", "all_gather", "broadcast", "all_to_all_single", "reduce_scatter", "reduce")
# megatron-core's names for a collective, bound at its import (dist_all_gather_func = all_gather_into_tensor, ...)
ALIASES = (
    ("megatron.core.tensor_parallel.mappings", "dist_all_gather_func"),
    ("megatron.core.tensor_parallel.mappings", "dist_reduce_scatter_func"),
    ("megatron.core.tensor_parallel.layers", "dist_all_gather_func"),
    ("megatron.core.tensor_parallel.layers", "dist_reduce_scatter_func"),
    ("megatron.core.utils", "dist_all_gather_func"),
)


def waiting_for_release(collective: Callable[..., Any]) -> Callable[..., Any]:
    """``collective`` that, called synchronously, returns once the communication library holds none of its
    tensors (NOTE [gloo's late release in Megatron's collectives])."""
    signature = inspect.signature(collective)

    @functools.wraps(collective)
    def run(*args: Any, **kwargs: Any) -> Any:
        arguments = signature.bind(*args, **kwargs).arguments
        tensors = [t for value in arguments.values() for t in (value if isinstance(value, (list, tuple)) else [value])
                   if isinstance(t, torch.Tensor)]
        if not arguments.get("async_op"):
            with released(*tensors):
                return collective(*args, **kwargs)
        before = reference_counts(tensors)
        work = collective(*args, **kwargs)
        if work is None:  # this rank is not in the group
            return None
        # what the work holds of the tensors (the caller's own references may change until it waits)
        return ReleasingWork(work, tensors, [n - b for n, b in zip(reference_counts(tensors), before)])
    run.waits_for_release = True  # type: ignore[attr-defined]
    return run


class ReleasingWork:
    """An asynchronous collective's work whose :meth:`wait` returns once the communication library holds none of
    its tensors; everything else is the work's own."""

    def __init__(self, work: Any, tensors: list[torch.Tensor], held: list[int]):
        self._work, self._tensors, self._held = work, tensors, held

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        done = self._work.wait(*args, **kwargs)
        if self._tensors:
            tensors, self._tensors = self._tensors, []
            # once the work is gone, the counts drop by what it held (and by the references this object held)
            counts = [n - h for n, h in zip(reference_counts(tensors), self._held)]
            self._work = _Done(done)
            wait_for_counts(tensors, counts)
        return done

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class _Done:
    """A waited work's stand-in (holding nothing): waiting again answers as the work did."""

    def __init__(self, result: Any):
        self.result = result

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        return self.result

    def is_completed(self) -> bool:
        return True


@contextlib.contextmanager
def collectives_released() -> Iterator[None]:
    """While active, :data:`COLLECTIVES` and megatron-core's :data:`ALIASES` of them wait for their release
    (:func:`waiting_for_release`); the originals are put back on exit."""
    owners: list[tuple[Any, str]] = [(dist, name) for name in COLLECTIVES]
    owners += [(importlib.import_module(module), name) for module, name in ALIASES]
    originals = [(owner, name, getattr(owner, name)) for owner, name in owners if hasattr(owner, name)]
    try:
        for owner, name, original in originals:
            setattr(owner, name, waiting_for_release(original))
        yield
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)
