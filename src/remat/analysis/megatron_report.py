"""Per-rank rows of a megatron-core prediction (and measurement): peak, where it is, what is alive there."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from remat.analysis.report import Column, cell, text_cell
from remat.memory.comparison import part_errors
from remat.parallel.pipeline_report import peak_error
from remat.timeline import Timeline
from remat.units import format_mib

RANK_COLUMNS: list[Column] = [
    ("rank", "rank", text_cell),
    ("policy", "policy", text_cell),
    ("peak_bytes", "peak MiB", cell(lambda v: format_mib(v, 2, suffix=False))),
    ("peak_phase", "peak in", text_cell),
    ("parameters", "params MiB", cell(lambda v: format_mib(v, 2, suffix=False))),
    ("gradients", "grads MiB", cell(lambda v: format_mib(v, 2, suffix=False))),
    ("optimizer_state", "optim MiB", cell(lambda v: format_mib(v, 2, suffix=False))),
    ("activations", "act MiB", cell(lambda v: format_mib(v, 2, suffix=False))),
]
COMPARE_COLUMNS: list[Column] = [
    *RANK_COLUMNS[:3],
    ("measured_bytes", "measured MiB", cell(lambda v: format_mib(v, 2, suffix=False))),
    ("error", "error %", cell(lambda v: f"{100 * v:+.3f}")),
    RANK_COLUMNS[3],
]
STATE = ("parameters", "gradients", "optimizer_state")


def rank_row(rank: int, timeline: Timeline) -> dict[str, Any]:
    """One rank's peak, its phase, and the bytes alive there: the model state apart, every activation category
    (saved, group inputs, recompute, head/loss, other) summed as ``activations``; ``at_peak`` keeps them all."""
    at_peak = timeline.at_peak
    return {
        "rank": rank, "policy": timeline.meta.get("policy", ""), "peak_bytes": timeline.peak_bytes,
        "peak_phase": timeline.peak_phase.label, **{part: at_peak[part] for part in STATE},
        "activations": sum(v for k, v in at_peak.items() if k not in STATE), "at_peak": at_peak,
        "routing": timeline.meta.get("moe_routing"), "ignored_flags": timeline.meta.get("megatron_args_ignored", []),
    }


def rank_rows(predicted: Mapping[int, Timeline],
              measured: Mapping[int, Timeline] | None = None) -> list[dict[str, Any]]:
    """Rows of :func:`rank_row`, the worst rank first; with ``measured``, each row also has the measured peak, the
    peak's error and the error of each part at the peak (``part_errors``)."""
    rows = []
    for rank, timeline in predicted.items():
        row = rank_row(rank, timeline)
        if measured is not None:
            real = measured[rank]
            row.update(measured_bytes=real.peak_bytes, error=peak_error(real.peak_bytes, timeline.peak_bytes),
                       part_errors=part_errors(timeline.at_peak, real.at_peak, real.peak_bytes))
        rows.append(row)
    return sorted(rows, key=lambda row: -row["peak_bytes"])
