"""A job rank's parameters, counted by hand from the modules Megatron-LM builds, on five of Megatron's functional-test
GPT configs (tests/functional_tests/test_cases/gpt/gpt3_mcore_te_*): the rank's count, and the bytes its
prediction holds for them on CUDA (512-byte allocator blocks)."""

from __future__ import annotations

import warnings

import pytest

from remat.job import Job
from remat.parallel.job_predict import predict_job

# the model flags the five configs share (GPT-2's vocabulary: Megatron reads 50257 tokens from its vocab.json)
BASE = ("--num-layers 12 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 --max-position-embeddings 1024 "
        "--micro-batch-size 4 --global-batch-size 32 --vocab-size 50257 --bf16 --transformer-impl transformer_engine "
        "--attention-softmax-in-fp32 --deterministic-mode --no-gradient-accumulation-fusion --use-mcore-models "
        "--ckpt-format torch_dist --world-size 8")
H, S = 512, 1024


def layer_params(tp: int, swiglu: bool) -> tuple[int, int]:
    """One TE transformer layer's parameters on a tp rank, and the fc1 bias (Megatron's LayerNormLinear /
    RowParallelLinear modules, biases on: --add-bias-linear is Megatron's default)."""
    ffn = int(4 * H * 2 / 3 / 64) * 64 if swiglu else 4 * H  # arguments.py: --swiglu makes ffn 2/3 x 4h, 64-aligned
    fc1 = 2 * ffn if swiglu else ffn  # SwiGLU's fc1 holds the gate and the up projection
    qkv = 2 * H + 3 * H * H // tp + 3 * H // tp  # input layernorm (weight, bias) + column-parallel QKV
    proj = H * H // tp + H  # row-parallel: its bias is whole on every rank
    mlp = 2 * H + fc1 * H // tp + fc1 // tp + H * ffn // tp + H  # pre-MLP layernorm + fc1 + fc2 (whole bias)
    return qkv + proj + mlp, fc1 // tp


def vocab(tp: int) -> int:
    return -(-50257 // (128 * tp)) * 128 * tp  # padded to a multiple of 128 x tp


CASES = {
    # name: (extra flags, tp, pp, swiglu, distributed optimizer)
    "tp1_pp4_frozen_resume_torch_dist_swiglu": (
        "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 --swiglu --dist-ckpt-optim-fully-reshardable",
        1, 4, True, False),
    "tp1_pp4_resume_torch_dist_swiglu": ("--tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 --swiglu",
                                         1, 4, True, False),
    "tp4_pp2_resume_torch_dist_reshard_8x1xNone": (
        "--tensor-model-parallel-size 4 --pipeline-model-parallel-size 2 --use-distributed-optimizer "
        "--dist-ckpt-optim-fully-reshardable", 4, 2, False, True),
    "tp4_pp2_frozen_resume_torch_dist_reshard_8x1xNone": (
        "--tensor-model-parallel-size 4 --pipeline-model-parallel-size 2 --use-distributed-optimizer", 4, 2, False,
        True),
    "tp4_pp1_resume_torch_dist_dist_optimizer_overlap_grad_reduce": (
        "--tensor-model-parallel-size 4 --pipeline-model-parallel-size 1 --use-distributed-optimizer "
        "--overlap-grad-reduce", 4, 1, False, True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_functional_test_configs_hold_megatrons_parameters(name: str) -> None:
    flags, tp, pp, swiglu, dist = CASES[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        job = Job.from_megatron_args(f"{BASE} {flags}".split())
    prediction = predict_job(job, device="cuda", kernels="te")
    layer, fc1_bias = layer_params(tp, swiglu)
    per_stage = 12 // pp
    embedding = vocab(tp) * H // tp  # vocab-parallel word embeddings; the tied output layer is the same size
    first = embedding + S * H  # + the learned position table (whole on every tp rank)
    last = embedding + 2 * H  # the final layernorm + the output layer (its own copy of the tied weight, pp > 1)
    for rank in prediction.ranks:
        expected = per_stage * layer + (first if rank.stage == 0 else 0) + (last if rank.stage == pp - 1 else 0)
        if pp == 1:
            expected -= embedding  # one stage: the output layer is the word embeddings themselves
        assert rank.state.num_parameters == expected
        # bf16 on CUDA: every tensor here is a multiple of 256 elements but SwiGLU's 2688-element fc1 bias (5376
        # bytes, held in 5632 as a tensor of its own); with the distributed optimizer the parameters are views of
        # one param_data buffer (every size a multiple of 128 elements: no padding)
        assert fc1_bias == (2688 if swiglu else 512)
        rounding = per_stage * (-(-2 * fc1_bias // 512) * 512 - 2 * fc1_bias) if not dist else 0
        assert rank.parts["parameters"] == 2 * expected + rounding
    if name.startswith("tp1_pp4"):
        assert [r.state.num_parameters for r in sorted(prediction.ranks, key=lambda r: r.stage)] == [
            35_640_704, 9_360_768, 9_360_768, 35_117_440]


# A Qwen2-style layer (issue 26): no linear biases but --add-qkv-bias, GQA, SwiGLU, RMSNorm, rope
QWEN2 = ("--num-layers 4 --hidden-size 512 --num-attention-heads 8 --group-query-attention --num-query-groups 2 "
         "--seq-length 512 --max-position-embeddings 512 --micro-batch-size 1 --global-batch-size 8 --vocab-size 1024 "
         "--bf16 --swiglu --disable-bias-linear --normalization RMSNorm --position-embedding-type rope "
         "--untie-embeddings-and-output-weights --tensor-model-parallel-size 2 --sequence-parallel --world-size 4")


def test_add_qkv_bias_holds_megatrons_qkv_bias_and_its_state() -> None:
    # attention.py:1698: linear_qkv gets bias=add_bias_linear or add_qkv_bias, a column-parallel [(q + 2 kv) x
    # head_dim / tp] per layer; TE's linear saves the bias parameter itself, no activation (layernorm_linear.py:492)
    plain, biased = (predict_job(Job.from_megatron_args(f"{QWEN2}{extra}".split()), device="cuda", kernels="te")
                     for extra in ("", " --add-qkv-bias"))
    heads, groups, head_dim, tp, layers = 8, 2, 512 // 8, 2, 4
    per_layer = (heads + 2 * groups) * head_dim // tp  # 384 on each tp rank
    for a, b in zip(plain.ranks, biased.ranks, strict=True):
        assert b.state.num_parameters - a.state.num_parameters == layers * per_layer
        growth = {part: b.parts[part] - a.parts[part] for part in a.parts}
        # bf16 parameters, one tensor each (768 bytes in a 1024-byte block); fp32 main grads in the contiguous
        # grad buffer, fp32 master copies and Adam's two fp32 moments (dp = 2, no distributed optimizer)
        assert growth == {**dict.fromkeys(a.parts, 0), "parameters": layers * 1024,
                          "gradients": layers * per_layer * 4, "master_parameters": layers * per_layer * 4,
                          "optimizer_state": layers * per_layer * 8}
        assert b.peak_bytes - a.peak_bytes == sum(growth.values())
