"""Pipeline partitions and schedules (GPipe, 1F1B, interleaved 1F1B): which microbatches a stage holds when."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from remat.config import ModelConfig
from remat.job_pipeline import GROUP_FLAG, microbatch_group_problem

SCHEDULES = ("1f1b", "gpipe", "interleaved")
RUNTIMES = ("torch", "megatron")
# what the saved tensors of a microbatch are: they are what pipelining multiplies by the microbatches in flight
SAVED_CATEGORIES = ("saved_activations", "group_inputs", "head_loss")


class PipelineError(ValueError):
    """A pipeline setting that cannot run; the message names the setting and the fix."""


# ------------------------------------------------------------------------------------------------ partition
def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise PipelineError(f"{name}={value!r}: must be a positive integer (--{name} N, N >= 1)")
    return int(value)


def chunk_layout(num_layers: int, pp: int, vpp: int = 1, layout: Sequence[int] | None = None, *,
                 empty_ends: bool = False) -> list[int]:
    """Layers per global model chunk (``pp * vpp`` of them, chunk g on rank ``g % pp``).

    Without ``layout`` the layers are split evenly and ``num_layers`` must be divisible by ``pp * vpp``. A
    ``layout`` lists the layer count of each chunk in global order (``pp * vpp`` counts >= 1 adding up to
    ``num_layers``), e.g. Megatron's uneven first/last stages (:attr:`remat.job.Job.chunk_layers`). With
    ``empty_ends`` the first and last chunk may have 0 layers (Megatron's layouts and counted embedding/loss give
    a chunk that only embeds, or only computes the loss).
    """
    pp = _positive_int("pp", pp)
    vpp = _positive_int("vpp", vpp)
    chunks = pp * vpp
    if layout is None:
        if num_layers % chunks:
            raise PipelineError(f"num_layers={num_layers} is not divisible by pp * vpp = {pp} * {vpp} = {chunks} "
                                f"model chunks: {_layout_fix(num_layers, pp, vpp)}")
        return [num_layers // chunks] * chunks
    counts = list(layout)
    if len(counts) != chunks:
        raise PipelineError(f"layout {counts} has {len(counts)} entries but pp * vpp = {chunks} model chunks: give "
                            "one layer count per chunk, in global chunk order (chunk g runs on rank g % pp)")
    for g, n in enumerate(counts):
        least = 0 if empty_ends and g in (0, chunks - 1) and chunks > 1 else 1
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < least:
            raise PipelineError(f"layout {counts}: every chunk needs at least one layer (a positive integer), "
                                f"got {n!r}")
    if sum(counts) != num_layers:
        raise PipelineError(f"layout {counts} adds up to {sum(counts)} layers but the model has "
                            f"num_layers={num_layers}: make the counts add up to {num_layers}")
    return [int(n) for n in counts]


def _layout_fix(num_layers: int, pp: int, vpp: int) -> str:
    """Settings that do run for a model of ``num_layers`` layers that ``pp * vpp`` does not divide: an uneven
    ``--layout`` when every chunk can get a layer, else fewer stages (or chunks per stage)."""
    chunks = pp * vpp
    if num_layers >= chunks:
        base, extra = divmod(num_layers, chunks)
        counts = [base + (1 if i < extra else 0) for i in range(chunks)]
        return (f"give layout=[layers of chunk 0, ..., chunk {chunks - 1}] (--layout {','.join(map(str, counts))}, "
                f"say), or pp * vpp dividing {num_layers}")
    # fewer chunks than layers are needed: every chunk holds at least one layer
    if vpp > 1:
        fits = [v for v in range(2, vpp) if pp * v <= num_layers and num_layers % (pp * v) == 0]
        if fits:
            return f"every chunk needs a layer: use vpp={fits[-1]} (--vpp {fits[-1]})"
        stages = max((p for p in range(2, pp + 1) if 2 * p <= num_layers and num_layers % (2 * p) == 0), default=0)
        if stages:
            return f"every chunk needs a layer: use pp={stages}, vpp=2 (--pp {stages} --vpp 2)"
        stages = max(p for p in range(1, pp + 1) if num_layers % p == 0)
        return (f"every chunk needs a layer: use pp={stages} with one chunk per stage (--pp {stages} --vpp 1 "
                "--schedule 1f1b)")
    stages = max(p for p in range(1, pp + 1) if num_layers % p == 0)
    return f"every stage needs a layer: use pp={stages} (--pp {stages}), or a deeper model"


@dataclass(frozen=True)
class ChunkSpec:
    """One model chunk: global chunk ``index`` (torch's stage index) of ``num_chunks``, its layers
    ``layer_offset .. layer_offset + num_layers - 1`` of the whole model."""

    index: int
    num_chunks: int
    layer_offset: int
    num_layers: int

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_chunks - 1

    def rank(self, pp: int) -> int:
        return self.index % pp

    def local_index(self, pp: int) -> int:
        return self.index // pp

    @property
    def kind(self) -> tuple[bool, bool, int]:
        """What a chunk's trace depends on: (has the embedding, has the head, layer count)."""
        return (self.is_first, self.is_last, self.num_layers)


def partition(config: ModelConfig, pp: int, vpp: int = 1, layout: Sequence[int] | None = None, *,
              empty_ends: bool = False) -> list[ChunkSpec]:
    """The ``pp * vpp`` model chunks of ``config``'s GPT, in global order (see :func:`chunk_layout`)."""
    counts = chunk_layout(config.num_layers, pp, vpp, layout, empty_ends=empty_ends)
    if config.tie_embeddings and len(counts) > 1:
        raise PipelineError("tie_embeddings=True shares the embedding with the output layer, which are in different "
                            "pipeline chunks: use tie_embeddings=False with pp * vpp > 1")
    specs, offset = [], 0
    for g, n in enumerate(counts):
        specs.append(ChunkSpec(g, len(counts), offset, n))
        offset += n
    return specs


def check_policy_fits(policy: Any, specs: Sequence[ChunkSpec]) -> None:
    """Refuse a full-recompute ``policy`` whose groups are deeper than a chunk (policies apply per model chunk, as
    in Megatron), naming the deepest group that fits."""
    smallest = min(s.num_layers for s in specs)
    for spec in specs:
        if policy.granularity == "full" and policy.num_layers > spec.num_layers:
            fit = str(policy).replace(f"/{policy.num_layers}", f"/{smallest}", 1)
            raise PipelineError(f"policy {policy} groups {policy.num_layers} layers but chunk {spec.index} has "
                                f"{spec.num_layers} layers (policies apply per model chunk, as in Megatron): use "
                                f"groups of <= {smallest} layers, e.g. {fit}")


def rank_chunks(specs: Sequence[ChunkSpec], pp: int, rank: int) -> list[ChunkSpec]:
    """The chunks rank ``rank`` runs, in local order (chunk r, r + pp, ...)."""
    return [s for s in specs if s.rank(pp) == rank]


# ------------------------------------------------------------------------------------------------ schedules
@dataclass(frozen=True)
class Action:
    """One compute step of a rank: ``kind`` 'F' (forward) or 'B' (backward) of global ``chunk`` on
    ``microbatch``."""

    kind: str
    chunk: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f"c{self.chunk}" if self.chunk else "")


