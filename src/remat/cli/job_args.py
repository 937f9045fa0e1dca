"""The whole-job flags of predict, compare and plan (NOTE [the job path]) and the :class:`~remat.job.Job` they
describe: ``--megatron-args`` (Megatron-LM's own flags, or @FILE) or the model and parallel flags with ``--dp``,
``--cp``, ``--distributed-optimizer``, ``--optimizer`` and ``--precision``."""

from __future__ import annotations

import argparse
import dataclasses
import textwrap
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from remat.cli.common import positive_number, resolve_cli_policies, resolve_model_config, sized
from remat.job import OPTIMIZERS, PRECISIONS, Job
from remat.job_flags import RECOMPUTE_FLAGS, JobError, flag_tokens
from remat.job_input import lower_bound_line, read_megatron_job, routing_line
from remat.job_launch import launcher_env
from remat.job_pipeline import FLAG_OF, layout_vpp
from remat.megatron_script import DEFAULT_TIMEOUT, ScriptError, ScriptLaunch, read_launch_script
from remat.policy import Policy
from remat.units import GPU_PRESETS

# ------------------------------------------------------------------------------------------------ a whole job
# NOTE [the job path]: --megatron-args or any of the job flags (--dp, --cp, --distributed-optimizer, --optimizer,
# --precision) make predict/compare/plan describe a whole Megatron-LM job (remat.job.Job): every part of every
# rank. Without them the single-process commands run as before. A flag the job path cannot honour is refused, by
# name, with the fix; so is a flag that --megatron-args already sets (the job has one source).
PIPELINE_SPLIT = tuple(FLAG_OF)  # the Job fields of an uneven pipeline split, each a flag of the same name
JOB_FLAGS = ("megatron_args", "megatron_script", "world_size", "allow_unmodelled", "script_timeout",
             "dp", "cp", "ep", "etp", "distributed_optimizer", "optimizer", "precision",
             *PIPELINE_SPLIT)
# CLI flag -> the Megatron flag that sets it inside --megatron-args
_MEGATRON_NAME = {
    "preset": "the model flags (--num-layers, --hidden-size, ...)", "config": "the model flags (--num-layers, ...)",
    "tp": "--tensor-model-parallel-size", "sp": "--sequence-parallel", "pp": "--pipeline-model-parallel-size",
    "vpp": "--num-virtual-stages-per-pipeline-rank", "microbatches": "--global-batch-size",
    "schedule": "--num-virtual-stages-per-pipeline-rank (interleaved) or nothing (1f1b)",
    "dp": "--data-parallel-size or --world-size", "cp": "--context-parallel-size",
    "ep": "--expert-model-parallel-size", "etp": "--expert-tensor-parallel-size",
    "distributed_optimizer": "--use-distributed-optimizer", "optimizer": "--optimizer", "precision": "--bf16/--fp16",
    "dropout": "--hidden-dropout/--attention-dropout", "layers": "--num-layers", "hidden": "--hidden-size",
    "heads": "--num-attention-heads", "query_groups": "--num-query-groups", "ffn": "--ffn-hidden-size",
    "seq": "--seq-length", "batch": "--micro-batch-size", "vocab": "--vocab-size", "activation": "--swiglu",
    "normalization": "--normalization", "position": "--position-embedding-type", "attention": "--attention-backend",
    "dtype": "--bf16/--fp16", **FLAG_OF,
}


