"""Kernel profiles: the CUDA and TransformerEngine kernels' saved tensors, traced under fake tensors on the CPU."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from autograd_kept import kept_by_node
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention import SDPBackend, sdpa_kernel

from remat.config import ModelConfig
from remat.memory.cuda_sdpa import select_backend
from remat.memory.kernels import KernelWarning, kernel_trace, prepare_model, resolve_kernels, use_kernels
from remat.memory.predict import predict, predict_config

TINY = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, micro_batch_size=2,
                   vocab_size=128, dtype="bf16")


def saved(node) -> dict[str, torch.Tensor]:
    return {name[len("_saved_"):]: getattr(node, name) for name in dir(node) if name.startswith("_saved_")
            and isinstance(getattr(node, name), torch.Tensor)}


def test_cuda_dropout_keeps_a_bool_mask_and_cpu_a_float_noise() -> None:
    with FakeTensorMode():
        x = torch.empty(4, 8, dtype=torch.bfloat16, requires_grad=True)
        with kernel_trace("cuda"):
            y = F.dropout(x, 0.1)
            same = F.dropout(x, 0.0)
        assert y.grad_fn.name() == "NativeDropoutBackward0"
        assert saved(y.grad_fn)["result1"].dtype == torch.bool
        assert same is x  # p = 0 is not fused: the input comes back
        with kernel_trace("cpu"):
            z = F.dropout(x, 0.1)
        assert z.grad_fn.name() == "MulBackward0" and saved(z.grad_fn)["other"].dtype == torch.bfloat16


def test_cuda_layer_norm_keeps_fp32_statistics_and_rms_norm_only_input_and_rstd() -> None:
    with FakeTensorMode(), kernel_trace("cuda"):
        x = torch.empty(2, 8, 16, dtype=torch.float16, requires_grad=True)
        w = torch.empty(16, dtype=torch.float16, requires_grad=True)
        ln = F.layer_norm(x, (16,), w, w)
        rms = F.rms_norm(x, (16,), w, 1e-5)
        kept_ln = [t for t in ln.grad_fn.saved_tensors if t is not None]
        kept_rms = [t for t in rms.grad_fn.saved_tensors if t is not None]
        (ln.sum() + rms.sum()).backward()
        assert x.grad.shape == x.shape and w.grad.shape == w.shape
    assert [(tuple(t.shape), t.dtype) for t in kept_ln if t.dim() == 3] == [
        ((2, 8, 16), torch.float16), ((2, 8, 1), torch.float32), ((2, 8, 1), torch.float32)]
    assert [(tuple(t.shape), t.dtype) for t in kept_rms if t.dim() == 3] == [
        ((2, 8, 16), torch.float16), ((2, 8, 1), torch.float32)]


def test_sdpa_backend_follows_the_cuda_dispatch_rules() -> None:
    with FakeTensorMode():
        q = torch.empty(1, 4, 128, 64, dtype=torch.bfloat16)
        mask = torch.ones(128, 128, dtype=torch.bool)
        q32, odd = q.float(), torch.empty(1, 4, 128, 6)
        assert select_backend(q, q, q, is_causal=True, dropout_p=0.1) == "flash"
        assert select_backend(q, q, q, mask) == "efficient"       # flash refuses any mask
        assert select_backend(q32, q32, q32, is_causal=True) == "efficient"  # flash refuses fp32
        assert select_backend(odd, odd, odd) == "math"            # head dim 6: not a multiple of 4
        big = torch.empty(1, 4, 128, 264, dtype=torch.bfloat16)
        assert select_backend(big, big, big) == "efficient"       # flash stops at head dim 256
        with sdpa_kernel([SDPBackend.MATH]):
            assert select_backend(q, q, q, is_causal=True) == "math"
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]), pytest.raises(RuntimeError, match="sdpa_kernel"):
            select_backend(q, q, q, mask)


def test_math_attention_on_cuda_keeps_softmax_bool_mask_and_dropped_probabilities() -> None:
    with FakeTensorMode(), sdpa_kernel([SDPBackend.MATH]), kernel_trace("cuda"):
        q = torch.empty(1, 2, 16, 8, dtype=torch.float32, requires_grad=True)
        out = F.scaled_dot_product_attention(q, q, q, dropout_p=0.1, is_causal=True)
        seen, names, stack = set(), set(), [out.grad_fn]
        while stack:
            n = stack.pop()
            if n is not None and n not in seen:
                seen.add(n)
                names.add(n.name())
                stack.extend(f for f, _ in n.next_functions)
    assert {"NativeDropoutBackward0", "SafeSoftmaxBackward0", "BmmBackward0"} <= names


def test_kernels_are_named_in_the_timeline_and_cpu_is_the_default() -> None:
    assert predict_config(TINY, "none").meta["kernels"] == "cpu"
    assert predict_config(TINY, "none", device="cuda").meta["kernels"] == "cuda"  # --device cuda implies cuda
    with use_kernels("te"):
        assert resolve_kernels() == "te"
        assert predict_config(TINY, "none").meta["kernels"] == "te"
    assert resolve_kernels() == "cpu"


def test_unknown_kernel_profile_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match=r"kernels='rocm': must be one of cpu, cuda, te"):
        predict_config(TINY, "none", kernels="rocm")


def test_cuda_and_te_bytes_per_layer_on_a_llama_style_model() -> None:
    llama = TINY.replace(activation="swiglu", normalization="rmsnorm", position="rope", num_query_groups=2,
                         add_bias_linear=False, attention="sdpa", hidden_dropout=0.0, attention_dropout=0.0)
    peaks = {k: predict_config(llama, "none", kernels=k).peak_bytes for k in ("cpu", "cuda", "te")}
    # CPU rms_norm keeps fp32 copies (upcast input and normalised x); CUDA's fused kernel keeps input + rstd
    assert peaks["cuda"] < peaks["cpu"]
    # TE keeps K, V un-repeated (GQA) and its fused SwiGLU keeps only the fc1 output
    assert peaks["te"] < peaks["cuda"]


def test_an_operator_the_profile_cannot_express_is_warned_with_its_bytes() -> None:
    lib = torch.library.Library("remat_test", "FRAGMENT")  # noqa: TOR901
    lib.define("fused(Tensor x) -> Tensor")
    lib.impl("fused", lambda x: x * 2, "CompositeExplicitAutograd")
    lib.impl("fused", lambda x: torch.empty_like(x), "Meta")

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(16, 16)])

        def forward(self, x):
            return torch.ops.remat_test.fused(self.layers[0](x)).square().mean()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tl = predict(Net, "none", batch=(torch.randn(4, 16),), kernels="cuda")
    messages = [str(w.message) for w in caught if issubclass(w.category, KernelWarning)]
    assert messages == ["kernels=cuda: remat_test.fused.default (not an ATen operator: what its CUDA kernel keeps "
                        "is unknown) is priced as the fake trace made it: 256 bytes of outputs in 1 call(s)"]
    assert tl.meta["kernel_warnings"] == messages


def test_a_recorder_above_the_profile_observes_for_it_and_gives_it_back() -> None:
    """NOTE [the kernel profile's observer, absorbed]: inside the recorder the observer is off the mode stack (one
    Python mode per operator) yet still notes what the profile cannot express; it is back on exit."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    from remat.memory.kernels import UntranslatedObserver
    from remat.memory.measure import StepRecorder

    lib = torch.library.Library("remat_test_absorbed", "FRAGMENT")  # noqa: TOR901
    lib.define("fused(Tensor x) -> Tensor")
    lib.impl("fused", lambda x: torch.empty_like(x), "Meta")
    model = torch.nn.Linear(4, 4)
    with warnings.catch_warnings(record=True) as caught, FakeTensorMode(), kernel_trace("cuda") as record:
        warnings.simplefilter("always")
        observer = _get_current_dispatch_mode()
        assert type(observer) is UntranslatedObserver
        with StepRecorder(model, [model]) as recorder:
            assert _get_current_dispatch_mode() is recorder and torch._C._len_torch_dispatch_stack() == 2
            torch.ops.remat_test_absorbed.fused(torch.empty(8, dtype=torch.float32))
        assert _get_current_dispatch_mode() is observer
        torch.ops.remat_test_absorbed.fused(torch.empty(4, dtype=torch.float32))
    assert record.messages == ["kernels=cuda: remat_test_absorbed.fused.default (not an ATen operator: what its CUDA "
                               "kernel keeps is unknown) is priced as the fake trace made it: 48 bytes of outputs "
                               "in 2 call(s)"]
    assert len([w for w in caught if issubclass(w.category, KernelWarning)]) == 1


