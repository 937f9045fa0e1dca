"""Expert parallelism (remat.models.expert_parallel): Megatron's all-to-all dispatcher over ep ranks, its values
against the unsharded MoE layer, the simulated rank's prediction against a real gloo run per rank, and the whole
job path (parameters, expert buffers, refusals, the CLI) for MoE models."""

from __future__ import annotations

import json

import pytest
import torch
from thread_ranks import Mailbox, run_ranks

from remat.cli import main
from remat.config import ConfigError, ModelConfig
from remat.job import Job, JobError, parse_megatron_args
from remat.memory.predict import trace
from remat.models.expert_parallel import (
    ExpertParallelGroup,
    SimulatedExpertGroup,
    expert_parallel_group,
    received_per_rank,
)
from remat.models.gpt import build_model
from remat.models.moe import MoELayer
from remat.parallel.job_measure import format_rows, measure_job, rank_rows
from remat.parallel.job_predict import predict_job, predict_stage

MOE = ModelConfig(num_layers=2, hidden_size=24, num_attention_heads=2, vocab_size=64, seq_length=16,
                  micro_batch_size=2, num_moe_experts=4, moe_ffn_hidden_size=16, moe_layer_freq=(0, 1),
                  attention="sdpa")


# ------------------------------------------------------------------------------------------------ values
class _ThreadGroup(ExpertParallelGroup):
    """ep ranks as threads of this process: a real exchange of values, for checking the dispatcher's arithmetic."""

    def __init__(self, mailbox: Mailbox, rank: int):
        self.mailbox, self.size, self.rank = mailbox, mailbox.size, rank

    def _all_to_all_into(self, out, x, output_splits, input_splits):
        got = self.mailbox.exchange(self.rank, list(x.split(input_splits)))
        assert [g.shape[0] for g in got] == output_splits
        out.copy_(torch.cat(got))

    def _gather_counts(self, gathered, local, counts):
        return self.mailbox.exchange(self.rank, [list(counts)] * self.size)


@pytest.mark.parametrize("grouped", [False, True])
def test_two_ranks_compute_what_the_unsharded_layer_computes(grouped):
    # each thread is an ep rank holding 2 of the 4 experts; every rank routes the same tokens, so each expert gets
    # every copy twice (once per source rank) and its weight gradient is twice the unsharded one
    config = MOE.replace(moe_grouped_gemm=grouped, moe_shared_expert_intermediate_size=8)
    torch.manual_seed(0)
    full = MoELayer(config, 0)
    x = torch.randn(2, 16, 24, requires_grad=True)
    weight = torch.randn(2, 16, 24)
    (full(x) * weight).sum().backward()
    mailbox = Mailbox(2)

    def rank(r):
        with expert_parallel_group(_ThreadGroup(mailbox, r)):
            layer = MoELayer(config.replace(expert_model_parallel_size=2), 0)
        with torch.no_grad():
            for name, p in layer.named_parameters():
                source = dict(full.named_parameters())
                if "local_experts." in name:  # local expert i is expert 2r + i
                    i = int(name.split(".")[2])
                    name = name.replace(f"local_experts.{i}.", f"local_experts.{2 * r + i}.")
                    p.copy_(source[name])
                elif name.startswith("experts."):
                    p.copy_(source[name][2 * r:2 * r + 2])
                else:
                    p.copy_(source[name])
        xr = x.detach().clone().requires_grad_()
        out = layer(xr)
        (out * weight).sum().backward()
        return out.detach(), xr.grad, dict(layer.named_parameters()), layer.last_received

    results = run_ranks(2, [mailbox], rank)
    full_params = dict(full.named_parameters())
    for r, (out, grad, params, received) in enumerate(results):
        assert received == [2 * c for c in full.router.last_counts[2 * r:2 * r + 2]]
        torch.testing.assert_close(out, full(x).detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grad, x.grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(params["router.weight"].grad, full_params["router.weight"].grad)
        for name, p in params.items():
            if name.startswith("experts.") and not grouped:
                i = int(name.split(".")[2])
                source = full_params[name.replace(f"local_experts.{i}.", f"local_experts.{2 * r + i}.")]
                torch.testing.assert_close(p.grad, 2 * source.grad, rtol=1e-5, atol=1e-6)
            elif name.startswith("experts."):
                torch.testing.assert_close(p.grad, 2 * full_params[name].grad[2 * r:2 * r + 2], rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------ simulated rank
@pytest.mark.parametrize("routing, expected", [
    ("balanced", [[32, 32], [32, 32]]),  # tokens x topk = 64 copies per rank in all
    ("capacity:1.5", [[48, 48], [48, 48]]),  # every expert full from both ranks: 4 x 24
    ("counts:20,4,6,2", [[40, 8], [12, 4]]),  # ep x this rank's share of the counts
])
def test_a_simulated_rank_receives_what_every_rank_sending_alike_would_send(routing, expected):
    config = MOE.replace(expert_model_parallel_size=2, moe_routing_assumption=routing)
    for r in range(2):
        with expert_parallel_group(SimulatedExpertGroup(2, r)):
            layer = MoELayer(config, 0)
        layer(torch.randn(2, 16, 24)).sum().backward()
        assert layer.last_received == expected[r]
    assert received_per_rank(config, 32) == [sum(e) for e in expected]


def test_the_fake_trace_of_a_simulated_rank_is_its_real_run():
    config = MOE.replace(expert_model_parallel_size=2, moe_routing_assumption="balanced", moe_grouped_gemm=True)
    from remat.memory.measure import measure
    from remat.models.gpt import sample_batch

    real = measure(build_model(config), sample_batch(config))
    fake = trace(config, "none")
    assert (fake.nbytes, fake.alloc_at, fake.free_at) == (real.nbytes, real.alloc_at, real.free_at)
    assert sum(p.numel() for p in build_model(config).parameters()) < sum(
        p.numel() for p in build_model(config.replace(expert_model_parallel_size=1)).parameters())


@pytest.mark.parametrize("policy", ["selective/moe", "selective/moe_act", "full/uniform/1@non-reentrant"])
def test_recompute_on_a_simulated_rank_is_exact_and_keeps_the_gradients(policy):
    # the all-to-alls run again in the recomputed forward: prediction == run, gradients bit-identical with dropout
    config = MOE.replace(expert_model_parallel_size=2, moe_routing_assumption="balanced", moe_grouped_gemm=True)
    from remat.memory.measure import measure
    from remat.models.gpt import sample_batch
    from remat.recompute.apply import apply

    def run(p):
        model = build_model(config)
        apply(model, p)
        torch.manual_seed(1)
        return model, measure(model, sample_batch(config))

    plain, _ = run("none")
    model, real = run(policy)
    fake = trace(config, policy)
    assert (fake.nbytes, fake.alloc_at, fake.free_at) == (real.nbytes, real.alloc_at, real.free_at)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), model.parameters()))


