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
from remat.policy import ENGINES, GRAMMAR, SELECTIVE_MODULES, PolicyError
from remat.timeline import TimelineError

# Exceptions that mean "the input is wrong", not "remat is broken": one line, exit code 2.
USER_ERRORS = (ConfigError, PolicyError, ApplyError, TimelineError, ValueError, OSError)  # OSError: unwritable --out
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
    parser = add_subcommand(
        sub, "explain", help="measure recompute policies and explain the peaks in plain words",
        description="Measure one training step of the reference GPT under each recompute policy and explain, with "
                    "the numbers, where each peak sits, why a bigger --recompute-num-layers group (up to the whole "
                    "stack) can still save memory, and how exact 'stored inputs + one group' is.",
        epilog="policy syntax (--policies takes a comma-separated list):\n" + GRAMMAR)
    add_model_arguments(parser)
    add_measure_arguments(parser)
    from remat.pipeline_cli import add_pipeline_arguments

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
    from remat.explain import explain
    from remat.report import format_explanation, plot_timelines, write_json

    if args.pp:
        from remat.pipeline_cli import run_pipeline_explain

        return run_pipeline_explain(args)
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
    if args.html is not None:
        from remat.html import write_html

        written.append(write_html(result, args.html))
    if args.snapshot is not None:
        from remat.snapshot import write_memory_snapshot

        for name, timeline in result.timelines.items():
            path = args.snapshot if len(result.timelines) == 1 else \
                args.snapshot.with_name(f"{args.snapshot.stem}-{file_name(name)}{args.snapshot.suffix}")
            written.append(write_memory_snapshot(timeline, path))
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


# ------------------------------------------------------------------------------------------------ predict / compare
# Shared by predict and compare: where the model comes from, which policies, tensor/sequence parallelism.
SWEEPS = ("megatron",)
MEGATRON_SELECTIVE_MODULES = ("core_attn", "mlp", "layernorm")  # the dense-model modules Megatron offers


def add_model_source_arguments(parser: argparse.ArgumentParser) -> None:
    """``--preset NAME`` | ``--config FILE``, then the model flags, which override single fields of either."""
    from remat.presets import preset_names

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
    from remat.presets import get_preset, load_config

    if getattr(args, "preset", None):
        base = get_preset(args.preset)
    elif getattr(args, "config", None) is not None:
        base = load_config(args.config)
    else:
        base = ModelConfig()
    fields = {name: getattr(args, flag) for flag, name in _MODEL_FLAGS.items() if getattr(args, flag) is not None}
    if args.dropout is not None:
        fields.update(hidden_dropout=args.dropout, attention_dropout=args.dropout)
    return base.replace(**fields) if fields else base


def add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    """Tensor/sequence-parallel flags (:mod:`remat.parallel`) and the pipeline flags (:mod:`remat.pipeline`)."""
    g = parser.add_argument_group("tensor parallelism")
    g.add_argument("--tp", type=int, default=1, metavar="T",
                   help="tensor-parallel size: predict one rank (Megatron's sharding of heads, MLP and vocabulary)")
    g.add_argument("--sp", action="store_true",
                   help="sequence parallelism: norms, dropouts and residuals hold 1/tp of the tokens")
    from remat.pipeline_cli import add_pipeline_arguments

    add_pipeline_arguments(parser)


