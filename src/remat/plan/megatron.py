"""Megatron-LM's recompute settings (the one definition of the sweep) and the traced prediction of any plan."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any

from remat.config import ModelConfig
from remat.memory import disk_cache
from remat.memory.compose import CompositionError, ShallowTrace, compose, shallow_plan
from remat.memory.disk_cache import cached_timeline
from remat.memory.kernels import resolve_kernels
from remat.memory.predict import predict_config, trace_rank
from remat.policy import Policy
from remat.recompute.plan_format import Plan, PlanError
from remat.timeline import Timeline

# NOTE [the Megatron space]: every setting Megatron-LM's flags can express for a dense model's layers: ``none``,
# ``full/uniform/K`` and ``full/block/K`` for K = 1..L, and ``selective`` with each non-empty set of
# MEGATRON_MODULES (remat's 'act' is MoE-only there; non_matmul is not Megatron's). plan() prices each with the
# unit model and traces (predicted(): exact fake traces, composed for deep stacks, cached on disk) only the cheapest
# that may fit until one's traced peak fits (NOTE [the Megatron screen] in remat.plan.api); that setting's cost
# also prunes the extended search (solve's incumbent).
# This is the one definition of that set: `remat predict/compare --sweep megatron` list it too (megatron_sweep).
# For MoE and MLA models (given their config) the selective part also lists each of Megatron's modules for those
# parts that the model has, alone (MOE_MLA_MODULES, Megatron's rules: moe_act needs grouped-GEMM experts,
# shared_experts a shared expert, mla_up_proj multi-latent attention; mlp only where some layer is dense, as
# Megatron's mlp leaves MoE layers alone). Alone, not in every combination: with the three dense modules that would
# be up to 2^7 - 1 = 127 selective settings, each a trace of its own (NOTE [sweep cost] in benchmarks/README.md).
MEGATRON_MODULES = ("core_attn", "mlp", "layernorm")
MOE_MLA_MODULES = ("moe_act", "moe", "shared_experts", "mla_up_proj")
SWEEPS = ("megatron", "megatron-offload")  # --sweep: megatron_sweep; + remat.plan.fine_offload.offload_sweep
SWEEP_DESCRIPTION = ("none, every full/uniform/K and full/block/K (K = 1..L), each set of selective modules "
                     f"({', '.join(MEGATRON_MODULES)}) and, for MoE/MLA models, each of "
                     f"{', '.join(MOE_MLA_MODULES)} the model has")


def megatron_modules(config: ModelConfig | None = None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The selective modules of the Megatron sweep for ``config``'s model: (those swept in every non-empty
    combination, the MoE/MLA ones swept alone), each in Megatron's rules (NOTE [the Megatron space]).

    Example::

        >>> from remat.presets import get_preset
        >>> megatron_modules(get_preset("deepseek-v3"))
        (('core_attn', 'mlp', 'layernorm'), ('moe_act', 'moe', 'shared_experts', 'mla_up_proj'))
        >>> megatron_modules(get_preset("mixtral-8x7b"))
        (('core_attn', 'layernorm'), ('moe',))
    """
    if config is None or not (config.is_moe or config.multi_latent_attention):
        return MEGATRON_MODULES, ()
    pattern = config.moe_layer_pattern()
    has = {"mlp": not all(pattern), "moe": any(pattern), "moe_act": any(pattern) and config.moe_grouped_gemm,
           "shared_experts": any(pattern) and bool(config.moe_shared_expert_intermediate_size),
           "mla_up_proj": config.multi_latent_attention}
    return (tuple(m for m in MEGATRON_MODULES if has.get(m, True)),
            tuple(m for m in MOE_MLA_MODULES if has[m]))


