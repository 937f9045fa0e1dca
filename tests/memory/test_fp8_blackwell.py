"""remat.memory.fp8 on Blackwell: Float8Tensor's single copy, blockwise emulated with MXFP8, and the mxfp8 recipe
(NOTE [FP8 linears on Blackwell]); bytes computed by hand from TransformerEngine 2.17.1's shapes."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from remat.cli import main
from remat.config import ModelConfig
from remat.job import Job, JobError
from remat.memory.fp8 import Fp8GatheredLinear, Fp8Linear, Fp8Recipe, fp8_state_bytes, scale_bytes
from remat.memory.rank_state import ParamInfo
from remat.memory.workspaces import MODULE_TORCH
from remat.models.tensor_parallel import SimulatedGroup
from remat.parallel.job_predict import parts_at, predict_stage, stage_parameters
from remat.units import GPU_PRESETS, MIB

MXFP8 = Fp8Recipe("mxfp8", 10)
MEGATRON = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --micro-batch-size 2 "
            "--vocab-size 128 --make-vocab-size-divisible-by 16 --bf16 --lr 1e-4 --attention-backend flash "
            "--normalization RMSNorm --swiglu --disable-bias-linear --position-embedding-type rope")


def _saved(out: torch.Tensor) -> tuple[dict[str, int], list[tuple[int, ...]]]:
    """The bytes ``out``'s autograd node saved by dtype, and their shapes (the weight parameter excluded)."""
    got: dict[str, int] = {}
    shapes = []
    for t in out.grad_fn.saved_tensors:
        if not isinstance(t, torch.nn.Parameter):
            got[str(t.dtype)] = got.get(str(t.dtype), 0) + t.numel() * t.element_size()
            shapes.append(tuple(t.shape))
    return got, shapes


