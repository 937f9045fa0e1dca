"""Megatron's fine-grained activation offloading (``,offload:...``; remat.recompute.activation_offload): gradients
equal the plain model's bit for bit with dropout on (alone and beside selective recompute, both engines), measured
and predicted timelines are the same to the byte with the host bytes apart, the minimum-size rule, Megatron's
steady state (the last layer keeps its tensors), and the refusals."""

from __future__ import annotations

import dataclasses
import functools
import math
import shlex

import pytest
import torch
from tiny_models import train_step
from torch import nn

from remat.analysis.explain_text import host_memory_sentence
from remat.analysis.prediction import format_prediction_table, prediction_row
from remat.cli.common import parse_policy_list
from remat.config import ModelConfig
from remat.job import Job, parse_megatron_args
from remat.job_flags import classify_megatron_flag
from remat.memory.measure import measure
from remat.memory.predict import predict_config, trace
from remat.models.gpt import build_model, layer_side_inputs, sample_batch
from remat.plan.fine_offload import (
    format_offload_options,
    megatron_offload_policies,
    offload_options,
    offload_sweep,
    transfer_seconds,
)
from remat.policy import Policy, PolicyError
from remat.recompute.activation_offload import installed_offload, offloading_last_groups
from remat.recompute.apply import apply, remove
from remat.recompute.region import ApplyError

DENSE = ModelConfig(num_layers=3, hidden_size=32, num_attention_heads=4, seq_length=16, micro_batch_size=2,
                    vocab_size=64, hidden_dropout=0.1, attention_dropout=0.1)
# layer 0 dense, layers 1-2 MoE with grouped experts (balanced routing: measure and predict route alike)
MOE = DENSE.replace(num_moe_experts=4, moe_grouped_gemm=True, moe_layer_freq=(0, 1, 1), activation="swiglu",
                    moe_routing_assumption="balanced")
# MLA + grouped MoE + shared expert (qkv_linear spans MLA's down- and up-projections)
MLA = MOE.replace(multi_latent_attention=True, position="rope", normalization="rmsnorm", q_lora_rank=16,
                  kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8,
                  moe_shared_expert_intermediate_size=16, moe_aux_loss_coeff=0.01)
TOKENS = DENSE.micro_batch_size * DENSE.seq_length  # b*s: a [b, s, h] tensor has TOKENS * 32 elements
DENSE_ALL = "attn_norm+qkv_linear+core_attn+attn_proj+mlp_norm"
ALL = DENSE_ALL + "+expert_fc1+moe_act"


