"""Every byte of every rank of a Megatron-LM job (:class:`remat.job.Job`): the whole-step prediction per rank.

For each pipeline stage the activations of the microbatches in flight come from the pipeline composition
(:mod:`remat.parallel.pipeline_predict`, Megatron's runtime), whose chunks are traced as one tensor-parallel
rank's shard (:mod:`remat.models.tp_stage`) holding s/cp tokens; the static model state of the rank
(:mod:`remat.memory.rank_state`: parameters, the fp32 main-gradient buffer, master parameters and optimizer state,
with Megatron's padding) is added as allocations alive for the whole step. The chunks keep what the GPU kernels keep
(:func:`job_kernels`: the ``cuda`` kernel profile unless told otherwise) and drop each parameter gradient where
Megatron's DDP hook does. Ranks that hold the same bytes are computed once: all tensor-parallel and
context-parallel positions of a stage are the same size, and of the data-parallel shards the one with the most
optimizer elements is priced.

MoE models (NOTE [expert parallelism in a job]): every chunk is traced with its own layers (dense or MoE, as
``moe_layer_freq`` says for their numbers), its MoE layers as one expert-parallel rank of a simulated group
(:mod:`remat.models.expert_parallel`), and the expert parameters are sharded by ep and kept in Megatron's
separate expert buffers (:mod:`remat.memory.rank_state`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from remat.config import DTYPES, ModelConfig, RoutingAssumption
from remat.job import Job, JobError
from remat.memory.alloc_config import AllocatorConfig
from remat.memory.flex_buffers import flex_outside_buffers
from remat.memory.fp8 import MODULE as FP8_MODULE
from remat.memory.fp8 import check_fp8_gpu, fp8_state_bytes
from remat.memory.fsdp_state import add_fsdp_transients, fsdp_rank_state, fsdp_summary
from remat.memory.kernels import model_kernels, resolve_kernels
from remat.memory.outside_allocator import OutsideBuffer, outside_bytes
from remat.memory.rank_state import ParamInfo, RankState, rank_parameters, rank_state
from remat.memory.replay_pool import BackgroundReplays, replay_now
from remat.memory.torch_fsdp2 import COMMUNICATION_MODULES, add_fsdp2_transients, fsdp2_rank_state
from remat.memory.tp_overlap import userbuffer_parts
from remat.memory.wgrad_fusion import MODULE as WGRAD_MODULE
from remat.memory.wgrad_fusion import dummy_wgrads, output_layer_dummy
from remat.memory.workspaces import (
    MODULE_ALLGATHER,
    MODULE_ALLTOALL,
    MODULE_FLEX,
    MODULE_MLA_ROPE,
    MODULE_TE,
    MODULE_TORCH,
    cublas_workspace_bytes,
    gpu_major,
    stage_workspaces,
)
from remat.models.expert_parallel import received_per_rank
from remat.models.tp_moe import simulated_expert_groups
from remat.parallel.chunk_trace import trace_chunk
from remat.parallel.cuda_graphs import MODULE as CUDA_GRAPH_MODULE
from remat.parallel.cuda_graphs import add_cuda_graphs, torch_gemms_in_graphs
from remat.parallel.deferred_wgrad import defer_output_layer_wgrad
from remat.parallel.pipeline_predict import MAX_COMPOSED_MICROBATCHES, compose_stage
from remat.parallel.pipeline_report import describe_stage
from remat.parallel.pipeline_runtime import StagePlan
from remat.parallel.schedule import (
    ChunkSpec,
    check_schedule,
    checkpointed_forwards,
    offload_last_groups,
    partition,
    rank_chunks,
    schedule_actions,
    warmup_forwards,
)
from remat.parallel.stages import BUFFERS, chunk_policy, keeps_layer_inputs
from remat.recompute.activation_offload import offload_modules_of
from remat.recompute.plan_format import Plan
from remat.timeline import CATEGORIES, Timeline
from remat.units import CUDA_BLOCK, round_up

# What a rank also holds that no prediction here counts; --reserve keeps room for it.
NOT_COUNTED = ("not counted: the CUDA context and kernels, NCCL's communicator buffers and, in the allocated peaks, "
               "the caching allocator's fragmentation (the reserved figures replay the allocator)")
PARTS = ("parameters", "gradients", "master_parameters", "optimizer_state", "activations", "communication",
         "workspaces")
# what a rank holds once the step is done (Megatron logs it as mem-allocated-bytes): the model state, the library
# buffers and the tensors the step leaves behind (each pipeline chunk's last received input and its gradient: NOTE
# [the model's last input] in remat.parallel.pipeline_runtime), not CP's ring buffers (an upper bound of a transient)
RESIDENT_PARTS = ("parameters", "gradients", "master_parameters", "optimizer_state", "activations", "workspaces")
PART_LABELS = {"parameters": "params", "gradients": "grads", "master_parameters": "master", "optimizer_state": "optim",
               "activations": "acts", "communication": "comm", "workspaces": "gemm ws"}  # short table headings
MASTER_MODULE = "optimizer.master_parameters"
OPTIMIZER_STATE_MODULE = "optimizer.state"
# what the CUDA libraries and Megatron keep for the whole run: the "workspaces" part
LIBRARY_BUFFERS = (MODULE_TORCH, MODULE_TE, MODULE_ALLGATHER, MODULE_FLEX, MODULE_ALLTOALL, MODULE_MLA_ROPE,
                   WGRAD_MODULE, CUDA_GRAPH_MODULE)
RING_MODULE = "cp.ring_attention.kv_exchange"
MAIN_GRAD_COPY_MODULE = "optimizer.main_param_grads"


@dataclass
class ShardedStagePlan(StagePlan):
    """A :class:`StagePlan` whose hidden states are token shards: [b*s/tp, h] under sequence parallelism."""

    activation_shards: int = 1
    attention_mask: bool = False  # the dataloader makes the dense causal mask (Job.create_attention_mask)
    cp: int = 1
    mask_to_backward: frozenset[int] = frozenset()  # chunks whose layers keep the mask to backward (keeps_layer_inputs)

    @property
    def activation_bytes(self) -> int:
        c = self.config
        nbytes = c.micro_batch_size * c.seq_length * c.hidden_size * c.torch_dtype.itemsize // self.activation_shards
        return round_up(nbytes, self.block)

    def batch_tensors(self, spec: ChunkSpec) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
        """NOTE [Megatron's batch on the device] in :mod:`remat.parallel.pipeline_runtime`."""
        if not (spec.is_first or spec.is_last):
            return [], []
        b, s = self.config.micro_batch_size, self.config.seq_length  # s: this context-parallel rank's tokens
        # the dataloader's mask beyond the layers' own causal mask, which stands in for part of it
        beyond = b * s * s * self.cp - s * s if self.attention_mask else 0
        mask = [("attention_mask", beyond)] if beyond > 0 else []
        to_backward = spec.index in self.mask_to_backward  # the layers' checkpoints save it
        step = ([] if to_backward else mask) + ([("position_ids", b * s * 8)]
                                                if spec.is_first or self.config.mtp_num_layers else [])
        return step, (mask if to_backward else []) + ([("loss_mask", b * s * 4)] if spec.is_last else [])


@dataclass
class RankPrediction:
    """One distinct rank of a job: its stage's timeline with the model state, and the state itself."""

    stage: int
    rank: int  # the global rank priced (Megatron's default order tp-cp-ep-dp-pp)
    ranks: int  # how many ranks hold the same bytes or fewer (the stage's tp x cp x dp ranks)
    state: RankState
    timeline: Timeline
    # the caching-allocator replay of the step (remat.memory.reserved.reserved_figures: max_memory_reserved, ...);
    # None: not replayed (a CPU prediction). Set by predict_job (add_reserved).
    reserved: dict[str, Any] | None = None
    # library buffers held outside PyTorch's allocator (remat.memory.outside_allocator): in no figure of the timeline
    outside: tuple[OutsideBuffer, ...] = ()

    # the timeline is complete when made: its peak and parts computed once (a report asks per row, table and sort)
    @functools.cached_property
    def peak(self) -> tuple[int, int]:  # (event, bytes) of the step's peak, from one live curve
        return self.timeline.peak()

    peak_event = property(lambda self: self.peak[0])
    peak_bytes = property(lambda self: self.peak[1])

    @property
    def peak_phase(self) -> str:  # the label of the phase the peak falls in
        return self.timeline.phase_at(self.peak_event).label

    def row(self) -> dict[str, Any]:
        """This rank as one JSON-ready row (:meth:`JobPrediction.rows`)."""
        return {"rank": self.rank, "stage": self.stage, "ranks_alike": self.ranks, "peak_bytes": self.peak_bytes,
                "peak_phase": self.peak_phase, **self.parts,
                "num_parameters": self.state.num_parameters, "dp_shard": self.state.dp_rank, "reserved": self.reserved,
                "outside_allocator": [b.to_dict() for b in self.outside]}

    @property
    def outside_bytes(self) -> int:
        """Bytes of :attr:`outside`: what the GPU holds beside the allocator's figures."""
        return outside_bytes(self.outside)

    @functools.cached_property
    def parts(self) -> dict[str, int]:
        """Bytes alive at the peak by part (:data:`PARTS`); they add up to :attr:`peak_bytes`."""
        return parts_at(self.timeline, self.peak_event)

    @property
    def first_step_peak_bytes(self) -> int:
        """The peak of the job's *first* training step: Adam's moments (``optimizer_state``) are created by the first
        optimizer step (TransformerEngine's and apex's FusedAdam initialise their state in ``step()``), after that
        step's forward and backward, so the first step peaks at the larger of its forward/backward without them and
        the state held once the step is done. Megatron-LM's H100 tests confirm it: their first iteration's
        ``mem-max-allocated-bytes`` is below the second's by the moments' bytes. Every later step peaks at
        :attr:`peak_bytes`, which is never lower."""
        tl = self.timeline
        moments = sum(n for n, m in zip(tl.nbytes, tl.module) if m == OPTIMIZER_STATE_MODULE)
        resident = sum(parts_at(tl, tl.num_events - 1)[part] for part in RESIDENT_PARTS)
        return max(self.peak_bytes - moments, resident)


@dataclass
class JobPrediction:
    """Every distinct rank of a job, the worst (highest peak) first."""

    job: Job
    ranks: list[RankPrediction]

    @property
    def worst(self) -> RankPrediction:
        return self.ranks[0]

    def rows(self) -> list[dict[str, Any]]:
        """One JSON-ready row per distinct rank, worst first: ``rank``, ``stage``, ``ranks_alike``, ``peak_bytes``,
        ``peak_phase``, the parts at the peak (:data:`PARTS`, each a key of its own, adding up to ``peak_bytes``),
        ``num_parameters``, ``dp_shard``, ``reserved`` (:func:`add_reserved`'s figures, or None) and
        ``outside_allocator`` (:attr:`RankPrediction.outside`, each buffer's name, bytes and source)."""
        return [r.row() for r in self.ranks]


def parts_at(timeline: Timeline, event: int) -> dict[str, int]:
    """Bytes alive after ``event`` by part: the model state rows by their module, the rest as activations."""
    parts = dict.fromkeys(PARTS, 0)
    for row in timeline.alive_at(event):
        category, module, nbytes = timeline.category[row], timeline.module[row], timeline.nbytes[row]
        if module == MASTER_MODULE:
            parts["master_parameters"] += nbytes
        elif module == RING_MODULE or module in COMMUNICATION_MODULES:  # (torch FSDP2's buffers)
            parts["communication"] += nbytes
        elif module in LIBRARY_BUFFERS:  # kept from setup or the first step on
            parts["workspaces"] += nbytes
        elif category in ("parameters", "gradients", "optimizer_state"):
            parts[category] += nbytes
        else:
            parts["activations"] += nbytes
    return parts


def ring_exchange_bytes(job: Job) -> int:
    """Context parallelism's K/V ring buffers of one attention (0 without CP).

    Megatron's p2p ring attention (Transformer Engine ``AttnFuncWithCPAndKVP2P``) double-buffers the K/V chunk it
    sends and receives; backward also double-buffers dK/dV. Priced as 4 x (K + V of this rank's s/cp tokens and
    query groups / tp), alive for the whole step: an upper bound of a transient.
    """
    if job.cp == 1:
        return 0
    m = job.model
    kv = 2 * m.micro_batch_size * (m.seq_length // job.cp) * (m.query_groups // job.tp) * m.head_dim
    return 4 * kv * m.torch_dtype.itemsize


def job_kernels(kernels: str | None = None) -> str:
    """The kernel profile a job's ranks are predicted with (:mod:`remat.memory.kernels`): ``kernels`` if given,
    else the one :func:`remat.memory.kernels.use_kernels` set (``remat --kernels``), else ``'cuda'``: a Megatron
    job runs on GPUs, whose kernels keep other tensors than the CPU ones (CUDA's attention backends keep an fp32
    logsumexp where CPU's math attention keeps the [b, heads, s, s] scores). ``'cpu'`` is for jobs run on CPU
    (:mod:`remat.parallel.job_measure` measures on gloo), predicted to the byte with the CPU kernels."""
    return resolve_kernels(kernels, "cuda")


def predict_job(job: Job, *, device: str = "cpu", kernels: str | None = None, env: Mapping[str, str] | None = None,
                gpu: str | None = None, allocator: AllocatorConfig | None = None,
                replay: bool | BackgroundReplays = True) -> JobPrediction:
    """Predict the whole training step of every distinct rank of ``job``.

    Args:
        job: the Megatron job (model, tp/sp/pp/vpp/cp/dp, batch, precision, optimizer, recompute policy).
        device: 'cpu' (exact bytes) or 'cuda' (activations rounded to 512-byte blocks).
        kernels: whose kernels' saved tensors the ranks keep: 'cpu', 'cuda' or 'te'; None: :func:`job_kernels`
            (default 'cuda', a GPU job).
        env: the training processes' environment variables (``CUBLAS_WORKSPACE_CONFIG`` sizes cuBLAS's
            workspaces, :mod:`remat.memory.workspaces`); None: none set.
        gpu: the GPU the job runs on (a :data:`remat.units.GPU_PRESETS` name; sizes the GEMM workspaces); None:
            Hopper.
        allocator: the ``PYTORCH_CUDA_ALLOC_CONF`` options of the caching-allocator replay of each rank
            (:func:`add_reserved`); None: PyTorch's defaults.
        replay: whether to replay the ranks (with GPU bytes) before returning; a
            :class:`~remat.memory.replay_pool.BackgroundReplays`: start them there (beside what the caller does
            next; its ``wait()`` sets each rank's ``reserved``), ``allocator`` then being its own.

    Returns:
        A :class:`JobPrediction`, worst rank first; each timeline's ``meta['job']`` says what is in it and
        ``meta['not_counted']`` what is not (:data:`NOT_COUNTED`). With GPU kernels (or ``device='cuda'``) each rank
        also has its ``reserved`` figures (:func:`add_reserved`).

    Example:
        >>> from remat.config import ModelConfig
        >>> job = Job.build(ModelConfig(num_layers=4, attention="sdpa"), precision="bf16", tp=2, pp=2,
        ...                 num_microbatches=4)
        >>> predict_job(job).worst.stage
        0
    """
    if not isinstance(job, Job):
        raise JobError(f"predict_job(job={job!r:.40}): give a remat.job.Job, e.g. Job.build(config, tp=2, pp=2) or "
                       "Job.from_megatron_args(argv)")
    kernels = job_kernels(kernels)
    out = [predict_stage(job, stage, device=device, kernels=kernels, env=env, gpu=gpu) for stage in range(job.pp)]
    out.sort(key=lambda r: (-r.peak_bytes, r.stage))
    add_replays(out, kernels, device, allocator, replay)
    return JobPrediction(job, out)


def outside_allocator_buffers(job: Job, stage: int) -> tuple[OutsideBuffer, ...]:
    """The library buffers pipeline stage ``stage``'s ranks hold outside PyTorch's allocator
    (:mod:`remat.memory.outside_allocator`): HybridEP's or DeepEP's (the flex dispatcher), TE's userbuffers
    (``--tp-comm-overlap``, every stage alike); empty when the job runs none."""
    return (*flex_outside_buffers(job, stage), *userbuffer_parts(job))


def add_replays(ranks: Sequence[RankPrediction], kernels: str, device: str, allocator: AllocatorConfig | None,
                replay: bool | BackgroundReplays) -> None:
    """:func:`add_reserved` to ``ranks`` when their bytes are GPU bytes (GPU kernels or ``device='cuda'``) and
    ``replay`` asks for it; a :class:`BackgroundReplays` gets them to replay beside what comes next."""
    if replays_wanted(kernels, device, replay):
        if isinstance(replay, BackgroundReplays):
            replay.add(ranks)
        else:
            add_reserved(ranks, allocator)


def replays_wanted(kernels: str, device: str, replay: bool | BackgroundReplays) -> bool:
    """Whether :func:`add_replays` replays: ``replay`` asks for it and the bytes are GPU bytes (GPU kernels or
    ``device='cuda'``), for which what the caching allocator reserves matters too."""
    return bool(replay) and (kernels != "cpu" or device == "cuda")


def add_reserved(ranks: Sequence[RankPrediction], allocator: AllocatorConfig | None = None) -> None:
    """Replay each rank's step (its allocations in order, every microbatch in flight) through the CUDA caching
    allocator and keep the figures in its ``reserved`` (:func:`remat.memory.reserved.reserved_figures`:
    ``max_memory_reserved``, ``max_memory_allocated``, ``fragmentation_at_peak_bytes``,
    ``largest_free_block_bytes``, ...), under ``allocator``'s options (None: PyTorch's defaults): a large job's
    ranks side by side on the idle cores, a rank the disk cache holds (or already replayed) not again
    (:func:`remat.memory.replay_pool.replay_now`)."""
    replay_now(ranks, allocator)


def check_job(job: Job) -> None:
    """Refuse, naming the flag and the fix, a job whose rank this module cannot predict."""
    m = job.model
    # MoE/MLA under tp, sp, etp: remat.models.tp_moe / tp_mla; their layout rules are Job's (check_expert_layout)
    if m.moe_routing_assumption and RoutingAssumption.parse(m.moe_routing_assumption).per_layer and \
            job.pp * (job.vpp or 1) > 1:
        raise JobError(f"moe_routing_assumption={m.moe_routing_assumption!r} gives each MoE layer its own counts, "
                       "which a pipelined job's chunks do not follow yet: give one count list for every MoE layer, "
                       "or pp=1")
    if m.is_moe and job.tp == 1 and job.expert_tp > 1:
        # Megatron accepts it (the experts' tokens gathered over etp data-parallel ranks); remat's MoE layer splits
        # its experts only inside the tensor-parallel model, so a tp=1 rank would be priced with whole experts
        raise JobError(f"etp (--expert-tensor-parallel-size)={job.expert_tp} with tp=1: remat splits the experts "
                       "over etp only inside its tensor-parallel model and would price whole experts; use etp=1, or "
                       "tp > 1 (--tensor-model-parallel-size) with --sequence-parallel")
    if job.cp > 1 and job.model.attention == "math":
        raise JobError(f"cp={job.cp} (--context-parallel-size): Megatron's context parallelism runs Transformer "
                       "Engine's fused/flash ring attention; unfused attention (--attention-backend unfused, "
                       "remat's 'math') cannot run with it: use --attention-backend auto/flash/fused or cp=1")
    if job.cp > 1 and m.transformer_impl == "local":  # megatron/core/transformer/dot_product_attention.py:57
        raise JobError(f"cp={job.cp} (--context-parallel-size) with --transformer-impl local: Megatron's local "
                       "DotProductAttention asserts context_parallel_size == 1; use cp=1 or TransformerEngine layers")
    check_schedule(job.schedule, job.pp, job.num_microbatches, job.vpp or 1, "megatron",
                   group=job.microbatch_group_size)
    check_microbatches(job)


def check_microbatches(job: Job) -> None:
    """Refuse, before any work, more microbatches than a rank's composed step holds."""
    if job.num_microbatches > MAX_COMPOSED_MICROBATCHES:  # the composition's work grows with them
        raise JobError(f"num_microbatches={job.num_microbatches} (--global-batch-size / (--micro-batch-size x dp), or "
                       f"--microbatches): a rank's step is composed microbatch by microbatch, for at most "
                       f"{MAX_COMPOSED_MICROBATCHES} microbatches; price the job with at most that many (past the "
                       "pipeline's warm-up every further microbatch repeats the same forwards and backwards)")


def stage_state(job: Job, stage: int, ep_rank: int | None = None) -> RankState:
    """The model state (parameters, main grads, master parameters, optimizer state) of a rank of pipeline stage
    ``stage`` (of expert-parallel rank ``ep_rank``, None: any): what that rank holds all step whatever the
    recompute policy, the one with the fullest optimizer shards. Cheap: no step is traced.

    Example:
        >>> from remat.config import ModelConfig
        >>> stage_state(Job.build(ModelConfig(num_layers=2), precision="bf16"), 0).num_parameters > 0
        True
    """
    if not 0 <= stage < job.pp:
        raise JobError(f"stage={stage}: the job has pipeline stages 0..{job.pp - 1}")
    if job.fsdp is not None:  # Megatron-FSDP's buffers (remat.memory.fsdp_state; one chunk: job_fsdp.check_fsdp)
        return fsdp_rank_state(job, stage_parameters(job, stage)[0])[0]
    if job.torch_fsdp2 is not None:  # torch FSDP2's padded shards (remat.memory.torch_fsdp2; pp = 1)
        return fsdp2_rank_state(job, stage_parameters(job, stage)[0])
    return rank_state(job, stage_parameters(job, stage), pipeline_rank=stage, ep_rank=ep_rank)


def stage_parameters(job: Job, stage: int) -> list[list[ParamInfo]]:
    """The parameters of each model chunk a rank of pipeline stage ``stage`` holds (:func:`rank_parameters`)."""
    vpp = job.vpp or 1
    pipelined = job.pp * vpp > 1
    split = job.model.replace(tie_embeddings=False) if pipelined else job.model  # tied: a copy on each end stage
    chunks = rank_chunks(partition(split, job.pp, vpp, job.chunk_layers, empty_ends=True), job.pp, stage)
    return [rank_parameters(job.model, first=s.is_first, last=s.is_last, num_layers=s.num_layers, tp=job.tp,
                            sp=job.sp, pipelined=pipelined, layer_offset=s.layer_offset, etp=job.expert_tp)
            for s in chunks]


# NOTE [expert parallelism in a job]
# A stage's ranks differ in what their experts receive only through the routing: rank r of ep receives ep x its
# experts' counts (every rank routing alike, remat.models.expert_parallel), so the expert-parallel rank whose
# experts receive the most copies (received_per_rank; the first on a tie, rank 0 under balanced routing) is
# traced, and of the ranks at that expert-parallel position the one with the fullest distributed-optimizer shards
# (dense and expert) is priced: its model state is alive all step, so its peak is the traced peak plus its state.
@functools.lru_cache(maxsize=64)
def busiest_expert_rank(config: ModelConfig) -> int:
    """The expert-parallel rank whose experts receive the most routed copies in one micro-batch of ``config``
    (``seq_length`` being what one rank holds); 0 without expert parallelism. Memoised: each stage of a job asks
    (a few ms for DeepSeek-V3's 58 MoE layers of 256 experts)."""
    if config.expert_model_parallel_size == 1:
        return 0
    received = received_per_rank(config, config.micro_batch_size * config.seq_length)
    return received.index(max(received))


def chunk_config(config: ModelConfig, spec: ChunkSpec) -> ModelConfig:
    """The config a chunk is traced with: its own layers' kinds (dense or MoE) when the model mixes them, so that
    the chunk built from layer 0 has them (a chunk trace is cached by config and kind)."""
    pattern = config.moe_layer_pattern()
    layers = slice(spec.layer_offset, spec.layer_offset + spec.num_layers)
    if config.mixed_layers and spec.num_layers:  # its layers' windows (NOTE [gpt-oss layers], remat.models.blocks)
        window = config.window_pattern()[layers] if config.mixed_attention else None  # and bf16 layers (FP8 jobs)
        fp8 = config.fp8_layers[layers] if config.fp8_layers is not None else None
        return config.with_depth(spec.num_layers, pattern[layers], window, fp8)
    if len(set(pattern)) == 1 or spec.num_layers == 0:  # one kind of layer, or none (an embedding/loss chunk)
        return config
    return config.with_depth(spec.num_layers, pattern[layers])


def predict_stage(job: Job, stage: int, *, device: str = "cpu", layout: Plan | None = None,
                  ep_rank: int | None = None, kernels: str | None = None, env: Mapping[str, str] | None = None,
                  gpu: str | None = None) -> RankPrediction:
    """Predict the whole training step of a rank of pipeline stage ``stage`` (one of :func:`predict_job`'s ranks).

    Args:
        job: the Megatron job.
        stage: the pipeline stage, 0 .. pp - 1.
        device: 'cpu' (exact bytes) or 'cuda' (activations rounded to 512-byte blocks).
        layout: a recompute plan of one model chunk's layers, run by every chunk of the stage instead of
            ``job.policy`` (remat plan's per-stage plans); None: ``job.policy``.
        ep_rank: the expert-parallel rank to price; None: the one whose experts receive the most routed copies
            (NOTE [expert parallelism in a job]).
        kernels: whose kernels' saved tensors the rank keeps: 'cpu', 'cuda' or 'te'; None: :func:`job_kernels`
            (default 'cuda', a GPU job). ``timeline.meta['kernels']`` says which.
        env, gpu: as for :func:`predict_job` (the GEMM workspaces, counted only for a CUDA prediction).

    Returns:
        The stage's :class:`RankPrediction`: its timeline holds the model state and the activations of the
        microbatches in flight under ``job.policy`` (or ``layout``).

    Example:
        >>> from remat.config import ModelConfig
        >>> job = Job.build(ModelConfig(num_layers=4, attention="sdpa"), precision="bf16", pp=2, num_microbatches=2)
        >>> predict_stage(job, 1).stage
        1
    """
    check_job(job)
    kernels = model_kernels(job_kernels(kernels), job.model)  # Megatron's local layers: the 'local' profile
    model, tp, sp, pp, cp = job.model, job.tp, job.sp, job.pp, job.cp
    vpp = job.vpp or 1
    config = model.replace(seq_length=model.seq_length // cp)  # each rank holds s/cp tokens of every sequence
    if config.fp8_recipe is not None:  # the GPU's FP8 GEMM layouts (NOTE [FP8 linears on Blackwell])
        config = config.replace(fp8_sm=check_fp8_gpu(gpu, config.fp8_recipe, config.tp_comm_overlap))
    if pp * vpp > 1 and config.tie_embeddings:
        config = config.replace(tie_embeddings=False)  # the last stage keeps its own copy of the tied embedding
    group = job.microbatch_group_size  # Megatron's microbatch groups of the interleaved schedule (None: pp)
    schedule = check_schedule(job.schedule, pp, job.num_microbatches, vpp, "megatron", group=group)
    chunks = rank_chunks(partition(config, pp, vpp, job.chunk_layers, empty_ends=True), pp, stage)
    combined = job.overlap_moe_expert_parallel_comm  # NOTE [the combined 1F1B schedule] in parallel.composer
    actions = schedule_actions(schedule, pp, job.num_microbatches, vpp, stage, runtime="megatron", group=group,
                               combined=combined)
    window = warmup_forwards(schedule, pp, job.num_microbatches, vpp, stage, "megatron", group=group,
                             combined=combined) + 1
    recompute = job.policy if layout is None else layout
    # TE's fused weight-gradient GEMMs (megatron-core's own linears fuse too, with a transient dummy as large as the
    # unfused gradient: no change there)
    fused = job.gradient_accumulation_fusion and kernels == "te"
    if ep_rank is None:
        ep_rank = busiest_expert_rank(config)
    elif not 0 <= ep_rank < job.ep:
        raise JobError(f"ep_rank={ep_rank}: the job has expert-parallel ranks 0..{job.ep - 1}")
    # each chunk runs the policy on its own layers (chunk_policy: MoE modules only where MoE layers are)
    specs = {s.index: s for s in chunks}
    configs = {c: chunk_config(config, s) for c, s in specs.items()}
    policies = {c: chunk_policy(recompute, configs[c], s.num_layers) for c, s in specs.items()}
    # the chunks whose layers open offload groups: decoder layers, or the last chunk's MTP depths (their layers offload)
    offloaded = {c: frozenset(offload_modules_of(policies[c]) if s.num_layers or (s.is_last and config.mtp_num_layers)
                              else ()) for c, s in specs.items()}
    trace_keys: dict[tuple[int, int], Any] = dict(checkpointed_forwards(actions, None, window))
    # the forwards that offload their last offload groups too (NOTE [which forwards keep their last offload group])
    trace_keys.update(offload_last_groups(actions, offloaded.__getitem__))
    with simulated_expert_groups(tp, job.ep, job.expert_tp, ep_rank):  # the rank's ep and etp positions
        traces = {(c, key): trace_chunk(configs[c], specs[c].kind, policies[c], device,
                                        tp, sp, batch_in_forward=True, kernels=kernels, drop_grads=True,
                                        fused_wgrad=fused, offload_last=frozenset() if key is True else key,
                                        delay_wgrad=job.delay_wgrad_compute and kernels == "te")
                  for c, key in sorted({(c, key) for (c, _), key in trace_keys.items()}, key=str)}
    plan = ShardedStagePlan(config, pp, job.num_microbatches, vpp, stage, schedule, "megatron", chunks, actions,
                            trace_keys, traces,
                            block=CUDA_BLOCK if device == "cuda" else 1, group=group, combined=combined,
                            activation_shards=tp if sp else 1, attention_mask=job.create_attention_mask, cp=cp,
                            mask_to_backward=frozenset(c for c, s in specs.items()
                                                       if keeps_layer_inputs(policies[c], s.num_layers)))
    timeline = compose_stage(plan, recompute, describe=False)  # described once its model state is in
    if job.embedding_wgrad_deferral is not None:  # the last stage's deferred output-layer wgrad (NOTE there)
        defer_output_layer_wgrad(timeline, plan, job.embedding_wgrad_deferral, tp)
    state = stage_state(job, stage, ep_rank if job.ep > 1 else None)
    workspaces = (stage_workspaces(job, stage, env=env, gpu=gpu, kernels=kernels)
                  if device == "cuda" or kernels != "cpu" else [])
    params = [p for chunk in stage_parameters(job, stage) for p in chunk]
    if fused:  # TE's cached dummy weight gradients, one per distinct weight shape (NOTE [gradient-accumulation fusion])
        itemsize = DTYPES[job.param_dtype].itemsize
        workspaces += [(WGRAD_MODULE, nbytes) for _, nbytes in
                       dummy_wgrads(params, itemsize) + output_layer_dummy(params, itemsize)]
    fp8 = 0
    if config.fp8_recipe is not None:  # the FP8 weights' copies and scaling state (NOTE [FP8 linears on Hopper])
        fp8 = fp8_state_bytes([p for p in params if p.fp8], config.fp8_recipe, param_gather=job.fp8_param_gather,
                              amax_history=job.fp8_amax_history_len, block=plan.block, sm=config.fp8_sm)
    add_model_state(timeline, state, ring_exchange_bytes(job), workspaces, block=plan.block,
                    main_grad_copies=main_grad_copy_bytes(job, state), fp8_weights=fp8)
    if job.fsdp is not None:  # its unsharded weight and gradient buckets, by phase (one chunk: pp = 1)
        groups = fsdp_rank_state(job, params)[1]
        add_fsdp_transients(timeline, job, groups, params, block=plan.block)
        timeline.meta["fsdp"] = fsdp_summary(groups)
    if job.torch_fsdp2 is not None:  # its gathers, gradients and reduce-scatters, by phase (NOTE [torch FSDP2])
        add_fsdp2_transients(timeline, job, params, block=plan.block)
    if job.cuda_graph_modules is not None:  # the capture, then a step whose graphs allocate nothing (NOTE there)
        capture = actions if pp > 1 else schedule_actions(schedule, pp, 1, vpp, stage, runtime="megatron", group=group)
        cublas = (cublas_workspace_bytes((env or {}).get("CUBLAS_WORKSPACE_CONFIG"), gpu_major(gpu))
                  if torch_gemms_in_graphs(job) and (device == "cuda" or kernels != "cpu") else 0)
        timeline = add_cuda_graphs(timeline, job, chunks, capture, block=plan.block,
                                   moments_module=OPTIMIZER_STATE_MODULE, cublas_workspace=cublas,
                                   cublas_module=MODULE_TORCH)
    timeline.meta["job"] = {"stage": stage, "tp": tp, "sp": sp, "cp": cp, "dp": job.dp, "pp": pp, "vpp": job.vpp,
                            "ep": job.ep, "ep_rank": state.ep_rank, "expert_dp_rank": state.expert_dp_rank,
                            "precision": job.precision, "optimizer": job.optimizer,
                            "distributed_optimizer": job.distributed_optimizer, "state": state.parts()}
    timeline.meta["kernels"] = kernels
    timeline.meta["not_counted"] = NOT_COUNTED
    describe_stage(timeline)
    rank = state.dp_rank * tp + stage * tp * cp * job.dp  # tp rank 0 of the priced dp x cp shard
    return RankPrediction(stage, rank, tp * cp * job.dp, state, timeline, outside=outside_allocator_buffers(job, stage))


def main_grad_copy_bytes(job: Job, state: RankState) -> int:
    """The fp32 gradients of the master parameters the optimizer step leaves behind when the main grads are not
    fp32 (fp16, or --grad-reduce-in-bf16): megatron/core/optimizer/optimizer.py:1097 ``main_param.grad =
    model_param.main_grad.float()`` (distrib_optimizer.py likewise per shard) is a copy, alive until the next step's
    ``zero_grad(set_to_none=True)`` (optimizer.py:1048), so counted in the resident state after the step (fp32
    main grads: ``.float()`` returns the buffer's own view, no copy)."""
    if job.fsdp is not None:  # fsdp param_and_grad_buffer.py:3376 ``optimizer_grad.to(param.dtype)``, per shard
        return 4 * state.shard_elements if job.fsdp.grads_dtype(job.precision) != "fp32" else 0
    if job.torch_fsdp2 is not None:  # ``model_param.grad.float()`` of each bf16/fp16 sharded gradient
        return 4 * state.shard_elements if job.precision != "fp32" and job.optimizer != "none" else 0
    return state.master_parameters if job.main_grad_dtype != "fp32" else 0


def add_model_state(timeline: Timeline, state: RankState, ring_bytes: int = 0,
                    workspaces: Sequence[tuple[str, int]] = (), *, block: int = 1, main_grad_copies: int = 0,
                    fp8_weights: int = 0) -> None:
    """Put a rank's model state into its stage timeline (in place).

    The chunks are traced with Megatron's DDP hook (``trace_chunk(drop_grads=True)``: each ``param.grad`` is
    dropped once autograd has accumulated it, so it dies where a Megatron rank's does: each bf16 weight gradient is
    a transient from its GEMM to the hook, as with --no-gradient-accumulation-fusion; the fused default, whose GEMM
    writes into the main grad and returns TE's persistent dummy wgrad of the weight's shape, is not modelled); a
    gradient a trace still keeps becomes a transient, and the buffers that
    live all step are added at the first event: the main-gradient buffer, the parameter buffer (its padding), the
    master parameters and the optimizer state, context parallelism's ring buffers and the CUDA libraries' GEMM
    workspaces (``workspaces``: ``(module, bytes)``, NOTE [GEMM workspaces]) and the FP8 linears' weight copies
    and scaling state (``fp8_weights``, :func:`remat.memory.fp8.fp8_state_bytes`).

    The trace rounds each parameter to the allocator's ``block`` bytes, as a separate tensor is on CUDA; with the
    distributed optimizer Megatron moves the parameters into its param_data buffer (they become views of it), so
    their traced rows are emptied and the buffer, rounded once, holds them.
    """
    # module buffers (the router's fp32 expert_bias, local_tokens_per_expert) are no parameters: they stay as traced
    param_rows = [row for row, c in enumerate(timeline.category)
                  if c == "parameters" and not timeline.module[row].endswith(BUFFERS)]
    traced = sum(timeline.nbytes[row] for row in param_rows)
    # compare like with like: both per tensor in the trace's blocks (a 384-element bf16 bias takes 1024 bytes)
    if traced > state.parameter_tensor_bytes(block):
        raise JobError(f"internal: the traced chunk holds {traced} parameter bytes, more than the "
                       f"{state.parameter_tensor_bytes(block)} counted for the rank; please report this job")
    if main_grad_copies > 0:  # main_grad_copy_bytes: made by the optimizer step, the step's last event
        _append_row(timeline, main_grad_copies, MAIN_GRAD_COPY_MODULE, "gradients", timeline.num_events - 1)
    if state.param_buffer:
        for row in param_rows:
            timeline.nbytes[row] = 0
        traced = 0
    # learned positions under CP: the table keeps all s rows, the trace s/cp
    missing = state.allocated_parameter_bytes(block) - traced
    for row, category in enumerate(timeline.category):
        if category == "gradients" and timeline.free_at[row] == -1 and timeline.alloc_at[row] + 1 < \
                timeline.num_events:
            timeline.free_at[row] = timeline.alloc_at[row] + 1
    rows = [(state.gradients, "ddp.grad_buffer", "gradients"),
            (missing, "ddp.param_buffer" if state.param_buffer else "parameters.untraced", "parameters"),
            (state.master_parameters, MASTER_MODULE, "optimizer_state"),
            (state.optimizer_state, OPTIMIZER_STATE_MODULE, "optimizer_state"),
            (fp8_weights, FP8_MODULE, "parameters"),
            (ring_bytes, RING_MODULE, "other"), *((n, module, "other") for module, n in workspaces)]
    for nbytes, module, category in rows:
        if nbytes > 0:
            _append_row(timeline, nbytes, module, category, 0)
    timeline.validate()


def _append_row(timeline: Timeline, nbytes: int, module: str, category: str, event: int) -> None:
    """An allocation of ``nbytes`` made at ``event`` and alive to the end of the step."""
    assert category in CATEGORIES
    timeline.add_row(nbytes, event, -1, module, category, None if event else 0)
