#!/usr/bin/env python
"""How accurate and how fast remat's prediction is.

(a) Accuracy. A grid of the reference GPT: GPT-style (GeLU, LayerNorm, learned positions, math attention,
dropout 0.1) and Llama-style (SwiGLU, RMSNorm, rotary, grouped-query sdpa attention, no dropout, no biases), two
sizes each, fp32 and bf16; for each, every policy remat implements - ``none``, ``full/uniform/K`` and
``full/block/K`` for every K, every selective module set (Megatron's core_attn/mlp/layernorm and remat's own
``act``) - with both engines (reentrant, non-reentrant). Each policy is predicted (``remat.memory.predict.predict``:
FakeTensorMode, composed from shallow stand-ins) and measured on this CPU with real tensors
(``remat.measure``). Printed per row: both peaks, the peak error and the worst error among the parts alive at the
peak (parameters, gradients, group inputs, saved activations, recompute, head/loss, other); then the worst of
each over the grid. error = (predicted - measured) / measured; a part measured as 0 bytes is taken relative to
the peak. Offloading rows (Megatron's fine-grained activation offloading, ``,offload:...``) also check the host
bytes (``meta['host_memory']``: peak, per module, series) predicted == measured.

(b) Speed, on the ``llama3-70b`` preset (80 layers, h=8192, s=8192, GQA, SwiGLU): for ``full/uniform/1`` (the
headline) and a few other policies, the full fake trace of all 80 layers (``predict_config(...,
compose_layers=False)``) against ``predict_config``'s composition from a shallow stand-in, cold (stand-in cache
emptied) and warm (stand-ins cached), with the speed-up (target: >= 20x cold for the headline; a policy whose
stand-in needs d layers cannot beat about 80/d cold); every composed timeline is checked equal to its full trace
(live curve, peak, at-peak parts, FLOPs). Then the whole Megatron sweep (none, every uniform and block K, the
selective module sets: 168 policies) through ``predict_many`` from a cold cache (target: <= 5 s on 2 cores), once
more as ``remat predict`` runs it (objects alive after start-up frozen with ``gc.freeze``), and (not with
``--quick``) the ``deepseek-v3`` sweep, MoE/MLA modules included (61 layers, 3 dense then 58 MoE: 127 policies;
target <= 10 s). The shallow traces of a sweep are made side by side on the cores
(:mod:`remat.memory.trace_pool`; ``REMAT_TRACE_WORKERS=1`` makes them one by one).

Speed runs first, in a fresh process. Times are wall-clock seconds on a possibly shared machine: the load
average is printed beside them.

Usage::

    python benchmarks/bench_predict.py            # everything (several minutes on 2 cores)
    python benchmarks/bench_predict.py --quick    # a smoke run: small grid, one speed policy, a 16-layer sweep
    python benchmarks/bench_predict.py --json out.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from itertools import combinations
from typing import Any

import numpy as np
import torch

import remat.memory.predict as predict_module
from remat.config import ModelConfig
from remat.memory.comparison import part_errors
from remat.memory.measure import measure
from remat.memory.predict import predict, predict_config, predict_many
from remat.memory.trace_pool import available_workers
from remat.models.gpt import build_model, sample_batch
from remat.plan.megatron import megatron_sweep
from remat.presets import get_preset
from remat.recompute.apply import apply
from remat.timeline import Timeline

GPT = dict(activation="gelu", normalization="layernorm", position="learned", attention="math",
           hidden_dropout=0.1, attention_dropout=0.1, add_bias_linear=True)
LLAMA = dict(activation="swiglu", normalization="rmsnorm", position="rope", attention="sdpa", hidden_dropout=0.0,
             attention_dropout=0.0, add_bias_linear=False)
SIZES = {
    "small": dict(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=64, micro_batch_size=2,
                  vocab_size=256),
    "large": dict(num_layers=6, hidden_size=128, num_attention_heads=8, seq_length=128, micro_batch_size=2,
                  vocab_size=1024),
}
QUICK_SIZES = {"tiny": dict(num_layers=3, hidden_size=32, num_attention_heads=4, seq_length=16, micro_batch_size=2,
                            vocab_size=64)}
# The first is the headline (Megatron's usual full recompute); the others show how the cold speed-up falls with the
# stand-in's depth (about 80 / stand-in layers at best: uniform K >= 3 and block stand-ins need 6-9 layers).
SPEED_POLICIES = ["full/uniform/1", "none", "selective/core_attn", "full/block/40", "full/uniform/4"]


def grid_configs(quick: bool) -> list[tuple[str, ModelConfig]]:
    out = []
    for style, fields in (("gpt", GPT), ("llama", LLAMA)):
        for size, dims in (QUICK_SIZES if quick else SIZES).items():
            for dtype in ("fp32", "bf16"):
                groups = {"num_query_groups": dims["num_attention_heads"] // 2} if style == "llama" else {}
                out.append((f"{style}-{size}-{dtype}", ModelConfig(**dims, **fields, **groups, dtype=dtype)))
    for size, dims in (QUICK_SIZES if quick else SIZES).items():
        # MoE rows: a first dense layer, then MoE layers (balanced routing forced in both runs, as the prediction
        # assumes it): Mixtral-style separate experts in bf16, DeepSeek-style grouped experts + MLA in fp32
        first_dense = (0,) + (1,) * (dims["num_layers"] - 1)
        moe = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=dims["hidden_size"],
                   moe_layer_freq=first_dense, moe_routing_assumption="balanced", **LLAMA)
        out.append((f"moe-{size}-bf16", ModelConfig(**dims, **moe, moe_shared_expert_intermediate_size=dims[
            "hidden_size"], dtype="bf16")))
        mla = dict(multi_latent_attention=True, q_lora_rank=dims["hidden_size"] // 2, kv_lora_rank=16,
                   qk_head_dim=8, qk_pos_emb_head_dim=8, v_head_dim=8)
        out.append((f"mla-moe-{size}-fp32", ModelConfig(**dims, **{**moe, "attention": "math"}, **mla,
                                                        moe_grouped_gemm=True, moe_router_score_function="sigmoid")))
    return out


def moe_policies(config: ModelConfig) -> list[str]:
    """Megatron's MoE/MLA recompute modules the config has (moe_act only with grouped experts), both engines."""
    if not config.is_moe:
        return []
    names = ["selective/moe", "selective/shared_experts", "selective/core_attn+moe"]
    if config.moe_grouped_gemm:
        names += ["selective/moe_act", "selective/moe_act+moe"]
    if config.multi_latent_attention:
        names += ["selective/mla_up_proj", "selective/core_attn+mla_up_proj+moe_act"]
    if config.moe_shared_expert_intermediate_size is None:
        names.remove("selective/shared_experts")
    return names + [f"{n}@non-reentrant" for n in names]


