"""The CUDA checks of issue 12 that ``benchmarks/gpu_check.py`` runs (``--checks offload,mla_sdpa,moe``): fine-grained
activation offloading, the attention kernel of multi-latent attention, and MoE experts with their recompute modules,
each predicted (``kernels='cuda'``, 512-byte blocks) and measured on the GPU.

Every comparison prints one line ``PASS``/``FAIL``/``INFO``/``SKIP`` with its bytes:

* ``offload``: a dense GPT (dropout 0.1, SDPA) under ``selective/core_attn,offload:attn_norm+core_attn,
  offload_min:4096`` and an all-module offload, a grouped-MoE model under ``offload:expert_fc1+moe_act`` (with and
  without ``selective/moe_act``). Per case: the predicted device peak against ``torch.cuda.max_memory_allocated``
  (less what was allocated before the model was built; 3%) and against the step recorder's own timeline on the GPU
  (the same allocations, to the byte); the host bytes (``meta['host_memory']``: peak and bytes per module) predicted
  against measured, to the byte, with the pinned host allocator's peak (``torch.cuda.host_memory_stats``) beside
  them; the device bytes the offloading saves (against the same recompute policy without it), predicted and
  measured; and every parameter's gradient bit for bit against the plain model's (no recompute, no offload), with
  dropout on (``torch.use_deterministic_algorithms(warn_only=True)`` for the step; the plain step is run twice so
  a kernel that is not reproducible shows as ``INCONCLUSIVE``, not as an offloading bug).
* ``mla_sdpa``: MLA with DeepSeek-V3's attention shape (128 heads, q/k head dim 128 + 64 = 192, v 128, s 4096) and
  two tiny ones (q/k 24 and v 16, aligned; q/k 12 and v 8, unaligned): the backend PyTorch runs (the autograd node
  of ``F.scaled_dot_product_attention``'s output, and ``torch._fused_sdp_choice``) against
  :func:`remat.memory.cuda_sdpa.select_backend` on the same tensors, and the tensors autograd saves for that call
  (shape, stride, dtype, bytes) against those of :func:`remat.memory.cuda_sdpa.cuda_sdpa` on fake tensors; then the
  whole model's predicted peak against the measured one under ``none`` and ``selective/mla_up_proj``.
* ``moe``: grouped experts with a shared expert under ``none``, ``selective/moe_act``, ``selective/moe``,
  ``selective/shared_experts``, ``selective/moe_act+shared_experts``, and separate experts under ``none`` and
  ``selective/moe``: predicted against measured peaks and the recorder's timeline (balanced routing forced, as in
  the tests), each module's saving against ``none`` predicted and measured; then the same grouped model routed for
  real on the GPU, predicted again from the token counts it reports.

``--dry-run-cpu`` runs the same code on tiny configs on the CPU (kernels='cpu', every figure exact, 0% limits);
the SDPA comparison needs CUDA and says so.
"""

from __future__ import annotations

import gc
import os
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from remat.config import ModelConfig
from remat.memory.allocator import replay_timeline
from remat.memory.cuda_sdpa import cuda_sdpa, select_backend
from remat.memory.measure import measure
from remat.memory.predict import predict_config
from remat.models.gpt import build_model, sample_batch
from remat.presets import get_preset
from remat.recompute.apply import apply
from remat.timeline import Timeline

MIB = 1 << 20
CHECKS = ("offload", "mla_sdpa", "moe")
DENSE_OFFLOAD = "attn_norm+qkv_linear+core_attn+attn_proj+mlp_norm"


