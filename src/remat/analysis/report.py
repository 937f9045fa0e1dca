"""Output of remat's commands: aligned text tables, the timelines plot (PNG) and JSON files.

Every file is written atomically (through a temporary file in the same folder, then renamed), so an
interrupted run never leaves a half-written report behind. Sizes in tables are MiB (2**20 bytes) with one
decimal.
"""

from __future__ import annotations

import io
import json
import os
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

import numpy as np

from remat.timeline import Timeline, write_atomic
from remat.units import MIB

Column = tuple[str, str, Callable[[Any], str]]


def cell(fmt: Callable[[Any], str]) -> Callable[[Any], str]:
    """A column formatter: ``'-'`` for a missing value (None), else ``fmt(value)``."""
    return lambda value: "-" if value is None else fmt(value)


text_cell = cell(str)
_mib = cell(lambda value: f"{value / MIB:.1f}")
_pct = cell(lambda value: f"{value:.1f}")
_seconds = cell(lambda value: f"{value:.3f}")
_ratio = cell(lambda value: f"{value:.2f}x")
error_pct = cell(lambda error: f"{100 * error:+.2f}")  # a relative error, as a signed percentage
# (row key, header, formatter) of the explain table, in order; headers say the unit.
EXPLAIN_COLUMNS: list[Column] = [
    ("policy", "policy", text_cell),
    ("peak_bytes", "peak MiB", _mib),
    ("peak_phase", "peak in", text_cell),
    ("activations_at_peak", "act@peak", _mib),
    ("group_inputs_at_peak", "inputs@peak", _mib),
    ("group_inputs_stored", "inputs stored", _mib),
    ("recompute_max_bytes", "recompute max", _mib),
    ("head_loss_at_peak", "head@peak", _mib),
    ("extra_forward_pct", "extra fwd %", _pct),
    ("step_seconds", "step s", _seconds),
    ("step_ratio", "vs none", _ratio),
]
FORMULA_COLUMNS: list[Column] = [
    ("policy", "policy", text_cell),
    ("group", "first recomputed", text_cell),
    ("stored_group_inputs", "inputs stored", _mib),
    ("group_activation_bytes", "group act (plain)", _mib),
    ("predicted_bytes", "predicted MiB", _mib),
    ("measured_bytes", "measured MiB", _mib),
    ("error", "error %", error_pct),
]
COLUMN_NOTES = (
    "act@peak: saved + recomputed activations alive at the peak; inputs@peak / inputs stored: checkpoint inputs "
    "alive at the peak / at the end of forward; recompute max: most recomputed activations alive at once; "
    "head@peak: final norm, logits, loss and their gradients at the peak; extra fwd %: recompute matmul FLOPs "
    "over the plain step's forward+backward; step s: median forward+backward wall time without the recorder; "
    "vs none: that time over none's."
)


def as_mapping(row: Any) -> Mapping[str, Any]:
    if isinstance(row, Mapping):
        return row
    if hasattr(row, "to_dict"):
        return row.to_dict()
    if is_dataclass(row) and not isinstance(row, type):
        return asdict(row)
    raise TypeError(f"a table row must be a mapping or a dataclass, got {type(row).__name__}")


def format_table(rows: Sequence[Any], columns: Sequence[Column] | None = None) -> str:
    """An aligned text table of ``rows`` (mappings or dataclasses such as :class:`remat.analysis.explain.PolicyRow`).

    ``columns`` are ``(key, header, formatter)``; the default is the explain table (:data:`EXPLAIN_COLUMNS`),
    with byte counts in MiB to one decimal. Text columns are left-aligned, numbers right-aligned.
    """
    columns = EXPLAIN_COLUMNS if columns is None else columns
    mapped = [as_mapping(r) for r in rows]
    cells = [[fmt(row.get(key)) for key, _, fmt in columns] for row in mapped]
    headers = [header for _, header, _ in columns]
    widths = [max([len(h)] + [len(line[i]) for line in cells]) for i, h in enumerate(headers)]
    # A column is numeric (right-aligned) when each of its cells reads as a number or a placeholder.
    numeric = [all(_looks_numeric(line[i]) for line in cells) and bool(cells) for i in range(len(headers))]

    def fmt_line(values: Sequence[str]) -> str:
        parts = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)]
        return "  ".join(parts).rstrip()

    lines = [fmt_line(headers), "  ".join("-" * w for w in widths)]
    lines += [fmt_line(line) for line in cells]
    return "\n".join(lines)


