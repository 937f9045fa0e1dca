"""Megatron settings that megatron-core 0.16.1 cannot run on CPU / under fake tensors, refused up front.

Each entry is a bug of megatron-core (or a CUDA-only feature) met while tracing; refusing the setting before the
model is built turns a traceback - or a recursion that never ends - into one line naming the setting and what to
use instead. tests/megatron/test_settings.py checks that megatron-core still fails on each (so an entry can go
when megatron-core is fixed).
"""

from __future__ import annotations

from typing import Any

from remat.megatron.compat import MegatronSettingError
from remat.megatron.world import ParallelSizes

# megatron-core's fine-grained activation offloading (PipelineOffloadManager) makes torch.cuda streams and events and
# needs TransformerEngine's cpu_offload module: it cannot run on CPU or under fake tensors here.
FINE_GRAINED_OFFLOADING = (
    "fine_grained_activation_offloading (--fine-grained-activation-offloading --offload-modules ...): megatron-core "
    "0.16.1 runs it on CUDA streams with TransformerEngine's cpu_offload, which cannot be traced on CPU; predict it "
    "on remat's reference model instead, with the same flags (remat predict --megatron-args '... "
    "--fine-grained-activation-offloading --offload-modules ...', or --policy 'selective,offload:core_attn+attn_proj')")


def known_failures(config: Any) -> list[str]:
    """One line per setting of ``config`` that megatron-core 0.16.1 fails on here."""
    problems = []
    if getattr(config, "fine_grained_activation_offloading", False):
        problems.append(FINE_GRAINED_OFFLOADING)
    modules = set(config.recompute_modules or ()) if config.recompute_granularity == "selective" else set()
    if "mlp" in modules and config.add_bias_linear and not config.num_moe_experts:
        problems.append("recompute_modules=['mlp'] with add_bias_linear=True: megatron-core 0.16.1 recurses without "
                        "end in the checkpointed MLP's bias-activation fusion; set add_bias_linear=False "
                        "(--disable-bias-linear) or drop 'mlp' from recompute_modules")
    if config.num_moe_experts and config.add_bias_linear:
        problems.append("num_moe_experts with add_bias_linear=True: megatron-core 0.16.1's MoE layer fails in forward "
                        "with biased experts; set add_bias_linear=False (--disable-bias-linear)")
    per_stage = config.num_layers // max(1, config.pipeline_model_parallel_size)
    if config.recompute_granularity == "full" and config.recompute_method == "uniform" \
            and per_stage % config.recompute_num_layers:
        problems.append(f"recompute_method='uniform' with recompute_num_layers={config.recompute_num_layers}, which "
                        f"does not divide the {per_stage} layers of a pipeline stage: megatron-core 0.16.1 indexes "
                        "past the last layer (IndexError); use a divisor of the stage's layers")
    if config.fp8 or getattr(config, "fp4", None):
        problems.append("fp8/fp4: needs TransformerEngine and a GPU; trace in bf16 (the activations' shapes are "
                        "the same, their bytes are not)")
    return problems


def check_settings(config: Any, seq_length: int, sizes: ParallelSizes) -> None:
    """Refuse, in one line naming the setting, what megatron-core cannot trace here (see :func:`known_failures`),
    and sizes that do not divide."""
    problems = known_failures(config)
    if problems:
        raise MegatronSettingError(problems[0])
    if seq_length % sizes.cp:
        raise MegatronSettingError(f"seq_length={seq_length} is not divisible by cp={sizes.cp} (context parallel)")
    if config.sequence_parallel and (seq_length // sizes.cp) % sizes.tp:
        raise MegatronSettingError(f"seq_length/cp={seq_length // sizes.cp} is not divisible by tp={sizes.tp}, "
                                   "which sequence_parallel needs")
    if config.tensor_model_parallel_size != sizes.tp or config.pipeline_model_parallel_size != sizes.pp \
            or config.context_parallel_size != sizes.cp or config.expert_model_parallel_size != sizes.ep:
        raise MegatronSettingError(
            f"the TransformerConfig says tp={config.tensor_model_parallel_size} pp="
            f"{config.pipeline_model_parallel_size} cp={config.context_parallel_size} ep="
            f"{config.expert_model_parallel_size}, the job tp={sizes.tp} pp={sizes.pp} cp={sizes.cp} ep={sizes.ep}: "
            "set tensor_model_parallel_size=... in the config to the job's sizes")
