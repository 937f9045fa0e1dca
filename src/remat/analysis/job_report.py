"""The per-rank report of a whole Megatron-LM job (``remat predict``/``plan`` with a job): the worst rank first with
its parts, then each distinct stage, and the line saying what no prediction counts and how ``--reserve`` keeps
room for it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from remat.job import Job
from remat.memory.reserved import REPLAY_NOTE, format_reserved
from remat.parallel.job_predict import NOT_COUNTED, PART_LABELS, PARTS, JobPrediction, RankPrediction
from remat.plan.job_result import JobPlan, StageChoice, format_state, smallest_dp
from remat.units import DEFAULT_RESERVE, GPU_PRESETS, format_bytes, format_seconds, parse_reserve

_SHORT = PART_LABELS


def describe_job(job: Job) -> str:
    """One line: the model, its parallel layout, batch, precision and optimizer."""
    m = job.model
    gqa = f", {m.query_groups} kv groups" if m.query_groups != m.num_attention_heads else ""
    layout = f"tp={job.tp}{' sp' if job.sp else ''} pp={job.pp}" + (f" vpp={job.vpp}" if job.vpp else "") + \
        f" cp={job.cp} dp={job.dp}" + (f" ep={job.ep}" if job.ep > 1 else "") + f" ({job.world_size} ranks)"
    if len(set(job.chunk_layers)) > 1:  # Megatron's uneven split: every chunk's decoder layers, in global order
        layout += " with chunks of " + "+".join(map(str, job.chunk_layers)) + " layers"
    layout += ", TP communication overlap (TE userbuffers)" * (job.tp_comm_overlap is not None)
    moe = (f", {m.num_moe_experts} experts (top-{m.moe_router_topk}, ffn={m.moe_ffn_size}) in "
           f"{sum(m.moe_layer_pattern())} layers") if m.is_moe else ""
    mixed = " mixed precision (fp32 main grads" + (", fp32 master params)" if job.optimizer != "none" else ")") \
        if job.precision != "fp32" else ""
    if job.torch_fsdp2 is not None:  # remat.memory.torch_fsdp2: no MixedPrecisionPolicy (NOTE [torch FSDP2])
        mixed = (f", torch FSDP2 over dp x cp ({job.precision} sharded parameters and gradients, "
                 f"{'resharded' if job.torch_fsdp2.reshard_after_forward else 'kept gathered'} after forward)")
    if m.fp8_recipe is not None:  # remat.memory.fp8: the transformer layers' linears
        mixed += f", FP8 linears ({m.fp8_recipe} scaling" + (", FP8 parameters)" if job.fp8_param_gather else ")")
    opt = job.optimizer + (" distributed over dp x cp" if job.distributed_optimizer else "") + (
        " (experts' over the expert data-parallel ranks)" if job.distributed_optimizer and job.ep > 1 else "")
    return (f"{m.num_layers} layers, h={m.hidden_size}, {m.num_attention_heads} heads{gqa}, ffn={m.ffn_size}{moe}, "
            f"s={m.seq_length}, b={m.micro_batch_size}, vocab={m.vocab_size}; {layout}; {job.num_microbatches} "
            f"microbatch{'es' * (job.num_microbatches > 1)}, {job.schedule}; {job.precision}{mixed}; optimizer {opt}")


def not_counted_line(budget: str | None = None, reserve: str | float | None = DEFAULT_RESERVE) -> str:
    """The line every job report prints: what is not counted, and how much ``--reserve`` sets aside for it.

    Args:
        budget: ``remat plan``'s ``--budget`` text (None for predict/compare).
        reserve: ``--reserve``.
    """
    name = budget.strip().lower() if isinstance(budget, str) else None
    if name in GPU_PRESETS:
        kept = parse_reserve(reserve, GPU_PRESETS[name])
        room = f"--reserve {reserve} sets aside {format_bytes(kept)} of {name} for them"
    elif budget is not None:
        room = ("--reserve sets aside nothing for them with a byte budget (it applies to GPU presets such as "
                "h100-80g): leave room in --budget")
    else:
        room = (f"remat plan's --reserve (default {DEFAULT_RESERVE} of a GPU preset: "
                f"{format_bytes(parse_reserve(DEFAULT_RESERVE, GPU_PRESETS['h100-80g']))} of h100-80g) sets aside "
                "room for them")
    return f"{NOT_COUNTED}; {room}."


def rank_row(r: RankPrediction, **extra: Any) -> dict[str, Any]:
    """One JSON row: ``extra`` (e.g. ``policy``), then :meth:`RankPrediction.row` (rank, stage, peak, every part of
    :data:`PARTS`, ``reserved``: the caching-allocator replay or None, ``outside_allocator``)."""
    return {**extra, **r.row()}


def _rank_lines(ranks: Sequence[RankPrediction]) -> list[str]:
    replayed = any(r.reserved for r in ranks)  # a column of max_memory_reserved beside the allocated peak
    head = f"  {'rank':>5} {'stage':>5} {'alike':>5} {'peak':>11}" + (f" {'reserved':>11}" if replayed else "") + \
        "  " + " ".join(f"{_SHORT[p]:>10}" for p in PARTS)
    lines = [head]
    for i, r in enumerate(ranks):
        tag = "worst" if i == 0 else ""
        reserved = format_bytes(r.reserved["max_memory_reserved"]) if r.reserved else "-"
        lines.append(f"  {r.rank:>5} {r.stage:>5} {r.ranks:>5} {format_bytes(r.peak_bytes):>11}"
                     + (f" {reserved:>11}" if replayed else "") + "  "
                     + " ".join(f"{format_bytes(r.parts[p]):>10}" for p in PARTS) + f"  {tag}".rstrip())
    return lines


def reserved_line(alloc_conf: str, source: str = "") -> str:
    """What the ``reserved`` column is: the replay, under which ``PYTORCH_CUDA_ALLOC_CONF`` (``source``: where the
    options came from, e.g. ``'--alloc-conf'``)."""
    conf = f"PYTORCH_CUDA_ALLOC_CONF={alloc_conf}" + (f" (from {source})" if source else "") if alloc_conf else \
        "PyTorch's default allocator options (--alloc-conf sets others, e.g. expandable_segments:True)"
    return (f"reserved: each rank's max_memory_reserved (its allocations in order, every microbatch in flight), from "
            f"{REPLAY_NOTE}; {conf}. Reserved memory is what a GPU runs out of; peak and the parts are allocated "
            "bytes.")


def format_job_prediction(prediction: JobPrediction, policy: str) -> str:
    """The worst rank with its parts, then a row per distinct rank (one per pipeline stage)."""
    w = prediction.worst
    parts = ", ".join(f"{p} {format_bytes(v)}" for p, v in w.parts.items() if v)
    lines = [f"policy {policy}: worst rank {w.rank} (stage {w.stage}) peaks at {format_bytes(w.peak_bytes)} "
             f"({w.peak_bytes:,} bytes) in {w.peak_phase}: {parts}",
             f"  kernels {w.timeline.meta.get('kernels', 'cpu')}: what these kernels save for backward "
             "(--kernels cpu|cuda|te)"]
    replayed = [(r.reserved["max_memory_reserved"], r) for r in prediction.ranks if r.reserved]
    if replayed:  # the rank a GPU runs out of first: the most reserved, not always the worst allocated
        most = max(replayed, key=lambda pair: pair[0])[1]
        lines.append(f"  most reserved: rank {most.rank} (stage {most.stage}), {format_reserved(most.reserved or {})}")
    outside = max(prediction.ranks, key=lambda r: r.outside_bytes)
    if outside.outside:
        lines.append(outside_line(outside))
    return "\n".join(lines + _rank_lines(prediction.ranks))


def outside_line(r: RankPrediction) -> str:
    """The library buffers a rank holds outside PyTorch's allocator (in no peak or reserved figure above)."""
    parts = "; ".join(f"{b.name} {format_bytes(b.nbytes)} ({b.source})" for b in r.outside)
    return (f"  outside PyTorch's allocator: rank {r.rank} (stage {r.stage}) also holds "
            f"{format_bytes(r.outside_bytes)} for the whole run, not in the peak or reserved figures (a GPU must have "
            f"room for both): {parts}")


