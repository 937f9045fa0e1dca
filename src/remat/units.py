"""Sizes and units: byte constants, one byte and time formatter, the byte-budget parser and GPU memory presets."""

from __future__ import annotations

import math
import re

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30
TIB = 1 << 40
CUDA_BLOCK = 512  # the CUDA caching allocator rounds every block up to a multiple of 512 bytes


class SizeError(ValueError):
    """A byte count, budget or reserve that cannot be read; the message says what to write instead."""


# ------------------------------------------------------------------------------------------------ budgets
_UNITS = {"": 1, "b": 1, "kib": KIB, "mib": MIB, "gib": GIB, "tib": 1 << 40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
# Device memory as nvidia-smi reports it (memory.total, MiB), before any reserve.
GPU_PRESETS: dict[str, int] = {
    "a100-40g": 40960 * MIB,
    "a100-80g": 81920 * MIB,
    "h100-80g": 81559 * MIB,
    "h100-94g": 95830 * MIB,
    "h200": 143771 * MIB,
    "h200-141g": 143771 * MIB,
}
DEFAULT_RESERVE = "10%"


def parse_bytes(text: str | int | float) -> int:
    """``'70GiB'`` -> 75161927680. Units: B, KiB, MiB, GiB, TiB (powers of 2), KB, MB, GB, TB (powers of 10);
    case-insensitive, spaces allowed, a plain number is bytes. The result is rounded down to whole bytes."""
    if isinstance(text, bool):
        raise SizeError(f"a byte count is expected, got {text!r}")
    if isinstance(text, (int, float)):
        value, unit = float(text), ""
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
        if not match:
            raise SizeError(f"cannot read {text!r} as bytes: write e.g. 70GiB, 75GB, 512MiB or a plain number")
        value, unit = float(match.group(1)), match.group(2).lower()
        if unit not in _UNITS:
            raise SizeError(f"unknown unit {match.group(2)!r} in {text!r}: use B, KiB, MiB, GiB, TiB, KB, MB, GB "
                            "or TB")
    if not math.isfinite(value) or value <= 0:
        raise SizeError(f"a memory budget must be positive, got {text!r}")
    return int(value * _UNITS[unit])


def parse_budget(text: str | int, reserve: str | float | None = DEFAULT_RESERVE) -> tuple[int, str]:
    """``(bytes, description)`` of a budget: a byte count (:func:`parse_bytes`, taken as given) or a GPU preset
    name (:data:`GPU_PRESETS`) minus ``reserve``: a fraction (``0.1``), a percentage (``'10%'``) or bytes
    (``'2GiB'``) kept free for the CUDA context, allocator fragmentation and communication buffers."""
    if isinstance(text, str) and text.strip().lower() in GPU_PRESETS:
        name = text.strip().lower()
        total = GPU_PRESETS[name]
        keep = parse_reserve(reserve, total)
        if keep >= total:
            raise SizeError(f"--reserve {reserve!r} leaves nothing of {name}'s {total / GIB:.1f} GiB")
        return total - keep, f"{name} ({total / GIB:.1f} GiB) minus {keep / GIB:.2f} GiB reserve"
    if isinstance(text, str) and re.fullmatch(r"\s*[A-Za-z][\w.-]*\s*", text) and not re.fullmatch(
            r"\s*[0-9.]+\s*[A-Za-z]*\s*", text):
        raise SizeError(f"unknown GPU preset {text!r}: use one of {', '.join(GPU_PRESETS)} or a size such as 70GiB")
    value = parse_bytes(text)
    return value, format_bytes(value)


def parse_reserve(reserve: str | float | None, total: int) -> int:
    """Bytes of ``total`` that ``reserve`` keeps free (see :func:`parse_budget`)."""
    if reserve is None:
        return 0
    if isinstance(reserve, (int, float)) and not isinstance(reserve, bool):
        if not 0 <= reserve < 1:
            raise SizeError(f"reserve={reserve!r}: a fraction must be in [0, 1); write bytes with a unit, e.g. 2GiB")
        return int(total * reserve)
    text = str(reserve).strip()
    if text.endswith("%"):
        try:
            pct = float(text[:-1])
        except ValueError:
            raise SizeError(f"cannot read reserve {reserve!r}: write e.g. 10% or 2GiB") from None
        if not 0 <= pct < 100:
            raise SizeError(f"reserve {reserve!r} must be in [0%, 100%)")
        return int(total * pct / 100)
    if re.fullmatch(r"0?\.[0-9]+|0", text):
        return parse_reserve(float(text), total)
    return parse_bytes(text)


def format_seconds(t: float) -> str:
    for unit, size in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if t >= size:
            return f"{t / size:.3g} {unit}"
    return f"{t * 1e9:.3g} ns"


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
