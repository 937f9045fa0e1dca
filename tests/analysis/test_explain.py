"""Tests for remat.analysis.explain and remat.analysis.report (tiny models, a few seconds); the ``remat explain``
command line is tests/cli/test_explain_cli.py's."""

from __future__ import annotations

import json

import pytest
import torch

from remat import ModelConfig, Policy, PolicyError, apply, build_model, measure, sample_batch
from remat.analysis.explain import default_policies, explain, resolve_policies
from remat.analysis.report import format_table, write_json

MIB = 1 << 20


def tiny(**changes) -> ModelConfig:
    return ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=64, micro_batch_size=4,
                       **changes)


@pytest.fixture(scope="module")
def big_vocab():
    # The head/loss part (logits, log-softmax, their gradients: 3 x 8 MiB) dwarfs 4 small layers' activations.
    return explain(tiny(vocab_size=8192), ["none", "full/uniform/1", "full/uniform/2", "full/uniform/4"], repeats=0)


@pytest.fixture(scope="module")
def small_vocab():
    return explain(tiny(vocab_size=64), ["none", "full/uniform/4"])  # untimed by default


# ------------------------------------------------------------------------------------------------ explain
def test_default_policies():
    assert default_policies(8) == ["none", "full/uniform/1", "full/uniform/2", "full/uniform/4", "full/uniform/8",
                                   "full/block/2", "full/block/4", "selective/core_attn", "selective/core_attn+mlp"]
    six = default_policies(6)
    assert "full/uniform/6" in six and "full/uniform/8" not in six and "full/block/1" in six
    assert "full/block/0" not in default_policies(2)


def test_resolve_policies_puts_none_first_and_dedupes():
    got = resolve_policies(["full/uniform/2", "full/uniform/2", "none@non-reentrant"], 4, engine="non-reentrant")
    assert [str(p) for p in got] == ["none@non-reentrant", "full/uniform/2@non-reentrant"]
    got = resolve_policies(["full/uniform/2@reentrant", Policy.parse("selective")], 4, engine="non-reentrant")
    assert [str(p) for p in got] == ["none", "full/uniform/2", "selective/core_attn"]
    with pytest.raises(PolicyError, match="4 layers"):
        resolve_policies(["full/block/5"], 4)
    with pytest.raises(PolicyError):
        resolve_policies([], 4)


def test_formula_holds(big_vocab):
    formula = {f.policy: f for f in big_vocab.formula}
    assert set(formula) == {"full/uniform/1", "full/uniform/2", "full/uniform/4"}
    for f in formula.values():
        assert abs(f.error) < 0.02, f
        assert f.predicted_bytes == f.stored_group_inputs + f.group_activation_bytes
        assert f.group_layers[-1] == 3  # the last group is recomputed first
    # Bigger groups store fewer inputs but rebuild more at once.
    assert formula["full/uniform/1"].stored_group_inputs > formula["full/uniform/4"].stored_group_inputs
    assert formula["full/uniform/1"].measured_bytes < formula["full/uniform/4"].measured_bytes


def test_rows_are_consistent(big_vocab):
    none = big_vocab.row("none")
    assert none.recompute_max_bytes == 0 and none.group_inputs_stored == 0 and none.extra_forward_pct == 0
    whole = big_vocab.row("full/uniform/4")
    # Full recompute re-runs every layer's forward: the layers' share of the step's FLOPs, a third of it
    # for the layers (forward = 1/3 of forward+backward) minus the head's share.
    assert 0 < whole.extra_forward_pct < 34
    assert whole.recompute_max_bytes > big_vocab.row("full/uniform/1").recompute_max_bytes
    assert whole.step_seconds is None and whole.step_ratio is None  # repeats=0
    for row in big_vocab.rows:
        assert row.peak_bytes == big_vocab.timelines[row.policy].peak_bytes
    report = json.loads(json.dumps(big_vocab.to_dict()))
    assert [r["policy"] for r in report["rows"]] == ["none", "full/uniform/1", "full/uniform/2", "full/uniform/4"]


