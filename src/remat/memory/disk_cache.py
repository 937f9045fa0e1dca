"""An on-disk JSON cache for what is slow to trace and never changes for a given input: shallow fake traces, unit
models and plan validations. Keyed by the caller's key plus torch's version and a digest of remat's own source, so
an upgrade or an edit of remat never reads a stale entry.

The folder is ``$REMAT_CACHE_DIR``, else ``~/.cache/remat``; ``REMAT_NO_CACHE=1`` (or :func:`set_enabled` /
``--no-cache``) turns it off. Entries are JSON written atomically (never pickle); a corrupt or foreign file is
ignored with a warning and rebuilt.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from remat.timeline import Timeline, TimelineError, write_atomic
from remat.version import __version__

CACHE_ENV = "REMAT_CACHE_DIR"
NO_CACHE_ENV = "REMAT_NO_CACHE"
FORMAT = "remat.cache"
VERSION = 1
_STATE = {"enabled": True}


def cache_dir() -> Path:
    """The cache folder: ``$REMAT_CACHE_DIR``, else ``~/.cache/remat``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "remat")


def enabled() -> bool:
    """Whether entries are read and written: :func:`set_enabled`, ``REMAT_NO_CACHE`` unset or ``0``, and, under
    pytest, only with an explicit ``REMAT_CACHE_DIR`` (tests never share state through the user's cache)."""
    if "PYTEST_CURRENT_TEST" in os.environ and not os.environ.get(CACHE_ENV):
        return False
    return _STATE["enabled"] and os.environ.get(NO_CACHE_ENV, "0") in ("", "0")


def set_enabled(on: bool) -> None:
    """Turn the disk cache on or off for this process (``--no-cache`` turns it off)."""
    _STATE["enabled"] = bool(on)


@contextmanager
def disabled() -> Iterator[None]:
    """The disk cache off inside the ``with`` block."""
    before = _STATE["enabled"]
    _STATE["enabled"] = False
    try:
        yield
    finally:
        _STATE["enabled"] = before


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """sha256 of remat's own ``.py`` files below the analysis layer (paths and contents): any edit of what traces
    or models a step invalidates every entry; reports and the command line do not."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256(__version__.encode())
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).parts[0] in ("analysis", "cli"):
            continue
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _full_key(kind: str, key: dict[str, Any]) -> dict[str, Any]:
    return {"kind": kind, "key": key, "torch": torch.__version__, "remat": __version__, "source": source_digest()}


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
