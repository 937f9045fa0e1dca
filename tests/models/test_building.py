"""Tests for remat.models.gpt.building: a build without data (meta, fake) skips torch.nn.init (NOTE [no
initialisation without data]); a build with data initialises as before, and the same fake trace comes out."""

from __future__ import annotations

import torch
from tiny_models import LLAMA
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from remat.models.gpt import build_model, building, holds_no_data
from remat.parallel.chunk_trace import trace_chunk


def _init_calls(device: str, fake: bool) -> int:
    calls = []
    real = nn.init.normal_

    def counting(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append(tensor.shape)
        return real(tensor, *args, **kwargs)

    nn.init.normal_ = counting
    try:
        if fake:
            with FakeTensorMode():
                build_model(LLAMA, device, seed=None)
        else:
            build_model(LLAMA, device)
    finally:
        nn.init.normal_ = real
    return len(calls)


def test_builds_without_data_skip_initialisation_and_builds_with_data_do_not() -> None:
    assert not holds_no_data("cpu") and holds_no_data("meta")
    with FakeTensorMode():
        assert holds_no_data("cpu")
    assert _init_calls("cpu", fake=False) > 0  # the embedding's normal_, at least
    assert _init_calls("meta", fake=False) == 0
    assert _init_calls("cpu", fake=True) == 0
    real = nn.init.normal_
    with building(LLAMA, "meta"):
        assert nn.init.normal_ is not real
    assert nn.init.normal_ is real  # put back
    first = next(build_model(LLAMA, "cpu", seed=0).parameters())  # a real build still initialises: seeded, the
    assert first.std() > 0 and torch.equal(first, next(build_model(LLAMA, "cpu", seed=0).parameters()))  # same


def test_a_fake_trace_is_the_same_with_initialisation_skipped(monkeypatch) -> None:
    import remat.models.gpt as gpt

    skipped = trace_chunk(LLAMA, (True, True, 2), "full/uniform/1", compose_layers=False).timeline
    monkeypatch.setattr(gpt, "holds_no_data", lambda device: False)  # initialise as a build with data does
    monkeypatch.setattr("remat.parallel.chunk_trace._TRACES", {})
    initialised = trace_chunk(LLAMA, (True, True, 2), "full/uniform/1", compose_layers=False).timeline
    for column in ("nbytes", "alloc_at", "free_at", "phase_index", "module", "category", "num_events"):
        assert getattr(skipped, column) == getattr(initialised, column), column
