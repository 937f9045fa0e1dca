"""Run a function on N local processes with torch.distributed, and always end.

:func:`run_ranks` starts ``world_size`` spawned processes that join one process group (gloo on CPU, NCCL on
GPUs) over a free TCP port on 127.0.0.1, runs ``fn(rank, world_size, *args)`` in each, and returns each rank's
JSON-able result. A rank that raises makes the whole run stop with that rank's traceback; a run that outlives
``timeout`` seconds is stopped. Either way every process is killed before the call returns: nothing is left
behind, and nothing hangs.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from remat.timeline import write_atomic


class DistributedRunError(RuntimeError):
    """A rank failed or the run timed out; ``rank`` is the failing rank (None for a timeout)."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn: Callable[..., Any], rank: int, world_size: int, port: int, backend: str, folder: str,
               args: tuple[Any, ...]) -> None:
    import torch.distributed as dist

    try:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        try:
            result = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        write_atomic(Path(folder) / f"rank{rank}.json", json.dumps(result))
    except BaseException:
        write_atomic(Path(folder) / f"rank{rank}.error", traceback.format_exc())
        os._exit(1)


def run_ranks(fn: Callable[..., Any], world_size: int, args: tuple[Any, ...] = (), *, backend: str = "gloo",
              timeout: float = 120.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return the results by rank.

    ``fn`` must be importable (a module-level function) and return something JSON can encode. Raises
    :class:`DistributedRunError` with the first failing rank's traceback, or after ``timeout`` seconds.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: need at least one process")
    context = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="remat-ranks-") as folder:
        processes = [context.Process(target=_rank_main, args=(fn, r, world_size, port, backend, folder, args),
                                     daemon=True) for r in range(world_size)]
        for p in processes:
            p.start()
        deadline = time.monotonic() + timeout
        try:
            while True:
                failed = [r for r, p in enumerate(processes) if p.exitcode not in (None, 0)]
                if failed:
                    rank = failed[0]
                    error = Path(folder) / f"rank{rank}.error"
                    detail = error.read_text() if error.exists() else f"exit code {processes[rank].exitcode}"
                    raise DistributedRunError(f"rank {rank} of {world_size} failed:\n{detail}", rank)
                if all(p.exitcode == 0 for p in processes):
                    break
                if time.monotonic() > deadline:
                    running = [r for r, p in enumerate(processes) if p.exitcode is None]
                    raise DistributedRunError(f"timed out after {timeout:.0f} s; ranks {running} still running")
                time.sleep(0.05)
        finally:
            for p in processes:
                if p.is_alive():
                    p.kill()
            for p in processes:
                p.join(timeout=10)
        return [json.loads((Path(folder) / f"rank{r}.json").read_text()) for r in range(world_size)]
