"""Shared by the kernel-profile tests: what an autograd graph keeps for backward, by node."""

from __future__ import annotations

import torch


def saved_by(node) -> list[torch.Tensor]:
    """The tensors an autograd node keeps: a custom Function's ``saved_tensors`` (remat's kernels), else the
    ``_saved_*`` tensors of a built-in node."""
    if isinstance(node, torch.autograd.function.BackwardCFunction):
        return [t for t in node.saved_tensors if t is not None]
    return [getattr(node, n) for n in dir(node) if n.startswith("_saved_") and isinstance(getattr(node, n),
                                                                                        torch.Tensor)]


def kept_by_node(out: torch.Tensor, *given: torch.Tensor) -> dict[str, int]:
    """Bytes of the storages ``out``'s graph keeps for backward, by the name of the first node that keeps each,
    leaving out the storages of ``given`` (tensors the caller holds anyway)."""
    kept: dict[str, int] = {}
    seen, stack, storages = set(), [out.grad_fn], {id(t.untyped_storage()) for t in given}
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for t in saved_by(node):
            if id(t.untyped_storage()) not in storages:
                storages.add(id(t.untyped_storage()))
                kept[node.name()] = kept.get(node.name(), 0) + t.untyped_storage().nbytes()
        stack.extend(f for f, _ in node.next_functions)
    return kept
