"""Reserved memory and PyTorch's memory viewer on the job path of the command line: ``remat predict``/``plan`` of a
whole job report each rank's replayed ``max_memory_reserved`` (``--alloc-conf``, or the launch line's
``PYTORCH_CUDA_ALLOC_CONF``), ``plan`` budgets reserved memory with a GPU budget, and ``--snapshot`` writes the worst
rank's step as a ``torch.cuda.memory._snapshot()`` pickle that torch's own viewer reads."""

from __future__ import annotations

import copy
import json
import pickle

import pytest
import torch.cuda._memory_viz as memory_viz

from remat.analysis.snapshot import snapshot_live_bytes
from remat.cli import main

JOB = ["--layers", "2", "--hidden", "32", "--heads", "2", "--seq", "16", "--batch", "1", "--vocab", "64", "--pp", "2",
       "--dp", "2", "--precision", "bf16"]
MEGATRON = ("torchrun --nproc-per-node 4 pretrain_gpt.py --num-layers 2 --hidden-size 32 --num-attention-heads 2 "
            "--seq-length 16 --micro-batch-size 1 --vocab-size 64 --make-vocab-size-divisible-by 16 --bf16 "
            "--pipeline-model-parallel-size 2 --global-batch-size 8")


def _json(capsys, argv, code=0):
    assert main([*argv, "--json"]) == code
    return json.loads(capsys.readouterr().out)


def test_predict_reports_every_ranks_reserved_memory(capsys):
    report = _json(capsys, ["predict", *JOB])
    assert report["alloc_conf"] == "" and report["alloc_conf_source"] == ""
    for row in report["rows"]:
        reserved = row["reserved"]
        assert reserved["max_memory_reserved"] >= reserved["max_memory_allocated"] >= row["peak_bytes"]
        assert reserved["overhead_bytes"] == reserved["max_memory_reserved"] - row["peak_bytes"]
        assert {"fragmentation_at_peak_bytes", "largest_free_block_bytes", "segments", "note"} <= set(reserved)
    assert main(["predict", *JOB]) == 0
    text = capsys.readouterr().out
    assert "most reserved: rank 0" in text and "reserved: each rank's max_memory_reserved" in text
    header = next(line for line in text.splitlines() if line.split()[:5] == ["rank", "stage", "alike", "peak",
                                                                              "reserved"])
    assert header


def test_alloc_conf_and_the_launch_lines_environment_set_the_replayed_options(capsys):
    default = _json(capsys, ["predict", *JOB])["rows"][0]["reserved"]
    flag = _json(capsys, ["predict", *JOB, "--alloc-conf", "expandable_segments:True"])
    assert flag["alloc_conf"] == "expandable_segments:True" and flag["alloc_conf_source"] == "--alloc-conf"
    reserved = flag["rows"][0]["reserved"]
    assert reserved["alloc_conf"] == "expandable_segments:True" and reserved != default
    launched = _json(capsys, ["predict", "--megatron-args", f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
                                                            f"{MEGATRON}"])
    assert launched["alloc_conf"] == "expandable_segments:True"
    assert launched["alloc_conf_source"] == "the launch line's PYTORCH_CUDA_ALLOC_CONF"
    assert launched["rows"][0]["reserved"]["alloc_conf"] == "expandable_segments:True"


def test_the_snapshot_is_the_worst_ranks_step_and_torchs_viewer_reads_it(tmp_path, capsys):
    path = tmp_path / "worst.pickle"
    report = _json(capsys, ["predict", *JOB, "--policy", "none,full/uniform/1", "--snapshot", str(path)])
    assert report["files"]["snapshot"] == str(path)
    worst = report["rows"][0]  # the first policy's worst rank
    with path.open("rb") as f:
        snap = pickle.load(f)  # noqa: S301 (the test's own file)
    live = snapshot_live_bytes(snap)
    assert live.max() == worst["peak_bytes"]  # every allocation and free of the rank's step, in order
    for page in (memory_viz.trace_plot(snap), memory_viz.trace_plot(copy.deepcopy(snap), filter_freed=True),
                 memory_viz.segment_plot(snap)):
        assert "add_local_files" in page
    assert "segments: 1" in memory_viz.segsum(snap)
    lines = memory_viz.memory(snap, format_flamegraph=lambda text: text).splitlines()
    assert sum(int(line.rsplit(" ", 1)[1]) for line in lines) == snap["segments"][0]["total_size"]
    assert memory_viz.trace(snap).startswith("Device 0")
    # each block's frames: its module and category, its phase (microbatch and chunk) and the policy
    frames = {f["filename"]: f["name"] for e in snap["device_traces"][0] if e["action"] == "alloc"
              for f in e["frames"]}
    names = {f["name"] for e in snap["device_traces"][0] for f in e["frames"]}
    assert frames["remat"] == "policy none" and "ddp.grad_buffer (gradients)" in names
    assert any(n.startswith("forward") and "microbatch" in n for n in names)
    assert any(n.startswith("backward") and "microbatch" in n for n in names)
    assert main(["predict", *JOB, "--snapshot", str(path)]) == 0
    assert f"snapshot: {path} (policy none's worst rank: rank 0, stage 0)" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["predict", *JOB], ["plan", *JOB, "--budget", "h100-80g"]], ids=["predict", "plan"])
def test_an_unwritable_snapshot_is_refused_before_the_work(monkeypatch, capsys, argv):
    import remat.cli.job as cli_job

    def work(*args, **kwargs):
        raise AssertionError("the work ran before --snapshot was checked")

    monkeypatch.setattr(cli_job, "predict_policies", work)
    monkeypatch.setattr(cli_job, "plan_job_reserved", work)
    assert main([*argv, "--snapshot", "/proc/x.pickle"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("remat: error: --snapshot /proc/x.pickle") and err.count("\n") == 1, err


@pytest.mark.parametrize("budget,flags,memory", [
    ("h100-80g", [], "reserved"),
    ("h100-80g", ["--budget-allocated"], "allocated"),
    ("1GiB", [], "allocated"),
    ("1GiB", ["--budget-reserved"], "reserved"),
])
def test_a_plan_with_a_gpu_budget_budgets_reserved_memory(capsys, budget, flags, memory):
    argv = ["plan", *JOB, "--budget", budget, *flags, "--operator-sets", "0", "--no-offload"]
    report = _json(capsys, argv)
    assert report["fits"] and report["budgeted_memory"] == memory
    assert report["stats"]["memory_budgeted"]["memory"] == memory
    assert all(row["reserved"]["max_memory_reserved"] >= row["peak_bytes"] for row in report["stages"])
    assert all(row["reserved"]["max_memory_reserved"] > 0 for row in report["uniform"]["rows"])
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert f"budgeted: {memory} " in text and ("--budget-allocated budgets allocated bytes instead" in text) == (
        memory == "reserved")
