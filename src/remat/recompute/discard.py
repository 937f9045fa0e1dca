"""Output-discarding recompute (Megatron's ``CheckpointWithoutOutput``): a producer module runs without keeping
its activations, and its output is dropped once the consumer module has used it, then rematerialised from the
kept inputs when backward reaches the consumer. remat's ``moe_act`` and ``mla_up_proj`` regions."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten, tree_unflatten

from remat.recompute.engines import RngState, observers
from remat.recompute.region import ApplyError, Region


@dataclass(frozen=True)
class Discarded:
    """What the consumer's graph keeps instead of a saved view of a discarded output: which output, and where
    in its storage the view sits."""

    handle: DiscardHandle
    index: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


# NOTE [how an output is discarded]
# Megatron frees the output's storage after the consumer's forward (untyped_storage().resize_(0)) and, from a hook
# on the consumer's output, re-runs the producer and copies the result back into that storage before the consumer's
# backward. remat gets the same memory without touching storages: while the consumer runs forward, a saved-tensor
# hook replaces every saved view of the producer's outputs by a Discarded placeholder, so nothing holds the outputs
# once the layer's code lets go of them. The first time backward unpacks a placeholder the producer is re-run (RNG
# restored, grad on: the recomputed outputs and their graph) and a copy of each output is made (Megatron's refilled
# storage); the views are cut from the copy. The copies go when the producer's own backward starts (Megatron's go
# when the consumer's saved tensors are released, just before), and the producer's backward runs through the
# recomputed graph, so gradients equal the plain model's bit for bit.
#
# Nothing but the node's saved tensors may hold the kept inputs, so that autograd frees them when the producer's
# backward is over, as it frees the plain model's saved tensors: the function the node re-runs holds the inputs'
# positions, not the inputs (a closure over the inputs kept every layer's fc1 output, 0.25 GiB per DeepSeek-V3 MoE
# layer, alive until the whole backward ended, above the plain model's peak), and the handle points at the node
# only weakly, since the node points at the handle (a strong pair is a cycle only Python's collector frees).
class DiscardHandle:
    """One forward of a producer: its outputs' storages (weakly), and in backward the recomputation."""

    def __init__(self, region: Region):
        self.region = region
        self.ctx_ref: Callable[[], Any] = lambda: None  # the producer's node, weakly (NOTE above)
        self.storages: list[StorageWeakRef] = []
        self.refilled: list[torch.Tensor] | None = None
        self.recomputed: list[torch.Tensor] | None = None
        self.inputs: list[torch.Tensor] = []

    def pack(self, tensor: torch.Tensor) -> Any:
        ref = StorageWeakRef(tensor.untyped_storage())
        for index, storage in enumerate(self.storages):
            if ref == storage:
                return Discarded(self, index, tuple(tensor.size()), tuple(tensor.stride()), tensor.storage_offset())
        return tensor

    @staticmethod
    def unpack(saved: Any) -> torch.Tensor:
        if not isinstance(saved, Discarded):
            return saved
        refilled = saved.handle.refill()[saved.index]
        return refilled.as_strided(saved.size, saved.stride, saved.offset)

    def refill(self) -> list[torch.Tensor]:
        """The producer re-run on its kept inputs (once), and a copy of each output for the consumer's backward."""
        if self.refilled is None:
            for observer in observers:
                observer.on_recompute(self.region, True)
            try:
                ctx = self.ctx_ref()
                if ctx is None:
                    raise RuntimeError(f"{self.region.label}: the producer's autograd node was freed before the "
                                       "consumer's backward, so its discarded output cannot be recomputed; keep "
                                       "the graph alive until backward reaches the consumer")
                self.inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
                with torch.enable_grad():
                    result = ctx.rng.run_restored(ctx.run, *self.inputs)
                del ctx
                self.recomputed = [leaf for leaf in tree_flatten(result)[0] if isinstance(leaf, torch.Tensor)]
                self.refilled = [t.detach().clone() for t in self.recomputed]
            finally:
                for observer in observers:
                    observer.on_recompute(self.region, False)
        return self.refilled


class DiscardingCheckpoint(torch.autograd.Function):
    """Megatron's ``CheckpointWithoutOutputFunction``: forward under ``no_grad`` keeping only the inputs (and RNG
    state); backward through the outputs :class:`DiscardHandle` recomputed."""

    @staticmethod
    def forward(ctx: Any, run: Callable[..., Any], handle: DiscardHandle, *inputs: torch.Tensor) -> Any:
        ctx.run, ctx.rng, ctx.handle = run, RngState(inputs), handle
        with torch.no_grad():
            outputs = run(*inputs)
        ctx.save_for_backward(*inputs)
        handle.ctx_ref = weakref.ref(ctx)
        return outputs

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        handle = ctx.handle
        handle.refill()
        handle.refilled = None  # the consumer's backward is over: its copies of the outputs go
        outputs, handle.recomputed = handle.recomputed or [], None
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if o.requires_grad and g is not None]
        del outputs
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        del pairs
        inputs, handle.inputs = handle.inputs, []
        return (None, None, *[t.grad if t.requires_grad else None for t in inputs])


