"""``remat explain``: measure recompute policies on the reference GPT and explain, with the numbers, why a bigger
``--recompute-num-layers`` group can save memory (the question in the README). :func:`explain` is the entry point;
the rows live in :mod:`remat.analysis.explain_data`, the words in :mod:`remat.analysis.explain_text`, and the
pipeline-parallel side in :mod:`remat.analysis.explain_pipeline` (``remat explain --pp``).
"""

from __future__ import annotations

import gc
import platform
import time
from collections.abc import Callable, Sequence

import torch

from remat.analysis.explain_data import (
    Contrast,
    Explanation,
    FormulaRow,
    PolicyRow,
    Regime,
    formula_row,
    policy_row,
    regime_of,
)
from remat.analysis.explain_text import explain_sentences, short_answer
from remat.config import ModelConfig
from remat.memory.comparison import check_fits, predicted_need
from remat.memory.measure import measure
from remat.models.gpt import build_model, sample_batch
from remat.policy import ENGINES, Policy, PolicyError
from remat.recompute.apply import apply, remove
from remat.timeline import Timeline

__all__ = ["Contrast", "Explanation", "FormulaRow", "PolicyRow", "Regime", "contrast_policies", "default_policies",
           "explain", "resolve_policies"]
DEVICES = ("cpu", "cuda")
Progress = Callable[[int, int, str], None]


