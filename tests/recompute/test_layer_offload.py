"""TransformerEngine's layer-level CPU offloading (Megatron's ``--cpu-offloading-num-layers N``, ``,cpu_offload:N``;
remat.recompute.layer_offload NOTE [TE's layer offloading]): gradients equal the plain model's bit for bit, measured
and predicted timelines are the same to the byte, TE 2.17.1's schedule (cpu_offload.py:576-653) seen in the device
bytes, its push rules (:454-475, 138-198), and Megatron's refusals."""

from __future__ import annotations

import functools

import pytest
import torch
from tiny_models import train_step
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from remat.config import ModelConfig
from remat.job import Job, JobError, parse_megatron_args
from remat.memory.measure import measure
from remat.memory.predict import trace
from remat.models.gpt import build_model, sample_batch
from remat.parallel.job_predict import predict_job
from remat.policy import Policy, PolicyError
from remat.recompute.apply import apply, remove
from remat.recompute.layer_offload import LayerOffload, LayerState, mark_offload_base
from remat.recompute.region import ApplyError

# [b, s, h] = 2 x 256 x 512 = 256Ki elements: the layers' activations are just large enough for TE to push them
CONFIG = ModelConfig(num_layers=4, hidden_size=512, num_attention_heads=8, seq_length=256, micro_batch_size=2,
                     vocab_size=64, hidden_dropout=0.1, attention_dropout=0.1, ffn_hidden_size=512)


def measured(config: ModelConfig, policy: str):
    model = build_model(config, seed=0)
    apply(model, policy)
    torch.manual_seed(1)
    return measure(model, sample_batch(config))


@functools.cache
def plain_step() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return train_step(CONFIG, "none")


@pytest.mark.parametrize("layers", [1, 2, 3])
def test_gradients_are_bit_identical_to_no_offloading(layers: int) -> None:
    plain_loss, plain = plain_step()
    loss, grads = train_step(CONFIG, f"none,cpu_offload:{layers}")
    assert torch.equal(loss, plain_loss)
    assert all(grads[n] is not None and torch.equal(grads[n], plain[n]) for n in plain)


def test_predicted_equals_measured_with_host_bytes_apart() -> None:
    real, fake = measured(CONFIG, "none,cpu_offload:2"), trace(CONFIG, "none,cpu_offload:2")
    assert (real.nbytes, real.alloc_at, real.free_at, real.category, real.phases, real.num_events) == \
        (fake.nbytes, fake.alloc_at, fake.free_at, fake.category, fake.phases, fake.num_events)
    host = real.meta["host_memory"]
    assert host == fake.meta["host_memory"] and host["series"][-1][1] == 0
    assert real.peak_bytes < measured(CONFIG, "none").peak_bytes


def test_the_schedule_is_tes_default_synchronizer() -> None:
    """L = 4, N = 2 (cpu_offload.py:602-647): layer j's device copies go before layer L-N+j's forward, come back
    when layer L-1-N+j's backward starts, and stay until the next layer's backward starts (the last one until the
    backward ends): the device bytes at each phase's start, against the plain run's, move by one layer's pushed
    bytes X at those points, and no sooner."""
    plain, off = measured(CONFIG, "none"), measured(CONFIG, "none,cpu_offload:2")
    by_layer = off.meta["host_memory"]["offloaded_bytes_by_layer"]
    assert sorted(by_layer) == ["0", "1"] and by_layer["0"] == by_layer["1"]
    x = by_layer["0"]
    live_plain, live_off = plain.live_bytes(), off.live_bytes()
    start, off_start = {p.label: p.start for p in plain.phases}, {p.label: p.start for p in off.phases}

    def diff(label: str) -> int:  # the bytes live just before the phase starts, offloading less plain
        return int(live_off[off_start[label] - 1]) - int(live_plain[start[label] - 1])

    expected = {"forward layer 1": 0, "forward layer 2": 0,  # layer 0 was copied out, still on the device
                "forward layer 3": -x,  # layer 0 let go of before layer 2's forward
                "forward head": -2 * x, "backward layer 3": -2 * x,
                "backward layer 1": -x,  # layer 1 back at layer 2's backward
                "backward layer 0": x,  # layer 0 back at layer 1's backward; layer 1 held until layer 0's starts
                "backward embedding": x}  # layer 0 held until the backward ends
    assert {label: diff(label) for label in expected} == expected
    assert off.live_bytes()[-1] == plain.live_bytes()[-1]


def test_small_tensors_and_parameters_stay() -> None:
    """Under 256Ki elements nothing is pushed (cpu_offload.py:459): a small model's step is the plain one's."""
    small = CONFIG.replace(hidden_size=64, num_attention_heads=4, seq_length=32)
    off, plain = measured(small, "none,cpu_offload:2"), measured(small, "none")
    assert "host_memory" not in off.meta
    assert (off.nbytes, off.alloc_at, off.free_at) == (plain.nbytes, plain.alloc_at, plain.free_at)