# ---------------------------------------------------------------------------------------------------------
# TransformerEngine 2.17.1's attention (Megatron-LM d98e8a6's pin), bytes kept per layer from the sources
# ---------------------------------------------------------------------------------------------------------
def kept_by_attention(b: int, a: int, s: int, d: int = 64, dtype: torch.dtype = torch.bfloat16, groups: int = 0,
                      kind: str = "unfused") -> dict[str, int]:
    """Bytes of each tensor TE's attention keeps for backward beyond q, k, v (views of the QKV GEMM's output, which
    the layer keeps anyway), by the autograd node that keeps it; q, k, v [b, heads, s, d] as the layer makes them."""
    from remat.memory.kernels import te_attention, te_unfused_attention

    g = groups or a
    with FakeTensorMode(), kernel_trace("te"):
        qkv = torch.empty(b, s, (a + 2 * g) * d, dtype=dtype, requires_grad=True)
        q, k, v = qkv.split([a * d, g * d, g * d], dim=-1)
        q, k, v = (t.view(b, s, -1, d).transpose(1, 2) for t in (q, k, v))
        mask = torch.ones(1, 1, s, s, dtype=torch.bool)
        if kind == "unfused":
            out = te_unfused_attention(q, k, v, mask, 0.1, d ** -0.5)
        else:
            out = te_attention(q, k, v, dropout_p=0.1, is_causal=True, enable_gqa=True)
        kept = kept_by_node(out, qkv)
        out.sum().backward()  # the backward runs
        assert qkv.grad.shape == qkv.shape
    return kept


