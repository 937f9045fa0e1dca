"""Stored answers: ``remat predict`` and ``remat plan`` print the same answer for the same command and the same
inputs, so a repeated command is answered from the disk cache before torch is even imported (about two seconds of
every cold start, and all of a traced answer's time).

The key is everything the answer depends on: the arguments; the contents of every file they name (``@FILE``,
``--config FILE``, paths inside ``--megatron-args``); the ``REMAT_*`` and ``PYTORCH_*`` environment variables; the
versions of remat (its whole source, digested), Python, torch, megatron-core, transformers and TransformerEngine;
and whether the machine has an NVIDIA device. Not stored: commands that write files (``--html``, ``--snapshot``,
``--out``), that run a launch script (``--megatron-script``: it may read anything), that time this machine
(``--measured-times``), ``--no-cache``, ``--debug``, and an answer whose search a time cap cut
(:func:`remat.cache_state.not_repeatable`). Only exit codes 0 (an answer) and 2 (a refusal naming the fix) are stored.
Entries are JSON written atomically; a corrupt one is ignored and written again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

from remat.cache_state import cache_dir, enabled, installed_version, repeatable, reset_repeatable, source_digest
from remat.files import write_atomic

COMMANDS = ("predict", "plan")
NOT_STORED = ("--html", "--snapshot", "--out", "--megatron-script", "--measured-times", "--no-cache", "--debug",
              "--help", "-h")
ENV_PREFIXES = ("REMAT_", "PYTORCH_")
DISTRIBUTIONS = ("torch", "megatron-core", "transformers", "transformer-engine", "numpy")
STORED_CODES = (0, 2)
FORMAT, VERSION = "remat.answer", 1
KIND = "answers"


def _names_unstored_flag(token: str) -> bool:
    """``--html``, ``--html=x`` and what argparse takes as their abbreviations (``--snap``)."""
    flag = token.split("=", 1)[0]
    if flag in NOT_STORED:
        return True
    return flag.startswith("--") and len(flag) > 2 and any(name.startswith(flag) for name in NOT_STORED)


def _file_digests(argv: Sequence[str]) -> dict[str, str]:
    """sha256 of each file an argument names: the argument itself, ``@FILE``, and the words and ``=`` values of
    an argument that holds several (``--megatron-args '... --yaml-cfg f.yaml'``)."""
    found: dict[str, str] = {}
    for token in argv:
        for word in {token, *token.split(), *(w.split("=", 1)[-1] for w in token.split())}:
            path = word[1:] if word.startswith("@") else word
            if path and path not in found and os.path.isfile(path):
                found[path] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return found


def answer_key(argv: Sequence[str]) -> dict[str, Any] | None:
    """What a stored answer of ``remat ARGV`` is keyed by, or None when it is not stored (see the module)."""
    argv = list(argv)
    if not argv or argv[0] not in COMMANDS or not enabled() or any(_names_unstored_flag(t) for t in argv):
        return None
    return {
        "argv": argv,
        "files": _file_digests(argv[1:]),
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)},
        "remat": source_digest(),
        "python": platform.python_version(),
        "versions": {name: installed_version(name) for name in DISTRIBUTIONS},
        "nvidia": os.path.exists("/dev/nvidiactl"),
    }


def _path(key: dict[str, Any]) -> Path:
    text = json.dumps(key, sort_keys=True, separators=(",", ":"))
    return cache_dir() / KIND / f"{hashlib.sha256(text.encode()).hexdigest()[:40]}.json"


def stored_answer(key: dict[str, Any]) -> dict[str, Any] | None:
    """The answer stored under ``key`` (``{"output": [[stream, text], ...], "code": int}``), or None."""
    try:
        data = json.loads(_path(key).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not (isinstance(data, dict) and data.get("format") == FORMAT and data.get("version") == VERSION
            and data.get("key") == json.loads(json.dumps(key)) and data.get("code") in STORED_CODES
            and isinstance(data.get("output"), list)
            and all(isinstance(c, list) and len(c) == 2 and c[0] in ("stdout", "stderr") and isinstance(c[1], str)
                    for c in data["output"])):
        return None
    return data


def replay(answer: dict[str, Any]) -> int:
    """Print a stored answer as the command printed it, in order; return its exit code."""
    streams = {"stdout": sys.stdout, "stderr": sys.stderr}
    for stream, text in answer["output"]:
        streams[stream].write(text)
    sys.stdout.flush()
    return int(answer["code"])


class _Tee:
    """A text stream that writes through and keeps what it wrote (but progress bars' carriage-return redraws)."""

    def __init__(self, stream: TextIO, name: str, output: list[list[str]]):
        self._stream, self._name, self._output = stream, name, output

    def write(self, text: str) -> int:
        if "\r" not in text:
            self._output.append([self._name, text])
        return self._stream.write(text)

    def __getattr__(self, name: str) -> Any:  # flush, isatty, encoding, fileno, ...
        return getattr(self._stream, name)


@contextlib.contextmanager
def recording(key: dict[str, Any] | None) -> Iterator[dict[str, Any]]:
    """Run the command inside; its printed output is stored under ``key`` (None: nothing) when the caller sets
    ``result["code"]`` to a stored exit code and nothing said the answer was not repeatable."""
    result: dict[str, Any] = {"code": None}
    if key is None:
        yield result
        return
    output: list[list[str]] = []
    reset_repeatable()
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Tee(sys.stdout, "stdout", output), _Tee(sys.stderr, "stderr", output)  # type: ignore
    try:
        yield result
    finally:
        sys.stdout, sys.stderr = saved
    if result["code"] in STORED_CODES and repeatable() and enabled():
        try:
            write_atomic(_path(key), json.dumps({"format": FORMAT, "version": VERSION, "key": key,
                                                 "code": result["code"], "output": output}))
        except OSError:  # an unwritable cache folder: the disk cache warns about it; the answer stands
            pass