def budgeted_line(budgeted: dict[str, Any], fits: bool = True) -> str:
    """What a job's plan held within the budget (``JobPlan.stats['memory_budgeted']``, :mod:`remat.plan.job_reserved`):
    reserved memory (the default with a GPU budget) or allocated bytes."""
    if budgeted["memory"] == "reserved":
        lowered = f"an allocated budget lowered to {format_bytes(budgeted['allocated_budget_bytes'])}"
        how = (f"planned under {lowered} in {budgeted['rounds']} rounds for the fragmentation" if fits and
               budgeted["rounds"] > 1 else "every rank's reserved memory fits as planned" if fits else
               f"no plan fits it (the last of {budgeted['rounds']} rounds under {lowered})" if budgeted["rounds"] > 1
               else "no plan fits it")
        return (f"budgeted: reserved memory (max_memory_reserved: the caching allocator's segments replayed from each "
                f"rank's step), what a GPU runs out of; {how}; --budget-allocated budgets allocated bytes instead")
    return ("budgeted: allocated bytes (max_memory_allocated); each rank's reserved memory is in the reserved column "
            "(--budget-reserved budgets it)")


def _choice_text(c: StageChoice) -> str:
    extra = f", recompute +{c.extra_compute_pct:.1f}% FLOPs ({format_seconds(c.extra_seconds)} per microbatch)" \
        if c.recompute_flops or c.extra_seconds else ", nothing recomputed"
    policy = c.policy
    what = str(c.plan) if policy is None else str(policy) if c.source == "megatron" else \
        f"{c.plan} (Megatron's {policy})"
    if c.offload_policy is not None:
        # the rank's host peak: every microbatch in flight holds its own offloaded groups (the stage timeline's)
        host = c.prediction.timeline.meta.get("host_memory") or {}
        in_flight = (c.prediction.timeline.meta.get("pipeline") or {}).get("max_in_flight")
        held = (f"host {format_bytes(host['peak_bytes'])} at most at once over the "
                f"{in_flight or 'several'} microbatches in flight ({format_bytes(c.host_bytes)} per microbatch)"
                if host.get("peak_bytes") else f"host {format_bytes(c.host_bytes)} per microbatch in flight")
        extra += (f"; chosen: fine-grained activation offloading of {', '.join(c.offload_policy.offload_modules)}, "
                  f"{held}, "
                  f"{format_seconds(c.transfer_seconds)} transfer time charged per microbatch; Megatron flags: "
                  f"{' '.join(c.offload_policy.to_megatron_args())}")
    return f"{what}, peak {format_bytes(c.prediction.peak_bytes)}{extra}"