def test_te_unfused_attention_keeps_the_fused_softmax_output_the_dropout_mask_and_the_dropped_probabilities() -> None:
    # Megatron's --attention-backend unfused, bf16, b=4, 8 heads, s=1024, head dim 64: the fused softmax kernel runs
    # (softmax.py is_kernel_available: 16 < s < 16384, s % 8 == 0, s % 4 == 0, b*heads % 4 == 0, s % 4 == 0 with
    # batch_per_block(1024) = 4): ScaledMaskedSoftmax keeps its bf16 output, native_dropout its bool mask, bmm the
    # dropped-out bf16 probabilities; baddbmm keeps q and k, bmm v (views); scores and the full mask are not kept
    b, a, s = 4, 8, 1024
    assert kept_by_attention(b, a, s) == {"_TeMaskedSoftmaxBackward": 2 * b * a * s * s,
                                          "NativeDropoutBackward0": 1 * b * a * s * s,
                                          "AttentionContextBackward": 2 * b * a * s * s}
    assert sum(kept_by_attention(b, a, s).values()) == 167_772_160  # 5 b a s², 160 MiB per layer


@pytest.mark.parametrize("dtype, softmax", [(torch.bfloat16, 4), (torch.float32, 4)])
def test_te_unfused_attention_without_the_fused_kernel_keeps_an_fp32_softmax_and_the_mask(dtype, softmax) -> None:
    # b*heads = 2 (not a multiple of 4), or fp32: forward_torch_softmax upcasts to fp32 (TE's softmax_in_fp32=True),
    # masked_fill_ keeps the [1, 1, s, s] bool mask (or'ed with the causal one), softmax its fp32 output; the
    # dropped-out probabilities are in the model dtype
    b, a, s, size = 1, 2, 32, dtype.itemsize
    assert kept_by_attention(b, a, s, dtype=dtype) == {"AttentionContextBackward": size * b * a * s * s,
                                                       "NativeDropoutBackward0": b * a * s * s,
                                                       "SoftmaxBackward0": softmax * b * a * s * s,
                                                       "MaskedFillBackward0": s * s}


