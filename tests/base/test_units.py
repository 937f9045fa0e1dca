"""Tests for remat.units: the byte parser, budgets and reserves, and the byte and time formatters."""

from __future__ import annotations

import pytest

from remat.units import (
    DEFAULT_RESERVE,
    GIB,
    GPU_PRESETS,
    KIB,
    MAX_BYTES,
    MIB,
    TIB,
    SizeError,
    format_bytes,
    format_in,
    format_mib,
    format_seconds,
    parse_budget,
    parse_bytes,
    parse_reserve,
    table_unit,
)


# ------------------------------------------------------------------------------------------------ parse_bytes
@pytest.mark.parametrize("text, expected", [
    ("1B", 1), ("1b", 1), ("1KiB", KIB), ("1 MiB", MIB), ("1gib", GIB), ("1TiB", TIB),
    ("1KB", 1000), ("1MB", 10**6), ("1GB", 10**9), ("1TB", 10**12), ("  70 GiB ", 70 * GIB),
    ("1.5KiB", 1536), (".5MiB", MIB // 2), ("2.7", 2), ("1e3", 1000), ("1E3KB", 10**6), ("1e-3KiB", 1),
    (4096, 4096), (4096.9, 4096), ("1024TiB", MAX_BYTES), (MAX_BYTES, MAX_BYTES),
])
def test_parse_bytes_units(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text, pattern", [
    ("", "cannot read ''"),
    ("GiB", "cannot read 'GiB'"),
    ("-1GiB", "'-1GiB' is negative"),
    ("12XB", "unknown unit 'XB'"),
    ("1.2.3GB", "cannot read"),
    ("nan", "cannot read"),
    (True, "a number of bytes is expected, got True"),
    (None, "cannot read None"),
    ("0", "must be positive, got '0'"),
    (0, "must be positive"),
    (-5, "must be positive"),
    (float("inf"), "not a finite number"),
    (float("nan"), "not a finite number"),
])
def test_parse_bytes_refuses(text, pattern):
    with pytest.raises(SizeError, match=pattern):
        parse_bytes(text)


@pytest.mark.parametrize("text", ["1e308TiB", "1e308", "1025TiB", "1025 tib", "1e400", 1e308, 10**400, "9" * 400],
                         ids=lambda v: repr(v)[:16])
def test_parse_bytes_refuses_sizes_above_the_maximum_without_overflow(text):
    """1e308 TiB overflowed a float (OverflowError) before; a sane maximum is named instead."""
    with pytest.raises(SizeError, match=r"is too large: at most 1024 TiB \(1,125,899,906,842,624 bytes\)") as err:
        parse_bytes(text)
    assert len(str(err.value)) < 200  # a 400-digit number is cut, not printed whole


@pytest.mark.parametrize("text", ["0.5", "0.5B", 0.5, "0.0001KiB", "1e-10GiB"])
def test_a_count_below_one_byte_is_refused_not_zero(text):
    with pytest.raises(SizeError, match="is less than one byte"):
        parse_bytes(text)
    with pytest.raises(SizeError, match="^budget: .*less than one byte"):
        parse_budget(text)


# ------------------------------------------------------------------------------------------------ budgets
def test_gpu_budget_minus_reserve():
    total = GPU_PRESETS["h100-80g"]
    assert parse_budget("h100-80g") == (total - int(total * 0.10),
                                        f"h100-80g ({total / GIB:.1f} GiB) minus {int(total * 0.1) / GIB:.2f} GiB "
                                        "reserve")
    assert parse_budget(" H100-80G ", "5%")[0] == total - int(total * 0.05)
    assert parse_budget("h100-80g", 0.2)[0] == total - int(total * 0.2)
    assert parse_budget("h100-80g", "0.2")[0] == total - int(total * 0.2)
    assert parse_budget("h100-80g", "2GiB")[0] == total - 2 * GIB
    assert parse_budget("h100-80g", "0")[0] == parse_budget("h100-80g", None)[0] == total
    assert parse_budget("h100-80g", "0GiB")[0] == total


def test_byte_budget_takes_no_reserve_and_says_so():
    assert parse_budget("70GiB") == (70 * GIB, "70.00 GiB")
    assert parse_budget("70GiB", DEFAULT_RESERVE) == (70 * GIB, "70.00 GiB")
    assert parse_budget("70GiB", None) == (70 * GIB, "70.00 GiB")
    assert parse_budget("70GiB", "0") == (70 * GIB, "70.00 GiB")
    assert parse_budget("70GiB", "2GiB") == (
        70 * GIB, "70.00 GiB (reserve 2GiB not applied: a reserve applies to GPU presets only)")
    assert parse_budget(4096, "50%")[0] == 4096


