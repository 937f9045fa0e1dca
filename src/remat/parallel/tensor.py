"""Measuring tensor-parallel ranks for real: one gloo process per rank."""

from __future__ import annotations

from typing import Any

from remat.config import ModelConfig
from remat.memory.measure import measure
from remat.models.gpt import sample_batch
from remat.models.tensor_parallel import DistributedGroup, build_tp_model, check_tensor_parallel
from remat.parallel.launch import DEFAULT_TIMEOUT, launch_job
from remat.policy import Policy
from remat.recompute.apply import apply
from remat.recompute.plan_format import Plan
from remat.timeline import Timeline


def measure_tensor_parallel_rank(job: dict[str, Any], policy_text: str, rank: int) -> Timeline:
    """One rank of :func:`remat.parallel.tensor.measure_tensor_parallel`: its share of the model, one measured step."""

    config = ModelConfig.from_dict(job["config"])
    model = build_tp_model(config, DistributedGroup(), job["sp"], seed=job["seed"])
    if job.get("plan") is not None:

        apply(model, Plan.from_dict(job["plan"]))
    else:
        apply(model, policy_text)
    timeline = measure(model, sample_batch(config))
    timeline.meta.update({"tp": job["world"], "sp": job["sp"], "rank": rank})
    return timeline


def measure_tensor_parallel(config: ModelConfig, policy: Any, tp: int, sp: bool = False,
                            timeout: float = DEFAULT_TIMEOUT, seed: int = 0) -> list[Any]:
    """Measure one training step on ``tp`` real tensor-parallel ranks (gloo on CPU, one process each, every
    process ended before this returns); one Timeline per rank. ``policy``: a :class:`~remat.policy.Policy`, its
    text, or a :class:`remat.plan.Plan`."""

    check_tensor_parallel(config, tp, sp)
    plan = policy.to_dict() if isinstance(policy, Plan) else None  # a plan travels as JSON, a policy as its text
    policy_text = str(Policy.parse(policy) if isinstance(policy, str) else policy)
    job = {"kind": "tensor_parallel", "config": config.to_dict(), "policies": [policy_text], "plan": plan,
           "world": tp, "sp": sp, "device": "cpu", "seed": seed, "fault": None, "timeout": float(timeout)}
    return [Timeline.from_dict(results[0]) for results in launch_job(job, tp, timeout)]
