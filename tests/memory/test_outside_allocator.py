"""Library buffers outside PyTorch's allocator: carried by every rank's prediction, printed, taken off a plan's
budget."""

from __future__ import annotations

import pytest

from remat.analysis.job_report import format_job_prediction, rank_row
from remat.config import ModelConfig
from remat.job import Job
from remat.memory.outside_allocator import OutsideBuffer
from remat.parallel import job_predict
from remat.plan import job_plan
from remat.recompute.plan_format import PlanError

BUFFER = OutsideBuffer("test buffers", 3 << 20, "test.py:1")


def _job() -> Job:
    return Job.build(ModelConfig(num_layers=4, attention="sdpa"), precision="bf16", pp=2, num_microbatches=4)


def test_a_plain_job_holds_nothing_outside_the_allocator():
    job = _job()
    assert job_predict.outside_allocator_buffers(job, 0) == () == job_predict.predict_job(job).worst.outside


def test_outside_buffers_are_reported_beside_the_peak(monkeypatch):
    monkeypatch.setattr(job_predict, "outside_allocator_buffers", lambda job, stage: (BUFFER,))
    prediction = job_predict.predict_job(_job())
    worst = prediction.worst
    assert worst.outside_bytes == 3 << 20
    assert worst.peak_bytes == worst.timeline.peak_bytes  # the allocator's figures leave them out
    text = format_job_prediction(prediction, "none")
    assert "outside PyTorch's allocator" in text and "test buffers 3.00 MiB (test.py:1)" in text
    assert rank_row(worst)["outside_allocator"] == [{"name": "test buffers", "bytes": 3 << 20, "source": "test.py:1"}]


def test_a_plan_budgets_what_the_allocator_may_use(monkeypatch):
    job = _job()
    plain = job_plan.plan_job(job, 1 << 30)
    monkeypatch.setattr(job_plan, "outside_allocator_buffers", lambda job, stage: (BUFFER,))
    planned = job_plan.plan_job(job, 1 << 30)
    assert planned.budget_bytes == plain.budget_bytes - (3 << 20)
    assert "minus 3.00 MiB of library buffers outside PyTorch's allocator" in planned.budget_text
    assert job_plan.plan_job(job, 1 << 30, outside_counted=True).budget_bytes == plain.budget_bytes
    with pytest.raises(PlanError, match="outside PyTorch's allocator alone take 3.00 MiB; give a larger --budget"):
        job_plan.plan_job(job, 2 << 20)
