"""``remat explain`` in words: the short answer first, then one sentence per finding, every number measured."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from remat.analysis.explain_data import (
    Contrast,
    FormulaRow,
    PolicyRow,
    Regime,
    head_loss_max,
    regime_of,
    whole_stack_policy,
)
from remat.config import ModelConfig
from remat.policy import Policy
from remat.timeline import Timeline
from remat.units import MIB, format_bytes

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


def _pct(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "n/a"


def model_words(config: ModelConfig) -> str:
    """``'8-layer GPT, h=256, s=256, b=4, vocab=512, fp32'``."""
    return (f"{config.num_layers}-layer GPT, h={config.hidden_size}, s={config.seq_length}, "
            f"b={config.micro_batch_size}, vocab={config.vocab_size}, {config.dtype}")


# ------------------------------------------------------------------------------------------------ short answer
def _saves(regime: Regime) -> bool:
    return regime.saving_bytes is not None and regime.saving_bytes > SAVING_THRESHOLD * regime.none_peak_bytes


def _regime_line(regime: Regime) -> str:
    sizes = (f"vocab {regime.vocab_size}: head/loss {format_bytes(regime.head_loss_bytes)}, layers "
             f"{format_bytes(regime.stack_activation_bytes)}")
    if regime.whole_stack is None or regime.whole_stack_peak_bytes is None or regime.saving_bytes is None:
        return f"{sizes}: none peaks at {format_bytes(regime.none_peak_bytes)}."
    verdict = f"-{_pct(regime.saving_bytes, regime.none_peak_bytes)}" if _saves(regime) else "no saving"
    return (f"{sizes}: none {format_bytes(regime.none_peak_bytes)}, {regime.whole_stack} "
            f"{format_bytes(regime.whole_stack_peak_bytes)} ({verdict}).")


def short_answer(config: ModelConfig, formula: Sequence[FormulaRow], regimes: Sequence[Regime]) -> list[str]:
    """The answer to the user's question in a few lines: the formula's measured error, where the whole-stack
    group's saving comes from, the numbers of each vocabulary measured, and the pipeline effect.

    Args:
        config: the main run's model.
        formula: the formula checks of the ``full/uniform/K`` policies (may be empty).
        regimes: one per vocabulary measured (:meth:`Explanation.regimes`).

    Returns:
        A heading line, then one line per point (not wrapped).
    """
    out = [f"In short ({model_words(config).split(', vocab=')[0]}, {config.dtype}; measured, exact bytes):"]
    if formula:
        worst = max(formula, key=lambda f: abs(f.error))
        ks = ", ".join(f.policy.split("/")[2] for f in formula)
        out.append(f"Your formula holds: stored group inputs + one group's activations, to {100 * worst.error:+.2f}% "
                   f"(full/uniform/{ks}).")
    if any(r.whole_stack for r in regimes):
        out.append("The saving: without recompute the head/loss tensors (logits, their gradients) sit on the layers' "
                   "activations; a whole-stack group frees them before recomputing: peak max(head, stack), not "
                   "head + stack.")
    out += [_regime_line(r) for r in regimes]
    if regimes and not any(_saves(r) for r in regimes) and max(r.vocab_size for r in regimes) < 32000:
        out.append("A larger vocabulary (bigger logits) is where it saves: add --contrast-vocab 32000.")
    out.append("Pipelines add more: each microbatch in flight keeps only its group inputs (remat explain --pp 4).")
    return out


# ------------------------------------------------------------------------------------------------ detail
def host_memory_sentence(policy: str, tl: Timeline) -> str:
    """What fine-grained activation offloading kept in host memory (``meta['host_memory']``), or ''."""
    host = tl.meta.get("host_memory")
    if not host:
        return ""
    total = sum(host["offloaded_bytes"].values())
    parts = ", ".join(f"{m} {format_bytes(b)}" for m, b in host["offloaded_bytes"].items())
    return (f"{policy} copies {format_bytes(total)} of saved tensors to host memory in forward ({parts}), at most "
            f"{format_bytes(host['peak_bytes'])} at once; those bytes are not in its device peak, and backward copies "
            "each group back when it reaches it.")


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
    # Parts under 0.05 MiB would read as noise and explain nothing.
    parts = sorted(((v, k) for k, v in tl.at_peak.items() if v >= MIB / 20 and k != "parameters"),
                   reverse=True)[:3]
    listed = ", ".join(f"{CATEGORY_WORDS[k]} {format_bytes(v)}" for v, k in parts)
    return (f"{row.policy} peaks at {format_bytes(row.peak_bytes)} in '{row.peak_phase}', {why}: besides "
            f"{format_bytes(row.parameters_bytes)} of parameters, {listed}.")


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
        bits.append(f"{what} ({n} x {format_bytes(nbytes)})" if n > 1 else f"{what} ({format_bytes(nbytes)})")
    shape = f"{config.micro_batch_size}x{config.seq_length}x{config.vocab_size}"
    return f"{', '.join(bits)}, each b x s x vocab = {shape} values"


def _whole_stack_sentences(config: ModelConfig, whole: PolicyRow, plain_row: PolicyRow, plain: Timeline,
                           regime: Regime) -> list[str]:
    L = config.num_layers
    head_max, head_event = head_loss_max(plain)
    stack_acts = regime.stack_activation_bytes
    saving = plain_row.peak_bytes - whole.peak_bytes
    head_words = _describe_head(plain, head_event, config)
    out = [
        f"Without recompute all {L} layers' activations ({format_bytes(stack_acts)}) are still stored when the "
        f"loss's backward runs, so they add up with the head/loss part ({format_bytes(head_max)}: {head_words}); "
        f"the peak is {format_bytes(plain_row.peak_bytes)} in '{plain_row.peak_phase}'.",
        f"With one group over the whole stack ({whole.policy}) the forward keeps only the group's inputs "
        f"({format_bytes(whole.group_inputs_stored)}); the head/loss part is freed when the head's backward ends, "
        f"before the stack is recomputed ({format_bytes(whole.recompute_max_bytes)} of rebuilt activations at "
        "most), so the peak is about the larger of the two plus parameters and gradients instead of their sum: "
        f"{format_bytes(whole.peak_bytes)} in '{whole.peak_phase}'."]
    if _saves(regime):
        out.append(
            f"So here the whole-stack group saves memory: {format_bytes(saving)} "
            f"({_pct(saving, plain_row.peak_bytes)} of {format_bytes(plain_row.peak_bytes)}), because the head/loss "
            f"part - {head_words} - no longer sits on top of the stack's activations; the saving is bounded by the "
            f"smaller of the head/loss part ({format_bytes(head_max)}) and the stack's activations "
            f"({format_bytes(stack_acts)}).")
    else:
        out.append(
            f"So here the whole-stack group does not save memory ({format_bytes(saving)}, "
            f"{_pct(saving, plain_row.peak_bytes)} of {format_bytes(plain_row.peak_bytes)}): the head/loss part "
            f"({format_bytes(head_max)}: the logits are small with vocab={config.vocab_size}) is small next to the "
            f"stack's activations ({format_bytes(stack_acts)}), and recomputing the whole stack rebuilds all of them "
            "at once, so the larger of the two is the stack's activations, as without recompute. A larger "
            "vocabulary (bigger logits) is where it saves.")
    return out


def _contrast_sentence(contrast: Contrast) -> str:
    regime = contrast.regime
    rows = ", ".join(f"{r.policy} {format_bytes(r.peak_bytes)} in '{r.peak_phase}'" for r in contrast.rows)
    verdict = ""
    if regime.saving_bytes is not None:
        verdict = (f": the whole-stack group saves {format_bytes(regime.saving_bytes)} "
                   f"({_pct(regime.saving_bytes, regime.none_peak_bytes)})" if _saves(regime)
                   else ": the whole-stack group saves nothing here")
        best = min(contrast.rows, key=lambda r: r.peak_bytes)
        verdict += f", and the lowest peak is {best.policy}'s"
    return (f"The same model at vocab={contrast.config.vocab_size} (measured too, untimed) has a head/loss part of "
            f"{format_bytes(regime.head_loss_bytes)} beside {format_bytes(regime.stack_activation_bytes)} of layer "
            f"activations; peaks: {rows}{verdict}.")


def _formula_sentences(formula: Sequence[FormulaRow], rows: Sequence[PolicyRow],
                       timelines: dict[str, Timeline]) -> list[str]:
    checks = "; ".join(f"{f.policy}: predicted {format_bytes(f.predicted_bytes)}, measured "
                       f"{format_bytes(f.measured_bytes)} ({100 * f.error:+.2f}%)" for f in formula)
    out = ["The user's formula (peak of the recompute phase = all stored group inputs + one group's activations, "
           "the group's activations being the plain run's activations of its layers) holds at the end of the "
           f"first group's recomputation (the last group, recomputed first): {checks}."]
    worst = max(formula, key=lambda f: abs(f.error))
    if abs(worst.error) < 0.02:
        out.append("It counts activations only: the step's peak adds parameters, the parameter gradients accumulated "
                   "so far, backward temporaries and, where it is larger, the head/loss part; so a bigger group "
                   "trades stored inputs for a bigger working set, exactly as the user says.")
    else:
        out.append(f"The largest error, {100 * worst.error:+.2f}% for {worst.policy}, means the formula misses "
                   "part of the recomputation's working set for this model.")
    uniform = sorted((r for r in rows if r.policy.startswith("full/uniform/")),
                     key=lambda r: int(r.policy.split("/")[2].split(",")[0].split("@")[0]))
    if len(uniform) < 2:
        return out
    best = min(uniform, key=lambda r: r.peak_bytes)
    out.append(
        f"Across group sizes, stored group inputs go from {format_bytes(uniform[0].group_inputs_stored)} "
        f"({uniform[0].policy}) to {format_bytes(uniform[-1].group_inputs_stored)} ({uniform[-1].policy}) while the "
        f"largest recompute working set goes from {format_bytes(uniform[0].recompute_max_bytes)} to "
        f"{format_bytes(uniform[-1].recompute_max_bytes)}; the lowest peak is {best.policy} at "
        f"{format_bytes(best.peak_bytes)}.")
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
    return out


def _cost_sentences(rows: Sequence[PolicyRow]) -> list[str]:
    costly = [r for r in rows if r.recompute_flops or r.policy.startswith("selective")]
    if not costly:
        return []
    cost = "; ".join(
        f"{r.policy} {r.extra_forward_pct:.1f}%" + (f" (step {r.step_ratio:.2f}x)" if r.step_ratio else "")
        for r in costly)
    out = ["Recompute is paid in forward compute, as matmul FLOPs over the plain step's forward+backward"
           f" (and measured step time over none's, noisy on a shared CPU): {cost}."]
    if any(not r.recompute_flops for r in costly):
        out.append("Norms, softmax, dropout and activations count no FLOPs: recomputing them (selective "
                   "layernorm/act, or non_matmul, every operator but the matrix multiplies) costs memory traffic, "
                   "which shows in step time only.")
    return out


def explain_sentences(config: ModelConfig, policies: Sequence[Policy], rows: Sequence[PolicyRow],
                      formula: Sequence[FormulaRow], timelines: dict[str, Timeline],
                      regime: Regime | None = None, contrast: Contrast | None = None) -> list[str]:
    """Plain-words explanation of the measured numbers; ``policies[0]`` must be ``none``.

    Args:
        config, policies, rows, formula, timelines: the main run (:func:`remat.analysis.explain.explain`).
        regime: the main run's :class:`Regime` (computed from the rows when None).
        contrast: the run at another vocabulary, described in one more sentence when given.

    Returns:
        The sentences, in the order the report prints them (not wrapped).
    """
    by_name = {r.policy: r for r in rows}
    plain = timelines[rows[0].policy]
    if regime is None:
        regime = regime_of(config, policies, rows, timelines)
    out = [f"Model: {model_words(config)}, {config.attention} attention; one forward+backward step, bytes of every "
           "storage alive counted exactly."]
    out += [_peak_sentence(r, timelines[r.policy]) for r in rows]
    out += [line for r in rows if (line := host_memory_sentence(r.policy, timelines[r.policy]))]
    whole = whole_stack_policy(policies, config.num_layers)
    if whole is not None:
        out += _whole_stack_sentences(config, by_name[str(whole)], rows[0], plain, regime)
    if contrast is not None:
        out.append(_contrast_sentence(contrast))
    if formula:
        out += _formula_sentences(formula, rows, timelines)
    out += _cost_sentences(rows)
    out.append(
        "The second reason bigger groups help (measured by remat explain --pp P): with pipeline parallelism (1F1B) "
        "stage r holds up to p - r microbatches in flight, each keeping its stored group inputs, but recomputes "
        "only one group of one microbatch at a time, so fewer, larger groups shrink the part that is multiplied by "
        "the microbatches in flight while the working set is paid once.")
    return out

