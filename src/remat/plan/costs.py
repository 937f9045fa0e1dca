"""Cost of recomputing a unit: FLOPs and bytes priced by a roofline, or forward times measured on this machine."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import SAC_IGNORED_OPS

from remat.config import ModelConfig
from remat.models.collectives import in_collective
from remat.models.gpt import build_model
from remat.plan.operator_space import LayerOperator, layer_operators, measured_price, roofline_price
from remat.plan.space import OBJECTIVES, SELECTIVE_SETS, contraction_sets
from remat.plan.unit_model import UnitModel
from remat.plan.unit_trace import layer_contractions
from remat.policy import SELECTIVE_MODULES, contraction_limit
from remat.recompute.apply import apply
from remat.recompute.operators import MATMUL_OPS, contraction
from remat.recompute.plan_format import KEEP, Plan, PlanError, Unit, keep_ops_token, kept_operators

# ------------------------------------------------------------------------------------------------ costs
# NOTE [roofline presets]: what prices the time objective on a GPU: dense bf16 tensor-core FLOP/s and HBM bandwidth
# from the vendors' data sheets (H100 SXM, H200 SXM, A100 SXM 80GB, MI300X). A unit's recompute is charged its
# FLOPs at the first plus the bytes it writes again at the second (a sum over the unit's operators: each is
# compute- or memory-bound, so the sum bounds the roofline's max from above by at most 2x).
ROOFLINES: dict[str, tuple[float, float]] = {
    "h100": (989e12, 3.35e12), "h200": (989e12, 4.8e12), "a100": (312e12, 2.039e12), "mi300x": (1307e12, 5.3e12)}


@dataclass(frozen=True)
class CostModel:
    """What a unit costs, as an integer the solver adds up (the default objective is ``'time'``).

    ``objective='extra_flops'``: FLOPs (the recomputed FLOPs, plus offload transfer seconds x
    ``flops_per_second``); ``'time'``: nanoseconds (FLOPs / ``flops_per_second`` plus the bytes the
    recomputation writes / ``memory_bandwidth``, plus transfer seconds). FLOP counters give norms, softmax,
    dropout and activations no FLOPs, so the FLOP objective recomputes them (``non_matmul``) for free; the time
    objective charges their memory traffic (each recomputed byte written once: a lower bound). With
    ``measured`` (seconds per layer forward, per selective module and per operator class,
    :func:`measure_layer_times`) recompute is priced by those times instead (in FLOP-equivalents at
    ``flops_per_second`` for the FLOP objective); a ``keep_ops`` layer costs ``sac_overhead`` plus the measured
    times of the operators it does not keep (``op_<i>``).
    Offloading a group input of ``hidden_bytes`` costs ``hidden_bytes / bandwidth`` twice: the copy out overlaps
    one layer's forward (only the excess is charged), the copy back is charged in full (NOTE [offload charge]).
    """

    objective: str = "time"
    flops_per_second: float = 400e12
    bandwidth: float = 25e9
    measured: tuple[tuple[str, float], ...] | None = None
    memory_bandwidth: float = 3e12

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise PlanError(f"unknown objective {self.objective!r}: use {' or '.join(OBJECTIVES)}")
        for name in ("flops_per_second", "bandwidth", "memory_bandwidth"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise PlanError(f"{name}={value!r} must be a positive number")

    def _seconds_to_cost(self, seconds: float) -> int:
        return math.ceil(seconds * self.flops_per_second) if self.objective == "extra_flops" else \
            math.ceil(seconds * 1e9)

    def layer_forward_seconds(self, model: UnitModel) -> float:
        if self.measured is not None:
            return dict(self.measured)["layer"]
        return model.layer_forward_flops / self.flops_per_second

    # NOTE [offload charge]: the copy of a group's input to the host runs on a side stream while the following
    # layers' forward runs, so only what exceeds one layer's forward time is charged; the copy back is issued when
    # the group's backward starts and is charged in full (remat restores just in time and does not prefetch, so
    # nothing hides it; a prefetch during the previous group's backward would hide it but would also hold the input
    # on the device during that backward, which the memory model would then have to charge).
    def offload_seconds(self, model: UnitModel) -> float:
        """Transfer time charged per offloaded group (see the class docstring)."""
        t = model.hidden_bytes / self.bandwidth
        return t + max(0.0, t - self.layer_forward_seconds(model))

    def recompute_seconds(self, model: UnitModel, unit: Unit) -> float:
        if self.measured is not None:
            times = dict(self.measured)
            if unit.is_group:
                return unit.size * times["layer"]
            kept = kept_operators(unit.modules)
            if kept is not None:  # the fixed price of a keep_ops layer, plus each item it does not keep
                return times.get("sac_overhead", 0.0) + sum(
                    t for key, t in times.items() if key.startswith("op_") and int(key[3:]) not in kept)
            if "non_matmul" in unit.modules:
                limit = contraction_limit(unit.modules)
                modules = [m for m in unit.modules if m in ("core_attn", "mlp")]
                contractions = sum(t for key, t in times.items() if key.startswith("contraction_")
                                   and int(key.removeprefix("contraction_")) <= limit)
                # (non_matmul layers run on remat's lean selective checkpoint, remat.recompute.operator_checkpoint:
                # sac_overhead, torch's selective checkpointing per keep_ops layer, is not theirs)
                return times["non_matmul"] + sum(times[f"{m}_matmuls"] for m in modules) + contractions
            return sum(times[m] for m in unit.modules)
        shape = model.shape(unit)
        return shape.recompute_flops / self.flops_per_second + shape.recompute_bytes / self.memory_bandwidth

    def cost(self, model: UnitModel, unit: Unit) -> int:
        """What ``unit`` adds to the objective: its recomputed FLOPs (``extra_flops``) or nanoseconds (``time``:
        :meth:`recompute_seconds`), plus an offloaded group's transfer charge. Measured times are rounded up to
        1/256 of a layer's forward time (a coarser grid keeps the solver's Pareto sets small)."""
        if unit.mode == "keep":
            return 0
        if self.measured is None:
            base = model.shape(unit).recompute_flops if self.objective == "extra_flops" else \
                self._seconds_to_cost(self.recompute_seconds(model, unit))
        else:
            grid = dict(self.measured)["layer"] / 256
            seconds = math.ceil(self.recompute_seconds(model, unit) / grid - 1e-9) * grid
            base = self._seconds_to_cost(seconds)
        if unit.mode == "offload":
            base += self._seconds_to_cost(self.offload_seconds(model))
        return base

    def extra_seconds(self, model: UnitModel, unit: Unit) -> float:
        """Predicted seconds ``unit`` adds to a step: the time objective's value, or under the FLOP objective the
        same roofline (recomputed FLOPs at ``flops_per_second``, rebuilt bytes at ``memory_bandwidth``, offload
        transfers charged): what reports compare plans by besides FLOPs."""
        if unit.mode == "keep":
            return 0.0
        if self.objective == "time":
            return self.cost(model, unit) * 1e-9
        shape = model.shape(unit)
        seconds = shape.recompute_flops / self.flops_per_second + shape.recompute_bytes / self.memory_bandwidth
        return seconds + (self.offload_seconds(model) if unit.mode == "offload" else 0.0)

    def operator_price(self) -> Callable[[LayerOperator], float]:
        """What recomputing one operator of a layer costs under this model, for ordering a layer's operators by
        price per byte (:func:`remat.plan.operator_space.operator_kinds`): measured seconds (``op_<i>``), the
        roofline's seconds (``time``), or FLOPs (``extra_flops``)."""
        if self.measured is not None:
            return measured_price(dict(self.measured))
        if self.objective == "time":
            return roofline_price(self.flops_per_second, self.memory_bandwidth)
        return lambda op: float(op.flops)

    def plain_step_seconds(self, model: UnitModel, num_layers: int, baseline_flops: int) -> float:
        """The predicted seconds of a step without recompute, what step-time ratios divide by. With measured
        times: ``num_layers`` measured layer steps (forward + backward; 3 forwards when not measured). Else the
        roofline: the step's forward and backward FLOPs (``baseline_flops``) at ``flops_per_second``, plus three
        times each layer's forward bytes (what recomputing a layer writes, traced) at ``memory_bandwidth`` (the
        backward writes about twice what the forward does)."""
        if self.measured is not None:
            times = dict(self.measured)
            return num_layers * times.get("layer_step", 3 * times["layer"])
        layer_bytes = model.shape(Unit("checkpoint", 1)).recompute_bytes
        return baseline_flops / self.flops_per_second + 3 * num_layers * layer_bytes / self.memory_bandwidth

    def describe(self) -> str:
        unit = "FLOPs" if self.objective == "extra_flops" else "ns"
        how = "measured forward times" if self.measured is not None else "FLOP counts" if \
            self.objective == "extra_flops" else f"FLOP counts and bytes at {self.memory_bandwidth / 1e9:g} GB/s"
        return (f"{self.objective} ({unit}, recompute priced by {how}; offload at {self.bandwidth / 1e9:g} GB/s, "
                f"{self.flops_per_second / 1e12:g} TFLOP/s)")


