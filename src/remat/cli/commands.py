"""The ``remat`` parser and how a parsed command runs (:mod:`remat.cli` starts here after looking for a stored
answer); each subcommand lives in a module of its own."""

from __future__ import annotations

import argparse
import gc
import sys
from collections.abc import Sequence

from remat.cli.common import USAGE_ERROR, USER_ERRORS, Parser, add_debug, check_pipeline_flags
from remat.cli.compare import compare_command
from remat.cli.explain import explain_command
from remat.cli.measure import measure_command
from remat.cli.plan import plan_command
from remat.cli.predict import predict_command
from remat.memory.kernels import KERNELS, use_kernels
from remat.memory.trace_pool import note_cpu
from remat.version import __version__

# Each adds its subparser and returns its runner; this order is the order of `remat --help`.
SUBCOMMANDS = (explain_command, predict_command, compare_command, plan_command, measure_command)


def build_parser() -> argparse.ArgumentParser:
    """The ``remat`` parser with every registered subcommand."""
    parser = Parser(prog="remat", description="See, predict and plan activation recomputation (checkpointing) "
                                               "for PyTorch transformer training.")
    parser.add_argument("--version", action="version", version=f"remat {__version__}")
    add_debug(parser, False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=Parser)
    for register in SUBCOMMANDS:
        runner = register(sub)
        # The subparser just added is the last one; its runner is stored on the namespace it fills.
        list(sub.choices.values())[-1].set_defaults(run=runner)
        list(sub.choices.values())[-1].add_argument(
            "--kernels", choices=KERNELS, default=None,
            help="whose kernels' saved tensors predictions trace: cpu (exact CPU kernels), cuda (PyTorch eager on "
                 "CUDA: fused dropout, fp32 norm statistics, CUDA attention backends), te (TransformerEngine's "
                 "fused layers); default cuda with --device cuda or a whole job (its ranks run on GPUs; compare "
                 "measures a job on CPU, with cpu), else cpu (docs/kernels.md)")
    return parser


def run(argv: Sequence[str], *, console: bool = False) -> int:
    """Parse ``argv`` and run the command; return the exit code. ``console``: the ``remat`` console script, which
    exits right after (its objects are then frozen rather than collected)."""
    note_cpu()  # the first count of idle cores measures from here, not waiting (NOTE [idle cores without waiting])
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, --version and usage errors
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else USAGE_ERROR)
    try:
        check_pipeline_flags(args)
        # every prediction below traces this kernel profile (--device cuda implies cuda)
        kernels = args.kernels or ("cuda" if getattr(args, "device", None) == "cuda" else None)
        with use_kernels(kernels):
            code = args.run(args)
        if console:
            # the console script exits next: its objects need no collection, and collecting the traces' cyclic
            # garbage (fake tensors, with weakref callbacks) at interpreter exit took about a second
            gc.freeze()
        return code
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
