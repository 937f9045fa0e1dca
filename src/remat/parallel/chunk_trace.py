"""Fake-tensor traces of one pipeline chunk's forward and backward, cut into reusable segments."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from remat.config import ModelConfig
from remat.memory.compose import (
    CompositionError,
    ShallowTrace,
    compose,
    config_family,
    layer_kinds,
    policy_family,
    role_set,
    shallow_plan,
    shallow_stand_ins,
    shallow_stand_ins_of_kinds,
)
from remat.memory.delayed_wgrad import delay_wgrads
from remat.memory.fake_hits import fake_tensor_mode
from remat.memory.kernels import kernel_trace, model_kernels, prepare_model
from remat.memory.wgrad_fusion import keep_fused_inputs
from remat.models.expert_parallel import simulated_expert_rank
from remat.models.gpt import empty_batch
from remat.models.tensor_parallel import SimulatedGroup
from remat.models.tp_stage import build_tp_stage_module, hidden_shape
from remat.parallel.chunk_compose import MicrobatchStep, join_microbatches, microbatch_step
from remat.parallel.schedule import ChunkSpec, PipelineError
from remat.parallel.stages import PipelineRecorder, build_stage_module, gc_paused
from remat.policy import Policy
from remat.recompute.activation_offload import offloading_last_groups
from remat.recompute.apply import apply
from remat.recompute.plan_format import Plan
from remat.timeline import Timeline
from remat.units import CUDA_BLOCK, round_up


# ------------------------------------------------------------------------------------------------ chunk traces
@dataclass
class TraceSegment:
    """The events of one forward or backward of a chunk trace, ready to be copied for any microbatch."""

    num_events: int = 0
    phases: list[tuple[int, str, str, str, int]] = field(default_factory=list)  # offset, kind, region, inner, flops
    nbytes: list[int] = field(default_factory=list)  # per allocation ordinal
    category: list[str] = field(default_factory=list)
    module: list[str] = field(default_factory=list)
    alloc_offsets: list[int] = field(default_factory=list)
    frees: list[tuple[int, str, int, int]] = field(default_factory=list)  # offset, 'F'|'self', ordinal, nbytes
    keep: int | None = None  # ordinal of the tensor the runtime keeps (stage output / input gradient)
    # fine-grained offloading: (offset, host bytes added (< 0: reloaded), offload module, chunk layer or -1); the
    # host holds the new total from that event on (offset == num_events: from the next segment's first event on)
    host: list[tuple[int, int, str, int]] = field(default_factory=list)
    # and where its groups commit (forward), start their backward and reload a tensor (backward): (offset, 'commit' |
    # 'start' | 'reload', offload module, chunk layer), for remat.parallel.composer's re-timing of reloads
    marks: list[tuple[int, str, str, int]] = field(default_factory=list)

    def signature(self) -> tuple[Any, ...]:
        return (self.num_events, tuple(self.nbytes), tuple(self.category), tuple(self.alloc_offsets),
                tuple((o, s, i) for o, s, i, _ in self.frees), self.keep, tuple(self.host), tuple(self.marks))


@dataclass
class ChunkTrace:
    """A fake trace of one chunk kind under one policy, cut into segments (see the module docstring)."""

    kind: tuple[bool, bool, int]
    policy: Policy
    params: list[tuple[int, str, str]]  # (nbytes, module, category) of parameters/buffers, in module order
    forward: TraceSegment
    backward_first: TraceSegment
    backward_next: TraceSegment
    input_bytes: int  # one microbatch's chunk input (hidden states; token ids for the first chunk)
    input_category: str  # its category: group_inputs when the chunk's first checkpoint keeps it
    output_bytes: int  # one microbatch's chunk output (hidden states, or the loss)
    timeline: Timeline
    batch_in_forward: bool = False  # token ids / labels made inside each forward (see trace_chunk)
    bounds: tuple[int, ...] = ()  # setup end, forward 0 end, forward 1 end, backward 0 end, backward 1 end, end
    kept_rows: tuple[int | None, ...] = ()  # timeline rows of the outputs (mb 0, 1) and input gradients (mb 0, 1)
    composed_from: int | None = None  # the layers of the shallow chunk it was laid out from (None: traced whole)


_TRACES: dict[tuple[Any, ...], ChunkTrace] = {}
_TRACES_CAPACITY = 128
_COMPOSE = [True]  # traced_whole() sets it off


@contextlib.contextmanager
def traced_whole() -> Iterator[None]:
    """Inside the block every chunk is traced whole (:func:`trace_chunk`'s ``compose_layers=False``), e.g. to check
    what composition gives against full traces."""
    before = _COMPOSE[0]
    _COMPOSE[0] = False
    try:
        yield
    finally:
        _COMPOSE[0] = before


def trace_chunk(config: ModelConfig, kind: tuple[bool, bool, int], policy: Policy | Plan | str, device: str = "cpu",
                tp: int = 1, sp: bool = False, *, batch_in_forward: bool = False,
                compose_layers: bool = True, kernels: str = "cpu", drop_grads: bool = False,
                fused_wgrad: bool = False, offload_last: frozenset[str] = frozenset(),
                delay_wgrad: bool = False) -> ChunkTrace:
    """Trace (fake) a chunk of ``kind`` = (has the embedding, has the head, layers) under ``policy``: two
    forwards whose outputs are kept, then their two backwards (each given the output gradient); cached.

    The first chunk's token ids and the last chunk's labels exist before the step (as torch.distributed.pipelining
    holds the whole batch), or with ``batch_in_forward`` are made inside each forward and held only by what the
    forward keeps (as Megatron's get_batch makes them inside its forward step), so the trace says when they go.

    A deep chunk is laid out from the trace of a shallow one with every layer role of it (NOTE [composing a chunk
    trace] in :mod:`remat.parallel.chunk_compose`; the same trace, event for event); ``compose_layers=False``, a
    policy that offloads, or a shallow trace that cannot be laid out trace the whole chunk.

    ``kernels``: whose kernels' saved tensors the chunk keeps (:mod:`remat.memory.kernels`: ``'cpu'``, ``'cuda'``,
    ``'te'``); part of the cache key. ``drop_grads``: each parameter's ``.grad`` is dropped as soon as autograd has
    accumulated it (a post-accumulate-grad hook), as Megatron's DDP hook does once it has added it into the
    main-gradient buffer, so the trace frees it where a Megatron rank does; else ``.grad`` is kept.
    ``fused_wgrad``: Megatron's gradient-accumulation fusion on a GPU: TransformerEngine's linears add their weight
    gradients straight into the main grads, so none is made (NOTE [gradient-accumulation fusion] in
    :mod:`remat.memory.wgrad_fusion`: the trace runs those weights without ``requires_grad`` and keeps each fused
    linear's input saved, as TE does). ``offload_last``: offload modules of a policy that offloads whose last layer's
    group is offloaded too (the forwards of NOTE [which forwards keep their last offload group] in
    :mod:`remat.parallel.schedule`). ``delay_wgrad``: Megatron's ``--delay-wgrad-compute``, TE's linears keep their
    input and output gradient until their layer's ``backward_dw`` (NOTE [delayed weight gradients] in
    :mod:`remat.memory.delayed_wgrad`)."""
    kernels = model_kernels(kernels, config)  # cuda/te of Megatron's local layers: their own kernels
    policy = Policy.parse(policy) if isinstance(policy, str) else policy
    batch_in_forward = batch_in_forward and (kind[0] or kind[1])  # a middle chunk has no batch
    compose_layers = compose_layers and _COMPOSE[0] and kind[2] > 0  # a chunk of no layers is traced as it is
    # the MTP layers after the loss chunk's layers are built as its last layer: a shallow stand-in's may differ
    compose_layers = compose_layers and not (config.mtp_num_layers and kind[1])
    compose_layers = compose_layers and not config.mixed_layers  # window and full, FP8 and bf16: not interchangeable
    # tp/sp: one tp rank's chunk (models.tp_stage); the simulated expert-parallel rank its MoE layers play
    offload_last = frozenset(offload_last)
    key = (config, kind, policy, device, tp, sp, batch_in_forward, simulated_expert_rank(), compose_layers, kernels,
           drop_grads, fused_wgrad, offload_last, delay_wgrad)
    if key not in _TRACES:
        if len(_TRACES) >= _TRACES_CAPACITY:
            del _TRACES[next(iter(_TRACES))]
        composed = (_composed_chunk(config, kind, policy, device, tp, sp, batch_in_forward, kernels, drop_grads,
                                    fused_wgrad, delay_wgrad) if compose_layers else None)
        with offloading_last_groups(offload_last):
            _TRACES[key] = composed or _trace_chunk(config, kind, policy, device, tp, sp, batch_in_forward, kernels,
                                                    drop_grads, fused_wgrad, delay_wgrad)
    return _TRACES[key]


# shallow chunk traces, each with its two microbatch steps (chunk_compose.microbatch_step) ready to be composed
_SHALLOW: dict[tuple[Any, ...], tuple[ChunkTrace, list[ShallowTrace], list[MicrobatchStep]]] = {}
_SHALLOW_CAPACITY = 64


def _chunk_stand_in(config: ModelConfig, layout: Policy | Plan, layers: int, where: tuple[Any, ...],
                    ) -> tuple[Policy | Plan, int, tuple[bool, ...] | None] | None:
    """The shallow (layout, layers, MoE pattern) a chunk of ``layers`` is composed from: a shallow chunk already
    traced with every role, else the shallowest stand-in; None when there is none (or the layout offloads)."""
    kinds = layer_kinds(config.with_depth(layers))
    if isinstance(layout, Plan):
        small = shallow_plan(layout) if kinds is None else None
        return None if small is None else (small, small.num_layers, None)
    if layout.offloads:
        return None
    need = role_set(layout, layers, kinds)
    family, config_kind = policy_family(layout), config_family(config)
    for (small_config, (_, _, depth), small_policy, *rest), (_, traces, _) in reversed(_SHALLOW.items()):
        if tuple(rest) == where and isinstance(small_policy, Policy) and depth < layers and \
                policy_family(small_policy) == family and config_family(small_config) == config_kind and \
                need <= traces[0].role_set:
            # a dense stack keeps no pattern (as below): the same shallow config, so the same cached trace
            return small_policy, depth, None if kinds is None else small_config.moe_layer_pattern()
    if kinds is None:
        return next(((p, d, None) for p, d in shallow_stand_ins(layout, layers)), None)
    found = next(shallow_stand_ins_of_kinds(layout, kinds), None)
    return None if found is None else (found[0], found[1], tuple(k == "moe" for k in found[2]))


def _keep_shallow(key: tuple[Any, ...], shallow: ChunkTrace) -> None:
    """Keep a shallow chunk trace (``key``: its config, kind, layout, then :func:`_composed_chunk`'s ``where``) with
    its two microbatch steps, ready to be composed."""
    if len(_SHALLOW) >= _SHALLOW_CAPACITY:
        del _SHALLOW[next(iter(_SHALLOW))]
    small_config, (_, _, depth), small_layout = key[:3]
    meta = {"num_layers": depth, "config": small_config.to_dict()}
    steps = [microbatch_step(shallow.timeline, shallow.bounds, m, meta) for m in (0, 1)]
    _SHALLOW[key] = (shallow, [ShallowTrace(s.timeline, small_layout) for s in steps], steps)


def shallow_chunk_keys() -> frozenset[tuple[Any, ...]]:
    """The keys of the shallow chunk traces kept in this process (:func:`shallow_chunks_since`)."""
    return frozenset(_SHALLOW)


def shallow_chunks_since(known: frozenset[tuple[Any, ...]]) -> list[tuple[tuple[Any, ...], ChunkTrace]]:
    """The shallow chunk traces of Megatron settings kept here and not among ``known``
    (:func:`shallow_chunk_keys`), in the order they were made: another process (e.g. the one that forked this one)
    takes them with :func:`keep_shallow_chunks` instead of tracing them again. A chunk laid out from any of them is
    the same, event for event, as from its own shallowest stand-in (NOTE [composing a chunk trace])."""
    return [(key, found[0]) for key, found in _SHALLOW.items() if key not in known and isinstance(key[2], Policy)]


def keep_shallow_chunks(found: Sequence[tuple[tuple[Any, ...], ChunkTrace]]) -> None:
    """Keep shallow chunk traces made in another process (:func:`shallow_chunks_since`) for later chunks here."""
    for key, shallow in found:
        if key not in _SHALLOW:
            _keep_shallow(key, shallow)


def _composed_chunk(config: ModelConfig, kind: tuple[bool, bool, int], layout: Policy | Plan, device: str, tp: int,
                    sp: bool, batch_in_forward: bool, kernels: str = "cpu", drop_grads: bool = False,
                    fused_wgrad: bool = False, delay_wgrad: bool = False) -> ChunkTrace | None:
    """The chunk trace laid out from a shallow chunk's (NOTE [composing a chunk trace]), or None."""
    where = (device, tp, sp, batch_in_forward, simulated_expert_rank(), kernels, drop_grads, fused_wgrad, delay_wgrad)
    traced = _traced_plan_stand_in(config, kind, layout, where)
    if traced is not None:  # a plan laid out from a shallow plan traced already, when that one can stand in
        trace = _laid_out(config, kind, layout, traced, where)
        if trace is not None:
            return trace
    found = _chunk_stand_in(config, layout, kind[2], where)
    if found is None or found[1] >= kind[2]:
        return None
    return _laid_out(config, kind, layout, found, where)


def _traced_plan_stand_in(config: ModelConfig, kind: tuple[bool, bool, int], layout: Policy | Plan,
                          where: tuple[Any, ...]) -> tuple[Plan, int, None] | None:
    """A shallow plan traced already for a chunk of the same kind (embedding, head) and a dense stack of the same
    config family, shallower than ``layout`` and with every layer role of it (e.g. a plan that differs from one
    traced before only where a run of layers ends): laid out, it gives the chunk's trace as its own shallowest
    stand-in does (NOTE [composing a deep step from a shallow trace] in remat.memory.compose); None when none is."""
    if not isinstance(layout, Plan) or any(s.mode == "offload" for s in layout.segments) or \
            layer_kinds(config.with_depth(kind[2])) is not None:
        return None
    need = role_set(layout, kind[2])
    config_kind = config_family(config)
    for (small_config, (first, last, depth), small, *rest), (_, traces, _) in reversed(_SHALLOW.items()):
        if tuple(rest) == where and (first, last) == kind[:2] and isinstance(small, Plan) and \
                small.engine == layout.engine and depth < kind[2] and config_family(small_config) == config_kind \
                and need <= traces[0].role_set:
            return small, depth, None
    return None


def _laid_out(config: ModelConfig, kind: tuple[bool, bool, int], layout: Policy | Plan,
              found: tuple[Policy | Plan, int, tuple[bool, ...] | None], where: tuple[Any, ...]) -> ChunkTrace | None:
    """The chunk trace laid out from the shallow chunk ``found`` (its layout, depth and MoE pattern), traced first
    when it is not kept yet; None when composition refuses it."""
    first, last, layers = kind
    device, tp, sp, batch_in_forward, _, kernels, drop_grads, fused_wgrad, delay_wgrad = where
    small_layout, depth, pattern = found
    small_config = config.with_depth(depth, pattern)
    key = (small_config, (first, last, depth), small_layout, *where)
    try:
        if key not in _SHALLOW:
            _keep_shallow(key, _trace_chunk(small_config, (first, last, depth), small_layout, device, tp, sp,
                                            batch_in_forward, kernels, drop_grads, fused_wgrad, delay_wgrad))
        shallow, traces, steps = _SHALLOW[key]
        kinds = layer_kinds(config.with_depth(layers))
        sources: list[list[int]] = [[], []]
        deep = [compose(traces[m], small_layout, layout, layers, kinds, sources=sources[m]) for m in (0, 1)]
        tl, bounds, kept = join_microbatches(deep, sources, shallow.timeline, shallow.bounds,
                                             [s.rows for s in steps], shallow.kept_rows, 0 if first else 1)
        n_inputs = sum(1 for e in shallow.timeline.alloc_at if e < shallow.bounds[0]) - len(shallow.params)
        n_params = sum(1 for e in tl.alloc_at if e < bounds[0]) - n_inputs
        trace = cut_chunk_trace(config, kind, layout, tl, bounds, n_params, kept, tl.meta["phase_flops"])
    except CompositionError:
        return None
    trace.batch_in_forward, trace.bounds, trace.kept_rows = shallow.batch_in_forward, tuple(bounds), tuple(kept)
    trace.composed_from = depth
    if batch_in_forward and first:  # the token ids are made in each forward (see _trace_chunk)
        trace.input_bytes, trace.input_category = shallow.input_bytes, shallow.input_category
    return trace


def _trace_chunk(config: ModelConfig, kind: tuple[bool, bool, int], policy: Policy | Plan, device: str, tp: int = 1,
                 sp: bool = False, batch_in_forward: bool = False, kernels: str = "cpu",
                 drop_grads: bool = False, fused_wgrad: bool = False, delay_wgrad: bool = False) -> ChunkTrace:
    if device not in ("cpu", "cuda"):
        raise PipelineError(f"device={device!r}: predict models 'cpu' (exact bytes) or 'cuda' (512-byte blocks)")
    first, last, layers = kind
    index = 0 if first else 1
    spec = ChunkSpec(index, index + (1 if last else 2), 0, layers)
    if layers:  # a chunk of no layers (only the embedding, or only the loss) has no layer to recompute
        policy.layer_groups(layers)  # refuses k > layers in the chunk, naming the depth
    # the kernel profile inside the fake mode and before the recorder (remat.memory.kernels.kernel_trace)
    with fake_tensor_mode(), kernel_trace(kernels):
        module = (build_stage_module(config, spec) if tp == 1 and not sp else
                  build_tp_stage_module(config, spec, SimulatedGroup(tp), sp, seed=None))
        shape = hidden_shape(config, tp, sp)  # [b*s/tp, h] token shards under SP, else [b, s, h]
        prepare_model(module, kernels)  # te: TE's fused attention / SwiGLU forwards, before the policy wraps them
        if layers:
            apply(module, policy)
        elif getattr(module, "mtp", None) is not None and getattr(policy, "granularity", "") != "full":
            # a chunk of MTP depths only (layout ...|mL): their layers run the selective modules and offloading
            apply(module, policy, layers=[depth.mtp_model_layer for depth in module.mtp])
        if fused_wgrad:  # the weight gradient goes into main_grad inside the GEMM: autograd makes none
            keep_fused_inputs(module)  # the linears still save their inputs (NOTE [gradient-accumulation fusion])
        if delay_wgrad:  # --delay-wgrad-compute (NOTE [delayed weight gradients])
            delay_wgrads(module)
        if drop_grads:  # Megatron's DDP hook (see trace_chunk); recomputation's inner backward runs it alike
            for p in module.parameters():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(_drop_grad)
        xs, ys, gs = [], [], []
        tokens, labels = empty_batch(config)  # fake, made in the fake mode; both microbatches read the same
        for _ in range(2):
            xs.append(tokens if first else torch.empty(*shape, dtype=config.torch_dtype).requires_grad_())
            ys.append(labels if last else None)
            gs.append(None if last else torch.empty(*shape, dtype=config.torch_dtype))
        recorder = PipelineRecorder(module, [module], block_bytes=CUDA_BLOCK if device == "cuda" else 1)
        bounds: list[int] = []
        outputs: list[torch.Tensor] = []
        grads: list[torch.Tensor | None] = []
        with gc_paused(collect=False), recorder:  # nothing made before the trace is recorded by it
            recorder.track_setup()
            n_params = len(recorder.timeline)
            given = ([] if batch_in_forward and first else xs) + ([] if batch_in_forward and last else ys) + gs
            recorder.track_setup([(f"input{i}", t) for i, t in enumerate(given)])
            bounds.append(recorder.timeline.num_events)
            for mb in range(2):
                recorder.begin_op("forward", spec, mb)
                x, y = xs[mb], ys[mb]
                if batch_in_forward:  # made here, then held only by the autograd graph (Megatron's get_batch)
                    x = torch.empty(x.shape, dtype=x.dtype) if first else x
                    y = torch.empty(y.shape, dtype=y.dtype) if last else y
                outputs.append(module(x, y))
                del x, y
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
            kept = [recorder.row_of(t.untyped_storage()) for t in outputs]
            kept += [None if g is None else recorder.row_of(g.untyped_storage()) for g in grads]
            del outputs, grads
        recorder.categorize(None)
    tl = recorder.timeline
    tl.meta["phase_flops"] = recorder.phase_flops
    bounds.append(tl.num_events)
    trace = cut_chunk_trace(config, kind, policy, tl, bounds, n_params, kept, recorder.phase_flops,
                            recorder.host_events, recorder.offload_marks)
    trace.batch_in_forward, trace.bounds, trace.kept_rows = batch_in_forward, tuple(bounds), tuple(kept)
    if batch_in_forward and first:  # no token ids among the setup inputs: one microbatch's, made in its forward
        trace.input_bytes = round_up(tokens.nbytes, recorder.block_bytes)
        trace.input_category = "other"
    return trace


def _drop_grad(param: torch.Tensor) -> None:
    param.grad = None


def cut_chunk_trace(config: ModelConfig, kind: tuple[bool, bool, int], policy: Policy, tl: Timeline,
                    bounds: Sequence[int], n_params: int, kept: Sequence[int | None], flops: Sequence[int],
                    host_events: Sequence[tuple[int, int, str, int]] = (),
                    marks: Sequence[tuple[int, str, str, int, tuple[str, int] | None]] = ()) -> ChunkTrace:
    """The :class:`ChunkTrace` of chunk trace ``tl`` (its first ``n_params`` rows the parameters, the next the
    chunk's input; ``bounds`` as :attr:`ChunkTrace.bounds`; ``kept`` its rows of the outputs and input gradients of
    microbatch 0 and 1, None where there is none; ``flops`` per phase), cut into segments.

    Raises:
        CompositionError: a segment frees what another microbatch made (each frees only what its own microbatch
            made, a backward also its forward's), something but a kept tensor is made or freed after the last
            backward, the two forwards differ, or the host bytes fine-grained offloading moves (``host_events``,
            :class:`PipelineRecorder`) do not go out in a microbatch's forward and come back in its backward."""
    setup_end, f0, f1, b0, b1, end = bounds
    spans = [(setup_end, f0), (f0, f1), (f1, b0), (b0, b1)]
    names = ("forward", "forward", "backward", "backward")
    mb_of = [0, 1, 0, 1]  # forward 0, forward 1, backward 0, backward 1
    # (as arrays: a chunk trace has tens of thousands of events, each one row's allocation or free)
    alloc, free = np.asarray(tl.alloc_at, np.int64), np.asarray(tl.free_at, np.int64)
    where = np.searchsorted(np.asarray([setup_end, f0, f1, b0, b1]), alloc, side="right") - 1  # -1: setup
    by_alloc = np.argsort(alloc, kind="stable")
    by_free = np.argsort(free, kind="stable")
    ordinal = np.arange(len(alloc), dtype=np.int64)  # a setup row's ordinal is its row; a segment's, its place
    segments: list[TraceSegment] = []
    for index, (lo, hi) in enumerate(spans):
        seg = TraceSegment(num_events=hi - lo)
        for p, phase in enumerate(tl.phases):
            end_p = tl.phases[p + 1].start if p + 1 < len(tl.phases) else tl.num_events
            if end_p > lo and phase.start < hi:
                seg.phases.append((max(0, phase.start - lo), phase.kind, phase.region, phase.detail,
                                   flops[p] if phase.start >= lo else 0))
        made = by_alloc[where[by_alloc] == index]  # the rows it allocates, in order
        ordinal[made] = np.arange(len(made))
        rows = made.tolist()
        seg.nbytes = [tl.nbytes[r] for r in rows]
        seg.category = [tl.category[r] for r in rows]
        seg.module = [tl.module[r] for r in rows]
        seg.alloc_offsets = (alloc[made] - lo).tolist()
        # each free releases a tensor of its own segment, or of the forward of its own microbatch (a backward's)
        freed = by_free[(free[by_free] >= lo) & (free[by_free] < hi)]
        own = where[freed] == index
        bad = ~own & ~((index >= 2) & (where[freed] == index - 2))
        if bad.any():
            was = int(where[freed[bad.nonzero()[0][0]]])
            name = "setup" if was < 0 else f"{names[was]} of microbatch {mb_of[was]}"
            raise CompositionError(f"chunk trace {kind} under {policy}: a free in the {names[index]} of microbatch "
                                   f"{mb_of[index]} releases a tensor of the {name}; a microbatch's steps can "
                                   "only be copied when they free their own tensors")
        seg.frees = list(zip((free[freed] - lo).tolist(), ["self" if o else "F" for o in own.tolist()],
                             ordinal[freed].tolist(), [tl.nbytes[r] for r in freed.tolist()]))
        segments.append(seg)
    # what the step still holds at its end are the kept outputs / input gradients (released by the runtime)
    late = sorted([(int(alloc[r]), True, r) for r in (alloc >= b1).nonzero()[0].tolist()] +
                  [(int(free[r]), False, r) for r in (free >= b1).nonzero()[0].tolist() if r not in kept])
    if late:
        _, is_alloc, row = late[0]
        raise CompositionError(f"chunk trace {kind} under {policy}: {tl.module[row]} "
                               f"({tl.nbytes[row]} bytes) is {'made' if is_alloc else 'freed'} after the "
                               "last backward; only the kept outputs and input gradients should be")
    forward0, forward1, backward0, backward1 = segments
    for event, delta, module, layer in host_events:
        # a host change recorded at event e holds from e on: it belongs to the segment whose events end at e - 1
        index = next((i for i, (lo, hi) in enumerate(spans) if lo < event <= hi), None)
        if index is None or (delta > 0) != (index < 2):
            raise CompositionError(f"chunk trace {kind} under {policy}: {abs(delta)} bytes of {module} move "
                                   f"{'to' if delta > 0 else 'from'} the host at event {event}, outside a forward "
                                   "(offload) or backward (reload) of a microbatch")
        segments[index].host.append((event - spans[index][0], delta, module, layer))
    for event, what, module, layer, op in marks:  # each in the forward or backward that made it
        if op is not None:
            index = ("forward", "backward").index(op[0]) * 2 + op[1]
            lo, hi = spans[index]
            segments[index].marks.append((min(max(event, lo), hi) - lo, what, module, layer))
    for fwd, bwd in ((forward0, backward0), (forward1, backward1)):
        if sum(h[1] for h in fwd.host) + sum(h[1] for h in bwd.host) != 0:
            raise CompositionError(f"chunk trace {kind} under {policy}: a microbatch's backward does not bring back "
                                   "every byte its forward offloaded")
    for seg, row in ((forward0, kept[0]), (forward1, kept[1]), (backward0, kept[2]), (backward1, kept[3])):
        if row is not None:
            seg.keep = int(ordinal[row])
    if forward0.signature() != forward1.signature():
        raise CompositionError(f"chunk trace {kind} under {policy}: the second microbatch's forward does not repeat "
                               "the first one's events, so forwards cannot be copied per microbatch")
    params = [(tl.nbytes[r], tl.module[r], tl.category[r]) for r in range(n_params)]
    input_bytes = tl.nbytes[n_params]
    out_row = kept[0]
    return ChunkTrace(kind, policy, params, forward0, backward0, backward1, input_bytes, tl.category[n_params],
                      tl.nbytes[out_row] if out_row is not None else 0, tl)
