"""FP8 training under TransformerEngine (Megatron-LM's ``--fp8-format`` / ``--fp8-recipe delayed|tensorwise``,
``--fp8-param-gather``): what a Hopper rank keeps for each FP8 linear.

NOTE [FP8 linears on Hopper]
Sources: TransformerEngine 2.17.1 (4329ff84, Megatron-LM d98e8a64's pin) ``pytorch/module/linear.py``,
``module/base.py``, ``module/grouped_linear.py``; Megatron-LM d98e8a64 ``megatron/core/fp8_utils.py``,
``megatron/core/extensions/transformer_engine.py``, ``megatron/core/distributed/param_and_grad_buffer.py``.

* Which GEMMs: Megatron enters ``fp8_autocast`` around every transformer layer and MTP layer
  (fp8_utils.py:832 ``get_fp8_context``; transformer_block.py:619-689, multi_token_prediction.py:1388), so every TE
  linear there runs in FP8: qkv / proj / fc1 / fc2, MLA's projections, the shared and routed experts. The
  embedding, the router (a plain GEMM) and the output layer (Megatron's own ``ColumnParallelLinear``) stay in the
  activation dtype; so does core attention (``fp8_dot_product_attention`` off by default).
* Delayed (``Float8Quantizer``) and tensorwise (``Float8CurrentScalingQuantizer``) scaling make ``Float8Tensor``s:
  one byte per element and an fp32 ``scale_inv`` of one element. Hopper's FP8 GEMM takes only the TN layout, so a
  tensor needed transposed has a second, transposed copy (its "columnwise" data, one byte per element).
* A linear's input (linear.py:368-389): quantized with both copies when backward needs it, the row-wise copy
  dropped after the GEMM (linear.py:546-560), so the column-wise copy (1 byte per element) is what is saved. A
  column-parallel linear under sequence parallelism (linear.py:328-363) quantizes its token shard row-wise only
  (FP8 column-wise data cannot be all-gathered), gathers it in FP8 (1 byte per gathered element, freed after the
  GEMM: linear.py:489), and saves the row-wise shard; backward gathers it again and transposes it (linear.py:1088).
* Backward quantizes the output gradient row- and column-wise (linear.py:823, 1130: dgrad and wgrad GEMMs) and
  makes the input gradient in the activation dtype; the weight gradient in the activation dtype too, unless
  gradient-accumulation fusion writes it into ``main_grad``.
* Weights: without ``--fp8-param-gather`` each linear quantizes its weight into a workspace cached on the module
  (``_fp8_workspaces['weight']``: Megatron passes ``is_first_microbatch``, transformer_engine.py:1338, so
  ``cache_name='weight'``, linear.py:1859; base.py:750 ``quantize_weight``), row- and column-wise (linear.py:409-419):
  2 bytes per weight element kept for the whole run beside the bf16 weight. With ``--fp8-param-gather`` the
  weights are ``Float8Tensor`` parameters (``fp8_model_init``): the DDP buffer holds them as uint8
  (param_and_grad_buffer.py:921 ``group_params_for_buffers``: a buffer of their own), and
  ``post_all_gather_processing`` (fp8_utils.py:687) makes their transposes after each all-gather: again 2 bytes
  per element, no workspace.

The trace runs these linears through :func:`fp8_linear` and friends, which allocate what TE allocates (uint8
tensors of the same shapes) around the same GEMM; the persistent weight copies are model state
(:func:`fp8_state_bytes`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from remat.job_flags import JobError
from remat.memory.workspaces import gpu_major
from remat.models.moe import GroupedLinear, grouped_mm
from remat.models.tp_layers import (
    ColumnParallelLinear,
    CopyToRegion,
    RowParallelLinear,
    TensorParallelGroup,
    is_te_linear_weight,
)

SCALE_BYTES = 4  # a Float8Tensor's fp32 scale_inv: one element
MODULE = "transformer_engine.fp8_weights"  # the timeline row of fp8_state_bytes


def check_fp8_gpu(gpu: str | None) -> None:
    """Refuse FP8 on a GPU whose FP8 layouts remat does not model: Ampere has no FP8 GEMMs (TE refuses), and
    Blackwell's FP8 GEMMs take every layout, so TE keeps no transposed copies there (NOTE [FP8 linears on
    Hopper] describes Hopper's; ``gpu=None`` is Hopper)."""
    major = gpu_major(gpu)
    if major != 9:
        raise JobError(f"gpu={gpu!r} with FP8 (--fp8-format): remat models TransformerEngine's FP8 tensors on Hopper "
                       "(h100, h200), which keep transposed copies; " + (
                           "Ampere has no FP8 GEMMs" if major < 9 else "Blackwell's keep none") +
                       ": price the job for an h100 (--gpu h100) or without --fp8-format")


