"""The ``remat`` command line: a thin layer over the Python API.

Each subcommand is one function decorated with :func:`command`: it adds its parser to the subparsers and
returns the function that runs it (``args -> exit code``). Shared flag groups (the model, the measurement)
are helpers, so a later ``predict``/``compare``/``measure``/``plan`` is one more decorated function.

Errors a user can fix (a bad config, policy, timeline file or value) are printed as one line
``remat: error: ...`` with exit code 2; ``--debug`` prints the traceback instead.
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from remat import __version__
from remat.apply import ApplyError
from remat.config import ACTIVATIONS, ATTENTIONS, DTYPES, NORMALIZATIONS, POSITIONS, ConfigError, ModelConfig
from remat.policy import ENGINES, GRAMMAR, PolicyError
from remat.timeline import TimelineError

# Exceptions that mean "the input is wrong", not "remat is broken": one line, exit code 2.
USER_ERRORS = (ConfigError, PolicyError, ApplyError, TimelineError, ValueError)
USAGE_ERROR = 2

Runner = Callable[[argparse.Namespace], int]
Subparsers = Any  # argparse's _SubParsersAction is private
_COMMANDS: list[Callable[[Subparsers], Runner]] = []


class _Parser(argparse.ArgumentParser):
    """argparse, but usage errors are the same one line as remat's own errors."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"remat: error: {message} (see '{self.prog} --help')\n")


def command(register: Callable[[Subparsers], Runner]) -> Callable[[Subparsers], Runner]:
    """Register a subcommand: ``register(subparsers)`` adds its parser and returns its runner."""
    _COMMANDS.append(register)
    return register


# ------------------------------------------------------------------------------------------------ shared flags
def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the reference GPT; an unset flag keeps :class:`ModelConfig`'s default."""
    d = ModelConfig()
    g = parser.add_argument_group("model (the reference GPT; defaults are a small 8-layer model)")
    g.add_argument("--layers", type=int, metavar="L", help=f"transformer layers (default {d.num_layers})")
    g.add_argument("--hidden", type=int, metavar="H", help=f"hidden size (default {d.hidden_size})")
    g.add_argument("--heads", type=int, metavar="A", help=f"attention heads (default {d.num_attention_heads})")
    g.add_argument("--query-groups", type=int, metavar="G", help="key/value groups (GQA; default: one per head)")
    g.add_argument("--ffn", type=int, metavar="F", help="MLP hidden size (default 4H for gelu)")
    g.add_argument("--seq", type=int, metavar="S", help=f"sequence length (default {d.seq_length})")
    g.add_argument("--batch", type=int, metavar="B", help=f"micro-batch size (default {d.micro_batch_size})")
    g.add_argument("--vocab", type=int, metavar="V", help=f"vocabulary size (default {d.vocab_size})")
    g.add_argument("--activation", choices=ACTIVATIONS, help=f"MLP activation (default {d.activation})")
    g.add_argument("--normalization", choices=NORMALIZATIONS, help=f"default {d.normalization}")
    g.add_argument("--position", choices=POSITIONS, help=f"position embedding (default {d.position})")
    g.add_argument("--attention", choices=ATTENTIONS,
                   help=f"math materialises the s x s scores, sdpa uses fused kernels (default {d.attention})")
    g.add_argument("--dtype", choices=tuple(DTYPES), help=f"parameter/activation dtype (default {d.dtype})")
    g.add_argument("--dropout", type=float, metavar="P",
                   help=f"hidden and attention dropout (default {d.hidden_dropout})")


_MODEL_FLAGS = {
    "layers": "num_layers", "hidden": "hidden_size", "heads": "num_attention_heads",
    "query_groups": "num_query_groups", "ffn": "ffn_hidden_size", "seq": "seq_length",
    "batch": "micro_batch_size", "vocab": "vocab_size", "activation": "activation",
    "normalization": "normalization", "position": "position", "attention": "attention", "dtype": "dtype",
}


def model_config_from_args(args: argparse.Namespace) -> ModelConfig:
    """The :class:`ModelConfig` the model flags ask for (ConfigError names the bad field)."""
    fields = {name: getattr(args, flag) for flag, name in _MODEL_FLAGS.items() if getattr(args, flag) is not None}
    if args.dropout is not None:
        fields.update(hidden_dropout=args.dropout, attention_dropout=args.dropout)
    return ModelConfig(**fields)