def format_job_plan(result: JobPlan) -> str:
    """``remat plan``'s text for a job: fits or not; the exact rows of every stage's plan, worst rank first, with
    every part; each stage's plan beside its best Megatron setting; the one Megatron setting for every stage."""
    job, budget = result.job, result.budget_bytes
    lines = [budgeted_line(result.stats["memory_budgeted"], result.fits)] if "memory_budgeted" in result.stats else []
    if not result.state_fits:
        worst = result.worst_state()
        lines.append(f"does not fit {result.budget_text}: the model state of stage {worst.stage}'s ranks alone is "
                     f"{format_bytes(worst.state.total)}, before any activation: {format_state(worst.state)}")
        dp = smallest_dp(job, worst, budget)
        fix = "shard the model state: more --tp/--pp, or a larger budget"
        if job.torch_fsdp2 is not None:  # every part of it is sharded over dp x cp (remat.memory.torch_fsdp2)
            fix = (f"shard it further: FSDP2 with --dp >= {-(-worst.state.total * job.dp // budget)} leaves room for "
                   "the model state (then activations), or more --tp, or a larger budget")
        elif dp is not None and (not job.distributed_optimizer or dp > job.dp):
            fix = (f"shard it: --distributed-optimizer with --dp >= {dp} leaves "
                   "room for the model state (then activations), or more --tp/--pp, or a larger budget")
        lines.append(f"  fix: {fix}")
        for s in result.stages:
            lines.append(f"  stage {s.stage}: model state {format_state(s.state)}")
        return "\n".join(lines)
    if result.fits:
        lines.append(f"fits {result.budget_text} with a plan per stage (objective {result.objective}); every part "
                     "of every rank counted, each predicted exactly:")
        lines += _rank_lines(result.ranks())
    else:
        lines.append(f"does not fit {result.budget_text}: no recompute plan brings every rank under it")
    lines.append("per-stage plans (each stage's chunk layers numbered from 0; remat.apply gives each stage its own) "
                 "and the best Megatron setting of each stage:")
    for s in result.stages:
        layers = f"layers {s.layers[0]}-{s.layers[1]}" if s.layers[1] >= s.layers[0] else "no decoder layer"
        if len(set(s.chunk_layers)) > 1:  # an uneven split: the plan is of the deepest chunk, the others its start
            layers += f" of chunks of {'+'.join(map(str, s.chunk_layers))} layers"
        where = f"  stage {s.stage} ({layers}, {s.in_flight} in flight)"
        if s.extended is not None:
            body = f"{_choice_text(s.extended)} [{s.extended.source}]: " + ", ".join(
                f"{p} {format_bytes(v)}" for p, v in s.extended.prediction.parts.items() if v)
        else:
            low = "" if s.prediction is None else \
                f"; the lowest peak predicted is {format_bytes(s.prediction.peak_bytes)}"
            body = f"nothing fits{low}"
        lines.append(f"{where}: {body}")
        if s.extended is not None and s.megatron is not None and s.megatron is not s.extended:
            lines.append(f"      best Megatron setting: {_choice_text(s.megatron)}")
        if s.megatron_without_offload is not None:
            lines.append(f"      without offloading: {_choice_text(s.megatron_without_offload)} (cost "
                         f"{s.megatron_without_offload.cost:,} vs {s.megatron.cost if s.megatron else 0:,})")
        elif s.megatron is None and s.extended is not None:
            lines.append("      no Megatron setting fits this stage")
        if s.megatron_search_cut:
            lines.append("      (the Megatron screen's time cap cut its search: a cheaper setting may fit)")
    if result.uniform is not None:
        flags = " ".join(result.uniform.to_megatron_args()) if result.uniform.engine == "reentrant" else "-"
        lines.append(f"one Megatron setting for every stage (what its flags express): {result.uniform} (flags: "
                     f"{flags or 'none'}), worst rank {format_bytes(result.uniform_ranks[0].peak_bytes)}:")
        lines += _rank_lines(result.uniform_ranks)
    else:
        lines.append("no one Megatron setting fits every stage")
    if result.stats.get("uniform_search_cut"):
        lines.append("  (the time cap cut the search for one setting for every stage: a cheaper setting may fit)")
    return "\n".join(lines)
