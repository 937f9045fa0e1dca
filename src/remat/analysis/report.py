"""Text and JSON output of remat's commands: aligned tables (sizes in one fixed unit per column), the
``remat explain`` report, and JSON files written atomically."""

from __future__ import annotations

import json
import os
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

import numpy as np

from remat.files import write_atomic
from remat.units import GIB, MIB

Column = tuple[str, str, Callable[[Any], str]]


def cell(fmt: Callable[[Any], str]) -> Callable[[Any], str]:
    """A column formatter: ``'-'`` for a missing value (None), else ``fmt(value)``."""
    return lambda value: "-" if value is None else fmt(value)


def size_cell(divisor: int = MIB, digits: int | None = None) -> Callable[[Any], str]:
    """A column of byte counts in one fixed unit (``divisor`` bytes: MIB, GIB, ...), so a column lines up:
    ``digits`` decimals (default one, two from GiB up), ``'-'`` for None. The header names the unit; text uses
    :func:`remat.units.format_bytes` instead."""
    digits = (2 if divisor >= GIB else 1) if digits is None else digits
    return cell(lambda value: f"{value / divisor:.{digits}f}")


text_cell = cell(str)
mib_cell = size_cell(MIB)
_pct = cell(lambda value: f"{value:.1f}")
_seconds = cell(lambda value: f"{value:.3f}")
_ratio = cell(lambda value: f"{value:.2f}x")
error_pct = cell(lambda error: f"{100 * error:+.2f}")  # a relative error, as a signed percentage
# (row key, header, formatter) of the explain table, in order; headers say the unit.
EXPLAIN_COLUMNS: list[Column] = [
    ("policy", "policy", text_cell),
    ("peak_bytes", "peak MiB", mib_cell),
    ("peak_phase", "peak in", text_cell),
    ("activations_at_peak", "act@peak", mib_cell),
    ("group_inputs_at_peak", "inputs@peak", mib_cell),
    ("group_inputs_stored", "inputs stored", mib_cell),
    ("recompute_max_bytes", "recompute max", mib_cell),
    ("head_loss_at_peak", "head@peak", mib_cell),
    ("extra_forward_pct", "extra fwd %", _pct),
    ("step_seconds", "step s", _seconds),
    ("step_ratio", "vs none", _ratio),
]
CONTRAST_COLUMNS: list[Column] = [column for column in EXPLAIN_COLUMNS
                                   if column[0] not in ("extra_forward_pct", "step_seconds", "step_ratio")]
FORMULA_COLUMNS: list[Column] = [
    ("policy", "policy", text_cell),
    ("group", "first recomputed", text_cell),
    ("stored_group_inputs", "inputs stored", mib_cell),
    ("group_activation_bytes", "group act (plain)", mib_cell),
    ("predicted_bytes", "predicted MiB", mib_cell),
    ("measured_bytes", "measured MiB", mib_cell),
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


def format_short_answer(lines: Sequence[str], width: int = 110) -> str:
    """The short answer: its heading line, then its points as a wrapped bullet list."""
    if not lines:
        return ""
    return "\n".join([lines[0], format_sentences(lines[1:], width)])


def format_explanation(explanation: Any, width: int = 110) -> str:
    """The full text report of :func:`remat.analysis.explain.explain`: the short answer, then the detail (table,
    column notes, the contrast run's table, the formula check, sentences)."""
    parts = []
    if explanation.short_answer:
        parts += [format_short_answer(explanation.short_answer, width), "", "In detail:", ""]
    parts += [format_table(explanation.rows), "", textwrap.fill(COLUMN_NOTES, width=width)]
    contrast = getattr(explanation, "contrast", None)
    if contrast is not None:
        parts += ["", f"The same model at vocab={contrast.config.vocab_size} (untimed):",
                  format_table(contrast.rows, CONTRAST_COLUMNS)]
    if explanation.formula:
        parts += ["", "User's formula: stored group inputs + the first recomputed group's activations (plain run), "
                      "vs measured at the end of that recomputation", format_formula_table(explanation.formula)]
    parts += ["", format_sentences(explanation.sentences, width)]
    return "\n".join(parts)


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
