"""Measure pipeline-parallel memory for real: one process per stage, ``torch.distributed.pipelining``.

:func:`measure_pipeline` starts ``pp`` worker processes (``python -m remat.parallel.worker``) that meet through a TCP
store on a free port of 127.0.0.1 and form a process group (gloo on CPU, NCCL with ``device='cuda'``, rank r on
``cuda:r``). Each rank builds its model chunks with the same partition as
:func:`remat.parallel.pipeline_predict.predict_pipeline`
(cut from one seeded :func:`remat.models.gpt.build_model`, so the weights are the unsplit GPT's), applies the policy
to each chunk, wraps them in ``PipelineStage`` and runs ``ScheduleGPipe`` / ``Schedule1F1B`` /
``ScheduleInterleaved1F1B`` with the loss computed inside the last chunk. The first step allocates the
pipeline's buffers (and infers the stages' shapes); the second step is recorded by
:class:`remat.parallel.stages.PipelineRecorder` (real tensors, exact storage bytes on CPU), after every gradient is
reset
to None. Each rank sends its :class:`~remat.timeline.Timeline` back as JSON through a temporary folder (written
atomically).

Every launched process ends: each worker runs in its own session (process group); when a rank fails, the run
stops with that rank's error (:class:`DistributedError`, the first rank to fail is named, with its message); when
the run does not finish within ``timeout`` seconds it stops naming the ranks still running; either way every
worker's process group is killed and reaped before the call returns. A worker also exits by itself when its
parent goes away.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from remat.timeline import write_atomic

DEFAULT_TIMEOUT = 120.0
_GRACE = 1.0  # after a rank fails, how long to wait for the others' errors (to name the first one)


class DistributedError(RuntimeError):
    """A multi-process run failed or timed out. ``rank`` is the rank whose error is reported (None for a
    timeout), ``pids`` the worker processes (all ended when this is raised)."""

    def __init__(self, message: str, rank: int | None = None, pids: Sequence[int] = ()):
        super().__init__(message)
        self.rank = rank
        self.pids = list(pids)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the run stays on 127.0.0.1
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _launch(job: dict[str, Any], world: int, timeout: float) -> list[list[dict[str, Any]]]:
    """Run the workers; return each rank's results, or raise DistributedError after ending every worker."""
    folder = Path(tempfile.mkdtemp(prefix="remat-pp-"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        write_atomic(folder / "job.json", json.dumps(job))
        env = _worker_env()
        deadline = time.monotonic() + timeout
        for rank in range(world):
            with open(folder / f"rank{rank}.log", "wb") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "remat.parallel.worker", "--worker", str(folder), str(rank),
                     str(os.getpid())],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                    start_new_session=True))  # its own process group: killed as a whole
        pids = [p.pid for p in procs]
        failed_at: float | None = None
        exited: dict[int, float] = {}  # rank -> when its exit was first seen (wall clock, as the error files)
        while True:
            codes = [p.poll() for p in procs]
            for rank, code in enumerate(codes):
                if code is not None and rank not in exited:
                    exited[rank] = time.time()
            if all(c == 0 for c in codes):
                break
            if any(c not in (None, 0) for c in codes):
                failed_at = failed_at or time.monotonic()
                if all(c is not None for c in codes) or time.monotonic() - failed_at >= _GRACE:
                    rank, message = _first_error(folder, codes, exited)
                    raise DistributedError(f"rank {rank} failed: {message}", rank, pids)
            if time.monotonic() >= deadline:
                running = [r for r, c in enumerate(codes) if c is None]
                errors = _errors(folder)
                extra = "".join(f"; rank {r} failed first: {e['error']}" for r, e in errors[:1])
                raise DistributedError(f"the run did not finish within {timeout:g} s: rank(s) "
                                       f"{', '.join(map(str, running))} still running (a hung rank, or a rank "
                                       f"waiting for one); all {world} processes were killed{extra}", None, pids)
            time.sleep(0.02)
        out = []
        for rank in range(world):
            path = folder / f"rank{rank}.json"
            try:
                out.append(json.loads(path.read_text(encoding="utf-8")))
            except (OSError, ValueError) as err:
                raise DistributedError(f"rank {rank} exited without a result ({err})", rank, pids) from err
        for rank, results in enumerate(out):
            for data in results:
                data.setdefault("meta", {})["pid"] = pids[rank]
        return out
    finally:
        _end_all(procs)
        shutil.rmtree(folder, ignore_errors=True)


def _end_all(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """Kill every worker's process group (each worker runs in its own session) and reap every worker."""
    for p in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)  # the worker and anything it started
    for p in procs:
        with contextlib.suppress(Exception):
            p.wait(timeout=30)


def _errors(folder: Path) -> list[tuple[int, dict[str, Any]]]:
    """Errors the ranks reported, earliest first."""
    found = []
    for path in folder.glob("rank*.error.json"):
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(path.read_text(encoding="utf-8"))
            found.append((int(data["rank"]), data))
    return sorted(found, key=lambda item: item[1].get("time", 0.0))


def _first_error(folder: Path, codes: Sequence[int | None], exited: dict[int, float]) -> tuple[int, str]:
    """The rank that failed first and its message: a rank's reported error counts from when it was written, a
    rank that died without one (killed, or exited directly) from when its exit was seen."""
    reported = dict(_errors(folder))
    failures = []
    for rank, code in enumerate(codes):
        if code in (None, 0):
            continue
        if rank in reported:
            failures.append((float(reported[rank].get("time", 0.0)), rank, str(reported[rank]["error"])))
            continue
        tail = ""
        with contextlib.suppress(OSError):
            lines = (folder / f"rank{rank}.log").read_text(encoding="utf-8", errors="replace").strip().splitlines()
            tail = lines[-1] if lines else ""
        how = f"killed by signal {-code}" if code < 0 else f"exited with status {code}"
        failures.append((exited.get(rank, time.time()), rank,
                         f"{how} without a Python error" + (f" (last output: {tail})" if tail else "")))
    _, rank, message = min(failures)
    return rank, message


def launch_job(job: dict[str, Any], world: int, timeout: float) -> list[list[dict[str, Any]]]:
    """Run ``job`` on ``world`` worker processes (a free port is chosen, and chosen again if it was taken);
    each rank's list of timeline dicts. Every worker is ended before this returns or raises."""
    for attempt in range(2):  # the free port may be taken between choosing it and rank 0 listening on it
        job["port"] = free_port()
        try:
            return _launch(job, world, float(timeout))
        except DistributedError as err:
            if attempt or "address already in use" not in str(err).lower():
                raise
    raise AssertionError("unreachable")


def inject_fault(fault: dict[str, Any], rank: int) -> None:
    kind = fault.get("kind", "raise")
    if kind == "hang":
        while True:
            time.sleep(1)
    if kind == "exit":
        os._exit(3)
    raise RuntimeError(fault.get("message", f"fault injected on rank {rank}"))
