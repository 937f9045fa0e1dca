"""Explain, with measured numbers, how recompute policies change a training step's memory: ``remat explain``.

This answers the Megatron-LM user question in ``shared/reference/question.md``: "why does a bigger
``--recompute-num-layers`` group, even one group over the whole layer stack, save memory, when recomputing a
group rebuilds all of its activations at once?". For each policy :func:`explain` builds the same model (same
seed), applies the policy, records one forward+backward step with :func:`remat.measure` and times the step
separately without the recorder. From the timelines it derives, per policy:

* where the peak sits and what is alive there (activations, stored group inputs, the head/loss part);
* the largest recompute working set and the extra forward compute recompute costs;
* for ``full/uniform/K``, the user's formula (stored group inputs + one group's activations) against the
  measured bytes at the end of the first group recomputation;

and turns the numbers into plain sentences. The short answer it measures: without recompute all layers'
activations are still alive when the loss's backward makes the logits' gradient, so they add up with the
head/loss part; with one group over the whole stack the head/loss part is freed before the stack is recomputed,
so the peak is the larger of the two instead of their sum. Pipeline parallelism is the second reason (a stage
holds several microbatches' stored inputs but recomputes one group at a time); it is not measured here.
"""

from __future__ import annotations

import gc
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from remat.config import ModelConfig
from remat.memory.measure import measure
from remat.models.gpt import build_model, sample_batch
from remat.policy import ENGINES, Policy, PolicyError
from remat.recompute.apply import apply, remove
from remat.timeline import Timeline
from remat.units import MIB

DEVICES = ("cpu", "cuda")
# The whole-stack group counts as saving memory only above this fraction of the plain peak: below it the
# difference is backward temporaries moving around, not a different memory regime.
SAVING_THRESHOLD = 0.01
# What each category alive at a peak is, in words (see remat.timeline.CATEGORIES).
CATEGORY_WORDS = {
    "parameters": "parameters",
    "gradients": "parameter gradients accumulated so far",
    "optimizer_state": "optimizer state",
    "group_inputs": "stored checkpoint inputs",
    "saved_activations": "activations kept from forward",
    "recompute": "activations rebuilt by recompute",
    "head_loss": "head/loss tensors (logits, their log-softmax and gradients)",
    "other": "backward temporaries (activation gradients)",
}
Progress = Callable[[int, int, str], None]


