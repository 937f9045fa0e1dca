"""The parallel layout of a Megatron job, and the process group one rank of it runs in here.

A fake trace of rank r of a TP x PP x CP x DP (EP inside DP x CP) job needs Megatron's parallel state as rank r
sees it, not the ranks themselves: :func:`megatron_world` starts torch.distributed with torch's fake backend
(every collective returns at once, shapes as on the real job) and calls Megatron's ``initialize_model_parallel``
without the gloo side groups. The same function with ``backend='gloo'`` runs a real CPU rank (one process, or
one of the processes :mod:`remat.megatron.multiprocess` starts).

NOTE [a world of one process] A real run of one process has nothing to communicate, but Megatron still calls
collectives on its groups of one rank (the cross-entropy all-reduces its [s, b] maxima and sums). gloo runs each on a
worker thread that holds the work, and so the tensor, until it picks its next job; when the worker is descheduled
past the point where Python drops the tensor, its free lands later in the timeline than in the prediction (a 256-byte
vocab-parallel maximum alive at the peak: a test failed on it under load; 20 of 20,000 all-reduces of a loaded run
were freed late here). A world of one therefore runs in torch's fake process group: over one rank each of its
collectives gives gloo's result (an all-reduce or broadcast leaves the tensor as it is, a gather or scatter copies
it), on the calling thread, and holds nothing after it returns. Runs of several processes keep gloo and wait for
its release instead (NOTE [gloo's late release in Megatron's collectives] in remat.megatron.released_collectives).
"""

from __future__ import annotations

import contextlib
import datetime
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch.distributed as dist

from remat.megatron.compat import MegatronSettingError


@dataclass(frozen=True)
class ParallelSizes:
    """Megatron's parallel sizes (``--tensor-model-parallel-size`` ...). ``dp`` None: the smallest data-parallel
    size the expert layout needs (EP x expert-TP must divide TP x CP x DP)."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    dp: int | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp", "ep"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise MegatronSettingError(f"{name}={getattr(self, name)!r}: parallel sizes are integers >= 1")
        if (self.tp * self.cp * self.data_parallel) % (self.ep * self.expert_tp) != 0:
            raise MegatronSettingError(
                f"ep={self.ep} x expert tp={self.expert_tp} does not divide tp x cp x dp = "
                f"{self.tp * self.cp * self.data_parallel}: raise dp (--data-parallel-size) to a multiple of "
                f"{self.ep * self.expert_tp}")

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def data_parallel(self) -> int:
        if self.dp is not None:
            if not isinstance(self.dp, int) or self.dp < 1:
                raise MegatronSettingError(f"dp={self.dp!r}: must be an integer >= 1")
            return self.dp
        needed = self.ep * self.expert_tp
        dp = 1
        while (self.tp * self.cp * dp) % needed:
            dp += 1
        return dp

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.data_parallel

    def stage_ranks(self) -> list[int]:
        """One global rank per pipeline stage (tensor/context/data rank 0), in Megatron's default order
        tp-cp-ep-dp-pp, where the pipeline rank is the outermost."""
        per_stage = self.world_size // self.pp
        return [stage * per_stage for stage in range(self.pp)]

    def model_parallel_ranks(self) -> list[int]:
        """Every rank of data-parallel replica 0: each tensor, context and pipeline position."""
        per_stage = self.world_size // self.pp
        inner = self.tp * self.cp
        return [stage * per_stage + r for stage in range(self.pp) for r in range(inner)]


@contextlib.contextmanager
def megatron_world(sizes: ParallelSizes, rank: int = 0, *, backend: str = "fake", seed: int = 1234,
                   init_method: str | None = None, timeout_s: float = 120.0) -> Iterator[None]:
    """torch.distributed and Megatron's parallel state for ``rank`` of a job of ``sizes``; undone on exit.

    Args:
        sizes: the job's parallel sizes.
        rank: the global rank this process plays.
        backend: ``'fake'`` (no communication, any world size) or ``'gloo'`` (a real run; a world of one process
            runs its collectives in-process, see NOTE [a world of one process]).
        seed: Megatron's ``model_parallel_cuda_manual_seed`` seed.
        init_method: where a real run of more than one process meets (``tcp://127.0.0.1:<port>``; every rank
            gives the same); a world of one process needs none.
        timeout_s: how long a real rank waits for its peers in a collective.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random

    if dist.is_available() and dist.is_initialized():
        raise MegatronSettingError("torch.distributed is already initialized in this process: remat starts its own "
                                   "(fake or gloo) group per rank; call it from a process without one")
    world = sizes.world_size
    if not 0 <= rank < world:
        raise MegatronSettingError(f"rank={rank}: the job has {world} ranks (0..{world - 1})")
    with contextlib.ExitStack() as stack:
        # init_process_group wraps sys.excepthook to prefix "[rank<r>]: " to tracebacks, and nothing unwraps it
        stack.callback(setattr, sys, "excepthook", sys.excepthook)
        if backend == "fake":
            from torch.testing._internal.distributed.fake_pg import FakeStore

            dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
        elif backend == "gloo":
            timeout = datetime.timedelta(seconds=timeout_s)
            if init_method is not None:
                dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world, timeout=timeout)
            elif world == 1:
                # See NOTE [a world of one process]: torch's fake group, whose collectives over one rank give
                # gloo's results, on the calling thread
                from torch.testing._internal.distributed.fake_pg import FakeStore

                dist.init_process_group("fake", rank=0, world_size=1, store=FakeStore())
            else:
                raise MegatronSettingError(f"a real run of tp x pp x cp x dp = {world} processes needs init_method "
                                           "(remat.megatron.measure_megatron_core_distributed starts them)")
        else:
            raise MegatronSettingError(f"backend={backend!r}: use 'fake' (predict) or 'gloo' (measure)")
        stack.callback(dist.destroy_process_group)
        stack.callback(parallel_state.destroy_model_parallel)
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=sizes.tp, pipeline_model_parallel_size=sizes.pp,
            context_parallel_size=sizes.cp, expert_model_parallel_size=sizes.ep,
            expert_tensor_parallel_size=sizes.etp, create_gloo_process_groups=False)
        random.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
        yield
        # every rank is done with its collectives before any tears down (only after a step that ended well: a
        # failed rank goes down at once, so its peers fail at once and the launcher reports its error)
        if backend == "gloo" and world > 1:
            dist.barrier()
