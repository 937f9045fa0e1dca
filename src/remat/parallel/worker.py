"""The worker process that :mod:`remat.parallel.launch` starts: runs one rank's job and writes its timelines."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

from remat.files import write_atomic
from remat.parallel.job_measure import measure_job_rank
from remat.parallel.launch import inject_fault, report_error, set_phase, watchdog
from remat.parallel.pipeline_measure import measure_pipeline_rank
from remat.parallel.tensor import measure_tensor_parallel_rank


# ------------------------------------------------------------------------------------------------ worker
def _worker(folder: Path, rank: int, launcher: int) -> int:
    job = json.loads((folder / "job.json").read_text(encoding="utf-8"))
    threading.Thread(target=watchdog, args=(launcher, time.time() + job["timeout"] + 5.0, folder, rank),
                     daemon=True).start()
    reported = False
    try:
        fault = job.get("fault") or {}
        if fault.get("rank") == rank and fault.get("when") == "start":
            inject_fault(fault, rank)
        if sys.platform.startswith("linux"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the run stays on 127.0.0.1
        set_phase("importing torch")
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        # what is alive now (torch, remat) never becomes garbage: keep it out of the collections that precede
        # every recorded step (gc_paused), which would otherwise rescan it for each policy
        gc.freeze()
        cuda = job["device"] == "cuda"
        if cuda:
            torch.cuda.set_device(rank)
        set_phase("connecting to the other ranks")
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{job['port']}",
                                rank=rank, world_size=job["world"],
                                timeout=datetime.timedelta(seconds=max(job["timeout"], 1.0)))
        try:
            tensor_parallel = job.get("kind") == "tensor_parallel"
            measure_one = measure_tensor_parallel_rank if tensor_parallel else measure_pipeline_rank
            if job.get("kind") == "job":  # a whole Megatron job's rank (remat.parallel.job_measure)
                measure_one = measure_job_rank
            results = []
            for policy in job["policies"]:
                set_phase(f"measuring {policy}")
                results.append(measure_one(job, policy, rank).to_dict())
            set_phase("waiting for the other ranks to finish")
            dist.barrier()  # every rank is done with its collectives before any tears its connections down
        except BaseException as err:
            # reported before the connections go down: tearing them down makes the peers fail ("Connection closed
            # by peer"), and the launcher blames the earliest reported error
            _report(folder, rank, err)
            reported = True
            raise
        finally:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        set_phase("writing its results")
        write_atomic(folder / f"rank{rank}.json", json.dumps(results, separators=(",", ":")))
        return 0
    except BaseException as err:  # noqa: BLE001 - every failure is reported to the parent
        if not reported:
            _report(folder, rank, err)
        return 1


def _report(folder: Path, rank: int, err: BaseException) -> None:
    message = "".join(traceback.format_exception_only(type(err), err)).strip()
    report_error(folder, rank, message, traceback.format_exc())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="remat pipeline worker (started by remat.parallel.launch)")
    parser.add_argument("--worker", nargs=3, metavar=("FOLDER", "RANK", "PARENT_PID"), required=True)
    args = parser.parse_args(argv)
    folder, rank, parent = args.worker
    return _worker(Path(folder), int(rank), int(parent))


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip the interpreter's teardown: the results are written (atomically) and the process group destroyed, and a
    # communication library's static destructors at exit could still abort the process (seen once on gloo as
    # "terminate called without an active exception"), which the launcher would report as a failed rank.
    os._exit(code)