def check_schedule(schedule: str, pp: int, microbatches: int, vpp: int = 1, runtime: str = "torch",
                   num_layers: int | None = None, *, group: int | None = None) -> str:
    """Validate a schedule's settings; return the schedule name in lower case. Errors name the fix, and only
    fixes that pass this check (and, given the model's ``num_layers``, its even partition) are suggested.
    ``group``: Megatron's ``--microbatch-group-size-per-virtual-pipeline-stage`` (None: pp), interleaved only."""
    if not isinstance(schedule, str) or schedule.strip().lower() not in SCHEDULES:
        raise PipelineError(f"unknown pipeline schedule {schedule!r}: use one of {', '.join(SCHEDULES)}")
    schedule = schedule.strip().lower()
    if runtime not in RUNTIMES:
        raise PipelineError(f"unknown pipeline runtime {runtime!r}: use one of {', '.join(RUNTIMES)}")
    pp = _positive_int("pp", pp)
    m = _positive_int("microbatches", microbatches)
    vpp = _positive_int("vpp", vpp)
    if schedule != "interleaved" and vpp != 1:
        interleaved = ("schedule='interleaved' (--schedule interleaved), or " if pp >= 2 and m % pp == 0 else "")
        raise PipelineError(f"vpp={vpp} model chunks per stage need the interleaved schedule: use {interleaved}"
                            f"vpp=1 (--vpp 1) with {schedule}")
    if schedule == "interleaved":
        if vpp < 2:
            two = (num_layers is not None and num_layers % (2 * pp) == 0 and pp >= 2 and m % pp == 0)
            raise PipelineError("the interleaved schedule needs vpp >= 2 model chunks per stage"
                                + (" (--vpp 2)" if two else "") + ": with one chunk per stage use "
                                "schedule='1f1b' (--schedule 1f1b)")
        if pp < 2:
            raise PipelineError("the interleaved schedule needs pp >= 2 stages: with one stage use "
                                "schedule='1f1b' and vpp=1 (--schedule 1f1b --vpp 1)")
        if group is not None:
            _check_group(group, pp, m, runtime)
        elif m % pp:
            lower, upper = max(pp, m - m % pp), m + pp - m % pp
            raise PipelineError(f"Megatron's interleaved schedule needs the microbatch count to be divisible by pp: "
                                f"microbatches={m}, pp={pp}; use microbatches={lower} or {upper} (--microbatches "
                                f"{lower})")
    elif group is not None:
        raise PipelineError(f"microbatch group size {group} (--microbatch-group-size-per-virtual-pipeline-stage) is "
                            f"for the interleaved schedule only: drop it with {schedule}")
    if schedule == "1f1b" and runtime == "torch" and m < pp:
        raise PipelineError(f"torch.distributed.pipelining's Schedule1F1B needs microbatches >= pp: got "
                            f"microbatches={m} < pp={pp}; use microbatches >= {pp} (--microbatches {pp}), or "
                            "schedule='gpipe' (--schedule gpipe); runtime='megatron' models Megatron's 1F1B, which "
                            "runs min(pp - r - 1, m) warm-ups")
    return schedule


