"""What each pipeline runtime (torch.distributed.pipelining, Megatron) allocates and frees, action by action."""

from __future__ import annotations

import bisect
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from remat.config import ModelConfig
from remat.memory.compose import CompositionError
from remat.parallel.chunk_trace import ChunkTrace, TraceSegment
from remat.parallel.schedule import Action, ChunkSpec, warmup_forwards
from remat.parallel.stages import parse_phase_detail, phase_detail
from remat.timeline import Phase, Timeline


class Composer:
    """Builds a stage timeline: synthesized allocations/frees and copied chunk-trace segments."""

    def __init__(self) -> None:
        self.tl = Timeline()
        self.flops: list[int] = []
        self.keys: dict[Any, int] = {}  # runtime-held tensors -> row
        self.forward_rows: dict[tuple[int, int], tuple[Sequence[int], TraceSegment]] = {}
        # fine-grained offloading: [event, host bytes from that event on], and what each module / layer offloaded
        self.host_series: list[list[int]] = []
        self.offloaded: dict[str, int] = {}
        self.offloaded_by_layer: dict[str, int] = {}

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

    def segment(self, seg: TraceSegment, spec: ChunkSpec, microbatch: int, prefix: str, kind: str,
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
        # one row per allocation of the segment, appended column by column (as _row appends them one by one)
        rows = range(len(tl.nbytes), len(tl.nbytes) + len(seg.nbytes))
        tl.nbytes.extend(seg.nbytes)
        tl.alloc_at.extend([base + offset for offset in seg.alloc_offsets])
        tl.free_at.extend([-1] * len(rows))
        tl.phase_index.extend([phase_ids[max(0, bisect.bisect_right(phase_starts, offset) - 1)]
                               for offset in seg.alloc_offsets])
        tl.module.extend([prefix + module for module in seg.module])
        tl.category.extend(seg.category)
        if kind == "F":
            self.forward_rows[(spec.index, microbatch)] = (rows, seg)
            source: tuple[Sequence[int], TraceSegment] | None = None
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
        for offset, delta, module, layer in seg.host:  # every microbatch in flight holds its own offloaded bytes
            held = (self.host_series[-1][1] if self.host_series else 0) + delta
            self.host_series.append([base + offset, held])
            if delta > 0:
                self.offloaded[module] = self.offloaded.get(module, 0) + delta
                where = str(layer + spec.layer_offset)
                self.offloaded_by_layer[where] = self.offloaded_by_layer.get(where, 0) + delta
        tl.num_events += seg.num_events

    def finish(self, meta: dict[str, Any]) -> Timeline:
        tl = self.tl
        tl.meta.update(meta)
        tl.meta["phase_flops"] = self.flops
        flops: dict[str, int] = {}
        for phase, amount in zip(tl.phases, self.flops):
            flops[phase.kind] = flops.get(phase.kind, 0) + amount
        tl.meta["flops"] = flops
        if self.host_series:  # the keys remat.memory.measure.measure writes; layers by global index
            tl.meta["host_memory"] = {"peak_bytes": max(b for _, b in self.host_series),
                                      "offloaded_bytes": self.offloaded, "offloaded_bytes_by_layer":
                                      self.offloaded_by_layer, "series": self.host_series}
        tl.validate()
        return tl


def _parse_inner(detail: str) -> str:
    """A chunk-trace phase detail without its 'microbatch i, chunk g' prefix."""
    if parse_phase_detail(detail) is None:
        return detail
    _, _, inner = detail.partition(": ")
    return inner


class Holders:
    """References that keep runtime tensors alive; a tensor is freed when its last holder lets go (the way
    CPython frees it when the last reference goes). A held key may be a holder itself (an object that references
    tensors: an output tensor holds its autograd graph, the graph holds the received input, the input holds its
    ``.grad``); when its last holder lets go, it lets go of what it holds."""

    def __init__(self, composer: Composer):
        self.composer = composer
        self.held: dict[Any, list[Any]] = defaultdict(list)
        self.count: Counter[Any] = Counter()

    def set(self, holder: Any, keys: Sequence[Any]) -> None:
        """``holder = keys`` (a variable reassigned: its old values are released after the new ones are held)."""
        old = self.held.pop(holder, [])
        self.held[holder] = [k for k in keys if k is not None]
        for k in self.held[holder]:
            self.count[k] += 1
        self._drop(old)

    def add(self, holder: Any, key: Any) -> None:
        if key is not None:
            self.held[holder].append(key)
            self.count[key] += 1

    def pop_into(self, holder: str, source: str) -> None:
        """``holder = source.pop(0)`` (the reference moves from the list to the variable)."""
        key = self.held[source].pop(0)
        old = self.held.pop(holder, [])
        self.held[holder] = [key]
        self._drop(old)

    def release(self, holder: Any, reverse: bool = False) -> None:
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
                if k in self.held:
                    self.release(k)


# ------------------------------------------------------------------------------------------------ predict


# ------------------------------------------------------------------------------------------------ runtimes
@dataclass
class StagePlan:
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

    block: int = 1
    group: int | None = None  # Megatron's microbatch group size of the interleaved schedule (None: pp)


def _storage_bytes(nbytes: int, block: int) -> int:
    return -(-nbytes // block) * block


def stage_setup(plan: StagePlan, composer: Composer) -> None:
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


def _forward(plan: StagePlan, composer: Composer, a: Action) -> tuple[str, int, int]:
    spec = plan.spec(a.chunk)
    key = ("out", a.chunk, a.microbatch)
    composer.segment(plan.trace(a).forward, spec, a.microbatch, plan.prefix(spec), "F", keep_key=key)
    composer.phase("setup", "pipeline")
    return key


def _backward(plan: StagePlan, composer: Composer, a: Action, first_backward: set[int]) -> Any:
    spec = plan.spec(a.chunk)
    trace = plan.trace(a)
    seg = trace.backward_next if a.chunk in first_backward else trace.backward_first
    first_backward.add(a.chunk)
    key = None if spec.is_first else ("igrad", a.chunk, a.microbatch)
    composer.segment(seg, spec, a.microbatch, plan.prefix(spec), "B", keep_key=key)
    composer.phase("setup", "pipeline")
    return key


def torch_runtime(plan: StagePlan, composer: Composer) -> None:
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
    h = Holders(composer)
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


# NOTE [Megatron's schedule variables]
# Megatron-LM's schedules (megatron/core/pipeline_parallel/schedules.py) keep a microbatch's tensors alive through
# the schedule function's variables and lists, and through the autograd graph, not just until its backward ends:
# * a stage output is "deallocated" once sent (deallocate_output_tensor: ``.data`` replaced by a 1-element
#   placeholder), but the tensor object stays in ``output_tensors`` until its backward and then in the
#   ``output_tensor`` variable until the next forward returns; it holds the placeholder and its autograd graph,
#   whose AccumulateGrad node holds the received input, which holds its ``.grad`` (the input gradient);
# * ``input_tensor_grad`` holds the input gradient until the next backward returns, ``output_tensor_grad`` the
#   received output gradient until the next one is received, ``input_tensor`` the received input until the next
#   receive (or the pop before a backward);
# * each microbatch's token ids / labels are made inside its forward step (get_batch) and live as long as the
#   graph keeps them: the chunk traces say when (trace_chunk(batch_in_forward=True));
# * the last stage keeps what each forward reports for logging (forward_data_store; a copy of the loss here).
# megatron_runtime follows forward_backward_pipelining_without_interleaving (and _no_pipelining with pp = 1) line
# by line with these references, as remat.parallel.megatron_rank runs it for real (tests/parallel/
# test_job_measure.py checks every rank to the byte). The interleaved schedule keeps per-chunk lists and receives
# one step ahead; it is laid out action by action (_megatron_by_action), not checked against a real run.
def megatron_runtime(plan: StagePlan, composer: Composer) -> None:
    """Lay out a rank's step as Megatron-LM runs it (see NOTE [Megatron's schedule variables])."""
    for spec in plan.chunks:
        for (chunk, _), trace in plan.traces.items():
            if chunk == spec.index and (spec.is_first or spec.is_last) and not trace.batch_in_forward:
                raise CompositionError(f"chunk {chunk}: runtime='megatron' makes each microbatch's token ids / "
                                       "labels inside its forward; trace the chunk with "
                                       "trace_chunk(..., batch_in_forward=True)")
    if plan.vpp > 1:
        _megatron_by_action(plan, composer)
    else:
        _MegatronSchedule(plan, composer).run()


class _MegatronSchedule:
    """Megatron's non-interleaved schedules on one chunk, with the references its variables hold."""

    def __init__(self, plan: StagePlan, composer: Composer):
        self.plan, self.composer, self.h = plan, composer, Holders(composer)
        (self.spec,) = plan.chunks
        self.c = self.spec.index
        self.first_backward: set[int] = set()

    def run(self) -> None:
        plan, h, composer, c = self.plan, self.h, self.composer, self.c
        composer.phase("setup", "pipeline")
        if not self.spec.is_first:  # the model's input tensor (set_input_tensor) is the last step's, with its grad
            composer.alloc(("recv_act", c, -1), plan.activation_bytes, f"pipeline.stage{c}.recv_activation",
                           plan.trace(Action("F", c, plan.microbatches - 1)).input_category)
            composer.alloc(("igrad", c, -1), plan.activation_bytes, f"pipeline.stage{c}.input_grad")
            h.add(("recv_act", c, -1), ("igrad", c, -1))
            h.set("model.input_tensor", [("recv_act", c, -1)])
        composer.alloc(("total_num_tokens", c), _storage_bytes(4, plan.block), "pipeline.total_num_tokens")
        h.set("total_num_tokens", [("total_num_tokens", c)])
        if plan.pp == 1 and plan.schedule == "1f1b":
            self.no_pipelining()
        else:
            self.one_f_one_b(warmup_forwards(plan.schedule, plan.pp, plan.microbatches, 1, plan.rank, "megatron"))
        composer.phase("setup", "pipeline")
        h.release("forward_data_store")  # returned to the caller; dropped once the step is done
        # the model keeps the last input (and its grad) until the next step's first forward

    def receive(self, kind: str, mb: int) -> tuple[str, int, int]:
        """p2p_communication: every receive is a fresh tensor (none where the stage has no neighbour)."""
        key = (kind, self.c, mb)
        spec, plan = self.spec, self.plan
        if kind == "recv_act" and not spec.is_first:
            self.composer.phase("setup", "pipeline", phase_detail(mb, self.c))
            category = plan.traces[(self.c, plan.checkpointed[(self.c, mb)])].input_category
            self.composer.alloc(key, plan.activation_bytes, f"pipeline.stage{self.c}.recv_activation", category)
        elif kind == "recv_grad" and not spec.is_last:
            self.composer.phase("setup", "pipeline", phase_detail(mb, self.c))
            self.composer.alloc(key, plan.activation_bytes, f"pipeline.stage{self.c}.recv_grad")
        return key

    def forward(self, mb: int) -> tuple[str, int, int]:
        """forward_step: the chunk's forward; returns the output tensor object (output storage + graph)."""
        plan, h, spec, c = self.plan, self.h, self.spec, self.c
        trace = plan.trace(Action("F", c, mb))
        out, graph, output = ("out", c, mb), ("graph", c, mb), ("output", c, mb)
        h.set("model.input_tensor", [("recv_act", c, mb)])  # set_input_tensor: the model keeps it
        self.composer.segment(trace.forward, spec, mb, plan.prefix(spec), "F", keep_key=out)
        h.set(graph, [("recv_act", c, mb)])  # the AccumulateGrad node of the received input
        h.set(output, [out, graph])
        if spec.is_last:  # forward_data_store: what the loss function reports
            self.composer.alloc(("loss_copy", c, mb), trace.output_bytes, "pipeline.forward_data_store")
            h.add("forward_data_store", ("loss_copy", c, mb))
        self.composer.phase("setup", "pipeline")
        return output

    def deallocate(self, mb: int) -> None:
        """deallocate_output_tensor: the output's storage becomes a 1-element placeholder (the loss is one)."""
        c, plan = self.c, self.plan
        one = plan.trace(Action("F", c, mb)).output_bytes if self.spec.is_last else _storage_bytes(
            plan.config.torch_dtype.itemsize, plan.block)
        self.composer.alloc(("placeholder", c, mb), one, "pipeline.output_placeholder")
        self.h.set(("output", c, mb), [("placeholder", c, mb), ("graph", c, mb)])

    def backward(self, mb: int, deallocated: bool = True) -> tuple[str, int, int]:
        """backward_step: the chunk's backward; the input gradient becomes the received input's ``.grad``."""
        reshaped = ("loss_grad", self.c, mb)
        if self.spec.is_last and deallocated:  # the engine sums the placeholder's ones to the 0-dim loss's shape
            self.composer.alloc(reshaped, self.plan.trace(Action("B", self.c, mb)).output_bytes, "head")
        grad = _backward(self.plan, self.composer, Action("B", self.c, mb), self.first_backward)
        self.composer.free(reshaped)
        key = ("igrad", self.c, mb)
        if grad is not None:
            self.h.add(("recv_act", self.c, mb), key)
        return key

    def no_pipelining(self) -> None:
        """forward_backward_no_pipelining: forward, backward, ``del output_tensor``, microbatch by microbatch."""
        h = self.h
        for i in range(self.plan.microbatches):
            h.set("output_tensor", [self.forward(i)])
            self.backward(i, deallocated=False)
            h.release("output_tensor")
        self.composer.phase("setup", "pipeline")
        h.release("total_num_tokens")

    def one_f_one_b(self, warmup: int) -> None:
        """forward_backward_pipelining_without_interleaving, line by line."""
        h, m = self.h, self.plan.microbatches
        remaining = m - warmup
        for i in range(warmup):
            h.set("input_tensor", [self.receive("recv_act", i)])
            h.set("output_tensor", [self.forward(i)])
            h.add("input_tensors", h.held["input_tensor"][0])
            h.add("output_tensors", ("output", self.c, i))
            self.deallocate(i)
        if remaining > 0:
            h.set("input_tensor", [self.receive("recv_act", warmup)])
        for i in range(remaining):
            f = i + warmup
            h.set("output_tensor", [self.forward(f)])
            h.set("output_tensor_grad", [self.receive("recv_grad", i)])
            h.add("input_tensors", h.held["input_tensor"][0])
            h.add("output_tensors", ("output", self.c, f))
            self.deallocate(f)
            h.pop_into("input_tensor", "input_tensors")
            h.pop_into("output_tensor", "output_tensors")
            h.set("input_tensor_grad", [self.backward(i)])
            h.set("input_tensor", [] if i == remaining - 1 else [self.receive("recv_act", f + 1)])
        for i in range(warmup):
            h.pop_into("input_tensor", "input_tensors")
            h.pop_into("output_tensor", "output_tensors")
            h.set("output_tensor_grad", [self.receive("recv_grad", remaining + i)])
            h.set("input_tensor_grad", [self.backward(remaining + i)])
        self.composer.phase("setup", "pipeline")
        # the function returns: its locals go in the order they were first assigned
        for holder in ("input_tensors", "output_tensors", "total_num_tokens", "input_tensor", "output_tensor",
                       "output_tensor_grad", "input_tensor_grad"):
            h.release(holder)


def _megatron_by_action(plan: StagePlan, composer: Composer) -> None:
    """The interleaved schedule, action by action: a received activation is a fresh tensor from just before the
    forward until the microbatch's backward ends, a stage output is freed once sent, a received output gradient
    lives through its backward, an input gradient is freed once sent; the losses are kept until the step ends."""
    first_backward: set[int] = set()
    act = plan.activation_bytes
    for a in plan.actions:
        spec = plan.spec(a.chunk)
        mb = (a.chunk, a.microbatch)
        composer.phase("setup", "pipeline", phase_detail(a.microbatch, a.chunk))
        if a.kind == "F":
            if not spec.is_first:
                composer.alloc(("recv_act", mb), act, f"pipeline.stage{spec.index}.recv_activation",
                               plan.trace(a).input_category)
            key = _forward(plan, composer, a)
            if not spec.is_last:
                composer.free(key)  # sent, then deallocated
        else:
            if not spec.is_last:
                composer.alloc(("recv_grad", mb), act, f"pipeline.stage{spec.index}.recv_grad")
            key = _backward(plan, composer, a, first_backward)
            for k in (key, ("recv_grad", mb), ("recv_act", mb)):
                composer.free(k)
    composer.phase("setup", "pipeline")
    for k in [k for k in composer.keys if k[0] == "out"]:
        composer.free(k)
