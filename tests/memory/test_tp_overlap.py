"""--tp-comm-overlap: TE's userbuffers outside PyTorch's allocator (sized by hand from TE 2.17.1's formulas) and the
tensors they replace inside it (NOTE [TP communication overlap] in remat.memory.tp_overlap)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from remat.analysis.job_report import format_job_prediction
from remat.config import ModelConfig
from remat.job import Job, JobError, parse_megatron_args
from remat.memory.fp8 import Fp8GatheredLinear
from remat.memory.tp_overlap import UB_REGION0_BYTES, UbGatheredLinear, UbReduceScatter, prepare_tp_overlap
from remat.memory.workspaces import te_workspace_bytes
from remat.models.tensor_parallel import SimulatedGroup
from remat.models.tp_layers import GatheredLinear, ReduceScatterToSequence
from remat.models.tp_stage import build_tp_stage_module
from remat.parallel import job_predict
from remat.parallel.job_predict import outside_allocator_buffers
from remat.parallel.schedule import ChunkSpec

MiB = 1 << 20
# rows = seq_length x micro_batch_size / cp = 2048 x 2; hidden 1000: a bf16 buffer is 8,192,000 bytes
ARGS = ("--num-layers 2 --hidden-size 1000 --num-attention-heads 8 --seq-length 2048 --max-position-embeddings 2048 "
        "--micro-batch-size 2 --global-batch-size 16 --vocab-size 1024 --bf16 --sequence-parallel --world-size 8 "
        "--tp-comm-overlap")
COMMUNICATOR = 4 * MiB + 2 * 65536 + 4 * 8 * 33  # region 0 (3,223,808 B rounded to 2 MiB), flags, ids of 8 ranks


def _outside(args: str) -> dict[str, int]:
    job = parse_megatron_args(args)[0]
    return {b.name.split(":")[0]: b.nbytes for b in outside_allocator_buffers(job, 0)}


def test_default_userbuffers_are_twelve_whole_bf16_buffers_plus_the_communicator():
    # initialize.py:223-246 shape [4096, 1000] bf16; every method holds the whole shape (no ring-exchange RS by
    # default), each buffer a cuMemCreate rounded up to 2 MiB: 8,192,000 B -> 8 MiB
    assert UB_REGION0_BYTES == 3_223_808  # userbuffers-host.cpp:355 LOCALSIZE
    got = _outside(f"{ARGS} --tensor-model-parallel-size 2")
    assert got == {"TE userbuffers (--tp-comm-overlap)": 12 * 8 * MiB, "TE userbuffers communicator": COMMUNICATOR}


def test_a_yaml_config_changes_methods_and_fp8_buffers(tmp_path):
    cfg = tmp_path / "ub.yaml"
    cfg.write_text("proj_fprop:\n  method: ring_exchange\n  num_sm: 1\nfc2_fprop:\n  fp8_buf: true\n")
    got = _outside(f"{ARGS} --tensor-model-parallel-size 4 --fp8-format hybrid --fp8-recipe tensorwise "
                   f"--use-distributed-optimizer --tp-comm-overlap-cfg {cfg}")
    # FP8 mode: the 8 all-gather GEMMs uint8 (4,096,000 B -> 4 MiB); proj_fprop a ring-exchange reduce-scatter in
    # bf16 holding 2 tp - 1 = 7 of 4 chunks (8,192,000 / 4 x 7 = 14,336,000 B -> 14 MiB); fc2_fprop pipelined with
    # fp8_buf: uint8 (4 MiB); qkv_wgrad and fc1_wgrad bf16 (8 MiB each)
    assert got["TE userbuffers (--tp-comm-overlap, FP8)"] == 8 * 4 * MiB + 14 * MiB + 4 * MiB + 2 * 8 * MiB
    # --first-last-layers-bf16 adds the bf16 set (initialize.py:228-238)
    both = _outside(f"{ARGS} --tensor-model-parallel-size 2 --fp8-format hybrid --fp8-recipe tensorwise "
                    "--first-last-layers-bf16 --use-distributed-optimizer")
    assert both["TE userbuffers (--tp-comm-overlap)"] == 12 * 8 * MiB
    assert both["TE userbuffers (--tp-comm-overlap, FP8)"] == 8 * 4 * MiB + 4 * 8 * MiB


def test_a_reduce_scattered_dgrad_moves_the_wgrad_reduce_scatter(tmp_path):
    cfg = tmp_path / "ub.yaml"
    cfg.write_text("qkv_dgrad: {method: ring_exchange}\n")
    args = f"{ARGS} --tensor-model-parallel-size 4 --tp-comm-overlap-cfg {cfg}"
    with pytest.raises(JobError, match="add --tp-comm-overlap-rs-dgrad"):  # TE's bulk overlap on a P2P buffer
        parse_megatron_args(args)
    # base.py:491-511: qkv_dgrad becomes a ring-exchange reduce-scatter (7 of 4 chunks: 14 MiB), qkv_wgrad stays
    # a (bulk, all-gather) whole buffer
    assert _outside(f"{args} --tp-comm-overlap-rs-dgrad")["TE userbuffers (--tp-comm-overlap)"] == \
        11 * 8 * MiB + 14 * MiB


@pytest.mark.parametrize("args,message", [
    (f"{ARGS} --tensor-model-parallel-size 1", "Megatron turns --sequence-parallel off at tp = 1"),
    (f"{ARGS} --tensor-model-parallel-size 2 --fp8-format hybrid --fp8-recipe blockwise --use-distributed-optimizer",
     "use --fp8-recipe tensorwise or delayed"),
    (f"{ARGS} --tensor-model-parallel-size 2 --deterministic-mode", "training/determinism.py:24"),
    (f"{ARGS} --tensor-model-parallel-size 2 --delay-wgrad-compute", "add --disable-tp-comm-bulk-wgrad"),
    (f"{ARGS.replace(' --sequence-parallel', '')} --tensor-model-parallel-size 2",
     "needs --sequence-parallel with --tensor-model-parallel-size > 1"),
    (f"{ARGS.replace(' --bf16', '')} --tensor-model-parallel-size 2", "add --bf16"),
])
def test_refusals_name_the_fix(args, message):
    with pytest.raises(JobError, match=message):
        parse_megatron_args(args)


def test_yaml_errors_name_the_key(tmp_path):
    cfg = tmp_path / "ub.yaml"
    cfg.write_text("qkv_fprop: {method: pipeline}\n")
    with pytest.raises(JobError, match="qkv_fprop uses 'pipeline'"):
        parse_megatron_args(f"{ARGS} --tensor-model-parallel-size 2 --tp-comm-overlap-cfg {cfg}")
    cfg.write_text("qkv_fprop: {num_warps: 4}\n")
    with pytest.raises(JobError, match="qkv_fprop.num_warps is not a userbuffers option"):
        parse_megatron_args(f"{ARGS} --tensor-model-parallel-size 2 --tp-comm-overlap-cfg {cfg}")
    with pytest.raises(JobError, match="cannot read it as YAML"):
        parse_megatron_args(f"{ARGS} --tensor-model-parallel-size 2 --tp-comm-overlap-cfg {tmp_path / 'none.yaml'}")


def test_the_flags_round_trip_and_idle_options_are_ignored(tmp_path):
    cfg = tmp_path / "ub.yaml"
    cfg.write_text("fc2_fprop: {num_sm: 8}\n")
    job, ignored = parse_megatron_args(f"{ARGS} --tensor-model-parallel-size 2 --disable-tp-comm-bulk-wgrad "
                                       f"--tp-comm-bootstrap-backend gloo --tp-comm-overlap-cfg {cfg}")
    assert job.model.tp_comm_overlap == ("ag", "bulk_dgrad") and "--tp-comm-bootstrap-backend" in ignored
    assert Job.from_megatron_args(job.to_megatron_args()) == job
    plain, ignored = parse_megatron_args(ARGS.replace(" --tp-comm-overlap", " --tp-comm-overlap-rs-dgrad")
                                         + " --tensor-model-parallel-size 2")
    assert plain.tp_comm_overlap is None and "--tp-comm-overlap-rs-dgrad" in ignored


# ------------------------------------------------------------------------------------------- inside the allocator
class _Allocations(TorchDispatchMode):
    """The shapes of the new tensors the operators make (not views nor in-place results: their returns alias)."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not any(r.alias_info is not None for r in func._schema.returns):
            self.shapes += [tuple(t.shape) for t in (out if isinstance(out, (tuple, list)) else [out])
                            if isinstance(t, torch.Tensor)]
        return out


