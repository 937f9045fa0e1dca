"""remat.memory.fake_hits: the outputs a fake mode makes from its cache with remat's function equal torch's, operator
by operator, over whole traced steps (NOTE [fast fake-tensor cache hits]); the cache hits a recorder makes itself give
the step the fake mode's dispatch gives (NOTE [fake cache hits without a dispatch])."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from remat.config import ModelConfig
from remat.memory.fake_hits import (
    UNCACHED,
    answers_from_cache,
    cached_output,
    fake_tensor_mode,
    fast_cache_hits,
    supported,
)
from remat.memory.kernels import use_kernels
from remat.memory.predict import predict, predict_config, trace

NAME = "_get_output_tensor_from_cache_entry"


def _described(t: object) -> object:
    """Everything a later operator, autograd or remat's recorder can read off an output."""
    if not isinstance(t, torch.Tensor):
        return t
    with warnings.catch_warnings():
        # a fake tensor's data pointer raises, or warns (once a process: not compared) where its mode allows it
        warnings.simplefilter("ignore")
        try:
            t.data_ptr()
            pointer = "no error"
        except RuntimeError as err:
            pointer = str(err)
    return (type(t), dict(vars(t)), torch._C._dispatch_keys(t), t.shape, t.stride(), t.storage_offset(), t.dtype,
            t.device, t.requires_grad, t.is_leaf, t._version, t.is_inference(), t.untyped_storage().nbytes(),
            pointer)


@pytest.fixture
def compared(monkeypatch):
    """Every cache hit made by remat's function, beside torch's output for the same entry: (operator, torch's
    description, remat's, whether each output shares the storage it must)."""
    pairs = []
    torchs = FakeTensorMode._output_from_cache_entry

    def both(mode, state, entry, key, func, args):
        ours_function = vars(mode).get(NAME)
        if ours_function is None:
            return torchs(mode, state, entry, key, func, args)
        delattr(mode, NAME)
        try:
            theirs = torchs(mode, state, entry, key, func, args)
        finally:
            setattr(mode, NAME, ours_function)
        ours = torchs(mode, state, entry, key, func, args)
        outputs = list(zip(theirs, ours)) if entry.is_output_tuple else [(theirs, ours)]
        for (t, o), info in zip(outputs, entry.output_infos):
            if isinstance(o, torch.Tensor) and info.inplace_idx is None:
                # a view shares its input's storage; anything else is new
                storages = {x.untyped_storage()._cdata for x in (t, o)}
                shared = len(storages) == 1 if func.is_view else len(storages) == 2
            else:
                shared = o is t  # in-place outputs, constants: the same object
            pairs.append((func, _described(t), _described(o), shared))
        return ours

    monkeypatch.setattr(FakeTensorMode, "_output_from_cache_entry", both)
    return pairs


def _check(pairs: list) -> None:
    assert len(pairs) > 300
    differ = [(str(func), [(a, b) for a, b in zip(theirs, ours) if a != b])
              for func, theirs, ours, _ in pairs if theirs != ours]
    assert not differ, differ[:2]
    assert all(shared for *_, shared in pairs)
    views = sum(func.is_view for func, *_ in pairs)
    assert 0 < views < len(pairs)  # both kinds made by the fast path


@pytest.mark.parametrize("kernels", ["cpu", "cuda"])
def test_outputs_equal_torchs_over_a_tensor_parallel_step(compared, kernels):
    assert supported(), "torch's FakeTensor constructor changed: check _output_from_entry against it"
    config = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, seq_length=16,
                         vocab_size=64, dtype="bf16", attention="sdpa", activation="swiglu")
    with use_kernels(kernels):
        predict_config(config, "selective/core_attn", tp=2, sp=True)
        predict(config.replace(num_layers=1), "full/uniform/1")
    _check(compared)


def test_outputs_equal_torchs_over_an_moe_step(compared):
    config = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=64,
                         dtype="bf16", num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=96,
                         moe_grouped_gemm=True)
    predict_config(config, "selective/moe_act", device="cuda")
    _check(compared)