def _check_group(group: Any, pp: int, m: int, runtime: str) -> None:
    """Megatron's checks of ``microbatch_group_size_per_vp_stage`` (schedules.py:1160-1180 at d98e8a64)."""
    if runtime != "megatron":
        raise PipelineError(f"a microbatch group size ({GROUP_FLAG}) is Megatron's: use runtime='megatron'")
    problem = microbatch_group_problem(_positive_int("group", group), pp, m)
    if problem:
        raise PipelineError(problem)


def schedule_table(microbatches: int, vpp: int, group: int) -> list[tuple[int, int]]:
    """(microbatch, local chunk) of each virtual microbatch, in order: Megatron's ``get_schedule_table``
    (schedules.py:989): groups of ``group`` microbatches run through every chunk before the next group; the last
    group takes the microbatches left (``group`` to ``group + pp - 1`` of them)."""
    out: list[tuple[int, int]] = []
    for low in range(0, microbatches, group):
        high = microbatches if low + group >= microbatches else low + group
        out += [(mb, c) for c in range(vpp) for mb in range(low, high)]
    return out


# NOTE [Megatron's interleaved warm-up]
# At d98e8a64, get_pp_rank_microbatches (megatron/core/pipeline_parallel/schedules.py:929-986) runs
# (pp - r - 1) * 2 + (vpp - 1) * group warm-up forwards on rank r (group = microbatch_group_size_per_vp_stage,
# default pp: megatron/core/model_parallel_config.py:567), capped at m * vpp, and nothing else: the old rule
# "all m * vpp forwards first when m == pp" went with the tunable schedule (Megatron-LM 4295be1a6c). With it the
# last rank of pp=4, vpp=3, m=4 ran all 12 forwards first and held the loss chunk's logits of all 4 microbatches;
# Megatron runs 8 (chunks 3 and 7) and then alternates F/B on chunk 11, one microbatch's logits at a time. The last
# stage's loss is never sent nor deallocated (schedules.py:1629, 1780, 1914 set it to None first): it stays in
# output_tensors (:1372), its graph keeping the head's saved tensors, until its backward pops it (:1432).
def warmup_forwards(schedule: str, pp: int, microbatches: int, vpp: int = 1, rank: int = 0,
                    runtime: str = "torch", *, group: int | None = None, combined: bool = False) -> int:
    """Forwards rank ``rank`` runs before its first backward, by Megatron's count: ``m`` (GPipe),
    ``min(pp - r - 1, m)`` (1F1B), ``min((pp - r - 1) * 2 + (vpp - 1) * group, m * vpp)`` (interleaved;
    ``group`` = Megatron's microbatch group size, default pp; see NOTE [Megatron's interleaved warm-up]).
    ``combined``: Megatron's combined 1F1B schedule (``--overlap-moe-expert-parallel-comm``), one more warm-up
    forward (schedules.py:966-970; pp = 1: the first forward runs alone, combined_1f1b.py:78); pp > 1 needs vpp."""
    schedule = check_schedule(schedule, pp, microbatches, vpp, runtime, group=group)
    m = microbatches
    if combined and schedule != "interleaved" and not (schedule == "1f1b" and pp == 1):
        raise PipelineError("the combined 1F1B schedule (--overlap-moe-expert-parallel-comm) runs with pp = 1 or "
                            "the interleaved schedule (Megatron asserts a virtual pipeline size when pp > 1)")
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(pp - rank - 1 + combined, m)
    g = pp if group is None else group
    return min((pp - rank - 1) * 2 + (vpp - 1) * g + combined, m * vpp)