def parallel_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``tp``/``sp`` as passed to ``predict_config``, ``predict_many`` and ``formulas.explain_differences``
    (empty for one unsharded rank)."""
    if args.tp == 1 and not args.sp:
        return {}
    if getattr(args, "adam", False):
        raise ValueError("--adam with --tp/--sp: Adam states are traced on one unsharded process only; drop one")
    return {"tp": args.tp, "sp": args.sp}


def megatron_sweep(num_layers: int, engine: str | None = None) -> list[str]:
    """Every Megatron recompute setting of a ``num_layers`` stack, in the short form of :class:`Policy`.

    ``none``; ``full/uniform/K`` for K = 1..L; ``full/block/K`` for K = 1..L (K = 0 is ``none``); ``selective``
    with each non-empty set of Megatron's dense-model modules (core_attn, mlp, layernorm). ``engine`` (None:
    Megatron's reentrant) is appended as ``@engine`` to every policy but ``none``.
    """
    from itertools import combinations

    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers={num_layers!r}: a sweep needs a stack of at least one layer")
    names = [f"full/uniform/{k}" for k in range(1, num_layers + 1)]
    names += [f"full/block/{k}" for k in range(1, num_layers + 1)]
    mods = MEGATRON_SELECTIVE_MODULES
    names += ["selective/" + "+".join(c) for n in range(1, len(mods) + 1) for c in combinations(mods, n)]
    suffix = f"@{engine}" if engine not in (None, "reentrant") else ""
    return ["none", *(name + suffix for name in names)]


def add_policy_arguments(parser: argparse.ArgumentParser) -> None:
    """``--policy`` (repeatable, comma lists) and ``--sweep``."""
    g = parser.add_argument_group("policies (none is always included, first, as the baseline)")
    g.add_argument("--policy", action="append", metavar="P",
                   help="a recompute policy, e.g. full/uniform/2 or selective/core_attn+mlp; repeat it or give a "
                        "comma-separated list (default: none, full/uniform/K for K = 1, 2, 4, ... and L, "
                        "full/block/L/4 and L/2, selective/core_attn, selective/core_attn+mlp)")
    g.add_argument("--sweep", choices=SWEEPS,
                   help="megatron: none, every full/uniform/K and full/block/K (K = 1..L) and each set of "
                        "selective modules (core_attn, mlp, layernorm); added to any --policy")


def resolve_cli_policies(args: argparse.Namespace, num_layers: int) -> list[Any]:
    """The :class:`Policy` list of ``--policy``/``--sweep`` (``--engine`` applied), ``none`` first."""
    from remat.explain import resolve_policies

    items: list[str] | None = None
    if args.policy:
        items = []
        for text in args.policy:
            items.extend(parse_policy_list(text) or [])
    if args.sweep == "megatron":
        items = (items or []) + megatron_sweep(num_layers)
    return resolve_policies(items, num_layers, args.engine)


def adam_steady_state(params: Any) -> Any:
    """``torch.optim.Adam`` whose moments (and step counters) already exist: the optimizer of any step after the
    first, whose forward and backward run with the Adam states alive. (On the very first step Adam creates them
    inside ``step()``; that step peaks no higher than a later one.)"""
    import torch

    optimizer = torch.optim.Adam(params)
    for group in optimizer.param_groups:
        for p in group["params"]:
            # a tensor made from a Python number, as Adam makes it: FakeTensorMode keeps its value for .item()
            optimizer.state[p] = {"step": torch.tensor(0.0, dtype=torch.float32),
                                  "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                  "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
    return optimizer


# Parts of the bytes alive at the peak, as the tables show them: (category, column header).
PART_COLUMNS = (("parameters", "params"), ("gradients", "grads"), ("optimizer_state", "optim"),
                ("group_inputs", "inputs"), ("saved_activations", "saved act"), ("recompute", "recompute"),
                ("head_loss", "head/loss"), ("other", "other"))


def prediction_row(policy: Any, timeline: Any, seconds: float | None = None) -> dict[str, Any]:
    """One policy's predicted step: peak bytes, the phase it is in, what is alive there (by category, adding up to
    the peak), the FLOPs per phase kind and the extra compute: recompute FLOPs over forward + backward FLOPs, %
    (matmul-style FLOPs as ``torch.utils.flop_counter`` counts them)."""
    flops = {k: int(v) for k, v in timeline.meta.get("flops", {}).items()}
    base = flops.get("forward", 0) + flops.get("backward", 0)
    row: dict[str, Any] = {
        "policy": str(policy),
        "peak_bytes": timeline.peak_bytes,
        "peak_phase": timeline.peak_phase.label,
        "at_peak": timeline.at_peak,
        "flops": flops,
        "extra_compute_pct": 100.0 * flops.get("recompute", 0) / base if base else 0.0,
    }
    if "composed_from" in timeline.meta:
        row["composed_from"] = timeline.meta["composed_from"]
    if "composition_refused" in timeline.meta:
        row["composition_refused"] = timeline.meta["composition_refused"]
    if seconds is not None:
        row["seconds"] = seconds
    return row


def _unit(largest: int) -> tuple[str, int]:
    """The unit a table of sizes up to ``largest`` bytes is printed in: GiB, MiB or KiB."""
    if largest >= 10 << 30:
        return "GiB", 1 << 30
    return ("MiB", 1 << 20) if largest >= 10 << 20 else ("KiB", 1 << 10)


def _size(divisor: int) -> Callable[[Any], str]:
    return lambda v: "-" if v is None else f"{v / divisor:.{2 if divisor > 1 << 20 else 1}f}"


def format_prediction_table(rows: Sequence[dict[str, Any]]) -> str:
    """The ``remat predict`` table: policy, peak, where, the at-peak parts, extra compute %."""
    from remat.report import format_table

    unit, divisor = _unit(max((r["peak_bytes"] for r in rows), default=0))
    size = _size(divisor)
    flat = [{**r, **{f"part:{k}": v for k, v in r["at_peak"].items()}} for r in rows]
    parts = [(k, h) for k, h in PART_COLUMNS if k != "optimizer_state" or any(r["at_peak"].get(k) for r in rows)]
    columns = [("policy", "policy", str), ("peak_bytes", f"peak {unit}", size), ("peak_phase", "where", str)]
    columns += [(f"part:{k}", h, size) for k, h in parts]
    columns.append(("extra_compute_pct", "extra compute %", lambda v: f"{v:.1f}"))
    return format_table(flat, columns)


def formula_report(config: ModelConfig, timeline: Any, **parallel: Any) -> dict[str, Any]:
    """Korthikanti's and Megatron's per-layer bytes beside the traced bytes of one layer of ``timeline`` (a
    no-recompute trace of ``config``), with each quantified reason (:func:`remat.formulas.explain_differences`)."""
    from remat import formulas

    traced = formulas.traced_layer_bytes(timeline, 0)
    differences = formulas.explain_differences(config, traced, device="cpu", **parallel)
    estimate = formulas.megatron_estimate(config, **parallel)
    return {
        "traced_layer_bytes": traced,
        "traced_layer": 0,
        "korthikanti_layer_bytes": formulas.korthikanti_layer_bytes(config, **parallel),
        "megatron_layer_bytes": estimate["per_layer_bytes"],
        "megatron_total_bytes": estimate["total_bytes"],
        "differences": [d.to_dict() for d in differences],
    }


def format_formula_report(report: dict[str, Any], config: ModelConfig, width: int = 110) -> str:
    """The formulas-beside-the-trace section below the predict table."""
    traced = report["traced_layer_bytes"]
    lines = [f"No recompute, one layer (layer {report['traced_layer']}: the bytes its forward allocates and still "
             f"holds when backward starts), s={config.seq_length} b={config.micro_batch_size} "
             f"h={config.hidden_size} a={config.num_attention_heads}:"]
    label_width = 40
    for diff in report["differences"]:
        label = f"{diff['source']} {diff['formula']}"
        lines.append(f"  {label:<{label_width}} {diff['estimate_bytes']:>16,} bytes")
    lines.append(f"  {'traced (CPU kernels, exact)':<{label_width}} {traced:>16,} bytes")
    for diff in report["differences"]:
        frac = diff["difference_fraction"]
        lines += ["", f"{diff['source']} -> traced: {diff['difference_bytes']:+,} bytes ({100 * frac:+.1f}%), "
                      f"{len(diff['reasons'])} reason(s):"]
        for reason in diff["reasons"]:
            text = f"{reason['nbytes']:+,} {reason['title']}: {reason['detail']}"
            lines.append(textwrap.fill(text, width=width, initial_indent="  - ", subsequent_indent="    "))
        if diff["unexplained_bytes"]:
            lines.append(f"  ({diff['unexplained_bytes']:+,} bytes unexplained)")
    lines += ["", f"Megatron's whole-model activation estimate (theoretical_memory_usage, 1 pipeline stage): "
                  f"{report['megatron_total_bytes'] / (1 << 20):,.1f} MiB."]
    return "\n".join(lines)


def _write_out(path: Path, obj: Any) -> Path:
    from remat.report import write_json

    try:
        return write_json(path, obj)
    except OSError as err:
        raise ValueError(f"--out {path}: cannot write ({err.strerror or err})") from None


def _model_summary(config: ModelConfig) -> str:
    gqa = f", {config.query_groups} kv groups" if config.query_groups != config.num_attention_heads else ""
    return (f"{config.num_layers} layers, h={config.hidden_size}, {config.num_attention_heads} heads{gqa}, "
            f"ffn={config.ffn_size}, s={config.seq_length}, b={config.micro_batch_size}, vocab={config.vocab_size}, "
            f"{config.activation}/{config.normalization}/{config.position}/{config.attention}, {config.dtype}")


@command
def predict_command(sub: Subparsers) -> Runner:
    """``remat predict``: each policy's memory timeline, traced under FakeTensorMode (nothing is allocated)."""
    parser = add_subcommand(
        sub, "predict", help="predict peak memory of recompute policies without running the step",
        description="Predict one training step's memory (forward, loss, backward) of the reference GPT under each "
                    "recompute policy, without allocating it: the step runs under FakeTensorMode and a deep stack "
                    "is composed from a shallow trace. Prints each policy's peak, where it is, what is alive there "
                    "and the extra compute, then the published per-layer formulas beside the traced bytes, with the "
                    "reasons they differ.",
        epilog=POLICY_LIST_EPILOG)
    add_model_source_arguments(parser)
    add_parallel_arguments(parser)
    add_policy_arguments(parser)
    g = parser.add_argument_group("predict")
    g.add_argument("--engine", choices=ENGINES,
                   help="checkpoint implementation for policies without '@engine' (default reentrant, Megatron's)")
    g.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: exact storage bytes; cuda: each storage rounded up to the CUDA caching allocator's "
                        "512-byte blocks (the kernels traced are still the CPU ones) (default cpu)")
    g.add_argument("--adam", action="store_true",
                   help="include Adam: its two moments per parameter exist through the step, and optimizer.step() "
                        "is traced (a full trace per policy: slower for deep models)")
    g.add_argument("--json", action="store_true", help="print the JSON report instead of the table")
    g.add_argument("--out", type=Path, metavar="FILE", help="also write the JSON report to FILE (atomically)")
    return run_predict


