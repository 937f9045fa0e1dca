"""Measure one training step's memory: a recorder that sees every storage allocated and freed, tagged with the
phase (forward, backward, recompute of a layer) that made it, and :func:`measure`, which runs a step under it."""

from __future__ import annotations

import gc
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode, _pop_mode, _push_mode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count, shape_wrapper

from remat.config import ModelConfig
from remat.lazy_torch import import_for_steps
from remat.memory.fake_hits import UNCACHED, answers_from_cache, cached_output, fake_mode_alone_below, fast_fake_mode
from remat.memory.kernels import UntranslatedObserver
from remat.memory.step_checks import Batch, check_loss, check_real_step, check_reference_batch, check_step, loss_of
from remat.memory.step_checks import MeasureError as MeasureError  # re-exported (remat.MeasureError)
from remat.models.tensor_parallel import TPGPT
from remat.recompute.apply import applied, find_layer_stack
from remat.recompute.engines import add_observer, in_backward, remove_observer
from remat.recompute.region import Region
from remat.timeline import Phase, Timeline
from remat.units import CUDA_BLOCK, round_up


def _cpu_flash_forward_flops(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any,
                             out_val: Any = None, **kwargs: Any) -> int:
    return sdpa_flop_count(query.shape, key.shape, value.shape)


