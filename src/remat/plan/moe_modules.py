"""Megatron's MoE and MLA recompute modules (moe_act, moe, shared_experts, mla_up_proj) in the planners' searches:
the selective settings of an MoE/MLA model and their units in a layer kind's unit model (NOTE [MoE modules in the
search])."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Sequence

from remat.config import ModelConfig
from remat.memory.trace_pool import idle_workers, run_forked
from remat.plan.costs import CostModel
from remat.plan.megatron import MOE_MLA_MODULES, megatron_modules, megatron_policies
from remat.plan.options import PlanOptions
from remat.plan.unit_model import UnitModel, UnitShape, add_traced_units
from remat.policy import SELECTIVE_MODULES, Policy
from remat.recompute.plan_format import KEEP, Unit

# NOTE [MoE modules in the search]: for an MoE/MLA model the planners (remat.plan.api.plan, remat.plan.job_plan)
# also search every selective setting Megatron accepts with its MoE/MLA modules the model has (megatron_modules:
# moe_act with grouped-GEMM experts, shared_experts with a shared expert, mla_up_proj with MLA; Megatron refuses
# moe_act without grouped GEMM and mla_up_proj without MLA, and accepts any other combination): every subset of
# those, each with every subset of the dense modules (core_attn, mlp where some layer is dense, layernorm), but not
# the empty one (the dense sweep's). moe with moe_act or shared_experts is a setting of its own: the checkpointed
# MoE layer's recomputation in backward runs them (discarding the experts' activation, checkpointing the shared
# expert), so its backward holds other bytes (tests/plan/test_moe_units.py). A setting is priced per layer kind (an
# MoE layer, or the dense layers of a model with first dense layers) on the kind's unit model, where each set is what
# it does on that layer (MoE modules do nothing on a dense layer, mlp nothing on an MoE layer: Megatron's mlp leaves
# MoE layers alone); the sets the kind has are traced into its unit model (add_traced_units, cached on disk), and
# the extended per-layer search may use them too. As every setting, the one chosen is predicted exactly.
MOE_PARTS = tuple(  # every subset of Megatron's MoE modules
    p for n in range(4) for p in itertools.combinations(("moe_act", "moe", "shared_experts"), n))
MOE_MLA = frozenset(MOE_MLA_MODULES)
TRACE_BATCH = 16  # MoE/MLA units traced per profile stack (add_moe_units): the fastest of 4, 16 and all 60 of a
# DeepSeek-V3 MoE layer (58 s against 60 and 84 s), each unit the same bytes in any of them


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
    depending on the neighbouring layers, is not searched): the others have no price). With ``models``, a
    selective setting that does on every model's layer kind what an earlier one does (:func:`on_layer`: mlp on an
    MoE stage) is left out, and one that does nothing there (``none``'s twin) too: the twins would only spend the
    Megatron screen's exact predictions (a DeepSeek-V3 MoE stage listed selective/mlp+X beside every X)."""
    out = megatron_policies(num_layers, engine)
    sets = () if config is None else moe_mla_sets(config)
    if not sets:
        return out
    dense = megatron_modules(config)[0]
    timed = None if cost is None or cost.measured is None else dict(cost.measured)
    listed = [p for p in out if set(p.modules) <= set(dense)] + [
        Policy("selective", modules=s, engine=engine) for s in sets if (timed is None or all(m in timed for m in s))
        and all(Unit("selective", 1, s) in m.shapes for m in models)]
    if not models:
        return listed
    seen: set[tuple[frozenset[str], ...]] = set()
    kept = []
    for policy in listed:
        if policy.granularity == "selective":
            effect = tuple(frozenset(on_layer(policy.modules, m.config)) for m in models)
            if effect in seen or not any(effect):
                continue
            seen.add(effect)
        kept.append(policy)
    return kept


