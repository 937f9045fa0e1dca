"""Megatron's uneven pipeline splits on the command line: the job flags of the same names, and --megatron-args."""

from __future__ import annotations

import json

from remat.cli import main
from remat.config import ModelConfig
from remat.job import Job
from remat.parallel.job_predict import predict_job

TINY = ["--layers", "3", "--hidden", "32", "--heads", "2", "--seq", "16", "--batch", "1", "--vocab", "64",
        "--attention", "sdpa"]


def test_predict_prices_every_stage_with_its_own_layers(capsys):
    argv = ["predict", *TINY, "--pp", "2", "--microbatches", "2", "--precision", "bf16",
            "--decoder-first-pipeline-num-layers", "1"]
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["job"]["chunk_layers"] == [1, 2] and report["job"]["decoder_first_pipeline_num_layers"] == 1
    assert "--decoder-first-pipeline-num-layers" in report["job"]["megatron_args"]
    model = ModelConfig(num_layers=3, hidden_size=32, num_attention_heads=2, seq_length=16, micro_batch_size=1,
                        vocab_size=64, attention="sdpa")
    job = Job.build(model, precision="bf16", pp=2, num_microbatches=2, decoder_first_pipeline_num_layers=1)
    assert [(r["stage"], r["peak_bytes"]) for r in report["rows"]] == [(r.stage, r.peak_bytes)
                                                                      for r in predict_job(job).ranks]
    assert main(argv) == 0
    assert "with chunks of 1+2 layers" in capsys.readouterr().out


def test_split_flags_with_megatron_args_are_refused_naming_where_they_go(capsys):
    code = main(["predict", "--megatron-args", "--num-layers 3 --hidden-size 32 --num-attention-heads 2 "
                 "--seq-length 16 --micro-batch-size 1 --vocab-size 64", "--pipeline-model-parallel-layout", "E|tttL"])
    assert code != 0
    err = capsys.readouterr().err
    assert "--pipeline-model-parallel-layout with --megatron-args" in err and "give it there" in err


def test_plan_plans_every_stage_of_an_uneven_split_for_its_own_layers(capsys):
    # the search itself is tests/plan/test_job_plan_uneven.py's; here the flags reach it and the report says so
    argv = ["plan", *TINY, "--pp", "2", "--microbatches", "2", "--precision", "bf16", "--budget", "1GiB",
            "--decoder-first-pipeline-num-layers", "1"]
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["fits"] and [s["chunk_layers"] for s in report["stages"]] == [[1], [2]]
    assert [s["layers"] for s in report["stages"]] == [[0, 0], [1, 2]]
    model = ModelConfig(num_layers=3, hidden_size=32, num_attention_heads=2, seq_length=16, micro_batch_size=1,
                        vocab_size=64, attention="sdpa")
    job = Job.build(model, precision="bf16", pp=2, num_microbatches=2, decoder_first_pipeline_num_layers=1)
    assert [(s["stage"], s["peak_bytes"]) for s in report["stages"]] == [(r.stage, r.peak_bytes) for r in sorted(
        predict_job(job).ranks, key=lambda r: r.stage)]
    assert all(s["peak_bytes"] <= report["budget_bytes"] for s in report["stages"])
    assert main(argv) == 0
    assert "stage 0 (layers 0-0" in capsys.readouterr().out


def test_a_layout_with_two_chunks_per_stage_plans_interleaved_without_schedule(capsys):
    # Megatron reads vpp from the layout and runs the interleaved schedule: remat plan does not ask for --schedule
    argv = ["plan", *TINY, "--pp", "2", "--microbatches", "2", "--precision", "bf16", "--budget", "1GiB",
            "--pipeline-model-parallel-layout", "Et|t|t|L", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["job"]["vpp"] == 2 and report["job"]["schedule"] == "interleaved", report["job"]
    assert [s["chunk_layers"] for s in report["stages"]] == [[1, 1], [1, 0]]
