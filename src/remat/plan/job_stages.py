"""Where a whole-job plan's stages stand: the model as one rank runs it, each stage's model chunks (even or uneven
splits) and the kind of its layers (NOTE [uneven splits])."""

from __future__ import annotations

from collections.abc import Sequence

from remat.config import ModelConfig
from remat.job import Job
from remat.parallel.schedule import ChunkSpec, partition, rank_chunks
from remat.plan.costs import CostModel
from remat.plan.moe_modules import add_moe_units
from remat.plan.options import PlanOptions
from remat.plan.unit_model import UnitModel, unit_model


def rank_config(job: Job) -> ModelConfig:
    """The model as one rank of ``job`` runs it: s/cp tokens per sequence, an untied embedding when pipelined."""
    config = job.model.replace(seq_length=job.model.seq_length // job.cp)
    if job.pp * (job.vpp or 1) > 1 and config.tie_embeddings:
        config = config.replace(tie_embeddings=False)
    return config


def stage_chunks(job: Job, stage: int) -> list[ChunkSpec]:
    """The model chunks a rank of ``stage`` holds, with their layers as Megatron splits them (even or not)."""
    return rank_chunks(partition(rank_config(job), job.pp, job.vpp or 1, job.chunk_layers, empty_ends=True), job.pp,
                       stage)


# NOTE [uneven splits]: under Megatron's uneven splits (--decoder-first/last-pipeline-num-layers, --account-for-*,
# --pipeline-model-parallel-layout) the stages' chunks differ in depth, and with vpp one stage's chunks may too. A
# stage's plan is of its deepest chunk's layers; a shorter chunk of the stage runs its first layers, a group cut at
# the chunk's end (remat.parallel.stages.cut_plan, what Megatron's uniform groups do; the exact prediction runs
# exactly that, and its cost is summed over the chunks). Its unit model is of the stage's layer kind, MoE or dense
# by the global index of its layers (Megatron's moe_layer_freq; a stage mixing both is modelled by the kind most of
# its layers are: the estimate only orders the search, every answer is predicted exactly). A stage without a decoder
# layer (an embedding- or loss-only stage) has nothing to recompute: its plan is "none", fitting or not as predicted.
# The one Megatron setting for every stage ranges over the deepest chunk of the job (recompute-num-layers up to
# it, as Megatron allows); on a shallower chunk it is what Megatron runs there (chunk_policy).
def stage_is_moe(config: ModelConfig, job: Job, stage: int) -> bool:
    """Whether most of the stage's layers are MoE layers (ties: MoE)."""
    pattern = config.moe_layer_pattern()
    kinds = [pattern[i] for c in stage_chunks(job, stage) for i in range(c.layer_offset, c.layer_offset + c.num_layers)]
    return 2 * sum(kinds) >= len(kinds) and any(kinds)


def stage_layer_kinds(config: ModelConfig, job: Job, stage: int) -> tuple[ModelConfig, ...]:
    """The layer kinds (:func:`kind_config`) the stage's layers are of: one, or both for a stage mixing them."""
    pattern = config.moe_layer_pattern()
    kinds = {pattern[i] for c in stage_chunks(job, stage) for i in range(c.layer_offset, c.layer_offset + c.num_layers)}
    return tuple(kind_config(config, moe) for moe in sorted(kinds))


def kind_config(config: ModelConfig, moe: bool) -> ModelConfig:
    """One layer of ``config`` of one kind: an MoE layer, or (``moe`` False) a dense one (an MoE model's dense
    layers, DeepSeek's first layers, are the dense model's: the MoE fields dropped)."""
    if moe:
        return config.with_depth(1, (True,))
    if not config.is_moe:
        return config.with_depth(1)
    return config.replace(num_layers=1, moe_layer_freq=1, num_moe_experts=None, moe_ffn_hidden_size=None,
                          moe_shared_expert_intermediate_size=None, moe_grouped_gemm=False,
                          moe_expert_capacity_factor=None, moe_routing_assumption=None, expert_model_parallel_size=1)


def stage_kinds(job: Job, options: PlanOptions, stages: Sequence[int]) -> dict[bool, tuple[UnitModel, CostModel]]:
    """The unit model and cost model of each layer kind of ``stages`` (MoE: :func:`stage_is_moe`), each kind's
    model pricing Megatron's MoE/MLA recompute modules too (:func:`remat.plan.moe_modules.add_moe_units`)."""
    config = rank_config(job)
    kinds: dict[bool, tuple[UnitModel, CostModel]] = {}
    for stage in stages:
        moe = stage_is_moe(config, job, stage)
        if moe not in kinds:
            kind = kind_config(config, moe)
            model = unit_model(kind, device=options.device, engine=options.engine, tp=job.tp, sp=job.sp)
            kinds[moe] = (add_moe_units(model, config), options.cost_model(kind))
    return kinds
