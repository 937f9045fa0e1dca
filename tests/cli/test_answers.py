"""Stored answers (remat.cli.answers): a repeated ``remat predict``/``plan`` prints what the first run printed,
without importing torch; anything the answer depends on (a file's contents, an environment variable) asks again;
commands that write files or time the machine, and searches a time cap cut, are never stored."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import remat.cache_state as cache_state
from remat.cli import main
from remat.cli.answers import KIND, answer_key

PREDICT = ["predict", "--layers", "2", "--hidden", "32", "--heads", "2", "--seq", "16", "--batch", "1",
           "--vocab", "64", "--policy", "none"]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv(cache_state.CACHE_ENV, str(folder))
    monkeypatch.delenv(cache_state.NO_CACHE_ENV, raising=False)
    return folder


def entries(folder: Path) -> list[Path]:
    return sorted((folder / KIND).glob("*.json"))


def run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_nothing_before_the_command_imports_torch() -> None:
    code = ("import sys, remat, remat.cli; from remat import __version__; "
            "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_repeated_answer_is_printed_from_the_cache_without_torch(cache: Path, capsys) -> None:
    first = run(capsys, *PREDICT, "--json")
    assert first[0] == 0 and len(entries(cache)) == 1
    code = (f"import sys; from remat.cli import main; code = main({PREDICT + ['--json']!r}); "
            "print('torch' in sys.modules, code, file=sys.stderr)")
    env = {**os.environ, cache_state.CACHE_ENV: str(cache)}
    env.pop("PYTEST_CURRENT_TEST", None)
    again = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert again.stdout == first[1] and json.loads(again.stdout)["rows"]
    assert again.stderr.splitlines()[-1] == "False 0"
    assert len(entries(cache)) == 1


def test_a_refusal_is_stored_with_its_exit_code(cache: Path, capsys) -> None:
    argv = [*PREDICT[:-2], "--policy", "full/uniform/3"]  # a group larger than the 2-layer stack
    first = run(capsys, *argv)
    assert first[0] == 2 and "remat: error:" in first[2] and len(entries(cache)) == 1
    assert run(capsys, *argv) == first


def test_a_changed_input_file_or_environment_asks_again(cache: Path, capsys, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "model.yaml"
    config.write_text("num_layers: 2\nhidden_size: 32\nnum_attention_heads: 2\nseq_length: 16\n"
                      "micro_batch_size: 1\nvocab_size: 64\n")
    argv = ["predict", "--config", str(config), "--policy", "none", "--json"]
    small = run(capsys, *argv)
    config.write_text(config.read_text().replace("vocab_size: 64", "vocab_size: 4096"))
    large = run(capsys, *argv)
    assert small[0] == large[0] == 0 and small[1] != large[1] and len(entries(cache)) == 2
    key = answer_key(argv)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert answer_key(argv) != key


@pytest.mark.parametrize("extra", [["--out", "{tmp}/report.json"], ["--no-cache"], ["--snap={tmp}/s.pickle"]])
def test_commands_that_write_files_or_refuse_the_cache_are_not_stored(cache: Path, tmp_path: Path,
                                                                       extra: list[str]) -> None:
    argv = [*PREDICT, *(e.format(tmp=tmp_path) for e in extra)]
    assert answer_key(argv) is None  # --snap: argparse's abbreviation of --snapshot


def test_an_answer_a_time_cap_cut_is_not_stored(cache: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    import remat.cli.commands as commands

    real = commands.run

    def cut(argv, console=False):  # what the plan searches do when their time cap stops them
        code = real(argv, console=console)
        cache_state.not_repeatable()
        return code

    monkeypatch.setattr(commands, "run", cut)
    assert run(capsys, *PREDICT)[0] == 0 and entries(cache) == []
    monkeypatch.setattr(commands, "run", real)
    assert run(capsys, *PREDICT)[0] == 0 and len(entries(cache)) == 1


def test_a_corrupt_entry_is_asked_again_and_rewritten(cache: Path, capsys) -> None:
    first = run(capsys, *PREDICT)
    (entry,) = entries(cache)
    entry.write_text("{not json")
    assert run(capsys, *PREDICT) == first
    assert json.loads(entry.read_text())["code"] == 0


def test_other_commands_and_no_cache_are_never_stored(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert answer_key(["compare", "--layers", "2"]) is None and answer_key([]) is None
    monkeypatch.setenv(cache_state.NO_CACHE_ENV, "1")
    assert answer_key(PREDICT) is None
