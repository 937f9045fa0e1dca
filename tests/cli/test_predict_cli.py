"""``remat predict`` on the command line: the table, the JSON report and --out, model sources, sweeps, Adam,
``--pp`` (per-stage rows), and bad input as one line with exit status 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_models import GPT, GPT_FLAGS, LLAMA

from remat.memory.predict import predict
from remat.plan.megatron import megatron_sweep
from remat.presets import load_config

TINY_FLAGS = GPT_FLAGS


def test_cli_predict_table(run_cli) -> None:
    code, out, _ = run_cli("predict", *TINY_FLAGS, "--policy", "full/uniform/1,selective")
    assert code == 0
    for text in ("policy", "peak KiB", "where", "saved act", "extra compute %", "full/uniform/1",
                 "selective/core_attn", "Korthikanti", "Megatron estimate", "traced (CPU kernels, exact)"):
        assert text in out


def test_cli_predict_json_and_out(run_cli, tmp_path: Path) -> None:
    out_file = tmp_path / "sub" / "predict.json"
    code, out, _ = run_cli("predict", *TINY_FLAGS, "--policy", "none", "--policy", "full/uniform/2",
                           "--engine", "non-reentrant", "--json", "--out", str(out_file))
    assert code == 0
    report = json.loads(out)
    assert json.loads(out_file.read_text()) == {**report, "seconds": json.loads(out_file.read_text())["seconds"]}
    assert [r["policy"] for r in report["rows"]] == ["none", "full/uniform/2@non-reentrant"]
    for row in report["rows"]:
        assert {"policy", "peak_bytes", "peak_phase", "at_peak", "flops", "extra_compute_pct"} <= set(row)
        assert sum(row["at_peak"].values()) == row["peak_bytes"]
    assert report["rows"][1]["peak_bytes"] == predict(GPT, "full/uniform/2@non-reentrant").peak_bytes
    assert report["rows"][1]["extra_compute_pct"] > 0 and report["rows"][0]["extra_compute_pct"] == 0
    formulas = report["formulas"]
    assert formulas["traced_layer_bytes"] > 0 and len(formulas["differences"]) == 2
    for diff in formulas["differences"]:
        assert diff["unexplained_bytes"] == 0


def test_cli_predict_sweep_config_file_adam(run_cli, tmp_path: Path) -> None:
    cfg = tmp_path / "tiny.yaml"
    # the Llama of the measured tests, in bf16, from the llama3-8b preset
    cfg.write_text("preset: llama3-8b\nnum_layers: 2\nhidden_size: 32\nnum_attention_heads: 4\n"
                   "num_query_groups: 2\nffn_hidden_size: null\nseq_length: 16\nmicro_batch_size: 2\n"
                   "vocab_size: 64\n")
    assert load_config(cfg) == LLAMA.replace(num_layers=2, dtype="bf16")
    code, out, _ = run_cli("predict", "--config", str(cfg), "--sweep", "megatron", "--json")
    assert code == 0
    rows = json.loads(out)["rows"]
    assert [r["policy"] for r in rows] == megatron_sweep(2)
    code, out, _ = run_cli("predict", "--config", str(cfg), "--layers", "1", "--policy", "full/uniform/1",
                           "--adam", "--json")
    assert code == 0
    report = json.loads(out)
    assert report["config"]["num_layers"] == 1 and report["optimizer"]
    assert all(r["at_peak"]["optimizer_state"] > 0 for r in report["rows"])


@pytest.mark.parametrize("argv", [
    ["predict", *TINY_FLAGS, "--policy", "full/uniform/9"],
    ["predict", *TINY_FLAGS, "--policy", "full/sideways/1"],
    ["predict", "--hidden", "30", "--heads", "4"],
    ["predict", "--preset", "gpt5"],
    ["predict", "--preset", "gpt-small", "--config", "x.yaml"],
    ["predict", "--config", "/nonexistent/model.yaml"],
    ["predict", "--sweep", "everything"],
])
def test_cli_bad_input_is_one_line_exit_2(run_cli, argv: list[str]) -> None:
    code, out, err = run_cli(*argv)
    assert code == 2
    assert err.startswith("remat: error: ") and err.count("\n") == 1, err
    assert out == ""


def test_cli_bad_config_file_names_it(run_cli, tmp_path: Path) -> None:
    f = tmp_path / "m.yaml"
    f.write_text("num_layers: 2\nhidden: 64\n")
    code, _, err = run_cli("predict", "--config", str(f))
    assert code == 2 and f"{f}: unknown field(s) 'hidden'" in err


# ------------------------------------------------------------------------------------------------ --pp
def test_cli_predict_json(pipeline_namespace, capsys):
    from remat.cli.pipeline import run_pipeline_predict

    args = pipeline_namespace(["--pp", "2", "--microbatches", "4", "--policies", "none,full/uniform/1", "--json"])
    assert run_pipeline_predict(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert [(s["stage"], s["policy"]) for s in report["stages"]] == [(0, "none"), (1, "none"),
                                                                    (0, "full/uniform/1"), (1, "full/uniform/1")]
    assert report["stages"][0]["max_in_flight"] == 2 and report["stages"][0]["why"]
