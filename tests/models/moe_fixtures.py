"""Shared by the MoE model tests: a small allgather-dispatcher MoE model and a dispatch mode that lists what each
operator allocates."""

from __future__ import annotations

import torch

from remat.config import ModelConfig

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