@functools.cache
def plain_step(config: ModelConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return train_step(config, "none")


CASES = [(DENSE, f"none,offload:{m},offload_min:0") for m in
         ("attn_norm", "qkv_linear", "core_attn+attn_proj", "mlp_norm", DENSE_ALL)]
CASES += [(DENSE, f"selective/core_attn,offload:{DENSE_ALL},offload_min:0"),
          (DENSE, f"selective/layernorm+mlp,offload:{DENSE_ALL},offload_min:{TOKENS}"),
          (DENSE, f"selective/mlp,offload:{DENSE_ALL},offload_min:0@non-reentrant"),
          (DENSE, f"full/block/1,offload:{DENSE_ALL},offload_min:0"),
          (DENSE, f"full/block/1,offload:{DENSE_ALL},offload_min:0@non-reentrant"),
          (MOE, f"none,offload:{ALL},offload_min:0"),
          (MOE, "selective/moe_act,offload:expert_fc1+moe_act,offload_min:0"),
          (MOE, f"selective/moe+core_attn,offload:{ALL},offload_min:0"),
          (MOE, "selective/moe,offload:mlp_norm+expert_fc1+moe_act,offload_min:0@non-reentrant"),
          (MLA, f"selective/moe_act+shared_experts,offload:{ALL},offload_min:0"),
          (MLA, "selective/mla_up_proj,offload:qkv_linear+attn_norm+moe_act,offload_min:0"),
          # the attention's query/key/value are offloaded and discarded (NOTE [offloading a discarded output])
          (MLA, f"selective/mla_up_proj+moe_act,offload:{ALL},offload_min:0"),
          (MLA, f"selective/mla_up_proj,offload:{ALL},offload_min:0@non-reentrant")]


@pytest.mark.parametrize("config,policy", CASES, ids=[f"{'dense moe mla'.split()[[DENSE, MOE, MLA].index(c)]}-{p}"
                                                      for c, p in CASES])
def test_gradients_are_bit_identical_to_no_offloading(config: ModelConfig, policy: str) -> None:
    plain_loss, plain = plain_step(config)
    loss, grads = train_step(config, policy)
    assert torch.equal(loss, plain_loss)
    assert grads.keys() == plain.keys()
    assert all(grads[n] is not None and torch.equal(grads[n], plain[n]) for n in plain)


def measured(config: ModelConfig, policy: str):
    model = build_model(config, seed=0)
    apply(model, policy)
    torch.manual_seed(1)
    return measure(model, sample_batch(config))


def same_timeline(a, b) -> bool:
    return (a.nbytes, a.alloc_at, a.free_at, a.category, a.phases, a.num_events) == \
        (b.nbytes, b.alloc_at, b.free_at, b.category, b.phases, b.num_events)


@pytest.mark.parametrize("config,policy", [
    (DENSE, f"none,offload:{DENSE_ALL},offload_min:{TOKENS}"),
    (DENSE, f"selective/core_attn,offload:{DENSE_ALL},offload_min:0"),
    (MOE, f"none,offload:{ALL},offload_min:0"),
    (MOE, f"selective/moe_act+core_attn,offload:{ALL},offload_min:{TOKENS}"),
    (MLA, f"selective/moe_act,offload:{ALL},offload_min:0"),
    (MLA, f"selective/mla_up_proj+moe_act,offload:{ALL},offload_min:0"),
])
def test_predicted_equals_measured_with_host_bytes_apart(config: ModelConfig, policy: str) -> None:
    real = measured(config, policy)
    fake = trace(config, policy)
    assert same_timeline(real, fake)  # the device timeline, event for event and byte for byte
    host = real.meta["host_memory"]
    assert host == fake.meta["host_memory"]
    assert host["peak_bytes"] > 0 and host["series"][-1][1] == 0  # everything came back in backward
    assert host["peak_bytes"] <= sum(host["offloaded_bytes"].values())
    # the device peak is lower than the same recompute policy's without offloading
    twin = dataclasses.replace(Policy.parse(policy), offload_modules=(), min_offloaded_tensor_size=1024 * 1024)
    assert real.peak_bytes < measured(config, str(twin)).peak_bytes


def test_offloaded_core_attention_still_refills_its_discarded_inputs() -> None:
    """core_attn offloaded beside mla_up_proj (Megatron's H100 test ..._fine_grained_offloading): the attention's
    query/key/value go to the host with its group, and its backward still re-runs the up-projection first (from the
    hook on its output, as Megatron's CheckpointWithoutOutput does), so the recomputed and the reloaded copies are
    on the device together."""
    both = measured(MLA, "selective/mla_up_proj,offload:core_attn,offload_min:0")
    alone = measured(MLA, "selective/mla_up_proj")
    recomputes = [p.label for p in both.phases if p.kind == "recompute"]
    assert recomputes and recomputes == [p.label for p in alone.phases if p.kind == "recompute"]
    # the group holds what it holds without the discard: the query/key/value (the discarded outputs) included
    offloaded = both.meta["host_memory"]["offloaded_bytes"]
    assert offloaded == measured(MLA, "none,offload:core_attn,offload_min:0").meta["host_memory"]["offloaded_bytes"]
    assert offloaded["core_attn"] > 0
    assert both.peak_bytes < alone.peak_bytes


def test_device_bytes_leave_at_forward_end() -> None:
    """attn_norm's only large saved tensor is the layer input: at the end of forward the device holds exactly the
    offloaded bytes less than without offloading, and they are on the host."""
    plain = measured(DENSE, "none")
    off = measured(DENSE, f"none,offload:attn_norm,offload_min:{TOKENS + 1}")
    offloaded = off.meta["host_memory"]["offloaded_bytes"]
    assert offloaded == {"attn_norm": 2 * TOKENS * 32 * 4}  # layers 0 and 1 (the last layer keeps its input)
    assert plain.live_bytes()[plain.forward_end] - off.live_bytes()[off.forward_end] == offloaded["attn_norm"]
    series = off.meta["host_memory"]["series"]
    host_at_forward_end = max(b for e, b in series if e <= off.forward_end)
    assert host_at_forward_end == offloaded["attn_norm"]


def test_min_size_rule() -> None:
    """Saved tensors under min_offloaded_tensor_size elements stay: LayerNorm's mean and rstd ([b, s, 1]) move
    only with a minimum of at most b*s; parameters never move; above every tensor's size nothing is offloaded."""
    norm_stats = 2 * TOKENS * 4  # mean and rstd, fp32
    big = measured(DENSE, f"none,offload:attn_norm,offload_min:{TOKENS * 32}")
    small = measured(DENSE, f"none,offload:attn_norm,offload_min:{TOKENS + 1}")
    every = measured(DENSE, f"none,offload:attn_norm,offload_min:{TOKENS}")
    assert big.meta["host_memory"]["offloaded_bytes"] == small.meta["host_memory"]["offloaded_bytes"] == {
        "attn_norm": 2 * TOKENS * 32 * 4}
    assert every.meta["host_memory"]["offloaded_bytes"] == {"attn_norm": 2 * (TOKENS * 32 * 4 + norm_stats)}
    nothing = measured(DENSE, f"none,offload:attn_norm,offload_min:{TOKENS * 32 + 1}")  # default 1M is this too
    assert "host_memory" not in nothing.meta and same_timeline(nothing, measured(DENSE, "none"))


def test_last_layer_of_each_module_keeps_its_tensors() -> None:
    """Megatron's steady state: the last group of each name is not offloaded (its backward comes first), except in
    the forwards whose own backward does not run next (offloading_last_groups, as a pipeline schedule asks)."""
    policy = "none,offload:attn_norm+expert_fc1,offload_min:0"
    layers = measured(MOE, policy).meta["host_memory"]["offloaded_bytes_by_layer"]
    assert sorted(layers) == ["0", "1"]  # attn_norm of layers 0-1, expert_fc1 of layer 1 (layer 0 is dense)
    with offloading_last_groups(["attn_norm"]):
        more = measured(MOE, policy).meta["host_memory"]["offloaded_bytes_by_layer"]
    assert sorted(more) == ["0", "1", "2"] and more["0"] == layers["0"] and more["2"] == layers["0"]
    assert more["1"] == layers["1"]  # expert_fc1 of layer 2 stays: only attn_norm's last group goes too


def test_remove_takes_the_hooks_away() -> None:
    model = build_model(DENSE)
    norm = model.layers[0].input_layernorm
    apply(model, f"selective/core_attn,offload:{DENSE_ALL}")
    assert norm._forward_pre_hooks and installed_offload(model) is not None
    apply(model, "selective/core_attn")
    assert not norm._forward_pre_hooks and installed_offload(model) is None
    apply(model, "none,offload:mlp_norm")
    remove(model)
    assert not model.layers[0]._forward_hooks and installed_offload(model) is None


def test_prediction_of_a_config_traces_offloading_in_full() -> None:
    config = DENSE.replace(num_layers=6)
    policy = f"selective/core_attn,offload:attn_norm+core_attn+attn_proj,offload_min:{TOKENS}"
    tl = predict_config(config, policy)
    assert "composed_from" not in tl.meta and tl.meta["host_memory"]["peak_bytes"] > 0
    assert same_timeline(tl, trace(config, policy))
    row = prediction_row(Policy.parse(policy), tl)
    assert row["host_peak_bytes"] == tl.meta["host_memory"]["peak_bytes"]
    table = format_prediction_table([prediction_row(Policy(), predict_config(config, "none")), row])
    assert " host KiB " in table.splitlines()[0]
    sentence = host_memory_sentence(policy, tl)
    assert "host memory" in sentence and "core_attn" in sentence


@pytest.mark.parametrize("config,policy,phrase", [
    (DENSE.replace(num_moe_experts=4, moe_routing_assumption="balanced"), "none,offload:expert_fc1",
     "moe_grouped_gemm=True"),
    (DENSE, "none,offload:moe_act", "no layer of the stack has them"),
])
def test_apply_refusals(config: ModelConfig, policy: str, phrase: str) -> None:
    with pytest.raises(ApplyError, match=phrase):
        apply(build_model(config), policy)


def test_a_model_without_the_module_is_refused_naming_its_submodules() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(2))

    with pytest.raises(ApplyError, match="offload module 'core_attn': layers.0 \\(Sequential\\) has none of "
                                         "self_attention.core_attention.*its submodules are: 0, 1"):
        apply(Net(), "none,offload:core_attn+attn_proj")


