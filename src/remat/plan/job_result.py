"""What a whole-job plan found (:func:`remat.plan.job_plan.plan_job`): each pipeline stage's answers
(:class:`StageChoice`, :class:`JobStagePlan`) and the job's (:class:`JobPlan`), with their JSON form."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from remat.job import Job
from remat.memory.rank_state import RankState
from remat.parallel.job_predict import RankPrediction
from remat.policy import Policy
from remat.recompute.plan_format import Plan
from remat.units import format_bytes

STATE_PARTS = ("parameters", "gradients", "master_parameters", "optimizer_state")


@dataclass
class StageChoice:
    """One answer for one stage: the plan every chunk of the stage runs and its exact whole-rank prediction."""

    plan: Plan | None  # of the stage's deepest chunk's layers, from 0 (NOTE [uneven splits]); None: it has no layer
    source: str  # 'extended' or 'megatron'
    prediction: RankPrediction
    cost: int  # the objective's value per microbatch, summed over the stage's chunks
    recompute_flops: int  # per microbatch, summed over the stage's chunks
    extra_seconds: float  # predicted seconds the recompute adds per microbatch (CostModel.extra_seconds)
    extra_compute_pct: float  # recompute FLOPs / the stage's layers' forward + backward FLOPs
    # a Megatron setting with fine-grained offloading (NOTE [offloading in a job]); ``plan`` is its recompute part
    offload_policy: Policy | None = None
    # with offload_policy: the most one microbatch-chunk holds on the host (traced: a forward that keeps its last
    # layer's groups on the device; the rank's host peak is in the prediction's host_memory)
    host_bytes: int = 0
    transfer_seconds: float = 0.0  # with offload_policy: the transfer time charged per microbatch (in ``cost``)

    @property
    def policy(self) -> Policy | None:
        """The Megatron setting this plan is (with its offloading), or None."""
        if self.plan is None:  # a stage without decoder layers recomputes nothing
            return self.offload_policy or Policy()
        return self.offload_policy or self.plan.megatron_policy()[0]

    @property
    def layout(self) -> Plan | Policy:
        """What each chunk of the stage applies (:func:`remat.apply`): the offload policy, else the plan (a shorter
        chunk its first layers, :func:`remat.parallel.stages.chunk_policy`), else (no layer) nothing."""
        return self.offload_policy or self.plan or Policy()

    def to_dict(self) -> dict[str, Any]:
        policy, why = (self.policy, "") if self.offload_policy is not None or self.plan is None else \
            self.plan.megatron_policy()
        p = self.prediction
        return {"plan": str(self.layout), "plan_json": None if self.offload_policy is not None or self.plan is None
                else self.plan.to_dict(),
                "source": self.source, "host_bytes_per_microbatch": self.host_bytes,
                # the rank's host peak over its microbatches in flight (the stage timeline's host_memory)
                "host_peak_bytes": (p.timeline.meta.get("host_memory") or {}).get("peak_bytes", 0),
                "transfer_seconds": self.transfer_seconds,
                "megatron_policy": None if policy is None else str(policy),
                "megatron_args": None if policy is None else _megatron_args(policy), "why_not_megatron": why,
                "rank": p.rank, "peak_bytes": p.peak_bytes, "peak_phase": p.peak_phase, **p.parts,
                "reserved": p.reserved,
                "cost": self.cost, "recompute_flops": self.recompute_flops, "extra_seconds": self.extra_seconds,
                "extra_compute_pct": self.extra_compute_pct}


@dataclass
class JobStagePlan:
    """What one pipeline stage runs, or why nothing fits it: the extended plan and the best Megatron setting."""

    stage: int
    state: RankState
    policy: Policy | None  # the best Megatron setting of the stage; None: none fits
    prediction: RankPrediction | None  # of ``policy``, or the lowest peak predicted when nothing fits
    tried: dict[str, int] = field(default_factory=dict)  # plan or policy -> exact predicted peak
    extended: StageChoice | None = None  # the cheapest plan that fits (None: nothing fits)
    megatron: StageChoice | None = None  # ``policy`` as a choice
    megatron_without_offload: StageChoice | None = None  # the best recompute-only setting, when offloading won
    offload_options: list[dict[str, Any]] = field(default_factory=list)  # fine-grained variants priced
    layers: tuple[int, int] = (0, 0)  # the first and last layer of its deepest chunk (the plan's); last < first: none
    chunk_layers: tuple[int, ...] = ()  # the layers of each of its chunks (an uneven split: not all the same)
    in_flight: int = 1  # the most microbatch-chunks it holds at once
    resolves: int = 0  # extended plans that did not fit when predicted exactly
    megatron_search_cut: bool = False  # the Megatron screen's time cap stopped it: maybe not the cheapest
    note: str = ""

    @property
    def fits(self) -> bool:
        return self.extended is not None


@dataclass
class JobPlan:
    """What :func:`plan_job` found: each stage's cheapest plan (extended search) with its best Megatron setting
    and, when one exists, one Megatron setting for every stage (what Megatron's flags express), all predicted
    exactly on every rank."""

    job: Job
    budget_bytes: int
    budget_text: str
    stages: list[JobStagePlan]
    uniform: Policy | None = None
    uniform_ranks: list[RankPrediction] = field(default_factory=list)  # worst first
    objective: str = "extra_flops"
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        """Every stage has a plan whose exact whole-rank peak is <= the budget."""
        return all(s.fits for s in self.stages)

    @property
    def state_fits(self) -> bool:
        """Every rank's model state alone is within the budget."""
        return all(s.state.total <= self.budget_bytes for s in self.stages)

    def worst_state(self) -> JobStagePlan:
        return max(self.stages, key=lambda s: (s.state.total, -s.stage))

    def ranks(self) -> list[RankPrediction]:
        """The exact prediction of each stage's plan, worst first (empty unless every stage fits)."""
        if not self.fits:
            return []
        return sorted((s.extended.prediction for s in self.stages if s.extended is not None),
                      key=lambda r: (-r.peak_bytes, r.stage))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready. Per stage: ``policy`` (its best Megatron setting) and ``tried``; ``rank``, ``peak_bytes``
        and the parts (:data:`STATE_PARTS`, ``activations``, ``communication``) of the plan it runs (the extended
        one, or the Megatron one when nothing fits); ``extended`` and ``megatron`` (:meth:`StageChoice.to_dict`).
        ``uniform``: the one Megatron setting for every stage with its flags and rows."""
        stages = []
        for s in self.stages:
            row: dict[str, Any] = {"stage": s.stage, "fits": s.fits, "policy": None if s.policy is None else str(
                s.policy), "state": s.state.parts(), "state_bytes": s.state.total, "tried": s.tried,
                "layers": list(s.layers),
                "chunk_layers": list(s.chunk_layers), "in_flight": s.in_flight, "resolves": s.resolves, "note": s.note,
                "megatron_search_cut": s.megatron_search_cut,
                "extended": None if s.extended is None else s.extended.to_dict(),
                "megatron": None if s.megatron is None else s.megatron.to_dict(),
                "megatron_without_offload": None if s.megatron_without_offload is None else
                s.megatron_without_offload.to_dict(), "fine_grained_offload": s.offload_options}
            shown = s.extended.prediction if s.extended is not None else s.prediction
            if shown is not None:
                row.update(rank=shown.rank, peak_bytes=shown.peak_bytes, **shown.parts, reserved=shown.reserved)
            else:
                row.update(rank=None, peak_bytes=None, reserved=None)
            stages.append(row)
        uniform = None
        if self.uniform is not None:
            uniform = {"policy": str(self.uniform), "megatron_args": _megatron_args(self.uniform),
                       "rows": [{"rank": r.rank, "stage": r.stage, "peak_bytes": r.peak_bytes, **r.parts,
                                 "reserved": r.reserved} for r in self.uniform_ranks]}
        return {"format": "remat.plan-job", "version": 1, "fits": self.fits, "budget_bytes": self.budget_bytes,
                "budget": self.budget_text, "objective": self.objective, "stages": stages, "uniform": uniform,
                "stats": self.stats}


def _megatron_args(policy: Policy) -> list[str] | None:
    try:
        return policy.to_megatron_args()
    except ValueError:
        return None


def smallest_dp(job: Job, stage: JobStagePlan, budget: int) -> int | None:
    """The data-parallel size at which, with the distributed optimizer, the stage's model state would leave room
    under ``budget`` (None when even an unbounded dp would not: parameters and main grads are not sharded)."""
    s = stage.state
    fixed = s.parameters + s.parameter_padding + s.gradients
    sharded = (s.master_parameters + s.optimizer_state) * (job.optimizer_shards if job.distributed_optimizer else 1)
    if fixed >= budget or not sharded:
        return None
    return -(-sharded // (budget - fixed)) // job.cp or 1


def format_state(state: RankState) -> str:
    """``parameters 16.43 GiB + gradients 32.86 GiB + ...`` of a rank's model state."""
    return " + ".join(f"{k} {format_bytes(v)}" for k, v in state.parts().items() if v) + \
        f" = {format_bytes(state.total)}"
