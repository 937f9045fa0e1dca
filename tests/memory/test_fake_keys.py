"""remat.memory.fake_keys: the fake mode's cache keys made by remat's function equal torch's, operator by operator,
over whole traced steps (NOTE [fast fake-tensor cache keys])."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from remat.config import ModelConfig
from remat.memory import fake_keys
from remat.memory.fake_keys import fast_cache_keys
from remat.memory.kernels import use_kernels
from remat.memory.predict import predict, predict_config


def _key(cache_key, mode, state, func, args, kwargs):
    try:
        return cache_key(mode, state, func, args, kwargs)
    except Exception as err:  # torch's bypasses: the same exception, the same reason
        return type(err), str(err)


@pytest.fixture
def compared(monkeypatch):
    """Every cache key a fake mode computes with remat's function, beside torch's for the same operator."""
    pairs = []
    torchs_key = FakeTensorMode._cache_key

    def both(mode, state, func, args, kwargs):
        ours_prep = vars(mode).get("_prep_args_for_hash")
        if ours_prep is None:
            return torchs_key(mode, state, func, args, kwargs)
        del mode._prep_args_for_hash
        try:
            theirs = _key(torchs_key, mode, state, func, args, kwargs)
        finally:
            mode._prep_args_for_hash = ours_prep
        ours = _key(torchs_key, mode, state, func, args, kwargs)
        pairs.append((func, theirs, ours))
        if isinstance(ours, tuple):
            raise ours[0](ours[1])
        return ours

    monkeypatch.setattr(FakeTensorMode, "_cache_key", both)
    return pairs


@pytest.mark.parametrize("kernels", ["cpu", "cuda"])
def test_keys_equal_torchs_over_a_tensor_parallel_step(compared, kernels):
    assert fake_keys.SUPPORTED, "torch's TensorMetadata changed: check _prep_args against it"
    config = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, seq_length=16,
                         vocab_size=64, dtype="bf16", attention="sdpa", activation="swiglu")
    with use_kernels(kernels):
        predict_config(config, "selective/core_attn", tp=2, sp=True)
        predict(config.replace(num_layers=1), "full/uniform/1")
    assert len(compared) > 300
    differ = [(str(func), theirs, ours) for func, theirs, ours in compared if theirs != ours]
    assert not differ, differ[:3]
    bypassed = sum(isinstance(ours, tuple) for _, _, ours in compared)
    assert bypassed < len(compared)  # most operators are cached, so the fast path is what made their keys


def test_installed_only_inside_and_only_on_fake_modes():
    torchs = vars(FakeTensorMode)["_prep_args_for_hash"]
    mode = FakeTensorMode()
    with fast_cache_keys(mode):
        assert "_prep_args_for_hash" in vars(mode)
        with fast_cache_keys(mode):  # nested: the outer one keeps it
            pass
        assert "_prep_args_for_hash" in vars(mode)
        with mode:
            x = torch.empty(3, 4)
            assert (x @ x.t()).shape == (3, 3)
    assert "_prep_args_for_hash" not in vars(mode)
    with fast_cache_keys(None):  # no fake mode (a real step): nothing to do
        pass
    assert vars(FakeTensorMode)["_prep_args_for_hash"] is torchs  # the class (every other fake mode) untouched
