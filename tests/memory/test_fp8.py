"""remat.memory.fp8 and remat.job_fp8: FP8 linears under TransformerEngine (NOTE [FP8 linears on Hopper])."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from remat.config import ModelConfig
from remat.job import Job, JobError
from remat.memory.fp8 import (
    Fp8GatheredLinear,
    Fp8GroupedMatmul,
    Fp8Linear,
    fp8_state_bytes,
    is_fp8_weight,
    prepare_fp8,
)
from remat.memory.rank_state import ParamInfo
from remat.models.tensor_parallel import SimulatedGroup
from remat.models.tp_stage import build_tp_stage_module
from remat.parallel.job_predict import parts_at, predict_stage, stage_parameters
from remat.parallel.schedule import ChunkSpec

MODEL = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128, seq_length=32,
                    micro_batch_size=2, activation="swiglu", normalization="rmsnorm", position="rope",
                    hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False, dtype="bf16")


def _saved_bytes(out: torch.Tensor) -> dict[str, int]:
    """The bytes ``out``'s autograd node saved, by dtype (the weight parameter excluded)."""
    got: dict[str, int] = {}
    for t in out.grad_fn.saved_tensors:
        if not isinstance(t, torch.nn.Parameter):
            got[str(t.dtype)] = got.get(str(t.dtype), 0) + t.numel() * t.element_size()
    return got


def test_fp8_linear_saves_the_transposed_one_byte_input_and_returns_the_gemm():
    x = torch.randn(2, 8, 16, dtype=torch.bfloat16, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(24, 16, dtype=torch.bfloat16))
    out = Fp8Linear.apply(x, w, None, "tensorwise")
    assert torch.equal(out, F.linear(x, w))  # same GEMM output, in the activation dtype
    # linear.py:560: only the column-wise copy (1 byte per element) and its fp32 scale_inv are saved
    assert _saved_bytes(out) == {"torch.uint8": 2 * 8 * 16, "torch.float32": 4}
    assert out.grad_fn.saved_tensors[0].shape == (16, 2 * 8)
    out.sum().backward()
    assert x.grad.shape == x.shape and x.grad.dtype == torch.bfloat16 and w.grad.shape == w.shape


def test_fp8_gathered_linear_saves_the_row_wise_shard_under_sequence_parallelism():
    # linear.py:328-363: FP8 column-wise data cannot be all-gathered; the shard is saved row-wise, 1 byte
    group = SimulatedGroup(2)
    x = torch.randn(8, 16, dtype=torch.bfloat16, requires_grad=True)  # [tokens/tp, h]
    w = torch.nn.Parameter(torch.randn(12, 16, dtype=torch.bfloat16))
    out = Fp8GatheredLinear.apply(x, w, None, group, "tensorwise")
    assert out.shape == (16, 12) and out.dtype == torch.bfloat16  # every token, this rank's outputs
    assert _saved_bytes(out) == {"torch.uint8": 8 * 16, "torch.float32": 4}
    assert out.grad_fn.saved_tensors[0].shape == (8, 16)
    out.sum().backward()
    assert x.grad.shape == (8, 16) and w.grad.shape == (12, 16)


def test_fp8_grouped_matmul_saves_one_byte_per_routed_element():
    x = torch.randn(10, 16, dtype=torch.bfloat16, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(2, 16, 8, dtype=torch.bfloat16))
    out = Fp8GroupedMatmul.apply(x, w, [4, 6], "delayed")
    assert torch.equal(out, torch.cat([x[:4] @ w[0], x[4:] @ w[1]]))
    assert _saved_bytes(out) == {"torch.uint8": 10 * 16, "torch.float32": 4}
    out.sum().backward()
    assert x.grad.shape == x.shape and w.grad.shape == w.shape


def test_prepare_fp8_changes_the_layers_linears_and_leaves_the_output_layer_embedding_and_router():
    config = MODEL.replace(num_moe_experts=4, moe_grouped_gemm=True, moe_layer_freq=(0, 1),
                           moe_shared_expert_intermediate_size=32, fp8_recipe="tensorwise")
    spec = ChunkSpec(0, 1, 0, 2)
    module = build_tp_stage_module(config, spec, SimulatedGroup(2), sp=True)
    changed = prepare_fp8(module, "tensorwise")
    fp8 = sorted(n for n, m in module.named_modules() if getattr(m, "saves_fp8_input", False))
    assert changed == len(fp8) and all(n.startswith("layers.") for n in fp8)
    assert {n.split(".", 2)[2] for n in fp8} == {
        "self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2",
        "mlp.experts.linear_fc1", "mlp.experts.linear_fc2", "mlp.shared_experts.linear_fc1",
        "mlp.shared_experts.linear_fc2"}
    assert not is_fp8_weight("head.output_layer.weight") and not is_fp8_weight("layers.1.mlp.router.weight")
    assert not is_fp8_weight("embedding.word_embeddings.weight")


