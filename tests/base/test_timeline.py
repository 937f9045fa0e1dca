"""Tests for remat.timeline: the allocation table, what is derived from it (live curve, peak, breakdown, phases),
its validation and its JSON file. Hand-made timelines, so every expected number is written out."""

from __future__ import annotations

import json

import numpy as np
import pytest

from remat.timeline import CATEGORIES, FORMAT_VERSION, Phase, Timeline, TimelineError


def hand_made() -> Timeline:
    """setup: 100 B of parameters; forward layer 0: 40 B saved, 8 B temporary; backward layer 0: 100 B of
    gradients, the 40 B freed, 16 B of temporaries freed at once.

    event: 0 alloc w(100) | 1 alloc a(40) | 2 alloc t(8) | 3 free t | 4 alloc g(100) | 5 alloc x(16) | 6 free x |
           7 free a
    live:  100, 140, 148, 140, 240, 256, 240, 200
    """
    return Timeline(
        nbytes=[100, 40, 8, 100, 16],
        alloc_at=[0, 1, 2, 4, 5],
        free_at=[-1, 7, 3, -1, 6],
        phase_index=[0, 1, 1, 2, 2],
        module=["layers.0.w", "layers.0", "layers.0", "layers.0.w", "layers.0"],
        category=["parameters", "saved_activations", "other", "gradients", "other"],
        phases=[Phase(0, "setup", ""), Phase(1, "forward", "layer 0"), Phase(4, "backward", "layer 0")],
        num_events=8,
        meta={"policy": "none", "num_layers": 1},
    )


def test_live_curve_and_peak():
    tl = hand_made()
    assert tl.live_bytes().tolist() == [100, 140, 148, 140, 240, 256, 240, 200]
    assert tl.live_bytes().dtype == np.int64
    assert (tl.peak_bytes, tl.peak_event) == (256, 5)
    assert tl.peak_phase == Phase(4, "backward", "layer 0") and tl.peak_phase.label == "backward layer 0"
    assert tl.at_peak == {**dict.fromkeys(CATEGORIES, 0), "parameters": 100, "saved_activations": 40,
                          "gradients": 100, "other": 16}
    assert list(tl.at_peak) == list(CATEGORIES)
    assert tl.forward_end == 3
    assert tl.peak_in("forward") == (2, 148) and tl.peak_in(("setup", "forward")) == (2, 148)
    assert tl.peak_in("recompute") is None
    assert [(p.label, s, e) for p, s, e in tl.phase_spans()] == [
        ("setup", 0, 1), ("forward layer 0", 1, 4), ("backward layer 0", 4, 8)]
    assert tl.top_allocations(5, n=2) == [
        {"nbytes": 100, "category": "parameters", "module": "layers.0.w", "phase": "setup"},
        {"nbytes": 100, "category": "gradients", "module": "layers.0.w", "phase": "backward layer 0"}]


def test_breakdown_adds_up_to_the_live_bytes_at_every_event():
    tl = hand_made()
    live = tl.live_bytes()
    for event in range(tl.num_events):
        parts = tl.breakdown(event)
        assert sum(parts.values()) == live[event], event
        assert set(parts) == set(CATEGORIES)
    assert tl.breakdown(2)["other"] == 8 and tl.breakdown(3)["other"] == 0  # freed at event 3


def test_peak_parts_are_the_peak_event_and_its_breakdown():
    tl = hand_made()
    assert tl.peak_parts() == (5, tl.breakdown(5)) == (tl.peak_event, tl.at_peak)
    assert sum(tl.peak_parts()[1].values()) == tl.peak_bytes == 256
    tie = Timeline(nbytes=[10, 10], alloc_at=[0, 2], free_at=[1, -1], phase_index=[0, 0], module=["a", "b"],
                   category=["other", "head_loss"], phases=[Phase(0, "forward", "")], num_events=3)
    assert tie.peak_parts() == (0, {**dict.fromkeys(CATEGORIES, 0), "other": 10})  # the first of equal peaks
    assert Timeline().peak_parts() == (0, dict.fromkeys(CATEGORIES, 0))


