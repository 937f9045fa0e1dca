"""The reference decoder remat measures and predicts: a GPT shaped like Megatron-LM's, readable top to bottom,
built by :func:`build_model` with a matching :func:`sample_batch`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from remat.config import ModelConfig
from remat.models.blocks import MLP, CoreAttention, LossAutoScaler, SwiGLU, apply_rotary, norm_layer, rotate
from remat.models.cross_entropy import language_model_loss, token_losses
from remat.models.mla import MLASelfAttention
from remat.models.moe import MoELayer

__all__ = ["GPT", "MLP", "CoreAttention", "Embedding", "LMHead", "MTPLayer", "SelfAttention",
           "SwiGLU", "TransformerLayer", "apply_rotary", "build_model", "building", "empty_batch", "layer_side_inputs",
           "multi_token_loss", "norm_layer", "roll_left", "rotary_tables", "routing_report", "sample_batch"]


class SelfAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int = 0):
        super().__init__()
        self.heads = config.num_attention_heads
        self.groups = config.query_groups
        self.head_dim = config.head_dim
        qkv_size = (self.heads + 2 * self.groups) * self.head_dim
        self.linear_qkv = nn.Linear(config.hidden_size, qkv_size, bias=config.qkv_bias)  # attention.py:1698
        self.add_qk_norms(config)
        self.rope_fused = config.apply_rope_fusion  # NOTE [unfused rope] in remat.models.blocks
        self.core_attention = CoreAttention(config, heads=self.heads, layer=layer)
        self.linear_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=config.add_bias_linear)

    def add_qk_norms(self, config: ModelConfig) -> None:
        """``--qk-layernorm``: a norm over each query and key head's ``head_dim`` values, applied after the split
        and before rotary (megatron/core/transformer/attention.py ``get_query_key_value_tensors``: ``q_layernorm`` /
        ``k_layernorm`` on [s, b, heads, head_dim]; replicated on every tensor-parallel rank)."""
        norms = config.has_qk_norms
        self.q_layernorm = norm_layer(config, config.head_dim) if norms else None
        self.k_layernorm = norm_layer(config, config.head_dim) if norms else None

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor,
                rotary: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        b, s, _ = x.shape
        return self.linear_proj(self.attend(self.linear_qkv(x), b, s, attention_mask, rotary))

    def attend(self, qkv: torch.Tensor, b: int, s: int, attention_mask: torch.Tensor,
               rotary: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """Split ``qkv`` ([b, s, ...]) into this module's heads, attend, and return [b, s, heads * head_dim]."""
        d = self.head_dim
        q, k, v = qkv.split([self.heads * d, self.groups * d, self.groups * d], dim=-1)
        q, k = q.view(b, s, self.heads, d), k.view(b, s, self.groups, d)
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(b, s, self.groups, d).transpose(1, 2)
        if rotary is not None:
            q, k = rotate(q, rotary, self.rope_fused), rotate(k, rotary, self.rope_fused)
        context = self.core_attention(q, k, v, attention_mask)
        return context.transpose(1, 2).reshape(b, s, self.heads * d)


# NOTE [the reference layer]
# embedding -> layers (each: input_layernorm -> self_attention -> dropout + residual -> pre_mlp_layernorm -> mlp ->
# dropout + residual) -> head (final_layernorm -> output_layer -> cross-entropy in fp32).
# As in Megatron, every layer takes the attention mask and the rotary tables as inputs, so a checkpointed group
# keeps more than the hidden states. Submodule names follow Megatron's (self_attention.core_attention,
# mlp.activation ...), which is what selective recompute targets.
class TransformerLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_number: int = 0):
        super().__init__()
        self.input_layernorm = norm_layer(config)
        self.self_attention = (MLASelfAttention(config) if config.multi_latent_attention
                               else SelfAttention(config, layer_number))
        self.pre_mlp_layernorm = norm_layer(config)
        pattern = config.moe_layer_pattern()
        # an MoE layer replaces the dense MLP where moe_layer_freq says so (NOTE [MoE fields] in remat.config)
        self.mlp = MoELayer(config, sum(pattern[:layer_number])) if pattern[layer_number] else MLP(config)
        self.dropout = config.hidden_dropout

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor,
                rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        attn = self.self_attention(self.input_layernorm(hidden), attention_mask, rotary)
        hidden = hidden + F.dropout(attn, p=self.dropout, training=self.training)
        mlp = self.mlp(self.pre_mlp_layernorm(hidden))
        return hidden + F.dropout(mlp, p=self.dropout, training=self.training)


