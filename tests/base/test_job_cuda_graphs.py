"""Megatron's TE CUDA-graph flags read into the Job (remat.job_cuda_graphs), refused by name where not modelled."""

from __future__ import annotations

import pytest

from remat.job import Job, JobError, parse_megatron_args
from remat.job_cuda_graphs import parse_cuda_graph_modules
from remat.job_input import read_megatron_job

BASE = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 "
        "--micro-batch-size 2 --global-batch-size 8 --vocab-size 256 --bf16 --pipeline-model-parallel-size 2 "
        "--world-size 2")
TE = "--cuda-graph-impl transformer_engine --cuda-graph-warmup-steps 0"


def test_scopes_are_read_as_megatron_reads_them_and_round_trip():
    for words, scopes in ((["attn"], ("attn",)), (["[attn", "mlp]"], ("attn", "mlp")), (["attn,mlp"], ("attn", "mlp")),
                          (["full"], ()), ([], ())):
        assert parse_cuda_graph_modules(words) == scopes
    job = Job.from_megatron_args(f"{BASE} {TE} --cuda-graph-modules attn")
    assert job.cuda_graph_modules == ("attn",)
    assert Job.from_megatron_args(job.to_megatron_args()) == job
    whole = Job.from_megatron_args(f"{BASE} {TE}")  # no scope: every layer whole (cuda_graph_config.py:39)
    assert whole.cuda_graph_modules == () and Job.from_megatron_args(whole.to_megatron_args()) == whole
    assert Job.from_megatron_args(BASE).cuda_graph_modules is None


def test_scope_flags_without_an_implementation_are_ignored():
    # Megatron reads the scopes and warm-up steps only with an implementation (--cuda-graph-impl none: no graphs)
    plain = Job.from_megatron_args(BASE)
    for extra in ("--cuda-graph-modules attn", "--cuda-graph-impl none --cuda-graph-warmup-steps 2"):
        job, ignored = parse_megatron_args(f"{BASE} {extra}")
        assert job == plain
        assert {flag for flag in extra.split() if flag.startswith("--cuda-graph-") and flag != "--cuda-graph-impl"} \
            <= set(ignored)


def test_warmup_steps_default_to_megatrons_and_round_trip():
    # transformer_config.py:1066: 3 eager steps before the capture unless the flag says otherwise
    job = Job.from_megatron_args(f"{BASE} --cuda-graph-impl transformer_engine --cuda-graph-modules attn")
    assert job.cuda_graph_warmup_steps == 3
    assert Job.from_megatron_args(job.to_megatron_args()) == job
    moe = (f"{BASE} {TE} --num-experts 4 --moe-router-topk 1 --cuda-graph-modules [attn moe_router moe_preprocess] "
           "--recompute-granularity selective --recompute-modules moe_act")
    job = Job.from_megatron_args(moe)  # moe_act runs in the eager routed experts (transformer_config.py:2858)
    assert job.cuda_graph_modules == ("attn", "moe_router", "moe_preprocess") and job.cuda_graph_warmup_steps == 0
    assert Job.from_megatron_args(job.to_megatron_args()) == job
    with pytest.raises(JobError, match=r"cuda_graph_warmup_steps=-1 \(--cuda-graph-warmup-steps\).*>= 0"):
        job.replace(cuda_graph_warmup_steps=-1)


@pytest.mark.parametrize("extra, fragments", [
    (f"{TE} --cuda-graph-modules attn moe_preprocess --num-experts 4 --moe-router-topk 1", ["moe_preprocess",
                                                                                           "add moe_router"]),
    (f"{TE} --cuda-graph-modules attn moe_router", ["moe_router", "no MoE layer"]),
    (f"{TE} --cuda-graph-modules moe --num-experts 4 --moe-router-topk 1", ["--cuda-graph-modules moe",
                                                                           "drop-padding"]),
    (f"{TE} --cuda-graph-modules attn moe_router --num-experts 4 --moe-router-topk 1 --recompute-granularity "
     "selective --recompute-modules core_attn", ["--recompute", "moe_act", "drop one"]),
    (f"{TE} --cuda-graph-modules attn bogus", ["--cuda-graph-modules bogus", "attn"]),
    (f"{TE} --cuda-graph-modules full attn", ["full", "alone"]),
    ("--cuda-graph-impl local", ["--cuda-graph-impl", "transformer_engine"]),
    (f"{TE} --cuda-graph-modules mlp --num-experts 4 --moe-router-topk 1", ["mlp", "no"]),
    (f"{TE} --num-experts 4 --moe-router-topk 1", ["whole layers", "--cuda-graph-modules attn"]),
    (f"{TE} --cuda-graph-modules attn --recompute-granularity full --recompute-method uniform "
     "--recompute-num-layers 1", ["--recompute", "drop one"]),
])
def test_unmodelled_graphs_are_refused_naming_the_flag_and_the_fix(extra, fragments):
    with pytest.raises(JobError) as err:
        Job.from_megatron_args(f"{BASE} {extra}")
    for fragment in fragments:
        assert fragment in str(err.value)


def test_the_other_cuda_graphs_cannot_be_left_out_as_a_lower_bound():
    # a replay allocates nothing (TE graph.py:866): priced eagerly, the job could hold less than the answer
    with pytest.raises(JobError, match="--enable-cuda-graph runs layers as CUDA graphs.*cannot be left out"):
        read_megatron_job(f"{BASE} --enable-cuda-graph", allow_unmodelled=["--enable-cuda-graph"])
