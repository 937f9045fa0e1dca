"""An on-disk JSON cache for what is slow to trace and never changes for a given input: shallow fake traces, unit
models and plan validations. Keyed by the caller's key plus torch's version and a digest of remat's own source, so
an upgrade or an edit of remat never reads a stale entry.

The folder, and whether the cache is on: :mod:`remat.cache_state`. Entries are JSON written atomically (never
pickle); a corrupt or foreign file is ignored with a warning and rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from remat.cache_state import (
    CACHE_ENV,
    NO_CACHE_ENV,
    cache_dir,
    disabled,
    enabled,
    set_enabled,
    source_digest,
)
from remat.files import write_atomic
from remat.timeline import Timeline, TimelineError
from remat.version import __version__

__all__ = ["CACHE_ENV", "NO_CACHE_ENV", "cache_dir", "cached_timeline", "disabled", "enabled", "load", "set_enabled",
           "source_digest", "store"]
FORMAT = "remat.cache"
VERSION = 1
# Entries are keyed by remat's source below the analysis layer: reports and the command line do not change a trace.
TRACED_SOURCE = ("analysis", "cli")


def _full_key(kind: str, key: dict[str, Any]) -> dict[str, Any]:
    return {"kind": kind, "key": key, "torch": torch.__version__, "remat": __version__,
            "source": source_digest(TRACED_SOURCE)}


def _path(full: dict[str, Any]) -> Path:
    text = json.dumps(full, sort_keys=True, separators=(",", ":"), default=str)
    return cache_dir() / full["kind"] / f"{hashlib.sha256(text.encode()).hexdigest()[:40]}.json"


def load(kind: str, key: dict[str, Any]) -> Any | None:
    """The payload stored under ``(kind, key)``, or None (absent, cache off, or a corrupt or foreign file: that
    one is reported with a warning and will be overwritten)."""
    if not enabled():
        return None
    full = _full_key(kind, key)
    path = _path(full)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as err:
        warnings.warn(f"remat cache: cannot read {path} ({err}); rebuilding it", stacklevel=2)
        return None
    try:
        data = json.loads(text)
        ok = isinstance(data, dict) and data.get("format") == FORMAT and data.get("version") == VERSION and \
            json.loads(json.dumps(data.get("key"), default=str)) == json.loads(json.dumps(full, default=str))
    except (json.JSONDecodeError, TypeError, ValueError):
        ok = False
    if not ok or "payload" not in data:
        warnings.warn(f"remat cache: {path} is corrupt or not a remat {kind} entry; ignoring it and rebuilding",
                      stacklevel=2)
        return None
    return data["payload"]


def store(kind: str, key: dict[str, Any], payload: Any) -> None:
    """Write ``payload`` (JSON-able) under ``(kind, key)`` atomically; a cache folder that cannot be written is
    reported with a warning and otherwise ignored."""
    if not enabled():
        return
    full = _full_key(kind, key)
    path = _path(full)
    try:
        write_atomic(path, json.dumps({"format": FORMAT, "version": VERSION, "key": full, "payload": payload},
                                      separators=(",", ":"), default=str))
    except OSError as err:
        warnings.warn(f"remat cache: cannot write {path} ({err}); set {CACHE_ENV} to a writable folder or pass "
                      "--no-cache", stacklevel=2)


def cached_timeline(kind: str, key: dict[str, Any], build: Callable[[], Timeline]) -> Timeline:
    """The timeline stored under ``(kind, key)``, else ``build()``'s, stored for next time."""
    data = load(kind, key)
    if data is not None:
        try:
            return Timeline.from_dict(data)
        except TimelineError as err:
            warnings.warn(f"remat cache: a {kind} entry is not a valid timeline ({err}); rebuilding it",
                          stacklevel=2)
    timeline = build()
    store(kind, key, timeline.to_dict())
    return timeline
