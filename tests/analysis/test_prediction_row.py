"""Tests for remat.analysis.prediction.prediction_row: the row's peak, its phase and what is alive there are the
timeline's own peak_bytes, peak_phase and at_peak (read from one live curve)."""

from __future__ import annotations

import pytest

from remat.analysis.prediction import prediction_row
from remat.config import ModelConfig
from remat.memory.predict import predict_config
from remat.policy import Policy


@pytest.mark.parametrize("text", ["none", "full/uniform/2", "selective/core_attn"])
def test_row_peak_parts_are_the_timelines(text: str) -> None:
    config = ModelConfig(num_layers=6, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=64)
    timeline = predict_config(config, text)
    row = prediction_row(Policy.parse(text), timeline)
    assert row["peak_bytes"] == timeline.peak_bytes
    assert row["peak_phase"] == timeline.peak_phase.label
    assert row["at_peak"] == timeline.at_peak
    assert sum(row["at_peak"].values()) == row["peak_bytes"]

