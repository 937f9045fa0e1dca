"""Megatron-LM's fine-grained activation offloading in :func:`remat.apply`: the tensors chosen modules save for
backward wait in host memory between forward and backward (:class:`ActivationOffload`, the policy part is
:mod:`remat.offload_policy`)."""

from __future__ import annotations

import contextlib
import functools
import itertools
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten

from remat.models.moe import MoELayer
from remat.offload_policy import OFFLOAD_MODULES
from remat.recompute.discard import DiscardHandle
from remat.recompute.engines import in_backward, observers
from remat.recompute.offload import offload_to_host, transfer_stream
from remat.recompute.region import ApplyError

# Megatron's offload module -> where it is in one layer: the first candidate whose modules exist is used. "a..b" is
# a span: from module a's forward start to module b's forward end (MLA computes its queries, keys and values in
# several modules, which Megatron's qkv_linear group covers together: get_query_key_value_tensors).
OFFLOAD_TARGETS: dict[str, tuple[str, ...]] = {
    "attn_norm": ("input_layernorm", "ln_1"),
    "qkv_linear": ("self_attention.linear_qkv", "self_attention.linear_q_down_proj..self_attention.up_proj",
                   "self_attention.linear_kv_down_proj..self_attention.up_proj", "attn.c_attn",
                   "self_attention.query_key_value", "attention.query_key_value"),
    "core_attn": ("self_attention.core_attention", "attn.core_attention", "self_attn.core_attention",
                  "attention.core_attention"),
    "attn_proj": ("self_attention.linear_proj", "self_attn.o_proj", "attn.c_proj", "self_attention.dense",
                  "attention.dense"),
    "mlp_norm": ("pre_mlp_layernorm", "pre_feedforward_layernorm", "post_attention_layernorm", "ln_2"),
    "expert_fc1": ("mlp.experts.linear_fc1",),
    "moe_act": ("mlp.experts.activation",),
}
# How many of the module's first tensor inputs Megatron releases when the group commits (its
# forced_released_tensors: the norms' and projections' input, core attention's query, key and value).
RELEASED_INPUTS = {"attn_norm": 1, "qkv_linear": 0, "core_attn": 3, "attn_proj": 1, "mlp_norm": 1, "expert_fc1": 1,
                   "moe_act": 1}
# Groups Megatron commits later than their forward's end: the norms after the residual add that follows attention
# (just before the MLP's norm) or the MLP (the layer's end), moe_act after the experts' fc2.
DELAYED_COMMIT = {"attn_norm": "mlp_norm", "mlp_norm": "", "moe_act": "mlp.experts.linear_fc2"}


