"""Megatron-FSDP's flags (``--use-megatron-fsdp``): the part of a :class:`remat.job.Job` that says how the
parameters, gradients and optimizer state are sharded; the bytes are :mod:`remat.memory.fsdp_state`'s.

Megatron-LM d98e8a64 megatron/training/arguments.py: ``--data-parallel-sharding-strategy`` defaults to
optim_grads_params (3190), ``--megatron-fsdp-main-params-dtype`` to fp32, ``--megatron-fsdp-main-grads-dtype`` and
``--megatron-fsdp-grad-comm-dtype`` to auto (3687-3699; 'auto' maps to None, 1079-1093: the parameters' dtype for
the main grads (param_and_grad_buffer.py:2313 ``_resolve_group_grad_dtype``), the main grads' for the
communication); Megatron-FSDP v1 turns the distributed optimizer on (1128). ``--fsdp-double-buffer`` (3202) keeps
the units' unsharded buckets in two persistent pools (NOTE [Megatron-FSDP double buffers] in
remat.memory.fsdp_state); ``--use-nccl-ub`` (3171) turns it on (1172-1176) and allocates the FSDP buffers from NCCL's
memory pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from remat.job_flags import JobError

STRATEGIES = ("optim", "optim_grads", "optim_grads_params")  # no_shard: refused (flag_value names the choices)
DTYPE_CHOICES = ("fp32", "bf16", "fp16", "auto")


@dataclass(frozen=True)
class FsdpConfig:
    """Megatron-FSDP v1's settings (``--use-megatron-fsdp``); Megatron's defaults."""

    strategy: str = "optim_grads_params"
    """``--data-parallel-sharding-strategy``: optim shards the fp32 main weights (and the optimizer state),
    optim_grads the main grads too, optim_grads_params the model weights too (ZeRO-1/2/3)."""
    main_grads_dtype: str = "auto"
    """``--megatron-fsdp-main-grads-dtype``; auto: the parameters' dtype."""
    grad_comm_dtype: str = "auto"
    """``--megatron-fsdp-grad-comm-dtype``; auto: the main grads' dtype (the unsharded gradient buckets')."""
    main_params_dtype: str = "fp32"
    """``--megatron-fsdp-main-params-dtype``: the sharded main weight buffer the optimizer steps (fp32 only)."""
    double_buffer: bool = False
    """``--fsdp-double-buffer``: the units' all-gather and gradient buckets come from two persistent pools
    (param_and_grad_buffer.py:2524-2576 FixedPoolAllocator), not allocated and freed per unit."""
    nccl_ub: bool = False
    """``--use-nccl-ub``: the FSDP buffers are allocated from NCCL's memory pool (a torch.cuda.MemPool: counted by
    PyTorch's allocator like the others) and registered with NCCL; it turns double buffering on (arguments.py:1172-1176,
    param_and_grad_buffer.py:2046-2053)."""

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise JobError(f"--data-parallel-sharding-strategy {self.strategy}: remat models "
                           f"{', '.join(STRATEGIES)}")
        for name in ("main_grads_dtype", "grad_comm_dtype"):
            if getattr(self, name) not in DTYPE_CHOICES:
                raise JobError(f"FsdpConfig.{name}={getattr(self, name)!r}: one of {', '.join(DTYPE_CHOICES)}")
        if self.nccl_ub and not self.double_buffer:
            raise JobError("FsdpConfig(nccl_ub=True) needs double_buffer=True: --use-nccl-ub turns "
                           "--fsdp-double-buffer on (Megatron-LM arguments.py:1172-1176)")
        if self.main_params_dtype != "fp32":
            raise JobError(f"--megatron-fsdp-main-params-dtype {self.main_params_dtype}: remat models only fp32 "
                           "main weights")

    def grads_dtype(self, precision: str) -> str:
        """The main-gradient buffer's dtype under ``precision`` (auto: the parameters')."""
        return precision if self.main_grads_dtype == "auto" else self.main_grads_dtype

    def comm_dtype(self, precision: str) -> str:
        """The unsharded gradient buckets' dtype (auto: the main grads')."""
        return self.grads_dtype(precision) if self.grad_comm_dtype == "auto" else self.grad_comm_dtype


