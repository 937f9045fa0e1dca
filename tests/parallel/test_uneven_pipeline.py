"""Megatron's uneven pipeline splits in the whole-job prediction: every stage priced with its own layers (dense or
MoE by their global index), measured on gloo to the byte."""

from __future__ import annotations

from remat.config import ModelConfig
from remat.job import Job
from remat.parallel.job_measure import format_rows, measure_job, rank_rows
from remat.parallel.job_predict import predict_job, predict_stage
from remat.parallel.schedule import partition
from remat.parallel.stages import build_stage_module
from remat.policy import Policy

DENSE = ModelConfig(num_layers=3, hidden_size=24, num_attention_heads=2, vocab_size=64, seq_length=16,
                    micro_batch_size=2, attention="sdpa", tie_embeddings=False)
# layer 0 dense, layers 1-2 MoE (DeepSeek's first-k dense layers)
MOE = DENSE.replace(num_moe_experts=4, moe_ffn_hidden_size=16, moe_layer_freq=(0, 1, 1),
                    moe_routing_assumption="balanced")


def test_an_uneven_layout_measured_equals_predicted_per_stage():
    # --pipeline-model-parallel-layout 'E|tttL': stage 0 builds no decoder layer (Megatron allows it), stage 1 the
    # dense layer 0, the two MoE layers and the loss (the same code path prices --decoder-first/last-... splits)
    job = Job.build(MOE, precision="bf16", pp=2, pipeline_model_parallel_layout="E|tttL", num_microbatches=2)
    assert job.chunk_layers == (0, 3)
    rows = rank_rows(job, measure_job(job, timeout=90))
    assert [r["stage"] for r in rows] == [0, 1]
    for r in rows:
        assert r["measured_parts"] == r["predicted_parts"], format_rows(rows)
        assert r["measured_bytes"] == r["predicted_bytes"], format_rows(rows)


def test_every_stage_holds_its_own_layers_parameters():
    # the rank state counts each chunk's layers by their global index: dense layer 0 on stage 0, MoE after
    job = Job.build(MOE.replace(num_layers=4, moe_layer_freq=(0, 0, 1, 1)), precision="bf16", pp=3,
                    decoder_last_pipeline_num_layers=2, num_microbatches=3)
    assert job.chunk_layers == (1, 1, 2)
    specs = partition(job.model, 3, 1, job.chunk_layers)
    for spec in specs:
        real = sum(p.numel() for p in build_stage_module(job.model, spec).parameters())
        assert predict_stage(job, spec.index, kernels="cpu").state.num_parameters == real
    # the same chunks written as a layout are the same job for the prediction, byte for byte
    same = job.replace(decoder_last_pipeline_num_layers=None, pipeline_model_parallel_layout="Et|t|ttL")
    assert same.chunk_layers == job.chunk_layers
    assert [r.peak_bytes for r in predict_job(same, kernels="cpu").ranks] == \
        [r.peak_bytes for r in predict_job(job, kernels="cpu").ranks]


def test_moe_recompute_modules_act_only_on_the_stages_with_moe_layers():
    # Megatron's --recompute-modules moe applies to MoE layers: a stage of dense layers runs nothing for it
    job = Job.build(MOE, precision="bf16", pp=2, decoder_first_pipeline_num_layers=1, num_microbatches=2)
    plain = {r.stage: r.peak_bytes for r in predict_job(job, kernels="cpu").ranks}
    moe = {r.stage: r.peak_bytes for r in predict_job(job.replace(policy=Policy.parse("selective/moe")),
                                                      kernels="cpu").ranks}
    assert moe[0] == plain[0] and moe[1] < plain[1]


def test_groups_deeper_than_a_short_chunk_recompute_all_its_layers_as_megatron():
    # Megatron's uniform groups end at the chunk's end, block checkpoints min(K, n) layers: on the 1-layer stage
    # full/uniform/2 and full/block/2 are full/uniform/1 and full/block/1
    job = Job.build(DENSE, precision="bf16", pp=2, decoder_first_pipeline_num_layers=1, num_microbatches=2)
    for deep, short in (("full/uniform/2", "full/uniform/1"), ("full/block/2", "full/block/1")):
        got = predict_stage(job.replace(policy=Policy.parse(deep)), 0, kernels="cpu")
        assert got.peak_bytes == predict_stage(job.replace(policy=Policy.parse(short)), 0, kernels="cpu").peak_bytes
        assert got.peak_bytes < predict_stage(job, 0, kernels="cpu").peak_bytes
