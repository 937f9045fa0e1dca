"""``remat predict --html`` / ``remat plan --html`` of a whole Megatron-LM job: one self-contained page (inline CSS
and SVG, no script, nothing fetched) with every distinct rank's parts at its peak against the GPU's capacity, the
worst rank's memory through the step against its pipeline schedule, what is alive at its peak, and, for a sweep or
a plan, each answer's worst-rank peak beside the budget (NOTE [The job page])."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Any

import numpy as np

from remat.analysis.html import nice_ticks
from remat.analysis.job_step import number_ranges, peak_html, scale_unit, step_svg
from remat.files import write_atomic
from remat.parallel.job_predict import PART_LABELS, PARTS, JobPrediction, RankPrediction
from remat.plan.job_result import STATE_PARTS, JobPlan
from remat.units import GPU_PRESETS, format_bytes

OVERHEAD = "allocator_overhead"  # reserved - allocated at the peak: the caching allocator's share
PART_NAMES = {"parameters": "parameters", "gradients": "gradients", "master_parameters": "master parameters",
              "optimizer_state": "optimizer state", "activations": "activations",
              "communication": "communication buffers", "workspaces": "workspaces",
              OVERHEAD: "allocator overhead (reserved - allocated)"}
PART_COLORS = {"parameters": "#8d99ae", "gradients": "#6d4c41", "master_parameters": "#26a69a",
               "optimizer_state": "#8e24aa", "activations": "#43a047", "communication": "#fb8c00",
               "workspaces": "#fdd835", OVERHEAD: "#ef9a9a"}
SHORT_NAMES = PART_LABELS  # table headings
RESERVED_KEYS = ("max_memory_reserved", "max_memory_allocated", "fragmentation_at_peak_bytes",
                 "largest_free_block_bytes")
MAX_BARS = 64  # distinct ranks drawn one bar each; more are grouped (group_ranks)
CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 20px auto; max-width: 1180px;
       color: #222; padding: 0 16px; }
h1 { font-size: 21px; margin-bottom: 4px; } h2 { font-size: 17px; margin-top: 26px; border-bottom: 1px solid #ddd; }
h3 { font-size: 15px; margin: 18px 0 4px; } .sub, .notes { color: #555; font-size: 13px; }
table { border-collapse: collapse; margin: 6px 0; font-variant-numeric: tabular-nums; font-size: 12.5px; }
th, td { padding: 2px 6px; border-bottom: 1px solid #eee; text-align: right; white-space: nowrap; }
th { background: #f5f5f5; font-weight: 600; } td.text, th.text { text-align: left; }
td.phase { white-space: normal; min-width: 150px; }
tr.worst td { background: #fdecea; } tr.fits td.verdict { color: #2e7d32; } tr.over td.verdict { color: #c62828; }
.swatch { display: inline-block; width: 11px; height: 11px; border-radius: 2px; margin-right: 5px; }
.key span.item { margin-right: 14px; white-space: nowrap; } .chart { overflow-x: auto; }
details.answer { border: 1px solid #ddd; border-radius: 6px; padding: 4px 12px; margin: 12px 0; }
details.answer > summary { font-weight: 600; font-size: 15px; cursor: pointer; padding: 4px 0; }
.grouped { background: #fff8e1; border-left: 3px solid #f9a825; padding: 4px 8px; }
svg text { font: 11px system-ui, sans-serif; fill: #333; } svg .axis { stroke: #999; } svg .grid { stroke: #eee; }
svg .capacity { stroke: #c62828; stroke-width: 1.5; stroke-dasharray: 6 3; } svg text.capacity-label { fill: #c62828; }
svg .peak-line { stroke: #000; stroke-dasharray: 2 3; }
"""


@dataclass
class Bar:
    """One bar of the rank chart: a distinct rank, or a group of alike ones drawn as its highest member."""

    ranks: list[RankPrediction]  # highest peak first
    parts: dict[str, int]  # of ranks[0], at its peak (PARTS), plus OVERHEAD when its reserved figures exist

    @property
    def top(self) -> RankPrediction:
        return self.ranks[0]

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    @property
    def ranks_alike(self) -> int:
        return sum(r.ranks for r in self.ranks)

    @property
    def label(self) -> str:
        if len(self.ranks) == 1:
            return f"rank {self.top.rank} · stage {self.top.stage}"
        return f"stages {number_ranges(sorted(r.stage for r in self.ranks))}"


