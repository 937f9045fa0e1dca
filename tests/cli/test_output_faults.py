"""A run interrupted while it writes its folder (``remat measure --timelines``, ``remat explain --out``) leaves the
previous run's files whole, and no staging folder behind: ^C and SIGTERM remove theirs at once, a SIGKILL's is
removed by the next run. The kill lands mid-write deterministically: the process signals itself right after its
first timeline file is written (Timeline.save patched). Tiny models; the measurement stands in the prediction for
the multi-process run (tests/parallel has the real ones)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from remat.analysis.outputs import RunFolder, owner, remove_stale
from remat.cli import main
from remat.timeline import Timeline

TINY = ["--layers", "2", "--hidden", "32", "--heads", "2", "--seq", "16", "--batch", "1", "--vocab", "64"]
MEASURE = ["measure", *TINY, "--policies", "none,full/uniform/1"]
EXPLAIN = ["explain", *TINY, "--policies", "none,full/uniform/1", "--repeats", "0", "--no-plot",
           "--contrast-vocab", "0"]
# A `remat` process that signals itself (REMAT_TEST_SIGNAL) right after writing its first timeline file.
KILLED_MIDWAY = """
import os, signal, sys
import remat.cli.pipeline as cli_pipeline
from remat.cli import main
from remat.parallel.pipeline_predict import predict_pipeline
from remat.timeline import Timeline

def measured(config, policies, pp, m, schedule, vpp, layout, partial, **_):
    return [predict_pipeline(config, p, pp, m, schedule, vpp, layout, partial) for p in policies]

def save(self, path, real=Timeline.save):
    written = real(self, path)
    signal.raise_signal(getattr(signal, os.environ["REMAT_TEST_SIGNAL"]))
    return written

cli_pipeline.measure_pipeline_many = measured
Timeline.save = save
sys.exit(main(sys.argv[1:]))
"""


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _aside(folder: Path) -> list[str]:
    """What a run left beside ``folder``: hidden staged or old folders and temporary files."""
    return sorted(p.name for p in folder.parent.iterdir() if p.name.startswith("."))


def _previous(argv: list[str], folder: Path) -> dict[str, bytes]:
    """Run ``argv`` and mark each file it wrote as the previous run's (so a mix of old and new shows)."""
    assert main(argv) == 0
    for path in folder.iterdir():
        path.write_bytes(b"previous " + path.name.encode())
    return _files(folder)


def _killed(argv: list[str], how: signal.Signals) -> tuple[int, int, str]:
    """Run ``remat argv`` in a process that ``how`` ends after its first timeline file: (exit status, pid, stderr)."""
    env = dict(os.environ, REMAT_TEST_SIGNAL=how.name)
    with subprocess.Popen([sys.executable, "-c", KILLED_MIDWAY, *argv], env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True) as proc:
        _, err = proc.communicate(timeout=120)
    return proc.returncode, proc.pid, err


def test_sigint_while_measure_writes_its_folder_keeps_the_previous_one(tmp_path, measured_by_prediction,
                                                                        monkeypatch, capsys):
    folder = tmp_path / "timelines"
    argv = [*MEASURE, "--timelines", str(folder), "--out", str(folder / "report.json")]
    before = _previous(argv, folder)
    assert sorted(before) == ["measured-full-uniform-1-stage0.json", "measured-none-stage0.json", "report.json"]
    real = Timeline.save

    def save(self, path):
        written = real(self, path)
        signal.raise_signal(signal.SIGINT)  # ^C, right after the first new file
        return written

    monkeypatch.setattr(Timeline, "save", save)
    # Python's ^C handler, whatever this process inherited (a shell's background job starts with SIGINT ignored)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    capsys.readouterr()
    try:
        code = main(argv)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert code == 130
    assert capsys.readouterr().err.strip() == "remat: interrupted"
    assert _files(folder) == before and _aside(folder) == []


def test_sigkill_while_measure_writes_its_folder_keeps_the_previous_one(tmp_path, measured_by_prediction):
    folder = tmp_path / "timelines"
    argv = [*MEASURE, "--timelines", str(folder), "--out", str(folder / "report.json")]
    before = _previous(argv, folder)
    code, pid, err = _killed(argv, signal.SIGKILL)
    assert code == -signal.SIGKILL, err
    assert _files(folder) == before
    (stage,) = _aside(folder)  # a SIGKILL runs no clean-up: its staged folder, named after the dead process
    assert stage.startswith(f".timelines.{pid}@") and stage.endswith(".tmp")
    assert main(argv) == 0  # the next run removes it, and writes the folder whole
    assert _aside(folder) == [] and sorted(_files(folder)) == sorted(before)
    assert all(not content.startswith(b"previous") for content in _files(folder).values())


def test_sigterm_while_explain_writes_its_folder_keeps_the_previous_one(tmp_path):
    folder = tmp_path / "ex"
    argv = [*EXPLAIN, "--out", str(folder)]
    before = _previous(argv, folder)
    assert sorted(before) == ["explain.json", "timeline-full-uniform-1.json", "timeline-none.json"]
    code, _, err = _killed(argv, signal.SIGTERM)
    assert code == -signal.SIGTERM, err  # it still dies of the signal
    assert _files(folder) == before and _aside(folder) == []


def test_what_dead_runs_left_aside_is_removed(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # a pid that is gone
    host = owner().partition("@")[2]
    target = tmp_path / "out"
    target.mkdir()
    dead, live = f"{child.pid}@{host}", owner()
    stale = [tmp_path / f".out.{dead}.abc123.tmp", tmp_path / f".out.old-{dead}.xyz789"]
    kept = [tmp_path / f".out.{live}.abc123.tmp", tmp_path / f".out.{child.pid}@other-host.abc123.tmp",
            tmp_path / ".out.legacy.tmp", tmp_path / f".other.{dead}.abc123.tmp"]
    for path in stale + kept:
        path.mkdir()
    page = tmp_path / f".page.html.{dead}.q1w2e3.tmp"
    page.write_text("half a page")
    assert sorted(remove_stale(target)) == sorted(stale)
    assert remove_stale(tmp_path / "page.html") == [page]
    assert not any(p.exists() for p in [*stale, page]) and all(p.exists() for p in kept)
    # a swap cut between its two renames: the old folder is the previous output, put back
    target.rmdir()
    old = tmp_path / f".out.old-{dead}.k9j8h7"
    old.mkdir()
    (old / "explain.json").write_text("previous")
    assert remove_stale(target) == [old] and (target / "explain.json").read_text() == "previous"
    # and a new RunFolder cleans up before it stages
    stage = tmp_path / f".out.{dead}.zzz999.tmp"
    stage.mkdir()
    with RunFolder(target) as run:
        assert not stage.exists() and run.stage.name.startswith(f".out.{owner()}.")
