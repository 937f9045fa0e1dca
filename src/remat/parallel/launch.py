"""The process launcher of real multi-process runs: one worker process per rank (``python -m remat.parallel.worker``),
every one of them ended, and its temporary folder removed, before :func:`launch_job` returns or raises."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from remat.timeline import write_atomic

DEFAULT_TIMEOUT = 120.0
PARALLEL_WORKER = ("remat.parallel.worker", "--worker")  # python -m <this> FOLDER RANK LAUNCHER_PID
_GRACE = 1.0  # after a rank fails, how long to wait for the others' errors (to name the first one)
FOLDER_PREFIX = "remat-pp-"  # + the launching process's pid + "-": a folder whose launcher is gone is stale

# NOTE [How a launch ends]
# The workers meet through a TCP store on a free port of 127.0.0.1 (gloo on CPU, NCCL with device='cuda') and get
# their job and send their results (timeline JSON, written atomically) through a temporary folder. Every launched
# process ends: each worker runs in its own session; when a rank fails the run stops with the first failure
# (first_failure), when the run does not finish within the timeout it stops naming the ranks still running; either
# way every worker's process group is killed and reaped and the folder removed (a finally block, which a SIGTERM
# of the launcher also runs: cleanup_on_sigterm). A worker exits by itself when its launcher is gone (a SIGKILL
# runs no finally block), removing the folder; a folder that survives even that is removed by the next launch
# (remove_stale_folders).


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
    src = str(Path(__file__).resolve().parents[2])  # the folder that holds the remat package
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the run stays on 127.0.0.1
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _launch(job: dict[str, Any], world: int, timeout: float, worker: Sequence[str]) -> list[Any]:
    """Run the workers; return each rank's results, or raise DistributedError after ending every worker."""
    remove_stale_folders()
    folder = Path(tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        write_atomic(folder / "job.json", json.dumps(job))
        env = _worker_env()
        deadline = time.monotonic() + timeout
        for rank in range(world):
            with open(folder / f"rank{rank}.log", "wb") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", *worker, str(folder), str(rank), str(os.getpid())],
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
                    rank, message = first_failure(folder, codes, exited)
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
        for rank, results in enumerate(out):  # one timeline dict, or a list of them
            for data in results if isinstance(results, list) else [results]:
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


_PEER_LOST = re.compile(r"connection (closed|reset) by peer|broken pipe", re.IGNORECASE)


def first_failure(folder: Path, codes: Sequence[int | None], exited: dict[int, float]) -> tuple[int, str]:
    """The rank whose failure stopped the run, and what happened to it.

    Args:
        folder: the run's folder, where ranks report their Python errors (``rank<r>.error.json``, with the time).
        codes: each rank's exit status (None: still running; negative: killed by that signal).
        exited: rank -> when the launcher first saw it exit (wall clock, as the error files).

    Returns:
        ``(rank, message)``. A rank that died without a Python error (killed by a signal other than SIGABRT, or
        ``os._exit``) comes first: its peers' errors ("Connection reset by peer") are what its death did to them,
        and they are often written before the launcher sees it die. Then the earliest reported error, then errors
        of a lost peer connection and ranks that aborted (SIGABRT): symptoms of another rank's failure.
    """
    reported = dict(_errors(folder))
    failures = []
    for rank, code in enumerate(codes):
        if code in (None, 0):
            continue
        if rank in reported:
            error = str(reported[rank]["error"])
            # a peer's lost connection is what a failed rank's teardown did to this one: blamed after real errors
            cause = 2 if _PEER_LOST.search(error) else 1
            failures.append((cause, float(reported[rank].get("time", 0.0)), rank, error))
            continue
        tail = ""
        with contextlib.suppress(OSError):
            lines = (folder / f"rank{rank}.log").read_text(encoding="utf-8", errors="replace").strip().splitlines()
            tail = lines[-1] if lines else ""
        how = f"was killed by {_signal_name(-code)}" if code < 0 else f"exited with status {code}"
        # a SIGABRT is what a communication library does when a peer's connection breaks: a symptom, blamed last
        cause = 0 if code > 0 or -code != signal.SIGABRT else 2
        failures.append((cause, exited.get(rank, time.time()), rank,
                         f"{how} without a Python error" + (f" (last output: {tail})" if tail else "")))
    _, _, rank, message = min(failures)
    return rank, message


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def remove_stale_folders(root: Path | None = None) -> list[Path]:
    """Remove the launch folders (``remat-pp-<pid>-*`` in ``root``, default the temporary directory) of this user
    whose launching process is gone; return them."""
    removed = []
    for path in Path(root or tempfile.gettempdir()).glob(f"{FOLDER_PREFIX}*-*"):
        pid = path.name[len(FOLDER_PREFIX):].split("-", 1)[0]
        with contextlib.suppress(OSError, ValueError):
            if pid.isdigit() and path.stat().st_uid == os.getuid() and not process_alive(int(pid)):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (a zombie counts as alive until reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class LauncherTerminated(BaseException):
    """SIGTERM arrived while workers ran (a BaseException, like KeyboardInterrupt: nothing should catch it)."""


@contextlib.contextmanager
def cleanup_on_sigterm() -> Any:
    """Turn a SIGTERM of this process into an exception while the block runs, so that its finally blocks end the
    workers and remove the folder; afterwards the process dies of the SIGTERM as it would have. Only in the main
    thread, and only where SIGTERM has its default action (a program's own handler is left alone)."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def terminate(signum: int, frame: Any) -> None:
        raise LauncherTerminated()

    signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    except LauncherTerminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)  # cleaned up: now die of it
        raise
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def launch_job(job: dict[str, Any], world: int, timeout: float,
               worker: Sequence[str] = PARALLEL_WORKER) -> list[Any]:
    """Run ``job`` on ``world`` worker processes (a free port is chosen, and chosen again if it was taken);
    each rank's result: what its worker wrote, a timeline dict or a list of them, each with ``meta['pid']`` set
    to the worker's process. ``worker`` is the module (and leading arguments) each rank runs as ``python -m
    <worker...> FOLDER RANK LAUNCHER_PID``: remat.parallel.worker by default, remat.megatron.rank_worker for
    megatron-core jobs. Every worker is ended before this returns or raises."""
    for attempt in range(2):  # the free port may be taken between choosing it and rank 0 listening on it
        job["port"] = free_port()
        try:
            with cleanup_on_sigterm():
                return _launch(job, world, float(timeout), tuple(worker))
        except DistributedError as err:
            if attempt or "address already in use" not in str(err).lower():
                raise
    raise AssertionError("unreachable")


def inject_fault(fault: dict[str, Any], rank: int) -> None:
    """For tests: make this rank fail as ``fault['kind']`` says: 'raise' (a RuntimeError with ``fault['message']``),
    'hang', 'exit' (status 3) or 'kill' (SIGKILL)."""
    kind = fault.get("kind", "raise")
    if kind == "hang":
        while True:
            time.sleep(1)
    if kind == "exit":
        os._exit(3)
    if kind == "kill":  # as the kernel's OOM killer or a user's kill -9 would
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError(fault.get("message", f"fault injected on rank {rank}"))


# What a worker process runs beside its job (parallel.worker, megatron.rank_worker): the other half of the
# launcher's protocol (the error file first_failure reads, the watchdog of a launcher that is gone).
def watchdog(launcher: int, deadline: float, folder: Path, rank: int) -> None:
    """End this worker when the process that launched it is gone or the run's time is over (the launcher
    normally kills it first). A launcher that is gone ran no cleanup (it was SIGKILLed): remove its folder."""
    while True:
        time.sleep(0.2)
        gone = not process_alive(launcher)
        if gone:
            shutil.rmtree(folder, ignore_errors=True)
            os._exit(4)
        if time.time() > deadline:
            with contextlib.suppress(Exception):
                report_error(folder, rank, "worker stopped: the run's timeout passed", "")
            os._exit(4)


def report_error(folder: Path, rank: int, error: str, trace: str) -> None:
    """Write this rank's error where the launcher looks for it (``rank<r>.error.json``, with the time)."""
    write_atomic(folder / f"rank{rank}.error.json",
                 json.dumps({"rank": rank, "error": error, "traceback": trace, "time": time.time()}))
