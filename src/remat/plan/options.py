"""Options of :func:`remat.plan.plan` and :func:`remat.plan.plan_pipeline`: what to search and how to price it
(:class:`PlanOptions`), and how the job is split over GPUs (:class:`ParallelOptions`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from remat.config import ModelConfig
from remat.offload_policy import MIN_OFFLOADED_TENSOR_SIZE
from remat.plan.costs import ROOFLINES, CostModel, measure_layer_times
from remat.plan.space import OBJECTIVES, selective_sets
from remat.policy import ENGINES, SELECTIVE_MODULES
from remat.recompute.plan_format import PlanError
from remat.units import DEFAULT_RESERVE, GPU_PRESETS, SizeError, format_bytes, parse_budget, parse_reserve

DEVICES = ("cpu", "cuda")
DEFAULT_FLOPS, DEFAULT_MEMORY_BANDWIDTH = 400e12, 3e12  # PlanOptions' throughput and device memory bandwidth
# the keys measure_layer_times returns for every model (contraction_<K> keys are optional)
MEASURED_KEYS = ("layer", "core_attn", "mlp", "layernorm", "act", "non_matmul", "core_attn_matmuls", "mlp_matmuls")


class OptionError(PlanError):
    """A :class:`PlanOptions` or :class:`ParallelOptions` field refused: ``field`` is its name and ``reason`` why
    and the fix (so that ``remat plan`` can name its flag instead of the field)."""

    def __init__(self, message: str, field: str = "", reason: str = "") -> None:
        super().__init__(message)
        self.field, self.reason = field, reason


def _refuse(owner: str, name: str, value: object, reason: str) -> OptionError:
    return OptionError(f"{owner}.{name}={value!r}: {reason}", name, reason)


def _positive(owner: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
        raise _refuse(owner, name, value, "give a positive finite number")


def _count(owner: str, name: str, value: object, minimum: int, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _refuse(owner, name, value, fix)


@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    """What :func:`~remat.plan.plan` searches and how it prices recompute. Every field has a default; the
    defaults are ``remat plan``'s."""

    reserve: str | float | None = DEFAULT_RESERVE
    """What a GPU-preset budget (``'h100-80g'``) keeps free: a percentage (``'10%'``), a fraction (``0.1``) or bytes
    (``'2GiB'``); None keeps nothing. A byte budget is taken as given."""

    objective: str = "time"
    """``'time'`` (the default): the least predicted step time (recompute priced by a roofline: FLOPs at
    :attr:`flops_per_second` plus recomputed bytes at :attr:`memory_bandwidth`, a GPU's with :attr:`roofline`; or
    by operator times measured on this machine, :attr:`measured_times`); ``'extra_flops'``: the fewest
    recomputed FLOPs."""

    engine: str = "reentrant"
    """Checkpoint implementation the plans use (:data:`remat.policy.ENGINES`); offload groups need
    ``'reentrant'``."""

    device: str = "cpu"
    """``'cpu'``: exact storage bytes; ``'cuda'``: CUDA's 512-byte allocator blocks."""

    offload: bool = True
    """Let the extended search offload a group's input to host memory (only with the reentrant engine)."""

    fine_grained_offload: bool = False
    """Make Megatron's fine-grained activation offloading a candidate (:func:`remat.plan.fine_offload.choose_offload`:
    none and selective/core_attn beside each offload module set, and the cheaper recompute settings that do not fit
    alone; transfers at :attr:`bandwidth`, each way overlapped with up to one layer's forward). The cheapest variant
    that fits becomes the Megatron answer when it costs less than the best recompute-only setting; every variant
    traced is reported (``stats['fine_grained_offload']``)."""

    min_offloaded_tensor_size: int = MIN_OFFLOADED_TENSOR_SIZE
    """With :attr:`fine_grained_offload`: the variants' minimum offloaded tensor size in elements (Megatron's
    ``--min-offloaded-tensor-size``, default 1048576); smaller saved tensors stay on the device."""

    selective_sets: str | Iterable[Sequence[str]] | None = None
    """The module sets selective layers may recompute: None for all (:data:`remat.plan.space.SELECTIVE_SETS`), a
    comma list of modules (``'core_attn,mlp'``: the sets made of those) or the sets themselves. Stored as a tuple of
    sets."""

    operator_sets: int | None = 16
    """How many ``keep_ops(...)`` kinds per layer the extended search offers (NOTE [operator kinds] in
    :mod:`remat.plan.operator_space`: which operators' outputs a layer keeps, ordered by recompute price per byte
    freed), spread evenly over the bytes they free; None: every one; 0: none. Only when :attr:`selective_sets`
    is None (restricting the module sets restricts the search to them), and not for MoE models (their layers'
    operators depend on the routing)."""

    measured_times: bool | Mapping[str, float] = False
    """Price recompute by times measured on this machine (True: :func:`measure_layer_times` runs, module by
    module and operator by operator; or pass its dict, e.g. a previous result's ``stats['measured_times']``).
    Implies the time objective."""

    flops_per_second: float = DEFAULT_FLOPS
    """Compute throughput that converts between seconds and FLOPs."""

    bandwidth: float = 25e9
    """Host-device bandwidth for offload, bytes per second (PCIe 4 x16: 25e9)."""

    memory_bandwidth: float = DEFAULT_MEMORY_BANDWIDTH
    """Device memory bandwidth, bytes per second: prices recomputed bytes under the time objective."""

    roofline: str | None = None
    """A GPU whose FLOP/s and memory bandwidth price the time objective (:data:`remat.plan.costs.ROOFLINES`:
    ``'h100'``, ``'h200'``, ``'a100'``, ``'mi300x'``); replaces :attr:`flops_per_second` and
    :attr:`memory_bandwidth`. None: those two as given."""

    max_resolves: int = 4
    """How often a plan whose traced peak exceeds the budget is re-solved under a lower budget before giving up."""

    def __post_init__(self) -> None:
        owner = "PlanOptions"
        if self.reserve is not None:
            try:
                parse_reserve(self.reserve, GPU_PRESETS["h100-80g"])
            except (SizeError, OverflowError) as err:
                raise _refuse(owner, "reserve", self.reserve, str(err).removeprefix("reserve: ")) from None
        if self.objective not in OBJECTIVES:
            raise _refuse(owner, "objective", self.objective, f"use {' or '.join(map(repr, OBJECTIVES))}")
        if self.engine not in ENGINES:
            raise _refuse(owner, "engine", self.engine, f"use {' or '.join(map(repr, ENGINES))}")
        if self.device not in DEVICES:
            raise _refuse(owner, "device", self.device, f"use {' or '.join(map(repr, DEVICES))}")
        if not isinstance(self.offload, bool):
            raise _refuse(owner, "offload", self.offload, "give True or False")
        if not isinstance(self.fine_grained_offload, bool):
            raise _refuse(owner, "fine_grained_offload", self.fine_grained_offload, "give True or False")
        _count(owner, "min_offloaded_tensor_size", self.min_offloaded_tensor_size, 0,
               f"give the elements below which a saved tensor stays on the device, an int >= 0 (Megatron's default "
               f"{MIN_OFFLOADED_TENSOR_SIZE})")
        if self.min_offloaded_tensor_size != MIN_OFFLOADED_TENSOR_SIZE and not self.fine_grained_offload:
            raise _refuse(owner, "min_offloaded_tensor_size", self.min_offloaded_tensor_size, "has no effect without "
                          "fine_grained_offload: set fine_grained_offload=True (--fine-grained-offload) or drop it")
        object.__setattr__(self, "selective_sets", _selective_sets(self.selective_sets))
        if not isinstance(self.measured_times, (bool, Mapping)):
            raise _refuse(owner, "measured_times", self.measured_times, "give True, False or the dict of "
                          "measure_layer_times")
        if isinstance(self.measured_times, Mapping):
            _check_measured_times(self.measured_times)
        for name in ("flops_per_second", "bandwidth", "memory_bandwidth"):
            _positive(owner, name, getattr(self, name))
        _check_objective(self)
        _count(owner, "max_resolves", self.max_resolves, 0, "give a count >= 0")
        if self.operator_sets is not None:
            _count(owner, "operator_sets", self.operator_sets, 0, "give a count >= 0 (0: no keep_ops kinds) or None "
                   "(all of them)")
        if self.roofline is not None:
            if self.roofline not in ROOFLINES:
                raise _refuse(owner, "roofline", self.roofline, f"use one of {', '.join(ROOFLINES)} or None")
            fps, bandwidth = ROOFLINES[self.roofline]
            for name, flag, default, own in (("flops_per_second", "--throughput", DEFAULT_FLOPS, fps),
                                             ("memory_bandwidth", "--memory-bandwidth", DEFAULT_MEMORY_BANDWIDTH,
                                              bandwidth)):
                if getattr(self, name) not in (default, own):  # the roofline would replace it unseen
                    raise _refuse(owner, name, getattr(self, name), f"roofline={self.roofline!r} (--roofline) "
                                  f"sets it: drop {name} ({flag}) or roofline")
            object.__setattr__(self, "flops_per_second", fps)
            object.__setattr__(self, "memory_bandwidth", bandwidth)

    def cost_model(self, config: ModelConfig) -> CostModel:
        """The :class:`CostModel` these options price with; measures the layer times first when
        ``measured_times=True`` (on CUDA when ``device='cuda'`` and one is available)."""
        measured = None
        if self.measured_times:
            if isinstance(self.measured_times, Mapping):
                times = dict(self.measured_times)
            else:
                here = "cuda" if self.device == "cuda" and torch.cuda.is_available() else "cpu"
                times = measure_layer_times(config, device=here)
            measured = tuple(sorted(times.items()))
        objective = "time" if measured is not None else self.objective
        return CostModel(objective, self.flops_per_second, self.bandwidth, measured, self.memory_bandwidth)

    def budget(self, budget: int | str) -> tuple[int, str]:
        """``(bytes, description)`` of ``budget``: bytes, or text such as ``'70GiB'`` or ``'h100-80g'`` (minus
        :attr:`reserve`)."""
        if isinstance(budget, str):
            return parse_budget(budget, self.reserve)
        if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
            raise PlanError(f"budget={budget!r}: give bytes (a positive int) or text such as '70GiB' or 'h100-80g'")
        return budget, format_bytes(budget)


