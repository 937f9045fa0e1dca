"""The stage search (remat.plan.pipeline.solve_stage) answers exactly what the plain grid of solves answers, and
its disk-cached answer is the searched one; rank parameters read back from the disk cache are the built ones; a
unit model built in a forked process (remat.plan.unit_prefetch) is the one built here."""

from __future__ import annotations

from pathlib import Path

import pytest

from remat.config import ModelConfig
from remat.memory import disk_cache
from remat.memory.rank_state import forget_parameters, rank_parameters
from remat.memory.trace_pool import available_workers
from remat.plan import pipeline
from remat.plan.costs import CostModel, candidate_units
from remat.plan.solver import Solution, min_peak, solve
from remat.plan.unit_model import (
    PENDING,
    UNIT_MODELS,
    group_stack,
    layer_stack,
    model_to_dict,
    stack_shapes,
    unit_model,
)
from remat.plan.unit_prefetch import cancel_prefetches, prefetch_unit_model
from remat.recompute.plan_format import KEEP

CFG = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, micro_batch_size=2,
                  vocab_size=128)


def grid_search(model, num_layers, budget, in_flight, cost, units, max_stored) -> Solution | None:
    """The stage search as first written: every cap of the grid solved, then the refined grid (the reference)."""
    if in_flight <= 1:
        return solve(model, num_layers, budget, cost, units=units)
    best = None
    grid = sorted({int(max_stored * k / 32) for k in range(33)})
    for _ in range(2):
        for cap in grid:
            sol = solve(model, num_layers, budget - (in_flight - 1) * cap, cost, units=units, stored_cap=cap)
            if sol is not None and (best is None or sol.cost < best.cost):
                best = sol
        if best is None:
            return None
        used = sum(model.shape(u).forward.net for u in best.units)
        step = max(1, (grid[1] - grid[0]) if len(grid) > 1 else 1)
        grid = sorted({max(0, used + int(step * k / 16)) for k in range(-16, 17)})
    return best


@pytest.fixture(scope="module")
def model():
    return unit_model(CFG)


@pytest.mark.parametrize("objective", ["time", "extra_flops"])
def test_the_stage_search_is_the_plain_grid_search(model, objective: str) -> None:
    L = CFG.num_layers
    units = candidate_units(L, contractions=model.contractions)
    cost = CostModel(objective=objective)
    stored = sum(model.shape(KEEP).forward.net for _ in range(L))
    low, high = min_peak(model, L, units), model.peak([KEEP] * L)
    checked = 0
    for in_flight in (1, 2, 3):
        extra = (in_flight - 1) * stored
        for share in (0.0, 0.2, 0.5, 0.8, 1.0, 1.3):  # from nothing fits to keeping every layer fits
            budget = int(low + share * (high + extra - low))
            want = grid_search(model, L, budget, in_flight, cost, units, stored)
            got = pipeline.search_stage(model, L, budget, in_flight, cost, units, stored)
            assert (got is None) == (want is None)
            if want is not None:
                assert (got.units, got.cost, got.model_peak) == (want.units, want.cost, want.model_peak)
                checked += 1
    assert checked >= 10


def test_a_stored_stage_answer_is_the_searched_one(model, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(disk_cache.CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(disk_cache.NO_CACHE_ENV, raising=False)
    L = CFG.num_layers
    units = candidate_units(L, contractions=model.contractions)
    stored = sum(model.shape(KEEP).forward.net for _ in range(L))
    budget = (min_peak(model, L, units) + model.peak([KEEP] * L) + stored) // 2
    cold = pipeline.solve_stage(model, L, budget, 2, CostModel(), units, stored)
    assert cold is not None and list(tmp_path.glob("stage_solution/*.json"))

    def no_search(*args: object) -> None:
        raise AssertionError("a stored answer must not be searched again")

    monkeypatch.setattr(pipeline, "search_stage", no_search)
    warm = pipeline.solve_stage(model, L, budget, 2, CostModel(), units, stored)
    assert (warm.units, warm.cost, warm.model_peak) == (cold.units, cold.cost, cold.model_peak)


def test_rank_parameters_read_back_are_the_built_ones(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(disk_cache.CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(disk_cache.NO_CACHE_ENV, raising=False)
    args = dict(first=True, last=False, num_layers=3, tp=2, sp=True, pipelined=True, layer_offset=0)
    forget_parameters()
    with disk_cache.disabled():
        built = rank_parameters(CFG, **args)
    forget_parameters()
    stored = rank_parameters(CFG, **args)  # built, and stored
    forget_parameters()
    assert list(tmp_path.glob("rank_parameters/*.json"))
    assert rank_parameters(CFG, **args) == stored == built  # read back from disk
    forget_parameters()


def test_a_prefetched_unit_model_is_the_built_one(model) -> None:
    if available_workers() <= 1:
        pytest.skip("one core: nothing is built on the side")
    UNIT_MODELS.clear()
    assert prefetch_unit_model(CFG)  # built in a forked process, taken by the next unit_model call
    got = unit_model(CFG)
    assert got is not model and got.shapes and all(model.shape(u) == shape for u, shape in got.shapes.items())

    def fixed(m) -> dict:  # what is built, without the groups expanded on demand since
        return model_to_dict(m) | {"build_seconds": 0, "shapes": None}

    assert fixed(got) == fixed(model)
    UNIT_MODELS.clear()
    assert prefetch_unit_model(CFG) and PENDING
    cancel_prefetches()  # not wanted: stopped; unit_model would build its own
    assert not PENDING
    UNIT_MODELS.clear()


@pytest.mark.parametrize("engine", ["reentrant", "non-reentrant"])
def test_a_units_shape_is_the_same_in_either_profile_stack(engine) -> None:
    """NOTE [the unit model]: the two profile stacks (traced side by side) give every unit the shape that one stack
    of all the units gives it, and the same group pieces."""
    model = unit_model(CFG, engine=engine)
    layers, groups = layer_stack(CFG, model.contractions), group_stack(CFG, engine)
    shapes, pieces = stack_shapes(CFG, layers + groups[1:], device="cpu", engine=engine, tp=1, sp=False)
    assert len(shapes) == len(layers) + len(groups) - 2 and pieces.keys() == model.group_pieces.keys()
    assert shapes == {u: model.shapes[u] for u in shapes} and pieces == model.group_pieces
