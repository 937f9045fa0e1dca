"""One rank of a Megatron-LM job run for real (gloo on CPU), rebuilt from plain tensors the way Megatron builds it.

:mod:`remat.parallel.job_measure` starts one process per rank; each builds, with the pieces below, its pipeline
stage of the model sharded by tensor parallelism, Megatron DDP's contiguous gradient buffer (and, with the
distributed optimizer, the parameter buffer), the mixed-precision optimizer (fp32 master parameters and Adam
moments, sharded over the data-parallel ranks with the distributed optimizer) and Megatron's 1F1B schedule, then
records one whole training step (forward/backward of every microbatch, the gradient reduction, the optimizer step
and the parameter all-gather) with the same recorder that measures everything else in remat.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from remat.config import ModelConfig
from remat.models.collectives import released
from remat.models.tp_stage import hidden_shape
from remat.parallel.schedule import ChunkSpec
from remat.parallel.stages import PipelineRecorder
from remat.recompute.activation_offload import offload_runtime, offloading_last_groups
from remat.units import round_up

# Module names of the model state rows: the same names remat.parallel.job_predict gives its rows.
GRAD_BUFFER = "ddp.grad_buffer"
MASTER = "optimizer.master_parameters"
STATE = "optimizer.state"


# NOTE [What a measured rank runs]
# Everything below follows Megatron-LM (megatron/core, 2026) so that a rank allocates what Megatron allocates:
# * distributed/param_and_grad_buffer.py::_ParamAndGradBuffer: parameters in reverse order in one fp32 (the main
#   grad dtype) buffer, each parameter's ``main_grad`` a view of it; with the distributed optimizer each
#   parameter starts at a multiple of 64 elements, the bucket ends at a multiple of lcm(dp, 128), a shared
#   embedding gets a bucket of its own, and the parameters move into a param_data buffer of the same layout.
#   One bucket per buffer (no --overlap-grad-reduce).
# * distributed/distributed_data_parallel.py: a hook after each parameter's gradient is accumulated adds it to
#   ``main_grad`` and drops ``param.grad``; finalize_model_grads scales the buffer by 1/dp and all-reduces it
#   (reduce-scatters each bucket into this rank's shard with the distributed optimizer), in place.
# * optimizer/optimizer.py::Float16OptimizerWithFloat16Params: an fp32 master copy per parameter whose gradient
#   is the fp32 main grad; distrib_optimizer.py: the master copies (``shard_main_param``) and Adam's moments
#   cover only the parameter elements in this rank's slice of each bucket, and the step ends with an all-gather
#   of the param_data buffer. Adam runs in place, as the fused Adam kernel Megatron runs on GPUs does (torch's
#   CPU Adam would allocate a denominator per parameter): the main grad, which the next step zeroes anyway,
#   holds the denominator. No gradient clipping (its norm is a few scalars).
# * pipeline_parallel/schedules.py::forward_backward_pipelining_without_interleaving (and _no_pipelining with
#   pp=1), line by line: its variables and lists hold the received tensors, outputs and gradients exactly as
#   long as Megatron's do; p2p_communication.py receives into a fresh ``torch.empty(..., requires_grad=True)``;
#   an output is "deallocated" once sent (its .data replaced by a 1-element tensor); backward runs the C++ engine
#   directly (custom_backward). Each microbatch's token ids (first stage) and labels (last stage) are made by
#   the forward step (Megatron's get_batch) and live as long as the model's autograd graph keeps them, beside its
#   other tensors (NOTE [Megatron's batch on the device] in remat.parallel.pipeline_runtime); the last
#   stage keeps a detached copy of each loss for logging (forward_data_store). As in Megatron, the model keeps
#   its last input (set_input_tensor) until the next forward step, so the last microbatch's input and its grad
#   outlive the step, and the schedule holds ``total_num_tokens`` (4 bytes) while it runs. Not mirrored: the
#   per-microbatch ``num_tokens`` (a CPU tensor in Megatron) and the loss scaling before the last stage's backward
#   (``config.grad_scale_func``).


def _run(tensors: Sequence[torch.Tensor], start: Callable[[], list[Any]]) -> None:
    """Start the communication of ``tensors`` and wait for it, and for gloo's worker thread to drop its references
    to them, so that the caller's frees happen in program order (:func:`remat.models.collectives.released`)."""
    with released(*tensors):
        for work in start():
            if work is not None:
                work.wait()