def fsdp_from_flags(got: dict[str, Any]) -> FsdpConfig | None:
    """The :class:`FsdpConfig` of the parsed flags ``got`` (None without ``--use-megatron-fsdp``)."""
    names = {"strategy": "--data-parallel-sharding-strategy", "main_grads_dtype": "--megatron-fsdp-main-grads-dtype",
             "grad_comm_dtype": "--megatron-fsdp-grad-comm-dtype",
             "main_params_dtype": "--megatron-fsdp-main-params-dtype", "double_buffer": "--fsdp-double-buffer",
             "nccl_ub": "--use-nccl-ub"}
    if not got.get("--use-megatron-fsdp"):
        # --use-nccl-ub with Megatron's DDP allocates its param/grad buffers (the same bytes) from NCCL's pool
        # (core/distributed/param_and_grad_buffer.py:1136-1156): nothing to change
        given = [flag for flag in names.values() if flag in got and flag != "--use-nccl-ub"]
        if given:  # Megatron parses them but uses them only with Megatron-FSDP
            raise JobError(f"{given[0]} without --use-megatron-fsdp: add --use-megatron-fsdp or drop it")
        return None
    fields = {field: got[flag] for field, flag in names.items() if flag in got}
    if fields.get("nccl_ub"):  # arguments.py:1172-1176: --use-nccl-ub turns the double buffers on
        fields["double_buffer"] = True
    return FsdpConfig(**fields)


def fsdp_args(fsdp: FsdpConfig | None) -> list[str]:
    """Megatron flags for ``fsdp`` (with ``--ckpt-format fsdp_dtensor``, which arguments.py:1169 asserts)."""
    if fsdp is None:
        return []
    return ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", fsdp.strategy,
            "--megatron-fsdp-main-params-dtype", fsdp.main_params_dtype,
            "--megatron-fsdp-main-grads-dtype", fsdp.main_grads_dtype,
            "--megatron-fsdp-grad-comm-dtype", fsdp.grad_comm_dtype, "--ckpt-format", "fsdp_dtensor",
            *(["--fsdp-double-buffer"] if fsdp.double_buffer else []), *(["--use-nccl-ub"] if fsdp.nccl_ub else [])]


def check_fsdp(fsdp: FsdpConfig | None, *, precision: str, pp: int, vpp: int | None, cp: int,
               instances: int, moe_overlap: bool) -> None:
    """Refuse, naming the flag, what remat's Megatron-FSDP model does not cover. MoE layers are modelled: their
    experts are each unit's expert group (NOTE [Megatron-FSDP buffers] in remat.memory.fsdp_state), and so is
    ``moe_overlap`` (``--overlap-moe-expert-parallel-comm``): its per-submodule hooks (mcore_fsdp_adapter.py:211-233)
    gather whole buckets, the same units' with the same prefetch, and the EP-overlap schedule releases each layer's
    after its forward and after its backward (``set_fsdp_reshard_hooks``, model_chunk_schedule_plan.py:178-221;
    with --delay-wgrad-compute after the layer's ``backward_dw``, utils.py:312-365), as the units' hooks do
    (NOTE [Megatron-FSDP buffers])."""
    if fsdp is None:
        return
    if pp > 1 or vpp is not None:
        raise JobError("--use-megatron-fsdp with pipeline parallelism: remat models Megatron-FSDP's all-gather "
                       "schedule for one model chunk per rank; use --pipeline-model-parallel-size 1")
    if cp > 1:
        raise JobError("--use-megatron-fsdp with --context-parallel-size > 1: not modelled yet; use cp=1")
    if moe_overlap and fsdp.double_buffer:  # Megatron refuses it: mcore_fsdp_adapter.py:177-181
        raise JobError(f"{'--use-nccl-ub' if fsdp.nccl_ub else '--fsdp-double-buffer'} with "
                       "--overlap-moe-expert-parallel-comm: Megatron-FSDP refuses double buffers with the 1F1B "
                       "overlap (mcore_fsdp_adapter.py:177); drop one of them")
    if instances > 1:  # hybrid FSDP (the outer data-parallel group)
        raise JobError("--use-megatron-fsdp with --num-distributed-optimizer-instances > 1 (hybrid FSDP): not "
                       "modelled yet")
    if fsdp.strategy == "optim" and fsdp.comm_dtype(precision) != fsdp.grads_dtype(precision):
        # param_and_grad_buffer.py:4058: an unsharded grad buffer in another comm dtype gets a bucket copy
        raise JobError("--data-parallel-sharding-strategy optim with --megatron-fsdp-grad-comm-dtype unlike the "
                       "main grads': the copy for the all-reduce is not modelled; drop the comm dtype")