def offload_policies(config: ModelConfig) -> list[str]:
    """Megatron's fine-grained activation offloading, alone and beside selective recompute; the minimum size is
    b*s elements so that hidden-sized tensors move at these sizes (Megatron's default, 1M elements, moves none)."""
    low = f"offload_min:{config.micro_batch_size * config.seq_length}"
    names = [f"none,offload:attn_norm+qkv_linear+core_attn+attn_proj+mlp_norm,{low}",
             f"selective/core_attn,offload:attn_norm+core_attn+attn_proj,{low}"]
    if config.moe_grouped_gemm:
        names.append(f"selective/moe_act,offload:mlp_norm+expert_fc1+moe_act,{low}")
    return names


def foundation_policies(num_layers: int) -> list[str]:
    """Every policy remat implements on a ``num_layers`` stack, with both engines (none once)."""
    act_sets = ["selective/" + "+".join(c) for n in range(1, 4) for c in combinations(("core_attn", "layernorm",
                                                                                         "act"), n) if "act" in c]
    operator_level = ["selective/non_matmul", "selective/core_attn+mlp+non_matmul", "selective/non_matmul+matmul_k64"]
    names = megatron_sweep(num_layers) + act_sets + operator_level
    return names + [f"{n}@non-reentrant" for n in names if n != "none"]