@dataclass(frozen=True)
class Layout:
    """Where a rank sits: Megatron's default order tp-cp-dp-pp (cp = 1 here); the expert ranks of a stage are
    ordered etp-ep-edp over the same tp x dp ranks (parallel_state's expert RankGenerator), so with etp = tp (the
    default, ``etp=None``) ep-edp sit inside the data-parallel ranks (NOTE [expert parameters] in
    :mod:`remat.memory.rank_state`), and with etp != tp the expert groups cut across the tensor-parallel ones."""

    tp: int
    dp: int
    pp: int
    rank: int
    ep: int = 1
    etp: int | None = None

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def stage_index(self) -> int:
        """The rank's place among its stage's tp x dp ranks (tp fastest)."""
        return self.tp_rank + self.tp * self.dp_rank

    @property
    def etp_rank(self) -> int:
        return self.stage_index % self.expert_tp

    @property
    def ep_rank(self) -> int:
        return self.stage_index // self.expert_tp % self.ep

    @property
    def edp_rank(self) -> int:
        """The rank's expert data-parallel shard."""
        return self.stage_index // (self.expert_tp * self.ep)

    def expert_rank(self, etp_rank: int, ep_rank: int, edp_rank: int, pp_rank: int) -> int:
        """The global rank at expert position (etp, ep, edp) of stage ``pp_rank``."""
        return etp_rank + self.expert_tp * (ep_rank + self.ep * edp_rank) + self.tp * self.dp * pp_rank

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp % self.dp

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.tp * self.dp)

    def global_rank(self, tp_rank: int, dp_rank: int, pp_rank: int) -> int:
        return tp_rank + self.tp * (dp_rank + self.dp * pp_rank)


def make_groups(lay: Layout) -> tuple[Any, Any, Any, Any, Any, Any, Any]:
    """This rank's tensor-parallel, data-parallel, embedding (first + last stage), expert-parallel, expert
    data-parallel, etp x ep and expert tensor-parallel groups (the expert ones None without expert parallelism and
    with etp = tp; the last one None with etp = tp: it is the tp group); every rank creates every group, in the same
    order, as torch.distributed requires."""
    def mine(ranks: list[int], current: Any) -> Any:
        """A new group of ``ranks`` (every rank creates it) if this rank is in it, else ``current``."""
        group = dist.new_group(ranks)
        return group if lay.rank in ranks else current

    tp_group = dp_group = embd_group = ep_group = edp_group = None
    for d in range(lay.dp):
        for p in range(lay.pp):
            ranks = [lay.global_rank(t, d, p) for t in range(lay.tp)]
            tp_group = mine(ranks, tp_group)
    for p in range(lay.pp):
        for t in range(lay.tp):
            ranks = [lay.global_rank(t, d, p) for d in range(lay.dp)]
            dp_group = mine(ranks, dp_group)
    if lay.pp > 1:
        for d in range(lay.dp):
            for t in range(lay.tp):
                ranks = [lay.global_rank(t, d, 0), lay.global_rank(t, d, lay.pp - 1)]
                embd_group = mine(ranks, embd_group)
    tp_ep_group = etp_group = None
    etp, edp = lay.expert_tp, lay.tp * lay.dp // (lay.expert_tp * lay.ep)
    at = lay.expert_rank
    if lay.ep > 1 or etp != lay.tp:  # (etp = tp: expert-parallel rank e, expert dp rank k is dp rank e + ep*k)
        for p in range(lay.pp):
            for t in range(etp):
                for k in range(edp):
                    ranks = [at(t, e, k, p) for e in range(lay.ep)]
                    ep_group = mine(ranks, ep_group)
                for e in range(lay.ep):
                    ranks = [at(t, e, k, p) for k in range(edp)]
                    edp_group = mine(ranks, edp_group)
            for k in range(edp):  # MoE token counts: the etp x ep ranks, ep-major (rank e * etp + t)
                ranks = [at(t, e, k, p) for e in range(lay.ep) for t in range(etp)]
                tp_ep_group = mine(ranks, tp_ep_group)
            if etp != lay.tp:  # the experts' own tensor-parallel groups (etp = tp: the tp group)
                for e in range(lay.ep):
                    for k in range(edp):
                        ranks = [at(t, e, k, p) for t in range(etp)]
                        etp_group = mine(ranks, etp_group)
    return tp_group, dp_group, embd_group, ep_group, edp_group, tp_ep_group, etp_group