def _cpu_flash_backward_flops(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


# torch.utils.flop_counter's formulas, plus the CPU flash-attention kernels it has none for (scaled_dot_product_
# attention on CPU), counted as its other attention kernels are.
FLOP_FORMULAS: dict[Any, Callable[..., int]] = dict(flop_registry)
_DEVICE_QUERY = torch.ops.prim.device.default  # what reading tensor.device dispatches to under a mode
_LIFT_FRESH = torch.ops.aten.lift_fresh.default  # torch.tensor(data) under a mode
# NOTE [unsafe views from view's cache entry]: FakeTensorMode never caches aten._unsafe_view (matmul's fold of batch
# dimensions, ~4% of a layer's operators): its cache makes a view's output alias its input by the operator's is_view
# tag, which _unsafe_view lacks, so each call runs the fake kernel again (about half a millisecond). That kernel is
# view's own (torch/_subclasses/fake_impls.py registers _view_meta for both), and below autograd, where a dispatch
# mode runs, view's output is no autograd view either: the same tensor, which view's cache entry makes. The recorder
# asks for view when the fake mode is alone below it; the kernel profile and the FLOP count still see _unsafe_view.
_UNSAFE_VIEW, _VIEW = torch.ops.aten._unsafe_view.default, torch.ops.aten.view.default
# argument types that are pytree leaves and never tensors: an argument list of these and tensors is its own flattening
_PLAIN_ARGS = frozenset((int, float, bool, complex, str, type(None), torch.dtype, torch.device, torch.layout,
                         torch.memory_format))


def _tensors_in(values: Any) -> Sequence[Any]:
    """The leaves of ``values`` in :func:`tree_flatten`'s order (what the recorder tracks of an operator's
    arguments or outputs): a list or tuple of tensors, plain values and lists or tuples of those (nearly every
    operator's) is flattened here, without tree_flatten's per-node type lookups; anything else by ``tree_flatten``."""
    if type(values) is not tuple and type(values) is not list:
        return tree_flatten(values)[0]
    leaves: list[Any] = []
    for value in values:
        if type(value) in _PLAIN_ARGS or isinstance(value, torch.Tensor):
            leaves.append(value)
        elif type(value) is list or type(value) is tuple:
            for item in value:
                if not (type(item) in _PLAIN_ARGS or isinstance(item, torch.Tensor)):
                    return tree_flatten(values)[0]
                leaves.append(item)
        else:
            return tree_flatten(values)[0]
    return leaves


# torch's formulas take shapes: shape_wrapper maps every tensor of an operator's arguments and output to its shape
# (a tree_map over them, about a twentieth of a trace's CPU); the formula itself is called on the shapes here
_SHAPE_WRAPPED = shape_wrapper(lambda: 0).__code__


class _NotPlain(Exception):
    """An argument :func:`_shape_of` leaves to torch's tree_map."""


def _shape_of(value: Any) -> Any:
    """``tree_map(get_shape, value)`` of torch.utils.flop_counter for tensors, plain values and lists, tuples and
    dicts of those; :class:`_NotPlain` for anything else."""
    if isinstance(value, torch.Tensor):
        return value.shape
    kind = type(value)
    if kind is tuple or kind is list:
        return kind([_shape_of(v) for v in value])
    if kind is dict:
        return {k: _shape_of(v) for k, v in value.items()}
    if kind in _PLAIN_ARGS:
        return value
    raise _NotPlain


def operator_flops(formula: Callable[..., int], args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    """``formula(*args, **kwargs, out_val=out)`` (a :data:`FLOP_FORMULAS` entry); torch's shape-wrapped formulas
    called on the shapes directly (:func:`_shape_of`), the same count."""
    if getattr(formula, "__code__", None) is _SHAPE_WRAPPED:
        try:
            return int(formula.__wrapped__(*_shape_of(args), out_shape=_shape_of(out),  # type: ignore[attr-defined]
                                           **_shape_of(kwargs)))
        except _NotPlain:
            pass
    return int(formula(*args, **kwargs, out_val=out))


for _name, _formula in (("_scaled_dot_product_flash_attention_for_cpu", _cpu_flash_forward_flops),
                        ("_scaled_dot_product_flash_attention_for_cpu_backward", _cpu_flash_backward_flops)):
    if hasattr(torch.ops.aten, _name):
        FLOP_FORMULAS.setdefault(getattr(torch.ops.aten, _name), _formula)




def run_model(model: nn.Module, batch: Batch) -> Any:
    return model(**batch) if isinstance(batch, dict) else model(*batch)


# NOTE [how a step is recorded]
# The recorder is a TorchDispatchMode: every operator's output storages are seen once, when first made, and a
# weakref.finalize on the storage records its free when its last reference goes. A storage counts once however
# many views share it. Phases come from module hooks: a layer's forward, the same layer run again by a
# checkpoint in backward (recompute), and gradient hooks on layer outputs for backward.
#
# The same recorder runs on real CPU tensors (exact bytes), on CUDA tensors (storage bytes rounded up to the
# caching allocator's 512-byte blocks, with torch.cuda.max_memory_allocated kept beside them), and under
# FakeTensorMode, where nothing is allocated at all (that is how remat.memory.predict works: a prediction is a
# measurement of a fake run).
class StepRecorder(TorchDispatchMode):
    """Records allocations, frees, phases and FLOPs while one training step runs inside it (see the NOTE above)."""

    def __init__(self, model: nn.Module, layers: list[nn.Module], *, block_bytes: int = 1):
        super().__init__()
        self.model = model
        self.layers = layers
        self.layer_index = {id(layer): i for i, layer in enumerate(layers)}
        self.module_names = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
        self.block_bytes = block_bytes
        self.timeline = Timeline()
        # id(storage) -> its allocation row, while the storage lives (its finalizer removes it): a dict keyed by id,
        # not a WeakIdKeyDictionary, whose lookups each make a weak reference (4% of a fake trace's CPU)
        self._rows: dict[int, int] = {}
        self.active = False
        self.group_input_rows: set[int] = set()
        self.phase_flops: list[int] = []  # FLOPs counted in each phase (torch.utils.flop_counter formulas)
        self.module_stack: list[str] = []
        self.recomputing: list[tuple[Region, Phase, int]] = []
        self._phase: Phase | None = None
        self._handles: list[Any] = []
        self._observer: UntranslatedObserver | None = None  # the kernel profile's, while it is absorbed
        self._cache_below: FakeTensorMode | None = None  # the fake mode whose cache hits are made here
        # fine-grained activation offloading (remat.recompute.activation_offload): host bytes, apart from the timeline
        self.host_bytes = 0
        self.host_series: list[list[int]] = []  # [event, host bytes from that event on]
        self.offloaded_bytes: dict[str, int] = {}  # offload module -> bytes copied to the host
        self.offloaded_by_layer: dict[str, int] = {}  # layer index (as text, as JSON keeps it) -> bytes
        self.reload_rows: set[int] = set()
        self.set_phase("setup", "")

    # -- events -------------------------------------------------------------------------------------------
    def set_phase(self, kind: str, region: str, detail: str = "") -> None:
        phase = Phase(self.timeline.num_events, kind, region, detail)
        if self._phase is not None and (phase.kind, phase.region, phase.detail) == (
                self._phase.kind, self._phase.region, self._phase.detail):
            return
        if self.timeline.phases and self.timeline.phases[-1].start == phase.start:
            self.timeline.phases[-1] = phase  # the previous phase made no event: replace it
        else:
            self.timeline.phases.append(phase)
            self.phase_flops.append(0)
        self._phase = phase

    def track(self, tensor: torch.Tensor) -> int | None:
        """Record ``tensor``'s storage as allocated now if it is new; return its row."""
        storage = tensor.untyped_storage()
        key = id(storage)
        row = self._rows.get(key)
        if row is not None:
            return row
        nbytes = storage.nbytes()
        if nbytes == 0:
            return None
        tl = self.timeline
        row = len(tl.nbytes)
        tl.nbytes.append(round_up(nbytes, self.block_bytes))
        tl.alloc_at.append(tl.num_events)
        tl.num_events += 1
        tl.free_at.append(-1)
        tl.phase_index.append(len(tl.phases) - 1)
        tl.module.append(self.module_stack[-1] if self.module_stack else self._default_module())
        tl.category.append("other")
        self._rows[key] = row
        weakref.finalize(storage, self._storage_died, key, row)
        return row

    def row_of(self, storage: torch.UntypedStorage) -> int | None:
        """The allocation row of a live ``storage`` (``tensor.untyped_storage()``), None if not recorded."""
        return self._rows.get(id(storage))

    def forget(self, storage: torch.UntypedStorage) -> None:
        """Record ``storage`` as new the next time it is seen (a row of its own)."""
        self._rows.pop(id(storage), None)

    def _storage_died(self, key: int, row: int) -> None:
        if self._rows.get(key) == row:  # its id may be another storage's from now on
            del self._rows[key]
        self._on_free(row)

    def _default_module(self) -> str:
        region = self._phase.region if self._phase else ""
        if region.startswith("layer "):
            return self.module_names.get(id(self.layers[int(region[6:])]), region)
        return region

    def _on_free(self, row: int) -> None:
        if self.active:
            self.timeline.free_at[row] = self.timeline.num_events
            self.timeline.num_events += 1

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if func is _DEVICE_QUERY:  # tensor.device (most dispatches of a fake step): no output, no FLOPs
            tensor = args[0]
            self.track(tensor)
            if type(tensor) is FakeTensor and fake_mode_alone_below(tensor.fake_mode):
                return tensor.fake_device  # what the fake mode's handler answers, without a second dispatch
            return func(*args)
        if func is _LIFT_FRESH:  # torch.tensor(...): in a fake trace its fake copy stands for the real step's tensor
            out = func(*args, **(kwargs or {}))
            self.track(out if type(out) is FakeTensor else args[0])
            return out
        kwargs = kwargs or {}
        # (args, kwargs) in tree_flatten's order: the arguments, then the keyword values as the dict holds them
        for leaf in _tensors_in(args) if not kwargs else (*_tensors_in(args), *_tensors_in(list(kwargs.values()))):
            if isinstance(leaf, torch.Tensor):  # storages made outside any operator (RNG states, ...)
                self.track(leaf)
        unsafe_view = func is _UNSAFE_VIEW and type(args[0]) is FakeTensor and fake_mode_alone_below(args[0].fake_mode)
        asked = _VIEW if unsafe_view else func  # NOTE [unsafe views from view's cache entry]
        fake = self._cache_below
        out = cached_output(fake, asked, args, kwargs) if fake is not None and fake_mode_alone_below(fake) else UNCACHED
        if out is UNCACHED:  # NOTE [fake cache hits without a dispatch]: a miss, or not the mode's cache to answer
            out = asked(*args, **kwargs)
        if self._observer is not None:
            self._observer.observe(func, args, out)
        packet = func.overloadpacket
        if packet in FLOP_FORMULAS:
            self.phase_flops[-1] += operator_flops(FLOP_FORMULAS[packet], args, kwargs, out)
        for leaf in (out,) if isinstance(out, torch.Tensor) else _tensors_in(out):
            if isinstance(leaf, torch.Tensor):
                self.track(leaf)
        return out

    # -- phases from hooks --------------------------------------------------------------------------------
    def _is_outer_call(self, module: nn.Module) -> bool:
        """A multi-layer region's member called by the model's loop (not inside the region's own run)."""
        region = module.__dict__.get("_remat_region")
        return region is not None and region.kind == "layers" and not region._running

    def _pre_hook(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        self.module_stack.append(self.module_names.get(id(module), type(module).__name__))
        i = self.layer_index.get(id(module))
        if i is None or self._is_outer_call(module):
            return
        if in_backward():
            detail = self.recomputing[-1][0].label if self.recomputing else ""
            self.set_phase("recompute", f"layer {i}", detail)
        else:
            self.set_phase("forward", f"layer {i}")
            first = next((a for a in tree_flatten(args)[0] if isinstance(a, torch.Tensor)), None)
            if self._starts_stack(module, i) and first is not None and first.requires_grad:
                self._grad_hook(first, "embedding")

    def _post_hook(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if self.module_stack:
            self.module_stack.pop()
        i = self.layer_index.get(id(module))
        if i is None or self._is_outer_call(module):
            return
        first = next((o for o in tree_flatten(output)[0] if isinstance(o, torch.Tensor)), None)
        if first is not None and first.requires_grad:
            self._grad_hook(first, f"layer {i}")
        if self._ends_stack(module, i) and not in_backward():
            self.set_phase("forward", "head")

    def _starts_stack(self, layer: nn.Module, index: int) -> bool:
        """Whether ``layer`` is the first of the stack (its input's gradient starts the embedding's backward)."""
        return index == 0

    def _ends_stack(self, layer: nn.Module, index: int) -> bool:
        """Whether ``layer`` is the last of the stack (the head's forward follows it)."""
        return index == len(self.layers) - 1

    def _region_layer(self, region: Region, position: int) -> int:
        """The index phases give the ``position``-th layer of a layer-group region."""
        return self.layer_index.get(id(region.modules[position]), region.layer_indices[position])

    def _grad_hook(self, tensor: torch.Tensor, region: str) -> None:
        def hook(grad: torch.Tensor) -> None:
            if self.active:
                self.set_phase("backward", region)
        tensor.register_hook(hook)

    def on_checkpoint_inputs(self, region: Region, tensors: Sequence[torch.Tensor]) -> None:
        for t in tensors:
            row = self.track(t)
            if row is not None:
                self.group_input_rows.add(row)

    def on_recompute(self, region: Region, begin: bool) -> None:
        if begin:
            self.recomputing.append((region, self._phase, len(self.module_stack)))
            where = self._phase.region if region.kind != "layers" else f"layer {self._region_layer(region, 0)}"
            self.set_phase("recompute", where, region.label)
        else:
            _, before, depth = self.recomputing.pop()
            del self.module_stack[depth:]
            if region.kind == "layers":  # what follows a group's recomputation is its last layer's backward
                self.set_phase("backward", f"layer {self._region_layer(region, -1)}")
            else:  # the phase as it was, its detail already complete (a subclass may add to details)
                StepRecorder.set_phase(self, before.kind, before.region, before.detail)

    def on_offload(self, module: str, nbytes: int, layer: int) -> None:
        """``nbytes`` of saved tensors of offload module ``module`` of stack layer ``layer`` were copied to host
        memory (the device copies' frees follow as their storages go)."""
        self.host_bytes += nbytes
        self.host_series.append([self.timeline.num_events, self.host_bytes])
        self.offloaded_bytes[module] = self.offloaded_bytes.get(module, 0) + nbytes
        self.offloaded_by_layer[str(layer)] = self.offloaded_by_layer.get(str(layer), 0) + nbytes

    def on_reload(self, module: str, tensors: Sequence[torch.Tensor], nbytes: int) -> None:
        """An offloaded group came back: its device copies ``tensors`` are allocated now, ``nbytes`` leave the host."""
        self.host_bytes -= nbytes
        self.host_series.append([self.timeline.num_events, self.host_bytes])
        for t in tensors:
            row = self.track(t)
            if row is not None:
                self.reload_rows.add(row)

    # -- lifecycle ----------------------------------------------------------------------------------------
    def __enter__(self) -> StepRecorder:
        import_for_steps(self.model)  # not inside the step: module code run there leaves its frames in reference cycles
        # NOTE [the kernel profile's observer, absorbed]: entered directly above the kernel profile's
        # UntranslatedObserver (a fake trace's usual stack), the recorder takes the observer off the mode stack for
        # the step and calls its observe() on each operator itself: the same notes, one Python dispatch per
        # operator instead of two, and tensor.device answered without a second mode (fake_mode_alone_below)
        below = _get_current_dispatch_mode()
        if type(below) is UntranslatedObserver:
            self._observer = below
            _pop_mode()
        # NOTE [fast fake-tensor cache keys], NOTE [fast fake-tensor cache hits]
        fake = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
        self._fast_fake = fast_fake_mode(fake)
        self._fast_fake.__enter__()
        self._cache_below = fake if isinstance(fake, FakeTensorMode) and answers_from_cache(fake) else None
        super().__enter__()
        self.active = True
        self._handles = [
            nn.modules.module.register_module_forward_pre_hook(self._pre_hook),
            nn.modules.module.register_module_forward_hook(self._post_hook, always_call=True),
        ]
        add_observer(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.active = False
        self._cache_below = None
        remove_observer(self)
        for handle in self._handles:
            handle.remove()
        super().__exit__(*exc)
        self._fast_fake.__exit__(None, None, None)
        if self._observer is not None:  # back under the kernel profile's exit (see __enter__)
            _push_mode(self._observer)
            self._observer = None

    def categorize(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Give every allocation its category (see remat.timeline.CATEGORIES)."""
        tl = self.timeline
        params = set()
        for t in list(self.model.parameters()) + list(self.model.buffers()):
            row = self.row_of(t.untyped_storage())
            if row is not None:
                params.add(row)
        grads = set()
        for p in self.model.parameters():
            if p.grad is not None:
                row = self.row_of(p.grad.untyped_storage())
                if row is not None:
                    grads.add(row)
        for row in range(len(tl.nbytes)):
            phase = tl.phases[tl.phase_index[row]]
            if row in params:
                category = "parameters"
            elif row in grads:
                category = "gradients"
            elif phase.kind == "optimizer":
                category = "optimizer_state"
            elif row in self.group_input_rows:
                category = "group_inputs"
            elif row in self.reload_rows:  # saved activations brought back from host memory
                category = "saved_activations"
            elif phase.region == "head":
                category = "head_loss"
            elif phase.kind == "recompute":
                category = "recompute"
            elif phase.kind == "forward":
                category = "saved_activations"
            else:
                category = "other"
            tl.category[row] = category
        if optimizer is not None:  # states that existed before this step (a second step) are optimizer states
            for state in optimizer.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        row = self.row_of(value.untyped_storage())
                        if row is not None and row not in params:
                            tl.category[row] = "optimizer_state"


def record_step(model: nn.Module, batch: Batch, *, optimizer: torch.optim.Optimizer | None = None,
                loss_fn: Callable[[Any, Batch], torch.Tensor] | None = None,
                layers: str | Sequence[nn.Module] | nn.Module | None = None, block_bytes: int = 1,
                ) -> tuple[Timeline, torch.Tensor]:
    """Run forward, loss, backward (and ``optimizer.step()``) once under a :class:`StepRecorder`."""
    state = applied(model)
    if state is not None and layers is None:
        stack = state.layers
    else:
        stack = find_layer_stack(model, layers)[1]
    model.zero_grad(set_to_none=True)

    recorder = StepRecorder(model, stack, block_bytes=block_bytes)
    # Python's cycle collector runs at moments that depend on how many Python objects were made, which differs
    # between real and fake tensors; with it paused, every storage is freed when its last reference goes.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _record(recorder, model, batch, optimizer, loss_fn, state, stack)
    finally:
        if gc_was_enabled:
            gc.enable()


def _record(recorder: StepRecorder, model: nn.Module, batch: Batch, optimizer: torch.optim.Optimizer | None,
            loss_fn: Callable[[Any, Batch], torch.Tensor] | None, state: Any,
            stack: list[nn.Module]) -> tuple[Timeline, torch.Tensor]:
    with recorder:
        for name, module in model.named_modules():
            recorder.module_stack.append(name)  # so each parameter's row names the module that owns it
            for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
                recorder.track(t)
            recorder.module_stack.pop()
        if optimizer is not None:
            for st in optimizer.state.values():
                for value in st.values():
                    if isinstance(value, torch.Tensor):
                        recorder.track(value)
        for leaf in tree_flatten(batch)[0]:
            if isinstance(leaf, torch.Tensor):
                recorder.track(leaf)
        recorder.set_phase("forward", "embedding")
        output = run_model(model, batch)
        loss = loss_fn(output, batch) if loss_fn is not None else loss_of(output)
        check_loss(loss, loss_fn is not None)
        del output
        recorder.set_phase("backward", "head")
        loss.backward()
        if optimizer is not None:
            recorder.set_phase("optimizer", "")
            optimizer.step()
        recorder.set_phase("setup", "end")
    recorder.categorize(optimizer)
    tl = recorder.timeline
    tl.meta["phase_flops"] = recorder.phase_flops
    flops: dict[str, int] = {}
    for phase, amount in zip(tl.phases, recorder.phase_flops):
        flops[phase.kind] = flops.get(phase.kind, 0) + amount
    tl.meta["flops"] = flops
    if state is not None:
        tl.meta.setdefault("policy", str(state.policy))
        tl.meta["regions"] = [r.label for r in state.regions]
    else:
        tl.meta.setdefault("policy", "none")
    tl.meta["num_layers"] = len(stack)
    if recorder.host_series:  # fine-grained activation offloading: host memory beside the device timeline
        tl.meta["host_memory"] = {"peak_bytes": max(b for _, b in recorder.host_series),
                                  "offloaded_bytes": recorder.offloaded_bytes,
                                  "offloaded_bytes_by_layer": recorder.offloaded_by_layer,
                                  "series": recorder.host_series}
    routing = getattr(model, "routing_report", None)  # MoE models: the token counts and where they came from
    if callable(routing) and routing() is not None:
        tl.meta["moe_routing"] = routing()
    return tl, loss.detach()


def measure(model: nn.Module, batch: Batch, *, optimizer: torch.optim.Optimizer | None = None,
            loss_fn: Callable[[Any, Batch], torch.Tensor] | None = None,
            layers: str | Sequence[nn.Module] | nn.Module | None = None) -> Timeline:
    """Run one training step of ``model`` on ``batch`` and return its memory :class:`~remat.timeline.Timeline`.

    The step is: gradients reset to None, forward (``model(*batch)`` or ``model(**batch)``), the loss, ``backward()``
    and, when ``optimizer`` is given, ``optimizer.step()``. Every storage allocated and freed on the way is one
    row of the timeline, tagged with its phase (forward/backward/recompute of layer i, head, optimizer) and its
    category (parameters, gradients, saved activations, ...). A recompute policy is whatever
    :func:`remat.recompute.apply` put on the model (or none). The bytes follow the parameters' device: on CPU
    the exact storage sizes; on CUDA the sizes rounded up to the caching allocator's 512-byte blocks, with the
    allocator's own peak over the step (``torch.cuda.max_memory_allocated``) in
    ``meta['cuda_max_memory_allocated']``.

    Args:
        model: the model, in training mode, with at least one parameter that requires grad.
        batch: the model's inputs: a tuple/list of positional arguments or a dict of keyword arguments. For
            the reference GPT (:mod:`remat.models.gpt`), ``(tokens, labels)`` of shape ``[micro_batch, seq]``
            with ids below ``vocab_size``; it is checked before anything runs.
        optimizer: optional; its ``step()`` becomes part of the step (its states are category
            ``optimizer_state``).
        loss_fn: ``loss_fn(output, batch)`` gives the scalar loss; by default the output itself, or its
            ``.loss`` / ``['loss']`` (Hugging Face).
        layers: the decoder layer stack when it is not found automatically (see
            :func:`remat.recompute.find_layer_stack`); by default that of the applied policy.

    Returns:
        The step's :class:`~remat.timeline.Timeline`; ``meta`` holds ``backend``, ``device``, ``policy``,
        ``num_layers``, ``flops`` per phase kind, ``loss`` and ``record_seconds``. With fine-grained activation
        offloading (:mod:`remat.recompute.activation_offload`) the host copies are not device rows: ``meta
        ['host_memory']`` holds ``peak_bytes`` (the most on the host at once), ``offloaded_bytes`` per offload
        module and ``offloaded_bytes_by_layer`` (copied to the host in forward) and ``series``: ``[event, bytes]``
        pairs, the host holding ``bytes`` from that event on; a reloaded copy is a device row of category
        ``saved_activations`` allocated when its group comes back.

    Raises:
        MeasureError: a model that is not a module, has no trainable parameters, is on the meta device or in eval
            mode, is run with gradients disabled (``torch.no_grad()``), a batch that is not a tuple/list/dict, or a
            reference-GPT batch of the wrong shape, dtype or with ids outside the vocabulary; an ``optimizer`` that
            is not a ``torch.optim.Optimizer``, a ``loss_fn`` that is not callable; a loss that is not a scalar
            tensor requiring grad.

    Example::

        >>> from remat.config import ModelConfig
        >>> from remat.models import build_model, sample_batch
        >>> from remat import apply
        >>> config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16)
        >>> model = build_model(config)
        >>> _ = apply(model, "full/uniform/1")
        >>> timeline = measure(model, sample_batch(config))
        >>> timeline.meta["policy"], sum(timeline.at_peak.values()) == timeline.peak_bytes
        ('full/uniform/1', True)
    """
    check_step(model, batch, "measure")
    check_real_step(model, optimizer, loss_fn)
    config = getattr(model, "config", None)
    if isinstance(config, ModelConfig) and loss_fn is None:
        check_reference_batch(config, batch, "measure", exact_shape=isinstance(model, TPGPT))
    device = next(model.parameters()).device
    meta: dict[str, Any] = {"backend": device.type, "device": str(device)}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    start = time.perf_counter()
    tl, loss = record_step(model, batch, optimizer=optimizer, loss_fn=loss_fn, layers=layers,
                           block_bytes=CUDA_BLOCK if device.type == "cuda" else 1)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        meta["cuda_max_memory_allocated"] = torch.cuda.max_memory_allocated(device)
        meta["cuda_allocated_before_step"] = base
    meta["record_seconds"] = time.perf_counter() - start
    meta["loss"] = float(loss)
    tl.meta.update(meta)
    return tl
