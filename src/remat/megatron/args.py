"""Megatron-LM's training command line (``pretrain_gpt.py --num-layers ...``) -> the megatron-core
``TransformerConfig`` and job that :func:`remat.megatron.predict_megatron_core` traces.

megatron-core ships without Megatron-LM's argument parser, so the flags that build a GPT's config are mapped here
the way Megatron-LM's ``core_transformer_config_from_args`` maps them (a flag's name is the config field's, with
the exceptions in :data:`RENAMED`). Tokenising (``@file``, a launcher before the ``*.py`` script) and the flags
known not to change memory (``--lr``, ...) are :mod:`remat.job_flags`'s; any other flag is refused by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from remat.job_flags import (
    classify_megatron_flag,
    flag_groups,
    flag_tokens,
    known_megatron_flags,
    shown_flag,
    suggest_flag,
)
from remat.megatron.compat import MegatronSettingError
from remat.megatron.settings import FINE_GRAINED_OFFLOADING
from remat.offload_policy import OFFLOAD_FLAGS
from remat.units import round_up

INT_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
              "kv_channels", "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
              "expert_model_parallel_size", "expert_tensor_parallel_size", "recompute_num_layers", "moe_router_topk",
              "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "q_lora_rank", "kv_lora_rank",
              "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
FLOAT_FIELDS = ("hidden_dropout", "attention_dropout", "moe_expert_capacity_factor", "layernorm_epsilon")
CHOICE_FIELDS = {"recompute_granularity": ("full", "selective"), "recompute_method": ("uniform", "block"),
                 "normalization": ("LayerNorm", "RMSNorm"), "moe_token_dispatcher_type": ("allgather",)}
SWITCH_FIELDS = ("sequence_parallel", "multi_latent_attention", "qk_layernorm", "moe_grouped_gemm", "add_qkv_bias")
# flag -> the config field it sets, where the names differ
RENAMED = {"--num-experts": "num_moe_experts", "--norm-epsilon": "layernorm_epsilon"}
# flags of the job around the model: -> StepShape / predict_megatron_core keyword
JOB_INT_FLAGS = {"--seq-length": "seq_length", "--micro-batch-size": "micro_batch_size", "--vocab-size": "vocab_size",
                 "--make-vocab-size-divisible-by": "make_vocab_size_divisible_by",
                 "--data-parallel-size": "dp", "--max-position-embeddings": "max_position_embeddings"}
JOB_SWITCHES = ("--use-distributed-optimizer", "--bf16", "--fp16", "--swiglu", "--disable-bias-linear",
                "--group-query-attention", "--recompute-activations", "--add-bias-linear",
                "--untie-embeddings-and-output-weights", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
                "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion",
                "--no-gradient-accumulation-fusion", "--use-cpu-initialization")


@dataclass
class MegatronArgs:
    """What a Megatron-LM command line says: the config's fields and the job's sizes."""

    config_fields: dict[str, Any] = field(default_factory=dict)
    job: dict[str, Any] = field(default_factory=dict)
    switches: set[str] = field(default_factory=set)
    ignored: list[str] = field(default_factory=list)


def _flag_field(name: str) -> str:
    return RENAMED.get(name, name[2:].replace("-", "_"))


def _one(name: str, vals: list[str]) -> str:
    if len(vals) != 1:
        raise MegatronSettingError(f"{name} takes one value, got {len(vals)}: write {name} VALUE")
    return vals[0]


def _number(name: str, vals: list[str], kind: type) -> Any:
    text = _one(name, vals)
    try:
        return kind(text)
    except ValueError:
        raise MegatronSettingError(f"{name} {text!r}: expected {'an integer' if kind is int else 'a number'}") from None


def parse_args(argv: str | Sequence[str]) -> MegatronArgs:
    """Split a Megatron-LM command line into config fields, job sizes and ignored flags (see the module
    docstring); a flag remat does not know to be harmless is refused in one line naming it."""
    try:
        tokens, ignored = flag_tokens(argv)
        groups = flag_groups(tokens)
    except ValueError as err:
        raise MegatronSettingError(str(err)) from None
    out = MegatronArgs(ignored=ignored)
    for name, vals in groups:
        key = _flag_field(name)
        if name in JOB_INT_FLAGS:
            out.job[JOB_INT_FLAGS[name]] = _number(name, vals, int)
        elif name in JOB_SWITCHES:
            if vals:
                raise MegatronSettingError(f"{name} is a switch and takes no value")
            out.switches.add(name)
        elif key in INT_FIELDS or key == "num_moe_experts":
            out.config_fields[key] = _number(name, vals, int)
        elif key in FLOAT_FIELDS:
            out.config_fields[key] = _number(name, vals, float)
        elif key in CHOICE_FIELDS:
            value = _one(name, vals)
            if value not in CHOICE_FIELDS[key]:
                raise MegatronSettingError(f"{name} {value}: use one of {', '.join(CHOICE_FIELDS[key])}")
            out.config_fields[key] = value
        elif key in SWITCH_FIELDS:
            out.config_fields[key] = True
        elif name == "--recompute-modules":
            if not vals:
                raise MegatronSettingError("--recompute-modules needs at least one module, e.g. core_attn mlp")
            out.config_fields["recompute_modules"] = vals
        elif name in OFFLOAD_FLAGS:
            raise MegatronSettingError(FINE_GRAINED_OFFLOADING)
        elif name == "--optimizer":
            if _one(name, vals) != "adam":
                raise MegatronSettingError(f"--optimizer {vals[0]}: the Megatron-core front end models adam only")
        elif name == "--position-embedding-type":
            out.job["position_embedding_type"] = _one(name, vals)
        elif classify_megatron_flag(name)[0] == "ignored":
            out.ignored.append(name)
        else:
            guess = suggest_flag(name, front_end_flags())
            hint = f"did you mean {guess}? If not, " if guess else ""
            raise MegatronSettingError(f"{shown_flag(name)} is not one of the flags remat's Megatron-core front end "
                                       f"maps to a TransformerConfig; {hint}remove it, or build the TransformerConfig "
                                       "yourself and call remat.megatron.predict_megatron_core")
    return out


def front_end_flags() -> list[str]:
    """The flags :func:`parse_args` maps (with those :mod:`remat.job_flags` ignores): what a misspelling is
    matched against."""
    fields = (*INT_FIELDS, *FLOAT_FIELDS, *CHOICE_FIELDS, *SWITCH_FIELDS)
    renamed = {field: flag for flag, field in RENAMED.items()}
    return sorted({*JOB_INT_FLAGS, *JOB_SWITCHES, *(renamed.get(f, "--" + f.replace("_", "-")) for f in fields),
                   "--recompute-modules", "--optimizer", "--position-embedding-type",
                   *(f for f in known_megatron_flags() if classify_megatron_flag(f)[0] == "ignored")})


def config_from_args(argv: str | Sequence[str]) -> tuple[Any, dict[str, Any], list[str]]:
    """The ``TransformerConfig`` (``MLATransformerConfig`` with ``--multi-latent-attention``) of a Megatron-LM
    command line, the keywords of :func:`remat.megatron.predict_megatron_core` for its job, and the flags ignored.

    Example::

        >>> config, job, ignored = config_from_args("--num-layers 4 --hidden-size 64 --num-attention-heads 4 "
        ...     "--seq-length 32 --micro-batch-size 2 --vocab-size 100 --lr 1e-4 --tensor-model-parallel-size 2")
        >>> config.tensor_model_parallel_size, job["vocab_size"], job["tp"], ignored
        (2, 256, 2, ['--lr'])
    """
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    parsed = parse_args(argv)
    fields, job, switches = dict(parsed.config_fields), dict(parsed.job), parsed.switches
    for required in ("num_layers", "hidden_size", "num_attention_heads"):
        if required not in fields:
            raise MegatronSettingError(f"--{required.replace('_', '-')} is missing: Megatron requires it")
    for required in ("seq_length", "micro_batch_size", "vocab_size"):
        if required not in job:
            flag = "--" + required.replace("_", "-")
            raise MegatronSettingError(f"{flag} is missing: add {flag} N"
                                       + (" (the tokenizer's vocabulary)" if required == "vocab_size" else ""))
    if "num_query_groups" in fields and "--group-query-attention" not in switches:
        fields.pop("num_query_groups")  # Megatron-LM reads --num-query-groups only with --group-query-attention
    if "--recompute-activations" in switches:
        fields.setdefault("recompute_granularity", "selective")
    if "--swiglu" in switches:
        fields.update(gated_linear_unit=True, activation_func=F.silu)
    if "--disable-bias-linear" in switches:
        fields["add_bias_linear"] = False
    for switch, dtype in (("--bf16", torch.bfloat16), ("--fp16", torch.float16)):
        if switch in switches:
            fields.update({switch[2:]: True, "params_dtype": dtype})
    if fields.get("pipeline_model_parallel_size", 1) > 1:
        fields["pipeline_dtype"] = fields.get("params_dtype", torch.float32)
    fields.setdefault("use_cpu_initialization", True)
    cls = MLATransformerConfig if fields.get("multi_latent_attention") else TransformerConfig
    try:
        config = cls(**fields)
    except (ValueError, AssertionError, TypeError) as err:
        raise MegatronSettingError(f"megatron-core refused these flags: {str(err).splitlines()[0]}") from None
    tp = config.tensor_model_parallel_size
    multiple = job.pop("make_vocab_size_divisible_by", 128) * tp  # Megatron-LM pads the vocabulary like this
    vocab = round_up(job["vocab_size"], multiple)
    job.pop("max_position_embeddings", None)
    if job.pop("position_embedding_type", "learned_absolute") != "learned_absolute":
        raise MegatronSettingError("--position-embedding-type: the front end builds GPTModel with learned absolute "
                                   "positions; rope changes no stored activation of the local spec but is not wired")
    keywords = {"seq_length": job["seq_length"], "micro_batch_size": job["micro_batch_size"], "vocab_size": vocab,
                "tp": tp, "pp": config.pipeline_model_parallel_size, "cp": config.context_parallel_size,
                "ep": config.expert_model_parallel_size, "etp": fields.get("expert_tensor_parallel_size"),
                "dp": job.get("dp"), "ddp": True,
                "use_distributed_optimizer": "--use-distributed-optimizer" in switches, "optimizer": "adam"}
    return config, keywords, parsed.ignored


def predict_from_args(argv: str | Sequence[str], *, ranks: str | Sequence[int] = "distinct",
                      routing: Any = None, device: str = "cpu") -> dict[int, Any]:
    """Predict a Megatron-LM training job from its own command line, rank by rank, with megatron-core's model code.

    Args:
        argv: the ``pretrain_gpt.py`` flags (a string or tokens; ``@file`` reads flags from a file). The model
            is megatron-core's ``GPTModel`` with the local layer spec, wrapped in Megatron's
            DistributedDataParallel, with Adam's state (sharded with ``--use-distributed-optimizer``).
        ranks, routing, device: as :func:`remat.megatron.predict_megatron_core`.

    Returns:
        ``{rank: Timeline}``; each timeline's ``meta['megatron_args_ignored']`` lists the flags that were ignored.

    Example::

        >>> timelines = predict_from_args("--num-layers 4 --hidden-size 64 --num-attention-heads 4 "
        ...                               "--seq-length 32 --micro-batch-size 2 --vocab-size 128 --bf16 "
        ...                               "--recompute-granularity full --recompute-method uniform "
        ...                               "--recompute-num-layers 2 --disable-bias-linear")
        >>> timelines[0].meta["policy"]
        'full/uniform/2'
    """
    from remat.megatron.api import predict_megatron_core

    config, keywords, ignored = config_from_args(argv)
    timelines = predict_megatron_core(config, **keywords, ranks=ranks, routing=routing, device=device)
    for timeline in timelines.values():
        timeline.meta["megatron_args_ignored"] = ignored
    return timelines
