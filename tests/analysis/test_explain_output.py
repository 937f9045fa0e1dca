"""``remat explain``'s answer and files: the short answer first, both vocabulary regimes, the phase-axis plot, the
run folder swapped in whole, paths and memory checked before anything runs (tiny models, a few seconds each)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import remat.analysis.capacity as capacity
import remat.cli.explain as cli_explain
from remat.analysis.capacity import MemoryCheckError, check_fits
from remat.analysis.explain import explain
from remat.analysis.outputs import RunFolder, foreign_entries, path_problem
from remat.analysis.report import format_explanation
from remat.analysis.timeline_plot import phase_axis, phase_segments, plot_timelines
from remat.cli import build_parser, main
from remat.config import ModelConfig
from remat.policy import Policy
from remat.units import format_bytes

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TINY = ["--layers", "4", "--hidden", "64", "--heads", "4", "--seq", "32", "--batch", "2", "--vocab", "128"]
QUICK = [*TINY, "--policies", "none,full/uniform/4", "--repeats", "0", "--no-plot", "--contrast-vocab", "0"]


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


def test_default_cli_shows_both_regimes(tmp_path, capsys):
    assert build_parser().parse_args(["explain"]).contrast_vocab == 32000
    assert ModelConfig().vocab_size == 512  # --vocab keeps its meaning: the main run's vocabulary
    out = tmp_path / "out"
    assert main(["explain", *TINY, "--policies", "none,full/uniform/4", "--repeats", "0", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("In short") and "vocab 128:" in text and "vocab 32000:" in text
    report = json.loads((out / "explain.json").read_text())
    assert report["config"]["vocab_size"] == 128 and report["contrast"]["config"]["vocab_size"] == 32000
    assert sorted(report["files"]["contrast_timelines"].values()) == [
        "timeline-vocab32000-full-uniform-1.json", "timeline-vocab32000-full-uniform-4.json",
        "timeline-vocab32000-none.json"]
    assert (out / "timeline-vocab32000-none.json").exists()


def test_contrast_vocab_flag(tmp_path, capsys):
    assert main(["explain", *QUICK, "--out", str(tmp_path / "a")]) == 0
    assert json.loads((tmp_path / "a" / "explain.json").read_text())["contrast"] is None
    capsys.readouterr()
    assert main(["explain", *QUICK[:-1], "-3", "--out", str(tmp_path / "b")]) == 2
    assert capsys.readouterr().err.startswith("remat: error: --contrast-vocab -3: must be")
    with pytest.raises(ValueError, match="contrast_vocab=0"):
        explain(ModelConfig(num_layers=1), ["none"], repeats=0, contrast_vocab=0)


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
def _run(out, *extra):
    return main(["explain", *QUICK, "--out", str(out), *extra])


def test_a_rerun_replaces_the_folder_whole(tmp_path):
    out = tmp_path / "out"
    assert main(["explain", *QUICK[:-7], "--policies", "none,full/uniform/1,full/uniform/4", "--repeats", "0",
                 "--no-plot", "--contrast-vocab", "0", "--out", str(out)]) == 0
    assert (out / "timeline-full-uniform-1.json").exists()
    assert _run(out) == 0
    # the previous run's full/uniform/1 timeline is gone: the folder holds this run's files only
    assert sorted(p.name for p in out.iterdir()) == ["explain.json", "timeline-full-uniform-4.json",
                                                     "timeline-none.json"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no staging folder left beside it


def test_an_interrupted_write_leaves_the_previous_run(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    assert _run(out, "--html", str(tmp_path / "r.html")) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    html_before = (tmp_path / "r.html").read_bytes()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_explain, "write_json", interrupted)  # explain.json is the last file of a run
    rerun = ["explain", *QUICK, "--policies", "none,full/uniform/2", "--out", str(out),
             "--html", str(tmp_path / "r.html")]
    assert main(rerun) == 130
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert (tmp_path / "r.html").read_bytes() == html_before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "r.html"]


def test_a_failed_html_write_leaves_nothing(tmp_path, monkeypatch, capsys):
    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cli_explain, "write_html", full_disk)
    assert _run(tmp_path / "out", "--html", str(tmp_path / "r.html")) == 2
    assert list(tmp_path.iterdir()) == []  # no timeline without explain.json, no half page


def test_out_with_other_files_is_refused_untouched(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert _run(tmp_path) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"remat: error: --out {tmp_path}: holds files remat explain did not write (notes.txt)")
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


@pytest.mark.parametrize("flag", ["--out", "--html", "--snapshot"])
def test_a_path_in_the_way_names_the_flag(flag, tmp_path, capsys):
    folder = tmp_path / "folder"
    folder.mkdir()
    blocker = tmp_path / "file"
    blocker.write_text("")
    target = blocker if flag == "--out" else folder
    args = ["explain", *QUICK, "--out", str(tmp_path / "out"), flag, str(target)]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    expected = "is a file, not a folder" if flag == "--out" else "is a folder: give a file name"
    assert err == f"remat: error: {flag} {target}: {expected}"
    assert not (tmp_path / "out").exists()


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
def test_a_model_too_large_is_refused_naming_the_flag(tmp_path, capsys):
    code = main(["explain", *TINY[:2], "--hidden", "100000", *TINY[4:], "--out", str(tmp_path / "out")])
    assert code == 2
    err = capsys.readouterr().err.strip()
    # the flag that made it large is named (the others are below their defaults)
    assert err.startswith("remat: error: --hidden 100000: measuring this 4-layer model (h=100000) needs about "), err
    assert "\n" not in err and "is available on cpu" in err
    assert not (tmp_path / "out").exists()


def test_a_contrast_too_large_names_contrast_vocab(tmp_path, capsys, monkeypatch):
    config = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, micro_batch_size=2,
                         vocab_size=128)
    main_need = capacity.predicted_need(config, [Policy()])
    # room for the main run, not for the contrast at vocab 1,000,000 (its logits alone are 256 MB)
    monkeypatch.setattr(capacity, "available_memory", lambda device="cpu": int(main_need * 20))
    assert main(["explain", *QUICK[:-1], "1000000", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("remat: error: --contrast-vocab 1000000: measuring the contrast run at vocab 1000000 "
                          "needs about "), err
    assert err.endswith("or --contrast-vocab 0 (no contrast run)")


def test_check_fits():
    check_fits(1, "cpu")
    with pytest.raises(MemoryCheckError, match="needs about 1048576.00 GiB") as caught:
        check_fits(1 << 50, "cpu", fix="use less")
    assert caught.value.need == 1 << 50 and str(caught.value).endswith(": use less")
