"""Pipeline-parallel memory: each stage's timeline with several microbatches in flight.

Under pipeline parallelism a stage does not run one forward and one backward: it runs the forwards of several
microbatches before the first backward comes back, so it holds several microbatches' saved activations (or
checkpoint inputs) at once. How many depends on the schedule and on the stage's position. This module predicts,
per stage, the memory timeline of one training step of the reference GPT (:mod:`remat.model`) split into
``pp`` stages x ``vpp`` model chunks, exactly, from fake traces of one microbatch per chunk:

* **Partition** (:func:`partition`): the layers are split evenly into ``pp * vpp`` model chunks (an explicit
  ``layout`` of layer counts may be given instead); global chunk ``g`` runs on rank ``g % pp`` (Megatron's
  virtual pipeline assignment: rank r holds chunks r, r + pp, r + 2 pp, ...). The embedding is in chunk 0;
  the final norm, the output layer and the loss are in the last chunk. :class:`StageModule` runs one chunk
  and keeps its layers in ``layers`` (an ``nn.ModuleList``), so :func:`remat.apply.apply` applies a policy per
  chunk, as Megatron does: uniform groups and block counts count within the chunk.
* **Schedules** (:func:`schedule_actions`): the order of forwards (F) and backwards (B) on each rank. GPipe runs
  every forward, then every backward. 1F1B (non-interleaved) runs ``min(pp - r - 1, m)`` warm-up forwards on
  rank r, then alternates one forward and one backward, then drains the backwards (so stage r holds up to
  ``pp - r`` microbatches; torch's ``Schedule1F1B`` runs the same sequence). Interleaved 1F1B runs Megatron's
  ``(pp - r - 1) * 2 + (vpp - 1) * pp`` warm-up forwards over its model chunks (microbatch group size = pp).
* **Chunk traces**: each distinct chunk (first / middle / last, its layer count, its policy) is traced once
  under ``FakeTensorMode`` with the same recorder as :func:`remat.measure.measure`: two microbatches' forwards
  (outputs kept, as in a pipeline) and their backwards (given the output's gradient; the first backward
  creates the parameter gradients, later ones accumulate into them). The trace is cut into segments: forward,
  first backward, later backward.
* **Composition**: a stage's timeline copies the segments in its schedule's order, each free resolved to the
  same microbatch's tensor (checked: a free must find a live tensor of the same size and category, or
  :class:`~remat.compose.CompositionError` is raised), plus what the pipeline runtime itself holds. With
  ``runtime='torch'`` (what :func:`remat.distributed.measure_pipeline` runs) that is
  ``torch.distributed.pipelining``'s: a receive buffer per microbatch for the activations and one for the output
  gradients (allocated once, kept), the whole batch of token ids/labels on the first/last stage, and the stage
  outputs and input gradients that its schedules and its gloo/NCCL send handles keep alive (modelled by
  following the schedule code's references; see :func:`_torch_runtime`). With ``runtime='megatron'``,
  Megatron-LM's: each received activation/gradient is a fresh tensor kept until the microbatch's backward ends,
  an output is freed once sent (``deallocate_pipeline_outputs``), an input gradient once sent, and each
  microbatch's token ids/labels are loaded at its forward and kept until its backward ends.
* **Partial recompute** (``partial_checkpoint_microbatches=N``, Megatron's
  ``num_microbatches_with_partial_activation_checkpoints``): Megatron checkpoints a forward k of a rank
  (counting the rank's forwards from 0) iff ``k % window >= N`` with ``window = warm-up forwards + 1``
  (``max_outstanding_backprops``); the first N of each window are the ones "where not all of the layers will be
  checkpointed" - here they keep everything (policy ``none``), the others run ``policy``.

Every returned :class:`~remat.timeline.Timeline` says in its phases which microbatch and chunk made each byte
(``detail`` = ``"microbatch 3, chunk 1"`` or ``"microbatch 3, chunk 1: group 0 (layers 0-1)"``; regions name
global layer indices), and in ``meta['pipeline']`` its stage, schedule, peak, which microbatches' saved tensors
are alive at the peak, and ``meta['why']`` says it in plain words.
"""

from __future__ import annotations

import bisect
import contextlib
import math
import numbers
import re
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from remat.apply import applied, apply
from remat.compose import CompositionError
from remat.config import ModelConfig
from remat.measure import CUDA_BLOCK, StepRecorder
from remat.model import GPT, Embedding, LMHead, TransformerLayer, build_model, building, sample_batch
from remat.policy import Policy
from remat.timeline import Phase, Timeline

SCHEDULES = ("1f1b", "gpipe", "interleaved")
RUNTIMES = ("torch", "megatron")
MIB = 1 << 20
# what the saved tensors of a microbatch are: they are what pipelining multiplies by the microbatches in flight
SAVED_CATEGORIES = ("saved_activations", "group_inputs", "head_loss")


class PipelineError(ValueError):
    """A pipeline setting that cannot run; the message names the setting and the fix."""


# ------------------------------------------------------------------------------------------------ partition
def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise PipelineError(f"{name}={value!r}: must be a positive integer")
    return int(value)