def add_job_arguments(parser: argparse.ArgumentParser) -> None:
    """The whole-job flags (NOTE [the job path]): ``--megatron-args``, ``--dp``, ``--cp``,
    ``--distributed-optimizer``, ``--optimizer``, ``--precision``."""
    g = parser.add_argument_group("whole Megatron-LM job (any of these: every part of every rank)", textwrap.fill(
        "with any of these flags the job's every rank is priced: parameters, fp32 main gradients, master parameters, "
        "optimizer state, activations of the microbatches in flight and communication buffers, worst rank first; "
        "TP, SP, PP, CP and DP together. Unset, --precision is the model's dtype (bf16/fp16: Megatron's mixed "
        "precision) and --optimizer adam", width=76))
    g.add_argument("--megatron-args", metavar="'ARGS'|@FILE",
                   help="Megatron-LM's own pretrain_gpt.py flags in one string, or @FILE holding them (# comments "
                        "allowed): model, parallel sizes, batch, precision, optimizer and --recompute-* flags; flags "
                        "that do not change memory are listed as ignored, unknown ones refused")
    g.add_argument("--world-size", type=sized("world_size"), metavar="N",
                   help="with --megatron-args/--megatron-script: the number of ranks, replacing what the launch line "
                        "gives (torchrun's --nproc_per_node x --nnodes, srun's tasks, ...); without either, one "
                        "data-parallel rank is assumed and the answer's first line says so")
    g.add_argument("--allow-unmodelled", action="append", metavar="FLAG,...",
                   help="with --megatron-args/--megatron-script: price the job without these refused flags (or "
                        "patterns: '--fp8-*'); every line of the answer is then stamped as a lower bound naming them. "
                        "Only flags refused because remat cannot model them, and not those that save memory")
    g.add_argument("--script-timeout", type=positive_number, metavar="S",
                   help=f"with --megatron-script: seconds the script may run while it is read (default "
                        f"{DEFAULT_TIMEOUT:g})")
    g.add_argument("--megatron-script", nargs=argparse.REMAINDER, metavar="SCRIPT [ARGS]",
                   help="a Megatron-LM launch script and its arguments (everything after it goes to the script: give "
                        "it last): remat runs it in a sandbox where nothing it calls runs (a restricted bash whose "
                        "launchers torchrun, python, srun, mpirun, deepspeed only record their command line), prices "
                        "the training launch it makes and says which line that was")
    g.add_argument("--dp", type=sized("dp"), metavar="D", help="data-parallel size (default 1)")
    g.add_argument("--cp", type=sized("cp"), metavar="C",
                   help="context-parallel size: each rank holds s/cp tokens, plus ring attention's K/V buffers")
    g.add_argument("--ep", type=sized("ep"), metavar="E",
                   help="expert-parallel size (Megatron's --expert-model-parallel-size, MoE models): each rank holds "
                        "num_moe_experts/ep experts and exchanges routed tokens all-to-all; dp must be a multiple of "
                        "ep (default: the model's, 1)")
    g.add_argument("--etp", type=sized("etp"), metavar="T",
                   help="the experts' tensor-parallel size (Megatron's --expert-tensor-parallel-size, MoE models): "
                        "each expert split over etp ranks, its tokens gathered over them; ep x etp must divide "
                        "tp x cp x dp (default: tp)")
    g.add_argument("--distributed-optimizer", action="store_true", default=None,
                   help="Megatron's --use-distributed-optimizer: master params and optimizer state sharded over dp")
    g.add_argument("--optimizer", choices=OPTIMIZERS,
                   help="adam (two fp32 moments; default), sgd (no momentum), muon (one fp32 momentum on matrices, "
                        "Adam on embeddings and norms; layer-wise sharded with --distributed-optimizer) or none "
                        "(no optimizer state)")
    g.add_argument("--precision", choices=PRECISIONS,
                   help="fp32, or Megatron's bf16/fp16 mixed precision: 2-byte parameters, fp32 main grads and "
                        "master parameters (default: the model's dtype)")
    # Megatron's uneven pipeline splits, under Megatron's names (remat.job_pipeline)
    g.add_argument("--decoder-first-pipeline-num-layers", type=sized("num_layers"), metavar="N",
                   help="decoder layers of the first pipeline stage; the middle stages share the rest evenly")
    g.add_argument("--decoder-last-pipeline-num-layers", type=sized("num_layers"), metavar="N",
                   help="decoder layers of the last pipeline stage")
    g.add_argument("--account-for-embedding-in-pipeline-split", action="store_true", default=None,
                   help="count the embedding as a layer of the first chunk (it builds one decoder layer fewer)")
    g.add_argument("--account-for-loss-in-pipeline-split", action="store_true", default=None,
                   help="count the loss as a layer of the last chunk (it builds one decoder layer fewer)")
    g.add_argument("--pipeline-model-parallel-layout", metavar="LAYOUT",
                   help="every chunk's layers, e.g. 'Et*3|(tt|)*29,t|L' (E embedding, t decoder layer, L loss, | "
                        "between chunks in global order); implies --vpp")


