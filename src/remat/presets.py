"""Named model configurations (:data:`PRESETS`: GPT-3 175B, Llama 3 8B/70B, Mixtral 8x7B, Qwen3-30B-A3B,
DeepSeek-V3, the small test model; described in
the NOTE beside them) and reading a :class:`~remat.config.ModelConfig` from a YAML or JSON file
(:func:`load_config`)."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from pathlib import Path
from types import MappingProxyType
from typing import Any

from remat.config import ConfigError, ModelConfig
from remat.limits import MAX_YAML_ALIASES, MAX_YAML_NODES, read_input_text, shorten

__all__ = ["PRESETS", "get_preset", "load_config", "config_from_mapping", "preset_names"]

# NOTE [the presets] (remat predict --preset NAME; get_preset)
# * gpt-small: ModelConfig(), the 8-layer test model (h=256, s=256, b=4, vocab 512, fp32).
# * gpt3-175b: GPT-3 175B (Brown et al. 2020) as Megatron-LM trains it and as Korthikanti et al. 2022 analyse it:
#   96 layers, h=12288, 96 heads (d=128), s=2048, FFN 4h=49152, vocabulary 51200 (GPT-2's 50257 padded by
#   Megatron), GeLU, LayerNorm, learned positions, biases, input and output embeddings tied (Megatron's default),
#   hidden and attention dropout 0.1 (Megatron's defaults, GPT-2/3's value), unfused math attention (the paper's
#   5as^2b score terms), bf16, micro-batch 1.
# * llama3-8b / llama3-70b: Meta Llama 3 (the published config.json shapes): 32 / 80 layers, h=4096 / 8192,
#   32 / 64 heads with 8 key/value groups (GQA), SwiGLU with ffn 14336 / 28672, RMSNorm, rotary positions,
#   vocabulary 128256, untied embeddings, no biases, no dropout, sdpa attention, bf16, micro-batch 1, and
#   s = 8192, the context both were pre-trained with (override seq_length for other lengths). The reference
#   model's rotary base is 10000 where Llama 3 uses 500000, which changes values, not memory.
_GPT3_175B = ModelConfig(
    num_layers=96, hidden_size=12288, num_attention_heads=96, ffn_hidden_size=4 * 12288, vocab_size=51200,
    seq_length=2048, micro_batch_size=1, activation="gelu", normalization="layernorm", position="learned",
    attention="math", hidden_dropout=0.1, attention_dropout=0.1, dtype="bf16", tie_embeddings=True,
    add_bias_linear=True)

_LLAMA3 = dict(
    num_query_groups=8, vocab_size=128256, seq_length=8192, micro_batch_size=1, activation="swiglu",
    normalization="rmsnorm", position="rope", attention="sdpa", hidden_dropout=0.0, attention_dropout=0.0,
    dtype="bf16", tie_embeddings=False, add_bias_linear=False)

# * mixtral-8x7b: Mistral AI's Mixtral-8x7B-v0.1 config.json (huggingface.co/mistralai/Mixtral-8x7B-v0.1): 32
#   layers, h=4096, 32 heads with 8 key/value groups, 8 experts with ffn 14336 (SwiGLU), top-2 softmax routing,
#   MoE in every layer, no shared expert, RMSNorm, rope, vocabulary 32000, untied embeddings, no biases; the
#   experts as separate MLPs (as Megatron's Mixtral conversion loads them), s=4096, bf16, micro-batch 1.
# * qwen3-30b-a3b: Qwen/Qwen3-30B-A3B config.json: 48 layers, h=2048, 32 heads of head_dim 128 (kv_channels)
#   with 4 key/value groups, 128 experts with moe_intermediate_size 768, top-8 (norm_topk_prob), MoE in every
#   layer, vocabulary 151936, untied; grouped experts, s=4096, bf16, micro-batch 1. Its per-head q/k RMSNorm is
#   not modelled (a few percent of the attention activations).
# * deepseek-v3: deepseek-ai/DeepSeek-V3 config.json and Megatron-LM's DeepSeek-V3 recipe: 61 layers, h=7168,
#   128 heads; MLA with q_lora_rank 1536, kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64,
#   v_head_dim 128; the first 3 layers dense (first_k_dense_replace=3, ffn 18432), then 58 MoE layers of 256
#   routed experts (moe_intermediate_size 2048), top-8 sigmoid routing, 1 shared expert (2048), grouped experts
#   (--moe-grouped-gemm); vocabulary 129280, untied, RMSNorm, no biases, s=4096, bf16, micro-batch 1. Not
#   modelled: the multi-token-prediction layer, the group-limited routing (it changes which experts, not how
#   many tokens) and the yarn rope scaling.
_MOE_COMMON = dict(
    micro_batch_size=1, activation="swiglu", normalization="rmsnorm", position="rope", attention="sdpa",
    hidden_dropout=0.0, attention_dropout=0.0, dtype="bf16", tie_embeddings=False, add_bias_linear=False,
    seq_length=4096)

#: name -> ModelConfig; read-only.
PRESETS: MappingProxyType[str, ModelConfig] = MappingProxyType({
    "gpt-small": ModelConfig(),
    "gpt3-175b": _GPT3_175B,
    "llama3-8b": ModelConfig(num_layers=32, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=14336,
                             **_LLAMA3),
    "llama3-70b": ModelConfig(num_layers=80, hidden_size=8192, num_attention_heads=64, ffn_hidden_size=28672,
                              **_LLAMA3),
    "mixtral-8x7b": ModelConfig(
        num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8, ffn_hidden_size=14336,
        vocab_size=32000, num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=14336, **_MOE_COMMON),
    "qwen3-30b-a3b": ModelConfig(
        num_layers=48, hidden_size=2048, num_attention_heads=32, num_query_groups=4, kv_channels=128,
        ffn_hidden_size=6144, vocab_size=151936, num_moe_experts=128, moe_router_topk=8, moe_ffn_hidden_size=768,
        moe_grouped_gemm=True, **_MOE_COMMON),
    "deepseek-v3": ModelConfig(
        num_layers=61, hidden_size=7168, num_attention_heads=128, ffn_hidden_size=18432, vocab_size=129280,
        num_moe_experts=256, moe_router_topk=8, moe_ffn_hidden_size=2048, moe_shared_expert_intermediate_size=2048,
        moe_grouped_gemm=True, moe_layer_freq=(0,) * 3 + (1,) * 58, moe_router_score_function="sigmoid",
        multi_latent_attention=True, q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64,
        v_head_dim=128, **_MOE_COMMON),
})

_FIELDS = {f.name: f for f in dataclasses.fields(ModelConfig)}
_BOOL_FIELDS = tuple(name for name, f in _FIELDS.items() if f.type in ("bool", bool))
_STR_FIELDS = tuple(name for name, f in _FIELDS.items() if f.type in ("str", str))
_FLOAT_FIELDS = tuple(name for name, f in _FIELDS.items() if "float" in str(f.type))


def preset_names() -> list[str]:
    """The preset names, in the order of :data:`PRESETS`."""
    return list(PRESETS)


def get_preset(name: str) -> ModelConfig:
    """The :class:`ModelConfig` of preset ``name``; :class:`ConfigError` lists the known names otherwise."""
    if not isinstance(name, str) or name.strip().lower() not in PRESETS:
        raise ConfigError(f"preset={name!r}: unknown preset; known presets: {', '.join(PRESETS)}")
    return PRESETS[name.strip().lower()]


def config_from_mapping(data: Any, source: str = "config") -> ModelConfig:
    """Build a :class:`ModelConfig` from ``data``: field names (``-`` or ``_``), optionally with ``preset``.

    The preset's fields are the base and every other key overrides one. ``source`` (a file name) starts every
    error message, which also names the field: ``cfg.yaml: hidden_size=100 is not divisible by ...``.
    """
    if data is None:
        raise ConfigError(f"{source}: empty; expected a mapping such as 'preset: llama3-8b' or 'num_layers: 8'")
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of field: value at the top level, got "
                          f"{type(data).__name__}")
    fields: dict[str, Any] = {}
    base = ModelConfig()
    for key, value in data.items():
        if not isinstance(key, str):
            raise ConfigError(f"{source}: field name {key!r} is not a string")
        name = key.strip().replace("-", "_")
        if name in fields or (name == "preset" and "preset" in fields):
            raise ConfigError(f"{source}: field {name!r} is given twice")
        fields[name] = value
    preset = fields.pop("preset", None)
    if preset is not None:
        try:
            base = get_preset(preset)
        except ConfigError as err:
            raise ConfigError(f"{source}: {err}") from None
    unknown = sorted(set(fields) - set(_FIELDS))
    if unknown:
        raise ConfigError(f"{source}: unknown field(s) {', '.join(map(repr, unknown))}; known fields: preset, "
                          f"{', '.join(_FIELDS)}")
    for name, value in fields.items():
        if name in _BOOL_FIELDS and not isinstance(value, bool):
            raise ConfigError(f"{source}: {name}={value!r}: must be true or false")
        if name in _STR_FIELDS and not isinstance(value, str):
            raise ConfigError(f"{source}: {name}={value!r}: must be a string")
        if isinstance(value, float) and value.is_integer() and name not in _FLOAT_FIELDS:
            raise ConfigError(f"{source}: {name}={value!r}: must be an integer (write {int(value)})")
    try:
        return base.replace(**fields)
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None
    except TypeError as err:  # a value of a type the checks do not cover
        raise ConfigError(f"{source}: {err}") from None


def load_config(path: str | os.PathLike[str]) -> ModelConfig:
    """Read a :class:`ModelConfig` from a YAML or JSON file.

    The file is a mapping of :class:`ModelConfig` field names to values, optionally with ``preset: NAME``, whose
    fields the other keys override (:func:`config_from_mapping`); keys may be written with ``-`` instead of
    ``_`` (``num-layers``). ``.json`` files are parsed as JSON, anything else as YAML (which also reads JSON)
    with a ``yaml.SafeLoader`` that refuses a key given twice; nothing is ever unpickled or executed. The file is
    read up to :data:`remat.limits.MAX_INPUT_FILE_BYTES`, and its YAML may use at most ``MAX_YAML_ALIASES`` aliases
    and hold ``MAX_YAML_NODES`` values with them expanded (no "billion laughs").

    Args:
        path: the file.

    Returns:
        The :class:`ModelConfig`.

    Raises:
        ConfigError: starting with the file name: a missing, unreadable or too long file, a syntax error (with its
            line), too many aliases, a key given twice, an unknown field, a bad value (naming the field).

    Example: a file ``llama-short.yaml`` holding::

        preset: llama3-8b
        num_layers: 4
        seq_length: 2048

    gives ``get_preset("llama3-8b").replace(num_layers=4, seq_length=2048)``.
    """
    import yaml

    path = Path(path)
    try:
        text = read_input_text(path)  # at most MAX_INPUT_FILE_BYTES (remat.limits): /dev/zero is refused
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot read the config file ({err})") from None
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text, object_pairs_hook=_unique_keys_object)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}: not valid JSON (line {err.lineno}, column {err.colno}: {err.msg})") from None
        except _DuplicateKey as err:
            raise ConfigError(f"{path}: key {shorten(err.args[0])} is given twice: keep one") from None
        except RecursionError:
            raise ConfigError(f"{path}: not a model config (its values are nested too deeply)") from None
    else:
        try:
            data = yaml.load(text, Loader=_unique_key_loader())  # a SafeLoader: builds plain data only
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise ConfigError(f"{path}: not valid YAML ({where}{problem})") from None
        except RecursionError:
            raise ConfigError(f"{path}: not a model config (its values are nested too deeply)") from None
    return config_from_mapping(data, str(path))


class _DuplicateKey(Exception):
    """A JSON object with a key given twice (json keeps the last one silently)."""


def _unique_keys_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


@functools.cache
def _unique_key_loader() -> type:
    """``yaml.SafeLoader`` that refuses a mapping with a key given twice (YAML forbids it; PyYAML keeps the last
    value silently). Merge keys (``<<: *base``) still override, as YAML defines them to."""
    import yaml
    from yaml.composer import ComposerError
    from yaml.constructor import ConstructorError

    class UniqueKeyLoader(yaml.SafeLoader):
        aliases = 0

        def compose_node(self, parent: Any, index: Any) -> Any:
            # remat.limits: at most MAX_YAML_ALIASES aliases and MAX_YAML_NODES values with them expanded, so that a
            # small file cannot describe a huge structure (a "billion laughs" file)
            if self.check_event(yaml.AliasEvent):
                self.aliases += 1
                if self.aliases > MAX_YAML_ALIASES:
                    raise ComposerError(None, None, f"more than {MAX_YAML_ALIASES} aliases (*name), remat's limit for "
                                        "a config file (MAX_YAML_ALIASES): write the values out",
                                        self.peek_event().start_mark)
            return super().compose_node(parent, index)

        def compose_document(self) -> Any:
            node = super().compose_document()
            if _expanded_size(node, {}) > MAX_YAML_NODES:
                raise ComposerError(None, None, f"more than {MAX_YAML_NODES:,} values with its aliases expanded, "
                                    "remat's limit for a config file (MAX_YAML_NODES)", node.start_mark)
            return node

        def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
            if isinstance(node, yaml.MappingNode):
                seen: set[Any] = set()
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":
                        continue
                    key = self.construct_object(key_node, deep=deep)
                    try:
                        duplicate = key in seen
                    except TypeError:  # an unhashable key: SafeLoader's own check names it
                        break
                    if duplicate:
                        raise ConstructorError("while constructing a mapping", node.start_mark,
                                               f"key {key!r} is given twice: keep one", key_node.start_mark)
                    seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader


def _expanded_size(node: Any, sizes: dict[int, int]) -> int:
    """Values under a YAML ``node`` (itself included) with every alias expanded; ``sizes`` memoises shared nodes, so
    the count takes one visit per distinct node however often it is aliased."""
    if id(node) not in sizes:
        children = node.value if isinstance(node.value, list) else []
        sizes[id(node)] = 1 + sum(_expanded_size(c, sizes) for child in children
                                  for c in (child if isinstance(child, tuple) else (child,)))
    return sizes[id(node)]