def test_a_group_of_another_size_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match="expert_model_parallel_size=2.*4 ranks"):
        with expert_parallel_group(SimulatedExpertGroup(4, 0)):
            MoELayer(MOE.replace(expert_model_parallel_size=2), 0)


# ------------------------------------------------------------------------------------------------ gloo
def test_ep2_prediction_equals_the_gloo_measurement_per_rank():
    # balanced routing forced in both; 2 local experts per rank (the received chunks are sorted by expert), the
    # distributed optimizer sharding the dense buffer over dp=2 and the expert buffer over edp=1
    job = Job.build(MOE.replace(moe_routing_assumption="balanced"), precision="bf16", ep=2, dp=2,
                    num_microbatches=2, distributed_optimizer=True)
    measured = measure_job(job, timeout=60)
    rows = rank_rows(job, measured)
    assert [r["dp_rank"] for r in rows] == [0, 1]
    for r, tl in zip(rows, measured):
        assert r["measured_parts"] == r["predicted_parts"], format_rows(rows)
        assert r["measured_bytes"] == r["predicted_bytes"], format_rows(rows)
        assert tl.meta["moe_routing"][0]["received_per_local_expert"] == [32, 32]
    assert rows[0]["measured_parts"]["master_parameters"] != rows[1]["measured_parts"]["master_parameters"]


def test_ep2_real_routing_measured_against_the_prediction_given_its_counts():
    # every rank routes the same tokens with the same router, so the counts one rank reports are every rank's; the
    # two ranks' experts receive different counts and each is predicted from its own trace
    job = Job.build(MOE.replace(moe_grouped_gemm=True), precision="bf16", ep=2, dp=2)
    measured = measure_job(job, timeout=60)
    reports = [tl.meta["moe_routing"][0] for tl in measured]
    assert {r["source"] for r in reports} == {"measured"}
    counts = reports[0]["tokens_per_expert"]
    assert reports[1]["tokens_per_expert"] == counts
    assert [r["received_per_local_expert"] for r in reports] == [[2 * c for c in counts[:2]],
                                                                [2 * c for c in counts[2:]]]
    given = job.replace(model=job.model.replace(moe_routing_assumption="counts:" + ",".join(map(str, counts))))
    rows = rank_rows(given, measured)
    for r in rows:
        assert r["measured_bytes"] == r["predicted_bytes"], format_rows(rows)


# ------------------------------------------------------------------------------------------------ the job path
def test_the_job_prices_the_rank_whose_experts_receive_the_most():
    job = Job.build(MOE.replace(moe_routing_assumption="counts:2,6,20,4"), precision="bf16", ep=2, dp=2)
    worst = predict_job(job).worst
    assert worst.state.ep_rank == 1 and worst.timeline.meta["job"]["ep_rank"] == 1
    assert predict_stage(job, 0, ep_rank=0).peak_bytes < worst.peak_bytes


