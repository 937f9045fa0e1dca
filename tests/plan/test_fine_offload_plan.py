"""The planner chooses Megatron's fine-grained activation offloading (remat.plan.fine_offload.choose_offload): an
offload variant that fits and costs less (recompute + transfer charge) than every recompute-only setting that fits
becomes the Megatron answer, the overall recommendation compares it with the extended plan, and the chosen policy
applied to the reference model measures on CPU exactly as predicted (device peak and host bytes, to the byte)."""

from __future__ import annotations

import functools
import json

import pytest

from remat import apply, build_model, measure, sample_batch
from remat.analysis.job_report import format_job_plan
from remat.cli import main
from remat.config import ModelConfig
from remat.job import Job
from remat.memory.predict import predict_config
from remat.memory.workspaces import stage_workspaces
from remat.parallel.job_predict import predict_stage
from remat.plan.api import BudgetError, plan
from remat.plan.job_plan import plan_job
from remat.plan.options import ParallelOptions, PlanOptions
from remat.plan.result import PlanResult
from remat.recompute.plan_format import PlanError
from remat.units import format_bytes

# tests/plan/test_plan.py's SMALL (its unit model is built once per session)
CONFIG = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, micro_batch_size=2,
                     vocab_size=128)
# recompute-only settings fit from 2,020,360 bytes (selective/core_attn+mlp+layernorm); offloading every dense module
# beside selective/core_attn peaks at 2,034,952 and with no recompute at 2,067,720: the last layer's groups stay on
# the device and its backward brings the layer below back (NOTE [when offloaded groups come back])
BUDGET = 2_100_000
RECOMPUTE_MIN, OFFLOAD_MIN = 2_020_360, 2_034_952
FAST, SLOW = 1e15, 1e6  # bytes per second: transfers hidden behind a layer's forward, or dearer than any recompute
DENSE_ALL = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm")


@functools.cache
def planned(budget: int, bandwidth: float, tp: int = 1) -> PlanResult:
    # min size 0: the tiny model's tensors are under Megatron's default of 1M elements
    # (no keep_ops kinds on the tensor-parallel rank: they would be traced for it alone)
    options = PlanOptions(fine_grained_offload=True, min_offloaded_tensor_size=0, bandwidth=bandwidth,
                          operator_sets=16 if tp == 1 else 0)
    return plan(CONFIG, budget, options, ParallelOptions(tp=tp, sp=tp > 1))


@pytest.mark.parametrize("budget", [BUDGET])
def test_offloading_wins_and_measures_as_predicted(budget: int) -> None:
    result = planned(budget, FAST)
    chosen = result.megatron
    assert chosen is not None and chosen.policy is not None and chosen.layout is chosen.policy
    assert chosen.policy.offload_modules and chosen.peak_bytes <= budget
    assert result.stats["fine_grained_offload_chosen"] == str(chosen.policy)
    option = next(o for o in result.stats["fine_grained_offload"] if o["policy"] == str(chosen.policy))
    assert option["fits"] and option["transfer_seconds"] == chosen.offload_seconds == 0.0  # hidden by the forward
    assert chosen.cost == option["cost"] == option["recompute_cost"]
    without = result.megatron_without_offload  # the best recompute-only setting fits and costs more
    assert without is not None and without.policy is None and chosen.cost < without.cost
    assert without.peak_bytes <= budget
    assert chosen.policy.granularity == "none"
    # the overall recommendation compares costs including it
    assert result.extended is not None and result.extended.cost <= chosen.cost

    # measured on real CPU tensors: the device peak and the host bytes the prediction gave, to the byte
    model = build_model(CONFIG)
    apply(model, chosen.layout)
    tl = measure(model, sample_batch(CONFIG))
    assert tl.peak_bytes == chosen.peak_bytes <= budget
    host = tl.meta["host_memory"]
    assert host["peak_bytes"] == chosen.host_peak_bytes > 0
    assert sum(host["offloaded_bytes"].values()) == chosen.offload_bytes == option["offloaded_bytes"]


def test_refusal_names_the_lowest_plan_offload_variants_included() -> None:
    """Below every peak: the BudgetError names the lowest plan; here a recompute-only one (2,020,360 bytes), since the
    lowest offload variant peaks higher (2,034,952: its last two layers' groups are on the device together)."""
    options = PlanOptions(fine_grained_offload=True, min_offloaded_tensor_size=0, bandwidth=FAST)
    offload = sorted(o["peak_bytes"] for o in planned(BUDGET, FAST).stats["fine_grained_offload"])
    assert offload[0] == OFFLOAD_MIN > RECOMPUTE_MIN
    assert offload[0] == predict_config(CONFIG, "selective/core_attn,offload:" + "+".join(DENSE_ALL) +
                                        ",offload_min:0").peak_bytes
    with pytest.raises(BudgetError, match="with plan selective/core_attn") as info:
        plan(CONFIG, 1_900_000, options)
    assert info.value.min_peak_bytes == RECOMPUTE_MIN


def test_offloading_loses_at_low_bandwidth() -> None:
    result = planned(BUDGET, SLOW)
    assert result.megatron is not None and result.megatron.policy is None and result.megatron_without_offload is None
    assert result.stats["fine_grained_offload_chosen"] is None
    fitting = [o for o in result.stats["fine_grained_offload"] if o["fits"]]
    assert fitting and all(o["cost"] > result.megatron.cost and o["transfer_seconds"] > 0 for o in fitting)
    # the same variant is free at the high bandwidth: only the charge differs
    fast = {o["policy"]: o for o in planned(BUDGET, FAST).stats["fine_grained_offload"]}
    for o in fitting:
        assert o["cost"] > o["recompute_cost"]
        if o["policy"] in fast:
            assert fast[o["policy"]]["cost"] == o["recompute_cost"]
    assert "<- chosen" not in result.format()