# ------------------------------------------------------------------------------------------------ DDP buffer
class GradBuffer:
    """Megatron's _ParamAndGradBuffer for one model chunk (see NOTE [What a measured rank runs]): of its dense
    parameters, reduced over the data-parallel ranks, or of its expert parameters, reduced over the expert
    data-parallel ranks (``group``, ``dp_rank``: this rank's group and position in it, set by the caller)."""

    group: Any = None
    dp_rank: int = 0

    def __init__(self, params: Sequence[nn.Parameter], shared: set[int], *, grad_dtype: torch.dtype,
                 distributed: bool, dp_size: int):
        self.dp_size = dp_size
        divisor = math.lcm(dp_size, 128)
        pad_start = (lambda i: round_up(i, 64)) if distributed else (lambda i: i)
        pad_end = (lambda i: round_up(i, divisor)) if distributed else (lambda i: i)
        self.index: dict[int, tuple[int, int]] = {}
        self.buckets: list[tuple[int, int]] = []
        start = bucket_start = end = 0
        open_bucket = False
        for p in list(params)[::-1]:
            start = pad_start(start)
            new_bucket = distributed and id(p) in shared
            if new_bucket and open_bucket:
                start = pad_end(start)
                self.buckets.append((bucket_start, start))
                bucket_start, open_bucket = start, False
            end = start + p.numel()
            self.index[id(p)] = (start, end)
            open_bucket = True
            if new_bucket:
                start = pad_end(end)
                self.buckets.append((bucket_start, start))
                bucket_start, open_bucket = start, False
            else:
                start = end
        if open_bucket:
            self.buckets.append((bucket_start, pad_end(end)))
        numel = self.buckets[-1][1] if self.buckets else 0
        self.param_data = None
        if distributed:
            self.param_data = torch.zeros(numel, dtype=params[0].dtype)
        self.grad_data = torch.zeros(numel, dtype=grad_dtype)
        for p in list(params)[::-1]:
            s, e = self.index[id(p)]
            if self.param_data is not None:
                old = p.data
                p.data = self.param_data[s:e].view(old.shape)
                p.data.detach().copy_(old)
                del old
            p.main_grad = self.grad_data[s:e].view(p.shape)  # type: ignore[attr-defined]


def add_grad_hooks(params: Sequence[nn.Parameter]) -> list[Any]:
    """Megatron DDP's backward hook: add each accumulated ``param.grad`` into ``param.main_grad``, drop it."""

    def hook(param: torch.Tensor) -> None:
        if param.grad is not None:
            param.main_grad.add_(param.grad.data)  # type: ignore[attr-defined]
            param.grad = None

    return [p.register_post_accumulate_grad_hook(hook) for p in params]


# ------------------------------------------------------------------------------------------------ optimizer
@dataclass
class _Slot:
    param: torch.Tensor  # what the optimizer updates: the fp32 master (shard), or the fp32 parameter (shard)
    grad: torch.Tensor  # its fp32 gradient: a view of the main-grad buffer
    model: torch.Tensor | None  # the bf16/fp16 parameter (shard) the master is copied back into
    state: list[torch.Tensor]