def load() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


# ------------------------------------------------------------------------------------------------ (a) accuracy
def accuracy(quick: bool) -> dict[str, Any]:
    torch.set_num_threads(1)  # bytes do not depend on threads; one thread keeps the real steps steady
    rows = []
    started = time.perf_counter()
    print("\n(a) accuracy: predicted vs measured peak on this CPU (real tensors), every policy, both engines")
    header = (f"{'config':<17} {'policy':<50} {'predicted B':>12} {'measured B':>12} {'peak err %':>10} "
              f"{'worst part':>17} {'part err %':>10}")
    print(header)
    print("-" * len(header))
    for name, config in grid_configs(quick):
        batch = sample_batch(config)
        for policy in foundation_policies(config.num_layers) + moe_policies(config) + offload_policies(config):
            # predict first: this also warms torch's lazy imports before the first real step is recorded
            pred = predict(config, policy)
            model = build_model(config, seed=0)
            apply(model, policy)
            torch.manual_seed(0)
            meas = measure(model, batch)
            del model
            error = (pred.peak_bytes - meas.peak_bytes) / meas.peak_bytes
            errors = part_errors(pred.at_peak, meas.at_peak, meas.peak_bytes)
            worst = max(errors, key=lambda k: abs(errors[k]))
            worst_error = errors[worst]
            rows.append({"config": name, "policy": policy, "predicted_bytes": pred.peak_bytes,
                         "measured_bytes": meas.peak_bytes, "error": error,
                         "worst_part": worst if worst_error else None, "worst_part_error": worst_error,
                         "composed": "composed_from" in pred.meta,
                         # offloading: the host bytes too (series, peak, per module) must be the same
                         "host_equal": pred.meta.get("host_memory") == meas.meta.get("host_memory")})
            print(f"{name:<17} {policy:<50} {pred.peak_bytes:>12,} {meas.peak_bytes:>12,} {100 * error:>+10.4f} "
                  f"{worst if worst_error else '-':>17} {100 * worst_error:>+10.4f}", flush=True)
    worst_peak = max(rows, key=lambda r: abs(r["error"]))
    worst_part = max(rows, key=lambda r: abs(r["worst_part_error"]))
    exact = sum(r["error"] == 0 and r["worst_part_error"] == 0 for r in rows)
    print(f"\n{len(rows)} rows ({sum(r['composed'] for r in rows)} composed from shallow stand-ins), "
          f"{exact} exact to the byte, {time.perf_counter() - started:.0f} s")
    print(f"worst peak error: {100 * worst_peak['error']:+.4f}% ({worst_peak['config']} {worst_peak['policy']})")
    print(f"worst part error: {100 * worst_part['worst_part_error']:+.4f}% ({worst_part['config']} "
          f"{worst_part['policy']}, {worst_part['worst_part'] or 'every part exact'})")
    offloaded = [r for r in rows if ",offload:" in r["policy"]]
    print(f"offloading rows: {len(offloaded)}, host bytes (peak, per module, series) predicted == measured in "
          f"{sum(r['host_equal'] for r in offloaded)}")
    return {"rows": rows, "worst_peak_error": worst_peak["error"], "worst_part_error": worst_part["worst_part_error"],
            "host_bytes_equal": all(r["host_equal"] for r in rows)}


# ------------------------------------------------------------------------------------------------ (b) speed
def same(composed: Timeline, full: Timeline) -> bool:
    return (composed.num_events == full.num_events and np.array_equal(composed.live_bytes(), full.live_bytes())
            and composed.peak_bytes == full.peak_bytes and composed.at_peak == full.at_peak
            and composed.meta["flops"] == full.meta["flops"])


