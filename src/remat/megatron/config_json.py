"""A megatron-core ``TransformerConfig`` as JSON, so a real multi-process run can rebuild it in every rank.

Only the fields that differ from the dataclass defaults travel, as JSON values (dtypes as ``"torch.bfloat16"``).
A field that is not JSON (an init method, an activation function) travels when rebuilding the config from the
other fields gives it back (``__post_init__`` derives it, or it is one of the activation functions named here);
otherwise :func:`config_to_json` refuses in one line naming the field.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
import torch.nn.functional as F

from remat.megatron.compat import MegatronSettingError

CONFIG_CLASSES = ("TransformerConfig", "MLATransformerConfig")
# activation functions a config may name: value in JSON -> the function
ACTIVATIONS = {"gelu": F.gelu, "silu": F.silu, "relu": F.relu}
_PRIMITIVE = (bool, int, float, str, type(None))


def _config_class(name: str) -> Any:
    if name not in CONFIG_CLASSES:
        raise MegatronSettingError(f"config class {name!r}: use one of {', '.join(CONFIG_CLASSES)}")
    from megatron.core import transformer

    return getattr(transformer, name)


def _to_json(value: Any) -> tuple[bool, Any]:
    if isinstance(value, _PRIMITIVE):
        return True, value
    if isinstance(value, torch.dtype):
        return True, {"dtype": str(value)}
    if isinstance(value, (list, tuple)):
        items = [_to_json(v) for v in value]
        if all(ok for ok, _ in items):
            return True, [v for _, v in items]
    for name, function in ACTIVATIONS.items():
        if value is function:
            return True, {"activation": name}
    return False, None


def _from_json(value: Any) -> Any:
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    if isinstance(value, dict) and set(value) == {"dtype"}:
        dtype = getattr(torch, str(value["dtype"]).removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            raise MegatronSettingError(f"config dtype {value['dtype']!r} is not a torch dtype")
        return dtype
    if isinstance(value, dict) and set(value) == {"activation"}:
        if value["activation"] not in ACTIVATIONS:
            raise MegatronSettingError(f"activation {value['activation']!r}: use one of {', '.join(ACTIVATIONS)}")
        return ACTIVATIONS[value["activation"]]
    return value


def _equivalent(a: Any, b: Any) -> bool:
    if isinstance(a, functools.partial) and isinstance(b, functools.partial):
        return a.func is b.func and a.args == b.args and a.keywords == b.keywords
    try:
        same = a == b
    except Exception:  # noqa: BLE001 - tensors and other values without a plain ==
        return a is b
    return same if isinstance(same, bool) else a is b


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def config_to_json(config: Any) -> dict[str, Any]:
    """``{"class": ..., "fields": {...}}`` for ``config`` (see the module docstring); :func:`config_from_json`
    rebuilds an equal config."""
    name = type(config).__name__
    _config_class(name)
    fields, opaque = {}, []
    for f in dataclasses.fields(config):
        if not f.init:
            continue
        value = getattr(config, f.name)
        if _equivalent(value, _default(f)):
            continue
        ok, encoded = _to_json(value)
        if ok:
            fields[f.name] = encoded
        else:
            opaque.append(f.name)
    data = {"class": name, "fields": fields}
    rebuilt = config_from_json(data)
    for field_name in opaque:
        if not _equivalent(getattr(rebuilt, field_name), getattr(config, field_name)):
            raise MegatronSettingError(
                f"TransformerConfig.{field_name}={getattr(config, field_name)!r} cannot be sent to the ranks of a "
                "real multi-process run: leave it at what megatron-core derives, or measure with a builder function "
                "in one process")
    return data


def config_from_json(data: dict[str, Any]) -> Any:
    """The config :func:`config_to_json` describes."""
    if not isinstance(data, dict) or "class" not in data or not isinstance(data.get("fields"), dict):
        raise MegatronSettingError("a config in JSON is {'class': 'TransformerConfig', 'fields': {...}}")
    cls = _config_class(str(data["class"]))
    return cls(**{k: _from_json(v) for k, v in data["fields"].items()})
