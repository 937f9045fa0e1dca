"""``remat predict/compare --megatron-core``: the user's Megatron-LM flags through megatron-core's own model."""

from __future__ import annotations

import json

import pytest

from remat.cli import main

megatron = pytest.importorskip("megatron.core", reason="megatron-core is not installed: pip install 'remat[megatron]'")

ARGS = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
        "--micro-batch-size 2 --vocab-size 128 --disable-bias-linear --recompute-granularity full "
        "--recompute-method uniform --recompute-num-layers 1 --lr 1e-4")


def test_predict_rows_add_up_and_name_ignored_flags(capsys):
    assert main(["predict", "--megatron-core", "--megatron-args", ARGS + " --tensor-model-parallel-size 2",
                 "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert rows and all(row["policy"] == "full/uniform/1" for row in rows)
    for row in rows:
        assert row["parameters"] + row["gradients"] + row["optimizer_state"] + row["activations"] == row["peak_bytes"]
        assert sum(row["at_peak"].values()) == row["peak_bytes"]
        assert row["ignored_flags"] == ["--lr"]


def test_compare_world_size_one_is_exact(capsys):
    assert main(["compare", "--megatron-core", "--megatron-args", ARGS, "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    assert row["measured_bytes"] == row["peak_bytes"] and row["error"] == 0.0


@pytest.mark.parametrize("extra, named", [(["--layers", "4"], "--layers"), (["--tp", "2"], "--tp"),
                                          (["--policy", "none"], "--policy")])
def test_reference_model_flags_are_refused_not_dropped(capsys, extra, named):
    assert main(["predict", "--megatron-core", "--megatron-args", ARGS, *extra]) == 2
    err = capsys.readouterr().err
    assert named in err and "--megatron-args" in err and err.count("\n") == 1


def test_megatron_core_needs_megatron_args(capsys):
    assert main(["predict", "--megatron-core"]) == 2
    assert "--megatron-core needs --megatron-args" in capsys.readouterr().err
