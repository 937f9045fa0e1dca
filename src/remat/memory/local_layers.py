"""Megatron-LM's local layers (``--transformer-impl local``, ``get_gpt_layer_local_spec``) as the ``local`` kernel
profile traces them (:mod:`remat.memory.kernels`), NVIDIA/Megatron-LM at d98e8a6.

What differs from the ``te`` profile is the core attention: megatron/core/transformer/dot_product_attention.py
``DotProductAttention.forward`` (:func:`local_attention`). Everything else keeps what TE's layers keep:

* norms: ``LNImpl`` is apex's ``FusedLayerNorm`` (gpt_layer_specs.py:62-76; the CI image, nvcr.io/nvidia/pytorch
  per docker/.ngc_version.dev, ships apex: the local golden runs import apex's ``scaled_masked_softmax_cuda``,
  fused_softmax.py:357). Its ``FusedLayerNormAffineFunction`` (fused_layer_norm.py:157) saves input, weight, bias
  and fp32 mean/invvar ``[tokens]``: the ``cuda`` profile's LayerNorm bytes. hidden sizes off
  ``persist_ln_hidden_sizes`` (fused_layer_norm.py:66) never take apex's persistent kernel.
* linears: ``LinearWithGradAccumulationAndAsyncCommunication`` (tensor_parallel/layers.py:604) saves its input and
  weight, ``torch.matmul`` then ``+ bias`` (layers.py:459); under sequence parallelism it gathers into the global
  buffer (layers.py:627) and keeps the shard: :func:`remat.memory.workspaces.global_buffer_requests`.
* MLP: ``bias_gelu_impl`` saves the fc1 GEMM output and the bias (fused_bias_gelu.py:39), the fc2 input is the
  GeLU output: the two ``[tokens, f]`` tensors the reference MLP keeps; ``bias_swiglu_impl`` saves the fc1 output
  only (fused_bias_swiglu.py:184), TE's fused SwiGLU's bytes.
* bias-dropout-add: the fused ``bias_dropout_add`` (fused_bias_dropout.py) keeps dropout's 1-byte mask.
"""

from __future__ import annotations

from typing import Any

import torch

from remat.memory.cuda_sdpa import HALF

aten = torch.ops.aten
MASK_FILL = -10000.0  # megatron/core/transformer/utils.py attention_mask_func


def heads_like(x: torch.Tensor, d: int | None = None) -> torch.Tensor:
    """A new [b, heads, s, d] tensor laid out token-major (Megatron's and TE's sbhd [s, b, heads, d]; remat's layers
    are bshd): a gradient or output for q/k/v views of the QKV GEMM output, whose reshape back is then a view, as in
    Megatron and TE."""
    b, h, s, dx = x.shape
    d = dx if d is None else d
    return x.new_empty_strided((b, h, s, d), (s * h * d, d, h * d, 1))


class _LocalScores(torch.autograd.Function):
    """``torch.baddbmm(matmul_input_buffer, q, kᵀ, beta=0.0, alpha=softmax_scale)`` (dot_product_attention.py:194):
    ``matmul_input_buffer`` is the global "mpu" buffer (persistent: a resident row, not traced here); baddbmm is
    out of place, so the scores are a new [b*np, sq, sk] tensor each call. ``BaddbmmBackward0`` keeps q and k (views
    of the QKV GEMM output: [sq, b*np, hn] reshapes of sbhd are views)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
        b, h, sq, _ = q.shape
        ctx.save_for_backward(q, k)
        ctx.scale = scale
        return q.new_empty((b, h, sq, k.shape[-2]))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k = ctx.saved_tensors
        # derivatives.yaml baddbmm: maybe_multiply(grad.bmm(batch2ᵀ), alpha)
        return heads_like(q) * ctx.scale, heads_like(k) * ctx.scale, None


class _UpperTriangSoftmax(torch.autograd.Function):
    """``ScaledUpperTriangMaskedSoftmax`` (fused_softmax.py:11, apex ``scaled_upper_triang_masked_softmax_cuda``):
    the probabilities, new, in the input dtype, saved with a host-side scale; backward writes the incoming gradient
    in place (apex csrc/megatron/scaled_upper_triang_masked_softmax_cuda.cu ``bwd_cuda`` returns output_grads)."""

    @staticmethod
    def forward(ctx: Any, scores: torch.Tensor) -> torch.Tensor:
        probs = torch.empty_like(scores, memory_format=torch.contiguous_format)
        ctx.save_for_backward(probs)
        return probs

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        ctx.saved_tensors  # noqa: B018  the kernel reads the probabilities (an offloaded copy is reloaded for it)
        return grad.contiguous()


class AttentionContext(torch.autograd.Function):
    """The probabilities times the values, ``torch.bmm`` in Megatron's local attention
    (dot_product_attention.py:239) and in TE's unfused one (backends.py:684): ``BmmBackward0`` keeps the
    (dropped-out) probabilities and v (a view); the context [b, heads, sq, d] is new."""

    @staticmethod
    def forward(ctx: Any, probs: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(probs, v)
        b, h, sq, _ = probs.shape
        return probs.new_empty((b, h, sq, v.shape[-1]))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs, v = ctx.saved_tensors
        return torch.empty_like(probs), heads_like(v)


def batch_per_block(sk: int) -> int:
    """apex csrc/megatron/scaled_masked_softmax.h ``get_batch_per_block``: 128 threads per block, warps of
    min(next_pow2(sk), 32) threads, two batches per warp when next_pow2(sk) <= 128."""
    pow2 = 1 << (sk - 1).bit_length()
    return (128 // min(pow2, 32)) * (2 if pow2 <= 128 else 1)


def local_softmax_fusable(dtype: torch.dtype, b: int, heads: int, sq: int, sk: int, fusion: bool = True) -> bool:
    """``FusedScaleMaskSoftmax.is_kernel_available`` (fused_softmax.py:238) for the causal mask type the local spec
    gives self-attention (gpt_layer_specs.py:442): ``--no-masked-softmax-fusion`` off, fp16/bf16, 16 < sk <= 4096,
    sq and sk multiples of 4, b*np a multiple of 4 and of the kernel's batches per block."""
    attn_batches = b * heads
    return (fusion and dtype in HALF and 16 < sk <= 4096 and sq % 4 == 0 and sk % 4 == 0 and attn_batches % 4 == 0
            and attn_batches % batch_per_block(sk) == 0)


