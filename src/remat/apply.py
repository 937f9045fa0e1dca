"""Apply a recompute :class:`~remat.policy.Policy` to a PyTorch layer stack.

``apply(model, policy)`` turns runs of modules into *checkpoint regions*, with Megatron-LM's semantics:

* ``full/uniform/k``: consecutive groups of k layers (the last one shorter when k does not divide the depth).
  A group's forward runs without keeping activations; only the group's input tensors (hidden states, attention
  mask, rotary tables, ...) are kept. In backward the whole group is recomputed, then backpropagated, so while a
  group's backward runs all k layers' activations exist at once.
* ``full/block/k``: the first k layers, each its own region; the other layers keep all activations.
* ``selective/<modules>``: the named submodules of every layer (attention core, MLP, norms, MLP activation).
* ``selective/non_matmul`` (alone or with ``core_attn``/``mlp``): each layer is one checkpoint under torch's
  selective activation checkpointing (``torch.utils.checkpoint.create_selective_checkpoint_contexts``, always
  the non-reentrant engine): the outputs of its matrix multiplies (:data:`MATMUL_OPS`) are kept, every other
  operator is recomputed in backward from them, and inside the named modules the matrix multiplies too; with
  ``matmul_k<N>`` also every ``mm``/``addmm``/``bmm``/``baddbmm`` whose contraction dimension is <= N.

Regions need no change to the model's code. The first module of a region runs the whole region under one
checkpoint; the later modules of a multi-layer region, when the model's own loop calls them, hand back the
region's output (they check that they were given the previous layer's output, i.e. that the loop is a plain
chain ``h = layer(h, ...)``). Forwards are replaced on the instances, so parameter names, ``state_dict`` keys
and module hooks are those of the plain model.

Engines: ``reentrant`` mirrors Megatron's ``CheckpointFunction`` (forward under ``no_grad``; backward restores
the RNG state, recomputes the region with grad enabled and backpropagates through it); ``non-reentrant`` uses
``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` with early stop. Both restore the RNG state so
dropout masks are the same in the recomputation, and gradients equal the plain model's bit for bit.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.utils.checkpoint
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_unflatten

from remat.policy import CONTRACTION_PREFIX, NON_MATMUL_INCLUDES, Policy, contraction_limit

# Where common model families keep their decoder layers, most specific first.
LAYER_STACK_PATHS = (
    "layers",                 # remat's reference GPT, torchtitan (ModuleDict)
    "model.layers",           # Llama, Mistral, Qwen2, Gemma (Hugging Face)
    "transformer.h",          # GPT-2, nanoGPT, Falcon
    "model.decoder.layers",   # OPT
    "gpt_neox.layers",        # GPT-NeoX, Pythia
    "transformer.blocks",     # MPT
    "decoder.layers",
    "encoder.layers",
    "h",
    "blocks",
)

# Selective module name -> candidate submodule paths inside one layer; every candidate present is recomputed.
# Hugging Face attention has no core submodule: remat.hf inserts "<attention>.core_attention" (see its docstring).
SELECTIVE_TARGETS: dict[str, tuple[str, ...]] = {
    "core_attn": ("self_attention.core_attention", "attn.core_attention", "self_attn.core_attention",
                  "attention.core_attention",   # GPT-NeoX
                  "attention.sdpa"),            # torchtitan (its ScaledDotProductAttention module)
    "mlp": ("mlp", "feed_forward", "ffn"),
    "layernorm": ("input_layernorm", "pre_mlp_layernorm", "post_attention_layernorm", "ln_1", "ln_2",
                  "attention_norm", "ffn_norm",
                  "self_attn_layer_norm", "final_layer_norm",      # OPT
                  "ln_attn", "ln_mlp",                              # Falcon (new decoder architecture)
                  "pre_feedforward_layernorm", "post_feedforward_layernorm"),  # Gemma 2/3
    "act": ("mlp.activation", "mlp.act_fn", "mlp.act", "feed_forward.act_fn",
            "activation_fn",  # OPT
            "mlp.gelu"),      # nanoGPT
}


def _aten_packets(*names: str) -> frozenset[Any]:
    return frozenset(getattr(torch.ops.aten, n) for n in names if hasattr(torch.ops.aten, n))


# Operators whose outputs a non_matmul region keeps: the matrix multiplies that nn.Linear, torch.matmul and the
# attention kernels reach at the dispatcher. They are the operators FLOP counters count, so recomputing the others
# costs no FLOPs.
MATMUL_OPS = _aten_packets(
    "mm", "addmm", "bmm", "baddbmm", "convolution", "_scaled_mm",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward", "_efficient_attention_forward")


def contraction(func: Any, args: Sequence[Any]) -> int | None:
    """The contraction dimension K of a matrix multiply (``mm``/``bmm``: ``a @ b``; ``addmm``/``baddbmm``:
    ``c + a @ b``): each output element costs 2K FLOPs. None for the other :data:`MATMUL_OPS`."""
    packet = func.overloadpacket
    if packet in (torch.ops.aten.mm, torch.ops.aten.bmm):
        return int(args[0].shape[-1])
    if packet in (torch.ops.aten.addmm, torch.ops.aten.baddbmm):
        return int(args[1].shape[-1])
    return None


class ApplyError(ValueError):
    """The policy cannot be applied to this model; the message says what to change."""


class RecomputeLayout(Protocol):
    """What :func:`apply` needs from a policy or a plan: which layers are checkpointed together and which
    submodules are checkpointed inside the others. :class:`~remat.policy.Policy` is one."""

    engine: str

    def layer_groups(self, depth: int) -> list[tuple[int, ...]]: ...

    def selective_modules(self, layer: int) -> tuple[str, ...]: ...


class CheckpointObserver(Protocol):
    """What a region reports while it runs (used by measurement to tag bytes)."""

    def on_checkpoint_inputs(self, region: Region, tensors: Sequence[torch.Tensor]) -> None: ...

    def on_recompute(self, region: Region, begin: bool) -> None: ...


_observers: list[CheckpointObserver] = []


def add_observer(observer: CheckpointObserver) -> None:
    _observers.append(observer)


def remove_observer(observer: CheckpointObserver) -> None:
    _observers.remove(observer)


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _first_tensor_index(leaves: list[Any]) -> int | None:
    return next((i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)), None)


def _first_tensor(value: Any) -> torch.Tensor | None:
    leaves = tree_flatten(value)[0]
    i = _first_tensor_index(leaves)
    return None if i is None else leaves[i]


def _side_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], Any]:
    """A call's inputs other than the hidden states (its first tensor), with their structure."""
    leaves, spec = tree_flatten((args, kwargs))
    first = _first_tensor_index(leaves)
    return [leaf for i, leaf in enumerate(leaves) if i != first], spec


