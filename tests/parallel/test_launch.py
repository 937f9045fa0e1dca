"""remat.parallel.launch: a killed worker is named as the cause, and no launch leaves its temporary folder behind,
even when the launching process is terminated or killed. The real runs are few and bounded by timeouts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from remat.config import ModelConfig
from remat.parallel.launch import DistributedError, first_failure, process_alive, remove_stale_folders, stall_report
from remat.parallel.pipeline_measure import measure_pipeline

SMALL = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, micro_batch_size=2,
                    vocab_size=128)


def _wait(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


# ------------------------------------------------------------------------------------------------ attribution
def test_a_killed_rank_is_blamed_before_the_peer_error_it_caused(tmp_path):
    """Rank 1 was SIGKILLed; rank 0 then reported its broken connection, stamped before the launcher saw rank 1
    exit (the race that blamed the survivor in 4 of 9 trials)."""
    now = time.time()
    (tmp_path / "rank0.error.json").write_text(json.dumps(
        {"rank": 0, "error": "RuntimeError: Connection reset by peer", "traceback": "", "time": now}))
    (tmp_path / "rank1.log").write_text("")
    rank, message = first_failure(tmp_path, [1, -signal.SIGKILL], {0: now + 0.05, 1: now + 0.02})
    assert (rank, message) == (1, "was killed by SIGKILL without a Python error")


def test_the_earliest_python_error_is_blamed_when_no_rank_was_killed(tmp_path):
    for rank, when in ((0, 2.0), (1, 1.0)):
        (tmp_path / f"rank{rank}.error.json").write_text(json.dumps(
            {"rank": rank, "error": f"error of rank {rank}", "traceback": "", "time": when}))
    # a SIGABRT (a communication library aborting on a broken peer) is a symptom, not the cause
    assert first_failure(tmp_path, [1, 1, -signal.SIGABRT], {0: 3.0, 1: 3.0, 2: 0.5}) == (1, "error of rank 1")


def test_a_lost_peer_connection_is_blamed_after_the_error_that_caused_it(tmp_path):
    """Rank 1 raised and tore its connections down before its error was written: rank 0's "Connection closed by
    peer", stamped earlier, is the symptom."""
    for rank, when, error in ((0, 1.0, "RuntimeError: [pair.cc:534] Connection closed by peer [127.0.0.1]:4242"),
                              (1, 2.0, "RuntimeError: rank one broke on purpose")):
        (tmp_path / f"rank{rank}.error.json").write_text(json.dumps(
            {"rank": rank, "error": error, "traceback": "", "time": when}))
    assert first_failure(tmp_path, [1, 1], {0: 3.0, 1: 3.0}) == (1, "RuntimeError: rank one broke on purpose")


def test_a_killed_worker_is_reported_by_rank_and_signal():
    with pytest.raises(DistributedError) as err:
        measure_pipeline(SMALL, "none", 2, 2, timeout=60, fault={"rank": 1, "kind": "kill"})
    assert err.value.rank == 1 and "rank 1 failed: was killed by SIGKILL" in str(err.value)
    assert not any(process_alive(pid) for pid in err.value.pids)


# ------------------------------------------------------------------------------------------------ temporary folders
LAUNCHER = """
import sys
from remat.config import ModelConfig
from remat.parallel.pipeline_measure import measure_pipeline
config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=2, seq_length=16, vocab_size=64)
measure_pipeline(config, "none", 2, 2, timeout=60, fault={"rank": 0, "kind": "hang", "when": "start"})
"""


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_an_ended_launcher_leaves_no_folder_and_no_worker(tmp_path, how):
    env = dict(os.environ, TMPDIR=str(tmp_path))
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    try:
        assert _wait(lambda: any((p / "rank1.log").exists() for p in tmp_path.glob("remat-pp-*")), 60)
        (folder,) = tmp_path.glob(f"remat-pp-{launcher.pid}-*")
        launcher.send_signal(how)
        assert launcher.wait(timeout=30) == -how  # it still dies of the signal
        assert _wait(lambda: not folder.exists(), 10)  # SIGTERM: its own cleanup; SIGKILL: the workers'
        workers = subprocess.run(["pgrep", "-f", f"remat.parallel.worker --worker {folder}"], capture_output=True,
                                 text=True).stdout.split()
        assert _wait(lambda: not any(process_alive(int(pid)) for pid in workers), 10)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


