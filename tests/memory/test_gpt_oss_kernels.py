"""What the gpt-oss layers keep for backward under the ``te`` profile (NOTE [gpt-oss layers] in remat.models.blocks):
Megatron's quick-geglu (eager, and the experts' fused kernel), TransformerEngine 2.17.1's attention with a sink and a
sliding window, and the learnable sink's parameters."""

from __future__ import annotations

import pytest
import torch
from autograd_kept import kept_by_node
from torch._subclasses.fake_tensor import FakeTensorMode

from remat.config import ModelConfig
from remat.memory.kernels import kernel_trace, prepare_model, te_unfused_attention
from remat.models.blocks import CoreAttention, QuickGeGLU
from remat.models.gpt import build_model, building
from remat.models.tensor_parallel import SimulatedGroup, build_tp_model

T, F = 16, 8  # tokens, ffn
GEGLU = ModelConfig(activation="quick_geglu", glu_linear_offset=1.0, activation_func_clamp_value=7.0, dtype="bf16")


def kept_by_geglu(config: ModelConfig, weighted: bool = False) -> dict[str, int]:
    with FakeTensorMode(), kernel_trace("te"):
        fc1_out = torch.empty(T, 2 * F, dtype=torch.bfloat16, requires_grad=True)
        probs = torch.empty(T, dtype=torch.float32, requires_grad=True)
        act = QuickGeGLU(config)
        out = act.weighted(fc1_out, probs) if weighted else act(fc1_out)
        kept = kept_by_node(out)
        assert out.shape == (T, F) and out.dtype == torch.bfloat16
        out.sum().backward()
        assert fc1_out.grad.shape == fc1_out.shape
    return kept


def test_eager_quick_geglu_with_clamp_keeps_the_fc1_output_and_three_halves():
    # mlp.py:325-334 / experts.py:994-1010 (--no-bias-gelu-fusion): each clamp keeps its input (a view of the fc1
    # output [T, 2f]), the compiled quick_gelu its clamped input [T, f], the product its two factors [T, f] each
    assert kept_by_geglu(GEGLU) == {"MulBackward0": 2 * 2 * T * F, "QuickGeluBackward": 2 * T * F,
                                    "ClampBackward1": 2 * T * 2 * F}


def test_eager_quick_geglu_without_clamp_keeps_the_fc1_output_through_the_gate_view():
    config = GEGLU.replace(activation_func_clamp_value=None)
    assert kept_by_geglu(config) == {"MulBackward0": 2 * 2 * T * F, "QuickGeluBackward": 2 * T * 2 * F}


def test_fused_weighted_quick_geglu_keeps_its_concatenated_input_the_probabilities_and_the_offset():
    # fused_bias_geglu.py:410-430: the clamped halves concatenated (a new [T, 2f]), WeightedQuickGeGLUFunction keeps
    # it, the [T, 1] fp32 weights and the offset as a bf16 scalar tensor; the clamps keep the fc1 output
    kept = kept_by_geglu(GEGLU.replace(bias_activation_fusion=True), weighted=True)
    assert kept == {"WeightedQuickGeGLUBackward": 2 * T * 2 * F + 4 * T + 2, "ClampBackward1": 2 * T * 2 * F}


def kept_by_core(config: ModelConfig, layer: int, b: int = 1, a: int = 2, s: int = 32, d: int = 16):
    """Bytes TE's attention keeps beyond q, k, v (views of the QKV output) for the reference core attention of
    layer ``layer`` built from ``config`` (bf16, dropout 0.1), by autograd node."""
    with FakeTensorMode(), kernel_trace("te"):
        with building(config, "cpu"):  # the sink's parameter in the model's dtype, as Float16Module casts it
            core = CoreAttention(config, heads=a, layer=layer).train()
        prepare_model(core, "te")
        qkv = torch.empty(b, s, 3 * a * d, dtype=torch.bfloat16, requires_grad=True)
        q, k, v = (t.view(b, s, a, d).transpose(1, 2) for t in qkv.split(a * d, dim=-1))
        out = core(q, k, v, torch.ones(1, 1, s, s, dtype=torch.bool).tril())
        kept = kept_by_node(out, qkv)
        out.sum().backward()
    return kept


SINK = ModelConfig(num_layers=2, num_attention_heads=2, hidden_size=32, dtype="bf16", softmax_type="learnable",
                   window_size=(7, 0), window_attn_skip_freq=2, attention="sdpa")


