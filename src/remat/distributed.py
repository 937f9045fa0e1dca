"""Measure pipeline-parallel memory for real: one process per stage, ``torch.distributed.pipelining``.

:func:`measure_pipeline` starts ``pp`` worker processes (``python -m remat.distributed``) that meet through a TCP
store on a free port of 127.0.0.1 and form a process group (gloo on CPU, NCCL with ``device='cuda'``, rank r on
``cuda:r``). Each rank builds its model chunks with the same partition as :func:`remat.pipeline.predict_pipeline`
(cut from one seeded :func:`remat.model.build_model`, so the weights are the unsplit GPT's), applies the policy
to each chunk, wraps them in ``PipelineStage`` and runs ``ScheduleGPipe`` / ``Schedule1F1B`` /
``ScheduleInterleaved1F1B`` with the loss computed inside the last chunk. The first step allocates the
pipeline's buffers (and infers the stages' shapes); the second step is recorded by
:class:`remat.pipeline.PipelineRecorder` (real tensors, exact storage bytes on CPU), after every gradient is reset
to None. Each rank sends its :class:`~remat.timeline.Timeline` back as JSON through a temporary folder (written
atomically).

Every launched process ends: each worker runs in its own session (process group); when a rank fails, the run
stops with that rank's error (:class:`DistributedError`, the first rank to fail is named, with its message); when
the run does not finish within ``timeout`` seconds it stops naming the ranks still running; either way every
worker's process group is killed and reaped before the call returns. A worker also exits by itself when its
parent goes away.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from remat.config import ModelConfig
from remat.policy import Policy
from remat.timeline import Timeline, write_atomic

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


def measure_pipeline(config: ModelConfig, policy: Policy | str, pp: int, microbatches: int, schedule: str = "1f1b",
                     vpp: int = 1, layout: Sequence[int] | None = None,
                     partial_checkpoint_microbatches: int | None = None, *, device: str = "cpu",
                     timeout: float = DEFAULT_TIMEOUT, seed: int = 0, fault: dict[str, Any] | None = None,
                     ) -> list[Timeline]:
    """Measure one training step of each pipeline stage for real; one :class:`Timeline` per rank.

    The settings mean what they mean for :func:`remat.pipeline.predict_pipeline` (with ``runtime='torch'``).
    ``timeout`` bounds the whole run in seconds (process start included); ``fault`` is for tests: ``{'rank': r,
    'kind': 'raise' | 'hang' | 'exit', 'message': text, 'when': 'step' | 'start'}`` makes rank r raise
    ``RuntimeError(text)``, sleep forever, or exit with status 3, either after the first (unrecorded) step, while
    the other ranks wait for it in the recorded step (``'step'``, the default), or before it imports torch
    (``'start'``). Raises :class:`DistributedError` (see the module
    docstring) and :class:`remat.pipeline.PipelineError` for settings that cannot run (before starting anything).
    Each timeline's ``meta`` has ``pid``, ``rank`` and ``pipeline`` (as predicted timelines, with the order the
    stage actually ran).
    """
    return measure_pipeline_many(config, [policy], pp, microbatches, schedule, vpp, layout,
                                 partial_checkpoint_microbatches, device=device, timeout=timeout, seed=seed,
                                 fault=fault)[0]


def measure_pipeline_many(config: ModelConfig, policies: Sequence[Policy | str], pp: int, microbatches: int,
                          schedule: str = "1f1b", vpp: int = 1, layout: Sequence[int] | None = None,
                          partial_checkpoint_microbatches: int | None = None, *, device: str = "cpu",
                          timeout: float = DEFAULT_TIMEOUT, seed: int = 0, fault: dict[str, Any] | None = None,
                          ) -> list[list[Timeline]]:
    """:func:`measure_pipeline` for several policies in one launch (one list of stage timelines per policy, in
    order); ``timeout`` bounds the whole launch."""
    from remat.pipeline import PipelineError, _check_partial, check_schedule, partition

    parsed = [Policy.parse(p) if isinstance(p, str) else p for p in policies]
    if not parsed:
        raise PipelineError("no policy to measure: give at least one, e.g. 'none'")
    schedule = check_schedule(schedule, pp, microbatches, vpp, "torch")
    partial = _check_partial(partial_checkpoint_microbatches)
    specs = partition(config, pp, vpp, layout)
    for policy in parsed:
        for spec in specs:
            if policy.granularity == "full" and policy.num_layers > spec.num_layers:
                raise PipelineError(f"policy {policy} groups {policy.num_layers} layers but chunk {spec.index} has "
                                    f"{spec.num_layers} layers: use --recompute-num-layers <= {spec.num_layers}")
    if device not in ("cpu", "cuda"):
        raise PipelineError(f"device={device!r}: use 'cpu' (gloo) or 'cuda' (NCCL, one GPU per rank)")
    if device == "cuda":
        import torch

        if torch.cuda.device_count() < pp:
            raise PipelineError(f"device='cuda' runs one rank per GPU: pp={pp} needs {pp} GPUs, this machine has "
                                f"{torch.cuda.device_count()}; use a smaller pp or device='cpu'")
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise PipelineError(f"timeout={timeout!r}: must be a positive number of seconds")
    job = {
        "config": config.to_dict(), "policies": [str(p) for p in parsed], "pp": pp, "microbatches": microbatches,
        "schedule": schedule, "vpp": vpp, "layout": [s.num_layers for s in specs], "partial": partial,
        "device": device, "seed": seed, "fault": fault, "timeout": float(timeout),
    }
    results = launch_job(job, pp, timeout)
    per_policy: list[list[Timeline]] = [[] for _ in parsed]
    for rank in range(pp):
        for i, data in enumerate(results[rank]):
            per_policy[i].append(Timeline.from_dict(data))
    return per_policy


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
                    [sys.executable, "-m", "remat.distributed", "--worker", str(folder), str(rank),
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


# ------------------------------------------------------------------------------------------------ compare
def compare_pipeline(config: ModelConfig, policies: Sequence[Policy | str], pp: int, microbatches: int,
                     schedule: str = "1f1b", vpp: int = 1, layout: Sequence[int] | None = None,
                     partial_checkpoint_microbatches: int | None = None, *, device: str = "cpu",
                     timeout: float = DEFAULT_TIMEOUT) -> list[dict[str, Any]]:
    """Per stage and policy: the measured peak, the predicted peak (``runtime='torch'``) and
    ``error = (predicted - measured) / measured``. Rows have ``stage``, ``policy``, ``predicted_bytes``,
    ``measured_bytes``, ``error``, ``max_in_flight``, ``in_flight_at_peak`` and ``why`` (measured)."""
    from remat.pipeline import peak_error, predict_pipeline, stage_summary

    measured = measure_pipeline_many(config, policies, pp, microbatches, schedule, vpp, layout,
                                     partial_checkpoint_microbatches, device=device, timeout=timeout)
    rows = []
    for policy, stages in zip(policies, measured):
        predicted = predict_pipeline(config, policy, pp, microbatches, schedule, vpp, layout,
                                     partial_checkpoint_microbatches, runtime="torch", device=device)
        for real, guess in zip(stages, predicted):
            summary = stage_summary(real)
            rows.append({"stage": summary["stage"], "policy": str(policy), "predicted_bytes": guess.peak_bytes,
                         "measured_bytes": real.peak_bytes, "error": peak_error(real.peak_bytes, guess.peak_bytes),
                         "max_in_flight": summary["max_in_flight"],
                         "in_flight_at_peak": summary["in_flight_at_peak"],
                         "predicted_phase": guess.peak_phase.label, "measured_phase": real.peak_phase.label,
                         "why": summary["why"]})
    return rows


# ------------------------------------------------------------------------------------------------ worker
def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _watchdog(launcher: int, deadline: float, folder: Path, rank: int) -> None:
    """End this worker when the process that launched it is gone or the run's time is over (the launcher
    normally kills it first)."""
    while True:
        time.sleep(0.2)
        gone = not _alive(launcher)
        if gone or time.time() > deadline:
            reason = "the launching process is gone" if gone else "the run's timeout passed"
            with contextlib.suppress(Exception):
                _report_error(folder, rank, f"worker stopped: {reason}", "")
            os._exit(4)


def _report_error(folder: Path, rank: int, error: str, trace: str) -> None:
    write_atomic(folder / f"rank{rank}.error.json",
                 json.dumps({"rank": rank, "error": error, "traceback": trace, "time": time.time()}))


def _worker(folder: Path, rank: int, launcher: int) -> int:
    job = json.loads((folder / "job.json").read_text(encoding="utf-8"))
    threading.Thread(target=_watchdog, args=(launcher, time.time() + job["timeout"] + 5.0, folder, rank),
                     daemon=True).start()
    try:
        fault = job.get("fault") or {}
        if fault.get("rank") == rank and fault.get("when") == "start":
            _inject(fault, rank)
        if sys.platform.startswith("linux"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the run stays on 127.0.0.1
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        cuda = job["device"] == "cuda"
        if cuda:
            torch.cuda.set_device(rank)
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{job['port']}",
                                rank=rank, world_size=job.get("world", job["pp"]),
                                timeout=datetime.timedelta(seconds=max(job["timeout"], 1.0)))
        try:
            measure_one = _measure_tensor_parallel_rank if job.get("kind") == "tensor_parallel" else _measure_rank
            results = [measure_one(job, policy, rank).to_dict() for policy in job["policies"]]
            dist.barrier()  # every rank is done with its collectives before any tears its connections down
        finally:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        write_atomic(folder / f"rank{rank}.json", json.dumps(results, separators=(",", ":")))
        return 0
    except BaseException as err:  # noqa: BLE001 - every failure is reported to the parent
        message = "".join(traceback.format_exception_only(type(err), err)).strip()
        _report_error(folder, rank, message, traceback.format_exc())
        return 1


def _measure_tensor_parallel_rank(job: dict[str, Any], policy_text: str, rank: int) -> Timeline:
    """One rank of :func:`remat.parallel.measure_tensor_parallel`: its share of the model, one measured step."""
    from remat.apply import apply
    from remat.measure import measure
    from remat.model import sample_batch
    from remat.parallel import DistributedGroup, build_tp_model

    config = ModelConfig.from_dict(job["config"])
    model = build_tp_model(config, DistributedGroup(), job["sp"], seed=job["seed"])
    if job.get("plan") is not None:
        from remat.plan import Plan

        apply(model, Plan.from_dict(job["plan"]))
    else:
        apply(model, policy_text)
    timeline = measure(model, sample_batch(config))
    timeline.meta.update({"tp": job["world"], "sp": job["sp"], "rank": rank})
    return timeline


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


def _measure_rank(job: dict[str, Any], policy_text: str, rank: int) -> Timeline:
    import torch
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    from remat.apply import apply
    from remat.measure import CUDA_BLOCK
    from remat.model import sample_batch
    from remat.pipeline import (
        PipelineRecorder,
        build_stage_modules,
        checkpointed_forwards,
        checkpointing_disabled,
        container_of,
        describe_stage,
        gc_paused,
        partition,
        pipeline_meta,
        rank_chunks,
        schedule_actions,
        warmup_forwards,
    )

    config = ModelConfig.from_dict(job["config"])
    pp, m, vpp, schedule = job["pp"], job["microbatches"], job["vpp"], job["schedule"]
    device = torch.device(f"cuda:{rank}" if job["device"] == "cuda" else "cpu")
    specs = partition(config, pp, vpp, job["layout"])
    mine = rank_chunks(specs, pp, rank)
    chunks = build_stage_modules(config, mine, device=device, seed=job["seed"])
    policy = Policy.parse(policy_text)
    for chunk in chunks:
        apply(chunk, policy)
    stages = [PipelineStage(chunk, chunk.spec.index, len(specs), device) for chunk in chunks]

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return output  # the last chunk computes the loss itself, as Megatron's last stage does

    if schedule == "gpipe":
        runner: Any = ScheduleGPipe(stages[0], m, loss_fn=loss_fn)
    elif schedule == "1f1b":
        runner = Schedule1F1B(stages[0], m, loss_fn=loss_fn)
    else:
        runner = ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn)

    expected = schedule_actions(schedule, pp, m, vpp, rank, runtime="torch")
    window = warmup_forwards(schedule, pp, m, vpp, rank, "megatron") + 1
    checkpointed = checkpointed_forwards(expected, job["partial"], window)
    by_index = {chunk.spec.index: chunk for chunk in chunks}
    ran: list[str] = []
    active: list[PipelineRecorder] = []  # the recorder while the recorded step runs

    for stage in stages:
        spec = by_index[stage.stage_index].spec

        def forward_one_chunk(mb: int, *args: Any, _stage: Any = stage, _f: Any = stage.forward_one_chunk,
                              _spec: Any = spec, **kwargs: Any) -> Any:
            ran.append(f"F{mb}" + (f"c{_spec.index}" if _spec.index else ""))
            for recorder in active:
                recorder.begin_op("forward", _spec, mb)
            ctx = (contextlib.nullcontext() if checkpointed.get((_spec.index, mb), True)
                   else checkpointing_disabled(_stage.submod))
            try:
                with ctx:
                    return _f(mb, *args, **kwargs)
            finally:
                for recorder in active:
                    recorder.end_op()

        def backward_one_chunk(mb: int, *args: Any, _f: Any = stage.backward_one_chunk, _spec: Any = spec,
                               **kwargs: Any) -> Any:
            ran.append(f"B{mb}" + (f"c{_spec.index}" if _spec.index else ""))
            for recorder in active:
                recorder.begin_op("backward", _spec, mb)
            try:
                return _f(mb, *args, **kwargs)
            finally:
                for recorder in active:
                    recorder.end_op()

        stage.forward_one_chunk = forward_one_chunk  # type: ignore[method-assign]
        stage.backward_one_chunk = backward_one_chunk  # type: ignore[method-assign]

    first = any(c.spec.is_first for c in chunks)
    last = any(c.spec.is_last for c in chunks)
    tokens, labels = sample_batch(config.replace(micro_batch_size=m * config.micro_batch_size), device=device,
                                  seed=job["seed"])
    tokens = tokens if first else None
    labels = labels if last else None
    fault = job.get("fault") or {}

    def step() -> None:
        args = (tokens,) if first else ()
        kwargs = {"labels": labels} if last else {}
        runner.step(*args, target=labels, return_outputs=False, **kwargs)

    step()  # allocates the pipeline's buffers and infers the stages' shapes: not recorded
    if fault.get("rank") == rank and fault.get("when", "step") == "step":
        _inject(fault, rank)
    for chunk in chunks:
        chunk.zero_grad(set_to_none=True)
    ran.clear()
    named: list[tuple[str, Any]] = []
    for stage in stages:
        for mb in range(m):
            named += [(f"pipeline.stage{stage.stage_index}.recv_activation", info.buffer)
                      for info in stage.args_recv_info.get(mb, ()) if not info.is_root_arg]
        for mb in range(m):
            named += [(f"pipeline.stage{stage.stage_index}.recv_grad", info.buffer)
                      for info in stage.grad_recv_info.get(mb, ())]
    named += [("tokens", tokens), ("labels", labels)]
    container = container_of(chunks)
    recorder = PipelineRecorder(container, chunks, block_bytes=CUDA_BLOCK if device.type == "cuda" else 1)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    with gc_paused(), recorder:
        recorder.track_setup(named)
        active.append(recorder)
        try:
            step()
        finally:
            active.clear()
        recorder.set_phase("setup", "end")
    recorder.categorize(None)
    tl = recorder.timeline
    tl.meta["phase_flops"] = recorder.phase_flops
    tl.meta.update({"backend": device.type, "device": str(device), "policy": str(policy), "rank": rank,
                    "config": config.to_dict(), "num_layers": sum(c.spec.num_layers for c in chunks),
                    "record_seconds": time.perf_counter() - start, "regions": []})
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        tl.meta["cuda_max_memory_allocated"] = torch.cuda.max_memory_allocated(device)
    info = pipeline_meta(schedule, pp, m, vpp, rank, [c.spec for c in chunks], "torch", job["partial"], expected)
    info["order"] = " ".join(ran)
    info["expected_order"] = " ".join(str(a) for a in expected)
    tl.meta["pipeline"] = info
    describe_stage(tl)
    return tl


def _inject(fault: dict[str, Any], rank: int) -> None:
    kind = fault.get("kind", "raise")
    if kind == "hang":
        while True:
            time.sleep(1)
    if kind == "exit":
        os._exit(3)
    raise RuntimeError(fault.get("message", f"fault injected on rank {rank}"))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="remat pipeline worker (started by remat.distributed)")
    parser.add_argument("--worker", nargs=3, metavar=("FOLDER", "RANK", "PARENT_PID"), required=True)
    args = parser.parse_args(argv)
    folder, rank, parent = args.worker
    return _worker(Path(folder), int(rank), int(parent))


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip the interpreter's teardown: the results are written (atomically) and the process group destroyed, and a
    # communication library's static destructors at exit could still abort the process (seen once on gloo as
    # "terminate called without an active exception"), which the launcher would report as a failed rank.
    os._exit(code)
