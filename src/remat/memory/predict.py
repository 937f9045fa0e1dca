"""Predict a training step's memory timeline without running it.

``predict`` runs the user's real model code under ``FakeTensorMode``: parameters, activations and gradients
are fake tensors that carry shapes, dtypes and storages but own no memory, so a 175B-parameter config traces on
a laptop. The step is recorded by the same :class:`~remat.memory.measure.StepRecorder` that :func:`remat.measure`
uses on real tensors, so the result is the same :class:`~remat.timeline.Timeline`, phase for phase and byte for
byte: prediction is a measurement of a fake run.

For the reference model, a deep stack is not traced layer by layer: :mod:`remat.memory.compose` lays out the step from
the trace of a shallow stack that has every layer role of the deep one (a few layers), and each shallow trace is
cached, so a sweep over every Megatron policy of an 80-layer model costs a handful of shallow traces.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map

from remat.config import ModelConfig
from remat.memory.compose import CompositionError, ShallowTrace, compose, shallow_stand_ins
from remat.memory.measure import Batch, record_step
from remat.models.gpt import build_model, sample_batch
from remat.models.tensor_parallel import SimulatedGroup, build_tp_model, check_tensor_parallel
from remat.policy import Policy
from remat.recompute.apply import apply
from remat.recompute.region import RecomputeLayout
from remat.timeline import Timeline
from remat.units import CUDA_BLOCK

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
    if isinstance(policy, str):
        policy = Policy.parse(policy)
    if isinstance(model, ModelConfig) and batch is None and optimizer is None and loss_fn is None and layers is None:
        return predict_config(model, policy, device=device)
    return trace(model, policy, batch=batch, optimizer=optimizer, loss_fn=loss_fn, layers=layers, device=device)


def predict_config(config: ModelConfig, policy: Policy | str, *, device: str = "cpu", tp: int = 1,
                   sp: bool = False, compose_layers: bool = True) -> Timeline:
    """Predict the reference model of ``config`` under ``policy``, composing deep stacks from shallow traces.

    ``tp``/``sp``: predict one tensor-parallel rank (Megatron's sharding, :mod:`remat.models.tensor_parallel`), with or
    without sequence parallelism; ``policy.distribute_saved_activations`` splits group inputs over the ranks.
    With ``compose_layers=False`` (or when composition is refused) the whole stack is traced.
    """
    if isinstance(policy, str):
        policy = Policy.parse(policy)
    policy.layer_groups(config.num_layers)  # refuses k > depth, naming the depth
    check_tensor_parallel(config, tp, sp)
    stand_ins = list(shallow_stand_ins(policy, config.num_layers)) if compose_layers else []
    # a stand-in already traced (for another policy of a sweep) beats a shallower one still to trace
    stand_ins.sort(key=lambda c: ((config.replace(num_layers=c[1]), c[0], device, tp, sp) not in _SHALLOW, c[1]))
    if stand_ins and stand_ins[0][1] < config.num_layers:
        shallow_policy, shallow_depth = stand_ins[0]
        try:
            shallow = _shallow_trace(config.replace(num_layers=shallow_depth), shallow_policy, device, tp, sp)
            timeline = compose(shallow, shallow_policy, policy, config.num_layers)
        except CompositionError as err:
            timeline = trace_rank(config, policy, device, tp, sp)
            timeline.meta["composition_refused"] = str(err)
        else:
            timeline.meta["config"] = config.to_dict()
            timeline.meta.update({"tp": tp, "sp": sp})
        return timeline
    return trace_rank(config, policy, device, tp, sp)


def rank_model_factory(config: ModelConfig, tp: int = 1, sp: bool = False) -> Callable[[], nn.Module]:
    """What builds the model one rank runs: the reference GPT, or its tensor-parallel rank
    (:mod:`remat.models.tensor_parallel`,
    a simulated group of ``tp``, sequence-parallel with ``sp``); a ``tp`` that does not divide the config is
    refused here, naming the field."""
    if tp == 1 and not sp:
        return lambda: build_model(config)
    check_tensor_parallel(config, tp, sp)
    return lambda: build_tp_model(config, SimulatedGroup(tp), sp)


def trace_rank(config: ModelConfig, layout: RecomputeLayout, device: str = "cpu", tp: int = 1,
               sp: bool = False) -> Timeline:
    """The whole-stack fake trace of one rank (:func:`rank_model_factory`) under ``layout`` (a policy or a plan)."""
    if tp == 1 and not sp:
        timeline = trace(config, layout, device=device)
    else:
        timeline = trace(rank_model_factory(config, tp, sp), layout, batch=sample_batch(config), device=device)
        timeline.meta["config"] = config.to_dict()
    timeline.meta.update({"tp": tp, "sp": sp})
    return timeline


def predict_many(config: ModelConfig, policies: Iterable[Policy | str], *, device: str = "cpu", tp: int = 1,
                 sp: bool = False) -> list[Timeline]:
    """:func:`predict_config` for each policy; shallow traces are shared between policies."""
    return [predict_config(config, policy, device=device, tp=tp, sp=sp) for policy in policies]


_SHALLOW: dict[tuple[ModelConfig, Policy, str, int, bool], ShallowTrace] = {}
_SHALLOW_CAPACITY = 64


def _shallow_trace(config: ModelConfig, policy: Policy, device: str, tp: int, sp: bool) -> ShallowTrace:
    key = (config, policy, device, tp, sp)
    if key not in _SHALLOW:
        if len(_SHALLOW) >= _SHALLOW_CAPACITY:
            del _SHALLOW[next(iter(_SHALLOW))]
        _SHALLOW[key] = ShallowTrace(trace_rank(config, policy, device, tp, sp), policy)
    return _SHALLOW[key]


def trace(model: ModelSource, policy: Policy | str, *, batch: Batch | Callable[[], Batch] | None = None,
           optimizer: OptimizerFactory | None = None, loss_fn: Callable[[Any, Batch], torch.Tensor] | None = None,
           layers: str | Sequence[nn.Module] | None = None, device: str = "cpu") -> Timeline:
    """Trace the whole step under FakeTensorMode (see :func:`predict`)."""
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
