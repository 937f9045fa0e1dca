"""``scaled_dot_product_attention`` as PyTorch eager runs it on CUDA, traced with CPU fake tensors.

:func:`select_backend` applies the backend rules of ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``
(``select_sdp_backend``: the priority order, then each backend's constraints) and :func:`cuda_sdpa` runs what
``scaled_dot_product_attention`` (``attention.cpp``) runs for that backend: the flash, memory-efficient or cuDNN
op (their meta kernels give the saved tensors) or the math composite with CUDA's fused dropout. The GPU is taken
to be sm80/sm90 (A100/H100/H200): the sm86/89 head-dimension limits of flash are not applied.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

aten = torch.ops.aten
HALF = (torch.float16, torch.bfloat16)
# at::SDPBackend values, as torch._C._get_sdp_priority_order() reports them
_MATH, _FLASH, _EFFICIENT, _CUDNN = 0, 1, 2, 3


def _heads_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool) -> bool:
    """``check_batch_size_and_num_heads_dense`` (GQA-capable backends): same batch; same heads, or with
    ``enable_gqa`` a query head count divisible by the key/value head count."""
    if not (q.shape[0] == k.shape[0] == v.shape[0]) or k.shape[1] != v.shape[1]:
        return False
    return q.shape[1] == k.shape[1] or (enable_gqa and q.shape[1] % k.shape[1] == 0)


def _dense_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """``check_tensor_shapes``, ``check_nonzero_sequence_lengths_dense`` and ``check_last_dim_stride_equals_1``."""
    return (q.dim() == k.dim() == v.dim() == 4 and min(q.shape[-2], k.shape[-2]) > 0
            and all(t.stride(-1) == 1 or t.shape[-1] == 1 for t in (q, k, v)))


def can_use_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool,
                  enable_gqa: bool) -> bool:
    """``can_use_flash_attention``: no mask, fp16/bf16, one head dim <= 256, square when causal."""
    d = q.shape[-1]
    return (torch.backends.cuda.flash_sdp_enabled() and _dense_ok(q, k, v) and mask is None
            and q.dtype in HALF and k.shape[-1] == d and v.shape[-1] == d and d <= 256
            and (not is_causal or q.shape[-2] == k.shape[-2]) and _heads_ok(q, k, v, enable_gqa))


def can_use_efficient(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool) -> bool:
    """``can_use_mem_efficient_attention`` on sm80+: fp32/fp16/bf16, head dims aligned to the GEMM (8 elements
    at 16 bits, 4 at 32) and q, k, v storage offsets aligned to as many elements."""
    if not (torch.backends.cuda.mem_efficient_sdp_enabled() and _dense_ok(q, k, v)):
        return False
    if q.dtype not in (*HALF, torch.float32):
        return False
    align = 8 if q.dtype in HALF else 4  # minimum_gemm_alignment: 128 bits of tensor-core operands
    dims = q.shape[-1] == k.shape[-1] and q.shape[-1] % align == 0 and v.shape[-1] % align == 0
    offsets = all(t.storage_offset() % align == 0 for t in (q, k, v))  # check_data_ptr_alignment_mem_efficient
    return dims and offsets and _heads_ok(q, k, v, enable_gqa)


def can_use_cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, enable_gqa: bool) -> bool:
    """``can_use_cudnn_attention`` (cuDNN 9.x on sm90): fp16/bf16, head dims <= 128 and multiples of 8, dropout
    in steps of 1/16."""
    return (torch.backends.cuda.cudnn_sdp_enabled() and _dense_ok(q, k, v) and q.dtype in HALF
            and q.shape[-1] <= 128 and v.shape[-1] <= 128 and q.shape[-1] % 8 == 0 and v.shape[-1] % 8 == 0
            and dropout_p * 16 == math.floor(dropout_p * 16) and k.shape[-2] != 1
            and _heads_ok(q, k, v, True))


def select_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                   dropout_p: float = 0.0, is_causal: bool = False, enable_gqa: bool = False) -> str:
    """The backend CUDA's ``select_sdp_backend`` picks: ``'flash'``, ``'efficient'``, ``'cudnn'`` or ``'math'``.

    Args:
        q, k, v: ``[b, heads, s, d]`` query, key and value.
        mask: the ``attn_mask`` argument (None: none).
        dropout_p, is_causal, enable_gqa: as passed to ``scaled_dot_product_attention``.

    Returns:
        The first backend of ``torch._C._get_sdp_priority_order()`` (default flash, efficient, math, cuDNN) that
        is enabled (``torch.backends.cuda.*_sdp_enabled``, ``torch.nn.attention.sdpa_kernel``) and accepts the
        inputs.

    Raises:
        RuntimeError: every backend is disabled or refuses the inputs (CUDA raises "No available kernel").

    Example::

        >>> q = torch.empty(1, 4, 128, 64, dtype=torch.bfloat16)
        >>> select_backend(q, q, q, is_causal=True), select_backend(q, q, q, mask=torch.ones(128, 128).bool())
        ('flash', 'efficient')
    """
    for backend in torch._C._get_sdp_priority_order():
        if backend == _FLASH and can_use_flash(q, k, v, mask, is_causal, enable_gqa):
            return "flash"
        if backend == _EFFICIENT and can_use_efficient(q, k, v, enable_gqa):
            return "efficient"
        if backend == _MATH and torch.backends.cuda.math_sdp_enabled():
            return "math"
        if backend == _CUDNN and can_use_cudnn(q, k, v, dropout_p, enable_gqa):
            return "cudnn"
    raise RuntimeError("scaled_dot_product_attention: no CUDA backend is enabled that accepts these inputs "
                       f"(q {list(q.shape)} {q.dtype}, mask {mask is not None}, dropout {dropout_p}); enable one "
                       "with torch.nn.attention.sdpa_kernel")


def convert_boolean_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """``convert_boolean_attn_mask``: a bool mask becomes an additive mask (0 / -inf) in ``dtype``."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask, 0.0, torch.scalar_tensor(-math.inf, dtype=dtype, device=mask.device))


