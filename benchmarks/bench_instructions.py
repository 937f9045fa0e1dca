#!/usr/bin/env python
"""The instructions one ``remat`` command executes, counted by valgrind's callgrind, for two trees side by side:
the machine's load moves every timing by 10-20% (``bench_cli_time.py`` needs many rounds to see a change of a few
percent), an instruction count moves by less than 0.1% from one run to the next.

The command runs as the console script runs it (:func:`remat.cli.console_imports`, its imports counted) in one
process (``REMAT_TRACE_WORKERS=1``: the same work, in order, as the forked workers share it), with
``PYTHONHASHSEED=0``, once per tree, the two trees at once (callgrind slows a process about 50 times: the 70B plan
takes 4-5 minutes). Printed: each tree's count and new/base. Each tree's ``src`` should hold its compiled modules
(``python -m compileall -q SRC``), else their compilation is counted too. Instructions are not seconds (a numpy call
retires its instructions faster than Python's loop does): read the ratio as the CPU work a change removed, and
time the command with ``bench_cli_time.py``.

Usage::

    python benchmarks/bench_instructions.py --base /tmp/base/src --new src -- plan --budget 50GiB \\
        --preset llama3-70b --tp 8 --sp --pp 4 --microbatches 8 --dp 8 --distributed-optimizer --no-cache
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

RUN = """
import contextlib, io, sys
from remat.cli import console_imports
with console_imports():
    from remat.cli.commands import run
with contextlib.redirect_stdout(io.StringIO()):
    code = run(sys.argv[1:], console=True)
sys.exit(code)
"""


def start(src: str, argv: list[str], log: str) -> subprocess.Popen[bytes]:
    """callgrind counting ``remat argv`` with ``src`` first on the path; its report goes to ``log``."""
    env = {**os.environ, "PYTHONPATH": src, "PYTHONHASHSEED": "0", "REMAT_TRACE_WORKERS": "1"}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return subprocess.Popen(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", f"--log-file={log}",
                             sys.executable, "-c", RUN, *argv], env=env, cwd=tempfile.gettempdir(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def instructions(log: str) -> int:
    """The count callgrind's report in ``log`` gives (``I refs``)."""
    with open(log) as f:
        found = re.findall(r"I\s+refs:\s+([\d,]+)", f.read())
    if not found:
        raise SystemExit(f"no instruction count in {log}: did the command run? (see the file)")
    return int(found[-1].replace(",", ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the baseline tree's src directory")
    parser.add_argument("--new", default="src", help="the measured tree's src directory (default: src)")
    parser.add_argument("argv", nargs=argparse.REMAINDER, help="-- then the remat command's arguments")
    args = parser.parse_args()
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not argv:
        parser.error("give the remat command after --, e.g. -- predict --preset llama3-70b --no-cache")
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed: this benchmark counts instructions with its callgrind tool")
    with tempfile.TemporaryDirectory() as tmp:
        logs = {name: os.path.join(tmp, f"{name}.log") for name in ("base", "new")}
        procs = {name: start(os.path.abspath(src), argv, logs[name])
                 for name, src in (("base", args.base), ("new", args.new))}
        for proc in procs.values():
            proc.wait()
        counts = {name: instructions(log) for name, log in logs.items()}
    print(f"remat {' '.join(argv)}")
    print(f"  base {counts['base']:>16,} instructions ({args.base})")
    print(f"  new  {counts['new']:>16,} instructions ({args.new})")
    print(f"  new/base {counts['new'] / counts['base']:.4f}")


if __name__ == "__main__":
    main()
