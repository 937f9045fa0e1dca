"""Build a unit model in a forked process while this one does other work (:func:`prefetch_unit_model`): a job
plan's unit model traces then run on one core while its exact stage predictions trace on the other."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import torch

from remat.config import ModelConfig
from remat.memory import disk_cache
from remat.memory.trace_pool import available_workers, worker_timeout
from remat.plan.unit_model import (
    PENDING,
    UNIT_MODELS,
    UnitModel,
    model_from_dict,
    model_to_dict,
    unit_model,
    unit_model_disk_key,
    unit_model_key,
)
from remat.policy import ENGINES

# the processes prefetch_unit_model started, by key, each with the end it sends its answer to
_STARTED: dict[tuple[Any, ...], tuple[BaseProcess, Connection]] = {}


def prefetch_unit_model(config: ModelConfig, *, device: str = "cpu", engine: str = "reentrant", tp: int = 1,
                        sp: bool = False) -> bool:
    """Start building :func:`~remat.plan.unit_model.unit_model`'s answer for these arguments in a forked process;
    the next ``unit_model`` call with them waits for it and takes it (the same model: built by the same code and
    sent back in the disk cache's exact JSON form; if the process fails or sends nothing within
    :func:`~remat.memory.trace_pool.worker_timeout` seconds, ``unit_model`` builds it itself and raises what
    fails). Nothing is started when the model is made or stored already, for arguments ``unit_model`` refuses, or
    with one core or no ``fork``. Returns whether a process was started."""
    key = unit_model_key(config, device, engine, tp, sp)
    if key in UNIT_MODELS or key in PENDING or device not in ("cpu", "cuda") or engine not in ENGINES:
        return False
    if available_workers() <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        return False
    if disk_cache.load("unit_model", unit_model_disk_key(key)) is not None:
        return False  # read from disk when asked: nothing to overlap
    process, receive = _fork(lambda: model_to_dict(unit_model(config, device=device, engine=engine, tp=tp, sp=sp)))
    PENDING[key] = lambda: _take(key, process, receive)
    _STARTED[key] = process, receive
    return True


def prefetch_pending(config: ModelConfig, *, device: str = "cpu", engine: str = "reentrant", tp: int = 1,
                     sp: bool = False) -> bool:
    """Whether :func:`prefetch_unit_model`'s process for these arguments is still building the model (it has sent
    nothing yet): a caller may do other work meanwhile instead of waiting in ``unit_model``."""
    key = unit_model_key(config, device, engine, tp, sp)
    started = _STARTED.get(key)
    if key not in PENDING or started is None:
        return False
    try:
        return not started[1].poll(0)
    except (EOFError, OSError):  # closed: taken or failed, nothing to wait for
        return False


def cancel_prefetches() -> None:
    """Stop the unit models still being built by :func:`prefetch_unit_model` (their answer is not wanted: e.g.
    every stage fits without recomputing anything); a later ``unit_model`` call builds its own."""
    for key, (process, _) in list(_STARTED.items()):
        if PENDING.pop(key, None) is not None and process.is_alive():
            process.terminate()
        process.join()
    _STARTED.clear()


def _take(key: tuple[Any, ...], process: BaseProcess, receive: Connection) -> UnitModel | None:
    _STARTED.pop(key, None)
    data = _received(process, receive)  # None: unit_model builds the model itself
    try:
        return None if data is None else model_from_dict(data)
    except (KeyError, TypeError, ValueError):
        return None


def _fork(build: Callable[[], Any]) -> tuple[BaseProcess, Connection]:
    """A forked process sending ``build()``'s answer (None when it fails), and the end that receives it."""
    receive, send = multiprocessing.Pipe(duplex=False)
    process = multiprocessing.get_context("fork").Process(target=_answer, args=(build, send), daemon=True)
    process.start()
    send.close()
    return process, receive


def _answer(build: Callable[[], Any], send: Connection) -> None:
    torch.set_num_threads(1)  # fake tensors compute nothing; never touch an OpenMP pool made before the fork
    try:
        send.send(build())
    except Exception:  # the parent builds it again and raises the error itself
        send.send(None)
    finally:
        send.close()


def _received(process: BaseProcess, receive: Connection) -> Any | None:
    try:  # a process that sends nothing in time (killed, stuck) is ended
        data = receive.recv() if receive.poll(worker_timeout()) else None
    except (EOFError, OSError):
        data = None
    finally:
        receive.close()
        if process.is_alive() and data is None:
            process.terminate()
        process.join()
    return data
