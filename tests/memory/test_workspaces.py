"""remat.memory.workspaces: the GEMM workspaces cuBLAS (PyTorch) and TransformerEngine keep on a GPU rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from remat.config import ModelConfig
from remat.job import Job, JobError
from remat.memory.workspaces import (
    MODULE_TE,
    MODULE_TORCH,
    cublas_workspace_bytes,
    gpu_major,
    stage_workspaces,
    te_workspace_bytes,
)
from remat.parallel.job_predict import RESIDENT_PARTS, parts_at, predict_job, predict_stage

MIB = 2**20
MODEL = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=128, seq_length=32,
                    micro_batch_size=2, attention="sdpa", hidden_dropout=0.0, attention_dropout=0.0)
GOLDEN = Path(__file__).parents[2] / "benchmarks" / "data" / "megatron_golden_h100_dev.json"


def test_cublas_workspace_follows_the_environment_and_the_gpu():
    # CublasHandlePool.cpp parseChosenWorkspaceSize: the sum of :SIZE_KIB:COUNT pairs, else 32 MiB on Hopper and
    # Blackwell (use32mb: majors 9-12), 8.125 MiB before
    assert cublas_workspace_bytes(":4096:8") == 4096 * 1024 * 8 == 32 * MIB
    assert cublas_workspace_bytes(":4096:2:16:8") == 4096 * 1024 * 2 + 16 * 1024 * 8
    assert cublas_workspace_bytes(":16:8") == 16 * 1024 * 8  # the deterministic setting PyTorch documents
    assert cublas_workspace_bytes(None, 9) == 32 * MIB
    assert cublas_workspace_bytes(None, 8) == 4096 * 1024 * 2 + 16 * 1024 * 8
    assert cublas_workspace_bytes(None, gpu_major("b200")) == cublas_workspace_bytes(None, gpu_major("gb200")) \
        == 32 * MIB
    assert cublas_workspace_bytes("nonsense", 9) == 32 * MIB  # torch warns and takes the default
    assert te_workspace_bytes(9) == te_workspace_bytes(10) == 32 * MIB + 1024 and te_workspace_bytes(8) == 4 * MIB
    assert gpu_major("h100-80g") == gpu_major("H200") == gpu_major(None) == 9 and gpu_major("a100-80g") == 8
    with pytest.raises(JobError, match="gpu='tpu'"):
        gpu_major("tpu")


def test_which_stages_run_torch_gemms():
    job = Job.build(MODEL, precision="bf16", pp=2, num_microbatches=2)
    first, last = stage_workspaces(job, 0), stage_workspaces(job, 1)
    assert first == [(MODULE_TE, 32 * MIB + 1024)]  # TE's linears only: no torch GEMM in forward or backward
    # the output layer's torch.matmul: one workspace for the forward thread, one for autograd's backward thread
    assert last == [(MODULE_TORCH, 32 * MIB)] * 2 + [(MODULE_TE, 32 * MIB + 1024)]
    unfused = Job.build(MODEL.replace(attention="math"), precision="bf16", pp=2, num_microbatches=2)
    assert stage_workspaces(unfused, 0) == last  # unfused attention's baddbmm/bmm
    # PyTorch's own layers (the cuda profile) or Megatron's local ones: every linear is a torch GEMM, no TE GEMM
    assert stage_workspaces(job, 0, kernels="cuda") == stage_workspaces(job, 1, kernels="cuda") == \
        [(MODULE_TORCH, 32 * MIB)] * 2
    a100 = stage_workspaces(job, 1, env={"CUBLAS_WORKSPACE_CONFIG": ":16:8"}, gpu="a100")
    assert a100 == [(MODULE_TORCH, 128 * 1024)] * 2 + [(MODULE_TE, 4 * MIB)]
    moe = Job.build(MODEL.replace(num_moe_experts=4, moe_grouped_gemm=True, add_bias_linear=False), precision="bf16")
    assert stage_workspaces(moe, 0).count((MODULE_TE, 32 * MIB + 1024)) == 5  # + one per TE compute stream


def test_a_gpu_rank_keeps_them_all_step_and_a_cpu_rank_none():
    # (gradient-accumulation fusion off: its dummy weight gradients are library buffers too, test_job_predict.py)
    job = Job.build(MODEL, precision="bf16", pp=2, num_microbatches=2, gradient_accumulation_fusion=False)
    gpu = predict_stage(job, 1, kernels="te", device="cuda")
    assert gpu.parts["workspaces"] == sum(n for _, n in stage_workspaces(job, 1))
    rows = [i for i, m in enumerate(gpu.timeline.module) if m in (MODULE_TORCH, MODULE_TE)]
    assert len(rows) == 3 and all(gpu.timeline.alloc_at[i] == 0 and gpu.timeline.free_at[i] == -1 for i in rows)
    cpu = predict_job(job, kernels="cpu")  # a job run on CPU (gloo) has no cuBLAS
    assert all(r.parts["workspaces"] == 0 for r in cpu.ranks)


def test_resident_state_matches_megatrons_h100_measurement():
    # Megatron-LM's functional test gpt3_mcore_te_tp1_pp1_frozen_resume_torch_dist_dist_optimizer (DGX H100): its
    # mem-allocated-bytes after the optimizer step is the model state plus the three GEMM workspaces, to 5 blocks
    cases = {c["case"]: c for c in json.loads(GOLDEN.read_text())["cases"]}
    case = cases["gpt/gpt3_mcore_te_tp1_pp1_frozen_resume_torch_dist_dist_optimizer"]
    argv = [t for flag, v in case["model_args"].items() if v is not False
            for t in ([flag] if v is True else [flag, str(v)])] + ["--world-size", str(case["world_size"])]
    with pytest.warns(UserWarning, match="--vocab-size"):
        job = Job.from_megatron_args(argv)
    rank = predict_stage(job, 0, kernels="te", device="cuda", env=case["env"], gpu="h100")
    end = parts_at(rank.timeline, rank.timeline.num_events - 1)  # after the optimizer step
    resident = sum(end[p] for p in RESIDENT_PARTS)
    measured = list(case["golden"]["mem-allocated-bytes"].values())[-1]
    assert 0 <= measured - resident <= 5 * 512
    assert measured - (resident - end["workspaces"]) > 96 * MIB  # what remat missed before
