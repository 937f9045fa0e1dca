"""Configuration of the reference GPT decoder.

The field names follow Megatron-LM's ``TransformerConfig`` where one exists, so that a Megatron run's settings
can be typed in directly. Every check names the field it refuses and how to fix it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from remat.config_routing import ConfigError, RoutingAssumption, parse_layer_freq
from remat.limits import CEILINGS, ceiling_problem, shorten

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ACTIVATIONS = ("gelu", "swiglu", "quick_geglu")  # quick_geglu: Megatron's --quick-geglu (remat.models.blocks)
SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")  # Megatron's --softmax-type (attention sinks)
NORMALIZATIONS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "rope")
ATTENTIONS = ("math", "sdpa")
ROUTER_SCORES = ("softmax", "sigmoid")
CROSS_ENTROPY = ("torch", "megatron", "megatron_fused", "te")  # remat.models.cross_entropy
FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")  # the --fp8-recipe values remat models (memory.fp8)
TRANSFORMER_IMPLS = ("transformer_engine", "local")  # Megatron's --transformer-impl (remat.memory.local_layers)


@dataclass(frozen=True)
class ModelConfig:
    """A GPT-style decoder: embedding -> ``num_layers`` layers -> final norm -> output layer -> loss.

    ``num_query_groups`` below ``num_attention_heads`` gives grouped-query attention (None: one group per
    head). ``ffn_hidden_size`` None means 4h for gelu and the Llama rounding of 8h/3 (to a multiple of 64) for
    swiglu. ``attention='math'`` materialises the s x s scores (Korthikanti's 5as^2b term); ``'sdpa'`` uses
    ``scaled_dot_product_attention`` (fused kernels keep only softmax statistics). ``kv_channels`` is the head
    dimension when it is not ``hidden_size / num_attention_heads`` (Megatron's name; Qwen3's ``head_dim``).

    Mixture of experts (Megatron's names, NOTE [MoE fields]): ``num_moe_experts`` routed experts (None: a dense
    model) of ``moe_ffn_hidden_size`` each, ``moe_router_topk`` per token, scored by ``moe_router_score_function``;
    ``moe_layer_freq`` 1 = every layer is MoE, N = layers 0, N, 2N..., or one 0/1 per layer (first dense layers:
    ``(0, 0, 0, 1, 1, ...)``); ``moe_shared_expert_intermediate_size`` adds a shared expert MLP;
    ``moe_grouped_gemm`` stores the experts as one batched weight (Megatron's GroupedMLP) instead of separate
    MLPs (SequentialMLP); ``moe_expert_capacity_factor`` drops the tokens beyond each expert's capacity;
    ``moe_aux_loss_coeff`` > 0 adds the load-balancing loss; ``moe_routing_assumption`` is how tokens are routed
    in a prediction (``balanced``, ``capacity:<factor>``, ``counts:<c0>,<c1>,...`` with ``;`` between MoE
    layers): None routes real tensors by their scores and assumes ``balanced`` under fake tensors, a value forces
    it in both (so a measurement can be compared with a prediction to the byte).

    Multi-latent attention (``multi_latent_attention``, DeepSeek's MLA, Megatron's ``MLATransformerConfig``
    names): queries through a ``q_lora_rank`` down-projection (None: one projection), keys and values through a
    ``kv_lora_rank`` one, ``qk_head_dim`` + ``qk_pos_emb_head_dim`` (rotary) per query/key head, ``v_head_dim``
    per value head.

    Every size is at most its ceiling in :data:`remat.limits.CEILINGS` (the largest real jobs plus a margin; a
    larger one is refused before any work), as is ``micro_batch_size x seq_length``.

    ``cross_entropy`` is the loss's implementation (:mod:`remat.models.cross_entropy`): ``torch``'s
    ``F.cross_entropy`` (a tensor-parallel rank, which cannot run it, runs ``megatron``'s), or what Megatron-LM runs:
    ``megatron``, ``megatron_fused`` (``--cross-entropy-loss-fusion``) or ``te`` (TransformerEngine's fused kernel).
    """

    num_layers: int = 8
    hidden_size: int = 256
    num_attention_heads: int = 4
    num_query_groups: int | None = None
    ffn_hidden_size: int | None = None
    vocab_size: int = 512
    seq_length: int = 256
    micro_batch_size: int = 4
    activation: str = "gelu"
    normalization: str = "layernorm"
    position: str = "learned"
    attention: str = "math"
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    dtype: str = "fp32"
    tie_embeddings: bool = False
    add_bias_linear: bool = True
    # Megatron's --add-qkv-bias: a bias on linear_qkv only (attention.py:1698 bias=add_bias_linear or add_qkv_bias;
    # MLA's projections ignore it, multi_latent_attention.py:226, 517-611); see qkv_bias
    add_qkv_bias: bool = False
    kv_channels: int | None = None
    # mixture of experts
    num_moe_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None
    moe_shared_expert_intermediate_size: int | None = None
    moe_grouped_gemm: bool = False
    moe_layer_freq: int | tuple[int, ...] = 1
    moe_router_score_function: str = "softmax"
    moe_expert_capacity_factor: float | None = None
    # Megatron's --moe-pad-expert-input-to-capacity: every expert takes exactly its capacity from every rank, whatever
    # the routing (moe_utils.py:1074-1076 apply_router_token_dropping, token_dispatcher.py:517-539); remat.models.moe
    moe_pad_expert_input_to_capacity: bool = False
    # Megatron's --moe-permute-fusion: the all-to-all dispatcher permutes with TransformerEngine's fused kernels,
    # which keep an int32 [tokens, 2 x experts + 1] map instead of int64 indices (NOTE [the permutation maps])
    moe_permute_fusion: bool = False
    # Megatron's --enable-experimental: with --moe-permute-fusion, the DeepEP dispatcher's fused indices-to-multihot
    # conversion (token_dispatcher.py:1425-1432; remat.models.deepep_dispatch), the only experimental path modelled
    enable_experimental: bool = False
    # Megatron's --deterministic-mode (torch.use_deterministic_algorithms(True)): the MoE combine's unfused unpermute
    # then adds with index_add_, which keeps the experts' outputs for its backward, not scatter_add_ (NOTE [the
    # combine's saved source] in remat.models.permute); the fused one (--moe-permute-fusion) is the same either way
    deterministic_algorithms: bool = False
    moe_aux_loss_coeff: float = 0.0
    moe_routing_assumption: str | None = None
    # Megatron's --moe-token-dispatcher-type (remat.models.allgather_dispatch) and --moe-router-dtype (None: the
    # model's dtype; 'fp32'/'fp64': the router's logits and probabilities in that dtype)
    moe_token_dispatcher_type: str = "alltoall"
    moe_flex_dispatcher_backend: str = "deepep"  # with 'flex' (Megatron's default): remat.models.flex_dispatch
    moe_router_dtype: str | None = None
    # Megatron's --moe-router-pre-softmax (softmax over all experts before the top-k), --moe-router-enable-expert-bias
    # (the fp32 expert_bias and local_tokens_per_expert buffers, bias added to sigmoid scores for the choice) and
    # --moe-z-loss-coeff (the router z-loss): remat.models.moe.Router
    moe_router_pre_softmax: bool = False
    moe_router_enable_expert_bias: bool = False
    moe_z_loss_coeff: float | None = None
    # Megatron's --moe-router-num-groups / --moe-router-group-topk: group-limited routing, the top-k chosen among the
    # experts of the group_topk groups of best scores (moe_utils.py group_limited_topk): a bool [T, E] mask kept by
    # its masked_fill (remat.models.moe.Router.top_k)
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    expert_model_parallel_size: int = 1
    # multi-latent attention
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    # MLA's rotary embedding (Megatron's --rope-type, default yarn for MLA): each MLA layer keeps its own tables
    # (NOTE [MLA's rotary tables] in remat.memory.workspaces)
    mla_rope_type: str = "yarn"
    # the loss
    cross_entropy: str = "torch"
    # multi-token prediction (Megatron's --mtp-num-layers; 0: none): that many MTP depths after the last layer, on
    # the chunk holding the loss (remat.models.gpt.MTPLayer)
    mtp_num_layers: int = 0
    # Megatron's layer implementation (--transformer-impl) and its local attention's softmax flags (remat.memory.
    # local_layers: --no-masked-softmax-fusion, --attention-softmax-in-fp32, --apply-query-key-layer-scaling)
    transformer_impl: str = "transformer_engine"
    masked_softmax_fusion: bool = True
    attention_softmax_in_fp32: bool = False
    apply_query_key_layer_scaling: bool = False
    # q/k normalisation (Megatron's --qk-layernorm); None: the attention's own default (see has_qk_norms)
    qk_layernorm: bool | None = None
    # Megatron's apply_rope_fusion (False: --no-rope-fusion): the unfused rotary embedding makes its cos/sin tables
    # anew at each application and its multiplies keep them (NOTE [unfused rope] in remat.models.blocks)
    apply_rope_fusion: bool = True
    # FP8 GEMMs in the TE linears (Megatron's --fp8-format with --fp8-recipe): None, or one of FP8_RECIPES
    # (remat.memory.fp8 NOTE [FP8 linears on Hopper]); fp8_layers: one 0/1 per layer (0: bf16, --first-last-layers-
    # bf16), None: every layer (the MTP layers always run in FP8)
    fp8_recipe: str | None = None
    fp8_layers: tuple[int, ...] | None = None
    # the compute capability (major) whose FP8 GEMMs TE runs (NOTE [FP8 linears on Blackwell]): 9 Hopper, 10
    # Blackwell (mxfp8 needs it); set from the job's GPU by remat.parallel.job_predict
    fp8_sm: int = 9
    # --tp-comm-overlap's changes in the TE linears (remat.memory.tp_overlap; set from Job.tp_comm_overlap)
    tp_comm_overlap: tuple[str, ...] = ()
    # NOTE [gpt-oss layers] in remat.models.blocks: --quick-geglu's offset, clamp and fused kernel
    # (--no-bias-gelu-fusion turns it off), --softmax-type, --window-size and --window-attn-skip-freq (an int N:
    # every Nth layer is full attention; or one 0/1 per layer, 1 = sliding window)
    glu_linear_offset: float = 0.0
    activation_func_clamp_value: float | None = None
    bias_activation_fusion: bool = False
    softmax_type: str = "vanilla"
    window_size: tuple[int, int] | None = None
    window_attn_skip_freq: int | tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length",
                     "micro_batch_size"):
            _check_positive_int(name, getattr(self, name))
        for name in ("num_query_groups", "ffn_hidden_size", "kv_channels"):
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name))
        check_size_ceilings(self)
        _check_choice("activation", self.activation, ACTIVATIONS)
        _check_choice("normalization", self.normalization, NORMALIZATIONS)
        _check_choice("position", self.position, POSITIONS)
        _check_choice("attention", self.attention, ATTENTIONS)
        _check_choice("dtype", self.dtype, tuple(DTYPES))
        _check_choice("cross_entropy", self.cross_entropy, CROSS_ENTROPY)
        _check_choice("transformer_impl", self.transformer_impl, TRANSFORMER_IMPLS)
        if self.fp8_recipe not in (None, *FP8_RECIPES):
            raise ConfigError(f"fp8_recipe={self.fp8_recipe!r}: must be None (no FP8) or one of "
                              f"{', '.join(FP8_RECIPES)} (the FP8 recipes remat models)")
        if self.fp8_sm not in (9, 10) or (self.fp8_recipe == "mxfp8" and self.fp8_sm != 10):
            raise ConfigError(f"fp8_sm={self.fp8_sm!r}: 9 (Hopper) or 10 (Blackwell); fp8_recipe='mxfp8' needs 10 (TE: "
                              "'Device compute capability 10.0 or higher required for MXFP8 execution')")
        layers = self.fp8_layers
        if layers is not None and (self.fp8_recipe is None or not isinstance(layers, tuple) or len(layers) !=
                                   self.num_layers or any(v not in (0, 1) or isinstance(v, bool) for v in layers)):
            raise ConfigError(f"fp8_layers={self.fp8_layers!r}: one 0 (bf16) or 1 (FP8) per layer ({self.num_layers}), "
                              "with an fp8_recipe; or None (every layer in FP8)")
        if isinstance(self.tp_comm_overlap, list):  # read back from JSON / YAML
            object.__setattr__(self, "tp_comm_overlap", tuple(self.tp_comm_overlap))
        if not isinstance(self.tp_comm_overlap, tuple) or set(self.tp_comm_overlap) - {"ag", "bulk_dgrad",
                                                                                         "bulk_wgrad"}:
            raise ConfigError(f"tp_comm_overlap={self.tp_comm_overlap!r}: a tuple of 'ag', 'bulk_dgrad', 'bulk_wgrad'")
        if self.qk_layernorm not in (None, True, False):
            raise ConfigError(f"qk_layernorm={self.qk_layernorm!r}: must be True, False or None (the attention's "
                              "default: MLA's q/kv norms, none for standard attention)")
        for name in ("hidden_dropout", "attention_dropout"):
            p = getattr(self, name)
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
                raise ConfigError(f"{name}={p!r}: a dropout probability must be a number in [0, 1)")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                f"{self.num_attention_heads}: pick a hidden_size that is a multiple of the head count")
        if self.num_attention_heads % self.query_groups:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} is not divisible by num_query_groups="
                f"{self.num_query_groups}: use a divisor of the head count (or None for one group per head)")
        if not self.apply_rope_fusion and self.position != "rope" and not self.multi_latent_attention:
            raise ConfigError("apply_rope_fusion=False (--no-rope-fusion) changes only the rotary embedding: set "
                              "position='rope' (or multi_latent_attention), or drop it")
        if (self.position == "rope" or self.multi_latent_attention) and self.rotary_dim % 2:
            raise ConfigError(f"position='rope' needs an even rotary dimension, got {self.rotary_dim}: "
                              "change hidden_size or num_attention_heads (qk_pos_emb_head_dim with MLA)")
        if isinstance(self.mtp_num_layers, bool) or not isinstance(self.mtp_num_layers, int) or self.mtp_num_layers < 0:
            raise ConfigError(f"mtp_num_layers={self.mtp_num_layers!r}: must be an integer >= 0 (0: no multi-token "
                              "prediction)")
        check_moe_fields(self)
        check_mla_fields(self)
        check_gpt_oss_fields(self)

    @property
    def has_qk_norms(self) -> bool:
        """Whether attention normalises queries and keys (``qk_layernorm``; None: MLA keeps DeepSeek's q/kv norms,
        the standard attention has none)."""
        return self.multi_latent_attention if self.qk_layernorm is None else self.qk_layernorm

    @property
    def qkv_bias(self) -> bool:
        """Whether the standard attention's ``linear_qkv`` has a bias: Megatron's ``add_bias_linear or add_qkv_bias``
        (megatron/core/transformer/attention.py:1698)."""
        return self.add_bias_linear or self.add_qkv_bias

    @property
    def gated(self) -> bool:
        """Whether the MLPs are gated linear units (fc1 gives 2 x ffn: swiglu, quick_geglu)."""
        return self.activation in ("swiglu", "quick_geglu")

    def window_attention(self, layer: int) -> bool:
        """Whether layer ``layer`` (0-based) attends within ``window_size``: megatron/core/transformer/utils.py:531
        ``is_layer_window_attention`` (1-based ``layer_number % window_attn_skip_freq != 0``, or the list's entry)."""
        if self.window_size is None:
            return False
        freq = self.window_attn_skip_freq
        if freq is None:
            return True
        return (layer + 1) % freq != 0 if isinstance(freq, int) else bool(freq[layer])

    def window_pattern(self) -> tuple[bool, ...]:
        """Whether each layer attends within ``window_size`` (:meth:`window_attention`)."""
        return tuple(self.window_attention(i) for i in range(self.num_layers))

    def fp8_bf16_layer_indices(self) -> tuple[int, ...]:
        """The layers (0-based) that run in bf16 although the model trains in FP8 (``fp8_layers``)."""
        return tuple(i for i, v in enumerate(self.fp8_layers or ()) if not v)

    @property
    def mixed_layers(self) -> bool:
        """Whether the layers are not interchangeable (window and full attention, FP8 and bf16): such a stack is traced
        whole, never composed from a shallow one, and a pipeline chunk keeps its own layers' patterns."""
        return self.mixed_attention or bool(self.fp8_bf16_layer_indices())

    @property
    def mixed_attention(self) -> bool:
        """Whether some layers slide a window and others attend fully: such a stack is traced whole, never composed
        from a shallow one (its layers are not interchangeable), and a pipeline chunk keeps its own layers' pattern
        (remat.parallel.job_predict.chunk_config)."""
        return len(set(self.window_pattern())) > 1

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """The dimensions rotary positions rotate: the head dimension, or MLA's decoupled rope dimensions."""
        return self.qk_pos_emb_head_dim if self.multi_latent_attention else self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_moe_experts is not None

    @property
    def moe_ffn_size(self) -> int:
        """Each routed expert's FFN size (``moe_ffn_hidden_size``, default the dense ``ffn_size``)."""
        return self.moe_ffn_hidden_size or self.ffn_size

    def moe_layer_pattern(self) -> tuple[bool, ...]:
        """Whether each layer is an MoE layer (Megatron's ``moe_layer_freq``: an int N makes layers 0, N, 2N...
        MoE; a tuple gives one 0/1 per layer); all False for a dense model."""
        if not self.is_moe:
            return (False,) * self.num_layers
        if isinstance(self.moe_layer_freq, int):
            return tuple(i % self.moe_layer_freq == 0 for i in range(self.num_layers))
        return tuple(bool(x) for x in self.moe_layer_freq)

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.activation == "swiglu":
            return 64 * ((8 * self.hidden_size // 3 + 63) // 64)
        return 4 * self.hidden_size

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def with_depth(self, num_layers: int, pattern: tuple[bool, ...] | None = None,
                   window: tuple[bool, ...] | None = None, fp8: tuple[int, ...] | None = None) -> ModelConfig:
        """This config with ``num_layers`` layers; an explicit MoE layer list is cut or replaced by ``pattern``
        (one bool per layer), which :meth:`replace` alone would refuse as the wrong length; an explicit list of
        sliding-window layers likewise (``window``: one bool per layer, as :meth:`window_attention` says), and of
        FP8 layers (``fp8``: ``fp8_layers`` of the new layers)."""
        if fp8 is not None or self.fp8_layers is not None:
            fp8 = tuple(fp8 if fp8 is not None else self.fp8_layers[:num_layers])  # type: ignore[index]
            cut = self.replace(fp8_layers=None).with_depth(num_layers, pattern, window)
            return cut.replace(fp8_layers=None if all(fp8[:num_layers]) else fp8[:num_layers])
        if window is not None or isinstance(self.window_attn_skip_freq, tuple):
            window = window if window is not None else self.window_pattern()[:num_layers]
            if len(window) < num_layers:
                raise ConfigError(f"with_depth({num_layers}): the window layer pattern has {len(window)} layers")
            return self.replace(window_attn_skip_freq=None).with_depth(num_layers, pattern).replace(
                window_attn_skip_freq=None if all(window[:num_layers]) else tuple(int(w) for w in window[:num_layers]))
        if pattern is None and isinstance(self.moe_layer_freq, int):
            return self.replace(num_layers=num_layers)
        pattern = pattern if pattern is not None else self.moe_layer_pattern()[:num_layers]
        if len(pattern) < num_layers:
            raise ConfigError(f"with_depth({num_layers}): the MoE layer pattern has {len(pattern)} layers")
        freq: int | tuple[int, ...] = 1 if all(pattern) else tuple(int(p) for p in pattern[:num_layers])
        return self.replace(num_layers=num_layers, moe_layer_freq=freq)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Build from a plain mapping (a parsed YAML/JSON file); unknown keys are refused by name."""
        if not isinstance(data, dict):
            raise ConfigError(f"a model config must be a mapping of field: value, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown config field(s) {unknown}; known fields: {sorted(known)}")
        return cls(**data)


# NOTE [MoE fields]
# The names are Megatron-LM's TransformerConfig fields (--num-experts is num_moe_experts there). An MoE layer
# replaces the dense MLP: router (linear h -> experts, softmax or sigmoid scores, top-k), token dispatch (the
# routed copies of the tokens permuted into expert order, as the all-to-all dispatcher does on one rank),
# experts, combine (weighted and scattered back), plus the shared expert when set. Which layers are MoE follows
# moe_layer_freq exactly as Megatron's get_gpt_decoder_block_spec reads it. expert_model_parallel_size ep > 1
# makes the model one expert-parallel rank: num_moe_experts / ep experts, tokens exchanged all-to-all
# (remat.models.expert_parallel).
def check_moe_fields(config: ModelConfig) -> None:
    """Refuse MoE fields Megatron would refuse, naming the field and the fix."""
    set_ = object.__setattr__
    freq = config.moe_layer_freq
    if isinstance(freq, str):
        freq = parse_layer_freq(freq, config.num_layers)
    if isinstance(freq, list):
        freq = tuple(freq)
    set_(config, "moe_layer_freq", freq)
    if isinstance(freq, tuple):
        if len(freq) != config.num_layers or any(isinstance(x, bool) or x not in (0, 1) for x in freq):
            raise ConfigError(f"moe_layer_freq={shorten(freq)}: a list needs one 0 (dense) or 1 (MoE) per layer, "
                              f"{config.num_layers} in all, e.g. [0]*3+[1]*{max(config.num_layers - 3, 1)}")
    else:
        _check_positive_int("moe_layer_freq", freq)
    _check_choice("moe_router_score_function", config.moe_router_score_function, ROUTER_SCORES)
    for name in ("moe_router_topk", "expert_model_parallel_size"):
        _check_positive_int(name, getattr(config, name))
    for name in ("num_moe_experts", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
        if getattr(config, name) is not None:
            _check_positive_int(name, getattr(config, name))
    for name, positive in (("moe_expert_capacity_factor", True), ("moe_aux_loss_coeff", False),
                           ("moe_z_loss_coeff", False)):
        value = getattr(config, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value < 0 or (positive and value == 0)):
            raise ConfigError(f"{name}={value!r} (Megatron's --{name.replace('_', '-')}): must be a finite number "
                              + ("> 0" if positive else ">= 0"))
    if not config.is_moe:
        for name, default in (("moe_ffn_hidden_size", None), ("moe_shared_expert_intermediate_size", None),
                              ("moe_grouped_gemm", False), ("moe_expert_capacity_factor", None),
                              ("moe_routing_assumption", None), ("expert_model_parallel_size", 1),
                              ("moe_token_dispatcher_type", "alltoall"), ("moe_router_dtype", None),
                              ("moe_router_pre_softmax", False), ("moe_router_enable_expert_bias", False),
                              ("moe_z_loss_coeff", None), ("moe_pad_expert_input_to_capacity", False),
                              ("moe_router_num_groups", None), ("moe_router_group_topk", None),
                              ("moe_permute_fusion", False), ("deterministic_algorithms", False)):
            if getattr(config, name) != default:
                raise ConfigError(f"{name}={getattr(config, name)!r} needs experts: set num_moe_experts, or drop it")
        return
    if config.moe_token_dispatcher_type not in ("alltoall", "allgather", "flex"):
        raise ConfigError(f"moe_token_dispatcher_type={config.moe_token_dispatcher_type!r}: remat models 'alltoall', "
                          "'allgather' and 'flex'")
    if config.moe_flex_dispatcher_backend not in ("deepep", "hybridep"):
        raise ConfigError(f"moe_flex_dispatcher_backend={config.moe_flex_dispatcher_backend!r}: write 'deepep' or "
                          "'hybridep' (--moe-flex-dispatcher-backend)")
    if config.moe_router_dtype not in (None, "fp32", "fp64"):
        raise ConfigError(f"moe_router_dtype={config.moe_router_dtype!r}: write None, 'fp32' or 'fp64'")
    if config.moe_router_enable_expert_bias and config.moe_router_score_function != "sigmoid":
        # transformer_config.py:2617-2625 (Megatron's 'sqrtsoftplus' is not among remat's score functions)
        raise ConfigError("moe_router_enable_expert_bias needs moe_router_score_function='sigmoid' (Megatron raises "
                          "'Expert bias for aux-loss-free routing only supports sigmoid and sqrtsoftplus'): add "
                          "--moe-router-score-function sigmoid")
    if config.moe_pad_expert_input_to_capacity and config.moe_expert_capacity_factor is None:
        # transformer_config.py:1862-1866
        raise ConfigError("moe_pad_expert_input_to_capacity needs moe_expert_capacity_factor (Megatron raises "
                          "'moe_expert_capacity_factor must be set to use moe_pad_expert_input_to_capacity'): add "
                          "--moe-expert-capacity-factor F")
    for name in ("moe_router_num_groups", "moe_router_group_topk"):
        if getattr(config, name) is not None:
            _check_positive_int(name, getattr(config, name))
    if config.moe_router_group_topk is not None:  # transformer_config.py:1454-1472 (11debfa7b4)
        groups, chosen = config.moe_router_num_groups, config.moe_router_group_topk
        if groups is None:
            raise ConfigError("moe_router_group_topk needs moe_router_num_groups (Megatron raises 'When using group "
                              "limited routing, moe_router_num_groups must be specified'): add "
                              "--moe-router-num-groups")
        if config.num_moe_experts % groups or chosen > groups or config.moe_router_topk % chosen:
            raise ConfigError(f"moe_router_num_groups={groups}, moe_router_group_topk={chosen}: the groups must "
                              f"split the {config.num_moe_experts} experts evenly, at most all of them chosen, and "
                              f"moe_router_topk={config.moe_router_topk} a multiple of the groups chosen (Megatron "
                              "asserts the first two; group_limited_topk takes topk // group_topk per group)")
    if config.moe_router_topk > config.num_moe_experts:
        raise ConfigError(f"moe_router_topk={config.moe_router_topk} exceeds num_moe_experts="
                          f"{config.num_moe_experts}: route each token to at most every expert")
    if config.num_moe_experts % config.expert_model_parallel_size:
        raise ConfigError(f"num_moe_experts={config.num_moe_experts} is not divisible by expert_model_parallel_size="
                          f"{config.expert_model_parallel_size}: pick an ep that divides the expert count")
    if config.moe_routing_assumption is not None:
        routing = RoutingAssumption.parse(config.moe_routing_assumption)
        for layer_counts in routing.counts:
            if len(layer_counts) != config.num_moe_experts:
                raise ConfigError(f"moe_routing_assumption={shorten(config.moe_routing_assumption)}: "
                                  f"{len(layer_counts)} counts for {config.num_moe_experts} experts: give one count "
                                  "per expert")
        object.__setattr__(config, "moe_routing_assumption", str(routing))


def check_size_ceilings(config: ModelConfig) -> None:
    """Refuse a size above remat's ceiling (:data:`remat.limits.CEILINGS`: the largest real jobs plus a margin), and
    more tokens per micro-batch than its ceiling, before any work sized by them."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        problem = ceiling_problem(f.name, value) if f.name in CEILINGS else None
        if problem:
            raise ConfigError(f"{f.name}={shorten(value)} {problem}")
    b, s = config.micro_batch_size, config.seq_length
    problem = ceiling_problem("tokens_per_microbatch", b * s)
    if problem:
        raise ConfigError(f"micro_batch_size x seq_length = {b:,} x {s:,} = {b * s:,} tokens per micro-batch "
                          f"{problem} tokens (a smaller micro_batch_size or seq_length)")


def check_mla_fields(config: ModelConfig) -> None:
    """Refuse MLA fields that cannot be built, naming the field and the fix."""
    for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
        _check_positive_int(name, getattr(config, name))
    if config.q_lora_rank is not None:
        _check_positive_int("q_lora_rank", config.q_lora_rank)
    if config.mla_rope_type not in ("yarn", "rope"):
        raise ConfigError(f"mla_rope_type={config.mla_rope_type!r}: MLA's rotary embedding is 'yarn' (Megatron's "
                          "default) or 'rope' (--rope-type)")
    if config.multi_latent_attention and config.apply_rope_fusion and config.mla_rope_type != "yarn":
        raise ConfigError("mla_rope_type='rope' with apply_rope_fusion: Megatron fuses MLA's rotary embedding only for "
                          "yarn (transformer_config.py:3345); set apply_rope_fusion=False (--no-rope-fusion) or "
                          "mla_rope_type='yarn'")
    if config.multi_latent_attention and config.num_query_groups not in (None, config.num_attention_heads):
        raise ConfigError(f"num_query_groups={config.num_query_groups}: MLA has one key/value head per query head; "
                          "drop num_query_groups")


def check_gpt_oss_fields(config: ModelConfig) -> None:
    """Refuse the gpt-oss layer fields (NOTE [gpt-oss layers] in remat.models.blocks) Megatron would refuse or
    remat does not model, naming the field and the fix."""
    _check_choice("softmax_type", config.softmax_type, SOFTMAX_TYPES)
    clamp, offset = config.activation_func_clamp_value, config.glu_linear_offset
    if isinstance(offset, bool) or not isinstance(offset, (int, float)) or not math.isfinite(offset):
        raise ConfigError(f"glu_linear_offset={offset!r}: must be a finite number")
    if clamp is not None and (isinstance(clamp, bool) or not isinstance(clamp, (int, float))
                              or not math.isfinite(clamp) or clamp <= 0):
        raise ConfigError(f"activation_func_clamp_value={clamp!r}: must be a finite number > 0 (or None)")
    if config.activation != "quick_geglu" and (clamp is not None or offset or config.bias_activation_fusion):
        raise ConfigError("glu_linear_offset, activation_func_clamp_value and bias_activation_fusion are modelled "
                          "for activation='quick_geglu' only: set it, or drop them")
    window, freq = config.window_size, config.window_attn_skip_freq
    if isinstance(window, list):
        window = tuple(window)
        object.__setattr__(config, "window_size", window)
    if window is not None and (not isinstance(window, tuple) or len(window) != 2 or any(
            isinstance(w, bool) or not isinstance(w, int) or w < -1 for w in window)):
        raise ConfigError(f"window_size={shorten(window)}: two integers >= -1 (left, right), e.g. (127, 0)")
    if isinstance(freq, list):
        freq = tuple(freq)
        object.__setattr__(config, "window_attn_skip_freq", freq)
    if isinstance(freq, tuple):
        if len(freq) != config.num_layers or any(isinstance(x, bool) or x not in (0, 1) for x in freq):
            raise ConfigError(f"window_attn_skip_freq={shorten(freq)}: a list needs one 0 (full) or 1 (sliding "
                              f"window) per layer, {config.num_layers} in all")
    elif freq is not None:
        _check_positive_int("window_attn_skip_freq", freq)
    if (window is not None or config.softmax_type != "vanilla") and (
            config.multi_latent_attention or config.transformer_impl == "local"):
        raise ConfigError("window_size and softmax_type are modelled for TransformerEngine's standard attention "
                          "(TEDotProductAttention) only: drop them, multi_latent_attention or transformer_impl='local'")


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name}={shorten(value)}: must be a positive integer")


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={shorten(value)}: must be one of {', '.join(choices)}")
