#!/usr/bin/env python
"""GPU check: remat's predicted peak against the CUDA caching allocator's ``max_memory_allocated``.

For three recompute policies - ``none``, ``full/uniform/1`` and ``selective/core_attn`` - of a ~1B-parameter
decoder in bf16 with SDPA attention (default: GPT-3 XL-like, 24 layers, h=2048, 16 heads, s=2048, b=1, vocab
50304; ``--model llama``: a Llama-like 16-layer h=2048 model with RMSNorm, SwiGLU, RoPE and GQA), it

1. predicts the step with ``remat.predict(config, policy, device='cuda')`` (a fake trace on the CPU, storages
   rounded to the allocator's 512-byte blocks; nothing is allocated), and
2. measures one real forward+backward on the GPU with ``remat.measure`` on a fresh model, which also records
   ``torch.cuda.max_memory_allocated`` over the step (its peak statistics are reset just before),

then prints, per policy, the predicted peak, ``max_memory_allocated`` and the error
``(predicted - max_memory_allocated) / max_memory_allocated``, plus the recorder's own CUDA timeline peak and the
bytes the allocator held beyond it (cuBLAS workspace, kernel-internal buffers). Exit status 1 when any
``|error|`` exceeds ``--max-error`` (3% by default), 0 otherwise. About a minute on an H100/H200.

Without a CUDA device it prints that and exits 0 without doing anything. ``--dry-run-cpu`` runs the same logic on
a tiny config on the CPU (the recorder's exact byte count stands in for ``max_memory_allocated``), so the script
can be checked where there is no GPU.

Known ways the prediction can differ on CUDA, which this check is there to catch: the fake trace runs the CPU
kernels, so attention dropout > 0 (``--dropout``) sends SDPA to the math fallback on the CPU (s x s
probabilities kept) while CUDA runs a fused kernel; RMSNorm on the CPU is composite (fp32 copies kept) while
CUDA runs the fused kernel.

    python benchmarks/gpu_check.py [--model gpt|llama] [--layers N] [--out results.json]
    python benchmarks/gpu_check.py --dry-run-cpu
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from remat import ModelConfig, apply, build_model, measure, sample_batch
from remat.memory.predict import predict

POLICIES = ("none", "full/uniform/1", "selective/core_attn")
MIB = 1 << 20


def model_config(name: str, layers: int | None, dropout: float) -> ModelConfig:
    """The ~1B-class configs: GPT-3 XL-like (``gpt``) or Llama-like (``llama``), bf16, SDPA, b=1, s=2048."""
    common = dict(hidden_size=2048, num_attention_heads=16, seq_length=2048, micro_batch_size=1, dtype="bf16",
                  attention="sdpa", hidden_dropout=dropout, attention_dropout=dropout)
    if name == "gpt":
        config = ModelConfig(num_layers=24, vocab_size=50304, **common)
    else:
        config = ModelConfig(num_layers=16, vocab_size=32000, num_query_groups=8, activation="swiglu",
                             normalization="rmsnorm", position="rope", add_bias_linear=False, **common)
    return config.replace(num_layers=layers) if layers else config


def tiny_config(name: str, dropout: float) -> ModelConfig:
    return model_config(name, 4, dropout).replace(hidden_size=64, num_attention_heads=4, seq_length=64,
                                                  vocab_size=256, num_query_groups=2 if name == "llama" else None)


def parameter_count(config: ModelConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in build_model(config, "meta", seed=None).parameters())


def check_policy(config: ModelConfig, policy: str, device: str) -> dict[str, Any]:
    """Predict and measure one policy; the measured number is ``max_memory_allocated`` on CUDA."""
    start = time.perf_counter()
    predicted = predict(config, policy, device=device)
    predict_s = time.perf_counter() - start

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    model = build_model(config, device, seed=0)
    apply(model, policy)
    batch = sample_batch(config, device, seed=0)
    torch.manual_seed(0)
    start = time.perf_counter()
    timeline = measure(model, batch)
    measure_s = time.perf_counter() - start
    if device == "cuda":
        measured = int(timeline.meta["cuda_max_memory_allocated"])
    else:
        measured = timeline.peak_bytes  # the CPU stand-in: exact storage bytes
    del model, batch
    gc.collect()
    error = (predicted.peak_bytes - measured) / measured
    return {
        "policy": policy,
        "predicted_bytes": predicted.peak_bytes,
        "predicted_phase": predicted.peak_phase.label,
        "max_memory_allocated": measured,
        "recorded_peak_bytes": timeline.peak_bytes,
        "recorded_phase": timeline.peak_phase.label,
        "allocator_beyond_recorded": measured - timeline.peak_bytes,
        "allocated_before_step": timeline.meta.get("cuda_allocated_before_step"),
        "error": error,
        "loss": timeline.meta.get("loss"),
        "predict_seconds": predict_s,
        "measure_seconds": measure_s,
    }


def format_rows(rows: list[dict[str, Any]], max_error: float) -> str:
    header = (f"{'policy':<22}{'predicted MiB':>15}{'max_alloc MiB':>15}{'error %':>9}{'recorded MiB':>14}"
              f"{'beyond MiB':>12}  {'predicted peak in':<28}{'measured peak in'}")
    lines = [header, "-" * len(header)]
    for r in rows:
        flag = "" if abs(r["error"]) <= max_error else "  <-- over the limit"
        lines.append(f"{r['policy']:<22}{r['predicted_bytes'] / MIB:>15.1f}{r['max_memory_allocated'] / MIB:>15.1f}"
                     f"{100 * r['error']:>+9.2f}{r['recorded_peak_bytes'] / MIB:>14.1f}"
                     f"{r['allocator_beyond_recorded'] / MIB:>12.1f}  {r['predicted_phase']:<28}"
                     f"{r['recorded_phase']}{flag}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("gpt", "llama"), default="gpt", help="the ~1B config (default gpt)")
    parser.add_argument("--layers", type=int, help="override the layer count (gpt 24, llama 16)")
    parser.add_argument("--dropout", type=float, default=0.0, help="hidden and attention dropout (default 0)")
    parser.add_argument("--policies", default=",".join(POLICIES), help=f"default {','.join(POLICIES)}")
    parser.add_argument("--max-error", type=float, default=0.03, help="fail above this |error| (default 0.03)")
    parser.add_argument("--out", type=Path, help="also write the results as JSON to this file")
    parser.add_argument("--dry-run-cpu", action="store_true",
                        help="no GPU needed: run the same logic on a tiny config on the CPU")
    args = parser.parse_args(argv)

    if args.dry_run_cpu:
        device, config = "cpu", tiny_config(args.model, args.dropout)
    elif not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device (torch {torch.__version__}, cuda available: False): nothing to check.")
        return 0
    else:
        device, config = "cuda", model_config(args.model, args.layers, args.dropout)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]

    started = time.perf_counter()
    params = parameter_count(config)
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU (dry run)"
    print(f"gpu_check on {where}, torch {torch.__version__}: {args.model}-style, {params / 1e6:,.1f}M parameters, "
          f"{config.num_layers} layers, h={config.hidden_size}, s={config.seq_length}, b={config.micro_batch_size}, "
          f"{config.dtype}, {config.attention}, dropout {args.dropout}", flush=True)
    rows = []
    for policy in policies:
        rows.append(check_policy(config, policy, device))
        r = rows[-1]
        print(f"  {policy}: predicted {r['predicted_bytes'] / MIB:.1f} MiB ({r['predict_seconds']:.1f} s), "
              f"max_memory_allocated {r['max_memory_allocated'] / MIB:.1f} MiB ({r['measure_seconds']:.1f} s), "
              f"error {100 * r['error']:+.2f}%", flush=True)
    print()
    print(format_rows(rows, args.max_error))
    worst = max(rows, key=lambda r: abs(r["error"]))
    ok = abs(worst["error"]) <= args.max_error
    seconds = time.perf_counter() - started
    print(f"\nworst: {worst['policy']} {100 * worst['error']:+.2f}% (limit {100 * args.max_error:.1f}%): "
          f"{'PASS' if ok else 'FAIL'} in {seconds:.0f} s")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": where, "torch": torch.__version__, "config": config.to_dict(),
                                        "parameters": params, "max_error": args.max_error, "pass": ok,
                                        "seconds": seconds, "rows": rows}, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
