"""Measure a megatron-core model for real on CPU with one gloo process per rank (TP, PP, ...), to compare with
:func:`remat.megatron.predict_megatron_core` rank by rank.

The processes are started, watched and always ended as :mod:`remat.parallel.launch` does for remat's own models
(its store folder, failure naming, SIGTERM clean-up and timeout); each runs :mod:`remat.megatron.rank_worker`,
which rebuilds the ``TransformerConfig`` from JSON (:mod:`remat.megatron.config_json`) and records its rank's step
with the same code as a prediction, only with real tensors and the gloo backend.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from remat.megatron.compat import MegatronSettingError
from remat.megatron.config_json import config_to_json
from remat.megatron.routing import RoutingAssumption
from remat.megatron.world import ParallelSizes
from remat.parallel.launch import (
    FOLDER_PREFIX,
    DistributedError,
    cleanup_on_sigterm,
    first_failure,
    free_port,
    remove_stale_folders,
)
from remat.timeline import Timeline, write_atomic

DEFAULT_TIMEOUT = 180.0
GRACE_S = 1.0  # after a rank fails, how long to wait for its peers' errors (to name the first failure)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parent.parent.parent)
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the run stays on 127.0.0.1
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _end(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:  # each worker runs in its own session: kill its whole process group
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
    for p in procs:
        with contextlib.suppress(Exception):
            p.wait(timeout=30)


def _run(job: dict[str, Any], world: int, timeout: float) -> list[dict[str, Any]]:
    remove_stale_folders()
    folder = Path(tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        write_atomic(folder / "job.json", json.dumps(job))
        env = _env()
        for rank in range(world):
            with open(folder / f"rank{rank}.log", "wb") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "remat.megatron.rank_worker", str(folder), str(rank), str(os.getpid())],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                    start_new_session=True))
        pids = [p.pid for p in procs]
        deadline, failed_at, exited = time.monotonic() + timeout, None, {}
        while True:
            codes = [p.poll() for p in procs]
            for rank, code in enumerate(codes):
                if code is not None:
                    exited.setdefault(rank, time.time())
            if all(c == 0 for c in codes):
                break
            if any(c not in (None, 0) for c in codes):
                failed_at = failed_at or time.monotonic()
                if all(c is not None for c in codes) or time.monotonic() - failed_at >= GRACE_S:
                    rank, message = first_failure(folder, codes, exited)
                    raise DistributedError(f"rank {rank} failed: {message}", rank, pids)
            if time.monotonic() >= deadline:
                running = ", ".join(str(r) for r, c in enumerate(codes) if c is None)
                raise DistributedError(f"the run did not finish within {timeout:g} s: rank(s) {running} still "
                                       f"running; all {world} processes were killed", None, pids)
            time.sleep(0.05)
        results = []
        for rank in range(world):
            try:
                results.append(json.loads((folder / f"rank{rank}.json").read_text(encoding="utf-8")))
            except (OSError, ValueError) as err:
                raise DistributedError(f"rank {rank} exited without a result ({err})", rank, pids) from err
        return results
    finally:
        _end(procs)
        shutil.rmtree(folder, ignore_errors=True)


def measure_megatron_core_distributed(config: Any, *, seq_length: int, micro_batch_size: int, vocab_size: int,
                                      tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, etp: int | None = None,
                                      dp: int | None = None, ddp: bool = False, use_distributed_optimizer: bool = False,
                                      optimizer: str = "none", routing: RoutingAssumption | str | None = None,
                                      timeout: float = DEFAULT_TIMEOUT) -> dict[int, Timeline]:
    """Run one training step of a megatron-core GPT for real on CPU, one gloo process per rank, and measure
    every rank.

    Args:
        config: a ``TransformerConfig`` (or ``MLATransformerConfig``) whose fields travel as JSON (see
            :mod:`remat.megatron.config_json`); the default local layer spec.
        seq_length, micro_batch_size, vocab_size, tp, pp, cp, ep, etp, dp, ddp, use_distributed_optimizer,
            optimizer, routing: as :func:`remat.megatron.predict_megatron_core`.
        timeout: seconds for the whole run; past it every process is killed and :class:`DistributedError` names
            the ranks still running.

    Returns:
        ``{rank: Timeline}`` for every rank of the job (``meta['backend'] == 'cpu'``, ``meta['pid']``).

    Raises:
        DistributedError: a rank failed (the first failure is named) or the run timed out; every process has
            ended when it is raised.

    Example::

        >>> config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
        ...                            tensor_model_parallel_size=2, use_cpu_initialization=True)
        >>> measured = measure_megatron_core_distributed(config, seq_length=32, micro_batch_size=2,
        ...                                              vocab_size=128, tp=2)
        >>> sorted(measured)
        [0, 1]
    """
    sizes = ParallelSizes(tp, pp, cp, ep, etp, dp)
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise MegatronSettingError(f"timeout={timeout!r}: give the run's limit in seconds, > 0")
    if isinstance(routing, str):
        routing = RoutingAssumption.parse(routing)
    job = {"config": config_to_json(config), "seq_length": seq_length, "micro_batch_size": micro_batch_size,
           "vocab_size": vocab_size, "sizes": {"tp": tp, "pp": pp, "cp": cp, "ep": ep, "etp": etp, "dp": dp},
           "ddp": ddp, "use_distributed_optimizer": use_distributed_optimizer, "optimizer": optimizer,
           "routing": str(routing) if routing is not None else None, "timeout": float(timeout)}
    for attempt in range(2):  # the free port may be taken between choosing it and rank 0 listening on it
        job["port"] = free_port()
        try:
            with cleanup_on_sigterm():
                results = _run(job, sizes.world_size, float(timeout))
            break
        except DistributedError as err:
            if attempt or "address already in use" not in str(err).lower():
                raise
    return {rank: Timeline.from_dict(data) for rank, data in enumerate(results)}