def test_fp8_state_counts_workspaces_or_transposes_and_the_delayed_amax_history():
    w = [ParamInfo("layers.0.mlp.linear_fc1.weight", 1000, shape=(40, 25)),
         ParamInfo("layers.0.mlp.experts.linear_fc1.weight", 2 * 600, shape=(2, 20, 30))]
    # workspaces: row- and column-wise copies, one scale_inv each; per expert for the grouped weight
    assert fp8_state_bytes(w, "tensorwise", param_gather=False) == 2 * 1000 + 8 + 2 * (2 * 600 + 8)
    # FP8 parameters: only the transposes are extra (the data is in the uint8 param buffer)
    assert fp8_state_bytes(w, "tensorwise", param_gather=True) == 1000 + 8 + 2 * (600 + 8)
    # delayed scaling: scale [3n] + amax_history [len, 3n] forward, [2n] + [len, 2n] backward, fp32, n GEMMs
    history = fp8_state_bytes(w, "delayed", param_gather=True, amax_history=16) - \
        fp8_state_bytes(w, "tensorwise", param_gather=True)
    assert history == 4 * (3 + 16 * 3 + 2 + 16 * 2) * (1 + 2)
    # every tensor its own allocator block on CUDA
    assert fp8_state_bytes(w[:1], "tensorwise", param_gather=True, block=512) == 1024 + 2 * 512


def test_fp8_job_flags_are_read_and_refusals_name_the_fix():
    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--micro-batch-size", "2", "--vocab-size", "128", "--bf16", "--world-size", "2"]
    job = Job.from_megatron_args(base + ["--fp8-format", "hybrid", "--fp8-param-gather", "--use-distributed-optimizer",
                                         "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max"])
    assert (job.model.fp8_recipe, job.fp8_param_gather, job.fp8_amax_history_len) == ("delayed", True, 1024)
    assert Job.from_megatron_args(job.to_megatron_args()) == job
    with pytest.raises(JobError, match="--fp8-param-gather needs --use-distributed-optimizer"):
        Job.from_megatron_args(base + ["--fp8-format", "hybrid", "--fp8-param-gather"])
    # mxfp8 is Blackwell's (NOTE [FP8 linears on Blackwell]); its FP8 parameters are not modelled
    mx = Job.from_megatron_args(base + ["--fp8-format", "hybrid", "--fp8-recipe", "mxfp8"])
    assert (mx.model.fp8_recipe, mx.model.fp8_sm) == ("mxfp8", 10)
    assert Job.from_megatron_args(mx.to_megatron_args()) == mx
    with pytest.raises(JobError, match="--fp8-param-gather with --fp8-recipe mxfp8 is not modelled.*drop"):
        Job.from_megatron_args(base + ["--fp8-format", "hybrid", "--fp8-recipe", "mxfp8", "--fp8-param-gather",
                                       "--use-distributed-optimizer"])
    with pytest.raises(JobError, match="--fp8-recipe custom"):
        Job.from_megatron_args(base + ["--fp8-format", "hybrid", "--fp8-recipe", "custom"])
    # transformer_config.py:1529-1556: not with delayed scaling; each count within one stage's layers
    with pytest.raises(JobError, match="--first-last-layers-bf16 with --fp8-recipe delayed.*tensorwise"):
        Job.from_megatron_args(base + ["--fp8-format", "hybrid", "--first-last-layers-bf16"])
    with pytest.raises(JobError, match="--num-layers-at-end-in-bf16 3: .* \\(2\\)"):
        Job.from_megatron_args(base + ["--fp8-format", "hybrid", "--fp8-recipe", "blockwise",
                                       "--first-last-layers-bf16", "--num-layers-at-end-in-bf16", "3"])
    mixed = Job.from_megatron_args(base + ["--fp8-format", "hybrid", "--fp8-recipe", "blockwise",
                                           "--first-last-layers-bf16", "--num-layers-at-start-in-bf16", "0"])
    assert (mixed.model.fp8_recipe, mixed.model.fp8_layers) == ("blockwise", (1, 0))
    assert Job.from_megatron_args(mixed.to_megatron_args()) == mixed
    # without --fp8-format Megatron reads no FP8 flag (args.fp8 is None): the recipe is ignored, not priced
    assert Job.from_megatron_args(base + ["--fp8-recipe", "tensorwise"]).model.fp8_recipe is None


def _activation_bytes(job: Job) -> int:
    rank = predict_stage(job, 0, kernels="te")
    return rank.parts["activations"]


