"""Predict a training step's memory timeline without running it.

``predict`` runs the user's real model code under ``FakeTensorMode``: parameters, activations and gradients
are fake tensors that carry shapes, dtypes and storages but own no memory, so a 175B-parameter config traces on
a laptop. The step is recorded by the same :class:`~remat.measure.StepRecorder` that :func:`remat.measure`
uses on real tensors, so the result is the same :class:`~remat.timeline.Timeline`, phase for phase and byte for
byte: prediction is a measurement of a fake run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map

from remat.apply import apply
from remat.config import ModelConfig
from remat.measure import CUDA_BLOCK, Batch, record_step
from remat.model import build_model, sample_batch
from remat.policy import Policy
from remat.timeline import Timeline

ModelSource = ModelConfig | Callable[[], nn.Module]
OptimizerFactory = Callable[[Any], torch.optim.Optimizer]


def _fake_batch(fake_mode: FakeTensorMode, batch: Batch | Callable[[], Batch]) -> Batch:
    if callable(batch):
        return batch()  # called inside the fake mode: whatever it makes is fake
    return tree_map(lambda x: fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) else x, batch)


def predict(model: ModelSource, policy: Policy | str = "none", *, batch: Batch | Callable[[], Batch] | None = None,
            optimizer: OptimizerFactory | None = None,
            loss_fn: Callable[[Any, Batch], torch.Tensor] | None = None,
            layers: str | Sequence[nn.Module] | None = None, device: str = "cpu") -> Timeline:
    """Predict the memory :class:`Timeline` of one training step of ``model`` under ``policy``.

    ``model`` is a :class:`ModelConfig` (the reference GPT is built from it) or a zero-argument factory that
    builds the user's model; the factory is called under the fake mode, so its parameters are fake too. For a
    factory, ``batch`` is required: real tensors (converted to fake ones of the same shape) or a zero-argument
    callable called under the fake mode. ``optimizer`` is an optional factory ``params -> Optimizer``
    (e.g. ``torch.optim.Adam``) whose ``step()`` becomes part of the step. ``device='cuda'`` rounds every
    storage to the CUDA caching allocator's 512-byte blocks. Nothing is allocated for real.
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: predict models 'cpu' (exact bytes) or 'cuda' (512-byte blocks)")
    if isinstance(model, ModelConfig):
        config = model
        factory: Callable[[], nn.Module] = lambda: build_model(config)
        if batch is None:
            batch = sample_batch(config)  # a few KiB of token ids, made for real and then faked
    else:
        if not callable(model):
            raise TypeError("predict(model=...) takes a ModelConfig or a zero-argument function that builds the "
                            "model")
        factory = model
        if batch is None:
            raise ValueError("predict(factory, ...) needs batch=: the model's inputs (real tensors, or a function "
                             "that makes them)")
    with FakeTensorMode(allow_non_fake_inputs=False) as fake_mode:
        module = factory()
        state = apply(module, policy, layers=layers)
        opt = optimizer(module.parameters()) if optimizer is not None else None
        timeline, _ = record_step(module, _fake_batch(fake_mode, batch), optimizer=opt, loss_fn=loss_fn,
                                  layers=state.layers, block_bytes=CUDA_BLOCK if device == "cuda" else 1)
    timeline.meta.update({"backend": "fake", "device": device})
    if isinstance(model, ModelConfig):
        timeline.meta["config"] = model.to_dict()
    return timeline
