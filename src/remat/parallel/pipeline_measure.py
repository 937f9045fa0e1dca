"""Measuring pipeline stages for real: torch.distributed.pipelining on gloo, one process per stage."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

from remat.config import ModelConfig
from remat.memory.comparison import check_fits
from remat.models.gpt import sample_batch
from remat.parallel.launch import DEFAULT_TIMEOUT, inject_fault, launch_job
from remat.parallel.pipeline_peaks import stage_peaks
from remat.parallel.pipeline_predict import MAX_COMPOSED_MICROBATCHES, pipeline_meta, predict_pipeline
from remat.parallel.pipeline_report import describe_stage, peak_error, stage_summary
from remat.parallel.schedule import (
    PipelineError,
    check_partial,
    check_policy_fits,
    check_schedule,
    checkpointed_forwards,
    partition,
    rank_chunks,
    schedule_actions,
    warmup_forwards,
)
from remat.parallel.stages import PipelineRecorder, build_stage_modules, checkpointing_disabled, container_of, gc_paused
from remat.policy import Policy
from remat.recompute.apply import apply
from remat.timeline import Timeline
from remat.units import CUDA_BLOCK


def measure_pipeline(config: ModelConfig, policy: Policy | str, pp: int, microbatches: int, schedule: str = "1f1b",
                     vpp: int = 1, layout: Sequence[int] | None = None,
                     partial_checkpoint_microbatches: int | None = None, *, device: str = "cpu",
                     timeout: float = DEFAULT_TIMEOUT, seed: int = 0, fault: dict[str, Any] | None = None,
                     ) -> list[Timeline]:
    """Measure one training step of each pipeline stage for real; one :class:`Timeline` per rank.

    The settings mean what they mean for :func:`remat.parallel.pipeline_predict.predict_pipeline` (with
    ``runtime='torch'``).
    ``timeout`` bounds the whole run in seconds (process start included); ``fault`` is for tests: ``{'rank': r,
    'kind': 'raise' | 'hang' | 'exit', 'message': text, 'when': 'step' | 'start'}`` makes rank r raise
    ``RuntimeError(text)``, sleep forever, or exit with status 3, either after the first (unrecorded) step, while
    the other ranks wait for it in the recorded step (``'step'``, the default), or before it imports torch
    (``'start'``). Raises :class:`DistributedError` (see the module
    docstring) and :class:`remat.parallel.schedule.PipelineError` for settings that cannot run (before starting
    anything).
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

    parsed = [Policy.parse(p) if isinstance(p, str) else p for p in policies]
    if not parsed:
        raise PipelineError("no policy to measure: give at least one, e.g. 'none'")
    schedule = check_schedule(schedule, pp, microbatches, vpp, "torch")
    if microbatches > MAX_COMPOSED_MICROBATCHES:  # refused before the run, not by the prediction after it
        raise PipelineError(f"microbatches={microbatches} (--microbatches): a measured run is put beside its "
                            f"composed prediction, built for at most {MAX_COMPOSED_MICROBATCHES} microbatches; "
                            f"measure at most {MAX_COMPOSED_MICROBATCHES} ('remat predict --pp' prints any count)")
    partial = check_partial(partial_checkpoint_microbatches)
    specs = partition(config, pp, vpp, layout)
    for policy in parsed:
        check_policy_fits(policy, specs)
    if device not in ("cpu", "cuda"):
        raise PipelineError(f"device={device!r}: use 'cpu' (gloo) or 'cuda' (NCCL, one GPU per rank)")
    if device == "cuda":
        import torch

        if torch.cuda.device_count() < pp:
            raise PipelineError(f"device='cuda' runs one rank per GPU: pp={pp} needs {pp} GPUs, this machine has "
                                f"{torch.cuda.device_count()}; use a smaller pp or device='cpu'")
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise PipelineError(f"timeout={timeout!r}: must be a positive number of seconds")
    check_stages_fit(config, parsed, pp, microbatches, schedule, vpp, layout, partial, device)
    job = {
        "kind": "pipeline", "config": config.to_dict(), "policies": [str(p) for p in parsed], "world": pp, "pp": pp,
        "microbatches": microbatches,
        "schedule": schedule, "vpp": vpp, "layout": [s.num_layers for s in specs], "partial": partial,
        "device": device, "seed": seed, "fault": fault, "timeout": float(timeout),
    }
    results = launch_job(job, pp, timeout)
    per_policy: list[list[Timeline]] = [[] for _ in parsed]
    for rank in range(pp):
        for i, data in enumerate(results[rank]):
            per_policy[i].append(Timeline.from_dict(data))
    return per_policy