# NOTE [how fine-grained offloading runs]
# For each offloaded module of each layer (but the last layer holding it, see below: Megatron's steady state keeps the
# last group of each name on the device so that backward need not wait for it), a forward pre-hook opens a group and
# pushes torch.autograd.graph.saved_tensors_hooks: every tensor autograd saves inside the module becomes a _Saved
# handle. When the group commits (its forward hook, or the later hook of DELAYED_COMMIT), each saved tensor of at
# least min_offloaded_tensor_size elements that is not one of the layer's parameters or buffers is copied to host
# memory (remat.recompute.offload.offload_to_host: pinned memory on a side stream on CUDA, a plain copy on CPU,
# made with the dispatch modes suspended so a recorder does not count it as device memory) and the handle lets go
# of the device tensor. Megatron then frees the module's inputs (RELEASED_INPUTS, untyped_storage().resize_(0)),
# which the model's code still holds; remat swaps the input tensor's data for an empty tensor (so a recorder sees
# the storage go when its last view goes), and only when the module saved that very storage and it was offloaded,
# so nothing can read a freed input, and the input is not a leaf (a tensor the caller gave, e.g. a pipeline stage's
# input, which backward gives a .grad of its shape). In backward the groups come back as NOTE [when offloaded groups
# come back] says; the copies go when autograd releases the handles, after their node ran. Observers (the step
# recorder) are told the host bytes as they come and go (on_offload / on_reload, one call per reloaded tensor), see
# each reloaded copy allocated when it is made, and a pipeline recorder the marks the composer re-times reloads by
# (on_offload_mark: 'commit', 'start', 'reload'). Inside other saved-tensor hooks (a non-reentrant checkpoint's)
# nothing is tagged (an output-discarding region's excepted: NOTE [offloading a discarded output]).
#
# NOTE [when offloaded groups come back]
# Megatron (pipeline_parallel/fine_grained_activation_offload.py at d98e8a64) pushes each group it offloads on its
# forward handler's reload stack when the group commits (bulk_offload:1229, commit order: a delayed attn_norm after
# attn_proj, mlp_norm last), and every group it opened, offloaded or kept, has a start function on its first input
# (FineGrainedOffloadingGroupStartFunction:1439) whose backward (on_group_start_backward:1332 -> bulk_reload:1271)
# brings back the top group of that handler's stack, or, once the stack is empty, the top group of the next backward
# handler whose forward has ended (pre_reload_last_layer:1198: a pipeline's next backward, laid out by
# remat.parallel.composer, or the measured runtime's offload_runtime(next_backward=...)). A tensor backward needs
# before its group came back is reloaded alone (tensor_pop:1063). So the reloads run ahead of backward by as many
# groups as the forward kept or had brought back by the backward before it: with its last layer's groups kept, a
# forward's backward reloads the layer below during its last layer and the next backward's last layer after that.
# remat hooks the group's first tensor input (its gradient hook runs when the start function's backward would) and
# pops the forward's own stack; the next handler's groups are the runtime's (remat.parallel.composer for a
# prediction, offload_runtime for a measured rank: a chunk trace has none, so its segments are re-timed per action).
#
# NOTE [offloading in a pipeline]
# Under pipeline parallelism each model chunk has its own ActivationOffload (remat.apply runs per chunk), and every
# forward of a microbatch offloads its groups independently: a rank holds on the host the groups of every
# microbatch in flight (its host peak adds them up), each brought back by its own backward or, for its top groups,
# by the backward before it (NOTE [when offloaded groups come back]). remat.parallel.job_predict composes this from
# the chunk trace (each forward/backward segment carries its host changes and reload marks,
# remat.parallel.chunk_trace.TraceSegment, re-timed by NOTE [re-timing reloads] in remat.parallel.composer) and a gloo
# run of the job measures the same, device and host bytes to the byte (tests/parallel/test_offload_pipeline.py).
# Which forwards keep their last layer's groups on the device follows Megatron's rule (NOTE [which forwards keep
# their last offload group] in remat.parallel.schedule): a forward keeps them when it is the step's first backward's
# or its own backward runs next, and offloads them inside offloading_last_groups (which the Megatron runtimes, traced
# and measured, enter for the other forwards). Outside it, every forward keeps them (pp = 1, and remat.apply on its
# own).
#
# NOTE [offloading a discarded output]
# With core_attn offloaded and mla_up_proj recomputed, Megatron (multi_latent_attention.py:343-466 at d98e8a64) runs
# the core attention under the offload's saved-tensor hooks, so its saved query, key and value are copied to the host
# at the group's commit like the rest; the up-projection checkpoint then frees their storages
# (discard_output_and_register_recompute). In backward a hook on the attention's output re-runs the up-projection into
# those storages (tensor_parallel/random.py CheckpointWithoutOutput, kept until the up-projection's backward) while
# the reloaded copies are what the attention's backward reads (fine_grained_activation_offload.py:937-955): both are
# on the device then. remat follows it: the offload's hooks go above the discarding region's (so the query, key and
# value are offloaded, not replaced by placeholders) and the region refills from a hook on the consumer's output
# (remat.recompute.discard.OutputDiscardingRegion).
_LAST_GROUPS_OFFLOADED: list[frozenset[str]] = [frozenset()]
# the measured pipeline runtime's names (NOTE [when offloaded groups come back]): the running forward's microbatch, and
# during a backward the microbatch of the next backward whose forward has ended (its groups are pre-reloaded)
_RUNTIME: dict[str, Any] = {"forward": None, "next_backward": None}


