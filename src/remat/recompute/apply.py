"""Apply a recompute policy to a PyTorch model's layer stack (:func:`apply`), undo it (:func:`remove`) and find the
stack (:func:`find_layer_stack`)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from torch import nn

import remat.recompute.hf as hf
from remat.models.moe import MoELayer
from remat.policy import CONTRACTION_PREFIX, NON_MATMUL_INCLUDES, OUTPUT_DISCARDING_MODULES, Policy, contraction_limit
from remat.recompute.activation_offload import prepare_offload
from remat.recompute.discard import OutputDiscardingRegion
from remat.recompute.layer_offload import prepare_layer_offload
from remat.recompute.plan_format import KEEP_OPS, kept_operators
from remat.recompute.region import (
    DISCARD_TARGETS,
    LAYER_STACK_PATHS,
    SELECTIVE_TARGETS,
    AppliedPolicy,
    ApplyError,
    RecomputeLayout,
    Region,
)


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
        try:
            members = list(layers)
        except TypeError:  # not iterable (layers=5)
            members = []
        if not members or not all(isinstance(m, nn.Module) for m in members):
            raise ApplyError(f"layers={layers!r}: give a path ('model.layers'), a ModuleList/ModuleDict, or a "
                             "non-empty list of modules")
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


def _mtp_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The transformer layers of remat's multi-token-prediction depths (``model.mtp[k].mtp_model_layer``, NOTE
    [multi-token prediction] in :mod:`remat.models.gpt`), with their names; none for other models."""
    depths = getattr(model, "mtp", None)
    if not isinstance(depths, nn.ModuleList):
        return []
    prefix = next((n for n, m in model.named_modules() if m is depths), "mtp")
    return [(f"{prefix}.{k}.mtp_model_layer", d.mtp_model_layer) for k, d in enumerate(depths)
            if isinstance(getattr(d, "mtp_model_layer", None), nn.Module)]


def _selective_targets(layer: nn.Module, layer_name: str, module: str) -> list[tuple[str, nn.Module]]:
    """The submodules of ``layer`` that selective ``module`` checkpoints; [] when the layer has none (an MoE
    module in a dense layer, mlp in an MoE layer: Megatron's mlp is for dense MLPs only)."""
    found = []
    for rel in SELECTIVE_TARGETS[module] if module not in DISCARD_TARGETS else DISCARD_TARGETS[module][:1]:
        try:
            target = layer.get_submodule(rel)
        except AttributeError:
            continue
        if module in ("mlp", "moe") and isinstance(target, MoELayer) != (module == "moe"):
            continue
        found.append((f"{layer_name}.{rel}", target))
    return found


def _no_targets(stack: list[nn.Module], names: list[str], module: str) -> ApplyError:
    """The error for a selective module that no layer of the stack has, saying what the model lacks."""
    layer, name = stack[0], names[0]
    if module in ("moe", "moe_act", "shared_experts") and not any(isinstance(m, MoELayer) for m in layer.modules()):
        return ApplyError(f"recompute module {module!r} is for MoE layers, but no layer of the stack has one: set "
                          "num_moe_experts (and moe_layer_freq) in the model config, or drop it")
    if module == "shared_experts":
        return ApplyError("recompute module 'shared_experts': the MoE layers have no shared expert: set "
                          "moe_shared_expert_intermediate_size, or drop it")
    if module == "mla_up_proj":
        return ApplyError("recompute module 'mla_up_proj' is for multi-latent attention (Megatron refuses it without "
                          "multi_latent_attention): set multi_latent_attention=True, or drop it")
    candidates = SELECTIVE_TARGETS.get(module) or DISCARD_TARGETS[module][:1]
    children = ", ".join(n for n, _ in layer.named_modules() if n) or "none"
    return ApplyError(f"selective module {module!r}: {name} ({type(layer).__name__}) has none of "
                      f"{', '.join(candidates)}; its submodules are: {children}")


def _discarding_region(index: int, layer: nn.Module, layer_name: str, i: int, module: str) -> Region | None:
    """The output-discarding region of ``module`` in one layer (None when the layer lacks the part)."""
    producer_path, consumer_path = DISCARD_TARGETS[module]
    if module == "moe_act" and isinstance(getattr(layer, "mlp", None), MoELayer) and \
            hasattr(layer.mlp.experts, "local_experts"):
        raise ApplyError(f"recompute module 'moe_act': {layer_name}.mlp.experts are separate expert MLPs "
                         "(moe_grouped_gemm=False), and Megatron refuses moe_act without grouped GEMM ('moe_act in "
                         "recompute_modules is only supported with moe_grouped_gemm'): set moe_grouped_gemm=True, or "
                         "recompute the experts with selective/moe")
    try:
        producer, consumer = layer.get_submodule(producer_path), layer.get_submodule(consumer_path)
    except AttributeError:
        return None
    return OutputDiscardingRegion(index, f"selective:{module}", [producer, consumer],
                                  [f"{layer_name}.{producer_path}", f"{layer_name}.{consumer_path}"], "reentrant",
                                  layer_indices=(i,))


