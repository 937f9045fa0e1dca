"""Measuring tensor-parallel ranks for real: one gloo process per rank."""

from __future__ import annotations

from collections.abc import Sequence
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
    if isinstance(policy, Plan):  # a plan travels as JSON, a policy as its text
        return _launch(config, [str(policy)], policy.to_dict(), tp, sp, timeout, seed)[0]
    return measure_tensor_parallel_many(config, [policy], tp, sp, timeout, seed)[0]


def measure_tensor_parallel_many(config: ModelConfig, policies: Sequence[Policy | str], tp: int, sp: bool = False,
                                 timeout: float = DEFAULT_TIMEOUT, seed: int = 0) -> list[list[Timeline]]:
    """:func:`measure_tensor_parallel` for several policies in one launch: one list of rank timelines per policy,
    in order (each rank builds its model afresh, with the same ``seed``, for every policy); ``timeout`` bounds the
    whole launch."""
    texts = [str(Policy.parse(p) if isinstance(p, str) else p) for p in policies]
    if not texts:
        raise ValueError("no policy to measure: give at least one, e.g. 'none'")
    return _launch(config, texts, None, tp, sp, timeout, seed)


def _launch(config: ModelConfig, texts: list[str], plan: dict[str, Any] | None, tp: int, sp: bool, timeout: float,
            seed: int) -> list[list[Timeline]]:
    check_tensor_parallel(config, tp, sp)
    job = {"kind": "tensor_parallel", "config": config.to_dict(), "policies": texts, "plan": plan,
           "world": tp, "sp": sp, "device": "cpu", "seed": seed, "fault": None, "timeout": float(timeout)}
    results = launch_job(job, tp, timeout)
    return [[Timeline.from_dict(results[rank][i]) for rank in range(tp)] for i in range(len(texts))]