@dataclass(frozen=True)
class TorchFsdp2Config:
    """torch FSDP2 (``--use-torch-fsdp2``): Megatron-LM wraps each TransformerLayer, the embedding, the rotary
    embedding and (TE layers) the output layer, then the root, with ``fully_shard(mesh=dp x cp,
    reshard_after_forward=...)`` and no mixed-precision policy (torch_fully_sharded_data_parallel.py:60-148); the
    bytes are :mod:`remat.memory.torch_fsdp2`'s."""

    reshard_after_forward: bool = True
    """False with ``--torch-fsdp2-no-reshard-after-forward`` (arguments.py:3218, training.py:2627-2629): each unit
    keeps its all-gathered parameters from its forward to its backward."""
    cpu_initialization: bool = False
    """``--use-cpu-initialization``: the model is built on the host and ``fully_shard`` moves one unit at a time to
    the GPU (training.py:2457-2465); without it each rank first builds the whole model on its GPU."""


FSDP2_CKPT_FORMATS = ("torch_dist", "torch_dcp")  # arguments.py:1042; training_config.py:486: torch_dist is the default


def torch_fsdp2_from_flags(got: dict[str, Any], ignored: list[str]) -> TorchFsdp2Config | None:
    """The :class:`TorchFsdp2Config` of the parsed flags ``got`` (None without ``--use-torch-fsdp2``); reads
    ``--ckpt-format`` (which changes no memory: appended to ``ignored``) for Megatron's checks on it."""
    ckpt = got.get("--ckpt-format", "torch_dist")
    if "--ckpt-format" in got:
        ignored.append("--ckpt-format")
    if not got.get("--use-torch-fsdp2"):
        if ckpt == "torch_dcp":  # arguments.py:1667-1668
            raise JobError("--ckpt-format torch_dcp without --use-torch-fsdp2: Megatron asserts 'torch_dcp is only "
                           "tested with FSDP'; use --ckpt-format torch_dist or add --use-torch-fsdp2")
        if got.get("--torch-fsdp2-no-reshard-after-forward"):
            raise JobError("--torch-fsdp2-no-reshard-after-forward without --use-torch-fsdp2: add --use-torch-fsdp2 "
                           "or drop it")
        return None
    if got.get("--use-megatron-fsdp"):  # training/models/dist_utils.py:294-295
        raise JobError("--use-torch-fsdp2 with --use-megatron-fsdp: Megatron raises 'Using use_megatron_fsdp and "
                       "use_torch_fsdp2 at the same time is not supported'; keep one")
    if ckpt not in FSDP2_CKPT_FORMATS:  # arguments.py:1042-1043
        raise JobError(f"--use-torch-fsdp2 with --ckpt-format {ckpt}: Megatron asserts '--use-torch-fsdp2 requires "
                       "--ckpt-format torch_dist or torch_dcp'; use --ckpt-format torch_dist")
    if ckpt == "torch_dcp" and got.get("--tensor-model-parallel-size", 1) > 1:  # arguments.py:1669-1670
        raise JobError("--ckpt-format torch_dcp with --tensor-model-parallel-size > 1: Megatron asserts it is not "
                       "tested with tensor parallelism; use --ckpt-format torch_dist")
    if "--init-model-with-meta-device" in ignored:  # training.py:2472-2474 materialises meta models only without it
        raise JobError("--init-model-with-meta-device with --use-torch-fsdp2: FSDP2 shards the meta parameters and "
                       "Megatron materialises meta models only without FSDP (training.py:2472-2474); not modelled, "
                       "drop it (or use --use-cpu-initialization)")
    return TorchFsdp2Config(reshard_after_forward=not got.get("--torch-fsdp2-no-reshard-after-forward"),
                            cpu_initialization="--use-cpu-initialization" in ignored)


