"""What a :class:`remat.job.Job` accepts of Megatron-LM's Muon optimizer (``--optimizer muon`` / ``dist_muon``);
its memory is modelled in :mod:`remat.memory.muon` (facts at NVIDIA/Megatron-LM d98e8a6, files cited)."""

from __future__ import annotations

from remat.config import ModelConfig
from remat.job_flags import JobError


def check_muon(model: ModelConfig, optimizer: str, precision: str, distributed: bool, instances: int, ep: int,
               fsdp: bool = False) -> bool:
    """Refuse, naming the field, the Muon jobs Megatron refuses; return whether the optimizer is distributed.

    ``optimizer='dist_muon'`` is Megatron's deprecated name of muon with ``--use-distributed-optimizer``
    (megatron/training/arguments.py:1725-1736: both become the layer-wise distributed optimizer, and
    training.py:2262-2263 turns DDP's distributed-optimizer buffers on for either).

    Example:
        >>> check_muon(ModelConfig(), "dist_muon", "bf16", False, 1, 1)
        True
        >>> check_muon(ModelConfig(), "muon", "fp16", False, 1, 1)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        remat.job_flags.JobError: optimizer='muon' with precision='fp16': Megatron raises ...
    """
    distributed = distributed or optimizer == "dist_muon"
    if precision == "fp16":
        raise JobError("optimizer='muon' with precision='fp16': Megatron raises 'emerging optimizer with fp16 is not "
                       "supported.' (megatron/core/optimizer/__init__.py:774); use bf16 or fp32")
    if fsdp:  # megatron/training/arguments.py:1738-1739
        raise JobError("optimizer='muon' with Megatron-FSDP (--use-megatron-fsdp): Megatron asserts 'Emerging "
                       "optimizer does not support Megatron-FSDP for now.'; use DDP")
    if distributed and instances > 1:  # layer_wise_optimizer.py:536-541
        raise JobError(f"optimizer='muon' with distributed_optimizer_instances={instances} "
                       "(--num-distributed-optimizer-instances): Megatron's layer-wise distributed optimizer "
                       "asserts a single instance; use 1")
    # optimizer/__init__.py:915-924: the scalar (Adam) groups of expert-parallel parameters are not wired up
    if distributed and model.is_moe and model.add_bias_linear and ep > 1:
        raise JobError("optimizer='muon' with the distributed optimizer and expert biases (no "
                       "--disable-bias-linear) under expert parallelism: Megatron asserts 'Non-emerging "
                       "expert-parallel param groups are not yet supported'; add --disable-bias-linear")
    return distributed
