"""The plan space: plan modes, objectives and the selective module sets a plan may choose from."""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from remat.policy import CONTRACTION_PREFIX, SELECTIVE_MODULES
from remat.recompute.plan_format import PlanError, usable_set

OBJECTIVES = ("extra_flops", "time")
SELECTIVE_SETS: tuple[tuple[str, ...], ...] = tuple(
    c for n in range(1, len(SELECTIVE_MODULES) + 1) for c in itertools.combinations(SELECTIVE_MODULES, n)
    if usable_set(c))


def contraction_sets(contractions: Iterable[int]) -> tuple[tuple[str, ...], ...]:
    """``non_matmul`` plus ``matmul_k<K>`` for each contraction size: the operator-level sets that also recompute
    the matrix multiplies with the most output bytes per FLOP (see :mod:`remat.policy`)."""
    return tuple(("non_matmul", f"{CONTRACTION_PREFIX}{k}") for k in sorted(set(contractions)))


def selective_sets(modules: str | Iterable[str]) -> tuple[tuple[str, ...], ...]:
    """The selective sets (:data:`SELECTIVE_SETS`) made of ``modules`` only (``'core_attn,mlp'`` or a list): what
    ``plan(selective_sets=...)`` takes to keep the search to some modules (e.g. module-level only)."""
    names = [m.strip() for m in modules.split(",")] if isinstance(modules, str) else list(modules)
    names = [m for m in names if m]
    unknown = [m for m in names if m not in SELECTIVE_MODULES]
    if unknown:
        raise PlanError(f"selective modules {unknown}: valid modules are {', '.join(SELECTIVE_MODULES)} (give none "
                        "to plan without selective layers)")
    return tuple(s for s in SELECTIVE_SETS if set(s) <= set(names))


# What Megatron-LM offers for a dense model's layers (remat's 'act' is MoE-only there).
MEGATRON_MODULES = ("core_attn", "mlp", "layernorm")