def test_torchs_own_crosscheck_passes():
    """torch's debugging mode dispatches each cache hit again, uncached, and compares: it finds the fast outputs
    equal too.

    The trace starts from an empty cache (the process's entries are put back after): the cross-check also compares
    ``is_leaf``, and the in-place softmax division of the vocab-parallel cross entropy (remat.models.cross_entropy),
    when its first call in the step is a hit of an entry an earlier trace made, is a leaf from the cache and not
    from a fresh dispatch; whether such an entry exists depends on what the process traced before. The step's
    timeline is the same either way (checked below, with the cache as the process has it)."""
    from remat.memory.predict import trace_rank
    from remat.policy import Policy

    config = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=64)
    policy = Policy.parse("selective/core_attn")
    kept = dict(FakeTensorMode.cache)
    FakeTensorMode.cache.clear()
    hits = FakeTensorMode.cache_hits
    try:
        with torch._dynamo.config.patch(fake_tensor_cache_crosscheck_enabled=True):
            checked = trace_rank(config, policy, tp=2, sp=True)
        assert FakeTensorMode.cache_hits > hits + 100
    finally:
        FakeTensorMode.cache.update(kept)
    assert checked.to_dict() == trace_rank(config, policy, tp=2, sp=True).to_dict()


def test_installed_only_inside_and_only_on_fake_modes():
    torchs = vars(FakeTensorMode)[NAME]
    mode = FakeTensorMode()
    with fast_cache_hits(mode):
        assert NAME in vars(mode)
        with fast_cache_hits(mode):  # nested: the outer one keeps it
            pass
        assert NAME in vars(mode)
        with mode:
            x = torch.empty(3, 4)
            y = x @ x.t()
            z = x @ x.t()  # a cache hit
            assert type(z) is FakeTensor and z.shape == y.shape == (3, 3) and z.fake_mode is mode
            assert x.t().untyped_storage()._cdata == x.untyped_storage()._cdata
    assert NAME not in vars(mode)
    with fast_cache_hits(None):  # no fake mode (a real step): nothing to do
        pass
    assert vars(FakeTensorMode)[NAME] is torchs  # the class (every other fake mode) untouched


def test_a_traces_fake_mode_is_fast_from_its_start():
    """fake_tensor_mode: the model's construction already makes its keys and hits the faster ways (the recorder's
    own block, entered inside, keeps them); real tensors are refused; nothing is left on the mode after."""
    real = torch.ones(2, 2)
    with fake_tensor_mode() as mode:
        assert isinstance(mode, FakeTensorMode)
        assert {NAME, "_prep_args_for_hash"} <= set(vars(mode))
        layer = torch.nn.Linear(4, 4)  # built in the mode: fake parameters, made through the fast methods
        assert isinstance(layer.weight, FakeTensor) and layer.weight.fake_mode is mode
        hits = FakeTensorMode.cache_hits
        torch.nn.Linear(4, 4)  # the same construction again: cache hits
        assert FakeTensorMode.cache_hits > hits
        on_gpu = torch.empty(3, 4, device="cuda")  # (a fake device: no GPU needed)
        hits = FakeTensorMode.cache_hits
        outputs = [on_gpu + 1 for _ in range(3)]  # hits after the first: the entry's device, normalised once
        assert FakeTensorMode.cache_hits >= hits + 2
        assert [o.device for o in outputs] == [on_gpu.device] * 3 == [torch.device("cuda", 0)] * 3
        with pytest.raises(Exception, match="allow_non_fake_inputs"):
            layer.weight + real
    assert not {NAME, "_prep_args_for_hash"} & set(vars(mode))


def test_a_fast_output_warns_on_its_data_pointer_as_torchs_do():
    """Fake modes allow a data pointer's read with a warning by default; torch warns once a process, so the first read
    is in a fresh one, of an output the fast path made."""
    code = textwrap.dedent("""
        import warnings
        import torch
        from torch._subclasses.fake_tensor import FakeTensorMode
        from remat.memory.fake_hits import fast_cache_hits
        mode = FakeTensorMode()
        assert mode._allow_unsafe_data_ptr_access
        with fast_cache_hits(mode), mode:
            x = torch.empty(3, 4)
            x @ x.t()
            hit = x @ x.t()
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            hit.data_ptr()
        print(len(warned), warned[0].message if warned else "")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    count, message = done.stdout.split(" ", 1)
    assert count == "1" and "Accessing the data pointer of FakeTensor is deprecated" in message


class _PassThrough(TorchDispatchMode):
    """A mode below the recorder: the fake mode is then not alone below it."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kernels", ["cpu", "cuda"])