class MegatronOptimizer:
    """Megatron's (distributed) mixed-precision optimizer: Adam/AdamW or SGD on fp32 master copies."""

    def __init__(self, buffer: GradBuffer, params: Sequence[nn.Parameter], *, kind: str, momentum: float,
                 mixed: bool, distributed: bool, dp_rank: int, dp_size: int, lr: float = 1e-4):
        self.kind, self.momentum, self.lr, self.steps = kind, momentum, lr, 0
        self.slots: list[_Slot] = []
        self.buffer, self.distributed, self.dp_rank, self.dp_size = buffer, distributed, dp_rank, dp_size
        if kind == "none":
            return
        ranges = []
        for p in params:
            s, e = buffer.index[id(p)]
            lo, hi = 0, e - s
            if distributed:
                b_start, b_end = next(b for b in buffer.buckets if b[0] <= s < b[1])
                size = (b_end - b_start) // dp_size
                r_lo, r_hi = b_start + dp_rank * size, b_start + (dp_rank + 1) * size
                lo, hi = max(s, r_lo) - s, min(e, r_hi) - s
            if hi > lo:
                ranges.append((p, lo, hi))
        for p, lo, hi in ranges:
            model = p.detach().view(-1)[lo:hi]
            grad = p.main_grad.view(-1)[lo:hi]  # type: ignore[attr-defined]
            master = model.clone().float() if mixed else model
            n_state = {"adam": 2, "sgd": 1 if momentum > 0 else 0}[kind]
            self.slots.append(_Slot(master, grad, model if mixed else None,
                                    [torch.zeros_like(master) for _ in range(n_state)]))

    @property
    def masters(self) -> list[torch.Tensor]:
        return [s.param for s in self.slots if s.model is not None]

    @property
    def states(self) -> list[torch.Tensor]:
        return [t for s in self.slots for t in s.state]

    def step(self, dp_group: Any) -> None:
        self.steps += 1
        b1, b2, eps, wd = 0.9, 0.999, 1e-8, 0.01
        bc1, bc2 = 1 - b1 ** self.steps, 1 - b2 ** self.steps
        for s in self.slots:
            g = s.grad
            if self.kind == "adam":
                exp_avg, exp_avg_sq = s.state
                s.param.mul_(1 - self.lr * wd)
                exp_avg.lerp_(g, 1 - b1)
                exp_avg_sq.mul_(b2).addcmul_(g, g, value=1 - b2)
                g.copy_(exp_avg_sq).div_(bc2).sqrt_().add_(eps)  # the fused kernel's denominator, in place
                s.param.addcdiv_(exp_avg, g, value=-self.lr / bc1)
            elif self.kind == "sgd":
                if s.state:
                    s.state[0].mul_(self.momentum).add_(g)
                    g = s.state[0]
                s.param.add_(g, alpha=-self.lr)
            if s.model is not None:
                s.model.copy_(s.param)
        if self.distributed and self.dp_size > 1:  # distrib_optimizer: all-gather the updated param_data
            data = self.buffer.param_data
            assert data is not None
            for b_start, b_end in self.buffer.buckets:
                bucket = data[b_start:b_end]
                size = (b_end - b_start) // self.dp_size
                shard = bucket[self.dp_rank * size:(self.dp_rank + 1) * size]
                _run([bucket, shard], lambda b=bucket, sh=shard: [dist.all_gather_into_tensor(b, sh, group=dp_group)])


