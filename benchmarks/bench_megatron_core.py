#!/usr/bin/env python
"""remat's Megatron-core front end: predicted (fake tensors) against measured (real CPU), and against remat's
reference model.

(1) Per setting - none, full uniform/block, selective modules - the peak and the parts alive at it for a small
megatron-core GPT, an MLA model and a MoE model (balanced routing): predicted (``predict_megatron_core``) vs
measured (``measure_megatron_core``, one gloo process).
(2) Real multi-process runs (gloo, one process per rank, ``measure_megatron_core_distributed``): TP=2 and PP=2,
per rank, ``--trials`` times (each should be exact: see the NOTE below).
(3) Cross-check: the same GPT through remat's reference model (``remat.memory.predict.predict_config``) and
through megatron-core, per policy, and the tensors of layer 0 alive at the end of forward in each, side by side.
(4) Trace time of one rank of a 70B-class job (80 layers, h=8192, GQA 64/8, ffn 28672, s=4096, bf16, TP=8):
fake traces of 1 and 3 layers, the time per layer, and the 80-layer time composed from them (an estimate,
labelled as such: megatron-core timelines are not composed layer by layer yet); ``--full-70b`` also traces all 80.

NOTE [gloo's late release] A real TP run all-reduces activations in place. gloo runs the collective on a worker
thread that holds the work (and so the tensor) until it picks its next job; when the Python code dropped its last
reference first, the tensor was freed a few events later than in the prediction, one or two all-reduced tensors
above it at the peak. Real ranks now wait for the release (NOTE [gloo's late release in Megatron's collectives] in
remat.megatron.released_collectives), so repeated trials should all be exact.

Usage::

    python benchmarks/bench_megatron_core.py            # everything (a few minutes on 2 cores)
    python benchmarks/bench_megatron_core.py --only 1,3
    python benchmarks/bench_megatron_core.py --full-70b # also the whole 80-layer trace (about 80 s)
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from collections import Counter
from typing import Any

import torch

warnings.simplefilter("ignore")

from remat.config import ModelConfig  # noqa: E402
from remat.megatron import measure_megatron_core, predict_megatron_core  # noqa: E402
from remat.megatron.multiprocess import measure_megatron_core_distributed  # noqa: E402
from remat.memory.predict import predict_config  # noqa: E402
from remat.timeline import CATEGORIES, Timeline  # noqa: E402

SHAPE = dict(seq_length=32, micro_batch_size=2, vocab_size=128)
SETTINGS: dict[str, dict[str, Any]] = {
    "none": {},
    "full/uniform/1": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full/uniform/2": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
    "full/block/1": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
    "selective/core_attn": dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
    "selective/mlp": dict(recompute_granularity="selective", recompute_modules=["mlp"]),
    "selective/layernorm": dict(recompute_granularity="selective", recompute_modules=["layernorm"]),
    "selective/core_attn+mlp+layernorm": dict(recompute_granularity="selective",
                                              recompute_modules=["core_attn", "mlp", "layernorm"]),
}
MLA = dict(multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8,
           v_head_dim=16)


def config(kind: str, **settings: Any) -> Any:
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    base = dict(num_layers=4, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
                add_bias_linear=False)
    if kind == "mla":
        return MLATransformerConfig(**base, **MLA, **settings)
    if kind == "moe":
        base.update(num_layers=2, num_moe_experts=4, moe_router_topk=2)
        if settings.get("recompute_modules") == ["mlp"]:
            settings = dict(settings, recompute_modules=["moe"])  # MoE layers' MLP is recompute module "moe"
    return TransformerConfig(**base, **settings)


def row(label: str, predicted: Timeline, measured: Timeline) -> str:
    err = (predicted.peak_bytes - measured.peak_bytes) / measured.peak_bytes
    parts = "exact" if predicted.at_peak == measured.at_peak else "differ: " + ", ".join(
        f"{k} {predicted.at_peak[k] - measured.at_peak[k]:+d}" for k in CATEGORIES
        if predicted.at_peak[k] != measured.at_peak[k])
    return f"  {label:<44} {predicted.peak_bytes:>10} {measured.peak_bytes:>10} {err:>+8.2%}  {parts}"


def table_settings() -> None:
    print("(1) predicted vs measured, one process (bytes; peak error; the parts alive at the peak)")
    for kind in ("dense", "mla", "moe"):
        print(f"{kind}: {'setting':<44} {'predicted':>10} {'measured':>10} {'error':>8}")
        for settings in SETTINGS.values():
            c = config(kind, **settings)
            routing = {"routing": "balanced"} if kind == "moe" else {}
            p = predict_megatron_core(c, **SHAPE, **routing)[0]
            m = measure_megatron_core(c, **SHAPE, **routing)[0]
            print(row(p.meta["policy"], p, m))


def table_multiprocess(trials: int) -> None:
    print(f"\n(2) real multi-process runs (gloo), per rank; {trials} trial(s) each")
    jobs = [("tp=2", dict(tp=2), dict(tensor_model_parallel_size=2)),
            ("pp=2", dict(pp=2), dict(pipeline_model_parallel_size=2, pipeline_dtype=torch.float32))]
    for label, sizes, fields in jobs:
        for name in ("none", "full/uniform/1", "selective/core_attn+mlp+layernorm"):
            c = config("dense", **fields, **SETTINGS[name])
            predicted = predict_megatron_core(c, **SHAPE, **sizes, ranks="all")
            for trial in range(trials):
                start = time.perf_counter()
                measured = measure_megatron_core_distributed(c, **SHAPE, **sizes, timeout=240)
                took = time.perf_counter() - start
                for rank in sorted(measured):
                    print(row(f"{label} {name} rank {rank} (trial {trial}, {took:.0f} s)", predicted[rank],
                              measured[rank]))


def layer0_tensors(tl: Timeline) -> Counter:
    """(module leaf, bytes) of the rows made in layer 0's forward and alive at the end of forward."""
    end = tl.forward_end
    found: Counter = Counter()
    for r in range(len(tl)):
        phase = tl.phases[tl.phase_index[r]]
        if phase.kind == "forward" and phase.region == "layer 0" and tl.alloc_at[r] <= end and \
                (tl.free_at[r] == -1 or tl.free_at[r] > end):
            leaf = tl.module[r].split("layers.0.", 1)[-1] if "layers.0" in tl.module[r] else tl.module[r]
            found[(leaf, tl.nbytes[r])] += 1
    return found


