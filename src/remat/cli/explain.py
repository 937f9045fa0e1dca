"""`remat explain`: measure policies on a model and say where the peak sits and why."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from remat.analysis.explain import Explanation, explain
from remat.analysis.html import write_html
from remat.analysis.outputs import RunFolder, replace_problem
from remat.analysis.report import format_explanation, format_short_answer, write_json
from remat.analysis.snapshot import write_memory_snapshot
from remat.analysis.timeline_plot import plot_timelines
from remat.cli.common import (
    ProgressBar,
    Runner,
    Subparsers,
    add_measure_arguments,
    add_model_arguments,
    add_pipeline_arguments,
    add_subcommand,
    check_writable,
    file_name,
    info,
    integer,
    json_text,
    model_config_from_args,
    parse_policy_list,
    writing,
)
from remat.cli.job_args import add_job_arguments, refuse_job_flags
from remat.cli.pipeline import run_pipeline_explain
from remat.config import ModelConfig
from remat.memory.comparison import MemoryCheckError
from remat.memory.kernels import resolve_kernels
from remat.memory.reserved import REPLAY_NOTE, explain_reserved, format_reserved
from remat.parallel.launch import cleanup_on_sigterm
from remat.policy import GRAMMAR


# ------------------------------------------------------------------------------------------------ explain
def explain_command(sub: Subparsers) -> Runner:
    """``remat explain``: measure policies on the reference GPT and explain where the memory goes."""
    parser = add_subcommand(
        sub, "explain", help="measure recompute policies and explain the peaks in plain words",
        description="Measure one training step of the reference GPT under each recompute policy and explain, with "
                    "the numbers, where each peak sits, why a bigger --recompute-num-layers group (up to the whole "
                    "stack) can still save memory, and how exact 'stored inputs + one group' is.",
        epilog="policy syntax (--policies takes a comma-separated list):\n" + GRAMMAR)
    add_model_arguments(parser)
    add_measure_arguments(parser)

    add_pipeline_arguments(parser)
    add_job_arguments(parser)  # refused in run_explain, by name, rather than ignored
    g = parser.add_argument_group("explain")
    g.add_argument("--policies", metavar="LIST",
                   help="comma-separated policies, e.g. none,full/uniform/2 (default: none, full/uniform/K for "
                        "K = 1, 2, 4, ... and L, full/block/L/4 and L/2, selective/core_attn, "
                        "selective/core_attn+mlp); none is always measured as the baseline")
    g.add_argument("--repeats", type=integer, metavar="N",
                   help="also time N forward+backward steps per policy without the recorder: the table's step s "
                        "(median) and vs none columns (default 0: not timed, about twice as quick; the bytes are "
                        "the same either way; e.g. --repeats 3)")
    g.add_argument("--contrast-vocab", type=integer, metavar="V",
                   help="also measure none, full/uniform/1 and full/uniform/L (untimed) with vocabulary V, the other "
                        "regime of the question: large logits make the whole-stack group save memory (default "
                        f"{CONTRAST_VOCAB}; 0: no contrast run; none when --vocab is V)")
    g.add_argument("--out", type=Path, default=Path("remat-out"), metavar="DIR",
                   help="where explain.json, timelines.png and timeline-<policy>.json go (default ./remat-out); the "
                        "folder is written aside and replaced whole at the end")
    g.add_argument("--json", action="store_true", help="print the JSON report instead of the table")
    g.add_argument("--no-plot", action="store_true", help="do not write timelines.png")
    g.add_argument("--html", type=Path, metavar="FILE",
                   help="also write the report as one self-contained HTML page (charts inline, nothing fetched)")
    g.add_argument("--snapshot", type=Path, metavar="FILE",
                   help="also write each policy's timeline as a torch.cuda.memory._snapshot() pickle for "
                        "https://pytorch.org/memory_viz: FILE with the policy before the suffix "
                        "(snap.pickle -> snap-full-uniform-2.pickle); FILE itself when there is one policy")
    return run_explain


# --repeats and --contrast-vocab when not given: the policies are timed only when asked (issue 24: the first run's
# answer in seconds; timing every policy 3 times doubled it)
REPEATS, CONTRAST_VOCAB = 0, 32000
# What `remat explain --pp` measures is its own: per stage none, full/uniform/1 and whole-chunk groups, untimed, at
# --vocab, into one JSON file in --out; these flags of the one-process explain are refused with --pp, not ignored.
NOT_WITH_PP = ("policies", "repeats", "contrast_vocab", "html", "snapshot")


def refuse_pipeline_ignored(args: argparse.Namespace) -> None:
    """Refuse, naming the flag, a one-process explain flag given with --pp (which would ignore it)."""
    for name in NOT_WITH_PP if args.pp else ():
        if getattr(args, name) is not None:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} with --pp: remat explain --pp measures its own policies per stage (none, "
                             "full/uniform/1 and whole-chunk groups), untimed, into --out/explain-pipeline.json: drop "
                             f"{flag}, or drop --pp")


# Model flags that set a size (flag -> ModelConfig attribute): a run too large for this machine names those given
# above their default.
SIZE_FLAGS = {"layers": "num_layers", "hidden": "hidden_size", "ffn": "ffn_size", "seq": "seq_length",
              "batch": "micro_batch_size", "vocab": "vocab_size", "heads": "num_attention_heads"}


def check_output_paths(args: argparse.Namespace) -> None:
    """Refuse, naming the flag, an --out/--html/--snapshot path that cannot be written, or an --out folder whose
    replacement would delete what remat did not write, before anything runs."""
    check_writable(args, folders=("out",), files=("html", "snapshot"))
    if args.pp:  # the pipeline report is one file written into --out; the folder is not replaced
        return
    own = [Path(p).name for p in (args.html, args.snapshot) if p is not None]
    problem = replace_problem(args.out, "remat explain", own)
    if problem is not None:
        raise ValueError(f"--out {args.out}: {problem}")


def _too_big(args: argparse.Namespace, config: ModelConfig, err: MemoryCheckError) -> ValueError:
    """The memory check's refusal, naming the flags that made the run that large."""
    if err.config is not None and err.config.vocab_size != config.vocab_size:
        return ValueError(f"--contrast-vocab {err.config.vocab_size}: {err}; or --contrast-vocab 0 (no contrast run)")
    default = ModelConfig()
    given = {flag: getattr(args, flag) for flag in SIZE_FLAGS if getattr(args, flag, None) is not None}
    larger = [f"--{flag} {value}" for flag, value in given.items() if value > getattr(default, SIZE_FLAGS[flag])]
    named = larger or [f"--{flag} {value}" for flag, value in given.items()]
    return ValueError(f"{' '.join(named) or 'the default model'}: {err}")


