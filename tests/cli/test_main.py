"""``remat`` itself: --version, a missing command, and everyday use of every subcommand (JSON on stdout, errors
in one line); the shared policy-list flag."""

from __future__ import annotations

import pytest

import remat.cli
from remat.cli import main
from remat.cli.common import parse_policy_list
from remat.policy import PolicyError


def _subcommands():
    from remat.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return {name: ({o for a in p._actions for o in a.option_strings},
                   {a.option_strings[0] if a.option_strings else a.dest for a in p._actions if a.required})
            for name, p in sub.choices.items()}


SUBCOMMANDS = _subcommands()
# --policies (explain, measure): two policies, not the default list of six, each measured for real; the default
# list is tests/analysis/test_explain.py's and predict's and compare's (--policy) here.
TINY_FLAGS = {"--layers": "2", "--hidden": "32", "--heads": "2", "--seq": "16", "--batch": "1", "--vocab": "64",
              "--repeats": "0", "--policies": "none,full/uniform/2"}
REQUIRED_VALUES = {"--budget": "1GiB"}  # values for the subcommands' required options


def _tiny_args(name: str, tmp_path) -> list[str]:
    options, required = SUBCOMMANDS[name]
    if "--layers" not in options:
        pytest.skip(f"remat {name} does not take the model flags")
    unknown = required - set(REQUIRED_VALUES)
    if unknown:
        pytest.skip(f"remat {name} requires {', '.join(sorted(unknown))}: add a value to REQUIRED_VALUES")
    args = [x for flag, value in {**TINY_FLAGS, **REQUIRED_VALUES}.items() if flag in options for x in (flag, value)]
    if "--no-plot" in options:
        args.append("--no-plot")
    if "--out" in options:
        args += ["--out", str(tmp_path / f"{name}-out")]
    return args


def test_version(capsys):
    from remat import __version__

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"remat {__version__}"


def test_a_missing_command_is_a_usage_error(capsys):
    assert main([]) == 2  # --version is test_version's
    assert capsys.readouterr().err.startswith("remat: error: ")


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_every_subcommand_prints_json(name, tmp_path, capsys):
    import json

    assert "--json" in SUBCOMMANDS[name][0], f"remat {name} has no --json"
    assert main([name, *_tiny_args(name, tmp_path), "--json"]) == 0
    json.loads(capsys.readouterr().out)  # stdout is the JSON document and nothing else


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_every_subcommand_errors_in_one_line(name, tmp_path, capsys):
    from remat.config import ConfigError

    args = _tiny_args(name, tmp_path)
    args[args.index("--layers") + 1] = "0"  # refused by the flag's type: a usage error naming the flag
    assert main([name, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("remat: error: ") and err.count("\n") == 1 and "--layers" in err, err
    args[args.index("--layers") + 1] = "2"
    args[args.index("--heads") + 1] = "3"  # a valid number, a model that cannot be: ConfigError names the fields
    assert main([name, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("remat: error: ") and err.count("\n") == 1 and "num_attention_heads=3" in err, err
    with pytest.raises(ConfigError):
        main(["--debug", name, *args])


# ------------------------------------------------------------------------------------------------ shared flags
def test_parse_policy_list_keeps_options():
    assert parse_policy_list("none, full/uniform/2,distribute,selective") == [
        "none", "full/uniform/2,distribute", "selective"]
    assert parse_policy_list(None) is None
    with pytest.raises(PolicyError):
        parse_policy_list(" , ")



def test_only_the_console_script_freezes_the_collector_before_it_exits(monkeypatch, tmp_path, capsys):
    import gc
    import sys

    args = ["plan", *_tiny_args("plan", tmp_path), "--json"]
    before = gc.get_freeze_count()  # (tests/conftest.py freezes what is alive when a module starts)
    assert main(args) == 0 and gc.get_freeze_count() <= before  # called with arguments (a library, a test)
    before = gc.get_freeze_count()
    monkeypatch.setattr(sys, "argv", ["/venv/bin/remat", *args])  # what the console script runs, then exits
    ended: list[int] = []
    monkeypatch.setattr(remat.cli, "exit_now", ended.append)  # (the real one would end this test's process)
    thresholds = gc.get_threshold()
    try:
        assert main() == 0 and ended == [0]  # the console script ends its process there (NOTE [the console's exit])
        # the youngest generation is collected less often (NOTE [the collector and the imports])
        assert gc.get_threshold() == (remat.cli.YOUNG_GENERATION_THRESHOLD, *thresholds[1:])
    finally:
        gc.set_threshold(*thresholds)
    assert gc.get_freeze_count() > before  # nothing it holds is collected again: exiting skips that


EXIT_NOW = """
import atexit, sys, threading
from remat.cli import exit_now
atexit.register(lambda: print("the exit handler ran", flush=True))
print("x" * 200_000)  # more than a pipe's buffer: written out before the process ends
if sys.argv[1] == "thread":
    threading.Thread(target=lambda: print("the thread ran", flush=True), daemon=False).start()
    threading.Thread(target=threading.Event().wait, daemon=True).start()  # still running at exit_now, however late
exit_now(3)
print("returned: the usual exit")
"""


@pytest.mark.parametrize("case", ["alone", "thread"])
def test_the_console_exit_keeps_output_and_exit_handlers(case):
    """exit_now ends the process with the code after flushing stdout and running atexit's handlers; with another
    thread running it returns, and the process exits as usual (NOTE [the console's exit])."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", EXIT_NOW, case], capture_output=True, text=True, timeout=120)
    lines = proc.stdout.splitlines()
    assert lines[0] == "x" * 200_000, proc.stderr
    if case == "alone":
        assert proc.returncode == 3 and lines[1:] == ["the exit handler ran"]
    else:
        assert proc.returncode == 0 and "returned: the usual exit" in lines and lines[-1] == "the exit handler ran"
