"""The README's examples run as written: every Python block executes, every ``remat`` command line parses, and
the figures quoted beside a command are what that command prints."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from remat.cli import build_parser, main

README = Path(__file__).resolve().parents[2] / "README.md"
TEXT = README.read_text()


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", TEXT, flags=re.S)


def remat_command_lines() -> list[str]:
    lines = []
    for block in blocks("bash"):
        for line in block.splitlines():
            command = line.split("#")[0].strip()
            lines += [part.strip() for part in command.split("&&") if part.strip().startswith("remat")]
    return lines


def test_the_readme_has_examples() -> None:
    assert len(blocks("python")) >= 2 and len(remat_command_lines()) >= 10


@pytest.mark.parametrize("index", range(len(blocks("python"))))
def test_python_block_runs(index: int) -> None:
    exec(compile(blocks("python")[index], f"README.md python block {index}", "exec"), {"__name__": "readme"})


@pytest.mark.parametrize("line", remat_command_lines())
def test_command_line_parses(line: str) -> None:
    args = shlex.split(line)[1:]
    build_parser().parse_args(args)  # argparse exits (SystemExit) on a flag that does not exist


def test_non_matmul_figures_are_what_predict_prints(capsys) -> None:
    match = re.search(r"`(remat predict --layers 8 [^`]*non_matmul\+matmul_k32)`:\s*none ([\d.]+) MiB, "
                      r"`non_matmul` ([\d.]+) MiB \(0% extra compute\), `non_matmul\+matmul_k32` ([\d.]+) MiB "
                      r"\(([\d.]+)%\)", TEXT)
    assert match, "the README's non_matmul sentence changed: update this test with it"
    command, *figures = match.groups()
    assert main([*shlex.split(command)[1:], "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    printed = [f"{row['peak_bytes'] / 2**20:.1f}" for row in rows]
    assert printed == figures[:3]
    assert f"{rows[2]['extra_compute_pct']:.1f}" == figures[3]