class _OperatorTimer(TorchDispatchMode):
    """Seconds spent in operators: matrix multiplies inside each named module, everything else (non_matmul)."""

    def __init__(self, sync: Callable[[], None], inside: Callable[[], str | None]):
        super().__init__()
        self.sync, self.inside = sync, inside
        self.spent: dict[str, float] = {}
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        self.sync()
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.sync()
        seconds = time.perf_counter() - start
        where = self.inside()
        key = "non_matmul" if func.overloadpacket not in MATMUL_OPS else f"{where}_matmuls" if where else "matmuls"
        self.spent[key] = self.spent.get(key, 0.0) + seconds
        if func not in SAC_IGNORED_OPS and not in_collective():  # numbered as keep_ops numbers them
            self.spent[f"op_{self.count}"] = seconds
            self.count += 1
        k = contraction(func, args)
        if k is not None:
            self.spent[f"contraction_{k}"] = self.spent.get(f"contraction_{k}", 0.0) + seconds
        return out


def measure_layer_times(config: ModelConfig, *, device: str = "cpu", repeats: int = 5) -> dict[str, float]:
    """Median forward seconds, on this machine, of one reference layer and of each submodule selective recompute
    can target (``core_attn``, ``mlp``, ``layernorm`` = both norms, ``act``), with grad enabled as in a
    recomputation; and, timed operator by operator in another pass, ``non_matmul`` (the layer's operators other
    than matrix multiplies: what a non_matmul layer recomputes), ``core_attn_matmuls`` / ``mlp_matmuls`` (the
    matrix multiplies inside those modules), ``contraction_<K>`` (the matrix multiplies of contraction size K,
    what ``matmul_k<N>`` adds for K <= N) and ``op_<i>`` (operator i of the layer, numbered as ``keep_ops(...)``
    numbers them, for each operator a keep_ops layer may keep: :func:`remat.plan.operator_space.layer_operators`);
    then ``layer_step`` (one layer's forward + backward) and ``sac_overhead`` (what a keep_ops layer keeping all
    it may keep adds to it: torch's selective-checkpointing dispatch and the operators it always recomputes).
    Real tensors: the config must fit in this machine's memory."""
    cfg = config.replace(num_layers=1)
    model = build_model(cfg, device=device)
    layer = model.layers[0]
    b, s, h = cfg.micro_batch_size, cfg.seq_length, cfg.hidden_size
    hidden = torch.randn(b, s, h, device=device, dtype=cfg.torch_dtype, requires_grad=True)
    mask = torch.ones(s, s, dtype=torch.bool, device=device).tril_().view(1, 1, s, s)
    rotary = model.rotary_tables(s, torch.device(device))
    targets = {"core_attn": [layer.self_attention.core_attention], "mlp": [layer.mlp],
               "layernorm": [layer.input_layernorm, layer.pre_mlp_layernorm], "act": [layer.mlp.activation]}
    spent: dict[str, float] = {}
    began: dict[int, float] = {}
    inside: list[str] = []

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def pre_for(name: str) -> Callable[..., None]:
        def pre(module: nn.Module, args: Any) -> None:
            sync()
            inside.append(name)
            began[id(module)] = time.perf_counter()
        return pre

    def post_for(name: str) -> Callable[..., None]:
        def post(module: nn.Module, args: Any, out: Any) -> None:
            sync()
            inside.pop()
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - began[id(module)]
        return post

    handles = []
    for name, modules in targets.items():
        for m in modules:
            handles += [m.register_forward_pre_hook(pre_for(name)), m.register_forward_hook(post_for(name))]
    ops = layer_operators(config)
    operator_keys = ["non_matmul", "core_attn_matmuls", "mlp_matmuls",
                     *(f"contraction_{k}" for k in layer_contractions(config)),
                     *(f"op_{op.index}" for op in ops if op.item >= 0)]
    samples: dict[str, list[float]] = {k: [] for k in ["layer", *targets, *operator_keys]}
    try:
        for i in range(repeats + 1):
            spent.clear()
            sync()
            t0 = time.perf_counter()
            out = layer(hidden, mask, rotary)
            sync()
            total = time.perf_counter() - t0
            modules = dict(spent)
            del out
            timer = _OperatorTimer(sync, lambda: next((n for n in reversed(inside) if n in ("core_attn", "mlp")),
                                                      None))
            with timer:
                out = layer(hidden, mask, rotary)
            del out
            if i == 0:
                continue  # warm-up
            samples["layer"].append(total)
            for name in targets:
                samples[name].append(modules.get(name, 0.0))
            for name in operator_keys:
                samples[name].append(timer.spent.get(name, 0.0))
    finally:
        for handle in handles:
            handle.remove()
    out = {k: float(np.median(v)) for k, v in samples.items()}
    out["layer_step"], out["sac_overhead"] = _layer_steps(cfg, device, repeats, ops, sync)
    return out


