"""The plan space: plan modes, objectives and the selective module sets a plan may choose from."""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from remat.policy import CONTRACTION_PREFIX, SELECTIVE_MODULES
from remat.recompute.plan_format import PlanError, usable_set

# NOTE [plan modes]: a Plan (remat.recompute.plan_format) says, for every layer of the stack, one of four things:
# * keep: the layer keeps every activation its backward needs (no recompute);
# * selective: the named submodules of the layer (core_attn, mlp, layernorm, act; see remat.policy) are checkpointed
#   and recomputed in backward, the rest is kept; or, with non_matmul, the layer keeps only its matrix multiplies'
#   outputs and recomputes every other operator (and the matrix multiplies of core_attn/mlp when named with it, or,
#   with matmul_k<K>, those whose contraction dimension is <= K: the smallest K frees the most bytes per recomputed
#   FLOP); non_matmul alone recomputes no FLOPs and frees most of the layer's bytes. The search offers matmul_k<K>
#   for each contraction size of the layer (contraction_sets); or, with keep_ops(<indices>), the layer keeps the
#   outputs of exactly those operators (remat.recompute.plan_format NOTE [operator sets]); the search offers the
#   prefixes of the layer's operators ordered by recompute price per byte (remat.plan.operator_space NOTE
#   [operator kinds]);
# * checkpoint: the layer belongs to a group of consecutive layers that is one checkpoint: only the group's inputs
#   are kept and the whole group is recomputed in backward (Megatron's full recompute, but the groups may have any
#   sizes and may be anywhere);
# * offload: a checkpoint group whose kept hidden-states input waits for backward in host memory (pinned on CUDA)
#   and is copied back when the group's backward starts (remat.recompute.offload). Gradients are the plain model's,
#   bit for bit.
OBJECTIVES = ("extra_flops", "time")  # PlanOptions' default: "time"
# the selective modules of the reference (dense) GPT's layers: MoE and MLA modules (remat.policy) are not searched
DENSE_MODULES = tuple(m for m in SELECTIVE_MODULES if m in ("core_attn", "mlp", "layernorm", "act", "non_matmul"))
SELECTIVE_SETS: tuple[tuple[str, ...], ...] = tuple(
    c for n in range(1, len(DENSE_MODULES) + 1) for c in itertools.combinations(DENSE_MODULES, n)
    if usable_set(c))


def contraction_sets(contractions: Iterable[int]) -> tuple[tuple[str, ...], ...]:
    """``non_matmul`` plus ``matmul_k<K>`` for each contraction size: the operator-level sets that also recompute
    the matrix multiplies with the most output bytes per FLOP (see :mod:`remat.policy`)."""
    return tuple(("non_matmul", f"{CONTRACTION_PREFIX}{k}") for k in sorted(set(contractions)))


def selective_sets(modules: str | Iterable[str]) -> tuple[tuple[str, ...], ...]:
    """The selective sets (:data:`SELECTIVE_SETS`) made of ``modules`` only (``'core_attn,mlp'`` or a list): what
    ``plan(selective_sets=...)`` takes to keep the search to some modules (e.g. module-level only); ``'none'`` (or
    no module) leaves selective layers out."""
    names = [m.strip() for m in modules.split(",")] if isinstance(modules, str) else list(modules)
    names = [m for m in names if m]
    if names == ["none"]:  # no selective layers (as an empty list)
        return ()
    unknown = [m for m in names if m not in SELECTIVE_MODULES]
    if unknown:
        raise PlanError(f"selective modules {unknown}: valid modules are {', '.join(SELECTIVE_MODULES)} (or none "
                        "alone, to plan without selective layers)")
    return tuple(s for s in SELECTIVE_SETS if set(s) <= set(names))

