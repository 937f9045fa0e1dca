"""The README's and the guides' (docs/*.md) examples run as written: every Python block executes, every ``remat``
command line parses, every ``python benchmarks/...`` line names a script and flags that exist, the figures quoted
beside a command are what that command prints, and the links and the site's navigation point at pages that
exist."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from remat.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TEXTS = {page.relative_to(ROOT).as_posix(): page.read_text() for page in PAGES}
README = TEXTS["README.md"]
COMMANDS = ("explain", "measure", "predict", "compare", "plan")


def blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def python_blocks() -> list[tuple[str, str]]:
    """(id, code) of every Python block, its id the page and the block's index there."""
    return [(f"{name}#{index}", code) for name, text in TEXTS.items()
            for index, code in enumerate(blocks(text, "python"))]


def shell_commands(program: str, text: str | None = None) -> list[str]:
    """The commands of ``bash`` blocks that start with ``program`` (``a && b`` is two commands; comments dropped)."""
    commands = []
    for block in blocks(text, "bash") if text is not None else [b for t in TEXTS.values() for b in blocks(t, "bash")]:
        for line in block.splitlines():
            command = line.split("#")[0].strip()
            commands += [part.strip() for part in command.split("&&") if part.strip().startswith(program)]
    return list(dict.fromkeys(commands))  # a command shown on two pages is checked once


def test_the_readme_and_guides_have_examples() -> None:
    assert len(blocks(README, "python")) >= 1 and len(python_blocks()) >= 4
    assert len(shell_commands("remat")) >= 20


def test_the_readme_has_one_example_per_command_and_the_two_set_up_commands() -> None:
    readme_commands = shell_commands("remat", README)
    for command in COMMANDS:
        assert any(line.split()[1] == command for line in readme_commands), f"no `remat {command}` example"
    # .ci/run runs the second one as the README's test command.
    assert "pip install . && remat explain " in README and "pip install -e '.[dev]' && pytest " in README


@pytest.mark.parametrize("code", [code for _, code in python_blocks()], ids=[name for name, _ in python_blocks()])
def test_python_block_runs(code: str, request: pytest.FixtureRequest) -> None:
    exec(compile(code, request.node.callspec.id, "exec"), {"__name__": "readme"})


@pytest.mark.parametrize("line", shell_commands("remat"))
def test_command_line_parses(line: str) -> None:
    args = shlex.split(line)[1:]
    build_parser().parse_args(args)  # argparse exits (SystemExit) on a flag that does not exist


@pytest.mark.parametrize("line", shell_commands("python benchmarks/"))
def test_benchmark_line_names_a_script_and_its_flags(line: str) -> None:
    _, script, *args = shlex.split(line)
    source = (ROOT / script).read_text()
    for flag in (arg for arg in args if arg.startswith("--")):
        assert f'"{flag}"' in source, f"{script} has no flag {flag}"


def test_links_point_at_pages_that_exist() -> None:
    for name, text in TEXTS.items():
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target) or target.startswith("#"):
                continue
            assert ((ROOT / name).parent / target.split("#")[0]).is_file(), f"{name} links to {target}"


def test_every_guide_is_in_the_site() -> None:
    def pages(nav: list) -> list[str]:
        found = []
        for item in nav:
            value = next(iter(item.values())) if isinstance(item, dict) else item
            found += pages(value) if isinstance(value, list) else [value]
        return found

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert sorted(pages(config["nav"])) == sorted(page.name for page in PAGES[1:])
    assert "::: remat" in TEXTS["docs/reference.md"]  # mkdocstrings renders remat.__all__ from the docstrings


def test_non_matmul_figures_are_what_predict_prints(capsys) -> None:
    pattern = (r"`(remat predict --layers 8 [^`]*non_matmul\+matmul_k32)`:\s*none ([\d.]+) MiB, "
               r"`non_matmul` ([\d.]+) MiB \(0% extra compute\), `non_matmul\+matmul_k32` ([\d.]+) MiB "
               r"\(([\d.]+)%\)")
    matches = [match for text in TEXTS.values() for match in [re.search(pattern, text)] if match]
    assert matches, "the non_matmul sentence (docs/policies.md) changed: update this test with it"
    command, *figures = matches[0].groups()
    assert main([*shlex.split(command)[1:], "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    printed = [f"{row['peak_bytes'] / 2**20:.1f}" for row in rows]
    assert printed == figures[:3]
    assert f"{rows[2]['extra_compute_pct']:.1f}" == figures[3]
