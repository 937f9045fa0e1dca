"""Will a measured run fit on this machine? Its predicted peak against the memory available, checked up front."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from remat.config import ModelConfig
from remat.memory.predict import predict_config
from remat.policy import Policy
from remat.units import format_bytes

# Measure only when the largest predicted peak is at most this fraction of the available memory: the process,
# torch's own buffers and a second copy of the model (the timed steps) need the rest.
MEMORY_FRACTION = 0.8


class MemoryCheckError(ValueError):
    """A run that would not fit in the memory available; ``config`` is the model that does not fit."""

    def __init__(self, message: str, need: int, available: int, config: ModelConfig | None = None):
        super().__init__(message)
        self.need = need
        self.available = available
        self.config = config


def available_memory(device: str | torch.device = "cpu") -> int | None:
    """Bytes a new allocation can get on ``device``: ``MemAvailable`` of ``/proc/meminfo`` on CPU, the free
    memory ``torch.cuda.mem_get_info`` reports on CUDA; None when it cannot be read (not Linux).

    Example::

        >>> available_memory("cpu") > 0
        True
    """
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_fits(need: int, device: str | torch.device = "cpu", *, what: str = "measuring",
               fix: str = "use a smaller model, or 'remat predict' alone", config: ModelConfig | None = None) -> None:
    """Raise :class:`MemoryCheckError` when ``need`` bytes exceed :data:`MEMORY_FRACTION` of the memory available
    on ``device``; do nothing when the available memory cannot be read.

    Args:
        need: bytes the run will hold at its peak (e.g. the largest predicted peak).
        device: where it runs.
        what: the run, as the message's subject.
        fix: what the message tells the user to do instead.
        config: the model, kept on the error for the caller to name its flags.

    Example::

        >>> check_fits(1 << 50, "cpu")
        Traceback (most recent call last):
        MemoryCheckError: measuring needs about 1048576.00 GiB ...
    """
    available = available_memory(device)
    if available is not None and need > MEMORY_FRACTION * available:
        raise MemoryCheckError(f"{what} needs about {format_bytes(need)} (the largest predicted peak) but "
                               f"{format_bytes(available)} is available on {torch.device(device)}: {fix}",
                               need, available, config)


def predicted_need(config: ModelConfig, policies: Sequence[Policy], device: str = "cpu") -> int:
    """The largest peak :func:`remat.memory.predict.predict_config` predicts for ``config`` over ``policies``
    (shapes only, under FakeTensorMode: nothing of that size is allocated)."""
    return max(predict_config(config, policy, device=device).peak_bytes for policy in policies)
