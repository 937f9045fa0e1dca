"""Tests for remat.memory.roles' stand-in search: shallow_stand_ins and shallow_stand_ins_of_kinds yield exactly
the shallow (policy, depth[, layer kinds]) that a plain search over every depth, layer count and kind pattern
finds, in the same order (the search skips depths with fewer layers than the deep stack has roles, and makes
each candidate policy once)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest

from remat.memory.roles import role_set, shallow_stand_ins, shallow_stand_ins_of_kinds
from remat.policy import Policy


def candidates(policy: Policy, depth: int) -> list[Policy]:
    if policy.granularity != "full":
        return [policy]
    low = 1 if policy.method == "uniform" else 0
    return [dataclasses.replace(policy, num_layers=k) for k in range(low, min(policy.num_layers, depth) + 1)]


def every_stand_in(policy: Policy, depth: int, max_depth: int) -> list[tuple[Policy, int]]:
    need = role_set(policy, depth)
    return [(c, n) for n in range(1, min(depth, max_depth) + 1) for c in candidates(policy, n)
            if need <= role_set(c, n)]


def every_stand_in_of_kinds(policy: Policy, kinds: Sequence[str], max_depth: int,
                            ) -> list[tuple[Policy, int, tuple[str, ...]]]:
    need = role_set(policy, len(kinds), kinds)
    names = sorted(set(kinds))
    out = []
    for n in range(1, min(len(kinds), max_depth) + 1):
        patterns = {tuple(kinds[:n]), tuple(kinds[-n:])}
        patterns |= {(a,) * i + (b,) * (n - i) for a in names for b in names for i in range(n + 1)}
        out += [(c, n, p) for c in candidates(policy, n) for p in sorted(patterns) if need <= role_set(c, n, p)]
    return out


POLICIES = ["none", "selective/core_attn", "full/uniform/1", "full/uniform/2", "full/uniform/3", "full/uniform/7",
            "full/uniform/80", "full/block/1", "full/block/5", "full/block/80"]


@pytest.mark.parametrize("text", POLICIES)
def test_shallow_stand_ins_are_every_covering_stack_in_order(text: str) -> None:
    policy = Policy.parse(text)
    found = list(shallow_stand_ins(policy, 80, max_depth=10))
    assert found == every_stand_in(policy, 80, 10)
    assert found, f"{text} on 80 layers has a stand-in of at most 10 layers"


@pytest.mark.parametrize("text", ["none", "selective/mlp", "full/uniform/3", "full/uniform/4", "full/block/2"])
@pytest.mark.parametrize("kinds", [("dense",) * 3 + ("moe",) * 20, ("dense", "moe") * 8])
def test_stand_ins_of_kinds_are_every_covering_stack_in_order(text: str, kinds: tuple[str, ...]) -> None:
    policy = Policy.parse(text)
    found = list(shallow_stand_ins_of_kinds(policy, kinds, max_depth=9))
    assert found == every_stand_in_of_kinds(policy, kinds, 9)
