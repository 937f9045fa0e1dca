"""A Megatron-LM job as users give it: a launch line (pasted, or read from a launch script), remat's ``--world-size``,
and ``--allow-unmodelled`` for the flags remat cannot model yet.

:func:`read_megatron_job` wraps :func:`remat.job.parse_megatron_args`:

* ``world_size`` replaces the world size the launch line or the flags give (scripts often take the node count from
  the scheduler); when nothing gives it, the job has one data-parallel rank, and the answer says which world size
  was assumed and how to give it (:attr:`MegatronJob.world_size_note`);
* every refusal is listed at once; when the flags remat cannot model are not the only problem, Megatron's own
  refusal of the rest is listed with them (``--pipeline-model-parallel-size 8`` over 12 layers, ...);
* ``allow_unmodelled`` names refused flags (or ``fnmatch`` patterns: ``--fp8-*``) to price the job without: the
  answer is then a lower bound, and :func:`stamp_text` / :func:`stamp_report` stamp every line and row of it, naming
  what is missing. Only flags refused because remat does not model them may be left out (not Megatron's own
  refusals, not a flag the job does not hold), and not those that save memory (:data:`SAVES_MEMORY`): without them
  the answer would overstate the job, not bound it from below.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from remat.job import Job, parse_megatron_args
from remat.job_flags import (
    DEFAULT_ONLY_FLAGS,
    JobError,
    classify_megatron_flag,
    flag_groups,
    launch_tokens,
    shown_flag,
)
from remat.job_launch import launcher_world_size


def _table(groups: dict[str, str]) -> dict[str, str]:
    return {flag: reason for reason, flags in groups.items() for flag in flags.split()}


# Refused flags that save (or may save) memory, or describe another model: priced without them, the answer would
# not be a lower bound of the job's memory, so --allow-unmodelled refuses them.
SAVES_MEMORY: dict[str, str] = _table({
    "offloads activations or optimizer state to host memory (the device holds less)":
        "--cpu-offloading --activation-offload-fraction --delta-offload-bytes-across-pp-ranks --optimizer-cpu-offload "
        "--optimizer-offload-fraction --use-torch-optimizer-for-cpu-offload --overlap-cpu-optimizer-d2h-h2d",
    "keeps optimizer state, main gradients or main parameters in lower precision":
        "--use-precision-aware-optimizer --main-grads-dtype --main-params-dtype --exp-avg-dtype --exp-avg-sq-dtype "
        "--megatron-fsdp-main-params-dtype",
    "chooses an optimizer whose state may be smaller than Adam's (remat's default without the flag)":
        "--optimizer --muon-scalar-optimizer",
    "keeps the logits in lower precision": "--fp16-lm-cross-entropy --output-logit-dtype",
    # TE saves 1-byte quantised inputs (and their transposes) where bf16 saves 2 bytes, and adds FP8 weight copies:
    # priced in bf16, the answer may be above the job's memory as well as below it
    "trains in FP8/FP4, whose quantised saved activations can be smaller than the bf16 ones remat would price":
        "--fp8-format --fp8-recipe --fp8-param-gather --fp4-format --fp4-recipe --fp4-param-gather "
        "--first-last-layers-bf16 --reuse-grad-buf-for-mxfp8-param-ag --te-precision-config-file",
    # TE graph.py:866 / CUDAGraph replays: the graphed layers' saved tensors live in the graphs' private pool, which a
    # replay reuses without allocating (remat.parallel.cuda_graphs): a steady step holds less than the eager one
    "runs layers as CUDA graphs, whose replays allocate nothing (the eager step remat would price may hold more)":
        "--enable-cuda-graph --external-cuda-graph --cuda-graph-scope --optimizer-cuda-graph",
    "replaces the learned position embedding (Megatron's default, which remat would price without the flag)":
        "--position-embedding-type",
    # without it remat prices Megatron's default allgather dispatcher, which gathers the tokens of every
    # expert-parallel rank (token_dispatcher.py MoEAllGatherTokenDispatcher): more than flex's exchange may keep
    "replaces the token dispatcher (the allgather dispatcher remat would price without it may keep more)":
        "--moe-token-dispatcher-type --moe-flex-dispatcher-backend",
    "splits or shards what a rank holds further": "--mlp-chunks-for-training --tensor-parallel-num-weight-shards "
        "--moe-extended-tp --decrease-batch-size-if-needed",
    "describes another model (remat's GPT would not bound it)": "--hybrid-layer-pattern --hybrid-override-pattern "
        "--is-hybrid-model --spec --heterogeneous-layers-config-path --heterogeneous-layers-config-encoded-json "
        "--encoder-num-layers --decoder-num-layers --encoder-seq-length --decoder-seq-length "
        "--experimental-attention-variant",
    "takes the model or batch from elsewhere (give the flags themselves)":
        "--yaml-cfg --use-checkpoint-args --use-mp-args-from-checkpoint-args",
    "is an old name of a modelled flag (use --tensor-model-parallel-size / --micro-batch-size)":
        "--model-parallel-size --batch-size",
})
SAVES_MEMORY_PREFIXES = {**{p: SAVES_MEMORY["--spec"] for p in ("--mamba-", "--mhc-", "--dsa-")},
                         **{p: SAVES_MEMORY["--fp8-format"] for p in ("--fp8-", "--fp4-")}}
LOWER_BOUND_TAG = "[lower bound] "
"""The stamp on every text line of an answer priced without some refused flags."""


def unmodelled_flags(groups: Sequence[tuple[str, list[str]]]) -> dict[str, str]:
    """The flags of ``groups`` (:func:`remat.job_flags.flag_groups`) refused because remat does not model them:
    refused, unknown, default-only with another value, or a modelled flag's unmodelled choice; each with why."""
    out: dict[str, str] = {}
    for name, vals in groups:
        kind, reason = classify_megatron_flag(name, vals)
        if kind in ("refused", "unknown") or (kind == "default-only" and vals != [DEFAULT_ONLY_FLAGS[name]]):
            out.setdefault(name, "not classified" if kind == "unknown" else reason)
    return out