def _aligned(t: torch.Tensor, alignment: int) -> bool:
    return all(t.stride(i) % alignment == 0 for i in range(t.dim() - 1)) and t.stride(-1) == 1


def _expand_mask(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``preprocess_mask`` (attention.cpp): pad the last dim to 8 elements if unaligned, then expand (a view)."""
    if not _aligned(mask, 8):
        last = mask.shape[-1]
        mask = F.pad(mask, (0, 8 - last % 8)).narrow(-1, 0, last)
    return mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def _pad_head_dim(t: torch.Tensor) -> torch.Tensor:
    """``pad_last_dim<8, false>``: flash needs a head dim that is a multiple of 8."""
    d = t.shape[-1]
    return t if d % 8 == 0 else F.pad(t, (0, 8 - d % 8))


def math_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, dropout_p: float,
              is_causal: bool, scale: float | None, enable_gqa: bool) -> torch.Tensor:
    """``_scaled_dot_product_attention_math`` with CUDA's ``at::dropout`` (the fused ``native_dropout``)."""
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    origin = q.dtype
    upcast = origin in HALF and not torch._C._get_math_sdp_allow_fp16_bf16_reduction()
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    factor = math.sqrt(scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
    query = q * factor
    if is_causal:
        mask = convert_boolean_mask(torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool,
                                               device=q.device).tril(), query.dtype)
    attn = torch.matmul(query, k.transpose(-2, -1) * factor)
    if mask is not None:
        attn.add_(mask)  # in place, as on real tensors
    attn = aten._safe_softmax.default(attn, -1)
    if dropout_p > 0.0:
        attn = aten.native_dropout.default(attn, dropout_p, True)[0]
    out = torch.matmul(attn, v)
    if upcast:
        attn.to(origin)  # the returned (and discarded) attention weights, converted back as the kernel does
        out = out.to(origin)
    return out


def cuda_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
              dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
              enable_gqa: bool = False) -> torch.Tensor:
    """What ``F.scaled_dot_product_attention`` runs on CUDA, on (fake) tensors of any device.

    Args:
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa: as
            :func:`torch.nn.functional.scaled_dot_product_attention`.

    Returns:
        The attention output, made by the kernel :func:`select_backend` picks, so that autograd keeps what that
        kernel keeps: flash and cuDNN the output, an fp32 logsumexp and the RNG state; memory-efficient also the
        additive mask; math the softmax output, the dropout mask and the dropped probabilities.

    Example::

        >>> from torch._subclasses.fake_tensor import FakeTensorMode
        >>> with FakeTensorMode():
        ...     q = torch.empty(1, 4, 128, 64, dtype=torch.bfloat16, requires_grad=True)
        ...     cuda_sdpa(q, q, q, dropout_p=0.1, is_causal=True).grad_fn.name()
        'ScaledDotProductFlashAttentionBackward0'
    """
    backend = select_backend(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    mask = convert_boolean_mask(attn_mask, query.dtype)
    if backend == "flash":
        d = query.shape[-1]
        out = aten._scaled_dot_product_flash_attention.default(
            _pad_head_dim(query), _pad_head_dim(key), _pad_head_dim(value), dropout_p, is_causal, False,
            scale=scale if scale is not None else 1.0 / math.sqrt(d))[0]
        return out if out.shape[-1] == d else out[..., :d]
    if backend == "efficient":
        if enable_gqa and key.shape[-3] != query.shape[-3]:
            key = key.repeat_interleave(query.shape[-3] // key.shape[-3], dim=-3)
            value = value.repeat_interleave(query.shape[-3] // value.shape[-3], dim=-3)
        if mask is not None:
            mask = _expand_mask(mask, query, key)
        lse = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        return aten._scaled_dot_product_efficient_attention.default(query, key, value, mask, lse, dropout_p,
                                                                     is_causal, scale=scale)[0]
    if backend == "cudnn":
        lse = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        return aten._scaled_dot_product_cudnn_attention.default(query, key, value, mask, lse, dropout_p, is_causal,
                                                                False, scale=scale)[0]
    return math_sdpa(query, key, value, mask, dropout_p, is_causal, scale, enable_gqa)
