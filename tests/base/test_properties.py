"""Property tests (hypothesis) of remat's text parsers: recompute policies, Megatron flags, byte budgets.

Whatever the input, only remat's own error types may escape (PolicyError, SizeError: one-line messages the CLI
prints as they are), never a ValueError, TypeError or OverflowError of Python's; what parses round-trips.
"""

from __future__ import annotations

import dataclasses
import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from remat.policy import ENGINES, METHODS, SELECTIVE_MODULES, Policy, PolicyError
from remat.units import GPU_PRESETS, MAX_BYTES, SizeError, parse_budget, parse_bytes, parse_reserve

# No example database (nothing written into the tree); a fixed number of examples keeps the file fast.
PROPERTY = settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

# Digits that str.isdigit() or \d accept besides 0-9: superscripts, Arabic-Indic, Devanagari, fullwidth.
ODD_DIGITS = "\u00b2\u00b3\u00b9\u0660\u0661\u0669\u06f4\u0966\u096a\uff10\uff11\U0001d7ce"
NUMBERS = st.one_of(
    st.integers(-3, 40).map(str),
    st.integers(0, 10**30).map(str),
    st.text(alphabet="0123456789" + ODD_DIGITS, min_size=1, max_size=6),
    st.sampled_from(["", "+2", "-0", "1.5", "1e3", "0x10", "  3", "9" * 5000]),
)
MODULE_NAMES = st.one_of(
    st.sampled_from([*SELECTIVE_MODULES, "moe_act", "mlp,core_attn", "", "CORE_ATTN", " mlp "]),
    NUMBERS.map(lambda n: f"matmul_k{n}"),
    st.text(max_size=8),
)


@st.composite
def policy_texts(draw: st.DrawFn) -> str:
    """Short forms near the grammar: right and wrong granularities, methods, counts, modules and suffixes."""
    granularity = draw(st.sampled_from(["none", "full", "selective", "Full", "partial", ""]))
    parts = [granularity]
    if draw(st.booleans()):
        parts.append(draw(st.sampled_from([*METHODS, "sideways"])) if granularity.lower() == "full"
                     else "+".join(draw(st.lists(MODULE_NAMES, min_size=1, max_size=4))))
    if granularity.lower() == "full" and draw(st.booleans()):
        parts.append(draw(NUMBERS))
    text = draw(st.sampled_from(["/", " / ", "//"])).join(parts)
    if draw(st.booleans()):
        text += draw(st.sampled_from([",distribute", ", distribute", ",fast", ","]))
    if draw(st.booleans()):
        text += "@" + draw(st.sampled_from([*ENGINES, "sac", "", "reentrant@reentrant"]))
    return text


@st.composite
def policies(draw: st.DrawFn) -> Policy:
    """Valid policies of every kind."""
    engine = draw(st.sampled_from(ENGINES))
    kind = draw(st.sampled_from(["none", "uniform", "block", "selective"]))
    if kind == "none":
        return Policy(engine=engine)
    if kind in METHODS:
        low = 1 if kind == "uniform" else 0
        return Policy("full", kind, draw(st.integers(low, 10**6)), engine=engine,
                      distribute_saved_activations=draw(st.booleans()))
    modules = draw(st.sets(st.sampled_from(["core_attn", "mlp", "layernorm", "act"]), min_size=1))
    if draw(st.booleans()):  # operator-level: non_matmul, without what it already recomputes
        modules = (modules - {"layernorm", "act"}) | {"non_matmul"}
        if draw(st.booleans()):
            modules.add(f"matmul_k{draw(st.integers(1, 10**9))}")
    return Policy("selective", modules=tuple(modules), engine=engine)


MEGATRON_TOKENS = st.sampled_from([
    "--recompute-granularity", "--recompute-method", "--recompute-num-layers", "--recompute-modules",
    "--recompute-activations", "--distribute-saved-activations", "--recompute-granularity=full",
    "--recompute-method=block", "--recompute-num-layers=", "--recompute-modules=mlp", "--recompute-gran",
    "--checkpoint-activations", "--moe-layer-recompute", "--bf16", "--num-layers", "24", "full", "selective",
    "uniform", "block", "none", "core_attn", "mlp", "act", "non_matmul", "matmul_k64", "moe_act", "-1", "2",
    "\u00b2", "\u0663", "", " ",
])
MEGATRON_ARGV = st.one_of(
    st.lists(MEGATRON_TOKENS, max_size=10),
    st.lists(MEGATRON_TOKENS, max_size=10).map(" ".join),
    st.lists(st.one_of(MEGATRON_TOKENS, st.sampled_from(["'", '"', "\\", "'full'", '"a b'])), max_size=8).map(
        " ".join),
    st.text(max_size=40),
    st.one_of(st.none(), st.integers(), st.binary(max_size=5), st.lists(st.integers(), min_size=1, max_size=3),
              st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=2)),
)