def _saves_memory(flag: str, groups: Sequence[tuple[str, list[str]]] = ()) -> str | None:
    """Why leaving ``flag`` out would overstate the job, or None."""
    return SAVES_MEMORY.get(flag) or next((r for p, r in SAVES_MEMORY_PREFIXES.items() if flag.startswith(p)), None)


def _allowed(patterns: Sequence[str], refused: dict[str, str], groups: Sequence[tuple[str, list[str]]]) -> list[str]:
    """The job's flags ``patterns`` name, each checked: refused for being unmodelled, and not saving memory."""
    allowed: list[str] = []
    present = [name.partition("=")[0] for name, _ in groups]
    for raw in patterns:
        pattern = raw.strip()
        if not pattern:
            continue
        pattern = pattern if pattern.startswith("-") else "--" + pattern
        names = [n for n in dict.fromkeys(present) if fnmatch.fnmatchcase(n, pattern)]
        if not names:
            have = ", ".join(map(shown_flag, refused)) or "none"
            raise JobError(f"--allow-unmodelled {shown_flag(pattern)}: the job has no such flag (the flags it holds "
                           f"that remat cannot model: {have})")
        for name in names:
            if name not in refused:
                if "*" in pattern or "?" in pattern:
                    continue  # a pattern leaves out only the refused flags it matches
                kind, shown = classify_megatron_flag(name)[0], shown_flag(name)
                raise JobError(f"--allow-unmodelled {shown}: remat does not refuse {shown} for being unmodelled (it "
                               f"is {kind}); only refused flags may be left out: drop it from --allow-unmodelled")
            why = _saves_memory(name, groups)
            if why:
                raise JobError(f"--allow-unmodelled {name}: {name} {why}, so the job priced without it could "
                               "overstate its memory, not bound it from below: it cannot be left out")
            allowed.append(name)
        if not any(n in refused for n in names):
            raise JobError(f"--allow-unmodelled {shown_flag(pattern)}: it matches none of the flags remat refuses "
                           f"({', '.join(map(shown_flag, refused)) or 'none'})")
    return list(dict.fromkeys(allowed))