@dataclass
class Answer:
    """One policy (or plan) of the job: its distinct ranks, worst first."""

    name: str
    ranks: list[RankPrediction]
    note: str = ""
    state_only: list[tuple[int, dict[str, int]]] = field(default_factory=list)  # (stage, model state) when no ranks


def reserved_of(rank: RankPrediction) -> dict[str, int] | None:
    """The rank's reserved-memory figures (:data:`RESERVED_KEYS`), when the prediction carries them."""
    reserved = getattr(rank, "reserved", None)
    return reserved if isinstance(reserved, Mapping) and "max_memory_reserved" in reserved else None


def bar_parts(rank: RankPrediction) -> dict[str, int]:
    """The rank's parts at its peak (adding up to its peak), plus the allocator's overhead to reserved."""
    parts = dict(rank.parts)
    reserved = reserved_of(rank)
    if reserved is not None:
        parts[OVERHEAD] = max(0, int(reserved["max_memory_reserved"]) - rank.peak_bytes)
    return parts


def needed_bytes(rank: RankPrediction) -> int:
    """What the rank needs of the GPU: its reserved peak when replayed (what runs out), else its allocated peak."""
    reserved = reserved_of(rank)
    return rank.peak_bytes if reserved is None else max(rank.peak_bytes, int(reserved["max_memory_reserved"]))


def group_ranks(ranks: Sequence[RankPrediction], max_bars: int = MAX_BARS) -> tuple[list[Bar], bool]:
    """The bars of ``ranks`` (worst first): one per rank, or, with more than ``max_bars``, ranks alike grouped:
    those with the same parts first, then runs of the nearest peaks; the worst rank keeps a bar of its own.
    Returns (bars, grouped)."""
    ordered = sorted(ranks, key=lambda r: (-r.peak_bytes, r.stage))
    parts = [bar_parts(r) for r in ordered]
    if len(ordered) <= max_bars:
        return [Bar([r], p) for r, p in zip(ordered, parts)], False
    same: dict[tuple[int, ...], Bar] = {}
    for r, p in zip(ordered, parts):
        key = tuple(p.get(k, 0) for k in (*PARTS, OVERHEAD))
        same.setdefault(key, Bar([], p)).ranks.append(r)
    bars = list(same.values())
    if len(bars) > max_bars:
        first, rest = bars[0], bars[1:]
        edges = np.linspace(0, len(rest), max_bars).astype(int)
        bars = [first] + [Bar([r for b in rest[a:z] for r in b.ranks], rest[a].parts)
                          for a, z in zip(edges[:-1], edges[1:]) if z > a]
    return bars, True


def _key(parts: Sequence[str]) -> str:
    items = "".join(f'<span class="item"><span class="swatch" style="background:{PART_COLORS[p]}"></span>'
                    f"{escape(PART_NAMES[p])}</span>" for p in parts)
    return f'<p class="key">{items}</p>'


def _capacity_marks(capacity: Sequence[tuple[str, int]], sx: Any, top: int, bottom: int) -> list[str]:
    out = []
    for i, (label, nbytes) in enumerate(capacity):
        x = sx(nbytes)
        out.append(f'<line class="capacity" data-bytes="{nbytes}" x1="{x:.1f}" x2="{x:.1f}" y1="{top - 4}" '
                   f'y2="{bottom}"><title>{escape(label)}: {nbytes:,} bytes</title></line>')
        out.append(f'<text class="capacity-label" x="{x - 4:.1f}" y="{top - 8 - 12 * i}" text-anchor="end">'
                   f"{escape(label)}</text>")
    return out


