"""Multi-token prediction (--mtp-num-layers, NOTE [multi-token prediction] in remat.models.gpt): parameters as
Megatron's source builds them, the CPU trace equal to a real step, the flags, and the H100 dev case."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from remat.config import ModelConfig
from remat.job import Job, JobError, parse_megatron_args
from remat.memory.measure import measure
from remat.memory.predict import predict
from remat.memory.rank_state import rank_parameters
from remat.models.gpt import build_model, sample_batch
from remat.parallel.job_predict import predict_stage

GOLDEN = Path(__file__).parents[2] / "benchmarks" / "data" / "megatron_golden_h100_dev.json"
SMALL = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128, seq_length=32,
                    micro_batch_size=2, normalization="rmsnorm", position="rope", add_bias_linear=False,
                    hidden_dropout=0.0, attention_dropout=0.0)


@pytest.mark.parametrize("tp,sp", [(1, False), (2, True)])
def test_an_mtp_depth_holds_megatrons_parameters(tp: int, sp: bool) -> None:
    # multi_token_prediction.py:1164-1252: enorm, hnorm, eh_proj [2h -> h] column-parallel without bias, one
    # transformer layer, final_layernorm; gpt_model.py:173: the last stage's own word embedding (vocab-parallel)
    h, v = SMALL.hidden_size, SMALL.vocab_size

    def count(config: ModelConfig, **kw: bool | int) -> int:
        return sum(p.numel for p in rank_parameters(config, tp=tp, sp=sp, **kw))  # type: ignore[arg-type]

    layer = count(SMALL, first=False, last=False, num_layers=1)
    for depths in (1, 2):
        mtp = SMALL.replace(mtp_num_layers=depths)
        extra = count(mtp, first=False, last=True, num_layers=2, pipelined=True) - count(
            SMALL, first=False, last=True, num_layers=2, pipelined=True)
        assert extra == v * h // tp + depths * (3 * h + 2 * h * h // tp + layer)
        # on a chunk that also embeds, the MTP depths share its embedding
        assert count(mtp, first=True, last=True, num_layers=2) - count(SMALL, first=True, last=True, num_layers=2) \
            == depths * (3 * h + 2 * h * h // tp + layer)
    params = rank_parameters(SMALL.replace(mtp_num_layers=1), first=False, last=True, num_layers=2, pipelined=True)
    assert [p.shared_embedding for p in params if p.name.startswith("mtp_embedding.")] == [True]


def test_an_mtp_layer_is_built_as_the_last_decoder_layer() -> None:
    # gpt_builders.py: transformer_layer_spec_for_mtp = decoder_layer_specs[-1]
    moe = SMALL.replace(num_moe_experts=4, moe_router_topk=2, moe_layer_freq=(1, 0), mtp_num_layers=1)
    assert type(build_model(moe).mtp[0].mtp_model_layer.mlp).__name__ == "MLP"
    last_moe = moe.replace(moe_layer_freq=(0, 1))
    assert type(build_model(last_moe).mtp[0].mtp_model_layer.mlp).__name__ == "MoELayer"


@pytest.mark.parametrize("depths", [1, 2])
def test_cpu_step_with_mtp_is_predicted_to_the_byte(depths: int) -> None:
    config = SMALL.replace(mtp_num_layers=depths)
    model = build_model(config, seed=0)
    torch.manual_seed(0)
    real = measure(model, sample_batch(config))
    fake = predict(config, "none")
    assert fake.peak_bytes == real.peak_bytes
    assert real.peak_bytes > measure(build_model(SMALL, seed=0), sample_batch(SMALL)).peak_bytes


def test_mtp_flags_round_trip_and_refusals() -> None:
    base = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
            "--padded-vocab-size 128 --position-embedding-type rope ")
    job, ignored = parse_megatron_args(base + "--mtp-num-layers 2 --mtp-loss-scaling-factor 0.3")
    assert job.model.mtp_num_layers == 2 and "--mtp-loss-scaling-factor" in ignored
    args = job.to_megatron_args()
    assert args[args.index("--mtp-num-layers") + 1] == "2"
    assert Job.from_megatron_args(args).model == job.model
    for extra, match in (("--mtp-use-repeated-layer", "multi-token-prediction block"),
                         ("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
                          "recompute"),):
        with pytest.raises(JobError, match=match):
            parse_megatron_args(base + "--mtp-num-layers 1 " + extra)
    with pytest.raises(JobError, match="rope"):
        parse_megatron_args(base.replace("rope", "learned_absolute") + "--mtp-num-layers 1")
    # a layout places the MTP depths before the loss (m), as many as --mtp-num-layers
    piped = base.replace("--num-layers 2", "--num-layers 4") + "--pipeline-model-parallel-size 2 "
    job, _ = parse_megatron_args(piped + "--mtp-num-layers 1 --pipeline-model-parallel-layout 'Ett|ttmL'")
    assert job.chunk_layers == (2, 2) and job.model.mtp_num_layers == 1
    for layout, match in (("Ett|ttL", "places no MTP layer"), ("Ett|ttmmL", "places 2 MTP layer"),
                          ("Ettm|ttL", "move the m's there")):
        with pytest.raises(JobError, match=match):
            parse_megatron_args(piped + f"--mtp-num-layers 1 --pipeline-model-parallel-layout '{layout}'")


def test_the_h100_mtp_case_is_predicted_within_5_percent() -> None:
    # Megatron-LM's moe/gpt3_mcore_te_tp2_pp2_ep4_etp1_memory_speed (DGX H100): --mtp-num-layers 1 on the last
    # stage of tp2 pp2 vpp4 ep4; its peak over the 50 iterations
    cases = {c["case"]: c for c in json.loads(GOLDEN.read_text())["cases"]}
    case = cases["moe/gpt3_mcore_te_tp2_pp2_ep4_etp1_memory_speed"]
    argv = [t for flag, v in case["model_args"].items() if v is not False
            for t in ([flag] if v is True else [flag, str(v)])] + ["--world-size", str(case["world_size"])]
    with pytest.warns(UserWarning, match="--vocab-size"):
        job = Job.from_megatron_args(argv)
    assert job.model.mtp_num_layers == 1
    rank = predict_stage(job, job.pp - 1, kernels="te", device="cuda", env=case["env"], gpu="h100")
    measured = max(case["golden"]["mem-max-allocated-bytes"].values())
    assert abs(rank.timeline.peak_bytes - measured) <= 0.05 * measured