# ------------------------------------------------------------------------------------------------ schedule
class P2P:
    """megatron/core/pipeline_parallel/p2p_communication.py on gloo: every receive is a fresh tensor."""

    def __init__(self, lay: Layout, shape: tuple[int, ...], dtype: torch.dtype):
        self.shape, self.dtype = shape, dtype
        self.first, self.last = lay.pp_rank == 0, lay.pp_rank == lay.pp - 1
        self.prev = lay.global_rank(lay.tp_rank, lay.dp_rank, lay.pp_rank - 1) if not self.first else None
        self.next = lay.global_rank(lay.tp_rank, lay.dp_rank, lay.pp_rank + 1) if not self.last else None

    def _empty(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, requires_grad=True)

    def _communicate(self, send: torch.Tensor | None, peer: int | None) -> torch.Tensor | None:
        """Send ``send`` to ``peer`` (if given) and receive a fresh tensor from it (if ``receive``)."""
        recv = self._empty()
        tensors = [recv] + ([send] if send is not None else [])
        _run(tensors, lambda: ([dist.isend(send, peer)] if send is not None else []) + [dist.irecv(recv, peer)])
        return recv

    def recv_forward(self) -> torch.Tensor | None:
        return None if self.first else self._communicate(None, self.prev)

    def recv_backward(self) -> torch.Tensor | None:
        return None if self.last else self._communicate(None, self.next)

    def send_forward(self, output: torch.Tensor) -> None:
        if not self.last:
            _run([output], lambda: [dist.isend(output, self.next)])

    def send_backward(self, grad: torch.Tensor | None) -> None:
        if not self.first:
            assert grad is not None
            _run([grad], lambda: [dist.isend(grad, self.prev)])

    def send_forward_recv_backward(self, output: torch.Tensor) -> torch.Tensor | None:
        return None if self.last else self._communicate(output, self.next)

    def send_backward_recv_forward(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        return None if self.first else self._communicate(grad, self.prev)


def deallocate_output_tensor(out: torch.Tensor) -> None:
    """schedules.py::deallocate_output_tensor: keep only the autograd graph of a sent output."""
    assert out._base is None, "counter-productive to free a view of another tensor"
    out.data = torch.empty((1,), dtype=out.dtype)


def custom_backward(output: torch.Tensor, grad_output: torch.Tensor | None) -> None:
    """schedules.py::custom_backward: the C++ engine directly (the output's data is a 1-element placeholder)."""
    if grad_output is None:
        grad_output = torch.ones_like(output, memory_format=torch.preserve_format)
    torch.autograd.Variable._execution_engine.run_backward(  # type: ignore[attr-defined]
        tensors=(output,), grad_tensors=(grad_output,), keep_graph=False, create_graph=False, inputs=(),
        allow_unreachable=True, accumulate_grad=True)


class RankStep:
    """Megatron's train_step on one rank: zero the grad buffer, forward/backward every microbatch (1F1B, or no
    pipelining with pp=1), finalize the gradients, optimizer step (see NOTE [What a measured rank runs])."""

    def __init__(self, module: nn.Module, spec: ChunkSpec, config: ModelConfig, lay: Layout, microbatches: int,
                 buffers: Sequence[GradBuffer], optimizers: Sequence[MegatronOptimizer], groups: tuple[Any, ...],
                 tied: list[torch.Tensor], distributed: bool, seed: int, sp: bool, attention_mask: bool = True,
                 mask_to_backward: bool = False):
        self.module, self.spec, self.config, self.lay, self.m = module, spec, config, lay, microbatches
        self.buffers, self.optimizers, self.distributed, self.seed = list(buffers), list(optimizers), distributed, seed
        self.tp_group, self.dp_group, self.embd_group = groups[:3]
        self.tied = tied
        self.p2p = P2P(lay, hidden_shape(config, lay.tp, sp), config.torch_dtype)
        self.recorder: PipelineRecorder | None = None
        self.model_input: torch.Tensor | None = None  # TransformerBlock.input_tensor (set_input_tensor)
        # microbatch -> the offload modules whose last group its forward offloads too (schedule.offload_last_groups)
        self.offload_last: dict[int, frozenset[str]] = {}
        self.forwarded: set[int] = set()  # microbatches whose forward ran this step (their groups can be pre-reloaded)
        self.attention_mask = attention_mask  # the dataloader makes the dense causal mask (Job.create_attention_mask)
        self.loss_masks: dict[int, torch.Tensor] = {}  # kept by the loss's multiply until the microbatch's backward
        # the layers' checkpoints keep the dataloader's mask to the backward (remat.parallel.stages.keeps_layer_inputs)
        self.mask_to_backward = mask_to_backward
        self.kept_masks: dict[int, torch.Tensor] = {}

    # -- forward / backward of one microbatch ---------------------------------------------------------------
    def _ids(self, mb: int, which: int) -> torch.Tensor:
        """get_batch: a microbatch's token ids (which=0) or labels (1); the same on every tensor-parallel rank."""
        c = self.config
        generator = torch.Generator().manual_seed(self.seed * 1000 + mb * 2 + which)
        return torch.randint(0, c.vocab_size, (c.micro_batch_size, c.seq_length), generator=generator)

    def _batch_rest(self, mb: int) -> list[torch.Tensor]:
        """get_batch's other tensors on this stage (NOTE [Megatron's batch on the device] in
        remat.parallel.pipeline_runtime): the dense causal mask, the position ids; the loss mask is kept aside."""
        c, spec = self.config, self.spec
        if not (spec.is_first or spec.is_last):
            return []
        b, s = c.micro_batch_size, c.seq_length
        # the dataloader's [b, 1, s, s] mask beyond the model's own [1, 1, s, s] causal mask (cp = 1 here)
        beyond = b * s * s - s * s if self.attention_mask and b > 1 else 0
        rest = [torch.ones(beyond, dtype=torch.bool)] if beyond and not self.mask_to_backward else []
        if spec.is_first or c.mtp_num_layers:
            rest.append(torch.zeros(b, s, dtype=torch.long))  # the ids themselves are never read here
        if beyond and self.mask_to_backward:
            self.kept_masks[mb] = torch.ones(beyond, dtype=torch.bool)
        if spec.is_last:
            self.loss_masks[mb] = torch.ones(b, s)
        return rest

    def forward_step(self, mb: int, input_tensor: torch.Tensor | None, store: list[torch.Tensor]) -> torch.Tensor:
        if self.recorder is not None:
            self.recorder.begin_op("forward", self.spec, mb)
        self.model_input = input_tensor  # set_input_tensor: the model keeps it until the next forward step
        batch = self._batch_rest(mb)
        x = self._ids(mb, 0) if self.spec.is_first else input_tensor
        labels = self._ids(mb, 1) if self.spec.is_last else None
        with offloading_last_groups(self.offload_last.get(mb, ())), offload_runtime(forward=mb):
            output = self.module(x, labels) if labels is not None else self.module(x)
        self.forwarded.add(mb)
        del x, labels
        if self.spec.is_last:
            store.append(output.detach().clone())  # forward_data_store: the loss reported for logging
        del batch  # forward_step returns
        if self.recorder is not None:
            self.recorder.end_op()
        return output

    def backward_step(self, mb: int, input_tensor: torch.Tensor | None, output_tensor: torch.Tensor,
                      output_tensor_grad: torch.Tensor | None) -> torch.Tensor | None:
        if self.recorder is not None:
            self.recorder.begin_op("backward", self.spec, mb)
        if input_tensor is not None:
            input_tensor.retain_grad()
        # the next backward is the next microbatch's (1F1B): once its forward ran, a backward whose own reload stack is
        # empty brings back its groups (NOTE [when offloaded groups come back] in remat.recompute.activation_offload)
        with offload_runtime(next_backward=mb + 1 if mb + 1 in self.forwarded else None):
            custom_backward(output_tensor, output_tensor_grad)
        if mb == self.m - 1:
            self.forwarded.clear()
        self.kept_masks.pop(mb, None)  # the layers' checkpoints are gone with their backward
        self.loss_masks.pop(mb, None)  # the loss's graph is gone with its backward
        grad = input_tensor.grad if input_tensor is not None else None
        if self.recorder is not None:
            self.recorder.end_op()
        return grad

    # -- the schedules -----------------------------------------------------------------------------------------
    def no_pipelining(self) -> list[torch.Tensor]:
        """forward_backward_no_pipelining: forward then backward, microbatch by microbatch."""
        store: list[torch.Tensor] = []
        total_num_tokens = torch.zeros([], dtype=torch.int)  # noqa: F841 - Megatron's, alive until it returns
        for i in range(self.m):
            output_tensor = self.forward_step(i, None, store)
            self.backward_step(i, None, output_tensor, None)
            del output_tensor  # Megatron releases the graph head before the next forward
        self.finalize_grads()
        return store

    def one_f_one_b(self) -> list[torch.Tensor]:
        """forward_backward_pipelining_without_interleaving, line by line (its variables hold what Megatron's
        hold, for as long)."""
        p2p = self.p2p
        num_warmup = min(self.lay.pp - self.lay.pp_rank - 1, self.m)
        remaining = self.m - num_warmup
        input_tensors: list[Any] = []
        output_tensors: list[Any] = []
        total_num_tokens = torch.zeros([], dtype=torch.int)  # noqa: F841 - Megatron's, alive until it returns
        store: list[torch.Tensor] = []  # forward_data_store
        for i in range(num_warmup):
            input_tensor = p2p.recv_forward()
            output_tensor = self.forward_step(i, input_tensor, store)
            p2p.send_forward(output_tensor)
            input_tensors.append(input_tensor)
            output_tensors.append(output_tensor)
            deallocate_output_tensor(output_tensor)
        if remaining > 0:
            input_tensor = p2p.recv_forward()
        for i in range(remaining):
            last_iteration = i == remaining - 1
            output_tensor = self.forward_step(i + num_warmup, input_tensor, store)
            output_tensor_grad = p2p.send_forward_recv_backward(output_tensor)
            input_tensors.append(input_tensor)
            output_tensors.append(output_tensor)
            deallocate_output_tensor(output_tensor)
            input_tensor = input_tensors.pop(0)
            output_tensor = output_tensors.pop(0)
            input_tensor_grad = self.backward_step(i, input_tensor, output_tensor, output_tensor_grad)
            if last_iteration:
                input_tensor = None
                p2p.send_backward(input_tensor_grad)
            else:
                input_tensor = p2p.send_backward_recv_forward(input_tensor_grad)
        for i in range(num_warmup):
            input_tensor = input_tensors.pop(0)
            output_tensor = output_tensors.pop(0)
            output_tensor_grad = p2p.recv_backward()
            input_tensor_grad = self.backward_step(remaining + i, input_tensor, output_tensor, output_tensor_grad)
            p2p.send_backward(input_tensor_grad)
        self.finalize_grads()  # inside the schedule function, while its variables still hold their tensors
        return store

    def finalize_grads(self) -> None:
        """finalize_model_grads: the data-parallel reduction of the grad buffer and the tied embedding's
        all-reduce between the first and last stage, in place."""
        if self.recorder is not None:
            self.recorder.set_phase("setup", "finalize_model_grads")
        dp = self.lay.dp
        for buffer in self.buffers:  # each over its group: the dense one over dp, the experts' over edp
            grad, n = buffer.grad_data, buffer.dp_size
            if dp > 1:
                grad.mul_(1.0 / dp)  # Megatron scales expert gradients by 1/dp too (then sums over edp)
            if n > 1 and self.distributed:
                # Megatron reduce-scatters each bucket into this rank's shard in place (NCCL allocates nothing);
                # gloo's reduce_scatter copies the whole bucket into a temporary first, a transient no GPU rank
                # has (it became the measured peak once offloading lowered the activations). An in-place
                # all-reduce leaves the same sums in this rank's shard (the only part the optimizer reads) and
                # allocates nothing, as NCCL's reduce-scatter.
                for b_start, b_end in buffer.buckets:
                    bucket = grad[b_start:b_end]
                    _run([bucket], lambda b=bucket, g=buffer.group: [dist.all_reduce(b, group=g)])
            elif n > 1:
                _run([grad], lambda g=grad, group=buffer.group: [dist.all_reduce(g, group=group)])
        for weight in self.tied:
            main_grad = weight.main_grad  # type: ignore[attr-defined]
            _run([main_grad], lambda g=main_grad: [dist.all_reduce(g, group=self.embd_group)])

    def train_step(self) -> None:
        for buffer in self.buffers:
            buffer.grad_data.zero_()
        for p in self.module.parameters():
            p.grad = None
        store = self.one_f_one_b() if self.lay.pp > 1 else self.no_pipelining()
        if self.recorder is not None:
            self.recorder.set_phase("optimizer", "")
        for optimizer in self.optimizers:
            optimizer.step(optimizer.buffer.group)
        if self.recorder is not None:
            self.recorder.set_phase("setup", "end")
        del store