def _check_measured_times(times: Mapping[str, float]) -> None:
    """Refuse measured times that are missing a key, not finite numbers >= 0, or a zero layer time (what the step
    time of a plan is measured in)."""
    missing = [k for k in MEASURED_KEYS if k not in times]
    if missing:
        raise OptionError(f"PlanOptions.measured_times lacks {', '.join(missing)}: pass what "
                          "remat.plan.measure_layer_times returns, or True to measure here", "measured_times")
    for key, seconds in times.items():
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds < float("inf") or (
                key == "layer" and seconds == 0):
            raise OptionError(f"PlanOptions.measured_times[{key!r}]={seconds!r}: give seconds, a finite number >= 0 "
                              "(> 0 for 'layer'), as remat.plan.measure_layer_times returns", "measured_times")


def _check_objective(options: PlanOptions) -> None:
    """Refuse pricing options the FLOP objective would ignore: measured times and a roofline price time."""
    if options.objective != "extra_flops":
        return
    for name, flag in (("measured_times", "--measured-times"), ("roofline", "--roofline")):
        value = getattr(options, name)
        if value is not None and value is not False:
            raise _refuse("PlanOptions", name, value if not isinstance(value, Mapping) else "{...}",
                          f"prices recompute in time, but objective='extra_flops' (--objective extra_flops) counts "
                          f"FLOPs: drop {name} ({flag}) or use objective='time'")


