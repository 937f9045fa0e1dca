"""Shared by the MoE model tests: a small allgather-dispatcher MoE model, a dispatch mode that lists what each
operator allocates, and a layer run on rank 1 of 2 expert-parallel ranks, for real and fake."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from remat.config import ModelConfig
from remat.models.expert_parallel import SimulatedExpertGroup, expert_parallel_group
from remat.models.moe import MoELayer

MOE = ModelConfig(num_layers=2, hidden_size=24, num_attention_heads=2, vocab_size=64, seq_length=16,
                  micro_batch_size=2, num_moe_experts=4, moe_ffn_hidden_size=16, moe_layer_freq=(0, 1),
                  attention="sdpa", moe_routing_assumption="balanced", moe_token_dispatcher_type="allgather")


class Allocations(torch.utils._python_dispatch.TorchDispatchMode):
    """The shapes and dtypes of every tensor an operator returns (what a run allocates, views included)."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[tuple[int, ...], torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t._base is None and func not in (
                    torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default):
                self.made.append((tuple(t.shape), t.dtype))
        return out


def received_real_and_fake(config: ModelConfig) -> tuple[MoELayer, list[int], list[int]]:
    """An MoE layer of ``config`` on rank 1 of 2 expert-parallel ranks, its forward and backward run for real and
    under FakeTensorMode: (the real layer, the copies each local expert received in each run)."""
    with expert_parallel_group(SimulatedExpertGroup(2, 1)):
        layer = MoELayer(config.replace(expert_model_parallel_size=2), 0)
    layer(torch.randn(2, 16, 24)).sum().backward()
    with FakeTensorMode():
        with expert_parallel_group(SimulatedExpertGroup(2, 1)):
            fake = MoELayer(config.replace(expert_model_parallel_size=2), 0)
        fake(torch.randn(2, 16, 24)).sum().backward()
    return layer, layer.last_received, fake.last_received
