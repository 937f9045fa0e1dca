"""Build a unit model in forked processes while this one does other work (:func:`prefetch_unit_model`): a job
plan's unit model traces (its layer stack and its group stack, one process each) then run beside its exact stage
predictions, on every core."""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import torch

from remat.config import ModelConfig
from remat.memory import disk_cache
from remat.memory.trace_pool import available_workers, warm_up, worker_timeout
from remat.plan.unit_model import (
    PENDING,
    UNIT_MODELS,
    UnitModel,
    base_unit_model,
    finish_unit_model,
    group_stack,
    model_from_dict,
    model_to_dict,
    stack_shapes,
    stack_shapes_from_json,
    stack_shapes_to_json,
    unit_model_disk_key,
    unit_model_key,
)
from remat.policy import ENGINES

# the processes prefetch_unit_model started, by key, each with the end it sends its answer to
_STARTED: dict[tuple[Any, ...], list[tuple[BaseProcess, Connection]]] = {}


def prefetch_unit_model(config: ModelConfig, *, device: str = "cpu", engine: str = "reentrant", tp: int = 1,
                        sp: bool = False) -> bool:
    """Start building :func:`~remat.plan.unit_model.unit_model`'s answer for these arguments in two forked processes
    (the model with the units of its layer stack, :func:`~remat.plan.unit_model.base_unit_model`, and the shapes of its
    group stack's units); the next ``unit_model`` call with them waits for both and takes the model they make (the same
    model: built by the same code and sent back in the disk cache's exact JSON form; if a process fails or sends nothing
    within :func:`~remat.memory.trace_pool.worker_timeout` seconds, ``unit_model`` builds it itself and raises what
    fails). Nothing is started when the model is made or stored already, for arguments ``unit_model`` refuses, or with
    one core or no ``fork``. Returns whether the processes were started."""
    key = unit_model_key(config, device, engine, tp, sp)
    if key in UNIT_MODELS or key in PENDING or device not in ("cpu", "cuda") or engine not in ENGINES:
        return False
    if available_workers() <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        return False
    if disk_cache.load("unit_model", unit_model_disk_key(key)) is not None:
        return False  # read from disk when asked: nothing to overlap
    started = time.perf_counter()
    forks = [_fork(lambda: model_to_dict(base_unit_model(config, device=device, engine=engine, tp=tp, sp=sp))),
             _fork(lambda: stack_shapes_to_json(stack_shapes(config, group_stack(config, engine), device=device,
                                                             engine=engine, tp=tp, sp=sp)))]
    PENDING[key] = lambda: _take(key, forks, started)
    _STARTED[key] = forks
    return True


def prefetch_pending(config: ModelConfig, *, device: str = "cpu", engine: str = "reentrant", tp: int = 1,
                     sp: bool = False) -> bool:
    """Whether :func:`prefetch_unit_model`'s processes for these arguments are still building the model (one has
    sent nothing yet): a caller may do other work meanwhile instead of waiting in ``unit_model``."""
    key = unit_model_key(config, device, engine, tp, sp)
    forks = _STARTED.get(key)
    if key not in PENDING or forks is None:
        return False
    try:
        return not all(receive.poll(0) for _, receive in forks)
    except (EOFError, OSError):  # closed: taken or failed, nothing to wait for
        return False


def cancel_prefetches() -> None:
    """Stop the unit models still being built by :func:`prefetch_unit_model` (their answer is not wanted: e.g.
    every stage fits without recomputing anything); a later ``unit_model`` call builds its own."""
    for key, forks in list(_STARTED.items()):
        wanted = PENDING.pop(key, None) is not None
        for process, _ in forks:
            if wanted and process.is_alive():
                process.terminate()
            process.join()
    _STARTED.clear()


def _take(key: tuple[Any, ...], forks: list[tuple[BaseProcess, Connection]], started: float) -> UnitModel | None:
    _STARTED.pop(key, None)
    base, groups = [_received(process, receive) for process, receive in forks]
    if base is None or groups is None:  # unit_model builds the model itself
        return None
    try:
        return finish_unit_model(model_from_dict(base), stack_shapes_from_json(groups), time.perf_counter() - started)
    except (KeyError, TypeError, ValueError):
        return None


def _fork(build: Callable[[], Any]) -> tuple[BaseProcess, Connection]:
    """A forked process sending ``build()``'s answer (None when it fails), and the end that receives it."""
    warm_up(dispatch=True)  # imported once here, not in each process forked (a plan forks several rounds)
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
