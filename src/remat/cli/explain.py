"""`remat explain`: measure policies on a model and say where the peak sits and why."""

from __future__ import annotations

import argparse
from pathlib import Path

from remat.analysis.explain import explain
from remat.analysis.html import write_html
from remat.analysis.report import format_explanation, plot_timelines, write_json
from remat.analysis.snapshot import write_memory_snapshot
from remat.cli.common import (
    ProgressBar,
    Runner,
    Subparsers,
    add_measure_arguments,
    add_model_arguments,
    add_pipeline_arguments,
    add_subcommand,
    file_name,
    info,
    json_text,
    model_config_from_args,
    parse_policy_list,
)
from remat.cli.pipeline import run_pipeline_explain
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
    g.add_argument("--html", type=Path, metavar="FILE",
                   help="also write the report as one self-contained HTML page (charts inline, nothing fetched)")
    g.add_argument("--snapshot", type=Path, metavar="FILE",
                   help="also write each policy's timeline as a torch.cuda.memory._snapshot() pickle for "
                        "https://pytorch.org/memory_viz: FILE with the policy before the suffix "
                        "(snap.pickle -> snap-full-uniform-2.pickle); FILE itself when there is one policy")
    return run_explain


def run_explain(args: argparse.Namespace) -> int:

    if args.pp:

        return run_pipeline_explain(args)
    config = model_config_from_args(args)
    policies = parse_policy_list(args.policies)
    if args.repeats < 0:
        raise ValueError(f"--repeats {args.repeats}: must be >= 0")
    bar = ProgressBar("remat explain")
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
    if args.html is not None:

        written.append(write_html(result, args.html))
    if args.snapshot is not None:

        for name, timeline in result.timelines.items():
            path = args.snapshot if len(result.timelines) == 1 else \
                args.snapshot.with_name(f"{args.snapshot.stem}-{file_name(name)}{args.snapshot.suffix}")
            written.append(write_memory_snapshot(timeline, path))
    written.insert(0, write_json(out / "explain.json", report))

    if args.json:
        print(json_text(report))
    else:
        print(format_explanation(result))
    info(f"wrote {', '.join(str(p) for p in written)} and {len(files)} timeline JSON file(s) in {out}")
    return 0