def _run(fn, *inputs):
    for t in inputs:
        t.grad = None  # each run's gradients are new tensors, not sums into the last run's
    mode = _Allocations()
    with mode:
        fn(*inputs).sum().backward()
    return mode.shapes


def test_a_column_linear_gathers_into_the_userbuffers():
    group = SimulatedGroup(2)
    with FakeTensorMode():
        x = torch.empty(8, 24, dtype=torch.bfloat16, requires_grad=True)  # [tokens/tp, h]: 16 tokens
        w = torch.nn.Parameter(torch.empty(12, 24, dtype=torch.bfloat16))
        plain = _run(lambda x, w: GatheredLinear.apply(x, w, None, group), x, w)
        ub = _run(lambda x, w: UbGatheredLinear.apply(x, w, None, group, ("ag", "bulk_dgrad", "bulk_wgrad")), x, w)
        fwd_only = _run(lambda x, w: UbGatheredLinear.apply(x, w, None, group, ("ag",)), x, w)
    # NCCL path: the gathered input in forward and backward and the whole dgrad, each [tokens, h]
    assert plain.count((16, 24)) == 3 and ub.count((16, 24)) == 0 and fwd_only.count((16, 24)) == 2
    # the input gradient: the reduce-scatter's output, or (bulk wgrad) the clone of the buffer's local chunk
    assert plain.count((8, 24)) == ub.count((8, 24)) == 1
    assert (16, 12) in ub and (12, 24) in ub  # the GEMM output and the weight gradient stay


