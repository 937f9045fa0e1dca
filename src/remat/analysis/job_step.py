"""The worst rank of a job through its training step, for the job page (:mod:`remat.analysis.job_html`): its
bytes alive against its pipeline schedule (each microbatch's forward and backward per model chunk, the
microbatch-chunks in flight, the optimizer step) with the peak marked, and what is alive at the peak."""

from __future__ import annotations

from collections.abc import Sequence
from html import escape
from typing import Any

import numpy as np

from remat.analysis.html import downsample_curve, nice_ticks
from remat.parallel.job_predict import RankPrediction
from remat.parallel.stages import parse_phase_detail
from remat.timeline import Timeline
from remat.units import GIB, MIB, format_bytes

TOP_TENSORS = 15  # the largest tensors alive at the peak, listed


def scale_unit(top: float) -> tuple[str, int]:
    """The unit of an axis reaching ``top`` bytes: ``('GiB', GIB)`` from 1 GiB on, else MiB."""
    return ("GiB", GIB) if top >= GIB else ("MiB", MIB)


def schedule_bands(tl: Timeline) -> list[tuple[int, int, str, int, int]]:
    """The pipeline schedule along the step: ``(first event, one past the last, kind, microbatch, chunk)`` for each
    run of consecutive phases of one microbatch's forward ('F') or backward ('B', its recompute included) on one
    model chunk, and ``'optimizer'`` spans (microbatch and chunk -1): optimizer phases, or, where the timeline has
    none (a job's: its optimizer state is alive all step), what follows the last backward, up to the step's end."""
    spans = tl.phase_spans()
    last = max((i for i, (p, _, _) in enumerate(spans) if p.kind in ("backward", "recompute")), default=len(spans))
    bands: list[list[Any]] = []
    for i, (phase, start, end) in enumerate(spans):
        who = parse_phase_detail(phase.detail)
        if phase.kind == "optimizer" or (i > last and phase.kind == "setup"):
            kind, who = "optimizer", (-1, -1)
        elif who is None or phase.kind not in ("forward", "backward", "recompute"):
            continue
        else:
            kind = "F" if phase.kind == "forward" else "B"
        if bands and bands[-1][2:] == [kind, *who] and bands[-1][1] == start:
            bands[-1][1] = end
        else:
            bands.append([start, end, kind, *who])
    return [tuple(b) for b in bands]  # type: ignore[misc]


def in_flight_steps(tl: Timeline, bands: Sequence[tuple[int, int, str, int, int]]) -> list[tuple[int, int]]:
    """``(event, microbatch-chunks in flight from it on)``: those whose forward has started and whose backward
    has not ended."""
    spans: dict[tuple[int, int], list[int]] = {}
    for start, end, kind, mb, chunk in bands:
        if kind == "optimizer":
            continue
        span = spans.setdefault((mb, chunk), [start, tl.num_events])
        span[0] = min(span[0], start)
        if kind == "B":
            span[1] = end if span[1] == tl.num_events else max(span[1], end)
    delta: dict[int, int] = {}
    for start, end in spans.values():
        delta[start] = delta.get(start, 0) + 1
        delta[end] = delta.get(end, 0) - 1
    steps, count = [], 0
    for event in sorted(delta):
        count += delta[event]
        steps.append((event, count))
    return steps