def check_stages_fit(config: ModelConfig, policies: Sequence[Policy], pp: int, microbatches: int, schedule: str,
                     vpp: int, layout: Sequence[int] | None, partial: int | None, device: str) -> None:
    """Refuse, before any process starts, a run whose stages would not fit in this machine's memory
    (:func:`remat.memory.comparison.check_fits`, as compare and explain check one process), from each stage's
    predicted peak (:func:`~remat.parallel.pipeline_peaks.stage_peaks`: shapes only, any microbatch count): on CPU
    every rank is a process of this machine, so their peaks add up; on CUDA each rank has a GPU of its own."""
    rows = [stage_peaks(config, p, pp, microbatches, schedule, vpp, layout, partial, runtime="torch", device=device)
            for p in policies]
    per_rank = [max(r[rank]["peak_bytes"] for r in rows) for rank in range(pp)]
    together = device == "cpu" and pp > 1
    check_fits(sum(per_rank) if together else max(per_rank), device, config=config,
               what=f"measuring {pp} pipeline stage(s)" + " (one process each, on this machine)" * together,
               basis="the stages' predicted peaks added" if together else "the largest predicted peak")


# ------------------------------------------------------------------------------------------------ compare
def compare_pipeline(config: ModelConfig, policies: Sequence[Policy | str], pp: int, microbatches: int,
                     schedule: str = "1f1b", vpp: int = 1, layout: Sequence[int] | None = None,
                     partial_checkpoint_microbatches: int | None = None, *, device: str = "cpu",
                     timeout: float = DEFAULT_TIMEOUT) -> list[dict[str, Any]]:
    """Measure every policy's stages in one launch (:func:`measure_pipeline_many`) and put each beside its
    prediction: the rows of :func:`measured_stage_rows`."""
    measured = measure_pipeline_many(config, policies, pp, microbatches, schedule, vpp, layout,
                                     partial_checkpoint_microbatches, device=device, timeout=timeout)
    return measured_stage_rows(config, policies, measured, pp, microbatches, schedule, vpp, layout,
                               partial_checkpoint_microbatches, device=device)


def measured_stage_rows(config: ModelConfig, policies: Sequence[Policy | str], measured: Sequence[Sequence[Timeline]],
                        pp: int, microbatches: int, schedule: str = "1f1b", vpp: int = 1,
                        layout: Sequence[int] | None = None, partial_checkpoint_microbatches: int | None = None, *,
                        device: str = "cpu") -> list[dict[str, Any]]:
    """Per policy, then stage: the measured stage's summary (:func:`~remat.parallel.pipeline_report.stage_summary`:
    ``stage``, ``policy``, ``peak_phase``, ``max_in_flight``, ``in_flight_at_peak``, ``why``, ...) with
    ``measured_bytes``, ``predicted_bytes`` (``runtime='torch'``), ``error = (predicted - measured) / measured``,
    ``measured_phase``, ``predicted_phase`` and the worker's ``pid``; ``measured`` is what
    :func:`measure_pipeline_many` returned for ``policies``."""
    rows = []
    for policy, stages in zip(policies, measured):
        predicted = predict_pipeline(config, policy, pp, microbatches, schedule, vpp, layout,
                                     partial_checkpoint_microbatches, runtime="torch", device=device)
        for real, guess in zip(stages, predicted):
            summary = stage_summary(real)
            summary.update(measured_bytes=real.peak_bytes, predicted_bytes=guess.peak_bytes,
                           error=peak_error(real.peak_bytes, guess.peak_bytes), pid=real.meta.get("pid"),
                           measured_phase=real.peak_phase.label, predicted_phase=guess.peak_phase.label)
            rows.append(summary)
    return rows


def measure_pipeline_rank(job: dict[str, Any], policy_text: str, rank: int) -> Timeline:
    import torch
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B


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
        inject_fault(fault, rank)
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
