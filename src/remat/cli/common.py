"""Flags and helpers that every remat subcommand shares."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import re
import sys
import textwrap
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

from remat.analysis.explain import resolve_policies
from remat.analysis.outputs import path_problem
from remat.analysis.report import write_json
from remat.config import (
    ACTIVATIONS,
    ATTENTIONS,
    DTYPES,
    NORMALIZATIONS,
    POSITIONS,
    ConfigError,
    ModelConfig,
    RoutingAssumption,
)
from remat.limits import ceiling_problem
from remat.parallel.launch import DEFAULT_TIMEOUT
from remat.parallel.schedule import RUNTIMES, SCHEDULES, PipelineError, check_schedule, partition
from remat.plan.fine_offload import OFFLOAD_SWEEP_DESCRIPTION, offload_sweep
from remat.plan.megatron import SWEEP_DESCRIPTION, SWEEPS, megatron_sweep
from remat.policy import ENGINES, GRAMMAR, Policy, PolicyError
from remat.presets import get_preset, load_config, preset_names
from remat.recompute.region import ApplyError
from remat.timeline import TimelineError
from remat.units import ascii_float, ascii_int

# Exceptions that mean "the input is wrong", not "remat is broken": one line, exit code 2.
USER_ERRORS = (ConfigError, PolicyError, ApplyError, TimelineError, ValueError, OSError)  # OSError: unwritable --out
USAGE_ERROR = 2
Runner = Callable[[argparse.Namespace], int]
Subparsers = Any  # argparse's _SubParsersAction is private


class Parser(argparse.ArgumentParser):
    """argparse, but usage errors are the same one line as remat's own errors, and a value that starts with a
    minus sign is the value of the flag before it (``--budget -1GiB``: argparse would take ``-1GiB`` for an
    option and say ``--budget`` expects an argument, instead of the flag's own error)."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"remat: error: {message} (see '{self.prog} --help')\n")

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        return super().parse_known_args(negative_values_joined(sys.argv[1:] if args is None else args), namespace)


def negative_values_joined(argv: Sequence[str]) -> list[str]:
    """``['--budget', '-1GiB']`` -> ``['--budget=-1GiB']``: a token that starts with ``-`` and a digit or a point
    (no remat option does) after a ``--flag`` without ``=``; everything else as given."""
    out: list[str] = []
    for token in argv:
        previous = out[-1] if out else ""
        if re.match(r"-\.?[0-9]", token) and previous.startswith("--") and "=" not in previous and previous != "--":
            out[-1] = f"{previous}={token}"
        else:
            out.append(token)
    return out


# ------------------------------------------------------------------------------------------------ number flags
# argparse types: a bad value is a usage error that names the flag ("argument --pp: must be a positive integer").
# Numbers are written with the digits 0-9 (NOTE [ASCII digits] in remat.units), as in policies and budgets.
def _number_type(kind: type, accept: Callable[[Any], bool], requirement: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = ascii_int(text.strip()) if kind is int else ascii_float(text.strip())
        if value is None:
            shown = repr(text) if len(text) <= 40 else repr(text[:37]) + "..."
            raise argparse.ArgumentTypeError(f"{shown} is not {'an integer' if kind is int else 'a number'} "
                                             f"written with the digits 0-9: give {requirement}")
        if not accept(value):
            raise argparse.ArgumentTypeError(f"must be {requirement}, got {text!r}")
        return value

    return parse


positive_int = _number_type(int, lambda v: v >= 1, "a positive integer")
non_negative_int = _number_type(int, lambda v: v >= 0, "an integer >= 0")
positive_seconds = _number_type(float, lambda v: math.isfinite(v) and v > 0, "a positive number of seconds")
non_negative_number = _number_type(float, lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0")
probability = _number_type(float, lambda v: 0 <= v < 1, "a probability in [0, 1)")
integer = _number_type(int, lambda v: True, "an integer")
positive_number = _number_type(float, lambda v: math.isfinite(v) and v > 0, "a positive finite number")
count_or_all = _number_type(int, lambda v: v >= -1, "a count >= 0, or -1 for all")


def sized(name: str, base: Callable[[str], int] = positive_int) -> Callable[[str], int]:
    """An argparse type for a flag that sets the size ``name`` (a key of :data:`remat.limits.CEILINGS`): ``base``'s
    integer, refused above remat's ceiling for that size as the flag is read, before any work."""

    def parse(text: str) -> int:
        value = base(text)
        problem = ceiling_problem(name, value)
        if problem:
            raise argparse.ArgumentTypeError(f"{value} {problem}")
        return value

    return parse


# ------------------------------------------------------------------------------------------------ shared flags
def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the reference GPT; an unset flag keeps :class:`ModelConfig`'s default."""
    d = ModelConfig()
    g = parser.add_argument_group("model (the reference GPT; defaults are a small 8-layer model)")
    g.add_argument("--layers", type=sized("num_layers"), metavar="L",
                   help=f"transformer layers (default {d.num_layers})")
    g.add_argument("--hidden", type=sized("hidden_size"), metavar="H", help=f"hidden size (default {d.hidden_size})")
    g.add_argument("--heads", type=sized("num_attention_heads"), metavar="A",
                   help=f"attention heads (default {d.num_attention_heads})")
    g.add_argument("--query-groups", type=sized("num_query_groups"), metavar="G",
                   help="key/value groups (GQA; default: one per head)")
    g.add_argument("--ffn", type=sized("ffn_hidden_size"), metavar="F", help="MLP hidden size (default 4H for gelu)")
    g.add_argument("--seq", type=sized("seq_length"), metavar="S", help=f"sequence length (default {d.seq_length})")
    g.add_argument("--batch", type=sized("micro_batch_size"), metavar="B",
                   help=f"micro-batch size (default {d.micro_batch_size})")
    g.add_argument("--vocab", type=sized("vocab_size"), metavar="V", help=f"vocabulary size (default {d.vocab_size})")
    g.add_argument("--activation", choices=ACTIVATIONS, help=f"MLP activation (default {d.activation})")
    g.add_argument("--normalization", choices=NORMALIZATIONS, help=f"default {d.normalization}")
    g.add_argument("--position", choices=POSITIONS, help=f"position embedding (default {d.position})")
    g.add_argument("--attention", choices=ATTENTIONS,
                   help=f"math materialises the s x s scores, sdpa uses fused kernels (default {d.attention})")
    g.add_argument("--dtype", choices=tuple(DTYPES), help=f"parameter/activation dtype (default {d.dtype})")
    g.add_argument("--dropout", type=probability, metavar="P",
                   help=f"hidden and attention dropout (default {d.hidden_dropout})")
    g.add_argument("--moe-routing", type=routing_assumption, metavar="ROUTING",
                   help="MoE models: the routing a prediction assumes, which sets each expert's routed tokens: "
                        "balanced (default), capacity:<factor> (every expert full: the worst case), or "
                        "counts:<c0>,<c1>,...[;<next MoE layer>...] (tokens per expert, e.g. a run's own)")


_MODEL_FLAGS = {
    "layers": "num_layers", "hidden": "hidden_size", "heads": "num_attention_heads",
    "query_groups": "num_query_groups", "ffn": "ffn_hidden_size", "seq": "seq_length",
    "batch": "micro_batch_size", "vocab": "vocab_size", "activation": "activation",
    "normalization": "normalization", "position": "position", "attention": "attention", "dtype": "dtype",
    "moe_routing": "moe_routing_assumption",
}


def routing_assumption(text: str) -> str:
    """``--moe-routing``'s value, checked (:class:`remat.config.RoutingAssumption`)."""
    try:
        RoutingAssumption.parse(text)
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err).replace("moe_routing_assumption=", "--moe-routing ")) from None
    return text


def _model_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`ModelConfig` fields the model flags set (those given)."""
    fields = {name: getattr(args, flag) for flag, name in _MODEL_FLAGS.items() if getattr(args, flag) is not None}
    if args.dropout is not None:
        fields.update(hidden_dropout=args.dropout, attention_dropout=args.dropout)
    return fields


def model_config_from_args(args: argparse.Namespace) -> ModelConfig:
    """The :class:`ModelConfig` the model flags ask for (ConfigError names the bad field)."""
    return ModelConfig(**_model_fields(args))


def add_measure_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of how a step is run: recompute engine and device."""
    g = parser.add_argument_group("measurement")
    g.add_argument("--engine", choices=ENGINES,
                   help="checkpoint implementation for policies without '@engine' (default reentrant, Megatron's)")
    g.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: exact storage bytes; cuda: allocator blocks (default cpu)")


def parse_policy_list(text: str | None) -> list[str] | None:
    """``'none, full/uniform/2'`` -> ``['none', 'full/uniform/2']``; None stays None (the default list).

    Commas inside a policy (``full/uniform/2,distribute``, ``selective,offload:core_attn+attn_proj,offload_min:0``)
    are kept: a piece that is only an option is joined to the policy before it.
    """
    if text is None:
        return None
    pieces = [p.strip() for p in text.split(",")]
    out: list[str] = []
    for piece in pieces:
        if not piece:
            continue
        if re.fullmatch(r"(distribute|offload\s*:[\w+\s]*|(offload_min|cpu_offload)\s*:[\s\w]*)(\s*@[\w-]+)?",
                        piece) and out:
            out[-1] += "," + piece
        else:
            out.append(piece)
    if not out:
        raise PolicyError(f"--policies {text!r} names no policy: give e.g. none,full/uniform/1")
    return out


class ProgressBar:
    """A tqdm bar on stderr over the policies being measured (silent when stderr is not a terminal)."""

    def __init__(self, description: str):
        from tqdm import tqdm

        self._tqdm = tqdm
        self.description = description
        self.bar: Any = None

    def __call__(self, index: int, total: int, policy: str) -> None:
        if self.bar is None:
            self.bar = self._tqdm(total=total, desc=self.description, unit="policy", file=sys.stderr,
                                  disable=None, leave=False)
        self.bar.n = index
        self.bar.set_postfix_str(policy, refresh=False)
        self.bar.refresh()
        if index >= total:
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def info(message: str) -> None:
    print(message, file=sys.stderr)


def file_name(policy: str) -> str:
    """A file-name-safe form of a policy: ``full/uniform/2@non-reentrant`` -> ``full-uniform-2-non-reentrant``."""
    return re.sub(r"[^A-Za-z0-9_+.-]+", "-", policy).strip("-")


def json_text(obj: Any) -> str:
    import json

    return json.dumps(obj, indent=2)


# ------------------------------------------------------------------------------------------------ predict / compare
# Shared by predict and compare: where the model comes from, which policies, tensor/sequence parallelism.


def add_model_source_arguments(parser: argparse.ArgumentParser) -> None:
    """``--preset NAME`` | ``--config FILE``, then the model flags, which override single fields of either."""

    g = parser.add_argument_group("model source", textwrap.fill(
        "a preset or a YAML/JSON file (ModelConfig field names, optionally 'preset: NAME'); the model flags below "
        "override single fields of either", width=76))
    source = g.add_mutually_exclusive_group()
    source.add_argument("--preset", choices=preset_names(), metavar="NAME",
                        help=f"a named model: {', '.join(preset_names())}")
    source.add_argument("--config", type=Path, metavar="FILE", help="a YAML or JSON model config file")
    add_model_arguments(parser)


def resolve_model_config(args: argparse.Namespace) -> ModelConfig:
    """The :class:`ModelConfig` of ``--preset``/``--config`` (else the default) with the model flags applied."""

    if getattr(args, "preset", None):
        base = get_preset(args.preset)
    elif getattr(args, "config", None) is not None:
        base = load_config(args.config)
    else:
        base = ModelConfig()
    fields = _model_fields(args)
    return base.replace(**fields) if fields else base


def add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    """Tensor/sequence-parallel flags (:mod:`remat.models.tensor_parallel`) and the pipeline flags
    (:mod:`remat.parallel`)."""
    g = parser.add_argument_group("tensor parallelism")
    g.add_argument("--tp", type=sized("tp"), default=1, metavar="T",
                   help="tensor-parallel size: predict one rank (Megatron's sharding of heads, MLP and vocabulary)")
    g.add_argument("--sp", action="store_true",
                   help="sequence parallelism: norms, dropouts and residuals hold 1/tp of the tokens")

    add_pipeline_arguments(parser)


def parallel_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``tp``/``sp`` as passed to ``predict_config``, ``predict_many`` and ``formulas.explain_differences``
    (empty for one unsharded rank)."""
    if args.tp == 1 and not args.sp:
        return {}
    if getattr(args, "adam", False):
        raise ValueError("--adam with --tp/--sp: Adam states are traced on one unsharded process only; drop one")
    return {"tp": args.tp, "sp": args.sp}


def add_policy_arguments(parser: argparse.ArgumentParser) -> None:
    """``--policy`` (repeatable, comma lists) and ``--sweep``."""
    g = parser.add_argument_group("policies (none is always included, first, as the baseline)")
    g.add_argument("--policy", action="append", metavar="P",
                   help="a recompute policy, e.g. full/uniform/2 or selective/core_attn+mlp; repeat it or give a "
                        "comma-separated list (default: none, full/uniform/K for K = 1, 2, 4, ... and L, "
                        "full/block/L/4 and L/2, selective/core_attn, selective/core_attn+mlp)")
    g.add_argument("--sweep", choices=SWEEPS,
                   help=f"megatron: {SWEEP_DESCRIPTION}; megatron-offload: the same plus Megatron's fine-grained "
                        f"activation offloading, {OFFLOAD_SWEEP_DESCRIPTION}; added to any --policy")


def resolve_cli_policies(args: argparse.Namespace, num_layers: int, config: ModelConfig | None = None) -> list[Any]:
    """The :class:`Policy` list of ``--policy``/``--sweep`` (``--engine`` applied), ``none`` first; ``config``:
    the model, whose MoE/MLA modules ``--sweep megatron`` lists too."""

    items: list[str] | None = None
    if args.policy:
        items = []
        for text in args.policy:
            items.extend(parse_policy_list(text) or [])
    if args.sweep in ("megatron", "megatron-offload"):
        items = (items or []) + megatron_sweep(num_layers, config=config)
    if args.sweep == "megatron-offload":  # fine-grained offloading variants (remat.plan.fine_offload)
        items = (items or []) + offload_sweep(num_layers)
    return resolve_policies(items, num_layers, args.engine)


@contextlib.contextmanager
def writing(flag: str, path: Any) -> Iterator[None]:
    """Around the writing of ``path``, given as ``flag``: an OSError becomes a one-line error naming the flag."""
    try:
        yield
    except OSError as err:
        raise ValueError(f"{flag} {path}: cannot write ({err.strerror or err})") from None


def write_out(path: Path, obj: Any) -> Path:
    """``--out FILE``: ``obj`` as JSON, atomically; an unwritable path is an error naming ``--out``."""
    with writing("--out", path):
        return write_json(path, obj)


def emit_report(args: argparse.Namespace, report: Any, print_text: Callable[[], None]) -> None:
    """The end of every report-printing command: ``--out FILE`` gets the JSON (atomically), then ``--json`` prints
    it, else ``print_text()`` prints the text; a written file is said last, on stderr."""
    out = getattr(args, "out", None)
    if out is not None:
        write_out(out, report)
    if args.json:
        print(json_text(report))
    else:
        print_text()
    if out is not None:
        info(f"wrote {out}")


def max_error_status(args: argparse.Namespace, rows: Sequence[dict[str, Any]], what: str = "a peak") -> int:
    """The exit status of ``remat compare``: 1 when ``--max-error`` is given and some row's ``|error|`` exceeds it
    (saying so on stderr, naming ``what`` exceeded it), else 0."""
    limit = getattr(args, "max_error", None)
    if limit is not None and any(abs(r["error"]) > limit for r in rows):
        info(f"remat compare: {what} error exceeds --max-error {limit}")
        return 1
    return 0


def check_writable(args: argparse.Namespace, *, files: Sequence[str] = (), folders: Sequence[str] = ()) -> None:
    """Refuse, naming the flag, an output path that cannot be written, before anything runs.

    Args:
        args: the parsed command line.
        files: the flags (as argparse names: ``'out'`` for ``--out``) whose value is a file; unset ones are skipped.
        folders: the flags whose value is a folder (:func:`remat.analysis.outputs.path_problem` with
            ``folder=True``).
    """
    for names, folder in ((files, False), (folders, True)):
        for name in names:
            path = getattr(args, name, None)
            problem = None if path is None else path_problem(path, folder=folder)
            if problem is not None:
                raise ValueError(f"{_flag(name)} {path}: {problem}")


def size_flags_given(args: argparse.Namespace) -> str:
    """The flags given that size a run (model sizes, pipeline stages, microbatches), as written: what a refusal of a
    run too large for this machine names (``'--layers 8 --hidden 2048 --pp 2'``)."""
    names = ("layers", "hidden", "heads", "ffn", "seq", "batch", "vocab", "pp", "vpp", "microbatches")
    return " ".join(f"--{name} {getattr(args, name)}" for name in names if getattr(args, name, None) is not None)


def model_summary(config: ModelConfig) -> str:
    gqa = f", {config.query_groups} kv groups" if config.query_groups != config.num_attention_heads else ""
    return (f"{config.num_layers} layers, h={config.hidden_size}, {config.num_attention_heads} heads{gqa}, "
            f"ffn={config.ffn_size}, s={config.seq_length}, b={config.micro_batch_size}, vocab={config.vocab_size}, "
            f"{config.activation}/{config.normalization}/{config.position}/{config.attention}, {config.dtype}")


# ------------------------------------------------------------------------------------------------ main
def add_debug(parser: argparse.ArgumentParser, default: Any) -> None:
    # On the main parser and on each subcommand, so --debug works before or after the subcommand; the
    # subcommands' default is SUPPRESS so they do not reset a --debug given before them.
    parser.add_argument("--debug", action="store_true", default=default,
                        help="print the full traceback of an error instead of one line")


def add_subcommand(sub: Subparsers, name: str, *, help: str, description: str,
                   epilog: str | None = None) -> argparse.ArgumentParser:
    """A subcommand's parser: its help line, its description wrapped at 78 columns, an optional epilog kept as
    written, and --debug."""
    parser = sub.add_parser(name, help=help, description=textwrap.fill(description, width=78, break_on_hyphens=False),
                            epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_debug(parser, argparse.SUPPRESS)
    return parser


POLICY_LIST_EPILOG = "policy syntax (--policy takes one policy or a comma-separated list):\n" + GRAMMAR


# ------------------------------------------------------------------------------------------------ flags
def _layout(text: str) -> list[int]:
    pieces = [p for p in re.split(r"[,\s]+", text.strip()) if p]
    counts = [n for p in pieces if (n := ascii_int(p)) is not None]
    if len(counts) != len(pieces):
        raise argparse.ArgumentTypeError(f"{text!r}: give layer counts per model chunk, e.g. 3,5")
    if not counts:
        raise argparse.ArgumentTypeError("is empty: give layer counts per model chunk, e.g. 3,5")
    if min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every model chunk needs at least one layer, e.g. 3,5")
    return counts


# Pipeline flags default to None so that a flag given without a pipeline (--pp) can be told from its default.
PIPELINE_DEFAULTS = {"pp": 1, "schedule": "1f1b", "vpp": 1, "pipeline_runtime": "torch", "timeout": DEFAULT_TIMEOUT}
PIPELINE_FLAGS = ("microbatches", "schedule", "vpp", "layout", "partial_checkpoint_microbatches",
                  "pipeline_runtime", "timeout")


def add_pipeline_arguments(parser: argparse.ArgumentParser, *, pp_optional: bool = False) -> None:
    """Add the pipeline-parallel flags. ``--pp`` defaults to None (no pipeline: the caller's own path);
    ``pp_optional``: the other pipeline flags are valid without ``--pp`` (which then means one stage)."""
    g = parser.add_argument_group("pipeline parallelism")
    g.add_argument("--pp", type=sized("pp"), metavar="P",
                   help="pipeline stages (Megatron's --pipeline-model-parallel-size); per-stage memory")
    g.add_argument("--microbatches", type=sized("num_microbatches"), metavar="M",
                   help="microbatches per step (default 2 x pp); --batch is the microbatch size")
    g.add_argument("--schedule", choices=SCHEDULES,
                   help="1f1b (default), gpipe, or interleaved (with --vpp model chunks per stage)")
    g.add_argument("--vpp", type=sized("vpp"), metavar="V",
                   help="model chunks per stage for the interleaved schedule (Megatron's "
                        "--num-layers-per-virtual-pipeline-stage gives layers / (pp x V)) (default 1)")
    g.add_argument("--layout", type=_layout, metavar="L0,L1,...",
                   help="layers of each model chunk in global order (default: even split)")
    g.add_argument("--partial-checkpoint-microbatches", type=sized("num_microbatches", non_negative_int), metavar="N",
                   help="Megatron's --num-microbatches-with-partial-activation-checkpoints: in each window of "
                        "in-flight microbatches the first N keep everything, the rest run the policy")
    g.add_argument("--pipeline-runtime", choices=RUNTIMES,
                   help="whose pipeline buffers predict models: torch (torch.distributed.pipelining, what measure "
                        "runs; default) or megatron")
    g.add_argument("--timeout", type=positive_seconds, metavar="S",
                   help=f"seconds a real multi-process run may take before every rank is killed "
                        f"(default {DEFAULT_TIMEOUT:g})")
    parser.set_defaults(pp_optional=pp_optional)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_pipeline_flags(args: argparse.Namespace) -> None:
    """Refuse pipeline flags that the command would ignore: given without ``--pp`` where ``--pp`` is what turns
    the pipeline on. Called by :func:`remat.cli.main` for every command with the pipeline flags."""
    if getattr(args, "pp", None) is not None or getattr(args, "pp_optional", True):
        return
    for name in PIPELINE_FLAGS:
        value = getattr(args, name, None)
        if value is None:
            continue
        shown = ",".join(map(str, value)) if isinstance(value, list) else f"{value:g}" if isinstance(
            value, float) else str(value)
        fix = "--pp P --schedule interleaved --vpp V" if name == "vpp" else "--pp P (pipeline stages)"
        raise PipelineError(f"{_flag(name)} {shown} is a pipeline setting, ignored without a pipeline: add {fix}, "
                            f"or drop {_flag(name)}")


@dataclasses.dataclass(frozen=True)
class PipelineArgs:
    """The pipeline settings of a parsed command line, checked."""

    pp: int
    microbatches: int
    schedule: str
    vpp: int
    layout: list[int] | None
    partial: int | None
    runtime: str
    timeout: float

    def describe(self) -> str:
        text = f"pp={self.pp}, {self.microbatches} microbatches, {self.schedule}"
        if self.vpp > 1:
            text += f" x {self.vpp} chunks per stage"
        if self.layout:
            text += f", layout {','.join(map(str, self.layout))}"
        if self.partial is not None:
            text += f", partial checkpointing N={self.partial}"
        return text


def pipeline_args(args: argparse.Namespace, config: ModelConfig, runtime: str | None = None) -> PipelineArgs:
    """Read and check the pipeline flags (``--pp`` absent means 1) for ``config``'s model. ``runtime``: the runtime
    a real run uses (``'torch'``; None for a prediction, which reads ``--pipeline-runtime`` and has no
    ``--timeout``). Raises PipelineError naming the flag and the fix (the partition is checked first, so that the
    fix a schedule error suggests has enough layers)."""

    def value(name: str) -> Any:
        given = getattr(args, name, None)
        return PIPELINE_DEFAULTS.get(name) if given is None else given

    pp = value("pp")  # absent: one stage
    m = value("microbatches")
    m = 2 * pp if m is None else m
    asked = getattr(args, "pipeline_runtime", None)
    if runtime is not None and asked not in (None, runtime):
        raise PipelineError(f"--pipeline-runtime {asked}: a real run measures the {runtime} runtime "
                            "(torch.distributed.pipelining); drop --pipeline-runtime, or use 'remat predict' to "
                            f"model {asked}")
    if runtime is None and getattr(args, "timeout", None) is not None:
        raise PipelineError(f"--timeout {args.timeout:g} bounds real multi-process runs, and a prediction runs none: "
                            "drop --timeout (or measure with 'remat measure' / 'remat compare')")
    runtime = runtime or value("pipeline_runtime")
    partition(config, pp, value("vpp"), getattr(args, "layout", None))
    schedule = check_schedule(value("schedule"), pp, m, value("vpp"), runtime, config.num_layers)
    return PipelineArgs(pp, m, schedule, value("vpp"), getattr(args, "layout", None),
                        getattr(args, "partial_checkpoint_microbatches", None), runtime, value("timeout"))


def config_from_args(args: argparse.Namespace) -> ModelConfig:
    """The model: ``--preset``/``--config`` with the model flags applied when the parser has them
    (:func:`remat.cli.common.resolve_model_config`), else the model flags alone."""
    if hasattr(args, "preset") or hasattr(args, "config"):
        return resolve_model_config(args)
    return model_config_from_args(args)


def policies_from_args(args: argparse.Namespace, config: ModelConfig, pipe: PipelineArgs,
                       default: Sequence[str] = ("none",)) -> list[Policy]:
    """The policies named by ``--policies`` (a comma list) and/or ``--policy`` (one, a comma list, or a list of
    them when repeated), plus ``--sweep megatron`` (every Megatron setting of the smallest model chunk), with
    ``--engine`` applied to those that do not name their own ``@engine``; ``default`` when none is named.
    Duplicates are dropped, order is kept."""
    texts: list[str] = []
    for name in ("policies", "policy"):
        value = getattr(args, name, None)
        if isinstance(value, str):
            texts.append(value)
        elif value:
            texts.extend(value)
    names = [n for text in texts for n in (parse_policy_list(text) or [])]
    if getattr(args, "sweep", None) in ("megatron", "megatron-offload"):
        depth = min(s.num_layers for s in partition(config, pipe.pp, pipe.vpp, pipe.layout))
        names += megatron_sweep(depth, config=config)
        names += offload_sweep(depth) if args.sweep == "megatron-offload" else []
    engine = getattr(args, "engine", None)
    out: list[Policy] = []
    for name in names or list(default):
        policy = Policy.parse(name)
        if engine and "@" not in name:
            policy = dataclasses.replace(policy, engine=engine)
        if policy not in out:
            out.append(policy)
    return out
