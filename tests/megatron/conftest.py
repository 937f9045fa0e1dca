"""Shared set-up of the megatron-core tests (each module skips, with the reason, where megatron-core is missing)."""

from __future__ import annotations

import pytest


@pytest.fixture
def small_config():
    """Build a 4-layer dense GPT config (fp32, no biases) with Megatron's own settings given as keywords."""
    from megatron.core.transformer import TransformerConfig

    def build(**overrides):
        settings = dict(num_layers=4, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
                        add_bias_linear=False)
        settings.update(overrides)
        return TransformerConfig(**settings)
    return build


@pytest.fixture
def step_shape():
    """One microbatch of the small models: 2 sequences of 32 tokens, a 128-token vocabulary."""
    return dict(seq_length=32, micro_batch_size=2, vocab_size=128)