def table_cross_check() -> None:
    print("\n(3) the same GPT (4 layers, h=64, 4 heads, s=32, b=2, vocab 128, gelu, LayerNorm, learned positions, "
          "dropout 0.1, fp32, no linear biases, untied embeddings)")
    reference = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=128, seq_length=32,
                            micro_batch_size=2, attention="math", add_bias_linear=False)
    policies = {"none": "none", "full/uniform/1": "full/uniform/1", "full/block/1": "full/block/1",
                "selective/core_attn": "selective/core_attn"}
    print(f"  {'policy':<22} {'remat ref':>10} {'mcore pred':>10} {'mcore meas':>10} {'ref - mcore':>12}")
    for name, policy in policies.items():
        ref = predict_config(reference, policy)
        c = config("dense", **SETTINGS[name])
        p, m = predict_megatron_core(c, **SHAPE)[0], measure_megatron_core(c, **SHAPE)[0]
        print(f"  {name:<22} {ref.peak_bytes:>10} {p.peak_bytes:>10} {m.peak_bytes:>10} "
              f"{ref.peak_bytes - p.peak_bytes:>+12}")
        for k in CATEGORIES:
            if ref.at_peak[k] != p.at_peak[k]:
                print(f"      at peak {k:<18} ref {ref.at_peak[k]:>9}  mcore {p.at_peak[k]:>9}")
        if name == "none":
            none_ref, none_mcore = ref, p
    print("  layer 0's tensors alive at the end of forward (policy none): module, bytes x count")
    a, b = layer0_tensors(none_ref), layer0_tensors(none_mcore)
    print(f"    remat reference: {sum(n * c for (_, n), c in a.items())} bytes")
    for (module, n), count in sorted(a.items(), key=lambda kv: -kv[0][1]):
        print(f"      {module:<48} {n:>7} x{count}")
    print(f"    megatron-core:   {sum(n * c for (_, n), c in b.items())} bytes")
    for (module, n), count in sorted(b.items(), key=lambda kv: -kv[0][1]):
        print(f"      {module:<48} {n:>7} x{count}")


def trace_70b(full: bool) -> None:
    from megatron.core.transformer import TransformerConfig

    print("\n(4) trace time of one rank of a 70B-class job (h=8192, 64 heads / 8 query groups, ffn 28672, swiglu, "
          "s=4096, b=1, bf16, TP=8, full/uniform/1), load average", os.getloadavg()[0])

    def seconds(layers: int) -> tuple[float, Timeline]:
        c = TransformerConfig(num_layers=layers, hidden_size=8192, num_attention_heads=64, num_query_groups=8,
                              ffn_hidden_size=28672, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                              add_bias_linear=False, bf16=True, params_dtype=torch.bfloat16,
                              tensor_model_parallel_size=8, recompute_granularity="full", recompute_method="uniform",
                              recompute_num_layers=1, use_cpu_initialization=True)
        start = time.perf_counter()
        tl = predict_megatron_core(c, seq_length=4096, micro_batch_size=1, vocab_size=128256, tp=8)[0]
        return time.perf_counter() - start, tl

    seconds(1)  # warm-up: imports and first-call costs
    one, _ = seconds(1)
    three, tl3 = seconds(3)
    per_layer = (three - one) / 2
    print(f"  1 layer {one:.2f} s, 3 layers {three:.2f} s: {per_layer:.2f} s per layer; "
          f"ESTIMATE for 80 layers (1 layer + 79 x per layer, not a trace): {one + 79 * per_layer:.1f} s; "
          f"3-layer peak {tl3.peak_bytes / 2**30:.2f} GiB")
    if full:
        t80, tl80 = seconds(80)
        print(f"  80 layers, traced: {t80:.1f} s, peak {tl80.peak_bytes / 2**30:.2f} GiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="1,2,3,4", help="which parts to run, e.g. 1,3")
    parser.add_argument("--trials", type=int, default=1, help="real multi-process runs per setting (part 2)")
    parser.add_argument("--full-70b", action="store_true", help="also trace all 80 layers of the 70B config")
    args = parser.parse_args()
    parts = {p.strip() for p in args.only.split(",")}
    if "1" in parts:
        table_settings()
    if "2" in parts:
        table_multiprocess(args.trials)
    if "3" in parts:
        table_cross_check()
    if "4" in parts:
        trace_70b(args.full_70b)


if __name__ == "__main__":
    main()