def applied(model: nn.Module) -> AppliedPolicy | None:
    """The policy currently applied to ``model`` by :func:`apply`, or None."""
    _check_module(model, "applied")
    return model.__dict__.get("_remat_applied")


def _check_module(model: object, who: str) -> None:
    if not isinstance(model, nn.Module):
        raise ApplyError(f"{who}(model=...) takes a torch.nn.Module, got {type(model).__name__}")


def remove(model: nn.Module) -> None:
    """Undo :func:`apply`: every module runs its own forward again.

    Args:
        model: a model :func:`apply` was called on (any other model is left as it is).

    Example::

        >>> from remat.config import ModelConfig
        >>> from remat.models import build_model
        >>> model = build_model(ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4))
        >>> _ = apply(model, "full/uniform/1")
        >>> remove(model)
        >>> applied(model) is None
        True
    """
    _check_module(model, "remove")
    state = model.__dict__.pop("_remat_applied", None)
    if state is not None:
        for region in state.regions:
            region.uninstall()
    offload = model.__dict__.pop("_remat_offload", None)  # fine-grained activation offloading
    if offload is not None:
        offload.uninstall()
    layer_offload = model.__dict__.pop("_remat_layer_offload", None)  # TE's layer offloading
    if layer_offload is not None:
        layer_offload.uninstall()