def test_megatron_command_line_in_and_out() -> None:
    assert classify_megatron_flag("--offload-modules")[0] == "recompute"
    assert classify_megatron_flag("--fine-grained-activation-offloading")[0] == "recompute"
    base = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --micro-batch-size 2 "
            "--vocab-size 512 ")
    job, _ = parse_megatron_args(base + "--recompute-activations --fine-grained-activation-offloading "
                                        "--offload-modules core_attn attn_proj --min-offloaded-tensor-size 4096")
    assert str(job.policy) == "selective/core_attn,offload:core_attn+attn_proj,offload_min:4096"
    assert parse_megatron_args(job.to_megatron_args())[0] == job
    with pytest.raises(ValueError, match="attn_proj needs core_attn"):
        parse_megatron_args(base + "--fine-grained-activation-offloading --offload-modules attn_proj")
    with pytest.raises(ValueError, match="--cpu-offloading"):
        parse_megatron_args(base + "--fine-grained-activation-offloading --offload-modules core_attn --cpu-offloading")


def test_cli_policy_lists_keep_offload_options() -> None:
    assert parse_policy_list("none, selective/core_attn,offload:core_attn+attn_proj,offload_min:0@non-reentrant, "
                             "full/block/1,distribute,offload: mlp_norm") == [
        "none", "selective/core_attn,offload:core_attn+attn_proj,offload_min:0@non-reentrant",
        "full/block/1,distribute,offload: mlp_norm"]
    with pytest.raises(PolicyError, match="use the reentrant engine"):
        Policy.parse("selective/core_attn,offload:core_attn+attn_proj,offload_min:0@non-reentrant")


