"""No speed-up may change an answer: the ``--json`` of the README's and the guides' whole-job commands, and every
row of ``benchmarks/bench_megatron_golden.py``, equal the copies saved in ``tests/data/answers/`` (wall-clock fields
aside).

The copies were written by the tree before the speed work (issue 23) and are rewritten only when an answer is
meant to change (say so in the commit): ``python tests/cli/test_saved_answers.py --write``."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest

from remat.cli import main

ROOT = Path(__file__).resolve().parents[2]
SAVED = ROOT / "tests" / "data" / "answers"
GOLDEN = "golden-rows"  # the saved rows of benchmarks/bench_megatron_golden.py
COMMANDS = {
    "predict-70b": "predict --preset llama3-70b --tp 8 --sp --pp 4 --microbatches 8 --dp 8 --distributed-optimizer "
                   "--policy full/uniform/1",
    "predict-70b-cp2": "predict --preset llama3-70b --tp 8 --sp --pp 4 --cp 2 --dp 8 --distributed-optimizer",
    "predict-mixtral": "predict --preset mixtral-8x7b --pp 4 --microbatches 8 --dp 8 --ep 8 --distributed-optimizer",
    "predict-deepseek-v3": "predict --preset deepseek-v3 --pp 16 --microbatches 32 --dp 64 --ep 64 "
                           "--distributed-optimizer --decoder-first-pipeline-num-layers 1 "
                           "--decoder-last-pipeline-num-layers 4 --policy selective/moe_act",
    "sweep-70b": "predict --preset llama3-70b --sweep megatron",
    "plan-70b-40g": "plan --budget 40GiB --preset llama3-70b --tp 8 --sp --pp 4 --microbatches 8 --dp 8 "
                    "--distributed-optimizer",
    "plan-70b-50g": "plan --budget 50GiB --preset llama3-70b --tp 8 --sp --pp 4 --microbatches 8 --dp 8 "
                    "--distributed-optimizer",
}


def without_clock(value: Any) -> Any:
    """``value`` without the fields that time this run (``*_seconds``, ``seconds``): they are not answers."""
    if isinstance(value, dict):
        return {k: without_clock(v) for k, v in value.items() if not (k == "seconds" or k.endswith("_seconds"))}
    if isinstance(value, list):
        return [without_clock(v) for v in value]
    return value


def answer(name: str) -> Any:
    """The ``--json`` answer of :data:`COMMANDS` ``[name]``, in this process, with the disk cache off."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main([*shlex.split(COMMANDS[name]), "--json", "--no-cache"])
    assert code == 0, f"remat {COMMANDS[name]} failed"
    return without_clock(json.loads(out.getvalue()))


def golden_rows() -> list[dict[str, Any]]:
    """Every row of ``benchmarks/bench_megatron_golden.py`` (its ``--json``), computed in this process."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location("bench_megatron_golden", ROOT / "benchmarks" /
                                                      "bench_megatron_golden.py")
        bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    cases = json.loads(bench.DATA.read_text())["cases"]
    return without_clock(json.loads(json.dumps([bench.run_case(case) for case in cases], default=str)))


def test_the_golden_rows_are_the_saved_ones() -> None:
    saved = json.loads((SAVED / f"{GOLDEN}.json").read_text())["answer"]
    rows = golden_rows()
    assert [r["case"] for r in rows] == [r["case"] for r in saved]
    for row, copy in zip(rows, saved):
        assert row == copy, row["case"]


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_the_answer_is_the_saved_one(name: str) -> None:
    saved = json.loads((SAVED / f"{name}.json").read_text())
    assert saved["command"] == COMMANDS[name], "the command changed: write its copy again (see the module)"
    assert answer(name) == saved["answer"]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="write the saved answers")
    parser.add_argument("--write", action="store_true", required=True)
    parser.add_argument("--only", default="", help="commands whose name contains this")
    SAVED.mkdir(parents=True, exist_ok=True)
    for name in (n for n in [*COMMANDS, GOLDEN] if parser.parse_args().only in n):
        command = COMMANDS.get(name, "python benchmarks/bench_megatron_golden.py --json FILE")
        copy = golden_rows() if name == GOLDEN else answer(name)
        text = json.dumps({"command": command, "answer": copy}, indent=1, sort_keys=True)
        (SAVED / f"{name}.json").write_text(text + "\n")
        print(f"wrote {SAVED / name}.json")
