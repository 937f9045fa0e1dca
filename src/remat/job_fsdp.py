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
