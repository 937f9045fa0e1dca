#!/usr/bin/env python
"""What Megatron's MoE and MLA recompute modules save on ``deepseek-v3`` and ``mixtral-8x7b``, and what they cost.

For each preset (default micro batch, sequence and dtype of the preset; the whole decoder stack on one rank; the
``cuda`` kernel profile and 512-byte CUDA allocator blocks; balanced routing, remat's default assumption) and each
Megatron setting - ``none``, ``selective`` (Megatron's default modules: core_attn), each MoE/MLA module alone
(``moe_act``, ``moe``, ``shared_experts``, ``mla_up_proj``: a module the model lacks or Megatron refuses for it is
printed with remat's refusal), the model's modules combined, and ``full/uniform/1`` - the step is predicted with
:func:`remat.memory.predict.predict_config` (fake tensors, deep stacks composed from shallow traces) and printed:

* the step's peak (parameters and gradients included) and where it is;
* the activation peak: the most bytes alive at once that are not parameters, gradients or optimizer states
  (:func:`remat.analysis.explain_data.category_live` over the other categories), and where it is;
* what is alive at the activation peak: the largest tensors (:meth:`remat.timeline.Timeline.top_allocations`),
  the same tensor of every layer counted together (``layers.*.``);
* the extra compute: recomputed FLOPs over forward + backward FLOPs
  (:func:`remat.analysis.prediction.prediction_row`, ``torch.utils.flop_counter``'s formulas, which count
  matmuls and attention only: recomputing an activation function costs 0% there);

then, per recompute module, its saving (activation peak and step peak against ``none``) beside that cost.

    python benchmarks/bench_moe.py                 # both presets, cold (no disk cache), about a minute on 2 cores
    python benchmarks/bench_moe.py --presets mixtral-8x7b --cache --json moe.json
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from typing import Any

import numpy as np

from remat.analysis.explain_data import category_live
from remat.analysis.prediction import prediction_row
from remat.config import ConfigError
from remat.memory import disk_cache
from remat.memory.kernels import use_kernels
from remat.memory.predict import predict_config
from remat.plan.megatron import MOE_MLA_MODULES, megatron_modules
from remat.policy import Policy, PolicyError
from remat.presets import get_preset
from remat.recompute.region import ApplyError
from remat.timeline import CATEGORIES, Timeline
from remat.units import format_bytes

PRESETS = ("deepseek-v3", "mixtral-8x7b")
WEIGHTS = ("parameters", "gradients", "optimizer_state")
ACTIVATIONS = tuple(c for c in CATEGORIES if c not in WEIGHTS)
TOP = 4  # tensors (grouped over layers) listed as alive at the activation peak


def policies_of(config: Any) -> list[tuple[str, str]]:
    """(label, policy text) of every setting the benchmark predicts for ``config``: each of Megatron's MoE/MLA
    modules alone (those the model lacks too, to show remat's refusal), then the ones it has combined (all of
    them; and, when there are two or more besides ``moe``, those without ``moe``, which already recomputes the
    experts and the shared expert)."""
    has = megatron_modules(config)[1]
    rows = [("none", "none"), ("selective (default)", "selective")]
    rows += [(m, f"selective/{m}") for m in MOE_MLA_MODULES]
    if len(has) > 1:
        rows.append(("combined", "selective/" + "+".join(has)))
    fine = tuple(m for m in has if m != "moe")
    if len(fine) > 1 and len(fine) < len(has):
        rows.append(("combined w/o moe", "selective/" + "+".join(fine)))
    rows.append(("full/uniform/1", "full/uniform/1"))
    return rows


def activation_peak(tl: Timeline) -> tuple[int, int]:
    """(bytes, event) of the most non-weight bytes (:data:`ACTIVATIONS`) alive at once."""
    live = category_live(tl, ACTIVATIONS)
    event = int(np.argmax(live))
    return int(live[event]), event


def alive_groups(tl: Timeline, event: int, n: int = TOP) -> list[tuple[str, str, int, int]]:
    """The ``n`` largest groups of non-weight tensors alive after ``event``: (module with every layer index as
    ``*``, category, total bytes, tensors), largest first."""
    groups: dict[tuple[str, str], list[int]] = {}
    for item in tl.top_allocations(event, n=len(tl)):
        if item["category"] in WEIGHTS:
            continue
        key = (re.sub(r"layers\.\d+\.", "layers.*.", item["module"] or "?"), item["category"])
        entry = groups.setdefault(key, [0, 0])
        entry[0] += item["nbytes"]
        entry[1] += 1
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])[:n]
    return [(module, category, total, count) for (module, category), (total, count) in ranked]


def predict_row(config: Any, label: str, text: str) -> dict[str, Any]:
    """One setting's prediction as a row (``refused`` holds the reason when remat refuses it)."""
    started = time.perf_counter()
    try:
        policy = Policy.parse(text)
        tl = predict_config(config, policy, device="cuda")
    except (PolicyError, ApplyError, ConfigError) as err:
        return {"label": label, "policy": text, "refused": str(err)}
    row = prediction_row(policy, tl, time.perf_counter() - started)
    act, event = activation_peak(tl)
    row.update(label=label, activation_peak_bytes=act, activation_peak_phase=tl.phase_at(event).label,
               alive=alive_groups(tl, event))
    return row


