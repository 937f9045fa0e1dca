"""``remat plan``: the cheapest recompute plan whose predicted peak memory fits a budget, guaranteed.

A :class:`Plan` says, for every layer of the reference GPT's stack, one of four things:

* ``keep``: the layer keeps every activation its backward needs (no recompute);
* ``selective``: the named submodules of the layer (``core_attn``, ``mlp``, ``layernorm``, ``act``; see
  :mod:`remat.policy`) are checkpointed and recomputed in backward, the rest is kept; or, with ``non_matmul``,
  the layer keeps only its matrix multiplies' outputs and recomputes every other operator (and the matrix
  multiplies of ``core_attn``/``mlp`` when named with it, or, with ``matmul_k<K>``, those whose contraction
  dimension is <= K: the smallest K frees the most bytes per recomputed FLOP); ``non_matmul`` alone recomputes
  no FLOPs and frees most of the layer's bytes. The extended search offers ``matmul_k<K>`` for each contraction
  size of the layer (:func:`layer_contractions`);
* ``checkpoint``: the layer belongs to a group of consecutive layers that is one checkpoint: only the group's
  inputs are kept and the whole group is recomputed in backward (Megatron's full recompute, but the groups may
  have any sizes and may be anywhere);
* ``offload``: a checkpoint group whose kept hidden-states input waits for backward in host memory (pinned on
  CUDA) instead of device memory, and is copied back when the group's backward starts (see
  ``remat.apply.offload_to_host``). Gradients are the plain model's, bit for bit.

:func:`plan` answers "what is the cheapest way to fit this budget" twice:

(a) **Megatron space**: every setting Megatron-LM's flags can express (``none``, ``full/uniform/K``,
    ``full/block/K`` for K = 1..L, ``selective`` with each set of core_attn/mlp/layernorm), each predicted by
    :func:`remat.predict.predict_many` (exact fake traces, composed for deep stacks); the answer is the setting
    of least extra compute whose predicted peak is <= the budget.
(b) **Extended space**: every plan made of the four layer modes above, with groups of any sizes. An exact dynamic
    program (:func:`solve`) finds the plan of least extra compute whose *modelled* peak is <= the budget. The
    model (:class:`UnitModel`) is built from two fake traces (``FakeTensorMode``, once per model shape): a stack
    that holds each kind of unit once (a kept layer, a selective layer per module set, checkpoint/offload groups
    of 1, 2 and 3 layers; larger groups repeat a middle layer's events), cut at unit boundaries marked by module
    hooks into per-unit forward and backward event blocks (each block's net bytes, its highest point and the
    FLOPs it recomputes), and a plain two-layer stack for the head when no unit keeps the attention mask. A
    step's live bytes are then a sum of blocks in execution order (setup and embedding, each unit's forward
    bottom-up, the head's forward and backward, each unit's backward top-down, the embedding's backward), plus
    two non-local terms handled exactly: parameter gradients accumulate (a fixed amount per layer) and the
    attention mask / rotary tables live until the lowest unit that keeps them has run its backward. The
    dynamic program walks the stack bottom-up over states (layers planned, which side inputs are kept below)
    with Pareto sets of (bytes kept below, extra compute); a unit's backward bound only needs the bytes kept
    below it and its position, so every constraint is checked exactly when its unit is added. Unit kinds that
    another kind beats on every count are left out, and the best Megatron setting's cost (with a
    fractional-knapsack lower bound on completing a partial plan) prunes the Pareto sets; 128 layers solve in
    a fraction of a second (``benchmarks/bench_plan.py`` times it). FLOP counters give norms and activations
    no FLOPs, so plans tying on FLOPs are then made to recompute as little as the budget allows (:func:`tidy`;
    the cost never rises).

**Guarantee.** The model is checked, not trusted: the chosen plan is predicted with the real trace
(:func:`predict_plan`: :func:`remat.compose.compose` from a shallow trace with every layer role of the plan, or
the whole stack traced when that is refused) and if its traced peak exceeds the budget the program is re-solved
under a budget lowered by the excess (at most a few times; a plan that never validates is not returned).
Every returned plan's *traced* peak is <= the budget. Where the model is exact (the tests compare it with full
traces on random plans of several model variants; the one known approximation is that the attention mask and
rotary tables are taken to be freed at the *end* of their lowest holder's backward, which can only over-estimate
by their bytes) re-solving never happens, and then a smaller budget never gives a cheaper plan (the feasible
set shrinks) and the dynamic program's answer is the exact optimum of the extended space (the tests compare it
with brute force over all segmentations of a 6-layer model). A budget below the smallest reachable peak raises
:class:`BudgetError` with that peak (``min_peak_bytes``) and the plan that reaches it (``plan``).

**Cost.** Extra compute is the FLOPs of what is recomputed (``torch.utils.flop_counter`` formulas, read from
the recompute phases of the fake traces: only matrix multiplies count, so ``non_matmul`` recompute is free), or,
with ``objective='time'``, seconds: FLOPs at ``flops_per_second`` plus the recomputed bytes at
``memory_bandwidth``, or, with ``measured_times=True``, the forward times of the recomputed layers, submodules
and operator classes measured on this machine. Offloading adds the transfer time of the group input, bytes /
``bandwidth``: the copy to the host runs on a side stream while the following layers' forward runs, so only
what exceeds one layer's forward time is charged; the copy back is issued when the group's backward starts and
is charged in full (remat restores just in time and does not prefetch, so nothing hides it; a prefetch during
the previous group's backward would hide it but would also hold the input on the device during that backward,
which the memory model would then have to charge). With the FLOP objective, seconds are converted to FLOPs at
``flops_per_second``.

**Tensor parallelism.** With ``tp`` (and ``sp``) the unit model, the Megatron sweep and the validation trace are
of one tensor-parallel rank (:mod:`remat.parallel`'s Megatron sharding on a simulated group), so the plan is one
GPU's. On real ranks a communication library may free a collective's buffer later than the simulated rank does
(gloo's worker thread did, in 5% of collectives, until remat's ranks waited for it), so the plans leave one
unsharded hidden-states tensor of room. Megatron's ``--distribute-saved-activations`` is not in the search
(``remat predict --tp`` predicts it), and tensor and pipeline parallelism are not planned together yet.

**Pipelines.** :func:`plan_pipeline` plans each pipeline stage separately (stage r holds up to ``pp - r``
microbatches under 1F1B, so stage 0 needs the most recompute), validates each stage with
:mod:`remat.pipeline`'s stage timelines, and reports the step time from the pipeline's critical path against the
best uniform (Megatron) setting.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import json
import math
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from remat.apply import MATMUL_OPS, apply, contraction, in_backward
from remat.compose import CompositionError, ShallowTrace, compose, layer_roles
from remat.config import ModelConfig
from remat.measure import CUDA_BLOCK, record_step
from remat.model import build_model, sample_batch
from remat.policy import (
    CONTRACTION_PREFIX,
    ENGINES,
    NON_MATMUL_INCLUDES,
    SELECTIVE_MODULES,
    Policy,
    PolicyError,
    contraction_limit,
    normalise_modules,
)
from remat.predict import predict_config, predict_many, rank_model_factory, trace_rank
from remat.timeline import Timeline

MODES = ("keep", "selective", "checkpoint", "offload")
OBJECTIVES = ("extra_flops", "time")
FORMAT = "remat.plan"
FORMAT_VERSION = 1
KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30

# Selective module sets a plan may use: every non-empty set of SELECTIVE_MODULES except those holding both mlp
# and act (act is inside mlp: one region cannot be nested in another) and those holding non_matmul with layernorm
# or act (non_matmul recomputes them already).
def _usable_set(modules: Iterable[str]) -> bool:
    mods = set(modules)
    return not {"mlp", "act"} <= mods and not ("non_matmul" in mods and mods & set(NON_MATMUL_INCLUDES))


SELECTIVE_SETS: tuple[tuple[str, ...], ...] = tuple(
    c for n in range(1, len(SELECTIVE_MODULES) + 1) for c in itertools.combinations(SELECTIVE_MODULES, n)
    if _usable_set(c))
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


class PlanError(ValueError):
    """A plan that is malformed or cannot be used as asked; the message says what to change."""


class BudgetError(ValueError):
    """The budget is below the smallest peak any plan reaches.

    ``min_peak_bytes`` is that smallest (traced) peak, ``plan`` the :class:`PlanChoice` that reaches it (its plan,
    parts and cost), ``budget_bytes`` the budget that was asked for.
    """

    def __init__(self, message: str, *, budget_bytes: int, min_peak_bytes: int, plan: PlanChoice):
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.min_peak_bytes = min_peak_bytes
        self.plan = plan


# ------------------------------------------------------------------------------------------------ budgets
_UNITS = {"": 1, "b": 1, "kib": KIB, "mib": MIB, "gib": GIB, "tib": 1 << 40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}

# Device memory as nvidia-smi reports it (memory.total, MiB), before any reserve.
GPU_PRESETS: dict[str, int] = {
    "a100-40g": 40960 * MIB,
    "a100-80g": 81920 * MIB,
    "h100-80g": 81559 * MIB,
    "h100-94g": 95830 * MIB,
    "h200": 143771 * MIB,
    "h200-141g": 143771 * MIB,
}
DEFAULT_RESERVE = "10%"


def parse_bytes(text: str | int | float) -> int:
    """``'70GiB'`` -> 75161927680. Units: B, KiB, MiB, GiB, TiB (powers of 2), KB, MB, GB, TB (powers of 10);
    case-insensitive, spaces allowed, a plain number is bytes. The result is rounded down to whole bytes."""
    if isinstance(text, bool):
        raise PlanError(f"a byte count is expected, got {text!r}")
    if isinstance(text, (int, float)):
        value, unit = float(text), ""
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
        if not match:
            raise PlanError(f"cannot read {text!r} as bytes: write e.g. 70GiB, 75GB, 512MiB or a plain number")
        value, unit = float(match.group(1)), match.group(2).lower()
        if unit not in _UNITS:
            raise PlanError(f"unknown unit {match.group(2)!r} in {text!r}: use B, KiB, MiB, GiB, TiB, KB, MB, GB "
                            "or TB")
    if not math.isfinite(value) or value <= 0:
        raise PlanError(f"a memory budget must be positive, got {text!r}")
    return int(value * _UNITS[unit])


def parse_budget(text: str | int, reserve: str | float | None = DEFAULT_RESERVE) -> tuple[int, str]:
    """``(bytes, description)`` of a budget: a byte count (:func:`parse_bytes`, taken as given) or a GPU preset
    name (:data:`GPU_PRESETS`) minus ``reserve``: a fraction (``0.1``), a percentage (``'10%'``) or bytes
    (``'2GiB'``) kept free for the CUDA context, allocator fragmentation and communication buffers."""
    if isinstance(text, str) and text.strip().lower() in GPU_PRESETS:
        name = text.strip().lower()
        total = GPU_PRESETS[name]
        keep = parse_reserve(reserve, total)
        if keep >= total:
            raise PlanError(f"--reserve {reserve!r} leaves nothing of {name}'s {total / GIB:.1f} GiB")
        return total - keep, f"{name} ({total / GIB:.1f} GiB) minus {keep / GIB:.2f} GiB reserve"
    if isinstance(text, str) and re.fullmatch(r"\s*[A-Za-z][\w.-]*\s*", text) and not re.fullmatch(
            r"\s*[0-9.]+\s*[A-Za-z]*\s*", text):
        raise PlanError(f"unknown GPU preset {text!r}: use one of {', '.join(GPU_PRESETS)} or a size such as 70GiB")
    value = parse_bytes(text)
    return value, _fmt_bytes(value)


def parse_reserve(reserve: str | float | None, total: int) -> int:
    """Bytes of ``total`` that ``reserve`` keeps free (see :func:`parse_budget`)."""
    if reserve is None:
        return 0
    if isinstance(reserve, (int, float)) and not isinstance(reserve, bool):
        if not 0 <= reserve < 1:
            raise PlanError(f"reserve={reserve!r}: a fraction must be in [0, 1); write bytes with a unit, e.g. 2GiB")
        return int(total * reserve)
    text = str(reserve).strip()
    if text.endswith("%"):
        try:
            pct = float(text[:-1])
        except ValueError:
            raise PlanError(f"cannot read reserve {reserve!r}: write e.g. 10% or 2GiB") from None
        if not 0 <= pct < 100:
            raise PlanError(f"reserve {reserve!r} must be in [0%, 100%)")
        return int(total * pct / 100)
    if re.fullmatch(r"0?\.[0-9]+|0", text):
        return parse_reserve(float(text), total)
    return parse_bytes(text)


def _fmt_seconds(t: float) -> str:
    for unit, size in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if t >= size:
            return f"{t / size:.3g} {unit}"
    return f"{t * 1e9:.3g} ns"


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


# ------------------------------------------------------------------------------------------------ plans
@dataclass(frozen=True)
class Unit:
    """One step of a plan, bottom-up: a kept layer, a selective layer, or a checkpoint/offload group."""

    mode: str                       # keep | selective | checkpoint | offload
    size: int = 1                   # layers (groups only; 1 otherwise)
    modules: tuple[str, ...] = ()   # selective only

    def __str__(self) -> str:
        if self.mode == "selective":
            return "selective/" + "+".join(self.modules)
        if self.mode in ("checkpoint", "offload"):
            return f"{self.mode}x{self.size}"
        return self.mode

    @property
    def is_group(self) -> bool:
        return self.mode in ("checkpoint", "offload")


KEEP = Unit("keep")


@dataclass(frozen=True)
class Segment:
    """Layers ``start .. stop-1`` in one mode. A ``checkpoint``/``offload`` segment is one checkpoint group; a
    ``keep``/``selective`` segment is a run of layers treated one by one."""

    mode: str
    start: int
    stop: int
    modules: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise PlanError(f"unknown plan mode {self.mode!r}: use one of {', '.join(MODES)}")
        for name in ("start", "stop"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise PlanError(f"segment {name}={value!r} must be a non-negative integer")
        if self.stop <= self.start:
            raise PlanError(f"segment {self.mode} {self.start}..{self.stop}: stop must be after start")
        mods = tuple(self.modules)
        if self.mode == "selective":
            if not mods:
                raise PlanError(f"selective segment modules {list(mods)}: name at least one of "
                                f"{', '.join(SELECTIVE_MODULES)}")
            try:
                mods = normalise_modules(mods)
            except PolicyError as err:
                raise PlanError(f"selective segment: {err}") from None
            if {"mlp", "act"} <= set(mods):
                raise PlanError("selective modules mlp and act cannot be combined (act is inside mlp): use mlp")
            if not _usable_set(mods):
                raise PlanError(f"selective modules {'+'.join(mods)}: non_matmul already recomputes layernorm and "
                                "act (they hold no matrix multiply): drop them")
        elif mods:
            raise PlanError(f"only selective segments name modules, not {self.mode}")
        object.__setattr__(self, "modules", mods)

    @property
    def layers(self) -> range:
        return range(self.start, self.stop)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mode": self.mode, "start": self.start, "stop": self.stop}
        if self.modules:
            out["modules"] = list(self.modules)
        return out


@dataclass(frozen=True)
class Plan:
    """A recompute plan for a stack of ``num_layers`` layers (a :class:`~remat.apply.RecomputeLayout`).

    ``segments`` cover layers ``0 .. num_layers-1`` in order without gaps; adjacent keep segments, and adjacent
    selective segments with the same modules, are merged. ``remat.apply(model, plan)`` applies it; offload
    segments need the reentrant engine.
    """

    num_layers: int
    segments: tuple[Segment, ...]
    engine: str = "reentrant"

    def __post_init__(self) -> None:
        if isinstance(self.num_layers, bool) or not isinstance(self.num_layers, int) or self.num_layers < 1:
            raise PlanError(f"num_layers={self.num_layers!r}: a plan needs at least one layer")
        if self.engine not in ENGINES:
            raise PlanError(f"unknown engine {self.engine!r}: use {' or '.join(ENGINES)}")
        segments = [s if isinstance(s, Segment) else Segment(**s) for s in self.segments]
        at = 0
        for seg in segments:
            if seg.start != at:
                raise PlanError(f"plan segments must cover layers 0..{self.num_layers - 1} in order: segment "
                                f"{seg.mode} {seg.start}..{seg.stop - 1} starts at {seg.start}, expected {at}")
            at = seg.stop
        if at != self.num_layers:
            raise PlanError(f"plan segments end at layer {at - 1} but the stack has {self.num_layers} layers")
        if self.engine != "reentrant" and any(s.mode == "offload" for s in segments):
            raise PlanError("offload segments need the reentrant engine")
        merged: list[Segment] = []
        for seg in segments:
            last = merged[-1] if merged else None
            if last is not None and seg.mode == last.mode and seg.mode in ("keep", "selective") and \
                    seg.modules == last.modules:
                merged[-1] = Segment(seg.mode, last.start, seg.stop, seg.modules)
            else:
                merged.append(seg)
        object.__setattr__(self, "segments", tuple(merged))

    # -- construction -------------------------------------------------------------------------------------
    @classmethod
    def from_units(cls, units: Sequence[Unit], engine: str = "reentrant") -> Plan:
        """The plan of ``units`` listed bottom-up (what :func:`solve` returns)."""
        segments, at = [], 0
        for unit in units:
            segments.append(Segment(unit.mode, at, at + unit.size, unit.modules))
            at += unit.size
        return cls(at, tuple(segments), engine)

    @classmethod
    def from_policy(cls, policy: Policy | str, num_layers: int) -> Plan:
        """The plan that does what a Megatron-style :class:`Policy` does on ``num_layers`` layers."""
        policy = Policy.parse(policy) if isinstance(policy, str) else policy
        if policy.distribute_saved_activations:
            raise PlanError(f"{policy}: distributed saved activations are not a plan mode")
        groups = policy.layer_groups(num_layers)
        segments: list[Segment] = []
        starts = {g[0]: g for g in groups}
        i = 0
        while i < num_layers:
            if i in starts:
                g = starts[i]
                segments.append(Segment("checkpoint", g[0], g[-1] + 1))
                i = g[-1] + 1
                continue
            mods = policy.selective_modules(i)
            segments.append(Segment("selective", i, i + 1, mods) if mods else Segment("keep", i, i + 1))
            i += 1
        return cls(num_layers, tuple(segments), policy.engine)

    # -- views --------------------------------------------------------------------------------------------
    def units(self) -> list[Unit]:
        """The plan as units, bottom-up: one per kept or selective layer, one per group."""
        out: list[Unit] = []
        for seg in self.segments:
            if seg.mode in ("checkpoint", "offload"):
                out.append(Unit(seg.mode, seg.stop - seg.start))
            else:
                out.extend(Unit(seg.mode, 1, seg.modules) for _ in seg.layers)
        return out

    def mode_of(self, layer: int) -> str:
        for seg in self.segments:
            if seg.start <= layer < seg.stop:
                return seg.mode
        raise PlanError(f"layer {layer} is outside the plan's {self.num_layers} layers")

    # -- RecomputeLayout ----------------------------------------------------------------------------------
    def _check_depth(self, depth: int) -> None:
        if depth != self.num_layers:
            raise PlanError(f"this plan is for {self.num_layers} layers but the stack has {depth}: plan the model "
                            "you apply it to")

    def layer_groups(self, depth: int) -> list[tuple[int, ...]]:
        """The checkpoint groups (checkpoint and offload segments) as tuples of consecutive layer indices."""
        self._check_depth(depth)
        return [tuple(s.layers) for s in self.segments if s.mode in ("checkpoint", "offload")]

    def offload_groups(self, depth: int) -> list[tuple[int, ...]]:
        """The groups whose kept hidden-states input is offloaded to host memory (read by :func:`remat.apply`)."""
        self._check_depth(depth)
        return [tuple(s.layers) for s in self.segments if s.mode == "offload"]

    def selective_modules(self, layer: int) -> tuple[str, ...]:
        """The submodules recomputed inside ``layer`` (empty outside selective segments)."""
        for seg in self.segments:
            if seg.start <= layer < seg.stop:
                return seg.modules if seg.mode == "selective" else ()
        return ()

    # -- text and JSON ------------------------------------------------------------------------------------
    def __str__(self) -> str:
        parts: list[str] = []
        segs = list(self.segments)
        i = 0
        while i < len(segs):
            seg = segs[i]
            name = "selective/" + "+".join(seg.modules) if seg.mode == "selective" else seg.mode
            if seg.mode in ("checkpoint", "offload"):
                size, j = seg.stop - seg.start, i
                while j + 1 < len(segs) and segs[j + 1].mode == seg.mode and \
                        segs[j + 1].stop - segs[j + 1].start == size:
                    j += 1
                last = segs[j].stop - 1
                span = f"{seg.start}-{last}" if last > seg.start else f"{seg.start}"
                parts.append(f"{name} {span}" + (f"/{size}" if j > i else ""))
                i = j + 1
                continue
            span = f"{seg.start}-{seg.stop - 1}" if seg.stop - 1 > seg.start else f"{seg.start}"
            parts.append(f"{name} {span}")
            i += 1
        text = ", ".join(parts)
        return text if self.engine == "reentrant" else f"{text} @{self.engine}"

    @classmethod
    def parse(cls, text: str) -> Plan:
        """Read :meth:`__str__`'s form: ``'keep 0-3, checkpoint 4-11/2, selective/core_attn 12, offload 13-14'``
        (``/K``: groups of K over the span); ``Plan.parse(str(p)) == p``."""
        if not isinstance(text, str) or not text.strip():
            raise PlanError(f"a plan string is expected, got {text!r}")
        body, _, engine = text.partition("@")
        engine = engine.strip() or "reentrant"
        segments: list[Segment] = []
        for piece in body.split(","):
            match = re.fullmatch(
                r"\s*(keep|checkpoint|offload|selective/([a-z0-9_+]+))\s+(\d+)(?:-(\d+))?(?:/(\d+))?\s*", piece)
            if not match:
                raise PlanError(f"cannot read plan segment {piece.strip()!r}: write e.g. 'keep 0-3', "
                                "'checkpoint 4-11/2', 'selective/core_attn+mlp 12-15', 'offload 16-17'")
            mode = match.group(1).split("/")[0]
            start = int(match.group(3))
            last = int(match.group(4)) if match.group(4) else start
            size = int(match.group(5)) if match.group(5) else last - start + 1
            if mode not in ("checkpoint", "offload") and match.group(5):
                raise PlanError(f"'/K' (groups of K) applies to checkpoint and offload segments, not {piece!r}")
            if size < 1 or (last - start + 1) % size:
                raise PlanError(f"{piece.strip()!r}: {last - start + 1} layers do not split into groups of {size}")
            modules = tuple(match.group(2).split("+")) if match.group(2) else ()
            if mode in ("checkpoint", "offload"):
                segments += [Segment(mode, s, s + size) for s in range(start, last + 1, size)]
            else:
                segments.append(Segment(mode, start, last + 1, modules))
        return cls(segments[-1].stop if segments else 0, tuple(segments), engine)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form; :meth:`from_dict` reads it back."""
        return {"format": FORMAT, "version": FORMAT_VERSION, "num_layers": self.num_layers, "engine": self.engine,
                "text": str(self), "segments": [s.to_dict() for s in self.segments]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """Read :meth:`to_dict`'s form (``text`` is ignored; ``segments`` are authoritative)."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise PlanError(f"not a remat plan: the field 'format' must be {FORMAT!r}")
        if data.get("version") != FORMAT_VERSION:
            raise PlanError(f"plan 'version' {data.get('version')!r} is not supported (this remat reads "
                            f"{FORMAT_VERSION})")
        try:
            segments = tuple(Segment(str(s["mode"]), int(s["start"]), int(s["stop"]), tuple(s.get("modules", ())))
                             for s in data["segments"])
            return cls(int(data["num_layers"]), segments, str(data.get("engine", "reentrant")))
        except (KeyError, TypeError) as err:
            raise PlanError(f"malformed plan: {type(err).__name__}: {err}") from err

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))

    # -- Megatron -----------------------------------------------------------------------------------------
    def megatron_policy(self) -> tuple[Policy | None, str]:
        """``(policy, '')`` when Megatron-LM's flags express this plan, else ``(None, why not)``."""
        units = self.units()
        modes = {u.mode for u in units}
        if "offload" in modes:
            return None, ("it offloads group inputs to host memory, which Megatron's recompute flags cannot "
                          "express (its fine-grained activation offloading works per module, beside recompute)")
        if any("non_matmul" in u.modules for u in units):
            return None, ("it recomputes every operator but the matrix multiplies (non_matmul, torch's selective "
                          "activation checkpointing); Megatron's --recompute-modules checkpoints whole modules")
        if modes == {"keep"}:
            return Policy(engine=self.engine), ""
        if modes == {"selective"}:
            sets = {u.modules for u in units}
            if len(sets) > 1:
                return None, ("its layers recompute different selective module sets; Megatron's "
                              "--recompute-modules applies one set to every layer")
            mods = next(iter(sets))
            if "act" in mods:
                return None, ("it recomputes the MLP activation ('act'), which Megatron offers only for MoE "
                              "experts (moe_act)")
            return Policy("selective", modules=mods, engine=self.engine), ""
        if "selective" in modes:
            return None, ("it mixes selective layers with other modes; Megatron applies one recompute "
                          "granularity to every layer")
        groups = [u.size for u in units if u.mode == "checkpoint"]
        if "keep" not in modes:
            k = groups[0]
            if all(g == k for g in groups[:-1]) and groups[-1] <= k:  # Megatron: end = min(start + K, L)
                return Policy("full", "uniform", k, engine=self.engine), ""
            return None, (f"its checkpoint groups have sizes {_sizes(groups)}; Megatron's uniform method uses "
                          "one size K for every group (the last one may be shorter)")
        # keep + checkpoint: Megatron's block method checkpoints the first K layers one by one
        first_keep = next(i for i, u in enumerate(units) if u.mode == "keep")
        if all(u.mode == "keep" for u in units[first_keep:]) and all(
                u.mode == "checkpoint" and u.size == 1 for u in units[:first_keep]):
            return Policy("full", "block", first_keep, engine=self.engine), ""
        return None, ("it keeps some layers and checkpoints others in groups other than 'the first K layers one "
                      "by one' (Megatron's block method); Megatron cannot place groups freely")

    def megatron_args(self) -> list[str]:
        """The Megatron-LM flags of this plan; raises :class:`PlanError` saying why when there are none."""
        policy, why = self.megatron_policy()
        if policy is None:
            raise PlanError(f"no Megatron-LM flags express this plan: {why}")
        return policy.to_megatron_args()


def _sizes(groups: Sequence[int]) -> str:
    distinct = sorted(set(groups))
    return ", ".join(str(g) for g in distinct[:6]) + (", ..." if len(distinct) > 6 else "")


# ------------------------------------------------------------------------------------------------ unit model
# Side inputs of the reference GPT: tensors made once per step outside the layers and given to every layer. Each
# lives until the lowest unit that keeps it has run its backward (or, when no unit keeps it, the forward's end).
SIDE_MASK, SIDE_ROTARY = "mask", "rotary"
NO_EVENT = -(1 << 62)  # the "highest point" of a block without events


def unit_holds(unit: Unit, classes: Iterable[str]) -> frozenset[str]:
    """The side inputs ``unit`` keeps for its backward. Every layer keeps the rotary tables (rope multiplies the
    queries and keys by them outside the attention core, and a checkpoint keeps its inputs); the causal mask is
    kept only by checkpoints whose inputs include it: groups, and selective layers that recompute core_attn or
    checkpoint the whole layer (non_matmul)."""
    out = set()
    whole_or_core = unit.is_group or (unit.mode == "selective" and bool({"core_attn", "non_matmul"} &
                                                                         set(unit.modules)))
    for c in classes:
        if c == SIDE_ROTARY or (c == SIDE_MASK and whole_or_core):
            out.add(c)
    return frozenset(out)


@dataclass(frozen=True)
class Block:
    """A run of a step's events: ``net`` bytes it leaves allocated, ``high`` its highest point (both relative to
    the live bytes when it starts; ``high`` is :data:`NO_EVENT` for an empty block)."""

    net: int
    high: int

    @staticmethod
    def of(deltas: np.ndarray) -> Block:
        if len(deltas) == 0:
            return Block(0, NO_EVENT)
        c = np.cumsum(deltas)
        return Block(int(c[-1]), int(c.max()))

    def then(self, other: Block) -> Block:
        high = self.high if other.high == NO_EVENT else max(self.high, self.net + other.high)
        return Block(self.net + other.net, high)


@dataclass(frozen=True)
class UnitShape:
    """What one unit does to the live bytes: its forward block, its backward block (recomputation included, side
    inputs alive throughout), and the FLOPs it recomputes."""

    forward: Block
    backward: Block
    recompute_flops: int
    recompute_bytes: int = 0  # bytes the recomputation allocates (a proxy for its element-wise work)


@dataclass
class _Piece:
    offset: int | None  # layer within the unit (None: before its first layer's phases)
    block: Block
    flops: int          # FLOPs recomputed in it
    remat_bytes: int    # bytes allocated by recomputation in it


@dataclass
class _Marks:
    forward: dict[int, int]   # unit index -> event at which the unit's forward starts
    backward: dict[int, int]  # unit index -> event at which the gradient of its output is ready
    head: int = -1            # the head's forward starts
    embedding: int = -1       # the gradient of the embedding's output is ready


def _recorder() -> Any:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from remat.measure import StepRecorder

    mode = _get_current_dispatch_mode()
    if isinstance(mode, StepRecorder):
        return mode
    for mode in reversed(_get_current_dispatch_mode_stack()):
        if isinstance(mode, StepRecorder):
            return mode
    raise RuntimeError("remat.plan: no step recorder is active")


def marked_trace(config: ModelConfig, units: Sequence[Unit], *, device: str = "cpu",
                 engine: str = "reentrant", tp: int = 1, sp: bool = False) -> tuple[Timeline, _Marks]:
    """Trace the reference GPT under the plan of ``units`` (fake tensors) and mark where each unit's forward and
    backward start, by module hooks that read the recorder's event count."""
    plan = Plan.from_units(units, engine)
    cfg = config.replace(num_layers=plan.num_layers)
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    at = 0
    for u, unit in enumerate(units):
        first[at], last[at + unit.size - 1] = u, u
        at += unit.size
    marks = _Marks({}, {})
    tokens, labels = sample_batch(cfg)
    with FakeTensorMode(allow_non_fake_inputs=False) as fake:
        model = rank_model_factory(cfg, tp, sp)()
        state = apply(model, plan)
        index = {id(layer): i for i, layer in enumerate(state.layers)}

        def outer(module: nn.Module) -> bool:
            region = module.__dict__.get("_remat_region")
            return not in_backward() and not (region is not None and region.kind == "layers" and region._running)

        def pre(module: nn.Module, args: tuple[Any, ...]) -> None:
            if module is model.head and not in_backward() and marks.head < 0:
                marks.head = _recorder().timeline.num_events
            i = index.get(id(module))
            if i is None or not outer(module):
                return
            if i in first and first[i] not in marks.forward:
                marks.forward[first[i]] = _recorder().timeline.num_events
            if i == 0 and isinstance(args[0], torch.Tensor) and args[0].requires_grad:
                args[0].register_hook(lambda g: setattr(marks, "embedding", _recorder().timeline.num_events))

        def post(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            i = index.get(id(module))
            if i is None or not outer(module) or i not in last:
                return
            u = last[i]
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(lambda g: marks.backward.__setitem__(u, _recorder().timeline.num_events))

        handles = [nn.modules.module.register_module_forward_pre_hook(pre),
                   nn.modules.module.register_module_forward_hook(post)]
        try:
            batch = (fake.from_tensor(tokens), fake.from_tensor(labels))
            timeline, _ = record_step(model, batch, layers=state.layers,
                                      block_bytes=CUDA_BLOCK if device == "cuda" else 1)
        finally:
            for handle in handles:
                handle.remove()
    missing = [u for u in range(len(units)) if u not in marks.forward or u not in marks.backward]
    if missing or marks.head < 0 or marks.embedding < 0:
        raise RuntimeError(f"remat.plan: unit boundaries were not all seen in the trace (units {missing})")
    return timeline, marks


def _deltas(tl: Timeline) -> np.ndarray:
    d = np.zeros(tl.num_events, dtype=np.int64)
    nbytes = np.asarray(tl.nbytes, dtype=np.int64)
    np.add.at(d, np.asarray(tl.alloc_at, dtype=np.int64), nbytes)
    free = np.asarray(tl.free_at, dtype=np.int64)
    freed = free >= 0
    np.add.at(d, free[freed], -nbytes[freed])
    return d


def _pieces(tl: Timeline, d: np.ndarray, lo: int, hi: int, first_layer: int) -> list[_Piece]:
    """The events ``lo .. hi-1`` cut at the recorder's phase starts; each piece names its layer within the unit."""
    flops = tl.meta.get("phase_flops", [0] * len(tl.phases))
    starts = [p.start for p in tl.phases]
    cuts = sorted({lo, hi, *(s for s in starts if lo < s < hi)})
    out = []
    for a, b in zip(cuts, cuts[1:]):
        p = max(0, bisect.bisect_right(starts, a) - 1)
        phase = tl.phases[p]
        offset = int(phase.region[6:]) - first_layer if phase.region.startswith("layer ") else None
        if offset is not None and offset < 0:
            offset = None
        counted = flops[p] if phase.kind == "recompute" and phase.start == a else 0
        remat = int(d[a:b][d[a:b] > 0].sum()) if phase.kind == "recompute" else 0
        out.append(_Piece(offset, Block.of(d[a:b]), counted, remat))
    return out


def _expand(pieces: list[_Piece], size: int, traced_size: int) -> tuple[Block, int, int]:
    """A group's block for ``size`` layers from the pieces of a traced group of ``traced_size`` >= 3 layers: the
    pieces of its middle layers (offsets 1 .. traced_size-2) stand for any middle layer."""
    if traced_size < 3 or size < 3:
        raise ValueError("group expansion needs traced and target groups of at least 3 layers")
    block, flops, remat = Block(0, NO_EVENT), 0, 0
    i = 0
    while i < len(pieces):
        piece = pieces[i]
        if piece.offset is not None and 1 <= piece.offset <= traced_size - 2:
            run = [piece]
            while i + 1 < len(pieces) and pieces[i + 1].offset is not None and \
                    1 <= pieces[i + 1].offset <= traced_size - 2:
                i += 1
                run.append(pieces[i])
            # the run covers traced_size-2 middle layers, in order or reversed; one layer's share repeats
            per_layer = [p for p in run if p.offset == run[0].offset]
            for _ in range(size - 2):
                for p in per_layer:
                    block, flops, remat = block.then(p.block), flops + p.flops, remat + p.remat_bytes
        else:
            block, flops, remat = block.then(piece.block), flops + piece.flops, remat + piece.remat_bytes
        i += 1
    return block, flops, remat


@dataclass
class UnitModel:
    """The memory model of one training step of the reference GPT, assembled from unit blocks (see the module
    docstring). Built by :func:`unit_model` from fake traces; exact where the tests say so."""

    config: ModelConfig
    device: str
    engine: str
    setup_fixed: int                 # bytes allocated before the forward outside the layers (embedding, head...)
    setup_per_layer: int             # ... and per layer (parameters, buffers)
    embedding: Block                 # the embedding's forward
    head_forward: dict[frozenset[str], Block]  # by the side inputs some unit keeps
    head_backward: Block
    tail: Block                      # the embedding's backward to the end of the step
    grad_per_layer: int              # bytes a layer leaves allocated after its forward and backward (its .grad)
    side: dict[str, int]             # bytes of each side input
    hidden_bytes: int                # one group input (the hidden states): what offloading moves
    layer_forward_flops: int
    layer_backward_flops: int
    contractions: tuple[int, ...] = ()  # the layer's matmul contraction sizes (its matmul_k<K> options)
    tp: int = 1                         # one tensor-parallel rank of tp (sp: sequence-parallel)
    sp: bool = False
    shapes: dict[Unit, UnitShape] = field(default_factory=dict)
    group_pieces: dict[str, tuple[list[_Piece], list[_Piece], int]] = field(default_factory=dict)
    build_seconds: float = 0.0

    def setup(self, num_layers: int) -> int:
        return self.setup_fixed + self.setup_per_layer * num_layers

    def holds(self, unit: Unit) -> frozenset[str]:
        return unit_holds(unit, self.side)

    def shape(self, unit: Unit) -> UnitShape:
        """The unit's shape; groups larger than the traced ones are expanded from their middle layers."""
        found = self.shapes.get(unit)
        if found is not None:
            return found
        if not unit.is_group or unit.mode not in self.group_pieces:
            raise PlanError(f"the unit model has no {unit} (engine {self.engine})")
        fwd_pieces, bwd_pieces, traced = self.group_pieces[unit.mode]
        fwd, _, _ = _expand(fwd_pieces, unit.size, traced)
        bwd, flops, remat = _expand(bwd_pieces, unit.size, traced)
        shape = UnitShape(fwd, bwd, flops, remat)
        self.shapes[unit] = shape
        return shape

    def peak(self, units: Sequence[Unit]) -> int:
        """The modelled peak of the plan ``units`` (bottom-up): the step's blocks in execution order."""
        return self.walk(units)[0]

    def walk(self, units: Sequence[Unit]) -> tuple[int, str]:
        """``(peak, where)``: the modelled peak and the block it is in."""
        L = sum(u.size for u in units)
        level = self.setup(L)
        best = (level + max(self.embedding.high, 0), "forward embedding")

        def visit(block: Block, where: str) -> None:
            nonlocal level, best
            if block.high != NO_EVENT and level + block.high > best[0]:
                best = (level + block.high, where)
            level += block.net

        visit(self.embedding, "forward embedding")
        shapes = [self.shape(u) for u in units]
        at = 0
        for unit, shape in zip(units, shapes):
            visit(shape.forward, f"forward {unit} at layer {at}")
            at += unit.size
        holds = [self.holds(u) for u in units]
        below: list[frozenset[str]] = []
        held: frozenset[str] = frozenset()
        for h in holds:
            below.append(held)
            held = held | h
        visit(self.head_forward[held], "forward head")
        visit(self.head_backward, "backward head")
        for j in reversed(range(len(units))):
            at -= units[j].size
            visit(shapes[j].backward, f"backward {units[j]} at layer {at}")
            for c in holds[j] - below[j]:  # the lowest holder frees the side input at its end
                level -= self.side[c]
        visit(self.tail, "backward embedding")
        return best


_MODELS: dict[tuple[ModelConfig, str, str, int, bool], UnitModel] = {}


def unit_model(config: ModelConfig, *, device: str = "cpu", engine: str = "reentrant", tp: int = 1,
               sp: bool = False) -> UnitModel:
    """The :class:`UnitModel` of ``config``'s layers (any depth), built from two fake traces and cached; with
    ``tp``/``sp``, of one tensor-parallel rank."""
    key = (config.replace(num_layers=1), device, engine, tp, sp)
    if key in _MODELS:
        return _MODELS[key]
    if device not in ("cpu", "cuda"):
        raise PlanError(f"device={device!r}: plans are predicted for 'cpu' (exact bytes) or 'cuda' (512-byte blocks)")
    if engine not in ENGINES:
        raise PlanError(f"unknown engine {engine!r}: use {' or '.join(ENGINES)}")
    start = time.perf_counter()
    group_modes = ("checkpoint", "offload") if engine == "reentrant" else ("checkpoint",)
    # the profile stack: a checkpointed layer at the bottom keeps every side input, so no unit above is the lowest
    # holder; then every unit kind once (groups of 1, 2 and 3 layers: a middle layer first appears at 3)
    contractions = layer_contractions(config, tp, sp)
    units = [Unit("checkpoint", 1), KEEP, *(Unit("selective", 1, s) for s in SELECTIVE_SETS + contraction_sets(
        contractions))]
    units += [Unit(m, k) for m in group_modes for k in (1, 2, 3)]
    tl, marks = marked_trace(config, units, device=device, engine=engine, tp=tp, sp=sp)
    d = _deltas(tl)
    n = len(units)
    L = sum(u.size for u in units)
    fwd_end = [marks.forward[u + 1] if u + 1 < n else marks.head for u in range(n)]
    bwd_end = [marks.backward[u - 1] if u > 0 else marks.embedding for u in range(n)]
    head_bwd = next(p.start for p in tl.phases if p.kind == "backward" and p.region == "head")

    # the plain two-layer stack: what the head does when no unit keeps the mask, and the side inputs' bytes
    plain, plain_marks = marked_trace(config, [KEEP, KEEP], device=device, engine=engine, tp=tp, sp=sp)
    pd = _deltas(plain)
    plain_head_bwd = next(p.start for p in plain.phases if p.kind == "backward" and p.region == "head")
    side = {SIDE_MASK: 0, SIDE_ROTARY: 0}
    setup_end = next(p.start for p in plain.phases if p.kind == "forward")
    for row in range(len(plain)):
        a, f = plain.alloc_at[row], plain.free_at[row]
        if setup_end <= a < plain_marks.forward[0] and plain.module[row] == "" and (
                f < 0 or f >= plain_marks.forward[0]):
            side[SIDE_MASK if plain_marks.head <= f < plain_head_bwd else SIDE_ROTARY] += plain.nbytes[row]
    side = {c: b for c, b in side.items() if b}

    setup_rows = [r for r in range(len(tl)) if tl.alloc_at[r] < setup_end_of(tl)]
    per_layer = sum(tl.nbytes[r] for r in setup_rows if re.match(r"layers\.0(\.|$)", tl.module[r]))
    setup_total = int(d[:setup_end_of(tl)].sum())
    model = UnitModel(
        config=config.replace(num_layers=1), device=device, engine=engine,
        setup_fixed=setup_total - per_layer * L, setup_per_layer=per_layer,
        embedding=Block.of(d[setup_end_of(tl):marks.forward[0]]),
        head_forward={}, head_backward=Block.of(d[head_bwd:marks.backward[n - 1]]),
        tail=Block.of(d[marks.embedding:]), grad_per_layer=0, side=side, hidden_bytes=0,
        layer_forward_flops=0, layer_backward_flops=0, contractions=contractions, tp=tp, sp=sp)
    all_held = frozenset(side)
    model.head_forward[all_held] = Block.of(d[marks.head:head_bwd])
    plain_held = unit_holds(KEEP, side)
    if plain_held != all_held:
        model.head_forward[plain_held] = Block.of(pd[plain_marks.head:plain_head_bwd])
        freed = sum(side[c] for c in all_held - plain_held)
        if model.head_forward[plain_held].net != model.head_forward[all_held].net - freed:
            raise RuntimeError("remat.plan: the head's forward frees other bytes than the unkept side inputs; the "
                               "unit model does not describe this model")

    flops = tl.meta.get("phase_flops", [0] * len(tl.phases))
    at = 0
    for u, unit in enumerate(units):
        fwd = _pieces(tl, d, marks.forward[u], fwd_end[u], at)
        bwd = _pieces(tl, d, marks.backward[u], bwd_end[u], at)
        shape = UnitShape(_chain(fwd), _chain(bwd), sum(p.flops for p in bwd), sum(p.remat_bytes for p in bwd))
        if u == 0:
            shape = model.shapes.get(unit, shape)  # the bottom copy is the lowest holder: use the one above
        else:
            model.shapes[unit] = shape
        if unit.is_group and unit.size == 3:
            model.group_pieces[unit.mode] = (fwd, bwd, 3)
        if unit == KEEP:
            starts = [p.start for p in tl.phases]
            for p, phase in enumerate(tl.phases):
                if marks.forward[u] <= starts[p] < fwd_end[u] and phase.kind == "forward":
                    model.layer_forward_flops += flops[p]
                if marks.backward[u] <= starts[p] < bwd_end[u] and phase.kind == "backward":
                    model.layer_backward_flops += flops[p]
        at += unit.size
    keep = model.shapes[KEEP]
    model.grad_per_layer = keep.forward.net + keep.backward.net
    for unit, shape in model.shapes.items():
        if shape.forward.net + shape.backward.net != model.grad_per_layer * unit.size:
            raise RuntimeError(f"remat.plan: unit {unit} leaves {shape.forward.net + shape.backward.net} bytes after "
                               f"its step, not {unit.size} x {model.grad_per_layer}; the unit model does not describe "
                               "this model")
    model.hidden_bytes = model.shapes[Unit("checkpoint", 1)].forward.net - (
        model.shapes[Unit("offload", 1)].forward.net if Unit("offload", 1) in model.shapes else 0)
    model.build_seconds = time.perf_counter() - start
    _MODELS[key] = model
    return model


class _ContractionCollector(TorchDispatchMode):
    def __init__(self, layer: nn.Module):
        super().__init__()
        self.inside, self.sizes = 0, set()
        layer.register_forward_pre_hook(lambda m, a: setattr(self, "inside", self.inside + 1))
        layer.register_forward_hook(lambda m, a, o: setattr(self, "inside", self.inside - 1))

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        k = contraction(func, args)
        if k is not None and self.inside:
            self.sizes.add(k)
        return func(*args, **(kwargs or {}))


def layer_contractions(config: ModelConfig, tp: int = 1, sp: bool = False) -> tuple[int, ...]:
    """The contraction sizes K of the matrix multiplies in one layer's forward (of one tensor-parallel rank),
    ascending (a fake forward)."""
    cfg = config.replace(num_layers=1)
    tokens, labels = sample_batch(cfg)
    with FakeTensorMode(allow_non_fake_inputs=False) as fake:
        model = rank_model_factory(cfg, tp, sp)()
        collector = _ContractionCollector(model.layers[0])
        with collector:
            model(fake.from_tensor(tokens), fake.from_tensor(labels))
    return tuple(sorted(collector.sizes))


def setup_end_of(tl: Timeline) -> int:
    """The first event after setup (the forward's start)."""
    return next(p.start for p in tl.phases if p.kind == "forward")


def _chain(pieces: Sequence[_Piece]) -> Block:
    block = Block(0, NO_EVENT)
    for p in pieces:
        block = block.then(p.block)
    return block


# ------------------------------------------------------------------------------------------------ costs
@dataclass(frozen=True)
class CostModel:
    """What a unit costs, as an integer the solver adds up.

    ``objective='extra_flops'``: FLOPs (the recomputed FLOPs, plus offload transfer seconds x
    ``flops_per_second``); ``'time'``: nanoseconds (FLOPs / ``flops_per_second`` plus the bytes the
    recomputation writes / ``memory_bandwidth``, plus transfer seconds). FLOP counters give norms, softmax,
    dropout and activations no FLOPs, so the FLOP objective recomputes them (``non_matmul``) for free; the time
    objective charges their memory traffic (each recomputed byte written once: a lower bound). With
    ``measured`` (seconds per layer forward, per selective module and per operator class,
    :func:`measure_layer_times`) recompute is priced by those times instead (in FLOP-equivalents at
    ``flops_per_second`` for the FLOP objective).
    Offloading a group input of ``hidden_bytes`` costs ``hidden_bytes / bandwidth`` twice: the copy out overlaps
    one layer's forward (only the excess is charged), the copy back is charged in full (see the module docstring).
    """

    objective: str = "extra_flops"
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

    def offload_seconds(self, model: UnitModel) -> float:
        """Transfer time charged per offloaded group (see the class docstring)."""
        t = model.hidden_bytes / self.bandwidth
        return t + max(0.0, t - self.layer_forward_seconds(model))

    def recompute_seconds(self, model: UnitModel, unit: Unit) -> float:
        if self.measured is not None:
            times = dict(self.measured)
            if unit.is_group:
                return unit.size * times["layer"]
            if "non_matmul" in unit.modules:
                limit = contraction_limit(unit.modules)
                modules = [m for m in unit.modules if m in ("core_attn", "mlp")]
                contractions = sum(t for key, t in times.items() if key.startswith("contraction_")
                                   and int(key.removeprefix("contraction_")) <= limit)
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
        k = contraction(func, args)
        if k is not None:
            self.spent[f"contraction_{k}"] = self.spent.get(f"contraction_{k}", 0.0) + seconds
        return out


def measure_layer_times(config: ModelConfig, *, device: str = "cpu", repeats: int = 5) -> dict[str, float]:
    """Median forward seconds, on this machine, of one reference layer and of each submodule selective recompute
    can target (``core_attn``, ``mlp``, ``layernorm`` = both norms, ``act``), with grad enabled as in a
    recomputation; and, timed operator by operator in another pass, ``non_matmul`` (the layer's operators other
    than matrix multiplies: what a non_matmul layer recomputes), ``core_attn_matmuls`` / ``mlp_matmuls`` (the
    matrix multiplies inside those modules) and ``contraction_<K>`` (the matrix multiplies of contraction size K,
    what ``matmul_k<N>`` adds for K <= N). Real tensors: the config must fit in this machine's memory."""
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
    operator_keys = ["non_matmul", "core_attn_matmuls", "mlp_matmuls",
                     *(f"contraction_{k}" for k in layer_contractions(config))]
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
    return {k: float(np.median(v)) for k, v in samples.items()}


# ------------------------------------------------------------------------------------------------ solver
def candidate_units(num_layers: int, *, offload: bool = True, engine: str = "reentrant",
                    selective_sets: Iterable[Sequence[str]] | None = None,
                    max_group: int | None = None, contractions: Sequence[int] = ()) -> list[Unit]:
    """The units the extended search may use: keep, each selective set, ``non_matmul+matmul_k<K>`` for each of
    the layer's contraction sizes ``contractions`` (:attr:`UnitModel.contractions`) when the sets allow
    ``non_matmul``, checkpoint (and offload) groups of 1 .. ``max_group`` (default: the whole stack) layers."""
    sets = SELECTIVE_SETS if selective_sets is None else tuple(
        tuple(m for m in SELECTIVE_MODULES if m in set(s)) for s in selective_sets)
    if ("non_matmul",) in sets:
        sets += contraction_sets(contractions)
    units = [KEEP, *(Unit("selective", 1, s) for s in sets)]
    top = num_layers if max_group is None else max(1, min(max_group, num_layers))
    modes = ("checkpoint", "offload") if offload and engine == "reentrant" else ("checkpoint",)
    units += [Unit(m, k) for m in modes for k in range(1, top + 1)]
    return units


@dataclass
class Solution:
    """A solver answer: the plan's units bottom-up, its cost (:meth:`CostModel.cost` summed) and its modelled
    peak; ``entries`` counts the Pareto entries the solver kept."""

    units: list[Unit]
    cost: int
    model_peak: int
    entries: int = 0
    seconds: float = 0.0


class _Tables:
    """The budget-independent numbers the solver needs for one model, depth and unit list."""

    def __init__(self, model: UnitModel, num_layers: int, units: Sequence[Unit], costs: Sequence[int]):
        self.model, self.L = model, num_layers
        self.units = list(units)
        self.costs = list(costs)
        self.shapes = [model.shape(u) for u in units]
        classes = sorted(model.side)
        self.bit = {c: 1 << i for i, c in enumerate(classes)}
        self.all_bits = (1 << len(classes)) - 1
        self.holds = [sum(self.bit[c] for c in model.holds(u)) for u in units]
        self.side_of_bits = [sum(model.side[c] for c in classes if not bits & self.bit[c])
                             for bits in range(self.all_bits + 1)]  # bytes of the side inputs NOT in bits
        self.c0 = model.setup(num_layers) + model.embedding.net
        all_held = frozenset(model.side)
        self.h_all = model.head_forward[all_held].net + model.head_backward.net
        self.g = model.grad_per_layer
        self.head_cap: dict[int, int] = {}
        for bits in range(self.all_bits + 1):
            held = frozenset(c for c in classes if bits & self.bit[c])
            hf = model.head_forward.get(held)
            if hf is not None:
                self.head_cap[bits] = max(self.c0 + hf.high, self.c0 + hf.net + model.head_backward.high)
        # what no plan goes below: setup + the embedding's forward, and the end of the step
        end_level = self.c0 + self.g * num_layers + self.h_all - sum(model.side.values())
        self.floor = max(model.setup(num_layers) + max(model.embedding.high, 0),
                         end_level + (model.tail.high if model.tail.high != NO_EVENT else 0))
        self.fwd_net = [sh.forward.net for sh in self.shapes]
        self.fwd_need = [self.c0 + sh.forward.high for sh in self.shapes]
        self.bwd_base = [self.c0 + sh.forward.net + self.h_all + sh.backward.high for sh in self.shapes]

    def need(self, t: int, i: int, held: int) -> int:
        """The highest point, minus the bytes S kept below it, that unit t placed at layer i reaches in its
        forward and in its backward: it fits iff S + need <= budget."""
        above = self.L - i - self.units[t].size
        bwd = self.bwd_base[t] + self.g * above - self.side_of_bits[held | self.holds[t]]
        return max(self.fwd_need[t], bwd)


_BIG = np.iinfo(np.int64).max


def solve(model: UnitModel, num_layers: int, budget: int,
          cost: CostModel | Callable[[Unit], int] | None = None, *,
          units: Sequence[Unit] | None = None, incumbent: int | None = None,
          stored_cap: int | None = None) -> Solution | None:
    """The plan of least cost whose modelled peak (:meth:`UnitModel.peak`) is <= ``budget``, or None.

    Ties in cost go to the plan that keeps fewer bytes. Exact dynamic program over the stack, bottom-up: a
    state is (layers planned, which side inputs a unit below keeps); each state keeps the Pareto set of (bytes
    kept below, cost) of the partial plans that reach it and satisfy every bound so far. Adding a unit checks
    its forward and backward bounds, which depend only on the bytes kept below it, its position and the state
    (see the module docstring); the head's bounds are checked at the end. A unit kind that another kind of the
    same size beats on every count (bytes kept, cost, forward and backward highs, side inputs kept) is never
    needed and is left out. ``incumbent``, the cost of a plan known to fit the model, prunes partial plans whose
    cost plus a lower bound on completing them (:func:`_cost_bound`) exceeds it. ``stored_cap`` also bounds the
    bytes the whole plan keeps (used for pipeline stages, where other microbatches hold that much each).
    """
    start = time.perf_counter()
    units = list(units) if units is not None else candidate_units(num_layers, engine=model.engine,
                                                                  contractions=model.contractions)
    price = _pricer(model, cost)
    tables = _Tables(model, num_layers, units, [price(u) for u in units])
    if tables.floor > budget:
        return None
    L = num_layers
    usable = _undominated(tables, [t for t, u in enumerate(units)
                                   if u.size <= L and tables.need(t, L - u.size, 0) <= budget])
    # the least bytes the layers i..L-1 can add, and the loosest head bound: prune hopeless entries
    min_rest = [0] * (L + 1)
    for i in range(L - 1, -1, -1):
        options = [tables.fwd_net[t] + min_rest[i + units[t].size] for t in usable if i + units[t].size <= L]
        min_rest[i] = min(options) if options else 1 << 62
    limit = budget - min(tables.head_cap.values())
    if stored_cap is not None:
        limit = min(limit, stored_cap)
    inc = _BIG if incumbent is None else incumbent
    bound = _cost_bound(tables, usable, limit) if incumbent is not None else None

    # a state's entries: arrays S (bytes kept below), C (cost), and where each came from
    keys: list[tuple[int, int]] = []
    frontiers: list[tuple[np.ndarray, ...]] = []
    incoming: dict[tuple[int, int], list[tuple[Any, ...]]] = {
        (0, 0): [(np.zeros(1, np.int64), np.zeros(1, np.int64), -1, np.zeros(1, np.int64), -1)]}
    kept = 0
    by_size: dict[int, list[int]] = {}
    for t in usable:
        by_size.setdefault(units[t].size, []).append(t)
    for i in range(L + 1):
        for key in sorted(k for k in incoming if k[0] == i):
            lower = None if bound is None else (bound[0], bound[1] - bound[2] * i)
            S, C, parent, pidx, unit = _merge(incoming.pop(key), limit - min_rest[i], inc, lower)
            if not len(S):
                continue
            kid = len(keys)
            keys.append(key)
            frontiers.append((S, C, parent, pidx, unit))
            kept += len(S)
            if i == L:
                continue
            held = key[1]
            for t in usable:
                u = units[t]
                if i + u.size > L:
                    continue
                n = int(np.searchsorted(S, budget - tables.need(t, i, held), side="right"))
                if n == 0:
                    continue
                dest = incoming.setdefault((i + u.size, held | tables.holds[t]), [])
                dest.append((S[:n] + tables.fwd_net[t], C[:n] + tables.costs[t], kid, np.arange(n), t))
    best: tuple[int, int, int, int] | None = None  # (cost, S, state, index)
    for kid, key in enumerate(keys):
        if key[0] != L:
            continue
        S, C = frontiers[kid][:2]
        ok = np.nonzero((S <= budget - tables.head_cap.get(key[1], 1 << 62)) & (S <= limit))[0]
        if len(ok):
            j = ok[np.lexsort((S[ok], C[ok]))[0]]
            cand = (int(C[j]), int(S[j]), kid, int(j))
            if best is None or cand[:2] < best[:2]:
                best = cand
    if best is None:
        return None
    chosen: list[Unit] = []
    kid, idx = best[2], best[3]
    while kid >= 0:
        _, _, parent, pidx, unit = frontiers[kid]
        if unit[idx] < 0:
            break
        chosen.append(units[int(unit[idx])])
        kid, idx = int(parent[idx]), int(pidx[idx])
    chosen.reverse()
    return Solution(chosen, best[0], model.peak(chosen), kept, time.perf_counter() - start)


def _merge(chunks: list[tuple[Any, ...]], s_limit: int, incumbent: int,
           lower: tuple[float, int] | None = None) -> tuple[np.ndarray, ...]:
    """The Pareto set of the entries in ``chunks``, sorted by S: an entry stays when every entry of smaller or
    equal S costs more (equal S and cost: one stays). Entries above ``s_limit`` go, and so do entries whose cost
    plus a lower bound on what completing them costs, ``rate * max(0, S - offset)`` with ``lower = (rate,
    offset)``, exceeds ``incumbent``."""
    if len(chunks) == 1:
        S, C, parent, pidx, unit = chunks[0]
        parent = np.full(len(S), parent, np.int64)
        unit = np.full(len(S), unit, np.int64)
    else:
        S = np.concatenate([c[0] for c in chunks])
        C = np.concatenate([c[1] for c in chunks])
        parent = np.concatenate([np.full(len(c[0]), c[2], np.int64) for c in chunks])
        pidx = np.concatenate([c[3] for c in chunks])
        unit = np.concatenate([np.full(len(c[0]), c[4], np.int64) for c in chunks])
    keep = (S <= s_limit) & (C <= incumbent)
    if lower is not None and lower[0] > 0:
        need = lower[0] * np.maximum(S - lower[1], 0).astype(np.float64)
        keep &= (C - incumbent).astype(np.float64) + need * (1 - 1e-9) <= 0.5
    if not keep.all():
        S, C, parent, pidx, unit = S[keep], C[keep], parent[keep], pidx[keep], unit[keep]
    if len(S) > 1:
        order = np.lexsort((C, S))
        c = C[order]
        before = np.empty(len(c), np.int64)
        before[0] = _BIG
        np.minimum.accumulate(c[:-1], out=before[1:])
        sel = order[c < before]
        S, C, parent, pidx, unit = S[sel], C[sel], parent[sel], pidx[sel], unit[sel]
    return S, C, parent, pidx, unit


def _cost_bound(tables: _Tables, usable: list[int], limit: int) -> tuple[float, int, int] | None:
    """``(rate, offset0, per_layer)``: completing a partial plan that keeps S bytes below layer i costs at least
    ``rate * max(0, S - (offset0 - per_layer * i))``.

    Why: the head's bound needs the final S <= ``limit``. Keeping every remaining layer would add
    ``keep`` bytes per layer; each unit instead saves ``keep * size - its bytes``. Units that cost nothing save at
    most ``free`` per layer, so the paid units must save the rest, at no less than ``rate`` per byte beyond the
    free share (a fractional-knapsack bound, valid whatever the order and the other bounds).
    """
    keep = next((t for t in usable if tables.units[t] == KEEP), None)
    if keep is None:
        return None
    a = tables.fwd_net[keep]
    saving = {t: a * tables.units[t].size - tables.fwd_net[t] for t in usable}
    free = max([saving[t] / tables.units[t].size for t in usable if tables.costs[t] == 0] + [0.0])
    rates = [tables.costs[t] / (saving[t] - free * tables.units[t].size) for t in usable
             if tables.costs[t] > 0 and saving[t] > free * tables.units[t].size]
    if not rates:
        return None
    # the saving still needed: S + (a - free) (L - i) - limit = S - offset_i, offset_i = limit - (a - free) (L - i);
    # rounding offset_i up keeps the bound valid
    per_layer = a - free
    return min(rates), math.ceil(limit - per_layer * tables.L), -math.ceil(per_layer)


def _undominated(tables: _Tables, usable: list[int]) -> list[int]:
    """``usable`` without the unit kinds that another kind of the same size beats or ties on every count the
    solver uses (bytes added to S, cost, forward need, backward base, side inputs kept; see
    :meth:`_Tables.need`). Replacing a dominated unit by its dominator in any plan keeps every bound and the
    cost, so the optimum is unchanged; of exact ties the first is kept."""
    def key(t: int) -> tuple[int, ...]:
        return (tables.fwd_net[t], tables.costs[t], tables.fwd_need[t], tables.bwd_base[t])

    out = []
    for b in usable:
        kb = key(b)
        dominated = False
        for a in usable:
            if a == b or tables.units[a].size != tables.units[b].size or tables.holds[a] & ~tables.holds[b]:
                continue
            ka = key(a)
            if all(x <= y for x, y in zip(ka, kb)) and (ka != kb or tables.holds[a] != tables.holds[b] or a < b):
                dominated = True
                break
        if not dominated:
            out.append(b)
    return out


def _pricer(model: UnitModel, cost: CostModel | Callable[[Unit], int] | None) -> Callable[[Unit], int]:
    if cost is None:
        cost = CostModel()
    if isinstance(cost, CostModel):
        cm = cost
        return lambda u: cm.cost(model, u)
    return cost


def tidy(model: UnitModel, units: Sequence[Unit], budget: int,
         cost: CostModel | Callable[[Unit], int] | None = None,
         peak: Callable[[list[Unit]], int] | None = None) -> list[Unit]:
    """The plan ``units`` with recomputation that costs nothing removed where the budget allows.

    FLOP counters give norms and activations no FLOPs, so the solver, which breaks cost ties towards fewer bytes
    kept, may recompute them where it need not. From the top down, each selective layer is replaced by the
    lightest subset of its modules (or a kept layer), and each offload group by a checkpoint group, that costs
    no more and keeps the modelled peak (``peak``, default :meth:`UnitModel.peak`) <= ``budget``; repeated until
    nothing changes. The cost never rises.
    """
    price = _pricer(model, cost)
    peak = peak or model.peak
    units = list(units)
    changed = True
    while changed:
        changed = False
        for j in reversed(range(len(units))):
            u = units[j]
            for v in _lighter(u):
                if price(v) > price(u):
                    continue
                trial = units[:j] + [v] + units[j + 1:]
                if peak(trial) <= budget:
                    units = trial
                    changed = True
                    break
    return units


def _recomputed(modules: Iterable[str]) -> frozenset[str]:
    """What a selective set recomputes, in module names: mlp includes act, non_matmul includes layernorm and act."""
    out = set(modules)
    if "mlp" in out:
        out.add("act")
    if "non_matmul" in out:
        out.update(NON_MATMUL_INCLUDES)
    return frozenset(out)


def _lighter(unit: Unit) -> list[Unit]:
    """Units of the same size that recompute less than ``unit``, lightest first."""
    if unit.mode == "selective":
        work = _recomputed(unit.modules)
        lighter = sorted((s for s in SELECTIVE_SETS if _recomputed(s) < work), key=lambda s: len(_recomputed(s)))
        return [KEEP, *(Unit("selective", 1, s) for s in lighter)]
    if unit.mode == "offload":
        return [Unit("checkpoint", unit.size)]
    return []


def feasible(model: UnitModel, num_layers: int, budget: int, units: Sequence[Unit]) -> bool:
    """Whether some plan made of ``units`` has a modelled peak <= ``budget`` (a DP keeping, per state, only the
    least bytes stored below: that is all feasibility needs)."""
    tables = _Tables(model, num_layers, units, [0] * len(units))
    if tables.floor > budget:
        return False
    L = num_layers
    best: dict[tuple[int, int], int] = {(0, 0): 0}
    for i in range(L):
        for key in sorted(k for k in best if k[0] == i):
            S = best.pop(key)
            for t, u in enumerate(units):
                j = i + u.size
                if j > L or S + tables.need(t, i, key[1]) > budget:
                    continue
                dest = (j, key[1] | tables.holds[t])
                value = S + tables.shapes[t].forward.net
                if value < best.get(dest, 1 << 62):
                    best[dest] = value
    return any(S + tables.head_cap.get(key[1], 1 << 62) <= budget for key, S in best.items() if key[0] == L)


def min_peak(model: UnitModel, num_layers: int, units: Sequence[Unit] | None = None) -> int:
    """The smallest modelled peak any plan made of ``units`` reaches (binary search over :func:`feasible`)."""
    units = list(units) if units is not None else candidate_units(num_layers, engine=model.engine,
                                                                  contractions=model.contractions)
    lo = _Tables(model, num_layers, units, [0] * len(units)).floor
    known = [[u] * num_layers for u in (KEEP, Unit("checkpoint", 1)) if u in units]
    hi = max([model.peak(p) for p in known] + [lo]) if known else 1 << 62
    if not feasible(model, num_layers, hi, units):
        raise RuntimeError("remat.plan: no plan fits even its own peak; the unit model is inconsistent")
    while lo < hi:
        mid = (lo + hi) // 2
        if feasible(model, num_layers, mid, units):
            hi = mid
        else:
            lo = mid + 1
    return lo


# ------------------------------------------------------------------------------------------------ prediction
_STAND_INS: dict[tuple[ModelConfig, Plan, str], ShallowTrace] = {}


def stand_in(plan: Plan) -> Plan | None:
    """A shallow plan with every layer role (:func:`remat.compose.layer_roles`) of ``plan``, for composing its
    timeline from a shallow trace: groups of more than 3 layers shrink to 3 and runs of more than 3 equal units
    to 3 (a role sees only its neighbours and region sizes up to 3). None when that is not shallower, or when the
    plan offloads (composition does not tell offload groups from checkpoint groups)."""
    if any(s.mode == "offload" for s in plan.segments):
        return None
    small: list[Unit] = []
    for unit in plan.units():
        u = Unit(unit.mode, min(unit.size, 3), unit.modules) if unit.is_group else unit
        if len(small) >= 3 and small[-1] == small[-2] == small[-3] == u:
            continue
        small.append(u)
    shallow = Plan.from_units(small, plan.engine)
    if shallow.num_layers >= plan.num_layers:
        return None
    if not set(layer_roles(plan, plan.num_layers)) <= set(layer_roles(shallow, shallow.num_layers)):
        return None
    return shallow


def predict_plan(config: ModelConfig, plan: Plan, *, device: str = "cpu", tp: int = 1, sp: bool = False) -> Timeline:
    """Predict (fake trace, exact bytes) one training step of the reference GPT of ``config`` under ``plan`` (of
    one tensor-parallel rank with ``tp``/``sp``).

    A Megatron-expressible plan goes through :func:`remat.predict.predict_config`; another plan is composed from
    the trace of its :func:`stand_in` (:func:`remat.compose.compose`), or traced whole when composition is
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
                    _STAND_INS[key] = ShallowTrace(trace_rank(key[0], shallow, device, tp, sp), shallow)
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
        return cls(tl.peak_bytes, tl.peak_phase.label, dict(tl.at_peak),
                   {k: int(v) for k, v in tl.meta.get("flops", {}).items()})


def megatron_policies(num_layers: int, engine: str = "reentrant") -> list[Policy]:
    """Every Megatron-LM recompute setting of a ``num_layers`` stack: none, full/uniform/K and full/block/K for
    K = 1..L, and selective with each non-empty set of core_attn, mlp, layernorm."""
    out = [Policy(engine=engine)]
    out += [Policy("full", "uniform", k, engine=engine) for k in range(1, num_layers + 1)]
    out += [Policy("full", "block", k, engine=engine) for k in range(1, num_layers + 1)]
    out += [Policy("selective", modules=c, engine=engine) for n in range(1, 4)
            for c in itertools.combinations(MEGATRON_MODULES, n)]
    return out


_MEGATRON: dict[tuple[ModelConfig, str, str, int, bool], list[tuple[Policy, Predicted]]] = {}


def megatron_table(config: ModelConfig, *, device: str = "cpu", engine: str = "reentrant", tp: int = 1,
                   sp: bool = False) -> list[tuple[Policy, Predicted]]:
    """Every Megatron setting (:func:`megatron_policies`) with its prediction (:func:`remat.predict.predict_many`);
    cached per config."""
    key = (config, device, engine, tp, sp)
    if key not in _MEGATRON:
        policies = megatron_policies(config.num_layers, engine)
        predicted = predict_many(config, policies, device=device, tp=tp, sp=sp)
        _MEGATRON[key] = [(p, Predicted.of(tl)) for p, tl in zip(policies, predicted)]
        if len(_MEGATRON) > 16:
            del _MEGATRON[next(iter(_MEGATRON))]
    return _MEGATRON[key]


# ------------------------------------------------------------------------------------------------ plan()
@dataclass
class PlanChoice:
    """One answer of :func:`plan`: the plan and what its traced prediction says.

    ``peak_bytes``/``at_peak``/``peak_phase`` come from the real (fake-tensor) trace; ``model_peak_bytes`` from the
    unit model. ``recompute_flops`` are the recomputation's FLOPs (``torch.utils.flop_counter`` formulas) and
    ``extra_compute_pct`` their share of the plain step's forward + backward FLOPs. ``cost`` is the objective's
    value (:class:`CostModel`). ``offload_bytes`` is what moves to the host (and back) per step and
    ``offload_seconds`` the transfer time charged. ``recompute_bytes`` is what the recomputation allocates again
    (unit model): the memory traffic of work FLOP counters do not see (norms, softmax, dropout, activations).
    """

    plan: Plan
    source: str
    peak_bytes: int
    peak_phase: str
    at_peak: dict[str, int]
    recompute_flops: int
    extra_compute_pct: float
    cost: int
    model_peak_bytes: int | None = None
    offload_bytes: int = 0
    offload_seconds: float = 0.0
    megatron_policy: str | None = None
    megatron_args: list[str] | None = None
    why_not_megatron: str = ""
    recompute_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "recompute_bytes": self.recompute_bytes,
            "plan": str(self.plan), "source": self.source, "peak_bytes": self.peak_bytes,
            "peak_phase": self.peak_phase, "at_peak": self.at_peak, "model_peak_bytes": self.model_peak_bytes,
            "recompute_flops": self.recompute_flops, "extra_compute_pct": self.extra_compute_pct,
            "cost": self.cost, "offload_bytes": self.offload_bytes, "offload_seconds": self.offload_seconds,
            "megatron_policy": self.megatron_policy, "megatron_args": self.megatron_args,
            "why_not_megatron": self.why_not_megatron, "plan_json": self.plan.to_dict(),
        }

    def snippet(self) -> str:
        """Python that applies this plan to a model built elsewhere (``model``)."""
        data = json.dumps(self.plan.to_dict(), separators=(",", ":"))
        return ("import remat\nfrom remat.plan import Plan\n\n"
                f"plan = Plan.from_dict({data})\n"
                "remat.apply(model, plan)  # model: your GPT-style model with a layer stack\n")


@dataclass
class PlanResult:
    """What :func:`plan` found: the best Megatron setting and the best extended plan for the budget."""

    config: ModelConfig
    budget_bytes: int
    budget_text: str
    objective: str
    cost_model: CostModel
    extended: PlanChoice
    megatron: PlanChoice | None
    megatron_note: str
    baseline: Predicted
    stats: dict[str, Any] = field(default_factory=dict)
    pipeline: dict[str, Any] | None = None
    tp: int = 1      # planned for one tensor-parallel rank of tp
    sp: bool = False  # ... with sequence parallelism

    def to_dict(self) -> dict[str, Any]:
        """Everything as JSON-able data (format ``remat.plan-result``)."""
        return {
            "format": "remat.plan-result", "version": 1, "config": self.config.to_dict(),
            "budget_bytes": self.budget_bytes, "budget": self.budget_text, "objective": self.objective,
            "tp": self.tp, "sp": self.sp,
            "cost_model": self.cost_model.describe(),
            "baseline": {"policy": "none", "peak_bytes": self.baseline.peak_bytes, "flops": self.baseline.flops},
            "extended": self.extended.to_dict(),
            "megatron": None if self.megatron is None else self.megatron.to_dict(),
            "megatron_note": self.megatron_note, "stats": self.stats, "pipeline": self.pipeline,
            "snippet": self.extended.snippet(),
        }

    def _rank_text(self) -> str:
        if self.tp == 1 and not self.sp:
            return ""
        return f"; one tensor-parallel rank of {self.tp}" + (" with sequence parallelism" if self.sp else "")

    def format(self) -> str:
        """The report ``remat plan`` prints."""
        c = self.config
        lines = [f"remat plan: {c.num_layers} layers, h={c.hidden_size}, s={c.seq_length}, b={c.micro_batch_size}, "
                 f"{c.dtype}{self._rank_text()}; budget {self.budget_text} = {self.budget_bytes:,} bytes",
                 f"no recompute: peak {_fmt_bytes(self.baseline.peak_bytes)} ({self.baseline.peak_phase})",
                 f"objective: {self.cost_model.describe()}", ""]
        for title, choice in (("Best Megatron-LM setting", self.megatron), ("Best extended plan", self.extended)):
            lines.append(f"{title}:")
            if choice is None:
                lines += [f"  none fits: {self.megatron_note}", ""]
                continue
            lines.append(f"  plan:           {choice.plan}")
            lines.append(f"  predicted peak: {_fmt_bytes(choice.peak_bytes)} ({choice.peak_bytes:,} bytes, "
                         f"{100 * choice.peak_bytes / self.budget_bytes:.1f}% of budget) in {choice.peak_phase}")
            parts = ", ".join(f"{k} {_fmt_bytes(v)}" for k, v in choice.at_peak.items() if v)
            lines.append(f"  at the peak:    {parts}")
            moved = (f", offload {_fmt_bytes(choice.offload_bytes)} each way ({1e3 * choice.offload_seconds:.2f} ms "
                     "charged)") if choice.offload_bytes else ""
            lines.append(f"  extra compute:  {choice.extra_compute_pct:.2f}% ({choice.recompute_flops:,} recomputed "
                         f"FLOPs; {_fmt_bytes(choice.recompute_bytes)} rebuilt in backward){moved}")
            if choice.megatron_args is not None:
                lines.append(f"  Megatron flags: {' '.join(choice.megatron_args) or '(none: no recompute flags)'}")
            else:
                lines.append(f"  Megatron flags: none express it: {choice.why_not_megatron}")
            lines.append("")
        if self.megatron is not None and self.megatron.cost:
            saved = 100 * (1 - self.extended.cost / self.megatron.cost)
            lines.append(f"The extended plan costs {saved:.1f}% less extra compute than the best Megatron setting.")
        if self.pipeline is not None:
            lines.append(self.pipeline.get("summary", ""))
        s = self.stats
        lines.append(f"solve: {1e3 * s.get('dp_seconds', 0):.0f} ms dynamic program ({s.get('entries', 0):,} Pareto "
                     f"entries), unit model {s.get('model_seconds', 0):.1f} s, Megatron sweep "
                     f"{s.get('megatron_seconds', 0):.1f} s, validation trace {s.get('validate_seconds', 0):.1f} s, "
                     f"re-solves {s.get('resolves', 0)}")
        lines += ["", "Apply it:", textwrap_indent(self.extended.snippet(), "  ")]
        return "\n".join(lines)


def textwrap_indent(text: str, prefix: str) -> str:
    return "\n".join(prefix + line if line else line for line in text.splitlines())


def _choice(config: ModelConfig, plan_: Plan, tl: Timeline | Predicted, source: str, cost: CostModel,
            model: UnitModel, baseline: Predicted) -> PlanChoice:
    pred = tl if isinstance(tl, Predicted) else Predicted.of(tl)
    base = baseline.flops.get("forward", 0) + baseline.flops.get("backward", 0)
    recompute = pred.flops.get("recompute", 0)
    policy, why = plan_.megatron_policy()
    args = None
    if policy is not None:
        try:
            args = policy.to_megatron_args()
        except PolicyError as err:
            args, why = None, str(err)
    units = plan_.units()
    offloaded = sum(1 for u in units if u.mode == "offload")
    return PlanChoice(
        plan=plan_, source=source, peak_bytes=pred.peak_bytes, peak_phase=pred.peak_phase, at_peak=pred.at_peak,
        recompute_flops=recompute, extra_compute_pct=100.0 * recompute / base if base else 0.0,
        cost=sum(cost.cost(model, u) for u in units), model_peak_bytes=model.peak(units),
        offload_bytes=offloaded * model.hidden_bytes, offload_seconds=offloaded * cost.offload_seconds(model),
        megatron_policy=None if policy is None else str(policy), megatron_args=args, why_not_megatron=why,
        recompute_bytes=sum(model.shape(u).recompute_bytes for u in units))


def plan(config: ModelConfig, budget: int | str, *, objective: str = "extra_flops", engine: str = "reentrant",
         device: str = "cpu", offload: bool = True, bandwidth: float = 25e9, flops_per_second: float = 400e12,
         memory_bandwidth: float = 3e12, measured_times: bool | dict[str, float] = False,
         reserve: str | float | None = DEFAULT_RESERVE, selective_sets: Iterable[Sequence[str]] | None = None,
         max_resolves: int = 4,
         pp: int | None = None, microbatches: int | None = None, schedule: str = "1f1b", vpp: int = 1,
         tp: int = 1, sp: bool = False) -> PlanResult:
    """The cheapest recompute plans for ``config`` whose predicted peak is <= ``budget`` (see the module docstring).

    ``budget``: bytes, or text for :func:`parse_budget` (``'70GiB'``, ``'h100-80g'`` minus ``reserve``).
    ``objective``: ``'extra_flops'`` or ``'time'`` (:class:`CostModel`); ``measured_times=True`` prices recompute
    by forward times measured here (:func:`measure_layer_times`; or pass that dict); ``memory_bandwidth`` (bytes
    per second) prices recomputed bytes under the time objective. ``offload=False`` leaves offload groups out of
    the extended search; ``selective_sets`` limits the selective layers' module sets (:func:`selective_sets`,
    e.g. ``selective_sets('core_attn,mlp,layernorm,act')`` for module-level recompute only; default
    :data:`SELECTIVE_SETS`; where ``non_matmul`` is allowed, ``non_matmul+matmul_k<K>`` for each of the layer's
    contraction sizes K is too). ``device='cuda'`` predicts with CUDA's 512-byte blocks.

    Returns a :class:`PlanResult` whose ``extended`` plan has a traced peak <= budget and costs no more than the
    best Megatron setting (``megatron``; None when no setting fits, with the reason in ``megatron_note``).
    Raises :class:`BudgetError` when no plan fits. With ``pp`` (pipeline stages), ``microbatches`` and
    ``schedule``, :func:`plan_pipeline` also plans each stage; its report is in ``pipeline``. With ``tp`` (and
    ``sp``: sequence parallelism) everything is planned for one tensor-parallel rank (:mod:`remat.parallel`'s
    Megatron sharding; the budget is one GPU's), leaving room for one unsharded hidden-states tensor
    (``stats['collective_margin_bytes']``): on real ranks the communication thread may free a collective's buffer
    later than the simulated rank does.
    """
    t_start = time.perf_counter()
    if isinstance(budget, str):
        budget_bytes, budget_text = parse_budget(budget, reserve)
    else:
        if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
            raise PlanError(f"budget={budget!r}: give bytes (a positive int) or text such as '70GiB' or 'h100-80g'")
        budget_bytes, budget_text = budget, _fmt_bytes(budget)
    if engine != "reentrant" and offload:
        offload = False  # offload groups need the reentrant engine
    if (tp > 1 or sp) and pp is not None:
        raise PlanError("plan takes tensor parallelism (tp/sp) or pipeline stages (pp), not both yet: plan a "
                        "pipeline stage's layers with tp, or drop tp")
    if (tp > 1 or sp) and measured_times:
        raise PlanError("measured_times times an unsharded layer on this machine, not a tensor-parallel rank: "
                        "drop measured_times with tp > 1")
    L = config.num_layers
    stats: dict[str, Any] = {}
    t = time.perf_counter()
    model = unit_model(config, device=device, engine=engine, tp=tp, sp=sp)
    stats["model_seconds"] = time.perf_counter() - t  # 0 when cached; building it took model.build_seconds
    stats["model_build_seconds"] = model.build_seconds
    measured = None
    if measured_times:
        here = "cuda" if device == "cuda" and torch.cuda.is_available() else "cpu"
        times = measured_times if isinstance(measured_times, dict) else measure_layer_times(config, device=here)
        measured = tuple(sorted(times.items()))
        stats["measured_times"] = dict(measured)
        if objective == "extra_flops":
            objective = "time"
    cost = CostModel(objective, flops_per_second, bandwidth, measured, memory_bandwidth)
    units = candidate_units(L, offload=offload, engine=engine, selective_sets=selective_sets,
                            contractions=model.contractions)

    t = time.perf_counter()
    table = megatron_table(config, device=device, engine=engine, tp=tp, sp=sp)
    stats["megatron_seconds"] = time.perf_counter() - t
    baseline = table[0][1]
    meg: list[tuple[Policy, Predicted, Plan, int, int]] = []
    for policy, pred in table:
        p = Plan.from_policy(policy, L)
        meg.append((policy, pred, p, sum(cost.cost(model, u) for u in p.units()), model.peak(p.units())))
    # Real tensor-parallel ranks: a communication library may let go of a collective's buffer (a reduce-scatter
    # input or all-gather output: one unsharded hidden-states tensor) later than the simulated rank frees it. remat's
    # gloo ranks wait for that (remat.parallel._released); the plans still leave one such tensor of room.
    margin = config.micro_batch_size * config.seq_length * config.hidden_size * \
        torch.empty((), dtype=config.torch_dtype).element_size() if tp > 1 else 0
    limit = budget_bytes - margin
    stats["collective_margin_bytes"] = margin
    fitting = [m for m in meg if m[1].peak_bytes <= limit]
    megatron_choice = None
    if fitting:
        # ties in cost (FLOP counters price norms at zero) go to the setting that rebuilds the fewest bytes
        policy, pred, p, c, _ = min(fitting, key=lambda m: (
            m[3], sum(model.shape(u).recompute_bytes for u in m[2].units()), m[1].peak_bytes))
        megatron_choice = _choice(config, p, pred, "megatron", cost, model, baseline)
        note = ""
    else:
        lowest = min(meg, key=lambda m: m[1].peak_bytes)
        note = (f"the lowest Megatron peak is {_fmt_bytes(lowest[1].peak_bytes)} ({lowest[0]}), above the budget")

    # the extended search: solve under the model, validate with the trace, re-solve below the excess if needed
    model_budget = limit
    chosen: tuple[Plan, Timeline, Solution] | None = None
    dp_seconds, entries, validate_seconds, resolves = 0.0, 0, 0.0, 0
    for _ in range(max_resolves + 1):
        incumbent = min((m[3] for m in meg if m[4] <= model_budget), default=None)
        sol = solve(model, L, model_budget, cost, units=units, incumbent=incumbent)
        if sol is None:
            break
        dp_seconds += sol.seconds
        entries = max(entries, sol.entries)
        tidied = tidy(model, sol.units, model_budget, cost)
        candidate = Plan.from_units(tidied, engine)
        t = time.perf_counter()
        tl = predict_plan(config, candidate, device=device, tp=tp, sp=sp)
        validate_seconds += time.perf_counter() - t
        if tl.peak_bytes <= limit:
            chosen = (candidate, tl, sol)
            break
        resolves += 1
        model_budget -= max(tl.peak_bytes - limit, 1)
    stats.update(dp_seconds=dp_seconds, entries=entries, validate_seconds=validate_seconds, resolves=resolves)

    if chosen is None and megatron_choice is None:
        raise _refusal(config, model, units, cost, budget_bytes, engine, device, baseline, meg, margin)
    if chosen is None:  # no solution validated at this budget: the Megatron answer is a valid plan
        assert megatron_choice is not None
        extended = dataclasses.replace(megatron_choice, source="megatron (no extended plan validated)")
    else:
        extended = _choice(config, chosen[0], chosen[1], "extended", cost, model, baseline)
        if megatron_choice is not None and megatron_choice.cost < extended.cost:
            extended = megatron_choice  # cannot happen when the model is exact; never return the costlier one
    stats["total_seconds"] = time.perf_counter() - t_start
    result = PlanResult(config, budget_bytes, budget_text, cost.objective, cost, extended, megatron_choice, note,
                        baseline, stats, tp=tp, sp=sp)
    if pp is not None:
        result.pipeline = plan_pipeline(config, budget_bytes, pp=pp, microbatches=microbatches or pp,
                                        schedule=schedule, vpp=vpp, cost=cost, device=device, engine=engine,
                                        offload=offload)
    return result


def _refusal(config: ModelConfig, model: UnitModel, units: list[Unit], cost: CostModel, budget: int, engine: str,
             device: str, baseline: Predicted, meg: list[tuple[Policy, Predicted, Plan, int, int]],
             margin: int = 0) -> BudgetError:
    """The :class:`BudgetError` for a budget no plan fits: the smallest peak and the cheapest plan reaching it."""
    L = config.num_layers
    lowest = min_peak(model, L, units)
    sol = solve(model, L, lowest, cost, units=units)
    assert sol is not None
    p = Plan.from_units(tidy(model, sol.units, lowest, cost), engine)
    tl = predict_plan(config, p, device=device, tp=model.tp, sp=model.sp)
    choice = _choice(config, p, tl, "extended", cost, model, baseline)
    best_meg = min(meg, key=lambda m: (m[1].peak_bytes, m[3]))
    if best_meg[1].peak_bytes < choice.peak_bytes:  # only if the model were off: report the lower traced peak
        choice = _choice(config, best_meg[2], best_meg[1], "megatron", cost, model, baseline)
    room = f" plus {margin:,} bytes of room for the collectives' buffers on real tensor-parallel ranks" if margin \
        else ""
    return BudgetError(
        f"no plan fits {_fmt_bytes(budget)} ({budget:,} bytes): the smallest reachable peak is "
        f"{_fmt_bytes(choice.peak_bytes)} ({choice.peak_bytes:,} bytes){room}, with plan {choice.plan}",
        budget_bytes=budget, min_peak_bytes=choice.peak_bytes + margin, plan=choice)


# ------------------------------------------------------------------------------------------------ pipelines
def stage_timeline(config: ModelConfig, rank: int, chunk_plan: Plan | Policy, *, pp: int, microbatches: int,
                   schedule: str = "1f1b", device: str = "cpu", runtime: str = "torch") -> Timeline:
    """The predicted timeline of pipeline stage ``rank`` (one model chunk per stage) running ``chunk_plan`` on its
    own layers, composed by :mod:`remat.pipeline` from fake traces of its chunk, exactly as
    :func:`remat.pipeline.predict_pipeline` composes a uniform policy's stages."""
    from remat import pipeline as pl

    schedule = pl.check_schedule(schedule, pp, microbatches, 1, runtime)
    specs = pl.partition(config, pp, 1)
    chunks = pl.rank_chunks(specs, pp, rank)
    actions = pl.schedule_actions(schedule, pp, microbatches, 1, rank, runtime=runtime)
    window = pl.warmup_forwards(schedule, pp, microbatches, 1, rank, "megatron") + 1
    checkpointed = pl.checkpointed_forwards(actions, None, window)
    traces = {(spec.index, True): pl.trace_chunk(config, spec.kind, chunk_plan, device) for spec in chunks}
    stage = pl._StagePlan(config, pp, microbatches, 1, rank, schedule, runtime, chunks, actions, checkpointed, traces,
                          block=CUDA_BLOCK if device == "cuda" else 1)
    compose_stage = getattr(pl, "_compose_stage", None) or pl.compose_stage
    return compose_stage(stage, chunk_plan, None)


def plan_pipeline(config: ModelConfig, budget: int, *, pp: int, microbatches: int, schedule: str = "1f1b",
                  vpp: int = 1, cost: CostModel | None = None, device: str = "cpu", engine: str = "reentrant",
                  offload: bool = True, runtime: str = "torch", max_resolves: int = 4) -> dict[str, Any]:
    """Plan each pipeline stage separately and compare with the best uniform (Megatron) setting.

    Stage r of a 1F1B pipeline holds up to ``min(pp - r, m)`` microbatches' saved tensors at once, so stage 0
    needs the most recompute; one policy for every stage (what Megatron's flags give) recomputes as much on the
    last stage as the first one needs. For each stage this searches the extended space with the unit model of
    the stage's layers plus what the other microbatches in flight keep (``(in flight - 1) x`` the plan's stored
    bytes, over a grid of caps on them) plus a per-stage offset calibrated on the no-recompute stage timeline;
    each stage's plan is then checked with :func:`stage_timeline` (the exact composed stage timeline of
    :mod:`remat.pipeline`) and re-solved below the excess if it does not fit. A stage never gets a plan costlier
    than the best uniform setting's (that one is kept when cheaper). The uniform candidates are every Megatron
    setting, each predicted with :func:`remat.pipeline.predict_pipeline`.

    Step time uses the pipeline's critical path: the slowest stage's time per microbatch, (forward + backward +
    recompute FLOPs) / ``cost.flops_per_second``, times ``microbatches + pp - 1``. Only ``vpp=1`` (one model chunk
    per stage) is planned per stage.
    """
    from remat import pipeline as pl

    if vpp != 1:
        raise PlanError(f"per-stage plans need one model chunk per stage (vpp=1), got vpp={vpp}")
    cost = cost or CostModel()
    start = time.perf_counter()
    specs = pl.partition(config, pp, 1)
    schedule = pl.check_schedule(schedule, pp, microbatches, 1, runtime)
    model = unit_model(config, device=device, engine=engine)
    fps = cost.flops_per_second
    baseline = Predicted.of(predict_config(config.replace(num_layers=1), Policy(engine=engine), device=device))
    head_fwd = baseline.flops.get("forward", 0) - model.layer_forward_flops
    head_bwd = baseline.flops.get("backward", 0) - model.layer_backward_flops
    in_flight = [pl.max_in_flight(pl.schedule_actions(schedule, pp, microbatches, 1, r, runtime=runtime))
                 for r in range(pp)]

    def stage_seconds(rank: int, recompute_flops: int) -> float:
        spec = specs[rank]
        flops = spec.num_layers * (model.layer_forward_flops + model.layer_backward_flops) + recompute_flops
        if spec.is_last:
            flops += head_fwd + head_bwd
        return flops / fps

    # the uniform settings: every Megatron policy that fits the smallest chunk, each stage predicted
    smallest = min(s.num_layers for s in specs)
    uniform: list[tuple[Policy, list[int], int]] = []
    for policy in megatron_policies(smallest, engine):
        tls = pl.predict_pipeline(config, policy, pp, microbatches, schedule, runtime=runtime, device=device)
        flops = sum(model.shape(u).recompute_flops for spec in specs
                    for u in Plan.from_policy(policy, spec.num_layers).units() if u.mode != "keep")
        uniform.append((policy, [tl.peak_bytes for tl in tls], flops))
    none_peaks = uniform[0][1]
    fits = [u for u in uniform if max(u[1]) <= budget]

    def rebuilt(p: Plan) -> int:  # ties in FLOPs (norms count none) go to what rebuilds the fewest bytes
        return sum(model.shape(u).recompute_bytes for u in p.units())

    best_uniform = min(fits, key=lambda u: (u[2], sum(rebuilt(Plan.from_policy(u[0], s.num_layers)) for s in specs),
                                            max(u[1]))) if fits else None

    def stored(us: Sequence[Unit]) -> int:
        return sum(model.shape(u).forward.net for u in us)

    stages: list[dict[str, Any]] = []
    for rank, spec in enumerate(specs):
        Lc, n = spec.num_layers, in_flight[rank]
        units = candidate_units(Lc, offload=offload, engine=engine, contractions=model.contractions)
        keep_plan = [KEEP] * Lc
        delta = none_peaks[rank] - (model.peak(keep_plan) + (n - 1) * stored(keep_plan))
        chosen = None
        tries = 0
        while tries <= max_resolves:
            sol = _solve_stage(model, Lc, budget - delta, n, cost, units, stored(keep_plan))
            if sol is None:
                break
            d = delta

            def estimate(us: list[Unit], n: int = n, d: int = d) -> int:
                return model.peak(us) + (n - 1) * stored(us) + d

            p = Plan.from_units(tidy(model, sol.units, budget, cost, estimate), engine)
            peak = stage_timeline(config, rank, p, pp=pp, microbatches=microbatches, schedule=schedule,
                                  device=device, runtime=runtime).peak_bytes
            if peak <= budget:
                chosen = (p, peak)
                break
            delta += peak - budget
            tries += 1
        entry: dict[str, Any] = {"stage": rank, "layers": [spec.layer_offset, spec.layer_offset + Lc - 1],
                                 "in_flight": n, "resolves": tries}
        candidates = []
        if chosen is not None:
            candidates.append(("extended", chosen[0], chosen[1]))
        if best_uniform is not None:
            candidates.append(("uniform", Plan.from_policy(best_uniform[0], Lc), best_uniform[1][rank]))
        if not candidates:
            entry.update(plan=None, fits=False)
            stages.append(entry)
            continue
        source, p, peak = min(candidates, key=lambda c: (sum(cost.cost(model, u) for u in c[1].units()),
                                                         rebuilt(c[1]), c[2]))
        flops = sum(model.shape(u).recompute_flops for u in p.units() if u.mode != "keep")
        policy, why = p.megatron_policy()
        entry.update(fits=True, source=source, plan=str(p), plan_json=p.to_dict(), peak_bytes=peak,
                     recompute_flops=flops, seconds_per_microbatch=stage_seconds(rank, flops),
                     megatron_policy=None if policy is None else str(policy), why_not_megatron=why)
        stages.append(entry)

    report: dict[str, Any] = {"pp": pp, "microbatches": microbatches, "schedule": schedule, "runtime": runtime,
                              "budget_bytes": budget, "stages": stages}
    if best_uniform is not None:
        per = [stage_seconds(r, sum(model.shape(u).recompute_flops
                                    for u in Plan.from_policy(best_uniform[0], specs[r].num_layers).units()
                                    if u.mode != "keep")) for r in range(pp)]
        report["uniform"] = {"policy": str(best_uniform[0]), "stage_peaks": best_uniform[1],
                             "recompute_flops": best_uniform[2], "seconds_per_microbatch": per,
                             "critical_path_seconds": max(per) * (microbatches + pp - 1),
                             "megatron_args": best_uniform[0].to_megatron_args()}
    else:
        lowest = min(uniform, key=lambda u: max(u[1]))
        report["uniform"] = None
        report["uniform_note"] = f"no uniform setting fits: the lowest is {lowest[0]} at {_fmt_bytes(max(lowest[1]))}"
    if all(st.get("fits") for st in stages):
        per = [st["seconds_per_microbatch"] for st in stages]
        report["critical_path_seconds"] = max(per) * (microbatches + pp - 1)
        if report["uniform"] is not None:
            u = report["uniform"]["critical_path_seconds"]
            report["step_time_saving_pct"] = 100 * (1 - report["critical_path_seconds"] / u) if u else 0.0
    report["seconds"] = time.perf_counter() - start
    report["summary"] = _pipeline_summary(report)
    return report


def _solve_stage(model: UnitModel, num_layers: int, budget: int, in_flight: int, cost: CostModel,
                 units: list[Unit], max_stored: int) -> Solution | None:
    """The cheapest plan of a stage's layers when ``in_flight - 1`` other microbatches keep the plan's stored bytes
    each: the least cost over a grid of caps T on the stored bytes of ``solve(budget - (in_flight - 1) T,
    stored_cap=T)``, refined around the best cap."""
    if in_flight <= 1:
        return solve(model, num_layers, budget, cost, units=units)
    best: Solution | None = None
    grid = sorted({int(max_stored * k / 32) for k in range(33)})
    for _ in range(2):
        found = []
        for cap in grid:
            sol = solve(model, num_layers, budget - (in_flight - 1) * cap, cost, units=units, stored_cap=cap)
            if sol is not None:
                found.append(cap)
                if best is None or sol.cost < best.cost:
                    best = sol
        if best is None:
            return None
        used = sum(model.shape(u).forward.net for u in best.units)
        step = max(1, (grid[1] - grid[0]) if len(grid) > 1 else 1)
        grid = sorted({max(0, used + int(step * k / 16)) for k in range(-16, 17)})
    return best


def _pipeline_summary(report: dict[str, Any]) -> str:
    lines = [f"Pipeline ({report['pp']} stages, {report['microbatches']} microbatches, {report['schedule']}): "
             "one plan per stage"]
    for st in report["stages"]:
        if not st.get("fits"):
            lines.append(f"  stage {st['stage']}: nothing fits")
            continue
        lines.append(f"  stage {st['stage']} (layers {st['layers'][0]}-{st['layers'][1]}, {st['in_flight']} in "
                     f"flight): {st['plan']} [{st['source']}], peak {_fmt_bytes(st['peak_bytes'])}, "
                     f"{st['recompute_flops']:,} recomputed FLOPs per microbatch")
    u = report.get("uniform")
    if u is not None:
        lines.append(f"  best uniform setting: {u['policy']} (stage peaks "
                     f"{', '.join(_fmt_bytes(p) for p in u['stage_peaks'])})")
    else:
        lines.append(f"  {report.get('uniform_note', '')}")
    if "critical_path_seconds" in report:
        text = f"  critical path {_fmt_seconds(report['critical_path_seconds'])} per step"
        if "step_time_saving_pct" in report:
            text += (f" vs {_fmt_seconds(report['uniform']['critical_path_seconds'])} with the uniform setting: "
                     f"{report['step_time_saving_pct']:.1f}% shorter")
        lines.append(text)
    return "\n".join(lines)
