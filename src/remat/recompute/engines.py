"""The checkpoint engines: a reentrant one (Megatron's CheckpointFunction semantics) and its observers."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.utils.checkpoint
from torch.utils._pytree import tree_flatten


class CheckpointObserver(Protocol):
    """What a region reports while it runs (used by measurement to tag bytes); ``region`` is the
    :class:`remat.recompute.region.Region` that runs."""

    def on_checkpoint_inputs(self, region: Any, tensors: Sequence[torch.Tensor]) -> None: ...

    def on_recompute(self, region: Any, begin: bool) -> None: ...


observers: list[CheckpointObserver] = []


def add_observer(observer: CheckpointObserver) -> None:
    observers.append(observer)


def remove_observer(observer: CheckpointObserver) -> None:
    observers.remove(observer)


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def first_tensor_index(leaves: list[Any]) -> int | None:
    return next((i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)), None)


def first_tensor(value: Any) -> torch.Tensor | None:
    leaves = tree_flatten(value)[0]
    i = first_tensor_index(leaves)
    return None if i is None else leaves[i]


def side_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], Any]:
    """A call's inputs other than the hidden states (its first tensor), with their structure."""
    leaves, spec = tree_flatten((args, kwargs))
    first = first_tensor_index(leaves)
    return [leaf for i, leaf in enumerate(leaves) if i != first], spec


def same_side_inputs(a: tuple[list[Any], Any], b: tuple[list[Any], Any]) -> bool:
    if a[1] != b[1] or len(a[0]) != len(b[0]):
        return False
    for x, y in zip(a[0], b[0]):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if x is not y:
                return False
        elif x is not y and x != y:
            return False
    return True


class RngState:
    """CPU and (where used) CUDA generator states, captured before a region's forward."""

    def __init__(self, tensors: Sequence[torch.Tensor]):
        self.cpu = torch.get_rng_state()
        self.cuda_devices = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
        self.cuda = [torch.cuda.get_rng_state(d) for d in self.cuda_devices]

    def run_restored(self, fn: Callable[..., Any], *args: Any) -> Any:
        with torch.random.fork_rng(devices=self.cuda_devices):
            torch.set_rng_state(self.cpu)
            for device, state in zip(self.cuda_devices, self.cuda):
                torch.cuda.set_rng_state(state, device)
            return fn(*args)


class OutputSpec:
    """Carries the region in, and the pytree structure of its output out of, ``autograd.Function.forward``."""

    def __init__(self, region: Any):
        self.region = region
        self.spec: Any = None
        self.leaves: list[Any] = []


class ReentrantCheckpoint(torch.autograd.Function):
    """Megatron's ``CheckpointFunction``: keep the inputs and RNG state, recompute the region in backward."""

    @staticmethod
    def forward(ctx: Any, run: Callable[..., Any], out: OutputSpec, distribute: Any, *inputs: torch.Tensor) -> Any:
        ctx.run = run
        ctx.rng = RngState(inputs)
        with torch.no_grad():
            result = run(*inputs)
        ctx.distribute = distribute
        if distribute is not None:
            # Megatron's --distribute-saved-activations: keep 1/tp of the hidden states, gather in backward
            hidden = inputs[0]
            ctx.hidden_shape = hidden.shape
            hidden.data = distribute.shard(hidden.data.reshape(-1))
            for observer in observers:
                observer.on_checkpoint_inputs(out.region, [hidden])
        ctx.save_for_backward(*inputs)
        out.leaves, out.spec = tree_flatten(result)
        return tuple(leaf for leaf in out.leaves if isinstance(leaf, torch.Tensor))

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved = list(ctx.saved_tensors)
        if ctx.distribute is not None:
            saved[0].data = ctx.distribute.all_gather(saved[0].data).view(ctx.hidden_shape)
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in saved]
        return (None, None, None, *recompute_and_backpropagate(ctx, inputs, grad_outputs))


def recompute_and_backpropagate(ctx: Any, inputs: list[torch.Tensor],
                                 grad_outputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor | None]:
    """Run the region again on ``inputs`` (RNG restored, grad on), backpropagate ``grad_outputs`` through it, and
    return the inputs' gradients (the backward of a reentrant checkpoint)."""
    with torch.enable_grad():
        result = ctx.rng.run_restored(ctx.run, *inputs)
    outputs = [leaf for leaf in tree_flatten(result)[0] if isinstance(leaf, torch.Tensor)]
    pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if o.requires_grad and g is not None]
    del result, outputs
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    del pairs
    return [t.grad if t.requires_grad else None for t in inputs]
