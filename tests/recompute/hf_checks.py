"""Checks shared by the Hugging Face tests: one training step's loss and gradients, and two timelines equal row for
row."""

from __future__ import annotations

from typing import Any

import torch


def train_step(model: torch.nn.Module, batch: dict[str, Any], seed: int = 5) -> tuple[torch.Tensor, dict]:
    """The loss and every parameter's gradient of one step on ``batch`` (dropout seeded with ``seed``)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(**batch)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def assert_same_timeline(predicted: Any, measured: Any) -> None:
    """Every allocation row, every phase and the peak equal."""
    for column in ("nbytes", "alloc_at", "free_at", "phase_index", "module", "category"):
        assert list(getattr(predicted, column)) == list(getattr(measured, column)), column
    assert predicted.phases == measured.phases
    assert predicted.peak_bytes == measured.peak_bytes