@dataclass(frozen=True)
class MegatronJob:
    """A job read from Megatron-LM's command line, with how its world size was set and what it leaves out."""

    job: Job
    ignored: list[str]
    """Flags accepted that do not change memory (and the launcher's command)."""
    unmodelled: tuple[str, ...] = ()
    """Refused flags priced without (``--allow-unmodelled``): when any, the answer is a lower bound."""
    world_size_source: str = "flags"
    """``launcher``, ``flags`` (``--world-size``/``--data-parallel-size`` among them), ``override`` (remat's
    ``--world-size``) or ``assumed`` (nothing gives it: one data-parallel rank)."""
    world_size_note: str | None = None
    """The line the answer starts with when the world size was assumed or overridden."""

    def lines(self) -> list[str]:
        """The answer's first lines about the input: the world size (when assumed or overridden), what is left
        out (when the answer is a lower bound)."""
        out = [self.world_size_note] if self.world_size_note else []
        if self.unmodelled:
            out.append(lower_bound_line(self.unmodelled))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"world_size": self.job.world_size, "world_size_source": self.world_size_source,
                "world_size_note": self.world_size_note, "unmodelled_flags": list(self.unmodelled)}


def read_megatron_job(argv: Sequence[str] | str, *, world_size: int | None = None,
                      allow_unmodelled: Sequence[str] = ()) -> MegatronJob:
    """The job a Megatron-LM command line (or whole launch line) describes, as :func:`parse_megatron_args` reads it,
    with remat's world size and the refused flags it may leave out.

    Args:
        argv: the flags, or a whole launch line (``torchrun --nproc_per_node 8 pretrain_gpt.py ...``), as tokens or
            one string; ``@file`` tokens are read.
        world_size: the number of ranks, replacing what the launch line and the flags say (None: theirs).
        allow_unmodelled: refused flags (or ``fnmatch`` patterns such as ``--fp8-*``) to price the job without.

    Returns:
        The :class:`MegatronJob`. Raises :class:`JobError` listing every flag that stops the prediction (with
        Megatron's own refusal of the rest, if any), or naming an ``allow_unmodelled`` entry that cannot be left out.

    Example:
        >>> read_megatron_job("torchrun --nproc_per_node 8 pretrain_gpt.py --num-layers 2 --hidden-size 64 "
        ...     "--num-attention-heads 4 --seq-length 128 --micro-batch-size 1 --fp8-format hybrid",
        ...     allow_unmodelled=["--fp8-format"]).unmodelled
        ('--fp8-format',)
    """
    if world_size is not None and (not isinstance(world_size, int) or isinstance(world_size, bool)
                                   or world_size < 1):
        raise JobError(f"--world-size {world_size!r}: give the number of ranks, a positive integer")
    launch, flags = launch_tokens(argv)
    groups = flag_groups(flags)
    refused = unmodelled_flags(groups)
    allowed = _allowed(allow_unmodelled, refused, groups)
    kept = [(n, v) for n, v in groups if n.partition("=")[0] not in allowed]
    in_flags = any(n.partition("=")[0] in ("--world-size", "--data-parallel-size") for n, _ in kept)
    from_launcher = launcher_world_size(launch) if launch else None
    if world_size is not None:
        kept = [(n, v) for n, v in kept if n.partition("=")[0] not in ("--world-size", "--data-parallel-size")]
        kept.append(("--world-size", [str(world_size)]))
    tokens = [*launch, *(t for name, vals in kept for t in (name, *vals))]
    try:
        job, ignored = parse_megatron_args(tokens)
    except JobError as err:
        raise JobError(_with_the_rest(str(err), launch, kept, [n for n in refused if n not in allowed])) from None
    source, note = "flags", None
    if world_size is not None:
        source = "override"
        given = from_launcher if from_launcher is not None and not in_flags else None
        note = (f"world size {world_size} (--world-size" + (f"; the launch line gives {given}" if given else "")
                + ")") if given != world_size else None
    elif not in_flags and from_launcher is not None:
        source = "launcher"
    elif not in_flags:
        source = "assumed"
        note = (f"world size {job.world_size} assumed (tp x pp x cp: one data-parallel rank): the "
                f"{'launch line' if launch else 'command line'} does not give it; give it with --world-size N")
    return MegatronJob(job, ignored, tuple(allowed), source, note)


def _with_the_rest(message: str, launch: list[str], kept: list[tuple[str, list[str]]], refused: list[str]) -> str:
    """``message`` (the refusal of ``refused``) with the fix and Megatron's own refusal of the rest, if any."""
    if not refused or not all(name in message for name in refused):
        return message  # another error than the refusal of these flags
    allowable = [n for n in refused if not _saves_memory(n, kept)]
    if allowable:
        message += (f"; or price the job without {'them' if len(allowable) > 1 else 'it'} as a lower bound: "
                    f"--allow-unmodelled {','.join(allowable)}")
    rest = [t for name, vals in kept if name.partition("=")[0] not in refused for t in (name, *vals)]
    try:
        parse_megatron_args([*launch, *rest])
    except ValueError as err:  # JobError, ConfigError, PolicyError: Megatron's (or remat's) refusal of the rest
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        message += f"; and without {'them' if len(refused) > 1 else 'it'}, the job is still refused: {first}"
    return message