def add_measure_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of how a step is run: recompute engine and device."""
    g = parser.add_argument_group("measurement")
    g.add_argument("--engine", choices=ENGINES,
                   help="checkpoint implementation for policies without '@engine' (default reentrant, Megatron's)")
    g.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: exact storage bytes; cuda: allocator blocks (default cpu)")


def parse_policy_list(text: str | None) -> list[str] | None:
    """``'none, full/uniform/2'`` -> ``['none', 'full/uniform/2']``; None stays None (the default list).

    Commas inside a policy (``full/uniform/2,distribute``) are kept: a piece that is only an option is
    joined to the policy before it.
    """
    if text is None:
        return None
    pieces = [p.strip() for p in text.split(",")]
    out: list[str] = []
    for piece in pieces:
        if not piece:
            continue
        if re.fullmatch(r"distribute(@[\w-]+)?", piece) and out:
            out[-1] += "," + piece
        else:
            out.append(piece)
    if not out:
        raise PolicyError(f"--policies {text!r} names no policy: give e.g. none,full/uniform/1")
    return out


class _Bar:
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


def _info(message: str) -> None:
    print(message, file=sys.stderr)


def file_name(policy: str) -> str:
    """A file-name-safe form of a policy: ``full/uniform/2@non-reentrant`` -> ``full-uniform-2-non-reentrant``."""
    return re.sub(r"[^A-Za-z0-9_+.-]+", "-", policy).strip("-")


# ------------------------------------------------------------------------------------------------ explain
@command
def explain_command(sub: Subparsers) -> Runner:
    """``remat explain``: measure policies on the reference GPT and explain where the memory goes."""
    parser = sub.add_parser(
        "explain", help="measure recompute policies and explain the peaks in plain words",
        description=textwrap.fill(
            "Measure one training step of the reference GPT under each recompute policy and explain, with the "
            "numbers, where each peak sits, why a bigger --recompute-num-layers group (up to the whole stack) can "
            "still save memory, and how exact 'stored inputs + one group' is.", width=78, break_on_hyphens=False),
        epilog="policy syntax (--policies takes a comma-separated list):\n" + GRAMMAR,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_debug(parser, argparse.SUPPRESS)
    add_model_arguments(parser)
    add_measure_arguments(parser)
    g = parser.add_argument_group("explain")
    g.add_argument("--policies", metavar="LIST",
                   help="comma-separated policies, e.g. none,full/uniform/2 (default: none, full/uniform/K for "
                        "K = 1, 2, 4, ... and L, full/block/L/4 and L/2, selective/core_attn, "
                        "selective/core_attn+mlp); none is always measured as the baseline")
    g.add_argument("--repeats", type=int, default=3, metavar="N",
                   help="timed steps per policy, median reported (default 3; 0: no timing)")
    g.add_argument("--out", type=Path, default=Path("remat-out"), metavar="DIR",
                   help="where explain.json, timelines.png and timeline-<policy>.json go (default ./remat-out)")
    g.add_argument("--json", action="store_true", help="print the JSON report instead of the table")
    g.add_argument("--no-plot", action="store_true", help="do not write timelines.png")
    return run_explain


def run_explain(args: argparse.Namespace) -> int:
    from remat.explain import explain
    from remat.report import format_explanation, plot_timelines, write_json

    config = model_config_from_args(args)
    policies = parse_policy_list(args.policies)
    if args.repeats < 0:
        raise ValueError(f"--repeats {args.repeats}: must be >= 0")
    bar = _Bar("remat explain")
    try:
        result = explain(config, policies, engine=args.engine, device=args.device, repeats=args.repeats,
                         progress=bar)
    finally:
        bar.close()

    out: Path = args.out
    files: dict[str, str] = {}
    for name, timeline in result.timelines.items():
        files[name] = str(timeline.save(out / f"timeline-{file_name(name)}.json").name)
    report = result.to_dict()
    report["files"] = {"timelines": files}
    written = []
    if not args.no_plot:
        title = (f"{config.num_layers} layers, h={config.hidden_size}, s={config.seq_length}, "
                 f"b={config.micro_batch_size}, vocab={config.vocab_size}, {config.dtype}: MiB alive through one step")
        plot_timelines(result.timelines, out / "timelines.png", title=title)
        report["files"]["plot"] = "timelines.png"
        written.append(out / "timelines.png")
    written.insert(0, write_json(out / "explain.json", report))

    if args.json:
        print(_json_text(report))
    else:
        print(format_explanation(result))
    _info(f"wrote {', '.join(str(p) for p in written)} and {len(files)} timeline JSON file(s) in {out}")
    return 0


def _json_text(obj: Any) -> str:
    import json

    return json.dumps(obj, indent=2)


# ------------------------------------------------------------------------------------------------ main
def _add_debug(parser: argparse.ArgumentParser, default: Any) -> None:
    # On the main parser and on each subcommand, so --debug works before or after the subcommand; the
    # subcommands' default is SUPPRESS so they do not reset a --debug given before them.
    parser.add_argument("--debug", action="store_true", default=default,
                        help="print the full traceback of an error instead of one line")


def build_parser() -> argparse.ArgumentParser:
    """The ``remat`` parser with every registered subcommand."""
    parser = _Parser(prog="remat", description="See, predict and plan activation recomputation (checkpointing) "
                                               "for PyTorch transformer training.")
    parser.add_argument("--version", action="version", version=f"remat {__version__}")
    _add_debug(parser, False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_Parser)
    for register in _COMMANDS:
        runner = register(sub)
        # The subparser just added is the last one; its runner is stored on the namespace it fills.
        list(sub.choices.values())[-1].set_defaults(run=runner)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``remat`` command line with ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, --version and usage errors
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else USAGE_ERROR)
    try:
        return args.run(args)
    except USER_ERRORS as err:
        if args.debug:
            raise
        first, _, rest = str(err).strip().partition("\n")
        hint = f" (see 'remat {args.command} --help')" if rest else ""
        print(f"remat: error: {first}{hint}", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:
        print("remat: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