# ------------------------------------------------------------------------------------------------ reporting
class Results:
    """Collects the PASS/FAIL/INCONCLUSIVE/INFO/SKIP/ERROR lines of a run; ``failed`` counts FAIL and ERROR."""

    def __init__(self) -> None:
        self.lines: list[dict[str, Any]] = []

    def add(self, verdict: str, check: str, what: str, detail: str) -> None:
        self.lines.append({"verdict": verdict, "check": check, "what": what, "detail": detail})
        print(f"  {verdict:<12} [{check}] {what}: {detail}", flush=True)

    def compare(self, check: str, what: str, ok: bool, detail: str) -> None:
        self.add("PASS" if ok else "FAIL", check, what, detail)

    @property
    def failed(self) -> int:
        return sum(line["verdict"] in ("FAIL", "ERROR") for line in self.lines)

    @contextmanager
    def guarded(self, check: str, what: str) -> Iterator[None]:
        """Run one case; an exception becomes an ``ERROR`` line (a failure) and the next case runs (one GPU run
        must report every case it can)."""
        try:
            yield
        except Exception as err:  # noqa: BLE001 - reported, counted as a failure
            traceback.print_exc()
            self.add("ERROR", check, what, f"{type(err).__name__}: {str(err)[:400]}")
            reset("cuda" if torch.cuda.is_available() else "cpu")


def mib(n: float) -> str:
    return f"{n / MIB:,.2f} MiB ({int(n):,} B)"


# ------------------------------------------------------------------------------------------------ configs
def dense_config(tiny: bool) -> ModelConfig:
    """A GPT with dropout and SDPA attention (dropout masks must come back equal after offloading)."""
    gpt = dict(dtype="bf16", attention="sdpa", hidden_dropout=0.1, attention_dropout=0.1)
    if tiny:
        return ModelConfig(num_layers=3, hidden_size=64, num_attention_heads=4, seq_length=64, micro_batch_size=2,
                           vocab_size=256, **gpt)
    return ModelConfig(num_layers=4, hidden_size=1024, num_attention_heads=8, seq_length=1024, micro_batch_size=2,
                       vocab_size=4096, **gpt)


def moe_config(tiny: bool, grouped: bool = True, routing: str | None = "balanced") -> ModelConfig:
    """Layer 0 dense, the others MoE (8 experts, top-2, grouped or separate, a shared expert), Llama-style, dropout
    0.1; ``routing`` forces the token counts (None: real routing)."""
    llama = dict(activation="swiglu", normalization="rmsnorm", position="rope", attention="sdpa",
                 add_bias_linear=False, dtype="bf16", hidden_dropout=0.1, attention_dropout=0.1)
    moe = dict(num_moe_experts=8, moe_router_topk=2, moe_grouped_gemm=grouped, moe_routing_assumption=routing)
    if tiny:
        return ModelConfig(num_layers=3, hidden_size=64, num_attention_heads=4, seq_length=64, micro_batch_size=2,
                           vocab_size=256, moe_ffn_hidden_size=64, moe_shared_expert_intermediate_size=32,
                           moe_layer_freq=(0, 1, 1), **moe, **llama)
    return ModelConfig(num_layers=4, hidden_size=512, num_attention_heads=8, seq_length=1024, micro_batch_size=2,
                       vocab_size=4096, moe_ffn_hidden_size=1024, moe_shared_expert_intermediate_size=512,
                       moe_layer_freq=(0, 1, 1, 1), **moe, **llama)


def mla_configs(tiny: bool) -> dict[str, ModelConfig]:
    """MLA models named by their attention shape: DeepSeek-V3's (2 layers, a small dense MLP) and two tiny ones."""
    base = dict(multi_latent_attention=True, position="rope", normalization="rmsnorm", activation="swiglu",
                attention="sdpa", add_bias_linear=False, dtype="bf16", hidden_dropout=0.0, attention_dropout=0.0)
    tiny_shape = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64, micro_batch_size=2,
                      vocab_size=256, q_lora_rank=32, kv_lora_rank=16)
    out = {"tiny q/k 24, v 16": ModelConfig(**tiny_shape, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16,
                                            **base),
           "tiny q/k 12, v 8": ModelConfig(**tiny_shape, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8, **base)}
    if not tiny:
        ds = get_preset("deepseek-v3")
        out = {"deepseek-v3 q/k 192, v 128": ModelConfig(
            num_layers=2, hidden_size=ds.hidden_size, num_attention_heads=ds.num_attention_heads,
            ffn_hidden_size=1024, vocab_size=1024, seq_length=ds.seq_length, micro_batch_size=ds.micro_batch_size,
            q_lora_rank=ds.q_lora_rank, kv_lora_rank=ds.kv_lora_rank, qk_head_dim=ds.qk_head_dim,
            qk_pos_emb_head_dim=ds.qk_pos_emb_head_dim, v_head_dim=ds.v_head_dim, **base), **out}
    return out