def run_predict(args: argparse.Namespace) -> int:
    import time

    from remat.predict import predict, predict_config

    if args.pp:
        from remat.pipeline_cli import run_pipeline_predict

        return run_pipeline_predict(args)
    config = resolve_model_config(args)
    policies = resolve_cli_policies(args, config.num_layers)
    parallel = parallel_kwargs(args)
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    plain_cpu = None  # a no-recompute trace on CPU without optimizer: what the formulas are compared with
    bar = _Bar("remat predict")
    try:
        for i, policy in enumerate(policies):
            if len(policies) > 1:
                bar(i, len(policies), str(policy))
            t0 = time.perf_counter()
            if args.adam:  # a full trace: composition does not cover optimizer.step() (nor, yet, tp/sp here)
                timeline = predict(config, policy, optimizer=adam_steady_state, device=args.device, **parallel)
            else:
                timeline = predict_config(config, policy, device=args.device, **parallel)
                if policy.is_none and args.device == "cpu":
                    plain_cpu = timeline
            rows.append(prediction_row(policy, timeline, time.perf_counter() - t0))
        if len(policies) > 1:
            bar(len(policies), len(policies), "")
    finally:
        bar.close()
    if plain_cpu is None:
        plain_cpu = predict_config(config, "none", device="cpu", **parallel)
    formulas = formula_report(config, plain_cpu, **parallel)
    report = {
        "format": "remat.predict", "version": 1, "config": config.to_dict(), "device": args.device,
        "optimizer": "adam (states alive through the step)" if args.adam else None,
        "parallel": parallel, "rows": rows, "formulas": formulas, "seconds": time.perf_counter() - started,
    }
    if args.out is not None:
        _write_out(args.out, report)
    if args.json:
        print(_json_text(report))
    else:
        notes = ("params/grads/optim: parameters, their gradients, Adam states; inputs: checkpointed group inputs; "
                 "saved act: activations kept for backward; recompute: rebuilt in backward; head/loss: final norm, "
                 "logits, loss and their gradients; other: activation gradients, temporaries, the batch. extra "
                 "compute %: recompute FLOPs over forward + backward FLOPs (torch.utils.flop_counter; it counts 0 "
                 "for CPU fused attention, so sdpa models under-count recomputed attention).")
        if args.device == "cuda":
            notes += (" --device cuda rounds storages to 512-byte blocks but traces CPU kernels: float dropout "
                      "noise instead of 1-byte masks, LayerNorm statistics in the activation dtype, CPU attention "
                      "kernels.")
        print(f"{_model_summary(config)}; predicted on {args.device}"
              + (", with Adam" if args.adam else "") + "\n")
        print(format_prediction_table(rows))
        print("\n" + textwrap.fill(notes, width=110) + "\n")
        print(format_formula_report(formulas, config))
    if args.out is not None:
        _info(f"wrote {args.out}")
    return 0


