"""Hugging Face transformers models: what :func:`remat.recompute.apply` needs to recompute them the Megatron way
(refusing HF's own gradient checkpointing, an attention-core submodule for ``core_attn``, no KV cache in
recomputed layers), and what a fake trace of one needs to take the real step's mask path (:func:`fake_mask_reads`,
used by :func:`remat.memory.predict.trace`). :func:`~remat.recompute.apply` calls into this module only when
``transformers`` is already imported, so nothing is imported for other models."""

from __future__ import annotations

import contextlib
import copy
import inspect
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from remat.recompute.region import SELECTIVE_TARGETS, AppliedPolicy, ApplyError, RecomputeLayout

# Where a decoder layer keeps its attention module (GPT-2: attn, Llama & co: self_attn, GPT-NeoX: attention,
# Falcon/BLOOM: self_attention).
ATTENTION_PATHS = ("self_attn", "attn", "attention", "self_attention")
CORE_NAME = "core_attention"
PREFIX = "remat:"
_STATE = "_remat_hf"
_registered: dict[str, Callable[..., Any]] = {}


def is_hf_model(model: nn.Module) -> bool:
    """Whether ``model`` is, or contains, a Hugging Face ``PreTrainedModel`` or decoder layer."""
    if "transformers" not in sys.modules:
        return False
    from transformers import PreTrainedModel
    from transformers.modeling_layers import GradientCheckpointingLayer

    return any(isinstance(m, (PreTrainedModel, GradientCheckpointingLayer)) for m in model.modules())


