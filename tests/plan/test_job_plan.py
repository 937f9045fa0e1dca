"""Planning a whole Megatron job (remat.plan.job_plan): the extended planner per stage under the budget left by the
rank's model state, every plan reported as fitting checked by the exact whole-rank prediction."""

from __future__ import annotations

import pytest

from remat.config import ModelConfig
from remat.job import Job
from remat.parallel.job_predict import PARTS, predict_job, predict_stage, stage_state
from remat.plan.costs import CostModel
from remat.plan.job_plan import plan_job, rank_config
from remat.plan.megatron import megatron_policies
from remat.plan.options import PlanOptions
from remat.plan.unit_model import unit_model
from remat.policy import Policy
from remat.recompute.plan_format import Plan, PlanError

CONFIG = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, micro_batch_size=2,
                     vocab_size=128, attention="sdpa")
JOB = Job.build(CONFIG, precision="bf16", tp=2, sp=True, pp=2, num_microbatches=4, dp=2, distributed_optimizer=True)


@pytest.fixture(scope="module")
def peaks() -> tuple[int, int]:
    """The worst rank's exact peak with nothing recomputed and with every layer recomputed."""
    keep = predict_job(JOB).worst.peak_bytes
    full = predict_job(JOB.replace(policy=Policy.parse("full/uniform/1"))).worst.peak_bytes
    return keep, full


@pytest.fixture(scope="module")
def middle(peaks) -> tuple[int, object]:
    keep, full = peaks
    budget = (keep + full) // 2
    return budget, plan_job(JOB, budget)


def test_every_plan_reported_as_fitting_is_its_exact_whole_rank_prediction(middle):
    budget, result = middle
    assert result.fits and result.state_fits
    for s in result.stages:
        ext = s.extended
        again = predict_stage(JOB, s.stage, layout=ext.plan)  # the plan run by every chunk of the stage
        assert ext.prediction.peak_bytes == again.peak_bytes <= budget
        assert ext.prediction.parts == again.parts and sum(again.parts[p] for p in PARTS) == again.peak_bytes
        assert again.parts["optimizer_state"] == stage_state(JOB, s.stage).optimizer_state > 0
        meg = predict_stage(JOB.replace(policy=s.policy), s.stage)
        assert s.megatron.prediction.peak_bytes == meg.peak_bytes <= budget
    rows = predict_job(JOB.replace(policy=result.uniform)).ranks
    assert [r.peak_bytes for r in result.uniform_ranks] == [r.peak_bytes for r in rows]
    assert max(r.peak_bytes for r in rows) <= budget


def test_the_extended_plan_is_never_costlier_than_megatron_and_cheaper_here(middle):
    _, result = middle
    for s in result.stages:
        assert s.extended.cost <= s.megatron.cost
    stage0 = result.stages[0]
    assert stage0.extended.cost < stage0.megatron.cost and stage0.extended.policy is None  # not a Megatron setting


def test_the_megatron_answer_is_the_cheapest_setting_that_fits_by_exact_prediction(middle):
    budget, result = middle
    model = unit_model(rank_config(JOB), tp=JOB.tp, sp=JOB.sp)
    cost = CostModel()
    L = JOB.layers_per_chunk
    stage = result.stages[0]
    fitting = []
    for policy in megatron_policies(L):
        peak = predict_stage(JOB.replace(policy=policy), 0).peak_bytes
        if peak <= budget:
            fitting.append(sum(cost.cost(model, u) for u in Plan.from_policy(policy, L).units()))
    assert stage.megatron.cost == min(fitting)


def test_a_budget_nothing_recomputed_fits_plans_nothing_and_one_below_recomputes(peaks):
    keep, _ = peaks
    nothing = Plan.from_policy("none", JOB.layers_per_chunk)
    result = plan_job(JOB, keep)
    assert result.fits and result.uniform == Policy()
    assert all(s.extended.plan == nothing for s in result.stages)
    below = plan_job(JOB, keep - 1)
    assert below.fits and below.stages[0].extended.plan != nothing  # (norms recompute at no FLOP cost)
    assert max(r.peak_bytes for r in below.ranks()) <= keep - 1