def _torch_softmax(scores: torch.Tensor, mask: torch.Tensor | None, in_fp32: bool, scaled: bool) -> torch.Tensor:
    """``FusedScaleMaskSoftmax.forward_torch_softmax`` (fused_softmax.py:299): an fp32 copy for 16-bit scores with
    ``softmax_in_fp32`` (forced by --apply-query-key-layer-scaling, transformer_config.py:1592), times the layer
    coefficient when scaled, ``masked_fill_`` in place with the caller's mask (utils.py attention_mask_func; keeps
    that mask, already alive; Megatron's is True where masked, remat's where kept: the same bytes), softmax (keeps
    its output), cast back. Without a mask Megatron's cached causal mask is process-wide (not counted)."""
    upcast = in_fp32 and scores.dtype in HALF
    x = scores.float() if upcast else scores
    if scaled:
        # input * self.scale (coeff = layer number, a Python number: a host-side scalar): a new tensor
        x = aten.mul.Scalar(x, 1.0)
    if mask is not None:
        x = x.masked_fill_(mask, MASK_FILL)
    probs = torch.softmax(x, dim=-1)
    return probs.to(scores.dtype) if upcast else probs


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, p: float,
                    scale: float, *, fusion: bool = True, in_fp32: bool = False, scaled: bool = False) -> torch.Tensor:
    """``DotProductAttention.forward`` (dot_product_attention.py:142), q/k/v [b, heads, s, d] views of the QKV GEMM:
    K and V ``repeat_interleave``'d under GQA (:169), the scores a new tensor (:194), the fused causal softmax
    (its output in the model dtype) when :func:`local_softmax_fusable`, else the torch softmax (:func:`_torch_softmax`;
    ``in_fp32``: --attention-softmax-in-fp32 or --apply-query-key-layer-scaling, ``scaled``: the latter),
    ``torch.nn.Dropout`` (CUDA ``native_dropout``: a bool mask, :216-220) and the bmm with V (:239). Kept: q, k,
    the softmax output, dropout's mask, the dropped probabilities and v."""
    b, h, sq, _ = q.shape
    if k.shape[1] != h:
        k, v = (t.repeat_interleave(h // t.shape[1], dim=1) for t in (k, v))
    scores = _LocalScores.apply(q, k, scale)
    if local_softmax_fusable(scores.dtype, b, h, sq, k.shape[-2], fusion):
        probs = _UpperTriangSoftmax.apply(scores)  # AttnMaskType.causal: the mask is not read (:285-291)
    else:
        in_fp32 = in_fp32 or scaled  # transformer_config.py:1592
        probs = _torch_softmax(scores, mask, in_fp32, scaled)
    del scores
    if 0.0 < p < 1.0 and probs.numel():
        probs = aten.native_dropout.default(probs, p, True)[0]
    return AttentionContext.apply(probs, v)


def local_scores_bytes(micro_batch: int, heads: int, seq: int, dtype_bytes: int) -> int:
    """The global "mpu" buffer the local attention asks for (dot_product_attention.py:189): [b*np, sq, sk] in the
    query's dtype."""
    return micro_batch * heads * seq * seq * dtype_bytes
