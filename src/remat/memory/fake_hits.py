"""Faster fake-tensor cache hits for remat's traces (:func:`fast_cache_hits`; with the cache keys of
:mod:`remat.memory.fake_keys`, :func:`fast_fake_mode`).

NOTE [fast fake-tensor cache hits]: on a cache hit, FakeTensorMode makes the operator's output from the cached
metadata (``FakeTensorMode._get_output_tensor_from_cache_entry``): an empty meta tensor of the cached shape and
strides (set to its input's storage for a view), made inside two entries of the ``in_kernel_invocation_manager``
generator, then ``FakeTensor(mode, empty, device)``, whose constructor checks its arguments, normalises the device
twice and writes fifteen symbolic-size memo slots through their descriptors. In a trace of a Llama layer that is
about a sixth of the CPU time. While a remat recorder runs over a fake mode, that mode's method is replaced (on that
instance only: other fake modes of the process keep torch's) by :func:`_output_from_entry`, which makes the same
tensor for the common entries (a new, strided, non-conjugate, non-negative output of static sizes on a real device,
the mode without a shape environment) in one kernel-invocation block, and gives the FakeTensor the attributes torch's
constructor gives it (:func:`supported` checks their names against a tensor torch made, once). Every other entry
(in-place outputs, constants, symbolic sizes; any while torch debugs fake tensors or exports) is torch's. A test
compares the two outputs, operator by operator, over whole traced steps (tests/memory/test_fake_hits.py): the
attributes, dispatch keys, sizes, strides, offset, storage (shared with the input for a view) and autograd flags
are equal.

NOTE [fake cache hits without a dispatch]: an operator a recorder passes on reaches the fake mode below it through
torch's dispatcher: the C++ argument parsing and Python fallback, two dynamo-disable wrappers, torch's call counter,
``FakeTensorMode.__torch_dispatch__`` and ``dispatch`` (which enters ``no_dispatch`` for a debug log line), then
``_cached_dispatch_impl``, which makes the cache key and, on a hit, the output from the entry. Around the key and
the output that is about a third of a hit's time. Where the fake mode is alone below the recorder (a fake trace's
usual stack: :func:`fake_mode_alone_below`), with its cache on and neither its cross-check nor its debug log
(:func:`answers_from_cache`), the recorder makes the key and the hit's output itself with the mode's own methods
(:func:`cached_output`): the same key, entry and output, made with the mode unset as during its dispatch, and the
same counters (``cache_hits``, torch's call counter). Everything else (a miss, a bypass, an operator the mode
answers another way: ``prim.device``, ``aten.size``, ..., :data:`remat.memory.fake_ops.OWN_KERNELS`) is dispatched
as before, its key made again. A test traces steps both ways and compares them (tests/memory/test_fake_hits.py).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch._ops import OpOverload
from torch._subclasses.fake_tensor import (
    _DISPATCH_HANDLE_DIRECTLY,
    _DISPATCH_META_HANDLERS,
    FakeTensor,
    FakeTensorConfig,
    FakeTensorMode,
    _BypassDispatchCache,
    _CacheKeyState,
    _DispatchCacheValidEntry,
    _is_indexed_device_type,
)
from torch._subclasses.fake_tensor import log as fake_log
from torch.utils._stats import simple_call_counter

from remat.memory.fake_keys import fast_cache_keys, override_fake_mode
from remat.memory.fake_ops import OWN_KERNELS

_TORCHS = FakeTensorMode._get_output_tensor_from_cache_entry
_STRIDED = torch.strided
_MEMOS = ("nonzero_memo", "item_memo", "unique_memo", "unique_consecutive_memo", "nested_int_memo")
# what FakeTensor's constructor leaves in a new tensor's __dict__ besides its device and mode (no constant, real
# tensor, Python type or dispatch keys; each memo cleared with its version and epoch)
_CLEARED = {"constant": None, "pytype": None, "dispatch_keys": None, "real_tensor": None,
            **{f"_{memo}{part}": None for memo in _MEMOS for part in ("", "_vc", "_epoch")}}
_normalize_device = FakeTensor._normalize_fake_device
_make_subclass = torch.Tensor._make_subclass
_empty_strided = torch.empty_strided
_set_meta_in_tls = torch._C._set_meta_in_tls_dispatch_include
_is_exporting = torch.compiler.is_exporting


@functools.cache
def supported() -> bool:
    """Whether the attributes torch's constructor gives a FakeTensor are the ones :func:`_output_from_entry` gives
    it (torch 2.13); checked on one tensor, the first time a recorder asks."""
    mode = FakeTensorMode()
    made = FakeTensor(mode, torch.empty(1, device="meta"), torch.device("cpu"))
    return frozenset(vars(made)) == frozenset({"_fake_device", "fake_mode", *_CLEARED})


# each cache entry's output as _output_from_entry makes it, (sizes, strides, offset, dtype, requires_grad, device) or
# None where torch's method makes it (entries are never changed; each is kept here too, so that its id names only it)
_Plain = tuple[tuple[int, ...], tuple[int, ...], int, torch.dtype, bool, torch.device | None]
_PLAIN: dict[int, tuple[Any, _Plain | None]] = {}


def _plain(entry: Any) -> _Plain | None:
    """What :func:`_output_from_entry` makes ``entry``'s output of: a new, strided, non-conjugate, non-negative
    output of static sizes on a real device; None for any other (in-place outputs, constants, symbolic sizes). Its
    device is the one FakeTensor's constructor normalises the entry's to, where that is a function of the entry alone:
    a device with an index, or of a kind without indices (first normalised here, which initialises a GPU's context as
    torch's does); None where it is the current device of its kind, asked each time."""
    found = _PLAIN.get(id(entry))
    if found is not None:  # (the entry it was made for is alive, kept here: no other object has its id)
        return found[1]
    metadata = entry.metadata
    plain = None
    if entry.inplace_idx is None and metadata is not None and not metadata.is_conj and not metadata.is_neg and \
            metadata.layout is _STRIDED and type(metadata.storage_offset) is int and metadata.device.type != "meta" \
            and all(type(n) is int for n in (*metadata.shape, *metadata.stride)):
        device = metadata.device
        fixed = device.index is not None or not _is_indexed_device_type(device.type)
        plain = (tuple(metadata.shape), tuple(metadata.stride), metadata.storage_offset, metadata.dtype,
                 metadata.requires_grad, _normalize_device(device) if fixed else None)
    _PLAIN[id(entry)] = (entry, plain)
    return plain


def _output_from_entry(mode: FakeTensorMode, state: Any, entry: Any, key: Any, func: Any,
                       args: Sequence[object]) -> FakeTensor | None:
    """torch's ``FakeTensorMode._get_output_tensor_from_cache_entry``, the same output, without its generic
    construction (NOTE [fast fake-tensor cache hits])."""
    # (torch's constructor records a traceback in debug mode, and FakeTensor.__init__ tracks tensors while exporting)
    plain = None if FakeTensorConfig.debug or _is_exporting() or mode.shape_env is not None else _plain(entry)
    if plain is None:
        return _TORCHS(mode, state, entry, key, func, args)
    view = None
    if isinstance(func, OpOverload) and func.is_view:
        view = args[entry.view_idx]
        if type(view) is not FakeTensor:
            return _TORCHS(mode, state, entry, key, func, args)  # torch's raises its own error
    shape, stride, offset, dtype, requires_grad, device = plain
    # torch's in_kernel_invocation_manager, entered once for both kernels
    was_in_kernel = mode.in_kernel_invocation
    with torch._C._DisableTorchDispatch():
        mode.in_kernel_invocation = True
        with torch._C._PreserveDispatchKeyGuard():
            _set_meta_in_tls(True)
            try:
                empty = _empty_strided(shape, stride, dtype=dtype, layout=_STRIDED, device="meta",
                                       requires_grad=requires_grad)
                if view is not None:  # a view shares its input's storage
                    empty.set_(view.untyped_storage(), offset, shape, stride)
            finally:
                mode.in_kernel_invocation = was_in_kernel
    if device is None:
        device = _normalize_device(entry.metadata.device)
    out = _make_subclass(FakeTensor, empty, empty.requires_grad, dispatch_device=True,
                         device_for_backend_keys=device)
    if not mode._allow_unsafe_data_ptr_access:
        torch._C._set_throw_on_mutable_data_ptr(out)
    else:
        torch._C._set_warn_deprecated_on_mutable_data_ptr(out)
    attributes = out.__dict__
    attributes["_fake_device"] = device
    attributes["fake_mode"] = mode
    attributes.update(_CLEARED)
    return out


def fast_cache_hits(mode: Any) -> contextlib.AbstractContextManager[None]:
    """Inside the block, fake mode ``mode`` makes its cache hits' outputs with :func:`_output_from_entry` (NOTE
    [fast fake-tensor cache hits]), as :func:`~remat.memory.fake_keys.override_fake_mode` installs it."""
    return override_fake_mode(mode, "_get_output_tensor_from_cache_entry", _output_from_entry, supported)


@contextlib.contextmanager
def fast_fake_mode(mode: Any) -> Iterator[None]:
    """Inside the block, fake mode ``mode`` makes its cache keys (:func:`~remat.memory.fake_keys.fast_cache_keys`)
    and its cache hits' outputs (:func:`fast_cache_hits`) the faster ways: what a remat recorder runs over."""
    with fast_cache_keys(mode), fast_cache_hits(mode):
        yield


@contextlib.contextmanager
def fake_tensor_mode() -> Iterator[FakeTensorMode]:
    """A new ``FakeTensorMode`` that refuses real tensors, entered, with the faster cache keys and hits of
    :func:`fast_fake_mode` from its start: the model's construction and the rest of a trace that runs outside the
    recorder make their keys and hits so too (a 70B job plan's modules are built in 1,400 fake dispatches). Yields
    the mode."""
    with FakeTensorMode(allow_non_fake_inputs=False) as mode, fast_fake_mode(mode):
        yield mode


UNCACHED = object()  # what cached_output gives when the fake mode's own dispatch must make the output
# the operators the fake mode answers another way than from its cache (its handlers; remat's own kernels): one set,
# one hash of the operator each
_DISPATCHED = frozenset(_DISPATCH_META_HANDLERS) | frozenset(_DISPATCH_HANDLE_DIRECTLY) | OWN_KERNELS
_FAKE_KEY = torch._C._TorchDispatchModeKey.FAKE
_DISPATCH_COUNTER = FakeTensorMode.__torch_dispatch__.__qualname__  # what torch's count wrapper counts it as


def fake_mode_alone_below(mode: FakeTensorMode) -> bool:
    """Whether, inside a dispatch mode's ``__torch_dispatch__``, an operator called now reaches fake mode ``mode``
    next, outside a fake kernel (no other dispatch mode between)."""
    return (torch._C._len_torch_dispatch_stack() == 1 and not mode.in_kernel_invocation
            and torch._C._get_dispatch_mode(_FAKE_KEY) is mode)


def answers_from_cache(mode: FakeTensorMode) -> bool:
    """Whether :func:`cached_output` may stand for ``mode``'s dispatch: its cache on, no cross-check, no debug log
    (asked once a recorder, not once an operator)."""
    return mode.cache_enabled and not mode.cache_crosscheck_enabled and not fake_log.isEnabledFor(logging.DEBUG)


def cached_output(mode: FakeTensorMode, func: Any, args: Sequence[object], kwargs: dict[str, object]) -> Any:
    """The output of ``func(*args, **kwargs)`` when its next dispatch is fake mode ``mode``'s
    (:func:`fake_mode_alone_below`, :func:`answers_from_cache`) and that mode's cache holds it, made as its cache
    hit makes it; :data:`UNCACHED` otherwise (a miss, a bypass, an operator the mode answers another way), where
    the caller dispatches it (NOTE [fake cache hits without a dispatch])."""
    if func in _DISPATCHED:
        return UNCACHED
    state = _CacheKeyState(mode.shape_env)
    try:
        key = mode._cache_key(state, func, args, kwargs)
    except _BypassDispatchCache:  # counted by the dispatch that follows
        return UNCACHED
    if state.cache_on_shape_env():
        return UNCACHED
    entry = FakeTensorMode.cache.get(key)
    if type(entry) is not _DispatchCacheValidEntry:
        return UNCACHED
    previous = torch._C._unset_dispatch_mode(_FAKE_KEY)  # as while the mode dispatches
    try:
        output = mode._output_from_cache_entry(state, entry, key, func, args)
    finally:
        torch._C._set_dispatch_mode(previous)
    FakeTensorMode.cache_hits += 1
    simple_call_counter[_DISPATCH_COUNTER] = simple_call_counter.get(_DISPATCH_COUNTER, 0) + 1
    return output
