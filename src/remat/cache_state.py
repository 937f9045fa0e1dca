"""Where remat's on-disk caches live, whether they are on, and what keys them (standard library only: the command
line reads a stored answer before it imports torch).

The folder is ``$REMAT_CACHE_DIR``, else ``~/.cache/remat``; ``REMAT_NO_CACHE=1`` (or :func:`set_enabled` /
``--no-cache``) turns every cache off. Two caches use it: :mod:`remat.memory.disk_cache` (traces, unit models) and
:mod:`remat.cli.answers` (whole answers of ``remat predict`` / ``remat plan``).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from remat.version import __version__

CACHE_ENV = "REMAT_CACHE_DIR"
NO_CACHE_ENV = "REMAT_NO_CACHE"
_STATE = {"enabled": True, "repeatable": True}


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
    """Turn the disk caches on or off for this process (``--no-cache`` turns them off)."""
    _STATE["enabled"] = bool(on)


@contextmanager
def disabled() -> Iterator[None]:
    """The disk caches off inside the ``with`` block."""
    before = _STATE["enabled"]
    _STATE["enabled"] = False
    try:
        yield
    finally:
        _STATE["enabled"] = before


def not_repeatable() -> None:
    """Say that this process's answer depends on more than its inputs (a search cut at a time cap): the command
    line does not store it as the answer to the same command."""
    _STATE["repeatable"] = False


def repeatable() -> bool:
    """Whether nothing called :func:`not_repeatable` since :func:`reset_repeatable`."""
    return _STATE["repeatable"]


def reset_repeatable() -> None:
    _STATE["repeatable"] = True


@functools.cache
def source_digest(skip: tuple[str, ...] = ()) -> str:
    """sha256 of remat's version and its own ``.py`` files (paths and contents), but those under the subpackages
    named in ``skip``: any edit of what is digested invalidates the entries keyed by it."""
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256(__version__.encode())
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).parts[0] in skip:
            continue
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


@functools.cache
def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution`` (e.g. ``torch``), read from its metadata without importing it;
    None when it is not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
