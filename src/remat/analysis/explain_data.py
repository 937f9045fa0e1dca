"""What ``remat explain`` measures, as data: per-policy rows, the user's-formula check, the other-vocabulary run,
and the timeline helpers that derive them."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from remat.config import ModelConfig
from remat.policy import Policy
from remat.timeline import Timeline


@dataclass
class PolicyRow:
    """The measured numbers of one policy; bytes are exact storage bytes on CPU, block-rounded on CUDA.

    ``activations_at_peak`` is saved activations plus recomputed activations alive at the peak;
    ``group_inputs_stored`` is what the checkpoints keep at the end of forward (the inputs of every group);
    ``recompute_max_bytes`` is the largest amount of recomputed activations alive at any moment;
    ``head_loss_at_peak`` is the final norm, logits, loss and their gradients alive at the peak.
    ``extra_forward_pct`` is the recomputation's matmul FLOPs over the plain step's forward+backward FLOPs
    (in percent); ``step_seconds`` is the median wall time of a forward+backward without the recorder and
    ``step_ratio`` that time over the plain (none) step's, measured in the same run (None when not timed).
    """

    policy: str
    peak_bytes: int
    peak_phase: str
    activations_at_peak: int
    group_inputs_at_peak: int
    group_inputs_stored: int
    recompute_max_bytes: int
    head_loss_at_peak: int
    gradients_at_peak: int
    parameters_bytes: int
    extra_forward_pct: float
    recompute_flops: int
    step_seconds: float | None
    step_ratio: float | None
    step_times: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class FormulaRow:
    """The user's formula for one ``full/uniform/K`` policy, checked against the measurement.

    ``predicted_bytes`` = ``stored_group_inputs`` (all groups' inputs at the end of forward) +
    ``group_activation_bytes`` (the plain run's activations of the layers of the last group, the one recomputed
    first). ``measured_bytes`` = stored group inputs + recomputed activations alive at the last event of that
    first recomputation. ``m_over_groups_bytes`` is the user's literal version: stored inputs + M / num_groups,
    M being all layers' activations of the plain run. ``error`` is (measured - predicted) / measured.
    """

    policy: str
    group: str
    group_layers: list[int]
    num_groups: int
    stored_group_inputs: int
    group_activation_bytes: int
    predicted_bytes: int
    measured_bytes: int
    m_over_groups_bytes: int
    error: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Regime:
    """One vocabulary's side of the question: how large the head/loss part is next to the stack's activations,
    and what that does to the plain peak and the whole-stack group's.

    ``head_loss_bytes`` is the most head/loss bytes (final norm, logits, loss, their gradients) alive at once in
    the plain run; ``stack_activation_bytes`` all layers' saved activations at the end of its forward;
    ``whole_stack`` the ``full/uniform/L`` policy (None when it was not measured); ``saving_bytes`` the plain peak
    minus that policy's.
    """

    vocab_size: int
    head_loss_bytes: int
    stack_activation_bytes: int
    none_peak_bytes: int
    whole_stack: str | None
    whole_stack_peak_bytes: int | None
    saving_bytes: int | None

    @property
    def saving_fraction(self) -> float | None:
        return None if self.saving_bytes is None or not self.none_peak_bytes else \
            self.saving_bytes / self.none_peak_bytes

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "saving_fraction": self.saving_fraction}


@dataclass
class Contrast:
    """The same model at another vocabulary, measured (untimed) under none, full/uniform/1 and full/uniform/L,
    so the other regime of the question shows next to the main run."""

    config: ModelConfig
    rows: list[PolicyRow]
    regime: Regime
    timelines: dict[str, Timeline]

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config.to_dict(), "policies": [r.policy for r in self.rows],
                "rows": [r.to_dict() for r in self.rows], "regime": self.regime.to_dict()}


@dataclass
class Explanation:
    """What :func:`remat.analysis.explain.explain` found: one row per policy, the formula checks, the short answer,
    sentences, the timelines, and the run at the contrasting vocabulary (None when not asked for)."""

    config: ModelConfig
    rows: list[PolicyRow]
    formula: list[FormulaRow]
    sentences: list[str]
    timelines: dict[str, Timeline]
    meta: dict[str, Any] = field(default_factory=dict)
    short_answer: list[str] = field(default_factory=list)
    regime: Regime | None = None
    contrast: Contrast | None = None

    def row(self, policy: str) -> PolicyRow:
        """The row of ``policy`` (its short form, e.g. ``'full/uniform/2'``)."""
        for row in self.rows:
            if row.policy == policy:
                return row
        raise KeyError(f"no row for policy {policy!r}; rows: {[r.policy for r in self.rows]}")

    def regimes(self) -> list[Regime]:
        """The main run's regime and the contrast's, smallest vocabulary first."""
        found = [r for r in (self.regime, self.contrast.regime if self.contrast else None) if r is not None]
        return sorted(found, key=lambda r: r.vocab_size)

    def to_dict(self) -> dict[str, Any]:
        """Everything but the timelines (saved separately), as JSON-able plain data."""
        return {
            "format": "remat.analysis.explain",
            "version": 1,
            "config": self.config.to_dict(),
            "policies": [r.policy for r in self.rows],
            "rows": [r.to_dict() for r in self.rows],
            "formula": [f.to_dict() for f in self.formula],
            "sentences": list(self.sentences),
            "meta": dict(self.meta),
            "short_answer": list(self.short_answer),
            "regime": self.regime.to_dict() if self.regime else None,
            "contrast": self.contrast.to_dict() if self.contrast else None,
        }


# ------------------------------------------------------------------------------------------------ timeline helpers
def category_live(tl: Timeline, categories: str | Sequence[str]) -> np.ndarray:
    """Bytes alive after each event, counting only allocations of the given categories."""
    wanted = {categories} if isinstance(categories, str) else set(categories)
    delta = np.zeros(tl.num_events + 1, dtype=np.int64)
    for row, category in enumerate(tl.category):
        if category in wanted:
            delta[tl.alloc_at[row]] += tl.nbytes[row]
            if tl.free_at[row] >= 0:
                delta[tl.free_at[row]] -= tl.nbytes[row]
    return np.cumsum(delta[:-1])


def first_recompute_end(tl: Timeline) -> tuple[int, str] | None:
    """(last event, group label) of the first group recomputation: the run of recompute phases of one group."""
    spans = tl.phase_spans()
    for i, (phase, _, end) in enumerate(spans):
        if phase.kind == "recompute":
            last = end
            for later, _, later_end in spans[i + 1:]:
                if later.kind != "recompute" or later.detail != phase.detail:
                    break
                last = later_end
            return last - 1, phase.detail
    return None


def layer_activation_bytes(plain: Timeline) -> dict[int, int]:
    """Per layer: bytes its forward keeps for backward in the plain run (alive at the end of forward)."""
    end = plain.forward_end
    out: dict[int, int] = {}
    for row in plain.alive_at(end):
        phase = plain.phases[plain.phase_index[row]]
        if phase.kind == "forward" and phase.region.startswith("layer ") and \
                plain.category[row] == "saved_activations":
            i = int(phase.region.split()[1])
            out[i] = out.get(i, 0) + plain.nbytes[row]
    return out


def head_loss_max(plain: Timeline) -> tuple[int, int]:
    """(bytes, event) of the most head/loss bytes alive at once in ``plain``."""
    live = category_live(plain, "head_loss")
    return (int(live.max()), int(np.argmax(live))) if len(live) else (0, 0)


# ------------------------------------------------------------------------------------------------ rows
def policy_row(policy: Policy, tl: Timeline, plain_flops: int, times: Sequence[float]) -> PolicyRow:
    """The :class:`PolicyRow` of one measured step; ``step_ratio`` is left None (it needs the plain step's time)."""
    event, at_peak = tl.peak_parts()  # once: peak_bytes, peak_phase and at_peak would each make the live curve
    stored = tl.breakdown(tl.forward_end)["group_inputs"]
    recompute = category_live(tl, "recompute")
    recompute_flops = int(tl.meta.get("flops", {}).get("recompute", 0))
    return PolicyRow(
        policy=str(policy),
        peak_bytes=sum(at_peak.values()),
        peak_phase=tl.phase_at(event).label,
        activations_at_peak=at_peak["saved_activations"] + at_peak["recompute"],
        group_inputs_at_peak=at_peak["group_inputs"],
        group_inputs_stored=stored,
        recompute_max_bytes=int(recompute.max()) if len(recompute) else 0,
        head_loss_at_peak=at_peak["head_loss"],
        gradients_at_peak=at_peak["gradients"],
        parameters_bytes=at_peak["parameters"],
        extra_forward_pct=100.0 * recompute_flops / plain_flops if plain_flops else 0.0,
        recompute_flops=recompute_flops,
        step_seconds=statistics.median(times) if times else None,
        step_ratio=None,
        step_times=list(times),
    )


def formula_row(policy: Policy, tl: Timeline, plain: Timeline, num_layers: int) -> FormulaRow | None:
    """Check the user's formula on one uniform policy's timeline; None for other policies."""
    if policy.granularity != "full" or policy.method != "uniform":
        return None
    end = first_recompute_end(tl)
    if end is None:
        return None
    event, label = end
    groups = policy.layer_groups(num_layers)
    last = groups[-1]  # backward reaches the last group first
    per_layer = layer_activation_bytes(plain)
    stored = tl.breakdown(tl.forward_end)["group_inputs"]
    group_bytes = sum(per_layer.get(i, 0) for i in last)
    at_end = tl.breakdown(event)
    measured = at_end["group_inputs"] + at_end["recompute"]
    predicted = stored + group_bytes
    m_total = sum(per_layer.values())
    return FormulaRow(
        policy=str(policy), group=label, group_layers=list(last), num_groups=len(groups),
        stored_group_inputs=stored, group_activation_bytes=group_bytes, predicted_bytes=predicted,
        measured_bytes=measured, m_over_groups_bytes=stored + m_total // len(groups),
        error=(measured - predicted) / measured if measured else 0.0,
    )


def whole_stack_policy(policies: Sequence[Policy], num_layers: int) -> Policy | None:
    """The ``full/uniform/L`` policy among ``policies`` (one group over the whole stack), if any."""
    return next((p for p in policies if p.granularity == "full" and p.method == "uniform"
                 and p.num_layers == num_layers), None)


def regime_of(config: ModelConfig, policies: Sequence[Policy], rows: Sequence[PolicyRow],
              timelines: dict[str, Timeline]) -> Regime:
    """The :class:`Regime` of one run; ``rows[0]`` must be the plain (none) run."""
    plain = timelines[rows[0].policy]
    whole = whole_stack_policy(policies, config.num_layers)
    whole_row = next((r for r in rows if whole is not None and r.policy == str(whole)), None)
    return Regime(
        vocab_size=config.vocab_size, head_loss_bytes=head_loss_max(plain)[0],
        stack_activation_bytes=plain.breakdown(plain.forward_end)["saved_activations"],
        none_peak_bytes=rows[0].peak_bytes, whole_stack=whole_row.policy if whole_row else None,
        whole_stack_peak_bytes=whole_row.peak_bytes if whole_row else None,
        saving_bytes=rows[0].peak_bytes - whole_row.peak_bytes if whole_row else None)
