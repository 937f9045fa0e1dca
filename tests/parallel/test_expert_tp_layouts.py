"""MoE jobs whose experts are split another way than the attention (expert tensor parallelism etp != tp) and MoE
jobs under context parallelism: Megatron's expert rank layout, a real gloo run at tp=2 x ep=2 with etp=1 against
its prediction to the byte, and what is priced or refused."""

from __future__ import annotations

import pytest

from remat.config import ModelConfig
from remat.job import Job, JobError
from remat.parallel import megatron_rank
from remat.parallel.job_measure import check_measurable, measure_job, rank_rows
from remat.parallel.job_predict import predict_job, stage_state
from remat.parallel.megatron_rank import Layout, make_groups

MOE = ModelConfig(num_layers=3, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16,
                  micro_batch_size=2, num_moe_experts=4, moe_ffn_hidden_size=16, moe_layer_freq=(0, 1, 1),
                  moe_shared_expert_intermediate_size=8, activation="swiglu", normalization="rmsnorm",
                  position="rope", add_bias_linear=False, attention="sdpa", moe_routing_assumption="balanced")

# megatron-core 0.16.1's expert RankGenerator(tp=etp, ep=ep, dp=tp*dp/(ep*etp), pp=1, cp=1,
# order="tp-cp-ep-dp-pp").get_ranks(...) for each (tp, dp, ep, etp): its "tp" (the experts' tensor-parallel
# groups), "ep", "dp" (expert data-parallel) and "tp-ep" groups, printed from megatron-core itself
MEGATRON_EXPERT_GROUPS = {
    (2, 1, 2, 1): {"tp": [[0], [1]], "ep": [[0, 1]], "dp": [[0], [1]], "tp-ep": [[0, 1]]},
    (2, 2, 2, 1): {"tp": [[0], [1], [2], [3]], "ep": [[0, 1], [2, 3]], "dp": [[0, 2], [1, 3]],
                   "tp-ep": [[0, 1], [2, 3]]},
    (2, 2, 1, 4): {"tp": [[0, 1, 2, 3]], "ep": [[0], [1], [2], [3]], "dp": [[0], [1], [2], [3]],
                   "tp-ep": [[0, 1, 2, 3]]},
    (2, 4, 2, 2): {"tp": [[0, 1], [2, 3], [4, 5], [6, 7]], "ep": [[0, 2], [1, 3], [4, 6], [5, 7]],
                   "dp": [[0, 4], [1, 5], [2, 6], [3, 7]], "tp-ep": [[0, 1, 2, 3], [4, 5, 6, 7]]},
    (4, 1, 2, 2): {"tp": [[0, 1], [2, 3]], "ep": [[0, 2], [1, 3]], "dp": [[0], [1], [2], [3]],
                   "tp-ep": [[0, 1, 2, 3]]},
}


@pytest.mark.parametrize("sizes", list(MEGATRON_EXPERT_GROUPS))
def test_the_real_runs_expert_groups_are_megatrons(sizes, monkeypatch):
    tp, dp, ep, etp = sizes
    expected = MEGATRON_EXPERT_GROUPS[sizes]
    monkeypatch.setattr(megatron_rank.dist, "new_group", lambda ranks: list(ranks))  # a group is its rank list
    for rank in range(tp * dp):
        lay = Layout(tp, dp, 1, rank, ep, etp)
        _, _, _, ep_group, edp_group, counts_group, etp_group = make_groups(lay)

        def mine(kind: str, rank: int = rank) -> list[int]:
            return next(g for g in expected[kind] if rank in g)
        assert (ep_group, edp_group, counts_group) == (mine("ep"), mine("dp"), mine("tp-ep"))
        assert etp_group == (mine("tp") if etp != tp else None)  # etp = tp: the tp group itself
        assert (lay.etp_rank, lay.ep_rank, lay.edp_rank) == (
            mine("tp").index(rank), mine("ep").index(rank), mine("dp").index(rank))


