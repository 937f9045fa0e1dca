"""``remat explain --html report.html``: the whole explanation as one self-contained page (inline CSS and SVG
charts, nothing fetched), so it opens offline, from an e-mail attachment or a CI artifact."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from html import escape
from pathlib import Path
from typing import Any

import numpy as np

from remat.analysis.report import COLUMN_NOTES, EXPLAIN_COLUMNS, FORMULA_COLUMNS, Column, as_mapping, mib_cell
from remat.analysis.timeline_plot import step_axis
from remat.files import write_atomic
from remat.timeline import CATEGORIES, Timeline
from remat.units import format_bytes

# matplotlib's tab10, so the page and timelines.png give a policy the same colour
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf")
CATEGORY_COLORS = {"parameters": "#9e9e9e", "gradients": "#6d4c41", "optimizer_state": "#8e24aa",
                   "group_inputs": "#1e88e5", "saved_activations": "#43a047", "recompute": "#fb8c00",
                   "head_loss": "#e53935", "other": "#fdd835"}
MAX_POINTS = 1500  # per line; more events are reduced to each bucket's lowest and highest point
CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 24px auto; max-width: 1100px;
       color: #222; padding: 0 16px; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 17px; margin-top: 28px; border-bottom: 1px solid #ddd; }
.sub { color: #666; margin-top: 0; }
table { border-collapse: collapse; margin: 8px 0; font-variant-numeric: tabular-nums; }
th, td { padding: 3px 9px; border-bottom: 1px solid #eee; text-align: right; white-space: nowrap; }
th { background: #f5f5f5; font-weight: 600; } td.text, th.text { text-align: left; }
tr.best td { background: #eef7ee; }
.swatch { display: inline-block; width: 11px; height: 11px; border-radius: 2px; margin-right: 6px;
          vertical-align: -1px; }
.notes { color: #555; font-size: 13px; max-width: 1000px; }
ul#explanation li { margin: 6px 0; }
svg text { font: 11px system-ui, sans-serif; fill: #333; }
svg .axis { stroke: #999; stroke-width: 1; } svg .grid { stroke: #eee; stroke-width: 1; }
svg .boundary { stroke: #555; stroke-dasharray: 4 3; }
.chart { overflow-x: auto; }
"""


