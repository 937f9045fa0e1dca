"""Which aten operators are matrix multiplies, and their contraction sizes (operator-level recompute)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.utils.checkpoint


def _aten_packets(*names: str) -> frozenset[Any]:
    return frozenset(getattr(torch.ops.aten, n) for n in names if hasattr(torch.ops.aten, n))


# Operators whose outputs a non_matmul region keeps: the matrix multiplies that nn.Linear, torch.matmul and the
# attention kernels reach at the dispatcher. They are the operators FLOP counters count, so recomputing the others
# costs no FLOPs.
MATMUL_OPS = _aten_packets(
    "mm", "addmm", "bmm", "baddbmm", "convolution", "_scaled_mm",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward", "_efficient_attention_forward")


def contraction(func: Any, args: Sequence[Any]) -> int | None:
    """The contraction dimension K of a matrix multiply (``mm``/``bmm``: ``a @ b``; ``addmm``/``baddbmm``:
    ``c + a @ b``): each output element costs 2K FLOPs. None for the other :data:`MATMUL_OPS`."""
    packet = func.overloadpacket
    if packet in (torch.ops.aten.mm, torch.ops.aten.bmm):
        return int(args[0].shape[-1])
    if packet in (torch.ops.aten.addmm, torch.ops.aten.baddbmm):
        return int(args[1].shape[-1])
    return None


# Every overload of MATMUL_OPS (what a dispatch mode sees: aten.mm.default, aten.addmm.out, ...), for a set lookup per
# operator.
MATMUL_OVERLOADS = frozenset(getattr(packet, name) for packet in MATMUL_OPS for name in packet.overloads())