def schedule_actions(schedule: str, pp: int, microbatches: int, vpp: int = 1, rank: int = 0, *,
                     runtime: str = "torch", group: int | None = None, combined: bool = False) -> list[Action]:
    """The forwards and backwards rank ``rank`` runs, in order (chunks are global chunk indices).

    1F1B: the warm-up forwards (:func:`warmup_forwards`), then one forward and one backward at a time, then the
    remaining backwards (``combined``: with :func:`warmup_forwards`'s combined count; each forward followed by a
    backward is then one combined step). Interleaved: the same over ``m * vpp`` virtual microbatches; forward k
    runs entry k of :func:`schedule_table` (groups of ``group`` microbatches, default pp), backward k the same
    microbatch on chunk ``vpp - 1 -`` that (Megatron's get_model_chunk_id(k, forward=False), schedules.py:1244;
    each chunk's backwards pop its inputs first in, first out, schedules.py:1432, i.e. in microbatch order).
    """
    schedule = check_schedule(schedule, pp, microbatches, vpp, runtime, group=group)
    if not isinstance(rank, numbers.Integral) or not 0 <= rank < pp:
        raise PipelineError(f"rank={rank!r}: must be in 0..{pp - 1}")
    m = microbatches
    if schedule == "gpipe":
        return [Action("F", rank, i) for i in range(m)] + [Action("B", rank, i) for i in range(m)]
    if schedule == "1f1b":
        w = warmup_forwards(schedule, pp, m, vpp, rank, runtime, combined=combined)
        acts = [Action("F", rank, i) for i in range(w)]
        for i in range(m - w):
            acts += [Action("F", rank, w + i), Action("B", rank, i)]
        return acts + [Action("B", rank, i) for i in range(m - w, m)]
    total = m * vpp
    w = warmup_forwards(schedule, pp, m, vpp, rank, runtime, group=group, combined=combined)
    table = schedule_table(m, vpp, pp if group is None else group)

    def virtual(k: int, forward: bool) -> Action:
        mb, local = table[k]
        if not forward:
            local = vpp - 1 - local
        return Action("F" if forward else "B", local * pp + rank, mb)

    acts = [virtual(k, True) for k in range(w)]
    for k in range(total - w):
        acts += [virtual(w + k, True), virtual(k, False)]
    return acts + [virtual(k, False) for k in range(total - w, total)]


