"""A full-recompute group whose layers take their own side inputs, run layer by layer (NOTE [groups of layers with
their own inputs] in :mod:`remat.recompute.region`): the calls the model's loop made (:class:`GroupCalls`) and the
reentrant checkpoint that closes such a group (:class:`StepwiseCheckpoint`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint
from torch.utils._pytree import tree_flatten, tree_unflatten

from remat.recompute.engines import OutputSpec, RngState, first_tensor, first_tensor_index, recompute_and_backpropagate


@dataclass(frozen=True)
class _Input:
    """A tensor argument of a recorded call: the group's ``index``-th checkpoint input."""

    index: int


_PREVIOUS = object()  # a later layer's hidden states: the previous layer's output, recomputed


class GroupCalls:
    """The calls the model's loop made to the layers of one group in one forward: each call's arguments with its
    tensors replaced by references to the group's checkpoint inputs (:attr:`tensors`: the group's input hidden
    states, then every side-input tensor of every layer, each once), and the hidden states of the later layers
    by the previous layer's output."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.calls: list[tuple[list[Any], Any]] = []
        self.output: Any = None  # the last recorded layer's output, once it ran
        self.rng: RngState | None = None  # reentrant: the RNG state before the first layer
        self._positions: dict[int, int] = {}
        self._generator: Any = None  # non-reentrant: torch's checkpoint, open while the group's layers run

    def __len__(self) -> int:
        return len(self.calls)

    def record(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
        """Record the next layer's call; return the tensors it adds to the checkpoint inputs."""
        leaves, spec = tree_flatten((args, kwargs))
        hidden = first_tensor_index(leaves)
        added = []
        template: list[Any] = []
        for i, leaf in enumerate(leaves):
            if not isinstance(leaf, torch.Tensor):
                template.append(leaf)
            elif i == hidden and self.calls:
                template.append(_PREVIOUS)
            else:
                if id(leaf) not in self._positions:
                    self._positions[id(leaf)] = len(self.tensors)
                    self.tensors.append(leaf)
                    added.append(leaf)
                template.append(_Input(self._positions[id(leaf)]))
        self.calls.append((template, spec))
        return added

    def arguments(self, position: int, inputs: list[torch.Tensor], previous: Any) -> tuple[tuple[Any, ...], Any]:
        """The ``position``-th call's ``(args, kwargs)`` on checkpoint inputs ``inputs`` (the recorded ones, or
        their detached copies in a recomputation), after a previous layer's output ``previous``."""
        template, spec = self.calls[position]
        leaves = [inputs[leaf.index] if type(leaf) is _Input else first_tensor(previous) if leaf is _PREVIOUS
                  else leaf for leaf in template]
        return tree_unflatten(leaves, spec)

    # -- the non-reentrant engine: torch's checkpoint, open from the first layer's call to the last one's -------
    def open_checkpoint(self, rerun: Callable[[list[torch.Tensor]], Any]) -> None:
        """Start torch's non-reentrant checkpoint over the layers about to run (its saved-tensor hooks stay on
        until :meth:`close_checkpoint`); ``rerun(inputs)`` recomputes the whole group."""

        def recompute(*saved: torch.Tensor) -> Any:  # torch hands back the inputs it was opened with
            return rerun([*saved, *self.tensors[len(saved):]])

        self._generator = torch.utils.checkpoint._checkpoint_without_reentrant_generator(
            recompute, True, torch.utils.checkpoint.noop_context_fn, "default", False, True, *self.tensors)
        next(self._generator)

    def close_checkpoint(self) -> None:
        generator, self._generator = self._generator, None
        if generator is not None:
            next(generator, None)

    def abandon(self) -> None:
        """Drop a group whose forward did not reach its last layer (an error, or a loop that stopped early)."""
        generator, self._generator = self._generator, None
        if generator is not None:
            generator.close()


class StepwiseCheckpoint(torch.autograd.Function):
    """Megatron's ``CheckpointFunction`` for a group run layer by layer: applied at the group's last layer, it runs
    that layer (``run_last``) under no_grad, keeps every checkpoint input, and in backward recomputes the whole
    group (``rerun``) from the RNG state taken before its first layer (``rng``)."""

    @staticmethod
    def forward(ctx: Any, run_last: Callable[[], Any], rerun: Callable[..., Any], rng: RngState, out: OutputSpec,
                *inputs: torch.Tensor) -> Any:
        ctx.run, ctx.rng = rerun, rng
        with torch.no_grad():
            result = run_last()
        ctx.save_for_backward(*inputs)
        out.leaves, out.spec = tree_flatten(result)
        return tuple(leaf for leaf in out.leaves if isinstance(leaf, torch.Tensor))

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        grads = recompute_and_backpropagate(ctx, inputs, grad_outputs)
        ctx.run = None  # its GroupCalls holds the inputs too: they go now, as the saved tensors do
        return (None, None, None, None, *grads)