def _color(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


def downsample_curve(x: np.ndarray, y: np.ndarray, max_points: int = MAX_POINTS) -> tuple[np.ndarray, np.ndarray]:
    """At most about ``max_points`` points: each bucket of consecutive points keeps its lowest and highest one, in
    order, so every peak (the global one included) stays on the line."""
    n = len(x)
    if n <= max_points:
        return x, y
    buckets = max_points // 2
    edges = np.linspace(0, n, buckets + 1).astype(int)
    keep: list[int] = []
    for a, b in zip(edges[:-1], edges[1:]):
        if b <= a:
            continue
        lo, hi = a + int(np.argmin(y[a:b])), a + int(np.argmax(y[a:b]))
        keep.extend(sorted({lo, hi}))
    idx = np.asarray(keep)
    return x[idx], y[idx]


def nice_ticks(top: float, count: int = 5, *, cover: bool = False) -> list[float]:
    """About ``count`` round ticks from 0 to ``top`` (the tick nearest it last); with ``cover``, up to the first
    tick at or above ``top``."""
    if top <= 0:
        return [0.0]
    raw = top / count
    magnitude = 10 ** np.floor(np.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    end = np.ceil(top / step - 1e-9) * step if cover else top
    return [float(v) for v in np.arange(0, end + step * 0.5, step)]


def timeline_svg(timelines: Mapping[str, Timeline], width: int = 1040, height: int = 440) -> str:
    """The timelines chart as an inline ``<svg id="memory-timeline">``: one polyline per policy, peaks marked."""
    left, right, top, bottom = 64, 16, 28, 44
    plot_w, plot_h = width - left - right, height - top - bottom
    series = []
    for i, (name, tl) in enumerate(timelines.items()):
        x, y = step_axis(tl)
        if len(x):
            series.append((i, name, tl, x, y))
    y_top = max((float(y.max()) for *_, y in series), default=1.0) * 1.08 or 1.0
    ticks = nice_ticks(y_top)
    y_top = max(y_top, ticks[-1])

    def sx(v: float) -> float:
        return left + plot_w * v / 2.0

    def sy(v: float) -> float:
        return top + plot_h * (1.0 - v / y_top)

    parts = [f'<svg id="memory-timeline" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" role="img" aria-label="MiB alive through one training step">']
    for t in ticks:
        parts.append(f'<line class="grid" x1="{left}" x2="{left + plot_w}" y1="{sy(t):.1f}" y2="{sy(t):.1f}"/>')
        parts.append(f'<text x="{left - 6}" y="{sy(t) + 4:.1f}" text-anchor="end">{t:g}</text>')
    parts.append(f'<line class="axis" x1="{left}" x2="{left}" y1="{top}" y2="{top + plot_h}"/>')
    parts.append(f'<line class="axis" x1="{left}" x2="{left + plot_w}" y1="{top + plot_h}" y2="{top + plot_h}"/>')
    parts.append(f'<line class="boundary" x1="{sx(1):.1f}" x2="{sx(1):.1f}" y1="{top}" y2="{top + plot_h}"/>')
    for v, label, anchor in ((0, "forward starts", "start"), (1, "backward starts", "middle"), (2, "end", "end")):
        parts.append(f'<text x="{sx(v):.1f}" y="{top + plot_h + 16}" text-anchor="{anchor}">{label}</text>')
    parts.append(f'<text x="{sx(0.5):.1f}" y="{top - 10}" text-anchor="middle">forward</text>')
    parts.append(f'<text x="{sx(1.5):.1f}" y="{top - 10}" text-anchor="middle">backward (and recompute)</text>')
    parts.append(f'<text transform="translate(14 {top + plot_h / 2:.0f}) rotate(-90)" text-anchor="middle">'
                 'MiB alive</text>')
    for i, name, _tl, x, y in series:
        rx, ry = downsample_curve(x, y)
        points = " ".join(f"{sx(a):.1f},{sy(b):.1f}" for a, b in zip(rx, ry))
        parts.append(f'<polyline class="policy-line" data-policy="{escape(name)}" fill="none" stroke="{_color(i)}" '
                     f'stroke-width="1.4" points="{points}"><title>{escape(name)}</title></polyline>')
    for i, name, tl, x, y in series:
        k = int(np.argmax(y))
        tip = f"{name}: peak {format_bytes(tl.peak_bytes)} in '{tl.peak_phase.label}'"
        parts.append(f'<circle class="peak-marker" data-policy="{escape(name)}" cx="{sx(x[k]):.1f}" '
                     f'cy="{sy(y[k]):.1f}" r="4.5" fill="{_color(i)}" stroke="black" stroke-width="1">'
                     f'<title>{escape(tip)}</title></circle>')
    parts.append("</svg>")
    return "\n".join(parts)


def _legend(names: Sequence[str], timelines: Mapping[str, Timeline]) -> str:
    items = [f'<span style="margin-right:16px"><span class="swatch" style="background:{_color(i)}"></span>'
             f'{escape(name)} (peak {format_bytes(timelines[name].peak_bytes)})</span>' for i, name in enumerate(names)]
    return f'<p class="legend">{"".join(items)} &nbsp;o = peak</p>'


def _table(rows: Sequence[Any], columns: Sequence[Column], table_id: str, row_class: str,
           best: str | None = None) -> str:
    head = "".join(f'<th class="{"text" if i == 0 else ""}">{escape(h)}</th>' for i, (_, h, _) in enumerate(columns))
    body = []
    for row in rows:
        data = as_mapping(row)
        cells = []
        for i, (key, _, fmt) in enumerate(columns):
            cells.append(f'<td class="{"text" if i == 0 or key == "peak_phase" else ""}">'
                         f"{escape(fmt(data.get(key)))}</td>")
        policy = str(data.get("policy", ""))
        cls = row_class + (" best" if best is not None and policy == best else "")
        body.append(f'<tr class="{cls}" data-policy="{escape(policy)}">{"".join(cells)}</tr>')
    return (f'<table id="{table_id}"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>')


def breakdown_html(timelines: Mapping[str, Timeline]) -> str:
    """Stacked bars and a table of what is alive at each policy's peak, by category (MiB)."""
    names = list(timelines)
    used = [c for c in CATEGORIES if any(timelines[n].at_peak[c] for n in names)]
    largest = max((timelines[n].peak_bytes for n in names), default=1) or 1
    bar_w, label_w, row_h = 760, 210, 22
    svg = [f'<svg id="peak-bars" xmlns="http://www.w3.org/2000/svg" width="{label_w + bar_w + 90}" '
           f'height="{row_h * len(names) + 8}" role="img" aria-label="bytes alive at each peak, by category">']
    for r, name in enumerate(names):
        tl = timelines[name]
        parts = tl.at_peak
        y = 4 + r * row_h
        svg.append(f'<text x="{label_w - 8}" y="{y + 14}" text-anchor="end">{escape(name)}</text>')
        x = float(label_w)
        for c in used:
            w = bar_w * parts[c] / largest
            if w > 0:
                tip = f"{name}: {c} {format_bytes(parts[c])}"
                svg.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{row_h - 6}" '
                           f'fill="{CATEGORY_COLORS[c]}"><title>{escape(tip)}</title></rect>')
                x += w
        svg.append(f'<text x="{x + 6:.1f}" y="{y + 14}">{format_bytes(tl.peak_bytes)}</text>')
    svg.append("</svg>")
    key = "".join(f'<span style="margin-right:14px"><span class="swatch" style="background:{CATEGORY_COLORS[c]}">'
                  f"</span>{escape(c)}</span>" for c in used)
    head = "".join(f"<th>{escape(c)}</th>" for c in used)
    body = []
    for name in names:
        tl = timelines[name]
        cells = "".join(f"<td>{mib_cell(tl.at_peak[c])}</td>" for c in used)
        total = mib_cell(tl.peak_bytes)
        body.append(f'<tr class="breakdown-row" data-policy="{escape(name)}"><td class="text">{escape(name)}</td>'
                    f'<td class="text">{escape(tl.peak_phase.label)}</td>{cells}<td>{total}</td></tr>')
    table = (f'<table id="peak-breakdown"><thead><tr><th class="text">policy</th><th class="text">peak in</th>{head}'
             f'<th>total MiB</th></tr></thead><tbody>{"".join(body)}</tbody></table>')
    return f'<div class="chart">{"".join(svg)}</div><p>{key}</p>{table}'


# NOTE [The report page]
# The page has, in order:
# 1. the short answer (ul#short-answer), as the text report opens;
# 2. the memory timelines: one line per policy (MiB alive through one step, forward on the left half, backward and
#    recompute on the right half), each policy's peak marked with a circle whose tooltip names the phase;
# 3. the per-policy table (the text report's columns);
# 4. what is alive at each policy's peak, by category, as stacked bars and as a table (the parts add up to the
#    peak exactly);
# 5. the user's-formula check (for full/uniform/K policies) and the plain-words explanation.
# Element ids a test or a script can rely on: short-answer, memory-timeline (the chart's <svg>), policy-table,
# peak-breakdown (its rows tr.breakdown-row), formula-table, explanation; every policy row is a tr.policy-row
# with data-policy. Everything is inline - CSS in a <style> element, charts as SVG drawn here - and nothing is
# fetched: no script, font, image or stylesheet from the network.
def render_html(explanation: Any, title: str | None = None) -> str:
    """The report page of a :class:`remat.analysis.explain.Explanation` (see NOTE [The report page]), as a string."""
    config = explanation.config
    timelines: Mapping[str, Timeline] = explanation.timelines
    names = [row.policy for row in explanation.rows]
    ordered = {name: timelines[name] for name in names if name in timelines}
    best = min(explanation.rows, key=lambda r: r.peak_bytes).policy if explanation.rows else None
    heading = title or "Activation recomputation: where the memory goes"
    model = (f"{config.num_layers} layers, h={config.hidden_size}, heads={config.num_attention_heads}, "
             f"s={config.seq_length}, b={config.micro_batch_size}, vocab={config.vocab_size}, {config.dtype}, "
             f"{config.attention} attention")
    meta = explanation.meta
    run = ", ".join(f"{k} {meta[k]}" for k in ("device", "engine", "torch") if k in meta)
    short = list(getattr(explanation, "short_answer", []) or [])
    sections = [
        f"<h1>{escape(heading)}</h1>",
        f'<p class="sub">{escape(model)}; one forward+backward step per policy. {escape(run)}</p>',
    ]
    if short:
        points = "".join(f"<li>{escape(line)}</li>" for line in short[1:])
        sections += [f"<h2>{escape(short[0].rstrip(':'))}</h2>", f'<ul id="short-answer">{points}</ul>']
    sections += [
        "<h2>Memory through one training step</h2>",
        _legend(list(ordered), ordered),
        f'<div class="chart">{timeline_svg(ordered)}</div>',
        "<h2>Policies</h2>",
        f'<div class="chart">{_table(explanation.rows, EXPLAIN_COLUMNS, "policy-table", "policy-row", best)}</div>',
        f'<p class="notes">{escape(COLUMN_NOTES)} Sizes are MiB (2^20 bytes); the lowest peak is highlighted.</p>',
        "<h2>What is alive at each peak</h2>",
        breakdown_html(ordered),
    ]
    if explanation.formula:
        sections += [
            "<h2>The user's formula: stored group inputs + one group's activations</h2>",
            '<p class="notes">Predicted: all groups\' stored inputs + the plain run\'s activations of the group '
            "recomputed first; measured at the end of that recomputation.</p>",
            _table(explanation.formula, FORMULA_COLUMNS, "formula-table", "formula-row"),
        ]
    sentences = "".join(f"<li>{escape(s)}</li>" for s in explanation.sentences)
    sections += ["<h2>In plain words</h2>", f'<ul id="explanation">{sentences}</ul>']
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{escape(heading)}</title><style>{CSS}</style></head>\n<body>\n"
            + "\n".join(sections) + "\n</body></html>\n")


def write_html(explanation: Any, path: str | os.PathLike[str], title: str | None = None) -> Path:
    """Write :func:`render_html` of ``explanation`` to ``path`` (atomically)."""
    return write_atomic(path, render_html(explanation, title))
