"""A sweep of bad and edge inputs over every subcommand, run in-process through ``remat.cli.main``.

Each case must end in bounded time with exit code 2 and one ``remat: error: ...`` line on stderr that names the
flag (or the field) to fix, never a traceback; the few legitimate edge inputs must exit 0. Every case is small:
the errors come before any model is built, and the accepted inputs use a 2-layer toy model.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from remat.cli import main

TINY = ["--layers", "2", "--hidden", "32", "--heads", "2", "--seq", "16", "--batch", "1", "--vocab", "64"]
FOUR = ["--layers", "4", "--hidden", "32", "--heads", "2", "--seq", "16", "--batch", "1", "--vocab", "64"]
CASE_SECONDS = 60  # far above any case (the slowest traces a toy model for a few seconds)
FILE = "/proc/version/nope.json"  # under a file: no directory can be made there
PLAN = ["plan", *TINY, "--budget"]
DENSE = "--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --micro-batch-size 1 --vocab-size 64"
MOE = f"{DENSE} --num-experts 2"


def _case(argv, names, code=2):
    return pytest.param(argv, names, code, id=" ".join(argv)[:90])


ERRORS = [
    # --- numbers of the model flags (every subcommand that has them)
    *[_case([cmd, *TINY, flag, value], [flag]) for cmd in ("predict", "compare", "explain", "measure", "plan")
      for flag, value in (("--layers", "0"), ("--hidden", "-8"), ("--heads", "x"), ("--seq", "1.5"))],
    _case(["predict", "--batch", "0"], ["--batch"]),
    _case(["predict", "--vocab", "-1"], ["--vocab"]),
    _case(["predict", "--ffn", "0"], ["--ffn"]),
    _case(["predict", "--query-groups", "0"], ["--query-groups"]),
    _case(["predict", "--dropout", "1.5"], ["--dropout"]),
    _case(["predict", "--dropout", "-0.1"], ["--dropout"]),
    _case(["predict", "--dropout", "nan"], ["--dropout"]),
    _case(["explain", "--dropout", "abc"], ["--dropout"]),
    _case(["predict", *TINY, "--heads", "3"], ["num_attention_heads"]),
    _case(["predict", *TINY, "--query-groups", "3"], ["query"]),
    # --- unknown choices
    _case(["predict", "--activation", "tanh"], ["--activation"]),
    _case(["predict", "--normalization", "batchnorm"], ["--normalization"]),
    _case(["predict", "--position", "alibi"], ["--position"]),
    _case(["predict", "--attention", "flash"], ["--attention"]),
    _case(["predict", "--dtype", "float8"], ["--dtype"]),
    _case(["predict", "--preset", "gpt-99"], ["--preset"]),
    _case(["predict", "--engine", "magic"], ["--engine"]),
    _case(["predict", "--device", "tpu"], ["--device"]),
    _case(["predict", "--sweep", "all"], ["--sweep"]),
    _case(["predict", "--schedule", "zigzag"], ["--schedule"]),
    _case(["predict", "--pipeline-runtime", "jax"], ["--pipeline-runtime"]),
    _case(["compare", "--device", "tpu"], ["--device"]),
    _case(["measure", "--schedule", "zigzag"], ["--schedule"]),
    _case(["plan", *TINY, "--budget", "1GiB", "--objective", "speed"], ["--objective"]),
    _case(["frobnicate"], ["frobnicate"]),
    _case(["predict", "--no-such-flag"], ["--no-such-flag"]),
    _case([], ["COMMAND"]),
    # --- model sources
    _case(["predict", "--config", "/nonexistent/model.yaml"], ["model.yaml"]),
    _case(["predict", "--preset", "gpt-small", "--config", "x.yaml"], ["--config"]),
    # --- policies
    _case(["predict", *TINY, "--policy", "full/uniform/0"], ["--recompute-num-layers"]),
    _case(["predict", *TINY, "--policy", "full/diagonal/1"], ["diagonal"]),
    _case(["predict", *TINY, "--policy", "selective/everything"], ["everything"]),
    _case(["predict", *TINY, "--policy", ","], ["--policies"]),
    _case(["predict", *TINY, "--policy", "full/uniform/3"], ["3"]),
    _case(["predict", *TINY, "--policy", "full/uniform/1@turbo"], ["turbo"]),
    _case(["compare", *TINY, "--policy", "bogus"], ["bogus"]),
    _case(["explain", *TINY, "--policies", "bogus"], ["bogus"]),
    _case(["explain", *TINY, "--policies", ","], ["--policies"]),
    _case(["measure", *TINY, "--policies", "full/uniform/9"], ["9"]),
    # --- parallel sizes
    _case(["predict", *TINY, "--tp", "0"], ["--tp"]),
    _case(["predict", *TINY, "--tp", "3"], ["tp"]),
    _case(["predict", *TINY, "--adam", "--tp", "2"], ["--adam", "--tp"]),
    _case(["compare", *TINY, "--tp", "2"], ["--tp"]),
    _case(["predict", *TINY, "--pp", "0"], ["--pp"]),
    _case(["predict", *TINY, "--pp", "-2"], ["--pp"]),
    _case(["compare", *TINY, "--pp", "0"], ["--pp"]),
    _case(["explain", *TINY, "--pp", "0"], ["--pp"]),
    _case(["measure", *TINY, "--pp", "0"], ["--pp"]),
    _case(["predict", *TINY, "--pp", "4"], ["--pp 2"]),
    _case(["compare", *TINY, "--pp", "3"], ["--pp 2"]),
    _case(["measure", *TINY, "--pp", "3"], ["--pp 2"]),
    _case(["predict", *FOUR, "--pp", "3"], ["--layout"]),
    _case(["predict", *TINY, "--pp", "2", "--microbatches", "0"], ["--microbatches"]),
    _case(["predict", *TINY, "--pp", "2", "--microbatches", "1"], ["--microbatches"]),
    _case(["predict", *TINY, "--pp", "2", "--vpp", "0"], ["--vpp"]),
    _case(["predict", *FOUR, "--pp", "2", "--vpp", "2"], ["--schedule interleaved", "--vpp 1"]),
    _case(["predict", *TINY, "--pp", "2", "--vpp", "2"], ["--vpp 1"]),
    _case(["predict", *TINY, "--vpp", "2"], ["--vpp", "--pp", "--schedule interleaved"]),
    _case(["predict", *TINY, "--pp", "2", "--vpp", "3", "--schedule", "interleaved"], ["--vpp 1"]),
    _case(["predict", *FOUR, "--pp", "2", "--vpp", "2", "--schedule", "interleaved", "--microbatches", "3"],
          ["--microbatches"]),
    _case(["predict", *TINY, "--pp", "2", "--schedule", "interleaved"], ["vpp", "--schedule 1f1b"]),
    _case(["predict", *TINY, "--pp", "2", "--layout", "1,0"], ["--layout"]),
    _case(["predict", *TINY, "--pp", "2", "--layout", "a,b"], ["--layout"]),
    _case(["predict", *TINY, "--pp", "2", "--layout", "1,1,1"], ["layout"]),
    _case(["predict", *TINY, "--pp", "2", "--layout", "2,1"], ["layout"]),
    _case(["predict", *TINY, "--pp", "2", "--policy", "full/uniform/2"], ["full/uniform/1"]),
    _case(["predict", *TINY, "--pp", "2", "--partial-checkpoint-microbatches", "-1"],
          ["--partial-checkpoint-microbatches"]),
    _case(["predict", *TINY, "--microbatches", "4"], ["--microbatches", "--pp"]),
    _case(["predict", *TINY, "--schedule", "gpipe"], ["--schedule", "--pp"]),
    _case(["predict", *TINY, "--layout", "1,1"], ["--layout", "--pp"]),
    _case(["predict", *TINY, "--pipeline-runtime", "megatron"], ["--pipeline-runtime", "--pp"]),
    _case(["compare", *TINY, "--partial-checkpoint-microbatches", "1"], ["--partial-checkpoint-microbatches"]),
    _case(["explain", *TINY, "--schedule", "gpipe"], ["--schedule", "--pp"]),
    # --- timeouts and limits
    _case(["predict", *TINY, "--timeout", "0"], ["--timeout"]),
    _case(["predict", *TINY, "--pp", "2", "--timeout", "5"], ["--timeout"]),
    _case(["measure", *TINY, "--timeout", "0"], ["--timeout"]),
    _case(["measure", *TINY, "--timeout", "-3"], ["--timeout"]),
    _case(["measure", *TINY, "--timeout", "inf"], ["--timeout"]),
    _case(["compare", *TINY, "--pp", "2", "--timeout", "nan"], ["--timeout"]),
    _case(["measure", *TINY, "--pipeline-runtime", "megatron"], ["--pipeline-runtime"]),
    _case(["compare", *TINY, "--max-error", "-1"], ["--max-error"]),
    _case(["compare", *TINY, "--max-error", "nan"], ["--max-error"]),
    _case(["explain", *TINY, "--repeats", "-1"], ["--repeats"]),
    # --- output paths
    _case(["predict", *TINY, "--policy", "none", "--out", FILE], ["--out"]),
    _case(["predict", *TINY, "--pp", "2", "--out", FILE], ["--out"]),
    _case(["explain", *TINY, "--policies", "none", "--repeats", "0", "--no-plot", "--out", FILE], ["--out"]),
    _case(["plan", *TINY, "--budget", "1GiB", "--out", FILE], ["--out"]),
    # --- budgets (plan)
    _case([*PLAN, "garbage"], ["garbage"]),
    _case([*PLAN, "0"], ["budget"]),
    _case([*PLAN, "-5GiB"], ["budget"]),
    _case([*PLAN, "1e308TiB"], ["budget"]),
    _case([*PLAN, "0.5"], ["budget"]),
    _case([*PLAN, "10 parsecs"], ["parsecs"]),
    _case([*PLAN, "h100-80g", "--reserve", "garbage"], ["reserve"]),
    _case([*PLAN, "h100-80g", "--reserve", "1e308TiB"], ["reserve"]),
    _case([*PLAN, "h100-80g", "--reserve", "150%"], ["reserve"]),
    _case([*PLAN, "1GiB", "--reserve", "garbage"], ["reserve"]),
    _case([*PLAN, "1GiB", "--pp", "0"], ["pp"]),
    _case([*PLAN, "1GiB", "--tp", "0"], ["tp"]),
    _case([*PLAN, "1GiB", "--selective-modules", "everything"], ["everything"]),
    # --- issue 25, silent flags: refused (exit 2, naming the flag) instead of accepted and ignored
    *[_case(["explain", *TINY, "--pp", "2", flag, value], [flag, "--pp"]) for flag, value in (
        ("--policies", "none"), ("--html", "x.html"), ("--snapshot", "x.pickle"), ("--repeats", "1"),
        ("--contrast-vocab", "0"))],
    _case([*PLAN, "1GiB", "--schedule", "gpipe"], ["--schedule gpipe", "--pp"]),
    _case([*PLAN, "1GiB", "--dp", "2", "--schedule", "gpipe"], ["--schedule gpipe", "--pp"]),
    _case([*PLAN, "1GiB", "--throughput", "100", "--roofline", "h100"], ["--throughput", "--roofline h100"]),
    _case([*PLAN, "1GiB", "--memory-bandwidth", "3000", "--roofline", "h100"], ["--memory-bandwidth", "--roofline"]),
    _case([*PLAN, "1GiB", "--objective", "extra_flops", "--measured-times"], ["--measured-times", "--objective"]),
    _case([*PLAN, "1GiB", "--objective", "extra_flops", "--roofline", "h100"], ["--roofline", "--objective"]),
    _case([*PLAN, "h100-80g", "--reserve", "1.5"], ["--reserve 1.5", "fraction", "%"]),
    _case([*PLAN, "1GiB", "--reserve", "2.0"], ["--reserve 2.0", "fraction"]),
    # errors about the options name remat plan's flag and the value given, not PlanOptions' field
    _case([*PLAN, "1GiB", "--microbatches", "4"], ["--microbatches 4:", "--pp"]),
    _case([*PLAN, "1GiB", "--reserve", "garbage"], ["--reserve garbage:"]),
    _case([*PLAN, "1GiB", "--min-offloaded-tensor-size", "5"], ["--min-offloaded-tensor-size 5:"]),
    _case([*PLAN, "1GiB", "--throughput", "-1"], ["--throughput", "positive"]),
    _case([*PLAN, "1GiB", "--bandwidth", "nan"], ["--bandwidth", "positive"]),
    _case([*PLAN, "1GiB", "--operator-sets", "-2"], ["--operator-sets", "-1 for all"]),
    # MoE values Megatron's flags give: finite, capacity factor > 0, loss coefficients >= 0
    *[_case(["predict", "--megatron-args", f"{MOE} {flag} {value}"], [flag, value]) for flag, value in (
        ("--moe-expert-capacity-factor", "nan"), ("--moe-expert-capacity-factor", "inf"),
        ("--moe-aux-loss-coeff", "-0.5"), ("--moe-aux-loss-coeff", "nan"), ("--moe-z-loss-coeff", "-1"))],
    # numbers are written with the digits 0-9 (NOTE [ASCII digits] in remat.units), as policies and budgets are
    *[_case(["predict", *TINY, "--layers", value], ["--layers", "digits 0-9"]) for value in ("٣", "２", "1_0")],
    _case(["plan", *TINY, "--budget", "1GiB", "--tp", "２"], ["--tp", "digits 0-9"]),
    _case(["predict", *TINY, "--dropout", "０.1"], ["--dropout", "digits 0-9"]),
    _case(["predict", *TINY, "--pp", "2", "--layout", "١,١"], ["--layout"]),
    _case(["explain", *TINY, "--repeats", "1_0"], ["--repeats", "digits 0-9"]),
    *[_case(["predict", "--megatron-args", DENSE.replace("--num-layers 2", f"--num-layers {value}")],
            ["--num-layers", value]) for value in ("٣", "２", "1_0")],
    _case(["predict", "--megatron-args", f"{DENSE} --hidden-dropout ０.1"], ["--hidden-dropout"]),
    # --- issue 25, output paths: checked before the work (test_an_unwritable_out_is_refused_before_the_work)
    _case(["predict", *TINY, "--policy", "none", "--out", "/"], ["--out /:", "is a folder"]),
    _case(["predict", *TINY, "--policy", "none", "--out", ""], ["--out .:", "is a folder"]),
    _case(["predict", *TINY, "--policy", "none", "--out", "/proc/x.json"], ["--out /proc/x.json:", "cannot write in"]),
    _case([*PLAN, "1GiB", "--out", "/"], ["--out /:", "is a folder"]),
    _case(["explain", *TINY, "--policies", "none", "--repeats", "0", "--no-plot", "--html", "/proc/x.html"],
          ["--html /proc/x.html:", "cannot write in /proc"]),
    _case(["explain", *TINY, "--policies", "none", "--repeats", "0", "--no-plot", "--snapshot", "/proc/x.pickle"],
          ["--snapshot /proc/x.pickle:", "cannot write in /proc"]),
    # --- issue 25, misspelled Megatron flags: the flag meant is named; an odd flag is shown escaped, whole
    *[_case(["predict", "--megatron-args", f"{DENSE} {flag}"], [flag.split()[0], f"did you mean {meant}?"])
      for flag, meant in (("--num-layer 2", "--num-layers"), ("--sequence_parallel", "--sequence-parallel"),
                          ("--tensor-parallel-size 2", "--tensor-model-parallel-size"))],
    _case(["predict", "--megatron-core", "--megatron-args", f"{DENSE} --num-layer 2"],
          ["--num-layer", "did you mean --num-layers?"]),
    _case(["predict", "--megatron-args", f"{DENSE} '--foo\nbar'"], ["'--foo\\nbar'", "changes memory"]),
    # --- issue 25, a negative size is the flag's value, refused as negative (not "expected one argument")
    _case([*PLAN, "-1GiB"], ["--budget -1GiB:", "negative"]),
    _case([*PLAN, "h100-80g", "--reserve", "-2GiB"], ["--reserve", "negative"]),
    # --- issue 24, the job page: an unwritable --html is refused before the work; --html/--gpu need a whole job
    _case(["predict", *TINY, "--dp", "2", "--html", "/proc/x.html"], ["--html /proc/x.html:", "cannot write in"]),
    _case(["predict", *TINY, "--dp", "2", "--html", FILE], ["--html", "not a folder"]),
    _case([*PLAN, "1GiB", "--dp", "2", "--html", "/"], ["--html /:", "is a folder"]),
    _case(["predict", *TINY, "--policy", "none", "--html", "x.html"], ["--html", "whole", "remat explain --html"]),
    _case(["predict", *TINY, "--pp", "2", "--html", "x.html"], ["--html", "per pipeline stage"]),
    _case([*PLAN, "1GiB", "--html", "x.html"], ["--html", "whole"]),
    _case(["predict", *TINY, "--policy", "none", "--gpu", "h100-80g"], ["--gpu", "whole"]),
    _case(["predict", *TINY, "--dp", "2", "--gpu", "h999"], ["--gpu", "h100-80g"]),
    _case(["predict", "--megatron-core", "--megatron-args", DENSE, "--html", "x.html"], ["--html", "--megatron-core"]),
    # --- issue 26, launch scripts and lower bounds (tests/cli/test_megatron_script.py has the scripts themselves)
    _case(["predict", "--megatron-script"], ["--megatron-script needs the launch script"]),
    _case(["plan", "--budget", "1GiB", "--megatron-script"], ["--megatron-script needs the launch script"]),
    _case(["predict", "--megatron-script", "/nonexistent/train.sh"], ["--megatron-script", "/nonexistent/train.sh"]),
    _case(["compare", "--megatron-script", "/proc/version"], ["--megatron-script /proc/version", "without calling"]),
    _case(["explain", *TINY, "--megatron-script", "x.sh"], ["--megatron-script", "whole Megatron job"]),
    _case(["predict", "--megatron-args", DENSE, "--megatron-script", "x.sh"], ["--megatron-script with --megatron-"]),
    _case(["predict", "--script-timeout", "0", "--megatron-script", "x.sh"], ["--script-timeout"]),
    _case(["predict", "--script-timeout", "2", "--megatron-args", DENSE], ["--script-timeout", "--megatron-script"]),
    _case(["predict", "--world-size", "0", "--megatron-args", DENSE], ["--world-size"]),
    _case(["predict", "--world-size", "3", "--megatron-args", f"{DENSE} --tensor-model-parallel-size 2"],
          ["--world-size 3"]),
    _case(["predict", *TINY, "--world-size", "8"], ["--world-size", "--megatron-args or --megatron-script"]),
    _case(["predict", *TINY, "--allow-unmodelled", "fp8-format"], ["--allow-unmodelled", "--megatron-args"]),
    _case(["predict", "--allow-unmodelled", "fp4-recipe", "--megatron-args", f"{DENSE} --fp4-format e2m1"],
          ["--allow-unmodelled --fp4-recipe", "no such flag", "--fp4-format"]),
    _case(["predict", "--allow-unmodelled", "lr", "--megatron-args", f"{DENSE} --lr 1"],
          ["--allow-unmodelled --lr", "only refused flags"]),
    _case(["predict", "--allow-unmodelled", "bf16", "--megatron-args", f"{DENSE} --bf16 --fp16"],
          ["--allow-unmodelled --bf16", "modelled"]),
    _case(["predict", "--allow-unmodelled", "cpu-offloading", "--megatron-args", f"{DENSE} --cpu-offloading"],
          ["--allow-unmodelled --cpu-offloading", "overstate"]),
    _case(["plan", "--budget", "1GiB", "--allow-unmodelled", "--fp8-*", "--megatron-args", DENSE],
          ["--allow-unmodelled", "expected one argument"]),
    # --- issue 24: reserved memory and PyTorch's viewer on the job path
    _case(["predict", *TINY, "--dp", "2", "--alloc-conf", "foo:1"], ["--alloc-conf", "unknown allocator option"]),
    _case(["predict", *TINY, "--dp", "2", "--alloc-conf", "expandable_segments:true"], ["--alloc-conf", "True"]),
    _case(["predict", *TINY, "--dp", "2", "--alloc-conf", "max_split_size_mb:10"], ["--alloc-conf", ">= 20"]),
    _case(["predict", *TINY, "--policy", "none", "--alloc-conf", "expandable_segments:True"],
          ["--alloc-conf", "replays nothing"]),
    _case(["predict", *TINY, "--pp", "2", "--alloc-conf", "expandable_segments:True"], ["--alloc-conf"]),
    _case(["predict", *TINY, "--policy", "none", "--snapshot", "x.pickle"], ["--snapshot", "remat explain --snapshot"]),
    _case(["predict", *TINY, "--dp", "2", "--snapshot", "/proc/x.pickle"], ["--snapshot /proc/x.pickle"]),
    _case(["predict", *TINY, "--dp", "2", "--snapshot", FILE], ["--snapshot"]),
    _case(["predict", "--megatron-core", "--megatron-args", DENSE, "--snapshot", "x.pickle"],
          ["--snapshot", "--megatron-core"]),
    _case([*PLAN, "1GiB", "--dp", "2", "--snapshot", "/"], ["--snapshot /"]),
    _case([*PLAN, "1GiB", "--snapshot", "x.pickle"], ["--snapshot", "one process"]),
    _case([*PLAN, "1GiB", "--alloc-conf", "expandable_segments:True"], ["--alloc-conf", "--budget-reserved"]),
    _case([*PLAN, "h100-80g", "--dp", "2", "--budget-reserved", "--budget-allocated"],
          ["--budget-reserved with --budget-allocated"]),
    _case(["predict", "--megatron-args",
           f"PYTORCH_CUDA_ALLOC_CONF=foo:1 torchrun --nproc-per-node 1 pretrain_gpt.py {DENSE}"],
          ["--megatron-args", "PYTORCH_CUDA_ALLOC_CONF=foo:1", "unknown allocator option"]),
    _case(["predict", "--alloc-conf", "expandable_segments:True", "--megatron-args",
           f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True torchrun --nproc-per-node 1 pretrain_gpt.py {DENSE}"],
          ["--alloc-conf with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True", "drop one"]),
]

ACCEPTED = [  # legitimate edge inputs: exit 0
    _case(["--version"], [], code=0),
    _case(["predict", "--help"], [], code=0),
    _case(["predict", *TINY, "--policy", "none", "--json"], [], code=0),
    _case(["predict", *TINY, "--pp", "2", "--policy", "none", "--json"], [], code=0),
    _case(["predict", *TINY, "--pp", "2", "--microbatches", "1000000", "--policy", "full/uniform/1"], [], code=0),
    _case(["predict", *FOUR, "--pp", "2", "--vpp", "2", "--schedule", "interleaved", "--microbatches", "100000",
           "--pipeline-runtime", "megatron", "--policy", "none"], [], code=0),
    _case(["predict", *FOUR, "--pp", "3", "--layout", "2,1,1", "--policy", "none"], [], code=0),
    _case(["predict", *TINY, "--pp", "1", "--policy", "none"], [], code=0),
]


@pytest.mark.parametrize("argv,names,code", ERRORS + ACCEPTED)
def test_bad_input_is_one_line_naming_the_flag(alarm, capsys, argv, names, code):
    assert main(argv) == code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    if code == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("remat: error: "), err
        for name in names:
            assert name in lines[0], (name, lines[0])


def test_the_sweep_is_wide():
    assert len(ERRORS) + len(ACCEPTED) >= 80
    commands = {case.values[0][0] for case in ERRORS if case.values[0]}
    assert {"predict", "compare", "explain", "measure", "plan"} <= commands


def test_unwritable_out_leaves_nothing_behind(tmp_path: Path, capsys):
    target = tmp_path / "report.json"
    target.mkdir()  # a directory where the file should go
    assert main(["predict", *TINY, "--pp", "2", "--out", str(target)]) == 2
    assert "--out" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == [target] and not list(target.iterdir())


@pytest.mark.parametrize("argv", [
    ["predict", *TINY, "--policy", "none", "--out", "/"],
    ["predict", *TINY, "--policy", "none", "--out", ""],
    ["predict", *TINY, "--policy", "none", "--out", FILE],
    ["predict", *TINY, "--policy", "none", "--out", "/proc/x.json"],  # root may write anywhere, but not there
    [*PLAN, "1GiB", "--out", "/"],
    [*PLAN, "1GiB", "--out", FILE],
], ids=lambda argv: " ".join(argv[:1] + argv[-2:]))
def test_an_unwritable_out_is_refused_before_the_work(monkeypatch, capsys, argv):
    import remat.cli.plan as cli_plan
    import remat.cli.predict as cli_predict

    def work(*args, **kwargs):
        raise AssertionError("the work ran before --out was checked")

    monkeypatch.setattr(cli_predict, "predict_policies", work)
    monkeypatch.setattr(cli_plan, "plan", work)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("remat: error: --out ") and err.count("\n") == 1, err
