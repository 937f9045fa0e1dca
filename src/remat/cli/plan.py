"""`remat plan`: the cheapest recompute plan that fits a budget."""

from __future__ import annotations

import argparse
from pathlib import Path

from remat.cli.common import (
    Runner,
    Subparsers,
    add_model_source_arguments,
    add_subcommand,
    check_writable,
    count_or_all,
    info,
    json_text,
    non_negative_int,
    positive_number,
    resolve_model_config,
    sized,
    write_out,
)
from remat.cli.job import job_requested, run_plan_job
from remat.cli.job_args import add_job_arguments, add_page_arguments, refuse_page_flags
from remat.cli.job_memory import add_memory_arguments, budgets_reserved, refuse_memory_flags
from remat.memory import disk_cache
from remat.memory.reserved import REPLAY_NOTE, format_reserved
from remat.offload_policy import MIN_OFFLOADED_TENSOR_SIZE
from remat.plan.api import BudgetError, plan
from remat.plan.costs import ROOFLINES
from remat.plan.options import DEFAULT_FLOPS, DEFAULT_MEMORY_BANDWIDTH, OptionError, ParallelOptions, PlanOptions
from remat.plan.reserved import plan_reserved
from remat.plan.space import OBJECTIVES
from remat.policy import ENGINES, SELECTIVE_MODULES
from remat.units import DEFAULT_RESERVE, GPU_PRESETS, SizeError, format_bytes, parse_budget


