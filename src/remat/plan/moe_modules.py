"""Megatron's MoE and MLA recompute modules (moe_act, moe, shared_experts, mla_up_proj) in the planners' searches:
the selective settings of an MoE/MLA model and their units in a layer kind's unit model (NOTE [MoE modules in the
search])."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Sequence

from remat.config import ModelConfig
from remat.plan.costs import CostModel
from remat.plan.megatron import MOE_MLA_MODULES, megatron_modules, megatron_policies
from remat.plan.options import PlanOptions
from remat.plan.unit_model import UnitModel, add_traced_units, model_from_dict, model_to_dict
from remat.plan.unit_prefetch import run_isolated
from remat.policy import SELECTIVE_MODULES, Policy
from remat.recompute.plan_format import KEEP, Unit

# NOTE [MoE modules in the search]: for an MoE/MLA model the planners (remat.plan.api.plan, remat.plan.job_plan)
# also search the selective settings with Megatron's MoE/MLA modules the model has (megatron_modules: moe_act with
# grouped-GEMM experts, shared_experts with a shared expert, mla_up_proj with MLA), each combined with every subset
# of the dense modules (core_attn, mlp where some layer is dense, layernorm). Of the MoE modules, moe checkpoints the
# whole MoE layer (its shared expert and its experts' activations included), so it is offered alone; moe_act and
# shared_experts alone and together. Megatron accepts moe with the others too, but they change nothing inside a
# checkpointed MoE layer: the same setting under a longer name. A setting is priced per layer kind (an MoE layer, or
# the dense layers of a model with first dense layers) on the kind's unit model, where each set is what it does on
# that layer (MoE modules do nothing on a dense layer, mlp nothing on an MoE layer: Megatron's mlp leaves MoE layers
# alone); the sets the kind has are traced into its unit model (add_traced_units, cached on disk), and the extended
# per-layer search may use them too. As every setting, the one chosen is predicted exactly.
MOE_PARTS = ((), ("moe",), ("moe_act",), ("shared_experts",), ("moe_act", "shared_experts"))
MOE_MLA = frozenset(MOE_MLA_MODULES)
TRACE_BATCH = 4  # MoE/MLA units traced per profile stack (add_moe_units)


def _ordered(modules: set[str]) -> tuple[str, ...]:
    return tuple(m for m in SELECTIVE_MODULES if m in modules)


def moe_mla_sets(config: ModelConfig) -> tuple[tuple[str, ...], ...]:
    """The selective sets with at least one MoE/MLA module of ``config``'s model (NOTE [MoE modules in the search]),
    in remat's module order; () for a model without MoE or MLA layers."""
    dense, alone = megatron_modules(config)
    if not alone:
        return ()
    moe = [p for p in MOE_PARTS if set(p) <= set(alone)]
    mla = [(), ("mla_up_proj",)] if "mla_up_proj" in alone else [()]
    out: list[tuple[str, ...]] = []
    for n in range(len(dense) + 1):
        for d in itertools.combinations(dense, n):
            out += [_ordered({*d, *p, *a}) for p in moe for a in mla if p or a]
    return tuple(out)


def job_policies(num_layers: int, engine: str, config: ModelConfig | None, cost: CostModel | None = None,
                 models: Sequence[UnitModel] = ()) -> list[Policy]:
    """Megatron's settings of a ``num_layers`` stack of ``config``'s model: ``none``, every ``full`` setting and
    ``selective`` with each non-empty set of the dense modules the model has (the dense sweep,
    :func:`remat.plan.megatron.megatron_policies`, for a model without MoE or MLA; an MoE model without a dense
    layer has no ``mlp`` to recompute: those settings would be ``none``'s twins), then ``selective`` with each of
    :func:`moe_mla_sets` (with measured times in ``cost``, only the sets whose every module was timed, and only
    those every unit model of ``models`` prices (:func:`add_moe_units`; a set whose trace it left out, its blocks
    depending on the neighbouring layers, is not searched): the others have no price)."""
    out = megatron_policies(num_layers, engine)
    sets = () if config is None else moe_mla_sets(config)
    if not sets:
        return out
    dense = megatron_modules(config)[0]
    timed = None if cost is None or cost.measured is None else dict(cost.measured)
    return [p for p in out if set(p.modules) <= set(dense)] + [
        Policy("selective", modules=s, engine=engine) for s in sets if (timed is None or all(m in timed for m in s))
        and all(Unit("selective", 1, s) in m.shapes for m in models)]