def test_a_row_linear_gathers_its_output_gradient_into_the_userbuffers():
    group = SimulatedGroup(2)
    with FakeTensorMode():
        x = torch.empty(16, 8, dtype=torch.bfloat16, requires_grad=True)  # [tokens, in/tp]
        w = torch.nn.Parameter(torch.empty(12, 8, dtype=torch.bfloat16))
        plain = _run(lambda x, w: ReduceScatterToSequence.apply(F.linear(x, w), group), x, w)
        ub = _run(lambda x, w: UbReduceScatter.apply(F.linear(x, w), group), x, w)
    # the [tokens, h] GEMM output both ways (createOutputTensor, gemm.cpp:201-203); the gathered output gradient
    # only without the userbuffers (base.py:1596-1605)
    assert plain.count((16, 12)) == 2 and ub.count((16, 12)) == 1
    assert plain.count((8, 12)) == ub.count((8, 12)) == 2  # the reduce-scatter's output and its gradient
    assert (16, 8) in ub and (12, 8) in ub  # dgrad and wgrad GEMM outputs


def test_fp8_column_linear_keeps_the_transpose_but_not_the_gathered_copies():
    group = SimulatedGroup(2)
    with FakeTensorMode():
        x = torch.empty(8, 24, dtype=torch.bfloat16, requires_grad=True)
        w = torch.nn.Parameter(torch.empty(12, 24, dtype=torch.bfloat16))
        plain = _run(lambda x, w: Fp8GatheredLinear.apply(x, w, None, group, "tensorwise"), x, w)
        ub = _run(lambda x, w: Fp8GatheredLinear.apply(x, w, None, group, "tensorwise",
                                                       ("ag", "bulk_dgrad", "bulk_wgrad")), x, w)
    # the gathered uint8 input in forward and backward (in the FP8 userbuffers) and the whole bf16 dgrad
    assert plain.count((16, 24)) == 3 and ub.count((16, 24)) == 0
    # kept: the gathered input's transpose for the wgrad GEMM (update_usage), the shard and the input gradient
    assert plain.count((24, 16)) == ub.count((24, 16)) == 1 and plain.count((8, 24)) == ub.count((8, 24)) == 2


def test_prepare_patches_the_decoder_linears_only():
    model = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128, seq_length=32,
                        micro_batch_size=2, dtype="bf16", num_moe_experts=2, moe_shared_expert_intermediate_size=64,
                        add_bias_linear=False)
    with FakeTensorMode():
        module = build_tp_stage_module(model, ChunkSpec(0, 2, 0, 2), SimulatedGroup(2), True, seed=None)
        assert prepare_tp_overlap(module, ("ag", "bulk_dgrad", "bulk_wgrad")) == 2 * 4  # qkv, proj, shared fc1, fc2
    overlap = {n: m.tp_overlap for n, m in module.named_modules() if hasattr(m, "tp_overlap")}
    assert overlap["layers.0.self_attention.linear_qkv"] == ("ag", "bulk_dgrad", "bulk_wgrad")
    assert overlap["layers.0.self_attention.linear_proj"] == ("ag",)
    assert overlap["layers.1.mlp.shared_experts.linear_fc1"] == ("ag",)  # a TEColumnParallelLinear: no bulk
    assert len(overlap) == 8  # not the output layer, not the routed experts (transformer_engine.py:1203-1206)


def test_a_job_prices_the_buffers_beside_its_smaller_peak(capsys):
    small = ARGS.replace("--seq-length 2048 --max-position-embeddings 2048", "--seq-length 512 "
                         "--max-position-embeddings 512").replace("--hidden-size 1000", "--hidden-size 512")
    job = parse_megatron_args(f"{small} --tensor-model-parallel-size 2")[0]
    with_ub = job_predict.predict_job(job, device="cuda", kernels="te", replay=False)
    without = job_predict.predict_job(job.replace(tp_comm_overlap=None), device="cuda", kernels="te", replay=False)
    assert with_ub.worst.outside_bytes == 12 * 2 * MiB + COMMUNICATOR and without.worst.outside_bytes == 0
    # the userbuffer GEMMs' own cuBLAS workspace, three of TE's (cpp_extensions/gemm.py:43-53), for the whole run
    ub_workspace = 3 * te_workspace_bytes(9)
    assert with_ub.worst.parts["workspaces"] - without.worst.parts["workspaces"] == ub_workspace
    # a layer's backward peaks while the NCCL path's gathered [tokens, h] bf16 input (or whole dgrad) is alive;
    # in its place the trace holds a one-row stand-in (one 1 KiB block)
    def backward_layers(p):
        tl = p.worst.timeline
        return max(int(tl.live_bytes()[a:b].max()) for ph, a, b in tl.phase_spans() if b > a and
                   ph.label.startswith("backward layer"))
    assert backward_layers(without) - backward_layers(with_ub) == 512 * 2 * 512 * 2 - 512 * 2 - ub_workspace
    text = format_job_prediction(with_ub, "none")
    assert "outside PyTorch's allocator" in text and "TE userbuffers (--tp-comm-overlap): 12 GEMM buffers" in text