def _same_side_inputs(a: tuple[list[Any], Any], b: tuple[list[Any], Any]) -> bool:
    if a[1] != b[1] or len(a[0]) != len(b[0]):
        return False
    for x, y in zip(a[0], b[0]):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if x is not y:
                return False
        elif x is not y and x != y:
            return False
    return True


class _RngState:
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


class _OutputSpec:
    """Carries the region in, and the pytree structure of its output out of, ``autograd.Function.forward``."""

    def __init__(self, region: Region):
        self.region = region
        self.spec: Any = None
        self.leaves: list[Any] = []


class _ReentrantCheckpoint(torch.autograd.Function):
    """Megatron's ``CheckpointFunction``: keep the inputs and RNG state, recompute the region in backward."""

    @staticmethod
    def forward(ctx: Any, run: Callable[..., Any], out: _OutputSpec, distribute: Any, *inputs: torch.Tensor) -> Any:
        ctx.run = run
        ctx.rng = _RngState(inputs)
        with torch.no_grad():
            result = run(*inputs)
        ctx.distribute = distribute
        if distribute is not None:
            # Megatron's --distribute-saved-activations: keep 1/tp of the hidden states, gather in backward
            hidden = inputs[0]
            ctx.hidden_shape = hidden.shape
            hidden.data = distribute.shard(hidden.data.reshape(-1))
            for observer in _observers:
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
        return (None, None, None, *_recompute_and_backpropagate(ctx, inputs, grad_outputs))