# ------------------------------------------------------------------------------------------------ lower bounds
def lower_bound_line(unmodelled: Sequence[str]) -> str:
    """The line that says an answer is a lower bound, naming what it leaves out."""
    names, them = ", ".join(map(shown_flag, unmodelled)), "them" if len(unmodelled) > 1 else "it"
    return (f"LOWER BOUND: priced without {names} (--allow-unmodelled; remat cannot model {them} yet): every figure "
            f"below leaves out what {'they add' if len(unmodelled) > 1 else 'it adds'}, so the job holds at least "
            "this much")


_VERDICTS = ((re.compile(r"^(\s*)fits "), r"\1the lower bound fits (the job may not: what the unmodelled flags add "
              r"is not counted) "),
             (re.compile(r"^(\s*)does not fit "), r"\1does not fit (even its lower bound) "))


def stamp_text(text: str, unmodelled: Sequence[str]) -> str:
    """Every line of ``text`` stamped as a lower bound (:data:`LOWER_BOUND_TAG`); a fits/does-not-fit verdict says
    it is of the lower bound. Unchanged when nothing was left out."""
    if not unmodelled:
        return text
    out = []
    for line in text.split("\n"):
        for pattern, repl in _VERDICTS:
            line = pattern.sub(repl, line, count=1)
        out.append(LOWER_BOUND_TAG + line if line.strip() else line)
    return "\n".join(out)


def stamp_report(report: dict[str, Any], unmodelled: Sequence[str]) -> dict[str, Any]:
    """``report`` (a JSON report) stamped as a lower bound: a top-level ``lower_bound`` naming what is left out,
    ``"lower_bound": true`` in every row of its lists, and every ``fits`` renamed ``fits_lower_bound`` (a lower bound
    that fits does not say the job fits). Unchanged when nothing was left out."""
    if not unmodelled:
        return report

    def renamed(value: Any) -> Any:
        if isinstance(value, dict):
            return {("fits_lower_bound" if k == "fits" else k): renamed(v) for k, v in value.items()}
        return [renamed(v) for v in value] if isinstance(value, list) else value

    stamped = renamed(report)
    for key, value in stamped.items():
        if isinstance(value, list):
            stamped[key] = [{**row, "lower_bound": True} if isinstance(row, dict) else row for row in value]
    return {"lower_bound": {"unmodelled_flags": list(unmodelled), "note": lower_bound_line(unmodelled)}, **stamped}


def routing_line(job: Job) -> str | None:
    """What an answer says of an MoE job's routing, which sets the tokens each expert receives: balanced unless
    ``moe_routing_assumption`` says otherwise. Megatron's routing follows the data (dropless: without bound; with a
    capacity factor, up to that factor times an expert's share), so a balanced answer names the setting that prices
    a skew. None for a dense job, or one whose experts are padded to their capacity (routing-independent)."""
    m = job.model
    if not m.is_moe or m.moe_pad_expert_input_to_capacity:
        return None
    # DeepEP receives each token once per destination rank, which the counts per expert do not set
    deepep = ("; DeepEP's received tokens priced at the most those counts allow (every copy a token of its own from "
              "each source rank: an upper bound)" if m.moe_token_dispatcher_type == "flex" and
              m.moe_flex_dispatcher_backend == "deepep" else "")
    if m.moe_routing_assumption is not None:
        return f"MoE routing: {m.moe_routing_assumption} (as given: --moe-routing, or moe_routing_assumption){deepep}"
    factor = m.moe_expert_capacity_factor
    bound = (f"up to {factor:g} times its share (--moe-expert-capacity-factor drops the rest)" if factor else
             "without bound (dropless)")
    return ("MoE routing: balanced assumed (each expert receives its share of the routed tokens); Megatron routes "
            f"by the data, and an expert may receive more, {bound}: --moe-routing capacity:F prices every expert at "
            f"F times its share{deepep}")