def apply(model: nn.Module, policy: RecomputeLayout | str,
          layers: str | Sequence[nn.Module] | nn.Module | None = None) -> AppliedPolicy:
    """Make ``model`` recompute activations in backward as ``policy`` says, replacing any policy applied before.

    The policy's semantics are Megatron-LM's (see :class:`~remat.policy.Policy`): ``full/uniform/k`` makes
    consecutive groups of k layers one checkpoint each (the last one shorter when k does not divide the depth):
    a group's forward keeps only its input tensors (hidden states, attention mask, rotary tables, ...), and in
    backward the whole group is recomputed, then backpropagated, so while a group's backward runs all k layers'
    activations exist at once (a group of Hugging Face layers of several ``layer_types``, which the model gives
    their own masks, runs layer by layer and keeps each layer's side inputs: NOTE [groups of layers with their own
    inputs] in :mod:`~remat.recompute.region`). ``full/block/k`` checkpoints the first k layers one by one; the
    other layers keep all activations. ``selective/<modules>`` checkpoints the named submodules of every layer
    (attention core, MLP, norms, MLP activation; found through :data:`~remat.recompute.region.SELECTIVE_TARGETS`;
    the transformer layer of remat's multi-token-prediction depths too, as Megatron's MTP runs them).
    ``selective/non_matmul`` (alone or with ``core_attn``/``mlp``) makes each layer one selective activation
    checkpoint (:func:`~remat.recompute.operator_checkpoint.checkpoint_operators`: the semantics and memory of
    torch's ``create_selective_checkpoint_contexts`` with the non-reentrant engine, whatever the engine says):
    the outputs of its matrix multiplies
    (:data:`~remat.recompute.operators.MATMUL_OPS`) are kept, every other operator is recomputed in backward
    from them, and inside the named modules the matrix multiplies too; with ``matmul_k<N>`` also every
    ``mm``/``addmm``/``bmm``/``baddbmm`` whose contraction dimension is <= N. A plan's
    ``selective/keep_ops(...)`` layer runs on the same engine, keeping the listed operators' outputs by index
    (:func:`~remat.recompute.operator_checkpoint.checkpoint_kept_operators`). A policy's ``offload_modules``
    (Megatron's fine-grained activation offloading) keep those modules' saved tensors in host memory between
    forward and backward (:mod:`remat.recompute.activation_offload`).

    Nothing in the model's code changes (NOTE [how regions run] in :mod:`remat.recompute.region`): forwards are
    replaced on the module instances, so parameter names, ``state_dict`` keys and module hooks are those of the
    plain model. Both engines restore the RNG state for the recomputation, so
    dropout masks are the same and gradients equal the plain model's bit for bit. The model can then be compiled
    (``torch.compile(model)``): groups, selective modules and non_matmul layers become torch's checkpoint in the
    graph (NOTE [regions under torch.compile] in :mod:`remat.recompute.region` says which kinds run eagerly).

    Args:
        model: the model; its layer stack is found by :func:`find_layer_stack`. Hugging Face models are
            supported (their own gradient checkpointing must be off; see :mod:`remat.recompute.hf`).
        policy: a :class:`~remat.policy.Policy`, its short form (``'full/uniform/4'``), or any
            :class:`~remat.recompute.region.RecomputeLayout` (e.g. a :class:`~remat.recompute.plan_format.Plan`
            with unequal groups or offloaded group inputs). ``'none'`` restores the plain model.
        layers: the decoder layer stack when it is not found automatically: its path (``'model.layers'``), the
            container, or a list of the layers.

    Returns:
        The :class:`~remat.recompute.region.AppliedPolicy` (policy, stack path, layers, regions); the same object
        is available later through :func:`applied`.

    Raises:
        ApplyError: ``model`` not a module, ``policy`` not a policy, no layer stack found, a selective module the
            layers do not have, a layer object repeated in the stack (naming both positions), an offload module no
            layer has (or grouped-expert modules on separate expert MLPs), or a combination that cannot run (e.g.
            offload with the non-reentrant engine); the model is left unchanged.
        PolicyError: a policy string that does not parse, or ``num_layers`` above the stack's depth.

    Example::

        >>> import torch
        >>> from remat.config import ModelConfig
        >>> from remat.models import build_model, sample_batch
        >>> config = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16)
        >>> model = build_model(config)
        >>> state = apply(model, "full/uniform/2")
        >>> [region.label for region in state.regions]
        ['group 0 (layers 0-1)', 'group 1 (layers 2-3)']
        >>> model(*sample_batch(config)).backward()  # layers 0-1 and 2-3 are recomputed in backward
    """
    if not isinstance(model, nn.Module):
        raise ApplyError(f"apply(model=...) takes a torch.nn.Module, got {type(model).__name__}")
    if isinstance(policy, str):
        policy = Policy.parse(policy)
    elif isinstance(policy, type) or not isinstance(getattr(policy, "engine", None), str) or \
            not all(callable(getattr(policy, name, None)) for name in ("layer_groups", "selective_modules")):
        raise ApplyError(f"apply(policy=...) takes a remat.Policy, its short form such as 'full/uniform/4', or a "
                         f"RecomputeLayout such as a remat.plan Plan; got {type(policy).__name__} {policy!r:.60}")
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
    found: set[str] = set()  # selective modules with a target in some layer
    kinds = hf.side_input_kinds(model, stack) if hf is not None else None  # layers given their own side inputs
    for group in policy.layer_groups(len(stack)):
        regions.append(Region(len(regions), "layers", [stack[i] for i in group], [names[i] for i in group],
                              policy.engine, layer_indices=tuple(group), distribute=distribute,
                              per_layer_inputs=kinds is not None and len({kinds[i] for i in group}) > 1))
        grouped.update(group)
    # Megatron's MTP depths build their transformer layer from the decoder's config, so it runs the same selective
    # modules (multi_token_prediction.py:1655-1736 at d98e8a64): as the last decoder layer's
    mtp = [(name, layer) for name, layer in _mtp_layers(model) if all(layer is not s for s in stack)]
    extra = [(len(stack) - 1, layer, name) for name, layer in mtp] if hf is None and stack else []
    for i, layer, layer_name in [(i, layer, names[i]) for i, layer in enumerate(stack)] + extra:
        modules = policy.selective_modules(i)
        if modules and i in grouped and layer is stack[i]:
            raise ApplyError(f"layer {i} is both in a recomputed group and selectively recomputed: a group already "
                             "recomputes everything in it; drop one of the two")
        if "non_matmul" in modules or kept_operators(modules) is not None:
            regions.append(_operator_level_region(len(regions), layer, layer_name, i, modules))
            found.update(m for m in modules if m not in SELECTIVE_TARGETS and m not in DISCARD_TARGETS
                         or _selective_targets(layer, layer_name, m))
            continue
        for module in modules:
            if module in OUTPUT_DISCARDING_MODULES:
                region = _discarding_region(len(regions), layer, layer_name, i, module)
                if region is not None:
                    regions.append(region)
                    found.add(module)
                continue
            for name, target in _selective_targets(layer, layer_name, module):
                regions.append(Region(len(regions), f"selective:{module}", [target], [name], policy.engine,
                                      layer_indices=(i,)))
                found.add(module)
            if module == "mlp" and isinstance(getattr(layer, "mlp", None), MoELayer):
                found.add(module)  # Megatron's mlp recomputes dense MLPs only: nothing to do in an MoE layer
    missing = [m for i in range(len(stack)) for m in policy.selective_modules(i) if m not in found
               and m != "non_matmul" and not m.startswith(CONTRACTION_PREFIX)]
    if missing:
        raise _no_targets(stack, names, missing[0])
    _mark_offloaded(policy, len(stack), regions)
    for region in regions:
        if region.per_layer_inputs and region.offload_inputs:
            raise ApplyError(f"{region.label}: its layers take different side inputs (attention masks by layer type), "
                             "so it runs layer by layer, and its input cannot be offloaded: drop the offload "
                             "segment, or make groups of layers of one type")
    _refuse_shared_modules(regions, stack, stack_path)
    # the policy's offload_modules (remat.recompute.activation_offload), in the MTP depths' layers too: Megatron's MTP
    # layer is a TransformerLayer whose groups go to the same chunk handler, after the decoder's
    # (multi_token_prediction.py:1361 _proj_and_transformer_layer at d98e8a64)
    offload = prepare_offload(policy, stack + [layer for _, layer in mtp] if hf is None else stack,
                              names + [name for name, _ in mtp] if hf is None else names)
    # TE's layer offloading runs the decoder's layers only (transformer_block.py:714-742; not the MTP depths)
    layer_offload = prepare_layer_offload(policy, stack, names)
    remove(model)
    installed: list[Region] = []
    try:
        for region in regions:
            region.install()
            installed.append(region)
        if offload is not None:  # after the regions: its saved-tensor hooks wrap a checkpoint's saved inputs
            offload.install()
            model.__dict__["_remat_offload"] = offload
        if layer_offload is not None:
            layer_offload.install()
            model.__dict__["_remat_layer_offload"] = layer_offload
    except BaseException:
        for region in installed:
            region.uninstall()
        raise
    state = AppliedPolicy(policy, stack_path, stack, regions)
    model.__dict__["_remat_applied"] = state
    if hf is not None:  # keeps the KV cache out of recomputed layers; drops cores no region uses
        hf.installed(model, state)
    return state


