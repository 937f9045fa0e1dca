"""A :class:`remat.job.Job` written back as Megatron-LM flags (:meth:`remat.job.Job.to_megatron_args`)."""

from __future__ import annotations

from typing import Any

from remat import job_loss, job_pipeline
from remat.job_cuda_graphs import cuda_graph_args
from remat.job_experts import moe_mla_args
from remat.job_flags import JobError
from remat.job_fsdp import fsdp_args, torch_fsdp2_args
from remat.job_tp_overlap import tp_overlap_args
from remat.policy import PolicyError


def megatron_argv(job: Any, include_world_size: bool = True) -> list[str]:
    """Megatron-LM flags for ``job`` (see :meth:`remat.job.Job.to_megatron_args`, which calls it)."""
    if job.schedule == "gpipe":
        raise JobError("schedule='gpipe' has no Megatron equivalent (Megatron runs 1f1b, or interleaved with "
                       "vpp): use job.replace(schedule='1f1b')")
    if job.optimizer == "none":
        raise JobError("optimizer='none' has no Megatron flag (Megatron always builds an optimizer): "
                       "use job.replace(optimizer='adam')")
    if job.policy.engine != "reentrant":
        raise JobError(f"policy {job.policy} uses the non-reentrant engine, but Megatron's checkpointing is "
                       "always reentrant: use the policy without '@non-reentrant'")
    try:
        recompute = job.policy.to_megatron_args()
    except PolicyError as err:
        raise JobError(str(err)) from None
    m = job.model
    args = ["--num-layers", str(m.num_layers), "--hidden-size", str(m.hidden_size),
            "--num-attention-heads", str(m.num_attention_heads)]
    if m.num_query_groups is not None:
        args += ["--group-query-attention", "--num-query-groups", str(m.num_query_groups)]
    args += ["--ffn-hidden-size", str(m.ffn_size), "--seq-length", str(m.seq_length),
             "--max-position-embeddings", str(m.seq_length), "--micro-batch-size", str(m.micro_batch_size),
             "--global-batch-size", str(job.global_batch_size), "--padded-vocab-size", str(m.vocab_size),
             "--normalization", {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}[m.normalization],
             "--position-embedding-type", {"learned": "learned_absolute", "rope": "rope"}[m.position],
             "--hidden-dropout", repr(float(m.hidden_dropout)),
             "--attention-dropout", repr(float(m.attention_dropout))]
    args += ["--swiglu"] * (m.activation == "swiglu") + ["--untie-embeddings-and-output-weights"] * (
        not m.tie_embeddings) + ["--disable-bias-linear"] * (not m.add_bias_linear) + ["--add-qkv-bias"] * (
        m.add_qkv_bias and not m.add_bias_linear)
    args += ["--attention-backend", "unfused"] * (m.attention == "math") + ["--no-rope-fusion"] * (
        not m.apply_rope_fusion)
    if m.activation == "quick_geglu":  # NOTE [gpt-oss layers] in remat.models.blocks
        args += ["--quick-geglu", "--glu-linear-offset", repr(float(m.glu_linear_offset))]
        args += ["--activation-func-clamp-value", repr(float(m.activation_func_clamp_value))] * (
            m.activation_func_clamp_value is not None) + ["--no-bias-gelu-fusion"] * (not m.bias_activation_fusion)
    args += ["--softmax-type", m.softmax_type] * (m.softmax_type != "vanilla")
    if m.window_size is not None:
        freq = m.window_attn_skip_freq
        args += ["--window-size", f"{m.window_size[0]},{m.window_size[1]}"] + ["--window-attn-skip-freq", str(
            freq) if isinstance(freq, int) else "[" + ",".join(map(str, freq)) + "]"] * (freq is not None)
    args += ["--kv-channels", str(m.kv_channels)] * (m.kv_channels is not None) + moe_mla_args(m)
    args += ["--tensor-model-parallel-size", str(job.tp), "--pipeline-model-parallel-size", str(job.pp),
             "--context-parallel-size", str(job.cp)] + ["--sequence-parallel"] * job.sp
    args += ["--expert-model-parallel-size", str(job.ep)] * (job.ep > 1)
    if job.vpp is not None:
        args += ["--num-virtual-stages-per-pipeline-rank", str(job.vpp)]
    if job.etp is not None:
        args += ["--expert-tensor-parallel-size", str(job.etp)]
    args += job_pipeline.pipeline_split_args(job)
    if include_world_size:
        args += ["--world-size", str(job.world_size)]
    if job.precision != "fp32":
        args.append(f"--{job.precision}")
    if job.precision == "fp16" and job.accumulate_grads_in_fp32:
        args.append("--accumulate-allreduce-grads-in-fp32")
    if job.precision == "bf16" and not job.accumulate_grads_in_fp32:
        args.append("--grad-reduce-in-bf16")
    args += ["--optimizer", job.optimizer]
    if job.optimizer == "sgd":
        args += ["--sgd-momentum", repr(float(job.sgd_momentum))]
    args += ["--use-distributed-optimizer"] * job.distributed_optimizer + [
        "--num-distributed-optimizer-instances", str(job.distributed_optimizer_instances)] * (
        job.distributed_optimizer_instances > 1) + ["--no-gradient-accumulation-fusion"] * (
        not job.gradient_accumulation_fusion) + ["--overlap-grad-reduce"] * (
        job.overlap_grad_reduce) + ["--ddp-pad-buckets-for-high-nccl-busbw"] * job.pad_buckets_for_high_nccl_busbw
    args += ["--overlap-moe-expert-parallel-comm"] * job.overlap_moe_expert_parallel_comm
    if m.fp8_recipe is not None:  # remat.job_fp8 (the format, e4m3 or hybrid, keeps one byte either way)
        args += ["--fp8-format", "hybrid", "--fp8-recipe", m.fp8_recipe] + ["--fp8-param-gather"] * job.fp8_param_gather
        args += ["--fp8-amax-history-len", str(job.fp8_amax_history_len)] * (job.fp8_amax_history_len != 1)
        if m.fp8_layers is not None:  # leading and trailing bf16 layers (remat.job_fp8)
            start = next(i for i, v in enumerate(m.fp8_layers + (1,)) if v)
            end = next(i for i, v in enumerate(m.fp8_layers[::-1] + (1,)) if v)
            args += ["--first-last-layers-bf16", "--num-layers-at-start-in-bf16", str(start),
                     "--num-layers-at-end-in-bf16", str(end)]
    args += ["--delay-wgrad-compute"] * job.delay_wgrad_compute + tp_overlap_args(job.tp_comm_overlap)
    args += ["--no-create-attention-mask-in-dataloader"] * (not job.create_attention_mask)
    args += cuda_graph_args(job.cuda_graph_modules, job.cuda_graph_warmup_steps)  # remat.job_cuda_graphs
    args += ["--overlap-param-gather"] * job.overlap_param_gather
    if job.ddp_bucket_size is not None:
        args += ["--ddp-bucket-size", str(job.ddp_bucket_size)]
    return args + fsdp_args(job.fsdp) + torch_fsdp2_args(job.torch_fsdp2) + job_loss.loss_args(m) + recompute
