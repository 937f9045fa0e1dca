"""Faster fake-tensor cache keys for remat's traces (:func:`fast_cache_keys`).

NOTE [fast fake-tensor cache keys]: FakeTensorMode caches each operator's output metadata under a key made from its
arguments (``FakeTensorMode._cache_key``); for each fake tensor argument it builds a ``TensorMetadata`` dataclass
and flattens it field by field, through a recursive, isinstance-chained ``_prep_args_for_hash``. In a trace of a
tensor-parallel Llama layer that is about a third of the CPU time. While a remat recorder runs over a fake mode,
that mode's ``_prep_args_for_hash`` is replaced (on that instance only: other fake modes of the process, e.g.
torch.compile's, keep torch's) by :func:`_prep_args`, which appends the same values in the same order for the
common arguments (plain lists and tuples; static-shape, strided, non-constant fake tensors of this mode; ints,
floats, bools, strings, None, dtypes, devices, layouts, memory formats) and hands everything else to torch's own
function. The keys are equal, so the cache hits and misses, and every output, are torch's: a test compares the
two functions' keys over every operator of a traced step (tests/memory/test_fake_keys.py). It is installed only when
torch's ``TensorMetadata`` has the fields it was written against (torch 2.13), else torch's function runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from types import MethodType
from typing import Any

import torch
from torch._prims_common import suggest_memory_format
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, TensorMetadata

# TensorMetadata's fields, in the order torch flattens them, as _prep_args writes them
_FIELDS = ("dtype", "shape", "stride", "device", "layout", "memory_format", "storage_offset", "storage_bytes",
           "requires_grad", "is_quantized", "is_conj", "is_neg", "is_inference", "is_sparse", "is_coalesced",
           "dense_dim", "sparse_dim")
SUPPORTED = tuple(f.name for f in dataclasses.fields(TensorMetadata)) == _FIELDS
_TORCHS = FakeTensorMode._prep_args_for_hash
_STRIDED = torch.strided
# (sizes, strides) -> what the key holds for a strided tensor laid out so, a function of them alone, worked out once
# for each: its sizes and strides as torch flattens them (marker, length, then each as int and value), and the memory
# format it names (None: not contiguous in the format suggest_memory_format suggests)
_LAYOUTS: dict[tuple[torch.Size, tuple[int, ...]], tuple[tuple[object, ...], torch.memory_format | None]] = {}
_SCALARS = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
                      torch.memory_format})


def _prep_args(mode: FakeTensorMode, result: list[object], args: Any, state: Any, id_hashed: list[object]) -> None:
    """torch's ``FakeTensorMode._prep_args_for_hash``, the same values appended, without its per-tensor dataclass
    (NOTE [fast fake-tensor cache keys])."""
    kind = type(args)
    if kind is dict:  # its type and length, then its keys and its values, each without markers
        result += (dict, f"length_{len(args)}")
        _append(mode, result, args.keys(), state, id_hashed)
        _append(mode, result, args.values(), state, id_hashed)
    elif kind is list or kind is tuple:
        result += (kind, f"length_{len(args)}")
        _append(mode, result, args, state, id_hashed)
    else:  # sizes, iterables: torch's (which calls back here for what they hold)
        _TORCHS(mode, result, args, state, id_hashed)


def _append(mode: FakeTensorMode, result: list[object], args: Any, state: Any, id_hashed: list[object]) -> None:
    append = result.append
    for arg in args:
        arg_kind = type(arg)
        if arg_kind in _SCALARS:
            append(arg_kind)
            append(arg)
        elif arg_kind is FakeTensor and arg.fake_mode is mode and arg.constant is None and \
                arg.layout is _STRIDED and not arg._has_symbolic_sizes_strides:
            shape, stride = arg.shape, arg.stride()
            layout = _LAYOUTS.get((shape, stride))
            if layout is None:
                layout = _LAYOUTS[(shape, stride)] = _layout(arg, shape, stride)
            sizes_and_strides, memory_format = layout
            append(arg.dtype)
            result += sizes_and_strides
            result += (arg.device, _STRIDED, memory_format, arg.storage_offset(), arg.untyped_storage().nbytes(),
                       arg.requires_grad, arg.is_quantized, arg.is_conj(), arg.is_neg(), arg.is_inference(),
                       arg.is_sparse, None, None, None)
        elif arg_kind is list or arg_kind is tuple or arg_kind is dict:
            _prep_args(mode, result, arg, state, id_hashed)
        else:  # anything else (raising torch's bypasses too), one argument: an iterator adds no list markers
            _TORCHS(mode, result, iter((arg,)), state, id_hashed)


def _layout(arg: FakeTensor, shape: torch.Size, stride: tuple[int, ...]) -> tuple[tuple[object, ...],
                                                                             torch.memory_format | None]:
    """``_LAYOUTS``'s entry for a strided tensor of these sizes and strides."""
    memory_format = suggest_memory_format(arg)
    if not arg.is_contiguous(memory_format=memory_format):
        memory_format = None
    values: list[object] = [torch.Size, f"length_{len(shape)}"]
    for n in shape:
        values += (int, n)
    values += (tuple, f"length_{len(stride)}")
    for n in stride:
        values += (int, n)
    return tuple(values), memory_format


@contextlib.contextmanager
def override_fake_mode(mode: Any, name: str, function: Callable[..., Any],
                       supported: Callable[[], bool]) -> Iterator[None]:
    """Inside the block, fake mode ``mode``'s method ``name`` is ``function`` bound to it (on that instance only:
    every other fake mode of the process keeps torch's); nothing changes when ``mode`` is not a FakeTensorMode,
    already has its own ``name`` (an outer block's), or ``supported()`` says torch is not the one ``function`` was
    written against (asked last: only for a fake mode)."""
    if not isinstance(mode, FakeTensorMode) or name in vars(mode) or not supported():
        yield
        return
    setattr(mode, name, MethodType(function, mode))
    try:
        yield
    finally:
        delattr(mode, name)


def fast_cache_keys(mode: Any) -> contextlib.AbstractContextManager[None]:
    """Inside the block, fake mode ``mode`` makes its cache keys with :func:`_prep_args` (NOTE [fast fake-tensor
    cache keys]), as :func:`override_fake_mode` installs it."""
    return override_fake_mode(mode, "_prep_args_for_hash", _prep_args, lambda: SUPPORTED)