def is_fp8_weight(name: str) -> bool:
    """Whether the parameter ``name`` is the weight of a TE linear Megatron runs in FP8 (NOTE [FP8 linears on
    Hopper]): every TE linear (:func:`remat.models.tp_layers.is_te_linear_weight`) of a transformer or MTP layer.

    Example:
        >>> is_fp8_weight("layers.0.mlp.linear_fc1.weight"), is_fp8_weight("head.output_layer.weight")
        (True, False)
    """
    return is_te_linear_weight(name)


def _gemm_shape(p: Any) -> tuple[int, int, int]:
    """(GEMMs, out, in) of an FP8 weight: a grouped [experts, in, out] weight is one [out, in] weight per expert,
    as TE's ``GroupedLinear`` holds ``weight{i}`` (grouped_linear.py:1346)."""
    if len(p.shape) == 3:
        return p.shape[0], p.shape[2], p.shape[1]
    if len(p.shape) == 2:
        return 1, p.shape[0], p.shape[1]
    return 1, p.numel, 1


def scale_bytes(rows: int, cols: int, recipe: str, *, columnwise: bool, block_dim: int = 1) -> int:
    """The fp32 ``scale_inv`` bytes of a [rows, cols] FP8 tensor's row-wise (or column-wise) data: one scale for
    ``delayed`` / ``tensorwise``; ``blockwise`` one per 1x128 block (``block_dim=1``, activations and gradients)
    or per 128x128 block (``block_dim=2``, weights), padded as ``Float8BlockQuantizer.get_scale_shape`` pads them
    (float8_blockwise_tensor.py:121-170).

    Example:
        >>> [scale_bytes(1000, 256, r, columnwise=False) for r in ("tensorwise", "blockwise")]
        [4, 8000]
    """
    if recipe != "blockwise":
        return SCALE_BYTES
    blocks = -(-cols // 128), -(-rows // 128)
    if block_dim == 2:
        shape = (blocks[0], _pad(blocks[1], 4)) if columnwise else (blocks[1], _pad(blocks[0], 4))
    else:
        shape = (blocks[1], _pad(cols, 4)) if columnwise else (blocks[0], _pad(rows, 4))
    return 4 * shape[0] * shape[1]


def fp8_state_bytes(params: Sequence[Any], recipe: str, *, param_gather: bool, amax_history: int = 1,
                    block: int = 1) -> int:
    """What a rank keeps for its FP8 linears for the whole run, beside parameters, gradients and optimizer state
    (NOTE [FP8 linears on Hopper]), each tensor rounded to the allocator's ``block`` bytes. ``params`` are
    :class:`remat.memory.rank_state.ParamInfo` (which imports this module: not imported here): the FP8 weights
    (``ParamInfo.fp8``: not those of layers run in bf16 under ``--first-last-layers-bf16``).

    * without ``param_gather``: each weight's cached FP8 workspace, row-wise and column-wise data (1 byte per
      element each) with their fp32 scales (:func:`scale_bytes`, 128x128 blocks for ``blockwise``);
    * with ``param_gather``: the parameter's row-wise data is in the uint8 param buffer (model state); its
      scales, its column-wise data and their scales are extra;
    * ``delayed`` scaling: each module's recipe state (quantization.py:1426 ``DelayedScalingRecipeState``): forward
      ``scale`` [3n] and ``amax_history`` [amax_history, 3n], backward [2n] and [amax_history, 2n], fp32, for n GEMMs
      (``tensorwise`` and ``blockwise`` quantizers keep none: quantization.py:1456, 1530).

    Example:
        >>> from remat.memory.rank_state import ParamInfo
        >>> w = [ParamInfo("layers.0.mlp.linear_fc1.weight", 1000, shape=(40, 25))]
        >>> fp8_state_bytes(w, "tensorwise", param_gather=False), fp8_state_bytes(w, "tensorwise", param_gather=True)
        (2008, 1008)
    """
    total = 0
    for p in params:
        gemms, out, inp = _gemm_shape(p)
        numel = out * inp
        scales = [_pad(scale_bytes(out, inp, recipe, columnwise=c, block_dim=2), block) for c in (False, True)]
        total += gemms * ((1 if param_gather else 2) * _pad(numel, block) + sum(scales))
        if recipe == "delayed":
            total += sum(_pad(4 * n * rows, block) for n in (3 * gemms, 2 * gemms) for rows in (1, amax_history))
    return total


def _pad(n: int, block: int) -> int:
    return -(-n // block) * block


def _quantized(x: torch.Tensor, recipe: str, transposed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 tensor's data (1 byte per element; ``transposed``: the column-wise copy, transposed on Hopper) and its
    fp32 scales (:func:`scale_bytes`, 1x128 blocks for ``blockwise`` activations and gradients)."""
    cols = x.shape[-1]
    rows = x.numel() // max(cols, 1)
    shape = (cols, rows) if transposed else tuple(x.shape)
    scale = scale_bytes(rows, cols, recipe, columnwise=transposed) // 4
    return (torch.empty(shape, dtype=torch.uint8, device=x.device),
            torch.empty(scale, dtype=torch.float32, device=x.device))


def _stand_in(rows: int, cols: int, like: torch.Tensor) -> torch.Tensor:
    """A [rows, cols] operand for a GEMM whose real operand is FP8 data: one row expanded (no copy), so the trace
    counts the GEMM's FLOPs and allocates its output, not a high-precision copy TE never makes (the one row,
    ``cols`` elements, is the only allocation: transient, at most one allocator block)."""
    return like.new_empty(1, cols).expand(rows, cols)


def _weight_grad(grad: torch.Tensor, rows: int, weight: torch.Tensor) -> torch.Tensor:
    """The wgrad GEMM (FP8 output-gradient x FP8 input, out_dtype the activation dtype): [out, in]."""
    grad_2d = grad.reshape(-1, grad.shape[-1])
    return grad_2d.t().mm(_stand_in(rows, weight.shape[1], grad))


def _grad_output_copies(grad: torch.Tensor, recipe: str) -> tuple[torch.Tensor, ...]:
    """Backward's quantized output gradient: row-wise (dgrad) and column-wise (wgrad) copies, linear.py:823."""
    return (*_quantized(grad, recipe), *_quantized(grad, recipe, transposed=True))


class Fp8Linear(torch.autograd.Function):
    """TE's ``_Linear`` in FP8 without an input all-gather: ``x @ weight.T (+ bias)`` keeping the column-wise FP8
    copy of ``x`` (NOTE [FP8 linears on Hopper])."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                recipe: str) -> torch.Tensor:
        rowwise = _quantized(x, recipe)
        saved = _quantized(x, recipe, transposed=True)
        out = F.linear(x, weight, bias)  # x's bytes are those of its FP8 copy's GEMM: the same output
        del rowwise  # linear.py:560: the row-wise data is dropped before saving
        ctx.save_for_backward(*saved, weight)
        ctx.shape, ctx.has_bias, ctx.recipe = x.shape, bias is not None, recipe
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        data, scale, weight = ctx.saved_tensors
        copies = _grad_output_copies(grad, ctx.recipe)
        grad_input = grad.matmul(weight).view(ctx.shape) if ctx.needs_input_grad[0] else None
        grad_weight = _weight_grad(grad, data.shape[1], weight) if ctx.needs_input_grad[1] else None
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        del copies, data, scale
        return grad_input, grad_weight, grad_bias, None


class Fp8GatheredLinear(torch.autograd.Function):
    """TE's column-parallel ``_Linear`` in FP8 under sequence parallelism (``x``: [tokens/tp, in]), linear.py:328-363:
    the token shard is quantized (row-wise only for ``delayed``/``tensorwise``, whose column-wise data cannot be
    all-gathered; both for ``blockwise``), gathered row-wise in FP8 for the GEMM (freed after it, :489), and the
    shard saved: row-wise, or column-wise for ``blockwise`` (:546-560, ``supports_only_rowwise_all_gather``);
    backward gathers the saved shard again (transposing it where it was saved row-wise, :1088)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                group: TensorParallelGroup, recipe: str) -> torch.Tensor:
        shard = _quantized(x, recipe)
        kept = _quantized(x, recipe, transposed=True) if recipe == "blockwise" else shard
        total = group.all_gather(shard[0]), group.all_gather(shard[1])
        out = F.linear(_stand_in(total[0].shape[0], x.shape[-1], x), weight, bias)
        del total, shard  # linear.py:489 clear_tensor_data(inputmat_total); the shard's row-wise data if unkept
        ctx.save_for_backward(*kept, weight)
        ctx.group, ctx.has_bias, ctx.recipe = group, bias is not None, recipe
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        data, scale, weight = ctx.saved_tensors
        if ctx.recipe == "blockwise":  # the column-wise [in, tokens/tp] shards gathered into [in, tokens]
            size = ctx.group.size
            gathered = data.new_empty(data.shape[0], data.shape[1] * size), scale.new_empty(scale.numel() * size)
        else:  # gathered row-wise, then update_usage(columnwise_usage=True) transposes it
            total = ctx.group.all_gather(data), ctx.group.all_gather(scale)
            gathered = _quantized(total[0], ctx.recipe, transposed=True)
            del total
        copies = _grad_output_copies(grad, ctx.recipe)
        grad_input = ctx.group.reduce_scatter(grad.matmul(weight)) if ctx.needs_input_grad[0] else None
        grad_weight = _weight_grad(grad, grad.shape[0], weight) if ctx.needs_input_grad[1] else None
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        del gathered, copies
        return grad_input, grad_weight, grad_bias, None, None


class Fp8GroupedMatmul(torch.autograd.Function):
    """TE's ``GroupedLinear`` in FP8: each expert's rows quantized (``split_quantize``), the column-wise copies
    saved; the weight [experts, in, out] as the reference's :class:`~remat.models.moe.GroupedMatmul`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, counts: list[int], recipe: str) -> torch.Tensor:
        rowwise = _quantized(x, recipe)
        saved = _quantized(x, recipe, transposed=True)
        out = grouped_mm(x, weight, counts)
        del rowwise
        ctx.save_for_backward(*saved, weight)
        ctx.shape, ctx.counts, ctx.recipe = x.shape, counts, recipe
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        data, scale, weight = ctx.saved_tensors
        copies = _grad_output_copies(grad, ctx.recipe)
        grad_x = grouped_mm(grad, weight.transpose(1, 2), ctx.counts) if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = weight.new_empty(weight.shape)
            for e, (rows, g) in enumerate(zip(ctx.counts, grad.split(ctx.counts))):
                torch.mm(_stand_in(rows, weight.shape[1], grad).t(), g, out=grad_weight[e])
        del copies, data, scale
        return grad_x, grad_weight, None, None


def _nn_linear(module: nn.Linear, recipe: str, x: torch.Tensor) -> torch.Tensor:
    return Fp8Linear.apply(x, module.weight, module.bias, recipe)


def _column(module: ColumnParallelLinear, recipe: str, x: torch.Tensor) -> torch.Tensor:
    if module.sp:
        return Fp8GatheredLinear.apply(x, module.weight, module.bias, module.group, recipe)
    return Fp8Linear.apply(CopyToRegion.apply(x, module.group), module.weight, module.bias, recipe)


def _row(module: RowParallelLinear, recipe: str, x: torch.Tensor) -> torch.Tensor:
    return module.reduce_partial(Fp8Linear.apply(x, module.weight, None, recipe))


def _grouped(module: GroupedLinear, recipe: str, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    return Fp8GroupedMatmul.apply(x, module.weight, counts, recipe)


def prepare_fp8(model: nn.Module, recipe: str, bf16_layers: Sequence[int] = ()) -> int:
    """Run every TE linear of ``model`` (:func:`is_fp8_weight`; NOTE [FP8 linears on Hopper]) in FP8 with ``recipe``,
    except in the layers ``model.layers[i]`` for i in ``bf16_layers`` (``--first-last-layers-bf16``): each module's
    forward becomes the FP8 one (an instance attribute, like the kernel profile's: recompute regions installed
    later wrap it). Returns how many modules changed. Each changed module is marked ``saves_fp8_input``
    (:func:`remat.memory.wgrad_fusion.keep_fused_inputs` leaves its input alone: the FP8 forward saves its own copy,
    as TE does whatever the fusion)."""
    skipped = {f"layers.{i}." for i in bf16_layers}
    changed = 0
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, nn.Parameter) or not is_fp8_weight(f"{name}.weight"):
            continue
        if any(name.startswith(prefix) for prefix in skipped):
            continue
        if isinstance(module, ColumnParallelLinear):
            forward = functools.partial(_column, module, recipe)
        elif isinstance(module, RowParallelLinear):
            forward = functools.partial(_row, module, recipe)
        elif isinstance(module, GroupedLinear):
            forward = functools.partial(_grouped, module, recipe)
        elif isinstance(module, nn.Linear):
            forward = functools.partial(_nn_linear, module, recipe)
        else:
            raise TypeError(f"{name}: {type(module).__name__} holds an FP8 weight but has no FP8 forward in "
                            "remat.memory.fp8; please report this model")
        module.__dict__["forward"] = forward
        module.saves_fp8_input = True
        changed += 1
    return changed
