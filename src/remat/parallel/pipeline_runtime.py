"""What each pipeline runtime (torch.distributed.pipelining, Megatron) allocates and frees, action by action."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from remat.config import ModelConfig
from remat.memory.compose import CompositionError
from remat.parallel.chunk_trace import ChunkTrace, TraceSegment
from remat.parallel.composer import Composer, Part
from remat.parallel.schedule import Action, ChunkSpec, warmup_forwards
from remat.parallel.stages import phase_detail
from remat.units import round_up


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
    # (chunk, microbatch) -> the key of the trace its forward and backward copy: True (the policy), False (no
    # recompute: Megatron's partial checkpointing), or the offload modules whose last group that forward offloads
    # too (Megatron's fine-grained offloading, remat.parallel.schedule.offload_last_groups)
    trace_keys: dict[tuple[int, int], Hashable]
    traces: dict[tuple[int, Hashable], ChunkTrace]  # (chunk, trace key) -> trace

    def prefix(self, spec: ChunkSpec) -> str:
        return "" if len(self.chunks) == 1 else f"chunk{spec.index}."

    def batch_tensors(self, spec: ChunkSpec) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
        """What Megatron's ``get_batch`` puts on the device for a forward step of ``spec`` beyond what the traces
        make, as (name, bytes): held through the forward step, and held to the micro-batch's backward (NOTE
        [Megatron's batch on the device]). None here: a Megatron job's plan has them."""
        return [], []

    def spec(self, chunk: int) -> ChunkSpec:
        return next(s for s in self.chunks if s.index == chunk)

    def trace(self, a: Action) -> ChunkTrace:
        return self.traces[(a.chunk, self.trace_keys[(a.chunk, a.microbatch)])]

    @property
    def activation_bytes(self) -> int:
        c = self.config
        return round_up(c.micro_batch_size * c.seq_length * c.hidden_size * c.torch_dtype.itemsize,
                              self.block)

    block: int = 1
    group: int | None = None  # Megatron's microbatch group size of the interleaved schedule (None: pp)
    combined: bool = False  # Megatron's combined 1F1B steps (NOTE [the combined 1F1B schedule] in parallel.composer)


def stage_setup(plan: StagePlan, composer: Composer) -> None:
    composer.phase("setup", "")
    for spec in plan.chunks:
        # every trace of a chunk holds the same parameters
        trace = next(t for (c, _), t in plan.traces.items() if c == spec.index)
        for nbytes, module, category in trace.params:
            composer.alloc(("param", spec.index, len(composer.keys)), nbytes, plan.prefix(spec) + module, category)
    if plan.runtime == "torch":
        m = plan.microbatches
        for spec in plan.chunks:
            for mb in range(m):
                if not spec.is_first:  # the chunk's input: a checkpoint input when the first group keeps it
                    category = plan.traces[(spec.index, plan.trace_keys[(spec.index, mb)])].input_category
                    composer.alloc(("recv_act", spec.index, mb), plan.activation_bytes,
                                   f"pipeline.stage{spec.index}.recv_activation", category)
            for mb in range(m):
                if not spec.is_last:
                    composer.alloc(("recv_grad", spec.index, mb), plan.activation_bytes,
                                   f"pipeline.stage{spec.index}.recv_grad")
        if any(s.is_first for s in plan.chunks):
            composer.alloc(("batch", "tokens"), round_up(m * plan.config.micro_batch_size *
                                                               plan.config.seq_length * 8, plan.block), "tokens")
        if any(s.is_last for s in plan.chunks):
            composer.alloc(("batch", "labels"), round_up(m * plan.config.micro_batch_size *
                                                               plan.config.seq_length * 8, plan.block), "labels")
    # parameters, buffers and what exists before the step never leave: drop their keys
    composer.keys.clear()


def _forward_part(plan: StagePlan, a: Action) -> Part:
    """What a forward copies (:class:`remat.parallel.composer.Part`); its kept output's key is the last item."""
    spec = plan.spec(a.chunk)
    return plan.trace(a).forward, spec, a.microbatch, plan.prefix(spec), "F", ("out", a.chunk, a.microbatch)


def _backward_part(plan: StagePlan, a: Action, first_backward: set[int]) -> Part:
    """What a backward copies; its input gradient's key (None on the first chunk) is the last item."""
    spec = plan.spec(a.chunk)
    trace = plan.trace(a)
    seg = trace.backward_next if a.chunk in first_backward else trace.backward_first
    first_backward.add(a.chunk)
    key = None if spec.is_first else ("igrad", a.chunk, a.microbatch)
    return seg, spec, a.microbatch, plan.prefix(spec), "B", key


# NOTE [Megatron's batch on the device]
# pretrain_gpt.py ``get_batch`` (Megatron-LM d98e8a64, :110-190) moves each micro-batch to the GPU inside its forward
# step, on the chunks holding the embedding or the loss only (``is_first_or_last_pipeline_stage``); megatron/core/
# utils.py ``get_batch_on_this_tp_rank`` (2167-2420) keeps, on every tensor-parallel rank, the token ids, position ids
# and the attention mask on the first stage, the labels, loss mask and attention mask on the last, all five with
# pp = 1 or MTP on the rank; ``get_batch_on_this_cp_rank`` cuts each to this rank's s / cp tokens (the mask along its
# query dimension). The chunk traces make the token ids and labels (``batch_in_forward``) and the layers' own causal
# mask [1, 1, s / cp, s / cp] (remat.models.tp_stage.chunk_forward), which stands in for part of the dataloader's; the
# runtime adds the rest: the dataloader's mask bool [b, 1, s / cp, s] beyond the layers' own (unless
# ``--no-create-attention-mask-in-dataloader``: GPTDatasetConfig.create_attention_mask, arguments.py:3334; b = 1 and
# cp = 1: nothing beyond it) and the position ids int64 [b, s / cp], held by
# ``forward_step``'s locals until it returns (TE's attention under a causal mask type reads no mask; remat's learned
# position embedding saves its own [s] indices), and the loss mask fp32 [b, s / cp], which the loss function's
# multiply keeps to the micro-batch's backward (pretrain_gpt.py ``loss_func``). Where the chunk's layers are
# recomputed in groups, or their core attention is, the mask is an argument Megatron's checkpoints save
# (``CheckpointFunction.save_for_backward(*args)``, tensor_parallel/random.py; attention.py
# ``_checkpointed_attention_forward``): it then lives to the micro-batch's backward, as the layers' own mask does in
# the trace (remat.parallel.stages.keeps_layer_inputs), and is freed after it (Megatron frees it with the bottom
# group's checkpoint: the first stage's embedding backward is the over-count). remat.parallel.megatron_rank makes
# the same tensors in its forward step. Over-counted: the layers' own mask on a middle chunk, or where the dataloader
# makes none, which Megatron's TE layers do without (s^2 / cp^2 bytes during a forward, to the backward under
# recompute: 64 MiB at s = 8,192).
def _batch_in(plan: StagePlan, composer: Composer, a: Action) -> None:
    """Allocate what ``get_batch`` adds for forward ``a`` (NOTE [Megatron's batch on the device])."""
    step, kept = plan.batch_tensors(plan.spec(a.chunk))
    for name, nbytes in step + kept:
        composer.alloc(("batch", name, a.chunk, a.microbatch), round_up(nbytes, plan.block), f"batch.{name}")


def _batch_out(plan: StagePlan, composer: Composer, a: Action) -> None:
    """Free, after forward ``a``, what its forward step held; after backward ``a``, what the loss kept to it."""
    step, kept = plan.batch_tensors(plan.spec(a.chunk))
    for name, _ in step if a.kind == "F" else kept:
        composer.free(("batch", name, a.chunk, a.microbatch))


def _forward(plan: StagePlan, composer: Composer, a: Action) -> tuple[str, int, int]:
    part = _forward_part(plan, a)
    composer.segment(*part)
    composer.phase("setup", "pipeline")
    return part[-1]


def _backward(plan: StagePlan, composer: Composer, a: Action, first_backward: set[int]) -> Any:
    part = _backward_part(plan, a, first_backward)
    composer.segment(*part)
    composer.phase("setup", "pipeline")
    return part[-1]


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
    composer.next_backward = _next_backwards(plan).get  # NOTE [re-timing reloads] in remat.parallel.composer
    if plan.vpp > 1 or plan.combined:
        _megatron_by_action(plan, composer)
    else:
        _MegatronSchedule(plan, composer).run()


def _next_backwards(plan: StagePlan) -> dict[tuple[int, int], tuple[tuple[int, int], TraceSegment] | None]:
    """(chunk, microbatch) of each backward -> the next backward whose chunk opens offload groups (Megatron's
    front_backward_chunk skips the empty handlers) and the segment it copies (as :func:`_backward_part` picks it)."""
    seen: set[int] = set()
    order: list[tuple[tuple[int, int], TraceSegment]] = []
    for a in plan.actions:
        if a.kind == "B":
            trace = plan.trace(a)
            order.append(((a.chunk, a.microbatch), trace.backward_next if a.chunk in seen else trace.backward_first))
            seen.add(a.chunk)
    out: dict[tuple[int, int], tuple[tuple[int, int], TraceSegment] | None] = {}
    after: tuple[tuple[int, int], TraceSegment] | None = None
    for key, seg in reversed(order):
        out[key] = after
        if any(kind == "start" for _, kind, _, _ in seg.marks):
            after = (key, seg)
    return out


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
        composer.alloc(("total_num_tokens", c), round_up(4, plan.block), "pipeline.total_num_tokens")
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
            category = plan.traces[(self.c, plan.trace_keys[(self.c, mb)])].input_category
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
        _batch_in(plan, self.composer, Action("F", c, mb))
        self.composer.segment(trace.forward, spec, mb, plan.prefix(spec), "F", keep_key=out)
        _batch_out(plan, self.composer, Action("F", c, mb))
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
        one = plan.trace(Action("F", c, mb)).output_bytes if self.spec.is_last else round_up(
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
        _batch_out(self.plan, self.composer, Action("B", self.c, mb))
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
    lives through its backward, an input gradient is freed once sent; the losses are kept until the step ends. A
    chunk's latest input and its gradient stay until the chunk's next forward (NOTE [the model's last input]).
    With ``plan.combined`` each forward followed by a backward runs with it as one combined 1F1B step (NOTE [the
    combined 1F1B schedule] in :mod:`remat.parallel.composer`)."""
    first_backward: set[int] = set()
    act, actions = plan.activation_bytes, plan.actions
    composer.phase("setup", "pipeline")
    tokens = ("total_num_tokens", plan.rank)  # the schedule's token counter, alive until it returns
    composer.alloc(tokens, round_up(4, plan.block), "pipeline.total_num_tokens")
    # NOTE [the model's last input]: each chunk's model keeps the input of its latest forward (set_input_tensor,
    # schedules.py:506-507 and combined_1f1b.py:372-373 -> transformer_block.py:455-463 ``self.input_tensor``) and
    # with it that input's ``.grad`` (backward_step's retain_grad, schedules.py:561, 591; combined_1f1b.py:421, 504),
    # so a received input and its gradient outlive the backward until the chunk's next forward: the last ones
    # outlive the step (the resident state after it), the previous step's are held until the first forward
    held: dict[int, int] = {}  # chunk -> the microbatch whose input its model holds (-1: the previous step's)
    finished: set[tuple[int, int]] = set()  # (chunk, microbatch) whose backward has run
    for spec in plan.chunks:
        if not spec.is_first:
            held[spec.index] = -1
            composer.alloc(("recv_act", (spec.index, -1)), act, f"pipeline.stage{spec.index}.recv_activation",
                           plan.trace(Action("F", spec.index, plan.microbatches - 1)).input_category)
            composer.alloc(("igrad", spec.index, -1), act, f"pipeline.stage{spec.index}.input_grad")
            finished.add((spec.index, -1))
    k = 0
    while k < len(actions):
        a = actions[k]
        # a forward runs beside the backward after it, never its own microbatch's: with pp = 1 the last forward
        # runs alone and so does the last backward (combined_1f1b.py:77-135; one microbatch: F0 then B0)
        pair = [a, actions[k + 1]] if plan.combined and a.kind == "F" and k + 1 < len(actions) and \
            actions[k + 1].kind == "B" and (actions[k + 1].chunk, actions[k + 1].microbatch) != \
            (a.chunk, a.microbatch) else [a]
        k += len(pair)
        composer.phase("setup", "pipeline", phase_detail(a.microbatch, a.chunk))
        for x in pair:  # what is received before the step
            spec, mb = plan.spec(x.chunk), (x.chunk, x.microbatch)
            if x.kind == "F" and not spec.is_first:
                composer.alloc(("recv_act", mb), act, f"pipeline.stage{spec.index}.recv_activation",
                               plan.trace(x).input_category)
            elif x.kind == "B" and not spec.is_last:
                composer.alloc(("recv_grad", mb), act, f"pipeline.stage{spec.index}.recv_grad")
        for x in pair:  # set_input_tensor: the model lets go of its previous input (once its backward has run)
            if x.kind == "F" and x.chunk in held:
                old, held[x.chunk] = (x.chunk, held[x.chunk]), x.microbatch
                if old in finished:
                    composer.free(("recv_act", old))
                    composer.free(("igrad", *old))
        parts = [_forward_part(plan, x) if x.kind == "F" else _backward_part(plan, x, first_backward) for x in pair]
        for x in pair:
            if x.kind == "F":
                _batch_in(plan, composer, x)
        if len(parts) == 2:
            composer.combined(parts[0], parts[1])
        else:
            composer.segment(*parts[0])
        composer.phase("setup", "pipeline")
        for x in pair:
            _batch_out(plan, composer, x)
        for x, part in zip(pair, parts):
            spec, mb = plan.spec(x.chunk), (x.chunk, x.microbatch)
            if x.kind == "F":
                if not spec.is_last:
                    composer.free(part[-1])  # sent, then deallocated
                else:  # forward_data_store: the loss reported for logging, kept until the step ends
                    composer.alloc(("loss_copy", *mb), plan.trace(x).output_bytes, "pipeline.forward_data_store")
            else:
                finished.add(mb)
                kept = held.get(x.chunk) == x.microbatch  # the model still holds it, and its grad
                for key in (("recv_grad", mb),) if kept else (part[-1], ("recv_grad", mb), ("recv_act", mb)):
                    composer.free(key)
    composer.phase("setup", "pipeline")
    for key in [key for key in composer.keys if key[0] in ("out", "loss_copy")] + [tokens]:
        composer.free(key)
