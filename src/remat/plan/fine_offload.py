"""Megatron-LM's fine-grained activation offloading as options of the Megatron space: which offload variants
``remat plan --fine-grained-offload`` and ``--sweep megatron-offload`` offer, and what their transfers cost.

NOTE [fine-grained offload charge]: a layer's offloaded bytes (traced: ``meta['host_memory']
['offloaded_bytes_by_layer']``) cross the host link twice, at ``bandwidth`` bytes per second. The copy out runs on
a side stream beside the following modules' forward and the copy back is prefetched one group ahead of backward,
so each direction hides behind up to one layer's forward time (the backward's compute is longer, so this is the
lesser overlap); only the excess is charged: ``2 * max(0, bytes / bandwidth - layer_forward_seconds)`` per layer.
The recompute of the variant is its recompute policy's (offloading recomputes nothing).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from remat.config import ModelConfig
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


def megatron_offload_policies(num_layers: int, config: ModelConfig | None = None, engine: str = "reentrant",
                              min_size: int = MIN_OFFLOADED_TENSOR_SIZE) -> list[Policy]:
    """The offload variants of the Megatron space: each set of :data:`DENSE_OFFLOAD_SETS` (and, for a config with
    grouped MoE experts, :data:`MOE_OFFLOAD_SETS`) beside each of :data:`BASE_POLICIES`, with minimum size
    ``min_size`` (Megatron's default). ``num_layers`` must be at least 2 (the last layer keeps its tensors in
    Megatron's steady state, so one layer offloads nothing): [] otherwise."""
    if num_layers < 2:
        return []
    sets = list(DENSE_OFFLOAD_SETS)
    if config is not None and config.is_moe and config.moe_grouped_gemm:
        sets += MOE_OFFLOAD_SETS
    out = []
    for base in BASE_POLICIES:
        for modules in sets:
            try:
                out.append(replace(Policy.parse(base), engine=engine, offload_modules=modules,
                                   min_offloaded_tensor_size=min_size))
            except PolicyError:  # e.g. core_attn recomputed and offloaded with the non-reentrant engine
                continue
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
    policy's cost plus the charge, in the cost model's unit)."""

    policy: Policy
    peak_bytes: int
    host_peak_bytes: int
    offloaded_bytes: int
    transfer_seconds: float
    cost: int
    fits: bool
    megatron_args: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"policy": str(self.policy), "peak_bytes": self.peak_bytes, "host_peak_bytes": self.host_peak_bytes,
                "offloaded_bytes": self.offloaded_bytes, "transfer_seconds": self.transfer_seconds,
                "cost": self.cost, "fits": self.fits, "megatron_args": self.megatron_args}


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
    forward = cost.layer_forward_seconds(model)
    out = []
    for policy in megatron_offload_policies(config.num_layers, config, engine, min_size):
        tl = predict_config(config, policy, device=device, tp=tp, sp=sp)
        host = tl.meta.get("host_memory") or {}
        twin = replace(policy, offload_modules=(), min_offloaded_tensor_size=MIN_OFFLOADED_TENSOR_SIZE)
        recompute = sum(cost.cost(model, u) for u in Plan.from_policy(twin, config.num_layers).units())
        seconds = transfer_seconds(host, forward, cost.bandwidth)
        charge = math.ceil(seconds * (cost.flops_per_second if cost.objective == "extra_flops" else 1e9))
        out.append(OffloadOption(policy, tl.peak_bytes, int(host.get("peak_bytes", 0)),
                                 sum(host.get("offloaded_bytes", {}).values()), seconds, recompute + charge,
                                 tl.peak_bytes <= limit, policy.to_megatron_args()))
    return sorted(out, key=lambda o: (not o.fits, o.cost, o.peak_bytes))


def format_offload_options(options: Sequence[dict[str, Any]]) -> list[str]:
    """Report lines of :meth:`OffloadOption.to_dict` rows (``remat plan --fine-grained-offload``)."""
    if not options:
        return []
    lines = ["Megatron with fine-grained activation offloading, cheapest fitting first (device peak, host bytes, "
             "transfer time charged):"]
    width = max(len(o["policy"]) for o in options)
    for o in options:
        lines.append(f"  {o['policy']:<{width}} {format_bytes(o['peak_bytes']):>11} {'fits' if o['fits'] else 'over'}"
                     f"  host {format_bytes(o['host_peak_bytes'])}, {1e3 * o['transfer_seconds']:.2f} ms charged")
    return lines
