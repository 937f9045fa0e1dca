"""Configuration of the reference GPT decoder.

The field names follow Megatron-LM's ``TransformerConfig`` where one exists, so that a Megatron run's settings
can be typed in directly. Every check names the field it refuses and how to fix it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ACTIVATIONS = ("gelu", "swiglu")
NORMALIZATIONS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "rope")
ATTENTIONS = ("math", "sdpa")


class ConfigError(ValueError):
    """A model configuration that cannot be built; the message names the field and the fix."""


@dataclass(frozen=True)
class ModelConfig:
    """A GPT-style decoder: embedding -> ``num_layers`` layers -> final norm -> output layer -> loss.

    ``num_query_groups`` below ``num_attention_heads`` gives grouped-query attention (None: one group per
    head). ``ffn_hidden_size`` None means 4h for gelu and the Llama rounding of 8h/3 (to a multiple of 64) for
    swiglu. ``attention='math'`` materialises the s x s scores (Korthikanti's 5as^2b term); ``'sdpa'`` uses
    ``scaled_dot_product_attention`` (fused kernels keep only softmax statistics).
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

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length",
                     "micro_batch_size"):
            _check_positive_int(name, getattr(self, name))
        for name in ("num_query_groups", "ffn_hidden_size"):
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name))
        _check_choice("activation", self.activation, ACTIVATIONS)
        _check_choice("normalization", self.normalization, NORMALIZATIONS)
        _check_choice("position", self.position, POSITIONS)
        _check_choice("attention", self.attention, ATTENTIONS)
        _check_choice("dtype", self.dtype, tuple(DTYPES))
        for name in ("hidden_dropout", "attention_dropout"):
            p = getattr(self, name)
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
                raise ConfigError(f"{name}={p!r}: a dropout probability must be a number in [0, 1)")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                f"{self.num_attention_heads}: pick a hidden_size that is a multiple of the head count")
        if self.num_attention_heads % self.query_groups:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} is not divisible by num_query_groups="
                f"{self.num_query_groups}: use a divisor of the head count (or None for one group per head)")
        if self.position == "rope" and self.head_dim % 2:
            raise ConfigError(f"position='rope' needs an even head dimension, got {self.head_dim}: "
                              "change hidden_size or num_attention_heads")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

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


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name}={value!r}: must be a positive integer")


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={value!r}: must be one of {', '.join(choices)}")