def _recompute_and_backpropagate(ctx: Any, inputs: list[torch.Tensor],
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


# ------------------------------------------------------------------------------------------ input offloading
# Used by remat.plan's "offload" segments: a full-recompute group whose kept input (the hidden states) waits for
# backward in host memory instead of device memory. Only the hidden states move; side inputs (attention mask,
# rotary tables) are shared by every layer and stay where they are.
#
# How it shows in measure/predict timelines (which record device memory): the copies are made with the
# TorchDispatchMode stack suspended, so the recorder does not see the host copy. It sees the device input freed
# once the group's forward has let go of it, and, in backward, the restored input first used (so allocated) at the
# start of the group's recomputation, then freed with the group's other recomputed tensors. On CUDA the host copy
# is pinned memory and both copies run on a side stream (device-to-host overlaps the next layers' forward; the
# restore is issued when the group's backward starts and the compute stream waits for it). On CPU the "device" is
# the CPU itself: the host copy is an ordinary CPU tensor that the timeline counts as offloaded, i.e. not at all,
# and it becomes the restored input (no second copy). Under FakeTensorMode the copies are fake (no memory).
_TRANSFER_STREAMS: dict[torch.device, Any] = {}


def _transfer_stream(device: torch.device) -> Any:
    if device not in _TRANSFER_STREAMS:
        _TRANSFER_STREAMS[device] = torch.cuda.Stream(device)
    return _TRANSFER_STREAMS[device]


def offload_to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of ``tensor`` (pinned memory when it is on CUDA), made unseen by dispatch-mode recorders."""
    with _disable_current_modes():
        if tensor.device.type != "cuda":
            return tensor.detach().to("cpu", copy=True)
        stream = _transfer_stream(tensor.device)
        stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(stream):
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
        tensor.record_stream(stream)  # its memory is not reused before the copy has read it
        return host


def restore_from_host(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` back on ``device`` (see :func:`offload_to_host`); on CPU the host copy itself is returned."""
    with _disable_current_modes():
        if device.type != "cuda":
            return host
        stream = _transfer_stream(device)
        with torch.cuda.stream(stream):
            restored = host.to(device, non_blocking=True)
        current = torch.cuda.current_stream(device)
        current.wait_stream(stream)
        restored.record_stream(current)
        return restored


class _OffloadedCheckpoint(torch.autograd.Function):
    """:class:`_ReentrantCheckpoint` whose kept hidden-states input (the first tensor) waits in host memory."""

    @staticmethod
    def forward(ctx: Any, run: Callable[..., Any], out: _OutputSpec, *inputs: torch.Tensor) -> Any:
        ctx.run = run
        ctx.rng = _RngState(inputs)
        hidden = inputs[0]
        ctx.hidden_device, ctx.hidden_requires_grad = hidden.device, hidden.requires_grad
        ctx.host = offload_to_host(hidden)
        with torch.no_grad():
            result = run(*inputs)
        ctx.save_for_backward(*inputs[1:])
        out.leaves, out.spec = tree_flatten(result)
        return tuple(leaf for leaf in out.leaves if isinstance(leaf, torch.Tensor))

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden = restore_from_host(ctx.host, ctx.hidden_device)
        ctx.host = None
        inputs = [hidden.detach().requires_grad_(ctx.hidden_requires_grad)]
        inputs += [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        del hidden
        return (None, None, *_recompute_and_backpropagate(ctx, inputs, grad_outputs))


def group_label(index: int, layers: Sequence[int]) -> str:
    """How reports name a full-recompute group: 'group 1 (layers 4-7)', 'group 0 (layer 0)'."""
    first, last = layers[0], layers[-1]
    return f"group {index} (layers {first}-{last})" if last > first else f"group {index} (layer {first})"


@dataclass(eq=False)
class Region:
    """A run of modules that is checkpointed as one unit (a layer group, or one submodule)."""

    index: int
    kind: str                       # "layers", "selective:<module>", or "selective:<modules with non_matmul>"
    modules: list[nn.Module]
    names: list[str]
    engine: str
    layer_indices: tuple[int, ...] = ()
    distribute: Any = None          # a tensor-parallel group: keep 1/tp of the hidden input (reentrant only)
    offload_inputs: bool = False    # keep the hidden-states input in host memory (remat.plan; reentrant)
    # non_matmul regions: submodules whose matrix multiplies are recomputed too (the layer's core_attn / mlp), and
    # the largest contraction dimension of the matmuls recomputed anywhere in the layer (matmul_k<N>; 0: none)
    matmuls_inside: list[nn.Module] = field(default_factory=list)
    max_contraction: int = 0
    _originals: list[Any] = field(default_factory=list, repr=False)
    _running: bool = field(default=False, repr=False)
    _pending: Any = field(default=None, repr=False)
    _next_member: int = field(default=0, repr=False)
    _side_inputs: Any = field(default=None, repr=False)
    _inside: int = field(default=0, repr=False)  # how deep the running code is in matmuls_inside modules
    _hooks: list[Any] = field(default_factory=list, repr=False)

    @property
    def operator_level(self) -> bool:
        """A non_matmul region: one layer under selective activation checkpointing."""
        return self.kind.startswith("selective:") and "non_matmul" in self.kind.split(":", 1)[1].split("+")

    @property
    def whole_layers(self) -> bool:
        """Whether the region re-runs whole layers (a group, or a non_matmul layer)."""
        return self.kind == "layers" or self.operator_level

    @property
    def label(self) -> str:
        if self.kind == "layers":
            return group_label(self.index, self.layer_indices)
        return f"{self.kind.split(':', 1)[1]} in {self.names[0]}"

    # -- installation -------------------------------------------------------------------------------------
    def install(self) -> None:
        for position, module in enumerate(self.modules):
            if "_remat_region" in module.__dict__:
                raise ApplyError(f"module {self.names[position]} is already in a recompute region: "
                                 "nested regions are not supported; use one policy")
            self._originals.append(module.__dict__.get("forward"))
            module.__dict__["forward"] = functools.partial(self._forward, position)
            module.__dict__["_remat_region"] = self
        for module in self.matmuls_inside:
            self._hooks += [module.register_forward_pre_hook(self._enter_inside),
                            module.register_forward_hook(self._leave_inside, always_call=True)]

    def uninstall(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        for module, original in zip(self.modules, self._originals):
            del module.__dict__["_remat_region"]
            if original is None:
                del module.__dict__["forward"]
            else:
                module.__dict__["forward"] = original
        self._originals.clear()

    def _original_forward(self, position: int) -> Callable[..., Any]:
        original = self._originals[position]
        module = self.modules[position]
        return original if original is not None else type(module).forward.__get__(module)

    def _enter_inside(self, module: nn.Module, args: Any) -> None:
        self._inside += 1

    def _leave_inside(self, module: nn.Module, args: Any, output: Any) -> None:
        self._inside -= 1

    def _keep_output(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> torch.utils.checkpoint.CheckpointPolicy:
        """The selective-checkpoint policy of a non_matmul region: keep matmul outputs outside matmuls_inside."""
        if self._inside == 0 and func.overloadpacket in MATMUL_OPS:
            k = contraction(func, args)
            if k is None or k > self.max_contraction:
                return torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE
        return torch.utils.checkpoint.CheckpointPolicy.PREFER_RECOMPUTE

    # -- running ------------------------------------------------------------------------------------------
    def _forward(self, position: int, *args: Any, **kwargs: Any) -> Any:
        if self._running:  # inside this region's own computation or recomputation
            return self._original_forward(position)(*args, **kwargs)
        if position == 0:
            output = self._run_checkpointed(args, kwargs) if torch.is_grad_enabled() else self._run(args, kwargs)
            if len(self.modules) > 1:
                self._pending, self._next_member = output, 1
                self._side_inputs = _side_inputs(args, kwargs)
            return output
        return self._pass_through(position, args, kwargs)

    def _pass_through(self, position: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        output = self._pending
        if output is None or position != self._next_member:
            raise ApplyError(f"{self.names[position]} was called before the first module of its group "
                             f"({self.names[0]}): the model does not run its layers in order; use "
                             "full/uniform/1 or full/block")
        if _first_tensor((args, kwargs)) is not _first_tensor(output):
            raise ApplyError(f"{self.names[position]} was not given the output of {self.names[position - 1]}: "
                             "the model's loop does work between layers, so a multi-layer group cannot "
                             "be recomputed as one; use full/uniform/1 or full/block")
        if not _same_side_inputs(_side_inputs(args, kwargs), self._side_inputs):
            self._pending = None
            raise ApplyError(f"{self.names[position]} was given other inputs besides the hidden states (e.g. its "
                             f"own attention mask) than {self.names[0]}, but its group ran every layer with the "
                             "first layer's inputs; use full/uniform/1 or full/block for this model")
        self._next_member += 1
        if self._next_member == len(self.modules):
            self._pending = self._side_inputs = None
        return output

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        recompute = in_backward()
        if recompute:
            for observer in _observers:
                observer.on_recompute(self, True)
        self._running = True
        try:
            output = self.modules[0](*args, **kwargs)
            for module in self.modules[1:]:
                leaves, spec = tree_flatten((args, kwargs))
                leaves[_first_tensor_index(leaves)] = _first_tensor(output)
                args, kwargs = tree_unflatten(leaves, spec)
                output = module(*args, **kwargs)
        finally:
            self._running = False
            if recompute:
                for observer in _observers:
                    observer.on_recompute(self, False)
        return output

    def _run_checkpointed(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        leaves, spec = tree_flatten((args, kwargs))
        tensor_positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        tensors = [leaves[i] for i in tensor_positions]
        if not tensors:
            raise ApplyError(f"{self.label} has no tensor inputs to checkpoint")
        template = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        for observer in _observers:
            observer.on_checkpoint_inputs(self, tensors)

        def run(*inputs: torch.Tensor) -> Any:
            filled = list(template)
            for i, tensor in zip(tensor_positions, inputs):
                filled[i] = tensor
            call_args, call_kwargs = tree_unflatten(filled, spec)
            return self._run(call_args, call_kwargs)

        if self.operator_level:
            contexts = functools.partial(torch.utils.checkpoint.create_selective_checkpoint_contexts,
                                         self._keep_output)
            return torch.utils.checkpoint.checkpoint(run, *tensors, use_reentrant=False, preserve_rng_state=True,
                                                     context_fn=contexts)
        if self.engine == "non-reentrant":
            return torch.utils.checkpoint.checkpoint(run, *tensors, use_reentrant=False,
                                                     preserve_rng_state=True)
        if not any(t.requires_grad for t in tensors) and any(
                p.requires_grad for m in self.modules for p in m.parameters()):
            raise ApplyError(f"{self.label}: no input requires grad, so a reentrant checkpoint would give its "
                             "parameters no gradient (as Megatron's and torch's reentrant checkpoints do); use "
                             "the non-reentrant engine ('@non-reentrant') or make the inputs require grad")
        out = _OutputSpec(self)
        if self.offload_inputs:
            outputs = iter(_OffloadedCheckpoint.apply(run, out, *tensors))
        else:
            outputs = iter(_ReentrantCheckpoint.apply(run, out, self.distribute, *tensors))
        leaves_out = [next(outputs) if isinstance(leaf, torch.Tensor) else leaf for leaf in out.leaves]
        return tree_unflatten(leaves_out, out.spec)


@dataclass
class AppliedPolicy:
    """What :func:`apply` did: the policy, where the layer stack is, and the checkpoint regions."""

    policy: Policy
    stack_path: str
    layers: list[nn.Module]
    regions: list[Region]

    @property
    def depth(self) -> int:
        return len(self.layers)


def find_layer_stack(model: nn.Module, layers: str | Sequence[nn.Module] | nn.Module | None = None,
                     ) -> tuple[str, list[nn.Module]]:
    """Return ``(path, layers)`` of the model's decoder layer stack.

    ``layers`` may name the container (``"model.layers"``), or be the container or a list of the layers.
    Without it, the common layouts (:data:`LAYER_STACK_PATHS`) are tried, then the one largest
    ``nn.ModuleList``/``nn.ModuleDict`` of same-typed modules.
    """
    if layers is not None:
        if isinstance(layers, str):
            try:
                container = model.get_submodule(layers)
            except AttributeError as err:
                raise ApplyError(f"layers={layers!r}: the model has no submodule at that path") from err
            return layers, _stack_members(container, layers)
        if isinstance(layers, nn.Module):
            path = next((n for n, m in model.named_modules() if m is layers), "<layers>")
            return path, _stack_members(layers, path)
        members = list(layers)
        if not members or not all(isinstance(m, nn.Module) for m in members):
            raise ApplyError("layers= must be a path, a ModuleList/ModuleDict, or a non-empty list of modules")
        return "<layers>", members
    for path in LAYER_STACK_PATHS:
        try:
            container = model.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(container, (nn.ModuleList, nn.ModuleDict)) and len(container) > 0:
            return path, _stack_members(container, path)
    candidates = [(n, m) for n, m in model.named_modules()
                  if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and len(m) > 1
                  and len({type(c) for c in m.children()}) == 1]
    if candidates:
        path, container = max(candidates, key=lambda c: len(c[1]))
        return path, _stack_members(container, path)
    raise ApplyError(f"could not find the layer stack of {type(model).__name__}: none of the usual paths "
                     f"({', '.join(LAYER_STACK_PATHS[:5])}, ...) holds an nn.ModuleList; pass "
                     "layers='path.to.the.ModuleList' (or the layers themselves)")


def _stack_members(container: nn.Module, path: str) -> list[nn.Module]:
    if isinstance(container, nn.ModuleDict):
        return list(container.values())
    if isinstance(container, nn.ModuleList):
        return list(container)
    raise ApplyError(f"layers={path!r} is a {type(container).__name__}, not an nn.ModuleList or "
                     "nn.ModuleDict: name the container that holds the layers")


def _selective_targets(layer: nn.Module, layer_name: str, module: str) -> list[tuple[str, nn.Module]]:
    found = []
    for rel in SELECTIVE_TARGETS[module]:
        try:
            found.append((f"{layer_name}.{rel}", layer.get_submodule(rel)))
        except AttributeError:
            continue
    if not found:
        children = ", ".join(n for n, _ in layer.named_modules() if n) or "none"
        raise ApplyError(f"selective module {module!r}: {layer_name} ({type(layer).__name__}) has none of "
                         f"{', '.join(SELECTIVE_TARGETS[module])}; its submodules are: {children}")
    return found


def applied(model: nn.Module) -> AppliedPolicy | None:
    """The policy currently applied to ``model`` by :func:`apply`, or None."""
    return model.__dict__.get("_remat_applied")


def remove(model: nn.Module) -> None:
    """Undo :func:`apply`: every module runs its own forward again."""
    state = model.__dict__.pop("_remat_applied", None)
    if state is not None:
        for region in state.regions:
            region.uninstall()


def apply(model: nn.Module, policy: RecomputeLayout | str,
          layers: str | Sequence[nn.Module] | nn.Module | None = None) -> AppliedPolicy:
    """Apply ``policy`` to ``model``'s layer stack, replacing any policy applied before.

    ``policy`` may be a :class:`Policy`, its string form (``"full/uniform/4"``), or any
    :class:`RecomputeLayout` (e.g. a plan with unequal groups). ``layers`` names the stack
    when it is not found automatically (see :func:`find_layer_stack`). ``Policy.parse("none")`` restores the
    plain model. Returns what was applied; the same object is available later through :func:`applied`.
    """
    if isinstance(policy, str):
        policy = Policy.parse(policy)
    hf = _hugging_face(model)
    if hf is None and getattr(model, "is_gradient_checkpointing", False):
        raise ApplyError(f"{type(model).__name__} has Hugging Face gradient checkpointing enabled: call "
                         "model.gradient_checkpointing_disable() first so that recompute is not stacked")
    stack_path, stack = find_layer_stack(model, layers)
    names = _layer_names(model, stack, stack_path)
    if hf is not None:  # refuses HF's own checkpointing; gives attention modules a core_attention submodule
        hf.prepare(model, stack, names, policy)
    distribute = _distribute_group(model, policy)
    regions: list[Region] = []
    grouped: set[int] = set()
    for group in policy.layer_groups(len(stack)):
        regions.append(Region(len(regions), "layers", [stack[i] for i in group], [names[i] for i in group],
                              policy.engine, layer_indices=tuple(group), distribute=distribute))
        grouped.update(group)
    for i, layer in enumerate(stack):
        modules = policy.selective_modules(i)
        if modules and i in grouped:
            raise ApplyError(f"layer {i} is both in a recomputed group and selectively recomputed: a group already "
                             "recomputes everything in it; drop one of the two")
        if "non_matmul" in modules:
            regions.append(_operator_level_region(len(regions), layer, names[i], i, modules))
            continue
        for module in modules:
            for name, target in _selective_targets(layer, names[i], module):
                regions.append(Region(len(regions), f"selective:{module}", [target], [name], policy.engine,
                                      layer_indices=(i,)))
    _mark_offloaded(policy, len(stack), regions)
    seen: dict[int, str] = {}
    for region in regions:
        for module, name in zip(region.modules, region.names):
            if id(module) in seen:
                raise ApplyError(f"{name} and {seen[id(module)]} are the same module instance: a stack that "
                                 "repeats one layer object cannot be checkpointed region by region; build "
                                 "distinct layers (e.g. copy.deepcopy)")
            seen[id(module)] = name
    remove(model)
    installed: list[Region] = []
    try:
        for region in regions:
            region.install()
            installed.append(region)
    except BaseException:
        for region in installed:
            region.uninstall()
        raise
    state = AppliedPolicy(policy, stack_path, stack, regions)
    model.__dict__["_remat_applied"] = state
    if hf is not None:  # keeps the KV cache out of recomputed layers; drops cores no region uses
        hf.installed(model, state)
    return state


def _operator_level_region(index: int, layer: nn.Module, name: str, i: int, modules: Sequence[str]) -> Region:
    """The non_matmul region of one layer; its other modules (core_attn, mlp) recompute their matmuls too."""
    redundant = [m for m in modules if m in NON_MATMUL_INCLUDES]
    if redundant:
        raise ApplyError(f"layer {i}: non_matmul already recomputes {'+'.join(redundant)} (no matrix multiply in "
                         "them): drop them from the selective modules")
    inside = [target for module in modules if module != "non_matmul" and not module.startswith(CONTRACTION_PREFIX)
              for _, target in _selective_targets(layer, name, module)]
    return Region(index, "selective:" + "+".join(modules), [layer], [name], "non-reentrant", layer_indices=(i,),
                  matmuls_inside=inside, max_contraction=contraction_limit(modules))


def _mark_offloaded(policy: RecomputeLayout, depth: int, regions: list[Region]) -> None:
    """Set ``offload_inputs`` on the group regions that ``policy.offload_groups(depth)`` names (a plan's offload
    segments, :mod:`remat.plan`); a layout without that method offloads nothing."""
    offload_groups = getattr(policy, "offload_groups", None)
    if offload_groups is None:
        return
    groups = {tuple(g) for g in offload_groups(depth)}
    if not groups:
        return
    if policy.engine != "reentrant":
        raise ApplyError("offloading group inputs works with the reentrant engine (the inputs are kept by remat's "
                         "own checkpoint function): use engine='reentrant' for a plan with offload segments")
    found = set()
    for region in regions:
        if region.kind == "layers" and region.layer_indices in groups:
            if region.distribute is not None:
                raise ApplyError(f"{region.label}: a group input cannot be both offloaded and distributed across "
                                 "tensor-parallel ranks; drop one of the two")
            region.offload_inputs = True
            found.add(region.layer_indices)
    missing = sorted(groups - found)
    if missing:
        raise ApplyError(f"offload_groups names {missing}, which are not checkpoint groups of layer_groups(): an "
                         "offloaded group must also be one of the layout's layer groups")


def _hugging_face(model: nn.Module) -> Any:
    """:mod:`remat.hf` for a Hugging Face model, else None (nothing is imported unless transformers already is)."""
    if "transformers" not in sys.modules:
        return None
    from remat import hf

    return hf if hf.is_hf_model(model) else None


def _distribute_group(model: nn.Module, policy: RecomputeLayout) -> Any:
    """The tensor-parallel group that --distribute-saved-activations splits group inputs over, if asked."""
    if not getattr(policy, "distribute_saved_activations", False):
        return None
    group = getattr(model, "tp_group", None)
    if group is None or group.size == 1:
        raise ApplyError("distribute_saved_activations splits each group's input across tensor-parallel ranks: it "
                         "needs a tensor-parallel model with tp > 1 (remat.parallel.build_tp_model)")
    if getattr(model, "sp", False):
        raise ApplyError("distribute_saved_activations is refused with sequence parallelism (as in Megatron): the "
                         "group inputs are already split; drop one of the two")
    if policy.engine != "reentrant":
        raise ApplyError("distribute_saved_activations works with the reentrant engine (Megatron's "
                         "CheckpointFunction); drop '@non-reentrant'")
    return group


def _layer_names(model: nn.Module, stack: list[nn.Module], stack_path: str) -> list[str]:
    by_module = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    return [by_module.get(id(layer), f"{stack_path}.{i}") for i, layer in enumerate(stack)]
