"""TransformerEngine's layer-level CPU offloading in :func:`remat.apply` (Megatron's ``--cpu-offloading-num-layers
N``, a :class:`~remat.policy.Policy`'s ``cpu_offloading_num_layers``): :class:`LayerOffload`."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten

from remat.recompute.engines import in_backward, observers
from remat.recompute.offload import offload_to_host, restore_from_host
from remat.recompute.region import ApplyError

# NOTE [TE's layer offloading]
# Megatron's TransformerBlock runs every layer inside TransformerEngine's CPU-offload context and passes the layer's
# output through its synchronization function (transformer_block.py:304-325, 714-742 at d98e8a64, TE's
# get_cpu_offload_context with model_layers = num_layers, pp = 1). TE 2.17.1's default synchronizer
# (pytorch/cpu_offload.py, DefaultOffloadSynchronizer :576-653, the v2 path: NVTE_CPU_OFFLOAD_V1 unset) with L layers
# and N offloaded, per forward:
# * the context's saved-tensor hooks push, in layers 0..N-1 only (:649-653), every saved tensor of at least 256Ki
#   elements that is not a parameter (TE's linears mark their weights not to offload) and is contiguous, or that the
#   fused / flash attention marked to offload through its base (q, k, v: backends.py:904-905, 1338-1339); a view of
#   the same number of elements as its base, or a marked one, goes as its base, once (:454-475, 138-198);
# * before layer i's forward (fwd_step :628-638): layer i-1's pushed tensors are copied to pinned host memory on a
#   side stream (start_offload :259-312), and layer j's device copies are let go of before layer L-N+j, so while
#   layer L-N+j runs layers 0..j-1 are on the host only (release_activation_forward_gpu_memory :314-329);
# * before layer i's backward (bwd_step :534-541, 640-647, from a pre-hook on the layer output's grad_fn): the layer
#   whose backward ran before is let go of (release_all_memory :446-452: its reloaded device tensors and host
#   copies), then layer j is brought back, whole, when layer L-1-N+j's backward starts (start_reload :331-364: one
#   device allocation per pushed tensor); the last layer's backward lets go of its own at the end of the backward
#   (finish_part_of_bwd, queued on the autograd engine).
# So a reloaded layer is on the device from the backward of layer L-1-N+j until layer j's backward has ended, and
# a pushed tensor's device memory goes only when nothing else holds its storage. remat reproduces this on the layer
# stack with hooks, using the offload machinery's host copies and observers (remat.recompute.offload,
# remat.recompute.engines: on_offload / on_reload, whose reloaded tensors the step recorder tracks). Contiguity is
# judged on Megatron's [s, b, ...] layout, where every tensor an operator makes is contiguous: remat's own tensors
# are [b, s, ...] and their strides say nothing of it, so a tensor with its own storage always qualifies and a view
# qualifies through its base (marked, or of the same size) or alone when it is contiguous.
_MIN_ELEMENTS = 256 * 1024  # cpu_offload.py:459
_NAME = "cpu_offload"  # the offload module name the observers see
_ACTIVE = [0]  # LayerOffloads installed: TE's is_cpu_offload_enabled()


def mark_offload_base(*tensors: torch.Tensor) -> None:
    """TE's ``start_offload(q, k, v, offload_base_tensor=True)`` (attention backends.py:904-905, 1338-1339): while
    layer offloading is on, a view among ``tensors`` is offloaded through its base (NOTE [TE's layer offloading])."""
    if not _ACTIVE[0]:
        return
    for t in tensors:
        if isinstance(t, torch.Tensor) and t._base is not None:
            t._remat_offload_base = True  # type: ignore[attr-defined]


@dataclasses.dataclass(eq=False)
class _Pushed:
    """One tensor a layer pushed (TE's TensorGroup entry): on the device, copied to the host, or back."""

    device: torch.Tensor | None
    host: torch.Tensor | None = None
    back: torch.Tensor | None = None
    nbytes: int = 0
    where: torch.device | None = None  # the device it comes back to


@dataclasses.dataclass(eq=False)
class _Handle:
    """What autograd keeps for a pushed tensor: its entry and, for a view offloaded through its base, the view."""

    pushed: _Pushed
    view: tuple[torch.Size, tuple[int, ...], int] | None


class LayerState:
    """TE's ``OffloadableLayerState`` for one layer of one forward."""

    def __init__(self, layer: int) -> None:
        self.layer = layer
        # the offloaded tensor (or base), deduplicated (:174-198) by storage and layout (an id could be reused)
        self.pushed: dict[tuple[Any, ...], _Pushed] = {}

    def start_offload(self) -> None:
        nbytes = 0
        for entry in self.pushed.values():
            if entry.device is not None and entry.host is None:
                entry.host, entry.where = offload_to_host(entry.device), entry.device.device
                entry.nbytes = entry.device.numel() * entry.device.element_size()
                nbytes += entry.nbytes
        for observer in observers if nbytes else ():
            if hasattr(observer, "on_offload"):
                observer.on_offload(_NAME, nbytes, self.layer)

    def release_forward(self) -> None:
        for entry in self.pushed.values():
            if entry.host is not None:
                entry.device = None

    def start_reload(self) -> None:
        for entry in self.pushed.values():
            if entry.host is not None and entry.back is None and entry.device is None and entry.where is not None:
                entry.back = restore_from_host(entry.host, entry.where)
                for observer in observers:
                    if hasattr(observer, "on_reload"):  # allocated now; the host copy stays until released
                        observer.on_reload(_NAME, [entry.back], 0)

    def release_all(self) -> None:
        nbytes = sum(entry.nbytes for entry in self.pushed.values() if entry.host is not None)
        for entry in self.pushed.values():
            entry.device = entry.host = entry.back = None
        self.pushed.clear()
        for observer in observers if nbytes else ():
            if hasattr(observer, "on_reload"):
                observer.on_reload(_NAME, [], nbytes)


class _Forward:
    """One forward's layer states and its backward's progress (TE's synchronizer between two resets)."""

    def __init__(self, num_layers: int) -> None:
        self.states = {i: LayerState(i) for i in range(num_layers)}
        self.previous_bwd: int | None = None
        self.finish_queued = False


class LayerOffload:
    """TransformerEngine's layer offloading installed on a layer stack (NOTE [TE's layer offloading]).

    Args:
        num_offloaded: N, the first layers whose saved tensors wait in host memory (0 < N < len(stack)).
        stack: the decoder layers; names: their qualified names (for messages).

    Raises:
        ApplyError: N outside 1 .. len(stack) - 1 (TE keeps the last layer on the device, cpu_offload.py:843).
    """

    def __init__(self, num_offloaded: int, stack: Sequence[nn.Module], names: Sequence[str]):
        self.stack, self.names = list(stack), list(names)
        layers = len(self.stack)
        if not 0 < num_offloaded < layers:
            raise ApplyError(f"cpu offloading of {num_offloaded} layers in a stack of {layers}: TransformerEngine "
                             "offloads 1 to num_layers - 1 layers (cpu_offload.py:843-847): use fewer")
        self.num_offloaded = num_offloaded
        # cpu_offload.py:602-626: layer j lets go before layer L-N+j's forward, comes back at layer L-1-N+j's backward
        self.release_at = {layers - num_offloaded + j: j for j in range(num_offloaded)}
        self.reload_at = {layers - 1 - num_offloaded + j: j for j in range(num_offloaded)}
        self.forward: _Forward | None = None
        self.hooks: list[Any] = []  # the open saved-tensor hooks of the running layer
        self.handles: list[Any] = []

    def install(self) -> None:
        for i, layer in enumerate(self.stack):
            self.handles += [layer.register_forward_pre_hook(functools.partial(self._fwd_step, i)),
                             layer.register_forward_hook(functools.partial(self._layer_end, i), always_call=True)]
        _ACTIVE[0] += 1

    def uninstall(self) -> None:
        if self.handles:
            _ACTIVE[0] -= 1
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    # -- forward ------------------------------------------------------------------------------------------
    def _fwd_step(self, i: int, module: nn.Module, args: Any) -> None:
        if in_backward() or not torch.is_grad_enabled():
            return
        if i == 0 or self.forward is None:  # fwd_step's reset (:524-528): a new forward's states
            self.forward = _Forward(len(self.stack))
        states = self.forward.states
        if 0 < i <= self.num_offloaded:  # :633-634
            states[i - 1].start_offload()
        if i in self.release_at:  # :636-637
            states[self.release_at[i]].release_forward()
        if i < self.num_offloaded:  # push_tensor only in offloaded layers (:649-653)
            params = {StorageWeakRef(t.untyped_storage()) for t in (*module.parameters(), *module.buffers())}
            hooks = torch.autograd.graph.saved_tensors_hooks(functools.partial(self.push, states[i], params),
                                                             self._pop)
            hooks.__enter__()
            self.hooks.append(hooks)

    def _layer_end(self, i: int, module: nn.Module, args: Any, output: Any) -> None:
        if in_backward() or not torch.is_grad_enabled() or self.forward is None:
            return
        if i < self.num_offloaded and self.hooks:
            self.hooks.pop().__exit__(None, None, None)
        out = next((t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad), None)
        if out is not None:  # the synchronization function's pre-hook (:899-930)
            out.register_hook(functools.partial(self._bwd_step, self.forward, i))

    @staticmethod
    def push(state: LayerState, params: set[StorageWeakRef], tensor: torch.Tensor) -> Any:
        """push_tensor (:366-400) with _check_if_offload (:454-475) and the base/dedup rules (:138-198)."""
        if tensor.numel() < _MIN_ELEMENTS or StorageWeakRef(tensor.untyped_storage()) in params:
            return tensor
        base, view = tensor, None
        if tensor._base is not None:
            if getattr(tensor, "_remat_offload_base", False) or tensor._base.numel() == tensor.numel():
                base = tensor._base
                view = (tensor.shape, tensor.stride(), tensor.storage_offset())
            elif not tensor.is_contiguous():
                return tensor  # TE warns and keeps it (:468-473)
        key = (StorageWeakRef(base.untyped_storage()), base.storage_offset(), tuple(base.shape), base.stride())
        entry = state.pushed.get(key)
        if entry is None:
            entry = state.pushed[key] = _Pushed(base.detach())
        return _Handle(entry, view)

    @staticmethod
    def _pop(saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Handle):
            return saved
        entry = saved.pushed
        tensor = entry.device if entry.device is not None else entry.back
        if tensor is None:
            raise ApplyError("cpu offloading (--cpu-offloading-num-layers): a layer's saved tensor was let go of "
                             "before its backward (a layer run twice in one forward?); run each offloaded layer once "
                             "per forward, or offload fewer layers")
        return tensor if saved.view is None else tensor.as_strided(*saved.view)

    # -- backward -----------------------------------------------------------------------------------------
    def _bwd_step(self, forward: _Forward, i: int, grad: torch.Tensor) -> None:
        if forward.previous_bwd is not None:  # :538-539
            forward.states[forward.previous_bwd].release_all()
        forward.previous_bwd = i
        if i in self.reload_at:  # :646-647
            forward.states[self.reload_at[i]].start_reload()
        if not forward.finish_queued:  # finish_part_of_bwd at the end of this backward
            forward.finish_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(functools.partial(self._finish, forward))

    @staticmethod
    def _finish(forward: _Forward) -> None:
        if forward.previous_bwd is not None:
            forward.states[forward.previous_bwd].release_all()
        forward.previous_bwd = None
        forward.finish_queued = False


def prepare_layer_offload(policy: Any, stack: Sequence[nn.Module], names: Sequence[str]) -> LayerOffload | None:
    """The :class:`LayerOffload` ``policy`` asks for on ``stack`` (not installed yet), or None."""
    layers = int(getattr(policy, "cpu_offloading_num_layers", 0) or 0)
    return LayerOffload(layers, stack, names) if layers else None
