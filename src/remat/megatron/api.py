"""Predict (fake tensors) and measure (real CPU) one training step of a megatron-core model, rank by rank.

The model is the user's own megatron-core code: a ``TransformerConfig`` plus a layer spec (a ``GPTModel`` is
built from them), or a zero-argument function that builds the model. Megatron's own recompute settings
(``recompute_granularity``, ``recompute_method``, ``recompute_num_layers``, ``recompute_modules``) run as they
are; each rank is traced in its own fake process group (:mod:`remat.megatron.world`) with the CPU workarounds of
:mod:`remat.megatron.cpu_patches` applied, and recorded into a remat :class:`~remat.timeline.Timeline`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from remat.config import RoutingAssumption
from remat.megatron.compat import MegatronSettingError
from remat.megatron.cpu_patches import megatron_on_cpu
from remat.megatron.recorder import record_megatron_step
from remat.megatron.released_collectives import collectives_released
from remat.megatron.routing import assume_routing, routing_assumption
from remat.megatron.settings import check_settings
from remat.megatron.world import ParallelSizes, megatron_world
from remat.timeline import Timeline
from remat.units import CUDA_BLOCK

ModelBuilder = Callable[[], nn.Module]
OPTIMIZERS = ("none", "adam")


@dataclass(frozen=True)
class StepShape:
    """What one microbatch looks like: ``micro_batch_size`` sequences of ``seq_length`` tokens (the whole
    sequence; each context-parallel rank holds ``seq_length / cp`` of it)."""

    seq_length: int
    micro_batch_size: int
    vocab_size: int | None = None


def _unwrap(model: nn.Module) -> nn.Module:
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    return model


def _layers_of(model: nn.Module) -> list[nn.Module]:
    inner = _unwrap(model)
    decoder = getattr(inner, "decoder", None)
    if decoder is None or not hasattr(decoder, "layers"):
        raise MegatronSettingError(f"{type(inner).__name__} has no decoder.layers: remat traces megatron-core "
                                   "models built on TransformerBlock (GPTModel, MambaModel's attention layers...)")
    return list(decoder.layers)


def _builder(model: Any, layer_spec: Any, shape: StepShape) -> tuple[ModelBuilder, Any]:
    from megatron.core.transformer import TransformerConfig

    if isinstance(model, TransformerConfig):
        from megatron.core.models.gpt import GPTModel

        if layer_spec is None:
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

            layer_spec = get_gpt_layer_local_spec(num_experts=model.num_moe_experts,
                                                  multi_latent_attention=model.multi_latent_attention)
        if shape.vocab_size is None:
            raise MegatronSettingError("vocab_size is required with a TransformerConfig (GPTModel's vocab_size)")
        config = model
        return (lambda: GPTModel(config, layer_spec, vocab_size=shape.vocab_size,
                                 max_sequence_length=shape.seq_length, pre_process=_is_first(),
                                 post_process=_is_last())), config
    if callable(model):
        return model, None
    raise MegatronSettingError("model: pass a megatron.core TransformerConfig (with layer_spec=) or a zero-argument "
                               "function that builds the model")


def _is_first() -> bool:
    from megatron.core import parallel_state

    return parallel_state.is_pipeline_first_stage()


def _is_last() -> bool:
    from megatron.core import parallel_state

    return parallel_state.is_pipeline_last_stage()


def _optimizer_state(model: nn.Module, optimizer: str, dp: int, distributed: bool) -> list[torch.Tensor]:
    """Megatron's mixed-precision Adam: fp32 master parameters (when the model's are not fp32) and two fp32
    moments, each a flat buffer, sharded over the data-parallel ranks with the distributed optimizer."""
    if optimizer == "none":
        return []
    params = [p for p in model.parameters() if p.requires_grad]
    total = sum(p.numel() for p in params)
    per_rank = -(-total // dp) if distributed else total
    kinds = 2 + (any(p.dtype != torch.float32 for p in params))
    return [torch.zeros(per_rank, dtype=torch.float32) for _ in range(kinds)]


def trace_rank(model: Any, layer_spec: Any, shape: StepShape, sizes: ParallelSizes, rank: int, *, fake: bool,
               ddp: bool = False, use_distributed_optimizer: bool = False, optimizer: str = "none",
               routing: RoutingAssumption | None = None, device: str = "cpu",
               allow_untested: bool = False, init_method: str | None = None) -> Timeline:
    """One rank's step, fake (predict) or real (measure); see :func:`predict_megatron_core`. ``init_method``: where
    the processes of a real multi-process run meet (:mod:`remat.megatron.multiprocess`)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if optimizer not in OPTIMIZERS:
        raise MegatronSettingError(f"optimizer={optimizer!r}: use one of {', '.join(OPTIMIZERS)}")
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        stack.enter_context(megatron_on_cpu(allow_untested))
        build, config = _builder(model, layer_spec, shape)
        if config is not None:
            check_settings(config, shape.seq_length, sizes)
        stack.enter_context(megatron_world(sizes, rank, backend="fake" if fake else "gloo", init_method=init_method))
        if not fake and sizes.world_size > 1:  # NOTE [gloo's late release in Megatron's collectives]
            stack.enter_context(collectives_released())
        stack.enter_context(torch.random.fork_rng(devices=[]))
        torch.manual_seed(1234)
        if fake:
            stack.enter_context(FakeTensorMode(allow_non_fake_inputs=False))
        try:
            built = build()
        except (AssertionError, TypeError, NameError, AttributeError, ValueError) as err:
            if isinstance(err, MegatronSettingError):
                raise
            raise MegatronSettingError(f"megatron-core could not build this model here: {type(err).__name__}: "
                                       f"{str(err).splitlines()[0] if str(err) else ''}") from err
        config = config if config is not None else _unwrap(built).config
        if config is not None and model is not config:
            check_settings(config, shape.seq_length, sizes)
        routing_used = stack.enter_context(assume_routing(routing, config))
        if config.bf16 or config.fp16:  # what Megatron's get_model() does for --bf16/--fp16
            from megatron.core.transformer.module import Float16Module

            target = torch.bfloat16 if config.bf16 else torch.float16
            # Float16Module converts with module.bfloat16(), which swaps parameters and cannot swap fake ones: convert
            # the floating-point parameters and buffers first (the same result), then let it wrap
            for t in list(built.parameters()) + list(built.buffers()):
                if t.is_floating_point() and t.dtype != target:
                    t.data = t.data.to(target)
            inner = built
            inner.bfloat16 = inner.half = lambda: inner
            try:
                built = Float16Module(config, inner)
            finally:
                del inner.bfloat16, inner.half
        extra: list[tuple[torch.Tensor, str, str]] = []
        if ddp:
            from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

            ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=config.bf16 or config.fp16,
                                                       use_distributed_optimizer=use_distributed_optimizer)
            built = DistributedDataParallel(config, ddp_config, built)
            for buffer in built.buffers + built.expert_parallel_buffers:
                extra.append((buffer.grad_data, "ddp.main_grad_buffer", "gradients"))
        for state in _optimizer_state(built, optimizer, sizes.data_parallel, use_distributed_optimizer):
            extra.append((state, "optimizer", "optimizer_state"))
        step, batch = _step(built, config, shape, sizes)
        extra += [(t, "batch", "other") for t in batch]
        try:
            timeline = record_megatron_step(_unwrap(built), _layers_of(built), step, extra=extra,
                                            block_bytes=CUDA_BLOCK if device == "cuda" else 1)
        except RecursionError as err:
            raise MegatronSettingError(f"megatron-core recursed without end tracing this config ({err}); "
                                       "see remat.megatron.settings for the settings known to do so") from None
    timeline.meta.update({
        "backend": "fake" if fake else "cpu", "device": device, "source": "megatron-core", "rank": rank,
        "parallel": {"tp": sizes.tp, "pp": sizes.pp, "cp": sizes.cp, "ep": sizes.ep, "etp": sizes.expert_tp,
                     "dp": sizes.data_parallel},
        "policy": policy_of(config), "ddp": ddp, "use_distributed_optimizer": use_distributed_optimizer,
        "optimizer": optimizer, "seq_length": shape.seq_length, "micro_batch_size": shape.micro_batch_size,
        "trace_seconds": time.perf_counter() - start,
    })
    if routing_used is not None:
        timeline.meta["moe_routing"] = routing_used
    return timeline


