"""``remat predict --megatron-core`` and ``remat compare --megatron-core``: the user's Megatron-LM command line
traced with megatron-core's own model code (remat.megatron), rank by rank."""

from __future__ import annotations

import argparse
import textwrap
import warnings

from remat.analysis.megatron_report import COMPARE_COLUMNS, RANK_COLUMNS, rank_rows
from remat.analysis.report import format_table
from remat.cli.common import emit_report
from remat.megatron import config_from_args, measure_megatron_core, measure_megatron_core_distributed, predict_from_args

# Flags that describe remat's reference model or job: with --megatron-core everything comes from --megatron-args,
# so any of them given is refused rather than dropped.
REFERENCE_ONLY = ("preset", "config", "layers", "hidden", "heads", "query_groups", "ffn", "seq", "batch", "vocab",
                  "activation", "normalization", "position", "attention", "dtype", "dropout", "engine", "sp", "pp",
                  "microbatches", "vpp", "layout", "dp", "cp", "distributed_optimizer", "optimizer", "precision",
                  "policies", "policy", "sweep", "adam")


def add_megatron_core_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--megatron-core", action="store_true",
                        help="trace megatron-core's own GPTModel (local layer spec, Megatron's DDP and Adam state) "
                             "built from --megatron-args, instead of remat's reference model; needs the extra "
                             "remat[megatron]")


def check_megatron_core_args(args: argparse.Namespace) -> str:
    """The --megatron-args text; refuses reference-model flags, which the megatron-core path would not use."""
    if not getattr(args, "megatron_args", None):
        raise ValueError("--megatron-core needs --megatron-args: Megatron-LM's own flags ('--num-layers 32 ...') "
                         "or @FILE")
    given = [name for name in REFERENCE_ONLY if getattr(args, name, None) not in (None, False, [], ())]
    if getattr(args, "tp", 1) not in (None, 1):
        given.append("tp")
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise ValueError(f"{flags} with --megatron-core: the model, the parallel sizes and the recompute setting "
                         "come from --megatron-args (e.g. --tensor-model-parallel-size, --recompute-granularity); "
                         "drop them")
    return args.megatron_args.strip()


def print_rows(args: argparse.Namespace, rows: list[dict], columns: list, title: str) -> None:
    emit_report(args, {"format": "remat.megatron-core", "version": 1, "rows": rows},
                lambda: print_text(rows, columns, title))


def print_text(rows: list[dict], columns: list, title: str) -> None:
    print(title + "\n")
    print(format_table(rows, columns))
    ignored = rows[0]["ignored_flags"] if rows else []
    if ignored:
        print("\n" + textwrap.fill("ignored (they do not change memory): " + " ".join(ignored), width=110))
    routing = rows[0]["routing"] if rows else None
    if routing:
        print(f"MoE routing assumed: {routing}")
    print("\n" + textwrap.fill("act: activations, checkpoint inputs, recomputed tensors, logits and temporaries alive "
                               "at the peak; grads include Megatron's fp32 main-grad buffer; optim: Adam's states "
                               "(and fp32 master parameters), sharded with --use-distributed-optimizer. Not counted: "
                               "the CUDA context, NCCL buffers and allocator fragmentation.", width=110))


def quiet_megatron_warnings() -> None:
    """megatron-core warns at import that TransformerEngine/Apex are absent and about CUDA settings: true, and
    irrelevant to a trace on CPU."""
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")


def run_predict_megatron_core(args: argparse.Namespace) -> int:
    argv = check_megatron_core_args(args)
    quiet_megatron_warnings()
    timelines = predict_from_args(argv, device=args.device)
    print_rows(args, rank_rows(timelines), RANK_COLUMNS,
               f"megatron-core, predicted (fake tensors) per distinct rank, worst first, on {args.device}")
    return 0


def run_compare_megatron_core(args: argparse.Namespace) -> int:
    argv = check_megatron_core_args(args)
    quiet_megatron_warnings()
    predicted = predict_from_args(argv, ranks="all")
    config, keywords, _ = config_from_args(argv)
    if keywords["tp"] * keywords["pp"] * keywords["cp"] * keywords["ep"] == 1 and (keywords["dp"] or 1) == 1:
        single = ("seq_length", "micro_batch_size", "vocab_size", "ddp", "optimizer")
        measured = measure_megatron_core(config, **{name: keywords[name] for name in single})
    else:
        measured = measure_megatron_core_distributed(config, **keywords, timeout=args.timeout or 300.0)
    print_rows(args, rank_rows(predicted, measured), COMPARE_COLUMNS,
               "megatron-core, predicted (fake tensors) vs measured (real CPU tensors, gloo) per rank, worst first")
    return 0
