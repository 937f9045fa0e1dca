"""Predict a training step's memory timeline without running it: the model's code under ``FakeTensorMode``
(:func:`predict`, :func:`trace`), and the reference GPT's deep stacks composed from cached shallow traces
(:func:`predict_config`, :func:`predict_many`)."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map

from remat.config import ConfigError, ModelConfig, RoutingAssumption
from remat.memory import disk_cache
from remat.memory.compose import (
    CompositionError,
    Role,
    ShallowTrace,
    compose,
    config_family,
    cover_stand_ins,
    layer_kinds,
    policy_family,
    role_set,
    shallow_stand_ins,
    shallow_stand_ins_of_kinds,
)
from remat.memory.disk_cache import cached_timeline
from remat.memory.fake_hits import fake_tensor_mode
from remat.memory.fake_ops import cpu_fake_ops
from remat.memory.kernels import kernel_trace, prepare_model, resolve_kernels, use_kernels
from remat.memory.measure import Batch, MeasureError, check_step, record_step
from remat.memory.trace_pool import run_forked
from remat.models.gpt import build_model, empty_batch
from remat.models.tensor_parallel import SimulatedGroup, build_tp_model, check_tensor_parallel
from remat.policy import Policy, PolicyError
from remat.recompute.apply import apply
from remat.recompute.hf import fake_mask_reads
from remat.recompute.region import RecomputeLayout
from remat.timeline import Timeline, TimelineError
from remat.units import CUDA_BLOCK

ModelSource = ModelConfig | Callable[[], nn.Module]
OptimizerFactory = Callable[[Any], torch.optim.Optimizer]


# NOTE [prediction is a measurement of a fake run]
# predict runs the user's real model code under FakeTensorMode: parameters, activations and gradients are fake
# tensors that carry shapes, dtypes and storages but own no memory, so a 175B-parameter config traces on a
# laptop. The step is recorded by the same StepRecorder that remat.memory.measure uses on real tensors, so the
# result is the same Timeline, phase for phase and byte for byte.
#
# For the reference model, a deep stack is not traced layer by layer: remat.memory.compose lays out the step from
# the trace of a shallow stack that has every layer role of the deep one (a few layers), and each shallow trace is
# cached (SHALLOW_TRACES), so a sweep over every Megatron policy of an 80-layer model costs a handful of shallow traces.
def _fake_batch(fake_mode: FakeTensorMode, batch: Batch | Callable[[], Batch]) -> Batch:
    if callable(batch):
        return batch()  # called inside the fake mode: whatever it makes is fake
    return tree_map(lambda x: fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) else x, batch)


def predict(model: ModelSource, policy: Policy | str = "none", *, batch: Batch | Callable[[], Batch] | None = None,
            optimizer: OptimizerFactory | None = None,
            loss_fn: Callable[[Any, Batch], torch.Tensor] | None = None,
            layers: str | Sequence[nn.Module] | None = None, device: str = "cpu", kernels: str | None = None,
            ) -> Timeline:
    """Predict the memory timeline of one training step of ``model`` under ``policy``, allocating nothing.

    The model's own code runs under ``FakeTensorMode`` and is recorded exactly as :func:`~remat.memory.measure`
    records a real step, so the result is the :class:`~remat.timeline.Timeline` that measuring would give, byte
    for byte on CPU (NOTE [prediction is a measurement of a fake run]). A :class:`~remat.config.ModelConfig`
    without the other options goes to :func:`predict_config` (deep stacks composed from shallow traces).

    Args:
        model: a :class:`~remat.config.ModelConfig` (the reference GPT is built from it) or a zero-argument
            function that builds and returns the user's ``nn.Module``; it is called under the fake mode, so its
            parameters are fake too.
        policy: a :class:`~remat.policy.Policy` or its short form, applied with :func:`remat.recompute.apply`.
        batch: required with a factory: the model's inputs as real tensors (converted to fake ones of the same
            shape), or a zero-argument function called under the fake mode that makes them. With a config, the
            reference batch's shapes (:func:`~remat.models.gpt.empty_batch`, made fake).
        optimizer: a factory ``params -> Optimizer`` (e.g. ``torch.optim.Adam``, or
            :func:`~remat.memory.optimizer.adam_steady_state` for a step after the first) whose ``step()`` becomes
            part of the step.
        loss_fn: ``loss_fn(output, batch)`` gives the scalar loss (default: the output, or its ``.loss``).
        layers: the layer stack when it is not found automatically (see :func:`remat.recompute.find_layer_stack`).
        device: ``'cpu'`` (exact storage bytes) or ``'cuda'`` (every storage rounded up to the CUDA caching
            allocator's 512-byte blocks).
        kernels: whose kernels' saved tensors to trace: ``'cpu'``, ``'cuda'`` or ``'te'``
            (:mod:`remat.memory.kernels`); default ``'cuda'`` for ``device='cuda'``, else ``'cpu'``.

    Returns:
        The step's :class:`~remat.timeline.Timeline`, ``meta['backend'] == 'fake'`` (or ``meta['composed_from']``
        for a composed config).

    Raises:
        MeasureError: a model that is neither a config nor a function, a factory that does not return an
            ``nn.Module``, a factory without ``batch``, an unknown ``device``, or a step that cannot run
            backward (no trainable parameters, gradients disabled).
        PolicyError, ApplyError: a policy that does not parse or cannot be applied to the model.

    Example::

        >>> import torch
        >>> from torch import nn
        >>> from remat.config import ModelConfig
        >>> config = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16)
        >>> predict(config, "full/uniform/2").peak_bytes < predict(config, "none").peak_bytes
        True
        >>> class Net(nn.Module):  # any model whose forward runs a ModuleList of layers in a chain
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(4))
        ...     def forward(self, x):
        ...         for layer in self.layers:
        ...             x = layer(x)
        ...         return x.square().mean()
        >>> tl = predict(Net, "full/uniform/2@non-reentrant", batch=(torch.randn(8, 16),))
        >>> tl.meta["num_layers"], tl.meta["backend"]
        (4, 'fake')
    """
    if isinstance(policy, str):
        policy = Policy.parse(policy)
    if isinstance(model, ModelConfig) and batch is None and optimizer is None and loss_fn is None and layers is None:
        return predict_config(model, policy, device=device, kernels=kernels)
    return trace(model, policy, batch=batch, optimizer=optimizer, loss_fn=loss_fn, layers=layers, device=device,
                 kernels=kernels)


def predict_config(config: ModelConfig, policy: Policy | str, *, device: str = "cpu", tp: int = 1,
                   sp: bool = False, compose_layers: bool = True, kernels: str | None = None) -> Timeline:
    """Predict one training step of the reference GPT of ``config`` under ``policy``.

    A deep stack is composed from the cached fake trace of a shallow one with every layer role of the deep one
    (:func:`remat.memory.compose.compose`, exact for the reference model); when composition is refused the whole
    stack is traced and the reason is kept in ``meta['composition_refused']``. A policy with fine-grained
    offloading (``offload_modules``) is always traced in full; its host bytes are in ``meta['host_memory']``.

    Args:
        config: the reference model's configuration.
        policy: a :class:`~remat.policy.Policy` or its short form; ``num_layers`` above ``config.num_layers`` is
            refused, naming the depth.
        device: ``'cpu'`` (exact bytes) or ``'cuda'`` (512-byte blocks).
        tp: tensor-parallel size: predict one rank of Megatron's sharding (:mod:`remat.models.tensor_parallel`);
            ``policy.distribute_saved_activations`` splits group inputs over the ranks.
        sp: with ``tp``, sequence parallelism.
        compose_layers: False traces the whole stack (slower; the same timeline).

    Returns:
        The step's :class:`~remat.timeline.Timeline`; ``meta`` holds ``config``, ``tp``, ``sp`` and, when
        composed, ``composed_from``.

    Raises:
        PolicyError: a policy that does not parse, is not a policy, or does not fit the depth.
        ConfigError: ``config`` not a :class:`ModelConfig`; a ``tp``/``sp`` that does not divide the config (naming
            the field).

    Example::

        >>> from remat.config import ModelConfig
        >>> config = ModelConfig(num_layers=24, hidden_size=32, num_attention_heads=4, seq_length=16)
        >>> tl = predict_config(config, "full/uniform/4")
        >>> tl.meta["num_layers"], tl.meta["composed_from"]["num_layers"] < 24
        (24, True)
    """
    if kernels is not None:  # the profile of every trace below (remat.memory.kernels.use_kernels)
        with use_kernels(kernels):
            return predict_config(config, policy, device=device, tp=tp, sp=sp, compose_layers=compose_layers)
    check_config(config, "predict_config")
    policy = as_policy(policy, "policy")
    policy.layer_groups(config.num_layers)  # refuses k > depth, naming the depth
    check_tensor_parallel(config, tp, sp)
    # MoE stacks that mix dense and MoE layers compose from shallow stacks that mix them too; MoE layers given
    # different routing counts are not interchangeable, so they are traced in full
    kinds = layer_kinds(config)
    per_layer = config.moe_routing_assumption is not None and \
        RoutingAssumption.parse(config.moe_routing_assumption).per_layer
    # offloading moves bytes to the host at moments the roles do not describe: traced in full
    # so are window and full attention layers (NOTE [gpt-oss layers] in remat.models.blocks)
    per_layer = per_layer or config.mixed_layers  # and FP8 beside bf16 layers (remat.memory.fp8)
    stand_in = None if not compose_layers or per_layer or policy.offloads else \
        _stand_in(config, policy, kinds, (device, tp, sp, resolve_kernels(None, device)))
    if stand_in is not None and stand_in[1] < config.num_layers:
        shallow_policy, shallow_depth, small_kinds = stand_in
        small_config = _stand_in_config(config, shallow_depth, small_kinds)
        return _composed(config, policy, kinds, lambda: _shallow_trace(small_config, shallow_policy, device, tp, sp),
                         device, tp, sp)
    return trace_rank(config, policy, device, tp, sp)


def check_config(config: object, who: str) -> None:
    """Refuse a ``config`` that is not a :class:`ModelConfig` (``who`` names the function)."""
    if not isinstance(config, ModelConfig):
        raise ConfigError(f"{who}(config={config!r:.40}): give a remat.ModelConfig, e.g. ModelConfig(num_layers=8) "
                          "or remat.presets.get_preset('gpt-small')")


def as_policy(value: object, argument: str) -> Policy:
    """``value`` as a :class:`Policy` (its short form parsed); anything else is refused naming ``argument``."""
    if isinstance(value, str):
        return Policy.parse(value)
    if not isinstance(value, Policy):
        raise PolicyError(f"{argument}={value!r:.60}: give a remat.Policy or its short form, e.g. 'full/uniform/1'")
    return value


def _composed(config: ModelConfig, policy: Policy, kinds: tuple[str, ...] | None, shallow: Callable[[], ShallowTrace],
              device: str, tp: int, sp: bool) -> Timeline:
    """``policy``'s step composed from the shallow trace ``shallow()`` gives, or traced in full (the reason in
    ``meta['composition_refused']``) when that trace cannot be laid out for it."""
    try:
        trace_ = shallow()
        timeline = compose(trace_, trace_.policy, policy, config.num_layers, kinds)
    except CompositionError as err:
        timeline = trace_rank(config, policy, device, tp, sp)
        timeline.meta["composition_refused"] = str(err)
    else:
        timeline.meta["config"] = config.to_dict()
        timeline.meta.update({"tp": tp, "sp": sp})
    return timeline


def _stand_in(config: ModelConfig, policy: Policy, kinds: tuple[str, ...] | None, where: tuple[Any, ...],
              planned: Iterable[tuple[tuple[Any, ...], frozenset[Role], tuple[str, ...] | None]] = (),
              ) -> tuple[Policy, int, tuple[str, ...] | None] | None:
    """The shallow (policy, depth, layer kinds) to compose ``config``'s step from: a shallow trace already made
    (for another policy of a sweep, or ``planned``: (key, roles, layer kinds)) that has every layer role of this
    one, else the shallowest stand-in (:func:`~remat.memory.compose.shallow_stand_ins`); None when there is none."""
    need = role_set(policy, config.num_layers, kinds)
    family, config_kind = policy_family(policy), config_family(config)
    made = [(key, t.role_set, t.kinds) for key, t in reversed(SHALLOW_TRACES.items())]
    for (small_config, small_policy, *rest), roles, small_kinds in [*planned, *made]:
        if tuple(rest) == where and policy_family(small_policy) == family and need <= roles and \
                small_config.num_layers < config.num_layers and config_family(small_config) == config_kind:
            return small_policy, small_config.num_layers, small_kinds
    if kinds is None:
        return next(((p, d, None) for p, d in shallow_stand_ins(policy, config.num_layers)), None)
    return next(shallow_stand_ins_of_kinds(policy, kinds), None)


def _trace_key(config: ModelConfig, stand_in: tuple[Policy, int, tuple[str, ...] | None],
               where: tuple[Any, ...]) -> tuple[Any, ...]:
    """The key of :data:`SHALLOW_TRACES` under which the trace of ``stand_in`` (policy, depth, layer kinds) of
    ``config`` is kept."""
    small_policy, depth, small_kinds = stand_in
    return (_stand_in_config(config, depth, small_kinds), small_policy, *where)


def _stand_in_config(config: ModelConfig, depth: int, kinds: tuple[str, ...] | None) -> ModelConfig:
    """``config`` on a stand-in's ``depth`` layers, of ``kinds`` (None: the config's own layer pattern)."""
    return config.with_depth(depth, None if kinds is None else tuple(k == "moe" for k in kinds))


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
        timeline = trace(rank_model_factory(config, tp, sp), layout, batch=functools.partial(empty_batch, config),
                         device=device)
        timeline.meta["config"] = config.to_dict()
    timeline.meta.update({"tp": tp, "sp": sp})
    return timeline


def predict_many(config: ModelConfig, policies: Iterable[Policy | str], *, device: str = "cpu", tp: int = 1,
                 sp: bool = False) -> list[Timeline]:
    """:func:`predict_config` for each of ``policies``; the shallow traces are shared between them, so a sweep
    costs a handful of shallow traces.

    Args:
        config, device, tp, sp: as for :func:`predict_config`.
        policies: policies or their short forms.

    Returns:
        One :class:`~remat.timeline.Timeline` per policy, in order.

    Example::

        >>> from remat.config import ModelConfig
        >>> config = ModelConfig(num_layers=8, hidden_size=32, num_attention_heads=4, seq_length=16)
        >>> peaks = [tl.peak_bytes for tl in predict_many(config, ["none", "full/uniform/1", "selective"])]
        >>> peaks[1] < peaks[0]
        True
    """
    check_config(config, "predict_many")
    if isinstance(policies, (str, Policy)) or not isinstance(policies, Iterable):
        raise PolicyError(f"predict_many(policies={policies!r:.60}): give a list of policies, e.g. ['none', "
                          "'full/uniform/1'] (one policy: predict_config)")
    policies = [as_policy(p, f"policies[{i}]") for i, p in enumerate(policies)]
    prepare_shallow_traces(config, policies, device=device, tp=tp, sp=sp)
    return [predict_config(config, policy, device=device, tp=tp, sp=sp) for policy in policies]


def prepare_shallow_traces(config: ModelConfig, policies: Iterable[Policy], *, device: str = "cpu", tp: int = 1,
                           sp: bool = False, on_composed: Callable[[int, Any, float], None] | None = None,
                           finish: Callable[[int, Timeline, float], Any] | None = None) -> int:
    """Make, before :func:`predict_config` composes ``policies`` one by one, every shallow trace it will compose
    them from: chosen together (a trace serves every policy whose layer roles it has; the fewest traced layers
    that serve them all, :func:`~remat.memory.roles.cover_stand_ins`), read from the disk cache or traced side by
    side on the machine's cores (:mod:`remat.memory.trace_pool`).
    Returns how many were traced.

    With ``on_composed``, each policy whose shallow trace is made here is composed as soon as that trace is
    made, while the other traces are still being made, and handed over as ``on_composed(index in policies,
    timeline, seconds)``: the timeline :func:`predict_config` gives for it afterwards (from the same stand-in).
    With ``finish`` too, those policies are composed in the process that made their shallow trace (a forked worker:
    this process's core is then left to the other answers), each handed to ``finish(index, timeline, seconds)``
    there, and ``on_composed`` receives what ``finish`` returns (picklable, e.g. a report row) instead of the
    timeline."""
    policies = list(policies)
    kinds = layer_kinds(config)
    if config.moe_routing_assumption is not None and RoutingAssumption.parse(config.moe_routing_assumption).per_layer:
        return 0
    if config.mixed_layers:  # traced whole, as predict_config does
        return 0
    where = (device, tp, sp, resolve_kernels(None, device))
    planned: dict[tuple[Any, ...], tuple[tuple[Any, ...], frozenset[Role], tuple[str, ...] | None]] = {}
    pending = []  # the policies that no shallow trace made before stands in for
    for policy in policies:
        if not policy.offloads:
            policy.layer_groups(config.num_layers)  # refuses k > depth, naming the depth
            found = _stand_in(config, policy, kinds, where)
            if found is not None and found[1] < config.num_layers and _trace_key(config, found, where) not in \
                    SHALLOW_TRACES:
                pending.append(policy)
    # the fewest traced layers that stand in for them all: a stand-in a layer deeper often serves several policies
    for small_policy, depth, small_kinds in cover_stand_ins(pending, config.num_layers, kinds):
        key = _trace_key(config, (small_policy, depth, small_kinds), where)
        if key not in SHALLOW_TRACES and key not in planned:
            planned[key] = (key, role_set(small_policy, depth, small_kinds), small_kinds)
    todo = []
    for key in planned:
        small_policy = key[1]
        stored = disk_cache.load("shallow_trace", _disk_key(key))
        timeline = None
        if stored is not None:
            try:
                timeline = Timeline.from_dict(stored)
            except TimelineError:
                timeline = None
        if timeline is None:
            todo.append(key)
        else:
            _remember(key, ShallowTrace(timeline, small_policy))
    todo.sort(key=lambda k: -k[0].num_layers)  # the longest first: the workers finish together
    waiting = _waiting_for(config, policies, kinds, where, [planned[k] for k in todo], tp, sp) \
        if on_composed is not None else {}
    made: dict[int, ShallowTrace] = {}
    deliver = on_composed or (lambda *_: None)

    def composed_from(key: tuple[Any, ...], shallow: ShallowTrace) -> Iterator[tuple[int, Timeline, float]]:
        """(index, timeline, seconds) of each policy waiting for ``key``'s shallow trace, composed from it."""
        for i in waiting.get(key, ()):
            start = time.perf_counter()
            composed = _composed(config, policies[i], kinds, lambda: shallow, device, tp, sp)
            yield i, composed, time.perf_counter() - start

    def compose_waiting(index: int, timeline: Timeline) -> None:
        try:
            made[index] = ShallowTrace(timeline, todo[index][1])
        except CompositionError:  # raised below, as without on_composed
            return
        for i, composed, seconds in composed_from(todo[index], made[index]):
            deliver(i, composed, seconds)

    def trace_and_finish(key: tuple[Any, ...]) -> tuple[Timeline, list[tuple[int, Any, float]]]:
        # in the worker: its policies composed and finished beside its trace (what comes back is small)
        timeline = trace_rank(key[0], key[1], device, tp, sp)
        try:
            shallow = ShallowTrace(timeline, key[1])
        except CompositionError:  # raised below, as without on_composed
            return timeline, []
        assert finish is not None  # (only handed out with one)
        return timeline, [(i, finish(i, composed, seconds), seconds)
                          for i, composed, seconds in composed_from(key, shallow)]

    def deliver_finished(index: int, answer: tuple[Timeline, list[tuple[int, Any, float]]]) -> None:
        for i, result, seconds in answer[1]:
            deliver(i, result, seconds)

    if finish is not None and waiting:
        answers = run_forked([functools.partial(trace_and_finish, k) for k in todo], on_result=deliver_finished)
        traced = [timeline for timeline, _ in answers]
    else:
        traced = run_forked([functools.partial(trace_rank, k[0], k[1], device, tp, sp) for k in todo],
                            on_result=compose_waiting if waiting else None)
    for index, (key, timeline) in enumerate(zip(todo, traced)):
        disk_cache.store("shallow_trace", _disk_key(key), timeline.to_dict())
        _remember(key, made[index] if index in made else ShallowTrace(timeline, key[1]))
    return len(todo)


def _waiting_for(config: ModelConfig, policies: Sequence[Policy], kinds: tuple[str, ...] | None,
                 where: tuple[Any, ...], todo: list[tuple[tuple[Any, ...], frozenset[Role], tuple[str, ...] | None]],
                 tp: int, sp: bool) -> dict[tuple[Any, ...], list[int]]:
    """Which of ``policies`` (indices) :func:`predict_config` will compose from each shallow trace of ``todo``
    ((key, roles, layer kinds), in the order they will be remembered) once they are all made: the stand-in it
    picks among the shallow traces then made (:func:`_stand_in`). Empty when that cannot be told beforehand (the
    cache would drop some) or the layout is refused (its error is raised as without early compositions)."""
    if len(SHALLOW_TRACES) + len(todo) > SHALLOW_TRACES_CAPACITY:
        return {}
    try:
        check_tensor_parallel(config, tp, sp)
    except ValueError:
        return {}
    ordered = [*((key, t.role_set, t.kinds) for key, t in SHALLOW_TRACES.items()), *todo]
    ordered.reverse()  # as _stand_in reads the traces made: the latest first
    pending: dict[tuple[Any, ...], list[int]] = {entry[0]: [] for entry in todo}
    for i, policy in enumerate(policies):
        if policy.offloads:  # traced in full (predict_config)
            continue
        found = _stand_in(config, policy, kinds, where, ordered)
        if found is None or found[1] >= config.num_layers:
            continue
        key = _trace_key(config, found, where)
        if key in pending:
            pending[key].append(i)
    return {key: found for key, found in pending.items() if found}


SHALLOW_TRACES: dict[tuple[ModelConfig, Policy, str, int, bool, str], ShallowTrace] = {}  # ..., kernel profile
SHALLOW_TRACES_CAPACITY = 128


def _disk_key(key: tuple[Any, ...]) -> dict[str, Any]:
    config, policy, device, tp, sp, kernels = key
    return {"config": config.to_dict(), "policy": repr(policy), "device": device, "tp": tp, "sp": sp,
            "kernels": kernels}


def _remember(key: tuple[Any, ...], trace_: ShallowTrace) -> None:
    if key not in SHALLOW_TRACES and len(SHALLOW_TRACES) >= SHALLOW_TRACES_CAPACITY:
        del SHALLOW_TRACES[next(iter(SHALLOW_TRACES))]
    SHALLOW_TRACES[key] = trace_


def _shallow_trace(config: ModelConfig, policy: Policy, device: str, tp: int, sp: bool) -> ShallowTrace:
    key = (config, policy, device, tp, sp, resolve_kernels(None, device))
    if key not in SHALLOW_TRACES:  # on disk too (remat.memory.disk_cache): a later process reuses it
        _remember(key, ShallowTrace(cached_timeline("shallow_trace", _disk_key(key), lambda: trace_rank(
            config, policy, device, tp, sp)), policy))
    return SHALLOW_TRACES[key]


def trace(model: ModelSource, policy: Policy | str, *, batch: Batch | Callable[[], Batch] | None = None,
           optimizer: OptimizerFactory | None = None, loss_fn: Callable[[Any, Batch], torch.Tensor] | None = None,
           layers: str | Sequence[nn.Module] | None = None, device: str = "cpu", kernels: str | None = None,
           ) -> Timeline:
    """Trace the whole step under ``FakeTensorMode``, layer by layer (never composed); arguments, result and errors
    as for :func:`predict`. The public way to get a full trace of any model, e.g. to check a composition."""
    if device not in ("cpu", "cuda"):
        raise MeasureError(f"device={device!r}: predict models 'cpu' (exact bytes) or 'cuda' (512-byte blocks)")
    if isinstance(model, ModelConfig):
        config = model
        factory: Callable[[], nn.Module] = lambda: build_model(config)
        if batch is None:
            batch = functools.partial(empty_batch, config)  # made inside the fake mode
    else:
        if isinstance(model, nn.Module) or not callable(model):
            hint = (f" (a {type(model).__name__} instance: pass the function that builds it, e.g. "
                    f"lambda: {type(model).__name__}(...), so that its parameters are made fake)"
                    if isinstance(model, nn.Module) else "")
            raise MeasureError(f"predict(model=...) takes a ModelConfig or a zero-argument function that builds the "
                               f"model, got {type(model).__name__}{hint}")
        factory = model
        if batch is None:
            raise MeasureError("predict(factory, ...) needs batch=: the model's inputs (real tensors, or a function "
                               "that makes them)")
    profile = resolve_kernels(kernels, device)  # remat.memory.kernels: the CUDA/TE kernels' saved tensors
    with fake_tensor_mode() as fake_mode, kernel_trace(profile) as kernel_record, \
            cpu_fake_ops(fake_mode):  # torch._grouped_mm as its CPU kernel runs (remat.memory.fake_ops)
        module = factory()
        if not isinstance(module, nn.Module):
            raise MeasureError(f"predict(model=...): the factory returned {type(module).__name__}, not a "
                               "torch.nn.Module: it must build and return the model, e.g. "
                               "predict(lambda: MyModel(...), policy, batch=...)")
        fake_batch = _fake_batch(fake_mode, batch)
        check_step(module, fake_batch, "predict")
        prepare_model(module, profile)
        state = apply(module, policy, layers=layers)
        opt = optimizer(module.parameters()) if optimizer is not None else None
        with fake_mask_reads(module, batch):  # HF mask decisions as the real batch makes them (remat.recompute.hf)
            timeline, _ = record_step(module, fake_batch, optimizer=opt, loss_fn=loss_fn,
                                      layers=state.layers, block_bytes=CUDA_BLOCK if device == "cuda" else 1)
    timeline.meta.update({"backend": "fake", "device": device, "kernels": profile})
    if kernel_record.messages:
        timeline.meta["kernel_warnings"] = kernel_record.messages
    if isinstance(model, ModelConfig):
        timeline.meta["config"] = model.to_dict()
    return timeline
