"""What :func:`remat.plan.plan` returns (:class:`PlanResult`, one :class:`PlanChoice` per answer) or raises
(:class:`BudgetError`), and the report ``remat plan`` prints from it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from remat.config import ModelConfig
from remat.plan.costs import CostModel
from remat.plan.fine_offload import format_offload_options
from remat.plan.megatron import Predicted
from remat.policy import Policy
from remat.recompute.plan_format import Plan
from remat.units import format_bytes, format_seconds


@dataclass
class PlanChoice:
    """One answer of :func:`plan`: the plan and what its traced prediction says.

    ``peak_bytes``/``at_peak``/``peak_phase`` come from the real (fake-tensor) trace; ``model_peak_bytes`` from the
    unit model. ``recompute_flops`` are the recomputation's FLOPs (``torch.utils.flop_counter`` formulas) and
    ``extra_compute_pct`` their share of the plain step's forward + backward FLOPs. ``cost`` is the objective's
    value (:class:`CostModel`). ``offload_bytes`` is what moves to the host (and back) per step and
    ``offload_seconds`` the transfer time charged. ``recompute_bytes`` is what the recomputation allocates again
    (unit model): the memory traffic of work FLOP counters do not see (norms, softmax, dropout, activations).

    A Megatron setting with fine-grained activation offloading (``remat plan --fine-grained-offload``,
    :func:`remat.plan.fine_offload.choose_offload`) is not a :class:`Plan`: ``policy`` holds it, ``plan`` its
    recompute part only, and :attr:`layout` (what :func:`remat.apply` takes) the policy. Then ``offload_bytes``
    are the bytes its modules copy to the host (and back), ``host_peak_bytes`` the most on the host at once and
    ``offload_seconds`` the transfer time charged (NOTE [fine-grained offload charge]); ``cost`` includes it.
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
    step_time_ratio: float = 1.0  # predicted step time over the no-recompute step's (CostModel.plain_step_seconds)
    policy: Policy | None = None  # a Megatron setting with fine-grained offloading; ``plan`` is its recompute part
    host_peak_bytes: int = 0  # with ``policy``: the most its offloading holds on the host at once

    @property
    def layout(self) -> Plan | Policy:
        """What to apply (:func:`remat.apply`): :attr:`policy` when set (fine-grained offloading), else the plan."""
        return self.plan if self.policy is None else self.policy

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; ``plan`` is :attr:`layout`'s text, ``plan_json`` the plan's form (None for a ``policy``, which
        a plan cannot express: apply ``policy``)."""
        return {
            "step_time_ratio": self.step_time_ratio, "recompute_bytes": self.recompute_bytes,
            "plan": str(self.layout), "source": self.source, "peak_bytes": self.peak_bytes,
            "peak_phase": self.peak_phase, "at_peak": self.at_peak, "model_peak_bytes": self.model_peak_bytes,
            "recompute_flops": self.recompute_flops, "extra_compute_pct": self.extra_compute_pct,
            "cost": self.cost, "offload_bytes": self.offload_bytes, "offload_seconds": self.offload_seconds,
            "megatron_policy": self.megatron_policy, "megatron_args": self.megatron_args,
            "why_not_megatron": self.why_not_megatron,
            "plan_json": self.plan.to_dict() if self.policy is None else None,
            "policy": None if self.policy is None else str(self.policy), "host_peak_bytes": self.host_peak_bytes,
        }

    def snippet(self) -> str:
        """Python that applies this plan to a model built elsewhere (``model``)."""
        if self.policy is not None:
            return ("import remat\n\n"
                    f"remat.apply(model, {str(self.policy)!r})  # model: your GPT-style model with a layer stack\n")
        data = json.dumps(self.plan.to_dict(), separators=(",", ":"))
        return ("import remat\nfrom remat.plan import Plan\n\n"
                f"plan = Plan.from_dict({data})\n"
                "remat.apply(model, plan)  # model: your GPT-style model with a layer stack\n")

    def extra_seconds(self, cost: CostModel) -> float:
        """Predicted seconds this plan adds to a step: the time objective's value when ``cost`` prices time,
        else the roofline estimate (FLOPs at ``flops_per_second``, rebuilt bytes at ``memory_bandwidth``, plus
        the offload transfers charged)."""
        if cost.objective == "time":
            return self.cost * 1e-9
        return (self.recompute_flops / cost.flops_per_second + self.recompute_bytes / cost.memory_bandwidth
                + self.offload_seconds)


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


@dataclass
class PlanResult:
    """What :func:`plan` found: the best Megatron setting and the best extended plan for the budget (and, with
    ``pp``, the per-stage plans in ``pipeline``)."""

    config: ModelConfig
    budget_bytes: int
    budget_text: str
    objective: str
    cost_model: CostModel
    extended: PlanChoice | None  # None only with a pipeline whose whole model fits no plan on one GPU
    megatron: PlanChoice | None
    megatron_note: str
    baseline: Predicted
    stats: dict[str, Any] = field(default_factory=dict)
    pipeline: dict[str, Any] | None = None
    tp: int = 1      # planned for one tensor-parallel rank of tp
    sp: bool = False  # ... with sequence parallelism
    megatron_without_offload: PlanChoice | None = None  # the best recompute-only setting, when offloading won

    def to_dict(self) -> dict[str, Any]:
        """Everything as JSON-able data (format ``remat.plan-result``)."""
        return {
            "format": "remat.plan-result", "version": 1, "config": self.config.to_dict(),
            "budget_bytes": self.budget_bytes, "budget": self.budget_text, "objective": self.objective,
            "tp": self.tp, "sp": self.sp,
            "cost_model": self.cost_model.describe(),
            "baseline": {"policy": "none", "peak_bytes": self.baseline.peak_bytes, "flops": self.baseline.flops},
            "extended": None if self.extended is None else self.extended.to_dict(),
            "megatron": None if self.megatron is None else self.megatron.to_dict(),
            "megatron_note": self.megatron_note, "stats": self.stats, "pipeline": self.pipeline,
            "megatron_without_offload": None if self.megatron_without_offload is None else
            self.megatron_without_offload.to_dict(),
            "snippet": None if self.extended is None else self.extended.snippet(),
        }

    def _rank_text(self) -> str:
        if self.tp == 1 and not self.sp:
            return ""
        return f"; one tensor-parallel rank of {self.tp}" + (" with sequence parallelism" if self.sp else "")

    def format(self) -> str:
        """The report ``remat plan`` prints. With a pipeline it leads with the per-stage plans and applies them;
        the one-GPU plans follow for reference."""
        c = self.config
        lines = [f"remat plan: {c.num_layers} layers, h={c.hidden_size}, s={c.seq_length}, b={c.micro_batch_size}, "
                 f"{c.dtype}{self._rank_text()}; budget {self.budget_text} = {self.budget_bytes:,} bytes",
                 self.headline(),
                 f"no recompute: peak {format_bytes(self.baseline.peak_bytes)} ({self.baseline.peak_phase})",
                 f"objective: {self.cost_model.describe()}", ""]
        if self.pipeline is not None:
            lines += [self.pipeline.get("summary", ""), ""]
            snippet = self.pipeline.get("snippet")
            lines += ["Apply it, on each pipeline stage:", indent(snippet, "  ")] if snippet else \
                ["No per-stage snippet: a stage fits no plan."]
            lines += ["", "For reference, the whole model on one GPU (no pipeline) under the same budget:", ""]
        if self.extended is None:
            lines += [f"  {self.megatron_note}", ""]
        else:
            for title, choice in (("Best Megatron-LM setting", self.megatron), ("Best extended plan", self.extended)):
                lines += [f"{title}:", *self._choice_lines(choice)]
                if title.startswith("Best Megatron") and self.megatron_without_offload is not None:
                    lines.append(self._without_offload_line())
                lines.append("")
        if self.megatron is not None and self.extended is not None:
            lines.append(versus_megatron(self.extended, self.megatron, self.cost_model, self.baseline))
        s = self.stats
        lines.append(f"solve: {1e3 * s.get('dp_seconds', 0):.0f} ms dynamic program ({s.get('entries', 0):,} Pareto "
                     f"entries), unit model {s.get('model_seconds', 0):.1f} s, Megatron sweep "
                     f"{s.get('megatron_seconds', 0):.1f} s, validation trace {s.get('validate_seconds', 0):.1f} s, "
                     f"re-solves {s.get('resolves', 0)}")
        if s.get("fine_grained_offload"):
            lines += ["", *format_offload_options(s["fine_grained_offload"], s.get("fine_grained_offload_chosen"))]
        if self.pipeline is None and self.extended is not None:
            lines += ["", "Apply it:", indent(self.extended.snippet(), "  ")]
        return "\n".join(lines)

    def headline(self) -> str:
        """The report's first figures: each answer's predicted step time as a ratio to the no-recompute step, then
        its recomputed FLOPs as a share of the step's."""
        answers = [(name, c) for name, c in (("extended plan", self.extended), ("best Megatron setting",
                                                                                 self.megatron)) if c is not None]
        if not answers:
            return "predicted step time: no one-GPU plan fits"
        return ("predicted step time: " + ", ".join(f"{c.step_time_ratio:.4f}x ({name})" for name, c in answers)
                + " of the no-recompute step; recomputed FLOPs: "
                + ", ".join(f"{c.extra_compute_pct:.2f}% ({name})" for name, c in answers) + " of the step's")

    def _without_offload_line(self) -> str:
        other = self.megatron_without_offload
        assert other is not None and self.megatron is not None
        return (f"  without offloading: {other.megatron_policy or other.layout} ({other.step_time_ratio:.4f}x no "
                f"recompute predicted, cost {other.cost:,}, peak {format_bytes(other.peak_bytes)}); offloading costs "
                f"{self.megatron.cost:,}")

    def _choice_lines(self, choice: PlanChoice | None) -> list[str]:
        if choice is None:
            return [f"  none fits: {self.megatron_note}"]
        parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in choice.at_peak.items() if v)
        moved = (f", offload {format_bytes(choice.offload_bytes)} each way ({1e3 * choice.offload_seconds:.2f} ms "
                 "charged)") if choice.offload_bytes and choice.policy is None else ""
        offload = []
        if choice.policy is not None:
            modules = ", ".join(choice.policy.offload_modules)
            offload = [f"  offloading:     chosen: Megatron's fine-grained activation offloading of {modules}: "
                       f"device peak {format_bytes(choice.peak_bytes)}, host peak "
                       f"{format_bytes(choice.host_peak_bytes)} ({format_bytes(choice.offload_bytes)} copied out and "
                       f"back), {1e3 * choice.offload_seconds:.3f} ms transfer time charged (at "
                       f"{self.cost_model.bandwidth / 1e9:g} GB/s, each way overlapped with up to one layer's "
                       "forward)"]
        flags = f"  Megatron flags: {' '.join(choice.megatron_args) or '(none: no recompute flags)'}" \
            if choice.megatron_args is not None else f"  Megatron flags: none express it: {choice.why_not_megatron}"
        extra = choice.extra_seconds(self.cost_model)
        return [f"  plan:           {choice.layout}",
                f"  step time:      {choice.step_time_ratio:.4f}x no recompute predicted ({format_seconds(extra)} "
                f"of recompute{' and transfers' if choice.offload_bytes else ''} per step)",
                f"  predicted peak: {format_bytes(choice.peak_bytes)} ({choice.peak_bytes:,} bytes, "
                f"{100 * choice.peak_bytes / self.budget_bytes:.1f}% of budget) in {choice.peak_phase}",
                f"  at the peak:    {parts}",
                f"  extra compute:  {choice.extra_compute_pct:.2f}% ({choice.recompute_flops:,} recomputed "
                f"FLOPs; {format_bytes(choice.recompute_bytes)} rebuilt in backward){moved}",
                *offload, flags]


