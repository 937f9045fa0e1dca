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

from remat.files import write_atomic

DEFAULT_TIMEOUT = 120.0
PARALLEL_WORKER = ("remat.parallel.worker", "--worker")  # python -m <this> FOLDER RANK LAUNCHER_PID
_GRACE = 1.0  # after a rank fails, how long to wait for the others' errors (to name the first one)
FOLDER_PREFIX = "remat-pp-"  # + the launching process's pid + "-": a folder whose launcher is gone is stale

# NOTE [How a launch ends]
# The workers meet through a TCP store on a free port of 127.0.0.1 (gloo on CPU, NCCL with device='cuda') and get
# their job and send their results (timeline JSON, written atomically) through a temporary folder. Every launched
# process ends: each worker runs in its own session; when a rank fails the run stops with the first failure
# (first_failure), when the run does not finish within the timeout it stops naming the rank that stopped making
# progress and the ranks waiting on it (stall_report, from each rank's heartbeat: NOTE [Heartbeats]); either
# way every worker's process group is killed and reaped and the folder removed (a finally block, which a SIGTERM
# of the launcher also runs: cleanup_on_sigterm). A worker exits by itself when its launcher is gone (a SIGKILL
# runs no finally block), removing the folder; a folder that survives even that is removed by the next launch
# (remove_stale_folders).


class DistributedError(RuntimeError):
    """A multi-process run failed or timed out. ``rank`` is the rank whose error is reported (for a timeout: the
    one rank that stopped making progress, None when it is not one), ``pids`` the worker processes (all ended when
    this is raised)."""

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
        deadline, started = time.monotonic() + timeout, time.time()
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
                stalled, why = stall_report(folder, codes, pids, started)
                errors = _errors(folder)
                extra = "".join(f"; rank {r} failed first: {e['error']}" for r, e in errors[:1])
                raise DistributedError(f"the run did not finish within {timeout:g} s: {why}; all {world} processes "
                                       f"were killed{extra}", stalled[0] if len(stalled) == 1 else None, pids)
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
    'hang' (a Python loop that makes no progress), 'stop' (SIGSTOP: the process, heartbeat included, stops), 'exit'
    (status 3) or 'kill' (SIGKILL)."""
    kind = fault.get("kind", "raise")
    if kind == "hang":
        while True:
            time.sleep(1)
    if kind == "stop":  # as a debugger, a ^Z or a stuck device driver would
        os.kill(os.getpid(), signal.SIGSTOP)
    if kind == "exit":
        os._exit(3)
    if kind == "kill":  # as the kernel's OOM killer or a user's kill -9 would
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError(fault.get("message", f"fault injected on rank {rank}"))


# What a worker process runs beside its job (parallel.worker, megatron.rank_worker): the other half of the
# launcher's protocol (the error file first_failure reads, the watchdog of a launcher that is gone).
def watchdog(launcher: int, deadline: float, folder: Path, rank: int) -> None:
    """End this worker when the process that launched it is gone or the run's time is over (the launcher
    normally kills it first). A launcher that is gone ran no cleanup (it was SIGKILLed): remove its folder.
    Meanwhile, write this rank's heartbeat (NOTE [Heartbeats])."""
    beat = Heartbeat(folder, rank)
    while True:
        with contextlib.suppress(Exception):  # a heartbeat is a diagnosis: never the cause of a failure
            beat.write()
        time.sleep(BEAT_SECONDS)
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


# NOTE [Heartbeats]
# A run that does not finish within its timeout is usually one rank that stopped (SIGSTOP, a debugger, a stuck
# driver) or loops without progress, and the others waiting for it in a collective. To tell them apart, each
# worker's watchdog thread writes rank<r>.beat.json every BEAT_SECONDS: the rank's phase (set_phase: connecting,
# measuring <policy>, ...) and where its main thread is (the innermost Python frame, and since when it has not
# moved). At the timeout, stall_report reads them: a rank whose heartbeat is stale (or whose process is stopped)
# stopped; a rank whose main thread sits in torch.distributed (a collective, a p2p wait, the rendezvous) waits; of
# the others, the one that has not moved for longest made no progress.
BEAT_SECONDS = 0.2
_STALE_BEAT = 2.0  # seconds without a heartbeat: the rank's process does not run
_PHASE: dict[str, Any] = {"phase": "starting", "since": time.time()}


def set_phase(phase: str) -> None:
    """In a worker: what this rank does now, as its heartbeat reports it (e.g. ``'measuring none'``)."""
    _PHASE.update(phase=phase, since=time.time())