def on_layer(modules: tuple[str, ...], layer: ModelConfig) -> tuple[str, ...]:
    """What a selective set does on one layer of ``layer``'s kind: its modules that layer has (MoE modules only on an
    MoE layer, mlp and remat's act only on a dense one, moe_act with grouped experts, shared_experts with a shared
    expert, mla_up_proj with MLA); any other module is kept as it is (core_attn, layernorm, remat's own)."""
    dense, alone = megatron_modules(layer)
    known = {"core_attn", "mlp", "act", "layernorm", "moe_act", "moe", "shared_experts", "mla_up_proj"}
    has = set(dense) | set(alone) | ({"act"} if "mlp" in dense else set())
    return tuple(m for m in modules if m not in known or m in has)


def on_every_layer(unit: Unit, kinds: Sequence[ModelConfig]) -> bool:
    """Whether ``unit`` may be placed on a layer of each of ``kinds`` (the layer kinds of a stage mixing dense and
    MoE layers, priced by one kind: NOTE [uneven splits] in remat.plan.job_stages): each of its modules is one the
    layer has, or mlp (nothing on an MoE layer, as Megatron's). remat.apply refuses a selective module that no layer
    it is placed on has (act placed only on a stage's MoE layer), so the extended search leaves such units out."""
    return unit.mode != "selective" or all(set(unit.modules) - set(on_layer(unit.modules, k)) <= {"mlp"}
                                           for k in kinds)


def add_moe_units(model: UnitModel, config: ModelConfig) -> UnitModel:
    """Make ``model`` (one layer kind of ``config``'s model) price every set of :func:`moe_mla_sets`, and return
    it: the sets the layer has are traced into it (:func:`remat.plan.unit_model.add_traced_units`, in profile stacks
    of :data:`TRACE_BATCH`); a set that does less on this layer is priced as what it does there (the unit of that
    set, or a kept layer).

    The traces run in this process, or where cores stand idle (:func:`remat.memory.trace_pool.idle_workers`) each
    batch in a forked worker, its shapes sent back and added in the order it added them: the same shapes, since
    nothing a trace leaves changes a later trace now that mla_up_proj's saved-tensor hooks are popped after a
    core_attn layer (:class:`remat.recompute.discard.OutputDiscardingRegion`; left pushed, they made a DeepSeek-V3
    stage's later full/block/1 trace 67 MB over its own, which is why these traces ran in a forked process before).
    """
    sets = moe_mla_sets(config)
    own = [Unit("selective", 1, s) for s in sets if on_layer(s, model.config) == s]
    batches = [own[start:start + TRACE_BATCH] for start in range(0, len(own), TRACE_BATCH)]
    workers = min(idle_workers(), len(batches)) if len(batches) > 1 else 1  # (asking idle_workers may take 50 ms)
    if workers > 1:  # side by side where cores stand idle: each batch's stack is traced alone (see above)
        for shapes in run_forked([_traced_batch(model, batch) for batch in batches], workers):
            model.shapes.update(shapes)
    else:
        for batch in batches:
            add_traced_units(model, batch)
    # a unit add_traced_units leaves out of its batch (its bytes depend on its neighbours) is traced alone, and left
    # out (not searched) if still so; none is for the models of the tests and DeepSeek-V3 since mla_up_proj's hooks
    # are popped (left pushed, they kept every later router's scores, 2 MiB a DeepSeek-V3 layer, and the sets with
    # core_attn on MoE layers came out off the layer's gradients)
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


def _traced_batch(model: UnitModel, batch: list[Unit]) -> Callable[[], dict[Unit, UnitShape]]:
    """A task (remat.memory.trace_pool.run_forked) adding ``batch``'s shapes to ``model`` as
    :func:`~remat.plan.unit_model.add_traced_units` does, and returning those it added, in the order it added them."""
    def task() -> dict[Unit, UnitShape]:
        before = set(model.shapes)
        add_traced_units(model, batch)
        return {u: shape for u, shape in model.shapes.items() if u not in before}
    return task


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
