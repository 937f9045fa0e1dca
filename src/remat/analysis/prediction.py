"""Rows and tables of predictions: per-part bytes of a timeline, and the formula report beside it."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from typing import Any

from remat.analysis.differences import explain_differences, traced_layer_bytes
from remat.analysis.formulas import korthikanti_layer_bytes, megatron_estimate
from remat.analysis.report import format_table, size_cell
from remat.config import ModelConfig
from remat.units import format_bytes, table_unit

# Parts of the bytes alive at the peak, as the tables show them: (category, column header).
PART_COLUMNS = (("parameters", "params"), ("gradients", "grads"), ("optimizer_state", "optim"),
                ("group_inputs", "inputs"), ("saved_activations", "saved act"), ("recompute", "recompute"),
                ("head_loss", "head/loss"), ("other", "other"))


def prediction_row(policy: Any, timeline: Any, seconds: float | None = None) -> dict[str, Any]:
    """One policy's predicted step: peak bytes, the phase it is in, what is alive there (by category, adding up to
    the peak), the FLOPs per phase kind and the extra compute: recompute FLOPs over forward + backward FLOPs, %
    (matmul-style FLOPs as ``torch.utils.flop_counter`` counts them)."""
    flops = {k: int(v) for k, v in timeline.meta.get("flops", {}).items()}
    base = flops.get("forward", 0) + flops.get("backward", 0)
    # the columns converted once (a sweep makes a row per policy): what is alive at the peak adds up to the peak
    peak_event, at_peak = timeline.peak_parts()
    row: dict[str, Any] = {
        "policy": str(policy),
        "peak_bytes": sum(at_peak.values()),
        "peak_phase": timeline.phase_at(peak_event).label,
        "at_peak": at_peak,
        "flops": flops,
        "extra_compute_pct": 100.0 * flops.get("recompute", 0) / base if base else 0.0,
    }
    host = timeline.meta.get("host_memory")
    if host:  # fine-grained activation offloading: host bytes, apart from the device peak
        row["host_peak_bytes"] = host["peak_bytes"]
        row["offloaded_bytes"] = dict(host["offloaded_bytes"])
    if "composed_from" in timeline.meta:
        row["composed_from"] = timeline.meta["composed_from"]
    if "composition_refused" in timeline.meta:
        row["composition_refused"] = timeline.meta["composition_refused"]
    if seconds is not None:
        row["seconds"] = seconds
    return row


def format_prediction_table(rows: Sequence[dict[str, Any]]) -> str:
    """The ``remat predict`` table: policy, peak, where, the at-peak parts, extra compute %."""

    unit, divisor = table_unit(max((r["peak_bytes"] for r in rows), default=0))
    size = size_cell(divisor)
    flat = [{**r, **{f"part:{k}": v for k, v in r["at_peak"].items()}} for r in rows]
    parts = [(k, h) for k, h in PART_COLUMNS if k != "optimizer_state" or any(r["at_peak"].get(k) for r in rows)]
    columns = [("policy", "policy", str), ("peak_bytes", f"peak {unit}", size), ("peak_phase", "where", str)]
    columns += [(f"part:{k}", h, size) for k, h in parts]
    if any("host_peak_bytes" in r for r in rows):  # offloading policies: their host memory
        columns.append(("host_peak_bytes", f"host {unit}", lambda v: size(v) if v is not None else "-"))
    columns.append(("extra_compute_pct", "extra compute %", lambda v: f"{v:.1f}"))
    return format_table(flat, columns)


def formula_report(config: ModelConfig, timeline: Any, **parallel: Any) -> dict[str, Any]:
    """Korthikanti's and Megatron's per-layer bytes beside the traced bytes of one layer of ``timeline`` (a
    no-recompute trace of ``config``), with each quantified reason
    (:func:`remat.analysis.differences.explain_differences`)."""

    traced = traced_layer_bytes(timeline, 0)
    differences = explain_differences(config, traced, device="cpu", **parallel)
    estimate = megatron_estimate(config, **parallel)
    return {
        "traced_layer_bytes": traced,
        "traced_layer": 0,
        "korthikanti_layer_bytes": korthikanti_layer_bytes(config, **parallel),
        "megatron_layer_bytes": estimate["per_layer_bytes"],
        "megatron_total_bytes": estimate["total_bytes"],
        "differences": [d.to_dict() for d in differences],
    }


def format_formula_report(report: dict[str, Any], config: ModelConfig, width: int = 110) -> str:
    """The formulas-beside-the-trace section below the predict table."""
    traced = report["traced_layer_bytes"]
    lines = [f"No recompute, one layer (layer {report['traced_layer']}: the bytes its forward allocates and still "
             f"holds when backward starts), s={config.seq_length} b={config.micro_batch_size} "
             f"h={config.hidden_size} a={config.num_attention_heads}:"]
    label_width = 40
    for diff in report["differences"]:
        label = f"{diff['source']} {diff['formula']}"
        lines.append(f"  {label:<{label_width}} {diff['estimate_bytes']:>16,} bytes")
    lines.append(f"  {'traced (CPU kernels, exact)':<{label_width}} {traced:>16,} bytes")
    for diff in report["differences"]:
        frac = diff["difference_fraction"]
        lines += ["", f"{diff['source']} -> traced: {diff['difference_bytes']:+,} bytes ({100 * frac:+.1f}%), "
                      f"{len(diff['reasons'])} reason(s):"]
        for reason in diff["reasons"]:
            text = f"{reason['nbytes']:+,} {reason['title']}: {reason['detail']}"
            lines.append(textwrap.fill(text, width=width, initial_indent="  - ", subsequent_indent="    "))
        if diff["unexplained_bytes"]:
            lines.append(f"  ({diff['unexplained_bytes']:+,} bytes unexplained)")
    lines += ["", f"Megatron's whole-model activation estimate (theoretical_memory_usage, 1 pipeline stage): "
                  f"{format_bytes(report['megatron_total_bytes'])}."]
    return "\n".join(lines)