def test_megatron_core_front_end_refuses_with_the_alternative() -> None:
    megatron = pytest.importorskip("remat.megatron.compat")
    try:
        megatron.require_megatron_core()
    except megatron.MegatronUnavailable as err:
        pytest.skip(str(err))
    from remat.megatron.args import parse_args
    from remat.megatron.settings import known_failures

    with pytest.raises(megatron.MegatronSettingError, match="remat predict --megatron-args"):
        parse_args("--num-layers 2 --fine-grained-activation-offloading --offload-modules core_attn")
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
                               fine_grained_activation_offloading=True, offload_modules=["core_attn"])
    assert any("cannot be traced on CPU" in p for p in known_failures(config))


# ------------------------------------------------------------------------ the planner's offload variants
def test_transfer_charge_overlaps_one_layer_forward_each_way() -> None:
    host = {"offloaded_bytes_by_layer": {"0": 100_000_000, "1": 10_000_000}}
    # layer 0: 4 ms each way, 1 ms hidden by a layer's forward; layer 1: 0.4 ms, all hidden
    assert transfer_seconds(host, 1e-3, 25e9) == pytest.approx(2 * 3e-3)
    assert transfer_seconds(None, 1e-3, 25e9) == 0.0


def test_megatron_offload_variants() -> None:
    dense = [str(p) for p in megatron_offload_policies(4)]
    assert dense == offload_sweep(4) == [
        "none,offload:core_attn+attn_proj", "none,offload:attn_norm+qkv_linear+core_attn+attn_proj+mlp_norm",
        "selective/core_attn,offload:core_attn+attn_proj",
        "selective/core_attn,offload:attn_norm+qkv_linear+core_attn+attn_proj+mlp_norm"]
    assert len(megatron_offload_policies(4, MOE)) == 8 and megatron_offload_policies(1) == []
    # the non-reentrant checkpoint of core_attn keeps its inputs: those variants are left out
    assert [str(p) for p in megatron_offload_policies(4, engine="non-reentrant")] == [
        f"{p}@non-reentrant" for p in dense[:2]]


