"""The Plan: a per-layer recompute assignment (segments of units), its file format and its validation."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from remat.policy import (
    ENGINES,
    MASK_CHECKPOINTING_MODULES,
    NON_MATMUL_INCLUDES,
    SELECTIVE_MODULES,
    Policy,
    PolicyError,
    normalise_modules,
)

FORMAT = "remat.plan"
# How a plan treats a unit of a layer.
MODES = ("keep", "selective", "checkpoint", "offload")


# Selective module sets a plan may use: every non-empty set of SELECTIVE_MODULES except those holding both mlp
# and act (act is inside mlp: one region cannot be nested in another) and those holding non_matmul with layernorm
# or act (non_matmul recomputes them already).
def usable_set(modules: Iterable[str]) -> bool:
    mods = set(modules)
    return not {"mlp", "act"} <= mods and not ("non_matmul" in mods and mods & set(NON_MATMUL_INCLUDES))


# NOTE [operator sets]: ``keep_ops(<indices>)`` is a selective "module" finer than any module: the layer is one
# selective activation checkpoint (remat.recompute.operator_checkpoint.checkpoint_kept_operators: torch's selective
# checkpointing semantics) that keeps the outputs of exactly the listed operators and recomputes every other one
# in backward. Operator i is the i-th aten operator the layer's forward dispatches, from 0, counting every
# operator torch's selective checkpointing asks its policy about (all but torch.utils.checkpoint.SAC_IGNORED_OPS:
# detach and metadata queries) and not dispatched by a collective of remat's parallel groups (NOTE [collectives are
# not operators] in remat.models.collectives: they differ by backend, so they are never counted nor kept);
# remat.plan lists a layer's operators (remat.plan.operator_space). Indices are
# written sorted, runs as ranges: ``keep_ops(3,19-21,41)``; ``keep_ops()`` keeps nothing (the whole layer is
# recomputed). An in-place operator that mutates a kept output must be kept with it, and a kept random draw needs
# every later draw kept (apply refuses the plan at the first step otherwise). It stands alone in a selective set.
KEEP_OPS = "keep_ops"
_KEEP_OPS_RE = re.compile(r"keep_ops\(([0-9,\-]*)\)")


def keep_ops_token(indices: Iterable[int]) -> str:
    """The selective module that keeps the outputs of operators ``indices`` (NOTE [operator sets]), canonical:
    ``keep_ops_token([41, 3, 19, 20, 21]) == 'keep_ops(3,19-21,41)'``."""
    values = sorted(set(indices))
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in values):
        raise PlanError(f"keep_ops indices {values}: give operator indices, integers >= 0")
    runs: list[str] = []
    k = 0
    while k < len(values):
        j = k
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        runs.append(str(values[k]) if j == k else f"{values[k]}-{values[j]}")
        k = j + 1
    return f"{KEEP_OPS}({','.join(runs)})"


def kept_operators(modules: Iterable[str]) -> frozenset[int] | None:
    """The operator indices a selective set's ``keep_ops(...)`` keeps, or None when it has none. Raises
    :class:`PlanError` for a malformed one."""
    found = None
    for m in modules:
        if not (isinstance(m, str) and m.strip().startswith(KEEP_OPS)):
            continue
        match = _KEEP_OPS_RE.fullmatch(m.strip().replace(" ", ""))
        if not match:
            raise PlanError(f"selective module {m!r}: write keep_ops(<operator indices>), e.g. keep_ops(3,19-21,41)")
        out: set[int] = set()
        for part in filter(None, match.group(1).split(",")):
            lo, _, hi = part.partition("-")
            if not lo.isascii() or not lo.isdigit() or (hi and not (hi.isascii() and hi.isdigit())) or \
                    (hi and int(hi) < int(lo)):
                raise PlanError(f"selective module {m!r}: {part!r} is not an index or a range a-b with a <= b")
            out.update(range(int(lo), int(hi or lo) + 1))
        found = frozenset(out)
    return found


def checkpoints_layer_inputs(modules: Iterable[str]) -> bool:
    """Whether a layer whose selective set is ``modules`` has a checkpoint whose inputs include the layer's attention
    mask, so that it lives to the layer's backward: recomputed core attention or its masked softmax
    (:data:`remat.policy.MASK_CHECKPOINTING_MODULES`), or the operator-level checkpoint of the whole layer that
    ``keep_ops(...)`` is (NOTE [operator sets])."""
    modules = tuple(modules)
    return any(m in MASK_CHECKPOINTING_MODULES for m in modules) or kept_operators(modules) is not None


FORMAT_VERSION = 1


class PlanError(ValueError):
    """A plan that is malformed or cannot be used as asked; the message says what to change."""


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
        kept = kept_operators(mods) if self.mode == "selective" else None
        if kept is not None:
            if len(mods) != 1:
                raise PlanError(f"selective modules {'+'.join(mods)}: keep_ops(...) names every operator the layer "
                                "keeps and stands alone: drop the other modules")
            mods = (keep_ops_token(kept),)
        elif self.mode == "selective":
            if not mods:
                raise PlanError(f"selective segment modules {list(mods)}: name at least one of "
                                f"{', '.join(SELECTIVE_MODULES)}")
            try:
                mods = normalise_modules(mods)
            except PolicyError as err:
                raise PlanError(f"selective segment: {err}") from None
            if {"mlp", "act"} <= set(mods):
                raise PlanError("selective modules mlp and act cannot be combined (act is inside mlp): use mlp")
            if not usable_set(mods):
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
    """A recompute plan for a stack of ``num_layers`` layers (a :class:`~remat.recompute.region.RecomputeLayout`).

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
        (``/K``: groups of K over the span; ``selective/keep_ops(3,19-21) 15``: NOTE [operator sets]);
        ``Plan.parse(str(p)) == p``."""
        if not isinstance(text, str) or not text.strip():
            raise PlanError(f"a plan string is expected, got {text!r}")
        body, _, engine = text.partition("@")
        engine = engine.strip() or "reentrant"
        segments: list[Segment] = []
        for piece in re.split(r",(?![^()]*\))", body):  # commas inside keep_ops(...) do not split
            match = re.fullmatch(r"\s*(keep|checkpoint|offload|selective/([a-z0-9_+]+|keep_ops\([0-9,\- ]*\)))\s+"
                                 r"(\d+)(?:-(\d+))?(?:/(\d+))?\s*", piece)
            if not match:
                raise PlanError(f"cannot read plan segment {piece.strip()!r}: write e.g. 'keep 0-3', "
                                "'checkpoint 4-11/2', 'selective/core_attn+mlp 12-15', 'offload 16-17', "
                                "'selective/keep_ops(3,19-21) 18'")
            mode = match.group(1).split("/")[0]
            start = int(match.group(3))
            last = int(match.group(4)) if match.group(4) else start
            size = int(match.group(5)) if match.group(5) else last - start + 1
            if mode not in ("checkpoint", "offload") and match.group(5):
                raise PlanError(f"'/K' (groups of K) applies to checkpoint and offload segments, not {piece!r}")
            if size < 1 or (last - start + 1) % size:
                raise PlanError(f"{piece.strip()!r}: {last - start + 1} layers do not split into groups of {size}")
            modules = () if not match.group(2) else (match.group(2),) if match.group(2).startswith(KEEP_OPS) \
                else tuple(match.group(2).split("+"))
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
        if any(kept_operators(u.modules) is not None for u in units):
            return None, ("it keeps chosen operators' outputs in some layers (keep_ops, torch's selective activation "
                          "checkpointing); Megatron's --recompute-modules checkpoints whole modules")
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