def _looks_numeric(cell: str) -> bool:
    text = cell.rstrip("x%").lstrip("+-")
    if text in ("", "-"):
        return True
    try:
        float(text)
    except ValueError:
        return False
    return True


def format_formula_table(rows: Sequence[Any]) -> str:
    """The user's-formula check (:class:`remat.analysis.explain.FormulaRow` rows) as an aligned table."""
    return format_table(rows, FORMULA_COLUMNS)


def format_sentences(sentences: Sequence[str], width: int = 110) -> str:
    """Sentences as a wrapped bullet list."""
    return "\n".join(textwrap.fill(s, width=width, initial_indent="- ", subsequent_indent="  ") for s in sentences)


def format_explanation(explanation: Any, width: int = 110) -> str:
    """The full text report of :func:`remat.analysis.explain.explain`: table, column notes, formula check, sentences."""
    parts = [format_table(explanation.rows), "", textwrap.fill(COLUMN_NOTES, width=width)]
    if explanation.formula:
        parts += ["", "User's formula: stored group inputs + the first recomputed group's activations (plain run), "
                      "vs measured at the end of that recomputation", format_formula_table(explanation.formula)]
    parts += ["", format_sentences(explanation.sentences, width)]
    return "\n".join(parts)


# ------------------------------------------------------------------------------------------------ plot
def step_axis(tl: Timeline) -> tuple[np.ndarray, np.ndarray]:
    """(x, MiB) of a timeline's live curve with forward mapped onto [0, 1] and backward onto [1, 2].

    The setup events before the forward (parameters and the batch being registered) are left out; aligning on
    the forward/backward boundary lets policies whose forwards have different event counts be compared.
    """
    live = tl.live_bytes().astype(np.float64) / MIB
    forward = [p.start for p in tl.phases if p.kind == "forward"]
    backward = [p.start for p in tl.phases if p.kind in ("backward", "recompute")]
    start = min(forward) if forward else 0
    boundary = min(backward) if backward else tl.num_events
    events = np.arange(tl.num_events, dtype=np.float64)
    x = np.where(events < boundary,
                 (events - start) / max(boundary - start, 1),
                 1.0 + (events - boundary) / max(tl.num_events - boundary, 1))
    keep = events >= start
    return x[keep], live[keep]


def plot_timelines(timelines: Mapping[str, Timeline], path: str | os.PathLike[str], title: str = "") -> Path:
    """Write a PNG of live memory through one training step: one line per policy, its peak marked.

    x runs over the step with forward on [0, 1] and backward on [1, 2] (a dashed line marks where backward
    starts); y is MiB alive. The legend gives each policy's peak. Uses matplotlib's Agg canvas directly, so no
    display or global backend is needed.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 6), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    colors = _colors(len(timelines))
    for (name, tl), color in zip(timelines.items(), colors):
        x, y = step_axis(tl)
        if not len(x):
            continue
        ax.plot(x, y, color=color, linewidth=1.3, label=f"{name} (peak {tl.peak_bytes / MIB:.1f} MiB)")
        i = int(np.argmax(y))
        ax.plot([x[i]], [y[i]], marker="o", color=color, markersize=6, markeredgecolor="black")
    ax.axvline(1.0, color="0.3", linestyle="--", linewidth=1)
    top = ax.get_ylim()[1]
    ax.text(0.5, top, "forward", ha="center", va="bottom", fontsize=9)
    ax.text(1.5, top, "backward (and recompute)", ha="center", va="bottom", fontsize=9)
    ax.set_xlim(0, 2)
    ax.set_xticks([0, 1, 2], ["forward starts", "backward starts", "end"])
    ax.set_ylabel("MiB alive")
    ax.set_title(title or "Memory through one training step (o = peak)", pad=18)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return write_atomic(path, buffer.getvalue())


def _colors(n: int) -> list[Any]:
    from matplotlib import colormaps

    cmap = colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(n)]


# ------------------------------------------------------------------------------------------------ JSON
def write_json(path: str | os.PathLike[str], obj: Any) -> Path:
    """Write ``obj`` as indented JSON to ``path`` atomically; numpy scalars are converted."""
    return write_atomic(path, json.dumps(obj, indent=2, default=_json_default) + "\n")


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")
