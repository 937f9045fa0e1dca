"""The whole-job flags of predict, compare and plan (NOTE [the job path]) and the :class:`~remat.job.Job` they
describe: ``--megatron-args`` (Megatron-LM's own flags, or @FILE) or the model and parallel flags with ``--dp``,
``--cp``, ``--distributed-optimizer``, ``--optimizer`` and ``--precision``."""

from __future__ import annotations

import argparse
import dataclasses
import textwrap
import warnings
from collections.abc import Callable

from remat.cli.common import positive_int, resolve_cli_policies, resolve_model_config
from remat.job import OPTIMIZERS, PRECISIONS, Job, parse_megatron_args
from remat.job_flags import RECOMPUTE_FLAGS, JobError, flag_tokens
from remat.job_pipeline import FLAG_OF, layout_vpp
from remat.policy import Policy

# ------------------------------------------------------------------------------------------------ a whole job
# NOTE [the job path]: --megatron-args or any of the job flags (--dp, --cp, --distributed-optimizer, --optimizer,
# --precision) make predict/compare/plan describe a whole Megatron-LM job (remat.job.Job): every part of every
# rank. Without them the single-process commands run as before. A flag the job path cannot honour is refused, by
# name, with the fix; so is a flag that --megatron-args already sets (the job has one source).
PIPELINE_SPLIT = tuple(FLAG_OF)  # the Job fields of an uneven pipeline split, each a flag of the same name
JOB_FLAGS = ("megatron_args", "dp", "cp", "ep", "etp", "distributed_optimizer", "optimizer", "precision",
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
    g.add_argument("--dp", type=positive_int, metavar="D", help="data-parallel size (default 1)")
    g.add_argument("--cp", type=positive_int, metavar="C",
                   help="context-parallel size: each rank holds s/cp tokens, plus ring attention's K/V buffers")
    g.add_argument("--ep", type=positive_int, metavar="E",
                   help="expert-parallel size (Megatron's --expert-model-parallel-size, MoE models): each rank holds "
                        "num_moe_experts/ep experts and exchanges routed tokens all-to-all; dp must be a multiple of "
                        "ep (default: the model's, 1)")
    g.add_argument("--etp", type=positive_int, metavar="T",
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
    g.add_argument("--decoder-first-pipeline-num-layers", type=positive_int, metavar="N",
                   help="decoder layers of the first pipeline stage; the middle stages share the rest evenly")
    g.add_argument("--decoder-last-pipeline-num-layers", type=positive_int, metavar="N",
                   help="decoder layers of the last pipeline stage")
    g.add_argument("--account-for-embedding-in-pipeline-split", action="store_true", default=None,
                   help="count the embedding as a layer of the first chunk (it builds one decoder layer fewer)")
    g.add_argument("--account-for-loss-in-pipeline-split", action="store_true", default=None,
                   help="count the loss as a layer of the last chunk (it builds one decoder layer fewer)")
    g.add_argument("--pipeline-model-parallel-layout", metavar="LAYOUT",
                   help="every chunk's layers, e.g. 'Et*3|(tt|)*29,t|L' (E embedding, t decoder layer, L loss, | "
                        "between chunks in global order); implies --vpp")


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

    def notes(self) -> list[str]:
        """The lines every job report prints about its input."""
        out = []
        if self.assumed:
            out.append("assumed (Megatron's defaults; set them to change): " + "; ".join(self.assumed))
        if self.ignored:
            out.append("ignored Megatron flags (they do not change memory): " + " ".join(self.ignored))
        return out


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
    if args.megatron_args is not None:
        for name in (*_MEGATRON_NAME, "layout", "partial_checkpoint_microbatches"):
            if name != "megatron_args" and _given(args, name):
                where = _MEGATRON_NAME.get(name)
                fix = f"give it there as {where}" if where else "drop it"
                raise ValueError(f"{flag_name(name)} with --megatron-args: the job comes from the Megatron flags; "
                                 f"{fix}")
        text = args.megatron_args.strip()
        if not text:
            raise JobError("--megatron-args is empty: give Megatron's flags ('--num-layers 32 ...') or @FILE")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            job, ignored = parse_megatron_args(text)
        assumed = [str(w.message) for w in caught]
        if getattr(args, "moe_routing", None) is not None:  # remat's prediction setting: no Megatron flag sets it
            job = job.replace(model=job.model.replace(moe_routing_assumption=args.moe_routing))
        tokens, _ = flag_tokens(text)
        recompute = any(t.partition("=")[0] in RECOMPUTE_FLAGS or t.startswith("--recompute-") for t in tokens)
        return JobSource(job, ignored, assumed, recompute)
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