def test_unsafe_views_come_from_views_cache_entry(kernels):
    """NOTE [unsafe views from view's cache entry]: the recorder asks the fake mode for view instead of matmul's
    _unsafe_view, which the fake mode never caches; the step's timeline is the same as with _unsafe_view run."""
    config = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, seq_length=16,
                         vocab_size=64, activation="swiglu")
    bypasses = FakeTensorMode.cache_bypasses
    before = bypasses["unsafe view"]
    fast = trace(config, "selective/core_attn", kernels=kernels)
    assert bypasses["unsafe view"] == before
    with _PassThrough():
        slow = trace(config, "selective/core_attn", kernels=kernels)
    assert bypasses["unsafe view"] > before + 10  # the step has them: run by the fake kernel each time
    assert fast.to_dict() == slow.to_dict()


def _counters() -> tuple:
    from torch.utils._stats import simple_call_counter

    return (FakeTensorMode.cache_hits, FakeTensorMode.cache_misses, dict(FakeTensorMode.cache_bypasses),
            simple_call_counter.get("FakeTensorMode.__torch_dispatch__", 0))


def _delta(before: tuple, after: tuple) -> tuple:
    bypasses = {k: after[2][k] - before[2].get(k, 0) for k in after[2] if after[2][k] != before[2].get(k, 0)}
    return after[0] - before[0], after[1] - before[1], bypasses, after[3] - before[3]


STEPS = [  # (config, policy, trace's arguments): dense TP/SP on CPU and CUDA kernels, full recompute, MoE experts
    (ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, seq_length=16,
                 vocab_size=64, dtype="bf16", attention="sdpa", activation="swiglu"), "selective/core_attn",
     {"tp": 2, "sp": True}),
    (ModelConfig(num_layers=3, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=64),
     "full/uniform/2", {"device": "cuda"}),
    (ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=64, dtype="bf16",
                 num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=96, moe_grouped_gemm=True),
     "selective/moe_act", {"device": "cuda"}),
]


@pytest.mark.parametrize("step", range(len(STEPS)))
def test_cache_hits_made_by_the_recorder_give_the_dispatched_step(monkeypatch, step):
    """NOTE [fake cache hits without a dispatch]: a step whose cache hits the recorder makes itself is the one the
    fake mode's dispatch makes: every row, phase and FLOP; the fake mode's counters move the same way."""
    import remat.memory.measure as measure

    config, policy, where = STEPS[step]
    made = []

    def counted(mode, func, args, kwargs):
        out = cached_output(mode, func, args, kwargs)
        made.append(out is not UNCACHED)
        return out

    predict_config(config, policy, **where)  # the cache filled, for both runs below
    monkeypatch.setattr(measure, "cached_output", counted)
    before = _counters()
    fast = predict_config(config, policy, **where)
    fast_counts = _delta(before, _counters())
    monkeypatch.setattr(measure, "answers_from_cache", lambda mode: False)
    before = _counters()
    dispatched = predict_config(config, policy, **where)
    assert fast.to_dict() == dispatched.to_dict()
    assert fast_counts == _delta(before, _counters())
    assert sum(made) > 300 and sum(made) > 0.9 * len(made)  # the recorder made nearly every output


def test_cached_output_answers_hits_only():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from remat.memory.fake_ops import GROUPED_MM

    mode = FakeTensorMode()
    mm = torch.ops.aten.mm.default
    with mode:
        x = torch.empty(3, 4)
        y = torch.empty(4, 5)
    fake_key = torch._C._TorchDispatchModeKey.FAKE
    with mode:
        previous = torch._C._unset_dispatch_mode(fake_key)  # as inside a recorder's dispatch: the mode set below
        torch._C._set_dispatch_mode(mode)
        assert cached_output(mode, mm, (x, torch.empty(4, 7)), {}) is UNCACHED  # a shape never dispatched: a miss
        dispatched = mm(x, y)
        hit = cached_output(mode, mm, (x, y), {})
        assert torch._C._get_dispatch_mode(fake_key) is mode  # set again after the hit
        assert cached_output(mode, torch.ops.prim.device.default, (x,), {}) is UNCACHED  # the mode's own handler
        assert cached_output(mode, GROUPED_MM, (x, y), {}) is UNCACHED  # remat's own kernel (fake_ops)
        torch._C._unset_dispatch_mode(fake_key)
        if previous is not None:
            torch._C._set_dispatch_mode(previous)
    assert type(hit) is FakeTensor and hit is not dispatched
    assert _described(hit) == _described(dispatched)
    assert answers_from_cache(mode)
    with torch._dynamo.config.patch(fake_tensor_cache_crosscheck_enabled=True):
        assert not answers_from_cache(FakeTensorMode())  # torch's cross-check dispatches each hit again: left to it