def own_checkpointing(model: nn.Module) -> list[str]:
    """Names of the layers of ``model`` on which HF's own gradient checkpointing is switched on.

    Those are HF's ``GradientCheckpointingLayer`` modules with ``gradient_checkpointing=True`` (any module with
    that flag for models that predate the class); ``activation_checkpointing_enable(every_n_layers=k)`` switches
    on every k-th layer only.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    flagged = [(name, m) for name, m in model.named_modules() if m.__dict__.get("gradient_checkpointing") is True]
    layers = [name for name, m in flagged if isinstance(m, GradientCheckpointingLayer)]
    return layers or [name or "<model>" for name, _ in flagged]


def _pretrained(model: nn.Module) -> nn.Module | None:
    from transformers import PreTrainedModel

    return next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)


# NOTE [HF's own gradient checkpointing]
# HF's own gradient checkpointing (model.activation_checkpointing_enable(), formerly
# gradient_checkpointing_enable()) is refused: remat would recompute layers that already recompute themselves.
# The message names the layers and the call that turns it off.
def check_own_checkpointing(model: nn.Module) -> None:
    """Refuse a model whose HF gradient checkpointing is on, naming the layers and the call that turns it off."""
    names = own_checkpointing(model)
    if not names:
        return
    pretrained = _pretrained(model)
    disable = ("activation_checkpointing_disable" if hasattr(type(pretrained), "activation_checkpointing_disable")
               else "gradient_checkpointing_disable")  # transformers < 5
    where = "model" if pretrained is model or pretrained is None else \
        "model." + next(n for n, m in model.named_modules() if m is pretrained)
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    raise ApplyError(f"{type(model).__name__} has Hugging Face gradient checkpointing enabled on {len(names)} "
                     f"layer(s) ({shown}): call {where}.{disable}() first, so that remat's recompute is not "
                     "stacked on HF's")


# ------------------------------------------------------------------------------------------------ attention core
# NOTE [the attention core of HF models]
# HF attention modules have no submodule for softmax(QK^T)V: they project Q, K and V, apply rotary embeddings,
# then call the function named by config._attn_implementation through HF's AttentionInterface (sdpa, eager,
# flash_attention_2, ...). For selective/core_attn remat inserts a parameter-free CoreAttention submodule,
# <attention>.core_attention, that calls that same function, and registers remat:<implementation> in HF's
# AttentionInterface (and the same mask function in AttentionMaskInterface). The registered function hands each
# call to the calling attention module's core_attention (an attention module without one goes straight to the
# original function), which is then checkpointed like any other selective region. The attention module alone is
# switched to the registered name, through a shallow copy of its config: the model's config (and every other
# model built from it) is left alone, and masks are built as before. So core_attn recomputes, per family:
#
#   family (attention module)               what core_attn recomputes
#   GPT-2 (attn)                            QK^T·scale, causal mask, softmax, attention dropout, ·V
#   Llama, Mistral, Qwen2 (self_attn)       GQA key/value expansion, QK^T·scale, mask (Mistral: sliding window),
#                                           softmax, attention dropout, ·V
#   GPT-NeoX (attention), OPT (self_attn)   QK^T·scale, mask, softmax, attention dropout, ·V
#
# Projections, rotary embeddings and the output projection stay outside (kept), as in Megatron's core_attention.
# With sdpa/flash kernels the saving is the kernel's saved output and statistics; with eager it is the s x s
# scores, probabilities and dropout mask. Falcon computes attention inline (not through AttentionInterface), so
# core_attn is refused for it; its MLP, norms and activation work.
#
# Selective names map onto each family's submodules through remat.recompute.region.SELECTIVE_TARGETS: mlp is the
# mlp submodule (OPT has none: its layer calls fc1, activation_fn and fc2 itself, so mlp is refused for OPT),
# layernorm is every norm of the layer (ln_1/ln_2, input_layernorm/post_attention_layernorm, OPT's
# self_attn_layer_norm/final_layer_norm), act the MLP activation module (mlp.act, mlp.act_fn, OPT's
# activation_fn).
#
# remat.remove(model) leaves the inserted core_attention modules and the attention modules' config copies in
# place; they only call the original attention function, so the model computes exactly as before. Applying a
# policy without core_attn (e.g. apply(model, "none")) takes them out and gives the attention modules back their
# config. Call model.set_attn_implementation(...) before remat.apply, not after: attention modules with a core
# keep the implementation they had when the policy was applied.
class CoreAttention(nn.Module):
    """softmax(QK^T·scale + mask)·V of one HF attention module, as a submodule that can be checkpointed.

    It calls the attention function the model was configured with (``sdpa``, ``eager``, flash ...), with the
    attention module as the function's ``module`` argument, exactly as the attention module would. It holds no
    parameters; the attention module is referenced, not registered (no cycle in ``named_modules``).
    """

    def __init__(self, attention: nn.Module, implementation: str):
        super().__init__()
        object.__setattr__(self, "attention", attention)
        self.implementation = implementation

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, **kwargs: Any) -> Any:
        function = base_function(self.attention, self.implementation)
        return function(self.attention, query, key, value, attention_mask, **kwargs)

    def extra_repr(self) -> str:
        return f"implementation={self.implementation!r}"


def base_function(attention: nn.Module, implementation: str) -> Callable[..., Any]:
    """The attention function ``implementation`` names for ``attention`` (``eager``: its family's own)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = getattr(sys.modules.get(type(attention).__module__), "eager_attention_forward", None)
    if implementation == "eager":
        if eager is None:
            raise ApplyError(f"{type(attention).__name__}: its module has no eager_attention_forward, so its "
                             "eager attention cannot be called as a core; use attn_implementation='sdpa'")
        return eager
    return ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager)


def _dispatcher(implementation: str) -> Callable[..., Any]:
    """The function registered as ``remat:<implementation>``: an attention module's call goes to its core."""

    def remat_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, **kwargs: Any) -> Any:
        core = module._modules.get(CORE_NAME)
        if isinstance(core, CoreAttention):
            return core(query, key, value, attention_mask, **kwargs)
        return base_function(module, implementation)(module, query, key, value, attention_mask, **kwargs)

    remat_attention.__name__ = f"remat_attention_{implementation}"
    return remat_attention


def register(implementation: str) -> str:
    """Register ``remat:<implementation>`` with HF's attention and mask interfaces; return the name."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    name = PREFIX + implementation
    if name not in _registered:
        _registered[name] = _dispatcher(implementation)
        AttentionInterface.register(name, _registered[name])
        # Masks are built by the function registered under the config's name; a name without one gets no mask.
        if implementation in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
            AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[implementation])
    return name


def attention_module(layer: nn.Module) -> tuple[str, nn.Module] | None:
    """(path, module) of a decoder layer's self-attention, or None."""
    for path in ATTENTION_PATHS:
        module = layer._modules.get(path)
        if module is not None:
            return path, module
    return None


