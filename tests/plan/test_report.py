"""Tests for what `remat plan` reports: the headline says time and FLOPs each with its own direction, and with --pp
the per-stage plans lead and the apply snippet is theirs."""

from __future__ import annotations

import json

from remat.cli import main
from remat.config import ModelConfig
from remat.parallel.pipeline_predict import predict_pipeline
from remat.parallel.schedule import partition
from remat.parallel.stages import build_stage_module
from remat.plan import CostModel, Plan, PlanChoice, PlanResult
from remat.plan.megatron import Predicted
from remat.plan.pipeline import pipeline_summary
from remat.recompute.apply import applied

TINY = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, micro_batch_size=2,
                   vocab_size=128)
FLAGS = ["--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "32", "--batch", "2", "--vocab", "128"]


def choice(flops: int, rebuilt: int, cost: int, ratio: float = 1.0) -> PlanChoice:
    return PlanChoice(plan=Plan.parse("keep 0-1"), source="x", peak_bytes=1000, peak_phase="backward layer 1",
                      at_peak={"parameters": 1000}, recompute_flops=flops, extra_compute_pct=0.0, cost=cost,
                      recompute_bytes=rebuilt, step_time_ratio=ratio)


def result(cost: CostModel, extended: PlanChoice, megatron: PlanChoice) -> PlanResult:
    baseline = Predicted(900, "backward layer 1", {}, {"forward": 10**12, "backward": 2 * 10**12})  # 3 s at 1e12
    return PlanResult(TINY, 2000, "2000 B", cost.objective, cost, extended, megatron, "", baseline)


def headline(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("Extended plan vs"))


def test_flop_headline_says_when_the_step_is_slower():
    """Fewer FLOPs (non_matmul: none) but 2 GB rebuilt at 1 GB/s: the step is longer, and the report says so."""
    cost = CostModel("extra_flops", flops_per_second=1e12, memory_bandwidth=1e9)
    text = result(cost, choice(0, 2 * 10**9, 0, 5 / 3), choice(10**12, 0, 10**12, 4 / 3)).format()
    assert "less extra compute" not in text
    assert headline(text) == (
        "Extended plan vs the best Megatron setting: recomputed FLOPs: 100.0% fewer (0 vs 1,000,000,000,000); "
        "predicted step time: 25.0% longer (1.6667x vs 1.3333x no recompute; FLOPs at 1 TFLOP/s and written bytes "
        "at 1 GB/s).")


def test_time_headline_leads_with_step_time_and_says_more_flops():
    cost = CostModel("time", flops_per_second=1e12, memory_bandwidth=1e9)
    text = result(cost, choice(2 * 10**12, 0, 10**9, 4 / 3), choice(10**12, 0, 2 * 10**9, 5 / 3)).format()
    assert headline(text) == (
        "Extended plan vs the best Megatron setting: predicted step time: 20.0% shorter (1.3333x vs 1.6667x no "
        "recompute; FLOPs at 1 TFLOP/s and written bytes at 1 GB/s); recomputed FLOPs: 100.0% more "
        "(2,000,000,000,000 vs 1,000,000,000,000).")


def test_report_leads_with_the_step_time_ratio_then_flops(capsys):
    """`remat plan` (default objective: time) prints each answer's predicted step-time ratio first, then its
    recomputed FLOPs; the JSON has the ratio of each answer."""
    from remat.plan import PlanOptions, plan

    assert PlanOptions().objective == "time"
    result = plan(TINY, 10**9)  # no recompute needed
    lines = result.format().splitlines()
    assert lines[1] == ("predicted step time: 1.0000x (extended plan), 1.0000x (best Megatron setting) of the "
                        "no-recompute step; recomputed FLOPs: 0.00% (extended plan), 0.00% (best Megatron setting) "
                        "of the step's")
    block = lines[lines.index("Best extended plan:") + 1:]
    assert block[1].startswith("  step time:      1.0000x no recompute predicted") and \
        block[4].startswith("  extra compute:")
    assert main(["plan", "--budget", "1GB", *FLAGS, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["objective"] == "time" and report["extended"]["step_time_ratio"] == 1.0


def test_pipeline_summary_says_longer_and_more():
    stage = {"stage": 0, "layers": [0, 0], "in_flight": 1, "fits": True, "plan": "keep 0", "source": "extended",
             "peak_bytes": 10, "recompute_flops": 300, "seconds_per_microbatch": 2.0}
    report = {"pp": 1, "microbatches": 1, "schedule": "1f1b", "stages": [stage], "critical_path_seconds": 2.1,
              "step_time_saving_pct": -5.0,
              "uniform": {"policy": "none", "stage_peaks": [10], "critical_path_seconds": 2.0, "recompute_flops": 200}}
    last = pipeline_summary(report).splitlines()[-1]
    assert last == ("  critical path 2.1 s per step vs 2 s with the uniform setting: 5.0% longer; recomputed FLOPs "
                    "per microbatch over all stages: 50.0% more (300 vs 200)")


def test_pipeline_report_leads_with_stage_plans_and_applies_them(capsys):
    """--pp: the per-stage plans come first, with a snippet that applies each stage's plan to its stage module;
    the whole model on one GPU is for reference, and its refusal (it holds both layers) no longer hides the stages'
    plans (the budget is stage 1's no-recompute peak: stage 0, with two microbatches in flight, must recompute)."""
    budget = min(tl.peak_bytes for tl in predict_pipeline(TINY, "none", 2, 2, "1f1b"))
    assert main(["plan", "--budget", str(budget), *FLAGS, "--pp", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    stages = report["pipeline"]["stages"]
    assert report["extended"] is None and "no plan fits" in report["megatron_note"]
    assert all(st["fits"] and st["peak_bytes"] <= budget for st in stages) and stages[0]["recompute_flops"] > 0

    assert main(["plan", "--budget", str(budget), *FLAGS, "--pp", "2"]) == 0
    text = capsys.readouterr().out
    assert text.index("Pipeline (2 stages") < text.index("Apply it, on each pipeline stage:") < \
        text.index("For reference, the whole model on one GPU")
    assert "plan = Plan.from_dict" not in text and "Best extended plan" not in text
    snippet = report["pipeline"]["snippet"]
    assert all(json.dumps(st["plan_json"], separators=(",", ":")) in snippet for st in stages)
    for spec, st in zip(partition(TINY, 2, 1), stages):
        module = build_stage_module(TINY, spec)
        exec(snippet, {"stage_module": module, "stage": st["stage"]})  # the snippet as printed, per stage
        assert applied(module).policy == Plan.from_dict(st["plan_json"])


def test_pipeline_report_with_a_one_gpu_plan_still_leads_with_stages(capsys):
    none = max(tl.peak_bytes for tl in predict_pipeline(TINY, "none", 2, 2, "1f1b"))
    budget = none + 300 * 1024  # the whole model fits on one GPU with some recompute
    assert main(["plan", "--budget", str(budget), *FLAGS, "--pp", "2"]) == 0
    text = capsys.readouterr().out
    assert text.index("Pipeline (2 stages") < text.index("Apply it, on each pipeline stage:") < \
        text.index("Best Megatron-LM setting") < text.index("Best extended plan")
    assert text.count("Apply it") == 1 and "stage_plans[stage]" in text