def test_a_budget_below_every_plan_does_not_fit_and_says_the_lowest_peak(peaks):
    _, full = peaks
    state = max(stage_state(JOB, s).total for s in range(JOB.pp))
    result = plan_job(JOB, state + 1)
    assert result.state_fits and not result.fits and result.ranks() == []
    worst = result.stages[0]
    assert worst.extended is None and worst.policy is None and worst.prediction.peak_bytes > state + 1


def test_a_model_state_over_the_budget_traces_nothing():
    state = stage_state(JOB, 0).total
    result = plan_job(JOB, state - 1)
    assert not result.state_fits and not result.fits
    assert all(s.prediction is None and not s.tried for s in result.stages)


def test_options_shape_the_search(peaks):
    keep, full = peaks
    budget = full + (keep - full) // 4
    result = plan_job(JOB, budget, PlanOptions(objective="time", offload=False, selective_sets="core_attn,mlp"))
    assert result.fits and result.objective == "time"
    for s in result.stages:
        for unit in s.extended.plan.units():
            assert unit.mode != "offload" and set(unit.modules) <= {"core_attn", "mlp"}
    with pytest.raises(PlanError, match=r"measured_times \(--measured-times\).*tp=2"):
        plan_job(JOB, budget, PlanOptions(measured_times=True))


def test_stage_predictions_are_read_back_from_the_disk_cache(peaks, tmp_path, monkeypatch):
    keep, full = peaks
    budget = (keep + full) // 2 + 4096
    monkeypatch.setenv("REMAT_CACHE_DIR", str(tmp_path))
    first = plan_job(JOB, budget)
    second = plan_job(JOB, budget)
    assert first.stats["exact_predictions"] > 0 and second.stats["exact_predictions"] == 0
    strip = [{k: v for k, v in d.items() if k != "stats"} for d in (first.to_dict(), second.to_dict())]
    assert strip[0] == strip[1]


def _answer(result) -> dict:
    out = result.to_dict()
    out["stats"] = {k: v for k, v in out["stats"].items() if not k.endswith("seconds")}
    return out


def test_stages_searched_side_by_side_give_the_answer_of_one_process(middle, monkeypatch):
    # NOTE [stages side by side]: forked workers search the stages (Megatron screen and extended search apart) and
    # the Megatron setting of every stage is predicted ahead in them; the plans, predictions, tried settings in
    # their order and the count of exact predictions are those of one process searching in order
    budget, _ = middle
    monkeypatch.setenv("REMAT_TRACE_WORKERS", "1")
    serial = _answer(plan_job(JOB, budget))
    monkeypatch.setenv("REMAT_TRACE_WORKERS", "2")
    forked = _answer(plan_job(JOB, budget))
    assert forked == serial
    assert [list(s["tried"]) for s in forked["stages"]] == [list(s["tried"]) for s in serial["stages"]]
    assert serial["stats"]["exact_predictions"] > 0


@pytest.mark.parametrize("fraction", [0.5, 0.9])
def test_what_a_plan_shows_is_one_prediction_per_stage_and_setting(peaks, fraction, monkeypatch):
    # a worker sends back its own copy of a prediction made before it was forked (the stages' "nothing recomputed");
    # the answer keeps this process's, so that the report's caching-allocator replays make each one once
    from remat.plan.job_exact import ExactStages

    keep, full = peaks
    monkeypatch.setenv("REMAT_TRACE_WORKERS", "2")
    result = plan_job(JOB, full + int((keep - full) * fraction))
    shown: dict[tuple[int, str], object] = {}
    for st in result.stages:
        for choice in (st.extended, st.megatron):
            if choice is not None:
                key = ExactStages.key(st.stage, choice.layout)[0]
                assert shown.setdefault(key, choice.prediction) is choice.prediction, key
    for rank in result.uniform_ranks:
        key = ExactStages.key(rank.stage, result.uniform)[0]
        assert shown.setdefault(key, rank) is rank, key
    assert any(key[1] == "none" for key in shown)  # a stage that fits with nothing recomputed is among them


