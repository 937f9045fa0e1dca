"""The whole-rank prediction of a Megatron job checked against a real run: every rank of a small job run on gloo
(one CPU process per rank, :mod:`remat.parallel.megatron_rank`), its measured peak beside the predicted one
(:func:`remat.parallel.job_predict.predict_job`), with the parts (parameters, gradients, master parameters,
optimizer state, activations) alive at each peak."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any

from remat.config import DTYPES, ModelConfig
from remat.job import Job, JobError
from remat.memory.rank_state import rank_shard_elements
from remat.models.expert_parallel import DistributedExpertGroup, expert_parallel_group, expert_tensor_parallel_group
from remat.models.tensor_parallel import DistributedGroup
from remat.models.tp_stage import build_tp_stage_module
from remat.parallel.job_predict import (
    PART_LABELS,
    PARTS,
    JobPrediction,
    RankPrediction,
    check_microbatches,
    chunk_config,
    parts_at,
    predict_job,
    predict_stage,
)
from remat.parallel.launch import DEFAULT_TIMEOUT, launch_job
from remat.parallel.megatron_rank import (
    GRAD_BUFFER,
    MASTER,
    STATE,
    GradBuffer,
    Layout,
    MegatronOptimizer,
    RankStep,
    add_grad_hooks,
    make_groups,
)
from remat.parallel.pipeline_report import peak_error
from remat.parallel.schedule import offload_last_groups, partition, schedule_actions
from remat.parallel.stages import PipelineRecorder, build_stage_module, chunk_policy, gc_paused, keeps_layer_inputs
from remat.policy import Policy
from remat.recompute.activation_offload import offload_modules_of
from remat.recompute.apply import apply
from remat.timeline import Timeline

MAX_WORLD = 8  # one CPU process per rank


def job_to_dict(job: Job) -> dict[str, Any]:
    """A JSON-ready form of ``job`` (the worker rebuilds it with :func:`job_from_dict`)."""
    out = {f.name: getattr(job, f.name) for f in dataclasses.fields(job) if f.name not in ("model", "policy")}
    return {**out, "model": job.model.to_dict(), "policy": str(job.policy)}


def job_from_dict(data: dict[str, Any]) -> Job:
    fields = {k: v for k, v in data.items() if k not in ("model", "policy")}
    return Job(model=ModelConfig.from_dict(data["model"]), policy=Policy.parse(data["policy"]), **fields)


def check_measurable(job: Job) -> None:
    """Refuse, naming the field, what the real run does not build (yet)."""
    refusals = [
        (job.cp > 1, f"cp={job.cp} (--context-parallel-size): the real run has no ring attention (context "
                     "parallelism's K/V exchange), for dense and MoE layers alike; remat predict (predict_job) prices "
                     "such a job (its MoE layers route the rank's s/cp tokens); measure with cp=1"),
        (job.vpp is not None, f"vpp={job.vpp}: the real run runs Megatron's non-interleaved 1F1B; use vpp=None"),
        (job.overlap_grad_reduce, "overlap_grad_reduce=True: the real run keeps one bucket per buffer; use False"),
        (job.torch_fsdp2 is not None, "torch_fsdp2 (--use-torch-fsdp2): the real run builds Megatron's DDP buffers, "
                                      "not FSDP2's shards; remat predict (predict_job) prices it"),
        (job.optimizer == "muon", "optimizer='muon': the real run steps Adam or SGD (megatron_rank.MegatronOptimizer); "
                                  "remat predict (predict_job) prices Muon; measure with adam"),
        (job.world_size > MAX_WORLD, f"tp*pp*cp*dp = {job.world_size} processes: the real run starts one CPU "
                                     f"process per rank; use at most {MAX_WORLD}"),
        (job.model.is_moe and job.tp == 1 and not job.sp and job.expert_tp > 1,
         f"etp={job.expert_tp} with tp=1: the real run splits experts only inside its tensor-parallel model; "
         "use etp=1, or tp > 1 with sequence parallelism"),
    ]
    for bad, message in refusals:
        if bad:
            raise JobError(message)
    check_microbatches(job)  # the run is put beside its prediction: refused now, not after the run


def measure_job(job: Job, *, timeout: float = DEFAULT_TIMEOUT, seed: int = 0) -> list[Timeline]:
    """Run one training step of every rank of ``job`` for real and record it (gloo on CPU, one process per
    rank, every process ended before this returns).

    Args:
        job: the job (tp, sp, pp, dp, distributed optimizer, precision, optimizer, policy); cp and vpp must be
            unset.
        timeout: seconds the whole run may take, process start included.
        seed: weights and token ids.

    Returns:
        One :class:`Timeline` per global rank (Megatron's order: tp fastest, then dp, then pp), recorded over
        the second of two steps; ``meta['job_rank']`` says where the rank sits.

    Example:
        >>> job = Job.build(ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=2, vocab_size=64,
        ...                             seq_length=16), precision="bf16", dp=2, distributed_optimizer=True)
        >>> [t.peak_bytes > 0 for t in measure_job(job)]  # doctest: +SKIP
        [True, True]
    """
    check_measurable(job)
    spec = {"kind": "job", "job": job_to_dict(job), "policies": [str(job.policy)], "world": job.world_size,
            "device": "cpu", "seed": seed, "fault": None, "timeout": float(timeout)}
    return [Timeline.from_dict(results[0]) for results in launch_job(spec, job.world_size, timeout)]


def measure_job_rank(spec: dict[str, Any], policy_text: str, rank: int) -> Timeline:
    """One rank of :func:`measure_job` (run by the worker process): build it, step once, record the next step."""
    job = job_from_dict(spec["job"])
    lay = Layout(job.tp, job.dp, job.pp, rank, job.ep, job.expert_tp)
    groups = make_groups(lay)
    config = job.model
    pipelined = job.pp > 1
    if pipelined and config.tie_embeddings:
        config = config.replace(tie_embeddings=False)  # each end stage keeps its copy; their grads are summed
    chunk = partition(config, job.pp, 1, job.chunk_layers, empty_ends=True)[lay.pp_rank]  # Megatron's split
    if job.tp == 1 and not job.sp:
        import torch

        torch.manual_seed(spec["seed"])
        experts = (expert_parallel_group(DistributedExpertGroup(groups[3])) if job.ep > 1 else
                   contextlib.nullcontext())
        with experts:  # the MoE layers dispatch over the real expert-parallel group
            module = build_stage_module(config, chunk)
    else:  # MoE layers: experts split over the etp group (default the tp group), counts exchanged over etp x ep
        experts = contextlib.ExitStack()
        if job.ep > 1:
            experts.enter_context(expert_parallel_group(DistributedExpertGroup(groups[3])))
        if config.is_moe:
            etp_group = groups[0] if groups[6] is None else groups[6]
            counts_group = groups[0] if groups[5] is None else groups[5]
            experts.enter_context(expert_tensor_parallel_group(
                DistributedGroup(etp_group),
                DistributedExpertGroup(counts_group) if job.expert_tp * job.ep > 1 else None))
        with experts:
            module = build_tp_stage_module(config, chunk, DistributedGroup(groups[0]), job.sp, seed=spec["seed"])
    policy = chunk_policy(Policy.parse(policy_text), chunk_config(config, chunk), chunk.num_layers)
    if chunk.num_layers:  # a chunk of only the embedding (or the loss) has no layer to recompute
        apply(module, policy)
    named_params = list(module.named_parameters())
    params = [p for _, p in named_params]
    tied = []
    if pipelined and job.model.tie_embeddings:
        tied = ([module.embedding.word_embeddings.weight] if chunk.is_first else []) + (
            [module.head.output_layer.weight] if chunk.is_last else [])
    # Megatron's dense buffer over dp and, under expert parallelism, the experts' over the expert data-parallel
    # ranks (NOTE [expert parameters] in remat.memory.rank_state), each with its own (distributed) optimizer
    expert = [job.ep > 1 and ".mlp.experts." in name for name, _ in named_params]
    edp = job.expert_data_parallel
    buffers, optimizers = [], []
    for is_expert, group, dp_rank, dp_size in ((False, groups[1], lay.dp_rank, job.dp),
                                               (True, groups[4], lay.edp_rank, edp)):
        mine = [p for p, e in zip(params, expert) if e == is_expert]
        if not mine:
            continue
        buffer = GradBuffer(mine, {id(t) for t in tied}, grad_dtype=DTYPES[job.main_grad_dtype],
                            distributed=job.distributed_optimizer, dp_size=dp_size)
        buffer.group, buffer.dp_rank = group, dp_rank
        buffers.append(buffer)
        optimizers.append(MegatronOptimizer(buffer, mine, kind=job.optimizer, momentum=job.sgd_momentum,
                                            mixed=job.precision != "fp32", distributed=job.distributed_optimizer,
                                            dp_rank=dp_rank, dp_size=dp_size))
    add_grad_hooks(params)
    step = RankStep(module, chunk, config, lay, job.num_microbatches, buffers, optimizers, groups, tied,
                    job.distributed_optimizer, spec["seed"], job.sp, attention_mask=job.create_attention_mask,
                    mask_to_backward=keeps_layer_inputs(policy, chunk.num_layers))
    modules = frozenset(offload_modules_of(policy) if chunk.num_layers else ())
    actions = schedule_actions("1f1b", job.pp, job.num_microbatches, 1, lay.pp_rank, runtime="megatron")
    step.offload_last = {mb: names for (_, mb), names in offload_last_groups(actions, lambda c: modules).items()}
    step.train_step()  # the optimizer's state and gloo's connections exist from now on: not recorded
    recorder = PipelineRecorder(module, [module])
    named = [(GRAD_BUFFER, b.grad_data) for b in buffers] + [(MASTER, t) for o in optimizers for t in o.masters] + [
        (STATE, t) for o in optimizers for t in o.states]
    if step.model_input is not None:  # the last step's input, kept by the model until this step's first forward
        named += [("pipeline.model_input", step.model_input), ("pipeline.model_input.grad", step.model_input.grad)]
    with gc_paused(), recorder:
        recorder.track_setup(named)
        del named  # it would keep the model's input alive
        step.recorder = recorder
        step.train_step()
        step.recorder = None
        recorder.set_phase("setup", "end")
    recorder.categorize(None)
    tl = recorder.timeline
    for row, module_name in enumerate(tl.module):
        if module_name == GRAD_BUFFER:
            tl.category[row] = "gradients"
        elif module_name in (MASTER, STATE):
            tl.category[row] = "optimizer_state"
    tl.meta["phase_flops"] = recorder.phase_flops
    if recorder.host_series:  # fine-grained offloading: the keys remat.memory.measure.measure writes
        tl.meta["host_memory"] = {"peak_bytes": max(b for _, b in recorder.host_series),
                                  "offloaded_bytes": recorder.offloaded_bytes,
                                  "offloaded_bytes_by_layer": {str(int(k) + chunk.layer_offset): v for k, v in
                                                               recorder.offloaded_by_layer.items()},
                                  "series": recorder.host_series}
    tl.meta.update({"backend": "cpu", "device": "cpu", "policy": policy_text, "rank": rank,
                    "config": config.to_dict(), "num_layers": chunk.num_layers,
                    "job_rank": {"rank": rank, "stage": lay.pp_rank, "tp_rank": lay.tp_rank,
                                 "dp_rank": lay.dp_rank, "ep_rank": lay.ep_rank, "expert_dp_rank": lay.edp_rank,
                                 "expert_tp_rank": lay.etp_rank}})
    if job.model.is_moe:
        tl.meta["moe_routing"] = [layer.mlp.routing_report() for layer in module.layers
                                  if hasattr(layer.mlp, "routing_report")]
    return tl


# ------------------------------------------------------------------------------------------------ compare
def rank_rows(job: Job, measured: Sequence[Timeline], prediction: JobPrediction | None = None) -> list[dict[str, Any]]:
    """Per global rank: where it sits, the predicted and measured peak, ``error = (predicted - measured) /
    measured`` and the parts alive at each peak (:data:`remat.parallel.job_predict.PARTS`).

    The prediction prices one data-parallel shard (the one with the most optimizer elements); a rank holding
    another shard is predicted with its own shard's master parameters and optimizer state (alive the whole step,
    so its peak moves by the difference), dense and expert shards alike; a rank at another expert-parallel
    position than the priced one gets its own trace (its experts may receive other counts)."""
    # the ranks ran on CPU (gloo): they are predicted with the CPU kernels (kernels='cpu'), to the byte
    prediction = prediction or predict_job(job, kernels="cpu")
    by_stage = {r.stage: r for r in prediction.ranks}
    by_expert_rank: dict[tuple[int, int], RankPrediction] = {}
    rows = []
    for tl in measured:
        where = tl.meta["job_rank"]
        guess = by_stage[where["stage"]]
        ep_rank = where.get("ep_rank", 0)
        if job.ep > 1 and ep_rank != guess.state.ep_rank:  # its experts may receive other counts: its own trace
            key = (where["stage"], ep_rank)
            if key not in by_expert_rank:
                by_expert_rank[key] = predict_stage(job, where["stage"], ep_rank=ep_rank,
                                                    kernels=prediction.ranks[0].timeline.meta["kernels"])
            guess = by_expert_rank[key]
        parts = dict(guess.parts)
        shift = 0
        if job.distributed_optimizer:
            mine = rank_shard_elements(job, guess.state.layouts, where["dp_rank"], where.get("expert_dp_rank", 0))
            per_element = {k: v // max(guess.state.shard_elements, 1) for k, v in
                           (("master_parameters", guess.state.master_parameters),
                            ("optimizer_state", guess.state.optimizer_state))}
            for part, size in per_element.items():
                delta = (mine - guess.state.shard_elements) * size
                parts[part] += delta
                shift += delta
        predicted = guess.peak_bytes + shift
        real = tl.peak_bytes
        rows.append({"rank": where["rank"], "stage": where["stage"], "tp_rank": where["tp_rank"],
                     "dp_rank": where["dp_rank"], "predicted_bytes": predicted, "measured_bytes": real,
                     "error": peak_error(real, predicted), "predicted_parts": parts,
                     "measured_parts": parts_at(tl, tl.peak_event),
                     "predicted_phase": guess.peak_phase, "measured_phase": tl.peak_phase.label,
                     "predicted_host": host_of(guess.timeline), "measured_host": host_of(tl)})
        if "moe_routing" in tl.meta:  # what the run routed; the prediction's assumption is the job model's
            rows[-1]["moe_routing"] = tl.meta["moe_routing"]
    return rows


def routing_counts(reports: Sequence[dict[str, Any]]) -> str:
    """The routing assumption that predicts what a real run routed: ``counts:`` with the tokens per expert of each
    of the stage's MoE layers (``reports``: a measured rank's ``meta['moe_routing']``; the last microbatch's)."""
    if not reports:
        raise ValueError("no MoE layer reported its routing: the stage has no MoE layers")
    return "counts:" + ";".join(",".join(map(str, r["tokens_per_expert"])) for r in reports)