@contextlib.contextmanager
def offload_runtime(forward: Any = None, next_backward: Any = None) -> Iterator[None]:
    """Inside the block, groups a forward opens carry ``forward`` (its microbatch), and a backward whose own reload
    stack is empty brings back the groups of the forward named ``next_backward`` (Megatron's pre_reload_last_layer
    into the next backward handler, NOTE [when offloaded groups come back])."""
    before = dict(_RUNTIME)
    _RUNTIME.update(forward=forward, next_backward=next_backward)
    try:
        yield
    finally:
        _RUNTIME.update(before)


@contextlib.contextmanager
def offloading_last_groups(modules: Sequence[str]) -> Iterator[None]:
    """Inside the block, offloading installed by :func:`remat.apply` offloads the last layer's group of each of
    ``modules`` too, as Megatron does in the forwards whose backward does not run next (NOTE [which forwards keep
    their last offload group] in :mod:`remat.parallel.schedule`)."""
    before = _LAST_GROUPS_OFFLOADED[0]
    _LAST_GROUPS_OFFLOADED[0] = frozenset(modules)
    try:
        yield
    finally:
        _LAST_GROUPS_OFFLOADED[0] = before


class _Saved:
    """One tensor a group's module saved: on the device (``tensor``), in host memory (``host``) or back
    (``device``, ready once ``event`` has passed)."""

    __slots__ = ("__weakref__", "device", "event", "group", "host", "tensor")

    def __init__(self, group: OffloadGroup, tensor: torch.Tensor):
        self.group, self.tensor = group, tensor
        self.host: torch.Tensor | None = None
        self.device: torch.Tensor | None = None
        self.event: Any = None


def _unpack(saved: _Saved) -> torch.Tensor:
    if saved.tensor is not None:
        return saved.tensor
    if saved.device is None:  # not brought back by its group's reload yet: this tensor alone, now (tensor_pop)
        saved.group.reload([saved])
    tensor = saved.device
    if saved.event is not None:  # the compute stream waits for the copy only when it needs the tensor
        current = torch.cuda.current_stream(tensor.device)
        current.wait_event(saved.event)
        tensor.record_stream(current)
        saved.event = None
    return tensor