def _bar_frame(svg_id: str, rows: int, largest: int, capacity: Sequence[tuple[str, int]], axis: str, *,
               label_w: int, bar_w: int, row_h: int, extra: str = "") -> tuple[list[str], Any, int, int]:
    """A horizontal bar chart's frame: the <svg> opening, the grid with its ticks (GiB or MiB) and the axis
    label; returns (the elements, bytes -> x, the first row's top, the last row's bottom). The capacity lines
    are drawn over it by :func:`_capacity_marks`."""
    top = 34 + 12 * max(0, len(capacity) - 1)
    bottom = top + row_h * rows
    largest = max([largest] + [n for _, n in capacity] + [1])
    unit, size = scale_unit(largest)
    ticks = nice_ticks(largest * 1.03 / size, 6, cover=True)
    scale_top = max(ticks[-1] * size, largest)

    def sx(v: float) -> float:
        return label_w + bar_w * v / scale_top

    out = [f'<svg id="{svg_id}" {extra}xmlns="http://www.w3.org/2000/svg" width="{label_w + bar_w + 150}" '
           f'height="{bottom + 32}" role="img" aria-label="{escape(axis)}">']
    for t in ticks:
        out.append(f'<line class="grid" x1="{sx(t * size):.1f}" x2="{sx(t * size):.1f}" y1="{top}" y2="{bottom}"/>'
                   f'<text x="{sx(t * size):.1f}" y="{bottom + 14}" text-anchor="middle">{t:g}</text>')
    out.append(f'<text x="{label_w + bar_w / 2}" y="{bottom + 28}" text-anchor="middle">{unit}: {escape(axis)}</text>')
    return out, sx, top, bottom


def rank_bars_svg(bars: Sequence[Bar], capacity: Sequence[tuple[str, int]], svg_id: str) -> str:
    """Every bar's parts stacked, the capacity lines across them, the worst (first) bar marked."""
    label_w, bar_w, row_h = 190, 720, 22
    out, sx, top, bottom = _bar_frame(svg_id, len(bars), max(b.total for b in bars), capacity,
                                      "each distinct rank's bytes at its peak, by part", label_w=label_w,
                                      bar_w=bar_w, row_h=row_h, extra='class="rank-bars" ')
    most = max(range(len(bars)), key=lambda i: (bars[i].total, -i))  # with reserved figures: what runs out first
    for i, bar in enumerate(bars):
        y = top + i * row_h
        weight = ' font-weight="bold"' if i == 0 else ""
        out.append(f'<text x="{label_w - 8}" y="{y + 14}" text-anchor="end"{weight}>{escape(bar.label)} '
                   f"(×{bar.ranks_alike})</text>")
        x = float(label_w)
        for part, nbytes in bar.parts.items():
            w = sx(nbytes) - label_w
            if nbytes > 0:
                tip = f"{bar.label}: {PART_NAMES[part]} {format_bytes(nbytes)} ({nbytes:,} bytes)"
                out.append(f'<rect class="part" data-part="{part}" data-bytes="{nbytes}" x="{x:.2f}" y="{y + 2}" '
                           f'width="{max(w, 0.3):.2f}" height="{row_h - 6}" fill="{PART_COLORS[part]}">'
                           f"<title>{escape(tip)}</title></rect>")
            x += w
        text = format_bytes(bar.total) + ("  ◀ worst rank" if i == 0 else "") + (
            "  ◀ most reserved" if i == most and i != 0 else "")
        out.append(f'<text x="{x + 6:.1f}" y="{y + 14}"{weight}>{escape(text)}</text>')
        if i == 0:
            out.append(f'<rect class="worst-mark" x="{label_w - 2}" y="{y}" width="{x - label_w + 4:.1f}" '
                       f'height="{row_h - 2}" fill="none" stroke="#c62828" stroke-width="1.5"/>')
    out += _capacity_marks(capacity, sx, top, bottom)
    out.append("</svg>")
    return "\n".join(out)


