"""One Megatron setting for every pipeline stage (remat.plan.job_uniform, NOTE [the uniform screen]): the cheapest
setting whose exact whole-rank prediction fits every stage, however many cheaper settings fit one stage and not
the other, as a brute-force exact search over every listed setting finds it."""

from __future__ import annotations

import pytest

from remat.analysis.job_report import format_job_plan
from remat.config import ModelConfig
from remat.job import Job
from remat.parallel.job_predict import predict_stage
from remat.parallel.stages import chunk_policy
from remat.plan import job_uniform
from remat.plan.costs import CostModel
from remat.plan.job_plan import plan_job
from remat.plan.job_stages import rank_config
from remat.plan.moe_modules import job_policies
from remat.plan.unit_model import UnitModel, unit_model
from remat.policy import Policy
from remat.recompute.plan_format import Plan

# 8 layers split 6 + 2 (stage 0 holds two microbatches in flight, stage 1 one and the loss of a 16384-token
# vocabulary, the higher peak under every setting): at the budget of stage 1's two layers recomputed in one group,
# eight settings no cheaper than the stages' own cheapest fits (full/block/2..5, selective with mlp) keep too much
# on stage 1, and the cheapest that fits both recomputes every layer of both stages. A screen that stopped after 6
# settings found none.
JOB = Job.build(ModelConfig(num_layers=8, hidden_size=64, num_attention_heads=4, seq_length=32, micro_batch_size=2,
                            vocab_size=16384, attention="sdpa"), precision="bf16", pp=2, num_microbatches=4,
                decoder_first_pipeline_num_layers=6)


@pytest.fixture(scope="module")
def brute() -> tuple[int, list[tuple[int, str, list[int]]]]:
    """The budget, and every listed setting with its cost (the slowest stage's) and its exact peaks: stage 1's,
    then stage 0's when stage 1's fits (a setting fits iff every stage's peak fits)."""
    config = rank_config(JOB)
    model, cost = unit_model(config, tp=JOB.tp, sp=JOB.sp), CostModel()
    budget = predict_stage(JOB.replace(policy=Policy.parse("full/uniform/2")), 1).peak_bytes
    rows = []
    for policy in job_policies(JOB.layers_per_chunk, "reentrant", config):
        plans = [Plan.from_policy(chunk_policy(policy, config, d), d) for d in (6, 2)]
        peaks = [predict_stage(JOB.replace(policy=policy), 1).peak_bytes]
        if peaks[0] <= budget:
            peaks.append(predict_stage(JOB.replace(policy=policy), 0).peak_bytes)
        rows.append((max(sum(cost.cost(model, u) for u in p.units()) for p in plans), str(policy), peaks))
    return budget, rows


def test_the_one_setting_is_the_cheapest_that_fits_every_stage_by_brute_force(brute) -> None:
    budget, rows = brute
    result = plan_job(JOB, budget)
    assert [s.chunk_layers for s in result.stages] == [(6,), (2,)]
    fitting = sorted((c, name) for c, name, peaks in rows if max(peaks) <= budget)
    cheapest = [name for c, name in fitting if c == fitting[0][0]]
    assert str(result.uniform) in cheapest
    peaks = {name: p for _, name, p in rows}[str(result.uniform)]
    assert [r.peak_bytes for r in sorted(result.uniform_ranks, key=lambda r: -r.stage)] == peaks
    assert max(peaks) <= budget and result.stats["uniform_search_cut"] is False
    # more than 6 settings no costlier than the stages' own cheapest fits come before it, none fitting both stages
    least = max(s.megatron.cost for s in result.stages)
    before = [name for c, name, p in rows if least <= c < fitting[0][0]]
    assert len(before) > 6 and all(max(p) > budget for c, name, p in rows if c < fitting[0][0])


def test_a_time_cap_that_cuts_the_search_says_so(brute, monkeypatch: pytest.MonkeyPatch) -> None:
    budget, rows = brute
    monkeypatch.setattr(job_uniform, "UNIFORM_SECONDS", 0.0)
    # bounds that skip nothing (each peak's bytes beyond the rank taken as a stack's), so the screen predicts
    monkeypatch.setattr(UnitModel, "beyond_rank", lambda self, units: 1 << 50)
    result = plan_job(JOB, budget)
    assert result.stats["uniform_search_cut"] is True and result.to_dict()["stats"]["uniform_search_cut"] is True
    assert "a cheaper setting may fit" in format_job_plan(result).split("one Megatron setting")[-1]
    # the answer after a cut is every layer recomputed, full/uniform/1, when it fits every stage (here it does not)
    full = {name: p for _, name, p in rows}["full/uniform/1"]
    assert (result.uniform is None) == (max(full) > budget)


def test_each_settings_lower_bound_is_under_its_exact_peak(brute) -> None:
    """The screens' premise (NOTE [the Megatron screen of a stage]): a setting's modelled peak + the stage's
    calibration on "nothing recomputed" - the bytes that peak holds beyond the rank is <= its exact peak, on both
    stages, for every setting; and it is tighter than the whole stack's slack for some."""
    _, rows = brute
    config = rank_config(JOB)
    model = unit_model(config, tp=JOB.tp, sp=JOB.sp)
    depth, in_flight = {0: 6, 1: 2}, {0: 2, 1: 1}

    def modelled(stage: int, policy: Policy) -> tuple[int, int]:
        units = Plan.from_policy(chunk_policy(policy, config, depth[stage]), depth[stage]).units()
        stored = sum(model.shape(u).forward.net for u in units)
        return model.peak(units) + (in_flight[stage] - 1) * stored, model.beyond_rank(units)

    offset = {s: predict_stage(JOB, s).peak_bytes - modelled(s, Policy())[0] for s in (0, 1)}
    tighter = checked = 0
    for _, name, peaks in rows:
        for stage, peak in zip((1, 0), peaks):
            m, held = modelled(stage, Policy.parse(name))
            assert m + offset[stage] - held <= peak, (name, stage)
            slack = model.held_beyond_rank(depth[stage])
            tighter += held < slack
            checked += 1
    assert checked > len(rows) and tighter > len(rows) // 2