# ------------------------------------------------------------------------------------------------ running
def reset(device: str) -> int:
    """Free what earlier steps left; on CUDA also warm cuBLAS up (its workspace is allocated through the caching
    allocator on the first matmul: not a step's memory), reset the peaks and return the bytes still allocated."""
    gc.collect()
    if device != "cuda":
        return 0
    with torch.enable_grad():  # plain cuBLAS and cuBLASLt (a linear with bias), bf16 and fp32
        w = torch.ones(16, 16, device=device, dtype=torch.bfloat16, requires_grad=True)
        (w @ w).float().sum().backward()
        F.linear(w, w, w[0]).float().sum().backward()
        (w.float() @ w.float()).sum().backward()
        F.linear(w.float(), w.float(), w[0].float()).sum().backward()
    del w
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    if hasattr(torch.cuda, "reset_peak_host_memory_stats"):
        torch.cuda.reset_peak_host_memory_stats()
    return torch.cuda.memory_allocated()


def measured_step(config: ModelConfig, policy: str, device: str) -> dict[str, Any]:
    """One recorded step: the recorder's timeline, the allocator's peak less what was allocated before (CPU: the
    recorder's peak), the reserved peak (CPU: the replay of the measured timeline) and the pinned host peak."""
    before = reset(device)
    model = build_model(config, device, seed=0)
    apply(model, policy)
    torch.manual_seed(1)
    timeline = measure(model, sample_batch(config, device, seed=0))
    out: dict[str, Any] = {"timeline": timeline, "before": before}
    if device == "cuda":
        out["allocated"] = int(timeline.meta["cuda_max_memory_allocated"]) - before
        out["reserved"] = int(torch.cuda.max_memory_reserved())
        stats = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
        out["pinned_peak"] = stats.get("active_bytes.peak", stats.get("allocated_bytes.peak"))
    else:
        out["allocated"] = timeline.peak_bytes
        out["reserved"] = replay_timeline(timeline).peak_reserved
        out["pinned_peak"] = None
    del model
    reset(device)
    return out


def predicted_step(config: ModelConfig, policy: str, device: str) -> Timeline:
    return predict_config(config, policy, device=device, kernels="cuda" if device == "cuda" else "cpu")


def timeline_difference(predicted: Timeline, measured: Timeline) -> str | None:
    """None when both timelines hold the same allocations (bytes, when made and freed, category) and events; else
    where they first differ."""
    a = list(zip(predicted.nbytes, predicted.alloc_at, predicted.free_at, predicted.category))
    b = list(zip(measured.nbytes, measured.alloc_at, measured.free_at, measured.category))
    if a == b and predicted.num_events == measured.num_events:
        return None
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return (f"row {i}: predicted {x[0]:,} B {x[3]} by {predicted.module[i]} (events {x[1]}-{x[2]}), measured "
                    f"{y[0]:,} B {y[3]} by {measured.module[i]} (events {y[1]}-{y[2]})")
    return f"{len(a)} predicted rows, {len(b)} measured; {predicted.num_events} / {measured.num_events} events"


def compare_peaks(results: Results, check: str, what: str, predicted: Timeline, measured: dict[str, Any],
                  limit: float) -> None:
    """Predicted device peak against the allocator's (``limit`` relative) and the recorder's timeline (exact)."""
    real = measured["allocated"]
    error = (predicted.peak_bytes - real) / real
    results.compare(check, f"{what}: device peak", abs(error) <= limit,
                    f"predicted {mib(predicted.peak_bytes)}, max_memory_allocated {mib(real)} "
                    f"({100 * error:+.2f}%, limit {100 * limit:.0f}%; {mib(measured['before'])} allocated before)")
    recorded = measured["timeline"]
    diff = timeline_difference(predicted, recorded)
    results.compare(check, f"{what}: recorder timeline", diff is None,
                    f"identical, peak {mib(recorded.peak_bytes)}" if diff is None else
                    f"peak predicted {mib(predicted.peak_bytes)} vs recorded {mib(recorded.peak_bytes)}; {diff}")
    replay = replay_timeline(predicted).peak_reserved
    results.add("INFO", check, f"{what}: reserved", f"predicted (allocator replay) {mib(replay)}, "
                f"max_memory_reserved {mib(measured['reserved'])}")