def in_flight_profile(actions: Sequence[Action]) -> list[int]:
    """Microbatch-chunks whose forward has run and backward has not, after each action."""
    alive, out = 0, []
    for a in actions:
        alive += 1 if a.kind == "F" else -1
        out.append(alive)
    return out


def max_in_flight(actions: Sequence[Action]) -> int:
    """The most microbatch-chunks a rank holds at once (forward done, backward not yet)."""
    return max(in_flight_profile(actions), default=0)


def checkpointed_forwards(actions: Sequence[Action], partial: int | None, window: int) -> dict[tuple[int, int], bool]:
    """(chunk, microbatch) -> whether its forward runs the recompute policy.

    None: all of them. Otherwise Megatron's rule for ``num_microbatches_with_partial_activation_checkpoints``:
    the rank's k-th forward is checkpointed iff ``k % window >= partial`` (``window`` = warm-up forwards + 1).
    """
    out: dict[tuple[int, int], bool] = {}
    k = 0
    for a in actions:
        if a.kind == "F":
            out[(a.chunk, a.microbatch)] = partial is None or k % window >= partial
            k += 1
    return out


# NOTE [which forwards keep their last offload group]
# Megatron's fine-grained activation offloading (megatron/core/pipeline_parallel/fine_grained_activation_offload.py
# at d98e8a64) keeps the last group of each offload module of a forward on the device, so that the backward that
# starts next need not wait for its reload, in two cases only (every other group is offloaded; the step's first
# iteration, its warm-up, offloads them all):
# (a) PipelineOffloadManager.post_warmup_callback marks not offloadable, per module name, the last group of that name
#     in the first chunk handler of the step's backward order that has one (chunks without that module, such as a
#     loss-only chunk, are skipped);
# (b) ChunkOffloadHandler.should_bulk_offload keeps the last group of a name when the forward's own handler is the
#     next one backward will run that has a group of that name (front_backward_chunk): a forward followed by its own
#     backward (pp = 1, a last stage's 1F1B).
# A handler is one (chunk, microbatch) forward: the handlers are cached in the warm-up iteration in forward order and
# queued for backward in the schedule's backward order, and every later iteration reuses them in the same order.
def offload_last_groups(actions: Sequence[Action], modules_of: Callable[[int], frozenset[str]]
                        ) -> dict[tuple[int, int], frozenset[str]]:
    """(chunk, microbatch) -> the offload modules whose last group that forward offloads too, for Megatron's steady
    state (NOTE [which forwards keep their last offload group]); ``modules_of(chunk)``: the offload modules the
    chunk's layers have. A forward absent from the result offloads no last group (it keeps every one)."""
    backward = [(a.chunk, a.microbatch) for a in actions if a.kind == "B"]
    out: dict[tuple[int, int], frozenset[str]] = {}
    names = sorted(set().union(*(modules_of(c) for c, _ in backward))) if backward else []
    for name in names:
        order = [key for key in backward if name in modules_of(key[0])]
        done = 0  # backwards of chunks with this module run so far
        for a in actions:
            key = (a.chunk, a.microbatch)
            if name not in modules_of(a.chunk):
                continue
            if a.kind == "B":
                done += 1
            # kept: (a) the first backward's forward; (b) a forward whose own backward is the next one
            elif key != order[0] and not (done < len(order) and order[done] == key):
                out[key] = out.get(key, frozenset()) | {name}
    return out


def check_partial(partial: int | None) -> int | None:
    if partial is None:
        return None
    if isinstance(partial, bool) or not isinstance(partial, numbers.Integral) or partial < 0:
        raise PipelineError(f"partial_checkpoint_microbatches={partial!r}: must be an integer >= 0 "
                            "(or None: every microbatch runs the policy)")
    return int(partial)