def policy_of(config: Any) -> str:
    """Megatron's recompute settings in remat's policy notation (``full/uniform/2``, ``selective/core_attn+mlp``)."""
    granularity = getattr(config, "recompute_granularity", None)
    if granularity is None:
        return "none"
    if granularity == "full":
        return f"full/{config.recompute_method}/{config.recompute_num_layers}"
    return "selective/" + "+".join(config.recompute_modules or ["core_attn"])


def _step(model: nn.Module, config: Any, shape: StepShape,
          sizes: ParallelSizes) -> tuple[Callable[[], Any], list[torch.Tensor]]:
    """The forward and loss of one microbatch on this rank, and the batch tensors it reads."""
    from megatron.core import parallel_state

    inner = _unwrap(model)
    tokens = shape.seq_length // sizes.cp
    b = shape.micro_batch_size
    input_ids = torch.zeros(b, tokens, dtype=torch.long)
    position_ids = torch.arange(tokens).unsqueeze(0).expand(b, tokens)
    labels = torch.zeros(b, tokens, dtype=torch.long)
    batch = [input_ids, position_ids, labels]
    first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
    received = None
    if not first:
        hidden_tokens = tokens // (sizes.tp if config.sequence_parallel else 1)
        dtype = config.pipeline_dtype or config.params_dtype
        received = torch.zeros(hidden_tokens, b, config.hidden_size, dtype=dtype, requires_grad=True)
        batch.append(received)

    def step() -> PipelineStage:
        if received is not None:
            with torch.no_grad():  # the previous stage's output (a no-op in the fake process group)
                dist.recv(received, parallel_state.get_pipeline_model_parallel_prev_rank())
            inner.set_input_tensor(received)
        output = model(input_ids, position_ids, None, labels=labels if last else None)
        if last:
            return PipelineStage(output.float().mean(), None, received)
        dist.send(output.detach(), parallel_state.get_pipeline_model_parallel_next_rank())
        return PipelineStage(output, parallel_state.get_pipeline_model_parallel_next_rank(), received)
    return step, batch


