"""Operators whose fake (meta) implementation in torch describes another kernel than the one a CPU step runs; a
remat fake trace gives them the CPU kernel's outputs (:func:`cpu_fake_ops`).

NOTE [grouped_mm in a fake trace]: transformers' MoE models (Mixtral, Qwen2-MoE, ...) run their experts through
``torch._grouped_mm`` (``F.grouped_mm``), which has a CPU kernel for float32, bfloat16 and float16 since torch 2.9.
Its meta implementation (``torch/_meta_registrations.py``: ``_meta_grouped_mm_common``) mirrors the CUDA kernel's
checks instead, and refuses anything but bfloat16 (``Expected inputs of BF16 type``), so a fake trace of an fp32
MoE model failed where the real CPU step runs. It also lays out the output by ``torch.version.cuda``: on a CPU build
of torch a plain contiguous tensor, where the CPU kernel (``create_grouped_gemm_output_tensor`` in ATen's
``GroupedMMUtils.h``), like the CUDA one, pads the output's rows to 16 bytes (a bf16 (10, 12) output has strides
(16, 1) and a 312-byte storage, not 240). While a remat trace runs, its fake mode answers ``aten._grouped_mm``
with :func:`grouped_mm_output`: the CPU kernel's checks (operand ranks, contraction, offsets, dtypes, 16-byte
strides) and its output layout, for every dtype; the backward's grouped matrix multiplies (torch's autograd formula)
take the same path. The kernel allocates nothing else a step records: it writes each group's product into that
output. The override is set on that mode instance only (its ``dispatch``), for the trace: other fake modes of the
process, and real tensors, keep torch's kernels (tests/recompute/test_hf_moe.py compares the layouts with the real
CPU kernel's and a traced Mixtral step with a measured one).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from types import MethodType
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from remat.units import round_up

GROUPED_MM = torch.ops.aten._grouped_mm.default
OWN_KERNELS = frozenset({GROUPED_MM})  # what cpu_fake_ops answers its own way, never from the fake cache
_EMPTY_STRIDED = torch.ops.aten.empty_strided.default


def grouped_mm_layout(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None = None,
                      bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                      ) -> tuple[list[int], list[int], torch.dtype]:
    """(size, stride, dtype) of the output of ``torch._grouped_mm(mat_a, mat_b, offs=offs, ...)`` as the CPU kernel
    makes it, after its checks (a ``RuntimeError`` for what it refuses). Rows are padded to 16 bytes."""
    a_2d, b_2d = mat_a.dim() == 2, mat_b.dim() == 2
    torch._check(mat_a.dim() in (2, 3) and mat_b.dim() in (2, 3),
                 lambda: f"Multiplicands must be 2D or 3D but got mat_a.dim()={mat_a.dim()} and "
                         f"mat_b.dim()={mat_b.dim()}")
    torch._check(mat_a.dtype == mat_b.dtype,
                 lambda: f"Expected mat_a and mat_b of one dtype, got {mat_a.dtype} and {mat_b.dtype}")
    torch._check(out_dtype is None or out_dtype == mat_a.dtype,
                 lambda: "Grouped gemm output dtype must match `mat_a` dtype")
    torch._check(bias is None, lambda: "Bias not supported yet")
    torch._check(mat_a.size(-1) == mat_b.size(-2) if not (a_2d and b_2d) else mat_a.size(1) == mat_b.size(0),
                 lambda: "contraction dimension of mat_a and mat_b must match")
    for mat in (mat_a, mat_b):
        _check_strides(mat)
    if a_2d or b_2d:
        torch._check(offs is not None, lambda: "Offsets tensor not provided, but is needed for "
                                               f"{mat_a.dim()}D/{mat_b.dim()}D multiplicand layouts.")
        assert offs is not None
        torch._check(offs.dim() == 1 and offs.dtype == torch.int32,
                     lambda: f"Offsets tensor must be a 1D int32 tensor, got {offs.dim()}D {offs.dtype}")
    else:
        torch._check(offs is None, lambda: "Offsets tensor provided, but is not needed for 3D/3D multiplicand "
                                           "layouts.")
    if a_2d and b_2d:
        size = [offs.size(0), mat_a.size(0), mat_b.size(1)]  # type: ignore[union-attr]
    elif a_2d:
        torch._check(offs.size(0) == mat_b.size(0), lambda: "matrix batch sizes have to match")  # type: ignore
        size = [mat_a.size(0), mat_b.size(-1)]
    elif b_2d:
        torch._check(offs.size(0) == mat_a.size(0), lambda: "matrix batch sizes have to match")  # type: ignore
        size = [mat_a.size(1), mat_b.size(1)]
    else:
        torch._check(mat_a.size(0) == mat_b.size(0), lambda: "batched dimension has to match")
        size = [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]
    dtype = mat_a.dtype
    alignment = 16 // dtype.itemsize
    padded = round_up(size[-1], alignment)
    stride = [size[1] * padded, padded, 1] if len(size) == 3 else [padded, 1]
    return size, stride, dtype


def _check_strides(mat: torch.Tensor) -> None:
    """The CPU kernel's layout check: row- or column-major in the last two dimensions, the leading stride a
    multiple of 16 bytes."""
    alignment = 16 // mat.element_size()
    strides, sizes = mat.stride(), mat.shape
    if strides[-2] == 1 and strides[-1] >= max(1, sizes[-2]):
        leading = strides[-1]
    elif strides[-1] == 1 and strides[-2] >= max(1, sizes[-1]):
        leading = strides[-2]
    else:
        raise RuntimeError(f"Invalid strides/sizes, got {list(strides)} for strides and {list(sizes)} for sizes")
    torch._check(leading % alignment == 0, lambda: "strides should be multiple of 16 bytes")


def grouped_mm_output(mode: FakeTensorMode, mat_a: torch.Tensor, mat_b: torch.Tensor,
                      offs: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                      out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The fake output of ``aten._grouped_mm`` in ``mode``: the CPU kernel's (NOTE [grouped_mm in a fake trace])."""
    size, stride, dtype = grouped_mm_layout(mat_a, mat_b, offs, bias, out_dtype)
    return FakeTensorMode.dispatch(mode, _EMPTY_STRIDED, (), (size, stride),
                                   {"dtype": dtype, "device": mat_a.device})


def _dispatch(mode: FakeTensorMode, func: Any, types: Sequence[type], args: Sequence[Any] = (),
              kwargs: Mapping[str, Any] | None = None) -> Any:
    if func is GROUPED_MM:
        return grouped_mm_output(mode, *args, **(kwargs or {}))
    return FakeTensorMode.dispatch(mode, func, types, args, kwargs or {})


@contextlib.contextmanager
def cpu_fake_ops(mode: Any) -> Iterator[None]:
    """Inside the block, fake mode ``mode`` gives the operators of NOTE [grouped_mm in a fake trace] the CPU
    kernels' outputs; on that instance only. Nothing changes when ``mode`` is not a ``FakeTensorMode`` or already
    has them.

    Example::

        >>> with FakeTensorMode() as mode, cpu_fake_ops(mode):
        ...     x, w = torch.empty(10, 8), torch.empty(3, 12, 8)
        ...     out = torch._grouped_mm(x, w.transpose(-2, -1), offs=torch.tensor([3, 7, 10], dtype=torch.int32))
        >>> out.shape, out.dtype
        (torch.Size([10, 12]), torch.float32)
    """
    if not isinstance(mode, FakeTensorMode) or "dispatch" in vars(mode):
        yield
        return
    mode.dispatch = MethodType(_dispatch, mode)  # type: ignore[method-assign]
    try:
        yield
    finally:
        del mode.dispatch
