"""remat.parallel.pipeline_peaks: per-stage peaks of long steps, extended from short ones, equal the full
composition (see NOTE [Periodic pipeline steps])."""

from __future__ import annotations

import pytest

import remat.parallel.pipeline_peaks as pipeline_peaks
from remat.config import ModelConfig
from remat.parallel.pipeline_peaks import stage_peaks
from remat.parallel.pipeline_predict import MAX_COMPOSED_MICROBATCHES, predict_pipeline
from remat.parallel.pipeline_report import stage_summary
from remat.parallel.schedule import PipelineError

SMALL = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, micro_batch_size=2,
                    vocab_size=128)
# b * s * 8 = 24 bytes of token ids per microbatch: the whole batch's 512-byte blocks repeat every 64 microbatches
ODD = SMALL.replace(seq_length=3, micro_batch_size=1)
KEYS = ("peak_bytes", "peak_phase", "max_in_flight", "in_flight_at_peak", "saved_bytes_at_peak",
        "kept_bytes_at_peak")


@pytest.mark.parametrize("schedule,vpp,m,partial,runtime,device,config", [
    ("1f1b", 1, 13, None, "torch", "cpu", SMALL),
    ("1f1b", 1, 14, None, "megatron", "cpu", SMALL),
    ("gpipe", 1, 11, None, "torch", "cpu", SMALL),
    ("gpipe", 1, 12, None, "megatron", "cuda", SMALL),
    ("interleaved", 2, 26, None, "torch", "cpu", SMALL),
    ("interleaved", 2, 24, None, "megatron", "cpu", SMALL),
    ("1f1b", 1, 23, 1, "torch", "cpu", SMALL),
    ("interleaved", 2, 62, 1, "megatron", "cpu", SMALL),
    ("1f1b", 1, 330, None, "torch", "cuda", ODD),
], ids=lambda v: str(v) if not isinstance(v, ModelConfig) else "")
def test_extended_peaks_equal_the_full_composition(monkeypatch, schedule, vpp, m, partial, runtime, device, config):
    monkeypatch.setattr(pipeline_peaks, "EXACT_MICROBATCHES", 0)  # extend whatever can be extended
    extended = stage_peaks(config, "full/uniform/1", 2, m, schedule, vpp, partial_checkpoint_microbatches=partial,
                           runtime=runtime, device=device)
    exact = predict_pipeline(config, "full/uniform/1", 2, m, schedule, vpp, partial_checkpoint_microbatches=partial,
                             runtime=runtime, device=device)
    assert all("extended_from" in row and max(row["extended_from"]) < m for row in extended)
    for row, tl in zip(extended, exact):
        summary = stage_summary(tl)
        assert {k: row[k] for k in KEYS} == {k: summary[k] for k in KEYS}


def test_a_million_microbatches_cost_what_a_few_do():
    rows = stage_peaks(SMALL, "full/uniform/1", 2, 1_000_000, "gpipe", runtime="megatron")
    short = stage_peaks(SMALL, "full/uniform/1", 2, 40, "gpipe", runtime="megatron")
    assert rows[0]["microbatches"] == 1_000_000  # GPipe holds every microbatch but the one in backward
    assert rows[0]["in_flight_at_peak"] == short[0]["in_flight_at_peak"] + 1_000_000 - 40 == 999_999
    per_microbatch = (short[0]["peak_bytes"] - stage_peaks(SMALL, "full/uniform/1", 2, 39, "gpipe",
                                                            runtime="megatron")[0]["peak_bytes"])
    assert rows[0]["peak_bytes"] == short[0]["peak_bytes"] + (1_000_000 - 40) * per_microbatch
    assert "Extended from the composed steps" in rows[0]["why"]


def test_full_timelines_are_bounded():
    with pytest.raises(PipelineError, match=f"at most {MAX_COMPOSED_MICROBATCHES} microbatches.*stage_peaks"):
        predict_pipeline(SMALL, "none", 2, MAX_COMPOSED_MICROBATCHES + 1)