class Embedding(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = (
            nn.Embedding(config.seq_length, config.hidden_size) if config.position == "learned" else None)
        self.dropout = config.hidden_dropout

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(tokens)
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(torch.arange(tokens.shape[1], device=tokens.device))
        return F.dropout(x, p=self.dropout, training=self.training)


class LMHead(nn.Module):
    """Final norm, output layer and the loss (``config.cross_entropy``): what lives outside the layer stack."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.final_layernorm = norm_layer(config)
        self.output_layer = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.cross_entropy = config.cross_entropy

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss(self.final_layernorm(hidden), labels)

    def loss(self, normed: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The mean loss of the final norm's output ``normed``."""
        return language_model_loss(self.logits(normed), labels, self.cross_entropy)

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        return self.output_layer(normed)

    def token_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The per-token loss [b, s] of ``logits`` (an MTP depth's)."""
        return token_losses(logits, labels, self.cross_entropy)


# NOTE [multi-token prediction]
# Megatron's --mtp-num-layers D (megatron/core/transformer/multi_token_prediction.py at d98e8a6, DeepSeek-V3's MTP)
# runs D depths after the decoder's final norm, on the chunk holding the loss (mtp_on_this_rank: the last
# (virtual) pipeline stage without a layout). Depth k (MultiTokenPredictionLayer.forward, :1655): roll the token
# ids left (roll_tensor :213, last position zeroed), embed them with the stage's own word embedding (gpt_model.py
# :173 builds a LanguageModelEmbedding wherever mtp_process, tied or not), enorm(embedding) and hnorm(hidden)
# concatenated [.., 2h] -> eh_proj (a column-parallel linear 2h -> h, no bias, gather_output=False, then
# gather_from_tensor_model_parallel_region and, under SP, scatter_to_sequence_parallel_region: :1331-1359) -> one
# transformer layer built from the spec of the decoder's last layer (gpt_builders.py: decoder_layer_specs[-1],
# so MoE when the last layer is) -> final_layernorm. The block concatenates [main, depth 1, ..., depth D] along
# the sequence (:2139) and process_mtp_loss (:932) chunks it back: each depth's logits come from the shared output
# layer, its labels and loss mask are rolled once more per depth, its per-token loss is masked and scaled by
# mtp_loss_scaling_factor / D / tokens, and MTPLossAutoScaler (:886) hangs it on the main hidden states (saving
# it for backward) before the main logits are computed.
MTP_LOSS_SCALE = 0.1  # Megatron's default --mtp-loss-scaling-factor: a value, not memory


def roll_left(tensor: torch.Tensor) -> torch.Tensor:
    """Megatron's ``roll_tensor(shifts=-1, dims=-1)`` without context parallelism: a new tensor, last position 0."""
    rolled = torch.roll(tensor, shifts=-1, dims=-1)
    rolled.select(-1, -1).fill_(0)
    return rolled


class MTPLayer(nn.Module):
    """One MTP depth (NOTE [multi-token prediction]); its transformer layer is built as the config's last layer."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.enorm, self.hnorm = norm_layer(config), norm_layer(config)
        self.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.mtp_model_layer = TransformerLayer(config, config.num_layers - 1)
        self.final_layernorm = norm_layer(config)

    def forward(self, hidden: torch.Tensor, decoder_input: torch.Tensor, attention_mask: torch.Tensor,
                rotary: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        x = self.eh_proj(torch.cat((self.enorm(decoder_input), self.hnorm(hidden)), -1))
        return self.final_layernorm(self.mtp_model_layer(x, attention_mask, rotary))


def multi_token_loss(head: nn.Module, depths: nn.ModuleList, embedding: nn.Module, hidden: torch.Tensor,
                     labels: torch.Tensor, attention_mask: torch.Tensor,
                     rotary: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """The main loss of the last layer's ``hidden`` with the MTP ``depths`` run after the final norm and their
    losses hung on it (NOTE [multi-token prediction]); ``head`` has ``final_layernorm``, ``loss`` and
    ``token_loss`` (:class:`LMHead` or its tensor-parallel version), ``embedding`` takes token ids."""
    normed = head.final_layernorm(hidden)  # the decoder's final norm (TransformerBlock), before the MTP block
    outputs, h = [normed], normed
    ids = labels.clone()  # roll_tensor(input_ids): token i+1 at position i, which is label i (the last zeroed)
    ids.select(-1, -1).fill_(0)
    for k, layer in enumerate(depths):
        ids = ids if k == 0 else roll_left(ids)
        h = layer(h, embedding(ids), attention_mask, rotary)
        outputs.append(h)
    parts = torch.cat(outputs, 0).chunk(1 + len(depths), 0)
    main, mtp_labels = parts[0], labels.clone()
    loss_mask = torch.ones(labels.shape, device=labels.device)  # the batch's loss mask (fp32)
    for k in range(len(depths)):
        logits = head.logits(parts[k + 1])  # process_mtp_loss's order: logits, then the rolls, then the loss
        mtp_labels, loss_mask = roll_left(mtp_labels), roll_left(loss_mask)
        num_tokens = loss_mask.sum()
        mtp_loss = loss_mask * head.token_loss(logits, mtp_labels)
        del logits
        main = LossAutoScaler.apply(main, MTP_LOSS_SCALE / len(depths) * mtp_loss / num_tokens.clamp(min=1))
    return head.loss(main, labels)


class GPT(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embedding = Embedding(config)
        self.layers = nn.ModuleList(TransformerLayer(config, i) for i in range(config.num_layers))
        self.head = LMHead(config)
        self.mtp = nn.ModuleList(MTPLayer(config) for _ in range(config.mtp_num_layers)) or None
        if config.tie_embeddings:
            self.head.output_layer.weight = self.embedding.word_embeddings.weight

    def rotary_tables(self, seq_length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        return rotary_tables(self.config, seq_length, device)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        causal_mask, rotary = layer_side_inputs(self.config, tokens)
        hidden = self.embedding(tokens)
        for layer in self.layers:
            hidden = layer(hidden, causal_mask, rotary)
        if self.mtp is not None:
            return multi_token_loss(self.head, self.mtp, self.embedding, hidden, labels, causal_mask, rotary)
        return self.head(hidden, labels)

    def routing_report(self) -> dict[str, object] | None:
        """The token counts per expert of the last step's MoE layers and where they came from (None: no MoE)."""
        return routing_report(self.config, self.layers)


def routing_report(config: ModelConfig, layers: nn.ModuleList) -> dict[str, object] | None:
    """``{'assumption', 'experts', 'topk', 'tokens_per_expert': {'<layer>': counts}}`` for the MoE layers in
    ``layers`` after a step; 'assumption' is the routing assumption used, or 'measured' for real routing."""
    reports = {i: layer.mlp.routing_report() for i, layer in enumerate(layers) if isinstance(layer.mlp, MoELayer)}
    if not reports:
        return None
    sources = sorted({r["source"] for r in reports.values()})
    return {"assumption": "+".join(sources), "experts": config.num_moe_experts, "topk": config.moe_router_topk,
            "tokens_per_expert": {str(i): r["tokens_per_expert"] for i, r in reports.items()}}


def layer_side_inputs(config: ModelConfig, tokens: torch.Tensor,
                      ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """What every layer takes besides the hidden states: the causal mask and (with rope) the rotary tables."""
    s, device = tokens.shape[1], tokens.device
    causal_mask = torch.ones(s, s, dtype=torch.bool, device=device).tril_().view(1, 1, s, s)
    return causal_mask, rotary_tables(config, s, device)


def rotary_tables(config: ModelConfig, seq_length: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """cos and sin of the rotary angles, [seq_length, rotary_dim / 2] in the model's dtype (None without rope);
    rotary_dim is the head dimension, or MLA's qk_pos_emb_head_dim. MLA always rotates its decoupled dimensions, with
    learned absolute positions too (megatron/core/transformer/multi_latent_attention.py builds its own
    RotaryEmbedding; GPTModel builds the learned table for position_embedding_type learned_absolute)."""
    if config.position != "rope" and not config.multi_latent_attention:
        return None
    d = config.rotary_dim
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
    angles = torch.outer(torch.arange(seq_length, device=device, dtype=torch.float32), inv_freq)
    return angles.cos().to(config.torch_dtype), angles.sin().to(config.torch_dtype)


def build_model(config: ModelConfig, device: torch.device | str = "cpu", seed: int | None = 0) -> GPT:
    """Build the reference GPT with random weights in ``config.dtype`` on ``device`` (training mode)."""
    if seed is not None:
        torch.manual_seed(seed)
    with building(config, device):
        return GPT(config).train()


@contextlib.contextmanager
def building(config: ModelConfig, device: torch.device | str) -> Iterator[None]:
    """Make new parameters in ``config.dtype`` on ``device`` in place: no ``.to()`` afterwards, which also works
    under FakeTensorMode. Parameters that hold no data (on the meta device, or fake) are not initialised (NOTE
    [no initialisation without data])."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(config.torch_dtype)
    try:
        with torch.device(device), (initialisation_skipped() if holds_no_data(device) else contextlib.nullcontext()):
            yield
    finally:
        torch.set_default_dtype(previous)


# NOTE [no initialisation without data]: a module built on the meta device or under FakeTensorMode has parameters
# without values, yet its constructors still run torch.nn.init on them: each init an operator dispatched through the
# fake mode, normal_ and uniform_ decomposed in Python (torch._refs), about half of a fake chunk's build (a
# DeepSeek-V3 chunk of 3 MoE layers: 21-39 ms with, 10-12 ms without). Nothing they write can be read, and they
# allocate nothing a trace records (the recorder starts after the build), so such builds skip them:
# initialisation_skipped() makes torch.nn.init's functions return their tensor untouched while it lasts (as
# Hugging Face's no_init_weights does). A build with data (a measurement) initialises as before.
_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
                   "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_",
                   "sparse_")


def holds_no_data(device: torch.device | str) -> bool:
    """Whether tensors made now on ``device`` hold no values: the meta device, or a fake tensor mode is active."""
    return torch.device(device).type == "meta" or torch._guards.detect_fake_mode() is not None


@contextlib.contextmanager
def initialisation_skipped() -> Iterator[None]:
    """While it lasts, torch.nn.init's functions leave their tensor as it is (NOTE [no initialisation without
    data])."""
    saved = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS}
    for name in saved:
        setattr(nn.init, name, _left_as_it_is)
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(nn.init, name, function)


def _left_as_it_is(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return tensor


def sample_batch(config: ModelConfig, device: torch.device | str = "cpu",
                 seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (tokens, labels) of shape [micro_batch_size, seq_length]; labels are tokens shifted by one."""
    generator = torch.Generator().manual_seed(seed)
    shape = (config.micro_batch_size, config.seq_length + 1)
    return _shifted(torch.randint(0, config.vocab_size, shape, generator=generator).to(device))


def empty_batch(config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sample_batch`'s tensors uninitialised (the same shapes, dtype and storages): what a fake trace makes
    inside its fake mode. A fake tensor holds no values, so making the batch for real and converting it
    (``FakeTensorMode.from_tensor``) buys nothing, and the conversion imports ``torch._dynamo.source`` (with
    ``torch._dynamo.utils``) in every process that traces: about 0.3 s of a 2-core machine on its own, 0.07 s beyond
    what a fake dispatch imports anyway (sympy, torch.distributed.tensor)."""
    return _shifted(torch.empty((config.micro_batch_size, config.seq_length + 1), dtype=torch.long))


def _shifted(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # with one sequence a microbatch both slices are contiguous: tokens and labels share the ids' storage
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
