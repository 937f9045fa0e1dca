"""Megatron-LM's local layers (--transformer-impl local): the bytes each local attention keeps, the global "mpu"
buffer, the torch workspaces, and the H100 golden cases (remat.memory.local_layers, remat.memory.workspaces)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from autograd_kept import kept_by_node
from torch._subclasses.fake_tensor import FakeTensorMode

from remat.config import ModelConfig
from remat.job import Job
from remat.memory.kernels import kernel_trace, model_kernels
from remat.memory.local_layers import local_attention, local_softmax_fusable
from remat.memory.workspaces import (
    MODULE_ALLGATHER,
    MODULE_TORCH,
    global_buffer_requests,
    global_memory_buffer_bytes,
    stage_workspaces,
)
from remat.parallel.job_predict import RESIDENT_PARTS, main_grad_copy_bytes, parts_at, predict_stage

MIB = 2**20
GOLDEN = Path(__file__).parents[2] / "benchmarks" / "data" / "megatron_golden_h100_dev.json"
LOCAL_CASES = ("gpt/gpt3_mcore_tp1_pp2", "gpt/gpt3_mcore_tp1_pp4", "gpt/gpt3_mcore_tp4_pp1_resume_torch",
               "gpt/gpt3_mcore_tp4_pp1_resume_torch_dist")


def kept_by_local_attention(b: int, a: int, s: int, d: int = 64, dtype: torch.dtype = torch.bfloat16,
                            groups: int = 0, **flags: bool) -> dict[str, int]:
    """Bytes each autograd node of the local attention keeps beyond q, k, v (views of the QKV GEMM output) and the
    caller's mask, by node name; the backward runs."""
    g = groups or a
    with FakeTensorMode(), kernel_trace("local"):
        qkv = torch.empty(b, s, (a + 2 * g) * d, dtype=dtype, requires_grad=True)
        q, k, v = qkv.split([a * d, g * d, g * d], dim=-1)
        q, k, v = (t.view(b, s, -1, d).transpose(1, 2) for t in (q, k, v))
        mask = torch.ones(1, 1, s, s, dtype=torch.bool)
        out = local_attention(q, k, v, mask, 0.1, d ** -0.5, **flags)
        kept = kept_by_node(out, qkv, mask)
        out.sum().backward()
        assert qkv.grad.shape == qkv.shape
    return kept


def test_local_attention_with_the_fused_causal_softmax_keeps_five_bytes_per_score() -> None:
    # dot_product_attention.py: baddbmm (:194, keeps q, k), ScaledUpperTriangMaskedSoftmax (fused_softmax.py:36,
    # keeps its bf16 output), nn.Dropout -> native_dropout (bool mask), bmm (:239, keeps the dropped bf16 probabilities
    # and v); the scores are a new tensor, not kept
    b, a, s = 4, 8, 1024
    assert kept_by_local_attention(b, a, s) == {"_UpperTriangSoftmaxBackward": 2 * b * a * s * s,
                                                "NativeDropoutBackward0": b * a * s * s,
                                                "AttentionContextBackward": 2 * b * a * s * s}
    assert sum(kept_by_local_attention(b, a, s).values()) == 160 * MIB  # 5 b a s² per layer at b=4, a=8, s=1024
    # fp16, tp=4 (2 heads): b*np = 8 is a multiple of batch_per_block(1024) = 4, the fused kernel runs
    assert sum(kept_by_local_attention(4, 2, 1024, dtype=torch.float16).values()) == 5 * 4 * 2 * 1024 * 1024


@pytest.mark.parametrize("flags, softmax", [({}, 2), ({"in_fp32": True}, 4), ({"scaled": True}, 4)])
def test_local_attention_without_the_fused_kernel_keeps_the_torch_softmax(flags, softmax) -> None:
    # b*np = 2 (not a multiple of 4): forward_torch_softmax (fused_softmax.py:299): fp32 with softmax_in_fp32 (forced
    # by --apply-query-key-layer-scaling), masked_fill_ keeps the caller's mask (alive anyway), softmax its output
    b, a, s = 1, 2, 32
    assert kept_by_local_attention(b, a, s, **flags) == {"SoftmaxBackward0": softmax * b * a * s * s,
                                                         "NativeDropoutBackward0": b * a * s * s,
                                                         "AttentionContextBackward": 2 * b * a * s * s}
    fused_off = kept_by_local_attention(4, 8, 64, fusion=False)  # --no-masked-softmax-fusion
    assert fused_off["SoftmaxBackward0"] == 2 * 4 * 8 * 64 * 64