def _layer_steps(cfg: ModelConfig, device: str, repeats: int, ops: Sequence[LayerOperator],
                 sync: Callable[[], None]) -> tuple[float, float]:
    """Median seconds of one layer's forward + backward, and the median extra seconds when the layer is a
    keep_ops layer keeping every operator it may keep (what every keep_ops layer pays for torch's selective
    checkpointing, plus the operators it always recomputes), timed alternately."""
    layers = []
    for kept in (None, [op.index for op in ops if op.item >= 0]):
        model = build_model(cfg, device=device, seed=0)
        if kept is not None:
            apply(model, Plan.from_units([Unit("selective", 1, (keep_ops_token(kept),))]))
        layers.append(model.layers[0])
    b, s, h = cfg.micro_batch_size, cfg.seq_length, cfg.hidden_size
    hidden = torch.randn(b, s, h, device=device, dtype=cfg.torch_dtype, requires_grad=True)
    mask = torch.ones(s, s, dtype=torch.bool, device=device).tril_().view(1, 1, s, s)
    rotary = build_model(cfg, device=device).rotary_tables(s, torch.device(device))
    grad = torch.ones(b, s, h, device=device, dtype=cfg.torch_dtype)
    samples: list[list[float]] = [[], []]
    for i in range(2 * repeats + 1):  # a difference of two steps: more rounds than for one
        for k, layer in enumerate(layers):
            sync()
            t0 = time.perf_counter()
            layer(hidden, mask, rotary).backward(grad)
            sync()
            if i:
                samples[k].append(time.perf_counter() - t0)
    plain = float(np.median(samples[0]))
    return plain, max(0.0, float(np.median([b - a for a, b in zip(*samples)])))


