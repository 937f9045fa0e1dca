"""Predicted against measured on this machine: each policy's step predicted (fake tensors) and measured (real),
and the check, before anything is measured, that the run fits in this machine's memory."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from remat.config import ModelConfig
from remat.memory.measure import measure
from remat.memory.optimizer import adam_steady_state
from remat.memory.predict import predict, predict_config, prepare_shallow_traces
from remat.models.gpt import build_model, sample_batch
from remat.policy import Policy
from remat.recompute.apply import apply
from remat.timeline import Timeline
from remat.units import format_bytes

Progress = Callable[[int, int, str], None]  # (done, total, policy now)
# Measuring allocates the predicted peak for real: refuse when the largest predicted peak is more than this share of
# the memory available; the process, torch's own buffers and a second copy of the model (timed steps) need the rest.
MEMORY_SHARE = 0.8


def predict_policies(config: ModelConfig, policies: Sequence[Policy], *, device: str = "cpu", adam: bool = False,
                     tp: int = 1, sp: bool = False, progress: Progress | None = None,
                     on_predicted: Callable[[int, Any, float], None] | None = None,
                     keep: Callable[[int], bool] | None = None,
                     summarize: Callable[[int, Timeline, float], Any] | None = None,
                     ) -> list[tuple[Timeline | None, float]]:
    """Each policy's predicted step and the seconds its prediction took.

    Args:
        config: the reference GPT.
        policies: the recompute policies, in order.
        device: ``'cpu'`` (exact bytes) or ``'cuda'`` (512-byte allocator blocks).
        adam: include Adam's states and trace ``optimizer.step()`` (a full trace per policy, one unsharded rank).
        tp, sp: one tensor-parallel rank (:func:`remat.memory.predict.predict_config`).
        progress: called as ``progress(i, len(policies), str(policy))`` before each policy and once at the end.
        on_predicted: called as ``on_predicted(i, timeline, seconds)`` once per policy, as soon as its timeline is
            made (for a policy composed while the other shallow traces are still being traced, then), so that a
            caller's own work on it (a report row) overlaps the tracing.
        keep: which policies' timelines (by index) the result holds; the others hold None once ``on_predicted`` has
            seen them, so that their memory is reused for the next ones (a sweep's timelines of an 80-layer model
            take hundreds of MB, and growing the process into them costs more than composing them). Default: all.
        summarize: when given, ``on_predicted`` receives ``summarize(i, timeline, seconds)`` (picklable, e.g. a
            report row) instead of the timeline, and the policies composed beside the shallow traces are composed
            and summarized in the worker that traced their stand-in (only kept timelines come back): this process
            does not compose them on a core the workers need.

    Returns:
        ``[(timeline, seconds), ...]`` in the order of ``policies`` (``timeline`` None where ``keep`` says so).

    Example::

        >>> [(tl, s)] = predict_policies(ModelConfig(num_layers=2), [Policy.parse("full/uniform/1")])
    """
    parallel = {"tp": tp, "sp": sp} if tp != 1 or sp else {}
    if adam and parallel:
        raise ValueError("--adam with --tp/--sp: Adam states are traced on one unsharded process only; drop one")
    early: dict[int, tuple[Timeline | None, float]] = {}  # composed while the other shallow traces were made

    def finished(i: int, timeline: Timeline, seconds: float) -> tuple[Timeline | None, Any]:
        """Policy ``i``'s timeline as the result holds it, and what ``on_predicted`` receives: made in the process
        that composed it (with ``summarize``, a worker's summary of a policy composed beside its trace)."""
        kept = timeline if keep is None or keep(i) else None
        return kept, timeline if summarize is None else summarize(i, timeline, seconds)

    def handed(i: int, made: tuple[Timeline | None, Any], seconds: float) -> tuple[Timeline | None, float]:
        """Policy ``i``'s entry of the result, its timeline (or summary) handed to ``on_predicted`` first."""
        if on_predicted is not None:
            on_predicted(i, made[1], seconds)
        return made[0], seconds

    def composed_early(i: int, made: Any, seconds: float) -> None:
        early[i] = handed(i, made if summarize is not None else finished(i, made, seconds), seconds)

    if not adam:  # every shallow trace the compositions below need, made together (side by side on the cores)
        prepare_shallow_traces(config, policies, device=device, **parallel, on_composed=composed_early,
                               finish=None if summarize is None else finished)
    out: list[tuple[Timeline | None, float]] = []
    for i, policy in enumerate(policies):
        if progress is not None:
            progress(i, len(policies), str(policy))
        if i in early:
            out.append(early[i])
            continue
        start = time.perf_counter()
        if adam:  # a full trace: composition does not cover optimizer.step()
            timeline = predict(config, policy, optimizer=adam_steady_state, device=device)
        else:
            timeline = predict_config(config, policy, device=device, **parallel)
        seconds = time.perf_counter() - start
        out.append(handed(i, finished(i, timeline, seconds), seconds))
    if progress is not None:
        progress(len(policies), len(policies), "")
    return out


class MemoryCheckError(ValueError):
    """A run that would not fit in the memory available; ``config`` is the model that does not fit (for the caller
    to name the flags that made it that large)."""

    def __init__(self, message: str, need: int, available: int, config: ModelConfig | None = None):
        super().__init__(message)
        self.need = need
        self.available = available
        self.config = config


def available_memory(device: str | torch.device = "cpu") -> int | None:
    """Bytes a new allocation can get on ``device``: ``MemAvailable`` of ``/proc/meminfo`` on CPU, the free
    memory ``torch.cuda.mem_get_info`` reports on CUDA; None when it cannot be told (not Linux, no CUDA device).

    Example::

        >>> available_memory("cpu") > 0
        True
    """
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0]) if torch.cuda.is_available() else None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_fits(need: int, device: str | torch.device = "cpu", *, what: str = "measuring",
               fix: str = "use a smaller model, or 'remat predict' alone", config: ModelConfig | None = None,
               basis: str = "the largest predicted peak") -> None:
    """Refuse to measure a run that needs more than :data:`MEMORY_SHARE` of the memory available on ``device``;
    do nothing when the available memory cannot be told.

    Args:
        need: bytes the run will hold at its peak (e.g. the largest predicted peak, :func:`predicted_need`).
        device: where it runs.
        what: the run, as the message's subject.
        fix: what the message tells the user to do instead.
        config: the model, kept on the error for the caller to name its flags.
        basis: how ``need`` was found, said in the message.

    Raises:
        MemoryCheckError: ``'<what> needs about <need> (the largest predicted peak) but <available> is available
            on <device>: <fix>'``.

    Example::

        >>> check_fits(1 << 50, "cpu")
        Traceback (most recent call last):
        MemoryCheckError: measuring needs about 1048576.00 GiB ...
    """
    available = available_memory(device)
    if available is not None and need > MEMORY_SHARE * available:
        raise MemoryCheckError(f"{what} needs about {format_bytes(need)} ({basis}) but "
                               f"{format_bytes(available)} is available on {torch.device(device)}: {fix}",
                               need, available, config)


def predicted_need(config: ModelConfig, policies: Sequence[Policy], device: str = "cpu") -> int:
    """The largest peak :func:`remat.memory.predict.predict_config` predicts for ``config`` over ``policies``
    (shapes only, under FakeTensorMode: nothing of that size is allocated)."""
    return max(predict_config(config, policy, device=device).peak_bytes for policy in policies)


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
        One :func:`comparison_row` per policy. Raises :class:`MemoryCheckError` before measuring when the largest
        predicted peak does not fit in this machine's free memory (:func:`check_fits`).

    Example::

        >>> rows = compare_policies(ModelConfig(num_layers=2), [Policy(), Policy.parse("full/uniform/1")])
        >>> abs(rows[1]["error"]) < 0.01
        True
    """
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device here; compare measures on this machine, use "
                         "--device cpu")
    predicted = [tl for tl, _ in predict_policies(config, policies, device=device, adam=adam)]
    check_fits(max(tl.peak_bytes for tl in predicted), device,
               fix="use a smaller config (--layers, --seq, --batch, ...), or 'remat predict' alone")
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