def test_local_softmax_kernel_availability_follows_is_kernel_available() -> None:
    assert local_softmax_fusable(torch.bfloat16, 4, 8, 1024, 1024)
    assert local_softmax_fusable(torch.float16, 4, 2, 4096, 4096)
    assert not local_softmax_fusable(torch.bfloat16, 4, 8, 8192, 8192)  # sk <= 4096 (TE's: < 16384)
    assert not local_softmax_fusable(torch.float32, 4, 8, 1024, 1024)
    assert not local_softmax_fusable(torch.bfloat16, 1, 2, 1024, 1024)  # b*np % 4
    assert not local_softmax_fusable(torch.bfloat16, 2, 2, 64, 64)      # b*np % batch_per_block(64) = 8
    assert not local_softmax_fusable(torch.bfloat16, 4, 8, 1024, 1024, fusion=False)


def test_local_attention_repeats_keys_and_values_under_gqa() -> None:
    b, a, s, d = 2, 4, 32, 16
    kept = kept_by_local_attention(b, a, s, d, groups=2)
    assert kept["_LocalScoresBackward"] == 2 * b * a * s * d  # the repeated K (and V, kept by the bmm)


MODEL = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=128, seq_length=32,
                    micro_batch_size=2, attention="sdpa", transformer_impl="local")


def test_the_global_buffer_holds_the_largest_request_per_name_and_dtype() -> None:
    # megatron/core/utils.py:735 GlobalMemoryBuffer.get_tensor: one tensor per (name, dtype), regrown, never freed
    assert global_memory_buffer_bytes([(("mpu", 2), 10), (("mpu", 2), 30), (("mpu", 4), 5)]) == 35
    job = Job.build(MODEL, precision="bf16", pp=2, num_microbatches=2)
    scores = 2 * 4 * 32 * 32 * 2  # b x heads x s x s, bf16
    assert global_buffer_requests(job, 0) == [(("mpu", 2), scores)]
    # every linear is torch's (tensor_parallel/layers.py:459): two cuBLAS workspaces on every stage, no TE one
    assert stage_workspaces(job, 0) == [(MODULE_TORCH, 32 * MIB)] * 2 + [(MODULE_ALLGATHER, scores)]
    sp = Job.build(MODEL.replace(num_attention_heads=8), precision="bf16", tp=4, sp=True)
    gathered = 32 * 2 * 64 * 2  # s x b x h, the column-parallel linears' all-gather (layers.py:627)
    assert global_buffer_requests(sp, 0) == [(("mpu", 2), 2 * 2 * 32 * 32 * 2), (("mpu", 2), gathered)]
    assert stage_workspaces(sp, 0)[-1] == (MODULE_ALLGATHER, gathered)  # the larger of the two
    te_sp = Job.build(MODEL.replace(transformer_impl="transformer_engine"), precision="bf16", tp=2, sp=True)
    assert global_buffer_requests(te_sp, 0) == [(("mpu", 2), gathered)]  # the output layer is megatron-core's


def test_cuda_and_te_profiles_of_a_local_model_are_local() -> None:
    assert model_kernels("te", MODEL) == model_kernels("cuda", MODEL) == "local"
    assert model_kernels("cpu", MODEL) == "cpu"
    assert model_kernels("te", MODEL.replace(transformer_impl="transformer_engine")) == "te"


def test_fp16_leaves_fp32_master_grads_after_the_step() -> None:
    # optimizer.py:1097 main_param.grad = model_param.main_grad.float(): a copy of fp16 main grads, not of fp32 ones
    fp16 = Job.build(MODEL, precision="fp16", num_microbatches=2)
    rank = predict_stage(fp16, 0, kernels="te", device="cuda")
    end = parts_at(rank.timeline, rank.timeline.num_events - 1)
    assert main_grad_copy_bytes(fp16, rank.state) == rank.state.master_parameters > 0
    assert end["gradients"] == rank.state.gradients + rank.state.master_parameters
    bf16 = Job.build(MODEL, precision="bf16", num_microbatches=2)
    assert main_grad_copy_bytes(bf16, predict_stage(bf16, 0, kernels="te", device="cuda").state) == 0


def _golden(name: str) -> dict:
    return next(c for c in json.loads(GOLDEN.read_text())["cases"] if c["case"] == name)


@pytest.mark.parametrize("name", LOCAL_CASES)
def test_megatrons_local_golden_cases_within_5_percent(name: str) -> None:
    case = _golden(name)
    argv = [str(t) for flag, value in case["model_args"].items() for t in
            ([flag] if value is True else [flag, value])] + ["--world-size", str(case["world_size"])]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        job = Job.from_megatron_args(argv)
        rank = predict_stage(job, job.pp - 1, device="cuda", kernels="te", env=case["env"], gpu="h100")
    assert rank.timeline.meta["kernels"] == "local"
    peak = max(case["golden"]["mem-max-allocated-bytes"].values())
    resident = case["golden"]["mem-allocated-bytes"]
    resident = resident[max(resident, key=int)]
    end = parts_at(rank.timeline, rank.timeline.num_events - 1)
    assert abs(rank.peak_bytes / peak - 1) < 0.05
    assert abs(sum(end[p] for p in RESIDENT_PARTS) / resident - 1) < 0.02