def rank_table(bars: Sequence[Bar], answer: str, capacity: Sequence[tuple[str, int]]) -> str:
    """The bars' exact bytes: one ``tr.rank-row`` per bar, its numbers also as data attributes."""
    parts = [p for p in (*PARTS, OVERHEAD) if any(p in b.parts for b in bars)]  # as data attributes, all
    shown = [p for p in PARTS if any(b.parts.get(p) for b in bars)]  # as columns, those held (and reserved)
    reserved = any(reserved_of(b.top) for b in bars)
    head = ["rank", "stage", "alike", "peak", "in", *(SHORT_NAMES[p] for p in shown)]
    head += ["reserved", "fragmented", "free block"] if reserved else []
    head += ["of cap."] if capacity else []
    rows = []
    for i, bar in enumerate(bars):
        r = bar.top
        attrs = {"policy": answer, "rank": r.rank, "stage": r.stage, "ranks-alike": bar.ranks_alike,
                 "peak-bytes": r.peak_bytes, "distinct-ranks": len(bar.ranks),
                 **{p: bar.parts.get(p, 0) for p in parts}}
        res = reserved_of(r)
        if res is not None:
            attrs.update({k.replace("_", "-"): int(res[k]) for k in RESERVED_KEYS if k in res})
        single = len(bar.ranks) == 1
        rank_text = f"{r.rank}" if single else f"{r.rank} (highest of {len(bar.ranks)})"
        stage_text = f"{r.stage}" if single else number_ranges(sorted(x.stage for x in bar.ranks))
        cells = [f'<td class="text">{rank_text}</td>', f'<td class="text">{stage_text}</td>',
                 f"<td>{bar.ranks_alike}</td>",
                 f'<td title="{r.peak_bytes:,} bytes">{format_bytes(r.peak_bytes)}</td>',
                 f'<td class="text phase">{escape(r.peak_phase)}</td>']
        cells += [f'<td title="{bar.parts.get(p, 0):,} bytes">{format_bytes(bar.parts.get(p, 0))}</td>' for p in shown]
        if reserved:
            cells += [f"<td>{format_bytes(res[k])}</td>" if res and k in res else "<td>-</td>" for k in RESERVED_KEYS
                      if k != "max_memory_allocated"]
        if capacity:
            verdict = f"{100 * bar.total / capacity[-1][1]:.0f}%"
            cells.append(f'<td class="verdict">{verdict}</td>')
        fits = "fits" if not capacity or bar.total <= capacity[-1][1] else "over"
        data = " ".join(f'data-{k}="{escape(str(v))}"' for k, v in attrs.items())
        cls = f"rank-row {fits}" + (" worst" if i == 0 else "")
        rows.append(f'<tr class="{cls}" {data}>{"".join(cells)}</tr>')
    th = "".join(f'<th class="{"text" if h in ("rank", "stage", "in") else ""}">{escape(h)}</th>' for h in head)
    return f'<table class="rank-table"><thead><tr>{th}</tr></thead><tbody>{"".join(rows)}</tbody></table>'


@dataclass
class Entry:
    """A bar of the policy chart: an answer's worst-rank peak (allocated), where it is, and the most a rank of it
    reserves (None: not replayed)."""

    name: str
    peak_bytes: int
    where: str
    reserved: int | None = None

    @property
    def needed(self) -> int:
        return self.peak_bytes if self.reserved is None else max(self.reserved, self.peak_bytes)


def answer_entry(answer: Answer) -> Entry:
    """The chart's bar of an answer: its worst rank, and its ranks' largest reserved figure when replayed."""
    w = answer.ranks[0]
    reserved = [int(res["max_memory_reserved"]) for r in answer.ranks if (res := reserved_of(r))]
    return Entry(answer.name, w.peak_bytes, f"rank {w.rank}, stage {w.stage}", max(reserved, default=None))


