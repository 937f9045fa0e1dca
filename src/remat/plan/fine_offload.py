"""Megatron-LM's fine-grained activation offloading as options of the Megatron space: which offload variants
``remat plan --fine-grained-offload`` and ``--sweep megatron-offload`` offer, what their transfers cost, and which
one the planner chooses (:func:`choose_offload`).

NOTE [fine-grained offload charge]: a layer's offloaded bytes (traced: ``meta['host_memory']
['offloaded_bytes_by_layer']``) cross the host link twice, at ``bandwidth`` bytes per second. The copy out runs on
a side stream beside the following modules' forward and the copy back is prefetched one group ahead of backward,
so each direction hides behind up to one layer's forward time (the backward's compute is longer, so this is the
lesser overlap); only the excess is charged: ``2 * max(0, bytes / bandwidth - layer_forward_seconds)`` per layer.
The recompute of the variant is its recompute policy's (offloading recomputes nothing). A variant's cost is its
recompute policy's cost plus the charge, in the objective's unit (:class:`~remat.plan.costs.CostModel`: ns of
the time objective, FLOP-equivalents at ``flops_per_second`` of the FLOP objective), so it compares directly with
every recompute-only setting and extended plan.

NOTE [choosing an offload variant]: the variants traced are each module set of :data:`DENSE_OFFLOAD_SETS` (and
:data:`MOE_OFFLOAD_SETS`) beside each of :data:`BASE_POLICIES` (listed in the report, fitting or not), and, where it
may pay, beside the recompute-only Megatron settings that are cheaper than the best one that fits (they did not
fit alone; with offloading they may, for less than that one costs). Adding offloading to the best fitting setting
itself never lowers the cost (the charge is >= 0), so it is not tried. Those extra pairs are screened first: a
setting's unit-model peak less the most that module set saved beside a base policy (traced) must be within the
budget (plus the unit model's slack), and at most :data:`MAX_EXTRA_TRACES` are traced, cheapest recompute first
(per setting the set that saved the most first; a set is skipped when a superset of it did not fit beside the same
setting; a setting that checkpoints every layer but the last offloads nothing and is skipped), while their
recompute alone still costs less than the best answer so far. The cheapest variant whose traced device peak fits
is chosen when it costs less than the best recompute-only setting that fits (or none fits).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from remat.config import ModelConfig
from remat.memory import disk_cache
from remat.memory.kernels import resolve_kernels
from remat.memory.predict import predict_config
from remat.offload_policy import MIN_OFFLOADED_TENSOR_SIZE, OFFLOAD_MODULES
from remat.plan.costs import CostModel
from remat.plan.unit_model import UnitModel
from remat.policy import Policy, PolicyError
from remat.recompute.plan_format import Plan
from remat.units import format_bytes

# the module sets offered, each with the recompute settings it is tried beside (none, and Megatron's default)
DENSE_OFFLOAD_SETS = (("core_attn", "attn_proj"), ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"))
MOE_OFFLOAD_SETS = (("expert_fc1", "moe_act"), OFFLOAD_MODULES)
BASE_POLICIES = ("none", "selective/core_attn")
MAX_EXTRA_TRACES = 4  # offload variants beside other recompute settings traced per plan (NOTE [choosing ...])


def offload_sets(config: ModelConfig | None = None) -> list[tuple[str, ...]]:
    """The offload module sets offered for ``config``'s model: :data:`DENSE_OFFLOAD_SETS`, plus
    :data:`MOE_OFFLOAD_SETS` for a config with grouped MoE experts."""
    sets = list(DENSE_OFFLOAD_SETS)
    if config is not None and config.is_moe and config.moe_grouped_gemm:
        sets += MOE_OFFLOAD_SETS
    return sets


def with_offload(policy: Policy, modules: Sequence[str], min_size: int) -> Policy | None:
    """``policy`` offloading ``modules`` (minimum size ``min_size`` elements), or None where the combination is
    refused (e.g. full/uniform, which saves nothing to offload; core_attn recomputed and offloaded with the
    non-reentrant engine)."""
    try:
        return replace(policy, offload_modules=tuple(modules), min_offloaded_tensor_size=min_size)
    except PolicyError:
        return None


def megatron_offload_policies(num_layers: int, config: ModelConfig | None = None, engine: str = "reentrant",
                              min_size: int = MIN_OFFLOADED_TENSOR_SIZE) -> list[Policy]:
    """The offload variants of the Megatron space: each set of :data:`DENSE_OFFLOAD_SETS` (and, for a config with
    grouped MoE experts, :data:`MOE_OFFLOAD_SETS`) beside each of :data:`BASE_POLICIES`, with minimum size
    ``min_size`` (Megatron's default). ``num_layers`` must be at least 2 (the last layer keeps its tensors in
    Megatron's steady state, so one layer offloads nothing): [] otherwise."""
    if num_layers < 2:
        return []
    out = []
    for base in BASE_POLICIES:
        for modules in offload_sets(config):
            variant = with_offload(replace(Policy.parse(base), engine=engine), modules, min_size)
            if variant is not None:
                out.append(variant)
    return out


OFFLOAD_SWEEP_DESCRIPTION = ("none and selective/core_attn beside each offload module set (" +
                             "; ".join("+".join(m) for m in DENSE_OFFLOAD_SETS) + ")")


def offload_sweep(num_layers: int) -> list[str]:
    """The short forms of the dense offload variants (:func:`megatron_offload_policies` without a config), as
    ``--sweep megatron-offload`` adds them to the Megatron sweep."""
    return [str(p) for p in megatron_offload_policies(num_layers)]


def transfer_seconds(host_memory: dict[str, Any] | None, layer_forward_seconds: float, bandwidth: float) -> float:
    """Seconds a step's offloading adds (NOTE [fine-grained offload charge]); 0 without ``host_memory``."""
    if not host_memory:
        return 0.0
    per_layer = host_memory.get("offloaded_bytes_by_layer") or {}
    return sum(2 * max(0.0, b / bandwidth - layer_forward_seconds) for b in per_layer.values())


@dataclass(frozen=True)
class OffloadOption:
    """One offload variant, traced: its device peak, host bytes, transfer charge and total cost (the recompute
    policy's cost plus the charge, in the cost model's unit), and what the trace says at the peak."""

    policy: Policy
    peak_bytes: int
    host_peak_bytes: int
    offloaded_bytes: int
    transfer_seconds: float
    cost: int
    fits: bool
    megatron_args: list[str] = field(default_factory=list)
    recompute_cost: int = 0  # the recompute policy's part of ``cost``
    peak_phase: str = ""
    at_peak: dict[str, int] = field(default_factory=dict)
    flops: dict[str, int] = field(default_factory=dict)  # per phase kind, as Predicted.flops

    def to_dict(self) -> dict[str, Any]:
        return {"policy": str(self.policy), "peak_bytes": self.peak_bytes, "host_peak_bytes": self.host_peak_bytes,
                "offloaded_bytes": self.offloaded_bytes, "transfer_seconds": self.transfer_seconds,
                "cost": self.cost, "recompute_cost": self.recompute_cost, "fits": self.fits,
                "megatron_args": self.megatron_args}


_TRACED: dict[tuple[Any, ...], dict[str, Any]] = {}


def traced_offload(config: ModelConfig, policy: Policy, *, device: str = "cpu", tp: int = 1,
                   sp: bool = False) -> dict[str, Any]:
    """What the whole-stack trace of ``policy`` (:func:`remat.memory.predict.predict_config`) says: ``peak_bytes``,
    ``peak_phase``, ``at_peak``, ``flops`` and ``host`` (``meta['host_memory']`` without its series; {} when
    nothing is offloaded), cached in memory and on disk (:mod:`remat.memory.disk_cache`)."""
    kernels = resolve_kernels(None, device)
    key = (config, repr(policy), device, tp, sp, kernels)
    if key in _TRACED:
        return _TRACED[key]
    disk_key = {"config": config.to_dict(), "policy": repr(policy), "device": device, "tp": tp, "sp": sp,
                "kernels": kernels}
    found = disk_cache.load("fine_offload", disk_key)
    if not (isinstance(found, dict) and {"peak_bytes", "peak_phase", "at_peak", "flops", "host"} <= found.keys()):
        tl = predict_config(config, policy, device=device, tp=tp, sp=sp)
        host = {k: v for k, v in (tl.meta.get("host_memory") or {}).items() if k != "series"}
        found = {"peak_bytes": tl.peak_bytes, "peak_phase": tl.peak_phase.label, "at_peak": dict(tl.at_peak),
                 "flops": {k: int(v) for k, v in tl.meta.get("flops", {}).items()}, "host": host}
        disk_cache.store("fine_offload", disk_key, found)
    if len(_TRACED) >= 256:
        del _TRACED[next(iter(_TRACED))]
    _TRACED[key] = found
    return found


def forget_offload_traces() -> None:
    """Empty this process's cache of offload traces (the disk cache stays)."""
    _TRACED.clear()


def price_offload(config: ModelConfig, policy: Policy, cost: CostModel, model: UnitModel, limit: int, *,
                  device: str = "cpu", tp: int = 1, sp: bool = False) -> OffloadOption:
    """One offload variant traced (:func:`traced_offload`) and priced (NOTE [fine-grained offload charge])."""
    t = traced_offload(config, policy, device=device, tp=tp, sp=sp)
    host = t["host"]
    twin = replace(policy, offload_modules=(), min_offloaded_tensor_size=MIN_OFFLOADED_TENSOR_SIZE)
    recompute = sum(cost.cost(model, u) for u in Plan.from_policy(twin, config.num_layers).units())
    seconds = transfer_seconds(host, cost.layer_forward_seconds(model), cost.bandwidth)
    charge = math.ceil(seconds * (cost.flops_per_second if cost.objective == "extra_flops" else 1e9))
    return OffloadOption(policy, int(t["peak_bytes"]), int(host.get("peak_bytes", 0)),
                         sum(host.get("offloaded_bytes", {}).values()), seconds, recompute + charge,
                         t["peak_bytes"] <= limit, policy.to_megatron_args(), recompute, str(t["peak_phase"]),
                         {str(k): int(v) for k, v in t["at_peak"].items()},
                         {str(k): int(v) for k, v in t["flops"].items()})


def _order(options: list[OffloadOption]) -> list[OffloadOption]:
    return sorted(options, key=lambda o: (not o.fits, o.cost, o.peak_bytes))


def offload_options(config: ModelConfig, cost: CostModel, model: UnitModel, limit: int, *, device: str = "cpu",
                    engine: str = "reentrant", tp: int = 1, sp: bool = False,
                    min_size: int = MIN_OFFLOADED_TENSOR_SIZE) -> list[OffloadOption]:
    """Every variant of :func:`megatron_offload_policies`, traced (:func:`remat.memory.predict.predict_config`,
    whole stacks: offloading is not composed) and priced, cheapest fitting first (those over ``limit`` bytes
    last).

    Args:
        config: the reference model; cost, model: the planner's cost model and unit model (the recompute policy's
            cost and one layer's forward time); limit: the budget in bytes; device, engine, tp, sp: as plan()'s;
            min_size: the variants' ``min_offloaded_tensor_size``.
    """
    return _order([price_offload(config, p, cost, model, limit, device=device, tp=tp, sp=sp)
                   for p in megatron_offload_policies(config.num_layers, config, engine, min_size)])


@dataclass(frozen=True)
class MegatronRow:
    """A recompute-only Megatron setting as the planner screened it: its cost and unit-model peak."""

    policy: Policy
    cost: int
    model_peak: int


def choose_offload(config: ModelConfig, cost: CostModel, model: UnitModel, limit: int, rows: Sequence[MegatronRow],
                   incumbent: int | None, *, device: str = "cpu", engine: str = "reentrant", tp: int = 1,
                   sp: bool = False, min_size: int = MIN_OFFLOADED_TENSOR_SIZE,
                   max_extra: int = MAX_EXTRA_TRACES) -> tuple[list[OffloadOption], OffloadOption | None]:
    """The offload variants traced and the one chosen (NOTE [choosing an offload variant]).

    Args:
        config, cost, model, limit, device, engine, tp, sp, min_size: as :func:`offload_options`.
        rows: every recompute-only Megatron setting with its cost and unit-model peak (the planner's screen).
        incumbent: the cost of the best recompute-only setting whose traced peak fits; None: none fits.
        max_extra: at most this many variants beside other recompute settings are traced.

    Returns:
        ``(options, chosen)``: every variant traced, cheapest fitting first, and the cheapest fitting one when it
        costs strictly less than ``incumbent`` (or ``incumbent`` is None), else None.
    """
    options = offload_options(config, cost, model, limit, device=device, engine=engine, tp=tp, sp=sp,
                              min_size=min_size)
    best = min((o.cost for o in options if o.fits), default=None)
    bound = min(c for c in (incumbent, best) if c is not None) if incumbent is not None or best is not None \
        else None
    # the most each module set saved beside a base policy: the base's unit-model peak less the traced variant's
    peaks = {str(r.policy): r.model_peak for r in rows}
    saving: dict[tuple[str, ...], int] = {}
    for o in options:
        base = replace(o.policy, offload_modules=(), min_offloaded_tensor_size=MIN_OFFLOADED_TENSOR_SIZE)
        if str(base) in peaks:
            saving[o.policy.offload_modules] = max(saving.get(o.policy.offload_modules, 0),
                                                   peaks[str(base)] - o.peak_bytes)
    slack = sum(model.side.values())
    tried = {str(o.policy) for o in options}
    extra = []
    L = config.num_layers
    for r in rows:
        grouped = {i for g in r.policy.layer_groups(L) for i in g}
        if (bound is not None and r.cost >= bound) or all(i in grouped for i in range(L - 1)):
            continue  # too dear, or every layer that may offload (not the last) is checkpointed: nothing to offload
        for modules, saved in saving.items():
            variant = with_offload(replace(r.policy, engine=engine), modules, min_size)
            if variant is not None and str(variant) not in tried and r.model_peak - saved - slack <= limit:
                extra.append((r.cost, r.model_peak - saved, str(r.policy), modules, variant))
    over: list[tuple[str, tuple[str, ...]]] = []  # (setting, module set) traced over the limit
    traced = 0
    # cheapest recompute first; per setting the module set that saved the most first
    for recompute, _, setting, modules, variant in sorted(extra, key=lambda e: e[:3]):
        if traced >= max_extra or (bound is not None and recompute >= bound):  # the charge is >= 0
            break
        if any(s == setting and set(modules) <= set(m) for s, m in over):
            continue  # offloading a superset of these modules beside this setting did not fit: neither will these
        option = price_offload(config, variant, cost, model, limit, device=device, tp=tp, sp=sp)
        traced += 1
        options.append(option)
        if not option.fits:
            over.append((setting, modules))
        elif bound is None or option.cost < bound:
            bound = option.cost
    options = _order(options)
    chosen = next((o for o in options if o.fits), None)
    if chosen is not None and incumbent is not None and chosen.cost >= incumbent:
        chosen = None
    return options, chosen


def format_offload_options(options: Sequence[dict[str, Any]], chosen: str | None = None) -> list[str]:
    """Report lines of :meth:`OffloadOption.to_dict` rows (``remat plan --fine-grained-offload``); the row whose
    policy is ``chosen`` is marked."""
    if not options:
        return []
    lines = ["Megatron with fine-grained activation offloading, cheapest fitting first (device peak, host bytes, "
             "transfer time charged, cost):"]
    width = max(len(o["policy"]) for o in options)
    for o in options:
        mark = "  <- chosen" if chosen is not None and o["policy"] == chosen else ""
        lines.append(f"  {o['policy']:<{width}} {format_bytes(o['peak_bytes']):>11} {'fits' if o['fits'] else 'over'}"
                     f"  host {format_bytes(o['host_peak_bytes'])}, {1e3 * o['transfer_seconds']:.2f} ms charged, "
                     f"cost {o['cost']:,}{mark}")
    return lines