# ------------------------------------------------------------------------------------------------ gradients
@contextmanager
def deterministic(device: str) -> Iterator[None]:
    """Deterministic kernels where PyTorch has them (warn only: an op without one stays as it is)."""
    if device != "cuda":
        yield
        return
    enabled, warn_only = torch.are_deterministic_algorithms_enabled(), \
        torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def gradients(config: ModelConfig, policy: str, device: str) -> dict[str, torch.Tensor]:
    """Every parameter's gradient after one step (weights of seed 0, dropout masks of seed 1), and the loss."""
    reset(device)
    model = build_model(config, device, seed=0)
    apply(model, policy)
    with deterministic(device):
        torch.manual_seed(1)
        loss = model(*sample_batch(config, device, seed=0))
        loss.backward()
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    out["(loss)"] = loss.detach()
    del model, loss
    return out


def differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors are not equal bit for bit (or missing on one side)."""
    return sorted(n for n in a.keys() | b.keys() if n not in a or n not in b or not torch.equal(a[n], b[n]))


def max_abs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], names: list[str]) -> float:
    common = [n for n in names if n in a and n in b]
    return max((float((a[n].float() - b[n].float()).abs().max()) for n in common), default=float("nan"))


def check_gradients(results: Results, check: str, config: ModelConfig, policy: str, twin: str, device: str,
                    plain_cache: dict[ModelConfig, tuple[dict, dict]]) -> None:
    """``policy``'s gradients bit for bit against the plain model's; ``twin`` (the same recompute without
    offloading) says whether a difference is the offloading's or the recompute's."""
    if config not in plain_cache:
        plain_cache[config] = (gradients(config, "none", device), gradients(config, "none", device))
    plain, again = plain_cache[config]
    got = gradients(config, policy, device)
    bad, noise = differing(plain, got), differing(plain, again)
    what = f"{policy}: gradients vs none"
    if not bad:
        results.add("PASS", check, what, f"{len(plain)} tensors bit-identical (loss included), dropout 0.1")
        return
    twin_note = ""
    if twin != "none":
        twin_bad = differing(plain, gradients(config, twin, device))
        twin_note = f"; without offloading ({twin}): {len(twin_bad)} differ"
    detail = (f"{len(bad)}/{len(plain)} differ (first {bad[0]}, max |diff| {max_abs(plain, got, bad):.3g})"
              f"{twin_note}")
    if noise:
        results.add("INCONCLUSIVE", check, what, f"{detail}; but two plain steps differ too ({len(noise)} tensors, "
                    f"e.g. {noise[0]}): a kernel is not reproducible here")
    else:
        results.add("FAIL", check, what, detail)


# ------------------------------------------------------------------------------------------------ (a) offloading
def offload_cases(tiny: bool) -> list[tuple[ModelConfig, str, str]]:
    """(config, policy, the same recompute without offloading)."""
    dense, moe = dense_config(tiny), moe_config(tiny)
    return [(dense, "selective/core_attn,offload:attn_norm+core_attn,offload_min:4096", "selective/core_attn"),
            (dense, f"none,offload:{DENSE_OFFLOAD},offload_min:4096", "none"),
            (moe, "none,offload:expert_fc1+moe_act,offload_min:4096", "none"),
            (moe, "selective/moe_act,offload:attn_norm+expert_fc1+moe_act,offload_min:4096", "selective/moe_act")]


def check_offload(results: Results, device: str, tiny: bool, limit: float) -> None:
    plain_cache: dict[ModelConfig, tuple[dict, dict]] = {}
    for config, policy, twin in offload_cases(tiny):
        what = f"{'moe' if config.is_moe else 'dense'} {policy}"
        with results.guarded("offload", what):
            offload_case(results, config, policy, twin, device, limit, plain_cache)


def offload_case(results: Results, config: ModelConfig, policy: str, twin: str, device: str, limit: float,
                 plain_cache: dict[ModelConfig, tuple[dict, dict]]) -> None:
    """One offloading policy: peaks, host bytes, saving against ``twin``, gradients."""
    what = f"{'moe' if config.is_moe else 'dense'} {policy}"
    predicted = predicted_step(config, policy, device)
    measured = measured_step(config, policy, device)
    compare_peaks(results, "offload", what, predicted, measured, limit)
    p_host, m_host = predicted.meta.get("host_memory", {}), measured["timeline"].meta.get("host_memory", {})
    same = bool(p_host) and all(p_host.get(k) == m_host.get(k) for k in ("peak_bytes", "offloaded_bytes"))
    results.compare("offload", f"{what}: host bytes", same,
                    f"peak predicted {mib(p_host.get('peak_bytes', 0))}, measured "
                    f"{mib(m_host.get('peak_bytes', 0))}; per module predicted {p_host.get('offloaded_bytes')}, "
                    f"measured {m_host.get('offloaded_bytes')}")
    if measured["pinned_peak"] is not None:
        results.add("INFO", "offload", f"{what}: pinned host allocator",
                    f"active peak {mib(measured['pinned_peak'])} (blocks rounded up to powers of two) for "
                    f"{mib(m_host.get('peak_bytes', 0))} of offloaded tensors")
    p_twin, m_twin = predicted_step(config, twin, device), measured_step(config, twin, device)
    p_saved = p_twin.peak_bytes - predicted.peak_bytes
    m_saved = m_twin["allocated"] - measured["allocated"]
    error = (p_saved - m_saved) / m_twin["allocated"]
    results.compare("offload", f"{what}: device bytes saved vs {twin}", abs(error) <= limit,
                    f"predicted {mib(p_saved)}, measured {mib(m_saved)} ({100 * error:+.2f}% of the peak)")
    check_gradients(results, "offload", config, policy, twin, device, plain_cache)


# ------------------------------------------------------------------------------------------------ (b) MLA attention
def backend_of(grad_fn: Any, depth: int = 4) -> str:
    """The SDPA backend whose autograd node made (or is just below) ``grad_fn``: flash, efficient, cudnn or math."""
    names = {"ScaledDotProductFlashAttentionBackward": "flash", "ScaledDotProductEfficientAttentionBackward":
             "efficient", "ScaledDotProductCudnnAttentionBackward": "cudnn"}
    frontier = [grad_fn]
    for _ in range(depth):
        for node in frontier:
            for prefix, backend in names.items():
                if node is not None and node.name().startswith(prefix):
                    return backend
        frontier = [n for node in frontier if node is not None for n, _ in node.next_functions]
    return "math"


def saved_of(call: Callable[[], torch.Tensor], reference: torch.Tensor) -> tuple[torch.Tensor, list[tuple]]:
    """Run ``call`` and list what autograd saves: (shape, stride, dtype, storage bytes, where), where is
    'device' for ``reference``'s device, else the other device's type."""
    saved: list[tuple] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        where = "device" if t.device == reference.device else t.device.type
        saved.append((tuple(t.shape), tuple(t.stride()), str(t.dtype).replace("torch.", ""),
                       t.untyped_storage().nbytes(), where))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = call()
    return out, saved


@contextmanager
def captured_sdpa() -> Iterator[list[dict[str, Any]]]:
    """Record the arguments of every ``F.scaled_dot_product_attention`` call in the block and the backend each ran."""
    calls: list[dict[str, Any]] = []
    original = F.scaled_dot_product_attention

    def spy(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        args = dict(attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        out, saved = saved_of(lambda: original(query, key, value, **args), query)
        calls.append({"q": query, "k": key, "v": value, **args, "saved": saved, "backend": backend_of(out.grad_fn)})
        return out

    F.scaled_dot_product_attention = spy
    try:
        yield calls
    finally:
        F.scaled_dot_product_attention = original


def fused_choice(call: dict[str, Any]) -> str:
    """``torch._fused_sdp_choice`` for the call, as a backend name ('?' where this torch has none)."""
    try:
        from torch.nn.attention import SDPBackend

        value = torch._fused_sdp_choice(call["q"], call["k"], call["v"], call["attn_mask"], call["dropout_p"],
                                        call["is_causal"], scale=call["scale"], enable_gqa=call["enable_gqa"])
        return {"FLASH_ATTENTION": "flash", "EFFICIENT_ATTENTION": "efficient", "CUDNN_ATTENTION": "cudnn",
                "MATH": "math"}.get(SDPBackend(value).name, SDPBackend(value).name)
    except Exception as err:  # noqa: BLE001 - a diagnostic only
        return f"? ({type(err).__name__})"


def predicted_saved(call: dict[str, Any]) -> tuple[str, list[tuple]]:
    """What remat's CUDA profile saves for the same call, on fake CPU tensors of the same layout."""
    with FakeTensorMode():
        def fake(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            x = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
            return x.requires_grad_(t.requires_grad)

        q, k, v, mask = fake(call["q"]), fake(call["k"]), fake(call["v"]), fake(call["attn_mask"])
        args = dict(dropout_p=call["dropout_p"], is_causal=call["is_causal"], scale=call["scale"],
                    enable_gqa=call["enable_gqa"])
        out, saved = saved_of(lambda: cuda_sdpa(q, k, v, mask, **args), q)
        return backend_of(out.grad_fn), saved


def describe(saved: list[tuple]) -> str:
    return ", ".join(f"{list(s)} {d} {n:,} B" + ("" if w == "device" else f" on {w}") for s, _, d, n, w in saved)


def compare_sdpa(results: Results, name: str, config: ModelConfig, device: str) -> None:
    """The first attention call of ``config``'s model run on ``device``: the backend PyTorch ran against remat's
    choice, and what autograd saved against what remat's CUDA profile saves for it."""
    reset(device)
    model = build_model(config, device, seed=0)
    with captured_sdpa() as calls:
        model(*sample_batch(config, device, seed=0))
    call = calls[0]
    ours = select_backend(call["q"], call["k"], call["v"], call["attn_mask"], call["dropout_p"], call["is_causal"],
                          call["enable_gqa"])
    mask = call["attn_mask"]
    shape = (f"q {list(call['q'].shape)}, k {list(call['k'].shape)}, v {list(call['v'].shape)} "
             f"{str(call['q'].dtype).replace('torch.', '')}, mask {None if mask is None else list(mask.shape)}, "
             f"dropout {call['dropout_p']}")
    results.compare("mla_sdpa", f"{name}: backend", ours == call["backend"],
                    f"PyTorch ran {call['backend']} (_fused_sdp_choice: {fused_choice(call)}), remat's "
                    f"select_backend picks {ours}; {shape}; priority order {torch._C._get_sdp_priority_order()}, "
                    f"cuDNN {torch.backends.cudnn.version()}, TORCH_CUDNN_SDPA_PREFERRED="
                    f"{os.environ.get('TORCH_CUDNN_SDPA_PREFERRED')}")
    backend, predicted = predicted_saved(call)
    same = backend == call["backend"] and \
        sorted(t[:4] for t in call["saved"]) == sorted(t[:4] for t in predicted)
    results.compare("mla_sdpa", f"{name}: saved tensors", same,
                    f"measured {sum(t[3] for t in call['saved']):,} B: {describe(call['saved'])}; predicted "
                    f"({backend}) {sum(t[3] for t in predicted):,} B: {describe(predicted)}")
    del model, calls, call
    reset(device)


def check_mla_sdpa(results: Results, device: str, tiny: bool, limit: float) -> None:
    for name, config in mla_configs(tiny).items():
        if device == "cuda":
            with results.guarded("mla_sdpa", f"{name}: backend and saved tensors"):
                compare_sdpa(results, name, config, device)
        else:
            q_dim = config.qk_head_dim + config.qk_pos_emb_head_dim
            with FakeTensorMode():
                q = torch.empty(config.micro_batch_size, config.num_attention_heads, config.seq_length, q_dim,
                                dtype=torch.bfloat16)
                v = torch.empty(*q.shape[:3], config.v_head_dim, dtype=torch.bfloat16)
                mask = torch.ones(1, 1, config.seq_length, config.seq_length, dtype=torch.bool)
                ours = select_backend(q, q, v, mask)
            results.add("SKIP", "mla_sdpa", f"{name}: backend and saved tensors",
                        f"no CUDA: remat's CUDA profile would run {ours}; PyTorch's choice needs a GPU")
        for policy in ("none", "selective/mla_up_proj"):
            with results.guarded("mla_sdpa", f"{name} {policy}"):
                compare_peaks(results, "mla_sdpa", f"{name} {policy}", predicted_step(config, policy, device),
                              measured_step(config, policy, device), limit)


# ------------------------------------------------------------------------------------------------ (c) MoE
MOE_POLICIES = ("none", "selective/moe_act", "selective/moe", "selective/shared_experts",
                "selective/moe_act+shared_experts")


def check_moe(results: Results, device: str, tiny: bool, limit: float) -> None:
    for grouped, policies in ((True, MOE_POLICIES), (False, ("none", "selective/moe"))):
        config = moe_config(tiny, grouped)
        kind = "grouped" if grouped else "separate"
        peaks: dict[str, tuple[int, int]] = {}
        for policy in policies:
            with results.guarded("moe", f"{kind} experts {policy}"):
                predicted, measured = predicted_step(config, policy, device), measured_step(config, policy, device)
                compare_peaks(results, "moe", f"{kind} experts {policy}", predicted, measured, limit)
                peaks[policy] = (predicted.peak_bytes, measured["allocated"])
        for policy in [p for p in policies[1:] if p in peaks and "none" in peaks]:
            p_saved, m_saved = peaks["none"][0] - peaks[policy][0], peaks["none"][1] - peaks[policy][1]
            error = (p_saved - m_saved) / peaks["none"][1]
            results.compare("moe", f"{kind} experts {policy}: saved vs none", abs(error) <= limit,
                            f"predicted {mib(p_saved)}, measured {mib(m_saved)} ({100 * error:+.2f}% of the peak)")
    # real routing on the device, predicted again from the counts it reports
    config = moe_config(tiny, True, routing=None)
    for policy in ("none", "selective/moe_act"):
        with results.guarded("moe", f"real routing {policy}"):
            measured = measured_step(config, policy, device)
            report = measured["timeline"].meta.get("moe_routing") or {}
            counts = report.get("tokens_per_expert", {})
            text = "counts:" + ";".join(",".join(map(str, counts[k])) for k in sorted(counts, key=int))
            predicted = predicted_step(config.replace(moe_routing_assumption=text), policy, device)
            compare_peaks(results, "moe", f"real routing {policy} ({report.get('assumption')}: {text})", predicted,
                          measured, limit)


def run_checks(checks: list[str], device: str, tiny: bool, limit: float) -> Results:
    """Run the named checks (:data:`CHECKS`) and return their lines."""
    results = Results()
    for check, fn in (("offload", check_offload), ("mla_sdpa", check_mla_sdpa), ("moe", check_moe)):
        if check in checks:
            started = time.perf_counter()
            print(f"\n[{check}]", flush=True)
            fn(results, device, tiny, limit)
            print(f"  ({time.perf_counter() - started:.0f} s)", flush=True)
    return results


def skip_all(checks: list[str], reason: str) -> Results:
    """A SKIP line per check (no CUDA device)."""
    results = Results()
    for check in checks:
        results.add("SKIP", check, "all comparisons", reason)
    return results


__all__ = ["CHECKS", "Results", "run_checks", "skip_all"]
