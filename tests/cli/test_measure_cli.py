"""``remat measure`` on the command line: registered, one-line errors, and output paths refused before anything
runs."""

from __future__ import annotations

import json

import pytest

from remat.cli import build_parser, main
from remat.config import ModelConfig
from remat.parallel.pipeline_predict import predict_pipeline

TINY = ["--layers", "4", "--hidden", "64", "--heads", "4", "--seq", "32", "--batch", "2", "--vocab", "128"]


def test_cli_measure_registered_and_errors_are_one_line(capsys):
    assert "measure" in build_parser()._subparsers._group_actions[0].choices
    code = main(["measure", "--layers", "4", "--pp", "3"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("remat: error: ") and "not divisible" in err and err.count("\n") == 1


@pytest.mark.parametrize("flag, where", [("--timelines", "file"), ("--timelines", "under a file"),
                                         ("--out", "folder"), ("--out", "under a file")])
def test_a_bad_output_path_is_refused_before_anything_runs(flag, where, tmp_path, measured_by_prediction, capsys):
    blocker, folder = tmp_path / "file", tmp_path / "folder"
    blocker.write_text("")
    folder.mkdir()
    target = {"file": blocker, "folder": folder, "under a file": blocker / "sub"}[where]
    assert main(["measure", *TINY, "--pp", "2", flag, str(target)]) == 2
    expected = {"file": "is a file, not a folder", "folder": "is a folder: give a file name",
                "under a file": f"{blocker} is a file, not a folder"}[where]
    assert capsys.readouterr().err.strip() == f"remat: error: {flag} {target}: {expected}"
    assert measured_by_prediction == []  # refused before the stages were launched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "folder"]


def test_timelines_are_written_per_policy_and_stage(tmp_path, measured_by_prediction, capsys):
    where = tmp_path / "new" / "timelines"  # made as needed
    assert main(["measure", *TINY, "--pp", "2", "--policies", "none,full/uniform/1", "--timelines", str(where),
                 "--json"]) == 0
    assert measured_by_prediction == [["none", "full/uniform/1"]]
    report = json.loads(capsys.readouterr().out)
    names = ["measured-none-stage0.json", "measured-none-stage1.json", "measured-full-uniform-1-stage0.json",
             "measured-full-uniform-1-stage1.json"]
    assert report["files"] == [str(where / name) for name in names]
    assert sorted(p.name for p in where.iterdir()) == sorted(names)
    config = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, micro_batch_size=2,
                         vocab_size=128)
    stage1 = predict_pipeline(config, "full/uniform/1", 2, 4)[1]
    assert (where / names[3]).read_text() == stage1.save(tmp_path / "expected.json").read_text()