# ------------------------------------------------------------------------------------------------ policies
def default_policies(num_layers: int) -> list[str]:
    """none; full/uniform/K for K = 1, 2, 4, ... and K = L; full/block/K for K = L/4, L/2; two selective ones."""
    uniform = [k for k in (2 ** i for i in range(num_layers.bit_length())) if k <= num_layers]
    uniform.append(num_layers)
    block = [k for k in (num_layers // 4, num_layers // 2) if k >= 1]
    names = ["none", *(f"full/uniform/{k}" for k in uniform), *(f"full/block/{k}" for k in block),
             "selective/core_attn", "selective/core_attn+mlp"]
    return list(dict.fromkeys(names))


def resolve_policies(policies: Sequence[str | Policy] | None, num_layers: int,
                     engine: str | None = None) -> list[Policy]:
    """Parse and check ``policies`` against a ``num_layers`` stack; ``none`` is put first when missing.

    ``engine`` (``reentrant``/``non-reentrant``) applies to the policies given as text without an ``@engine``
    suffix and to the default list; :class:`Policy` objects are used as they are. Duplicates are dropped.
    Raises :class:`PolicyError` for a bad policy, e.g. a group larger than the stack.
    """
    if engine is not None and engine not in ENGINES:
        raise PolicyError(f"unknown recompute engine {engine!r}: valid values are {', '.join(ENGINES)}")
    items = default_policies(num_layers) if policies is None else list(policies)
    if not items:
        raise PolicyError("no policies to explain: give at least one, e.g. none,full/uniform/1")
    out: list[Policy] = []
    for item in items:
        if isinstance(item, Policy):
            policy = item
        else:
            policy = Policy.parse(item)
            if engine is not None and "@" not in item and not policy.is_none:
                policy = Policy(policy.granularity, policy.method, policy.num_layers, policy.modules, engine,
                                policy.distribute_saved_activations)
        policy.layer_groups(num_layers)  # refuses K > depth before anything is measured
        if policy not in out:
            out.append(policy)
    # The plain run is the baseline of the step-time ratio, the FLOP percentage and the formula check.
    plain = [p for p in out if p.is_none]
    return plain[:1] + [p for p in out if not p.is_none] if plain else [Policy(), *out]


# ------------------------------------------------------------------------------------------------ measuring
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _time_policies(config: ModelConfig, policies: Sequence[Policy], batch: tuple[torch.Tensor, torch.Tensor],
                   repeats: int, device: torch.device, seed: int, progress: Progress | None, done: int,
                   steps: int) -> dict[str, list[float]]:
    """Wall seconds of ``repeats`` forward+backward steps per policy, without the recorder.

    One model is re-applied with each policy in turn, round-robin (none, A, B, ..., none, A, B, ...), so that a
    slow spell of a shared machine hits every policy alike instead of skewing the ratios to none.
    """
    times: dict[str, list[float]] = {str(p): [] for p in policies}
    if not repeats:
        return times
    model = build_model(config, device, seed=seed)
    # The measured steps already ran every kernel; one untimed step guards against lazy set-up the recorder's
    # path did not trigger.
    _step(model, batch, device)
    for r in range(repeats):
        for policy in policies:
            if progress is not None:
                progress(done, steps, f"time {policy} ({r + 1}/{repeats})")
            apply(model, policy)
            times[str(policy)].append(_step(model, batch, device))
            done += 1
    remove(model)
    del model
    _release(device)
    return times


def _step(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor], device: torch.device) -> float:
    """Wall seconds of one forward+backward (gradients reset first and after)."""
    model.zero_grad(set_to_none=True)
    _sync(device)
    start = time.perf_counter()
    model(*batch).backward()
    _sync(device)
    seconds = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return seconds


def _check_device(device: str) -> torch.device:
    if device not in DEVICES:
        raise ValueError(f"device={device!r}: must be one of {', '.join(DEVICES)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch sees no CUDA device (this torch build: "
                         f"{torch.__version__}): use device 'cpu'")
    return torch.device(device)


def contrast_policies(num_layers: int, engine: str | None = None) -> list[Policy]:
    """What the contrast run measures: none, full/uniform/1 and the whole-stack group full/uniform/L."""
    return resolve_policies(["none", "full/uniform/1", f"full/uniform/{num_layers}"], num_layers, engine)


def _measure_policies(config: ModelConfig, policies: Sequence[Policy], batch: tuple[torch.Tensor, torch.Tensor],
                      device: torch.device, seed: int, progress: Progress | None, done: int, steps: int,
                      label: str = "") -> dict[str, Timeline]:
    """One recorded forward+backward per policy, each on a fresh model built from ``seed``."""
    timelines: dict[str, Timeline] = {}
    for i, policy in enumerate(policies):
        name = str(policy)
        if progress is not None:
            progress(done + i, steps, f"measure {name}{label}")
        model = build_model(config, device, seed=seed)
        apply(model, policy)
        torch.manual_seed(seed)  # the same dropout masks in every policy's measured step
        tl = measure(model, batch)
        tl.meta["config"] = config.to_dict()
        timelines[name] = tl
        del model
        _release(device)
    return timelines


def _rows(policies: Sequence[Policy], timelines: dict[str, Timeline],
          times: dict[str, list[float]]) -> list[PolicyRow]:
    plain = timelines[str(policies[0])]
    plain_flops = int(plain.meta["flops"].get("forward", 0) + plain.meta["flops"].get("backward", 0))
    rows = [policy_row(p, timelines[str(p)], plain_flops, times.get(str(p), [])) for p in policies]
    base = rows[0].step_seconds
    for row in rows:
        if row.step_seconds is not None and base:
            row.step_ratio = row.step_seconds / base
    return rows


def explain(config: ModelConfig | None = None, policies: Sequence[str | Policy] | None = None, *,
            engine: str | None = None, device: str = "cpu", repeats: int = 3, seed: int = 0,
            progress: Progress | None = None, contrast_vocab: int | None = None,
            check_memory: bool = True) -> Explanation:
    """Measure ``policies`` on the reference GPT of ``config`` and explain the differences.

    Args:
        config: the model; default ``ModelConfig()`` (8 layers, h=256, s=256, b=4, vocab 512).
        policies: default :func:`default_policies`; ``none`` is always measured, first, as the baseline.
        engine: ``reentrant``/``non-reentrant`` for the policies given as text without ``@engine``.
        device: ``'cpu'`` (exact bytes) or ``'cuda'`` (allocator blocks).
        repeats: timed forward+backward steps per policy without the recorder, round-robin over the policies
            after all are measured (0: not timed).
        seed: model initialisation, batch and dropout seed, the same for every policy.
        progress: ``progress(i, n, what)`` before each of the ``n`` steps (``what`` names it), and with
            ``i == n`` at the end.
        contrast_vocab: also measure none, full/uniform/1 and full/uniform/L (untimed) on the same model with this
            vocabulary, the other regime of the question (:attr:`Explanation.contrast`); None, or the model's own
            vocabulary: no contrast run.
        check_memory: first predict the largest peak and refuse (:class:`~remat.memory.comparison.MemoryCheckError`)
            when it would not fit in this machine's available memory.

    Returns:
        An :class:`Explanation`: rows, formula checks, :attr:`~Explanation.short_answer`, sentences, timelines.

    Example::

        >>> result = explain(ModelConfig(num_layers=4), ["none", "full/uniform/4"], repeats=0, contrast_vocab=32000)
        >>> print("\\n".join(result.short_answer))
    """
    config = ModelConfig() if config is None else config
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 0:
        raise ValueError(f"repeats={repeats!r}: must be an integer >= 0 (timed steps per policy)")
    if contrast_vocab is not None and (isinstance(contrast_vocab, bool) or not isinstance(contrast_vocab, int)
                                       or contrast_vocab < 1):
        raise ValueError(f"contrast_vocab={contrast_vocab!r}: must be a vocabulary size >= 1, or None for no "
                         "contrast run")
    dev = _check_device(device)
    resolved = resolve_policies(policies, config.num_layers, engine)
    other = config.replace(vocab_size=contrast_vocab) \
        if contrast_vocab is not None and contrast_vocab != config.vocab_size else None
    other_policies = contrast_policies(config.num_layers, engine) if other is not None else []
    if check_memory:
        check_fits(predicted_need(config, resolved, device), dev, config=config,
                   what=f"measuring this {config.num_layers}-layer model (h={config.hidden_size})")
        if other is not None:
            check_fits(predicted_need(other, other_policies, device), dev, config=other,
                       what=f"measuring the contrast run at vocab {other.vocab_size}")
    started = time.perf_counter()
    steps = len(resolved) * (1 + repeats) + len(other_policies)
    batch = sample_batch(config, dev, seed=seed)
    timelines = _measure_policies(config, resolved, batch, dev, seed, progress, 0, steps)
    contrast = None
    if other is not None:
        other_timelines = _measure_policies(other, other_policies, sample_batch(other, dev, seed=seed), dev, seed,
                                            progress, len(resolved), steps, f" (vocab {other.vocab_size})")
        other_rows = _rows(other_policies, other_timelines, {})
        contrast = Contrast(other, other_rows, regime_of(other, other_policies, other_rows, other_timelines),
                            other_timelines)
    times = _time_policies(config, resolved, batch, repeats, dev, seed, progress,
                           len(resolved) + len(other_policies), steps)
    if progress is not None:
        progress(steps, steps, "")

    rows = _rows(resolved, timelines, times)
    plain = timelines[str(resolved[0])]
    formula = [f for p in resolved if (f := formula_row(p, timelines[str(p)], plain, config.num_layers))]
    regime = regime_of(config, resolved, rows, timelines)
    sentences = explain_sentences(config, resolved, rows, formula, timelines, regime, contrast)
    meta = {
        "device": str(dev), "engine": engine or "reentrant (unless a policy names one)", "repeats": repeats,
        "seed": seed, "torch": torch.__version__, "python": platform.python_version(),
        "threads": torch.get_num_threads(), "seconds": time.perf_counter() - started,
        "flops_note": "matmul FLOPs counted by torch.utils.flop_counter",
    }
    result = Explanation(config, rows, formula, sentences, timelines, meta, regime=regime, contrast=contrast)
    result.short_answer = short_answer(config, formula, result.regimes())
    return result