def step_svg(rank: RankPrediction, capacity: Sequence[tuple[str, int]], svg_id: str) -> str:
    """The rank's live bytes through the step above its schedule: a lane per model chunk with each microbatch's
    forward (F) and backward (B) bands, the optimizer step, the microbatch-chunks in flight; the peak marked."""
    tl = rank.timeline
    live = tl.live_bytes()
    bands = schedule_bands(tl)
    chunks = sorted({b[4] for b in bands if b[2] != "optimizer"}) or [0]
    width, left, right, top, plot_h, lane_h, flight_h = 1080, 78, 16, 30, 260, 18, 44
    plot_w = width - left - right
    lanes_top = top + plot_h + 40
    flight_top = lanes_top + lane_h * (len(chunks) + 1) + 10
    height = flight_top + flight_h + 30
    peak, event = rank.peak_bytes, rank.peak_event
    shown = [(label, n) for label, n in capacity if n <= 1.6 * peak]
    unit, size = scale_unit(max([peak] + [n for _, n in shown]))
    ticks = nice_ticks(max([peak] + [n for _, n in shown]) * 1.05 / size, 6, cover=True)
    y_top = ticks[-1] * size or 1
    n = max(tl.num_events, 1)

    def sx(e: float) -> float:
        return left + plot_w * e / n

    def sy(v: float) -> float:
        return top + plot_h * (1 - v / y_top)

    out = [f'<svg id="{svg_id}" class="step-chart" xmlns="http://www.w3.org/2000/svg" width="{width}" '
           f'height="{height}" role="img" aria-label="the worst rank\'s bytes alive through the step, with its '
           'pipeline schedule">']
    for t in ticks:
        out.append(f'<line class="grid" x1="{left}" x2="{left + plot_w}" y1="{sy(t * size):.1f}" '
                   f'y2="{sy(t * size):.1f}"/><text x="{left - 6}" y="{sy(t * size) + 4:.1f}" text-anchor="end">'
                   f"{t:g}</text>")
    out.append(f'<text transform="translate(14 {top + plot_h / 2:.0f}) rotate(-90)" text-anchor="middle">{unit} '
               "alive</text>")
    out.append(f'<line class="axis" x1="{left}" x2="{left}" y1="{top}" y2="{top + plot_h}"/><line class="axis" '
               f'x1="{left}" x2="{left + plot_w}" y1="{top + plot_h}" y2="{top + plot_h}"/>')
    out.append(f'<text x="{left + plot_w / 2}" y="{top + plot_h + 16}" text-anchor="middle">the step, in allocation '
               f"events ({tl.num_events:,}), start to optimizer step</text>")
    for label, nbytes in shown:
        out.append(f'<line class="capacity" data-bytes="{nbytes}" x1="{left}" x2="{left + plot_w}" '
                   f'y1="{sy(nbytes):.1f}" y2="{sy(nbytes):.1f}"/><text class="capacity-label" x="{left + plot_w - 4}" '
                   f'y="{sy(nbytes) - 4:.1f}" text-anchor="end">{escape(label)}</text>')
    x, y = downsample_curve(np.arange(len(live), dtype=float), live.astype(float))
    points = " ".join(f"{sx(a):.1f},{sy(b):.1f}" for a, b in zip(x, y))
    out.append(f'<polyline class="live-line" fill="none" stroke="#1f77b4" stroke-width="1.3" points="{points}"/>')
    phase = tl.peak_phase.label
    out.append(f'<line class="peak-line" x1="{sx(event):.1f}" x2="{sx(event):.1f}" y1="{top}" '
               f'y2="{flight_top + flight_h}"/>')
    out.append(f'<circle class="peak-marker" data-bytes="{peak}" data-event="{event}" cx="{sx(event):.1f}" '
               f'cy="{sy(peak):.1f}" r="4.5" fill="#d62728" stroke="#000"><title>peak {format_bytes(peak)} '
               f"({peak:,} bytes) after event {event:,}, in {escape(phase)}</title></circle>")
    anchor = "end" if sx(event) > left + plot_w * 0.6 else "start"
    dx = -8 if anchor == "end" else 8
    out.append(f'<text x="{sx(event) + dx:.1f}" y="{max(sy(peak) - 6, top + 10):.1f}" text-anchor="{anchor}" '
               f'font-weight="bold">peak {format_bytes(peak)}: {escape(phase)}</text>')
    lane_of = {c: i for i, c in enumerate(chunks)}
    for c, i in lane_of.items():
        out.append(f'<text x="{left - 6}" y="{lanes_top + i * lane_h + 13}" text-anchor="end">chunk {c}</text>')
    out.append(f'<text x="{left - 6}" y="{lanes_top + len(chunks) * lane_h + 13}" text-anchor="end">optimizer</text>')
    out.append(f'<text x="{left + plot_w / 2}" y="{lanes_top - 8}" text-anchor="middle">pipeline schedule: F = a '
               "microbatch's forward, B = its backward (recompute included)</text>")
    for start, end, kind, mb, chunk in bands:
        lane = len(chunks) if kind == "optimizer" else lane_of[chunk]
        x0, w = sx(start), max(sx(end) - sx(start), 0.6)
        fill = "#9e9e9e" if kind == "optimizer" else (("#64b5f6", "#1e88e5") if kind == "F" else
                                                      ("#ffb74d", "#f57c00"))[mb % 2]
        tag = "optimizer" if kind == "optimizer" else f"{kind}{mb}"
        tip = "after the last backward: the optimizer step" if kind == "optimizer" else \
            f"{'forward' if kind == 'F' else 'backward'} of microbatch {mb}, chunk {chunk}"
        out.append(f'<rect class="band" data-kind="{kind}" data-microbatch="{mb}" data-chunk="{chunk}" '
                   f'x="{x0:.2f}" y="{lanes_top + lane * lane_h + 1}" width="{w:.2f}" height="{lane_h - 3}" '
                   f'fill="{fill}"><title>{escape(tip)}: events {start:,}-{end - 1:,}</title></rect>')
        if w >= 7 * len(tag):
            out.append(f'<text x="{x0 + w / 2:.1f}" y="{lanes_top + lane * lane_h + 12}" text-anchor="middle">'
                       f"{tag}</text>")
        elif kind == "optimizer":
            out.append(f'<text x="{x0 - 4:.1f}" y="{lanes_top + lane * lane_h + 12}" text-anchor="end">optimizer '
                       "step ▸</text>")
    steps = in_flight_steps(tl, bands)
    most = max((c for _, c in steps), default=0)
    if most:
        base = float(flight_top + flight_h)
        pts, prev = [(float(left), base)], base
        for e, c in steps:
            level = flight_top + flight_h * (1 - c / most)
            pts += [(sx(e), prev), (sx(e), level)]
            prev = level
        pts.append((float(left + plot_w), prev))
        out.append(f'<polyline class="in-flight" data-max="{most}" fill="none" stroke="#6a1b9a" stroke-width="1.3" '
                   f'points="{" ".join(f"{a:.1f},{b:.1f}" for a, b in pts)}"/>')
        out.append(f'<text x="{left - 6}" y="{flight_top + 12}" text-anchor="end">{most} in flight</text>'
                   f'<text x="{left - 6}" y="{flight_top + flight_h}" text-anchor="end">0</text>'
                   f'<text x="{left + plot_w / 2}" y="{flight_top + flight_h + 16}" text-anchor="middle">microbatch-'
                   "chunks in flight (forward started, backward not ended)</text>")
    out.append("</svg>")
    return "\n".join(out)


