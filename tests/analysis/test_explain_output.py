"""``remat explain``'s answer and files: the short answer first, both vocabulary regimes, the phase-axis plot, the
run folder swapped in whole, output paths and the memory check (tiny models, a few seconds each); the command line
itself is tests/cli/test_explain_cli.py's."""

from __future__ import annotations

import json

import numpy as np
import pytest

from remat.analysis.explain import explain
from remat.analysis.outputs import RunFolder, foreign_entries, path_problem
from remat.analysis.report import format_explanation
from remat.analysis.timeline_plot import phase_axis, phase_segments, plot_timelines
from remat.config import ModelConfig
from remat.memory.comparison import MemoryCheckError, check_fits
from remat.units import format_bytes

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def both_regimes():
    config = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=64, micro_batch_size=4,
                         vocab_size=64)
    return explain(config, ["none", "full/uniform/1", "full/uniform/4"], repeats=0, contrast_vocab=8192)


# ------------------------------------------------------------------------------------------------ the answer
def test_report_opens_with_the_short_answer(both_regimes):
    text = format_explanation(both_regimes)
    lines = text.splitlines()
    assert lines[0].startswith("In short (4-layer GPT, h=64, s=64, b=4, fp32")
    head = "\n".join(lines[:lines.index("In detail:")]).replace("\n  ", " ")  # undo the wrapping
    # the formula, with its measured error; where the saving comes from; both regimes' numbers; pipelines
    worst = max(both_regimes.formula, key=lambda f: abs(f.error))
    assert "Your formula holds" in head and f"{100 * worst.error:+.2f}%" in head
    assert "max(head, stack)" in head
    small, large = both_regimes.regimes()
    assert (small.vocab_size, large.vocab_size) == (64, 8192)
    assert f"vocab 64: head/loss {format_bytes(small.head_loss_bytes)}" in head and "(no saving)" in head
    saving = 100 * large.saving_bytes / large.none_peak_bytes
    assert saving > 10 and f"({-saving:.1f}%)" in head
    assert "--pp" in head
    assert len(both_regimes.short_answer) <= 6
    # then the detail, as before: the table and the sentences
    assert "peak MiB" in text[text.index("In detail:"):] and both_regimes.sentences[0][:30] in text


def test_contrast_regime_is_measured(both_regimes):
    contrast = both_regimes.contrast
    assert contrast.config.vocab_size == 8192 and contrast.config.replace(vocab_size=64) == both_regimes.config
    assert [r.policy for r in contrast.rows] == ["none", "full/uniform/1", "full/uniform/4"]
    none, whole = contrast.rows[0], contrast.rows[-1]
    assert contrast.regime.saving_bytes == none.peak_bytes - whole.peak_bytes > 0
    assert none.peak_phase == "backward head"  # the logits' gradient on top of every layer's activations
    assert contrast.regime.head_loss_bytes > contrast.regime.stack_activation_bytes
    for row in contrast.rows:
        assert row.peak_bytes == contrast.timelines[row.policy].peak_bytes and row.step_seconds is None
    assert any("vocab=8192 (measured too" in s for s in both_regimes.sentences)


def test_json_keeps_its_fields_and_adds_the_answer(both_regimes):
    report = json.loads(json.dumps(both_regimes.to_dict()))
    assert {"format", "version", "config", "policies", "rows", "formula", "sentences", "meta"} <= set(report)
    assert report["short_answer"] == both_regimes.short_answer
    assert report["regime"]["vocab_size"] == 64 and report["contrast"]["config"]["vocab_size"] == 8192
    assert report["contrast"]["regime"]["saving_bytes"] == both_regimes.contrast.regime.saving_bytes


# ------------------------------------------------------------------------------------------------ the plot
def test_phase_axis_gives_each_phase_a_unit(both_regimes):
    tl = both_regimes.timelines["full/uniform/4"]
    segments = phase_segments(tl)
    assert [s.label for s in segments] == ["emb", "F0", "F1", "F2", "F3", "head", "B head", "R0", "R1", "R2", "R3",
                                           "B3", "B2", "B1", "B0", "emb B"]
    assert [s.x for s in segments] == list(range(len(segments)))
    assert {s.band for s in segments[7:11]} == {"recompute"} and segments[6].phase == "backward head"
    x, y, _ = phase_axis(tl)
    assert np.all(np.diff(x) > 0) and len(x) == tl.num_events - segments[0].start
    peak = int(np.argmax(y))
    inside = next(s for s in segments if s.x <= x[peak] < s.x + 1)
    assert inside.phase == tl.peak_phase.label and y[peak] * (1 << 20) == tl.peak_bytes
    # the head's backward has few events, but a whole unit on the axis
    none = phase_segments(both_regimes.contrast.timelines["none"])
    head = next(s for s in none if s.label == "B head")
    assert head.end - head.start < 0.05 * sum(s.end - s.start for s in none)


def test_plot_has_one_panel_per_policy_and_one_peak_marker(both_regimes, tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    saved = []
    real_savefig = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (saved.append(fig), real_savefig(fig, *a, **k)))
    path = plot_timelines(both_regimes.timelines, tmp_path / "t.png", title="t")
    assert path.read_bytes()[:8] == PNG_MAGIC
    axes = saved[0].axes
    assert len(axes) == len(both_regimes.timelines)
    for ax, (name, tl) in zip(axes, both_regimes.timelines.items()):
        markers = [line for line in ax.lines if line.get_marker() == "v"]
        assert len(markers) == 1  # the peak, marked once
        assert markers[0].get_ydata()[0] * (1 << 20) == tl.peak_bytes
        assert [t.get_text() for t in ax.get_xticklabels()] == [s.label for s in phase_segments(tl)]
        assert any(t.get_text() == name for t in ax.texts)


# ------------------------------------------------------------------------------------------------ the run folder


def test_path_problem_and_foreign_entries(tmp_path):
    (tmp_path / "f").write_text("")
    assert path_problem(tmp_path / "new" / "deeper" / "x.html") is None
    assert path_problem(tmp_path / "f" / "x.html") == f"{tmp_path / 'f'} is a file, not a folder"
    assert path_problem(tmp_path / "f", folder=True) == "is a file, not a folder"
    assert path_problem(tmp_path, folder=False) == "is a folder: give a file name"
    for name in ("explain.json", "timelines.png", "timeline-none.json", ".explain.json.abc.tmp"):
        (tmp_path / name).write_text("")
    assert foreign_entries(tmp_path) == ["f"] and foreign_entries(tmp_path, ["f"]) == []


def test_run_folder_commit_and_discard(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "old.json").write_text("old")
    with RunFolder(target) as run:
        run.path("new.json").write_text("new")
        outside = run.outside(tmp_path / "page.html")
        outside.write_text("page")
        assert not (tmp_path / "page.html").exists() and (target / "old.json").exists()
    # left without commit: nothing changed, nothing left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and [p.name for p in target.iterdir()] == ["old.json"]
    with RunFolder(target) as run:
        run.path("new.json").write_text("new")
        run.outside(tmp_path / "page.html").write_text("page")
        run.outside(target / "inside.html").write_text("inside")
        run.commit()
    assert sorted(p.name for p in target.iterdir()) == ["inside.html", "new.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "page.html"]


# ------------------------------------------------------------------------------------------------ memory


def test_check_fits():
    check_fits(1, "cpu")
    with pytest.raises(MemoryCheckError, match="needs about 1048576.00 GiB") as caught:
        check_fits(1 << 50, "cpu", fix="use less")
    assert caught.value.need == 1 << 50 and str(caught.value).endswith(": use less")