def torch_fsdp2_args(cfg: TorchFsdp2Config | None) -> list[str]:
    """Megatron flags for ``cfg`` (the untied embeddings and --no-gradient-accumulation-fusion it needs are the
    job's own flags)."""
    if cfg is None:
        return []
    return ["--use-torch-fsdp2"] + ["--torch-fsdp2-no-reshard-after-forward"] * (not cfg.reshard_after_forward) + [
        "--use-cpu-initialization"] * cfg.cpu_initialization


def check_torch_fsdp2(job: Any) -> None:
    """Refuse a torch-FSDP2 :class:`remat.job.Job` Megatron refuses (arguments.py:1031-1045, 1739; the message
    names the flag and the fix) or remat does not model."""
    cfg = job.torch_fsdp2
    if cfg is None:
        return
    if not isinstance(cfg, TorchFsdp2Config):
        raise JobError(f"Job.torch_fsdp2={cfg!r}: give a remat.job_fsdp.TorchFsdp2Config or None")
    m = job.model
    megatron = (  # (refused, flag, Megatron's assertion)
        (job.fsdp is not None, "--use-megatron-fsdp", "'Using use_megatron_fsdp and use_torch_fsdp2 at the same time "
         "is not supported' (dist_utils.py:295); keep one"),
        (job.pp > 1 or job.vpp is not None, "--pipeline-model-parallel-size > 1",
         "'--use-torch-fsdp2 is not supported with pipeline parallelism' (arguments.py:1034); use pp=1"),
        (job.ep > 1, "--expert-model-parallel-size > 1",
         "'--use-torch-fsdp2 is not supported with expert parallelism' (arguments.py:1036); use ep=1"),
        (job.distributed_optimizer, "--use-distributed-optimizer", "'--use-torch-fsdp2 is not supported with MCore's "
         "distributed optimizer' (arguments.py:1038); drop it (FSDP2 shards the optimizer state itself)"),
        (job.gradient_accumulation_fusion, "gradient-accumulation fusion (Megatron's default)", "'--use-torch-fsdp2 "
         "is not supported with gradient accumulation fusion' (arguments.py:1040); add "
         "--no-gradient-accumulation-fusion (Job(gradient_accumulation_fusion=False))"),
        (m.tie_embeddings, "tied embeddings (Megatron's default)", "'--use-torch-fsdp2 requires "
         "--untie-embeddings-and-output-weights' (arguments.py:1044); add it (model.replace(tie_embeddings=False))"),
        (job.optimizer in ("muon", "dist_muon"), "--optimizer muon", "'Emerging optimizer does not support "
         "Torch-FSDP2 for now' (arguments.py:1739); use adam or sgd"),
        (job.overlap_param_gather, "--overlap-param-gather", "'--overlap-param-gather only supported with "
         "distributed optimizer, megatron fsdp, or dist_muon' (arguments.py:1024-1026); drop it"),
    )
    unmodelled = (
        (m.fp8_recipe is not None, "--fp8-format", "FSDP2's all-gather of TE's FP8 parameters and their transposes"),
        (job.cuda_graph_modules is not None, "--cuda-graph-impl", "FSDP2's gathers inside or between CUDA graphs"),
        (bool(m.mtp_num_layers), "--mtp-num-layers", "the MTP block's FSDP units"),
        (job.delay_wgrad_compute, "--delay-wgrad-compute", "weight gradients made after FSDP2's post-backward"),
    )
    for bad, flag, why in megatron:
        if bad:
            raise JobError(f"--use-torch-fsdp2 with {flag}: Megatron asserts {why}")
    for bad, flag, what in unmodelled:
        if bad:
            raise JobError(f"--use-torch-fsdp2 with {flag}: {what} is not modelled yet; drop {flag} or FSDP2")
