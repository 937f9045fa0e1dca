"""``remat compare`` on the command line: predicted against measured rows, --out, --max-error, ``--pp``, and
refusals before anything is measured (bad input, a model too large for this machine, an unwritable --out)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_models import GPT, GPT_FLAGS

import remat.memory.comparison as comparison
from remat.policy import Policy
from remat.units import KIB, format_bytes

TINY_FLAGS = GPT_FLAGS


def test_cli_compare(run_cli, tmp_path: Path) -> None:
    code, out, _ = run_cli("compare", *TINY_FLAGS, "--policy", "full/uniform/1,full/block/2@non-reentrant",
                           "--policy", "selective/core_attn+mlp", "--json", "--out", str(tmp_path / "c.json"),
                           "--max-error", "0.01")
    assert code == 0
    rows = json.loads(out)
    assert rows == json.loads((tmp_path / "c.json").read_text())
    assert [r["policy"] for r in rows] == ["none", "full/uniform/1", "full/block/2@non-reentrant",
                                           "selective/core_attn+mlp"]
    for row in rows:
        assert {"policy", "predicted_bytes", "measured_bytes", "error", "part_errors", "worst_part"} <= set(row)
        assert abs(row["error"]) <= 0.01 and max(abs(e) for e in row["part_errors"].values()) <= 0.02
    code, out, _ = run_cli("compare", *TINY_FLAGS, "--policy", "full/uniform/3", "--dtype", "bf16")
    assert code == 0 and "error %" in out and "worst peak error" in out


@pytest.mark.parametrize("argv", [
    ["compare", *TINY_FLAGS, "--device", "cuda"] if not torch.cuda.is_available() else ["compare", "--layers", "0"],
    ["compare", "--preset", "llama3-70b", "--policy", "none"],
    ["compare", *TINY_FLAGS, "--max-error", "-1"],
])
def test_cli_bad_compare_input_is_one_line_exit_2(run_cli, argv: list[str]) -> None:
    code, out, err = run_cli(*argv)
    assert code == 2
    assert err.startswith("remat: error: ") and err.count("\n") == 1, err
    assert out == ""


def test_a_model_too_large_for_this_machine_is_refused_before_measuring(run_cli, monkeypatch):
    measured = []
    monkeypatch.setattr(comparison, "measure", lambda *a, **k: measured.append(a))
    # the one memory check of remat (remat explain's too): here 1 KiB is free
    monkeypatch.setattr(comparison, "available_memory", lambda device="cpu": KIB)
    code, out, err = run_cli("compare", *TINY_FLAGS, "--policy", "none")
    need = comparison.predicted_need(GPT, [Policy()])
    assert code == 2 and out == "" and measured == []
    assert err.strip() == (f"remat: error: measuring needs about {format_bytes(need)} (the largest predicted peak) "
                           "but 1.00 KiB is available on cpu: use a smaller config (--layers, --seq, --batch, ...), "
                           "or 'remat predict' alone")


def test_an_unwritable_out_is_refused_before_measuring(run_cli, monkeypatch, tmp_path):
    predicted = []
    monkeypatch.setattr(comparison, "predict_policies", lambda *a, **k: predicted.append(a))
    code, _, err = run_cli("compare", *TINY_FLAGS, "--policy", "none", "--out", str(tmp_path))
    assert code == 2 and predicted == []
    assert err.strip() == f"remat: error: --out {tmp_path}: is a folder: give a file name"


# ------------------------------------------------------------------------------------------------ --pp
def test_cli_compare_rows(pipeline_namespace, measured_by_prediction, capsys):
    """compare's rows (the measurement is replaced by the prediction: the real runs are tests/parallel's)."""
    from remat.cli.pipeline import run_pipeline_compare

    args = pipeline_namespace(["--pp", "2", "--microbatches", "4", "--schedule", "gpipe", "--policies",
                               "none,full/uniform/2", "--json"])
    assert run_pipeline_compare(args) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 4
    for row in rows:
        assert {"stage", "policy", "predicted_bytes", "measured_bytes", "error"} <= set(row)
        assert row["error"] == 0.0