def test_the_first_of_equal_peaks_is_the_peak():
    tl = Timeline(nbytes=[10, 10], alloc_at=[0, 2], free_at=[1, -1], phase_index=[0, 0],
                  module=["a", "b"], category=["other", "other"], phases=[Phase(0, "forward", "")], num_events=3)
    assert tl.live_bytes().tolist() == [10, 0, 10]
    assert (tl.peak_event, tl.peak_bytes) == (0, 10)


def test_an_empty_timeline_has_no_peak():
    tl = Timeline()
    assert len(tl) == 0 and tl.peak_bytes == 0 and tl.peak_event == 0 and tl.live_bytes().tolist() == []
    tl.validate()


def test_phase_label_and_phase_at():
    assert Phase(3, "recompute", "layer 2", "group 1 (layers 2-3)").label == "recompute layer 2 [group 1 (layers 2-3)]"
    assert Phase(0, "setup", "").label == "setup"
    tl = hand_made()
    assert [tl.phase_at(e).kind for e in range(tl.num_events)] == ["setup"] + ["forward"] * 3 + ["backward"] * 4


# ------------------------------------------------------------------------------------------------ JSON
def test_save_and_load_round_trip(tmp_path):
    tl = hand_made()
    path = tl.save(tmp_path / "sub" / "step.json")
    assert path == tmp_path / "sub" / "step.json"
    data = json.loads(path.read_text())
    assert (data["format"], data["version"], data["peak_bytes"]) == ("remat.timeline", FORMAT_VERSION, 256)
    assert data["modules"] == ["layers.0", "layers.0.w"] and data["categories"] == list(CATEGORIES)
    loaded = Timeline.load(path)
    assert loaded == tl  # every field, the phases and meta included
    assert all(isinstance(p, Phase) for p in loaded.phases)
    assert Timeline.from_dict(tl.to_dict()) == tl
    assert not list(tmp_path.joinpath("sub").glob(".*.tmp"))  # written through a temporary file, none left


def test_load_names_a_file_that_is_not_json(tmp_path):
    path = tmp_path / "t.json"
    path.write_text("{not json")
    with pytest.raises(TimelineError, match=f"^{path}: not valid JSON"):
        Timeline.load(path)


@pytest.mark.parametrize("change, field", [
    (lambda d: d.update(format="other"), "'format'"),
    (lambda d: d.update(version=2), "'version'"),
    (lambda d: d["allocations"].pop("free_at"), "free_at"),
    (lambda d: d["allocations"]["module"].__setitem__(0, 7), "allocations.module"),
    (lambda d: d["allocations"]["category"].__setitem__(0, -1), "allocations.category"),
    (lambda d: d.pop("num_events"), "num_events"),
])
def test_from_dict_names_the_field(change, field):
    data = hand_made().to_dict()
    change(data)
    with pytest.raises(TimelineError, match=field):
        Timeline.from_dict(data)


# ------------------------------------------------------------------------------------------------ validate
def broken(**changes) -> Timeline:
    tl = hand_made()
    for name, value in changes.items():
        setattr(tl, name, value)
    return tl


@pytest.mark.parametrize("tl, pattern", [
    (broken(free_at=[-1, 7, 3, -1]), r"timeline field 'free_at' has 4 rows, expected 5"),
    (broken(module=["m"] * 6), r"timeline field 'module' has 6 rows, expected 5"),
    (broken(nbytes=[100, -40, 8, 100, 16]), r"allocation 1: nbytes -40 is negative"),
    (broken(category=["parameters", "activations", "other", "gradients", "other"]),
     r"allocation 1: unknown category 'activations'"),
    (broken(alloc_at=[0, 1, 2, 4, 8]), r"allocation 4: alloc_at 8 outside the step"),
    (broken(free_at=[-1, 7, 2, -1, 6]), r"allocation 2: free_at 2 is not after alloc_at"),
    (broken(free_at=[-1, 8, 3, -1, 6]),
     r"allocation 1: free_at 8 is not after alloc_at 1 and inside the step \(8 events\)"),
    (broken(phase_index=[0, 1, 1, 3, 2]), r"allocation 3: phase_index 3 names no phase \(there are 3\)"),
])
def test_validate_names_the_field(tl, pattern):
    with pytest.raises(TimelineError, match=pattern):
        tl.validate()


def test_a_valid_timeline_validates():
    hand_made().validate()


def test_the_docstring_examples_hold():
    import doctest

    import remat.timeline

    result = doctest.testmod(remat.timeline, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0, result
