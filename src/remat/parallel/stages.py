"""Pipeline stage modules cut from the reference GPT, and the recorder that labels their phases."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from remat.config import ModelConfig
from remat.memory.measure import StepRecorder
from remat.models.gpt import GPT, Embedding, LMHead, MTPLayer, TransformerLayer, build_model, building, rotary_tables
from remat.models.tp_stage import chunk_forward
from remat.parallel.schedule import ChunkSpec, PipelineError
from remat.policy import MOE_MODULES, Policy
from remat.recompute.apply import applied
from remat.recompute.plan_format import Plan, Segment, checkpoints_layer_inputs


class StageModule(nn.Module):
    """One model chunk of the reference GPT: [embedding] -> ``layers`` -> [final norm, output layer, loss].

    ``forward(x, labels=None)`` takes token ids (first chunk) or hidden states [b, s, h] and returns the hidden
    states, or the loss on the last chunk (which needs ``labels``). Like :class:`remat.models.gpt.GPT`, every chunk
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
            self.mtp = source.mtp if spec.is_last else None
            self.mtp_embedding = source.embedding if self.mtp is not None and not spec.is_first else None
        else:
            self.embedding = Embedding(config) if spec.is_first else None
            self.layers = nn.ModuleList(TransformerLayer(config, i) for i in span)
            self.head = LMHead(config) if spec.is_last else None
            if config.tie_embeddings and self.embedding is not None and self.head is not None:
                self.head.output_layer.weight = self.embedding.word_embeddings.weight
            mtp = spec.is_last and config.mtp_num_layers > 0  # NOTE [multi-token prediction] in remat.models.gpt
            self.mtp = nn.ModuleList(MTPLayer(config) for _ in range(config.mtp_num_layers)) if mtp else None
            self.mtp_embedding = Embedding(config) if mtp and self.embedding is None else None

    def rotary_tables(self, seq_length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        return rotary_tables(self.config, seq_length, device)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        return chunk_forward(self, x, labels, x.shape[1], PipelineError)  # x: token ids [b, s] or hidden [b, s, h]


def chunk_policy(policy: Policy | Any, config: ModelConfig, num_layers: int | None = None) -> Policy | Any:
    """The policy a model chunk of ``config`` (its own layers, :func:`remat.parallel.job_predict.chunk_config`) runs.

    Megatron's ``moe``, ``moe_act`` and ``shared_experts`` recompute modules act on MoE layers only; a chunk
    with none (DeepSeek's first dense layers on their own pipeline stage) runs the policy without them (nothing
    else changes; a selective policy left with no module recomputes nothing). Full recompute of K layers on a
    chunk of ``num_layers`` n < K (an uneven split) is what Megatron's ``_checkpointed_forward`` runs there:
    uniform groups end at the chunk's end (one group of n), block checkpoints its first min(K, n) layers, so
    ``full/uniform/n`` / ``full/block/n``. A :class:`~remat.recompute.plan_format.Plan` of a deeper chunk (remat
    plan's per-stage plan of the stage's deepest chunk) runs its first n layers, a group cut at the chunk's end as
    Megatron's uniform groups are (:func:`cut_plan`). Anything else is returned as is.
    """
    if isinstance(policy, Plan) and num_layers is not None and policy.num_layers > num_layers:
        return cut_plan(policy, num_layers)
    if isinstance(policy, Policy) and policy.recomputes_layers and num_layers and policy.num_layers > num_layers:
        policy = dataclasses.replace(policy, num_layers=num_layers)
    if not isinstance(policy, Policy) or any(config.moe_layer_pattern()) or \
            not any(m in MOE_MODULES for m in policy.modules):
        return policy
    rest = tuple(m for m in policy.modules if m not in MOE_MODULES)
    return dataclasses.replace(policy, modules=rest) if rest else dataclasses.replace(
        policy, granularity="none", modules=())


def keeps_layer_inputs(layout: Policy | Plan, num_layers: int) -> bool:
    """Whether a chunk of ``num_layers`` layers under ``layout`` (a policy or a plan, as :func:`chunk_policy`
    gives it) saves its layers' inputs for the backward: a recompute group checkpoints the hidden states, the
    attention mask and the rotary tables it is given (Megatron's ``CheckpointFunction.save_for_backward(*args)``,
    tensor_parallel/random.py), and so does recomputed core attention (attention.py
    ``_checkpointed_attention_forward``), or its masked softmax (remat's ``non_matmul``), or a plan's
    operator-level checkpoint of a whole layer (``keep_ops``; remat.recompute.plan_format.checkpoints_layer_inputs).
    The dataloader's attention mask is then held until the micro-batch's backward (NOTE [Megatron's batch on the
    device] in remat.parallel.pipeline_runtime)."""
    if not num_layers:
        return False
    return bool(layout.layer_groups(num_layers)) or any(
        checkpoints_layer_inputs(layout.selective_modules(i)) for i in range(num_layers))


def cut_plan(plan: Plan, num_layers: int) -> Plan | Policy:
    """``plan``'s first ``num_layers`` layers (a group cut at the end keeps its layers below it, as Megatron's
    uniform groups end at a chunk's end); no layer: the policy that recomputes nothing."""
    if num_layers <= 0:
        return Policy(engine=plan.engine)
    return Plan(num_layers, tuple(Segment(s.mode, s.start, min(s.stop, num_layers), s.modules)
                                  for s in plan.segments if s.start < num_layers), plan.engine)


def build_stage_module(config: ModelConfig, spec: ChunkSpec, device: torch.device | str = "cpu") -> StageModule:
    """A chunk with freshly initialised weights in ``config.dtype`` (parameters made in place; works under
    ``FakeTensorMode``)."""
    with building(config, device):
        return StageModule(config, spec).train()


def build_stage_modules(config: ModelConfig, specs: Sequence[ChunkSpec], device: torch.device | str = "cpu",
                        seed: int | None = 0) -> list[StageModule]:
    """The chunks ``specs`` cut from one :func:`remat.models.gpt.build_model` (same ``seed``: the same weights as the
    unsplit GPT; the other chunks' parameters are dropped)."""
    model = build_model(config, device=device, seed=seed)
    return [StageModule(config, spec, _modules_from=model).train() for spec in specs]


# ------------------------------------------------------------------------------------------------ recorder
def phase_detail(microbatch: int, chunk: int, inner: str = "") -> str:
    """How phases name the microbatch and chunk: ``'microbatch 3, chunk 1'`` (``': <inner>'`` appended)."""
    text = f"microbatch {microbatch}, chunk {chunk}"
    return f"{text}: {inner}" if inner else text


_DETAIL = re.compile(r"^microbatch (\d+), chunk (\d+)(?::|$)")


@functools.lru_cache(maxsize=4096)
def parse_phase_detail(detail: str) -> tuple[int, int] | None:
    """(microbatch, chunk) named by a phase detail written by :func:`phase_detail`, else None (memoised: a stage's
    thousands of phases name a few hundred)."""
    match = _DETAIL.match(detail)
    return (int(match.group(1)), int(match.group(2))) if match else None


# a module's buffers (the MoE router's expert_bias, ...) are recorded under "<module> buffers": parameters' rows
# beside them, not parameters (Megatron's DDP buffers and optimizer hold parameters only)
BUFFERS = " buffers"


class PipelineRecorder(StepRecorder):
    """:class:`~remat.memory.measure.StepRecorder` for a rank's model chunks: layer phases name global layer indices,
    the head phase belongs to the last chunk only, and while :meth:`begin_op` has set a (microbatch, chunk)
    every phase's detail names them (:func:`phase_detail`)."""

    def __init__(self, model: nn.Module, chunks: Sequence[StageModule], *, block_bytes: int = 1):
        self.context: tuple[int, int] | None = None
        # fine-grained offloading: (event, host bytes added (< 0: reloaded), offload module, stack layer or -1)
        self.host_events: list[tuple[int, int, str, int]] = []
        # and its reload marks (event, 'commit' | 'start' | 'reload', module, stack layer, (op kind, microbatch)): NOTE
        # [when offloaded groups come back] in remat.recompute.activation_offload
        self.offload_marks: list[tuple[int, str, str, int, tuple[str, int] | None]] = []
        self.op: tuple[str, int] | None = None
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
        self.op = (kind, microbatch)
        if kind == "forward":
            self.set_phase("forward", "embedding" if spec.is_first else "")
        else:
            self.set_phase("backward", "head" if spec.is_last else "")

    def on_offload(self, module: str, nbytes: int, layer: int) -> None:
        self.host_events.append((self.timeline.num_events, nbytes, module, layer))
        super().on_offload(module, nbytes, layer)

    def on_reload(self, module: str, tensors: Sequence[torch.Tensor], nbytes: int) -> None:
        self.host_events.append((self.timeline.num_events, -nbytes, module, -1))
        super().on_reload(module, tensors, nbytes)

    def on_offload_mark(self, kind: str, module: str, layer: int) -> None:
        self.offload_marks.append((self.timeline.num_events, kind, module, layer, self.op))

    def end_op(self) -> None:
        """The current forward or backward ended; what follows is the pipeline runtime's own work."""
        self.context = self.op = None
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
        """Record what exists before the step: every parameter (named by its module) and buffer (named by its
        module + :data:`BUFFERS`), then ``named`` tensors (batch, pipeline buffers), each under the given module
        name."""
        for name, module in self.model.named_modules():
            for owner, tensors in ((name, module.parameters(recurse=False)),
                                   (name + BUFFERS, module.buffers(recurse=False))):
                self.module_stack.append(owner)
                for t in tensors:
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