def _refill_before_backward(handle_ref: Callable[[], DiscardHandle | None], grad: torch.Tensor) -> None:
    handle = handle_ref()
    if handle is not None and handle.ctx_ref() is not None:
        handle.refill()


class OutputDiscardingRegion(Region):
    """A producer module (``modules[0]``) whose outputs are discarded once the consumer module (``modules[1]``)
    has run (NOTE [how an output is discarded]). Only the producer's forward is replaced; the consumer keeps its
    own (it may be in another region, e.g. ``core_attn``) and gets the saved-tensor hooks from module hooks."""

    def install(self) -> None:
        producer, consumer = self.modules
        if "_remat_region" in producer.__dict__:
            raise ApplyError(f"module {self.names[0]} is already in a recompute region: nested regions are not "
                             "supported; use one policy")
        self._originals.append(producer.__dict__.get("forward"))
        producer.__dict__["forward"] = self._produce
        producer.__dict__["_remat_region"] = self
        self._hooks += [consumer.register_forward_pre_hook(self._enter_consumer),
                        consumer.register_forward_hook(self._leave_consumer, always_call=True)]

    def uninstall(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        producer = self.modules[0]
        del producer.__dict__["_remat_region"]
        original = self._originals.pop()
        if original is None:
            del producer.__dict__["forward"]
        else:
            producer.__dict__["forward"] = original

    def _produce(self, *args: Any, **kwargs: Any) -> Any:
        forward = self._original_forward(0)
        self._pending = None
        if not torch.is_grad_enabled():  # inside a reentrant checkpoint's forward: nothing is kept anyway
            return forward(*args, **kwargs)
        leaves, spec = tree_flatten((args, kwargs))
        positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        tensors = [leaves[i] for i in positions]
        template = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]  # run must not hold them
        del leaves
        for observer in observers:
            observer.on_checkpoint_inputs(self, tensors)
        out_spec: list[Any] = [None]  # the output's structure, set by run

        def run(*inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
            filled = list(template)
            for i, tensor in zip(positions, inputs):
                filled[i] = tensor
            call_args, call_kwargs = tree_unflatten(filled, spec)
            out_leaves, out_spec[0] = tree_flatten(forward(*call_args, **call_kwargs))
            if not all(isinstance(leaf, torch.Tensor) for leaf in out_leaves):
                raise ApplyError(f"{self.label}: an output-discarding region's outputs must all be tensors")
            return tuple(out_leaves)

        handle = DiscardHandle(self)
        outputs = DiscardingCheckpoint.apply(run, handle, *tensors)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        for output in outputs:
            if not output.is_contiguous():
                raise ApplyError(f"{self.label}: an output-discarding region needs contiguous outputs (they are "
                                 "rematerialised as contiguous copies)")
        handle.storages = [StorageWeakRef(t.untyped_storage()) for t in outputs]
        self._pending = handle
        return tree_unflatten(list(outputs), out_spec[0])

    # A consumer in a checkpoint region of its own (core_attn with mla_up_proj) is called again inside its call (the
    # region re-runs the module): the hooks are a stack, one entry per call, so the inner call's leaving does not
    # lose the outer call's hooks (lost, they stayed pushed for the rest of the process: every later saved tensor
    # went through pack, which keeps an op's own output in a cycle autograd never frees, e.g. a router's scores).
    def _enter_consumer(self, module: nn.Module, args: Any) -> None:
        handle, self._pending = self._pending, None
        hooks = torch.autograd.graph.saved_tensors_hooks(handle.pack, DiscardHandle.unpack) if handle else None
        if hooks is not None:
            hooks.__enter__()
        self.__dict__.setdefault("_consumer_hooks", []).append((handle, hooks))

    def _leave_consumer(self, module: nn.Module, args: Any, output: Any) -> None:
        stack = self.__dict__.get("_consumer_hooks")
        handle, hooks = stack.pop() if stack else (None, None)
        if hooks is None:
            return
        hooks.__exit__(None, None, None)
        # Megatron re-runs the producer from a hook on the consumer's output (discard_output_and_register_recompute),
        # before the consumer's backward, whether or not that backward reads a discarded output: where the consumer's
        # saved tensors were offloaded instead (core_attn offloaded with mla_up_proj), the refill still happens there
        for leaf in tree_flatten(output)[0]:
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                leaf.register_hook(functools.partial(_refill_before_backward, weakref.ref(handle)))
