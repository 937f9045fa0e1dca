"""The language-model loss: PyTorch's cross-entropy, or one of the three Megatron-LM runs, each an autograd Function
whose allocations follow its source (the same in-place operations, saved tensors and dtype casts), so that a fake
trace holds every logits-sized tensor a GPU holds.

``ModelConfig.cross_entropy`` names it. Megatron-LM (d98e8a64) picks one at every tensor-parallel size, tp = 1
included (megatron/core/models/common/language_module/language_module.py::compute_language_model_loss):

* ``torch``: ``F.cross_entropy(logits.float())``, log_softmax + nll_loss (the reference GPT's default).
* ``megatron``: ``_VocabParallelCrossEntropy`` (megatron/core/tensor_parallel/cross_entropy.py), without
  ``--cross-entropy-loss-fusion``: one fp32 copy of the logits (``.float()``; none for fp32 logits) made into the
  softmax in place and saved; backward turns it into the gradient in place and returns it in fp32, which autograd
  casts to the logits' dtype.
* ``megatron_fused``: ``--cross-entropy-loss-fusion`` with ``--cross-entropy-fusion-impl native`` (the default),
  megatron/core/fusions/fused_cross_entropy.py: the same forward, the two all-reduces batched into one
  ``torch.cat``; its helpers run under ``torch.compile`` (megatron/core/jit.py), which in backward computes the
  gradient in a new fp32 buffer and returns it ``.to(torch.bfloat16)`` (whatever the logits' dtype).
* ``te``: ``--cross-entropy-fusion-impl te``, TransformerEngine's ``parallel_cross_entropy`` as Megatron pins it
  (v2.17.1, 4329ff84: transformer_engine/pytorch/cross_entropy.py, triton/cross_entropy.py): two Triton kernels
  write the gradient into the logits themselves in forward and save them; backward scales them in place. (TE 2.18
  writes it into a new fp32 tensor instead, NVIDIA/TransformerEngine#3193; Megatron-LM d98e8a64 refuses the fusion.)

Bytes per logit element beyond the rest (N tokens x V/tp logits, bf16 model): ``megatron``: forward 6 (the bf16
logits + the fp32 copy), saved 4, backward 6 (the fp32 gradient + its bf16 cast); ``megatron_fused``: 6, 4 and 10
(the saved softmax, inductor's fp32 buffer and the bf16 gradient); ``te``: 2 throughout. Besides those, [N]-sized
temporaries: the eager source's (inductor fuses some of ``megatron_fused``'s away), and the Triton kernels'
per-row values, which the kernels keep in registers. Checked against Megatron's H100 memory test
gpt3_mcore_te_tp2_pp2_cross_entropy_loss_fusion (1.711 GiB, 0.38 GiB = one fp32 logits shard above the same job
unfused), and by running ``fused_cross_entropy.py`` under torch.compile (inductor, CPU) and reading its buffers
(forward: the fp32 copy alone, written in place; backward: that one extra buffer).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from remat.config import CROSS_ENTROPY

if TYPE_CHECKING:
    from remat.models.tp_layers import TensorParallelGroup

__all__ = ["CROSS_ENTROPY", "FusedVocabParallelCrossEntropy", "TECrossEntropy", "VocabParallelCrossEntropy",
           "language_model_loss", "token_losses"]
TE_IGNORE_INDEX = -100  # megatron/core/extensions/transformer_engine.py::te_parallel_cross_entropy passes it


def language_model_loss(logits: torch.Tensor, labels: torch.Tensor, kind: str,
                        group: TensorParallelGroup | None = None) -> torch.Tensor:
    """The mean cross-entropy of ``logits`` ([..., V/tp], this rank's vocabulary shard) against ``labels`` ([...])
    computed by ``kind`` (one of :data:`CROSS_ENTROPY`); ``group`` is the tensor-parallel group (None: tp = 1).

    The Megatron kinds give the per-token loss (as Megatron's loss function receives it) and average it here, so
    every kind has the gradient of ``F.cross_entropy``'s mean."""
    if kind == "torch":
        if group is not None and group.size > 1:
            raise ValueError("cross_entropy='torch' needs the whole vocabulary on one rank (tp = 1)")
        # Megatron computes the cross-entropy in fp32 whatever the model's dtype.
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
    return token_losses(logits, labels, kind, group).mean()


def token_losses(logits: torch.Tensor, labels: torch.Tensor, kind: str,
                 group: TensorParallelGroup | None = None) -> torch.Tensor:
    """The per-token cross-entropy (fp32, shaped as ``labels``) of ``logits`` computed by ``kind``, as
    Megatron's ``compute_language_model_loss`` returns it (``torch``: ``F.cross_entropy`` without reduction)."""
    if kind == "torch":
        if group is not None and group.size > 1:
            raise ValueError("cross_entropy='torch' needs the whole vocabulary on one rank (tp = 1)")
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)
    function = {"megatron": VocabParallelCrossEntropy, "megatron_fused": FusedVocabParallelCrossEntropy,
                "te": TECrossEntropy}.get(kind)
    if function is None:
        raise ValueError(f"cross_entropy={kind!r}: must be one of {', '.join(CROSS_ENTROPY)}")
    return function.apply(logits, labels, group)


def _rank(group: TensorParallelGroup | None) -> tuple[int, int]:
    return (0, 1) if group is None else (group.rank, group.size)


def _all_reduce(group: TensorParallelGroup | None, x: torch.Tensor, op: str = "sum") -> None:
    if group is not None:  # tp = 1: Megatron's all-reduce over one rank changes nothing
        group.all_reduce_(x, op=op)


# -- megatron/core/tensor_parallel/cross_entropy.py::VocabParallelCrossEntropy, statement for statement ----------
def _logits_max(vocab_parallel_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    vocab_parallel_logits = vocab_parallel_logits.float()  # the fp32 copy (the logits themselves when fp32)
    logits_max = torch.max(vocab_parallel_logits, dim=-1)[0]
    return vocab_parallel_logits, logits_max


def _predicted_logits(vocab_parallel_logits: torch.Tensor, target: torch.Tensor, logits_max: torch.Tensor,
                      group: TensorParallelGroup | None,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    rank, _ = _rank(group)
    partition_vocab_size = vocab_parallel_logits.size()[-1]
    vocab_start_index = rank * partition_vocab_size
    vocab_end_index = vocab_start_index + partition_vocab_size
    vocab_parallel_logits -= logits_max.unsqueeze(dim=-1)  # in place
    target_mask = (target < vocab_start_index) | (target >= vocab_end_index)
    masked_target = target.clone() - vocab_start_index
    # masked_target[target_mask] = 0, which index_put_ runs as masked_fill_ (no index tensor, and no GPU scalar:
    # TensorAdvancedIndexing.cpp::canDispatchToMaskedFill); the fake index_put_ would allocate where it does not
    masked_target.masked_fill_(target_mask, 0)
    logits_2d = vocab_parallel_logits.view(-1, partition_vocab_size)
    masked_target_1d = masked_target.view(-1)
    arange_1d = torch.arange(start=0, end=logits_2d.size()[0], device=logits_2d.device)
    predicted_logits_1d = logits_2d[arange_1d, masked_target_1d]
    predicted_logits_1d = predicted_logits_1d.clone().contiguous()
    predicted_logits = predicted_logits_1d.view_as(target)
    predicted_logits.masked_fill_(target_mask, 0.0)  # predicted_logits[target_mask] = 0.0, as above
    exp_logits = vocab_parallel_logits
    torch.exp(vocab_parallel_logits, out=exp_logits)  # in place
    sum_exp_logits = exp_logits.sum(dim=-1)
    return target_mask, masked_target_1d, predicted_logits, sum_exp_logits, exp_logits


def _cross_entropy_loss(exp_logits: torch.Tensor, predicted_logits: torch.Tensor,
                        sum_exp_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    loss = torch.log(sum_exp_logits) - predicted_logits
    exp_logits.div_(sum_exp_logits.unsqueeze(dim=-1))  # the softmax, in place
    return exp_logits, loss


def _gradients(softmax: torch.Tensor, target_mask: torch.Tensor, masked_target_1d: torch.Tensor,
               grad_output: torch.Tensor) -> torch.Tensor:
    # prepare_gradient_calculation_operands + calculate_gradients: the saved softmax becomes the gradient in place
    grad_input = softmax
    partition_vocab_size = softmax.size()[-1]
    grad_2d = grad_input.view(-1, partition_vocab_size)
    arange_1d = torch.arange(start=0, end=grad_2d.size()[0], device=grad_2d.device)
    softmax_update = 1.0 - target_mask.view(-1).float()
    grad_2d[arange_1d, masked_target_1d] -= softmax_update
    grad_input.mul_(grad_output.unsqueeze(dim=-1))
    return grad_input


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Megatron's ``_VocabParallelCrossEntropy`` (label smoothing 0): the per-token loss of ``logits``, this rank's
    vocabulary shard, against ``target``."""

    @staticmethod
    def forward(ctx: Any, vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                group: TensorParallelGroup | None) -> torch.Tensor:
        vocab_parallel_logits, logits_max = _logits_max(vocab_parallel_logits)
        _all_reduce(group, logits_max, "max")
        target_mask, masked_target_1d, predicted_logits, sum_exp_logits, exp_logits = _predicted_logits(
            vocab_parallel_logits, target, logits_max, group)
        _all_reduce(group, predicted_logits)
        _all_reduce(group, sum_exp_logits)
        exp_logits, loss = _cross_entropy_loss(exp_logits, predicted_logits, sum_exp_logits)
        ctx.save_for_backward(exp_logits, target_mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        # fp32; autograd casts it to the logits' dtype while the softmax is still saved
        return _gradients(softmax, target_mask, masked_target_1d, grad_output), None, None


class FusedVocabParallelCrossEntropy(torch.autograd.Function):
    """megatron/core/fusions/fused_cross_entropy.py::_VocabParallelCrossEntropy: the same helpers, one all-reduce
    of ``cat(predicted_logits, sum_exp_logits)``, and the gradient returned as ``.to(torch.bfloat16)``."""

    @staticmethod
    def forward(ctx: Any, vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                group: TensorParallelGroup | None) -> torch.Tensor:
        vocab_parallel_logits, logits_max = _logits_max(vocab_parallel_logits)
        _all_reduce(group, logits_max, "max")
        target_mask, masked_target_1d, predicted_logits, sum_exp_logits, exp_logits = _predicted_logits(
            vocab_parallel_logits, target, logits_max, group)
        predicted_logits_sum_exp_logits = torch.cat((predicted_logits, sum_exp_logits))
        del predicted_logits, sum_exp_logits  # locals of the compiled calculate_predicted_logits: gone on return
        _all_reduce(group, predicted_logits_sum_exp_logits)
        split_val = predicted_logits_sum_exp_logits.size()[0] // 2
        predicted_logits, sum_exp_logits = torch.split(predicted_logits_sum_exp_logits, split_val)
        exp_logits, loss = _cross_entropy_loss(exp_logits, predicted_logits, sum_exp_logits)
        ctx.save_for_backward(exp_logits, target_mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        # calculate_gradients runs compiled: the in-place index_put_ on the saved softmax is functionalised, and
        # inductor does not re-inplace it; it copies the softmax into a new fp32 buffer, scatters into that, and
        # from it writes the bf16 result and the softmax (the mutation); the buffer goes when the graph returns
        # (seen in inductor's output code for this function: empty_strided((N, V)) fp32 beside the bf16 output)
        work = softmax.clone()
        grad_bf16 = torch.empty_like(softmax, dtype=torch.bfloat16)
        grad_bf16.copy_(_gradients(work, target_mask, masked_target_1d, grad_output))
        softmax.copy_(work)
        del work
        return grad_bf16, None, None  # bf16 always (autograd casts it on for fp32/fp16 logits)


# -- TransformerEngine v2.17.1: transformer_engine/pytorch/triton/cross_entropy.py -------------------------------
def _te_forward(inp: torch.Tensor, target: torch.Tensor,
                group: TensorParallelGroup | None) -> tuple[torch.Tensor, torch.Tensor]:
    """cross_entropy_forward: the per-token loss, and ``inp`` holding the gradient (written in place)."""
    B, SQ, V = inp.shape
    n_rows = B * SQ
    loss_1d = torch.zeros(n_rows, dtype=torch.float32, device=inp.device)
    m_d_X_y = torch.zeros(n_rows * 3, dtype=torch.float32, device=inp.device)
    n_non_ignore = torch.zeros(1, dtype=torch.int64, device=inp.device)
    if inp.stride(-1) != 1 or inp.stride(-2) != inp.shape[-1]:
        inp = inp.contiguous()
    if target.stride(-1) != 1:
        target = target.contiguous()
    rank, world_size = _rank(group)
    x, y = inp.view(n_rows, V), target.reshape(n_rows)
    local = _te_online_softmax(x, y, m_d_X_y.view(n_rows, 3), rank, n_non_ignore)
    n_non_ignore = torch.clamp(n_non_ignore, min=1)
    m_d_X_y_gathered = group.all_gather(m_d_X_y) if group is not None and world_size > 1 else m_d_X_y
    _te_cross_entropy_kernel(x, y, local, rank, loss_1d, m_d_X_y.view(n_rows, 3),
                             m_d_X_y_gathered.view(world_size, n_rows, 3))
    return torch.reshape(loss_1d, (B, SQ)), inp


def _te_online_softmax(x: torch.Tensor, y: torch.Tensor, stats: torch.Tensor, rank: int,
                       n_non_ignore: torch.Tensor) -> torch.Tensor:
    """online_softmax_kernel: each row's max m, sum d of exp(x - m) and target logit X_y (-inf off this rank's
    shard) into ``stats`` [N, 3]. The kernel only reads ``x``; here ``x`` becomes exp(x - m) in place, which the
    second kernel overwrites anyway, so that no [N, V] temporary exists. Returns the targets' local columns."""
    V = x.shape[-1]
    n_non_ignore.add_((y != TE_IGNORE_INDEX).sum())
    inside = (y >= rank * V) & (y < (rank + 1) * V)
    local = (y - rank * V).clamp_(0, V - 1)
    stats[:, 2].copy_(x.gather(1, local.unsqueeze(1)).squeeze(1).float().masked_fill_(~inside, float("-inf")))
    m = x.amax(dim=-1)
    stats[:, 0].copy_(m)
    x.sub_(m.unsqueeze(-1)).exp_()
    stats[:, 1].copy_(x.sum(dim=-1))
    return local


def _te_cross_entropy_kernel(x: torch.Tensor, y: torch.Tensor, local: torch.Tensor, rank: int, loss_1d: torch.Tensor,
                             mine: torch.Tensor, gathered: torch.Tensor) -> None:
    """cross_entropy_kernel (reduce_loss False, no label smoothing): combine the ranks' (m, d, X_y), write the loss
    into ``loss_1d`` and the gradient softmax(x) - onehot(y) into ``x`` (holding exp(x - m_local)) in place; an
    ignored row's gradient and loss are 0."""
    m, d, x_y = gathered.unbind(-1)  # [world, N] each
    big_m = m.amax(dim=0)
    big_d = (d * torch.exp(m - big_m)).sum(dim=0)
    x_y = x_y.amax(dim=0)
    loss_1d.copy_(torch.log(big_d) - (x_y - big_m))
    x.mul_(torch.exp(mine[:, 0] - big_m).div_(big_d).unsqueeze(-1))
    rows = torch.arange(x.shape[0], device=x.device)
    V = x.shape[-1]
    inside = (y >= rank * V) & (y < (rank + 1) * V)
    x.index_put_((rows, local), inside.to(x.dtype).neg_(), accumulate=True)
    ignored = y == TE_IGNORE_INDEX
    x.masked_fill_(ignored.unsqueeze(-1), 0.0)
    loss_1d.masked_fill_(ignored, 0.0)


def _te_backward(inp: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
    """cross_entropy_backward: ``inp`` (the gradient) times ``grad_output`` in place (element_mul_kernel). TE skips
    it when ``grad_output`` equals a new ``torch.tensor(1.0)``, which the per-token loss's [s, b] gradient never
    does (that 4-byte tensor is left out)."""
    return inp.mul_(grad_output.contiguous().unsqueeze(-1))


class TECrossEntropy(torch.autograd.Function):
    """transformer_engine/pytorch/cross_entropy.py::CrossEntropyFunction (v2.17.1; label smoothing 0, reduce_loss
    False, ignore index -100): saves the logits, which hold the gradient, and returns them as the gradient."""

    @staticmethod
    def forward(ctx: Any, inp: torch.Tensor, target: torch.Tensor,
                group: TensorParallelGroup | None) -> torch.Tensor:
        loss, inp = _te_forward(inp, target, group)
        ctx.save_for_backward(inp.detach())
        return loss

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (inp,) = ctx.saved_tensors
        return _te_backward(inp, grad_output), None, None