def host_of(timeline: Timeline) -> dict[str, Any]:
    """Fine-grained offloading's host bytes of a rank's step (``meta['host_memory']``): ``peak_bytes`` (the most
    on the host at once, over every microbatch in flight), ``offloaded_bytes`` (per offload module, summed over the
    step's microbatches) and ``series`` (``[event, bytes]``: the host holds ``bytes`` from that event on); ``{}``
    without offloading."""
    host = timeline.meta.get("host_memory") or {}
    return {k: host[k] for k in ("peak_bytes", "offloaded_bytes", "series") if k in host}


def compare_job(job: Job, *, timeout: float = DEFAULT_TIMEOUT, seed: int = 0) -> list[dict[str, Any]]:
    """:func:`measure_job` and :func:`rank_rows` together: one row per global rank."""
    return rank_rows(job, measure_job(job, timeout=timeout, seed=seed))


def format_rows(rows: Sequence[dict[str, Any]]) -> str:
    """A per-rank table: rank, stage, tp position, predicted and measured bytes, error %, then the parts."""
    short = PART_LABELS
    head = f"{'rank':>4} {'stage':>5} {'tp':>3} {'dp':>3} {'predicted':>11} {'measured':>11} {'error':>8}  parts"
    lines = [head]
    for r in rows:
        lines.append(f"{r['rank']:>4} {r['stage']:>5} {r['tp_rank']:>3} {r['dp_rank']:>3} "
                     f"{r['predicted_bytes']:>11,} {r['measured_bytes']:>11,} {r['error'] * 100:>7.3f}%  "
                     + " ".join(f"{short[p]}={r['measured_parts'][p]:,}" for p in PARTS if r['measured_parts'][p]))
        diff = [f"{short[p]} {r['predicted_parts'][p] - r['measured_parts'][p]:+,}" for p in PARTS
                if r['predicted_parts'][p] != r['measured_parts'][p]]
        guess, real = r.get("predicted_host") or {}, r.get("measured_host") or {}
        if guess or real:
            lines.append(f"{'':>49}host peak (offloaded, all microbatches in flight): predicted "
                         f"{guess.get('peak_bytes', 0):,}, measured {real.get('peak_bytes', 0):,}")
            if guess.get("peak_bytes", 0) != real.get("peak_bytes", 0):
                diff.append(f"host {guess.get('peak_bytes', 0) - real.get('peak_bytes', 0):+,}")
        if diff:
            lines.append(f"{'':>49}predicted - measured: " + ", ".join(diff))
    return "\n".join(lines)
