"""Megatron-core's own MoE layer, measured on CPU: its combine keeps the experts' outputs from the layer's forward
to its backward only under deterministic algorithms, as remat's layer does (NOTE [the combine's saved source] in
remat.models.permute)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from layer_rows import kept_by_layer

from remat.megatron.compat import MegatronUnavailable, require_megatron_core

try:
    require_megatron_core()
except MegatronUnavailable as err:
    pytest.skip(str(err), allow_module_level=True)

from remat.config import ModelConfig  # noqa: E402
from remat.megatron import measure_megatron_core  # noqa: E402
from remat.memory.predict import trace  # noqa: E402

TOKENS, TOPK, HIDDEN = 64, 2, 64  # 2 sequences of 32 tokens, top-2 of 4 experts
OUTPUTS = TOKENS * TOPK * HIDDEN * 4  # the experts' outputs [n, h], fp32


def _megatron(deterministic: bool) -> Counter[int]:
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, use_cpu_initialization=True,
                               add_bias_linear=False, num_moe_experts=4, moe_router_topk=TOPK, moe_layer_freq=[0, 1])
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)  # what --deterministic-mode sets (training/arguments.py)
    try:
        return kept_by_layer(measure_megatron_core(config, seq_length=32, micro_batch_size=2, vocab_size=128)[0])
    finally:
        torch.use_deterministic_algorithms(before)


def test_megatrons_combine_keeps_the_experts_outputs_only_under_deterministic_algorithms():
    plain, deterministic = _megatron(False), _megatron(True)
    # unpermute's index_add_ keeps its source, the [n, h] outputs (scatter_add_ keeps its index alone); the router's
    # index_put_ keeps its int64 [T, 1] row indices (not modelled by remat: 8 bytes a token)
    assert deterministic - plain == Counter({OUTPUTS: 1, TOKENS * 8: 1}) and not plain - deterministic
    remat = ModelConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, seq_length=32, micro_batch_size=2,
                        vocab_size=128, num_moe_experts=4, moe_router_topk=TOPK, moe_layer_freq=(0, 1),
                        moe_token_dispatcher_type="allgather", moe_routing_assumption="balanced")
    ours = kept_by_layer(trace(remat, "none"))
    ours_deterministic = kept_by_layer(trace(remat.replace(deterministic_algorithms=True), "none"))
    assert ours_deterministic - ours == Counter({OUTPUTS: 1}) and not ours - ours_deterministic
