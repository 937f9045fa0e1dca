"""Offloading a checkpoint's input to host memory between forward and backward."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten

from remat.recompute.engines import OutputSpec, RngState, recompute_and_backpropagate

# ------------------------------------------------------------------------------------------ input offloading
# Used by remat.plan's "offload" segments: a full-recompute group whose kept input (the hidden states) waits for
# backward in host memory instead of device memory. Only the hidden states move; side inputs (attention mask,
# rotary tables) are shared by every layer and stay where they are.
#
# How it shows in measure/predict timelines (which record device memory): the copies are made with the
# TorchDispatchMode stack suspended, so the recorder does not see the host copy. It sees the device input freed
# once the group's forward has let go of it, and, in backward, the restored input first used (so allocated) at the
# start of the group's recomputation, then freed with the group's other recomputed tensors. On CUDA the host copy
# is pinned memory and both copies run on a side stream (device-to-host overlaps the next layers' forward; the
# restore is issued when the group's backward starts and the compute stream waits for it). On CPU the "device" is
# the CPU itself: the host copy is an ordinary CPU tensor that the timeline counts as offloaded, i.e. not at all,
# and it becomes the restored input (no second copy). Under FakeTensorMode the copies are fake (no memory).
_TRANSFER_STREAMS: dict[torch.device, Any] = {}


def transfer_stream(device: torch.device) -> Any:
    """The side CUDA stream host copies of ``device``'s tensors are made on (one per device, made once)."""
    if device not in _TRANSFER_STREAMS:
        _TRANSFER_STREAMS[device] = torch.cuda.Stream(device)
    return _TRANSFER_STREAMS[device]


def offload_to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of ``tensor`` (pinned memory when it is on CUDA), made unseen by dispatch-mode recorders."""
    with _disable_current_modes():
        if tensor.device.type != "cuda":
            return tensor.detach().to("cpu", copy=True)
        stream = transfer_stream(tensor.device)
        stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(stream):
            # the device tensor's layout (its stride order), so that a copy brought back computes as the original
            host = torch.empty_like(tensor, device="cpu", pin_memory=True)
            host.copy_(tensor, non_blocking=True)
        tensor.record_stream(stream)  # its memory is not reused before the copy has read it
        return host


def restore_from_host(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` back on ``device`` (see :func:`offload_to_host`); on CPU the host copy itself is returned."""
    with _disable_current_modes():
        if device.type != "cuda":
            return host
        stream = transfer_stream(device)
        with torch.cuda.stream(stream):
            restored = host.to(device, non_blocking=True)
        current = torch.cuda.current_stream(device)
        current.wait_stream(stream)
        restored.record_stream(current)
        return restored


class OffloadedCheckpoint(torch.autograd.Function):
    """:class:`_ReentrantCheckpoint` whose kept hidden-states input (the first tensor) waits in host memory."""

    @staticmethod
    def forward(ctx: Any, run: Callable[..., Any], out: OutputSpec, *inputs: torch.Tensor) -> Any:
        ctx.run = run
        ctx.rng = RngState(inputs)
        hidden = inputs[0]
        ctx.hidden_device, ctx.hidden_requires_grad = hidden.device, hidden.requires_grad
        ctx.host = offload_to_host(hidden)
        with torch.no_grad():
            result = run(*inputs)
        ctx.save_for_backward(*inputs[1:])
        out.leaves, out.spec = tree_flatten(result)
        return tuple(leaf for leaf in out.leaves if isinstance(leaf, torch.Tensor))

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden = restore_from_host(ctx.host, ctx.hidden_device)
        ctx.host = None
        inputs = [hidden.detach().requires_grad_(ctx.hidden_requires_grad)]
        inputs += [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        del hidden
        return (None, None, *recompute_and_backpropagate(ctx, inputs, grad_outputs))
