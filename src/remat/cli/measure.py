"""`remat measure`: measure pipeline stages for real on gloo."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from remat.cli.common import (
    Runner,
    add_measure_arguments,
    add_model_arguments,
    add_pipeline_arguments,
    add_subcommand,
)
from remat.cli.pipeline import run_pipeline_measure


# ------------------------------------------------------------------------------------------------ remat measure
def measure_command(sub: Any) -> Runner:
    """``remat measure``: measure each pipeline stage in a real multi-process run (``--pp 1``: one process)."""
    parser = add_subcommand(
        sub, "measure", help="measure per-stage memory in a real pipeline-parallel run (one process per stage)",
        description="Run one training step of the reference GPT split into --pp pipeline stages, one process per "
                    "stage (gloo on CPU, NCCL with --device cuda), record every stage's memory, and show each "
                    "stage's measured peak next to the prediction, with what is in flight at the peak.")
    add_model_arguments(parser)
    add_measure_arguments(parser)
    add_pipeline_arguments(parser, pp_optional=True)  # measure without --pp: one stage, one process
    g = parser.add_argument_group("measure")
    g.add_argument("--policies", metavar="LIST", default="none",
                   help="comma-separated recompute policies, e.g. none,full/uniform/1 (default none)")
    g.add_argument("--json", action="store_true", help="print a JSON report instead of the table")
    g.add_argument("--out", type=Path, metavar="FILE", help="also write the JSON report to FILE (atomically)")
    g.add_argument("--timelines", type=Path, metavar="DIR",
                   help="also write each stage's measured timeline JSON there (measured-<policy>-stage<r>.json); "
                        "the folder is written aside and replaced whole at the end (with --out FILE when FILE is in "
                        "it), so an interrupted run leaves the previous one as it was")
    return run_pipeline_measure

