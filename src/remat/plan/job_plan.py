"""Planning a whole Megatron-LM job (:class:`remat.job.Job`): the recompute setting of every pipeline stage whose
rank fits the budget with *every* part counted.

A rank's peak is its model state (parameters, fp32 main grads, master parameters, optimizer state: alive the whole
step, :func:`remat.parallel.job_predict.stage_state`) plus the activations of the microbatches in flight under the
setting, plus communication buffers: exactly :func:`remat.parallel.job_predict.predict_stage`, which every answer
here is. Tensor, sequence, pipeline, context and data parallelism combine; each stage gets its own setting.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from remat.job import Job
from remat.memory.rank_state import RankState
from remat.parallel.job_predict import RankPrediction, check_job, predict_stage, stage_state
from remat.plan.options import PlanOptions
from remat.policy import Policy
from remat.units import format_bytes

STATE_PARTS = ("parameters", "gradients", "master_parameters", "optimizer_state")

# NOTE [the job search]: the settings searched per stage are Megatron's, in order of recompute: none, then
# selective/core_attn when attention materialises the s x s scores (unfused 'math' attention: that is what
# Megatron's selective recompute is for; flash attention keeps none), then full/block/k for k = 1 .. layers of a
# model chunk (the first k layers of every chunk recomputed; k = all is full/uniform/1's memory). A peak falls as k
# grows, so k is found by bisection: about log2(layers) stage predictions per stage, each exact. Unequal groups,
# offload and selective mixes (remat plan without a job) are not searched for a whole job yet.


@dataclass
class JobStagePlan:
    """The setting chosen for one pipeline stage, or why none fits."""

    stage: int
    state: RankState
    policy: Policy | None  # None: nothing fits
    prediction: RankPrediction | None  # of ``policy``, or of the setting with the lowest peak when nothing fits
    tried: dict[str, int] = field(default_factory=dict)  # policy -> predicted peak

    @property
    def fits(self) -> bool:
        return self.policy is not None


@dataclass
class JobPlan:
    """What :func:`plan_job` found: a setting per stage and, when they all fit, one Megatron setting for every
    stage (what Megatron's flags express), checked on every stage."""

    job: Job
    budget_bytes: int
    budget_text: str
    stages: list[JobStagePlan]
    uniform: Policy | None = None
    uniform_ranks: list[RankPrediction] = field(default_factory=list)  # worst first

    @property
    def fits(self) -> bool:
        return all(s.fits for s in self.stages) and self.uniform is not None

    @property
    def state_fits(self) -> bool:
        """Every rank's model state alone is within the budget."""
        return all(s.state.total <= self.budget_bytes for s in self.stages)

    def worst_state(self) -> JobStagePlan:
        return max(self.stages, key=lambda s: (s.state.total, -s.stage))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: per stage its setting, peak and parts (``rank``/``stage`` and :data:`STATE_PARTS` plus
        activations and communication), the uniform Megatron setting and its flags."""
        stages = []
        for s in self.stages:
            row: dict[str, Any] = {"stage": s.stage, "fits": s.fits, "policy": None if s.policy is None else str(
                s.policy), "state": s.state.parts(), "state_bytes": s.state.total, "tried": s.tried}
            if s.prediction is not None:
                row.update(rank=s.prediction.rank, peak_bytes=s.prediction.peak_bytes, **s.prediction.parts)
            else:
                row.update(rank=None, peak_bytes=None)
            stages.append(row)
        uniform = None
        if self.uniform is not None:
            uniform = {"policy": str(self.uniform), "megatron_args": _megatron_args(self.uniform),
                       "rows": [{"rank": r.rank, "stage": r.stage, "peak_bytes": r.peak_bytes, **r.parts}
                                for r in self.uniform_ranks]}
        return {"format": "remat.plan-job", "version": 1, "fits": self.fits, "budget_bytes": self.budget_bytes,
                "budget": self.budget_text, "stages": stages, "uniform": uniform}


def _megatron_args(policy: Policy) -> list[str] | None:
    try:
        return policy.to_megatron_args()
    except ValueError:
        return None


def job_settings(job: Job, engine: str = "reentrant") -> list[Policy]:
    """The settings :func:`plan_job` searches, least recompute first (NOTE [the job search])."""
    out = [Policy(engine=engine)]
    if job.model.attention == "math":
        out.append(Policy("selective", modules=("core_attn",), engine=engine))
    out += [Policy("full", "block", k, engine=engine) for k in range(1, job.layers_per_chunk + 1)]
    return out


def plan_job(job: Job, budget: int | str, options: PlanOptions | None = None) -> JobPlan:
    """The least-recompute Megatron setting of every pipeline stage of ``job`` whose rank fits ``budget``.

    Args:
        job: the training job; its own policy is ignored (the plan chooses it).
        budget: one GPU's memory: bytes, or text as :func:`remat.plan.plan` takes (``'70GiB'``, ``'h100-80g'``
            minus ``options.reserve``).
        options: the engine, device and reserve used (:class:`PlanOptions`); the other options price the extended
            search, which a job plan does not run (NOTE [the job search]).

    Returns:
        A :class:`JobPlan`. A stage whose model state alone exceeds the budget is not traced: nothing fits it.

    Example:
        >>> from remat.config import ModelConfig
        >>> job = Job.build(ModelConfig(num_layers=4, attention="sdpa"), precision="bf16", pp=2, num_microbatches=4)
        >>> plan_job(job, "1GiB").fits
        True
    """
    options = PlanOptions() if options is None else options
    budget_bytes, budget_text = options.budget(budget)
    check_job(job)
    settings = job_settings(job, options.engine)
    states = [stage_state(job, stage) for stage in range(job.pp)]
    if any(state.total > budget_bytes for state in states):  # no setting can help: trace nothing
        return JobPlan(job, budget_bytes, budget_text, [JobStagePlan(i, st, None, None) for i, st in enumerate(states)])
    stages = [_plan_stage(job, stage, states[stage], settings, budget_bytes, options.device)
              for stage in range(job.pp)]
    result = JobPlan(job, budget_bytes, budget_text, stages)
    if not all(s.fits for s in stages):
        return result
    # one setting for every stage: the one of the stage that needs the most recompute, checked on every stage
    index = max(settings.index(s.policy) for s in stages)
    for policy in settings[index:]:
        ranks = []
        for s in stages:
            known = s.prediction if s.policy == policy else None
            ranks.append(known or predict_stage(job.replace(policy=policy), s.stage, device=options.device))
        if all(r.peak_bytes <= budget_bytes for r in ranks):
            result.uniform, result.uniform_ranks = policy, sorted(ranks, key=lambda r: (-r.peak_bytes, r.stage))
            break
    return result


def _plan_stage(job: Job, stage: int, state: RankState, settings: list[Policy], budget: int,
                device: str) -> JobStagePlan:
    out = JobStagePlan(stage, state, None, None)
    cache: dict[int, RankPrediction] = {}

    def peak(i: int) -> int:
        if i not in cache:
            cache[i] = predict_stage(job.replace(policy=settings[i]), stage, device=device)
            out.tried[str(settings[i])] = cache[i].peak_bytes
        return cache[i].peak_bytes

    blocks = [i for i, p in enumerate(settings) if p.method == "block"]
    chosen = next((i for i in range(blocks[0]) if peak(i) <= budget), None)
    if chosen is None and peak(blocks[-1]) <= budget:
        lo, hi = blocks[0], blocks[-1]  # hi fits; find the smallest block setting that fits
        while lo < hi:
            mid = (lo + hi) // 2
            if peak(mid) <= budget:
                hi = mid
            else:
                lo = mid + 1
        chosen = hi
    if chosen is None:
        lowest = min(cache, key=lambda i: cache[i].peak_bytes)
        out.prediction = cache[lowest]
        return out
    out.policy, out.prediction = settings[chosen], cache[chosen]
    return out


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
