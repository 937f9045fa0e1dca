"""benchmarks/profile_cli.py: where one cold run of a command spends its time (issue 23's profile, made by a script)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "profile_cli.py"
JOB = ["predict", "--preset", "llama3-70b", "--tp", "8", "--sp", "--pp", "4", "--cp", "2", "--dp", "8",
       "--distributed-optimizer"]


def profile(*args: str) -> list[str]:
    env = {**os.environ, "REMAT_TRACE_WORKERS": "2"}  # two workers however busy the machine is
    out = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env,
                         timeout=600, check=True)
    return out.stdout.splitlines()


def test_the_timeline_shows_each_workers_tasks_between_the_commands_start_and_end() -> None:
    lines = profile(*JOB)
    assert lines[0].endswith("--no-cache (exit 0)")
    start = float(next(line for line in lines if line.endswith("the command starts")).split()[0])
    end = float(next(line for line in lines if line.endswith("the command ends")).split()[0])
    imports = float(re.match(r"\s*0\.00 -\s*([\d.]+)\s+imports", lines[1]).group(1))
    assert 0 < imports <= start < end
    assert any(re.search(r"run_forked: \d+ tasks \(remat\.plan\.job_exact\)", line) for line in lines)
    tasks = [re.match(r"\s*([\d.]+) -\s*([\d.]+)\s+(worker \d+)\s+task \d+: ([\d.]+) s", line) for line in lines]
    tasks = [m for m in tasks if m]
    assert len({m.group(3) for m in tasks}) == 2  # the job's distinct stages, predicted side by side
    for m in tasks:
        begin, finish, seconds = float(m.group(1)), float(m.group(2)), float(m.group(4))
        assert start <= begin <= finish <= end and abs(finish - begin - seconds) <= 0.011
    assert re.match(r"CPU: this process [\d.]+ s, its workers [\d.]+ s; wall [\d.]+ s", lines[-1])


def test_the_serial_profile_names_the_stages_of_an_answer_within_the_commands_time() -> None:
    lines = profile("--serial", *JOB)
    assert lines[0].endswith("(exit 0), one process, under cProfile")
    total = float(re.search(r"the command\s+([\d.]+) s \(100%\)", lines[2]).group(1))
    areas = {m.group(1).strip(): float(m.group(2)) for m in (re.match(r"\s{4}(.+?)\s+([\d.]+) s \(", line)
                                                             for line in lines[3:]) if m}
    assert len(areas) == 8 and all(0 <= seconds <= total for seconds in areas.values())
    assert areas["chunk traces of a job's stages (laid out too)"] > 0
    assert areas["model traces (a single-process predict)"] == 0  # a job traces chunks, not a whole model
    assert areas["caching-allocator replays"] > 0  # a whole job's ranks are replayed for their reserved bytes