def test_fp8_job_keeps_one_byte_inputs_and_the_weight_copies():
    bf16 = Job.build(MODEL, precision="bf16", tp=2, sp=True, dp=2, num_microbatches=2, distributed_optimizer=True)
    fp8 = bf16.replace(model=MODEL.replace(fp8_recipe="tensorwise"))
    gathered = fp8.replace(fp8_param_gather=True)
    # every layer linear's saved input shrinks from 2 bytes to 1 per element (the shard under SP for qkv/fc1)
    assert _activation_bytes(fp8) < _activation_bytes(bf16)
    params = [p for chunk in stage_parameters(fp8, 0) for p in chunk if p.fp8]
    fp8_numel = sum(p.numel for p in params)
    assert fp8_numel > 0
    a, b, c = (predict_stage(j, 0, kernels="te") for j in (bf16, fp8, gathered))
    end = [parts_at(r.timeline, r.timeline.num_events - 1)["parameters"] for r in (a, b, c)]
    # the cached workspaces: 2 bytes per FP8 weight element and two fp32 scales per weight
    assert end[1] - end[0] == fp8_state_bytes(params, "tensorwise", param_gather=False)
    # FP8 parameters: 1 byte each in a uint8 buffer of their own (padded apart), plus the transposes
    assert c.state.parameters == a.state.parameters - fp8_numel
    assert end[2] == c.state.parameters + c.state.parameter_padding + fp8_state_bytes(params, "tensorwise",
                                                                                        param_gather=True)
    # the optimizer's shards are the same elements either way
    assert (c.state.master_parameters, c.state.optimizer_state) == (a.state.master_parameters,
                                                                     a.state.optimizer_state)


def test_fp8_on_ampere_and_mxfp8_on_hopper_are_refused_as_te_refuses_them():
    job = Job.build(MODEL.replace(fp8_recipe="delayed"), precision="bf16")
    with pytest.raises(JobError, match="gpu='a100' with FP8.*Ampere has no FP8 GEMMs.*--gpu"):
        predict_stage(job, 0, kernels="te", gpu="a100")
    mx = job.replace(model=MODEL.replace(fp8_recipe="mxfp8", fp8_sm=10))
    for gpu in ("h100-80g", None):  # quantization.py:162-168 check_mxfp8_support
        with pytest.raises(JobError, match="mxfp8 on .*compute capability 10.0 or higher.*--gpu b200"):
            predict_stage(mx, 0, kernels="te", gpu=gpu)
    assert predict_stage(job, 0, kernels="te", gpu="h200").peak_bytes > 0


def test_blockwise_scales_follow_te_get_scale_shape():
    from remat.memory.fp8 import scale_bytes

    # float8_blockwise_tensor.py:121-170, fp32 scales: 1x128 blocks for activations, 128x128 for weights, the last
    # dimension padded to 4
    assert scale_bytes(1000, 300, "blockwise", columnwise=False) == 4 * 3 * 1000  # (ceil(300/128), 1000)
    assert scale_bytes(1000, 300, "blockwise", columnwise=True) == 4 * 8 * 300  # (ceil(1000/128), 300)
    assert scale_bytes(1000, 300, "blockwise", columnwise=False, block_dim=2) == 4 * 8 * 4  # (8, pad(3, 4))
    assert scale_bytes(1000, 300, "blockwise", columnwise=True, block_dim=2) == 4 * 3 * 8  # (3, pad(8, 4))
    assert scale_bytes(1000, 300, "delayed", columnwise=True) == 4


def test_blockwise_gathered_linear_saves_the_column_wise_shard():
    # linear.py:546-560: Float8BlockQuantizer can all-gather column-wise data, so the shard is saved column-wise
    x = torch.randn(256, 128, dtype=torch.bfloat16, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(64, 128, dtype=torch.bfloat16))
    out = Fp8GatheredLinear.apply(x, w, None, SimulatedGroup(2), "blockwise")
    assert out.grad_fn.saved_tensors[0].shape == (128, 256)  # [in, tokens/tp]
    assert _saved_bytes(out) == {"torch.uint8": 256 * 128, "torch.float32": 4 * 2 * 128}  # (256/128, 128) scales
    out.sum().backward()
    assert x.grad.shape == x.shape


def test_first_last_layers_bf16_keep_their_linears_and_weights_out_of_fp8():
    config = MODEL.replace(num_layers=4, fp8_recipe="tensorwise", fp8_layers=(0, 1, 1, 0))
    module = build_tp_stage_module(config, ChunkSpec(0, 1, 0, 4), SimulatedGroup(1))
    prepare_fp8(module, "tensorwise", config.fp8_bf16_layer_indices())
    fp8 = {n.split(".")[1] for n, m in module.named_modules() if getattr(m, "saves_fp8_input", False)}
    assert fp8 == {"1", "2"}
    assert config.mixed_layers and config.with_depth(2, fp8=(0, 1)).fp8_layers == (0, 1)
    assert config.with_depth(2, fp8=(1, 1)).fp8_layers is None
    job = Job.build(config, precision="bf16", pp=2, num_microbatches=2, distributed_optimizer=True,
                    fp8_param_gather=True)
    for stage, fp8_layer in ((0, "1"), (1, "0")):  # global layers 1 and 2: the first of stage 1's two
        names = {p.name.split(".")[1] for chunk in stage_parameters(job, stage) for p in chunk if p.fp8}
        assert names == {fp8_layer}
    with pytest.raises(Exception, match="fp8_layers"):
        MODEL.replace(fp8_layers=(1, 1))  # no recipe
    # the bf16 layer keeps 2-byte inputs where its FP8 twin keeps 1-byte copies: more activation bytes
    every = job.replace(model=config.replace(fp8_layers=None))
    assert predict_stage(job, 1, kernels="te").parts["activations"] > \
        predict_stage(every, 1, kernels="te").parts["activations"]