def _refuse_shared_modules(regions: list[Region], stack: list[nn.Module], stack_path: str) -> None:
    """Refuse a module that two regions (or two places of one region) would run: a stack that repeats one layer
    object. The message names both positions in the stack (``layers.1 and layers.3``): the names the model gives
    a shared module are all the same, so positions are what tells them apart."""
    positions: dict[int, list[int]] = {}
    for i, layer in enumerate(stack):
        positions.setdefault(id(layer), []).append(i)
    seen: dict[int, tuple[str, int]] = {}
    for region in regions:
        owned = region.modules[:1] if isinstance(region, OutputDiscardingRegion) else region.modules  # not consumers
        for k, (module, name) in enumerate(zip(owned, region.names)):
            layer = region.layer_indices[min(k, len(region.layer_indices) - 1)] if region.layer_indices else -1
            if id(module) not in seen:
                seen[id(module)] = (name, layer)
                continue
            places = positions.get(id(module), [])
            if len(places) > 1:  # a repeated layer
                where = " and ".join(f"{stack_path}.{i}" for i in places[:2]) + (
                    f" (and {len(places) - 2} more)" if len(places) > 2 else "")
            else:  # a submodule shared by two layers: the model names it once, so say which layers hold it
                first, first_layer = seen[id(module)]
                where = f"{first} (in layer {first_layer}) and {name} (in layer {layer})"
            raise ApplyError(f"{where} are the same module instance: a stack that repeats one layer (or submodule) "
                             "object cannot be checkpointed region by region; build distinct layers (e.g. "
                             "copy.deepcopy)")


def _operator_level_region(index: int, layer: nn.Module, name: str, i: int, modules: Sequence[str]) -> Region:
    """The non_matmul region of one layer; its other modules (core_attn, mlp) recompute their matmuls too."""
    redundant = [m for m in modules if m in NON_MATMUL_INCLUDES]
    if redundant:
        raise ApplyError(f"layer {i}: non_matmul already recomputes {'+'.join(redundant)} (no matrix multiply in "
                         "them): drop them from the selective modules")
    inside = [target for module in modules if module != "non_matmul" and not module.startswith(CONTRACTION_PREFIX)
              and not module.startswith(KEEP_OPS) for _, target in _selective_targets(layer, name, module)]
    return Region(index, "selective:" + "+".join(modules), [layer], [name], "non-reentrant", layer_indices=(i,),
                  matmuls_inside=inside, max_contraction=contraction_limit(modules),
                  kept_ops=kept_operators(modules))  # keep_ops(...): remat.recompute.plan_format


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
    """:mod:`remat.recompute.hf` for a Hugging Face model, else None (nothing is imported unless transformers already
    is)."""
    if "transformers" not in sys.modules:
        return None
    return hf if hf.is_hf_model(model) else None


def _distribute_group(model: nn.Module, policy: RecomputeLayout) -> Any:
    """The tensor-parallel group that --distribute-saved-activations splits group inputs over, if asked."""
    if not getattr(policy, "distribute_saved_activations", False):
        return None
    group = getattr(model, "tp_group", None)
    if group is None or group.size == 1:
        raise ApplyError("distribute_saved_activations splits each group's input across tensor-parallel ranks: it "
                         "needs a tensor-parallel model with tp > 1 (remat.models.tensor_parallel.build_tp_model)")
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