def format_rows(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'setting':<20}{'policy':<48}{'step peak':>12}{'act peak':>12}  {'act peak in':<22}"
             f"{'extra FLOPs':>11}  alive at the activation peak (largest)"]
    for r in rows:
        if "refused" in r:
            lines.append(f"{r['label']:<20}{r['policy']:<48}  refused: {r['refused']}")
            continue
        alive = "; ".join(f"{m} ({c}) {format_bytes(b)}" + (f" x{k}" if k > 1 else "")
                          for m, c, b, k in r["alive"])
        lines.append(f"{r['label']:<20}{r['policy']:<48}{format_bytes(r['peak_bytes']):>12}"
                     f"{format_bytes(r['activation_peak_bytes']):>12}  {r['activation_peak_phase']:<22}"
                     f"{r['extra_compute_pct']:>10.1f}%  {alive}")
    return "\n".join(lines)


def markdown(rows: list[dict[str, Any]], saved: list[dict[str, Any]]) -> str:
    """Both tables of one preset as one Markdown table (for benchmarks/README.md)."""
    by_label = {r["label"]: r for r in saved}
    lines = ["| setting | step peak | activation peak (where) | act. saved vs none | extra FLOPs | largest alive at "
             "the activation peak |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "refused" in r:
            lines.append(f"| {r['label']} (`{r['policy']}`) | refused: {r['refused']} | | | | |")
            continue
        s = by_label.get(r["label"])
        save = f"{format_bytes(s['activation_saved_bytes'])} ({s['activation_saved_pct']:.1f}%)" if s else "-"
        alive = "; ".join(f"`{m}` {c} {format_bytes(b)}" + (f" ({k} tensors)" if k > 1 else "")
                          for m, c, b, k in r["alive"][:3])
        lines.append(f"| {r['label']} (`{r['policy']}`) | {format_bytes(r['peak_bytes'])} | "
                     f"{format_bytes(r['activation_peak_bytes'])} ({r['activation_peak_phase']}) | {save} | "
                     f"{r['extra_compute_pct']:.1f}% | {alive} |")
    return "\n".join(lines)


def savings(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each recompute setting against ``none``: activation-peak and step-peak bytes saved, extra FLOPs %."""
    plain = next(r for r in rows if r["policy"] == "none")
    out = []
    for r in rows:
        if r is plain or "refused" in r:
            continue
        saved = plain["activation_peak_bytes"] - r["activation_peak_bytes"]
        out.append({"label": r["label"], "policy": r["policy"], "activation_saved_bytes": saved,
                    "activation_saved_pct": 100.0 * saved / plain["activation_peak_bytes"],
                    "step_saved_bytes": plain["peak_bytes"] - r["peak_bytes"],
                    "extra_compute_pct": r["extra_compute_pct"]})
    return out


def format_savings(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'setting':<20}{'act peak saved':>16}{'% of none':>10}{'step peak saved':>17}{'extra FLOPs':>12}"
             f"{'MiB saved per 1% FLOPs':>24}"]
    for r in rows:
        per = (f"{r['activation_saved_bytes'] / (1 << 20) / r['extra_compute_pct']:,.0f}"
               if r["extra_compute_pct"] > 0 else "-")
        lines.append(f"{r['label']:<20}{format_bytes(r['activation_saved_bytes']):>16}"
                     f"{r['activation_saved_pct']:>9.1f}%{format_bytes(r['step_saved_bytes']):>17}"
                     f"{r['extra_compute_pct']:>11.1f}%{per:>24}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default=",".join(PRESETS), help=f"comma-separated (default {','.join(PRESETS)})")
    parser.add_argument("--cache", action="store_true",
                        help="read and write remat's disk cache of shallow traces (default off: cold timings)")
    parser.add_argument("--json", help="also write the rows as JSON to this file")
    parser.add_argument("--markdown", action="store_true", help="also print each preset as a Markdown table")
    args = parser.parse_args(argv)
    disk_cache.set_enabled(args.cache)
    started = time.perf_counter()
    report = {}
    for name in [p.strip() for p in args.presets.split(",") if p.strip()]:
        config = get_preset(name)
        t0 = time.perf_counter()
        with use_kernels("cuda"):
            rows = [predict_row(config, label, text) for label, text in policies_of(config)]
        seconds = time.perf_counter() - t0
        print(f"\n== {name}: {config.num_layers} layers, h={config.hidden_size}, s={config.seq_length}, "
              f"b={config.micro_batch_size}, {config.dtype}, {config.num_moe_experts} experts top-"
              f"{config.moe_router_topk}{', MLA' if config.multi_latent_attention else ''}; kernels=cuda, "
              f"device=cuda (512-byte blocks), balanced routing; {seconds:.1f} s\n")
        print(format_rows(rows))
        print()
        print(format_savings(savings(rows)))
        if args.markdown:
            print("\n" + markdown(rows, savings(rows)))
        report[name] = {"seconds": seconds, "rows": rows, "savings": savings(rows)}
    total = time.perf_counter() - started
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\nbench_moe: {total:.1f} s (load average {load:.1f}, disk cache {'on' if args.cache else 'off'})")
    if args.json:
        import json

        from remat.files import write_atomic

        write_atomic(args.json, json.dumps(report, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