# ----------------------------------------------------------------------------------------------- compare
def part_errors(predicted: dict[str, int], measured: dict[str, int], measured_peak: int) -> dict[str, float]:
    """Per at-peak category: (predicted - measured) / measured; a part measured as 0 bytes is taken relative to
    the measured peak instead (0.0 when both are 0), so every error is a finite fraction."""
    out = {}
    for key in measured:
        p, m = predicted.get(key, 0), measured[key]
        out[key] = (p - m) / m if m else ((p - m) / measured_peak if measured_peak else 0.0)
    return out


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


@command
def compare_command(sub: Subparsers) -> Runner:
    """``remat compare``: predicted against measured peaks on this machine, policy by policy."""
    parser = add_subcommand(
        sub, "compare", help="predict and measure the same steps here and report the error",
        description="Predict each policy's step (FakeTensorMode) and measure it on this machine with real tensors, "
                    "then report both peaks, the error of the prediction and the worst error among the parts alive "
                    "at the peak. Real tensors are allocated: use a config that fits in this machine's memory.",
        epilog=POLICY_LIST_EPILOG)
    add_model_source_arguments(parser)
    add_parallel_arguments(parser)
    add_policy_arguments(parser)
    add_measure_arguments(parser)
    g = parser.add_argument_group("compare")
    g.add_argument("--adam", action="store_true", help="include Adam (states alive through the step) on both sides")
    g.add_argument("--max-error", type=float, metavar="FRACTION",
                   help="exit with code 1 when a peak's |error| exceeds FRACTION (e.g. 0.01)")
    g.add_argument("--json", action="store_true", help="print the rows as a JSON list instead of the table")
    g.add_argument("--out", type=Path, metavar="FILE", help="also write the rows as JSON to FILE (atomically)")
    return run_compare