class _Cost:
    """The two things offload_options asks of the planner's cost and unit models (one layer's forward time, a
    unit's recompute cost): a 0.1 ms forward, recompute free, time objective."""

    objective, bandwidth, flops_per_second = "time", 1e6, 400e12

    def layer_forward_seconds(self, model: object) -> float:
        return 1e-4

    def cost(self, model: object, unit: object) -> int:
        return 0


def test_offload_options_are_traced_and_priced() -> None:
    options = offload_options(DENSE, _Cost(), None, limit=10**9, min_size=TOKENS + 1)
    assert [o.fits for o in options] == [True] * 4
    by_policy = {str(o.policy): o for o in options}
    full = by_policy[f"none,offload:{DENSE_ALL},offload_min:{TOKENS + 1}"]
    tl = trace(DENSE, full.policy)
    assert (full.peak_bytes, full.host_peak_bytes) == (tl.peak_bytes, tl.meta["host_memory"]["peak_bytes"])
    per_layer = tl.meta["host_memory"]["offloaded_bytes_by_layer"]
    assert set(per_layer) == {"0", "1"} and sum(per_layer.values()) == full.offloaded_bytes
    assert full.transfer_seconds == pytest.approx(sum(2 * (b / 1e6 - 1e-4) for b in per_layer.values()))
    assert full.cost == math.ceil(full.transfer_seconds * 1e9)
    assert [o.cost for o in options] == sorted(o.cost for o in options)  # cheapest first
    lines = format_offload_options([o.to_dict() for o in options])
    assert "fine-grained activation offloading" in lines[0] and len(lines) == 5


def test_plan_command_takes_the_flag() -> None:
    from remat.cli import build_parser
    from remat.cli.plan import plan_options

    args = build_parser().parse_args(["plan", "--budget", "1GiB", "--layers", "4", "--fine-grained-offload",
                                      "--bandwidth", "450"])
    options = plan_options(args)
    assert options.fine_grained_offload and options.bandwidth == 450e9
    assert not plan_options(build_parser().parse_args(["plan", "--budget", "1GiB"])).fine_grained_offload


def test_a_leaf_input_is_offloaded_but_not_released() -> None:
    """A layer input the caller made (a pipeline stage's input, a leaf that gets a .grad) keeps its data: its
    saved copy is offloaded, the tensor itself is the caller's."""
    grads = []
    for policy in ("none", "none,offload:attn_norm,offload_min:0"):
        model = build_model(DENSE, seed=0)
        apply(model, policy)
        tokens, _ = sample_batch(DENSE)
        mask, rotary = layer_side_inputs(DENSE, tokens)
        torch.manual_seed(2)
        x = torch.randn(DENSE.micro_batch_size, DENSE.seq_length, DENSE.hidden_size, requires_grad=True)
        hidden = x
        for layer in model.layers:
            hidden = layer(hidden, mask, rotary)
        hidden.square().sum().backward()
        assert x.shape == x.grad.shape == (DENSE.micro_batch_size, DENSE.seq_length, DENSE.hidden_size)
        grads.append(x.grad)
    assert torch.equal(*grads)


