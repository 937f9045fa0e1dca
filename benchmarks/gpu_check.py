#!/usr/bin/env python
"""GPU check: predicted (CUDA kernel profile) allocated and reserved peaks against the CUDA caching allocator.

For three models in bf16 - a dense GPT (LayerNorm, GeLU, learned positions, dropout, SDPA), a Llama-style model
(RMSNorm, SwiGLU, RoPE, GQA, SDPA) and a Hugging Face ``LlamaForCausalLM`` built from a config with random
weights (no download) - and several recompute policies, it

1. predicts the step on the CPU with ``kernels='cuda'`` (a fake trace whose dropout, norms and attention are
   the CUDA kernels', storages rounded to 512-byte blocks) and replays the predicted allocations through the
   caching allocator (:mod:`remat.memory.allocator`) for the reserved peak, then
2. measures one real forward + backward on the GPU with ``remat.measure`` (peak statistics reset just before)
   and reads ``torch.cuda.max_memory_allocated`` and ``torch.cuda.max_memory_reserved``.

It prints a table of both errors per model and policy (``--checks peaks``), then runs issue 12's checks
(``offload``, ``mla_sdpa``, ``moe``: :mod:`gpu_check_moe` beside this script): Megatron's fine-grained activation
offloading (pinned host copies on a side stream) predicted against measured, device and host bytes, with gradients
bit for bit against the plain model; which SDPA backend PyTorch runs for multi-latent attention (DeepSeek-V3's q/k
head dim 192, v 128, and tiny shapes) and whether the tensors it saves are those of remat's CUDA profile; MoE
grouped and separate experts under ``moe_act``, ``moe`` and ``shared_experts`` recompute, balanced and real routing;
and ``streams`` (:mod:`gpu_check_streams`): allocations on the default and two side streams through the allocator,
in a fresh process per ``PYTORCH_CUDA_ALLOC_CONF``, against the replay given each row's stream (equal to the byte).
Each of those comparisons prints a ``PASS``/``FAIL`` line with its bytes (``INFO`` for figures without a limit,
``INCONCLUSIVE`` when the plain step itself is not bit-reproducible). It exits 1 when any allocated error exceeds
``--max-error`` (3%), any reserved error of the peaks table ``--max-reserved-error`` (5%), or any line is ``FAIL``.
About two minutes on an H100/H200 for the peaks, under two more for the rest.

``--dry-run-cpu`` runs the same code on tiny configs on the CPU with ``kernels='cpu'``: the recorder's exact
bytes stand in for ``max_memory_allocated`` and the replay of the measured timeline for ``max_memory_reserved``,
so every prediction must be exact there (both limits default to 0: a single byte off fails; the SDPA backend
comparison needs CUDA and is skipped). Without a CUDA device (and without ``--dry-run-cpu``) it prints a ``no CUDA``
line and a ``SKIP`` line per check and exits 0.

    python benchmarks/gpu_check.py [--checks peaks,offload,mla_sdpa,moe] [--models gpt,llama,hf]
                                   [--policies none,full/uniform/1] [--out results.json]
    python benchmarks/gpu_check.py --dry-run-cpu
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from gpu_check_moe import CHECKS, run_checks, skip_all  # the issue-12 checks, beside this script
from gpu_check_streams import check_streams  # the replay's streams against the allocator's

from remat import ModelConfig, apply, build_model, measure, sample_batch
from remat.memory.allocator import replay_timeline
from remat.memory.predict import predict, predict_config

ALL_CHECKS = ("peaks", *CHECKS, "streams")
POLICIES = ("none", "full/uniform/1", "selective/core_attn")
HF_POLICIES = ("none", "full/uniform/1")
MIB = 1 << 20


def gpt_config(tiny: bool) -> ModelConfig:
    if tiny:
        return ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=64, micro_batch_size=2,
                           vocab_size=256, dtype="bf16", attention="sdpa")
    return ModelConfig(num_layers=16, hidden_size=2048, num_attention_heads=16, seq_length=2048, micro_batch_size=2,
                       vocab_size=50304, dtype="bf16", attention="sdpa", hidden_dropout=0.1, attention_dropout=0.1)


def llama_config(tiny: bool) -> ModelConfig:
    llama = dict(activation="swiglu", normalization="rmsnorm", position="rope", add_bias_linear=False,
                 hidden_dropout=0.0, attention_dropout=0.0, dtype="bf16", attention="sdpa")
    if tiny:
        return ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, seq_length=64,
                           micro_batch_size=2, vocab_size=256, **llama)
    return ModelConfig(num_layers=16, hidden_size=2048, num_attention_heads=16, num_query_groups=8,
                       seq_length=4096, micro_batch_size=1, vocab_size=32000, **llama)


def hf_model(tiny: bool) -> tuple[Callable[..., torch.nn.Module], Callable[[str], dict[str, torch.Tensor]]]:
    """A ``LlamaForCausalLM`` factory (random weights from a config, SDPA attention) and its batch maker."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = (dict(hidden_size=64, intermediate_size=176, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256) if tiny else
             dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=12, num_attention_heads=16,
                  num_key_value_heads=8, vocab_size=32000))
    config = LlamaConfig(**shape, max_position_embeddings=4096, attn_implementation="sdpa", use_cache=False)
    seq, batch = (64, 2) if tiny else (2048, 2)

    def factory(device: str = "cpu") -> torch.nn.Module:
        # parameters made in bf16 where they live: .to() cannot convert fake parameters, and on the GPU no fp32
        # copy is ever allocated
        torch.manual_seed(0)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device(device):
                return LlamaForCausalLM(config).train()
        finally:
            torch.set_default_dtype(previous)

    def make_batch(device: str) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
        return {"input_ids": ids.to(device), "labels": ids.to(device)}

    return factory, make_batch


