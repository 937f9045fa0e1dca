"""The on-disk cache (remat.memory.disk_cache) of unit models, shallow traces and plan validations: round trips are
exact, a warm cache answers what a cold one does, corrupt or foreign entries are ignored with a warning and
rebuilt, and --no-cache / REMAT_NO_CACHE leave the folder untouched."""

from __future__ import annotations

import copy
import importlib
import json
from pathlib import Path

import pytest

from remat.cli import main
from remat.config import ModelConfig
from remat.memory import disk_cache
from remat.memory import predict as memory_predict
from remat.memory.predict import predict_config
from remat.plan import megatron as plan_megatron
from remat.plan.api import plan
from remat.plan.costs import candidate_units
from remat.plan.solver import min_peak
from remat.plan.unit_model import model_from_dict, model_to_dict, unit_model
from remat.recompute.plan_format import KEEP, Unit

plan_unit_model = importlib.import_module("remat.plan.unit_model")  # remat.plan's unit_model is the function
CFG = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, micro_batch_size=2,
                  vocab_size=128)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh cache folder, and no in-memory caches: every answer comes from a trace or from disk."""
    monkeypatch.setenv(disk_cache.CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(disk_cache.NO_CACHE_ENV, raising=False)
    disk_cache.set_enabled(True)
    _forget()
    yield tmp_path
    disk_cache.set_enabled(True)
    _forget()


def _forget() -> None:
    memory_predict.SHALLOW_TRACES.clear()
    plan_unit_model.UNIT_MODELS.clear()
    plan_megatron.forget_predictions()


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.json"))


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, Path, str]:
    """unit_model(CFG) built once, from traces, into a cache folder of its own: the model, and its stored entry
    (path relative to the folder, text). Shared by the tests that read a fresh build without changing it."""
    root = tmp_path_factory.mktemp("built")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(disk_cache.CACHE_ENV, str(root))
        patch.delenv(disk_cache.NO_CACHE_ENV, raising=False)
        disk_cache.set_enabled(True)
        _forget()
        model = unit_model(CFG)
        _forget()
    [path] = [p for p in _files(root) if p.parent.name == "unit_model"]
    return model, path.relative_to(root), path.read_text()


def test_unit_model_round_trip_is_exact(built: tuple[object, Path, str]) -> None:
    model = copy.deepcopy(built[0])  # the shared build stays as built
    model.shape(Unit("checkpoint", 7))  # an expanded group is kept too
    assert model_from_dict(json.loads(json.dumps(model_to_dict(model)))) == model


def test_store_and_load(cache: Path) -> None:
    disk_cache.store("thing", {"a": 1}, {"x": [1, 2]})
    assert disk_cache.load("thing", {"a": 1}) == {"x": [1, 2]}
    assert disk_cache.load("thing", {"a": 2}) is None
    with disk_cache.disabled():
        assert disk_cache.load("thing", {"a": 1}) is None


@pytest.mark.parametrize("content", ["{not json", json.dumps({"format": "remat.cache", "version": 1,
                                                               "key": {"kind": "other"}, "payload": 3}), "[]"])
def test_corrupt_or_foreign_entry_is_ignored_with_a_warning(cache: Path, content: str) -> None:
    disk_cache.store("thing", {"a": 1}, 5)
    [path] = _files(cache)
    path.write_text(content)
    with pytest.warns(UserWarning, match="corrupt or not a remat thing entry"):
        assert disk_cache.load("thing", {"a": 1}) is None
    disk_cache.store("thing", {"a": 1}, 6)  # rebuilt in place
    assert disk_cache.load("thing", {"a": 1}) == 6


def test_warm_plan_is_the_cold_plan_and_reads_no_trace(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = unit_model(CFG)
    low = min_peak(model, CFG.num_layers, candidate_units(CFG.num_layers))
    budget = (low + model.peak([KEEP] * CFG.num_layers)) // 2
    for path in _files(cache):
        path.unlink()
    _forget()
    cold = plan(CFG, budget)
    assert {p.parent.name for p in _files(cache)} >= {"unit_model", "shallow_trace", "predicted"}
    _forget()

    def no_trace(*args: object, **kwargs: object) -> None:
        raise AssertionError("a warm cache must not trace")

    monkeypatch.setattr(memory_predict, "trace_rank", no_trace)
    monkeypatch.setattr(plan_megatron, "trace_rank", no_trace)
    monkeypatch.setattr(plan_unit_model, "marked_trace", no_trace)
    warm = plan(CFG, budget)
    assert warm.to_dict()["extended"] == cold.to_dict()["extended"]
    assert warm.to_dict()["megatron"] == cold.to_dict()["megatron"]


def test_corrupt_unit_model_entry_is_rebuilt(cache: Path, built: tuple[object, Path, str]) -> None:
    first, entry, text = built  # the entry unit_model(CFG) stores, truncated
    (cache / entry).parent.mkdir(parents=True, exist_ok=True)
    (cache / entry).write_text(text[:50])
    with pytest.warns(UserWarning, match="corrupt"):
        again = unit_model(CFG)
    assert model_to_dict(again) | {"build_seconds": 0} == model_to_dict(first) | {"build_seconds": 0}
    assert json.loads((cache / entry).read_text())["key"] == json.loads(text)["key"]  # rewritten in place


def test_shallow_trace_from_disk_gives_the_same_timeline(cache: Path) -> None:
    deep = CFG.replace(num_layers=12)
    cold = predict_config(deep, "full/uniform/2")
    memory_predict.SHALLOW_TRACES.clear()
    warm = predict_config(deep, "full/uniform/2")
    assert warm.to_dict() == cold.to_dict()


@pytest.mark.parametrize("how", ["flag", "env"])
def test_no_cache_writes_nothing(cache: Path, monkeypatch: pytest.MonkeyPatch, how: str,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--layers", "4", "--hidden", "64", "--heads", "4", "--seq", "32", "--batch", "2", "--vocab",
            "128", "--budget", "64MiB"]
    if how == "flag":
        args.append("--no-cache")
    else:
        monkeypatch.setenv(disk_cache.NO_CACHE_ENV, "1")
    assert main(args) == 0
    assert _files(cache) == []
    assert "Best extended plan" in capsys.readouterr().out
