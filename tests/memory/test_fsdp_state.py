"""Megatron-FSDP (remat.job_fsdp, remat.memory.fsdp_state): flags, buffer arithmetic, the H100 dev case."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from remat.job import Job, JobError, parse_megatron_args
from remat.job_fsdp import FsdpConfig
from remat.memory.fsdp_state import (
    GATHER_MODULE,
    GRAD_BUCKET_MODULE,
    POOL_MODULES,
    buffer_items,
    double_buffer_units,
    fsdp_groups,
    fsdp_rank_state,
    megatron_params,
)
from remat.memory.rank_state import ParamInfo
from remat.parallel.job_predict import RESIDENT_PARTS, parts_at, predict_stage, stage_parameters

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
DENSE = "gpt/gpt3_mcore_te_tp2_zp_z3_resume_fsdp_dtensor"
MOE = "moe/gpt3_mcore_te_tp2_zp_z3_resume_torch_dist_te_8experts2parallel_top2router"
BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --micro-batch-size 2 "
        "--vocab-size 1000 --bf16 --world-size 4 --global-batch-size 16 ")


def _case(name: str) -> dict:
    data = json.loads((BENCH / "data" / "megatron_golden_h100_dev.json").read_text())
    return next(c for c in data["cases"] if c["case"] == name)


def test_buffer_items_pairs_remainders_and_fills_gaps() -> None:
    # param_and_grad_buffer.py:258: a (10 = 2 x 4 + 2) takes 3 chunks, b's remainder (2) shares a's last chunk,
    # the fragment c (1 < 4) is appended after the regular items (no gap left)
    used, items = buffer_items([ParamInfo("a", 10, shape=(5, 2)), ParamInfo("b", 6, shape=(3, 2)),
                                ParamInfo("c", 1, shape=(1,))], 4)
    assert items == [(0, 10), (10, 16), (16, 17)] and used == 17
    used, items = buffer_items([ParamInfo("a", 5, shape=(5,)), ParamInfo("c", 2, shape=(2,))], 4)
    assert items == [(0, 5), (5, 7)] and used == 8  # c fills the gap after a's remainder


def test_flags_round_trip_and_refusals() -> None:
    job, _ = parse_megatron_args(BASE + "--use-megatron-fsdp --megatron-fsdp-main-grads-dtype fp32")
    assert job.fsdp == FsdpConfig(main_grads_dtype="fp32") and job.distributed_optimizer  # arguments.py:1128
    assert Job.from_megatron_args(job.to_megatron_args()) == job
    assert parse_megatron_args(BASE + "--use-megatron-fsdp --outer-dp-sharding-strategy no_shard")[0].fsdp
    for extra in ("--outer-dp-sharding-strategy optim",
                  "--data-parallel-sharding-strategy no_shard", "--megatron-fsdp-main-params-dtype bf16",
                  "--megatron-fsdp-max-pool-double-buffer"):
        with pytest.raises(JobError):
            parse_megatron_args(BASE + "--use-megatron-fsdp " + extra)
    # MoE layers are modelled, with the combined-1F1B overlap's per-submodule gathers too (tests/memory/
    # test_fsdp_ep_overlap.py)
    moe = (BASE + "--use-megatron-fsdp --num-experts 4 --expert-model-parallel-size 2 "
           "--moe-token-dispatcher-type alltoall ")
    assert parse_megatron_args(moe)[0].model.is_moe
    assert parse_megatron_args(moe + "--overlap-moe-expert-parallel-comm")[0].overlap_moe_expert_parallel_comm
    with pytest.raises(JobError, match="without --use-megatron-fsdp"):
        parse_megatron_args(BASE + "--data-parallel-sharding-strategy optim")


@pytest.mark.parametrize("strategy", ["optim", "optim_grads", "optim_grads_params"])
def test_rank_state_per_strategy(strategy: str) -> None:
    job = parse_megatron_args(BASE + f"--use-megatron-fsdp --data-parallel-sharding-strategy {strategy}")[0]
    params = stage_parameters(job, 0)[0]
    state, groups = fsdp_rank_state(job, params)
    full = sum(g.size for g in groups)
    shard = sum(g.size // 4 for g in groups)
    assert all(g.size % 4 == 0 for g in groups)
    # param_and_grad_buffer.py:2330: weights sharded only by optim_grads_params, grads by optim_grads(_params),
    # fp32 main weights always; bf16 main grads ('auto': the parameters' dtype)
    assert state.parameters + state.parameter_padding == 2 * (shard if strategy == "optim_grads_params" else full)
    assert state.gradients == 2 * (full if strategy == "optim" else shard)
    assert state.master_parameters == 4 * shard
    assert state.optimizer_state == 8 * state.shard_elements <= 8 * shard
    assert sum(g.numel for g in groups) == sum(p.numel for p in params)


def test_dense_dev_case_buffers() -> None:
    sys.path.insert(0, str(BENCH))
    from bench_megatron_golden import measured, megatron_argv

    case = _case(DENSE)
    job = Job.from_megatron_args(megatron_argv(case))
    params = stage_parameters(job, 0)[0]
    groups = fsdp_groups(job, params)
    non_unit = [g for g in groups if g.unit is None]
    # one non-unit group: word embeddings [50432/2, 512], positions [1024, 512], final norm 2 x [512]; chunk factor
    # 512, padded to dp x 512 (param_and_grad_buffer.py:285)
    assert [(g.numel, g.size) for g in non_unit] == [((25216 + 1024 + 2) * 512, 6561 * 2048)]
    assert len(groups) == 13 and {g.unit for g in groups} == {None, *range(12)}
    rank = predict_stage(job, 0, device="cuda", kernels="te", env=case["env"], gpu="h100")
    peak, resident = measured(case)
    tl = rank.timeline
    end = parts_at(tl, tl.num_events - 1)
    assert 0 <= rank.peak_bytes / peak - 1 < 0.05  # an upper bound, never under
    assert abs(sum(end[p] for p in RESIDENT_PARTS) / resident - 1) < 0.02
    # the peak is the first forward's head: the final norm's prefetch gathered all 12 units again (NOTE); the
    # embedding's fp32 grad bucket is made later, by the final norm's weight gradient (the output weight is tied)
    assert tl.phase_at(tl.peak_event).label == "forward head [microbatch 0, chunk 0]"
    alive = [i for i in tl.alive_at(tl.peak_event) if tl.module[i] == GATHER_MODULE]
    assert len(alive) == 12
    assert sum(tl.nbytes[i] for i in alive) >= 2 * sum(g.size for g in groups if g.unit is not None)
    assert GRAD_BUCKET_MODULE not in {tl.module[i] for i in tl.alive_at(tl.peak_event)}


def test_expert_groups_shard_over_expert_data_parallel_with_te_weights() -> None:
    # 16 ranks, ep=4: one local expert per rank, expert data-parallel size 16 / 4 = 4 (dense: dp = 16)
    base = BASE.replace("--world-size 4 --global-batch-size 16", "--world-size 16 --global-batch-size 32")
    job = parse_megatron_args(base + "--use-megatron-fsdp --num-experts 4 --expert-model-parallel-size 4 "
                              "--moe-grouped-gemm --moe-ffn-hidden-size 24")[0]
    assert (job.dp, job.expert_data_parallel) == (16, 4)
    params = stage_parameters(job, 0)[0]
    grouped = [p for p in params if ".experts." in p.name]
    assert [p.shape for p in grouped] == [(1, 64, 24), (1, 24, 64)] * 2  # remat's [experts, in, out], two layers
    # TE GroupedLinear's weight{i} [out, in] (grouped_linear.py:1346): the chunk factor is lcm(64, 24) = 192, not
    # the 1536 of a whole [in, out] matrix, so 2 x 1536 elements pad to 4 shards x 192, not to 4 x 1536
    assert [(p.name.rsplit(".", 1)[1], p.shape) for p in megatron_params(grouped[:2])] == [("weight0", (24, 64)),
                                                                                          ("weight0", (64, 24))]
    groups = fsdp_groups(job, params)
    experts = [g for g in groups if g.expert]
    assert [(g.unit, g.numel, g.size, g.shards, g.shard) for g in experts] == [(0, 3072, 3072, 4, 768),
                                                                              (1, 3072, 3072, 4, 768)]
    assert all(g.shards == 16 for g in groups if not g.expert)
    state, _ = fsdp_rank_state(job, params)
    dense_shard = sum(g.shard for g in groups if not g.expert)
    assert state.parameters + state.parameter_padding == 2 * (dense_shard + 2 * 768)  # bf16 weight shards
    assert state.master_parameters == 4 * (dense_shard + 2 * 768)


def test_moe_dev_case_state_and_golden_run_dtype() -> None:
    sys.path.insert(0, str(BENCH))
    from bench_megatron_golden import GOLDEN_RUN_FLAGS, measured, megatron_argv

    case = _case(MOE)
    argv = megatron_argv(case)
    job = Job.from_megatron_args(argv)
    params = stage_parameters(job, 0)[0]
    state, groups = fsdp_rank_state(job, params)
    # tp=2, ep=2, etp=tp: 4 local experts of [512 -> 1024 -> 512] per layer, sharded over 8 / (2 x 2) = 2 ranks
    experts = [g for g in groups if g.expert]
    assert [(g.unit, g.numel, g.size, g.shards) for g in experts] == [(u, 4 * 2 * 512 * 1024, 4194304, 2)
                                                                      for u in range(12)]
    assert all(g.shards == 4 for g in groups if not g.expert)
    # the golden run's fp32 main grads (GOLDEN_RUN_FLAGS): a bf16 buffer and the optimizer's fp32 copy of each
    # shard (param_and_grad_buffer.py:3376) at d98e8a64 are 2 bytes per shard element more than one fp32 buffer
    today = Job.from_megatron_args([a for a in argv if a not in GOLDEN_RUN_FLAGS[MOE]])
    assert today.fsdp.grads_dtype(today.precision) == "bf16"
    bf16 = fsdp_rank_state(today, params)[0]
    assert bf16.gradients + 4 * bf16.shard_elements - state.gradients == 2 * state.shard_elements
    rank = predict_stage(job, 0, device="cuda", kernels="te", env=case["env"], gpu="h100")
    peak, resident = measured(case)
    tl = rank.timeline
    end = parts_at(tl, tl.num_events - 1)
    assert abs(sum(end[p] for p in RESIDENT_PARTS) / resident - 1) < 0.002  # -0.7 MiB of 751 MiB
    # +0.2%: the first forward's head holds every unit's weights gathered again, 12 x (8 MiB of experts + the
    # dense ~1 MiB), the 104 MiB that was missing at the backward head (NOTE [Megatron-FSDP buffers])
    assert abs(rank.peak_bytes / peak - 1) < 0.005
    alive = [i for i in tl.alive_at(tl.peak_event) if tl.module[i] == GATHER_MODULE]
    assert sum(tl.nbytes[i] for i in alive) >= 2 * sum(g.size for g in groups if g.unit is not None)


def _spans(tl, kind: str, region: str) -> list[tuple[int, int]]:
    return [(s, e) for phase, s, e in tl.phase_spans() if phase.kind == kind and phase.region == region]


def test_first_forward_regathers_the_units_at_the_final_norm() -> None:
    # 2 layers, 2 microbatches; the non-units' pre-forward hooks prefetch only before the first root pre-backward
    # (megatron_fsdp.py:794-813, 936-953, 704): in microbatch 0 the final norm's gathers both units again at the
    # head's forward, each held to its backward's release; microbatch 1's head gathers nothing
    job = parse_megatron_args(BASE + "--use-megatron-fsdp")[0]
    params = stage_parameters(job, 0)[0]
    groups = fsdp_rank_state(job, params)[1]
    tl = predict_stage(job, 0, device="cuda", kernels="te").timeline
    unit_bytes = [-(-sum(g.size for g in groups if g.unit == u) * 2 // 512) * 512 for u in (0, 1)]
    heads = _spans(tl, "forward", "head")
    assert len(heads) == 2
    rows = [i for i, m in enumerate(tl.module) if m == GATHER_MODULE]
    again = sorted((tl.free_at[i], tl.nbytes[i]) for i in rows if tl.alloc_at[i] == heads[0][0])
    layer_bwd = [_spans(tl, "backward", f"layer {u}")[0][1] for u in (0, 1)]  # microbatch 0's
    assert again == sorted(zip(layer_bwd, unit_bytes))
    assert not [i for i in rows if tl.alloc_at[i] == heads[1][0]]
    # microbatch 0's backward gathers nothing: its units are still there (all_gather_params gathers only EMPTY
    # buckets, param_and_grad_buffer.py:4518-4526)
    assert not [i for i in rows if heads[0][1] <= tl.alloc_at[i] < _spans(tl, "backward", "embedding")[0][0]]


def test_tied_non_unit_grad_bucket_made_by_the_final_norm_gradient() -> None:
    # the tied output weight is shared: its gradient waits for the root post-backward (megatron_fsdp.py:742, 867);
    # the non-unit group's first main_grad access is the final norm's weight gradient, the head backward's last
    # (its post-accumulate-grad hook, 1136-1143 -> _grad_acc, 635-682), each microbatch
    job = parse_megatron_args(BASE + "--use-megatron-fsdp")[0]
    groups = fsdp_rank_state(job, stage_parameters(job, 0)[0])[1]
    non_unit = [g for g in groups if g.unit is None]
    assert len(non_unit) == 1 and "head.final_layernorm.weight" in non_unit[0].names
    assert "head.output_layer.weight" not in non_unit[0].names
    tl = predict_stage(job, 0, device="cuda", kernels="te").timeline
    size = -(-non_unit[0].size * 2 // 512) * 512  # bf16 gradient communication (no --megatron-fsdp-grad-comm-dtype)
    made = [tl.alloc_at[i] for i, m in enumerate(tl.module) if m == GRAD_BUCKET_MODULE and tl.nbytes[i] == size]
    assert made == [e - 1 for _, e in _spans(tl, "backward", "head")]


# ------------------------------------------------------------------------------------------------ double buffers
def test_double_buffer_flags() -> None:
    job = parse_megatron_args(BASE + "--use-megatron-fsdp --fsdp-double-buffer")[0]
    assert job.fsdp == FsdpConfig(double_buffer=True) and Job.from_megatron_args(job.to_megatron_args()) == job
    # arguments.py:1172-1176: --use-nccl-ub turns the double buffers on
    job = parse_megatron_args(BASE + "--use-megatron-fsdp --use-nccl-ub")[0]
    assert job.fsdp == FsdpConfig(double_buffer=True, nccl_ub=True)
    assert Job.from_megatron_args(job.to_megatron_args()) == job
    with pytest.raises(JobError, match="--fsdp-double-buffer without --use-megatron-fsdp"):
        parse_megatron_args(BASE + "--fsdp-double-buffer")
    # with Megatron's DDP, NCCL's pool holds the same param/grad buffers (param_and_grad_buffer.py:1136-1156)
    assert parse_megatron_args(BASE + "--use-nccl-ub")[0].fsdp is None
    with pytest.raises(JobError, match="needs double_buffer=True"):
        FsdpConfig(nccl_ub=True)
    with pytest.raises(JobError, match=r"--use-nccl-ub with --overlap-moe-expert-parallel-comm: .*refuses double "
                                       r"buffers .*mcore_fsdp_adapter.py:177"):
        parse_megatron_args(BASE + "--use-megatron-fsdp --use-nccl-ub --num-experts 4 --expert-model-parallel-size 2 "
                            "--moe-token-dispatcher-type alltoall --overlap-moe-expert-parallel-comm")


def _pool_rows(tl) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, module in enumerate(tl.module):
        out.setdefault(module, []).append(i)
    return out


def test_double_buffers_hold_two_units_buckets_for_the_whole_step() -> None:
    # 4 identical decoder layers: every unit double-buffered (param_and_grad_buffer.py:676-697)
    base = BASE.replace("--num-layers 2", "--num-layers 4") + "--use-megatron-fsdp "
    plain, pooled = (parse_megatron_args(base + extra)[0] for extra in ("", "--fsdp-double-buffer"))
    groups = fsdp_rank_state(pooled, stage_parameters(pooled, 0)[0])[1]
    assert double_buffer_units(groups) == {0, 1, 2, 3}
    unit_bytes = sum(-(-g.size * 2 // 512) * 512 for g in groups if g.unit == 0)  # bf16 buckets, 512-byte blocks
    tl0 = predict_stage(plain, 0, device="cuda", kernels="te").timeline
    tl = predict_stage(pooled, 0, device="cuda", kernels="te").timeline
    rows = _pool_rows(tl)
    # no per-unit buckets left: they come from the pools; the non-unit ones are allocated as without it
    assert GATHER_MODULE not in rows
    assert [tl.nbytes[i] for i in rows[GRAD_BUCKET_MODULE]] == [tl0.nbytes[i] for i in _pool_rows(tl0)[
        GRAD_BUCKET_MODULE] if tl0.nbytes[i] != unit_bytes]
    for module in POOL_MODULES.values():  # two buffer groups of one unit's buckets, all step and after it
        assert [(tl.nbytes[i], tl.alloc_at[i], tl.free_at[i]) for i in rows[module]] == [(unit_bytes, 0, -1)] * 2
    end0, end = parts_at(tl0, tl0.num_events - 1), parts_at(tl, tl.num_events - 1)
    assert sum(end[p] for p in RESIDENT_PARTS) - sum(end0[p] for p in RESIDENT_PARTS) == 4 * unit_bytes


def test_double_buffers_take_the_largest_class_of_matching_units() -> None:
    # a dense first layer, then 3 MoE layers (as DeepSeek-V3's [0]*3+[1]*58): the MoE layers are double-buffered,
    # the dense one's buckets are allocated and freed as without double buffers (the fallback allocator, 740)
    base = (BASE.replace("--num-layers 2", "--num-layers 4") + "--use-megatron-fsdp --num-experts 4 "
            "--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall --moe-grouped-gemm "
            "--moe-ffn-hidden-size 32 --moe-layer-freq [0]*1+[1]*3 ")
    job = parse_megatron_args(base + "--fsdp-double-buffer")[0]
    groups = fsdp_rank_state(job, stage_parameters(job, 0)[0])[1]
    assert double_buffer_units(groups) == {1, 2, 3}
    moe_bytes = sum(-(-g.size * 2 // 512) * 512 for g in groups if g.unit == 1)
    dense_bytes = sum(-(-g.size * 2 // 512) * 512 for g in groups if g.unit == 0)
    tl = predict_stage(job, 0, device="cuda", kernels="te").timeline
    rows = _pool_rows(tl)
    assert {tl.nbytes[i] for i in rows[GATHER_MODULE]} == {dense_bytes}  # layer 0's, each microbatch
    assert [tl.nbytes[i] for i in rows[POOL_MODULES[GATHER_MODULE]]] == [g for g in [
        -(-g.size * 2 // 512) * 512 for g in groups if g.unit == 1]] * 2
    assert sum(tl.nbytes[i] for i in rows[POOL_MODULES[GATHER_MODULE]]) == 2 * moe_bytes

