"""Record one training step of a megatron-core model into a remat :class:`~remat.timeline.Timeline`.

remat's :class:`~remat.memory.measure.StepRecorder` learns about checkpoints from remat's own engines; Megatron
checkpoints with its own ``CheckpointFunction`` (full recompute, selective ``core_attn``/``mlp``/``moe``) and
``CheckpointWithoutOutput`` (``layernorm``, ``moe_act``, ``mla_up_proj``: the output's storage is released with
``resize_(0)`` after use and refilled in backward). :func:`observe_megatron_checkpoints` wraps those two while a
step is recorded and reports to the recorder what remat's engines report: the tensors a checkpoint keeps (group
inputs), when a region is recomputed, and - for the output-discarding kind - the storage released and refilled,
which no operator shows.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, disable_fake_tensor_cache

from remat.lazy_torch import load_dynamo
from remat.megatron.compat import MegatronSettingError
from remat.megatron.cpu_patches import replaced
from remat.memory.measure import StepRecorder
from remat.recompute.engines import in_backward, observers
from remat.recompute.region import group_label
from remat.timeline import Timeline

# Checkpoints whose backward runs, innermost last. Megatron's checkpoints do not nest in a correct run beyond a
# selective module inside a full-recompute group; a deeper stack is a runaway recursion (see settings.py).
RECOMPUTING: list[Any] = []
MAX_RECOMPUTE_NESTING = 8

# NOTE [a refilled storage under fake tensors]
# CheckpointWithoutOutput refills a released output with ``output.untyped_storage().copy_(recomputed storage)``,
# which reaches the dispatcher as ``aten.set_.source_Storage`` on a tensor wrapping each storage. FakeTensorMode's
# dispatch cache (torch 2.13) puts the storage object itself in that op's cache key, and the cache is a class-level
# dict that is never emptied: the refilled storage stays alive for good, so a fake step never frees it while the
# real step frees it after the consuming module's backward. Those two ops run with the cache off.
STORAGE_SETTERS = (torch.ops.aten.set_.source_Storage, torch.ops.aten.set_.source_Storage_storage_offset)

# Megatron submodule attribute -> the recompute_modules value that checkpoints it
SELECTIVE_NAMES = {"core_attention": "core_attn", "mlp": "mlp", "experts": "moe", "shared_experts": "shared_experts",
                   "input_layernorm": "layernorm", "pre_mlp_layernorm": "layernorm", "linear_fc1": "moe_act",
                   "activation_func": "moe_act"}


@dataclass(eq=False)
class MegatronRegion:
    """What one Megatron checkpoint covers; duck-types :class:`remat.recompute.region.Region` for the recorder."""

    kind: str                                   # "layers" or "selective:<recompute_modules value>"
    modules: list[nn.Module] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    layer_indices: tuple[int, ...] = ()
    index: int = 0

    @property
    def label(self) -> str:
        if self.kind == "layers":
            return group_label(self.index, self.layer_indices)
        return f"{self.kind.split(':', 1)[1]} in {self.names[0] if self.names else '?'}"


class ModulesEntered:
    """The modules whose forward starts while the context is active, in order."""

    def __init__(self) -> None:
        self.modules: list[nn.Module] = []

    def __enter__(self) -> ModulesEntered:
        self._handle = nn.modules.module.register_module_forward_pre_hook(lambda m, a: self.modules.append(m))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._handle.remove()


def _describe(modules: list[nn.Module], function: Any) -> MegatronRegion:
    from megatron.core.transformer.transformer_layer import BaseTransformerLayer

    layers = [m for m in modules if isinstance(m, BaseTransformerLayer)]
    if layers:
        return MegatronRegion("layers", layers, layer_indices=tuple(m.layer_number - 1 for m in layers))
    first = function if isinstance(function, nn.Module) else (modules[0] if modules else None)
    return MegatronRegion("selective:?", [first] if first is not None else [])


def _checkpoint_function_forward(original: Callable[..., Any]) -> Callable[..., Any]:
    def forward(ctx: Any, run_function: Callable[..., Any], distribute_saved_activations: bool, *args: Any) -> Any:
        region = MegatronRegion("selective:?")

        def run(*inputs: Any) -> Any:
            if not in_backward():
                return run_function(*inputs)
            for observer in observers:
                observer.on_recompute(region, True)
            try:
                return run_function(*inputs)
            finally:
                for observer in observers:
                    observer.on_recompute(region, False)

        with ModulesEntered() as entered:
            outputs = original(ctx, run, distribute_saved_activations, *args)
        described = _describe(entered.modules, run_function)
        region.kind, region.modules, region.layer_indices = described.kind, described.modules, described.layer_indices
        for observer in observers:
            observer.on_checkpoint_inputs(region, [a for a in args if isinstance(a, torch.Tensor)])
        return outputs
    return staticmethod(forward)


def _checkpoint_function_backward(original: Callable[..., Any]) -> Callable[..., Any]:
    def backward(ctx: Any, *grads: Any) -> Any:
        if len(RECOMPUTING) >= MAX_RECOMPUTE_NESTING:
            raise MegatronSettingError(
                f"megatron-core re-entered a checkpoint's backward {MAX_RECOMPUTE_NESTING} levels deep: a runaway "
                "recursion of this recompute setting (see remat.megatron.settings.known_failures)")
        RECOMPUTING.append(ctx)
        try:
            return original(ctx, *grads)
        finally:
            RECOMPUTING.pop()
    return staticmethod(backward)


def _without_output_checkpoint(original: Callable[..., Any]) -> Callable[..., Any]:
    def checkpoint(self: Any, run_function: Callable[..., Any], *args: Any) -> Any:
        self._remat_region = MegatronRegion("selective:?", [run_function] if isinstance(run_function, nn.Module)
                                            else [])
        return original(self, run_function, *args)
    return checkpoint


def _without_output_discard(original: Callable[..., Any]) -> Callable[..., Any]:
    def discard(self: Any, hook_tensor: torch.Tensor) -> Any:
        for output in self.outputs or ():
            for observer in observers:
                if hasattr(observer, "on_storage_released"):
                    observer.on_storage_released(output)
        return original(self, hook_tensor)
    return discard


def _without_output_recompute(original: Callable[..., Any]) -> Callable[..., Any]:
    def _recompute(self: Any, grad: Any) -> Any:
        if self.ctx is None:
            return original(self, grad)
        region = getattr(self, "_remat_region", MegatronRegion("selective:?"))
        outputs = list(self.outputs or ())
        for observer in observers:
            observer.on_recompute(region, True)
        try:
            return original(self, grad)
        finally:
            for output in outputs:
                for observer in observers:
                    if hasattr(observer, "on_storage_refilled"):
                        observer.on_storage_refilled(output)
            for observer in observers:
                observer.on_recompute(region, False)
    return _recompute


@contextlib.contextmanager
def observe_megatron_checkpoints() -> Iterator[None]:
    """While active, Megatron's checkpoints report to remat's checkpoint observers (see the module docstring)."""
    from megatron.core.tensor_parallel import random

    cf, cwo = random.CheckpointFunction, random.CheckpointWithoutOutput
    with replaced(cf, {"forward": _checkpoint_function_forward(cf.forward),
                       "backward": _checkpoint_function_backward(cf.backward)}), \
            replaced(cwo, {"checkpoint": _without_output_checkpoint(cwo.checkpoint),
                           "discard_output_and_register_recompute":
                               _without_output_discard(cwo.discard_output_and_register_recompute),
                           "_recompute": _without_output_recompute(cwo._recompute)}):
        yield


class MegatronStepRecorder(StepRecorder):
    """A :class:`StepRecorder` that also names Megatron's regions and follows released/refilled storages."""

    def __init__(self, model: nn.Module, layers: list[nn.Module], *, block_bytes: int = 1):
        super().__init__(model, layers, block_bytes=block_bytes)
        self.region_count = 0
        self.released_rows: set[int] = set()  # rows whose storage was released with resize_(0)

    def on_checkpoint_inputs(self, region: Any, tensors: Sequence[torch.Tensor]) -> None:
        if region.kind == "layers":
            region.index = self.region_count
            self.region_count += 1
        self._name(region)
        super().on_checkpoint_inputs(region, tensors)

    def on_recompute(self, region: Any, begin: bool) -> None:
        self._name(region)
        super().on_recompute(region, begin)

    def _name(self, region: Any) -> None:
        if region.kind != "layers" and not region.names and region.modules:
            name = self.module_names.get(id(region.modules[0]), type(region.modules[0]).__name__)
            region.names = [name]
            region.kind = f"selective:{SELECTIVE_NAMES.get(name.rsplit('.', 1)[-1], name.rsplit('.', 1)[-1])}"

    def on_storage_released(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        row = self.row_of(storage)
        if row is None or not self.active:
            return
        tl = self.timeline
        tl.free_at[row] = tl.num_events
        tl.num_events += 1
        self.forget(storage)
        self.released_rows.add(row)

    def on_storage_refilled(self, tensor: torch.Tensor) -> None:
        self.track(tensor)  # a new row, with its own finalizer: the storage's bytes are back

    def _on_free(self, row: int) -> None:
        if row in self.released_rows:  # its free was recorded at the release; a refill has a row of its own
            return
        super()._on_free(row)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if func not in STORAGE_SETTERS:
            return super().__torch_dispatch__(func, types, args, kwargs)
        fake = next((a for a in args if isinstance(a, FakeTensor)), None)
        if fake is None:
            return super().__torch_dispatch__(func, types, args, kwargs)
        with disable_fake_tensor_cache(fake.fake_mode):  # see NOTE [a refilled storage under fake tensors]
            return super().__torch_dispatch__(func, types, args, kwargs)


def record_megatron_step(model: nn.Module, layers: list[nn.Module], step: Callable[[], torch.Tensor], *,
                         extra: Sequence[tuple[torch.Tensor, str, str]] = (), block_bytes: int = 1) -> Timeline:
    """Run ``step`` (forward and loss of ``model``; returns the loss) and its backward under a
    :class:`MegatronStepRecorder`.

    Args:
        model: the module whose parameters and buffers are the step's "parameters".
        layers: the transformer layers in order (phases are named after them).
        step: builds the loss; called inside the recorder.
        extra: (tensor, module name, category) of storages that exist before the step and belong to it besides
            parameters: Megatron DDP's main-grad buffer ("gradients"), optimizer state ("optimizer_state").
        block_bytes: round every storage up to this (512 models the CUDA caching allocator).

    Returns:
        The step's :class:`Timeline`.
    """
    load_dynamo()  # before recording; see remat.memory.measure.record_step

    model.zero_grad(set_to_none=True)
    recorder = MegatronStepRecorder(model, layers, block_bytes=block_bytes)
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        with observe_megatron_checkpoints(), recorder:
            for name, module in model.named_modules():
                recorder.module_stack.append(name)
                for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
                    recorder.track(t)
                recorder.module_stack.pop()
            extra_rows = []
            for tensor, name, category in extra:
                recorder.module_stack.append(name)
                row = recorder.track(tensor)
                recorder.module_stack.pop()
                if row is not None:
                    extra_rows.append((row, category))
            recorder.set_phase("forward", "embedding")
            loss = step()
            recorder.set_phase("backward", "head")
            loss.backward()
            recorder.set_phase("setup", "end")
        recorder.categorize(None)
    finally:
        if gc_was_enabled:
            gc.enable()
    tl = recorder.timeline
    for row, category in extra_rows:
        tl.category[row] = category
    flops: dict[str, int] = {}
    for phase, amount in zip(tl.phases, recorder.phase_flops):
        flops[phase.kind] = flops.get(phase.kind, 0) + amount
    tl.meta.update({"phase_flops": recorder.phase_flops, "flops": flops, "num_layers": len(layers)})
    return tl