def run_explain(args: argparse.Namespace) -> int:
    refuse_job_flags(args, "explain", "use 'remat predict' with the same flags: it prices every part of every rank")
    refuse_pipeline_ignored(args)
    check_output_paths(args)
    if args.pp:
        return run_pipeline_explain(args)
    config = model_config_from_args(args)
    policies = parse_policy_list(args.policies)
    repeats = REPEATS if args.repeats is None else args.repeats
    contrast_vocab = CONTRAST_VOCAB if args.contrast_vocab is None else args.contrast_vocab
    if repeats < 0:
        raise ValueError(f"--repeats {repeats}: must be >= 0")
    if contrast_vocab < 0:
        raise ValueError(f"--contrast-vocab {contrast_vocab}: must be a vocabulary size, or 0 for no contrast run")
    bar = ProgressBar("remat explain")

    def lead(lines: list[str]) -> None:
        """The short answer, printed as soon as it is known (the other policies are measured after it)."""
        bar.close()  # the next step's progress opens a new bar below the answer
        print(format_short_answer(lines), flush=True)

    try:
        result = explain(config, policies, engine=args.engine, device=args.device, repeats=repeats,
                         progress=bar, contrast_vocab=contrast_vocab or None, answer=None if args.json else lead)
    except MemoryCheckError as err:
        raise _too_big(args, config, err) from None
    finally:
        bar.close()

    # a SIGTERM or ^C while the folder is staged removes the stage (and a SIGKILL's is removed by the next run)
    with writing("--out", args.out), cleanup_on_sigterm(), RunFolder(args.out) as run:
        files, report = _write_run(args, config, result, run)
        out = run.commit()

    if args.json:
        print(json_text(report))
    else:  # the short answer is out already (lead): the rest of format_explanation's report
        print("\nIn detail:\n\n" + format_explanation(dataclasses.replace(result, short_answer=[])))
        if "allocator_replay" in report:
            print(f"\nReserved memory ({REPLAY_NOTE}):")
            for name, figures in report["allocator_replay"].items():
                print(f"  {name} ({figures['source']}): {format_reserved(figures)}")
    written = [out / "explain.json"] + ([out / "timelines.png"] if not args.no_plot else []) + \
        [Path(p) for p in report["files"].get("html", [])] + [Path(p) for p in report["files"].get("snapshots", [])]
    info(f"wrote {', '.join(str(p) for p in written)} and {len(files)} timeline JSON file(s) in {out}")
    if not repeats:
        info("step times not measured: --repeats 3 times each policy's step 3 times (the step s and vs none columns)")
    return 0