class Heartbeat:
    """A worker's heartbeat file (``rank<r>.beat.json``): :meth:`write` records the phase and where the main
    thread is now."""

    def __init__(self, folder: Path, rank: int):
        self.path = folder / f"rank{rank}.beat.json"
        self.where: tuple[str, int, str] | None = None
        self.where_since = time.time()

    def write(self) -> None:
        where, module = _main_thread_place()  # first: nothing before it may release the GIL (see there)
        if not self.path.parent.is_dir():  # the run is over (its folder removed): not made again
            return
        now = time.time()
        if where != self.where:
            self.where, self.where_since = where, now
        write_atomic(self.path, json.dumps({
            "time": now, "phase": _PHASE["phase"], "phase_since": _PHASE["since"],
            "where": f"{Path(where[0]).name}:{where[1]} in {where[2]}" if where else "(no Python frame)",
            "where_since": self.where_since, "waiting": module.startswith("torch.distributed")}))


def _main_thread_place() -> tuple[tuple[str, int, str] | None, str]:
    """(file, line, function) of the main thread's innermost frame and its module, as plain values.

    The frame object is dropped before this returns, and nothing here releases the GIL, so the main thread cannot
    run while it is held: a frame held while its function returns keeps that function's locals (tensors) alive, and
    a recorded step would see them freed late."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return None, ""
    place = (frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name), str(frame.f_globals.get("__name__", ""))
    del frame
    return place


def _process_stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped by a signal (Linux's /proc; False where it cannot be told)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[:1] in (["T"], ["t"])


def stall_report(folder: Path, codes: Sequence[int | None], pids: Sequence[int],
                 started: float) -> tuple[list[int], str]:
    """Which ranks kept a run from finishing, from their heartbeats (NOTE [Heartbeats]).

    Args:
        folder: the run's folder, with each rank's ``rank<r>.beat.json``.
        codes: each rank's exit status (None: still running).
        pids: each rank's process.
        started: when the run started (wall clock, as the heartbeats).

    Returns:
        ``(stalled ranks, text)``: the text names the rank(s) that made no progress, since when and in which phase,
        and the ranks waiting on them, e.g. ``'rank 1 stopped making progress 0.8 s into the run (no heartbeat
        since; phase: measuring none, at pipeline_measure.py:211 in measure_pipeline_rank); rank(s) 0 waiting on
        it in torch.distributed (...)'``.
    """
    now = time.time()
    beats: dict[int, dict[str, Any]] = {}
    for rank in range(len(codes)):
        with contextlib.suppress(OSError, ValueError):
            beats[rank] = json.loads((folder / f"rank{rank}.beat.json").read_text(encoding="utf-8"))
    running = [r for r, c in enumerate(codes) if c is None]

    def at(seconds: float) -> str:
        return f"{max(seconds - started, 0.0):.1f} s into the run"

    def doing(beat: dict[str, Any]) -> str:
        return f"phase: {beat['phase']} (since {at(beat['phase_since'])}), at {beat['where']}"

    stopped, waiting, working, starting = [], [], [], []
    for rank in running:
        beat = beats.get(rank)
        if _process_stopped(pids[rank]) or (beat is not None and now - beat["time"] > _STALE_BEAT):
            stopped.append(rank)
        elif beat is None:  # still importing (torch, remat) before its watchdog started
            starting.append(rank)
        elif beat["waiting"]:
            waiting.append(rank)
        else:
            working.append(rank)
    parts = []
    for rank in stopped:
        beat = beats.get(rank)
        how = "its process is stopped (SIGSTOP?)" if _process_stopped(pids[rank]) else "no heartbeat since"
        parts.append(f"rank {rank} stopped making progress " + (
            f"{at(beat['time'])} ({how}; {doing(beat)})" if beat else f"before its first heartbeat ({how})"))
    # else, of the ranks neither stopped nor waiting, the one whose main thread has not moved for longest
    still = sorted((r for r in working if now - beats[r]["where_since"] > _STALE_BEAT),
                   key=lambda r: beats[r]["where_since"])
    stalled = stopped or still[:1]
    for rank in stalled[len(stopped):]:
        beat = beats[rank]
        parts.append(f"rank {rank} made no progress since {at(beat['where_since'])} ({doing(beat)})")
    others = [r for r in working if r not in stalled]
    if others:
        parts.append(f"rank(s) {', '.join(map(str, others))} still working (" +
                     "; ".join(f"rank {r}: {doing(beats[r])}" for r in others) + ")")
    if starting:
        parts.append(f"rank(s) {', '.join(map(str, starting))} still starting (no heartbeat yet: importing "
                     "torch and remat; a longer --timeout may be all it takes)")
    if waiting:
        whom = "on it" if len(stalled) == 1 else "on them" if stalled else \
            "for the ranks still starting" if starting else "in torch.distributed (a deadlock?)"
        parts.append(f"rank(s) {', '.join(map(str, waiting))} waiting {whom} (" +
                     "; ".join(f"rank {r}: {doing(beats[r])}" for r in waiting) + ")")
    finished = [r for r, c in enumerate(codes) if c == 0]
    if finished:
        parts.append(f"rank(s) {', '.join(map(str, finished))} finished")
    return stalled, "; ".join(parts)

