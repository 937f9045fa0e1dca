"""The checks of a training step before and while it is recorded (:func:`~remat.memory.measure.measure` and
:func:`~remat.memory.predict.predict`): what can be run and measured, and the loss backward starts from."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from remat.config import ModelConfig

Batch = Sequence[Any] | dict[str, Any]


class MeasureError(ValueError):
    """A training step that cannot be measured or predicted as given; the message says what to change."""


def loss_of(output: Any) -> torch.Tensor:
    """The scalar loss in a model's output: a tensor, or an object/dict with ``loss`` (Hugging Face)."""
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", output)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise MeasureError("the model's output is not a scalar loss: return the loss from forward, or pass "
                           "loss_fn=lambda output, batch: ... to measure/predict")
    return loss


def check_step(model: Any, batch: Any, who: str = "measure") -> None:
    """Refuse, before anything runs, a step that cannot be recorded: ``model`` not a module or without trainable
    parameters, gradients disabled, ``batch`` not a tuple/list/dict. ``who`` names the caller in the messages."""
    if not isinstance(model, nn.Module):
        raise MeasureError(f"{who}: model must be a torch.nn.Module, got {type(model).__name__}")
    params = list(model.parameters())
    name = type(model).__name__
    if not params:
        raise MeasureError(f"{who}: {name} has no parameters, so a training step has nothing to train: give the "
                           "model whose step you want to measure (its parameters, gradients and activations)")
    if not any(p.requires_grad for p in params):
        raise MeasureError(f"{who}: every parameter of {name} has requires_grad=False (frozen), so backward "
                           "computes nothing: unfreeze what you train (p.requires_grad_(True)) before measuring")
    if torch.is_inference_mode_enabled() or not torch.is_grad_enabled():
        raise MeasureError(f"{who}: gradients are disabled here (torch.no_grad() or torch.inference_mode()), but a "
                           "training step runs backward: call it outside that block")
    if not isinstance(batch, (tuple, list, dict)):
        raise MeasureError(f"{who}: batch must be a tuple or list of the model's positional inputs or a dict of "
                           f"its keyword inputs, got {type(batch).__name__}: e.g. batch=(tokens, labels)")


def check_reference_batch(config: ModelConfig, batch: Batch, who: str = "measure", exact_shape: bool = False) -> None:
    """Refuse a batch the reference GPT of ``config`` cannot take: ``(tokens, labels)``, integer tensors of the
    same shape ``[micro_batch, seq]`` (seq at most ``config.seq_length`` with learned positions; exactly
    ``[micro_batch_size, seq_length]`` with ``exact_shape``, as a tensor-parallel rank needs) whose ids are in
    ``[0, vocab_size)``. The ids are read, so call it on real tensors only."""
    want = ("(tokens, labels): two integer tensors of shape [micro_batch, seq], e.g. "
            "remat.models.sample_batch(config)")
    if isinstance(batch, dict):
        values = [batch.get("tokens"), batch.get("labels")] if set(batch) == {"tokens", "labels"} else [*batch.values()]
    else:
        values = list(batch)
    if len(values) != 2 or not all(isinstance(t, torch.Tensor) for t in values):
        raise MeasureError(f"{who}: batch must be {want} for the reference GPT; got {len(values)} item(s)")
    tokens, labels = values
    for label, t in (("tokens", tokens), ("labels", labels)):
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise MeasureError(f"{who}: batch {label} are {t.dtype}, not token ids: the reference GPT takes {want}")
        if t.dim() != 2 or t.numel() == 0:
            raise MeasureError(f"{who}: batch {label} have shape {list(t.shape)}; the reference GPT takes {want}")
    if tokens.shape != labels.shape:
        raise MeasureError(f"{who}: batch tokens {list(tokens.shape)} and labels {list(labels.shape)} differ in "
                           "shape: labels are the tokens shifted by one, of the same shape")
    if exact_shape and tuple(tokens.shape) != (config.micro_batch_size, config.seq_length):
        raise MeasureError(f"{who}: batch shape {list(tokens.shape)} is not [micro_batch_size, seq_length] = "
                           f"[{config.micro_batch_size}, {config.seq_length}], which a tensor-parallel rank needs: "
                           "use remat.models.sample_batch(config)")
    if config.position == "learned" and tokens.shape[1] > config.seq_length:
        raise MeasureError(f"{who}: batch sequence length {tokens.shape[1]} exceeds seq_length={config.seq_length}, "
                           "the learned position table's size: cut the batch or raise seq_length")
    for label, t in (("tokens", tokens), ("labels", labels)):
        low, high = int(t.min()), int(t.max())
        if low < 0 or high >= config.vocab_size:
            bad = low if low < 0 else high
            raise MeasureError(f"{who}: batch {label} hold id {bad}, outside the vocabulary [0, {config.vocab_size}) "
                               "(vocab_size): use ids below vocab_size, or raise vocab_size")


def check_real_step(model: nn.Module, optimizer: Any, loss_fn: Any) -> None:
    """What :func:`~remat.memory.measure.measure` refuses beyond :func:`check_step`: an ``optimizer`` that is not
    a torch optimizer, a ``loss_fn`` that cannot be called, and a model on the meta device or in eval mode."""
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise MeasureError(f"measure: optimizer={optimizer!r:.40} is not a torch.optim.Optimizer: give one over the "
                           "model's parameters, e.g. torch.optim.Adam(model.parameters()), or None")
    if loss_fn is not None and not callable(loss_fn):
        raise MeasureError(f"measure: loss_fn={loss_fn!r:.40} is not callable: give loss_fn(output, batch) -> loss")
    name = type(model).__name__
    if next(model.parameters()).is_meta:
        raise MeasureError(f"measure: {name} is on the meta device (no memory to measure): build it on cpu or cuda, "
                           "or use remat.predict")
    if not model.training:
        raise MeasureError(f"measure: {name} is in eval mode, whose step (no dropout) is not the training step: call "
                           "model.train() first")


def check_loss(loss: Any, from_loss_fn: bool) -> None:
    """Refuse a loss backward cannot start from: not a scalar tensor, or one that does not require grad."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
        raise MeasureError(f"the loss {'loss_fn gave' if from_loss_fn else 'of the output'} is not a scalar tensor "
                           "that requires grad, so backward has nothing to compute: return the loss computed from the "
                           "model's output (not detached, not under torch.no_grad())")