def add_page_arguments(group: argparse.ArgumentParser, *, gpu: bool = False) -> None:
    """``--html FILE`` (and, with ``gpu``, ``--gpu NAME``) of predict and plan: the job's page
    (:mod:`remat.analysis.job_html`), drawn against the GPU's memory or the budget."""
    group.add_argument("--html", type=Path, metavar="FILE",
                       help="with a whole job: also write one self-contained page (inline SVG, opens offline): every "
                            "distinct rank's parts at its peak against the capacity, the worst rank's memory through "
                            "the step against its pipeline schedule, what is alive at its peak, each policy's worst "
                            "rank beside the others")
    if gpu:
        group.add_argument("--gpu", type=gpu_preset, metavar="NAME",
                           help=f"with a whole job: the GPU it runs on ({', '.join(GPU_PRESETS)}): its memory is the "
                                "capacity the text and --html's page compare each rank with, its architecture sizes "
                                "the GEMM workspaces (default: Hopper's workspaces, no capacity)")


def gpu_preset(text: str) -> str:
    """``--gpu``'s value: a :data:`remat.units.GPU_PRESETS` name (any case)."""
    name = text.strip().lower()
    if name not in GPU_PRESETS:
        raise argparse.ArgumentTypeError(f"unknown GPU {text!r}: use one of {', '.join(GPU_PRESETS)}")
    return name


def refuse_page_flags(args: argparse.Namespace, why: str) -> None:
    """Refuse ``--html``/``--gpu`` where no whole job is priced (``why`` says what runs instead)."""
    for name, what, fix in (("html", "draws a whole Megatron job's ranks", "remat explain --html"),
                            ("gpu", "compares a whole Megatron job's ranks with the GPU",
                             f"remat plan --budget {getattr(args, 'gpu', '')}")):
        if getattr(args, name, None) is not None:
            raise ValueError(f"--{name} {what}, and {why}: add the job flags (--dp, "
                             f"--optimizer, --megatron-args, ...), or use {fix} for one process")


def job_flags_given(args: argparse.Namespace) -> list[str]:
    """The job flags on the command line, as written (``['--dp', '--megatron-args']``)."""
    return [flag_name(name) for name in JOB_FLAGS if getattr(args, name, None) is not None]


def refuse_job_flags(args: argparse.Namespace, command: str, fix: str) -> None:
    """Refuse the job flags in a command that does not price a whole job (never ignore them silently)."""
    given = job_flags_given(args)
    if given:
        raise ValueError(f"{' '.join(given)}: 'remat {command}' does not price a whole Megatron job yet; {fix}")


@dataclasses.dataclass(frozen=True)
class JobSource:
    """A :class:`Job` read from the command line, with what the output must say about it."""

    job: Job
    ignored: list[str]  # Megatron flags accepted that do not change memory
    assumed: list[str]  # defaults remat took for flags not given
    recompute_given: bool  # --megatron-args holds --recompute-* flags (the job's policy)
    env: dict[str, str] = dataclasses.field(default_factory=dict)  # what the launch line sets (VAR=value ...)
    first_lines: tuple[str, ...] = ()  # what the answer starts with: assumed world size, the script's launch, ...
    details: dict[str, Any] = dataclasses.field(default_factory=dict)  # the same, for the JSON report ("input")
    unmodelled: tuple[str, ...] = ()  # refused flags priced without (--allow-unmodelled): the answer is a lower bound

    def notes(self) -> list[str]:
        """The lines every job report prints about its input."""
        out = []
        if self.assumed:
            out.append("assumed (Megatron's defaults; set them to change): " + "; ".join(self.assumed))
        if self.ignored:
            out.append("ignored Megatron flags (they do not change memory): " + " ".join(self.ignored))
        routing = routing_line(self.job)
        if routing:
            out.append(routing)
        return out


