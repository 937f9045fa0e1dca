"""Per-stage summaries of pipeline timelines: what is in flight at the peak, and measured-vs-predicted errors."""

from __future__ import annotations

import math
from typing import Any

from remat.parallel.schedule import SAVED_CATEGORIES
from remat.parallel.stages import parse_phase_detail
from remat.timeline import Timeline
from remat.units import format_mib


# ------------------------------------------------------------------------------------------------ analysis
def _pair_spans(tl: Timeline) -> dict[tuple[int, int], tuple[int, int | None]]:
    """(microbatch, chunk) -> (first event of its forward, one past the last event of its backward or None)."""
    spans: dict[tuple[int, int], tuple[int, int | None]] = {}
    for phase, start, end in tl.phase_spans():
        who = parse_phase_detail(phase.detail)
        if who is None:
            continue
        first, last = spans.get(who, (start, None))
        if phase.kind in ("backward", "recompute"):
            last = end if last is None else max(last, end)
        spans[who] = (min(first, start), last)
    return spans


def in_flight_at(tl: Timeline, event: int) -> tuple[dict[tuple[int, int], dict[str, int]], dict[tuple[int, int], int]]:
    """What the microbatches leave alive after ``event``.

    Returns (in flight, kept): in flight maps each (microbatch, chunk) whose forward has started and whose
    backward has not ended to the bytes of its saved tensors alive (by category, :data:`SAVED_CATEGORIES`); kept
    maps each (microbatch, chunk) whose backward has ended to the bytes still alive that it made (its output or
    input gradient, held by the pipeline runtime's send handles or variables).
    """
    spans = _pair_spans(tl)
    flight: dict[tuple[int, int], dict[str, int]] = {}
    kept: dict[tuple[int, int], int] = {}
    phase_who = [parse_phase_detail(phase.detail) for phase in tl.phases]  # once a phase, not once a row
    for row in tl.alive_at(event).tolist():
        who = phase_who[tl.phase_index[row]]
        if who is None:
            continue
        _, end = spans.get(who, (0, None))
        if end is not None and end <= event:
            if tl.category[row] not in ("parameters", "gradients", "optimizer_state"):
                kept[who] = kept.get(who, 0) + tl.nbytes[row]
        elif tl.category[row] in SAVED_CATEGORIES:
            parts = flight.setdefault(who, {})
            parts[tl.category[row]] = parts.get(tl.category[row], 0) + tl.nbytes[row]
    return dict(sorted(flight.items())), dict(sorted(kept.items()))