# ------------------------------------------------------------------------------------------------ plan
def plan_command(sub: Subparsers) -> Runner:
    """``remat plan``: the cheapest recompute plan whose predicted peak fits a memory budget."""

    parser = add_subcommand(
        sub, "plan", help="the cheapest recompute plan that fits a memory budget, guaranteed by the trace",
        description="Find the recompute plan of least predicted step time whose predicted peak memory fits "
                    "--budget: the best Megatron-LM setting (every uniform/block/selective setting, predicted) and "
                    "the best extended plan (per-layer keep / selective modules / kept operators / checkpoint groups "
                    "of any size / offloaded groups, found by an exact dynamic program and checked with the real "
                    "trace), for one process, one "
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
    g.add_argument("--objective", choices=OBJECTIVES, default="time",
                   help="minimise the predicted step time (default: recompute priced by --roofline, or by "
                        "--throughput and --memory-bandwidth, or by --measured-times) or recomputed FLOPs")
    g.add_argument("--operator-sets", type=count_or_all, default=16, metavar="N",
                   help="keep_ops kinds per layer the search offers: which operators' outputs a layer keeps, "
                        "ordered by recompute price per byte freed (default 16; 0: none; -1: all)")
    g.add_argument("--measured-times", action="store_true",
                   help="price recompute by layer/submodule forward times measured on this machine (real tensors)")
    g.add_argument("--engine", choices=ENGINES, default="reentrant",
                   help="checkpoint implementation (default reentrant, Megatron's; offload needs it)")
    g.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: exact storage bytes; cuda: 512-byte allocator blocks (default cpu)")
    g.add_argument("--budget-reserved", action="store_true",
                   help="budget reserved memory (the CUDA caching allocator's segments, replayed from the plan's "
                        "predicted step), not only allocated memory: what runs out on a GPU (a whole job with a GPU "
                        "budget does by default)")
    g.add_argument("--no-offload", action="store_true", help="do not offload group inputs to host memory")
    g.add_argument("--fine-grained-offload", action="store_true",
                   help="let the plan choose Megatron's fine-grained activation offloading (none and "
                        "selective/core_attn beside each --offload-modules set, and cheaper recompute settings that "
                        "do not fit alone; transfers at --bandwidth, each way overlapped with up to one layer's "
                        "forward): the cheapest that fits is the Megatron answer when it costs less than every "
                        "recompute-only setting that fits; all traced are listed")
    g.add_argument("--min-offloaded-tensor-size", type=non_negative_int, default=MIN_OFFLOADED_TENSOR_SIZE, metavar="N",
                   help="with --fine-grained-offload: saved tensors under N elements stay on the device (Megatron's "
                        f"flag; default {MIN_OFFLOADED_TENSOR_SIZE})")
    g.add_argument("--no-cache", action="store_true",
                   help="neither read nor write the on-disk cache of traces and unit models ($REMAT_CACHE_DIR, "
                        "default ~/.cache/remat)")
    g.add_argument("--bandwidth", type=positive_number, default=25.0, metavar="GB/S",
                   help="host-device bandwidth for offload, GB/s (default 25, PCIe 4 x16; about 50 for PCIe 5 "
                        "x16, 450 for Grace Hopper's NVLink-C2C)")
    g.add_argument("--throughput", type=positive_number, metavar="TFLOP/S",
                   help=f"compute throughput that converts seconds and FLOPs (default {DEFAULT_FLOPS / 1e12:g})")
    g.add_argument("--memory-bandwidth", type=positive_number, metavar="GB/S",
                   help="device memory bandwidth that prices recomputed bytes under --objective time (default "
                        f"{DEFAULT_MEMORY_BANDWIDTH / 1e9:g})")
    g.add_argument("--roofline", choices=tuple(ROOFLINES),
                   help="price --objective time with this GPU's FLOP/s and memory bandwidth (replaces --throughput "
                        "and --memory-bandwidth)")
    g.add_argument("--selective-modules", default=",".join(SELECTIVE_MODULES), metavar="M1,M2",
                   help="modules selective layers may recompute (default all: "
                        f"{','.join(SELECTIVE_MODULES)}; non_matmul is operator-level, see remat.policy)")
    g.add_argument("--tp", type=sized("tp"), default=1, metavar="T",
                   help="tensor-parallel size: plan one rank (Megatron's sharding of heads, MLP and vocabulary)")
    g.add_argument("--sp", action="store_true", help="with --tp: sequence parallelism")
    g.add_argument("--pp", type=sized("pp"), metavar="P", help="pipeline stages: also plan each stage separately")
    g.add_argument("--microbatches", type=sized("num_microbatches"), metavar="M",
                   help="microbatches per step with --pp (default P)")
    g.add_argument("--schedule", metavar="NAME",
                   help="pipeline schedule with --pp (default 1f1b; interleaved where --vpp or a layout's chunks "
                        "imply it, as Megatron)")
    g.add_argument("--json", action="store_true", help="print the JSON report instead of the text")
    g.add_argument("--out", type=Path, metavar="FILE", help="also write the JSON report to FILE")
    add_page_arguments(g)
    add_memory_arguments(g, plan=True)
    add_job_arguments(parser)
    return run_plan


# The PlanOptions/ParallelOptions field each flag sets (flag's dest -> field): their errors name the flag.
OPTION_FLAGS = {"reserve": "reserve", "objective": "objective", "engine": "engine", "device": "device",
                "min_offloaded_tensor_size": "min_offloaded_tensor_size", "selective_modules": "selective_sets",
                "measured_times": "measured_times", "throughput": "flops_per_second", "bandwidth": "bandwidth",
                "memory_bandwidth": "memory_bandwidth", "roofline": "roofline", "operator_sets": "operator_sets",
                "tp": "tp", "sp": "sp", "pp": "pp", "microbatches": "microbatches", "schedule": "schedule"}


def _flag_error(args: argparse.Namespace, err: OptionError) -> ValueError:
    """``err`` naming the flag (and the value given) instead of the options field."""
    dest = next((dest for dest, field in OPTION_FLAGS.items() if field == err.field), None)
    if dest is None or not err.reason:
        return err
    value = getattr(args, dest, None)
    shown = "" if isinstance(value, bool) or value is None else f" {value}"
    return ValueError(f"--{dest.replace('_', '-')}{shown}: {err.reason}")


def check_plan_flags(args: argparse.Namespace) -> None:
    """Refuse flags that the other flags would make ignored: the roofline's numbers replace --throughput and
    --memory-bandwidth, --objective extra_flops counts FLOPs (neither a roofline nor measured times price it), and
    --schedule sets a pipeline's schedule (with --pp, or --megatron-args, which refuses it)."""
    given = [flag for flag in ("throughput", "memory_bandwidth") if getattr(args, flag) is not None]
    if args.roofline is not None and given:
        raise ValueError(f"--{given[0].replace('_', '-')} with --roofline {args.roofline}: the roofline sets the "
                         "throughput and the memory bandwidth: drop one")
    if args.objective == "extra_flops":
        for flag, value in (("--roofline", args.roofline), ("--measured-times", args.measured_times or None)):
            if value is not None:
                raise ValueError(f"{flag} prices recompute in time, but --objective extra_flops counts FLOPs: drop "
                                 f"{flag} or use --objective time")
    if args.schedule is not None and args.pp is None and args.megatron_args is None and args.megatron_script is None:
        raise ValueError(f"--schedule {args.schedule} is a pipeline setting, ignored without a pipeline: add --pp P "
                         "(pipeline stages), or drop --schedule")


def plan_options(args: argparse.Namespace) -> PlanOptions:
    """The :class:`PlanOptions` of ``remat plan``'s flags (an error names the flag)."""
    throughput = DEFAULT_FLOPS if args.throughput is None else args.throughput * 1e12
    memory_bandwidth = DEFAULT_MEMORY_BANDWIDTH if args.memory_bandwidth is None else args.memory_bandwidth * 1e9
    try:
        return PlanOptions(reserve=args.reserve, objective=args.objective, engine=args.engine, device=args.device,
                           offload=not args.no_offload, fine_grained_offload=args.fine_grained_offload,
                           min_offloaded_tensor_size=getattr(args, "min_offloaded_tensor_size",
                                                             MIN_OFFLOADED_TENSOR_SIZE),
                           selective_sets=args.selective_modules,
                           measured_times=args.measured_times, flops_per_second=throughput,
                           bandwidth=args.bandwidth * 1e9, memory_bandwidth=memory_bandwidth,
                           roofline=getattr(args, "roofline", None),
                           operator_sets=_operator_sets(getattr(args, "operator_sets", 16)))
    except OptionError as err:
        raise _flag_error(args, err) from None


def _operator_sets(value: int) -> int | None:
    return None if value == -1 else value


def parallel_options(args: argparse.Namespace) -> ParallelOptions:
    """The :class:`ParallelOptions` of ``remat plan``'s --tp/--sp/--pp/--microbatches/--schedule."""
    try:
        return ParallelOptions(tp=args.tp, sp=args.sp, pp=args.pp, microbatches=args.microbatches,
                               schedule=args.schedule or "1f1b")
    except OptionError as err:
        raise _flag_error(args, err) from None


def run_plan(args: argparse.Namespace) -> int:
    check_plan_flags(args)
    check_writable(args, files=("out", "html", "snapshot"))  # before the work, not after it
    budgets_reserved(args)  # --budget-reserved with --budget-allocated: refused before the work
    try:  # read before the work too, so that an error names the flag
        parse_budget(args.budget, None)
    except SizeError as err:
        raise ValueError(f"--budget {args.budget}: {str(err).removeprefix('budget: ')}") from None
    disk_cache.set_enabled(not args.no_cache)
    # a job, or a bf16/fp16 model (Megatron's mixed precision): every rank with every part (remat.cli.job)
    megatron = args.megatron_args is not None or args.megatron_script is not None  # the job is Megatron's flags
    if job_requested(args, mixed_precision_model=not megatron and resolve_model_config(args).dtype != "fp32"):
        return run_plan_job(args, plan_options(args))
    refuse_page_flags(args, "this plan is of one process" + (" per pipeline stage" if args.pp else ""))
    refuse_memory_flags(args, "this plan is of one process" + (" per pipeline stage" if args.pp else "") + (
        "" if args.budget_reserved else " without --budget-reserved"), alloc_conf_too=not args.budget_reserved)
    config = resolve_model_config(args)
    try:
        if args.budget_reserved:
            result, reserved = plan_reserved(config, args.budget, plan_options(args), parallel_options(args),
                                             args.alloc_conf)
        else:
            result, reserved = plan(config, args.budget, plan_options(args), parallel_options(args)), None
    except BudgetError as err:
        report = {"format": "remat.plan-result", "version": 1, "config": config.to_dict(), "fits": False,
                  "budget_bytes": err.budget_bytes, "min_peak_bytes": err.min_peak_bytes,
                  "min_peak_plan": err.plan.to_dict(), "message": str(err)}
        if args.out is not None:
            write_out(args.out, report)
        if args.json:
            print(json_text(report))
        else:
            print(f"remat plan: {err}")
            print(err.plan.snippet())
        return 1
    report = result.to_dict()
    report["fits"] = True
    if reserved is not None:
        report["allocator_replay"] = reserved
    if args.out is not None:
        written = write_out(args.out, report)
        info(f"wrote {written}")
    print(json_text(report) if args.json else result.format())
    if not args.json:  # a single-process plan of an fp32 model: say what it leaves out (the job path counts it)
        print("not counted: optimizer state and master parameters (plan the whole Megatron job, every part of every "
              "rank, with --optimizer adam or --megatron-args), the CUDA context, NCCL buffers, fragmentation")
    if reserved is not None and not args.json:
        print(f"\nreserved (--budget-reserved, {REPLAY_NOTE}): {format_reserved(reserved)}; planned under an "
              f"allocated budget of {format_bytes(reserved['allocated_budget_bytes'])}")
    return 0
