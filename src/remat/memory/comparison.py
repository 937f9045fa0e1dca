"""Predicted against measured on this machine: each policy's step predicted (fake tensors) and measured (real)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from remat.config import ModelConfig
from remat.memory.measure import measure
from remat.memory.optimizer import adam_steady_state
from remat.memory.predict import predict, predict_config
from remat.models.gpt import build_model, sample_batch
from remat.policy import Policy
from remat.recompute.apply import apply
from remat.timeline import Timeline
from remat.units import format_bytes

Progress = Callable[[int, int, str], None]  # (done, total, policy now)
# Measuring allocates the predicted peak for real; refuse when it would take more than this share of what is free.
MEMORY_SHARE = 0.8


def predict_policies(config: ModelConfig, policies: Sequence[Policy], *, device: str = "cpu", adam: bool = False,
                     tp: int = 1, sp: bool = False, progress: Progress | None = None,
                     ) -> list[tuple[Timeline, float]]:
    """Each policy's predicted step and the seconds its prediction took.

    Args:
        config: the reference GPT.
        policies: the recompute policies, in order.
        device: ``'cpu'`` (exact bytes) or ``'cuda'`` (512-byte allocator blocks).
        adam: include Adam's states and trace ``optimizer.step()`` (a full trace per policy, one unsharded rank).
        tp, sp: one tensor-parallel rank (:func:`remat.memory.predict.predict_config`).
        progress: called as ``progress(i, len(policies), str(policy))`` before each policy and once at the end.

    Returns:
        ``[(timeline, seconds), ...]`` in the order of ``policies``.

    Example::

        >>> [(tl, s)] = predict_policies(ModelConfig(num_layers=2), [Policy.parse("full/uniform/1")])
    """
    parallel = {"tp": tp, "sp": sp} if tp != 1 or sp else {}
    if adam and parallel:
        raise ValueError("--adam with --tp/--sp: Adam states are traced on one unsharded process only; drop one")
    out = []
    for i, policy in enumerate(policies):
        if progress is not None:
            progress(i, len(policies), str(policy))
        start = time.perf_counter()
        if adam:  # a full trace: composition does not cover optimizer.step()
            timeline = predict(config, policy, optimizer=adam_steady_state, device=device)
        else:
            timeline = predict_config(config, policy, device=device, **parallel)
        out.append((timeline, time.perf_counter() - start))
    if progress is not None:
        progress(len(policies), len(policies), "")
    return out


def available_memory(device: str) -> int | None:
    """Bytes free for new allocations on ``device`` ('cpu': MemAvailable of /proc/meminfo; 'cuda': the free
    device memory), or None when it cannot be told."""
    if device == "cuda":
        import torch

        return int(torch.cuda.mem_get_info()[0])
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_fits_here(need: int, device: str) -> None:
    """Refuse (ValueError naming the fix) to measure a step that needs ``need`` bytes when this machine has less
    than ``need / MEMORY_SHARE`` free on ``device``."""
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--device cuda: torch sees no CUDA device here; compare measures on this machine, use "
                             "--device cpu")
    available = available_memory(device)
    if available is not None and need > MEMORY_SHARE * available:
        raise ValueError(f"measuring needs about {format_bytes(need)} (the largest predicted peak) but "
                         f"{format_bytes(available)} is available on {device}: use a smaller config (--layers, --seq, "
                         "--batch, ...), or 'remat predict' alone")


def part_errors(predicted: dict[str, int], measured: dict[str, int], measured_peak: int) -> dict[str, float]:
    """Per at-peak category: (predicted - measured) / measured; a part measured as 0 bytes is taken relative to
    the measured peak instead (0.0 when both are 0), so every error is a finite fraction."""
    out = {}
    for key in measured:
        p, m = predicted.get(key, 0), measured[key]
        out[key] = (p - m) / m if m else ((p - m) / measured_peak if measured_peak else 0.0)
    return out


def comparison_row(policy: Policy, predicted: Timeline, measured: Timeline) -> dict[str, Any]:
    """One policy's predicted and measured peaks, the peak's error and the worst error among the parts alive at
    the peak (``worst_part`` None when every part is exact)."""
    errors = part_errors(predicted.at_peak, measured.at_peak, measured.peak_bytes)
    worst: str | None = max(errors, key=lambda k: abs(errors[k])) if errors else None
    worst_error = errors[worst] if worst else 0.0
    if worst_error == 0:
        worst = None
    return {
        "policy": str(policy), "predicted_bytes": predicted.peak_bytes, "measured_bytes": measured.peak_bytes,
        "error": ((predicted.peak_bytes - measured.peak_bytes) / measured.peak_bytes
                  if measured.peak_bytes else 0.0),
        "predicted_phase": predicted.peak_phase.label, "measured_phase": measured.peak_phase.label,
        "predicted_at_peak": predicted.at_peak, "measured_at_peak": measured.at_peak,
        "part_errors": errors, "worst_part": worst, "worst_part_error": worst_error,
    }


def compare_policies(config: ModelConfig, policies: Sequence[Policy], *, device: str = "cpu", adam: bool = False,
                     progress: Progress | None = None) -> list[dict[str, Any]]:
    """Predict and measure each policy's step of the reference GPT on this machine.

    Args:
        config: the reference GPT (real tensors are allocated: it must fit here).
        policies: the recompute policies, in order.
        device: ``'cpu'`` or ``'cuda'`` (this machine's first GPU).
        adam: include Adam's states on both sides.
        progress: called as ``progress(i, len(policies), str(policy))`` while measuring.

    Returns:
        One :func:`comparison_row` per policy. Raises ValueError before measuring when the largest predicted peak
        does not fit in this machine's free memory (:func:`check_fits_here`).

    Example::

        >>> rows = compare_policies(ModelConfig(num_layers=2), [Policy(), Policy.parse("full/uniform/1")])
        >>> abs(rows[1]["error"]) < 0.01
        True
    """
    import torch

    predicted = [tl for tl, _ in predict_policies(config, policies, device=device, adam=adam)]
    check_fits_here(max(tl.peak_bytes for tl in predicted), device)
    where = torch.device(device)
    batch = sample_batch(config, where)
    rows = []
    for i, (policy, pred) in enumerate(zip(policies, predicted)):
        if progress is not None:
            progress(i, len(policies), str(policy))
        model = build_model(config, where, seed=0)
        apply(model, policy)
        optimizer = adam_steady_state(model.parameters()) if adam else None
        torch.manual_seed(0)
        measured = measure(model, batch, optimizer=optimizer)
        del model, optimizer
        rows.append(comparison_row(policy, pred, measured))
    if progress is not None:
        progress(len(policies), len(policies), "")
    return rows
