"""One pipeline chunk of one tensor-parallel rank: the reference GPT cut by pipeline stage and sharded by Megatron's
tensor (and sequence) parallelism, so that TP and PP combine in one module.

A chunk holds [vocab-parallel embedding] -> its layers -> [final norm, vocab-parallel output layer, loss], built from
the modules of :mod:`remat.models.tensor_parallel`. Under sequence parallelism the hidden states between chunks are
[b*s/tp, h] token shards (Megatron's [s/tp, b, h]: the same bytes), else [b, s, h].
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from remat.config import ModelConfig
from remat.models.gpt import building, multi_token_loss, rotary_tables
from remat.models.tensor_parallel import (
    TensorParallelGroup,
    TPEmbedding,
    TPHead,
    TPMTPLayer,
    TPTransformerLayer,
    check_tensor_parallel,
)


class TPStageModule(nn.Module):
    """A model chunk on one tensor-parallel rank.

    ``spec`` is any object with ``is_first``, ``is_last``, ``num_layers`` (and, for the pipeline recorder,
    ``index``/``layer_offset``), e.g. a :class:`remat.parallel.schedule.ChunkSpec`. ``forward(x, labels=None)``
    takes token ids (first chunk) or hidden states and returns hidden states, or the loss on the last chunk.
    """

    def __init__(self, config: ModelConfig, spec: Any, group: TensorParallelGroup, sp: bool = False,
                 layer_numbers: Sequence[int] | None = None):
        super().__init__()
        check_tensor_parallel(config, group.size, sp)
        self.config, self.spec, self.tp_group, self.sp = config, spec, group, sp
        self.embedding = TPEmbedding(config, group, sp) if spec.is_first else None
        if layer_numbers is None:  # each layer is built as itself (dense or MoE, as moe_layer_freq says)
            offset = getattr(spec, "layer_offset", 0)
            layer_numbers = range(offset, offset + spec.num_layers)
        self.layers = nn.ModuleList(TPTransformerLayer(config, group, sp, i) for i in layer_numbers)
        self.head = TPHead(config, group, sp) if spec.is_last else None
        if config.tie_embeddings and self.embedding is not None and self.head is not None:
            self.head.output_layer.weight = self.embedding.word_embeddings.weight
        mtp = spec.is_last and config.mtp_num_layers > 0  # Megatron: on the last (virtual) stage, no layout
        self.mtp = nn.ModuleList(TPMTPLayer(config, group, sp) for _ in range(config.mtp_num_layers)) if mtp else None
        # the MTP stage builds its own word embedding, tied or not (gpt_model.py:173 'pre_process or mtp_process')
        self.mtp_embedding = TPEmbedding(config, group, sp) if mtp and self.embedding is None else None

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        # under SP a middle chunk's input is [b*s/tp, h]: its shape does not give s
        return chunk_forward(self, x, labels, self.config.seq_length)


def chunk_forward(chunk: nn.Module, x: torch.Tensor, labels: torch.Tensor | None, seq_length: int,
                  error: type[Exception] = ValueError) -> torch.Tensor:
    """The forward of a pipeline chunk, plain (:class:`remat.parallel.stages.StageModule`) or tensor-parallel
    (:class:`TPStageModule`): [``chunk.embedding``] -> ``chunk.layers`` -> [``chunk.head``], the first and last
    None when the chunk has none (``chunk`` also has ``config`` and ``spec``).

    Like :class:`remat.models.gpt.GPT`, the chunk makes its own causal mask and rotary tables for ``seq_length``
    tokens, so a chunk that holds the whole model runs the GPT's operations in the same order. Returns the hidden
    states, or the loss on the last chunk; a last chunk given no ``labels`` raises ``error`` naming the chunk.
    """
    s = seq_length
    causal_mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril_().view(1, 1, s, s)
    rotary = rotary_tables(chunk.config, s, x.device)
    hidden = chunk.embedding(x) if chunk.embedding is not None else x
    for layer in chunk.layers:
        hidden = layer(hidden, causal_mask, rotary)
    if chunk.head is None:
        return hidden
    if labels is None:
        raise error(f"chunk {getattr(chunk.spec, 'index', '?')} computes the loss and needs labels=")
    mtp = getattr(chunk, "mtp", None)
    if mtp is not None:  # NOTE [multi-token prediction] in remat.models.gpt
        embedding = chunk.embedding if chunk.embedding is not None else chunk.mtp_embedding
        return multi_token_loss(chunk.head, mtp, embedding, hidden, labels, causal_mask, rotary)
    return chunk.head(hidden, labels)


def hidden_shape(config: ModelConfig, tp: int = 1, sp: bool = False) -> tuple[int, ...]:
    """The shape of the hidden states a chunk receives and sends: [b*s/tp, h] under SP, else [b, s, h].

    Example:
        >>> hidden_shape(ModelConfig(micro_batch_size=2, seq_length=8, hidden_size=4), tp=2, sp=True)
        (8, 4)
    """
    b, s, h = config.micro_batch_size, config.seq_length, config.hidden_size
    return (b * s // tp, h) if sp else (b, s, h)


def build_tp_stage_module(config: ModelConfig, spec: Any, group: TensorParallelGroup, sp: bool = False,
                          device: torch.device | str = "cpu", seed: int | None = 0,
                          layer_numbers: Sequence[int] | None = None) -> TPStageModule:
    """A chunk of one tensor-parallel rank in ``config.dtype`` on ``device`` (training mode; works under
    ``FakeTensorMode``).

    Args:
        config: the whole model (its ``seq_length`` is what one rank holds: s/cp under context parallelism).
        spec: the chunk (see :class:`TPStageModule`).
        group: the tensor-parallel group (a ``SimulatedGroup`` to predict, a ``DistributedGroup`` to run).
        sp: sequence parallelism.
        device: where the parameters are made.
        seed: seeds torch's generator with ``seed + group.rank`` (None: leave it).
        layer_numbers: the layers' numbers in the whole model (default ``spec.layer_offset`` onwards): MoE or
            dense as ``moe_layer_freq`` says for each.

    Returns:
        The module, in training mode.
    """
    if seed is not None:
        torch.manual_seed(seed + group.rank)
    with building(config, device):
        return TPStageModule(config, spec, group, sp, layer_numbers).train()