# ------------------------------------------------------------------------------------------------ solver
def candidate_units(num_layers: int, *, offload: bool = True, engine: str = "reentrant",
                    selective_sets: Iterable[Sequence[str]] | None = None,
                    max_group: int | None = None, contractions: Sequence[int] = (),
                    operator_sets: Sequence[Sequence[str]] = ()) -> list[Unit]:
    """The units the extended search may use: keep, each selective set, ``non_matmul+matmul_k<K>`` for each of
    the layer's contraction sizes ``contractions`` (:attr:`UnitModel.contractions`) when the sets allow
    ``non_matmul``, the ``keep_ops(...)`` sets ``operator_sets`` (:func:`remat.plan.operator_space.operator_kinds`;
    the unit model must hold them, :func:`remat.plan.unit_model.add_traced_units`), checkpoint (and offload)
    groups of 1 .. ``max_group`` (default: the whole stack) layers."""
    sets = SELECTIVE_SETS if selective_sets is None else tuple(
        tuple(m for m in SELECTIVE_MODULES if m in set(s)) for s in selective_sets)
    if ("non_matmul",) in sets:
        sets += contraction_sets(contractions)
    units = [KEEP, *(Unit("selective", 1, s) for s in sets), *(Unit("selective", 1, tuple(s)) for s in operator_sets)]
    top = num_layers if max_group is None else max(1, min(max_group, num_layers))
    modes = ("checkpoint", "offload") if offload and engine == "reentrant" else ("checkpoint",)
    units += [Unit(m, k) for m in modes for k in range(1, top + 1)]
    return units
