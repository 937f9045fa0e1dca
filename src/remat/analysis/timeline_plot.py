"""The timelines plot of ``remat explain`` (``timelines.png``): MiB alive through one step, against its phases.

One panel per policy; the x-axis is the step's phases in order (forward of each layer, head, recompute, backward),
each phase one unit wide whatever its number of events, so a short phase such as the head/loss spike stays visible.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from remat.files import write_atomic
from remat.timeline import Timeline
from remat.units import MIB, format_bytes

# Background of each kind of phase, and what the legend calls it.
BANDS = {"forward": ("#dbe9f6", "forward"), "head": ("#f8d0cc", "head/loss (forward and backward)"),
         "recompute": ("#fde3c0", "recompute"), "backward": ("#eeeeee", "backward")}
AXIS_NOTE = ("phases of the step in order, each one unit wide: F i = forward of layer i, R i = recompute of layer i, "
             "B i = backward of layer i; head = final norm, logits and loss; emb = embedding")


@dataclass(frozen=True)
class PhaseSegment:
    """One phase of a step on the phase axis: events ``start`` to ``end`` (exclusive) drawn on ``[x, x + 1)``."""

    label: str   # the tick label: 'F3', 'head', 'R5', 'B0', 'emb'
    band: str    # a key of BANDS
    phase: str   # the phase's full label, e.g. 'recompute layer 4 [group 1 (layers 4-7)]'
    start: int
    end: int
    x: float


def _short(kind: str, region: str) -> tuple[str, str]:
    """(tick label, band) of a phase."""
    if region == "head":
        return ("head" if kind == "forward" else "B head"), "head"
    letter = {"forward": "F", "backward": "B", "recompute": "R"}.get(kind, kind[:3])
    if region.startswith("layer "):
        return f"{letter}{region.split()[1]}", kind if kind in BANDS else "backward"
    name = "emb" if region == "embedding" else (region or kind)
    return (f"{name}" if kind == "forward" else f"{name} {letter}"), kind if kind in BANDS else "backward"


def phase_segments(tl: Timeline) -> list[PhaseSegment]:
    """The phases of ``tl`` after setup, one unit each, in order.

    Args:
        tl: a measured or predicted timeline.

    Returns:
        One :class:`PhaseSegment` per non-empty phase (the setup phase, where parameters and the batch are
        registered, is left out), ``x`` counting from 0.

    Example::

        >>> [s.label for s in phase_segments(tl)][:3]
        ['emb', 'F0', 'F1']
    """
    segments: list[PhaseSegment] = []
    for phase, start, end in tl.phase_spans():
        if phase.kind == "setup":
            continue
        label, band = _short(phase.kind, phase.region)
        segments.append(PhaseSegment(label, band, phase.label, start, end, float(len(segments))))
    return segments


def phase_axis(tl: Timeline) -> tuple[np.ndarray, np.ndarray, list[PhaseSegment]]:
    """(x, MiB alive, segments): the live curve with each event placed inside its phase's unit.

    Events of a phase with ``n`` events sit at ``x + k / n``, k = 0..n-1, so the curve drawn as steps fills the
    phase's unit.
    """
    live = tl.live_bytes().astype(np.float64) / MIB
    segments = phase_segments(tl)
    xs, ys = [], []
    for seg in segments:
        n = seg.end - seg.start
        xs.append(seg.x + np.arange(n, dtype=np.float64) / n)
        ys.append(live[seg.start:seg.end])
    if not xs:
        return np.zeros(0), np.zeros(0), segments
    return np.concatenate(xs), np.concatenate(ys), segments


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
    """Write a PNG of live memory through one training step: one panel per timeline, against its phases.

    Args:
        timelines: panel title (a policy, maybe with the model it ran on) -> timeline, drawn top to bottom.
        path: the PNG to write (atomically).
        title: the figure's title.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Each panel shades its phases by kind (forward, head/loss, recompute, backward), labels every phase on the
    x-axis and marks the peak once, with its MiB and phase. Panels of one model (``meta['config']``) share the y
    scale and all panels share the x unit, so heights and lengths compare across policies. Uses matplotlib's Agg
    canvas directly: no display or global backend is needed.

    Example::

        >>> plot_timelines({"none": tl_none, "full/uniform/8": tl_whole}, "timelines.png")
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    curves = {name: phase_axis(tl) for name, tl in timelines.items()}
    n = max(len(curves), 1)
    width = max((len(segs) for _, _, segs in curves.values()), default=1) or 1
    # Panels of the same model share a y scale; another model (e.g. a larger vocabulary) gets its own.
    model = {name: json.dumps(tl.meta.get("config"), sort_keys=True) for name, tl in timelines.items()}
    tops: dict[str, float] = {}
    for name, (_, y, _) in curves.items():
        tops[model[name]] = max(tops.get(model[name], 0.0), float(y.max()) if len(y) else 0.0)
    fig = Figure(figsize=(max(11.0, 0.36 * width + 1.5), 1.55 * n + 1.3), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(n, 1, squeeze=False)[:, 0]
    colors = _colors(len(curves))
    for ax, (name, (x, y, segments)), color in zip(axes, curves.items(), colors):
        # the phase bands, one collection per panel (an axvspan per phase: a third of the plot's time)
        ax.broken_barh([(seg.x, 1.0) for seg in segments], (0, 1), transform=ax.get_xaxis_transform(),
                       facecolors=[BANDS[seg.band][0] for seg in segments], linewidth=0, zorder=0)
        if len(x):
            ax.step(np.append(x, x[-1] + (1.0 / max(segments[-1].end - segments[-1].start, 1))),
                    np.append(y, y[-1]), where="post", color=color, linewidth=1.4, zorder=2)
            i = int(np.argmax(y))
            seg = next(s for s in segments if s.x <= x[i] < s.x + 1)
            ax.plot([x[i]], [y[i]], marker="v", color=color, markersize=8, markeredgecolor="black", zorder=3)
            left = x[i] < 0.6 * width  # the words go where the panel has room
            ax.annotate(f"peak {format_bytes(timelines[name].peak_bytes)} in {seg.phase}", (x[i], y[i]),
                        xytext=(8 if left else -8, 4), textcoords="offset points", fontsize=8, zorder=4,
                        ha="left" if left else "right")
        ax.text(0.004, 0.93, name, transform=ax.transAxes, fontsize=9, fontweight="bold", va="top", zorder=4,
                bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1.5})
        ax.set_xlim(0, width)
        ax.set_ylim(0, 1.25 * tops[model[name]] or 1.0)
        ax.set_xticks([s.x + 0.5 for s in segments], [s.label for s in segments], fontsize=6.5)
        ax.tick_params(axis="x", length=0, pad=2)
        ax.tick_params(axis="y", labelsize=8)
        ax.set_ylabel("MiB", fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    axes[-1].set_xlabel(AXIS_NOTE, fontsize=8)
    handles = [Patch(color=c, label=words) for c, words in BANDS.values()]
    fig.legend(handles=handles, loc="upper right", ncol=len(handles), fontsize=8, frameon=False,
               bbox_to_anchor=(0.99, 1.0))
    fig.suptitle(title or "Memory alive through one training step", x=0.01, ha="left", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.45 / (1.55 * n + 1.3)))
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return write_atomic(path, buffer.getvalue())


def _colors(n: int) -> list[Any]:
    """tab10, repeated: each panel has one line, and tab20's pale half would vanish on the phase bands."""
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    return [cmap(i % cmap.N) for i in range(n)]