def test_stale_folders_of_gone_launchers_are_removed(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # a pid that is gone
    stale = tmp_path / f"remat-pp-{child.pid}-abc"
    live = tmp_path / f"remat-pp-{os.getpid()}-abc"
    other = tmp_path / "remat-pp-notapid-abc"
    for path in (stale, live, other):
        path.mkdir()
        (path / "job.json").write_text("{}")
    assert remove_stale_folders(tmp_path) == [stale]
    assert not stale.exists() and live.exists() and other.exists()
    assert Path(tmp_path).exists()


# ------------------------------------------------------------------------------------------------ a stalled run
def _beat(folder: Path, rank: int, *, age: float, phase: str, where: str, still: float, waiting: bool) -> None:
    now = time.time()
    (folder / f"rank{rank}.beat.json").write_text(json.dumps(
        {"time": now - age, "phase": phase, "phase_since": now - still, "where": where, "where_since": now - still,
         "waiting": waiting}))


def test_the_rank_without_progress_is_named_with_the_ranks_waiting_on_it(tmp_path):
    started = time.time() - 30
    me = os.getpid()  # a running process: the heartbeats alone tell
    _beat(tmp_path, 0, age=0.1, phase="measuring none", where="schedules.py:683 in _wait_batch_p2p", still=20,
          waiting=True)
    _beat(tmp_path, 1, age=12.0, phase="measuring none", where="model.py:10 in forward", still=12, waiting=False)
    _beat(tmp_path, 2, age=0.1, phase="importing torch", where="__init__.py:5 in <module>", still=0.1,
          waiting=False)
    stalled, text = stall_report(tmp_path, [None, None, None, 0], [me] * 4, started)
    assert stalled == [1]
    assert text.startswith("rank 1 stopped making progress 18.0 s into the run (no heartbeat since; phase: "
                           "measuring none (since 18.0 s into the run), at model.py:10 in forward)")
    assert "rank(s) 2 still working" in text and "rank(s) 3 finished" in text
    assert "rank(s) 0 waiting on it (rank 0: phase: measuring none" in text and "_wait_batch_p2p" in text
    # alive but not moving (a Python loop, a deadlock outside torch.distributed): the one still longest
    _beat(tmp_path, 1, age=0.1, phase="measuring none", where="launch.py:267 in inject_fault", still=25,
          waiting=False)
    stalled, text = stall_report(tmp_path, [None, None, None, 0], [me] * 4, started)
    assert stalled == [1] and text.startswith("rank 1 made no progress since 5.0 s into the run (phase: ")
    # every rank waits in torch.distributed: none to blame
    for rank in (1, 2):
        _beat(tmp_path, rank, age=0.1, phase="measuring none", where="distributed_c10d.py:1 in recv", still=9,
              waiting=True)
    stalled, text = stall_report(tmp_path, [None, None, None], [me] * 3, started)
    assert stalled == [] and text.startswith("rank(s) 0, 1, 2 waiting in torch.distributed (a deadlock?)")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a stopped process is read from /proc")
def test_a_stopped_process_is_named_and_a_rank_still_starting_is_not_blamed(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(sleeper.pid, signal.SIGSTOP)  # as inject_fault's 'stop' does to a rank
        assert _wait(lambda: Path(f"/proc/{sleeper.pid}/stat").read_text().rpartition(")")[2].split()[0] == "T", 10)
        _beat(tmp_path, 0, age=0.1, phase="connecting to the other ranks", where="rendezvous.py:199 in _create",
              still=3, waiting=True)
        stalled, text = stall_report(tmp_path, [None, None], [os.getpid(), sleeper.pid], time.time() - 5)
        assert stalled == [1]
        assert text == ("rank 1 stopped making progress before its first heartbeat (its process is stopped "
                        "(SIGSTOP?)); rank(s) 0 waiting on it (rank 0: phase: connecting to the other ranks (since "
                        "2.0 s into the run), at rendezvous.py:199 in _create)")
        # no heartbeat and not stopped: still importing, which a short timeout cuts; nobody is blamed
        stalled, text = stall_report(tmp_path, [None, None], [os.getpid(), os.getpid()], time.time() - 5)
        assert stalled == [] and text.startswith("rank(s) 1 still starting (no heartbeat yet")
        assert "rank(s) 0 waiting for the ranks still starting" in text
    finally:
        sleeper.kill()
        sleeper.wait()
