"""The FP8 part of a Megatron-LM command line (``--fp8-format``, ``--fp8-recipe``, ``--fp8-param-gather``,
``--fp8-amax-history-len``, ``--fp8-amax-compute-algo``, ``--fp8-margin``, ``--fp8-interval``,
``--first-last-layers-bf16`` with ``--num-layers-at-start/end-in-bf16``): read into ``ModelConfig.fp8_recipe`` and
``fp8_layers`` (what each FP8 linear keeps: :mod:`remat.memory.fp8`) and the job's
``fp8_param_gather`` / ``fp8_amax_history_len`` (what a rank keeps for the whole run).

Facts from Megatron-LM d98e8a64: ``--fp8-format`` (e4m3 or hybrid) turns FP8 on (arguments.py: ``args.fp8``); the
recipe defaults to ``delayed``; ``mxfp8`` is TE's ``MXFP8BlockScaling`` (transformer_engine.py:279), Blackwell
only; ``--fp8-param-gather`` needs the distributed optimizer or FSDP (arguments.py:1095);
``--fp8-amax-history-len`` defaults to 1 and sizes delayed scaling's amax history (``TEDelayedScaling``); the
compute algorithm, margin and interval change values only. The FP8 formats hold one byte per element either way.
"""

from __future__ import annotations

from typing import Any

from remat.config import ModelConfig
from remat.job_flags import JobError

FP8_VALUE_FLAGS = ("--fp8-amax-compute-algo", "--fp8-margin", "--fp8-interval")


def fp8_fields(got: dict[str, Any], ignored: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(model fields, job fields)`` of the FP8 flags in ``got`` (flag -> parsed value); the flags that change
    values only are appended to ``ignored``.

    Example:
        >>> fp8_fields({"--fp8-format": "hybrid", "--fp8-param-gather": True}, [])
        ({'fp8_recipe': 'delayed'}, {'fp8_param_gather': True, 'fp8_amax_history_len': 1})
    """
    ignored += [flag for flag in FP8_VALUE_FLAGS if flag in got]
    fmt = got.get("--fp8-format")
    if fmt is None:
        given = [flag for flag in ("--fp8-recipe", "--fp8-param-gather", "--fp8-amax-history-len",
                                   "--first-last-layers-bf16", "--num-layers-at-start-in-bf16",
                                   "--num-layers-at-end-in-bf16") if flag in got]
        ignored += given  # Megatron reads them only under --fp8-format (args.fp8 is None otherwise)
        return {}, {}
    recipe = got.get("--fp8-recipe", "delayed")
    # mxfp8 runs on Blackwell only (TE check_mxfp8_support): its GEMM layouts are Blackwell's (NOTE [FP8 linears on
    # Blackwell]); the other recipes take the job's GPU when it is predicted
    model: dict[str, Any] = {"fp8_recipe": recipe} | ({"fp8_sm": 10} if recipe == "mxfp8" else {})
    counts = [got.get(f"--num-layers-at-{end}-in-bf16", 1) for end in ("start", "end")]
    if got.get("--first-last-layers-bf16"):
        # transformer_config.py:1529-1556: not with delayed scaling; each count within one stage's layers
        if recipe == "delayed":
            raise JobError("--first-last-layers-bf16 with --fp8-recipe delayed: Megatron refuses it ('Delayed scaling "
                           "does not support first / last layer in BF16'); use --fp8-recipe tensorwise or drop it")
        layers, pp = got["--num-layers"], got.get("--pipeline-model-parallel-size", 1)
        for end, n in zip(("start", "end"), counts):
            if not 0 <= n <= layers // pp:
                raise JobError(f"--num-layers-at-{end}-in-bf16 {n}: Megatron needs 0 to the layers of one pipeline "
                               f"stage ({layers // pp}); give a count in that range")
        bf16 = set(range(counts[0])) | set(range(layers - counts[1], layers))  # fp8_utils.py:711
        model["fp8_layers"] = tuple(int(i not in bf16) for i in range(layers)) if bf16 else None
    else:
        ignored += [f"--num-layers-at-{end}-in-bf16" for end in ("start", "end")
                    if f"--num-layers-at-{end}-in-bf16" in got]
    return model, {"fp8_param_gather": bool(got.get("--fp8-param-gather")),
                   "fp8_amax_history_len": got.get("--fp8-amax-history-len", 1)}


def check_fp8(model: ModelConfig, *, param_gather: bool, amax_history_len: int, distributed_optimizer: bool,
              fsdp: bool, precision: str) -> None:
    """Refuse an FP8 job Megatron refuses or remat does not model, naming the flag and the fix."""
    if isinstance(amax_history_len, bool) or not isinstance(amax_history_len, int) or amax_history_len < 1:
        raise JobError(f"fp8_amax_history_len (--fp8-amax-history-len)={amax_history_len!r}: must be a positive "
                       "integer")
    if model.fp8_recipe is None:
        if param_gather:
            raise JobError("--fp8-param-gather without --fp8-format: Megatron trains in FP8 only with --fp8-format "
                           "(e4m3 or hybrid); add it or drop --fp8-param-gather")
        return
    if precision == "fp32":
        raise JobError("--fp8-format in an fp32 job: Megatron's FP8 layers run beside --bf16 (or --fp16) weights; "
                       "add --bf16")
    if model.transformer_impl == "local":
        raise JobError("--fp8-format with --transformer-impl local: FP8 GEMMs are TransformerEngine's; use "
                       "--transformer-impl transformer_engine")
    if fsdp:
        raise JobError("--fp8-format with --use-megatron-fsdp: Megatron-FSDP's FP8 parameter and workspace handling "
                       "is not modelled yet; price the job without FSDP, or without FP8 as a lower bound of the "
                       "activations")
    if param_gather and model.fp8_recipe == "mxfp8":
        raise JobError("--fp8-param-gather with --fp8-recipe mxfp8 is not modelled: Megatron's DDP buffer then shares "
                       "the MXFP8 parameters' all-gather with the gradient buffer (param_and_grad_buffer.py:1160-1176, "
                       "--reuse-grad-buf-for-mxfp8-param-ag); drop --fp8-param-gather to price bf16 weights with TE's "
                       "cached MXFP8 copies")
    if param_gather and not distributed_optimizer:
        raise JobError("--fp8-param-gather needs --use-distributed-optimizer (Megatron asserts it: "
                       "arguments.py:1095): add it or drop --fp8-param-gather")