def number_ranges(values: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``'0-2, 5'``."""
    runs: list[list[int]] = []
    for v in values:
        if runs and runs[-1][1] == v - 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def peak_html(rank: RankPrediction, table_class: str = "peak-tensors") -> str:
    """What is alive at the rank's peak: the pipeline's words, the microbatches in flight (per model chunk), the
    largest tensors (those alike, of one module and phase, on one row with their count)."""
    tl = rank.timeline
    info = (tl.meta.get("pipeline") or {}).get("peak") or {}
    out = []
    if tl.meta.get("why"):
        out.append(f'<p class="why">{escape(tl.meta["why"])}</p>')
    chunks: dict[int, list[dict[str, Any]]] = {}
    for a in info.get("alive") or []:
        chunks.setdefault(a["chunk"], []).append(a)
    items = []
    for chunk, alive in chunks.items():
        sizes = [a["bytes"] for a in alive]
        each = format_bytes(sizes[0]) if min(sizes) == max(sizes) else \
            f"{format_bytes(min(sizes))} to {format_bytes(max(sizes))}"
        items.append(f"chunk {chunk}: microbatch{'es' * (len(alive) > 1)} "
                     f"{number_ranges(sorted(a['microbatch'] for a in alive))}, {format_bytes(sum(sizes))} in all "
                     f"({each} each)")
    if items:
        out.append(f'<p class="in-flight-at-peak">In flight at the peak: {escape("; ".join(items))}.</p>')
    groups: dict[tuple[int, str, str, str], int] = {}
    for t in tl.top_allocations(tl.peak_event, 20 * TOP_TENSORS):
        key = (t["nbytes"], t["category"], t["module"], t["phase"])
        groups[key] = groups.get(key, 0) + 1
    rows = "".join(f'<tr class="tensor-row" data-bytes="{n}" data-count="{count}"><td title="{n:,} bytes">'
                   f'{format_bytes(n)}</td><td>{"×" + str(count) if count > 1 else ""}</td><td class="text">'
                   f'{escape(category)}</td><td class="text">{escape(module)}</td><td class="text">{escape(phase)}'
                   "</td></tr>" for (n, category, module, phase), count in list(groups.items())[:TOP_TENSORS])
    out.append(f'<table class="{table_class}"><thead><tr><th>bytes</th><th></th><th class="text">category</th>'
               '<th class="text">module</th><th class="text">made in</th></tr></thead>'
               f"<tbody>{rows}</tbody></table>")
    return "\n".join(out)