def _write_run(args: argparse.Namespace, config: ModelConfig, result: Explanation,
               run: RunFolder) -> tuple[dict[str, str], dict[str, Any]]:
    """Write every file of the run into ``run`` (staged); returns the timeline files and the report."""
    files: dict[str, str] = {}
    for name, timeline in result.timelines.items():
        files[name] = timeline.save(run.path(f"timeline-{file_name(name)}.json")).name
    report = result.to_dict()
    report["files"] = {"timelines": files}
    kernels = resolve_kernels(None, args.device)
    if kernels != "cpu" or args.device == "cuda":  # what runs out on a GPU: the caching allocator, replayed
        report["allocator_replay"] = explain_reserved(config, result.timelines, args.device, kernels)
    panels = dict(result.timelines)
    if result.contrast is not None:
        vocab = result.contrast.config.vocab_size
        report["files"]["contrast_timelines"] = {
            name: timeline.save(run.path(f"timeline-vocab{vocab}-{file_name(name)}.json")).name
            for name, timeline in result.contrast.timelines.items()}
        panels = {f"{name} (vocab {config.vocab_size})": tl for name, tl in result.timelines.items()}
        panels.update({f"{name} (vocab {vocab})": tl for name, tl in result.contrast.timelines.items()})
    if not args.no_plot:
        title = (f"{config.num_layers} layers, h={config.hidden_size}, s={config.seq_length}, "
                 f"b={config.micro_batch_size}, vocab={config.vocab_size}, {config.dtype}: MiB alive through one step")
        if result.contrast is not None:
            title += f" (and at vocab={result.contrast.config.vocab_size}, the last panels)"
        plot_timelines(panels, run.path("timelines.png"), title=title)
        report["files"]["plot"] = "timelines.png"
    if args.html is not None:
        with writing("--html", args.html):
            write_html(result, run.outside(args.html))
        report["files"]["html"] = [str(args.html)]
    if args.snapshot is not None:
        report["files"]["snapshots"] = []
        for name, timeline in result.timelines.items():
            path = args.snapshot if len(result.timelines) == 1 else \
                args.snapshot.with_name(f"{args.snapshot.stem}-{file_name(name)}{args.snapshot.suffix}")
            with writing("--snapshot", path):
                write_memory_snapshot(timeline, run.outside(path))
            report["files"]["snapshots"].append(str(path))
    write_json(run.path("explain.json"), report)
    return files, report