def test_te_unfused_attention_keeps_repeated_keys_and_values_under_gqa() -> None:
    b, a, s, d = 2, 4, 32, 16
    kept = kept_by_attention(b, a, s, d, groups=2)
    assert kept["_TeScoresBackward"] == kept["AttentionContextBackward"] - 2 * b * a * s * s == 2 * b * a * s * d


def test_te_fused_attention_keeps_fp32_stats_and_the_rng_state() -> None:
    # auto on H100 (deterministic, bf16, causal, dropout 0.1, head dim 64): FusedAttention's cuDNN
    # F16_arbitrary_seqlen: q, k, v (un-repeated), out, Stats fp32 [b, h, s, 1], rng_state int64 [2]
    b, a, s = 4, 8, 1024
    out_bytes = 2 * b * s * a * 64
    assert kept_by_attention(b, a, s, kind="auto") == {"_TeFusedAttentionBackward": out_bytes + 4 * b * a * s + 16}
    assert kept_by_attention(2, 4, 32, groups=2, kind="auto") == {"_TeFusedAttentionBackward": 2 * 2 * 32 * 4 * 64
                                                                  + 4 * 2 * 4 * 32 + 16}


def test_te_softmax_kernel_availability_follows_is_kernel_available() -> None:
    from remat.memory.kernels import te_softmax_fusable

    assert te_softmax_fusable(torch.bfloat16, 4, 8, 1024, 1024)
    assert te_softmax_fusable(torch.float16, 2, 4, 32, 32)          # batch_per_block(32) = 8
    assert not te_softmax_fusable(torch.float32, 4, 8, 1024, 1024)  # 16-bit inputs only
    assert not te_softmax_fusable(torch.bfloat16, 1, 2, 32, 32)     # b * heads % 4
    assert not te_softmax_fusable(torch.bfloat16, 4, 8, 1020, 1020)  # s % 8
    assert not te_softmax_fusable(torch.bfloat16, 4, 8, 16, 16)      # 16 < s
    assert not te_softmax_fusable(torch.bfloat16, 4, 8, 16384, 16384)
    assert not te_softmax_fusable(torch.bfloat16, 4, 8, 8, 16)      # causal needs sq == sk


def test_te_mla_layer_keeps_what_megatron_mla_keeps_under_unfused_attention() -> None:
    # Megatron-LM d98e8a6 MLASelfAttention (TE spec, --qk-layernorm, --no-rope-fusion) with TE 2.17.1's unfused
    # attention keeps, per layer: the down-projections' input (TELinear); linear_q_up_proj's and linear_kv_up_proj's
    # (TELayerNormColumnParallelLinear, layernorm_linear.py:492-501) input (q_compressed; kv_compressed, a view of
    # kv_combined) and ln_out, with an fp32 rsigma each; query and key [s, b, heads, qk + pos] (baddbmm,
    # backends.py:567; made by torch.cat, multi_latent_attention.py:967, 975, so .contiguous() copies nothing);
    # value made contiguous (:979; bmm); the fused softmax output (softmax.py:107; the bmm's input too: dropout 0
    # returns it); the permuted context (linear_proj). The unfused rope (rope_utils.py:92-156) keeps only its
    # cos/sin tables (the multiplies by a tensor that needs no gradient keep that tensor): no other [.., qk + pos]
    # tensor is kept (issue 27: the memory_speed case's gap is not a missing MLA tensor)
    from remat.models.gpt import rotary_tables
    from remat.models.mla import MLASelfAttention

    b, s, h, n, q_lora, kv_lora, qk, pos, v = 2, 32, 64, 4, 48, 16, 8, 4, 8
    config = ModelConfig(num_layers=1, hidden_size=h, num_attention_heads=n, seq_length=s, micro_batch_size=b,
                         vocab_size=64, multi_latent_attention=True, position="rope", normalization="rmsnorm",
                         q_lora_rank=q_lora, kv_lora_rank=kv_lora, qk_head_dim=qk, qk_pos_emb_head_dim=pos,
                         v_head_dim=v, dtype="bf16", attention="math", attention_dropout=0.0, qk_layernorm=True)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with FakeTensorMode(), kernel_trace("te"):
            layer = MLASelfAttention(config)
            prepare_model(layer, "te")
            x = torch.empty(b, s, h, requires_grad=True)
            rotary = rotary_tables(config, s, x.device)
            out = layer(x, torch.ones(1, 1, s, s, dtype=torch.bool), rotary)
            kept = kept_by_node(out, *layer.parameters(), *rotary)
    finally:
        torch.set_default_dtype(default)
    assert kept["_TeScoresBackward"] == 2 * (2 * b * s * n * (qk + pos))        # query, key
    assert kept["AttentionContextBackward"] == 2 * (b * n * s * s + b * s * n * v)  # the probabilities, value
    assert "_TeMaskedSoftmaxBackward" not in kept  # the same probabilities: dropout 0 returns its input
    # the rest, as listed above: the layer's input, q_compressed and its ln_out, kv_combined and kv's ln_out, the
    # context (bf16), and the two fp32 rsigma
    bf16 = 2 * b * s * (h + q_lora + q_lora + (kv_lora + pos) + kv_lora + n * v)
    rest = sum(kept.values()) - kept["_TeScoresBackward"] - kept["AttentionContextBackward"]
    assert rest == bf16 + 2 * 4 * b * s