def run_compare(args: argparse.Namespace) -> int:
    import torch

    from remat.apply import apply
    from remat.measure import measure
    from remat.model import build_model, sample_batch
    from remat.predict import predict, predict_config

    if args.pp:
        from remat.pipeline_cli import run_pipeline_compare

        return run_pipeline_compare(args)
    config = resolve_model_config(args)
    policies = resolve_cli_policies(args, config.num_layers)
    parallel = parallel_kwargs(args)
    if parallel:
        raise ValueError("compare measures one unsharded process: --tp/--sp are for predict (real tensor-parallel "
                         "ranks are measured by remat.parallel.measure_tensor_parallel)")
    if args.max_error is not None and not args.max_error >= 0:
        raise ValueError(f"--max-error {args.max_error}: must be a fraction >= 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device here; compare measures on this machine, use "
                         "--device cpu")
    device = torch.device(args.device)
    predicted = []
    for policy in policies:
        if args.adam:
            predicted.append(predict(config, policy, optimizer=adam_steady_state, device=args.device, **parallel))
        else:
            predicted.append(predict_config(config, policy, device=args.device, **parallel))
    need = max(tl.peak_bytes for tl in predicted)
    available = _available_memory() if device.type == "cpu" else torch.cuda.mem_get_info(device)[0]
    if available is not None and need > 0.8 * available:
        raise ValueError(f"measuring needs about {need / (1 << 30):,.2f} GiB (the largest predicted peak) but "
                         f"{available / (1 << 30):,.2f} GiB is available on {device}: use a smaller config "
                         "(--layers, --seq, --batch, ...), or 'remat predict' alone")
    batch = sample_batch(config, device)
    rows: list[dict[str, Any]] = []
    bar = _Bar("remat compare")
    try:
        for i, (policy, pred) in enumerate(zip(policies, predicted)):
            bar(i, len(policies), str(policy))
            model = build_model(config, device, seed=0)
            apply(model, policy)
            optimizer = adam_steady_state(model.parameters()) if args.adam else None
            torch.manual_seed(0)
            meas = measure(model, batch, optimizer=optimizer)
            del model, optimizer
            errors = part_errors(pred.at_peak, meas.at_peak, meas.peak_bytes)
            worst: str | None = max(errors, key=lambda k: abs(errors[k]))
            worst_error = errors[worst] if worst else 0.0
            if worst_error == 0:
                worst = None
            rows.append({
                "policy": str(policy), "predicted_bytes": pred.peak_bytes, "measured_bytes": meas.peak_bytes,
                "error": (pred.peak_bytes - meas.peak_bytes) / meas.peak_bytes if meas.peak_bytes else 0.0,
                "predicted_phase": pred.peak_phase.label, "measured_phase": meas.peak_phase.label,
                "predicted_at_peak": pred.at_peak, "measured_at_peak": meas.at_peak,
                "part_errors": errors, "worst_part": worst, "worst_part_error": worst_error,
            })
        bar(len(policies), len(policies), "")
    finally:
        bar.close()
    if args.out is not None:
        _write_out(args.out, rows)
    if args.json:
        print(_json_text(rows))
    else:
        from remat.report import format_table

        unit, divisor = _unit(max(r["measured_bytes"] for r in rows))
        size = _size(divisor)
        pct = lambda v: f"{100 * v:+.2f}"
        print(f"{_model_summary(config)}; measured on {device}" + (", with Adam" if args.adam else "") + "\n")
        print(format_table(rows, [
            ("policy", "policy", str), ("predicted_bytes", f"predicted {unit}", size),
            ("measured_bytes", f"measured {unit}", size), ("error", "error %", pct),
            ("measured_phase", "measured peak in", str), ("worst_part", "worst part", lambda v: v or "-"),
            ("worst_part_error", "part error %", pct)]))
        worst_row = max(rows, key=lambda r: abs(r["error"]))
        print(f"\nworst peak error {100 * worst_row['error']:+.3f}% ({worst_row['policy']}); worst part error "
              f"{100 * max(abs(r['worst_part_error']) for r in rows):.3f}%. error = (predicted - measured) / "
              "measured; a part measured as 0 is taken relative to the peak.")
    if args.out is not None:
        _info(f"wrote {args.out}")
    if args.max_error is not None and any(abs(r["error"]) > args.max_error for r in rows):
        _info(f"remat compare: a peak error exceeds --max-error {args.max_error}")
        return 1
    return 0