class PipelineStage:
    """One stage's result of a microbatch: ``backward()`` takes the next stage's gradient (a non-last stage)
    and sends the gradient of the received input to the previous stage (a non-first stage), as Megatron's
    schedules do; with one stage it is ``loss.backward()``."""

    def __init__(self, output: torch.Tensor, next_rank: int | None, received: torch.Tensor | None):
        self.output, self.next_rank, self.received = output, next_rank, received

    def backward(self) -> None:
        from megatron.core import parallel_state

        output, self.output = self.output, None
        if self.next_rank is None:
            output.backward()
        else:
            grad = torch.empty_like(output)
            dist.recv(grad, self.next_rank)
            torch.autograd.backward(output, grad)
            del grad
        if self.received is not None:
            dist.send(self.received.grad, parallel_state.get_pipeline_model_parallel_prev_rank())


def _select_ranks(sizes: ParallelSizes, ranks: str | Sequence[int]) -> list[int]:
    if ranks == "distinct":
        return sizes.stage_ranks()
    if ranks == "model_parallel":
        return sizes.model_parallel_ranks()
    if ranks == "all":
        return list(range(sizes.world_size))
    if isinstance(ranks, str):
        raise MegatronSettingError(f"ranks={ranks!r}: use 'distinct', 'model_parallel', 'all' or a list of ranks")
    return [int(r) for r in ranks]