def test_tp2_sp_ep2_etp1_measured_equals_predicted_per_rank():
    # Megatron's --expert-tensor-parallel-size 1 under tp=2: the expert-parallel pair is the tensor-parallel pair,
    # each rank holds two whole experts and all-to-alls its sequence shard's routed copies, no gather over etp
    job = Job.build(MOE, precision="bf16", tp=2, sp=True, ep=2, etp=1)
    measured = measure_job(job, timeout=90)
    rows = rank_rows(job, measured)
    assert [(r["predicted_bytes"], r["predicted_parts"]) for r in rows] == [
        (r["measured_bytes"], r["measured_parts"]) for r in rows]
    assert [(t.meta["job_rank"]["ep_rank"], t.meta["job_rank"]["expert_tp_rank"]) for t in measured] == [
        (0, 0), (1, 0)]
    # balanced: b*s/tp * topk / experts = 8 copies of each expert from each of the 2 ranks, 2 whole experts a rank
    for timeline in measured:
        assert [r["received_per_local_expert"] for r in timeline.meta["moe_routing"]] == [[16, 16]] * 2
    whole = stage_state(job, 0).num_parameters
    split = Job.build(MOE, precision="bf16", tp=2, sp=True, ep=2, etp=2, dp=2)  # etp = tp: each expert halved
    # 2 MoE layers x 2 local experts x half of (gate + up: 32 x 2*16, down: 16 x 32)
    assert whole - stage_state(split, 0).num_parameters == 2 * 2 * (32 * 32 + 16 * 32) // 2


def test_etp_over_one_with_tp1_is_refused_naming_the_flag():
    job = Job.build(MOE, precision="bf16", ep=2, etp=2, dp=4)
    with pytest.raises(JobError, match=r"etp \(--expert-tensor-parallel-size\)=2 with tp=1.*use etp=1"):
        predict_job(job)
    with pytest.raises(JobError, match=r"etp=2 with tp=1"):
        check_measurable(job)


def test_moe_under_cp_is_priced_on_the_ranks_sequence_shard_and_its_real_run_refused():
    # Megatron routes each context-parallel rank's own s/cp tokens: the rank's activations are those of the job
    # at s/cp (the ring exchange apart), its parameters and optimizer shards the same (rope: no position table)
    job = Job.build(MOE, precision="bf16", tp=2, sp=True, ep=2, cp=2, num_microbatches=2)
    rank = predict_job(job).ranks[0]
    half = predict_job(Job.build(MOE.replace(seq_length=8), precision="bf16", tp=2, sp=True, ep=2, dp=2,
                                 num_microbatches=2)).ranks[0]
    assert rank.parts["communication"] > 0 and half.parts["communication"] == 0
    assert {k: v for k, v in rank.parts.items() if k != "communication"} == {
        k: v for k, v in half.parts.items() if k != "communication"}
    assert rank.peak_bytes - rank.parts["communication"] == half.peak_bytes
    with pytest.raises(JobError, match=r"cp=2 \(--context-parallel-size\): the real run has no ring attention.*"
                                       r"MoE.*measure with cp=1"):
        check_measurable(job)


def test_the_etp_flag_sets_the_jobs_expert_tensor_parallel_size(capsys):
    from remat.cli import build_parser, main
    from remat.cli.job_args import job_from_args

    args = build_parser().parse_args(["predict", "--preset", "mixtral-8x7b", "--tp", "2", "--sp", "--ep", "2",
                                      "--etp", "1"])
    job = job_from_args(args, default_microbatches=lambda pp: 1).job
    assert (job.tp, job.ep, job.etp, job.expert_tp) == (2, 2, 1, 1)
    assert "--expert-tensor-parallel-size 1" in " ".join(job.to_megatron_args())
    assert main(["predict", "--preset", "mixtral-8x7b", "--ep", "2", "--etp", "2", "--dp", "4"]) == 2
    assert "etp (--expert-tensor-parallel-size)=2 with tp=1" in capsys.readouterr().err