def megatron_policies(num_layers: int, engine: str = "reentrant", config: ModelConfig | None = None,
                      ) -> list[Policy]:
    """Every Megatron-LM recompute setting of a ``num_layers`` stack (NOTE [the Megatron space]).

    Args:
        num_layers: the stack's depth (>= 1).
        engine: the checkpoint engine of every policy (Megatron's is ``'reentrant'``).
        config: the model, for its MoE/MLA modules (:func:`megatron_modules`); None: a dense model's.

    Returns:
        ``none``, ``full/uniform/K`` for K = 1..L, ``full/block/K`` for K = 1..L, then ``selective`` with each
        non-empty set of the model's dense modules (:data:`MEGATRON_MODULES`) and each of its MoE/MLA modules
        alone, as :class:`Policy` objects.
    """
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers={num_layers!r}: a sweep needs a stack of at least one layer")
    dense, alone = megatron_modules(config)
    out = [Policy(engine=engine)]
    out += [Policy("full", "uniform", k, engine=engine) for k in range(1, num_layers + 1)]
    out += [Policy("full", "block", k, engine=engine) for k in range(1, num_layers + 1)]
    out += [Policy("selective", modules=c, engine=engine) for n in range(1, len(dense) + 1)
            for c in itertools.combinations(dense, n)]
    out += [Policy("selective", modules=(m,), engine=engine) for m in alone]
    return out


def megatron_sweep(num_layers: int, engine: str | None = None, config: ModelConfig | None = None) -> list[str]:
    """:func:`megatron_policies` in the short form of :class:`Policy` (``'none'``, ``'full/uniform/1'``, ...), as
    ``--sweep megatron`` lists them; ``engine`` (None: Megatron's reentrant) is appended as ``@engine`` to every
    policy but ``none``; ``config``: the model, for its MoE/MLA modules.

    Example::

        >>> megatron_sweep(2)
        ['none', 'full/uniform/1', 'full/uniform/2', 'full/block/1', 'full/block/2', 'selective/core_attn', \
'selective/mlp', 'selective/layernorm', 'selective/core_attn+mlp', 'selective/core_attn+layernorm', \
'selective/mlp+layernorm', 'selective/core_attn+mlp+layernorm']
    """
    policies = megatron_policies(num_layers, engine or "reentrant", config)
    return ["none", *(str(p) for p in policies[1:])]


# ------------------------------------------------------------------------------------------------ prediction
_STAND_INS: dict[tuple[ModelConfig, Plan, str], ShallowTrace] = {}


def stand_in(plan: Plan) -> Plan | None:
    """A shallow plan with every layer role of ``plan`` (:func:`remat.memory.compose.shallow_plan`), or None."""
    return shallow_plan(plan)


def predict_plan(config: ModelConfig, plan: Plan, *, device: str = "cpu", tp: int = 1, sp: bool = False) -> Timeline:
    """Predict (fake trace, exact bytes) one training step of the reference GPT of ``config`` under ``plan`` (of
    one tensor-parallel rank with ``tp``/``sp``).

    A Megatron-expressible plan goes through :func:`remat.memory.predict.predict_config`; another plan is composed from
    the trace of its :func:`stand_in` (:func:`remat.memory.compose.compose`), or traced whole when composition is
    refused or the plan offloads. ``meta['plan']`` holds the plan's text.
    """
    if plan.num_layers != config.num_layers:
        raise PlanError(f"the plan is for {plan.num_layers} layers but the config has {config.num_layers}")
    policy, _ = plan.megatron_policy()
    if policy is not None:
        tl = predict_config(config, policy, device=device, tp=tp, sp=sp)
    else:
        tl = None
        shallow = stand_in(plan)
        if shallow is not None:
            key = (config.replace(num_layers=shallow.num_layers), shallow, device, tp, sp)
            try:
                if key not in _STAND_INS:
                    if len(_STAND_INS) >= 32:
                        del _STAND_INS[next(iter(_STAND_INS))]
                    disk_key = {"config": key[0].to_dict(), "plan": str(shallow), "engine": shallow.engine,
                                "device": device, "tp": tp, "sp": sp, "kernels": resolve_kernels(None, device)}
                    _STAND_INS[key] = ShallowTrace(cached_timeline("plan_stand_in", disk_key, lambda: trace_rank(
                        key[0], shallow, device, tp, sp)), shallow)
                tl = compose(_STAND_INS[key], shallow, plan, plan.num_layers)
                tl.meta["config"] = config.to_dict()
            except CompositionError as err:
                tl = None
                refused = str(err)
        if tl is None:
            tl = trace_rank(config, plan, device, tp, sp)
            if shallow is not None:
                tl.meta["composition_refused"] = refused
    tl.meta["plan"] = str(plan)
    return tl


