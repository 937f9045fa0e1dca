"""Megatron-LM's Muon optimizer (``--optimizer muon`` / ``dist_muon``): remat.memory.muon, its rank state and the
Job's flags (facts at NVIDIA/Megatron-LM d98e8a6 and emerging_optimizers 0.3.0, cited in remat.memory.muon)."""

from __future__ import annotations

import doctest
import json
from pathlib import Path

import pytest

import remat.job_optimizer
import remat.memory.muon
from remat.config import ModelConfig
from remat.job import Job, JobError, parse_megatron_args
from remat.memory.muon import is_muon_matrix, layer_wise_layout
from remat.memory.rank_state import rank_parameters, rank_state, shard_elements
from remat.parallel.job_predict import RESIDENT_PARTS, parts_at, predict_stage

GOLDEN = Path(__file__).parents[2] / "benchmarks" / "data" / "megatron_golden_h100_dev.json"
# no biases: Megatron's layer-wise optimizer refuses the experts' (Adam-managed) biases under expert parallelism
MOE = ModelConfig(num_layers=2, hidden_size=24, num_attention_heads=2, vocab_size=64, seq_length=16,
                  num_moe_experts=4, moe_ffn_hidden_size=16, moe_layer_freq=(0, 1), add_bias_linear=False)


def test_doctests() -> None:
    for module in (remat.memory.muon, remat.job_optimizer):
        assert doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE).failed == 0


def test_muon_owns_every_matrix_but_the_word_embedding_and_output_layer() -> None:
    # emerging_optimizers.py:140-147: not 2-D or is_embedding_or_output_parameter -> Adam; router and learned
    # position embedding are 2-D, so Muon's; experts: one 2-D weight per expert in Megatron (3-D in remat)
    params = rank_parameters(MOE.replace(expert_model_parallel_size=2), first=True, last=True, num_layers=2)
    muon = {p.name for p in params if is_muon_matrix(p.name, p.shape)}
    assert muon == {"embedding.position_embeddings.weight", "layers.1.mlp.router.weight",
                    *(f"layers.{i}.self_attention.linear_{n}.weight" for i in (0, 1) for n in ("qkv", "proj")),
                    "layers.0.mlp.linear_fc1.weight", "layers.0.mlp.linear_fc2.weight",
                    *(f"layers.1.mlp.experts.local_experts.{i}.linear_fc{n}.weight" for i in (0, 1) for n in (1, 2))}
    grouped = rank_parameters(MOE.replace(expert_model_parallel_size=2, moe_grouped_gemm=True), first=True, last=True,
                              num_layers=2)  # one (experts, in, out) tensor: Megatron's weight{i} per expert
    assert [(p.name, p.shape, is_muon_matrix(p.name, p.shape)) for p in grouped if p.expert][0] == (
        "layers.1.mlp.experts.linear_fc1.weight", (2, 24, 16), True)
    assert {p.name for p in params} - muon == {
        "embedding.word_embeddings.weight", "head.output_layer.weight", "head.final_layernorm.weight",
        "head.final_layernorm.bias",
        *(f"layers.{i}.{n}.{w}" for i in (0, 1) for n in ("input_layernorm", "pre_mlp_layernorm")
          for w in ("weight", "bias"))}


def test_muon_keeps_one_fp32_momentum_per_matrix_element_and_adam_two_moments_on_the_rest() -> None:
    h, v, s, f, fm, e = 24, 64, 16, 4 * 24, 16, 4
    matrices = s * h + 2 * (3 * h * h + h * h) + 2 * h * f + e * h + e * 2 * h * fm  # pos, attention, MLPs, router
    scalars = v * h + 2 * 2 * (2 * h) + 2 * h + h * v  # word embedding, 4 norms, final norm, output layer
    job = Job.build(MOE, precision="bf16", dp=2, optimizer="muon")
    state = rank_state(job, [rank_parameters(job.model, first=True, last=True, num_layers=2)])
    n = matrices + scalars
    assert state.num_parameters == n
    # bf16 params, fp32 main grads, Float16OptimizerWithFloat16Params' unsharded fp32 masters (4 bytes each),
    # Muon's momentum_buffer (zeros_like the fp32 master: 4) and Adam's exp_avg + exp_avg_sq (8)
    assert state.parts() == {"parameters": 2 * n, "gradients": 4 * n, "master_parameters": 4 * n,
                             "optimizer_state": 4 * matrices + 8 * scalars}
    fp32 = rank_state(job.replace(precision="fp32"), [rank_parameters(job.model.replace(dtype="fp32"), first=True,
                                                                      last=True, num_layers=2)])
    assert fp32.master_parameters == 0 and fp32.optimizer_state == 4 * matrices + 8 * scalars  # FP32Optimizer
    assert job.state_bytes_per_param()["optimizer_state"] == 4  # the matrices' (the scalars take Adam's 8)


def test_layer_wise_layout_keeps_each_matrix_whole_in_one_shard() -> None:
    # layer_wise_optimizer.py:196-443: 8 equal matrices over 4 shards pack exactly (no padding)
    buckets, ranges = layer_wise_layout([(4096, 1)] * 8, 4)
    assert buckets == [(0, 4 * 8192)] and sorted(ranges) == [(i * 4096, (i + 1) * 4096) for i in range(8)]
    # mixed sizes: sorted by Newton-Schulz cost, placed on the least-loaded shard under a 1.3 x mean numel cap
    buckets, ranges = layer_wise_layout([(100, 1), (100, 1), (60, 1)], 2)
    assert buckets == [(0, 384)] and ranges == [(0, 60), (64, 164), (192, 292)]
    # a bucket closes once it holds bucket_size elements and the next matrix would grow it
    buckets, _ = layer_wise_layout([(4096, 1)] * 8, 2, bucket_size=8192)
    assert buckets == [(0, 8192), (8192, 16384), (16384, 24576), (24576, 32768)]