UNITS = ["", "B", "b", "KiB", "MiB", "GiB", "TiB", "kb", "MB", "GB", "TB", "PiB", "XB", "%"]
BYTE_TEXTS = st.one_of(
    st.builds(lambda n, sp, u: f"{n}{sp}{u}",
              st.one_of(st.floats(allow_nan=True, allow_infinity=True).map(repr),
                        st.integers(-10**20, 10**400).map(str), NUMBERS,
                        st.sampled_from(["1e308", "1e-308", ".5", "0.", "1e400", "nan", "inf", "-0"])),
              st.sampled_from(["", " ", "\t"]), st.sampled_from(UNITS)),
    st.text(max_size=12),
    st.sampled_from([*GPU_PRESETS, "H100-80G", " h200 ", "h900", "garbage"]),
)
BYTE_VALUES = st.one_of(BYTE_TEXTS, st.integers(-10**20, 10**400), st.floats(), st.booleans(), st.none())
RESERVES = st.one_of(st.none(), st.floats(), st.integers(-3, 3), BYTE_TEXTS,
                     st.floats(allow_nan=True).map(lambda f: f"{f}%"), st.sampled_from(["10%", "0", ".25", "2GiB"]))


def policy_or_none(parse, value):
    """``parse(value)``, or None when it raises PolicyError; any other exception fails the test."""
    try:
        return parse(value)
    except PolicyError as err:
        assert str(err), "an error message must say what is wrong"
        return None


def size_or_none(parse, *args):
    try:
        return parse(*args)
    except SizeError as err:
        assert str(err)
        return None


# ------------------------------------------------------------------------------------------------ policies
@PROPERTY
@given(st.one_of(policy_texts(), st.text(max_size=30)))
def test_policy_parse_raises_only_policy_error_and_round_trips(text: str) -> None:
    policy = policy_or_none(Policy.parse, text)
    if policy is not None:
        assert Policy.parse(str(policy)) == policy
        assert str(Policy.parse(str(policy))) == str(policy)


@PROPERTY
@given(st.one_of(st.none(), st.integers(), st.floats(), st.binary(), st.lists(st.text(max_size=3), max_size=2)))
def test_policy_parse_refuses_what_is_not_text(value: object) -> None:
    assert policy_or_none(Policy.parse, value) is None


@PROPERTY
@given(policies())
def test_every_policy_round_trips_through_its_short_form(policy: Policy) -> None:
    assert Policy.parse(str(policy)) == policy


@PROPERTY
@given(policies())
def test_every_policy_with_megatron_flags_round_trips_through_them(policy: Policy) -> None:
    argv = policy_or_none(lambda p: p.to_megatron_args(), policy)
    if argv is None:  # act and non_matmul are remat's own: no Megatron flag
        assert {"act", "non_matmul"} & set(policy.modules)
        return
    expected = dataclasses.replace(policy, engine="reentrant")  # Megatron has one engine
    assert Policy.from_megatron_args(argv) == expected
    assert Policy.from_megatron_args(" ".join(argv)) == expected


@PROPERTY
@given(MEGATRON_ARGV)
def test_from_megatron_args_raises_only_policy_error(argv: object) -> None:
    policy = policy_or_none(Policy.from_megatron_args, argv)
    if policy is not None:
        assert policy.engine == "reentrant"
        assert Policy.parse(str(policy)) == policy


# ------------------------------------------------------------------------------------------------ bytes
@PROPERTY
@given(BYTE_VALUES)
def test_parse_bytes_raises_only_size_error_and_gives_whole_positive_bytes(value: object) -> None:
    nbytes = size_or_none(parse_bytes, value)
    if nbytes is not None:
        assert isinstance(nbytes, int) and 1 <= nbytes <= MAX_BYTES


@PROPERTY
@given(st.integers(1, MAX_BYTES), st.sampled_from(["", "B", "KiB", "MiB", "GiB", "KB", "MB", "GB"]))
def test_parse_bytes_reads_whole_units_exactly(count: int, unit: str) -> None:
    size = {"": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "KB": 10**3, "MB": 10**6,
            "GB": 10**9}[unit]
    nbytes = size_or_none(parse_bytes, f"{count}{unit}")
    if count * size <= MAX_BYTES and count < 2**53:  # below float's exact-integer range, the count is exact
        assert nbytes == count * size
    elif count * size > MAX_BYTES * 1.0001:
        assert nbytes is None


@PROPERTY
@given(BYTE_VALUES, RESERVES)
def test_parse_budget_raises_only_size_error(budget: object, reserve: object) -> None:
    result = size_or_none(parse_budget, budget, reserve)
    if result is not None:
        nbytes, description = result
        assert isinstance(nbytes, int) and 1 <= nbytes <= MAX_BYTES and description


@PROPERTY
@given(RESERVES, st.integers(0, MAX_BYTES))
def test_parse_reserve_raises_only_size_error(reserve: object, total: int) -> None:
    kept = size_or_none(parse_reserve, reserve, total)
    if kept is not None:
        assert isinstance(kept, int) and kept >= 0
        if isinstance(reserve, float) and math.isfinite(reserve) or isinstance(reserve, str) and "%" in reserve:
            assert kept <= total
