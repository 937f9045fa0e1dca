"""``remat explain`` on the command line: the files of a run (timelines, plot, JSON, --html, --snapshot), the
table and JSON output, both vocabulary regimes, the run folder replaced whole, and paths and memory checked before
anything runs (tiny models, a few seconds each)."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

import remat.cli.explain as cli_explain
import remat.memory.comparison as comparison
from remat.analysis.explain import explain
from remat.analysis.report import format_explanation, format_short_answer
from remat.cli import build_parser, main
from remat.cli.common import file_name
from remat.config import ModelConfig
from remat.policy import Policy, PolicyError
from remat.timeline import Timeline

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TINY = ["--layers", "4", "--hidden", "64", "--heads", "4", "--seq", "32", "--batch", "2", "--vocab", "128"]
QUICK = [*TINY, "--policies", "none,full/uniform/4", "--repeats", "0", "--no-plot", "--contrast-vocab", "0"]
POLICIES = ["none", "full/uniform/1", "full/uniform/2", "full/uniform/4"]
CLI_MODEL = ["--layers", "2", "--hidden", "32", "--heads", "2", "--seq", "16", "--batch", "1", "--vocab", "64",
             "--repeats", "0", "--no-plot"]


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """One default run (plot, timings, the contrast vocabulary): its exit code, folder and printed text."""
    out = tmp_path_factory.mktemp("explain") / "out"
    with contextlib.redirect_stdout(io.StringIO()) as text:
        code = main(["explain", *TINY, "--policies", ",".join(POLICIES), "--repeats", "1", "--out", str(out)])
    return code, out, text.getvalue()


# ------------------------------------------------------------------------------------------------ files and output
def test_cli_writes_png_json_and_timelines(cli_run):
    code, out, _ = cli_run
    assert code == 0
    assert (out / "timelines.png").read_bytes()[:8] == PNG_MAGIC
    report = json.loads((out / "explain.json").read_text())
    assert [r["policy"] for r in report["rows"]] == POLICIES
    assert report["sentences"] and all(isinstance(s, str) for s in report["sentences"])
    assert report["files"]["plot"] == "timelines.png"
    for policy in POLICIES:
        name = report["files"]["timelines"][policy]
        assert name == f"timeline-{file_name(policy)}.json"
        timeline = Timeline.load(out / name)
        row = next(r for r in report["rows"] if r["policy"] == policy)
        assert timeline.peak_bytes == row["peak_bytes"]
        assert timeline.meta["policy"] == policy
    # Written atomically: no temporary files left behind.
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


def test_cli_table_output(capsys, tmp_path):
    code = main(["explain", *TINY, "--policies", "none,full/uniform/4", "--repeats", "0", "--no-plot",
                 "--out", str(tmp_path)])
    assert code == 0
    text = capsys.readouterr().out
    assert "peak MiB" in text and "full/uniform/4" in text and "pipeline" in text
    assert not (tmp_path / "timelines.png").exists()


def test_the_short_answer_leads_then_the_rest_of_the_report(tmp_path, monkeypatch, capsys):
    # printed as soon as it is known, before the PNG is drawn; the whole text is format_explanation's report
    printed_before_plot, results = [], []
    real_plot, real_explain = cli_explain.plot_timelines, cli_explain.explain

    def plot(*args, **kwargs):
        printed_before_plot.append(capsys.readouterr().out)
        return real_plot(*args, **kwargs)

    monkeypatch.setattr(cli_explain, "plot_timelines", plot)
    monkeypatch.setattr(cli_explain, "explain", lambda *a, **k: results.append(real_explain(*a, **k)) or results[0])
    assert main(["explain", *TINY, "--policies", "none,full/uniform/4", "--out", str(tmp_path / "out")]) == 0
    rest = capsys.readouterr()
    result = results[0]
    assert printed_before_plot == [format_short_answer(result.short_answer) + "\n"]
    assert printed_before_plot[0] + rest.out == format_explanation(result) + "\n"
    # untimed unless asked, and the run says how to time it
    assert build_parser().parse_args(["explain"]).repeats is None and cli_explain.REPEATS == 0
    assert all(row.step_seconds is None for row in result.rows) and result.meta["repeats"] == 0
    assert "--repeats 3" in rest.err


def test_cli_json_output(capsys, tmp_path):
    code = main(["explain", *TINY, "--policies", "full/uniform/2", "--repeats", "1", "--json", "--no-plot",
                 "--engine", "non-reentrant", "--contrast-vocab", "0", "--out", str(tmp_path)])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    # none is always measured as the baseline; --engine applies to policies without '@engine'.
    assert [r["policy"] for r in report["rows"]] == ["none", "full/uniform/2@non-reentrant"]
    assert report["config"]["num_layers"] == 4
    assert report["rows"][0]["step_ratio"] == pytest.approx(1.0)
    assert report["formula"][0]["policy"] == "full/uniform/2@non-reentrant"
    assert json.loads((tmp_path / "explain.json").read_text())["rows"] == report["rows"]


def test_cli_html_and_snapshot(tmp_path, capsys):
    html, snap = tmp_path / "r.html", tmp_path / "snap.pickle"
    code = main(["explain", *CLI_MODEL, "--policies", "none,full/uniform/2", "--out", str(tmp_path / "out"),
                 "--html", str(html), "--snapshot", str(snap)])
    assert code == 0
    assert html.exists() and '<tr class="policy-row' in html.read_text(encoding="utf-8")
    assert (tmp_path / "snap-none.pickle").exists() and (tmp_path / "snap-full-uniform-2.pickle").exists()
    assert "r.html" in capsys.readouterr().err
    code = main(["explain", *CLI_MODEL, "--policies", "none", "--contrast-vocab", "0", "--out",
                 str(tmp_path / "out"), "--snapshot", str(snap), "--json"])
    assert code == 0 and snap.exists()


# ------------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("flags, words", [
    (["--policies", "full/uniform/99"], ["num_layers=99", "4 layers"]),
    (["--heads", "3"], ["hidden_size=64", "num_attention_heads=3"]),
    (["--policies", "full/sideways/2"], ["full/sideways/2"]),
    (["--policies", "selective/moe"], ["moe"]),
    (["--repeats", "-1"], ["--repeats"]),
    (["--dropout", "1.5"], ["dropout"]),
    (["--layers", "four"], ["--layers", "four"]),
    (["--attention", "flash"], ["--attention", "flash"]),
    (["--vocab", "0"], ["--vocab", "0"]),
    pytest.param(["--device", "cuda"], ["cuda"],
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")),
])
def test_cli_bad_values_one_line(flags, words, capsys, tmp_path):
    code = main(["explain", *TINY, *flags, "--out", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("remat: error: ") and "\n" not in err, err
    for word in words:
        assert word in err, err
    assert not (tmp_path / "explain.json").exists()


def test_cli_debug_raises(tmp_path):
    with pytest.raises(PolicyError):
        main(["--debug", "explain", *TINY, "--policies", "full/uniform/99", "--out", str(tmp_path)])
    with pytest.raises(PolicyError):
        main(["explain", "--debug", *TINY, "--policies", "full/uniform/99", "--out", str(tmp_path)])


# ------------------------------------------------------------------------------------------------ both regimes
def test_default_cli_shows_both_regimes(cli_run):
    assert build_parser().parse_args(["explain"]).contrast_vocab is None and cli_explain.CONTRAST_VOCAB == 32000
    assert ModelConfig().vocab_size == 512  # --vocab keeps its meaning: the main run's vocabulary
    code, out, text = cli_run  # run with the default --contrast-vocab
    assert code == 0
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


def test_an_unwritable_output_is_a_one_line_error(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    for flag in ("--out", "--html", "--snapshot"):
        args = ["explain", *CLI_MODEL, "--policies", "none", "--out", str(tmp_path / "out"), flag,
                str(blocker / "sub" / "x")]
        if flag == "--out":
            args = args[:-4] + args[-2:]
        assert main(args) == 2, flag
        err = capsys.readouterr().err
        assert err.startswith("remat: error: ") and err.count("\n") == 1, err
        # the flag is named, no temporary file is, and nothing of the run was written
        assert err.startswith(f"remat: error: {flag} {blocker / 'sub' / 'x'}: {blocker} is a file"), err
        assert ".tmp" not in err
        assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------ memory
def test_a_model_too_large_is_refused_naming_the_flag(tmp_path, capsys):
    code = main(["explain", *TINY[:2], "--hidden", "60000", *TINY[4:], "--out", str(tmp_path / "out")])
    assert code == 2
    err = capsys.readouterr().err.strip()
    # the flag that made it large is named (the others are below their defaults)
    assert err.startswith("remat: error: --hidden 60000: measuring this 4-layer model (h=60000) needs about "), err
    assert "\n" not in err and "is available on cpu" in err
    assert not (tmp_path / "out").exists()


def test_a_contrast_too_large_names_contrast_vocab(tmp_path, capsys, monkeypatch):
    config = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, micro_batch_size=2,
                         vocab_size=128)
    main_need = comparison.predicted_need(config, [Policy()])
    # room for the main run, not for the contrast at vocab 1,000,000 (its logits alone are 256 MB)
    monkeypatch.setattr(comparison, "available_memory", lambda device="cpu": int(main_need * 20))
    assert main(["explain", *QUICK[:-1], "1000000", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("remat: error: --contrast-vocab 1000000: measuring the contrast run at vocab 1000000 "
                          "needs about "), err
    assert err.endswith("or --contrast-vocab 0 (no contrast run)")