@dataclass
class PolicyRow:
    """The measured numbers of one policy; bytes are exact storage bytes on CPU, block-rounded on CUDA.

    ``activations_at_peak`` is saved activations plus recomputed activations alive at the peak;
    ``group_inputs_stored`` is what the checkpoints keep at the end of forward (the inputs of every group);
    ``recompute_max_bytes`` is the largest amount of recomputed activations alive at any moment;
    ``head_loss_at_peak`` is the final norm, logits, loss and their gradients alive at the peak.
    ``extra_forward_pct`` is the recomputation's matmul FLOPs over the plain step's forward+backward FLOPs
    (in percent); ``step_seconds`` is the median wall time of a forward+backward without the recorder and
    ``step_ratio`` that time over the plain (none) step's, measured in the same run (None when not timed).
    """

    policy: str
    peak_bytes: int
    peak_phase: str
    activations_at_peak: int
    group_inputs_at_peak: int
    group_inputs_stored: int
    recompute_max_bytes: int
    head_loss_at_peak: int
    gradients_at_peak: int
    parameters_bytes: int
    extra_forward_pct: float
    recompute_flops: int
    step_seconds: float | None
    step_ratio: float | None
    step_times: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class FormulaRow:
    """The user's formula for one ``full/uniform/K`` policy, checked against the measurement.

    ``predicted_bytes`` = ``stored_group_inputs`` (all groups' inputs at the end of forward) +
    ``group_activation_bytes`` (the plain run's activations of the layers of the last group, the one recomputed
    first). ``measured_bytes`` = stored group inputs + recomputed activations alive at the last event of that
    first recomputation. ``m_over_groups_bytes`` is the user's literal version: stored inputs + M / num_groups,
    M being all layers' activations of the plain run. ``error`` is (measured - predicted) / measured.
    """

    policy: str
    group: str
    group_layers: list[int]
    num_groups: int
    stored_group_inputs: int
    group_activation_bytes: int
    predicted_bytes: int
    measured_bytes: int
    m_over_groups_bytes: int
    error: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Explanation:
    """What :func:`explain` found: one row per policy, the formula checks, sentences, and the timelines."""

    config: ModelConfig
    rows: list[PolicyRow]
    formula: list[FormulaRow]
    sentences: list[str]
    timelines: dict[str, Timeline]
    meta: dict[str, Any] = field(default_factory=dict)

    def row(self, policy: str) -> PolicyRow:
        """The row of ``policy`` (its short form, e.g. ``'full/uniform/2'``)."""
        for row in self.rows:
            if row.policy == policy:
                return row
        raise KeyError(f"no row for policy {policy!r}; rows: {[r.policy for r in self.rows]}")

    def to_dict(self) -> dict[str, Any]:
        """Everything but the timelines (saved separately), as JSON-able plain data."""
        return {
            "format": "remat.analysis.explain",
            "version": 1,
            "config": self.config.to_dict(),
            "policies": [r.policy for r in self.rows],
            "rows": [r.to_dict() for r in self.rows],
            "formula": [f.to_dict() for f in self.formula],
            "sentences": list(self.sentences),
            "meta": dict(self.meta),
        }


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


# ------------------------------------------------------------------------------------------------ timeline helpers
def category_live(tl: Timeline, categories: str | Sequence[str]) -> np.ndarray:
    """Bytes alive after each event, counting only allocations of the given categories."""
    wanted = {categories} if isinstance(categories, str) else set(categories)
    delta = np.zeros(tl.num_events + 1, dtype=np.int64)
    for row, category in enumerate(tl.category):
        if category in wanted:
            delta[tl.alloc_at[row]] += tl.nbytes[row]
            if tl.free_at[row] >= 0:
                delta[tl.free_at[row]] -= tl.nbytes[row]
    return np.cumsum(delta[:-1])


def first_recompute_end(tl: Timeline) -> tuple[int, str] | None:
    """(last event, group label) of the first group recomputation: the run of recompute phases of one group."""
    spans = tl.phase_spans()
    for i, (phase, _, end) in enumerate(spans):
        if phase.kind == "recompute":
            last = end
            for later, _, later_end in spans[i + 1:]:
                if later.kind != "recompute" or later.detail != phase.detail:
                    break
                last = later_end
            return last - 1, phase.detail
    return None


def layer_activation_bytes(plain: Timeline) -> dict[int, int]:
    """Per layer: bytes its forward keeps for backward in the plain run (alive at the end of forward)."""
    end = plain.forward_end
    out: dict[int, int] = {}
    for row in plain.alive_at(end):
        phase = plain.phases[plain.phase_index[row]]
        if phase.kind == "forward" and phase.region.startswith("layer ") and \
                plain.category[row] == "saved_activations":
            i = int(phase.region.split()[1])
            out[i] = out.get(i, 0) + plain.nbytes[row]
    return out