def policy_chart(entries: Sequence[Entry], capacity: Sequence[tuple[str, int]]) -> str:
    """Each answer's worst-rank peak (and, lighter, the most a rank reserves) as a bar beside the capacity, and as a
    table (``tr.policy-row``: data-policy, data-peak-bytes, data-reserved-bytes)."""
    label_w, bar_w, row_h = 300, 600, 20
    out, sx, top, bottom = _bar_frame("policy-peaks", len(entries), max(e.needed for e in entries), capacity,
                                      "the worst rank's peak", label_w=label_w, bar_w=bar_w, row_h=row_h)
    limit = capacity[-1][1] if capacity else None
    reserved = any(e.reserved is not None for e in entries)
    rows = []
    for i, e in enumerate(entries):
        y, fits = top + i * row_h, limit is None or e.needed <= limit
        fill = "#90a4ae" if limit is None else "#66bb6a" if fits else "#ef5350"
        out.append(f'<text x="{label_w - 8}" y="{y + 13}" text-anchor="end">{escape(e.name[:48])}</text>'
                   f'<rect class="policy-bar" data-policy="{escape(e.name)}" data-bytes="{e.peak_bytes}" '
                   f'x="{label_w}" y="{y + 2}" width="{sx(e.peak_bytes) - label_w:.2f}" height="{row_h - 5}" '
                   f'fill="{fill}"><title>{escape(e.name)}: {format_bytes(e.peak_bytes)} ({escape(e.where)})</title>'
                   "</rect>")
        if e.needed > e.peak_bytes:
            out.append(f'<rect class="reserved-bar" data-bytes="{e.needed}" x="{sx(e.peak_bytes):.2f}" y="{y + 2}" '
                       f'width="{sx(e.needed) - sx(e.peak_bytes):.2f}" height="{row_h - 5}" fill="{fill}" '
                       f'fill-opacity="0.4"><title>the most a rank reserves: {format_bytes(e.needed)}</title></rect>')
        shown = format_bytes(e.peak_bytes) + (f" (reserved {format_bytes(e.needed)})" if e.needed > e.peak_bytes
                                              else "")
        out.append(f'<text x="{sx(e.needed) + 5:.1f}" y="{y + 13}">{shown}</text>')
        verdict = "" if limit is None else "fits" if fits else f"over by {format_bytes(e.needed - limit)}"
        cells = [f'<td class="text">{escape(e.name)}</td>',
                 f'<td title="{e.peak_bytes:,} bytes">{format_bytes(e.peak_bytes)}</td>']
        cells += [f'<td>{"-" if e.reserved is None else format_bytes(e.reserved)}</td>'] if reserved else []
        cells += [f'<td class="text">{escape(e.where)}</td>', f'<td class="text verdict">{verdict}</td>']
        extra = "" if e.reserved is None else f' data-reserved-bytes="{e.reserved}"'
        rows.append(f'<tr class="policy-row {"fits" if fits else "over"}" data-policy="{escape(e.name)}" '
                    f'data-peak-bytes="{e.peak_bytes}"{extra}>{"".join(cells)}</tr>')
    out += _capacity_marks(capacity, sx, top, bottom)
    out.append("</svg>")
    head = ["policy or plan", "worst-rank peak", *(["most reserved"] if reserved else []), "where",
            "against " + capacity[-1][0] if capacity else ""]
    th = "".join(f'<th class="{"text" if h in ("policy or plan", "where") or h.startswith("against") else ""}">'
                 f"{escape(h)}</th>" for h in head)
    table = f'<table id="policy-table"><thead><tr>{th}</tr></thead><tbody>{"".join(rows)}</tbody></table>'
    return f'<div class="chart">{"".join(out)}</div>{table}'