def dispatches(attention: nn.Module) -> bool:
    """Whether the attention module calls its core through HF's ``AttentionInterface`` (Falcon does not)."""
    forward = inspect.unwrap(type(attention).forward)
    code = getattr(forward, "__code__", None)
    return code is not None and "ALL_ATTENTION_FUNCTIONS" in code.co_names


@dataclass
class _State:
    """What this module changed on a model: inserted cores, switched configs, cache hooks."""

    cores: list[tuple[nn.Module, Any]] = field(default_factory=list)  # (attention module, its own config)
    hooks: list[Any] = field(default_factory=list)


def _state(model: nn.Module) -> _State:
    return model.__dict__.setdefault(_STATE, _State())


def _base_implementation(config: Any) -> str:
    current = config._attn_implementation or "eager"
    return current[len(PREFIX):] if current.startswith(PREFIX) else current


def _install_core(model: nn.Module, layer: nn.Module, layer_name: str) -> None:
    found = attention_module(layer)
    if found is None:
        raise ApplyError(f"selective module 'core_attn': {layer_name} ({type(layer).__name__}) has none of the "
                         f"attention submodules {', '.join(ATTENTION_PATHS)}")
    path, attention = found
    if isinstance(attention._modules.get(CORE_NAME), CoreAttention):
        return
    if CORE_NAME in attention._modules:
        return  # the model has its own core module: SELECTIVE_TARGETS finds it
    config = getattr(attention, "config", None)
    if config is None or not dispatches(attention):
        raise ApplyError(
            f"selective module 'core_attn': {type(attention).__name__} ({layer_name}.{path}) computes attention "
            "inline instead of through Hugging Face's AttentionInterface, so its core (softmax(QK^T)V) cannot be "
            "recomputed on its own; use selective/mlp, selective/layernorm, selective/act or full recompute")
    implementation = _base_implementation(config)
    if implementation == "eager" and getattr(attention, "reorder_and_upcast_attn", False):
        raise ApplyError(f"selective module 'core_attn': {layer_name}.{path} uses GPT-2's reorder_and_upcast_attn, "
                         "which HF runs only under attn_implementation='eager' outside the AttentionInterface; use "
                         "attn_implementation='sdpa' or reorder_and_upcast_attn=False")
    # The attention module alone sees remat's implementation: a shallow copy of its config (the setter of
    # _attn_implementation would also rewrite the shared sub-configs, so the field is set directly).
    own = copy.copy(config)
    own.__dict__["_attn_implementation_internal"] = register(implementation)
    attention.config = own
    attention.add_module(CORE_NAME, CoreAttention(attention, implementation))
    _state(model).cores.append((attention, config))


def prepare(model: nn.Module, stack: Sequence[nn.Module], names: Sequence[str], policy: RecomputeLayout) -> None:
    """Before :func:`remat.apply` builds its regions: refuse HF checkpointing, add the cores ``policy`` needs."""
    check_own_checkpointing(model)
    for i, layer in enumerate(stack):
        modules = policy.selective_modules(i)
        if "mlp" in modules and not any(p in layer._modules for p in SELECTIVE_TARGETS["mlp"]) \
                and "fc1" in layer._modules and "fc2" in layer._modules:
            raise ApplyError(f"selective module 'mlp': {names[i]} ({type(layer).__name__}) has no MLP submodule: its "
                             "forward calls fc1, activation_fn and fc2 itself (OPT), so they cannot be recomputed as "
                             "one region; use selective/act (the activation's output), selective/layernorm or full")
        if "core_attn" in modules:
            _install_core(model, layer, names[i])


def side_input_kinds(model: nn.Module, stack: Sequence[nn.Module]) -> list[str] | None:
    """Per layer of ``stack``, the kind of side inputs the model's loop gives it, when not every layer gets the same:
    its ``config.layer_types`` entry (Gemma 2/3, Qwen2, ...: ``sliding_attention`` layers get the sliding-window
    mask, ``full_attention`` ones the causal mask, Gemma 3's also their own rotary tables). None when the config has
    one layer type (or none); a full-recompute group of layers of several kinds runs layer by layer (NOTE [groups of
    layers with their own inputs] in :mod:`remat.recompute.region`)."""
    config = getattr(_pretrained(model), "config", None)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    types = getattr(text, "layer_types", None)
    if not isinstance(types, (list, tuple)) or len(set(types)) < 2:
        return None
    kinds = []
    for position, layer in enumerate(stack):
        found = attention_module(layer)
        index = getattr(found[1], "layer_idx", position) if found is not None else position
        if not isinstance(index, int) or not 0 <= index < len(types):
            return None
        kinds.append(str(types[index]))
    return kinds