def speed(quick: bool) -> dict[str, Any]:
    config = get_preset("llama3-70b")
    policies = SPEED_POLICIES[:1] if quick else SPEED_POLICIES
    if quick:
        config = config.replace(num_layers=16)
    predict_config(config.replace(num_layers=2), "full/uniform/1", compose_layers=False)  # warm-up, not timed
    print(f"(b) speed: {config.num_layers} layers of llama3-70b (h={config.hidden_size}, s={config.seq_length}, "
          f"{config.query_groups} kv groups, swiglu, bf16); load average {load()}")
    header = (f"{'policy':<20} {'full trace s':>12} {'cold s':>7} {'cold x':>7} {'frozen s':>8} {'frozen x':>8} "
              f"{'warm s':>7} {'warm x':>7} {'stand-in':>26} {'equal':>5}")
    print(header)
    print("-" * len(header))
    rows = []
    for policy in policies:
        predict_module.SHALLOW_TRACES.clear()
        t0 = time.perf_counter()
        full = predict_config(config, policy, compose_layers=False)
        t_full = time.perf_counter() - t0
        predict_module.SHALLOW_TRACES.clear()
        t0 = time.perf_counter()
        cold = predict_config(config, policy)
        t_cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        warm = predict_config(config, policy)
        t_warm = time.perf_counter() - t0
        predict_module.SHALLOW_TRACES.clear()
        gc.collect()
        gc.freeze()  # as remat predict runs: the gc.collect() before each recorded step skips start-up objects
        t0 = time.perf_counter()
        frozen = predict_config(config, policy)
        t_frozen = time.perf_counter() - t0
        gc.unfreeze()
        source = cold.meta.get("composed_from", {})
        equal = same(cold, full) and same(warm, full) and same(frozen, full)
        rows.append({"policy": policy, "full_s": t_full, "cold_s": t_cold, "warm_s": t_warm, "frozen_s": t_frozen,
                     "cold_speedup": t_full / t_cold, "frozen_speedup": t_full / t_frozen,
                     "warm_speedup": t_full / t_warm, "stand_in": source, "equal": equal,
                     "peak_bytes": full.peak_bytes})
        stand_in = f"{source.get('policy', '-')} on {source.get('num_layers', '-')}"
        print(f"{policy:<20} {t_full:>12.2f} {t_cold:>7.3f} {t_full / t_cold:>6.1f}x {t_frozen:>8.3f} "
              f"{t_full / t_frozen:>7.1f}x {t_warm:>7.3f} {t_full / t_warm:>6.0f}x {stand_in:>26} "
              f"{'yes' if equal else 'NO':>5}", flush=True)
    head = rows[0]
    verdict = lambda x: "PASS" if x >= 20 else "FAIL"
    print(f"{head['policy']}, target >= 20x cold: {head['cold_speedup']:.1f}x through the API in a fresh process "
          f"({verdict(head['cold_speedup'])}), {head['frozen_speedup']:.1f}x with start-up objects frozen as remat "
          f"predict runs ({verdict(head['frozen_speedup'])}); {head['warm_speedup']:.0f}x with its stand-in cached; "
          f"composed == full trace for every policy: {'yes' if all(r['equal'] for r in rows) else 'NO'}")
    print("(cold: the stand-in is traced; frozen: the same with gc.freeze() done first, as remat predict does, so "
          "remat.measure's gc.collect() before the trace skips start-up objects; warm: the stand-in is cached)")

    sweep = megatron_sweep(config.num_layers, config=config)
    predict_module.SHALLOW_TRACES.clear()
    t0 = time.perf_counter()
    timelines = predict_many(config, sweep)
    t_sweep = time.perf_counter() - t0
    shallow = len(predict_module.SHALLOW_TRACES)
    shallow_layers = sum(key[0].num_layers for key in predict_module.SHALLOW_TRACES)
    t0 = time.perf_counter()
    predict_many(config, sweep)
    t_again = time.perf_counter() - t0
    # as `remat predict --sweep megatron` runs it: the objects alive after start-up frozen (gc.freeze), so the
    # gc.collect() that remat.measure runs before every recorded step does not rescan them
    predict_module.SHALLOW_TRACES.clear()
    gc.collect()
    gc.freeze()
    t0 = time.perf_counter()
    predict_many(config, sweep)
    t_sweep_frozen = time.perf_counter() - t0
    gc.unfreeze()
    best = min(range(len(sweep)), key=lambda i: timelines[i].peak_bytes)
    print(f"\nMegatron sweep: {len(sweep)} policies of {config.num_layers} layers via predict_many in {t_sweep:.2f} s "
          f"from a cold cache ({shallow} shallow traces of {shallow_layers} layers in all, {available_workers()} at "
          f"a time; {t_sweep / len(sweep) * 1000:.0f} ms per policy), {t_again:.2f} s again with the stand-ins "
          f"cached; target <= 5 s: {'PASS' if t_sweep <= 5 else 'FAIL'} (load average {load()}); "
          f"{t_sweep_frozen:.2f} s cold with the start-up objects frozen, as remat predict runs: "
          f"{'PASS' if t_sweep_frozen <= 5 else 'FAIL'}")
    print(f"lowest peak: {sweep[best]} at {timelines[best].peak_bytes / 2**30:.2f} GiB "
          f"(none: {timelines[0].peak_bytes / 2**30:.2f} GiB)")
    out = {"layers": config.num_layers, "policies": rows, "sweep_policies": len(sweep), "sweep_s": t_sweep,
           "sweep_warm_s": t_again, "sweep_frozen_s": t_sweep_frozen, "shallow_traces": shallow,
           "shallow_layers": shallow_layers}
    if not quick:  # an MoE + MLA model: the MoE/MLA modules are in its sweep, and its stand-ins mix layer kinds
        moe = get_preset("deepseek-v3")
        moe_sweep = megatron_sweep(moe.num_layers, config=moe)
        predict_module.SHALLOW_TRACES.clear()
        t0 = time.perf_counter()
        moe_timelines = predict_many(moe, moe_sweep)
        t_moe = time.perf_counter() - t0
        traced = sum(key[0].num_layers for key in predict_module.SHALLOW_TRACES)
        composed = sum("composed_from" in tl.meta for tl in moe_timelines)
        print(f"deepseek-v3 Megatron sweep: {len(moe_sweep)} policies of {moe.num_layers} layers in {t_moe:.2f} s "
              f"cold ({len(predict_module.SHALLOW_TRACES)} shallow traces of {traced} layers; {composed} composed); "
              f"target <= 10 s: {'PASS' if t_moe <= 10 else 'FAIL'} (load average {load()})")
        out.update({"deepseek_sweep_policies": len(moe_sweep), "deepseek_sweep_s": t_moe,
                    "deepseek_shallow_layers": traced})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny grid, one policy, 16 layers")
    parser.add_argument("--skip-accuracy", action="store_true")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args(argv)
    print(f"remat bench_predict: torch {torch.__version__}, python {platform.python_version()}, "
          f"{os.cpu_count()} CPUs, load average {load()}\n")
    result: dict[str, Any] = {"quick": args.quick, "torch": torch.__version__}
    # speed first, in a fresh process: the accuracy grid leaves objects behind that slow every later gc.collect()
    if not args.skip_speed:
        result["speed"] = speed(args.quick)
    if not args.skip_accuracy:
        result["accuracy"] = accuracy(args.quick)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    ok = True
    if "accuracy" in result:
        acc = result["accuracy"]
        ok &= abs(acc["worst_peak_error"]) <= 0.01 and abs(acc["worst_part_error"]) <= 0.02 and acc["host_bytes_equal"]
    if "speed" in result:
        ok &= all(r["equal"] for r in result["speed"]["policies"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