@pytest.mark.parametrize("normalization", ["layernorm", "rmsnorm"])
def test_te_qk_norms_keep_a_contiguous_copy_of_the_query_and_key(normalization) -> None:
    # Megatron's q/k norms under the TE spec are TENorm (te.pytorch LayerNorm / RMSNorm), whose op keeps
    # input_.contiguous() (TE ops/basic/layer_norm.py:199, 221; rmsnorm.py:182, 202): the query and key are views of
    # the QKV output (attention.py:1913-1936), so each norm keeps its own copy beside its fp32 statistics (issue 27:
    # 2 x 1 MiB per layer in the qk_layernorm_test_mode case). PyTorch's CUDA norm keeps the view (no copy).
    from remat.models.gpt import SelfAttention

    b, s, n, d = 2, 32, 4, 16
    config = ModelConfig(num_layers=1, hidden_size=n * d, num_attention_heads=n, num_query_groups=2, seq_length=s,
                         micro_batch_size=b, vocab_size=64, dtype="bf16", normalization=normalization,
                         qk_layernorm=True, attention_dropout=0.0)
    heads = {"q": n, "k": 2}
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    kept: dict[str, dict[str, list[torch.Tensor]]] = {}
    try:
        for kernels in ("te", "cuda"):
            with FakeTensorMode(), kernel_trace(kernels):
                layer = SelfAttention(config)
                prepare_model(layer, kernels)
                outs: dict[str, torch.Tensor] = {}
                for name in heads:
                    getattr(layer, f"{name}_layernorm").register_forward_hook(
                        lambda _m, _i, out, name=name, outs=outs: outs.__setitem__(name, out))
                layer(torch.empty(b, s, n * d, requires_grad=True), torch.ones(1, 1, s, s, dtype=torch.bool), None)
                kept[kernels] = {name: [t for t in out.grad_fn.saved_tensors if t is not None and t.dim() == 4]
                                 for name, out in outs.items()}
    finally:
        torch.set_default_dtype(default)
    qkv_bytes = 2 * b * s * (n + 2 * 2) * d
    stats = 1 if normalization == "rmsnorm" else 2
    for name, h in heads.items():
        x, *statistics = kept["te"][name]
        assert x.is_contiguous() and x.untyped_storage().nbytes() == 2 * b * s * h * d  # its own copy
        assert [(t.dtype, t.numel()) for t in statistics] == [(torch.float32, b * s * h)] * stats
        view = kept["cuda"][name][0]
        assert not view.is_contiguous() and view.untyped_storage().nbytes() == qkv_bytes  # the QKV output's
