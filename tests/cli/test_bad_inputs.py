"""A sweep of bad and edge inputs over every subcommand, run in-process through ``remat.cli.main``.

Each case must end in bounded time with exit code 2 and one ``remat: error: ...`` line on stderr that names the
flag (or the field) to fix, never a traceback; the few legitimate edge inputs must exit 0. Every case is small:
the errors come before any model is built, and the accepted inputs use a 2-layer toy model.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from remat.cli import main

TINY = ["--layers", "2", "--hidden", "32", "--heads", "2", "--seq", "16", "--batch", "1", "--vocab", "64"]
FOUR = ["--layers", "4", "--hidden", "32", "--heads", "2", "--seq", "16", "--batch", "1", "--vocab", "64"]
CASE_SECONDS = 60  # far above any case (the slowest traces a toy model for a few seconds)
FILE = "/proc/version/nope.json"  # under a file: no directory can be made there
PLAN = ["plan", *TINY, "--budget"]


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


@pytest.fixture
def alarm():
    """Each case ends within CASE_SECONDS (an unbounded one raises here instead of hanging the suite)."""

    def expired(signum, frame):
        raise TimeoutError(f"the case ran for more than {CASE_SECONDS} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(CASE_SECONDS)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


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