@pytest.mark.parametrize("fields, words", [
    (dict(ep=3, dp=3), ["ep (--expert-model-parallel-size)=3", "num_moe_experts=4", "use ep from 1, 2, 4"]),
    (dict(ep=2, dp=1), ["ep (--expert-model-parallel-size)=2", "raise dp", "multiple of 2"]),
])
def test_impossible_expert_layouts_are_refused_naming_the_flag(fields, words):
    with pytest.raises(JobError) as info:
        Job.build(MOE, precision="bf16", **fields)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("fields, words", [
    (dict(tp=2), ["tp (--tensor-model-parallel-size)=2", "MoE", "add --sequence-parallel"]),
    (dict(etp=2, dp=2), ["Bias in Moe is only supported when ETP==1", "--disable-bias-linear",
                         "--expert-tensor-parallel-size 1"]),
])
def test_what_megatron_refuses_for_moe_under_tp_is_refused_with_the_fix(fields, words):
    with pytest.raises(JobError) as info:
        predict_job(Job.build(MOE.replace(num_attention_heads=2), precision="bf16", **fields))
    for word in words:
        assert word in str(info.value)


def test_megatron_flags_of_a_moe_job_round_trip_with_either_dispatcher():
    base = ("--num-layers 2 --hidden-size 24 --num-attention-heads 2 --seq-length 16 --micro-batch-size 2 "
            "--padded-vocab-size 64 --bf16 --num-experts 4 --moe-ffn-hidden-size 16 --moe-layer-freq ([0]*1+[1]*1) "
            "--world-size 2 --expert-model-parallel-size 2")
    default = parse_megatron_args(base)[0]  # Megatron's default dispatcher
    assert default.model.moe_token_dispatcher_type == "allgather"
    assert parse_megatron_args(default.to_megatron_args())[0] == default
    job, ignored = parse_megatron_args(base + " --moe-token-dispatcher-type alltoall --moe-router-force-load-balancing")
    assert job.model.moe_token_dispatcher_type == "alltoall"
    assert (job.ep, job.model.expert_model_parallel_size, job.model.moe_layer_freq) == (2, 2, (0, 1))
    assert ignored == ["--moe-router-force-load-balancing"]
    assert parse_megatron_args(job.to_megatron_args())[0] == job


def test_predict_mixtral_with_ep_on_the_command_line(capsys):
    argv = ["predict", "--preset", "mixtral-8x7b", "--layers", "2", "--seq", "32", "--ep", "4", "--dp", "4",
            "--distributed-optimizer", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["job"]["ep"] == 4 and report["job"]["model"]["expert_model_parallel_size"] == 4
    assert "--expert-model-parallel-size" in report["job"]["megatron_args"]
    job = Job.build(ModelConfig.from_dict(report["job"]["model"]), precision="bf16", ep=4, dp=4,
                    distributed_optimizer=True)
    assert report["rows"][0]["peak_bytes"] == predict_job(job).worst.peak_bytes
    assert main(argv[:-1]) == 0
    assert "ep=4" in capsys.readouterr().out


def _split_and_cat(x, sizes, order):  # Megatron's sort_chunks_by_idxs as written, autograd's own backward
    chunks = x.split(list(sizes))
    return torch.cat([chunks[i] for i in order])


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("policy", ["none", "selective/moe", "selective/non_matmul", "full/uniform/1"])
def test_sorting_chunks_makes_the_events_of_split_and_cat(monkeypatch, tp, policy):
    # NOTE [sorting chunks]: one gradient tensor made directly, the same allocations and frees as autograd's chunk
    # views and cat; 4 local experts of 8 at ep=2 (the received chunks sorted by expert and back), one tp rank of 2
    import remat.models.expert_parallel as ep_module
    from remat.memory.predict import rank_model_factory
    from remat.models.gpt import sample_batch

    config = MOE.replace(num_moe_experts=8, moe_routing_assumption="balanced", moe_grouped_gemm=True,
                         expert_model_parallel_size=2, add_bias_linear=False)

    def fake():
        return trace(rank_model_factory(config, tp, tp > 1), policy, batch=sample_batch(config))
    ours = fake()
    calls = []

    def split_and_cat(x, sizes, order):
        calls.append(len(sizes))
        return _split_and_cat(x, sizes, order)
    # both dispatchers (remat.models.tp_moe's too) sort through expert_parallel.sort_by_chunks
    monkeypatch.setattr(ep_module, "sort_chunks", split_and_cat)
    theirs = fake()
    assert calls  # the twin ran
    assert (ours.nbytes, ours.alloc_at, ours.free_at, ours.module, ours.category) == (
        theirs.nbytes, theirs.alloc_at, theirs.free_at, theirs.module, theirs.category)
    assert [(p.start, p.kind, p.region) for p in ours.phases] == [(p.start, p.kind, p.region) for p in theirs.phases]


def test_sorted_chunks_and_their_gradient_are_split_and_cat_s():
    from remat.models.expert_parallel import sort_chunks

    x = torch.randn(10, 3, requires_grad=True)
    sizes, order = [2, 0, 3, 1, 4], [3, 0, 4, 1, 2]
    y = sort_chunks(x, sizes, order)
    twin = x.detach().clone().requires_grad_()
    expected = _split_and_cat(twin, sizes, order)
    assert torch.equal(y, expected)
    grad = torch.randn_like(y)
    y.backward(grad)
    expected.backward(grad)
    assert torch.equal(x.grad, twin.grad)