def test_whole_stack_saves_with_large_vocabulary(big_vocab):
    none, whole = big_vocab.row("none"), big_vocab.row("full/uniform/4")
    assert whole.peak_bytes < none.peak_bytes
    assert none.peak_phase == "backward head"
    text = " ".join(big_vocab.sentences)
    verdict = next(s for s in big_vocab.sentences if "whole-stack group" in s and "memory" in s)
    assert "saves memory" in verdict and "does not" not in verdict
    assert "logits" in verdict and "8.00 MiB" in verdict  # b x s x vocab x 4 bytes = 4 x 64 x 8192 x 4
    assert "pipeline" in text


def test_whole_stack_does_not_save_with_tiny_vocabulary(small_vocab):
    verdict = next(s for s in small_vocab.sentences if "whole-stack group" in s and "memory" in s)
    assert "does not save memory" in verdict
    assert small_vocab.row("full/uniform/4").peak_bytes >= 0.99 * small_vocab.row("none").peak_bytes


def test_the_short_answer_comes_before_the_other_policies():
    # none and the full/uniform policies first (in the order given), then the contrast run's none and whole-stack
    # group: the short answer rests on those alone; then the rest and the timed steps. Rows keep the order given.
    config = tiny(vocab_size=64).replace(num_layers=2)
    policies = ["selective/core_attn", "full/uniform/2", "full/block/1", "full/uniform/1"]
    events: list = []
    result = explain(config, policies, repeats=1, contrast_vocab=4096,
                     progress=lambda i, n, what: events.append(what), answer=events.append)
    at = next(i for i, event in enumerate(events) if isinstance(event, list))
    assert events[at] == result.short_answer and result.short_answer[0].startswith("In short")
    assert sum(isinstance(event, list) for event in events) == 1
    assert events[:at] == ["measure none", "measure full/uniform/2", "measure full/uniform/1",
                           "measure none (vocab 4096)", "measure full/uniform/2 (vocab 4096)"]
    assert events[at + 1:at + 4] == ["measure full/uniform/1 (vocab 4096)", "measure selective/core_attn",
                                     "measure full/block/1"]
    assert all(event.startswith("time ") for event in events[at + 4:-1]) and events[-1] == ""
    assert [r.policy for r in result.contrast.rows] == ["none", "full/uniform/1", "full/uniform/2"]
    assert [r.policy for r in result.rows] == ["none", *policies]
    assert list(result.timelines) == ["none", *policies]
    # each policy's step is measured on a fresh model whatever the order: the same timeline as measured alone
    for policy in ("selective/core_attn", "full/uniform/1"):
        model = build_model(config, seed=0)
        apply(model, policy)
        torch.manual_seed(0)
        alone, tl = measure(model, sample_batch(config, seed=0)), result.timelines[policy]
        assert (alone.nbytes, alone.alloc_at, alone.free_at, alone.category, alone.module) == \
            (tl.nbytes, tl.alloc_at, tl.free_at, tl.category, tl.module)


def test_explain_times_the_policies_only_when_asked(small_vocab):
    assert all(row.step_seconds is None and row.step_times == [] for row in small_vocab.rows)
    assert small_vocab.meta["repeats"] == 0
    timed = explain(tiny(vocab_size=64).replace(num_layers=1), ["none"], repeats=2)
    assert len(timed.rows[0].step_times) == 2 and timed.rows[0].step_ratio == 1.0


# ------------------------------------------------------------------------------------------------ report
def test_format_table_aligns_and_uses_mib():
    rows = [{"policy": "none", "peak_bytes": 1.5 * MIB, "peak_phase": "backward head", "step_ratio": 1.0},
            {"policy": "full/uniform/12", "peak_bytes": 1234.56 * MIB, "peak_phase": "backward layer 0"}]
    lines = format_table(rows).splitlines()
    assert len(lines) == 4
    assert "1.5" in lines[2] and "1234.6" in lines[3] and "1.00x" in lines[2]
    peak_col = lines[0].index("peak MiB") + len("peak MiB")
    assert lines[2][:peak_col].endswith("1.5") and lines[3][:peak_col].endswith("1234.6")  # right-aligned


def test_write_json_atomic(tmp_path):
    path = write_json(tmp_path / "sub" / "x.json", {"a": [1, 2]})
    assert json.loads(path.read_text()) == {"a": [1, 2]}
    assert [p.name for p in path.parent.iterdir()] == ["x.json"]
