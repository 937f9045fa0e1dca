"""``remat explain``: measure recompute policies on the reference GPT and explain, with the numbers, why a bigger
``--recompute-num-layers`` group can save memory (the question in the README). :func:`explain` is the entry point;
the rows live in :mod:`remat.analysis.explain_data`, the words in :mod:`remat.analysis.explain_text`, and the
pipeline-parallel side in :mod:`remat.analysis.explain_pipeline` (``remat explain --pp``).
"""

from __future__ import annotations

import gc
import platform
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

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
    whole_stack_policy,
)
from remat.analysis.explain_text import explain_sentences, short_answer
from remat.config import ModelConfig
from remat.memory.comparison import check_fits, predicted_need
from remat.memory.measure import measure
from remat.models.gpt import build_model, sample_batch
from remat.policy import ENGINES, Policy, PolicyError
from remat.recompute.apply import apply, remove
from remat.timeline import Timeline

__all__ = ["Contrast", "Explanation", "FormulaRow", "PolicyRow", "Regime", "answer_policies", "contrast_policies",
           "default_policies", "explain", "resolve_policies"]
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


def answer_policies(policies: Sequence[Policy], num_layers: int, formula: bool = True) -> list[Policy]:
    """The policies the short answer rests on, measured first: none and the whole-stack group ``full/uniform/L``
    (a regime's line: the plain peak and the group's saving) and, with ``formula``, every other
    ``full/uniform/K`` (the formula check, made on the main run only)."""
    whole = whole_stack_policy(policies, num_layers)
    return [p for p in policies if p.is_none or p == whole or
            (formula and p.granularity == "full" and p.method == "uniform")]


@contextmanager
def _young_collections() -> Iterator[None]:
    """Inside: collections skip every object alive on entry (:func:`gc.freeze`). Each measured step's garbage is
    collected after it (:func:`_release`); with torch imported a full collection walks millions of long-lived
    objects (0.2 s, a dozen times a run), none of them the step's."""
    frozen = gc.get_freeze_count()
    gc.freeze()
    try:
        yield
    finally:
        if not frozen:  # a caller's own freeze stays as it was
            gc.unfreeze()


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
            engine: str | None = None, device: str = "cpu", repeats: int = 0, seed: int = 0,
            progress: Progress | None = None, contrast_vocab: int | None = None,
            check_memory: bool = True, answer: Callable[[list[str]], None] | None = None) -> Explanation:
    """Measure ``policies`` on the reference GPT of ``config`` and explain the differences.

    Args:
        config: the model; default ``ModelConfig()`` (8 layers, h=256, s=256, b=4, vocab 512).
        policies: default :func:`default_policies`; ``none`` is always measured, first, as the baseline.
        engine: ``reentrant``/``non-reentrant`` for the policies given as text without ``@engine``.
        device: ``'cpu'`` (exact bytes) or ``'cuda'`` (allocator blocks).
        repeats: timed forward+backward steps per policy without the recorder, round-robin over the policies
            after all are measured (default 0: not timed; the bytes do not depend on it).
        seed: model initialisation, batch and dropout seed, the same for every policy.
        progress: ``progress(i, n, what)`` before each of the ``n`` steps (``what`` names it), and with
            ``i == n`` at the end.
        contrast_vocab: also measure none, full/uniform/1 and full/uniform/L (untimed) on the same model with this
            vocabulary, the other regime of the question (:attr:`Explanation.contrast`); None, or the model's own
            vocabulary: no contrast run.
        check_memory: first predict the largest peak and refuse (:class:`~remat.memory.comparison.MemoryCheckError`)
            when it would not fit in this machine's available memory.
        answer: called with :attr:`~Explanation.short_answer` as soon as it is known: none and the
            ``full/uniform/K`` policies are measured first, then the contrast run's none and ``full/uniform/L``;
            its ``full/uniform/1``, the other policies and the timed steps after.

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
    # what the short answer rests on first (it is handed to ``answer`` then), the other policies after
    first, other_first = answer_policies(resolved, config.num_layers), \
        answer_policies(other_policies, config.num_layers, formula=False)
    rest, other_rest = [p for p in resolved if p not in first], [p for p in other_policies if p not in other_first]
    # without a contrast run other_policies is empty: nothing is measured on other_config
    other_config, label = (other, f" (vocab {other.vocab_size})") if other is not None else (config, "")
    other_batch = sample_batch(other_config, dev, seed=seed)
    with _young_collections():
        measured = _measure_policies(config, first, batch, dev, seed, progress, 0, steps)
        done = len(first)
        other_measured = _measure_policies(other_config, other_first, other_batch, dev, seed, progress, done, steps,
                                           label)
        done += len(other_first)
        if answer is not None:
            answer(_short_answer(config, first, measured, other, other_first, other_measured))
        other_measured.update(_measure_policies(other_config, other_rest, other_batch, dev, seed, progress, done,
                                                steps, label))
        done += len(other_rest)
        measured.update(_measure_policies(config, rest, batch, dev, seed, progress, done, steps))
        times = _time_policies(config, resolved, batch, repeats, dev, seed, progress, done + len(rest), steps)
    if progress is not None:
        progress(steps, steps, "")

    contrast = None
    if other is not None:
        other_timelines = {str(p): other_measured[str(p)] for p in other_policies}
        other_rows = _rows(other_policies, other_timelines, {})
        contrast = Contrast(other, other_rows, regime_of(other, other_policies, other_rows, other_timelines),
                            other_timelines)
    timelines = {str(p): measured[str(p)] for p in resolved}  # in the policies' order, whatever the measuring order
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


def _short_answer(config: ModelConfig, first: Sequence[Policy], timelines: dict[str, Timeline],
                  other: ModelConfig | None, other_first: Sequence[Policy],
                  other_timelines: dict[str, Timeline]) -> list[str]:
    """The short answer from :func:`answer_policies`' timelines alone (of the main run and of the contrast's):
    what :func:`explain` gives as :attr:`Explanation.short_answer` once every policy is measured (the others have
    no formula row and no part in a regime)."""
    plain = timelines[str(first[0])]
    formula = [f for p in first if (f := formula_row(p, timelines[str(p)], plain, config.num_layers))]
    regimes = [regime_of(config, first, _rows(first, timelines, {}), timelines)]
    if other is not None:
        regimes.append(regime_of(other, other_first, _rows(other_first, other_timelines, {}), other_timelines))
    return short_answer(config, formula, sorted(regimes, key=lambda r: r.vocab_size))