def on_layer(modules: tuple[str, ...], layer: ModelConfig) -> tuple[str, ...]:
    """What a selective set does on one layer of ``layer``'s kind: its modules that layer has (MoE modules only on an
    MoE layer, mlp only on a dense one, moe_act with grouped experts, shared_experts with a shared expert,
    mla_up_proj with MLA); any other module is kept as it is (core_attn, layernorm, remat's own)."""
    dense, alone = megatron_modules(layer)
    known = {"core_attn", "mlp", "layernorm", "moe_act", "moe", "shared_experts", "mla_up_proj"}
    has = set(dense) | set(alone)
    return tuple(m for m in modules if m not in known or m in has)


def add_moe_units(model: UnitModel, config: ModelConfig) -> UnitModel:
    """Make ``model`` (one layer kind of ``config``'s model) price every set of :func:`moe_mla_sets`, and return
    it: the sets the layer has are traced into it (:func:`remat.plan.unit_model.add_traced_units`); a set that does
    less on this layer is priced as what it does there (the unit of that set, or a kept layer).

    The traces run in a forked process (:func:`remat.plan.unit_prefetch.run_isolated`; here when there is none):
    made in this process, they changed later whole-rank predictions of MoE/MLA stages (a DeepSeek-V3 stage's
    full/block/1 came out 67 MB over its own full trace) through state not yet found; in a child, nothing is left.
    """
    data = run_isolated(lambda: model_to_dict(_add_moe_units(model, config)))
    if data is not None:
        try:
            model.shapes.update(model_from_dict(data).shapes)
            return model
        except (KeyError, TypeError, ValueError):
            pass
    return _add_moe_units(model, config)


def _add_moe_units(model: UnitModel, config: ModelConfig) -> UnitModel:
    sets = moe_mla_sets(config)
    own = [Unit("selective", 1, s) for s in sets if on_layer(s, model.config) == s]
    # in a few layers per profile stack: in one long stack a DeepSeek-V3 MoE layer's units came out 2 MiB off the
    # layer's gradients at some positions (add_traced_units leaves such units out and traces the rest again, which
    # moved the 2 MiB to other units until none was left); a unit left out of its batch is traced alone
    for start in range(0, len(own), TRACE_BATCH):
        add_traced_units(model, own[start:start + TRACE_BATCH])
    for unit in own:
        if unit not in model.shapes:
            add_traced_units(model, [unit])
    for s in sets:
        unit, done = Unit("selective", 1, s), on_layer(s, model.config)
        if unit not in model.shapes and done != s:
            same = Unit("selective", 1, done) if done else KEEP
            if same not in model.shapes:
                traced_same = add_traced_units(model, [same])
                if not traced_same:
                    continue
            model.shapes[unit] = model.shapes[same]
    return model


def layer_moe_units(model: UnitModel, options: PlanOptions | None = None) -> list[Unit]:
    """The units of MoE/MLA selective sets that ``model``'s layer has and holds (traced by :func:`add_moe_units`),
    within ``options.selective_sets`` when given: what the extended per-layer search adds to its units (none with
    ``options.measured_times``: the MoE/MLA modules are not timed, so they have no measured price)."""
    if options is not None and options.measured_times:
        return []
    allowed = None if options is None or options.selective_sets is None else {
        frozenset(s) for s in options.selective_sets}
    return sorted((u for u in model.shapes if u.mode == "selective" and set(u.modules) & MOE_MLA
                   and on_layer(u.modules, model.config) == u.modules
                   and (allowed is None or frozenset(u.modules) in allowed)), key=str)


def layer_price(model: UnitModel, cost: CostModel) -> Callable[[Unit], int]:
    """``cost``'s price of a unit on ``model``'s layer, for :func:`remat.plan.solver.tidy`: a selective set the
    layer lacks (the dense 'act' of an MoE layer, which the unit model leaves out) is never the lighter choice."""
    return lambda u: cost.cost(model, u) if u.mode != "selective" or u in model.shapes else sys.maxsize
