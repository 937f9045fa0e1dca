"""Optimizer state of a steady-state step (what Adam keeps once it has run)."""

from __future__ import annotations

from typing import Any


def adam_steady_state(params: Any) -> Any:
    """``torch.optim.Adam`` whose moments (and step counters) already exist: the optimizer of any step after the
    first, whose forward and backward run with the Adam states alive. (On the very first step Adam creates them
    inside ``step()``; that step peaks no higher than a later one.)"""
    import torch

    optimizer = torch.optim.Adam(params)
    for group in optimizer.param_groups:
        for p in group["params"]:
            # a tensor made from a Python number, as Adam makes it: FakeTensorMode keeps its value for .item()
            optimizer.state[p] = {"step": torch.tensor(0.0, dtype=torch.float32),
                                  "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                  "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
    return optimizer
