"""remat against Megatron-LM's own GPU measurements: the H100 golden values of its functional tests.

For each dev case vendored in ``benchmarks/data/megatron_golden_h100_dev.json`` (Megatron-LM's
``model_config.yaml`` flags and ``golden_values_dev_dgx_h100.json`` memory, with their source paths and commit;
``benchmarks/vendor_megatron_golden.py`` writes it), remat predicts the job as the test runs it: its MODEL_ARGS as
``--megatron-args``, the recipe's world size, its ENV_VARS (``CUBLAS_WORKSPACE_CONFIG``), CUDA and
TransformerEngine's kernels. The golden values come from the last global rank (the last pipeline stage):

* ``mem-max-allocated-bytes`` is ``allocated_bytes.all.peak`` since the process started; the benchmark compares the
  largest over the logged iterations with the last stage's predicted step peak;
* ``mem-allocated-bytes`` is ``allocated_bytes.all.current`` after the optimizer step: the resident state (parameters,
  main gradients, master parameters, optimizer state, the GEMM workspaces and what the step leaves behind, e.g. each
  pipeline chunk's last received input and its gradient), compared with the same parts predicted.

    python benchmarks/bench_megatron_golden.py                  # the table and the summary
    python benchmarks/bench_megatron_golden.py --only tp1_pp4   # cases whose name contains it
    python benchmarks/bench_megatron_golden.py --explain gpt3_mcore_te_tp1_pp4_vp1_resume_torch_dist
    python benchmarks/bench_megatron_golden.py --json rows.json # the rows, for comparisons between trees
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from remat.job import Job
from remat.parallel.job_predict import RESIDENT_PARTS, parts_at, predict_stage

DATA = Path(__file__).parent / "data" / "megatron_golden_h100_dev.json"
# What is known of a case the prediction does not match within 2%: a finding to print beside its row, never a
# correction (the predictions are the model's, unchanged by these notes).
# NOTE [routing drift]: the golden mem-max-allocated-bytes is the peak since the process started, logged each
# iteration. Under dropless routing the copies each rank's experts receive change as the router learns, so the
# peak of an MoE run can climb long after its first iterations while the resident state stays flat; remat prices
# balanced routing (or the --moe-routing assumption given). Where a row's note says so, the peak of the steady
# iterations is quoted beside it: the same step, under the routing of those iterations.
NOTES = {
    "moe/gpt3_moe_mcore_te_tp4_ep2_etp2_pp2_resume_torch_dist_dist_optimizer":
        "balanced routing is assumed and --moe-aux-loss-coeff is 0 (nothing balances the experts): the logged "
        "running peak climbs from 1.0649 GiB (iteration 2, remat -1.2%) to 1.0707 GiB (iteration 26) with the "
        "routing; the dataloader's attention mask, held through each forward step (NOTE [Megatron's batch on the "
        "device]), was the tensor missing at the forward-head peak (-2.0% -> -1.8%)",
    "moe/gpt3_mcore_te_tp2_pp2_ep4_etp1_memory_speed":
        "routing drift (NOTE [routing drift]): the logged running peak stays at 53.94 GiB from iteration 3 to 29 "
        "(remat -0.3%) and climbs to 55.98 GiB only at iterations 30-39, in five steps, with a flat resident state: "
        "dropless routing (--moe-aux-loss-coeff 1e-4, expert bias) sending more copies to this rank's experts; "
        "this rank's experts taking 1.48x their balanced share (capacity:1.48) predicts 56.05 GiB, 1.05x 54.03 GiB. "
        "One MLA layer under te keeps what Megatron's keeps "
        "(test_te_mla_layer_keeps_what_megatron_mla_keeps_under_unfused_attention; its --no-rope-fusion tables, "
        "4 x [s, 1, 1, 64] bf16 per layer: tests/megatron/test_megatron_rope.py)",
}
# Flags the golden run had that the case's model_config.yaml no longer gives: its golden values are older than a change
# of Megatron's defaults (a fact of the measured run, from the git history; never a correction)
GOLDEN_RUN_FLAGS = {
    # its golden values last changed at febd25e3fb (2026-03-22); until adfe9e11d9 (2026-07-01) mcore_fsdp_adapter.py
    # made Megatron-FSDP's main grads and grad communication fp32 whenever grad_reduce_in_fp32 was set, which
    # arguments.py sets under --bf16 (accumulate_allreduce_grads_in_fp32); adfe9e11d9 gave the other FSDP tests
    # (gpt3_mcore_te_tp2_zp_z3_resume_fsdp_dtensor, deepseek_proxy_fsdp_ep2_fsdp2_ep_overlap) these flags to keep it
    "moe/gpt3_mcore_te_tp2_zp_z3_resume_torch_dist_te_8experts2parallel_top2router":
        ["--megatron-fsdp-main-grads-dtype", "fp32", "--megatron-fsdp-grad-comm-dtype", "fp32"],
}
GIB, MIB = 2**30, 2**20


def megatron_argv(case: dict[str, Any]) -> list[str]:
    """The case's MODEL_ARGS as Megatron's test harness passes them (``true``: the bare flag, ``false``: absent,
    ``[a b]``: the words), the flags its golden run had besides (:data:`GOLDEN_RUN_FLAGS`) and its world size."""
    argv: list[str] = []
    for flag, value in case["model_args"].items():
        if value is False:
            continue
        text = str(value)
        # tests/functional_tests/shell_test_utils/_run_training.sh: a value "[a b]" is stripped of its brackets and
        # split into words (nargs='+' flags); any other value is one word
        values = text[1:-1].split() if text.startswith("[") and text.endswith("]") and "]" not in text[1:-1] else [text]
        argv += [flag] if value is True else [flag, *values]
    return argv + GOLDEN_RUN_FLAGS.get(case["case"], []) + ["--world-size", str(case["world_size"])]


def measured(case: dict[str, Any]) -> tuple[int, int]:
    """The golden peak (the largest mem-max-allocated-bytes logged) and resident state (the last
    mem-allocated-bytes logged)."""
    peaks, resident = case["golden"]["mem-max-allocated-bytes"], case["golden"]["mem-allocated-bytes"]
    return max(peaks.values()), resident[max(resident, key=int)]


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    """One row: the prediction of the last stage beside the measurement, or the refusal."""
    peak, resident = measured(case)
    row: dict[str, Any] = {"case": case["case"], "measured_peak": peak, "measured_resident": resident}
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            job = Job.from_megatron_args(megatron_argv(case))
            rank = predict_stage(job, job.pp - 1, device="cuda", kernels="te", env=case["env"], gpu="h100")
    except ValueError as err:  # JobError, ConfigError, PolicyError: remat refuses the job, naming the flag
        row["refused"] = str(err).splitlines()[0]
        return row
    parts = rank.parts
    # resident: what the step leaves (mem-allocated-bytes is logged after it), e.g. fp16's fp32 master grads
    end = parts_at(rank.timeline, rank.timeline.num_events - 1)
    # a run that logs its first iteration only (--train-iters 1) peaks in that step, before Adam's moments exist
    first_step = set(case["golden"]["mem-max-allocated-bytes"]) == {"1"}
    row.update(stage=rank.stage, rank=rank.rank,
               predicted_peak=rank.first_step_peak_bytes if first_step else rank.peak_bytes,
               predicted_resident=sum(end[p] for p in RESIDENT_PARTS), peak_phase=rank.timeline.peak_phase.label,
               parts=parts, seconds=round(time.perf_counter() - start, 3))
    if first_step:  # the only iteration logged
        at_end = rank.first_step_peak_bytes > rank.peak_bytes - parts["optimizer_state"]
        row["peak_phase"] = "first step: " + ("after its optimizer step" if at_end else row["peak_phase"])
    row["peak_error"] = row["predicted_peak"] / peak - 1
    row["resident_error"] = row["predicted_resident"] / resident - 1
    row["resident_error_bytes"] = row["predicted_resident"] - resident
    return row


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'case':78s} {'stage':>5s} {'meas GiB':>8s} {'pred GiB':>8s} {'peak err':>8s} "
             f"{'meas res MiB':>12s} {'pred res MiB':>12s} {'res err':>8s}  peak at / refusal"]
    for r in rows:
        name = r["case"]
        if "refused" in r:
            lines.append(f"{name:78s} {'-':>5s} {r['measured_peak'] / GIB:8.3f} {'-':>8s} {'-':>8s} "
                         f"{r['measured_resident'] / MIB:12.1f} {'-':>12s} {'-':>8s}  refused: {r['refused'][:160]}")
        else:
            lines.append(f"{name:78s} {r['stage']:5d} {r['measured_peak'] / GIB:8.3f} {r['predicted_peak'] / GIB:8.3f} "
                         f"{r['peak_error']:+8.1%} {r['measured_resident'] / MIB:12.1f} "
                         f"{r['predicted_resident'] / MIB:12.1f} {r['resident_error']:+8.1%}  {r['peak_phase']}"
                         + (f"  [note: {NOTES[name]}]" if name in NOTES else ""))
    return "\n".join(lines)


def summary(rows: list[dict[str, Any]]) -> str:
    done = [r for r in rows if "refused" not in r]
    text = f"cases predicted: {len(done)}/{len(rows)}"
    if not done:
        return text
    errors = [r["peak_error"] for r in done]
    within = {limit: sum(abs(e) <= limit for e in errors) for limit in (0.05, 0.10)}
    over, under = max(done, key=lambda r: r["peak_error"]), min(done, key=lambda r: r["peak_error"])
    resident_ok = sum(abs(r["resident_error"]) <= 0.02 or abs(r["resident_error_bytes"]) <= 64 * MIB for r in done)
    return "\n".join([
        text,
        f"peak error: median {statistics.median(errors):+.1%}, median |error| "
        f"{statistics.median(abs(e) for e in errors):.1%}; within 5%: {within[0.05]}/{len(done)} "
        f"({within[0.05] / len(done):.0%}), within 10%: {within[0.10]}/{len(done)} ({within[0.10] / len(done):.0%})",
        f"worst over: {over['peak_error']:+.1%} {over['case']}",
        f"worst under: {under['peak_error']:+.1%} {under['case']}",
        f"under by more than 2%: {sum(e < -0.02 for e in errors)} ("
        f"{sum(r['peak_error'] < -0.02 and r['case'] in NOTES for r in done)} with a note on what is known)",
        f"resident state within 2% or 64 MiB: {resident_ok}/{len(done)}; median error "
        f"{statistics.median(r['resident_error'] for r in done):+.2%}, range "
        f"{min(r['resident_error_bytes'] for r in done) / MIB:+.1f} to "
        f"{max(r['resident_error_bytes'] for r in done) / MIB:+.1f} MiB",
    ])


def explain(case: dict[str, Any]) -> str:
    """One case: remat's parts at the peak and the largest tensors alive there, beside the measured figures."""
    row = run_case(case)
    out = [f"{case['case']} ({case['model_config']} at {DATA.name}'s commit), world size {case['world_size']}",
           f"flags: {' '.join(megatron_argv(case))}",
           f"measured (last rank): peak {row['measured_peak'] / GIB:.3f} GiB, "
           f"resident {row['measured_resident'] / MIB:.1f} MiB"]
    if "refused" in row:
        return "\n".join(out + [f"remat refuses it: {row['refused']}"])
    out.append(f"predicted (stage {row['stage']}, rank {row['rank']}): peak {row['predicted_peak'] / GIB:.3f} GiB "
               f"({row['peak_error']:+.1%}) at {row['peak_phase']}; resident {row['predicted_resident'] / MIB:.1f} MiB "
               f"({row['resident_error_bytes'] / MIB:+.1f} MiB)")
    out += [f"  {part:18s} {nbytes / MIB:10.1f} MiB" for part, nbytes in row["parts"].items()]
    job = Job.from_megatron_args(megatron_argv(case))
    rank = predict_stage(job, job.pp - 1, device="cuda", kernels="te", env=case["env"], gpu="h100")
    tl = rank.timeline
    alive = sorted(tl.alive_at(tl.peak_event), key=lambda i: -tl.nbytes[i])
    out.append("largest tensors alive at the peak (bytes, category, module, made in):")
    out += [f"  {tl.nbytes[i]:>14,d}  {tl.category[i]:18s} {tl.module[i]:48s} {tl.phases[tl.phase_index[i]].label}"
            for i in alive[:25]]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="cases whose name contains this")
    parser.add_argument("--explain", metavar="CASE", help="one case's parts and tensors at the peak")
    parser.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    args = parser.parse_args()
    cases = json.loads(DATA.read_text())["cases"]
    if args.explain:
        match = [c for c in cases if args.explain in c["case"]]
        if len(match) != 1:
            sys.exit(f"--explain {args.explain!r} matches {len(match)} cases: give a unique part of one name")
        print(explain(match[0]))
        return
    start = time.perf_counter()
    rows = [run_case(c) for c in cases if args.only in c["case"]]
    print(format_table(rows))
    print()
    print(summary(rows))
    print(f"time: {time.perf_counter() - start:.1f} s for {len(rows)} cases")
    if args.json:
        with tempfile.NamedTemporaryFile("w", dir=Path(args.json).resolve().parent, delete=False) as tmp:
            json.dump(rows, tmp, indent=1)
        os.replace(tmp.name, args.json)


if __name__ == "__main__":
    main()
