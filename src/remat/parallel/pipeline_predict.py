"""Pipeline-parallel memory predicted per stage: each stage's timeline of one training step, with several
microbatches in flight, composed exactly from fake traces of one microbatch per model chunk (see
NOTE [Pipeline composition])."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from remat.config import ModelConfig
from remat.memory.predict import trace
from remat.parallel.chunk_trace import trace_chunk
from remat.parallel.composer import Composer
from remat.parallel.pipeline_report import describe_stage, same_step
from remat.parallel.pipeline_runtime import StagePlan, megatron_runtime, stage_setup, torch_runtime
from remat.parallel.schedule import (
    Action,
    ChunkSpec,
    PipelineError,
    check_partial,
    check_policy_fits,
    check_schedule,
    checkpointed_forwards,
    max_in_flight,
    partition,
    rank_chunks,
    schedule_actions,
    warmup_forwards,
)
from remat.policy import Policy
from remat.timeline import Timeline
from remat.units import CUDA_BLOCK

# NOTE [Pipeline composition]
# Under pipeline parallelism a stage does not run one forward and one backward: it runs the forwards of several
# microbatches before the first backward comes back, so it holds several microbatches' saved activations (or
# checkpoint inputs) at once. How many depends on the schedule and on the stage's position. This module predicts,
# per stage, the memory timeline of one training step of the reference GPT (:mod:`remat.models.gpt`) split into
# ``pp`` stages x ``vpp`` model chunks, exactly, from fake traces of one microbatch per chunk:
#
# * **Partition** (:func:`partition`): the layers are split evenly into ``pp * vpp`` model chunks (an explicit
#   ``layout`` of layer counts may be given instead); global chunk ``g`` runs on rank ``g % pp`` (Megatron's
#   virtual pipeline assignment: rank r holds chunks r, r + pp, r + 2 pp, ...). The embedding is in chunk 0;
#   the final norm, the output layer and the loss are in the last chunk. :class:`StageModule` runs one chunk
#   and keeps its layers in ``layers`` (an ``nn.ModuleList``), so :func:`remat.recompute.apply.apply` applies a
#   policy per chunk, as Megatron does: uniform groups and block counts count within the chunk.
# * **Schedules** (:func:`schedule_actions`): the order of forwards (F) and backwards (B) on each rank. GPipe runs
#   every forward, then every backward. 1F1B (non-interleaved) runs ``min(pp - r - 1, m)`` warm-up forwards on
#   rank r, then alternates one forward and one backward, then drains the backwards (so stage r holds up to
#   ``pp - r`` microbatches; torch's ``Schedule1F1B`` runs the same sequence). Interleaved 1F1B runs Megatron's
#   ``(pp - r - 1) * 2 + (vpp - 1) * group`` warm-up forwards over its model chunks (microbatch group size, default
#   pp; NOTE [Megatron's interleaved warm-up] in :mod:`remat.parallel.schedule`), in get_schedule_table's order.
# * **Chunk traces**: each distinct chunk (first / middle / last, its layer count, its policy) is traced once
#   under ``FakeTensorMode`` with the same recorder as :func:`remat.memory.measure.measure`: two microbatches' forwards
#   (outputs kept, as in a pipeline) and their backwards (given the output's gradient; the first backward
#   creates the parameter gradients, later ones accumulate into them). The trace is cut into segments: forward,
#   first backward, later backward.
# * **Composition**: a stage's timeline copies the segments in its schedule's order, each free resolved to the
#   same microbatch's tensor (checked: a free must find a live tensor of the same size and category, or
#   :class:`~remat.memory.compose.CompositionError` is raised), plus what the pipeline runtime itself holds. With
#   ``runtime='torch'`` (what :func:`remat.parallel.pipeline_measure.measure_pipeline` runs) that is
#   ``torch.distributed.pipelining``'s: a receive buffer per microbatch for the activations and one for the output
#   gradients (allocated once, kept), the whole batch of token ids/labels on the first/last stage, and the stage
#   outputs and input gradients that its schedules and its gloo/NCCL send handles keep alive (modelled by
#   following the schedule code's references; see :func:`torch_runtime`). With ``runtime='megatron'``,
#   Megatron-LM's, kept alive by what its schedule functions reference (:func:`megatron_runtime`; see NOTE
#   [Megatron's schedule variables] in :mod:`remat.parallel.pipeline_runtime`): each receive is a fresh tensor,
#   held by the schedule's variables and lists and by the autograd graph (the received input holds its ``.grad``,
#   the input gradient), in places past the microbatch's backward; a sent output's storage becomes a one-element
#   placeholder (``deallocate_output_tensor``) while the tensor object and its graph stay referenced; each
#   microbatch's token ids/labels are made inside its forward (``get_batch``) and live as long as the chunk trace
#   says; the last stage keeps a copy of each loss (``forward_data_store``). The non-interleaved schedules are
#   followed line by line, as :mod:`remat.parallel.megatron_rank` runs them for real; the interleaved one is laid
#   out action by action.
# * **Partial recompute** (``partial_checkpoint_microbatches=N``, Megatron's
#   ``num_microbatches_with_partial_activation_checkpoints``): Megatron checkpoints a forward k of a rank
#   (counting the rank's forwards from 0) iff ``k % window >= N`` with ``window = warm-up forwards + 1``
#   (``max_outstanding_backprops``); the first N of each window are the ones "where not all of the layers will be
#   checkpointed" - here they keep everything (policy ``none``), the others run ``policy``.
#
# Every returned :class:`~remat.timeline.Timeline` says in its phases which microbatch and chunk made each byte
# (``detail`` = ``"microbatch 3, chunk 1"`` or ``"microbatch 3, chunk 1: group 0 (layers 0-1)"``; regions name
# global layer indices), and in ``meta['pipeline']`` its stage, schedule, peak, which microbatches' saved tensors
# are alive at the peak, and ``meta['why']`` says it in plain words.

# A composed stage timeline has every microbatch's events (thousands per microbatch for a deep stage); longer steps
# get their per-stage peaks from remat.parallel.pipeline_peaks, at a cost independent of the microbatch count.
MAX_COMPOSED_MICROBATCHES = 2048


# ------------------------------------------------------------------------------------------------ composition
def predict_pipeline(config: ModelConfig, policy: Policy | str, pp: int, microbatches: int, schedule: str = "1f1b",
                     vpp: int = 1, layout: Sequence[int] | None = None,
                     partial_checkpoint_microbatches: int | None = None, *, runtime: str = "torch",
                     device: str = "cpu") -> list[Timeline]:
    """Predict each pipeline stage's memory timeline of one training step (one :class:`Timeline` per rank).

    ``config`` is the whole model (``micro_batch_size`` is the microbatch); ``policy`` is applied to every model
    chunk (groups and block counts count within a chunk); the step runs ``microbatches`` microbatches under
    ``schedule`` ('1f1b', 'gpipe' or 'interleaved' with ``vpp`` chunks per stage). ``layout`` gives the layers of
    each global chunk (default: even). ``partial_checkpoint_microbatches`` is Megatron's
    ``num_microbatches_with_partial_activation_checkpoints`` (see NOTE [Pipeline composition]). ``runtime`` says
    whose pipeline buffers to model: 'torch' (``torch.distributed.pipelining``, what
    :func:`remat.parallel.pipeline_measure.measure_pipeline` runs) or 'megatron' (Megatron-LM's schedules, as
    :func:`megatron_runtime` follows them). ``device='cuda'`` rounds storages to 512-byte blocks. Nothing is
    allocated for real. Raises :class:`PipelineError` for settings that cannot run.

    Each timeline's ``meta['pipeline']`` holds the stage's schedule, its warm-up forwards, the most microbatches it
    holds at once, and at its peak the (microbatch, chunk) pairs whose saved tensors are alive; ``meta['why']``
    explains the peak in words.
    """
    policy = Policy.parse(policy) if isinstance(policy, str) else policy
    schedule = check_schedule(schedule, pp, microbatches, vpp, runtime)
    if microbatches > MAX_COMPOSED_MICROBATCHES:
        raise PipelineError(f"microbatches={microbatches}: a composed stage timeline holds every microbatch's "
                            f"events, so it is built for at most {MAX_COMPOSED_MICROBATCHES} microbatches; for the "
                            "per-stage peaks of longer steps use remat.parallel.pipeline_peaks.stage_peaks (what "
                            "'remat predict --pp' prints), whose cost does not grow with the microbatch count")
    partial = check_partial(partial_checkpoint_microbatches)
    specs = partition(config, pp, vpp, layout)
    check_policy_fits(policy, specs)
    return [predict_stage(config, policy, specs, rank, pp, microbatches, schedule, vpp, partial, runtime=runtime,
                          device=device) for rank in range(pp)]


def predict_stage(config: ModelConfig, policy: Policy, specs: Sequence[ChunkSpec], rank: int, pp: int,
                  microbatches: int, schedule: str, vpp: int, partial: int | None, *, runtime: str = "torch",
                  device: str = "cpu") -> Timeline:
    """Stage ``rank``'s timeline of :func:`predict_pipeline`, for settings it has already checked (``specs`` from
    :func:`~remat.parallel.schedule.partition`); a stage's timeline depends on no other stage's."""
    chunks = rank_chunks(specs, pp, rank)
    actions = schedule_actions(schedule, pp, microbatches, vpp, rank, runtime=runtime)
    window = warmup_forwards(schedule, pp, microbatches, vpp, rank, "megatron") + 1  # Megatron's window
    checkpointed = checkpointed_forwards(actions, partial, window)
    traces = {}
    for spec in chunks:
        in_forward = runtime == "megatron"  # Megatron makes each microbatch's token ids/labels in its forward
        traces[(spec.index, True)] = trace_chunk(config, spec.kind, policy, device, batch_in_forward=in_forward)
        if partial is not None:
            traces[(spec.index, False)] = trace_chunk(config, spec.kind, Policy(), device, batch_in_forward=in_forward)
    plan = StagePlan(config, pp, microbatches, vpp, rank, schedule, runtime, chunks, actions, checkpointed,
                     traces, block=CUDA_BLOCK if device == "cuda" else 1)
    return compose_stage(plan, policy, partial)


def compose_stage(plan: StagePlan, policy: Policy, partial: int | None = None, *, describe: bool = True) -> Timeline:
    """One rank's timeline from its plan (see :func:`predict_pipeline`); ``describe``: check its rows
    (:meth:`~remat.timeline.Timeline.validate`) and fill its ``meta['why']``
    (:func:`~remat.parallel.pipeline_report.describe_stage`), which a caller adding rows after does itself."""
    composer = Composer()
    stage_setup(plan, composer)
    if plan.runtime == "torch":
        torch_runtime(plan, composer)
    else:
        megatron_runtime(plan, composer)
    composer.phase("setup", "end")
    meta = {
        "backend": "fake", "device": "cuda" if plan.block > 1 else "cpu", "policy": str(policy),
        "config": plan.config.to_dict(), "num_layers": sum(s.num_layers for s in plan.chunks),
    }
    meta["pipeline"] = pipeline_meta(plan.schedule, plan.pp, plan.microbatches, plan.vpp, plan.rank, plan.chunks,
                                     plan.runtime, partial, plan.actions, group=plan.group)
    tl = composer.finish(meta, validate=describe)
    if describe:
        describe_stage(tl)
    return tl


def pipeline_meta(schedule: str, pp: int, microbatches: int, vpp: int, rank: int, chunks: Sequence[ChunkSpec],
                  runtime: str, partial: int | None, actions: Sequence[Action], *,
                  group: int | None = None) -> dict[str, Any]:
    """What ``meta['pipeline']`` records about a stage (shared by predicted and measured timelines)."""
    return {
        "stage": rank, "pp": pp, "vpp": vpp, "microbatches": microbatches, "schedule": schedule, "runtime": runtime,
        "chunks": [s.index for s in chunks],
        "layers": [[s.layer_offset, s.layer_offset + s.num_layers - 1] for s in chunks],
        "partial_checkpoint_microbatches": partial,
        "warmup_forwards": warmup_forwards(schedule, pp, microbatches, vpp, rank, runtime, group=group),
        "max_in_flight": max_in_flight(actions),
        "order": " ".join(str(a) for a in actions),
    }


def single_stage_difference(config: ModelConfig, policy: Policy | str, device: str = "cpu") -> str | None:
    """Check the composition against a plain trace: None when a 1-stage, 1-microbatch pipeline (composed from the
    chunk trace, ``runtime='torch'``) allocates and frees what :func:`remat.memory.predict.predict` traces for the whole
    step, event for event, else what differs. The pipeline keeps the loss in its loss list until the step ends,
    while the plain trace keeps it past its end: frees after the plain trace's last event count as never freed."""

    (composed,) = predict_pipeline(config, policy, 1, 1, device=device)
    plain = trace(config, policy, device=device)
    n = plain.num_events
    trailing = sum(1 for f in composed.free_at if f >= n)
    if composed.num_events != n + trailing:
        return f"num_events: {composed.num_events} != {n} + {trailing} frees at the end"
    clipped = Timeline(composed.nbytes, composed.alloc_at, [f if f < n else -1 for f in composed.free_at],
                       composed.phase_index, composed.module, composed.category, composed.phases, n)
    return same_step(clipped, plain)