def predict_megatron_core(model: Any, layer_spec: Any = None, *, seq_length: int, micro_batch_size: int,
                          vocab_size: int | None = None, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                          etp: int | None = None, dp: int | None = None, ranks: str | Sequence[int] = "distinct",
                          ddp: bool = False, use_distributed_optimizer: bool = False, optimizer: str = "none",
                          routing: RoutingAssumption | str | None = None, device: str = "cpu",
                          allow_untested: bool = False) -> dict[int, Timeline]:
    """Predict one training step of a megatron-core model on each chosen rank, under fake tensors.

    Args:
        model: a ``megatron.core.transformer.TransformerConfig`` (a ``GPTModel`` is built from it and
            ``layer_spec``; its recompute settings are Megatron's own) or a zero-argument function that builds
            the model (called on each rank inside its fake process group and under ``FakeTensorMode``).
        layer_spec: the ``ModuleSpec`` of a layer (default: megatron-core's local, non-TransformerEngine spec).
        seq_length, micro_batch_size: one microbatch (the whole sequence; a context-parallel rank holds 1/cp).
        vocab_size: GPTModel's vocabulary (required with a config).
        tp, pp, cp, ep, etp, dp: Megatron's parallel sizes (``dp`` None: the smallest the expert layout needs).
        ranks: ``'distinct'`` (one rank per pipeline stage: tensor, context and expert ranks are symmetric),
            ``'model_parallel'`` (every tensor/context/pipeline position of replica 0), ``'all'``, or rank ids.
        ddp: wrap in Megatron's DistributedDataParallel (its contiguous main-grad buffer is the gradients).
        use_distributed_optimizer: shard the optimizer state (and DDP's reduce-scatter) over the dp ranks.
        optimizer: ``'adam'`` adds Megatron's mixed-precision Adam state (fp32 master copy unless the model is
            fp32, two fp32 moments) as allocated buffers; ``'none'`` leaves it out.
        routing: MoE routing assumption (:class:`~remat.config.RoutingAssumption` or its text; default balanced).
        device: ``'cpu'`` (exact bytes) or ``'cuda'`` (512-byte blocks of the caching allocator).

    Returns:
        ``{rank: Timeline}``, each with ``meta['rank']``, ``meta['parallel']``, ``meta['policy']`` and, for MoE,
        ``meta['moe_routing']``.

    Example::

        >>> config = TransformerConfig(num_layers=4, hidden_size=256, num_attention_heads=8,
        ...                            recompute_granularity="full", recompute_method="uniform",
        ...                            recompute_num_layers=2, use_cpu_initialization=True)
        >>> timelines = predict_megatron_core(config, seq_length=512, micro_batch_size=2, vocab_size=32000, tp=2)
    """
    sizes = ParallelSizes(tp, pp, cp, ep, etp, dp)
    routing = routing_assumption(routing)
    shape = StepShape(seq_length, micro_batch_size, vocab_size)
    return {rank: trace_rank(model, layer_spec, shape, sizes, rank, fake=True, ddp=ddp,
                             use_distributed_optimizer=use_distributed_optimizer, optimizer=optimizer,
                             routing=routing, device=device, allow_untested=allow_untested)
            for rank in _select_ranks(sizes, ranks)}


def measure_megatron_core(model: Any, layer_spec: Any = None, *, seq_length: int, micro_batch_size: int,
                          vocab_size: int | None = None, ddp: bool = False, optimizer: str = "none",
                          routing: RoutingAssumption | str | None = None,
                          allow_untested: bool = False) -> dict[int, Timeline]:
    """Run the same step for real on CPU (one gloo process, world size 1) and measure it.

    Takes :func:`predict_megatron_core`'s arguments for a single-rank job; its result compares with
    ``predict_megatron_core(..., tp=1)`` rank by rank (``{0: Timeline}``). MoE runs under the same routing
    assumption as the prediction, so the token counts are the ones predicted.
    """
    routing = routing_assumption(routing)
    shape = StepShape(seq_length, micro_batch_size, vocab_size)
    timeline = trace_rank(model, layer_spec, shape, ParallelSizes(), 0, fake=False, ddp=ddp, optimizer=optimizer,
                          routing=routing, allow_untested=allow_untested)
    return {0: timeline}
