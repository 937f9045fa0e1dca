"""Tests for remat.memory.compose: a deep step laid out from a shallow fake trace equals the full fake trace of the
deep stack, event for event and byte for byte.

The grid runs here, in this process, one test per case (no background worker). It is kept small by design: every
policy runs with each engine, and the two runs of a policy are on *complementary* configs (other style, other
dtype, other depth), so every policy meets both styles, both dtypes, both depths and both engines.
``REMAT_FULL_GRID=1`` runs the whole product instead (a few minutes).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from tiny_models import ENGINES, GPT, STYLES, with_engine

from remat.memory.compose import CompositionError, compose, shallow_stand_in
from remat.memory.predict import predict_config, trace
from remat.policy import Policy
from remat.timeline import Timeline

FULL_GRID = os.environ.get("REMAT_FULL_GRID") == "1"

# Deep enough that every policy of the grid has a shallower stand-in (a uniform group of k >= 3 layers needs about
# 3k of them: a bottom, a middle and a top group), and 11 leaves a shorter last group for every k = 2, 3, 4, 10.
DEPTHS = (10, 11)
GRID_CONFIGS = [(style, dtype, depth) for style in STYLES for dtype in ("fp32", "bf16") for depth in DEPTHS]
# A selective set changes what each layer keeps inside, not the layer roles that composition copies: the default
# grid runs one set of each kind (attention alone, norms and activation, every non-matmul operator, three modules
# together); selective/mlp and selective/core_attn+non_matmul (made of those parts) join under REMAT_FULL_GRID=1.
GRID_SELECTIVE = ["selective/core_attn", "selective/layernorm+act", "selective/non_matmul",
                  "selective/core_attn+mlp+layernorm"]
if FULL_GRID:
    GRID_SELECTIVE += ["selective/mlp", "selective/core_attn+non_matmul"]
# (label, policy at depth L): uniform k = 1, 2, 3, 4, L-1, L; block k = 1, 3, L; none; the selective sets.
GRID_POLICIES = [("none", lambda L: "none"),
                 *[(f"full/uniform/{k}", lambda L, k=k: f"full/uniform/{k}") for k in (1, 2, 3, 4)],
                 ("full/uniform/L-1", lambda L: f"full/uniform/{L - 1}"),
                 ("full/uniform/L", lambda L: f"full/uniform/{L}"),
                 ("full/block/1", lambda L: "full/block/1"), ("full/block/3", lambda L: "full/block/3"),
                 ("full/block/L", lambda L: f"full/block/{L}"),
                 *[(name, lambda L, name=name: name) for name in GRID_SELECTIVE]]


def grid_cases() -> list[tuple[str, str, int, int, str]]:
    """(style, dtype, depth, policy index, engine): see the module docstring for the design."""
    cases = []
    for i in range(len(GRID_POLICIES)):
        for e, engine in enumerate(ENGINES):
            if FULL_GRID:
                if not (i == 0 and e):  # none has no engine
                    cases += [(*c, i, engine) for c in GRID_CONFIGS]
            elif not (i == 0 and e):
                # configs are indexed by 3 bits (style, dtype, depth); the other engine gets the complement
                c = GRID_CONFIGS[(i * 3) % 8 if e == 0 else 7 - (i * 3) % 8]
                cases.append((*c, i, engine))
    if not FULL_GRID:  # none (no engine) on the complementary config too
        cases.append((*GRID_CONFIGS[7], 0, "reentrant"))
    return cases


def grid_policy(case: tuple[str, str, int, int, str]) -> str:
    _, _, depth, index, engine = case
    return with_engine(GRID_POLICIES[index][1](depth), engine)


def grid_case_id(case: tuple[str, str, int, int, str]) -> str:
    style, dtype, depth, _, _ = case
    return f"{style}-{dtype}-L{depth}-{grid_policy(case)}"


def assert_same_timeline(composed: Timeline, full: Timeline) -> None:
    assert composed.num_events == full.num_events, (composed.num_events, full.num_events)
    assert composed.nbytes == full.nbytes, "allocation sizes differ"
    assert composed.alloc_at == full.alloc_at and composed.free_at == full.free_at, "event order differs"
    assert composed.category == full.category, "categories differ"
    spans = [(p.label, start, end) for p, start, end in composed.phase_spans()]
    assert spans == [(p.label, start, end) for p, start, end in full.phase_spans()], "phases differ"
    assert np.array_equal(composed.live_bytes(), full.live_bytes()), "live curves differ"
    assert composed.peak_bytes == full.peak_bytes, (composed.peak_bytes, full.peak_bytes)
    assert composed.peak_event == full.peak_event, (composed.peak_event, full.peak_event)
    assert composed.peak_phase.label == full.peak_phase.label, (composed.peak_phase, full.peak_phase)
    assert composed.at_peak == full.at_peak, (composed.at_peak, full.at_peak)
    assert composed.meta["flops"] == full.meta["flops"], (composed.meta["flops"], full.meta["flops"])


def test_grid_design_covers_every_policy_engine_style_dtype_and_depth() -> None:
    seen: dict[str, set] = {}
    for case in grid_cases():
        style, dtype, depth, index, engine = case
        seen.setdefault(GRID_POLICIES[index][0], set()).update({style, dtype, depth, engine})
    assert len(seen) == len(GRID_POLICIES)
    for label, values in seen.items():
        engines = {"reentrant"} if label == "none" else set(ENGINES)
        assert {"gpt", "llama", "fp32", "bf16", *DEPTHS, *engines} <= values, label
    assert len({grid_case_id(c) for c in grid_cases()}) == len(grid_cases())


@pytest.mark.parametrize("case", grid_cases(), ids=grid_case_id)
def test_composed_equals_full_trace(case: tuple[str, str, int, int, str]) -> None:
    style, dtype, depth, _, _ = case
    config = STYLES[style].replace(num_layers=depth, dtype=dtype)
    policy = grid_policy(case)
    composed = predict_config(config, policy)
    assert "composition_refused" not in composed.meta, composed.meta["composition_refused"]
    assert composed.meta["composed_from"]["num_layers"] < depth, composed.meta["composed_from"]
    full = predict_config(config, policy, compose_layers=False)
    assert "composed_from" not in full.meta
    assert_same_timeline(composed, full)


def test_compose_directly_from_a_timeline_names_its_source() -> None:
    config = GPT.replace(num_layers=9)
    policy = Policy.parse("full/uniform/4")
    stand_in, small = shallow_stand_in(policy, 9)
    assert small < 9
    shallow = trace(config.replace(num_layers=small), stand_in)
    deep = compose(shallow, stand_in, policy, 9)
    assert deep.meta["composed_from"] == {"policy": str(stand_in), "num_layers": small}
    assert deep.meta["num_layers"] == 9 and deep.meta["policy"] == "full/uniform/4"
    assert_same_timeline(deep, trace(config, policy))
    assert [p.detail for p in deep.phases if p.kind == "recompute"][0] == "group 2 (layer 8)"


def test_compose_refuses_a_shallow_trace_without_the_roles_needed() -> None:
    plain = trace(GPT.replace(num_layers=2), "none")
    with pytest.raises(CompositionError, match="role"):
        compose(plain, Policy.parse("none"), Policy.parse("full/uniform/2"), 6)
