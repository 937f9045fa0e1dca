"""The pipeline flags of remat's commands: refused when they would be ignored, and every fix an error suggests
is accepted when applied."""

from __future__ import annotations

import json
import re

import pytest

from remat.cli import main

TINY = ["--layers", "2", "--hidden", "32", "--heads", "2", "--seq", "16", "--batch", "1", "--vocab", "64"]
FOUR = ["--layers", "4", "--hidden", "32", "--heads", "2", "--seq", "16", "--batch", "1", "--vocab", "64"]
SUGGESTION = re.compile(r"\((--[^)]*)\)")  # a fix is written as '(--flag value ...)'
FLAG_VALUE = re.compile(r"(--[a-z-]+)(?: ([^\s,()]+(?:,[^\s,()]+)*))?")


def _error(capsys, argv):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("remat: error: ") and "\n" not in err
    return err


def _apply(argv, fix):
    """``argv`` with the flags of ``fix`` ('--pp 2 --vpp 1') set to its values."""
    out = list(argv)
    for flag, value in FLAG_VALUE.findall(fix):
        if flag in out:
            i = out.index(flag)
            out[i + 1] = value
        else:
            out += [flag, value]
    return out


@pytest.mark.parametrize("argv", [
    ["predict", *TINY, "--pp", "4"],  # suggested --layout 1,1,1,1 before, itself refused
    ["predict", *TINY, "--pp", "2", "--vpp", "3", "--schedule", "interleaved"],
    ["predict", *TINY, "--pp", "2", "--vpp", "2"],
    ["predict", *FOUR, "--pp", "2", "--vpp", "3", "--schedule", "interleaved"],
    ["predict", *FOUR, "--pp", "2", "--vpp", "2"],
    ["predict", *FOUR, "--pp", "3"],
    ["predict", *FOUR, "--pp", "4", "--microbatches", "2"],
    ["predict", *TINY, "--pp", "2", "--schedule", "interleaved"],
    ["predict", *FOUR, "--pp", "2", "--vpp", "2", "--schedule", "interleaved", "--microbatches", "3"],
    ["predict", *TINY, "--pp", "2", "--policy", "full/uniform/2"],
    ["compare", *TINY, "--pp", "3"],  # applied to predict below: compare would measure for real
])
def test_every_suggested_fix_is_accepted(capsys, argv):
    err = _error(capsys, argv)
    fixes = SUGGESTION.findall(err)
    policy = re.search(r"e\.g\. (full/\S+)$", err)
    assert fixes or policy, err
    runs = [_apply(argv, fix) for fix in fixes]
    if policy:
        runs.append(_apply(argv, f"--policy {policy.group(1)}"))
    for fixed in runs:
        fixed = ["predict", *fixed[1:], "--json"] + ([] if "--policy" in fixed else ["--policy", "none"])
        assert main(fixed) == 0, (err, fixed, capsys.readouterr().err)
        assert json.loads(capsys.readouterr().out)["stages"]


@pytest.mark.parametrize("argv,words", [
    (["predict", *TINY, "--pp", "0"], ["--pp", "positive"]),  # ran as pp=1
    (["measure", *TINY, "--timeout", "0"], ["--timeout", "positive"]),  # ran with 120 s
    (["predict", *TINY, "--vpp", "2"], ["--vpp 2", "--pp", "--schedule interleaved"]),  # ignored
    (["predict", *TINY, "--pp", "2", "--timeout", "9"], ["--timeout"]),  # ignored: a prediction runs no process
    (["compare", *TINY, "--pp", "2", "--pipeline-runtime", "megatron"], ["--pipeline-runtime"]),  # ignored
])
def test_values_that_were_silently_replaced_are_refused(capsys, argv, words):
    err = _error(capsys, argv)
    for word in words:
        assert word in err


def test_measure_keeps_its_one_stage_default(capsys):
    """``remat measure`` without --pp measures one stage, so its pipeline flags are not refused for lack of --pp
    (this one is refused for what it is: 3 microbatches of a 1-stage interleaved schedule)."""
    err = _error(capsys, ["measure", *TINY, "--schedule", "interleaved", "--vpp", "2"])
    assert "pp >= 2" in err and "--pp" not in err.split("use")[0]


def test_a_million_microbatches_are_predicted_in_bounded_time(capsys):
    assert main(["predict", *TINY, "--pp", "2", "--microbatches", "1000000", "--policy", "full/uniform/1",
                 "--json"]) == 0
    stages = json.loads(capsys.readouterr().out)["stages"]
    assert [s["microbatches"] for s in stages] == [1_000_000, 1_000_000]
    assert all(s["extended_from"] and max(s["extended_from"]) < 100 for s in stages)