def installed(model: nn.Module, state: AppliedPolicy) -> None:
    """After :func:`remat.apply` installed its regions: drop cores no region uses, hook the KV cache."""
    hf = _state(model)
    for handle in hf.hooks:
        handle.remove()
    hf.hooks.clear()
    for region in state.regions:
        if region.whole_layers:
            for module in region.modules:
                hf.hooks.append(module.register_forward_pre_hook(_without_cache, with_kwargs=True))
    keep = []
    for attention, config in hf.cores:
        core = attention._modules.get(CORE_NAME)
        if core is not None and ("_remat_region" in core.__dict__ or
                                 any(core in region.matmuls_inside for region in state.regions)):
            keep.append((attention, config))
        else:
            attention._modules.pop(CORE_NAME, None)
            attention.config = config
    hf.cores = keep
    if not hf.hooks and not hf.cores:
        model.__dict__.pop(_STATE, None)


# NOTE [the KV cache in recomputed layers]
# HF models build a DynamicCache in training too (use_cache defaults to True). A layer recomputed in backward
# would append its keys and values to the cache a second time and then attend over both copies, so - as HF's own
# checkpointing does - layers in a full-recompute region (or a non_matmul layer) get cache=None and
# use_cache=False while gradients are enabled. The math is unchanged (the cache is not read when it starts
# empty); the cache returned by such a step is empty.
def _without_cache(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Forward pre-hook of a layer in a full-recompute region: no KV cache while gradients are on."""
    region = module.__dict__.get("_remat_region")
    if region is None or not region.whole_layers or not torch.is_grad_enabled():
        return None  # the policy was removed, or nothing is checkpointed (inference): the cache works as usual
    from transformers.cache_utils import Cache

    if not any(isinstance(a, Cache) for a in args) and not any(isinstance(v, Cache) for v in kwargs.values()) \
            and not kwargs.get("use_cache"):
        return None
    args = tuple(None if isinstance(a, Cache) else a for a in args)
    kwargs = {k: (None if isinstance(v, Cache) else v) for k, v in kwargs.items()}
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    return args, kwargs


# ------------------------------------------------------------------------------------------------ masks in a fake trace
# NOTE [HF masks in a fake trace]
# transformers decides from tensor values whether an attention mask must be built: sdpa gets attn_mask=None and
# is_causal=True when the attention_mask masks no token and the position_ids hold one sequence per row
# (masking_utils: find_packed_sequence_indices, _ignore_causal_mask_sdpa). Those reads are guarded by is_tracing(),
# which counts fake tensors as tracing, so under FakeTensorMode the conservative path was taken: position ids
# treated as packed, a (batch, 1, s, s) bool mask built (plus its index temporaries) and kept all step, and every
# sdpa call given that mask - with GQA that also means repeat_kv copies of keys and values saved per layer instead
# of enable_gqa. The real step skipped all of it, so the prediction was above the measurement (gpu_check's tiny
# HF Llama: +5.6% with no recompute).
#
# fake_mask_reads makes the fake trace take the real step's path: for the reads masking_utils makes at the sites
# below (MASK_READ_SITES), fake tensors no longer count as tracing, and the value read (aten._local_scalar_dense)
# is answered from the real batch (BatchMasks): "no padding" from its attention_mask, "not packed" from its
# position_ids (absent ones are made by the model as an arange: not packed). The tensors of the comparison itself
# (the `== 0`, `.all()`, `sum()` results) are still made, fake, as the real step makes them. A read elsewhere, or
# one whose answer the batch cannot give (a pre-filled KV cache, q_length != kv_length, or a static cache's tensor
# offset), stays traced as before. A batch made by a function under the fake mode has no values: it is taken as
# unpadded and unpacked.
MASK_READ_SITES = {  # masking_utils function -> which fact of the batch its reads ask for
    "find_packed_sequence_indices": "unpacked",
    "_ignore_causal_mask_sdpa": "unpadded",
    "_ignore_bidirectional_mask_sdpa": "unpadded",
    "_can_skip_bidirectional_mask_xpu": "unpadded",
    "create_recurrent_attention_mask": "unpadded",
}
_MASKING_MODULE = "transformers.masking_utils"


@dataclass(frozen=True)
class BatchMasks:
    """What transformers' mask code reads from a batch's values."""

    unpadded: bool = True  # its 2-D attention_mask (if any) masks no token
    unpacked: bool = True  # its position_ids (if any) hold one sequence per row

    @classmethod
    def of(cls, model: nn.Module, batch: Any) -> BatchMasks:
        """The facts of a real ``batch`` for ``model`` (a dict of keyword arguments or a tuple of positional ones);
        a batch that is not real tensors (a function, fake tensors) gives the defaults."""
        from torch._subclasses.fake_tensor import FakeTensor
        from transformers.masking_utils import find_packed_sequence_indices

        if isinstance(batch, dict):
            named = batch
        elif isinstance(batch, (tuple, list)):
            try:
                named = inspect.signature(model.forward).bind_partial(*batch).arguments
            except TypeError:
                named = {}
        else:
            return cls()
        mask, positions = (t if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) and t.dim() == 2
                           else None for t in (named.get("attention_mask"), named.get("position_ids")))
        return cls(unpadded=mask is None or bool((mask == 1).all()),
                   unpacked=positions is None or find_packed_sequence_indices(positions) is None)


def _mask_read_site(frame: Any) -> str | None:
    """The fact a masking_utils read made in ``frame`` asks for, or None when the batch cannot answer it."""
    name = frame.f_code.co_name
    if frame.f_globals.get("__name__") != _MASKING_MODULE or name not in MASK_READ_SITES:
        return None
    if name == "_ignore_causal_mask_sdpa":
        local = frame.f_locals
        if isinstance(local.get("q_offset"), torch.Tensor) or local.get("q_length") not in (1, local.get("kv_length")):
            return None  # a static cache's offset, or a pre-filled cache: other questions than "any padding?"
    return MASK_READ_SITES[name]


class _MaskReads(TorchDispatchMode):
    """Answers masking_utils' reads of fake values (``aten._local_scalar_dense``) from the batch's facts."""

    def __init__(self, facts: BatchMasks):
        super().__init__()
        self.facts = facts

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default and args[0].dtype == torch.bool:
            frame = sys._getframe(1)
            while frame is not None and frame.f_globals.get("__name__") != _MASKING_MODULE:
                frame = frame.f_back
            fact = _mask_read_site(frame) if frame is not None else None
            if fact is not None:
                return getattr(self.facts, fact)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def fake_mask_reads(model: nn.Module, batch: Any) -> Iterator[BatchMasks | None]:
    """Run the block (a fake trace of ``model``, inside ``FakeTensorMode``) with transformers' mask decisions taken
    as the real ``batch`` makes them (NOTE [HF masks in a fake trace]); nothing changes for a model that is not a
    Hugging Face one.

    Args:
        model: the model being traced.
        batch: its inputs as real tensors (a dict of keyword arguments or a tuple of positional ones), or anything
            else (e.g. the function that makes them), which is taken as unpadded and unpacked.

    Returns:
        A context manager yielding the :class:`BatchMasks` used, or None for a model that is not an HF one.

    Example::

        >>> from torch._subclasses.fake_tensor import FakeTensorMode
        >>> with FakeTensorMode(), fake_mask_reads(torch.nn.Linear(2, 2), {}) as facts:
        ...     facts is None
        True
    """
    if not is_hf_model(model):
        yield None
        return
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
    from transformers import masking_utils

    with unset_fake_temporarily():
        facts = BatchMasks.of(model, batch)
    tracing = masking_utils.is_tracing

    def is_tracing(tensor: Any = None) -> bool:
        if isinstance(tensor, FakeTensor) and _mask_read_site(sys._getframe(1)) is not None:
            tensor = None  # the batch answers this read (_MaskReads): only real tracing counts
        return tracing(tensor)

    masking_utils.is_tracing = is_tracing
    try:
        with _MaskReads(facts):
            yield facts
    finally:
        masking_utils.is_tracing = tracing
