"""Sizes and units: byte constants, the byte and time formatters every layer prints with, the byte-budget parser
and GPU memory presets."""

from __future__ import annotations

import math
import re

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30
TIB = 1 << 40
CUDA_BLOCK = 512  # the CUDA caching allocator rounds every block up to a multiple of 512 bytes
# The largest byte count parse_bytes reads: 1024 TiB, far above any one device's memory (the budget is one GPU's).
MAX_BYTES = 1 << 50


class SizeError(ValueError):
    """A byte count, budget or reserve that cannot be read; the message says what to write instead."""


# ------------------------------------------------------------------------------------------------ numbers in text
# NOTE [ASCII digits]: every number remat reads from text (policy strings, budgets, command-line flags, Megatron
# flags) is written with the digits 0-9. int() and float() also read other scripts' digits ('٣', '２') and '_'
# separators ('1_0'), and str.isdigit() and \d accept superscripts: a flag should mean what it shows.
MAX_DIGITS = 18  # the most digits of a count read from text (and the largest count a Policy holds): plenty here


def ascii_int(text: object, *, signed: bool = True) -> int | None:
    """``text`` as an int when it is at most :data:`MAX_DIGITS` digits 0-9 (after an optional sign when
    ``signed``), else None: ``ascii_int('12') == 12``, ``ascii_int('1_0') is None``, ``ascii_int('٣') is None``."""
    sign = "[+-]?" if signed else ""
    if not isinstance(text, str) or not re.fullmatch(rf"{sign}[0-9]{{1,{MAX_DIGITS}}}", text):
        return None
    return int(text)


def ascii_float(text: object) -> float | None:
    """``float(text)`` when ``text`` is ASCII without '_' (``'1.5'``, ``'1e-3'``, ``'nan'``), else None (also
    when float() refuses it)."""
    if not isinstance(text, str) or not text.isascii() or "_" in text:
        return None
    try:
        return float(text)
    except ValueError:
        return None