# NOTE [The job page]
# In order: the job (model, layout, batch, precision, optimizer) and the short answer (ul#short-answer: each
# answer's worst rank and peak, and how it compares with the capacity); for more than one answer (a sweep, a plan)
# svg#policy-peaks and table#policy-table (tr.policy-row, data-policy, data-peak-bytes); then per answer a
# details.answer (the first and the lowest open) with: the rank chart (svg.rank-bars: one row per distinct rank, or
# per group of alike ranks beyond MAX_BARS, its parts stacked, the capacity lines, the worst rank framed) and
# table.rank-table (tr.rank-row with the exact bytes as data attributes: data-rank, data-stage, data-ranks-alike,
# data-peak-bytes, one per part, the reserved figures when present); the worst rank through the step
# (svg.step-chart: live bytes, the capacity line, the peak marker, the schedule's bands rect.band per chunk lane,
# the optimizer step, the microbatch-chunks in flight); what is alive at its peak (table.peak-tensors). Capacity
# lines are ``(label, bytes)``, the last the one a rank must fit (a plan's budget; a GPU's memory). Inline CSS and
# SVG only: nothing fetched, no script.
def render_job_html(title: str, header: Sequence[str], answers: Sequence[Answer], *,
                    capacity: Sequence[tuple[str, int]] = (), entries: Sequence[Entry] | None = None,
                    notes: Sequence[str] = ()) -> str:
    """The job page (NOTE [The job page]) as a string.

    Args:
        title: the heading.
        header: lines about the job (what it is, what was assumed).
        answers: each policy's (or plan's) ranks, the first drawn open.
        capacity: the capacity lines, ``(label, bytes)``; the last is the limit.
        entries: the policy chart's bars; None: each answer's worst rank (:func:`answer_entry`).
        notes: closing lines (what is not counted).
    """
    limit = capacity[-1] if capacity else None
    if entries is None:
        entries = [answer_entry(a) for a in answers if a.ranks]
    short = []
    for a in answers:
        if not a.ranks:
            short.append(f"{a.name}: {a.note or 'no rank predicted'}")
            continue
        w = a.ranks[0]
        line = (f"{a.name}: worst rank {w.rank} (stage {w.stage}, {w.ranks} ranks alike) peaks at "
                f"{format_bytes(w.peak_bytes)} in {w.peak_phase}")
        res = reserved_of(w)
        if res is not None:
            line += f"; reserved {format_bytes(res['max_memory_reserved'])}"
        most = max(a.ranks, key=needed_bytes)
        if most is not w:
            line += f"; rank {most.rank} (stage {most.stage}) reserves the most: {format_bytes(needed_bytes(most))}"
        if limit is not None:
            total = needed_bytes(most)
            line += (f": {100 * total / limit[1]:.0f}% of {limit[0]}" + ("" if total <= limit[1] else
                                                                         f", over by {format_bytes(total - limit[1])}"))
        short.append(line)
    body = [f"<h1>{escape(title)}</h1>", *(f'<p class="sub">{escape(line)}</p>' for line in header),
            '<ul id="short-answer">' + "".join(f"<li>{escape(s)}</li>" for s in short) + "</ul>"]
    if len(entries) > 1:
        body += ["<h2>Each answer's worst rank beside the capacity</h2>", policy_chart(entries, capacity)]
    lowest = min((a for a in answers if a.ranks), key=lambda a: a.ranks[0].peak_bytes, default=None)
    for i, a in enumerate(answers):
        shown = " open" if i == 0 or a is lowest else ""
        body.append(f'<details class="answer" data-policy="{escape(a.name)}"{shown}>'
                    f"<summary>{escape(a.name)}</summary>")
        if a.note:
            body.append(f'<p class="notes">{escape(a.note)}</p>')
        if a.state_only:
            head = "".join(f"<th>{PART_NAMES[k]}</th>" for k in STATE_PARTS)
            rows = "".join(f'<tr class="state-row" data-stage="{s}"><td>{s}</td>' + "".join(
                f"<td>{format_bytes(p.get(k, 0))}</td>" for k in STATE_PARTS) + "</tr>" for s, p in a.state_only)
            body.append(f'<table class="state-table"><thead><tr><th>stage</th>{head}</tr></thead><tbody>{rows}'
                        "</tbody></table>")
        if not a.ranks:
            body.append("</details>")
            continue
        bars, grouped = group_ranks(a.ranks)
        body.append("<h3>Every distinct rank at its peak</h3>")
        if grouped:
            body.append(f'<p class="grouped">{len(a.ranks):,} distinct ranks are too many to draw one bar each: ranks '
                        f"alike (the same parts at their peak, then the nearest peaks) share one of {len(bars)} "
                        "bars, drawn as the group's highest rank; the worst rank keeps its own.</p>")
        used = [p for p in (*PARTS, OVERHEAD) if any(b.parts.get(p) for b in bars)]
        body += [f'<div class="chart">{rank_bars_svg(bars, capacity, f"rank-bars-{i}")}</div>', _key(used),
                 f'<div class="chart">{rank_table(bars, a.name, capacity)}</div>']
        w = a.ranks[0]
        body += [f"<h3>The worst rank ({w.rank}, stage {w.stage}) through the step</h3>",
                 f'<div class="chart">{step_svg(w, capacity, f"step-{i}")}</div>',
                 f"<h3>At its peak: {format_bytes(w.peak_bytes)} in {escape(w.peak_phase)}</h3>",
                 peak_html(w), "</details>"]
    body += [f'<p class="notes">{escape(line)}</p>' for line in notes]
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{escape(title)}</title><style>{CSS}</style></head>\n<body>\n" + "\n".join(body)
            + "\n</body></html>\n")