def test_a_sliding_window_layer_with_a_sink_and_dropout_runs_te_unfused_attention():
    # utils.py:1257 (no fused kernel for a window with dropout) and :1027 (no flash kernel for a sink): the unfused
    # attention; backends.py:629-656: the sink column makes [b, h, s, s + 1] logits, 33 columns (not a multiple of
    # 8): forward_torch_softmax in fp32 keeps its output and the padded [1, 1, s, s + 1] 'arbitrary' mask; dropout's
    # bool mask and the dropped probabilities are [b, h, s, s] (the sink column dropped before)
    b, a, s = 1, 2, 32
    assert kept_by_core(SINK, layer=0) == {"AttentionContextBackward": 2 * b * a * s * s,
                                           "NativeDropoutBackward0": b * a * s * s,
                                           "SoftmaxBackward0": 4 * b * a * s * (s + 1),
                                           "MaskedFillBackward0": s * (s + 1)}


def test_a_full_layer_with_a_sink_runs_fused_attention_keeping_the_fp32_offset():
    # layer_number 2 % 2 == 0: full attention; FusedAttention keeps q, k, v, out, Stats, rng_state and the
    # softmax_offset.reshape(1, -1, 1, 1).to(fp32) among aux_ctx_tensors (attention.cpp:274, 298)
    b, a, s, d = 1, 2, 32, 16
    assert kept_by_core(SINK, layer=1) == {"_TeFusedAttentionBackward": 2 * b * s * a * d + 4 * b * a * s + 16 + 4 * a}


def test_a_window_without_a_sink_keeps_what_the_fused_kernels_keep():
    # no sink: FlashAttention takes the window with dropout; it keeps q, k, v, out, fp32 softmax statistics, rng
    b, a, s, d = 1, 2, 32, 16
    config = SINK.replace(softmax_type="vanilla")
    assert kept_by_core(config, layer=0) == {"_TeFusedAttentionBackward": 2 * b * s * a * d + 4 * b * a * s + 16}


def test_te_unfused_attention_with_a_window_softmaxes_through_the_arbitrary_mask_kernel():
    # a window alone: mask type 'arbitrary' with a [1, 1, s, s] mask, s % 8 == 0: ScaledMaskedSoftmax (bf16 output)
    b, a, s, d = 4, 8, 64, 16
    with FakeTensorMode(), kernel_trace("te"):
        qkv = torch.empty(b, s, 3 * a * d, dtype=torch.bfloat16, requires_grad=True)
        q, k, v = (t.view(b, s, a, d).transpose(1, 2) for t in qkv.split(a * d, dim=-1))
        out = te_unfused_attention(q, k, v, torch.ones(1, 1, s, s, dtype=torch.bool), 0.1, d ** -0.5, window=(7, 0))
        kept = kept_by_node(out, qkv)
    assert kept == {"_TeMaskedSoftmaxBackward": 2 * b * a * s * s, "NativeDropoutBackward0": b * a * s * s,
                    "AttentionContextBackward": 2 * b * a * s * s}


@pytest.mark.parametrize("tp", [1, 2])
def test_the_learnable_sink_is_one_parameter_per_head_and_layer(tp):
    # TE dot_product_attention.py:488: Parameter(zeros(num_attention_heads // tp)) in every layer's attention
    config = ModelConfig(num_layers=3, hidden_size=64, num_attention_heads=4, vocab_size=128, seq_length=16,
                         micro_batch_size=1, dtype="bf16")
    with FakeTensorMode():
        def count(c: ModelConfig) -> int:
            model = build_model(c) if tp == 1 else build_tp_model(c, SimulatedGroup(tp))
            return sum(p.numel() for p in model.parameters())

        assert count(config.replace(softmax_type="learnable")) - count(config) == 3 * 4 // tp
        assert count(config.replace(softmax_type="off-by-one")) == count(config)  # a plain tensor, no parameter


def test_window_and_full_layers_are_traced_whole_and_a_chunk_keeps_its_own_layers_windows():
    from remat.memory.predict import predict_config
    from remat.parallel.job_predict import chunk_config
    from remat.parallel.schedule import ChunkSpec

    config = ModelConfig(num_layers=6, hidden_size=32, num_attention_heads=2, vocab_size=64, seq_length=16,
                         micro_batch_size=1, dtype="bf16", window_size=(3, 0), window_attn_skip_freq=2)
    assert config.mixed_attention and not config.replace(window_attn_skip_freq=None).mixed_attention
    composed = predict_config(config, "full/uniform/1", device="cuda", kernels="te")
    whole = predict_config(config, "full/uniform/1", device="cuda", kernels="te", compose_layers=False)
    assert composed.peak_bytes == whole.peak_bytes  # the stack is not composed from a shallow one
    # a pipeline chunk of global layers 3..5 (layer_number 4, 5, 6): full, window, full, built from its layer 0
    chunk = chunk_config(config, ChunkSpec(1, 2, 3, 3))
    assert chunk.window_pattern() == (False, True, False) == config.window_pattern()[3:]