def indent(text: str, prefix: str) -> str:
    """``text`` with ``prefix`` before each non-empty line (and no trailing newline)."""
    return "\n".join(prefix + line if line else line for line in text.splitlines())


def compared(new: float, old: float, less: str, more: str) -> str:
    """``'12.5% less'`` / ``'3.0% more'`` / ``'the same'``: ``new`` against ``old``, in the words given."""
    if new == old:
        return "the same"
    if old == 0:
        return more
    return f"{100 * abs(1 - new / old):.1f}% {less if new < old else more}"


# NOTE [the headline]: the extended plan is the cheapest under the objective, so it never loses on that axis, but
# it may on the other: under the FLOP objective a non_matmul plan recomputes no FLOPs yet rebuilds more bytes
# (slower on a memory-bound device), and under the time objective a plan may recompute more FLOPs than Megatron's
# and still take less time. The headline leads with the objective's axis (time as a step-time ratio) and always
# states the other with its own direction ("more"/"longer" where it is worse).
def versus_megatron(extended: PlanChoice, megatron: PlanChoice, cost: CostModel, baseline: Predicted) -> str:
    """One sentence comparing the extended plan with the best Megatron setting in predicted step time (each
    plan's :attr:`PlanChoice.step_time_ratio`) and in recomputed FLOPs, each with its own direction."""
    flops = (f"recomputed FLOPs: {compared(extended.recompute_flops, megatron.recompute_flops, 'fewer', 'more')} "
             f"({extended.recompute_flops:,} vs {megatron.recompute_flops:,})")
    if cost.measured is not None:
        how = "operator times measured on this machine"
    else:
        how = (f"FLOPs at {cost.flops_per_second / 1e12:g} TFLOP/s and written bytes at "
               f"{cost.memory_bandwidth / 1e9:g} GB/s")
    a, b = extended.step_time_ratio, megatron.step_time_ratio
    time = f"predicted step time: {compared(a, b, 'shorter', 'longer')} ({a:.4f}x vs {b:.4f}x no recompute; {how})"
    first, second = (time, flops) if cost.objective == "time" else (flops, time)
    return f"Extended plan vs the best Megatron setting: {first}; {second}."
