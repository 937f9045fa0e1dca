"""One rank of a real multi-process megatron-core run (started by :mod:`remat.megatron.multiprocess`):
``python -m remat.megatron.rank_worker FOLDER RANK LAUNCHER_PID``. It records its rank's step and writes the
timeline, or its error, into FOLDER; it ends itself when its launcher is gone or the run's time is over."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

from remat.files import write_atomic
from remat.parallel.launch import report_error, set_phase, watchdog


def run_rank(folder: Path, rank: int, launcher: int) -> int:
    """Run rank ``rank`` of the job in ``folder``; 0 when its timeline is written, 1 after reporting an error."""
    job = json.loads((folder / "job.json").read_text(encoding="utf-8"))
    threading.Thread(target=watchdog, args=(launcher, time.time() + job["timeout"] + 5.0, folder, rank),
                     daemon=True).start()
    try:
        set_phase("importing torch and megatron-core")
        import warnings

        import torch

        torch.set_num_threads(1)
        warnings.simplefilter("ignore")  # megatron-core's import-time warnings (no Apex, no TransformerEngine)
        from remat.megatron.api import StepShape, trace_rank
        from remat.megatron.config_json import config_from_json
        from remat.megatron.routing import routing_assumption
        from remat.megatron.world import ParallelSizes

        routing = routing_assumption(job.get("routing"))
        set_phase("connecting to the other ranks and measuring the step")
        timeline = trace_rank(config_from_json(job["config"]), None,
                              StepShape(job["seq_length"], job["micro_batch_size"], job["vocab_size"]),
                              ParallelSizes(**job["sizes"]), rank, fake=False, ddp=job["ddp"],
                              use_distributed_optimizer=job["use_distributed_optimizer"], optimizer=job["optimizer"],
                              routing=routing, init_method=f"tcp://127.0.0.1:{job['port']}")
        set_phase("writing its results")
        write_atomic(folder / f"rank{rank}.json", json.dumps(timeline.to_dict(), separators=(",", ":")))
        return 0
    except BaseException as err:  # noqa: BLE001 - every failure is reported to the launcher
        report_error(folder, rank, "".join(traceback.format_exception_only(type(err), err)).strip(),
                     traceback.format_exc())
        return 1


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 3:
        print("usage: python -m remat.megatron.rank_worker FOLDER RANK LAUNCHER_PID (started by "
              "remat.megatron.multiprocess)", file=sys.stderr)
        return 2
    return run_rank(Path(args[0]), int(args[1]), int(args[2]))


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip the interpreter's teardown: gloo's static destructors can abort a finished rank
