"""``remat plan --budget-reserved``: the chosen plan's replayed reserved memory fits the budget."""

from __future__ import annotations

import pytest

from remat.config import ModelConfig
from remat.memory.predict import predict_config
from remat.memory.reserved import reserved_figures
from remat.plan.reserved import plan_reserved

CONFIG = ModelConfig(num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=256, micro_batch_size=4,
                     vocab_size=512, dtype="bf16")


def test_plan_reserved_fits_reserved_memory_where_plain_planning_would_not() -> None:
    plain = reserved_figures(predict_config(CONFIG, "none", device="cuda"))
    budget = plain["max_memory_reserved"] - 1  # the plain step's segments do not fit
    result, figures = plan_reserved(CONFIG, budget)
    assert figures["max_memory_reserved"] <= budget
    assert result.budget_bytes == budget
    assert result.extended.peak_bytes <= figures["allocated_budget_bytes"] <= budget


def test_plan_reserved_refuses_pipelines() -> None:
    from remat.plan.options import ParallelOptions

    with pytest.raises(ValueError, match="--budget-reserved .* --pp"):
        plan_reserved(CONFIG, "1GiB", parallel=ParallelOptions(pp=2))