def _read_script(args: argparse.Namespace) -> ScriptLaunch:
    """``--megatron-script SCRIPT [ARGS]``: the launch it makes (:func:`remat.megatron_script.read_launch_script`)."""
    script, *script_args = args.megatron_script or [""]
    if not script:
        raise ValueError("--megatron-script needs the launch script: --megatron-script train.sh [ARGS...], last on "
                         "the command line")
    try:
        return read_launch_script(script, script_args,
                                  timeout=getattr(args, "script_timeout", None) or DEFAULT_TIMEOUT)
    except ScriptError as err:
        raise ScriptError(f"--megatron-script {err}") from None


def _given(args: argparse.Namespace, name: str) -> bool:
    value = getattr(args, name, None)
    return value not in (None, False) and not (name == "tp" and value == 1) and not (
        name == "schedule" and value == "1f1b" and getattr(args, "pp", None) is None)


def job_from_args(args: argparse.Namespace, *, default_microbatches: Callable[[int], int]) -> JobSource:
    """The :class:`Job` of ``--megatron-args``, or of the model, parallel and job flags (NOTE [the job path]).

    Args:
        args: the parsed command line.
        default_microbatches: microbatches per step when ``--microbatches`` is not given, from pp.

    Returns:
        A :class:`JobSource`. Raises JobError/ValueError naming the flag and the fix.
    """
    script = getattr(args, "megatron_script", None)
    if args.megatron_args is not None or script is not None:
        given = "--megatron-script" if script is not None else "--megatron-args"
        if script is not None and args.megatron_args is not None:
            raise ValueError("--megatron-script with --megatron-args: the job has one source; drop one")
        if script is None and getattr(args, "script_timeout", None) is not None:
            raise ValueError("--script-timeout needs --megatron-script (it bounds reading a launch script): drop it")
        for name in (*_MEGATRON_NAME, "layout", "partial_checkpoint_microbatches"):
            if name != "megatron_args" and _given(args, name):
                where = _MEGATRON_NAME.get(name)
                fix = f"give it there as {where}" if where else "drop it"
                raise ValueError(f"{flag_name(name)} with {given}: the job comes from the Megatron flags; {fix}")
        launch = _read_script(args) if script is not None else None
        text: str | list[str] = launch.argv if launch is not None else args.megatron_args.strip()
        if not text:
            raise JobError("--megatron-args is empty: give Megatron's flags ('--num-layers 32 ...') or @FILE")
        allow = [f for item in getattr(args, "allow_unmodelled", None) or () for f in item.split(",") if f.strip()]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            read = read_megatron_job(text, world_size=getattr(args, "world_size", None), allow_unmodelled=allow)
        job, ignored = read.job, read.ignored
        assumed = [str(w.message) for w in caught]
        if getattr(args, "moe_routing", None) is not None:  # remat's prediction setting: no Megatron flag sets it
            job = job.replace(model=job.model.replace(moe_routing_assumption=args.moe_routing))
        tokens, launcher = flag_tokens(text)
        recompute = any(t.partition("=")[0] in RECOMPUTE_FLAGS or t.startswith("--recompute-") for t in tokens)
        env = {**(launcher_env(launcher[0]) if launcher else {}), **(launch.env if launch else {})}
        # the answer's first lines: an assumed world size, the script's launch, what a lower bound leaves out
        lines = [*([read.world_size_note] if read.world_size_note else []), *(launch.lines() if launch else []),
                 *([lower_bound_line(read.unmodelled)] if read.unmodelled else [])]
        details = {**read.to_dict(), **({"script": launch.to_dict()} if launch else {})}
        return JobSource(job, ignored, assumed, recompute, env, tuple(lines), details, read.unmodelled)
    for name in ("world_size", "allow_unmodelled", "script_timeout"):
        if getattr(args, name, None) is not None:
            needs = "--megatron-script" if name == "script_timeout" else "--megatron-args or --megatron-script"
            raise ValueError(f"{flag_name(name)} needs {needs} (it applies to a Megatron job read from its flags)"
                             + ("; with the model flags give --dp" if name == "world_size" else "") + ": drop it")
    for name, fix in (("layout", "give Megatron's --decoder-first/last-pipeline-num-layers or "
                                 "--pipeline-model-parallel-layout instead"),
                      ("partial_checkpoint_microbatches", "the job path does not model it yet")):
        if getattr(args, name, None) is not None:
            raise ValueError(f"{flag_name(name)} with a whole job: {fix}; drop {flag_name(name)}")
    if getattr(args, "pipeline_runtime", None) not in (None, "megatron"):
        raise ValueError(f"--pipeline-runtime {args.pipeline_runtime} with a whole job: a job runs Megatron's "
                         "pipeline; drop it (or use --pipeline-runtime megatron)")
    if getattr(args, "timeout", None) is not None and not hasattr(args, "max_error"):
        raise ValueError(f"--timeout {args.timeout:g} bounds real runs and a prediction runs none: drop --timeout")
    config = resolve_model_config(args)
    assumed = []
    precision = args.precision
    if precision is None:
        precision = config.dtype
        mixed = ", Megatron mixed precision: fp32 main grads and master params" if precision != "fp32" else ""
        assumed.append(f"--precision {precision} (the model's dtype{mixed})")
    optimizer = args.optimizer
    if optimizer is None:
        optimizer = "adam"
        assumed.append("--optimizer adam (fp32 moments)")
    if args.dp is None:
        assumed.append("--dp 1")
    ep = args.ep or config.expert_model_parallel_size
    pp = getattr(args, "pp", None) or 1
    vpp = getattr(args, "vpp", None)
    split = {name: getattr(args, name, None) for name in PIPELINE_SPLIT}
    split = {k: bool(v) if k.startswith("account") else v for k, v in split.items()}
    if vpp is None and split["pipeline_model_parallel_layout"] is not None:
        vpp = layout_vpp(split["pipeline_model_parallel_layout"], pp)  # Megatron reads vpp from the layout
    vpp = None if vpp in (None, 1) else vpp
    microbatches = getattr(args, "microbatches", None) or default_microbatches(pp)
    schedule = getattr(args, "schedule", None) or ("interleaved" if vpp else "1f1b")
    job = Job.build(config, precision=precision, tp=args.tp, sp=args.sp, pp=pp, vpp=vpp, cp=args.cp or 1,
                    dp=args.dp or 1, ep=ep, etp=args.etp, num_microbatches=microbatches, schedule=schedule,
                    optimizer=optimizer, distributed_optimizer=bool(args.distributed_optimizer), **split)
    return JobSource(job, [], assumed, False)


def job_policies(args: argparse.Namespace, source: JobSource) -> list[Policy]:
    """The policies a job command runs: ``--policy``/``--sweep`` (none first; each must fit a model chunk), else
    the job's own (``--recompute-*`` in ``--megatron-args``, or none); ``--engine`` applied."""
    job = source.job
    if getattr(args, "policy", None) or getattr(args, "sweep", None):
        if source.recompute_given:
            raise ValueError("--policy/--sweep with --recompute-* flags in --megatron-args: the job has one "
                             "source of its recompute policy; drop one of them")
        return resolve_cli_policies(args, min(n for n in job.chunk_layers if n), job.model)  # fits every chunk
    policy = job.policy
    engine = getattr(args, "engine", None)
    if engine:
        policy = dataclasses.replace(policy, engine=engine)
    return [policy]


def flag_name(name: str) -> str:
    """``'distributed_optimizer'`` -> ``'--distributed-optimizer'``."""
    return "--" + name.replace("_", "-")