def write_job_html(path: str | os.PathLike[str], title: str, header: Sequence[str], answers: Sequence[Answer],
                   **kwargs: Any) -> Path:
    """Write :func:`render_job_html` to ``path`` atomically; returns the path."""
    return write_atomic(path, render_job_html(title, header, answers, **kwargs))


# ------------------------------------------------------------------------------------------------ sources
def gpu_capacity(gpu: str | None) -> list[tuple[str, int]]:
    """The capacity line of a GPU preset (:data:`remat.units.GPU_PRESETS`); none for None."""
    if gpu is None:
        return []
    name = gpu.strip().lower()
    return [(f"{name} ({format_bytes(GPU_PRESETS[name])})", GPU_PRESETS[name])]


def budget_capacity(budget: str, budget_bytes: int, budget_text: str) -> list[tuple[str, int]]:
    """A plan's capacity lines: the GPU's memory when ``budget`` names a preset, then the budget itself."""
    lines = gpu_capacity(budget) if budget.strip().lower() in GPU_PRESETS else []
    return lines + [(f"budget {budget_text}" if budget_text else f"budget {format_bytes(budget_bytes)}",
                     budget_bytes)]


def prediction_answers(predictions: Sequence[tuple[str, JobPrediction]]) -> list[Answer]:
    """``remat predict``'s answers: one per policy, its distinct ranks worst first."""
    return [Answer(name, list(p.ranks)) for name, p in predictions]


def plan_answers(result: JobPlan) -> tuple[list[Answer], list[Entry]]:
    """``remat plan``'s answers (the per-stage plans, or the lowest peaks found; the one Megatron setting for every
    stage) and its policy chart: those answers' worst ranks, each stage's best Megatron setting together, and every
    setting tried on every stage (its worst stage)."""
    answers = []
    if not result.state_fits:
        answers.append(Answer("model state alone", [], "the model state does not fit before any activation",
                              [(s.stage, s.state.parts()) for s in result.stages]))
    elif result.fits:
        plans = "; ".join(f"stage {s.stage}: {s.extended.layout}" for s in result.stages if s.extended is not None)
        answers.append(Answer("per-stage plans", result.ranks(), f"each stage runs its own plan: {plans}"))
    else:
        lowest = sorted((s.prediction for s in result.stages if s.prediction is not None),
                        key=lambda r: (-r.peak_bytes, r.stage))
        answers.append(Answer("lowest peak found per stage (nothing fits)", lowest))
    if result.uniform is not None and result.uniform_ranks:
        answers.append(Answer(f"one Megatron setting: {result.uniform}", list(result.uniform_ranks),
                              "the one setting Megatron's flags can give every stage"))
    entries = [answer_entry(a) for a in answers if a.ranks]
    best = [s.megatron.prediction for s in result.stages if s.megatron is not None]
    if best and len(best) == len(result.stages):
        worst = max(best, key=lambda r: r.peak_bytes)
        entries.append(answer_entry(Answer("each stage's best Megatron setting", [worst, *best])))
    common = set.intersection(*(set(s.tried) for s in result.stages)) if result.stages else set()
    for name in sorted(common, key=lambda k: -max(s.tried[k] for s in result.stages)):
        worst_stage = max(result.stages, key=lambda s: s.tried[name])
        entries.append(Entry(f"tried: {name}", worst_stage.tried[name], f"stage {worst_stage.stage}"))
    return answers, entries


def capacity_line(predictions: Sequence[tuple[Any, JobPrediction]], capacity: tuple[str, int]) -> str:
    """The text's comparison with the capacity of each policy's rank that needs the most (reserved where
    replayed)."""
    label, limit = capacity
    parts = []
    for policy, p in predictions:
        total = max(needed_bytes(r) for r in p.ranks)
        parts.append(f"{policy} {100 * total / limit:.0f}%" + ("" if total <= limit else " (over)"))
    return f"against {label}, the rank that needs the most (reserved where replayed) uses: " + ", ".join(parts)
