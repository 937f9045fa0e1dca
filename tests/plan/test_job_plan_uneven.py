"""Planning a job under Megatron's uneven pipeline splits (remat.plan.job_plan, NOTE [uneven splits]): each stage's
plan is of its own chunks' depths, every answer reported as fitting is its exact whole-rank prediction, and the one
Megatron setting for every stage is what Megatron runs on each, predicted to the byte."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from remat.config import ModelConfig
from remat.job import Job
from remat.memory.kernels import use_kernels
from remat.parallel.job_predict import PARTS, predict_job, predict_stage
from remat.plan.job_plan import JobPlan, plan_job
from remat.plan.job_stages import kind_config, stage_is_moe
from remat.policy import Policy

CONFIG = ModelConfig(num_layers=5, hidden_size=32, num_attention_heads=2, vocab_size=64, seq_length=16,
                     micro_batch_size=2, attention="sdpa", tie_embeddings=False)


@pytest.fixture(autouse=True)
def cpu_kernels() -> Iterator[None]:
    """The kernels a gloo run keeps, in every test: one unit model (one layer kind, one profile) serves them all."""
    with use_kernels("cpu"):
        yield


def between(job: Job) -> int:
    """A budget between the worst rank's exact peak with nothing and with every layer recomputed."""
    keep = predict_job(job).worst.peak_bytes
    full = predict_job(job.replace(policy=Policy.parse("full/uniform/1"))).worst.peak_bytes
    assert full < keep
    return (keep + full) // 2


def check_exact(job: Job, result: JobPlan) -> None:
    """Every stage's chosen plan and Megatron setting, and the one setting for every stage, are their exact
    predictions, within the budget."""
    budget = result.budget_bytes
    assert result.fits
    for s in result.stages:
        ext = s.extended
        again = predict_stage(job, s.stage, layout=ext.plan)  # None: the job's own policy (recompute nothing)
        assert ext.prediction.peak_bytes == again.peak_bytes <= budget, s.stage
        assert ext.prediction.parts == again.parts and sum(again.parts[p] for p in PARTS) == again.peak_bytes
        meg = predict_stage(job.replace(policy=s.policy), s.stage)
        assert s.megatron.prediction.peak_bytes == meg.peak_bytes <= budget
    rows = predict_job(job.replace(policy=result.uniform)).ranks
    assert [(r.stage, r.peak_bytes) for r in result.uniform_ranks] == [(r.stage, r.peak_bytes) for r in rows]
    assert max(r.peak_bytes for r in rows) <= budget


def test_a_shorter_first_stage_is_planned_for_its_own_layer():
    # --decoder-first-pipeline-num-layers 1 on 5 layers: stage 0 holds 1 layer, stage 1 four
    job = Job.build(CONFIG, precision="bf16", pp=2, decoder_first_pipeline_num_layers=1, num_microbatches=4)
    result = plan_job(job, between(job))
    assert [s.chunk_layers for s in result.stages] == [(1,), (4,)]
    assert [s.layers for s in result.stages] == [(0, 0), (1, 4)]
    assert result.stages[0].extended.plan.num_layers == 1 and result.stages[1].extended.plan.num_layers == 4
    check_exact(job, result)
    assert result.stages[1].extended.recompute_flops > 0  # the deep stage recomputes to fit
    # the one setting may recompute up to the deepest chunk's layers (Megatron's check), not the shallowest's
    assert not result.uniform.recomputes_layers or result.uniform.num_layers <= 4


def test_a_layout_with_mixed_chunks_and_an_embedding_only_chunk_is_planned_per_stage():
    # 'Et|t|tt|L' under vpp=2: stage 0 holds chunks of 1 and 2 layers, stage 1 one of 1 layer and the loss alone
    job = Job.build(CONFIG.replace(num_layers=4), precision="bf16", pp=2, vpp=2, num_microbatches=4,
                    pipeline_model_parallel_layout="Et|t|tt|L")
    result = plan_job(job, between(job))
    assert [s.chunk_layers for s in result.stages] == [(1, 2), (1, 0)]
    assert result.stages[0].extended.plan.num_layers == 2 and result.stages[1].extended.plan.num_layers == 1
    check_exact(job, result)


def test_a_loss_only_stage_recomputes_nothing_and_the_one_setting_is_its_prediction():
    # 'Ettt|L': stage 0 the embedding and three layers, stage 1 only the loss (a gloo run of an uneven layout against
    # its prediction is tests/parallel/test_uneven_pipeline.py's)
    job = Job.build(CONFIG.replace(num_layers=3), precision="bf16", pp=2, num_microbatches=2,
                    pipeline_model_parallel_layout="Ettt|L")
    result = plan_job(job, between(job))
    check_exact(job, result)
    last = result.stages[1]
    assert last.chunk_layers == (0,) and last.layers[1] < last.layers[0] and last.extended.plan is None
    assert str(last.policy) == str(Policy()) and last.extended.to_dict()["plan_json"] is None
    assert result.stages[0].extended.recompute_flops > 0 and result.uniform.granularity != "none"
    uniform = job.replace(policy=result.uniform)
    assert {r.stage: r.peak_bytes for r in result.uniform_ranks} == {r.stage: r.peak_bytes
                                                                     for r in predict_job(uniform).ranks}


def test_each_stage_is_modelled_by_the_kind_of_its_layers():
    # DeepSeek's first dense layers: a stage of them is priced with a dense layer, one mostly of MoE layers with an
    # MoE layer (the kind by global index, Megatron's moe_layer_freq); the dense layer keeps the model's dense FFN
    moe = CONFIG.replace(num_layers=5, num_moe_experts=4, moe_ffn_hidden_size=16, moe_layer_freq=(0, 0, 0, 1, 1))
    job = Job.build(moe, precision="bf16", pp=2, decoder_first_pipeline_num_layers=2, num_microbatches=2)
    assert [stage_is_moe(moe, job, s) for s in (0, 1)] == [False, True]  # layers 0-1 dense; 2 dense, 3-4 MoE
    dense, expert = kind_config(moe, False), kind_config(moe, True)
    assert (dense.num_layers, dense.is_moe, dense.ffn_size) == (1, False, moe.ffn_size)
    assert (expert.num_layers, expert.moe_layer_pattern()) == (1, (True,))