# ------------------------------------------------------------------------------------------------ plan
@command
def plan_command(sub: Subparsers) -> Runner:
    """``remat plan``: the cheapest recompute plan whose predicted peak fits a memory budget."""
    from remat.plan import DEFAULT_RESERVE, GPU_PRESETS, OBJECTIVES

    parser = add_subcommand(
        sub, "plan", help="the cheapest recompute plan that fits a memory budget, guaranteed by the trace",
        description="Find the recompute plan of least extra compute whose predicted peak memory fits --budget: the "
                    "best Megatron-LM setting (every uniform/block/selective setting, predicted) and the best "
                    "extended plan (per-layer keep / selective / checkpoint groups of any size / offloaded groups, "
                    "found by an exact dynamic program and checked with the real trace), for one process, one "
                    "tensor-parallel rank (--tp, --sp) or each pipeline stage (--pp). Exit code 1 when no plan "
                    "fits: the smallest reachable peak and its plan are printed.")
    add_model_source_arguments(parser)
    g = parser.add_argument_group("plan")
    g.add_argument("--budget", required=True, metavar="SIZE",
                   help="device memory for the step: bytes with a unit (70GiB, 75GB, 512MiB; KiB/MiB/GiB are powers "
                        f"of 2, KB/MB/GB of 10) or a GPU ({', '.join(GPU_PRESETS)}) minus --reserve")
    g.add_argument("--reserve", default=DEFAULT_RESERVE, metavar="R",
                   help="what a GPU budget keeps free: a percentage, a fraction or bytes (default "
                        f"{DEFAULT_RESERVE.replace('%', '%%')})")
    g.add_argument("--objective", choices=OBJECTIVES, default="extra_flops",
                   help="minimise recomputed FLOPs (default) or estimated seconds")
    g.add_argument("--measured-times", action="store_true",
                   help="price recompute by layer/submodule forward times measured on this machine (real tensors)")
    g.add_argument("--engine", choices=ENGINES, default="reentrant",
                   help="checkpoint implementation (default reentrant, Megatron's; offload needs it)")
    g.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: exact storage bytes; cuda: 512-byte allocator blocks (default cpu)")
    g.add_argument("--no-offload", action="store_true", help="do not offload group inputs to host memory")
    g.add_argument("--bandwidth", type=float, default=25.0, metavar="GB/S",
                   help="host-device bandwidth for offload, GB/s (default 25, PCIe 4 x16)")
    g.add_argument("--throughput", type=float, default=400.0, metavar="TFLOP/S",
                   help="compute throughput that converts seconds and FLOPs (default 400)")
    g.add_argument("--memory-bandwidth", type=float, default=3000.0, metavar="GB/S",
                   help="device memory bandwidth that prices recomputed bytes under --objective time (default 3000)")
    g.add_argument("--selective-modules", default=",".join(SELECTIVE_MODULES), metavar="M1,M2",
                   help="modules selective layers may recompute (default all: "
                        f"{','.join(SELECTIVE_MODULES)}; non_matmul is operator-level, see remat.policy)")
    g.add_argument("--tp", type=int, default=1, metavar="T",
                   help="tensor-parallel size: plan one rank (Megatron's sharding of heads, MLP and vocabulary)")
    g.add_argument("--sp", action="store_true", help="with --tp: sequence parallelism")
    g.add_argument("--pp", type=int, metavar="P", help="pipeline stages: also plan each stage separately")
    g.add_argument("--microbatches", type=int, metavar="M", help="microbatches per step with --pp (default P)")
    g.add_argument("--schedule", default="1f1b", metavar="NAME", help="pipeline schedule with --pp (default 1f1b)")
    g.add_argument("--json", action="store_true", help="print the JSON report instead of the text")
    g.add_argument("--out", type=Path, metavar="FILE", help="also write the JSON report to FILE")
    return run_plan


