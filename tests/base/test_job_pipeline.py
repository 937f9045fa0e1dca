"""remat.job_pipeline: Megatron's uneven pipeline splits as Job fields, read from and written back to its flags."""

from __future__ import annotations

import pytest

from remat.config import ModelConfig
from remat.job import Job, JobError, parse_megatron_args
from remat.job_pipeline import chunk_layer_counts, layout_vpp, parse_layout
from remat.policy import Policy

MODEL = ModelConfig(num_layers=7, hidden_size=32, num_attention_heads=4, vocab_size=128, seq_length=16,
                    tie_embeddings=False)
FLAGS = ("--num-layers 7 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 "
         "--padded-vocab-size 128 --untie-embeddings-and-output-weights --global-batch-size 8 ")


@pytest.mark.parametrize("extra, chunks", [
    ("--pipeline-model-parallel-size 3 --decoder-first-pipeline-num-layers 1", (1, 3, 3)),
    ("--pipeline-model-parallel-size 3 --decoder-last-pipeline-num-layers 3", (2, 2, 3)),
    ("--pipeline-model-parallel-size 3 --decoder-first-pipeline-num-layers 2 --decoder-last-pipeline-num-layers 1",
     (2, 4, 1)),
    ("--pipeline-model-parallel-size 4 --account-for-embedding-in-pipeline-split", (1, 2, 2, 2)),
    ("--pipeline-model-parallel-size 3 --account-for-embedding-in-pipeline-split "
     "--account-for-loss-in-pipeline-split", (2, 3, 2)),
    ("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 "
     "--account-for-loss-in-pipeline-split", (1, 1, 1, 1, 1, 1, 1, 0)),
    ("--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout 'E|t*7L'", (0, 7)),
    ("--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout 'Et|(tt|)*2,ttL'", (1, 2, 2, 2)),
])
def test_flags_give_megatrons_chunks_and_round_trip(extra, chunks):
    job, ignored = parse_megatron_args(FLAGS + extra)
    assert job.chunk_layers == chunks and not ignored
    assert job.layers_per_chunk == max(chunks)
    assert parse_megatron_args(job.to_megatron_args())[0] == job  # every field comes back


def test_the_layout_implies_vpp_and_the_interleaved_schedule():
    job = Job.from_megatron_args(FLAGS + "--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout "
                                 "'Et|(tt|)*2,ttL'")
    assert (job.vpp, job.schedule, job.pipeline_model_parallel_layout) == (2, "interleaved", "Et|(tt|)*2,ttL")
    assert "--num-virtual-stages-per-pipeline-rank" in job.to_megatron_args()
    assert layout_vpp("Ett|tL", 2) is None
    # Megatron's own example, without the MTP layer remat does not have: 16 stages x 2 chunks, one chunk empty
    chunks = parse_layout("Et*3|(tt|)*29|L", 16)
    assert [c.items for c in chunks] == ["Ettt"] + ["tt"] * 29 + ["", "L"]
    with pytest.raises(JobError, match="chunk 30 is empty"):  # Megatron passes hidden states through it
        chunk_layer_counts(61, 16, 2, layout="Et*3|(tt|)*29|L")


def test_job_fields_build_the_same_job():
    job = Job.build(MODEL, precision="bf16", pp=3, decoder_first_pipeline_num_layers=1, num_microbatches=3)
    assert job.chunk_layers == (1, 3, 3)
    args = job.to_megatron_args()
    assert args[args.index("--decoder-first-pipeline-num-layers") + 1] == "1"
    assert parse_megatron_args(job.to_megatron_args())[0] == job


@pytest.mark.parametrize("extra, fragments", [
    ("--pipeline-model-parallel-size 3", ["num_layers=7 (--num-layers) is not divisible by pp=3",
                                          "--decoder-first-pipeline-num-layers"]),
    ("--pipeline-model-parallel-size 3 --decoder-first-pipeline-num-layers 2",
     ["leave 5 layers for 2 middle stage(s)", "change the first/last counts"]),
    ("--pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 7",
     ["leave 0 of --num-layers 7 for 1 middle stage(s)"]),
    ("--pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 3 --decoder-last-pipeline-num-layers 3",
     ["leave 1 of --num-layers 7 for 0 middle stage(s)", "middle layers exactly when there are middle stages"]),
    ("--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 "
     "--decoder-first-pipeline-num-layers 3", ["--decoder-first-pipeline-num-layers 3 is not divisible by vpp=2"]),
    ("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 "
     "--decoder-first-pipeline-num-layers 3", ["--num-virtual-stages-per-pipeline-rank with an uneven split"]),
    ("--pipeline-model-parallel-size 3 --decoder-first-pipeline-num-layers 1 "
     "--account-for-loss-in-pipeline-split", ["Megatron refuses them together"]),
    ("--pipeline-model-parallel-size 3 --account-for-loss-in-pipeline-split",
     ["--num-layers 7 + 1 (--account-for-loss-in-pipeline-split) = 8 layers are not divisible by pp = 3"]),
    ("--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout 'Ettt|tttm|L'",
     ["MTP layers (m)", "before the loss (...tmL)", "move the m's there"]),
    ("--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout 'Ett|tx|ttL'", ["unknown character(s) 'x'"]),
    ("--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout 'Ett|ttL|tt'",
     ["has 3 chunks, not a multiple of pp=2"]),
    ("--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout 'tEtt|tttL'",
     ["the embedding E must open the first chunk", "move them there"]),
    ("--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout 'Ettt|ttL'",
     ["places 5 decoder layers (t) but --num-layers is 7"]),
    ("--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout 'Ettt||tttt|L'", ["chunk 1 is empty"]),
    ("--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 3 "
     "--pipeline-model-parallel-layout 'Ettt|ttt|t|L'", ["has 4 chunks = pp 2 x 2", "use vpp=2"]),
    ("--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout 'Ettt|tttL' "
     "--decoder-first-pipeline-num-layers 3", ["--pipeline-model-parallel-layout with "
                                               "--decoder-first-pipeline-num-layers", "keep the layout"]),
    ("--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout 'Ettt|tttL' "
     "--num-layers-per-virtual-pipeline-stage 1", ["drop --num-layers-per-virtual-pipeline-stage"]),
    ("--pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 0", ["needs a positive integer"]),
])
def test_refusals_name_the_flag_and_the_fix(extra, fragments):
    with pytest.raises(JobError) as err:
        parse_megatron_args(FLAGS + extra)
    assert all(f in str(err.value) for f in fragments), str(err.value)


def test_chunk_layer_counts_examples_and_recompute_depth():
    assert chunk_layer_counts(61, 16, first=4, last=1) == (4,) + (4,) * 14 + (1,)
    assert chunk_layer_counts(10, 3, 2, first=2, last=4) == (1, 2, 2, 1, 2, 2)  # F/vpp, middle/vpp, K/vpp per round
    assert chunk_layer_counts(61, 8, 4, layout="Et*2|(tt|)*22t|(tt|)*7L") == (2,) + (2,) * 22 + (1,) + (2,) * 7 + (0,)
    with pytest.raises(JobError, match="--recompute-num-layers 4 exceeds the 3 layers of a model chunk"):
        Job.build(MODEL, pp=3, decoder_first_pipeline_num_layers=1, num_microbatches=3,
                  policy=Policy.parse("full/uniform/4"))
    with pytest.raises(JobError, match=r"decoder_first_pipeline_num_layers \(--decoder-first-pipeline-num-layers\)"):
        Job.build(MODEL, pp=3, decoder_first_pipeline_num_layers=True)