def chunk_layout(num_layers: int, pp: int, vpp: int = 1, layout: Sequence[int] | None = None) -> list[int]:
    """Layers per global model chunk (``pp * vpp`` of them, chunk g on rank ``g % pp``).

    Without ``layout`` the layers are split evenly and ``num_layers`` must be divisible by ``pp * vpp``. A
    ``layout`` lists the layer count of each chunk in global order (``pp * vpp`` counts >= 1 adding up to
    ``num_layers``), e.g. Megatron's uneven first/last stages.
    """
    pp = _positive_int("pp", pp)
    vpp = _positive_int("vpp", vpp)
    chunks = pp * vpp
    if layout is None:
        if num_layers % chunks:
            divisors = [d for d in range(1, num_layers + 1) if num_layers % d == 0]
            raise PipelineError(
                f"num_layers={num_layers} is not divisible by pp * vpp = {pp} * {vpp} = {chunks} model chunks: "
                f"use pp * vpp in {divisors}, or give layout=[layers of chunk 0, ..., chunk {chunks - 1}] "
                f"(--layout {','.join(str(n) for n in _even_layout(num_layers, chunks))}, say)")
        return [num_layers // chunks] * chunks
    counts = list(layout)
    if len(counts) != chunks:
        raise PipelineError(f"layout {counts} has {len(counts)} entries but pp * vpp = {chunks} model chunks: give "
                            "one layer count per chunk, in global chunk order (chunk g runs on rank g % pp)")
    for n in counts:
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
            raise PipelineError(f"layout {counts}: every chunk needs at least one layer (a positive integer), "
                                f"got {n!r}")
    if sum(counts) != num_layers:
        raise PipelineError(f"layout {counts} adds up to {sum(counts)} layers but the model has "
                            f"num_layers={num_layers}: make the counts add up to {num_layers}")
    return [int(n) for n in counts]


def _even_layout(num_layers: int, chunks: int) -> list[int]:
    base, extra = divmod(num_layers, chunks)
    return [max(1, base + (1 if i < extra else 0)) for i in range(chunks)]


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


def partition(config: ModelConfig, pp: int, vpp: int = 1, layout: Sequence[int] | None = None) -> list[ChunkSpec]:
    """The ``pp * vpp`` model chunks of ``config``'s GPT, in global order (see :func:`chunk_layout`)."""
    counts = chunk_layout(config.num_layers, pp, vpp, layout)
    if config.tie_embeddings and len(counts) > 1:
        raise PipelineError("tie_embeddings=True shares the embedding with the output layer, which are in different "
                            "pipeline chunks: use tie_embeddings=False with pp * vpp > 1")
    specs, offset = [], 0
    for g, n in enumerate(counts):
        specs.append(ChunkSpec(g, len(counts), offset, n))
        offset += n
    return specs


def rank_chunks(specs: Sequence[ChunkSpec], pp: int, rank: int) -> list[ChunkSpec]:
    """The chunks rank ``rank`` runs, in local order (chunk r, r + pp, ...)."""
    return [s for s in specs if s.rank(pp) == rank]


class StageModule(nn.Module):
    """One model chunk of the reference GPT: [embedding] -> ``layers`` -> [final norm, output layer, loss].

    ``forward(x, labels=None)`` takes token ids (first chunk) or hidden states [b, s, h] and returns the hidden
    states, or the loss on the last chunk (which needs ``labels``). Like :class:`remat.model.GPT`, every chunk
    makes its own causal mask and rotary tables, and the same operations run in the same order, so one chunk
    that holds the whole model is the GPT step for step.
    """

    def __init__(self, config: ModelConfig, spec: ChunkSpec, *, _modules_from: GPT | None = None):
        super().__init__()
        self.config = config
        self.spec = spec
        span = range(spec.layer_offset, spec.layer_offset + spec.num_layers)
        if _modules_from is not None:
            source = _modules_from
            self.embedding = source.embedding if spec.is_first else None
            self.layers = nn.ModuleList(source.layers[i] for i in span)
            self.head = source.head if spec.is_last else None
        else:
            self.embedding = Embedding(config) if spec.is_first else None
            self.layers = nn.ModuleList(TransformerLayer(config) for _ in span)
            self.head = LMHead(config) if spec.is_last else None
            if config.tie_embeddings and self.embedding is not None and self.head is not None:
                self.head.output_layer.weight = self.embedding.word_embeddings.weight

    def rotary_tables(self, seq_length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        return GPT.rotary_tables(self, seq_length, device)  # type: ignore[arg-type]  # uses only .config

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        s = x.shape[1]
        causal_mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril_().view(1, 1, s, s)
        rotary = self.rotary_tables(s, x.device)
        hidden = self.embedding(x) if self.embedding is not None else x
        for layer in self.layers:
            hidden = layer(hidden, causal_mask, rotary)
        if self.head is None:
            return hidden
        if labels is None:
            raise PipelineError(f"chunk {self.spec.index} computes the loss and needs labels=")
        return self.head(hidden, labels)


def build_stage_module(config: ModelConfig, spec: ChunkSpec, device: torch.device | str = "cpu") -> StageModule:
    """A chunk with freshly initialised weights in ``config.dtype`` (parameters made in place; works under
    ``FakeTensorMode``)."""
    with building(config, device):
        return StageModule(config, spec).train()


def build_stage_modules(config: ModelConfig, specs: Sequence[ChunkSpec], device: torch.device | str = "cpu",
                        seed: int | None = 0) -> list[StageModule]:
    """The chunks ``specs`` cut from one :func:`remat.model.build_model` (same ``seed``: the same weights as the
    unsplit GPT; the other chunks' parameters are dropped)."""
    model = build_model(config, device=device, seed=seed)
    return [StageModule(config, spec, _modules_from=model).train() for spec in specs]


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


def check_schedule(schedule: str, pp: int, microbatches: int, vpp: int = 1, runtime: str = "torch") -> str:
    """Validate a schedule's settings; return the schedule name in lower case. Errors name the fix."""
    if not isinstance(schedule, str) or schedule.strip().lower() not in SCHEDULES:
        raise PipelineError(f"unknown pipeline schedule {schedule!r}: use one of {', '.join(SCHEDULES)}")
    schedule = schedule.strip().lower()
    if runtime not in RUNTIMES:
        raise PipelineError(f"unknown pipeline runtime {runtime!r}: use one of {', '.join(RUNTIMES)}")
    pp = _positive_int("pp", pp)
    m = _positive_int("microbatches", microbatches)
    vpp = _positive_int("vpp", vpp)
    if schedule != "interleaved" and vpp != 1:
        raise PipelineError(f"vpp={vpp} model chunks per stage need the interleaved schedule: use "
                            f"schedule='interleaved' (--schedule interleaved), or vpp=1 with {schedule}")
    if schedule == "interleaved":
        if vpp < 2:
            raise PipelineError("the interleaved schedule needs vpp >= 2 model chunks per stage (--vpp 2): with one "
                                "chunk per stage use schedule='1f1b'")
        if pp < 2:
            raise PipelineError("the interleaved schedule needs pp >= 2 stages: with one stage use schedule='1f1b' "
                                "(or gpipe) and vpp=1")
        if m % pp:
            raise PipelineError(f"Megatron's interleaved schedule needs the microbatch count to be divisible by pp: "
                                f"microbatches={m}, pp={pp}; use microbatches={max(pp, m - m % pp)} or "
                                f"{m + pp - m % pp}")
    if schedule == "1f1b" and runtime == "torch" and m < pp:
        raise PipelineError(f"torch.distributed.pipelining's Schedule1F1B needs microbatches >= pp: got "
                            f"microbatches={m} < pp={pp}; use microbatches >= {pp}, or schedule='gpipe' "
                            "(runtime='megatron' models Megatron's 1F1B, which runs min(pp - r - 1, m) warm-ups)")
    return schedule


def warmup_forwards(schedule: str, pp: int, microbatches: int, vpp: int = 1, rank: int = 0,
                    runtime: str = "torch") -> int:
    """Forwards rank ``rank`` runs before its first backward, by Megatron's count: ``m`` (GPipe),
    ``min(pp - r - 1, m)`` (1F1B), ``min((pp - r - 1) * 2 + (vpp - 1) * pp, m * vpp)`` (interleaved; Megatron runs
    all ``m * vpp`` forwards first when ``m == pp``, torch does not)."""
    schedule = check_schedule(schedule, pp, microbatches, vpp, runtime)
    m = microbatches
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(pp - rank - 1, m)
    total = m * vpp
    if runtime == "megatron" and m == pp:
        return total
    return min((pp - rank - 1) * 2 + (vpp - 1) * pp, total)


def schedule_actions(schedule: str, pp: int, microbatches: int, vpp: int = 1, rank: int = 0, *,
                     runtime: str = "torch") -> list[Action]:
    """The forwards and backwards rank ``rank`` runs, in order (chunks are global chunk indices).

    1F1B: the warm-up forwards (:func:`warmup_forwards`), then one forward and one backward at a time, then the
    remaining backwards. Interleaved: the same over ``m * vpp`` virtual microbatches; virtual microbatch k is
    chunk ``(k // pp) % vpp`` (backward: ``vpp - 1 -`` that) of the rank, and microbatch
    ``(k // (pp * vpp)) * pp + k % pp``.
    """
    schedule = check_schedule(schedule, pp, microbatches, vpp, runtime)
    if not isinstance(rank, numbers.Integral) or not 0 <= rank < pp:
        raise PipelineError(f"rank={rank!r}: must be in 0..{pp - 1}")
    m = microbatches
    if schedule == "gpipe":
        return [Action("F", rank, i) for i in range(m)] + [Action("B", rank, i) for i in range(m)]
    if schedule == "1f1b":
        w = warmup_forwards(schedule, pp, m, vpp, rank, runtime)
        acts = [Action("F", rank, i) for i in range(w)]
        for i in range(m - w):
            acts += [Action("F", rank, w + i), Action("B", rank, i)]
        return acts + [Action("B", rank, i) for i in range(m - w, m)]
    total = m * vpp
    w = warmup_forwards(schedule, pp, m, vpp, rank, runtime)

    def virtual(k: int, forward: bool) -> Action:
        local = (k // pp) % vpp
        if not forward:
            local = vpp - 1 - local
        return Action("F" if forward else "B", local * pp + rank, (k // (pp * vpp)) * pp + k % pp)

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


def _check_partial(partial: int | None) -> int | None:
    if partial is None:
        return None
    if isinstance(partial, bool) or not isinstance(partial, numbers.Integral) or partial < 0:
        raise PipelineError(f"partial_checkpoint_microbatches={partial!r}: must be an integer >= 0 "
                            "(or None: every microbatch runs the policy)")
    return int(partial)


# ------------------------------------------------------------------------------------------------ recorder
def phase_detail(microbatch: int, chunk: int, inner: str = "") -> str:
    """How phases name the microbatch and chunk: ``'microbatch 3, chunk 1'`` (``': <inner>'`` appended)."""
    text = f"microbatch {microbatch}, chunk {chunk}"
    return f"{text}: {inner}" if inner else text


_DETAIL = re.compile(r"^microbatch (\d+), chunk (\d+)(?::|$)")


def parse_phase_detail(detail: str) -> tuple[int, int] | None:
    """(microbatch, chunk) named by a phase detail written by :func:`phase_detail`, else None."""
    match = _DETAIL.match(detail)
    return (int(match.group(1)), int(match.group(2))) if match else None


class PipelineRecorder(StepRecorder):
    """:class:`~remat.measure.StepRecorder` for a rank's model chunks: layer phases name global layer indices,
    the head phase belongs to the last chunk only, and while :meth:`begin_op` has set a (microbatch, chunk)
    every phase's detail names them (:func:`phase_detail`)."""

    def __init__(self, model: nn.Module, chunks: Sequence[StageModule], *, block_bytes: int = 1):
        self.context: tuple[int, int] | None = None
        super().__init__(model, [layer for chunk in chunks for layer in chunk.layers], block_bytes=block_bytes)
        self.chunks = list(chunks)
        self.layer_index = {}
        self.layer_chunk: dict[int, ChunkSpec] = {}
        self.layer_names: dict[int, str] = {}
        for chunk in chunks:
            for i, layer in enumerate(chunk.layers):
                g = chunk.spec.layer_offset + i
                self.layer_index[id(layer)] = g
                self.layer_chunk[id(layer)] = chunk.spec
                self.layer_names[g] = self.module_names.get(id(layer), f"layers.{i}")

    def set_phase(self, kind: str, region: str, detail: str = "") -> None:
        context = getattr(self, "context", None)
        if context is not None:
            detail = phase_detail(*context, detail)
        super().set_phase(kind, region, detail)

    def begin_op(self, kind: str, spec: ChunkSpec, microbatch: int) -> None:
        """A forward or backward of ``spec``'s chunk on ``microbatch`` starts."""
        self.context = (microbatch, spec.index)
        if kind == "forward":
            self.set_phase("forward", "embedding" if spec.is_first else "")
        else:
            self.set_phase("backward", "head" if spec.is_last else "")

    def end_op(self) -> None:
        """The current forward or backward ended; what follows is the pipeline runtime's own work."""
        self.context = None
        self.set_phase("setup", "pipeline")

    def _default_module(self) -> str:
        region = self._phase.region if self._phase else ""
        if region.startswith("layer "):
            return self.layer_names.get(int(region[6:]), region)
        return region

    def _starts_stack(self, layer: nn.Module, index: int) -> bool:
        spec = self.layer_chunk[id(layer)]
        return spec.is_first and index == spec.layer_offset

    def _ends_stack(self, layer: nn.Module, index: int) -> bool:
        spec = self.layer_chunk[id(layer)]
        return spec.is_last and index == spec.layer_offset + spec.num_layers - 1

    def track_setup(self, named: Sequence[tuple[str, torch.Tensor | None]] = ()) -> None:
        """Record what exists before the step: every parameter and buffer (named by its module), then
        ``named`` tensors (batch, pipeline buffers), each under the given module name."""
        for name, module in self.model.named_modules():
            self.module_stack.append(name)
            for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
                self.track(t)
            self.module_stack.pop()
        for name, tensor in named:
            if tensor is not None:
                self.module_stack.append(name)
                self.track(tensor)
                self.module_stack.pop()


def container_of(chunks: Sequence[StageModule]) -> nn.Module:
    """The module a rank's recorder sees: the chunk itself, or ``chunk<g>`` children when the rank has several
    (so parameter rows are named ``layers.3.mlp...`` or ``chunk5.layers.3.mlp...``)."""
    if len(chunks) == 1:
        return chunks[0]
    return nn.ModuleDict({f"chunk{c.spec.index}": c for c in chunks})


@contextlib.contextmanager
def gc_paused(collect: bool = True) -> Iterator[None]:
    """Pause Python's cycle collector (after a collection when ``collect``): it runs at moments that depend on how
    many Python objects were made (which differs between real and fake tensors); with it paused every storage is
    freed when its last reference goes, so a recorded step frees the same tensors at the same events."""
    import gc

    if collect:
        gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextlib.contextmanager
def checkpointing_disabled(module: nn.Module) -> Iterator[None]:
    """Run ``module``'s forward as if no policy were applied (for a microbatch that Megatron's partial
    recompute leaves un-checkpointed): every region of the applied policy calls its modules' own forwards."""
    state = applied(module)
    regions = state.regions if state is not None else []
    saved = [r._running for r in regions]
    for r in regions:
        r._running = True
    try:
        yield
    finally:
        for r, value in zip(regions, saved):
            r._running = value


# ------------------------------------------------------------------------------------------------ chunk traces
@dataclass
class _Segment:
    """The events of one forward or backward of a chunk trace, ready to be copied for any microbatch."""

    num_events: int = 0
    phases: list[tuple[int, str, str, str, int]] = field(default_factory=list)  # offset, kind, region, inner, flops
    nbytes: list[int] = field(default_factory=list)  # per allocation ordinal
    category: list[str] = field(default_factory=list)
    module: list[str] = field(default_factory=list)
    alloc_offsets: list[int] = field(default_factory=list)
    frees: list[tuple[int, str, int, int]] = field(default_factory=list)  # offset, 'F'|'self', ordinal, nbytes
    keep: int | None = None  # ordinal of the tensor the runtime keeps (stage output / input gradient)

    def signature(self) -> tuple[Any, ...]:
        return (self.num_events, tuple(self.nbytes), tuple(self.category), tuple(self.alloc_offsets),
                tuple((o, s, i) for o, s, i, _ in self.frees), self.keep)


@dataclass
class ChunkTrace:
    """A fake trace of one chunk kind under one policy, cut into segments (see the module docstring)."""

    kind: tuple[bool, bool, int]
    policy: Policy
    params: list[tuple[int, str, str]]  # (nbytes, module, category) of parameters/buffers, in module order
    forward: _Segment
    backward_first: _Segment
    backward_next: _Segment
    input_bytes: int  # one microbatch's chunk input (hidden states; token ids for the first chunk)
    input_category: str  # its category: group_inputs when the chunk's first checkpoint keeps it
    output_bytes: int  # one microbatch's chunk output (hidden states, or the loss)
    timeline: Timeline


_TRACES: dict[tuple[Any, ...], ChunkTrace] = {}
_TRACES_CAPACITY = 128


def trace_chunk(config: ModelConfig, kind: tuple[bool, bool, int], policy: Policy | str, device: str = "cpu",
                ) -> ChunkTrace:
    """Trace (fake) a chunk of ``kind`` = (has the embedding, has the head, layers) under ``policy``: two
    forwards whose outputs are kept, then their two backwards (each given the output gradient); cached."""
    policy = Policy.parse(policy) if isinstance(policy, str) else policy
    key = (config, kind, policy, device)
    if key not in _TRACES:
        if len(_TRACES) >= _TRACES_CAPACITY:
            del _TRACES[next(iter(_TRACES))]
        _TRACES[key] = _trace_chunk(config, kind, policy, device)
    return _TRACES[key]


def _trace_chunk(config: ModelConfig, kind: tuple[bool, bool, int], policy: Policy, device: str) -> ChunkTrace:
    if device not in ("cpu", "cuda"):
        raise PipelineError(f"device={device!r}: predict models 'cpu' (exact bytes) or 'cuda' (512-byte blocks)")
    first, last, layers = kind
    index = 0 if first else 1
    spec = ChunkSpec(index, index + (1 if last else 2), 0, layers)
    policy.layer_groups(layers)  # refuses k > layers in the chunk, naming the depth
    tokens, labels = sample_batch(config)
    b, s, h = config.micro_batch_size, config.seq_length, config.hidden_size
    with FakeTensorMode(allow_non_fake_inputs=False) as fake:
        module = build_stage_module(config, spec)
        apply(module, policy)
        xs, ys, gs = [], [], []
        for _ in range(2):
            if first:
                xs.append(fake.from_tensor(tokens))
            else:
                xs.append(torch.empty(b, s, h, dtype=config.torch_dtype).requires_grad_())
            ys.append(fake.from_tensor(labels) if last else None)
            gs.append(None if last else torch.empty(b, s, h, dtype=config.torch_dtype))
        recorder = PipelineRecorder(module, [module], block_bytes=CUDA_BLOCK if device == "cuda" else 1)
        bounds: list[int] = []
        outputs: list[torch.Tensor] = []
        grads: list[torch.Tensor | None] = []
        with gc_paused(collect=False), recorder:  # nothing made before the trace is recorded by it
            recorder.track_setup()
            n_params = len(recorder.timeline)
            recorder.track_setup([(f"input{i}", t) for i, t in enumerate(xs + ys + gs)])
            bounds.append(recorder.timeline.num_events)
            for mb in range(2):
                recorder.begin_op("forward", spec, mb)
                outputs.append(module(xs[mb], ys[mb]))
                recorder.end_op()
                bounds.append(recorder.timeline.num_events)
            for mb in range(2):
                recorder.begin_op("backward", spec, mb)
                torch.autograd.backward([outputs[mb]], grad_tensors=[gs[mb]])
                grads.append(xs[mb].grad if xs[mb].requires_grad else None)
                xs[mb].grad = None
                recorder.end_op()
                bounds.append(recorder.timeline.num_events)
            recorder.set_phase("setup", "end")
            kept = [recorder.rows.get(t.untyped_storage()) for t in outputs]
            kept += [None if g is None else recorder.rows.get(g.untyped_storage()) for g in grads]
            del outputs, grads
        recorder.categorize(None)
    tl = recorder.timeline
    tl.meta["phase_flops"] = recorder.phase_flops
    bounds.append(tl.num_events)
    return _cut(config, kind, policy, tl, bounds, n_params, kept, recorder.phase_flops)


def _cut(config: ModelConfig, kind: tuple[bool, bool, int], policy: Policy, tl: Timeline, bounds: list[int],
         n_params: int, kept: list[int | None], flops: list[int]) -> ChunkTrace:
    """Cut a chunk trace into segments; check the frees (each segment frees only what its own microbatch made)."""
    setup_end, f0, f1, b0, b1, end = bounds
    rows_at: dict[int, tuple[bool, int]] = {}
    for row in range(len(tl)):
        rows_at[tl.alloc_at[row]] = (True, row)
        if tl.free_at[row] >= 0:
            rows_at[tl.free_at[row]] = (False, row)
    owner: dict[int, tuple[int, int]] = {}  # row -> (segment index, ordinal); setup rows are segment -1
    for row in range(len(tl)):
        if tl.alloc_at[row] < setup_end:
            owner[row] = (-1, row)
    spans = [(setup_end, f0), (f0, f1), (f1, b0), (b0, b1)]
    mb_of = [0, 1, 0, 1]  # forward 0, forward 1, backward 0, backward 1
    segments: list[_Segment] = []
    for index, (lo, hi) in enumerate(spans):
        seg = _Segment(num_events=hi - lo)
        for p, phase in enumerate(tl.phases):
            end_p = tl.phases[p + 1].start if p + 1 < len(tl.phases) else tl.num_events
            if end_p > lo and phase.start < hi:
                seg.phases.append((max(0, phase.start - lo), phase.kind, phase.region, phase.detail,
                                   flops[p] if phase.start >= lo else 0))
        for event in range(lo, hi):
            is_alloc, row = rows_at[event]
            if is_alloc:
                owner[row] = (index, len(seg.nbytes))
                seg.nbytes.append(tl.nbytes[row])
                seg.category.append(tl.category[row])
                seg.module.append(tl.module[row])
                seg.alloc_offsets.append(event - lo)
                continue
            where, ordinal = owner[row]
            if where == index:
                seg.frees.append((event - lo, "self", ordinal, tl.nbytes[row]))
            elif index >= 2 and where == index - 2 and mb_of[where] == mb_of[index]:
                seg.frees.append((event - lo, "F", ordinal, tl.nbytes[row]))
            else:
                name = ("setup" if where < 0 else ("forward", "forward", "backward", "backward")[where] +
                        f" of microbatch {mb_of[where]}")
                raise CompositionError(f"chunk trace {kind} under {policy}: a free in the "
                                       f"{('forward', 'forward', 'backward', 'backward')[index]} of microbatch "
                                       f"{mb_of[index]} releases a tensor of the {name}; a microbatch's steps can "
                                       "only be copied when they free their own tensors")
        segments.append(seg)
    # what the step still holds at its end are the kept outputs / input gradients (released by the runtime)
    for event in range(b1, end):
        is_alloc, row = rows_at[event]
        if is_alloc or row not in kept:
            raise CompositionError(f"chunk trace {kind} under {policy}: {tl.module[row]} "
                                   f"({tl.nbytes[row]} bytes) is {'made' if is_alloc else 'freed'} after the "
                                   "last backward; only the kept outputs and input gradients should be")
    forward0, forward1, backward0, backward1 = segments
    for seg, row in ((forward0, kept[0]), (forward1, kept[1]), (backward0, kept[2]), (backward1, kept[3])):
        if row is not None:
            seg.keep = owner[row][1]
    if forward0.signature() != forward1.signature():
        raise CompositionError(f"chunk trace {kind} under {policy}: the second microbatch's forward does not repeat "
                               "the first one's events, so forwards cannot be copied per microbatch")
    params = [(tl.nbytes[r], tl.module[r], tl.category[r]) for r in range(n_params)]
    input_bytes = tl.nbytes[n_params]
    out_row = kept[0]
    return ChunkTrace(kind, policy, params, forward0, backward0, backward1, input_bytes, tl.category[n_params],
                      tl.nbytes[out_row] if out_row is not None else 0, tl)


# ------------------------------------------------------------------------------------------------ composition
class _Composer:
    """Builds a stage timeline: synthesized allocations/frees and copied chunk-trace segments."""

    def __init__(self) -> None:
        self.tl = Timeline()
        self.flops: list[int] = []
        self.keys: dict[Any, int] = {}  # runtime-held tensors -> row
        self.forward_rows: dict[tuple[int, int], tuple[list[int], _Segment]] = {}

    def phase(self, kind: str, region: str, detail: str = "", flops: int = 0) -> None:
        tl = self.tl
        if tl.phases and tl.phases[-1].start == tl.num_events:
            tl.phases[-1] = Phase(tl.num_events, kind, region, detail)
            self.flops[-1] = flops
        else:
            tl.phases.append(Phase(tl.num_events, kind, region, detail))
            self.flops.append(flops)

    def _row(self, nbytes: int, alloc_at: int, phase: int, module: str, category: str) -> int:
        tl = self.tl
        tl.nbytes.append(nbytes)
        tl.alloc_at.append(alloc_at)
        tl.free_at.append(-1)
        tl.phase_index.append(phase)
        tl.module.append(module)
        tl.category.append(category)
        return len(tl.nbytes) - 1

    def alloc(self, key: Any, nbytes: int, module: str, category: str = "other") -> None:
        if nbytes <= 0:
            return
        if key in self.keys:
            raise CompositionError(f"pipeline tensor {key} allocated twice")
        self.keys[key] = self._row(nbytes, self.tl.num_events, len(self.tl.phases) - 1, module, category)
        self.tl.num_events += 1

    def free(self, key: Any) -> None:
        row = self.keys.pop(key, None)
        if row is None:
            return
        if self.tl.free_at[row] != -1:
            raise CompositionError(f"pipeline tensor {key} freed twice")
        self.tl.free_at[row] = self.tl.num_events
        self.tl.num_events += 1

    def segment(self, seg: _Segment, spec: ChunkSpec, microbatch: int, prefix: str, kind: str,
                keep_key: Any = None) -> None:
        """Copy ``seg`` for ``microbatch`` of ``spec``'s chunk; ``kind`` 'F' or 'B'. Frees of the forward's
        tensors resolve to the same (chunk, microbatch) forward copied before; each is checked."""
        tl = self.tl
        base = tl.num_events
        phase_ids = []
        for offset, kind_, region, inner, flops in seg.phases:
            if region.startswith("layer "):
                region = f"layer {int(region[6:]) + spec.layer_offset}"
            phase = Phase(base + offset, kind_, region, phase_detail(microbatch, spec.index, _parse_inner(inner)))
            if tl.phases and tl.phases[-1].start == phase.start:  # the phase before made no event
                tl.phases[-1] = phase
                self.flops[-1] = flops
            else:
                tl.phases.append(phase)
                self.flops.append(flops)
            phase_ids.append(len(tl.phases) - 1)
        phase_starts = [p[0] for p in seg.phases]
        rows = []
        for ordinal, nbytes in enumerate(seg.nbytes):
            offset = seg.alloc_offsets[ordinal]
            phase = phase_ids[max(0, bisect.bisect_right(phase_starts, offset) - 1)]
            rows.append(self._row(nbytes, base + offset, phase, prefix + seg.module[ordinal], seg.category[ordinal]))
        if kind == "F":
            self.forward_rows[(spec.index, microbatch)] = (rows, seg)
            source: tuple[list[int], _Segment] | None = None
        else:
            source = self.forward_rows.pop((spec.index, microbatch), None)
            if source is None:
                raise CompositionError(f"the backward of microbatch {microbatch} of chunk {spec.index} comes before "
                                       "its forward")
        for offset, where, ordinal, nbytes in seg.frees:
            if where == "self":
                target = rows[ordinal]
            else:
                assert source is not None
                target_rows, forward = source
                if ordinal >= len(target_rows) or forward.nbytes[ordinal] != nbytes:
                    raise CompositionError(f"a free in the backward of microbatch {microbatch} of chunk {spec.index} "
                                           "does not find its tensor in that microbatch's forward")
                target = target_rows[ordinal]
            if tl.free_at[target] != -1 or tl.nbytes[target] != nbytes:
                raise CompositionError(f"a free in the {'forward' if kind == 'F' else 'backward'} of microbatch "
                                       f"{microbatch} of chunk {spec.index} finds another tensor")
            tl.free_at[target] = base + offset
        if seg.keep is not None and keep_key is not None:
            self.keys[keep_key] = rows[seg.keep]
        tl.num_events += seg.num_events

    def finish(self, meta: dict[str, Any]) -> Timeline:
        tl = self.tl
        tl.meta.update(meta)
        tl.meta["phase_flops"] = self.flops
        flops: dict[str, int] = {}
        for phase, amount in zip(tl.phases, self.flops):
            flops[phase.kind] = flops.get(phase.kind, 0) + amount
        tl.meta["flops"] = flops
        tl.validate()
        return tl


def _parse_inner(detail: str) -> str:
    """A chunk-trace phase detail without its 'microbatch i, chunk g' prefix."""
    if parse_phase_detail(detail) is None:
        return detail
    _, _, inner = detail.partition(": ")
    return inner


class _Holders:
    """References that keep runtime tensors alive; a tensor is freed when its last holder lets go (the way
    CPython frees it when the last reference goes)."""

    def __init__(self, composer: _Composer):
        self.composer = composer
        self.held: dict[str, list[Any]] = defaultdict(list)
        self.count: Counter[Any] = Counter()

    def set(self, holder: str, keys: Sequence[Any]) -> None:
        """``holder = keys`` (a variable reassigned: its old values are released after the new ones are held)."""
        old = self.held.pop(holder, [])
        self.held[holder] = [k for k in keys if k is not None]
        for k in self.held[holder]:
            self.count[k] += 1
        self._drop(old)

    def add(self, holder: str, key: Any) -> None:
        if key is not None:
            self.held[holder].append(key)
            self.count[key] += 1

    def release(self, holder: str, reverse: bool = False) -> None:
        """The holder lets go of its tensors; ``reverse``: last first, as CPython clears or frees a list."""
        keys = self.held.pop(holder, [])
        self._drop(keys[::-1] if reverse else keys)

    def release_all(self) -> None:
        for holder in list(self.held):
            self.release(holder)

    def _drop(self, keys: list[Any]) -> None:
        for k in keys:
            self.count[k] -= 1
            if self.count[k] == 0:
                del self.count[k]
                self.composer.free(k)


# ------------------------------------------------------------------------------------------------ runtimes
@dataclass
class _StagePlan:
    """Everything needed to compose one rank's timeline."""

    config: ModelConfig
    pp: int
    microbatches: int
    vpp: int
    rank: int
    schedule: str
    runtime: str
    chunks: list[ChunkSpec]
    actions: list[Action]
    checkpointed: dict[tuple[int, int], bool]
    traces: dict[tuple[int, bool], ChunkTrace]  # (chunk, runs the policy) -> trace

    def prefix(self, spec: ChunkSpec) -> str:
        return "" if len(self.chunks) == 1 else f"chunk{spec.index}."

    def spec(self, chunk: int) -> ChunkSpec:
        return next(s for s in self.chunks if s.index == chunk)

    def trace(self, a: Action) -> ChunkTrace:
        return self.traces[(a.chunk, self.checkpointed[(a.chunk, a.microbatch)])]

    @property
    def activation_bytes(self) -> int:
        c = self.config
        return _storage_bytes(c.micro_batch_size * c.seq_length * c.hidden_size * c.torch_dtype.itemsize,
                              self.block)

    @property
    def token_bytes(self) -> int:
        return _storage_bytes(self.config.micro_batch_size * self.config.seq_length * 8, self.block)

    block: int = 1


def _storage_bytes(nbytes: int, block: int) -> int:
    return -(-nbytes // block) * block


def _setup(plan: _StagePlan, composer: _Composer) -> None:
    composer.phase("setup", "")
    for spec in plan.chunks:
        trace = plan.traces[(spec.index, True)]
        for nbytes, module, category in trace.params:
            composer.alloc(("param", spec.index, len(composer.keys)), nbytes, plan.prefix(spec) + module, category)
    if plan.runtime == "torch":
        m = plan.microbatches
        for spec in plan.chunks:
            for mb in range(m):
                if not spec.is_first:  # the chunk's input: a checkpoint input when the first group keeps it
                    category = plan.traces[(spec.index, plan.checkpointed[(spec.index, mb)])].input_category
                    composer.alloc(("recv_act", spec.index, mb), plan.activation_bytes,
                                   f"pipeline.stage{spec.index}.recv_activation", category)
            for mb in range(m):
                if not spec.is_last:
                    composer.alloc(("recv_grad", spec.index, mb), plan.activation_bytes,
                                   f"pipeline.stage{spec.index}.recv_grad")
        if any(s.is_first for s in plan.chunks):
            composer.alloc(("batch", "tokens"), _storage_bytes(m * plan.config.micro_batch_size *
                                                               plan.config.seq_length * 8, plan.block), "tokens")
        if any(s.is_last for s in plan.chunks):
            composer.alloc(("batch", "labels"), _storage_bytes(m * plan.config.micro_batch_size *
                                                               plan.config.seq_length * 8, plan.block), "labels")
    # parameters, buffers and what exists before the step never leave: drop their keys
    composer.keys.clear()


def _forward(plan: _StagePlan, composer: _Composer, a: Action) -> tuple[str, int, int]:
    spec = plan.spec(a.chunk)
    key = ("out", a.chunk, a.microbatch)
    composer.segment(plan.trace(a).forward, spec, a.microbatch, plan.prefix(spec), "F", keep_key=key)
    composer.phase("setup", "pipeline")
    return key


def _backward(plan: _StagePlan, composer: _Composer, a: Action, first_backward: set[int]) -> Any:
    spec = plan.spec(a.chunk)
    trace = plan.trace(a)
    seg = trace.backward_next if a.chunk in first_backward else trace.backward_first
    first_backward.add(a.chunk)
    key = None if spec.is_first else ("igrad", a.chunk, a.microbatch)
    composer.segment(seg, spec, a.microbatch, plan.prefix(spec), "B", keep_key=key)
    composer.phase("setup", "pipeline")
    return key


def _torch_runtime(plan: _StagePlan, composer: _Composer) -> None:
    """Lay out a rank's step as ``torch.distributed.pipelining`` runs it (torch 2.13).

    What the runtime holds besides the chunks' own tensors follows its code: a stage output stays in
    ``fwd_cache`` until its backward ends, and the send ops (P2POp lists) and send handles (``Work`` objects,
    which keep their tensor until they are destroyed) keep outputs and input gradients alive as long as the
    schedule's variables and lists hold them: until the step ends in GPipe and the interleaved runtime (they
    collect every send handle), and in 1F1B until the variable that holds them is reassigned. The loss of every
    microbatch stays in the schedule's loss list until the step ends. At the end the lists are emptied last item
    first and the schedule function's variables are released in the order they were first assigned (as CPython
    does), which fixes the order of the last frees.
    """
    h = _Holders(composer)
    first_backward: set[int] = set()
    m = plan.microbatches

    def sends_f(key: Any, a: Action) -> list[Any]:
        return [] if plan.spec(a.chunk).is_last else [key]

    def forward(a: Action) -> Any:
        key = _forward(plan, composer, a)
        h.set(f"fwd_cache{a.chunk}.{a.microbatch}", [key])
        if plan.spec(a.chunk).is_last:
            h.add("internal_losses", key)
        return key

    def backward(a: Action) -> Any:
        key = _backward(plan, composer, a, first_backward)
        h.release(f"fwd_cache{a.chunk}.{a.microbatch}")  # popped at the start, held by locals until it returns
        return key

    def loss_of(spec: ChunkSpec, mb: int) -> list[Any]:
        return [("out", spec.index, mb)] if spec.is_last else []

    if plan.schedule == "gpipe":
        (spec,) = plan.chunks
        for i in range(m):
            h.set("ops", [])  # receive ops
            h.set("works", [])
            a = Action("F", spec.index, i)
            key = forward(a)
            h.set("output", [key])
            h.set("ops", sends_f(key, a))
            h.set("works", sends_f(key, a))
            for k in sends_f(key, a):
                h.add("fwd_sends_to_wait", k)
        for i in range(m):
            h.set("ops", [])
            h.set("works", [])
            h.set("loss", loss_of(spec, i))
            key = backward(Action("B", spec.index, i))
            h.set("ops", [key])
            h.set("works", [key])
            h.add("bwd_sends_to_wait", key)
        composer.phase("setup", "pipeline")
        h.release("internal_losses", reverse=True)
        for holder in ("fwd_sends_to_wait", "ops", "works", "output", "bwd_sends_to_wait", "loss"):
            h.release(holder, reverse=holder.endswith("_to_wait"))
    elif plan.schedule == "1f1b":
        (spec,) = plan.chunks
        w = min(m, plan.pp - spec.index)  # torch's warm-up count (the sequence equals Megatron's)
        f = b = 0
        for _ in range(w):
            a = Action("F", spec.index, f)
            key = forward(a)
            h.set("output", [key])
            h.set("fwd_sends", sends_f(key, a))
            if f != w - 1:
                h.set("send_work", sends_f(key, a))
            f += 1
        while True:
            h.set("loss", loss_of(spec, b))
            key = backward(Action("B", spec.index, b))
            h.set("bwd_sends", [key])
            b += 1
            if f == m:
                break
            a = Action("F", spec.index, f)
            key = forward(a)
            h.set("output", [key])
            h.set("fwd_sends", sends_f(key, a))
            f += 1
        h.set("send_work", list(h.held.get("bwd_sends", [])))
        while b < m:
            h.set("loss", loss_of(spec, b))
            key = backward(Action("B", spec.index, b))
            h.set("bwd_sends", [key])
            h.set("send_work", [key])
            b += 1
        composer.phase("setup", "pipeline")
        h.release("internal_losses", reverse=True)
        for holder in ("send_work", "fwd_sends", "output", "loss", "bwd_sends"):
            h.release(holder)
    else:  # interleaved: _PipelineScheduleRuntime keeps every send handle until the step ends
        for a in plan.actions:
            if a.kind == "F":
                key = forward(a)
                for k in sends_f(key, a):
                    h.add("send_ops", k)
            else:
                h.add("send_ops", backward(a))
        composer.phase("setup", "pipeline")
        h.release("send_ops", reverse=True)
        h.release("internal_losses", reverse=True)
    h.release_all()


def _megatron_runtime(plan: _StagePlan, composer: _Composer) -> None:
    """Lay out a rank's step as Megatron-LM runs it: a received activation is a fresh tensor from just before
    the forward until the microbatch's backward ends, a stage output is freed once sent
    (``deallocate_pipeline_outputs``), a received output gradient lives through its backward, an input gradient
    is freed once sent, and each microbatch's token ids (first stage) and labels (last stage) are loaded at its
    forward and kept until its backward ends; the losses are kept until the step ends."""
    first_backward: set[int] = set()
    act, tok = plan.activation_bytes, plan.token_bytes
    for a in plan.actions:
        spec = plan.spec(a.chunk)
        mb = (a.chunk, a.microbatch)
        if a.kind == "F":
            composer.phase("setup", "pipeline", phase_detail(a.microbatch, a.chunk))
            if spec.is_first:
                composer.alloc(("tokens", mb), tok, "tokens")
            else:
                composer.alloc(("recv_act", mb), act, f"pipeline.stage{spec.index}.recv_activation",
                               plan.trace(a).input_category)
            if spec.is_last:
                composer.alloc(("labels", mb), tok, "labels")
            key = _forward(plan, composer, a)
            if not spec.is_last:
                composer.free(key)  # sent, then deallocated
        else:
            composer.phase("setup", "pipeline", phase_detail(a.microbatch, a.chunk))
            if not spec.is_last:
                composer.alloc(("recv_grad", mb), act, f"pipeline.stage{spec.index}.recv_grad")
            key = _backward(plan, composer, a, first_backward)
            for k in (key, ("recv_grad", mb), ("recv_act", mb), ("tokens", mb), ("labels", mb)):
                composer.free(k)
    composer.phase("setup", "pipeline")
    for k in [k for k in composer.keys if k[0] == "out"]:
        composer.free(k)


# ------------------------------------------------------------------------------------------------ predict
def predict_pipeline(config: ModelConfig, policy: Policy | str, pp: int, microbatches: int, schedule: str = "1f1b",
                     vpp: int = 1, layout: Sequence[int] | None = None,
                     partial_checkpoint_microbatches: int | None = None, *, runtime: str = "torch",
                     device: str = "cpu") -> list[Timeline]:
    """Predict each pipeline stage's memory timeline of one training step (one :class:`Timeline` per rank).

    ``config`` is the whole model (``micro_batch_size`` is the microbatch); ``policy`` is applied to every model
    chunk (groups and block counts count within a chunk); the step runs ``microbatches`` microbatches under
    ``schedule`` ('1f1b', 'gpipe' or 'interleaved' with ``vpp`` chunks per stage). ``layout`` gives the layers of
    each global chunk (default: even). ``partial_checkpoint_microbatches`` is Megatron's
    ``num_microbatches_with_partial_activation_checkpoints`` (see the module docstring). ``runtime`` says whose
    pipeline buffers to model: 'torch' (``torch.distributed.pipelining``, what
    :func:`remat.distributed.measure_pipeline` runs) or 'megatron'. ``device='cuda'`` rounds storages to 512-byte
    blocks. Nothing is allocated for real. Raises :class:`PipelineError` for settings that cannot run.

    Each timeline's ``meta['pipeline']`` holds the stage's schedule, its warm-up forwards, the most microbatches it
    holds at once, and at its peak the (microbatch, chunk) pairs whose saved tensors are alive; ``meta['why']``
    explains the peak in words.
    """
    policy = Policy.parse(policy) if isinstance(policy, str) else policy
    schedule = check_schedule(schedule, pp, microbatches, vpp, runtime)
    partial = _check_partial(partial_checkpoint_microbatches)
    specs = partition(config, pp, vpp, layout)
    for spec in specs:
        if policy.granularity == "full" and policy.num_layers > spec.num_layers:
            raise PipelineError(f"policy {policy} groups {policy.num_layers} layers but chunk {spec.index} has "
                                f"{spec.num_layers} layers (policies apply per model chunk, as in Megatron): use "
                                f"--recompute-num-layers <= {min(s.num_layers for s in specs)}")
    none = Policy()
    out = []
    for rank in range(pp):
        chunks = rank_chunks(specs, pp, rank)
        actions = schedule_actions(schedule, pp, microbatches, vpp, rank, runtime=runtime)
        window = warmup_forwards(schedule, pp, microbatches, vpp, rank, "megatron") + 1  # Megatron's window
        checkpointed = checkpointed_forwards(actions, partial, window)
        traces = {}
        for spec in chunks:
            traces[(spec.index, True)] = trace_chunk(config, spec.kind, policy, device)
            if partial is not None:
                traces[(spec.index, False)] = trace_chunk(config, spec.kind, none, device)
        plan = _StagePlan(config, pp, microbatches, vpp, rank, schedule, runtime, chunks, actions, checkpointed,
                          traces, block=CUDA_BLOCK if device == "cuda" else 1)
        out.append(_compose_stage(plan, policy, partial))
    return out


def _compose_stage(plan: _StagePlan, policy: Policy, partial: int | None = None) -> Timeline:
    """One rank's timeline from its plan (see :func:`predict_pipeline`)."""
    composer = _Composer()
    _setup(plan, composer)
    if plan.runtime == "torch":
        _torch_runtime(plan, composer)
    else:
        _megatron_runtime(plan, composer)
    composer.phase("setup", "end")
    meta = {
        "backend": "fake", "device": "cuda" if plan.block > 1 else "cpu", "policy": str(policy),
        "config": plan.config.to_dict(), "num_layers": sum(s.num_layers for s in plan.chunks),
    }
    meta["pipeline"] = pipeline_meta(plan.schedule, plan.pp, plan.microbatches, plan.vpp, plan.rank, plan.chunks,
                                     plan.runtime, partial, plan.actions)
    tl = composer.finish(meta)
    describe_stage(tl)
    return tl


def pipeline_meta(schedule: str, pp: int, microbatches: int, vpp: int, rank: int, chunks: Sequence[ChunkSpec],
                  runtime: str, partial: int | None, actions: Sequence[Action]) -> dict[str, Any]:
    """What ``meta['pipeline']`` records about a stage (shared by predicted and measured timelines)."""
    return {
        "stage": rank, "pp": pp, "vpp": vpp, "microbatches": microbatches, "schedule": schedule, "runtime": runtime,
        "chunks": [s.index for s in chunks],
        "layers": [[s.layer_offset, s.layer_offset + s.num_layers - 1] for s in chunks],
        "partial_checkpoint_microbatches": partial,
        "warmup_forwards": warmup_forwards(schedule, pp, microbatches, vpp, rank, runtime),
        "max_in_flight": max_in_flight(actions),
        "order": " ".join(str(a) for a in actions),
    }


# ------------------------------------------------------------------------------------------------ analysis
def _pair_spans(tl: Timeline) -> dict[tuple[int, int], tuple[int, int | None]]:
    """(microbatch, chunk) -> (first event of its forward, one past the last event of its backward or None)."""
    spans: dict[tuple[int, int], tuple[int, int | None]] = {}
    for phase, start, end in tl.phase_spans():
        who = parse_phase_detail(phase.detail)
        if who is None:
            continue
        first, last = spans.get(who, (start, None))
        if phase.kind in ("backward", "recompute"):
            last = end if last is None else max(last, end)
        spans[who] = (min(first, start), last)
    return spans


def in_flight_at(tl: Timeline, event: int) -> tuple[dict[tuple[int, int], dict[str, int]], dict[tuple[int, int], int]]:
    """What the microbatches leave alive after ``event``.

    Returns (in flight, kept): in flight maps each (microbatch, chunk) whose forward has started and whose
    backward has not ended to the bytes of its saved tensors alive (by category, :data:`SAVED_CATEGORIES`); kept
    maps each (microbatch, chunk) whose backward has ended to the bytes still alive that it made (its output or
    input gradient, held by the pipeline runtime's send handles or variables).
    """
    spans = _pair_spans(tl)
    flight: dict[tuple[int, int], dict[str, int]] = {}
    kept: dict[tuple[int, int], int] = {}
    for row in tl.alive_at(event):
        who = parse_phase_detail(tl.phases[tl.phase_index[row]].detail)
        if who is None:
            continue
        _, end = spans.get(who, (0, None))
        if end is not None and end <= event:
            if tl.category[row] not in ("parameters", "gradients", "optimizer_state"):
                kept[who] = kept.get(who, 0) + tl.nbytes[row]
        elif tl.category[row] in SAVED_CATEGORIES:
            parts = flight.setdefault(who, {})
            parts[tl.category[row]] = parts.get(tl.category[row], 0) + tl.nbytes[row]
    return dict(sorted(flight.items())), dict(sorted(kept.items()))


def describe_stage(tl: Timeline) -> str:
    """Fill ``meta['pipeline']['peak']`` (bytes, phase, the microbatches whose saved tensors are alive, what the
    runtime keeps of finished ones) and ``meta['why']`` (plain words) of a stage timeline; return the sentence."""
    info = tl.meta.setdefault("pipeline", {})
    event = tl.peak_event
    peak = tl.peak_bytes
    flight, kept = in_flight_at(tl, event)
    parts = tl.breakdown(event)
    saved = sum(sum(v.values()) for v in flight.values())
    held = sum(kept.values())
    phase = tl.peak_phase
    running = parse_phase_detail(phase.detail)
    info["peak"] = {
        "bytes": peak, "event": event, "phase": phase.label,
        "in_flight": len(flight),
        "alive": [{"microbatch": mb, "chunk": c, "bytes": sum(v.values()), **v} for (mb, c), v in flight.items()],
        "saved_bytes": saved,
        "kept_after_backward": [{"microbatch": mb, "chunk": c, "bytes": n} for (mb, c), n in kept.items()],
        "kept_bytes": held, "breakdown": parts,
    }
    stage = info.get("stage", "?")
    schedule = info.get("schedule", "?")
    vpp = info.get("vpp", 1)
    names = ", ".join(f"{mb}" + (f" (chunk {c})" if vpp > 1 else "") for mb, c in flight)
    words = [f"Stage {stage} peaks at {peak / MIB:.2f} MiB during {phase.label}."]
    if flight:
        n = len(flight)
        what = ("microbatch-chunk" if vpp > 1 else "microbatch") + ("s" if n > 1 and vpp > 1 else "es" if n > 1
                                                                    else "")
        words.append(f"{n} {what} in flight (microbatch {names}) keep{'s' if n == 1 else ''} saved activations "
                     f"and checkpoint inputs there: {saved / MIB:.2f} MiB"
                     + (f", about {saved / n / MIB:.2f} MiB each" if n > 1 else "")
                     + f", {100 * saved / max(peak, 1):.0f}% of the peak.")
    warm = info.get("warmup_forwards")
    top = info.get("max_in_flight")
    pp = info.get("pp", "?")
    if schedule == "gpipe":
        words.append("GPipe runs every forward before any backward, so every microbatch's saved tensors are alive "
                     "when the first backward starts, on every stage.")
    elif schedule == "1f1b":
        words.append(f"1F1B runs {warm} warm-up forward{'s' if warm != 1 else ''} on this stage before its first "
                     f"backward, then one forward before each backward, so it holds up to {top} "
                     f"microbatch{'es' if top != 1 else ''} (pp - stage = {pp} - {stage}): the first stage holds the "
                     "most, the last one.")
    elif schedule == "interleaved":
        words.append(f"Interleaved 1F1B runs {warm} warm-up forwards over this stage's {vpp} model chunks before "
                     f"its first backward ((pp - stage - 1) * 2 + (vpp - 1) * pp), so up to {top} microbatch-chunks "
                     "are in flight, each a 1/vpp slice of the stage's layers.")
    if running is not None and phase.kind in ("backward", "recompute"):
        doing = ("recomputing a checkpointed group" if phase.kind == "recompute"
                 else "its activation gradients and temporaries")
        words.append(f"The peak comes while microbatch {running[0]}'s backward runs on top of them ({doing}).")
    if held:
        words.append(f"The pipeline runtime still holds {held / MIB:.2f} MiB of outputs or input gradients of "
                     f"{len(kept)} finished microbatch{'es' if len(kept) > 1 else ''} (kept by send handles or "
                     "schedule variables).")
    words.append(f"Parameters {parts.get('parameters', 0) / MIB:.2f} MiB, gradients "
                 f"{parts.get('gradients', 0) / MIB:.2f} MiB, receive buffers, batch and backward temporaries "
                 f"{parts.get('other', 0) / MIB:.2f} MiB.")
    text = " ".join(words)
    tl.meta["why"] = text
    return text


def stage_summary(tl: Timeline) -> dict[str, Any]:
    """A JSON-able summary of one stage timeline: stage, peak bytes, peak phase, in-flight count, why."""
    info = tl.meta.get("pipeline", {})
    if "peak" not in info:
        describe_stage(tl)
    peak = info["peak"]
    return {"stage": info.get("stage"), "policy": tl.meta.get("policy"), "schedule": info.get("schedule"),
            "microbatches": info.get("microbatches"), "peak_bytes": tl.peak_bytes, "peak_phase": peak["phase"],
            "max_in_flight": info.get("max_in_flight"), "in_flight_at_peak": peak["in_flight"],
            "saved_bytes_at_peak": peak["saved_bytes"], "kept_bytes_at_peak": peak["kept_bytes"],
            "why": tl.meta.get("why", "")}


def same_step(a: Timeline, b: Timeline) -> str | None:
    """None when two timelines allocate and free the same bytes in the same order (phases and module names may
    differ), else what differs first. Used to check that a 1-stage, 1-microbatch pipeline is the plain step."""
    for name in ("num_events",):
        if getattr(a, name) != getattr(b, name):
            return f"{name}: {getattr(a, name)} != {getattr(b, name)}"
    for name in ("nbytes", "alloc_at", "free_at", "category"):
        x, y = getattr(a, name), getattr(b, name)
        if x != y:
            i = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
            return f"{name} differs first at row {i}"
    return None


def single_stage_difference(config: ModelConfig, policy: Policy | str, device: str = "cpu") -> str | None:
    """Check the composition against a plain trace: None when a 1-stage, 1-microbatch pipeline (composed from the
    chunk trace, ``runtime='torch'``) allocates and frees what :func:`remat.predict.predict` traces for the whole
    step, event for event, else what differs. The pipeline keeps the loss in its loss list until the step ends,
    while the plain trace keeps it past its end: frees after the plain trace's last event count as never freed."""
    from remat.predict import _trace

    (composed,) = predict_pipeline(config, policy, 1, 1, device=device)
    plain = _trace(config, policy, device=device)
    n = plain.num_events
    trailing = sum(1 for f in composed.free_at if f >= n)
    if composed.num_events != n + trailing:
        return f"num_events: {composed.num_events} != {n} + {trailing} frees at the end"
    clipped = Timeline(composed.nbytes, composed.alloc_at, [f if f < n else -1 for f in composed.free_at],
                       composed.phase_index, composed.module, composed.category, composed.phases, n)
    return same_step(clipped, plain)


def peak_error(measured: int, predicted: int) -> float:
    """(predicted - measured) / measured, or 0 when both are 0."""
    if measured == 0:
        return 0.0 if predicted == 0 else math.inf
    return (predicted - measured) / measured