def _to_device(host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, Any]:
    """``host`` back on ``device`` and the CUDA event that marks the copy done (None on CPU, where the host copy
    itself is returned)."""
    if device.type != "cuda":
        return host, None
    with _disable_current_modes():
        stream = transfer_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            restored = host.to(device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return restored, event


class OffloadGroup:
    """The tensors one module of one layer saved during one forward (Megatron's ``OffloadTensorGroup``)."""

    def __init__(self, owner: ActivationOffload, name: str, layer: int, seq: int, forward: int,
                 params: set[StorageWeakRef], released: list[torch.Tensor]):
        self.owner, self.name, self.layer, self.seq, self.forward = owner, name, layer, seq, forward
        self.tag = _RUNTIME["forward"]  # the runtime's name for this forward (its microbatch), or None
        self.params = params
        self.released = [weakref.ref(t) for t in released]
        self.saved: list[weakref.ref[_Saved]] = []
        self.host_bytes = 0
        self.device: torch.device | None = None
        self.reloaded = False
        self.on_host: dict[int, int] = {}  # id of an offloaded handle not back yet -> its host bytes

    def pack(self, tensor: torch.Tensor) -> _Saved:
        saved = _Saved(self, tensor.detach())  # detached: a saved output would otherwise hold its own grad_fn
        self.saved.append(weakref.ref(saved))
        return saved

    def commit(self, min_size: int) -> None:
        """Copy the saved tensors of at least ``min_size`` elements to host memory and let go of them on the device,
        then release the inputs Megatron releases (NOTE [how fine-grained offloading runs])."""
        moving = [s for s in (ref() for ref in self.saved) if s is not None and s.tensor is not None
                  and s.tensor.numel() >= min_size and StorageWeakRef(s.tensor.untyped_storage()) not in self.params]
        if not moving:
            return
        for saved in moving:
            saved.host = offload_to_host(saved.tensor)
            self.host_bytes += saved.tensor.numel() * saved.tensor.element_size()
            # a handle autograd lets go of unread (its node never runs) takes its host copy with it
            self.on_host[id(saved)] = saved.host.numel() * saved.host.element_size()
            weakref.finalize(saved, self._dropped, id(saved))
        self.device = moving[0].tensor.device
        for observer in observers:
            if hasattr(observer, "on_offload"):
                observer.on_offload(self.name, self.host_bytes, self.layer)
        offloaded = {StorageWeakRef(s.tensor.untyped_storage()) for s in moving}
        # only tensors the model made (not a leaf the caller gave: a pipeline stage's input, which gets a .grad)
        inputs = [t for t in (ref() for ref in self.released) if t is not None and t._base is None
                  and t.grad_fn is not None and StorageWeakRef(t.untyped_storage()) in offloaded]
        for saved in moving:
            saved.tensor = None
        del moving
        for tensor in inputs:
            tensor.data = tensor.new_empty(0)
        self.released = []

    def _dropped(self, key: int) -> None:
        """A handle died with its tensor still on the host: its bytes leave the host, none come to the device."""
        nbytes = self.on_host.pop(key, 0)
        for observer in observers if nbytes else ():
            if hasattr(observer, "on_reload"):
                observer.on_reload(self.name, [], nbytes)

    def reload(self, only: Sequence[_Saved] | None = None) -> None:
        """Bring the group's offloaded tensors back to the device (``only``: those handles alone, Megatron's
        ``tensor_pop`` of one tensor that backward needs before its group came back), one allocation each."""
        if only is None:
            self.reloaded = True
        for saved in (ref() for ref in self.saved) if only is None else only:
            if saved is None or saved.host is None:
                continue
            nbytes = self.on_host.pop(id(saved), 0)
            saved.device, saved.event = _to_device(saved.host, self.device)
            saved.host = None
            for observer in observers:
                if hasattr(observer, "on_offload_mark"):
                    observer.on_offload_mark("reload", self.name, self.layer)
                if hasattr(observer, "on_reload"):
                    observer.on_reload(self.name, [saved.device], nbytes)


class ActivationOffload:
    """Fine-grained activation offloading installed on a layer stack (NOTE [how fine-grained offloading runs]).

    Args:
        modules: offload module names (:data:`~remat.offload_policy.OFFLOAD_MODULES`).
        min_size: saved tensors of fewer elements stay on the device (``min_offloaded_tensor_size``).
        stack: the decoder layers; names: their qualified names (for messages).

    Raises:
        ApplyError: a module no layer of the stack has (naming what the layer has), grouped-expert modules with
            separate expert MLPs, or a module shared by two layers.
    """

    def __init__(self, modules: Sequence[str], min_size: int, stack: Sequence[nn.Module], names: Sequence[str]):
        self.modules, self.min_size = tuple(modules), min_size
        self.stack, self.names = list(stack), list(names)
        self.targets: dict[tuple[int, str], tuple[nn.Module, nn.Module]] = {}  # (layer, name) -> (start, end)
        self.last_of: dict[str, int] = {}  # name -> the last layer that has it
        for name in self.modules:
            found = {i: target for i, layer in enumerate(self.stack)
                     if (target := self._target(layer, self.names[i], name)) is not None}
            if not found:
                raise self._missing(name)
            self.targets.update({(i, name): t for i, t in found.items()})
            # Megatron's steady state: the last group of each name stays on the device, unless the forward is one of
            # those that offload it too (offloading_last_groups)
            self.last_of[name] = max(found)
        seen: dict[int, str] = {}
        for (i, name), (start, _) in self.targets.items():
            if seen.setdefault(id(start), f"{self.names[i]} ({name})") != f"{self.names[i]} ({name})":
                raise ApplyError(f"{seen[id(start)]} and {self.names[i]} ({name}) are the same module instance: a "
                                 "module shared by two layers cannot be offloaded layer by layer; build distinct "
                                 "layers (e.g. copy.deepcopy)")
        self.active: dict[tuple[int, str], list[Any]] = {key: [] for key in self.targets}
        self.pending: dict[tuple[int, str], OffloadGroup] = {}
        self.waiting: list[OffloadGroup] = []  # committed groups not yet reloaded, in the order they started
        self.counter = itertools.count()
        self.forward, self.last_start = 0, (len(self.stack), 0)  # forwards run so far; the last group's place
        self.handles: list[Any] = []

    # -- targets ------------------------------------------------------------------------------------------
    @staticmethod
    def _target(layer: nn.Module, layer_name: str, name: str) -> tuple[nn.Module, nn.Module] | None:
        if name in ("expert_fc1", "moe_act") and isinstance(getattr(layer, "mlp", None), MoELayer) and \
                hasattr(layer.mlp.experts, "local_experts"):
            raise ApplyError(f"offload module {name!r}: {layer_name}.mlp.experts are separate expert MLPs "
                             "(moe_grouped_gemm=False), and Megatron offloads expert_fc1/moe_act only in grouped-GEMM "
                             "experts (TEGroupedMLP): set moe_grouped_gemm=True, or drop it")
        for candidate in OFFLOAD_TARGETS[name]:
            first, _, last = candidate.partition("..")
            try:
                return layer.get_submodule(first), layer.get_submodule(last or first)
            except AttributeError:
                continue
        return None

    def _missing(self, name: str) -> ApplyError:
        layer, layer_name = self.stack[0], self.names[0]
        if name in ("expert_fc1", "moe_act"):
            return ApplyError(f"offload module {name!r} is for grouped MoE experts, but no layer of the stack has "
                              "them: set num_moe_experts and moe_grouped_gemm=True in the model config, or drop it")
        children = ", ".join(n for n, _ in layer.named_modules() if n) or "none"
        return ApplyError(f"offload module {name!r}: {layer_name} ({type(layer).__name__}) has none of "
                          f"{', '.join(OFFLOAD_TARGETS[name])}; its submodules are: {children}")

    # -- installation -------------------------------------------------------------------------------------
    def install(self) -> None:
        """Register the hooks (NOTE [how fine-grained offloading runs])."""
        for (i, name), (start, end) in self.targets.items():
            self.handles += [start.register_forward_pre_hook(functools.partial(self._start, i, name)),
                             end.register_forward_hook(functools.partial(self._stop, i, name), always_call=True)]
            trigger = DELAYED_COMMIT.get(name)
            if trigger:
                target = self._target(self.stack[i], self.names[i], trigger) if trigger in OFFLOAD_TARGETS else None
                if target is not None:  # before the MLP's norm runs: the residual add after attention is done
                    self.handles.append(target[0].register_forward_pre_hook(
                        functools.partial(self._trigger, i, name)))
                else:
                    try:
                        module = self.stack[i].get_submodule(trigger)
                    except AttributeError:
                        continue  # committed at the layer's end
                    self.handles.append(module.register_forward_hook(functools.partial(self._trigger, i, name)))
        for i in sorted({i for i, _ in self.targets}):
            self.handles.append(self.stack[i].register_forward_hook(functools.partial(self._layer_end, i),
                                                                    always_call=True))

    def uninstall(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    # -- forward ------------------------------------------------------------------------------------------
    def _start(self, i: int, name: str, module: nn.Module, args: tuple[Any, ...]) -> None:
        stack = self.active[(i, name)]
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        # an output-discarding region's hooks (core_attn with mla_up_proj) go under the offload's: Megatron offloads
        # what the core attention saves, the discarded query/key/value included (NOTE [offloading a discarded output])
        discarding = top is not None and isinstance(getattr(top[0], "__self__", None), DiscardHandle)
        kept = i == self.last_of[name] and name not in _LAST_GROUPS_OFFLOADED[0]  # stays on the device
        if in_backward() or not torch.is_grad_enabled() or any(entry is not None for entry in stack) or \
                (top is not None and not discarding):
            # a recomputation, a checkpoint's no-grad forward, a nested call: nothing to tag; inside other saved-tensor
            # hooks (a non-reentrant checkpoint's) the saved tensors are theirs, as in Megatron's checkpoints
            stack.append(None)
            return
        place = (i, OFFLOAD_MODULES.index(name))  # groups start in this order within one forward
        if place <= self.last_start:
            self.forward += 1
        self.last_start = place
        tensors = [leaf for leaf in tree_flatten(args)[0] if isinstance(leaf, torch.Tensor)]
        first = next((t for t in tensors if t.requires_grad), None)
        if first is not None:  # the group's start function: its backward pops a reload (kept groups' too)
            first.register_hook(functools.partial(self._start_backward, i, name, self.forward, _RUNTIME["forward"]))
        if kept:
            stack.append(None)
            return
        layer = self.stack[i]
        params = {StorageWeakRef(t.untyped_storage()) for t in itertools.chain(layer.parameters(), layer.buffers())}
        inputs = tensors[:RELEASED_INPUTS[name]]
        group = OffloadGroup(self, name, i, next(self.counter), self.forward, params, inputs)
        hooks = torch.autograd.graph.saved_tensors_hooks(group.pack, _unpack)
        hooks.__enter__()
        stack.append((group, hooks))

    def _stop(self, i: int, name: str, module: nn.Module, args: Any, output: Any) -> None:
        stack = self.active[(i, name)]
        entry = stack.pop() if stack else None
        if entry is None:
            return
        group, hooks = entry
        hooks.__exit__(None, None, None)
        if name in DELAYED_COMMIT:
            self.pending[(i, name)] = group
        else:
            self._commit(group)

    def _trigger(self, i: int, name: str, module: nn.Module, *args: Any) -> None:
        if not in_backward() and (i, name) in self.pending:
            self._commit(self.pending.pop((i, name)))

    def _layer_end(self, i: int, module: nn.Module, args: Any, output: Any) -> None:
        if in_backward():
            return
        for key in [key for key in self.pending if key[0] == i]:
            self._commit(self.pending.pop(key))

    def _commit(self, group: OffloadGroup) -> None:
        group.commit(self.min_size)
        # Megatron's reload stack takes every group it offloads, in commit order, also one with nothing large enough
        self.waiting = [g for g in self.waiting if not g.saved or any(ref() is not None for ref in g.saved)]
        self.waiting.append(group)
        for observer in observers:
            if hasattr(observer, "on_offload_mark"):
                observer.on_offload_mark("commit", group.name, group.layer)

    # -- backward -----------------------------------------------------------------------------------------
    def _start_backward(self, i: int, name: str, forward: int, tag: Any, grad: torch.Tensor) -> None:
        """A group's start function's backward (NOTE [when offloaded groups come back]): bring back the top group of
        its forward's reload stack, or once that is empty the top group of the runtime's next backward."""
        for observer in observers:
            if hasattr(observer, "on_offload_mark"):
                observer.on_offload_mark("start", name, i)
        own = [g for g in self.waiting if g.forward == forward]
        if not own and _RUNTIME["next_backward"] is not None and _RUNTIME["next_backward"] != tag:
            own = [g for g in self.waiting if g.tag == _RUNTIME["next_backward"]]
        if own:
            self.waiting.remove(own[-1])
            own[-1].reload()


def offload_modules_of(policy: Any) -> tuple[str, ...]:
    """The offload modules of a policy or layout (``()`` for one without ``offload_modules``)."""
    modules = tuple(getattr(policy, "offload_modules", ()) or ())
    unknown = [m for m in modules if m not in OFFLOAD_MODULES]
    if unknown:
        raise ApplyError(f"offload module {unknown[0]!r}: valid modules are {', '.join(OFFLOAD_MODULES)}")
    return modules


def prepare_offload(policy: Any, stack: Sequence[nn.Module], names: Sequence[str]) -> ActivationOffload | None:
    """The :class:`ActivationOffload` ``policy`` asks for on ``stack`` (not installed yet), or None."""
    modules = offload_modules_of(policy)
    if not modules:
        return None
    return ActivationOffload(modules, int(policy.min_offloaded_tensor_size), stack, names)


def installed_offload(model: nn.Module) -> ActivationOffload | None:
    """The fine-grained offloading :func:`remat.apply` installed on ``model``, or None."""
    return model.__dict__.get("_remat_offload")
