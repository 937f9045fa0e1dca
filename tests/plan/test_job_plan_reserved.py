"""Planning a whole job against reserved memory (remat.plan.job_reserved, NOTE [a job's reserved budget]): the
plan's every rank replayed through the caching allocator, planned again while its reserved memory exceeds the
budget."""

from __future__ import annotations

import pytest

from remat.analysis.job_report import format_job_plan
from remat.config import ModelConfig
from remat.job import Job
from remat.parallel.job_predict import predict_job
from remat.plan.job_plan import plan_job
from remat.plan.job_reserved import add_plan_reserved, plan_job_reserved
from remat.plan.options import PlanOptions
from remat.units import MIB

# activations of a few MiB each: what a plan recomputes changes the allocator's segments
CONFIG = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=512, micro_batch_size=2,
                     vocab_size=256, attention="sdpa", dtype="bf16")
JOB = Job.build(CONFIG, precision="bf16", pp=2, num_microbatches=4)
OPTIONS = PlanOptions(operator_sets=0, offload=False)


@pytest.fixture(scope="module")
def budget() -> int:
    """1 MiB under the reserved memory of the worst rank with nothing recomputed (its allocated peak fits)."""
    worst = predict_job(JOB).worst
    budget = worst.reserved["max_memory_reserved"] - MIB
    assert worst.peak_bytes < budget
    return budget


def test_a_plan_of_allocated_bytes_alone_can_exceed_the_gpu(budget):
    result = plan_job(JOB, budget, OPTIONS)
    add_plan_reserved(result)
    assert result.fits and result.stats["memory_budgeted"]["memory"] == "allocated"
    assert max(r.reserved["max_memory_reserved"] for r in result.ranks()) > budget  # fits allocated, not reserved


def test_the_reserved_budget_plans_again_until_every_ranks_reserved_memory_fits(budget):
    result = plan_job_reserved(JOB, budget, OPTIONS)
    budgeted = result.stats["memory_budgeted"]
    assert result.fits and result.budget_bytes == budget
    assert budgeted["memory"] == "reserved" and budgeted["rounds"] >= 2 and budgeted["allocated_budget_bytes"] < budget
    shown = [*result.ranks(), *result.uniform_ranks, *(s.megatron.prediction for s in result.stages)]
    assert shown and all(r.reserved["max_memory_reserved"] <= budget for r in shown)
    assert any(s.extended.cost > 0 for s in result.stages)  # something is recomputed to fit
    report = result.to_dict()
    assert all(row["reserved"]["max_memory_reserved"] <= budget for row in report["stages"])
    assert "budgeted: reserved memory" in format_job_plan(result).splitlines()[0]


def test_a_budget_no_rank_can_reserve_within_is_not_reported_as_fitting(budget):
    # the GEMM workspaces and the model state alone take more segments than this
    result = plan_job_reserved(JOB, 66 * MIB, OPTIONS)
    assert not result.fits
    assert all(r.reserved["max_memory_reserved"] > 66 * MIB for s in result.stages if (r := s.prediction))