@dataclass(frozen=True)
class Predicted:
    """What a prediction says about a step: the peak, the phase it is in, the bytes alive there by category
    (adding up to the peak) and the FLOPs per phase kind."""

    peak_bytes: int
    peak_phase: str
    at_peak: dict[str, int]
    flops: dict[str, int]

    @classmethod
    def of(cls, tl: Timeline) -> Predicted:
        event, parts = tl.peak_parts()  # once: peak_bytes, peak_phase and at_peak would each make the live curve
        return cls(sum(parts.values()), tl.phase_at(event).label, parts,
                   {k: int(v) for k, v in tl.meta.get("flops", {}).items()})


_PREDICTED: dict[tuple[Any, ...], Predicted] = {}


def predicted(config: ModelConfig, layout: Plan | Policy, *, device: str = "cpu", tp: int = 1,
              sp: bool = False) -> Predicted:
    """:class:`Predicted` of one step under ``layout`` (a plan, :func:`predict_plan`, or a policy,
    :func:`remat.memory.predict.predict_config`), cached in memory and on disk (:mod:`remat.memory.disk_cache`):
    what the planner needs of a traced prediction, without keeping the timeline."""
    kernels = resolve_kernels(None, device)
    what = f"plan {layout} @{layout.engine}" if isinstance(layout, Plan) else f"policy {layout!r}"
    key = (config, what, device, tp, sp, kernels)
    found = _PREDICTED.get(key)
    if found is not None:
        return found
    disk_key = {"config": config.to_dict(), "layout": what, "device": device, "tp": tp, "sp": sp, "kernels": kernels}
    stored = disk_cache.load("predicted", disk_key)
    try:
        found = None if stored is None else Predicted(int(stored["peak_bytes"]), str(stored["peak_phase"]),
                                                      {str(k): int(v) for k, v in stored["at_peak"].items()},
                                                      {str(k): int(v) for k, v in stored["flops"].items()})
    except (KeyError, TypeError, ValueError, AttributeError):
        found = None
    if found is None:
        tl = predict_plan(config, layout, device=device, tp=tp, sp=sp) if isinstance(layout, Plan) else \
            predict_config(config, layout, device=device, tp=tp, sp=sp)
        found = Predicted.of(tl)
        disk_cache.store("predicted", disk_key, dataclasses.asdict(found))
    if len(_PREDICTED) >= 1024:
        del _PREDICTED[next(iter(_PREDICTED))]
    _PREDICTED[key] = found
    return found


_MEGATRON: dict[tuple[ModelConfig, str, str, int, bool], list[tuple[Policy, Predicted]]] = {}


def forget_predictions() -> None:
    """Empty this process's caches of predictions and stand-in traces (the disk cache stays)."""
    _PREDICTED.clear()
    _STAND_INS.clear()
    _MEGATRON.clear()


def megatron_table(config: ModelConfig, *, device: str = "cpu", engine: str = "reentrant", tp: int = 1,
                   sp: bool = False) -> list[tuple[Policy, Predicted]]:
    """Every Megatron setting (:func:`megatron_policies`) with its prediction (:func:`predicted`: cached per config
    in memory and on disk)."""
    key = (config, device, engine, tp, sp)
    if key not in _MEGATRON:
        policies = megatron_policies(config.num_layers, engine)
        _MEGATRON[key] = [(p, predicted(config, p, device=device, tp=tp, sp=sp)) for p in policies]
        if len(_MEGATRON) > 16:
            del _MEGATRON[next(iter(_MEGATRON))]
    return _MEGATRON[key]
