"""The fake traces a unit model is cut from: a profile stack of the reference GPT marked where each unit's forward
and backward start (:func:`marked_trace`), and a layer's operators read by a dispatch mode watching a one-layer
forward (:func:`watch_one_layer`, :func:`layer_contractions`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from remat.config import ModelConfig
from remat.memory.fake_hits import fake_tensor_mode
from remat.memory.kernels import kernel_trace, prepare_model, resolve_kernels
from remat.memory.measure import StepRecorder, record_step
from remat.memory.predict import rank_model_factory
from remat.models.gpt import empty_batch
from remat.recompute.apply import apply
from remat.recompute.engines import in_backward
from remat.recompute.operators import contraction
from remat.recompute.plan_format import Plan, Unit
from remat.timeline import Timeline
from remat.units import CUDA_BLOCK


@dataclass
class UnitMarks:
    """Where each unit of a marked trace starts (:func:`marked_trace`): events of the recorder's timeline."""

    forward: dict[int, int]   # unit index -> event at which the unit's forward starts
    backward: dict[int, int]  # unit index -> event at which the gradient of its output is ready
    head: int = -1            # the head's forward starts
    embedding: int = -1       # the gradient of the embedding's output is ready


def _recorder() -> Any:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    mode = _get_current_dispatch_mode()
    if isinstance(mode, StepRecorder):
        return mode
    for mode in reversed(_get_current_dispatch_mode_stack()):
        if isinstance(mode, StepRecorder):
            return mode
    raise RuntimeError("remat.plan: no step recorder is active")


def marked_trace(config: ModelConfig, units: Sequence[Unit], *, device: str = "cpu",
                 engine: str = "reentrant", tp: int = 1, sp: bool = False) -> tuple[Timeline, UnitMarks]:
    """Trace the reference GPT under the plan of ``units`` (fake tensors) and mark where each unit's forward and
    backward start, by module hooks that read the recorder's event count."""
    plan = Plan.from_units(units, engine)
    cfg = config.replace(num_layers=plan.num_layers)
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    at = 0
    for u, unit in enumerate(units):
        first[at], last[at + unit.size - 1] = u, u
        at += unit.size
    marks = UnitMarks({}, {})
    with fake_tensor_mode(), kernel_trace(resolve_kernels(None, device)) as kernels:
        model = rank_model_factory(cfg, tp, sp)()
        prepare_model(model, kernels.kernels)  # the active kernel profile (use_kernels), as remat.memory.predict's
        state = apply(model, plan)
        index = {id(layer): i for i, layer in enumerate(state.layers)}

        def outer(module: nn.Module) -> bool:
            region = module.__dict__.get("_remat_region")
            return not in_backward() and not (region is not None and region.kind == "layers" and region._running)

        def pre(module: nn.Module, args: tuple[Any, ...]) -> None:
            if module is model.head and not in_backward() and marks.head < 0:
                marks.head = _recorder().timeline.num_events
            i = index.get(id(module))
            if i is None or not outer(module):
                return
            if i in first and first[i] not in marks.forward:
                marks.forward[first[i]] = _recorder().timeline.num_events
            if i == 0 and isinstance(args[0], torch.Tensor) and args[0].requires_grad:
                args[0].register_hook(lambda g: setattr(marks, "embedding", _recorder().timeline.num_events))

        def post(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            i = index.get(id(module))
            if i is None or not outer(module) or i not in last:
                return
            u = last[i]
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(lambda g: marks.backward.__setitem__(u, _recorder().timeline.num_events))

        handles = [nn.modules.module.register_module_forward_pre_hook(pre),
                   nn.modules.module.register_module_forward_hook(post)]
        try:
            batch = empty_batch(cfg)  # fake, made in the fake mode
            timeline, _ = record_step(model, batch, layers=state.layers,
                                      block_bytes=CUDA_BLOCK if device == "cuda" else 1)
        finally:
            for handle in handles:
                handle.remove()
    missing = [u for u in range(len(units)) if u not in marks.forward or u not in marks.backward]
    if missing or marks.head < 0 or marks.embedding < 0:
        raise RuntimeError(f"remat.plan: unit boundaries were not all seen in the trace (units {missing})")
    return timeline, marks


class _ContractionCollector(TorchDispatchMode):
    def __init__(self, layer: nn.Module):
        super().__init__()
        self.inside, self.sizes = 0, set()
        layer.register_forward_pre_hook(lambda m, a: setattr(self, "inside", self.inside + 1))
        layer.register_forward_hook(lambda m, a, o: setattr(self, "inside", self.inside - 1))

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        k = contraction(func, args)
        if k is not None and self.inside:
            self.sizes.add(k)
        return func(*args, **(kwargs or {}))


def watch_one_layer(config: ModelConfig, tp: int, sp: bool,
                    watcher: Callable[[nn.Module], TorchDispatchMode]) -> TorchDispatchMode:
    """Run a fake forward of a one-layer model (one tensor-parallel rank) under ``watcher(model.layers[0])`` and
    return the watcher: how the plan space reads a layer's operators without running anything."""
    cfg = config.replace(num_layers=1)
    with fake_tensor_mode():
        model = rank_model_factory(cfg, tp, sp)()
        mode = watcher(model.layers[0])
        with mode:
            model(*empty_batch(cfg))
    return mode


def layer_contractions(config: ModelConfig, tp: int = 1, sp: bool = False) -> tuple[int, ...]:
    """The contraction sizes K of the matrix multiplies in one layer's forward (of one tensor-parallel rank),
    ascending (a fake forward)."""
    return tuple(sorted(watch_one_layer(config, tp, sp, _ContractionCollector).sizes))
