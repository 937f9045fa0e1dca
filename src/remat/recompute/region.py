"""A recomputed region of a layer stack, and the types that describe what apply() did."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.utils.checkpoint
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from remat.policy import Policy
from remat.recompute.engines import (
    OutputSpec,
    ReentrantCheckpoint,
    RngState,
    first_tensor,
    first_tensor_index,
    in_backward,
    observers,
    same_side_inputs,
    side_inputs,
)
from remat.recompute.offload import OffloadedCheckpoint
from remat.recompute.operator_checkpoint import (
    checkpoint_kept_operators,
    checkpoint_matmuls,
    checkpoint_operators,
    prepare_kept_operators,
)
from remat.recompute.operators import MATMUL_OVERLOADS, contraction
from remat.recompute.stepwise import GroupCalls, StepwiseCheckpoint

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
# Hugging Face attention has no core submodule: remat.recompute.hf inserts "<attention>.core_attention" (see its
# NOTE [the attention core of HF models]).
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
            "mlp.gelu",       # nanoGPT
            "mlp.experts.act_fn"),  # Hugging Face MoE experts (Mixtral, Qwen2-MoE, ...)
    # MoE and MLA (remat's reference model, Megatron's names); "mlp" skips MoE layers, "moe" takes only them
    "moe": ("mlp",),
    "shared_experts": ("mlp.shared_experts",),
}
# Output-discarding modules: (producer whose outputs are discarded, consumer that uses them) inside one layer
DISCARD_TARGETS: dict[str, tuple[str, str]] = {
    "moe_act": ("mlp.experts.activation", "mlp.experts.linear_fc2"),
    "mla_up_proj": ("self_attention.up_proj", "self_attention.core_attention"),
}


class ApplyError(ValueError):
    """The policy cannot be applied to this model; the message says what to change."""


class RecomputeLayout(Protocol):
    """What :func:`apply` needs from a policy or a plan: which layers are checkpointed together and which
    submodules are checkpointed inside the others. :class:`~remat.policy.Policy` is one."""

    engine: str

    def layer_groups(self, depth: int) -> list[tuple[int, ...]]: ...

    def selective_modules(self, layer: int) -> tuple[str, ...]: ...


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
    # keep_ops regions (remat.recompute.plan_format NOTE [operator sets]): the indices of the operators kept
    kept_ops: frozenset[int] | None = None
    # a group whose layers take their own side inputs (HF's sliding and global attention layers): run layer by layer
    per_layer_inputs: bool = False
    _originals: list[Any] = field(default_factory=list, repr=False)
    _running: bool = field(default=False, repr=False)
    _pending: Any = field(default=None, repr=False)
    _next_member: int = field(default=0, repr=False)
    side_inputs: Any = field(default=None, repr=False)
    _inside: int = field(default=0, repr=False)  # how deep the running code is in matmuls_inside modules
    _hooks: list[Any] = field(default_factory=list, repr=False)
    _calls: GroupCalls | None = field(default=None, repr=False)  # per_layer_inputs: the forward in progress

    def __post_init__(self) -> None:
        _disable_compile_on_eager_methods()
        if self.kept_ops is not None:  # its fallback under torch.compile, made now rather than while traced
            prepare_kept_operators()

    @property
    def operator_level(self) -> bool:
        """A non_matmul or keep_ops region: one layer under selective activation checkpointing."""
        return self.kept_ops is not None or (
            self.kind.startswith("selective:") and "non_matmul" in self.kind.split(":", 1)[1].split("+"))

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

    def _keeps_output(self, func: Any, args: tuple[Any, ...]) -> bool:
        """Whether a non_matmul region keeps the output of a matrix multiply (``func`` is one of MATMUL_OVERLOADS):
        outside matmuls_inside, and with a contraction dimension above max_contraction (or none)."""
        if self._inside:
            return False
        k = contraction(func, args)
        return k is None or k > self.max_contraction

    # -- running ------------------------------------------------------------------------------------------
    # NOTE [how regions run]
    # Regions need no change to the model's code. The first module of a region runs the whole region under one
    # checkpoint; the later modules of a multi-layer region, when the model's own loop calls them, hand back the
    # region's output (they check that they were given the previous layer's output, i.e. that the loop is a
    # plain chain h = layer(h, ...), and the same side inputs). Forwards are replaced on the instances, so
    # parameter names, state_dict keys and module hooks are those of the plain model.
    #
    # Engines: reentrant mirrors Megatron's CheckpointFunction (forward under no_grad; backward restores the RNG
    # state, recomputes the region with grad enabled and backpropagates through it); non-reentrant uses
    # torch.utils.checkpoint.checkpoint(use_reentrant=False) with early stop. Both restore the RNG state so
    # dropout masks are the same in the recomputation, and gradients equal the plain model's bit for bit.
    def _forward(self, position: int, *args: Any, **kwargs: Any) -> Any:
        if self._running:  # inside this region's own computation or recomputation
            return self._original_forward(position)(*args, **kwargs)
        if self.per_layer_inputs:
            return self._step(position, args, kwargs)
        if position == 0:
            output = self._run_checkpointed(args, kwargs) if torch.is_grad_enabled() else self._run(args, kwargs)
            if len(self.modules) > 1:
                self._pending, self._next_member = output, 1
                self._side_inputs = side_inputs(args, kwargs)
            return output
        return self._pass_through(position, args, kwargs)

    def _pass_through(self, position: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        output = self._pending
        if output is None or position != self._next_member:
            raise ApplyError(f"{self.names[position]} was called before the first module of its group "
                             f"({self.names[0]}): the model does not run its layers in order; use "
                             "full/uniform/1 or full/block")
        if first_tensor((args, kwargs)) is not first_tensor(output):
            raise ApplyError(f"{self.names[position]} was not given the output of {self.names[position - 1]}: "
                             "the model's loop does work between layers, so a multi-layer group cannot "
                             "be recomputed as one; use full/uniform/1 or full/block")
        if not same_side_inputs(side_inputs(args, kwargs), self._side_inputs):
            self._pending = None
            raise ApplyError(f"{self.names[position]} was given other inputs besides the hidden states (e.g. its "
                             f"own attention mask) than {self.names[0]}, but its group ran every layer with the "
                             "first layer's inputs; use full/uniform/1 or full/block for this model")
        self._next_member += 1
        if self._next_member == len(self.modules):
            self._pending = self._side_inputs = None
        return output

    # NOTE [groups of layers with their own inputs]
    # A group of layers that the model gives different side inputs (Gemma 2/3, Qwen2 with layer_types: sliding-window
    # and global attention layers, each kind with its own mask, Gemma 3 its own rotary tables) cannot run as one call
    # with its first layer's inputs: apply() marks it per_layer_inputs (remat.recompute.hf.side_input_kinds), and
    # each layer runs when the model's loop calls it, on its own inputs (remat.recompute.stepwise.GroupCalls records
    # them). The group is still one checkpoint: reentrant, its layers run under no_grad and the last one under
    # StepwiseCheckpoint, which keeps the group's input and every layer's side inputs (each tensor once) and, in
    # backward, recomputes the whole group from the RNG state taken before its first layer; non-reentrant, torch's
    # checkpoint is opened at the first layer and closed after the last, its recomputation rerunning every layer on
    # its own inputs. The loop sees each layer's true output; gradients equal the plain model's bit for bit. Without
    # gradients (inference) each layer simply runs.
    def _step(self, position: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        calls = self._calls
        if position == 0 or not torch.is_grad_enabled():
            if calls is not None:
                calls.abandon()
            self._calls = calls = GroupCalls() if torch.is_grad_enabled() else None
            if calls is None:
                return self._run_member(position, args, kwargs)
        elif calls is None or position != len(calls):
            raise ApplyError(f"{self.names[position]} was called before the first module of its group "
                             f"({self.names[0]}): the model does not run its layers in order; use "
                             "full/uniform/1 or full/block")
        elif first_tensor((args, kwargs)) is not first_tensor(calls.output):
            self._calls = None
            calls.abandon()
            raise ApplyError(f"{self.names[position]} was not given the output of {self.names[position - 1]}: "
                             "the model's loop does work between layers, so a multi-layer group cannot "
                             "be recomputed as one; use full/uniform/1 or full/block")
        added = calls.record(args, kwargs)
        if not calls.tensors:
            raise ApplyError(f"{self.label} has no tensor inputs to checkpoint")
        for observer in observers:
            observer.on_checkpoint_inputs(self, added)
        last = position == len(self.modules) - 1
        try:
            if self.engine == "non-reentrant":
                if position == 0:
                    calls.open_checkpoint(lambda inputs: self._rerun(calls, inputs))
                output = self._run_member(position, args, kwargs)
                if last:
                    calls.close_checkpoint()
            elif last:
                output = self._close_reentrant(calls, position, args, kwargs)
            else:
                if position == 0:
                    calls.rng = RngState(calls.tensors)
                with torch.no_grad():
                    output = self._run_member(position, args, kwargs)
        except BaseException:
            self._calls = None
            calls.abandon()
            raise
        calls.output = None if last else output  # a reentrant group's backward holds calls: not its output
        if last:
            self._calls = None
        return output

    def _run_member(self, position: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self._running = True
        try:
            return self.modules[position](*args, **kwargs)
        finally:
            self._running = False

    def _close_reentrant(self, calls: GroupCalls, position: int, args: tuple[Any, ...],
                         kwargs: dict[str, Any]) -> Any:
        """The last layer of a per_layer_inputs group under StepwiseCheckpoint: the group's output."""
        if not any(t.requires_grad for t in calls.tensors) and any(
                p.requires_grad for m in self.modules for p in m.parameters()):
            raise ApplyError(f"{self.label}: no input requires grad, so a reentrant checkpoint would give its "
                             "parameters no gradient (as Megatron's and torch's reentrant checkpoints do); use "
                             "the non-reentrant engine ('@non-reentrant') or make the inputs require grad")
        rng = calls.rng if calls.rng is not None else RngState(calls.tensors)  # a one-layer group
        out = OutputSpec(self)
        outputs = iter(StepwiseCheckpoint.apply(lambda: self._run_member(position, args, kwargs),
                                                lambda *inputs: self._rerun(calls, list(inputs)), rng, out,
                                                *calls.tensors))
        return tree_unflatten([next(outputs) if isinstance(leaf, torch.Tensor) else leaf for leaf in out.leaves],
                              out.spec)

    def _rerun(self, calls: GroupCalls, inputs: list[torch.Tensor]) -> Any:
        """Recompute a per_layer_inputs group: every layer on its own recorded inputs."""
        recompute = self._begin()
        try:
            output = None
            for position, module in enumerate(self.modules):
                args, kwargs = calls.arguments(position, inputs, output)
                output = module(*args, **kwargs)
        finally:
            self._end(recompute)
        return output

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        recompute = self._begin()
        try:
            output = self.modules[0](*args, **kwargs)
            for module in self.modules[1:]:
                leaves, spec = tree_flatten((args, kwargs))
                leaves[first_tensor_index(leaves)] = first_tensor(output)
                args, kwargs = tree_unflatten(leaves, spec)
                output = module(*args, **kwargs)
        finally:
            self._end(recompute)
        return output

    def _begin(self) -> bool:
        """The region's modules start running; observers are told when it is the recomputation (returned)."""
        # only observers care whether this is the recomputation (and torch.compile cannot trace the question)
        recompute = bool(observers) and in_backward()
        if recompute:
            for observer in observers:
                observer.on_recompute(self, True)
        self._running = True
        return recompute

    def _end(self, recompute: bool) -> None:
        self._running = False
        if recompute:
            for observer in observers:
                observer.on_recompute(self, False)

    def _run_checkpointed(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        leaves, spec = tree_flatten((args, kwargs))
        tensor_positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        tensors = [leaves[i] for i in tensor_positions]
        if not tensors:
            raise ApplyError(f"{self.label} has no tensor inputs to checkpoint")
        template = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        for observer in observers:
            observer.on_checkpoint_inputs(self, tensors)

        def run(*inputs: torch.Tensor) -> Any:
            filled = list(template)
            for i, tensor in zip(tensor_positions, inputs):
                filled[i] = tensor
            call_args, call_kwargs = tree_unflatten(filled, spec)
            return self._run(call_args, call_kwargs)

        if self.kept_ops is not None:  # the same engine, keeping operators by index
            return checkpoint_kept_operators(run, tensors, self.kept_ops, self.label, ApplyError)
        if self.operator_level:  # remat's lean selective checkpoint (remat.recompute.operator_checkpoint)
            if torch.compiler.is_compiling():
                return self._compiled_operator_level(run, tensors)
            return checkpoint_operators(run, tensors, self._keeps_output, MATMUL_OVERLOADS, self.label)
        if torch.compiler.is_compiling():  # NOTE [regions under torch.compile]
            if self.offload_inputs or self.distribute is not None:
                return self._eager_reentrant(run, tensors)
            return torch.utils.checkpoint.checkpoint(run, *tensors, use_reentrant=False, preserve_rng_state=True)
        if self.engine == "non-reentrant":
            return torch.utils.checkpoint.checkpoint(run, *tensors, use_reentrant=False,
                                                     preserve_rng_state=True)
        if not any(t.requires_grad for t in tensors) and any(
                p.requires_grad for m in self.modules for p in m.parameters()):
            raise ApplyError(f"{self.label}: no input requires grad, so a reentrant checkpoint would give its "
                             "parameters no gradient (as Megatron's and torch's reentrant checkpoints do); use "
                             "the non-reentrant engine ('@non-reentrant') or make the inputs require grad")
        return self._run_reentrant(run, tensors)

    def _run_reentrant(self, run: Callable[..., Any], tensors: list[torch.Tensor]) -> Any:
        out = OutputSpec(self)
        if self.offload_inputs:
            outputs = iter(OffloadedCheckpoint.apply(run, out, *tensors))
        else:
            outputs = iter(ReentrantCheckpoint.apply(run, out, self.distribute, *tensors))
        leaves_out = [next(outputs) if isinstance(leaf, torch.Tensor) else leaf for leaf in out.leaves]
        return tree_unflatten(leaves_out, out.spec)

    def _compiled_operator_level(self, run: Callable[..., Any], tensors: list[torch.Tensor]) -> Any:
        """A non_matmul layer under torch.compile (NOTE [regions under torch.compile])."""
        if self.matmuls_inside:  # the rule needs the module hooks as the operators run: not traceable
            return self._eager_operator_level(run, tensors)
        return checkpoint_matmuls(run, tensors, self.max_contraction)

    def _eager_reentrant(self, run: Callable[..., Any], tensors: list[torch.Tensor]) -> Any:
        return self._run_reentrant(run, tensors)

    def _eager_operator_level(self, run: Callable[..., Any], tensors: list[torch.Tensor]) -> Any:
        return checkpoint_operators(run, tensors, self._keeps_output, MATMUL_OVERLOADS, self.label)


# Region's methods that run eagerly under torch.compile, each a graph break: _step (a group spans several of the
# model's calls), _eager_reentrant and _eager_operator_level (NOTE [regions under torch.compile]).
EAGER_METHODS = ("_step", "_eager_reentrant", "_eager_operator_level")


def _disable_compile_on_eager_methods() -> None:
    """Wrap :data:`EAGER_METHODS` in ``torch.compiler.disable``, once, when the first region is made.

    Not decorators: ``torch.compiler.disable`` imports ``torch._dynamo`` (about a second of every ``remat``
    command's start), and a region must exist before any of them can run, compiled or not.
    """
    if not hasattr(vars(Region)["_step"], "_torchdynamo_disable"):
        for name in EAGER_METHODS:
            setattr(Region, name, torch.compiler.disable(vars(Region)[name]))


# NOTE [regions under torch.compile]
# A model remat.apply was called on can be compiled (torch.compile(model)). Under dynamo a group or a selective
# module region becomes torch.utils.checkpoint.checkpoint(use_reentrant=False), which dynamo turns into the
# tag_activation_checkpoint higher-order operator that AOTAutograd's partitioner honours: it keeps the region's inputs
# only, as Megatron's reentrant CheckpointFunction does (a Python autograd.Function with a callable argument, which
# dynamo cannot trace). A non_matmul layer (with matmul_k<N> or not) becomes torch's selective checkpoint with the
# same rule (checkpoint_matmuls: MUST_SAVE the matrix multiplies it keeps, PREFER_RECOMPUTE every other operator),
# the policy asked once, when the graph is traced, instead of a dispatch mode at every operator of every step.
# Outside the regions the partitioner decides as it does for the plain model (its min-cut recomputes cheap operators,
# so a compiled plan may keep fewer bytes than the same plan run eagerly: measure it). Four kinds run eagerly on
# remat's own engines, each as a graph break: offloaded group inputs and --distribute-saved-activations (reentrant
# engine only), a non_matmul layer that recomputes core_attn or mlp matmuls too (its rule follows module hooks as the
# operators run), and keep_ops layers (their indices count an eager forward's operators; a traced forward runs
# others, e.g. one native_dropout for empty_like, bernoulli_, div_, mul). Gradients: bit for bit those of the
# compiled plain model, and of the eager one, on CPU with aot_eager (tests/recompute/test_compiled_regions.py).
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