def test_one_linears_saved_tensors_under_mxfp8_computed_by_hand():
    # a [2, 128, 64] input (256 tokens x 64 features) into a [96, 64] weight, on fake tensors
    with FakeTensorMode():
        x = torch.empty(2, 128, 64, dtype=torch.bfloat16, requires_grad=True)
        w = torch.nn.Parameter(torch.empty(96, 64, dtype=torch.bfloat16))
        out = Fp8Linear.apply(x, w, None, MXFP8)
        got, shapes = _saved(out)
        # linear.py:546-560: the column-wise MXFP8 copy is saved, in the input's own shape (mxfp8_tensor.py:141),
        # 1 byte per element, with its E8M0 scales: one byte per 32 tokens of a feature, padded to [4, 128]
        # (quantizer.cpp:1710-1740): [pad(256 / 32, 4), pad(64, 128)] = [8, 128]
        assert got == {"torch.uint8": 256 * 64 + 8 * 128}
        assert shapes == [(2, 128, 64), (8 * 128,)]
        assert out.shape == (2, 128, 96) and out.dtype == torch.bfloat16
        out.sum().backward()
        assert x.grad.shape == x.shape and w.grad.shape == w.shape
    # the row-wise scales of the same input: one byte per 32 features of a token, padded to [128, 4]
    assert scale_bytes(256, 64, "mxfp8", columnwise=False) == 256 * 4
    # TE quantizes no MXFP8 tensor whose dimensions are not multiples of 32 (quantizer.cpp:1395)
    x = torch.randn(2, 10, 64, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(JobError, match="\\[20, 64\\].*divisible by 32.*multiples of 32"):
        Fp8Linear.apply(x, torch.nn.Parameter(torch.randn(96, 64, dtype=torch.bfloat16)), None, MXFP8)


def test_blackwell_float8_linear_saves_its_one_row_wise_copy():
    # quantizer.cpp:288-312 / float8_tensor_storage.py:241-252: no transpose on Blackwell, the row-wise data serves
    x = torch.randn(2, 8, 16, dtype=torch.bfloat16, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(24, 16, dtype=torch.bfloat16))
    hopper, blackwell = (Fp8Linear.apply(x, w, None, Fp8Recipe("tensorwise", sm)) for sm in (9, 10))
    assert _saved(hopper) == ({"torch.uint8": 2 * 8 * 16, "torch.float32": 4}, [(16, 16), (1,)])  # transposed
    assert _saved(blackwell) == ({"torch.uint8": 2 * 8 * 16, "torch.float32": 4}, [(2, 8, 16), (1,)])
    blackwell.sum().backward()
    assert x.grad.shape == x.shape and w.grad.shape == w.shape


class _Fp8Bytes(TorchDispatchMode):
    """The uint8 (FP8 data and E8M0 scale) bytes allocated under it."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dtype == torch.uint8 and func is torch.ops.aten.empty.memory_format:
            self.nbytes += out.numel()
        return out


def test_blackwell_quantizes_once_where_hopper_makes_a_transpose():
    # the FP8 bytes one linear's forward and backward make: input and output gradient, each quantized row-wise and
    # transposed on Hopper (2 x (256 x 64 + 256 x 128)), once on Blackwell; MXFP8 both ways with E8M0 scales
    # ([pad(256, 128), pad(64 / 32, 4)] + [pad(256 / 32, 4), pad(64, 128)] for the input, and for the gradient),
    # plus the cached weight's swizzled scales at fprop and dgrad ([128, 4] and [4, 128])
    def made(recipe: str) -> int:
        x = torch.randn(256, 64, dtype=torch.bfloat16, requires_grad=True)
        w = torch.nn.Parameter(torch.randn(128, 64, dtype=torch.bfloat16))
        with _Fp8Bytes() as mode:
            Fp8Linear.apply(x, w, None, recipe).float().sum().backward()
        return mode.nbytes

    data = 256 * 64 + 256 * 128
    assert made(Fp8Recipe("tensorwise", 9)) == 2 * data
    assert made(Fp8Recipe("tensorwise", 10)) == data
    assert made(MXFP8) == 2 * data + (256 * 4 + 8 * 128) + (256 * 4 + 8 * 128) + 128 * 4 + 4 * 128
    # blockwise on Blackwell: Hopper's tensors, and each GEMM converts both operands' scales to swizzled MXFP8 ones,
    # [pad(d0, 128), ceil(d1 / 128) * 4] bytes of their [d0, d1] data (swizzle.cpp:328-333): fprop weight [128, 64]
    # and input [256, 64], dgrad weight^T [64, 128] and gradient [256, 128], wgrad input^T [64, 256] and
    # gradient^T [128, 256]
    converted = 128 * 4 + 256 * 4 + 128 * 4 + 256 * 4 + 128 * 8 + 128 * 8
    assert made(Fp8Recipe("blockwise", 10)) - made(Fp8Recipe("blockwise", 9)) == converted


def test_mxfp8_gathered_linear_saves_the_column_wise_shard():
    # linear.py:546-560: MXFP8's column-wise data can be all-gathered, so the shard is saved column-wise (its own
    # shape) and gathered again in backward (linear.py:883-901)
    x = torch.randn(64, 64, dtype=torch.bfloat16, requires_grad=True)  # [tokens/tp, h]
    w = torch.nn.Parameter(torch.randn(32, 64, dtype=torch.bfloat16))
    out = Fp8GatheredLinear.apply(x, w, None, SimulatedGroup(2), MXFP8)
    assert out.shape == (128, 32)
    assert _saved(out) == ({"torch.uint8": 64 * 64 + 4 * 128}, [(64, 64), (4 * 128,)])  # [pad(64/32, 4), pad(64,128)]
    out.sum().backward()
    assert x.grad.shape == x.shape and w.grad.shape == w.shape


def test_fp8_weight_state_on_blackwell_by_hand():
    w = [ParamInfo("layers.0.mlp.linear_fc1.weight", 64 * 96, shape=(64, 96))]  # [out, in]
    # Float8Tensor workspace on Blackwell: the row-wise data and one fp32 scale; FP8 parameters: the scale alone
    assert fp8_state_bytes(w, "tensorwise", param_gather=False, sm=10) == 64 * 96 + 4
    assert fp8_state_bytes(w, "tensorwise", param_gather=True, sm=10) == 4
    # delayed scaling keeps its amax history on either GPU
    assert fp8_state_bytes(w, "delayed", param_gather=False, sm=10) - 64 * 96 - 4 == 4 * (3 + 3 + 2 + 2)
    # MXFP8 workspace: both copies, scales [pad(64, 128), pad(96 / 32, 4)] and [pad(64 / 32, 4), pad(96, 128)]
    assert fp8_state_bytes(w, "mxfp8", param_gather=False, sm=10) == 2 * 64 * 96 + 128 * 4 + 4 * 128
    # blockwise keeps Hopper's tensors on Blackwell (its quantizer has no device branch)
    assert fp8_state_bytes(w, "blockwise", param_gather=False, sm=10) == \
        fp8_state_bytes(w, "blockwise", param_gather=False, sm=9)


def test_a_blackwell_fp8_job_keeps_one_weight_copy_and_the_larger_cublas_workspace():
    job = Job.from_megatron_args(MEGATRON.split() + ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"])
    bf16 = job.replace(model=job.model.replace(fp8_recipe=None))
    params = [p for chunk in stage_parameters(job, 0) for p in chunk if p.fp8]
    b200, h100, plain = (predict_stage(j, 0, device="cuda", kernels="te", gpu=g)
                         for j, g in ((job, "b200"), (job, "h100-80g"), (bf16, "b200")))
    end = [parts_at(r.timeline, r.timeline.num_events - 1)["parameters"] for r in (b200, h100, plain)]
    assert end[0] - end[2] == fp8_state_bytes(params, "tensorwise", param_gather=False, block=512, sm=10)
    # Hopper's transposes and their scales, each its own 512-byte-rounded block
    assert end[1] - end[0] == sum(-(-p.numel // 512) * 512 + 512 for p in params)
    # the saved copies are 1 byte per element on both (only the transients differ): no more at the peak
    assert b200.parts["activations"] <= h100.parts["activations"] and b200.peak_bytes < h100.peak_bytes
    # torch's cuBLAS workspace is 32 MiB on Blackwell too (CublasHandlePool.cpp use32mb)
    rows = [m for m in b200.timeline.module if m == MODULE_TORCH]
    assert rows and b200.parts["workspaces"] >= 2 * 32 * MIB
    assert GPU_PRESETS["b200"] == 183359 * MIB and GPU_PRESETS["gb200"] == 189471 * MIB


def test_remat_predict_prices_an_mxfp8_job_on_b200(capsys):
    line = f"torchrun --nproc_per_node 2 pretrain_gpt.py {MEGATRON} --fp8-format e4m3 --fp8-recipe mxfp8"
    assert main(["predict", "--megatron-args", line, "--gpu", "b200"]) == 0
    out = capsys.readouterr().out
    assert "FP8 linears (mxfp8 scaling)" in out and "against b200 (179.06 GiB)" in out
    assert main(["predict", "--megatron-args", line, "--gpu", "h100-80g"]) == 2
    assert "compute capability 10.0 or higher required for MXFP8" in capsys.readouterr().err
    job = Job.from_megatron_args(line.split())
    mx = predict_stage(job, 0, device="cuda", kernels="te", gpu="gb200")
    tensorwise = predict_stage(job.replace(model=job.model.replace(fp8_recipe="tensorwise")), 0, device="cuda",
                               kernels="te", gpu="gb200")
    # MXFP8 keeps both copies of each weight (plus E8M0 scales) where Blackwell's Float8Tensor keeps one
    assert mx.parts["parameters"] > tensorwise.parts["parameters"]
    assert ModelConfig(num_layers=1, fp8_recipe="mxfp8", fp8_sm=10).fp8_sm == 10
    with pytest.raises(ValueError, match="fp8_sm=9.*mxfp8.*needs 10"):
        ModelConfig(num_layers=1, fp8_recipe="mxfp8")


def test_remat_plan_refuses_mxfp8_naming_predict_gpu():
    from remat.job import parse_megatron_args
    from remat.plan.job_plan import plan_job
    from remat.recompute.plan_format import PlanError

    job = parse_megatron_args("--num-layers 2 --hidden-size 128 --num-attention-heads 4 --seq-length 128 "
                              "--micro-batch-size 1 --vocab-size 256 --bf16 --fp8-format e4m3 --fp8-recipe mxfp8")[0]
    with pytest.raises(PlanError, match="remat predict --gpu b200"):
        plan_job(job, "80GiB")
