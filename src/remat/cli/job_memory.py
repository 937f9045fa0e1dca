"""``--alloc-conf``, ``--snapshot`` and the budgeted memory of ``remat predict``/``plan`` for a whole job: the
caching-allocator options of the reserved-memory replay (:func:`remat.parallel.job_predict.add_reserved`), the worst
rank's step for PyTorch's memory viewer (:mod:`remat.analysis.snapshot`), and whether a plan budgets reserved or
allocated memory (:mod:`remat.plan.job_reserved`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from remat.analysis.snapshot import write_memory_snapshot
from remat.cli.common import writing
from remat.cli.job_args import JobSource
from remat.memory.alloc_config import AllocatorConfig, allocator_config_of_env
from remat.parallel.job_predict import RankPrediction
from remat.units import GPU_PRESETS


def alloc_conf(text: str) -> AllocatorConfig:
    """``--alloc-conf``'s value: ``PYTORCH_CUDA_ALLOC_CONF`` options (:meth:`AllocatorConfig.parse`)."""
    try:
        return AllocatorConfig.parse(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_memory_arguments(group: argparse.ArgumentParser, *, plan: bool = False) -> None:
    """``--alloc-conf`` and ``--snapshot`` (and, for ``plan``, ``--budget-allocated``)."""
    group.add_argument("--alloc-conf", type=alloc_conf, metavar="OPTIONS",
                       help="PYTORCH_CUDA_ALLOC_CONF options of the caching-allocator replay that predicts reserved "
                            "memory (max_memory_reserved, what a GPU runs out of), e.g. 'expandable_segments:True' or "
                            "'max_split_size_mb:512' (default: PyTorch's defaults, or what the --megatron-args launch "
                            "line sets: PYTORCH_CUDA_ALLOC_CONF=... torchrun ...)")
    group.add_argument("--snapshot", type=Path, metavar="FILE",
                       help="with a whole job: also write the worst rank's step (of the first policy, or of the plan) "
                            "as a torch.cuda.memory._snapshot() pickle for https://pytorch.org/memory_viz, each "
                            "block's module and phase as its frames")
    if plan:
        group.add_argument("--budget-allocated", action="store_true",
                           help="with a whole job and a GPU budget: budget allocated bytes (max_memory_allocated) "
                                "instead of reserved memory (the default there: the caching allocator's segments, "
                                "replayed from each rank's step)")


def refuse_memory_flags(args: argparse.Namespace, why: str, *, alloc_conf_too: bool = True) -> None:
    """Refuse ``--snapshot`` (and ``--alloc-conf``) where no whole job is priced (``why`` says what runs)."""
    if getattr(args, "snapshot", None) is not None:
        raise ValueError(f"--snapshot writes a whole job's worst rank, and {why}: add the job flags (--dp, "
                         "--optimizer, --megatron-args, ...), or use remat explain --snapshot for one process")
    if alloc_conf_too and getattr(args, "alloc_conf", None) is not None:
        raise ValueError(f"--alloc-conf sets the options of the caching-allocator replay, and {why}, which replays "
                         "nothing: drop --alloc-conf, or price GPU bytes (--kernels cuda or te, or a whole job)")


def job_allocator(args: argparse.Namespace, source: JobSource) -> tuple[AllocatorConfig | None, str]:
    """The allocator options of a job's replay and where they come from: ``--alloc-conf``, else the
    ``PYTORCH_CUDA_ALLOC_CONF`` (or ``PYTORCH_ALLOC_CONF``) that ``--megatron-args``' launch line sets, else
    PyTorch's defaults (``(None, '')``). Both given: refused, the job has one source."""
    given = getattr(args, "alloc_conf", None)
    try:
        from_env = allocator_config_of_env(source.env)
    except ValueError as err:
        raise ValueError(f"--megatron-args: its launch line's {err}") from None
    if given is not None and from_env is not None:
        raise ValueError(f"--alloc-conf with {from_env[0]}={source.env[from_env[0]]} in --megatron-args' launch line: "
                         "the job has one source of its allocator options: drop one of them")
    if given is not None:
        return given, "--alloc-conf"
    if from_env is not None:
        return from_env[1], f"the launch line's {from_env[0]}"
    return None, ""


def budgets_reserved(args: argparse.Namespace) -> bool:
    """Whether ``remat plan`` of a job budgets reserved memory: with a GPU preset budget (what a GPU runs out of)
    unless ``--budget-allocated``, or with ``--budget-reserved``; a byte budget budgets allocated bytes."""
    if getattr(args, "budget_reserved", False) and getattr(args, "budget_allocated", False):
        raise ValueError("--budget-reserved with --budget-allocated: a plan budgets one of them; drop one")
    if getattr(args, "budget_reserved", False):
        return True
    return not getattr(args, "budget_allocated", False) and str(args.budget).strip().lower() in GPU_PRESETS


def write_snapshot(args: argparse.Namespace, report: dict[str, Any], rank: RankPrediction | None,
                   what: str) -> str | None:
    """``--snapshot FILE``: ``rank``'s step as a memory snapshot, written atomically; its path goes into the
    report's ``files``; returns the line the text ends with (None without --snapshot)."""
    path = getattr(args, "snapshot", None)
    if path is None:
        return None
    if rank is None:
        return f"snapshot: not written: {what}"
    with writing("--snapshot", path):
        write_memory_snapshot(rank.timeline, path)
    report.setdefault("files", {})["snapshot"] = str(path)
    return (f"snapshot: {path} ({what}: rank {rank.rank}, stage {rank.stage}); open it in "
            "https://pytorch.org/memory_viz")