# ------------------------------------------------------------------------------------------------ measuring
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _time_policies(config: ModelConfig, policies: Sequence[Policy], batch: tuple[torch.Tensor, torch.Tensor],
                   repeats: int, device: torch.device, seed: int, progress: Progress | None,
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
    done = len(policies)
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


def _row(policy: Policy, tl: Timeline, plain_flops: int, times: list[float]) -> PolicyRow:
    at_peak = tl.at_peak
    stored = tl.breakdown(tl.forward_end)["group_inputs"]
    recompute = category_live(tl, "recompute")
    flops = tl.meta.get("flops", {})
    recompute_flops = int(flops.get("recompute", 0))
    return PolicyRow(
        policy=str(policy),
        peak_bytes=tl.peak_bytes,
        peak_phase=tl.peak_phase.label,
        activations_at_peak=at_peak["saved_activations"] + at_peak["recompute"],
        group_inputs_at_peak=at_peak["group_inputs"],
        group_inputs_stored=stored,
        recompute_max_bytes=int(recompute.max()) if len(recompute) else 0,
        head_loss_at_peak=at_peak["head_loss"],
        gradients_at_peak=at_peak["gradients"],
        parameters_bytes=at_peak["parameters"],
        extra_forward_pct=100.0 * recompute_flops / plain_flops if plain_flops else 0.0,
        recompute_flops=recompute_flops,
        step_seconds=statistics.median(times) if times else None,
        step_ratio=None,
        step_times=times,
    )


def formula_row(policy: Policy, tl: Timeline, plain: Timeline, num_layers: int) -> FormulaRow | None:
    """Check the user's formula on one uniform policy's timeline; None for other policies."""
    if policy.granularity != "full" or policy.method != "uniform":
        return None
    end = first_recompute_end(tl)
    if end is None:
        return None
    event, label = end
    groups = policy.layer_groups(num_layers)
    last = groups[-1]  # backward reaches the last group first
    per_layer = layer_activation_bytes(plain)
    stored = tl.breakdown(tl.forward_end)["group_inputs"]
    group_bytes = sum(per_layer.get(i, 0) for i in last)
    at_end = tl.breakdown(event)
    measured = at_end["group_inputs"] + at_end["recompute"]
    predicted = stored + group_bytes
    m_total = sum(per_layer.values())
    return FormulaRow(
        policy=str(policy), group=label, group_layers=list(last), num_groups=len(groups),
        stored_group_inputs=stored, group_activation_bytes=group_bytes, predicted_bytes=predicted,
        measured_bytes=measured, m_over_groups_bytes=stored + m_total // len(groups),
        error=(measured - predicted) / measured if measured else 0.0,
    )


def explain(config: ModelConfig | None = None, policies: Sequence[str | Policy] | None = None, *,
            engine: str | None = None, device: str = "cpu", repeats: int = 3, seed: int = 0,
            progress: Progress | None = None) -> Explanation:
    """Measure ``policies`` on the reference GPT of ``config`` and explain the differences.

    ``config`` defaults to ``ModelConfig()`` (8 layers, h=256, s=256, b=4, vocab 512); ``policies`` to
    :func:`default_policies` (``none`` is always measured, first, as the baseline). ``engine`` applies to the
    policies given as text without ``@engine``. ``device`` is ``'cpu'`` (exact bytes) or ``'cuda'``. Each
    policy's step is timed ``repeats`` times without the recorder (0: not timed), round-robin over the policies
    after all are measured. ``progress(i, n, what)`` is called before each of the ``n`` steps (one measured
    step per policy, then the timed ones), ``what`` naming it, and with ``i == n`` at the end.
    """
    config = ModelConfig() if config is None else config
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 0:
        raise ValueError(f"repeats={repeats!r}: must be an integer >= 0 (timed steps per policy)")
    dev = _check_device(device)
    resolved = resolve_policies(policies, config.num_layers, engine)
    started = time.perf_counter()
    batch = sample_batch(config, dev, seed=seed)
    steps = len(resolved) * (1 + repeats)
    timelines: dict[str, Timeline] = {}
    for i, policy in enumerate(resolved):
        name = str(policy)
        if progress is not None:
            progress(i, steps, f"measure {name}")
        model = build_model(config, dev, seed=seed)
        apply(model, policy)
        torch.manual_seed(seed)  # the same dropout masks in every policy's measured step
        tl = measure(model, batch)
        tl.meta["config"] = config.to_dict()
        timelines[name] = tl
        del model
        _release(dev)
    times = _time_policies(config, resolved, batch, repeats, dev, seed, progress, steps)
    if progress is not None:
        progress(steps, steps, "")

    plain = timelines[str(resolved[0])]
    plain_flops = int(plain.meta["flops"].get("forward", 0) + plain.meta["flops"].get("backward", 0))
    rows = [_row(p, timelines[str(p)], plain_flops, times[str(p)]) for p in resolved]
    base = rows[0].step_seconds
    for row in rows:
        if row.step_seconds is not None and base:
            row.step_ratio = row.step_seconds / base
    formula = [f for p in resolved if (f := formula_row(p, timelines[str(p)], plain, config.num_layers))]
    sentences = explain_sentences(config, resolved, rows, formula, timelines)
    meta = {
        "device": str(dev), "engine": engine or "reentrant (unless a policy names one)", "repeats": repeats,
        "seed": seed, "torch": torch.__version__, "python": platform.python_version(),
        "threads": torch.get_num_threads(), "seconds": time.perf_counter() - started,
        "flops_note": "matmul FLOPs counted by torch.utils.flop_counter",
    }
    return Explanation(config, rows, formula, sentences, timelines, meta)


# ------------------------------------------------------------------------------------------------ sentences
def mib(nbytes: float) -> str:
    """Bytes as MiB with one decimal, e.g. ``'125.0 MiB'``."""
    return f"{nbytes / MIB:.1f} MiB"


def _pct(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "n/a"


def _peak_sentence(row: PolicyRow, tl: Timeline) -> str:
    phase = tl.peak_phase
    if phase.kind == "backward" and phase.region == "head":
        why = ("at the start of backward, where the loss's backward makes the logits' gradient while everything "
               "the forward kept is still alive")
    elif phase.kind == "recompute":
        why = "while a checkpointed group is recomputed: its layers' activations are rebuilt on top of what is stored"
    elif phase.kind == "backward" and row.activations_at_peak and \
            tl.at_peak["recompute"] >= tl.at_peak["saved_activations"]:
        why = "while backpropagating through a recomputed group, whose rebuilt activations are still alive"
    elif phase.kind == "backward":
        why = "during backward, once parameter gradients have accumulated on top of the activations still kept"
    else:
        why = f"in the {phase.kind}"
    # Parts under 0.05 MiB would print as 0.0 MiB and explain nothing.
    parts = sorted(((v, k) for k, v in tl.at_peak.items() if v >= MIB / 20 and k != "parameters"),
                   reverse=True)[:3]
    listed = ", ".join(f"{CATEGORY_WORDS[k]} {mib(v)}" for v, k in parts)
    return (f"{row.policy} peaks at {mib(row.peak_bytes)} in '{row.peak_phase}', {why}: besides "
            f"{mib(row.parameters_bytes)} of parameters, {listed}.")


def head_tensors(tl: Timeline, event: int, config: ModelConfig) -> list[tuple[str, int]]:
    """Name the logits-sized head/loss tensors alive after ``event``: (what it is, bytes), largest first."""
    elements = config.micro_batch_size * config.seq_length * config.vocab_size
    sizes = {elements * 4, elements * torch.empty((), dtype=config.torch_dtype).element_size()}
    named = []
    for item in tl.top_allocations(event, n=len(tl)):
        if item["category"] != "head_loss" or not any(abs(item["nbytes"] - s) < 1024 for s in sizes):
            continue
        if item["phase"].startswith("backward"):
            what = "a gradient of the logits"
        elif item["module"].endswith("output_layer"):
            what = "the logits"
        else:
            what = "the log-softmax of the logits kept by the cross-entropy"
        named.append((what, int(item["nbytes"])))
    return named


def _describe_head(tl: Timeline, event: int, config: ModelConfig) -> str:
    named = head_tensors(tl, event, config)
    if not named:
        return "the final norm's output and the loss (the logits are small here)"
    counts: dict[tuple[str, int], int] = {}
    for what, nbytes in named:
        counts[(what, nbytes)] = counts.get((what, nbytes), 0) + 1
    bits = []
    for (what, nbytes), n in counts.items():
        if n > 1:
            what = what.replace("a gradient of the logits", "gradients of the logits (and of their log-softmax)")
        bits.append(f"{what} ({n} x {mib(nbytes)})" if n > 1 else f"{what} ({mib(nbytes)})")
    shape = f"{config.micro_batch_size}x{config.seq_length}x{config.vocab_size}"
    return f"{', '.join(bits)}, each b x s x vocab = {shape} values"


def explain_sentences(config: ModelConfig, policies: Sequence[Policy], rows: Sequence[PolicyRow],
                      formula: Sequence[FormulaRow], timelines: dict[str, Timeline]) -> list[str]:
    """Plain-words explanation of the measured numbers; ``policies[0]`` must be ``none``."""
    L = config.num_layers
    by_name = {r.policy: r for r in rows}
    plain_row = rows[0]
    plain = timelines[plain_row.policy]
    out = [f"Model: {L}-layer GPT, h={config.hidden_size}, s={config.seq_length}, b={config.micro_batch_size}, "
           f"vocab={config.vocab_size}, {config.dtype}, {config.attention} attention; one forward+backward step, "
           "bytes of every storage alive counted exactly."]
    out += [_peak_sentence(r, timelines[r.policy]) for r in rows]

    # The whole-stack group against no recompute.
    stack_acts = plain.breakdown(plain.forward_end)["saved_activations"]
    head_live = category_live(plain, "head_loss")
    head_max = int(head_live.max()) if len(head_live) else 0
    head_event = int(np.argmax(head_live)) if len(head_live) else 0
    whole = next((p for p in policies if p.granularity == "full" and p.method == "uniform"
                  and p.num_layers == L), None)
    if whole is not None:
        w = by_name[str(whole)]
        saving = plain_row.peak_bytes - w.peak_bytes
        head_words = _describe_head(plain, head_event, config)
        out.append(
            f"Without recompute all {L} layers' activations ({mib(stack_acts)}) are still stored when the loss's "
            f"backward runs, so they add up with the head/loss part ({mib(head_max)}: {head_words}); the peak is "
            f"{mib(plain_row.peak_bytes)} in '{plain_row.peak_phase}'.")
        out.append(
            f"With one group over the whole stack ({w.policy}) the forward keeps only the group's inputs "
            f"({mib(w.group_inputs_stored)}); the head/loss part is freed when the head's backward ends, before the "
            f"stack is recomputed ({mib(w.recompute_max_bytes)} of rebuilt activations at most), so the peak is "
            f"about the larger of the two plus parameters and gradients instead of their sum: "
            f"{mib(w.peak_bytes)} in '{w.peak_phase}'.")
        if saving > SAVING_THRESHOLD * plain_row.peak_bytes:
            out.append(
                f"So here the whole-stack group saves memory: {mib(saving)} ({_pct(saving, plain_row.peak_bytes)} of "
                f"{mib(plain_row.peak_bytes)}), because the head/loss part - {head_words} - no longer sits on top "
                f"of the stack's activations; the saving is bounded by the smaller of the head/loss part "
                f"({mib(head_max)}) and the stack's activations ({mib(stack_acts)}).")
        else:
            out.append(
                f"So here the whole-stack group does not save memory ({mib(saving)}, "
                f"{_pct(saving, plain_row.peak_bytes)} of {mib(plain_row.peak_bytes)}): the head/loss part "
                f"({mib(head_max)}: the logits are small with vocab={config.vocab_size}) is small next to the "
                f"stack's activations ({mib(stack_acts)}), and recomputing the whole stack rebuilds all of them at "
                "once, so the larger of the two is the stack's activations, as without recompute. A larger "
                "vocabulary (bigger logits) is where it saves.")

    # The user's formula.
    if formula:
        checks = "; ".join(f"{f.policy}: predicted {mib(f.predicted_bytes)}, measured {mib(f.measured_bytes)} "
                           f"({100 * f.error:+.2f}%)" for f in formula)
        out.append(
            "The user's formula (peak of the recompute phase = all stored group inputs + one group's activations, "
            "the group's activations being the plain run's activations of its layers) holds at the end of the "
            f"first group's recomputation (the last group, recomputed first): {checks}.")
        worst = max(formula, key=lambda f: abs(f.error))
        if abs(worst.error) < 0.02:
            out.append(
                "It counts activations only: the step's peak adds parameters, the parameter gradients accumulated "
                "so far, backward temporaries and, where it is larger, the head/loss part; so a bigger group trades "
                "stored inputs for a bigger working set, exactly as the user says.")
        else:
            out.append(f"The largest error, {100 * worst.error:+.2f}% for {worst.policy}, means the formula misses "
                       "part of the recomputation's working set for this model.")
        uniform = sorted((r for r in rows if r.policy.startswith("full/uniform/")),
                         key=lambda r: int(r.policy.split("/")[2].split(",")[0].split("@")[0]))
        if len(uniform) >= 2:
            best = min(uniform, key=lambda r: r.peak_bytes)
            out.append(
                f"Across group sizes, stored group inputs go from {mib(uniform[0].group_inputs_stored)} "
                f"({uniform[0].policy}) to {mib(uniform[-1].group_inputs_stored)} ({uniform[-1].policy}) while the "
                f"largest recompute working set goes from {mib(uniform[0].recompute_max_bytes)} to "
                f"{mib(uniform[-1].recompute_max_bytes)}; the lowest peak is {best.policy} at {mib(best.peak_bytes)}.")
            outside = all(timelines[r.policy].peak_phase.kind != "recompute" and
                          timelines[r.policy].at_peak["recompute"] == 0 for r in uniform)
            if outside:
                out.append(
                    "Every full/uniform peak here sits outside the recomputation (" +
                    ", ".join(sorted({r.peak_phase for r in uniform})) + "), so the groups' working sets never "
                    "reach it and only the stored group inputs differ: bigger groups give lower peaks. That is the "
                    "regime Megatron's documentation describes ('increasing the number of layers per group "
                    "reduces the memory usage').")
            elif best is uniform[0]:
                out.append(
                    "The peaks here sit in the recomputation or the backward right after it, so the user's formula "
                    "governs and the smallest group wins; bigger groups only pay off when the peak sits elsewhere: "
                    "a large head/loss part (large vocabulary), or many microbatches in flight under pipeline "
                    "parallelism.")

    # Compute cost.
    costly = [r for r in rows if r.recompute_flops or r.policy.startswith("selective")]
    if costly:
        cost = "; ".join(
            f"{r.policy} {r.extra_forward_pct:.1f}%" + (f" (step {r.step_ratio:.2f}x)" if r.step_ratio else "")
            for r in costly)
        out.append("Recompute is paid in forward compute, as matmul FLOPs over the plain step's forward+backward"
                   f" (and measured step time over none's, noisy on a shared CPU): {cost}.")
        if any(not r.recompute_flops for r in costly):
            out.append("Norms, softmax, dropout and activations count no FLOPs: recomputing them (selective "
                       "layernorm/act, or non_matmul, every operator but the matrix multiplies) costs memory traffic, "
                       "which shows in step time only.")

    out.append(
        "The second reason bigger groups help, not measured here: with pipeline parallelism (1F1B) stage r holds "
        "up to p - r microbatches in flight, each keeping its stored group inputs, but recomputes only one group "
        "of one microbatch at a time, so fewer, larger groups shrink the part that is multiplied by the "
        "microbatches in flight while the working set is paid once.")
    return out
