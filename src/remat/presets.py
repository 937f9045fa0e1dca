"""Named model configurations (:data:`PRESETS`: GPT-3 175B, Llama 3 8B/70B, the small test model; described in
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

#: name -> ModelConfig; read-only.
PRESETS: MappingProxyType[str, ModelConfig] = MappingProxyType({
    "gpt-small": ModelConfig(),
    "gpt3-175b": _GPT3_175B,
    "llama3-8b": ModelConfig(num_layers=32, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=14336,
                             **_LLAMA3),
    "llama3-70b": ModelConfig(num_layers=80, hidden_size=8192, num_attention_heads=64, ffn_hidden_size=28672,
                              **_LLAMA3),
})

_FIELDS = {f.name: f for f in dataclasses.fields(ModelConfig)}
_BOOL_FIELDS = tuple(name for name, f in _FIELDS.items() if f.type in ("bool", bool))
_STR_FIELDS = tuple(name for name, f in _FIELDS.items() if f.type in ("str", str))


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
        if isinstance(value, float) and value.is_integer() and name not in ("hidden_dropout", "attention_dropout"):
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
    with a ``yaml.SafeLoader`` that refuses a key given twice; nothing is ever unpickled or executed.

    Args:
        path: the file.

    Returns:
        The :class:`ModelConfig`.

    Raises:
        ConfigError: starting with the file name: a missing or unreadable file, a syntax error (with its line), a
            key given twice, an unknown field, a bad value (naming the field).

    Example: a file ``llama-short.yaml`` holding::

        preset: llama3-8b
        num_layers: 4
        seq_length: 2048

    gives ``get_preset("llama3-8b").replace(num_layers=4, seq_length=2048)``.
    """
    import yaml

    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
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
            raise ConfigError(f"{path}: key {err.args[0]!r} is given twice: keep one") from None
    else:
        try:
            data = yaml.load(text, Loader=_unique_key_loader())  # a SafeLoader: builds plain data only
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise ConfigError(f"{path}: not valid YAML ({where}{problem})") from None
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
    from yaml.constructor import ConstructorError

    class UniqueKeyLoader(yaml.SafeLoader):
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