def run_plan(args: argparse.Namespace) -> int:
    from remat.plan import BudgetError, plan, selective_sets

    config = resolve_model_config(args)
    try:
        result = plan(config, args.budget, objective=args.objective, engine=args.engine, device=args.device,
                      offload=not args.no_offload, bandwidth=args.bandwidth * 1e9,
                      flops_per_second=args.throughput * 1e12, memory_bandwidth=args.memory_bandwidth * 1e9,
                      measured_times=args.measured_times, selective_sets=selective_sets(args.selective_modules),
                      reserve=args.reserve, pp=args.pp, microbatches=args.microbatches, schedule=args.schedule,
                      tp=args.tp, sp=args.sp)
    except BudgetError as err:
        report = {"format": "remat.plan-result", "version": 1, "config": config.to_dict(), "fits": False,
                  "budget_bytes": err.budget_bytes, "min_peak_bytes": err.min_peak_bytes,
                  "min_peak_plan": err.plan.to_dict(), "message": str(err)}
        if args.out is not None:
            _write_out(args.out, report)
        if args.json:
            print(_json_text(report))
        else:
            print(f"remat plan: {err}")
            print(err.plan.snippet())
        return 1
    report = result.to_dict()
    report["fits"] = True
    if args.out is not None:
        written = _write_out(args.out, report)
        _info(f"wrote {written}")
    print(_json_text(report) if args.json else result.format())
    return 0


# ------------------------------------------------------------------------------------------------ main
def _add_debug(parser: argparse.ArgumentParser, default: Any) -> None:
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
    _add_debug(parser, argparse.SUPPRESS)
    return parser


POLICY_LIST_EPILOG = "policy syntax (--policy takes one policy or a comma-separated list):\n" + GRAMMAR


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


import remat.pipeline_cli  # noqa: E402,F401  registers `remat measure` (it imports this module's helpers)
