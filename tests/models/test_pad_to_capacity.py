"""``--moe-pad-expert-input-to-capacity`` (remat.models.moe NOTE [padding to capacity]): every expert takes exactly
its capacity ceil(T x topk / E x F) from every rank, whatever the scores (Megatron-LM d98e8a64
moe_utils.py:1050-1076, token_dispatcher.py:517-539, 758-786)."""

from __future__ import annotations

import pytest
import torch
from moe_fixtures import MOE, Allocations

from remat.config import ConfigError
from remat.job import JobError, parse_megatron_args
from remat.models.moe import MoELayer
from remat.parallel.job_predict import predict_stage

PADDED = MOE.replace(moe_token_dispatcher_type="alltoall", add_bias_linear=False, moe_expert_capacity_factor=1.5,
                     moe_pad_expert_input_to_capacity=True, moe_routing_assumption=None)
BASE = ("--num-layers 2 --hidden-size 24 --num-attention-heads 2 --seq-length 16 --micro-batch-size 2 "
        "--padded-vocab-size 64 --bf16 --num-experts 4 --moe-ffn-hidden-size 16 --disable-bias-linear "
        "--moe-token-dispatcher-type alltoall --moe-expert-capacity-factor 1.5")


def _permuted(layer: MoELayer, x: torch.Tensor) -> list[tuple[int, ...]]:
    """The [rows, h] bf16 tensors the layer's forward makes (the permuted tokens among them)."""
    with Allocations() as seen:
        layer(x)
    return [shape for shape, dtype in seen.made if dtype == torch.bfloat16 and len(shape) == 2 and shape[1] == 24]


def test_the_permuted_tokens_are_capacity_times_experts_whatever_the_scores():
    # 16 x 2 = 32 tokens x topk 2 = 64 copies over 4 experts x 1.5: capacity 24, so 96 permuted rows of h = 24
    x = torch.randn(16, 2, 24, dtype=torch.bfloat16, requires_grad=True)
    layer = MoELayer(PADDED, 0).to(torch.bfloat16)
    with torch.no_grad():  # every token scores expert 0 highest: dropless routing would give it all 32
        layer.router.weight.zero_()
        layer.router.weight[0] = 1
    x_skewed = x.abs()
    rows = _permuted(layer, x_skewed)
    capacity, experts, hidden = 24, 4, 24
    assert layer.router.last_counts == [capacity] * experts
    assert (capacity * experts, hidden) in rows
    assert capacity * experts * hidden * 2 == 4608  # the permuted tokens' bytes in bf16
    # without the padding the same capacity factor only drops: expert 0 keeps its 24, the others what chose them
    dropped = MoELayer(PADDED.replace(moe_pad_expert_input_to_capacity=False), 0).to(torch.bfloat16)
    dropped.load_state_dict(layer.state_dict())
    _permuted(dropped, x_skewed)
    assert dropped.router.last_counts[0] == capacity and sum(dropped.router.last_counts) < capacity * experts


def test_an_expert_parallel_rank_receives_capacity_from_every_rank():
    # token_dispatcher.py:526-530: capacity x tp x ep tokens per local expert
    layer = MoELayer(PADDED.replace(expert_model_parallel_size=2), 0).to(torch.bfloat16)
    layer(torch.randn(16, 2, 24, dtype=torch.bfloat16))
    report = layer.routing_report()
    assert report["received_per_local_expert"] == [48, 48] and "padded to capacity 24" in report["source"]


def test_a_padded_job_is_priced_as_every_expert_at_its_capacity():
    padded, ignored = parse_megatron_args(f"{BASE} --moe-pad-expert-input-to-capacity")
    assert padded.model.moe_pad_expert_input_to_capacity and "--moe-pad-expert-input-to-capacity" not in ignored
    assert parse_megatron_args(padded.to_megatron_args())[0] == padded
    plain, _ = parse_megatron_args(BASE)
    at_capacity = plain.replace(model=plain.model.replace(moe_routing_assumption="capacity:1.5"))
    a, b = predict_stage(padded, 0, device="cuda"), predict_stage(at_capacity, 0, device="cuda")
    assert a.peak_bytes == b.peak_bytes and a.parts == b.parts
    assert a.peak_bytes > predict_stage(plain, 0, device="cuda").peak_bytes  # balanced dropless: 16 per expert


def test_padding_refusals_name_the_fix():
    with pytest.raises(JobError, match="add --moe-expert-capacity-factor"):
        parse_megatron_args(BASE.replace(" --moe-expert-capacity-factor 1.5", "") +
                            " --moe-pad-expert-input-to-capacity")
    with pytest.raises(ConfigError, match="needs experts"):
        PADDED.replace(num_moe_experts=None, moe_layer_freq=1, moe_token_dispatcher_type="alltoall",
                       moe_expert_capacity_factor=None, moe_ffn_hidden_size=None)
    # capacity ceil(64 / 4 x 2.5) = 40 > 32 tokens: Megatron's drop-and-pad permute cannot fill it
    too_big = MoELayer(PADDED.replace(moe_expert_capacity_factor=2.5), 0)
    with pytest.raises(ConfigError, match="lower --moe-expert-capacity-factor"):
        too_big(torch.randn(16, 2, 24))