def test_push_rules() -> None:
    """A tensor with its own storage goes itself; a view of its base's size, or one the fused attention marked, goes
    as its base (once); an unmarked non-contiguous part of a base stays (TE warns), and so do parameters."""
    model = build_model(CONFIG)
    offload = LayerOffload(2, list(model.layers), [f"layers.{i}" for i in range(4)])
    offload.install()
    try:
        state, big = LayerState(0), torch.zeros(512, 1024)
        params = set()
        assert LayerOffload.push(state, params, big).view is None
        left, right = big[:, :512], big[:, 512:]  # non-contiguous halves
        assert LayerOffload.push(state, params, left) is left  # unmarked: stays
        mark_offload_base(left, right)
        first, second = LayerOffload.push(state, params, left), LayerOffload.push(state, params, right)
        assert first.pushed is second.pushed and first.pushed.device.shape == big.shape  # the base, once
        assert LayerOffload.push(state, params, big.view(1024, 512)).pushed is first.pushed  # same size: the base
        assert len(state.pushed) == 1  # big itself and the views' base: one tensor, pushed once
        weight = nn.Parameter(torch.zeros(512, 512))
        assert LayerOffload.push(state, {StorageWeakRef(weight.untyped_storage())}, weight) is weight
        assert LayerOffload.push(state, params, torch.zeros(256 * 1024 - 1)).__class__ is torch.Tensor
    finally:
        offload.uninstall()
    mark_offload_base(left)  # no offloading installed: TE's start_offload does nothing
    assert not getattr(big[:, :1], "_remat_offload_base", False)


def test_remove_takes_the_hooks_away() -> None:
    model = build_model(CONFIG)
    apply(model, "none,cpu_offload:2")
    remove(model)
    torch.manual_seed(1)
    assert "host_memory" not in measure(model, sample_batch(CONFIG)).meta


def test_policy_and_megatron_flags() -> None:
    policy = Policy.from_megatron_args("--cpu-offloading-num-layers 2")
    assert str(policy) == "none,cpu_offload:2" and Policy.parse(str(policy)) == policy and policy.offloads
    assert policy.to_megatron_args() == ["--cpu-offloading-num-layers", "2"] and not policy.is_none
    for text, phrase in (("selective,cpu_offload:1", "recomputation is enabled"),
                         ("none,offload:core_attn,cpu_offload:1", "cannot be enabled with cpu_offloading"),
                         ("none,cpu_offload:x", "layer count")):
        with pytest.raises(PolicyError, match=phrase):
            Policy.parse(text)
    with pytest.raises(ApplyError, match="1 to num_layers - 1"):
        apply(build_model(CONFIG), "none,cpu_offload:4")


BASE = ("--num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 --max-position-embeddings 1024 "
        "--micro-batch-size 1 --global-batch-size 2 --vocab-size 1024 --bf16 --swiglu --disable-bias-linear "
        "--normalization RMSNorm --position-embedding-type rope --world-size 1")


@pytest.mark.parametrize("extra, phrase", [
    ("--cpu-offloading-num-layers 4", "only for layers less than 4"),
    ("--cpu-offloading-num-layers 2 --pipeline-model-parallel-size 2 --world-size 2", "Pipeline parallelism"),
    ("--cpu-offloading-num-layers 2 --recompute-activations", "recomputation is enabled"),
    ("--cpu-offloading-num-layers 2 --fine-grained-activation-offloading --offload-modules core_attn",
     "cannot be enabled with cpu_offloading"),
])
def test_megatrons_refusals(extra: str, phrase: str) -> None:
    with pytest.raises((JobError, PolicyError), match=phrase):
        parse_megatron_args(f"{BASE.replace(' --world-size 1', '')} {extra}")


def test_a_megatron_job_is_priced_with_tes_offloading() -> None:
    job, ignored = parse_megatron_args(f"{BASE} --cpu-offloading-num-layers 2 "
                                       "--cpu-offloading-retain-pinned-cpu-buffers")
    assert job.policy.cpu_offloading_num_layers == 2 and "--cpu-offloading-retain-pinned-cpu-buffers" in ignored
    assert parse_megatron_args(job.to_megatron_args())[0] == job
    plain = predict_job(Job.from_megatron_args(BASE), device="cuda", kernels="te").worst
    off = predict_job(job, device="cuda", kernels="te").worst
    assert off.parts["activations"] < plain.parts["activations"]
    assert {k: v for k, v in off.parts.items() if k != "activations"} == \
        {k: v for k, v in plain.parts.items() if k != "activations"}


def test_a_real_megatron_rank_measures_what_is_predicted() -> None:
    """Megatron's runtime for real (gloo, remat.parallel.job_measure: two microbatches, pp = 1, each forward followed
    by its backward as forward_backward_no_pipelining runs them) holds what the prediction says, byte for byte."""
    from remat.parallel.job_measure import measure_job, rank_rows

    config = CONFIG.replace(attention="sdpa", hidden_dropout=0.0, attention_dropout=0.0)
    job = Job.build(config, precision="bf16", num_microbatches=2, policy=Policy.parse("none,cpu_offload:2"))
    (row,) = rank_rows(job, measure_job(job, timeout=120))
    assert row["measured_parts"] == row["predicted_parts"] and row["measured_bytes"] == row["predicted_bytes"]