def test_the_screens_predictions_made_ahead_give_the_answer_of_one_process(middle, monkeypatch):
    # NOTE [stages side by side]: the predictions the Megatron screens (and the setting for every stage) will likely
    # ask for are made in workers beside the extended searches, each counted only when asked for
    from remat.plan.job_exact import ExactStages

    budget, _ = middle
    monkeypatch.setenv("REMAT_TRACE_WORKERS", "1")
    serial = _answer(plan_job(JOB, budget))
    made: list[object] = []
    keep = ExactStages.keep_ahead
    monkeypatch.setattr(ExactStages, "keep_ahead", lambda self, answers: made.extend(answers) or keep(self, answers))
    monkeypatch.setenv("REMAT_TRACE_WORKERS", "2")
    forked = _answer(plan_job(JOB, budget))
    assert forked == serial
    assert [list(s["tried"]) for s in forked["stages"]] == [list(s["tried"]) for s in serial["stages"]]
    assert made  # predictions were made ahead, and the answer, its tried order and counts are one process's


def test_alike_stages_predicted_ahead_give_the_answer_of_one_process(monkeypatch):
    # NOTE [stages side by side]: the middle stages of PP=4 are alike; the worker that predicts the first of them
    # ahead lays the others out too, and the answer is still one process's
    from remat.plan.job_exact import ExactStages

    job = Job.build(CONFIG.replace(num_layers=8), precision="bf16", pp=4, num_microbatches=4)
    keep = predict_job(job).worst.peak_bytes
    full = predict_job(job.replace(policy=Policy.parse("full/uniform/1"))).worst.peak_bytes
    budget = full + (keep - full) // 3
    monkeypatch.setenv("REMAT_TRACE_WORKERS", "1")
    serial = _answer(plan_job(job, budget))
    made: list[tuple[int, str]] = []
    keep_ahead = ExactStages.keep_ahead
    monkeypatch.setattr(ExactStages, "keep_ahead",
                        lambda self, answers: made.extend(a[0][0] for a in answers) or keep_ahead(self, answers))
    monkeypatch.setenv("REMAT_TRACE_WORKERS", "2")
    forked = _answer(plan_job(job, budget))
    assert forked == serial
    assert [list(s["tried"]) for s in forked["stages"]] == [list(s["tried"]) for s in serial["stages"]]
    alike = {setting for stage, setting in made if stage == 1} & {setting for stage, setting in made if stage == 2}
    assert alike, made  # a setting of both middle stages was predicted ahead


def test_tracing_ahead_while_the_unit_model_is_built_changes_no_answer(monkeypatch):
    # NOTE [tracing ahead]: the full/block stand-ins traced while the unit model is built leave the answer alone
    from remat.plan import job_exact, job_plan

    job = Job.build(CONFIG.replace(num_layers=10), precision="bf16", pp=2, num_microbatches=2)
    keep = predict_job(job).worst.peak_bytes
    full = predict_job(job.replace(policy=Policy.parse("full/uniform/1"))).worst.peak_bytes
    budget = (keep + full) // 2
    made: list[str] = []
    real = job_plan.predict_stage
    with monkeypatch.context() as patch:
        patch.setattr(job_plan, "idle_cores", lambda *a, **k: 2.0)
        patch.setattr(job_plan, "prefetch_pending", lambda *a, **k: True)
        for module in (job_plan, job_exact):  # traced ahead (job_plan), predicted exactly (job_exact)
            patch.setattr(module, "predict_stage", lambda j, *a, **k: made.append(str(j.policy)) or real(j, *a, **k))
        ahead = _answer(plan_job(job, budget))
    assert ahead == _answer(plan_job(job, budget))
    # each stage with nothing recomputed, then per kind of stage (embedding, head) selective/core_attn and one
    # full/block stand-in ahead
    assert made[:6] == ["none", "none", "selective/core_attn", "selective/core_attn", "full/block/3", "full/block/3"]