# ------------------------------------------------------------------------------------------------ budgets
_UNITS = {"": 1, "b": 1, "kib": KIB, "mib": MIB, "gib": GIB, "tib": TIB,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_NUMBER_WITH_UNIT = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*")
# Device memory as nvidia-smi reports it (memory.total, MiB), before any reserve.
GPU_PRESETS: dict[str, int] = {
    "a100-40g": 40960 * MIB,
    "a100-80g": 81920 * MIB,
    "h100-80g": 81559 * MIB,
    "h100-94g": 95830 * MIB,
    "h200": 143771 * MIB,
    "h200-141g": 143771 * MIB,
    # Blackwell (sm100): nvidia-smi's memory.total on an HGX B200 (183359MiB) and a GB200 NVL72 tray's GPU
    # (189471MiB), as published nvidia-smi outputs of both show it
    "b200": 183359 * MIB,
    "gb200": 189471 * MIB,
}
DEFAULT_RESERVE = "10%"


def parse_bytes(text: str | int | float) -> int:
    """Read a positive byte count.

    Args:
        text: a number with an optional unit: B, KiB, MiB, GiB, TiB (powers of 2) or KB, MB, GB, TB (powers of
            10); case-insensitive, spaces allowed; a plain number (or an int/float) is bytes.

    Returns:
        The count rounded down to whole bytes, at least 1 and at most :data:`MAX_BYTES`.

    Raises:
        SizeError: text that is not a number with a known unit, not positive, less than one byte, infinite or
            above :data:`MAX_BYTES`; the message names the value and what to write instead.

    Example::

        >>> parse_bytes("70GiB"), parse_bytes("1.5 KiB"), parse_bytes("2kb"), parse_bytes(4096)
        (75161927680, 1536, 2000, 4096)
    """
    return _read_bytes(text, None, allow_zero=False)


def _read_bytes(text: object, what: str | None, *, allow_zero: bool) -> int:
    """:func:`parse_bytes`, with ``what`` (``'budget'``, ``'reserve'``) starting the messages; ``allow_zero``
    accepts 0."""
    start = f"{what}: " if what else ""
    shown = _shown(text)
    if isinstance(text, bool):
        raise SizeError(f"{start}a number of bytes is expected, got {shown}")
    if isinstance(text, (int, float)):
        value, unit = text, 1
    else:
        match = _NUMBER_WITH_UNIT.fullmatch(str(text))
        if not match and _NUMBER_WITH_UNIT.fullmatch(re.sub(r"^\s*-", "", str(text))):
            raise SizeError(f"{start}{shown} is negative: write a size such as 70GiB")
        if not match:
            raise SizeError(f"{start}cannot read {shown} as bytes: write e.g. 70GiB, 75GB, 512MiB or a plain number")
        key = match.group(2).lower()
        if key not in _UNITS:
            raise SizeError(f"{start}unknown unit {match.group(2)!r} in {shown}: use B, KiB, MiB, GiB, TiB, KB, MB, "
                            "GB or TB")
        value, unit = float(match.group(1)), _UNITS[key]
        if math.isinf(value):  # digits past float's range (1e400): too large, not "not finite"
            raise SizeError(f"{start}{shown} is too large: at most {MAX_BYTES // TIB} TiB ({MAX_BYTES:,} bytes)")
    if isinstance(value, float) and not math.isfinite(value):
        raise SizeError(f"{start}{shown} is not a finite number of bytes: write e.g. 70GiB")
    if value < 0 or (value == 0 and not allow_zero):
        raise SizeError(f"{what or 'a byte count'} must be positive, got {shown}: write e.g. 70GiB")
    if value > MAX_BYTES / unit:  # compared before multiplying: 1e308 TiB would overflow a float
        raise SizeError(f"{start}{shown} is too large: at most {MAX_BYTES // TIB} TiB ({MAX_BYTES:,} bytes)")
    nbytes = int(value * unit) if isinstance(value, float) else value * unit
    if nbytes == 0 and value != 0:
        raise SizeError(f"{start}{shown} is less than one byte: write a whole number of bytes or a unit, e.g. "
                        "512MiB")
    return nbytes


def _shown(value: object, limit: int = 40) -> str:
    """``repr(value)``, cut to ``limit`` characters (a 400-digit number does not fill the terminal)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def parse_budget(text: str | int, reserve: str | float | None = DEFAULT_RESERVE) -> tuple[int, str]:
    """Read a memory budget: a byte count, or a GPU preset minus a reserve.

    Args:
        text: a byte count (:func:`parse_bytes`, taken as given) or a GPU preset name from :data:`GPU_PRESETS`
            (``'h100-80g'``, case-insensitive).
        reserve: what a GPU preset keeps free for the CUDA context, allocator fragmentation and communication
            buffers: a fraction (``0.1``), a percentage (``'10%'``), bytes (``'2GiB'``) or None (nothing). It
            applies to GPU presets only, but it is read (and refused when unreadable) with a byte budget too.

    Returns:
        ``(bytes, description)``. The description is the preset, its size and the reserve taken off it
        (``'h100-80g (79.6 GiB) minus 7.96 GiB reserve'``), or the byte count (``'70.00 GiB'``); for a byte
        count given with a reserve other than :data:`DEFAULT_RESERVE` (and not zero) it adds that the reserve was
        not applied.

    Raises:
        SizeError: an unreadable budget or reserve, an unknown preset name, or a reserve that leaves nothing.

    Example::

        >>> parse_budget("70GiB")
        (75161927680, '70.00 GiB')
        >>> parse_budget("a100-80g", "2GiB")
        (83751862272, 'a100-80g (80.0 GiB) minus 2.00 GiB reserve')
    """
    if isinstance(text, str) and text.strip().lower() in GPU_PRESETS:
        name = text.strip().lower()
        total = GPU_PRESETS[name]
        keep = parse_reserve(reserve, total)
        if keep >= total:
            raise SizeError(f"reserve: {_shown(reserve)} leaves nothing of {name}'s {total / GIB:.1f} GiB: write "
                            "e.g. 10% or 2GiB")
        return total - keep, f"{name} ({total / GIB:.1f} GiB) minus {keep / GIB:.2f} GiB reserve"
    if isinstance(text, str) and re.fullmatch(r"\s*[A-Za-z][\w.-]*\s*", text) and not re.fullmatch(
            r"\s*[0-9.]+\s*[A-Za-z]*\s*", text):
        raise SizeError(f"unknown GPU preset {text!r}: use one of {', '.join(GPU_PRESETS)} or a size such as 70GiB")
    value = _read_bytes(text, "budget", allow_zero=False)
    description = format_bytes(value)
    # A reserve is taken off GPU presets only; an unreadable one is refused all the same, so a typo is not silent.
    if parse_reserve(reserve, value) and reserve != DEFAULT_RESERVE:
        description += f" (reserve {reserve} not applied: a reserve applies to GPU presets only)"
    return value, description


def parse_reserve(reserve: str | float | None, total: int) -> int:
    """Bytes of ``total`` that ``reserve`` keeps free.

    Args:
        reserve: a fraction in [0, 1) (``0.1``, ``'0.1'``), a percentage in [0%, 100%) (``'10%'``), bytes with a
            unit (``'2GiB'``; ``'0'`` is nothing) or None (nothing).
        total: the device's bytes that a fraction or percentage is taken of.

    Returns:
        The bytes kept free, rounded down (may exceed ``total`` for a byte reserve; :func:`parse_budget` refuses
        that).

    Raises:
        SizeError: a reserve that cannot be read or is out of range; the message says what to write.

    Example::

        >>> parse_reserve("10%", 1000), parse_reserve(0.25, 1000), parse_reserve("1KiB", 1000)
        (100, 250, 1024)
    """
    if reserve is None:
        return 0
    if isinstance(reserve, (int, float)) and not isinstance(reserve, bool):
        if not 0 <= reserve < 1:
            raise SizeError(f"reserve: {_shown(reserve)}: a fraction must be in [0, 1); write bytes with a unit, e.g. "
                            "2GiB")
        return int(total * reserve)
    text = str(reserve).strip()
    if text.endswith("%"):
        try:
            pct = float(text[:-1])
        except ValueError:
            raise SizeError(f"reserve: cannot read {_shown(reserve)}: write e.g. 10% or 2GiB") from None
        if not 0 <= pct < 100:
            raise SizeError(f"reserve: {_shown(reserve)} must be in [0%, 100%): write e.g. 10% or 2GiB")
        return int(total * pct / 100)
    if re.fullmatch(r"0?\.[0-9]+|0", text):
        return parse_reserve(float(text), total)
    if re.fullmatch(r"[0-9]*\.[0-9]*", text):  # '1.5': a fraction out of range, not 1.5 bytes
        raise SizeError(f"reserve: {_shown(reserve)}: a fraction must be in [0, 1); write a percentage (15%) or "
                        "bytes with a unit (2GiB)")
    return _read_bytes(text, "reserve", allow_zero=True)


# ------------------------------------------------------------------------------------------------ formatting
# NOTE [byte formatting]: every size remat prints goes through this section, so one size reads the same in
# every report. format_bytes picks the unit (for sentences: '1.50 GiB'); format_in prints in a fixed unit (for
# columns and for sentences that compare sizes: '125.0 MiB'); table_unit picks one unit for a whole table.
_FIXED_UNITS = {"B": 1, "KiB": KIB, "MiB": MIB, "GiB": GIB, "TiB": TIB}


def round_up(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple`` (an allocation's padding, a block size)."""
    return -(-n // multiple) * multiple


def format_bytes(n: float) -> str:
    """A byte count in the largest binary unit it reaches, with two decimals.

    Args:
        n: bytes (may be negative: the unit follows the magnitude).

    Returns:
        ``'<x.xx> GiB'``, ``'MiB'`` or ``'KiB'``, or ``'<n> B'`` below 1 KiB (whole bytes).

    Example::

        >>> format_bytes(75161927680), format_bytes(1536), format_bytes(-3 * MIB), format_bytes(512)
        ('70.00 GiB', '1.50 KiB', '-3.00 MiB', '512 B')
    """
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def format_in(n: float, unit: str = "MiB", digits: int = 1, *, suffix: bool = True) -> str:
    """A byte count in a fixed unit.

    Args:
        n: bytes.
        unit: ``'B'``, ``'KiB'``, ``'MiB'``, ``'GiB'`` or ``'TiB'``.
        digits: decimals.
        suffix: append ``' <unit>'``; False for table cells whose header names the unit.

    Returns:
        e.g. ``'125.0 MiB'``, or ``'125.0'`` without the suffix.

    Example::

        >>> format_in(125 * MIB), format_in(3 * MIB // 2, digits=2, suffix=False), format_in(GIB, "GiB", 0)
        ('125.0 MiB', '1.50', '1 GiB')
    """
    if unit not in _FIXED_UNITS:
        raise ValueError(f"unit={unit!r}: use one of {', '.join(_FIXED_UNITS)}")
    text = f"{n / _FIXED_UNITS[unit]:.{digits}f}"
    return f"{text} {unit}" if suffix else text


def format_mib(n: float, digits: int = 1, *, suffix: bool = True) -> str:
    """``format_in(n, 'MiB', digits, suffix=suffix)``: ``format_mib(125 * MIB) == '125.0 MiB'``."""
    return format_in(n, "MiB", digits, suffix=suffix)


def table_unit(largest: float) -> tuple[str, int]:
    """The unit a table whose largest size is ``largest`` bytes prints in: GiB from 10 GiB, MiB from 10 MiB, else
    KiB, so that every cell keeps at least two significant digits.

    Returns:
        ``(unit name, bytes per unit)``, e.g. ``table_unit(20 * GIB) == ('GiB', GIB)``; format the cells with
        :func:`format_in`.
    """
    if largest >= 10 * GIB:
        return "GiB", GIB
    return ("MiB", MIB) if largest >= 10 * MIB else ("KiB", KIB)


def format_seconds(t: float) -> str:
    """A duration with three significant digits in s, ms, us or ns: ``format_seconds(0.0123) == '12.3 ms'``."""
    for unit, size in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if t >= size:
            return f"{t / size:.3g} {unit}"
    return f"{t * 1e9:.3g} ns"
