"""Megatron-FSDP with --overlap-moe-expert-parallel-comm (and --delay-wgrad-compute, --overlap-param-gather):
when the unsharded buckets are made and what the step leaves gathered (NOTE [Megatron-FSDP buffers])."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from remat.job import Job
from remat.memory.fsdp_state import (
    GATHER_MODULE,
    GRAD_BUCKET_MODULE,
    PRESERVED_MODULE,
    fsdp_rank_state,
    start_param_sync_buckets,
    unit_size,
)
from remat.parallel.job_predict import RESIDENT_PARTS, parts_at, predict_stage, stage_parameters

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
CASE = "moe/deepseek_proxy_fsdp_ep2_fsdp2_ep_overlap"
FLAGS = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --micro-batch-size 2 "
         "--vocab-size 1000 --bf16 --world-size 4 --global-batch-size 16 --num-experts 4 --moe-grouped-gemm "
         "--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall --use-megatron-fsdp "
         "--untie-embeddings-and-output-weights --no-gradient-accumulation-fusion --overlap-grad-reduce "
         "--overlap-moe-expert-parallel-comm --delay-wgrad-compute --megatron-fsdp-grad-comm-dtype fp32 "
         "--megatron-fsdp-main-grads-dtype fp32 ")


def _rank(flags: str):  # noqa: ANN202
    job = Job.from_megatron_args(flags)
    return job, predict_stage(job, 0, device="cuda", kernels="te")


def test_output_layer_group_bucket_made_at_its_weight_gradient() -> None:
    job, rank = _rank(FLAGS)
    tl = rank.timeline
    head = next((p, s, e) for p, s, e in tl.phase_spans() if p.kind == "backward" and p.region == "head")
    assert job.num_microbatches == 2  # the first backward's head
    out = next(p for p in stage_parameters(job, 0)[0] if p.name == "head.output_layer.weight")
    _, groups = fsdp_rank_state(job, stage_parameters(job, 0)[0])
    (non_unit,) = [g for g in groups if g.unit is None]
    bucket = [i for i in range(len(tl.nbytes)) if tl.module[i] == GRAD_BUCKET_MODULE
              and tl.nbytes[i] == -(-non_unit.size * 4 // 512) * 512 and head[1] <= tl.alloc_at[i] < head[2]]
    wgrad = [tl.alloc_at[i] for i in range(len(tl.nbytes)) if tl.nbytes[i] == -(-out.numel * 2 // 512) * 512
             and head[1] <= tl.alloc_at[i] < head[2]]
    # _grad_acc allocates the fp32 bucket on the first main_grad access: the output layer's bf16 weight gradient
    # (megatron_fsdp.py:635-682), not where the head's backward starts (the logits' gradient comes first)
    assert len(bucket) == 1 and wgrad and tl.alloc_at[bucket[0]] == min(wgrad) > head[1]


def test_overlap_param_gather_leaves_start_param_sync_buckets() -> None:
    job, with_flag = _rank(FLAGS + "--overlap-param-gather")
    _, without = _rank(FLAGS)
    params = stage_parameters(job, 0)[0]
    _, groups = fsdp_rank_state(job, params)
    taken = start_param_sync_buckets(groups, unit_size(groups, params))
    assert taken == list(range(len(groups)))  # a small model: every bucket within the 500M-element prefetch

    def resident(rank) -> int:  # noqa: ANN001
        end = parts_at(rank.timeline, rank.timeline.num_events - 1)
        return sum(end[p] for p in RESIDENT_PARTS)

    # distrib_optimizer.py:3181-3185 start_param_sync after the step: the preserved non-unit buckets and the units'
    # gathered ones stay, in the parameters' dtype
    gathered = sum(-(-groups[i].size * 2 // 512) * 512 for i in taken)
    assert resident(with_flag) - resident(without) == gathered
    tl = with_flag.timeline
    kept = {tl.module[i] for i in range(len(tl.nbytes)) if tl.free_at[i] == -1}
    assert {GATHER_MODULE, PRESERVED_MODULE} <= kept
    assert with_flag.peak_bytes == without.peak_bytes  # gathered after the step: the step's peak is before


def test_deepseek_dev_case_predicted() -> None:
    sys.path.insert(0, str(BENCH))
    from bench_megatron_golden import measured, megatron_argv

    data = json.loads((BENCH / "data" / "megatron_golden_h100_dev.json").read_text())
    case = next(c for c in data["cases"] if c["case"] == CASE)
    job = Job.from_megatron_args(megatron_argv(case))
    assert job.delay_wgrad_compute and job.overlap_moe_expert_parallel_comm and job.num_microbatches == 1
    rank = predict_stage(job, 0, device="cuda", kernels="te", env=case["env"], gpu="h100")
    peak, resident = measured(case)
    end = parts_at(rank.timeline, rank.timeline.num_events - 1)
    # +2.8%, at the head's forward, where the first forward's final norm gathered every unit again (26 MiB; NOTE
    # [Megatron-FSDP buffers])
    assert abs(rank.peak_bytes / peak - 1) < 0.03
    assert abs(sum(end[p] for p in RESIDENT_PARTS) - resident) < 64 * 2**20  # +13 MiB