def describe_stage(tl: Timeline) -> str:
    """Fill ``meta['pipeline']['peak']`` (bytes, phase, the microbatches whose saved tensors are alive, what the
    runtime keeps of finished ones) and ``meta['why']`` (plain words) of a stage timeline; return the sentence."""
    info = tl.meta.setdefault("pipeline", {})
    event, parts = tl.peak_parts()  # once: peak_event, peak_bytes and at_peak would each convert the columns again
    peak = sum(parts.values())
    flight, kept = in_flight_at(tl, event)
    saved = sum(sum(v.values()) for v in flight.values())
    held = sum(kept.values())
    phase = tl.phase_at(event)
    running = parse_phase_detail(phase.detail)
    info["peak"] = {
        "bytes": peak, "event": event, "phase": phase.label,
        "in_flight": len(flight),
        "alive": [{"microbatch": mb, "chunk": c, "bytes": sum(v.values()), **v} for (mb, c), v in flight.items()],
        "saved_bytes": saved,
        "kept_after_backward": [{"microbatch": mb, "chunk": c, "bytes": n} for (mb, c), n in kept.items()],
        "kept_bytes": held, "breakdown": parts,
    }
    stage = info.get("stage", "?")
    schedule = info.get("schedule", "?")
    vpp = info.get("vpp", 1)
    names = ", ".join(f"{mb}" + (f" (chunk {c})" if vpp > 1 else "") for mb, c in flight)
    words = [f"Stage {stage} peaks at {format_mib(peak, 2)} during {phase.label}."]
    if flight:
        n = len(flight)
        what = ("microbatch-chunk" if vpp > 1 else "microbatch") + ("s" if n > 1 and vpp > 1 else "es" if n > 1
                                                                    else "")
        words.append(f"{n} {what} in flight (microbatch {names}) keep{'s' if n == 1 else ''} saved activations "
                     f"and checkpoint inputs there: {format_mib(saved, 2)}"
                     + (f", about {format_mib(saved / n, 2)} each" if n > 1 else "")
                     + f", {100 * saved / max(peak, 1):.0f}% of the peak.")
    warm = info.get("warmup_forwards")
    top = info.get("max_in_flight")
    pp = info.get("pp", "?")
    if schedule == "gpipe":
        words.append("GPipe runs every forward before any backward, so every microbatch's saved tensors are alive "
                     "when the first backward starts, on every stage.")
    elif schedule == "1f1b":
        words.append(f"1F1B runs {warm} warm-up forward{'s' if warm != 1 else ''} on this stage before its first "
                     f"backward, then one forward before each backward, so it holds up to {top} "
                     f"microbatch{'es' if top != 1 else ''} (pp - stage = {pp} - {stage}): the first stage holds the "
                     "most, the last one.")
    elif schedule == "interleaved":
        words.append(f"Interleaved 1F1B runs {warm} warm-up forwards over this stage's {vpp} model chunks before "
                     f"its first backward ((pp - stage - 1) * 2 + (vpp - 1) * pp), so up to {top} microbatch-chunks "
                     "are in flight, each a 1/vpp slice of the stage's layers.")
    if running is not None and phase.kind in ("backward", "recompute"):
        doing = ("recomputing a checkpointed group" if phase.kind == "recompute"
                 else "its activation gradients and temporaries")
        words.append(f"The peak comes while microbatch {running[0]}'s backward runs on top of them ({doing}).")
    if held:
        words.append(f"The pipeline runtime still holds {format_mib(held, 2)} of outputs or input gradients of "
                     f"{len(kept)} finished microbatch{'es' if len(kept) > 1 else ''} (kept by send handles or "
                     "schedule variables).")
    words.append(f"Parameters {format_mib(parts.get('parameters', 0), 2)}, gradients "
                 f"{format_mib(parts.get('gradients', 0), 2)}, receive buffers, batch and backward temporaries "
                 f"{format_mib(parts.get('other', 0), 2)}.")
    text = " ".join(words)
    tl.meta["why"] = text
    return text


def stage_summary(tl: Timeline) -> dict[str, Any]:
    """A JSON-able summary of one stage timeline: stage, peak bytes, peak phase, in-flight count, why."""
    info = tl.meta.get("pipeline", {})
    if "peak" not in info:
        describe_stage(tl)
    peak = info["peak"]
    return {"stage": info.get("stage"), "policy": tl.meta.get("policy"), "schedule": info.get("schedule"),
            "microbatches": info.get("microbatches"), "peak_bytes": tl.peak_bytes, "peak_phase": peak["phase"],
            "max_in_flight": info.get("max_in_flight"), "in_flight_at_peak": peak["in_flight"],
            "saved_bytes_at_peak": peak["saved_bytes"], "kept_bytes_at_peak": peak["kept_bytes"],
            "why": tl.meta.get("why", "")}


def same_step(a: Timeline, b: Timeline) -> str | None:
    """None when two timelines allocate and free the same bytes in the same order (phases and module names may
    differ), else what differs first. Used to check that a 1-stage, 1-microbatch pipeline is the plain step."""
    for name in ("num_events",):
        if getattr(a, name) != getattr(b, name):
            return f"{name}: {getattr(a, name)} != {getattr(b, name)}"
    for name in ("nbytes", "alloc_at", "free_at", "category"):
        x, y = getattr(a, name), getattr(b, name)
        if x != y:
            i = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
            return f"{name} differs first at row {i}"
    return None


def peak_error(measured: int, predicted: int) -> float:
    """(predicted - measured) / measured, or 0 when both are 0."""
    if measured == 0:
        return 0.0 if predicted == 0 else math.inf
    return (predicted - measured) / measured
