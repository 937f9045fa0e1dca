"""Tests for prepare_shallow_traces(on_composed=...): each policy whose shallow trace is made is composed as soon as
that trace arrives (while the others are still traced), and that timeline is the one predict_config gives for it
once every trace is made: the same stand-in, the same bytes, row for row."""

from __future__ import annotations

import os

import pytest

from remat.config import ModelConfig
from remat.memory import predict as predict_module
from remat.memory.comparison import predict_policies
from remat.memory.predict import predict_config, prepare_shallow_traces
from remat.memory.trace_pool import WORKERS_ENV
from remat.policy import Policy
from remat.timeline import Timeline

CONFIG = ModelConfig(num_layers=10, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=64)
POLICIES = [Policy.parse(t) for t in ("none", "full/uniform/1", "full/uniform/3", "full/uniform/4", "full/block/4",
                                      "selective/core_attn", "full/uniform/10")]


@pytest.mark.parametrize("workers", ["1", "2"])
def test_early_compositions_are_predict_configs(monkeypatch: pytest.MonkeyPatch, workers: str) -> None:
    monkeypatch.setenv(WORKERS_ENV, workers)
    monkeypatch.setattr(predict_module, "SHALLOW_TRACES", {})  # every stand-in traced here
    early: dict[int, Timeline] = {}
    traced = prepare_shallow_traces(CONFIG, POLICIES, on_composed=lambda i, tl, _: early.__setitem__(i, tl))
    assert traced > 0 and sorted(early) == list(range(len(POLICIES)))  # each composed once its trace was made
    for i, policy in enumerate(POLICIES):
        assert early[i].to_dict() == predict_config(CONFIG, policy).to_dict(), str(policy)
    # predict_policies, its traces made afresh, hands the early timelines over in order
    monkeypatch.setattr(predict_module, "SHALLOW_TRACES", {})
    got = predict_policies(CONFIG, POLICIES)
    assert [tl.to_dict() for tl, _ in got] == [predict_config(CONFIG, p).to_dict() for p in POLICIES]


@pytest.mark.parametrize("workers", ["1", "2"])
def test_summaries_are_made_where_the_traces_are(monkeypatch: pytest.MonkeyPatch, workers: str) -> None:
    """predict_policies(summarize=...): each policy composed beside the traces is summarized in the process that
    traced its stand-in (with 2 workers, not this one), and on_predicted gets the summary of the same timeline
    predict_config gives; only the kept timelines come back."""
    monkeypatch.setenv(WORKERS_ENV, workers)
    monkeypatch.setattr(predict_module, "SHALLOW_TRACES", {})
    here = os.getpid()

    def summarize(i: int, timeline: Timeline, seconds: float) -> tuple[int, int, int, int]:
        return i, timeline.peak_bytes, len(timeline), os.getpid()

    got: dict[int, tuple[int, int, int, int]] = {}
    out = predict_policies(CONFIG, POLICIES, summarize=summarize, on_predicted=lambda i, s, _: got.__setitem__(i, s),
                           keep=lambda i: POLICIES[i].is_none)
    assert sorted(got) == list(range(len(POLICIES)))
    for i, policy in enumerate(POLICIES):
        expected = predict_config(CONFIG, policy)
        assert got[i][:3] == (i, expected.peak_bytes, len(expected)), str(policy)
        assert (out[i][0] is None) != policy.is_none
    assert out[0][0].to_dict() == predict_config(CONFIG, "none").to_dict()
    made_here = sum(pid == here for *_, pid in got.values())
    assert made_here == (len(POLICIES) if workers == "1" else 0)