@pytest.mark.parametrize("budget", ["70GiB", "h100-80g", 4096])
@pytest.mark.parametrize("reserve, pattern", [
    ("garbage", r"^reserve: cannot read 'garbage' as bytes"),
    ("ten%", r"^reserve: cannot read 'ten%'"),
    ("100%", r"^reserve: '100%' must be in \[0%, 100%\)"),
    ("-5%", r"^reserve: '-5%' must be in"),
    ("nan%", r"^reserve: 'nan%' must be in"),
    (1.5, r"^reserve: 1\.5: a fraction must be in \[0, 1\)"),
    (-0.1, r"a fraction must be in"),
    ("1e308TiB", r"^reserve: '1e308TiB' is too large: at most 1024 TiB"),
    ("12XB", r"^reserve: unknown unit 'XB'"),
])
def test_a_bad_reserve_is_refused_with_any_budget(budget, reserve, pattern):
    """A reserve is read, and refused when unreadable, even where it is not applied (a byte budget)."""
    with pytest.raises(SizeError, match=pattern):
        parse_budget(budget, reserve)


@pytest.mark.parametrize("text, pattern", [
    ("h900", "unknown GPU preset 'h900': use one of a100-40g"),
    ("1e308TiB", "^budget: '1e308TiB' is too large"),
    ("garbage5", "unknown GPU preset"),
    ("5 apples", "^budget: unknown unit 'apples'"),
])
def test_a_bad_budget_is_refused(text, pattern):
    with pytest.raises(SizeError, match=pattern):
        parse_budget(text)


def test_a_reserve_that_leaves_nothing_is_refused():
    with pytest.raises(SizeError, match=r"^reserve: '200GiB' leaves nothing of h200's 140\.4 GiB"):
        parse_budget("h200", "200GiB")


def test_parse_reserve():
    assert parse_reserve("10%", 1000) == 100
    assert parse_reserve(" 12.5% ", 1000) == 125
    assert parse_reserve(0.25, 1000) == 250
    assert parse_reserve(".5", 1000) == 500
    assert parse_reserve("1KiB", 1000) == KIB  # may exceed total; parse_budget refuses that
    assert parse_reserve(None, 1000) == parse_reserve(0, 1000) == parse_reserve("0", 1000) == 0


# ------------------------------------------------------------------------------------------------ formatting
@pytest.mark.parametrize("n, text", [
    (0, "0 B"), (512, "512 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (1536, "1.50 KiB"), (MIB, "1.00 MiB"),
    (70 * GIB, "70.00 GiB"), (3 * TIB, "3072.00 GiB"), (-3 * MIB, "-3.00 MiB"), (-100, "-100 B"),
    (1.5 * MIB, "1.50 MiB"),
])
def test_format_bytes(n, text):
    assert format_bytes(n) == text


def test_format_in_a_fixed_unit():
    assert format_in(125 * MIB) == format_mib(125 * MIB) == "125.0 MiB"
    assert format_mib(3 * MIB // 2, 2) == "1.50 MiB"
    assert format_mib(3 * MIB // 2, 2, suffix=False) == "1.50"
    assert format_in(GIB, "GiB", 0) == "1 GiB"
    assert format_in(2048, "KiB", 1, suffix=False) == "2.0"
    assert format_in(7, "B", 0) == "7 B"
    assert format_in(0.05 * MIB) == "0.1 MiB" and format_in(0.04 * MIB) == "0.0 MiB"
    with pytest.raises(ValueError, match="unit='MB': use one of B, KiB, MiB, GiB, TiB"):
        format_in(1, "MB")


@pytest.mark.parametrize("largest, unit", [
    (0, ("KiB", KIB)), (10 * MIB - 1, ("KiB", KIB)), (10 * MIB, ("MiB", MIB)), (10 * GIB - 1, ("MiB", MIB)),
    (10 * GIB, ("GiB", GIB)), (80 * GIB, ("GiB", GIB)),
])
def test_table_unit(largest, unit):
    assert table_unit(largest) == unit


@pytest.mark.parametrize("t, text", [
    (2.0, "2 s"), (12.345, "12.3 s"), (0.0123, "12.3 ms"), (1e-3, "1 ms"), (4.56e-6, "4.56 us"), (7e-9, "7 ns"),
    (0.0, "0 ns"),
])
def test_format_seconds(t, text):
    assert format_seconds(t) == text


def test_the_docstring_examples_hold():
    import doctest

    import remat.units

    result = doctest.testmod(remat.units, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0, result