def test_report_and_json_carry_the_choice() -> None:
    result = planned(BUDGET, FAST)
    text = result.format()
    policy = result.megatron.policy
    assert f"plan:           {policy}" in text
    assert "chosen: Megatron's fine-grained activation offloading of attn_norm" in text
    assert "--fine-grained-activation-offloading --offload-modules " + " ".join(policy.offload_modules) in text
    assert f"without offloading: {result.megatron_without_offload.megatron_policy} (" in text
    assert f"{policy}" in text.split("cheapest fitting first")[1]
    assert f"remat.apply(model, {str(policy)!r})" in text
    data = json.loads(json.dumps(result.to_dict()))
    meg = data["megatron"]
    assert meg["policy"] == meg["plan"] == str(policy) and meg["plan_json"] is None
    assert meg["host_peak_bytes"] == result.megatron.host_peak_bytes and meg["megatron_args"][-2:] == [
        "--min-offloaded-tensor-size", "0"]
    assert data["megatron_without_offload"]["megatron_policy"] == result.megatron_without_offload.megatron_policy


def test_tensor_parallel_rank() -> None:
    budget = predict_config(CONFIG, "none", tp=2, sp=True).peak_bytes - 1
    result = planned(budget, FAST, tp=2)
    chosen = result.megatron
    assert chosen is not None and chosen.policy is not None
    limit = budget - result.stats["collective_margin_bytes"]
    tl = predict_config(CONFIG, chosen.policy, tp=2, sp=True)
    assert chosen.peak_bytes == tl.peak_bytes <= limit
    assert chosen.host_peak_bytes == tl.meta["host_memory"]["peak_bytes"]


def test_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--layers", "4", "--hidden", "64", "--heads", "4", "--seq", "32", "--batch", "2", "--vocab",
            "128", "--budget", "2050KiB", "--fine-grained-offload", "--min-offloaded-tensor-size", "0", "--json"]
    assert main([*argv, "--bandwidth", "1000000"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["megatron"]["policy"] == data["stats"]["fine_grained_offload_chosen"]
    assert "--fine-grained-activation-offloading" in data["megatron"]["megatron_args"]
    assert main([*argv, "--bandwidth", "0.001"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["megatron"]["policy"] is None and data["stats"]["fine_grained_offload_chosen"] is None


def test_options_refuse_a_bad_minimum_size() -> None:
    with pytest.raises(PlanError, match="min_offloaded_tensor_size=-1: give .* int >= 0"):
        PlanOptions(fine_grained_offload=True, min_offloaded_tensor_size=-1)
    with pytest.raises(PlanError, match="no effect without fine_grained_offload: set fine_grained_offload=True"):
        PlanOptions(min_offloaded_tensor_size=0)


# tests/plan/test_job_plan.py's job: stage 0 peaks at 1,018,184 bytes with nothing recomputed, 954,664 offloading
# every dense module, 928,072 with selective/mlp; stage 1 fits 960,000 as it is
JOB = Job.build(CONFIG.replace(attention="sdpa"), precision="bf16", tp=2, sp=True, pp=2, num_microbatches=4, dp=2,
                distributed_optimizer=True)
# every GPU rank of it also keeps PyTorch's two cuBLAS workspaces (the cuda kernel profile: torch GEMMs forward and
# backward, remat.memory.workspaces), 64 MiB on every stage beside those figures
JOB_BUDGET = 960_000 + sum(n for _, n in stage_workspaces(JOB, 0, kernels="cuda"))


@pytest.mark.parametrize("bandwidth", [FAST, SLOW])
def test_whole_job_stage_chooses_offloading_when_cheaper(bandwidth: float) -> None:
    options = PlanOptions(fine_grained_offload=True, min_offloaded_tensor_size=0, bandwidth=bandwidth)
    result = plan_job(JOB, JOB_BUDGET, options)
    assert result.fits
    stage = result.stages[0]
    chosen = stage.megatron
    assert chosen is not None and stage.offload_options
    if bandwidth == SLOW:
        assert chosen.offload_policy is None and stage.megatron_without_offload is None
        assert all(o["cost"] > o["recompute_cost"] for o in stage.offload_options)
        return
    assert chosen.offload_policy is not None and stage.policy == chosen.offload_policy == chosen.layout
    assert stage.megatron_without_offload is not None and chosen.cost < stage.megatron_without_offload.cost
    exact = predict_stage(JOB.replace(policy=chosen.offload_policy), 0)  # every microbatch in flight offloading
    assert chosen.prediction.peak_bytes == exact.peak_bytes <= JOB_BUDGET
    assert chosen.host_bytes > 0 and chosen.transfer_seconds == 0.0
    assert stage.extended is not None and stage.extended.cost <= chosen.cost
    data = json.loads(json.dumps(result.to_dict()))["stages"][0]
    assert data["megatron"]["plan"] == str(chosen.offload_policy) and data["megatron"]["plan_json"] is None
    assert "--fine-grained-activation-offloading" in data["megatron"]["megatron_args"]
    text = format_job_plan(result)
    assert "chosen: fine-grained activation offloading of attn_norm" in text and "without offloading: " in text
    # the host line: the rank's host peak, each of stage 0's 2 microbatches in flight holding its own groups; the
    # second's backward does not run next, so it offloads its last layer's groups too (NOTE [which forwards keep their
    # last offload group] in remat.parallel.schedule): more than twice what a forward that keeps them offloads
    host = exact.timeline.meta["host_memory"]["peak_bytes"]
    assert host == data["megatron"]["host_peak_bytes"] > 2 * chosen.host_bytes
    assert f"host {format_bytes(host)} at most at once over the 2 microbatches in flight" in text