def test_dist_muon_shards_whole_matrices_and_the_rest_byte_wise() -> None:
    job = Job.build(MOE, precision="bf16", ep=2, dp=4, optimizer="dist_muon")
    assert (job.optimizer, job.distributed_optimizer) == ("muon", True)
    params = rank_parameters(job.model, first=True, last=True, num_layers=2)
    state = rank_state(job, [params])
    scalar, dense, expert = state.layouts  # the Adam buffer (byte-level), Muon's dense and expert buffers
    assert (scalar.muon_numel, dense.muon_numel, expert.muon_numel) == (0, dense.numel_unpadded, expert.numel_unpadded)
    assert (scalar.expert, dense.expert, expert.expert) == (False, False, True)
    for lay, shards in ((dense, 4), (expert, 2)):  # every matrix whole inside one shard of its bucket
        for start, end in lay.params:
            b_start, b_end = next(b for b in lay.buckets if b[0] <= start < b[1])
            size = (b_end - b_start) // shards
            assert (start - b_start) // size == (end - 1 - b_start) // size
    g, edp = state.dp_rank, state.expert_dp_rank
    muon = shard_elements(dense, 4, g) + shard_elements(expert, 2, edp)
    assert state.shard_elements == shard_elements(scalar, 4, g) + muon
    assert state.master_parameters == 4 * state.shard_elements
    assert state.optimizer_state == 8 * shard_elements(scalar, 4, g) + 4 * muon
    assert state.gradients == 4 * (scalar.numel + dense.numel + expert.numel) and state.param_buffer


def test_muon_flags_round_trip_and_refusals() -> None:
    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
            "--micro-batch-size", "1", "--padded-vocab-size", "128", "--bf16", "--world-size", "2"]
    job, ignored = parse_megatron_args(base + ["--optimizer", "dist_muon", "--muon-scalar-optimizer", "adam",
                                               "--muon-momentum", "0.9"])
    assert (job.optimizer, job.distributed_optimizer) == ("muon", True) and "--muon-scalar-optimizer" in ignored
    assert parse_megatron_args(base + ["--optimizer", "muon", "--use-distributed-optimizer"])[0] == job
    args = job.to_megatron_args()
    assert args[args.index("--optimizer") + 1] == "muon" and "--use-distributed-optimizer" in args
    assert parse_megatron_args(args)[0] == job
    plain = parse_megatron_args(base + ["--optimizer", "muon"])[0]
    assert not plain.distributed_optimizer and parse_megatron_args(plain.to_megatron_args())[0] == plain
    for extra, match in ((["--optimizer", "muon", "--muon-scalar-optimizer", "lion"], "scalar optimizer"),
                         (["--optimizer", "muon", "--no-use-layer-wise-param-layout"], "layer-wise"),
                         (["--optimizer", "adaptive_muon"], "remat models only")):
        with pytest.raises(JobError, match=match):
            parse_megatron_args(base + extra)
    with pytest.raises(JobError, match="fp16"):
        Job.build(MOE, precision="fp16", optimizer="muon")
    with pytest.raises(JobError, match="single instance"):
        Job.build(MOE, precision="bf16", dp=4, optimizer="dist_muon", distributed_optimizer_instances=2)
    with pytest.raises(JobError, match="disable-bias-linear"):
        Job.build(MOE.replace(add_bias_linear=True), precision="bf16", ep=2, dp=2, optimizer="dist_muon")


@pytest.mark.parametrize("name", ["moe/gpt3_moe_mcore_te_ep8_resume_torch_dist_muon",
                                  "moe/gpt3_moe_mcore_te_ep8_resume_torch_dist_dist_muon_param_layout"])
def test_muon_dev_cases_match_megatrons_h100_measurement(name: str) -> None:
    # plain muon: unsharded masters + momentum (resident 1045.9 MiB); muon + --use-distributed-optimizer: the
    # layer-wise optimizer (707.8 MiB); the peak is the forward's logits either way (Newton-Schulz: one 1536x512
    # matrix at a time in step())
    case = {c["case"]: c for c in json.loads(GOLDEN.read_text())["cases"]}[name]
    argv = [t for flag, v in case["model_args"].items() if v is not False
            for t in ([flag] if v is True else [flag, str(v)])] + ["--world-size", str(case["world_size"])]
    with pytest.warns(UserWarning, match="--vocab-size"):
        job = Job.from_megatron_args(argv)
    rank = predict_stage(job, 0, kernels="te", device="cuda", env=case["env"], gpu="h100")
    peak = max(case["golden"]["mem-max-allocated-bytes"].values())
    resident = list(case["golden"]["mem-allocated-bytes"].values())[-1]
    end = parts_at(rank.timeline, rank.timeline.num_events - 1)
    assert -0.02 <= rank.peak_bytes / peak - 1 <= 0.05
    assert abs(sum(end[p] for p in RESIDENT_PARTS) / resident - 1) <= 0.01