def test_a_megatron_job_offloading_core_attn_beside_mla_up_proj_is_predicted() -> None:
    """The pair Megatron's H100 test ..._no_mtp_no_a2a_ovlp_fine_grained_offloading runs is predicted (no longer
    refused), its core_attn group offloaded in every microbatch of the pipeline."""
    args = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
            "--global-batch-size 8 --padded-vocab-size 128 --position-embedding-type rope --multi-latent-attention "
            "--kv-lora-rank 16 --qk-head-dim 8 --qk-pos-emb-head-dim 8 --v-head-dim 8 --recompute-granularity "
            "selective --recompute-modules mla_up_proj --fine-grained-activation-offloading --offload-modules "
            "core_attn attn_proj --min-offloaded-tensor-size 0 --pipeline-model-parallel-size 2 --world-size 2")
    job = Job.from_megatron_args(shlex.split(args))
    assert job.policy.offload_modules == ("core_attn", "attn_proj") and "mla_up_proj" in job.policy.modules
    from remat.parallel.job_predict import predict_stage
    host = predict_stage(job, 0, kernels="cpu").timeline.meta["host_memory"]
    assert host["offloaded_bytes"]["core_attn"] > 0 and host["series"][-1][1] == 0


class MarkRecorder:
    """An observer of the offload's marks: ('commit' | 'start' | 'reload', module, layer) in order."""

    def __init__(self) -> None:
        self.marks: list[tuple[str, str, int]] = []

    def on_offload_mark(self, kind: str, module: str, layer: int) -> None:
        self.marks.append((kind, module, layer))


def test_groups_come_back_from_the_reload_stack_a_layer_ahead() -> None:
    """NOTE [when offloaded groups come back]: each group's start function's backward brings back the top group of
    its forward's reload stack (commit order: attn_norm commits after core_attn), so with the last layer's groups kept
    the layer below comes back during the last layer's backward, before its own backward reads it; a tensor read
    before its group came back is reloaded alone (tensor_pop: the last layer's, when that forward offloads them)."""
    from remat.recompute.engines import observers

    model = build_model(DENSE, seed=0)
    apply(model, "none,offload:attn_norm+core_attn+mlp_norm,offload_min:0")
    recorder = MarkRecorder()
    observers.append(recorder)
    try:
        model(*sample_batch(DENSE)).backward()
    finally:
        observers.remove(recorder)
        remove(model)
    commits = [(m, g) for k, m, g in recorder.marks if k == "commit"]
    assert commits == [(m, g) for g in (0, 1) for m in ("core_attn", "attn_norm", "mlp_norm")]  # layer 2 is kept
    backward = recorder.marks[recorder.marks.index(("start", "mlp_norm", 2)):]
    # layer 2's start functions bring back layer 1's groups, top of the stack first; nothing of layer 1 before
    popped = {}
    for k, (kind, module, layer) in enumerate(backward):
        if kind == "start" and k + 1 < len(backward) and backward[k + 1][0] == "reload":
            popped[(module, layer)] = backward[k + 1][1:]
    assert [popped.get((m, 2)) for m in ("mlp_norm", "core_attn", "attn_norm")] == [
        ("mlp_norm", 1), ("attn_norm", 1), ("core_attn", 1)]
    reloads = [(m, g) for kind, m, g in backward if kind == "reload"]
    assert set(reloads[:len([r for r in reloads if r[1] == 1])]) == {(m, 1) for m in ("mlp_norm", "attn_norm",
                                                                                       "core_attn")}
    # every offloaded group came back
    assert sorted(set(reloads)) == sorted(commits)
    # a forward that offloads its last layer too: that layer's mlp_norm tensors are read before any start function
    # ran, so they come back one by one on demand, ahead of the stack's pops
    apply(model, "none,offload:attn_norm+core_attn+mlp_norm,offload_min:0")
    recorder = MarkRecorder()
    observers.append(recorder)
    try:
        with offloading_last_groups(("attn_norm", "core_attn", "mlp_norm")):
            model(*sample_batch(DENSE)).backward()
    finally:
        observers.remove(recorder)
        remove(model)
    first_start = next(k for k, mark in enumerate(recorder.marks) if mark[0] == "start")
    first_reload = next(k for k, mark in enumerate(recorder.marks) if mark[0] == "reload")
    assert first_reload < first_start and recorder.marks[first_reload] == ("reload", "mlp_norm", 2)
