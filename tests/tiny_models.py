"""The tiny GPT and Llama that the prediction, composition and command-line tests share (``from tiny_models import
GPT``: pytest puts tests/ on the import path through tests/conftest.py).

Tiny on purpose: every byte of a step is traced or measured, and the size changes no code path.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from remat.config import ModelConfig
from remat.models.gpt import build_model, sample_batch
from remat.recompute.apply import apply

GPT = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16, micro_batch_size=2,
                  vocab_size=64)
# Llama's shape: grouped-query attention, SwiGLU, RMSNorm, rope, SDPA, no dropout and no biases.
LLAMA = GPT.replace(num_query_groups=2, activation="swiglu", normalization="rmsnorm", position="rope",
                    attention="sdpa", hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False)
STYLES = {"gpt": GPT, "llama": LLAMA}
# GPT as the command line's model flags.
GPT_FLAGS = ["--layers", "4", "--hidden", "32", "--heads", "4", "--seq", "16", "--batch", "2", "--vocab", "64"]
ENGINES = ("reentrant", "non-reentrant")


def with_engine(policy: str, engine: str) -> str:
    """``policy`` run by ``engine`` (none has no engine; reentrant is the default, left unwritten)."""
    return policy if engine == "reentrant" or policy == "none" else f"{policy}@{engine}"


def train_step(config: ModelConfig, policy: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One step of the reference model (seed 0) under ``policy`` with the dropout masks of seed 1: the loss and
    every parameter's gradient, for bit-for-bit comparisons against ``none``."""
    model = build_model(config, seed=0)
    apply(model, policy)
    torch.manual_seed(1)  # the dropout masks
    loss = model(*sample_batch(config))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def segmentations(kinds: Sequence, layers: int) -> Iterator[tuple]:
    """Every sequence of plan units from ``kinds`` whose sizes add up to ``layers`` (the brute force the plan
    solver is checked against)."""
    if layers == 0:
        yield ()
        return
    for unit in kinds:
        if unit.size <= layers:
            for rest in segmentations(kinds, layers - unit.size):
                yield (unit, *rest)