def _selective_sets(value: object) -> tuple[tuple[str, ...], ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return selective_sets(value)
    try:
        items = tuple(value)  # type: ignore[call-overload]
        if any(isinstance(s, str) for s in items):
            raise TypeError
        sets = tuple(tuple(s) for s in items)
    except TypeError:
        raise PlanError(f"PlanOptions.selective_sets={value!r}: give a comma list of modules ('core_attn,mlp') or "
                        "a list of module sets ([('core_attn',), ('core_attn', 'mlp')])") from None
    unknown = sorted({m for s in sets for m in s if m not in SELECTIVE_MODULES and not m.startswith("matmul_k")})
    if unknown:
        raise PlanError(f"PlanOptions.selective_sets names {', '.join(map(repr, unknown))}: valid modules are "
                        f"{', '.join(SELECTIVE_MODULES)}")
    return sets


@dataclass(frozen=True, kw_only=True)
class ParallelOptions:
    """How the training job is split over GPUs: one tensor-parallel rank (``tp``, ``sp``) or pipeline stages
    (``pp``, ``microbatches``, ``schedule``), not both yet. The default is one unsharded GPU."""

    tp: int = 1
    """Tensor-parallel size: plan one rank under Megatron's sharding of heads, MLP and vocabulary."""

    sp: bool = False
    """Sequence parallelism (with ``tp``): norms, dropouts and residuals hold 1/tp of the tokens."""

    pp: int | None = None
    """Pipeline stages: also plan each stage separately (:func:`~remat.plan.plan_pipeline`). None: no pipeline."""

    microbatches: int | None = None
    """Microbatches per step with ``pp`` (None: ``pp``)."""

    schedule: str = "1f1b"
    """Pipeline schedule with ``pp`` (:mod:`remat.parallel.schedule`: ``'1f1b'``, ``'gpipe'``, ...)."""

    vpp: int = 1
    """Model chunks per pipeline stage; per-stage plans need 1."""

    runtime: str = "torch"
    """Whose pipeline the stage timelines model: ``'torch'`` (torch.distributed.pipelining) or ``'megatron'``."""

    def __post_init__(self) -> None:
        owner = "ParallelOptions"
        _count(owner, "tp", self.tp, 1, "give the tensor-parallel size, an int >= 1")
        if not isinstance(self.sp, bool):
            raise PlanError(f"{owner}.sp={self.sp!r}: give True or False")
        if self.pp is not None:
            _count(owner, "pp", self.pp, 1, "give the number of pipeline stages, an int >= 1, or None")
        if self.microbatches is not None:
            _count(owner, "microbatches", self.microbatches, 1, "give the microbatches per step, an int >= 1")
            if self.pp is None:
                raise _refuse(owner, "microbatches", self.microbatches, "given without pp: set pp (--pp, the pipeline "
                              "stages) or drop microbatches (--microbatches)")
        if self.schedule != "1f1b" and self.pp is None:
            raise _refuse(owner, "schedule", self.schedule, "a pipeline schedule, given without pp: set pp "
                          "(--pp, the pipeline stages) or drop schedule (--schedule)")
        _count(owner, "vpp", self.vpp, 1, "give the model chunks per stage, an int >= 1")
        if (self.tp > 1 or self.sp) and self.pp is not None:
            raise PlanError("plan takes tensor parallelism (tp/sp) or pipeline stages (pp), not both yet: plan a "
                            "pipeline stage's layers with tp, or drop tp")

    @property
    def tensor_parallel(self) -> bool:
        """True when planning one rank of a tensor-parallel group."""
        return self.tp > 1 or self.sp

    @property
    def num_microbatches(self) -> int:
        """``microbatches``, or ``pp`` when unset (a pipeline needs ``pp``)."""
        if self.pp is None:
            raise PlanError("ParallelOptions.pp is None: set pp (pipeline stages) to plan a pipeline")
        return self.microbatches or self.pp