def _reset(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def measured_peaks(build: Callable[[], torch.nn.Module], batch: Any, policy: str, device: str) -> dict[str, Any]:
    """One real step: (allocated peak, reserved peak, recorded timeline peak)."""
    _reset(device)
    model = build()
    apply(model, policy)
    torch.manual_seed(0)
    timeline = measure(model, batch)
    if device == "cuda":
        allocated = int(timeline.meta["cuda_max_memory_allocated"])
        reserved = int(torch.cuda.max_memory_reserved())
    else:  # the CPU stand-ins: exact storage bytes, and the replay of what was measured
        allocated = timeline.peak_bytes
        reserved = replay_timeline(timeline).peak_reserved
    del model
    _reset(device)
    return {"allocated": allocated, "reserved": reserved, "recorded": timeline.peak_bytes}


def check(name: str, policy: str, predicted: Any, measured: dict[str, Any]) -> dict[str, Any]:
    replay = replay_timeline(predicted)
    return {
        "model": name, "policy": policy, "kernels": predicted.meta.get("kernels"),
        "predicted_allocated": predicted.peak_bytes, "max_memory_allocated": measured["allocated"],
        "allocated_error": (predicted.peak_bytes - measured["allocated"]) / measured["allocated"],
        "predicted_reserved": replay.peak_reserved, "max_memory_reserved": measured["reserved"],
        "reserved_error": (replay.peak_reserved - measured["reserved"]) / measured["reserved"],
        "recorded_peak": measured["recorded"], "predicted_phase": predicted.peak_phase.label,
        "kernel_warnings": predicted.meta.get("kernel_warnings", []),
    }


def run(models: list[str], policies: list[str], device: str, tiny: bool) -> list[dict[str, Any]]:
    kernels = "cuda" if device == "cuda" else "cpu"
    rows = []
    for name in models:
        for policy in (policies if name != "hf" else [p for p in policies if p in HF_POLICIES]):
            started = time.perf_counter()
            if name == "hf":
                factory, make_batch = hf_model(tiny)
                predicted = predict(factory, policy, batch=make_batch("cpu"), device=device, kernels=kernels)

                def build(factory: Callable[[str], torch.nn.Module] = factory) -> torch.nn.Module:
                    return factory(device)

                batch: Any = make_batch(device)
            else:
                config = gpt_config(tiny) if name == "gpt" else llama_config(tiny)
                predicted = predict_config(config, policy, device=device, kernels=kernels)

                def build(config: ModelConfig = config) -> torch.nn.Module:
                    return build_model(config, device, seed=0)

                batch = sample_batch(config, device, seed=0)
            row = check(name, policy, predicted, measured_peaks(build, batch, policy, device))
            row["seconds"] = time.perf_counter() - started
            rows.append(row)
            print(f"  {name} {policy}: allocated {row['predicted_allocated'] / MIB:,.1f} vs "
                  f"{row['max_memory_allocated'] / MIB:,.1f} MiB ({100 * row['allocated_error']:+.2f}%), reserved "
                  f"{row['predicted_reserved'] / MIB:,.1f} vs {row['max_memory_reserved'] / MIB:,.1f} MiB "
                  f"({100 * row['reserved_error']:+.2f}%) [{row['seconds']:.0f} s]", flush=True)
    return rows


def format_rows(rows: list[dict[str, Any]], max_error: float, max_reserved_error: float) -> str:
    header = (f"{'model':<7}{'policy':<22}{'pred alloc MiB':>15}{'max_alloc MiB':>15}{'err %':>8}"
              f"{'pred resv MiB':>15}{'max_resv MiB':>14}{'err %':>8}  predicted peak in")
    lines = [header, "-" * len(header)]
    for r in rows:
        bad = abs(r["allocated_error"]) > max_error or abs(r["reserved_error"]) > max_reserved_error
        lines.append(f"{r['model']:<7}{r['policy']:<22}{r['predicted_allocated'] / MIB:>15,.1f}"
                     f"{r['max_memory_allocated'] / MIB:>15,.1f}{100 * r['allocated_error']:>+8.2f}"
                     f"{r['predicted_reserved'] / MIB:>15,.1f}{r['max_memory_reserved'] / MIB:>14,.1f}"
                     f"{100 * r['reserved_error']:>+8.2f}  {r['predicted_phase']}{'  <-- over' if bad else ''}")
    return "\n".join(lines)


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as handle:
        handle.write(json.dumps(data, indent=2) + "\n")
    os.replace(handle.name, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checks", default=",".join(ALL_CHECKS),
                        help=f"any of {', '.join(ALL_CHECKS)} (default all): peaks is the table above; offload, "
                        "mla_sdpa and moe are issue 12's (benchmarks/gpu_check_moe.py); streams replays several "
                        "streams' allocations (benchmarks/gpu_check_streams.py)")
    parser.add_argument("--models", default="gpt,llama,hf", help="any of gpt, llama, hf (default all three)")
    parser.add_argument("--policies", default=",".join(POLICIES), help=f"default {','.join(POLICIES)} (hf: none, "
                        "full/uniform/1 only)")
    parser.add_argument("--max-error", type=float, help="allocated |error| limit (default 0.03; 0 with "
                        "--dry-run-cpu)")
    parser.add_argument("--max-reserved-error", type=float, help="reserved limit (default 0.05; 0 with "
                        "--dry-run-cpu)")
    parser.add_argument("--out", type=Path, help="also write the results as JSON to this file")
    parser.add_argument("--dry-run-cpu", action="store_true", help="no GPU needed: tiny configs on the CPU")
    args = parser.parse_args(argv)
    checks = [c.strip() for c in args.checks.split(",") if c.strip()]
    unknown = sorted(set(checks) - set(ALL_CHECKS))
    if unknown:
        parser.error(f"--checks: unknown {', '.join(unknown)}; choose from {', '.join(ALL_CHECKS)}")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(models) - {"gpt", "llama", "hf"})
    if unknown:
        parser.error(f"--models: unknown {', '.join(unknown)}; choose from gpt, llama, hf")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if args.max_error is None:  # the CPU dry run is exact by construction: any byte off is a bug
        args.max_error = 0.0 if args.dry_run_cpu else 0.03
    if args.max_reserved_error is None:
        args.max_reserved_error = 0.0 if args.dry_run_cpu else 0.05
    if args.dry_run_cpu:
        device, where = "cpu", "CPU (dry run, kernels=cpu)"
    elif not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device (torch {torch.__version__}): every CUDA check is skipped; --dry-run-cpu "
              "checks the script's logic on the CPU.")
        skip_all(checks, f"no CUDA device (torch {torch.__version__})")
        return 0
    else:
        device, where = "cuda", torch.cuda.get_device_name()
    started = time.perf_counter()
    print(f"gpu_check on {where}, torch {torch.__version__}, bf16, checks {', '.join(checks)}", flush=True)
    rows: list[dict[str, Any]] = []
    ok, report = True, {"device": where, "torch": torch.__version__, "checks": checks,
                        "max_error": args.max_error, "max_reserved_error": args.max_reserved_error}
    if "peaks" in checks:
        print(f"\n[peaks] models {', '.join(models)}", flush=True)
        try:
            rows = run(models, policies, device, tiny=args.dry_run_cpu)
        except Exception as err:  # noqa: BLE001 - the other checks still run on the one GPU run
            traceback.print_exc()
            print(f"  ERROR        [peaks] {type(err).__name__}: {err}")
            rows, ok = [], False
            report["peaks_error"] = f"{type(err).__name__}: {err}"
    if rows:
        print("\n" + format_rows(rows, args.max_error, args.max_reserved_error))
        worst_alloc = max(rows, key=lambda r: abs(r["allocated_error"]))
        worst_resv = max(rows, key=lambda r: abs(r["reserved_error"]))
        ok = (abs(worst_alloc["allocated_error"]) <= args.max_error
              and abs(worst_resv["reserved_error"]) <= args.max_reserved_error)
        print(f"\nworst allocated: {worst_alloc['model']} {worst_alloc['policy']} "
              f"{100 * worst_alloc['allocated_error']:+.2f}% (limit {100 * args.max_error:.0f}%); worst reserved: "
              f"{worst_resv['model']} {worst_resv['policy']} {100 * worst_resv['reserved_error']:+.2f}% (limit "
              f"{100 * args.max_reserved_error:.0f}%): {'PASS' if ok else 'FAIL'}")
        report["rows"] = rows
    others = [c for c in checks if c != "peaks"]
    if others:
        results = run_checks(others, device, tiny=args.dry_run_cpu, limit=args.max_error)
        if "streams" in others:
            print("\n[streams]", flush=True)
            check_streams(results, device)
        counts = {v: sum(line["verdict"] == v for line in results.lines) for v in
                  ("PASS", "FAIL", "ERROR", "INCONCLUSIVE", "INFO", "SKIP")}
        print("\n" + ", ".join(f"{n} {v}" for v, n in counts.items() if n) + f" in {', '.join(others)}")
        ok = ok and results.failed == 0
        report["lines"] = results.lines
    seconds = time.perf_counter() - started
    print(f"\ngpu_check: {'PASS' if ok else 'FAIL'} in {seconds:.0f} s")
    if args.out is not None:
        write_json(args.out, {**report, "pass": ok, "seconds": seconds})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
