"""Tests for remat.parallel.chunk_compose: a deep pipeline chunk's trace laid out from a shallow chunk's equals the
full trace of the deep chunk, event for event and byte for byte, segments included (NOTE [composing a chunk
trace]). Small models, one case per test; the cases cross chunk kinds, styles, policies, plans, the batch made in
the forward, tensor/sequence parallelism and a stack that mixes dense and MoE layers."""

from __future__ import annotations

import gc

import pytest

from remat.config import ModelConfig
from remat.memory.compose import CompositionError
from remat.parallel.chunk_compose import microbatch_step
from remat.parallel.chunk_trace import ChunkTrace, trace_chunk
from remat.policy import Policy
from remat.recompute.plan_format import KEEP, Plan, Unit

GPT = ModelConfig(num_layers=12, hidden_size=32, num_attention_heads=4, seq_length=16, micro_batch_size=2,
                  vocab_size=64, attention="sdpa")
LLAMA = GPT.replace(num_query_groups=2, activation="swiglu", normalization="rmsnorm", position="rope",
                    hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False)
MOE = LLAMA.replace(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_grouped_gemm=True,
                    moe_layer_freq=(0, 0) + (1,) * 10)
PLAN = Plan.from_units([Unit("checkpoint", 4), KEEP, KEEP, Unit("selective", 1, ("core_attn",)),
                        Unit("selective", 1, ("core_attn",)), Unit("checkpoint", 2)])

# (config, chunk kind, layout, batch made in the forward, tp, sp[, kernels, grads dropped as accumulated])
CASES = [
    ("gpt", (False, False, 9), "none", False, 1, False),
    ("gpt", (True, False, 8), "full/uniform/1", True, 1, False),
    ("gpt", (False, True, 10), "full/uniform/3", True, 1, False),
    ("gpt", (True, True, 9), "full/block/2", False, 1, False),
    ("gpt", (False, False, 9), "selective/core_attn+mlp", False, 2, True),
    ("llama", (False, False, 10), "full/uniform/4", False, 1, False),
    ("llama", (True, False, 8), "full/uniform/2@non-reentrant", True, 1, False),
    ("llama", (True, False, 8), "full/uniform/2", True, 2, True),
    ("llama", (False, True, 9), "selective/layernorm", True, 1, False),
    ("llama", (True, True, 10), "selective/non_matmul", True, 1, False),
    ("llama", (False, False, 10), "plan", False, 1, False),
    ("llama", (False, True, 10), "plan", True, 2, True),
    ("moe", (False, False, 10), "selective/moe_act", False, 1, False),
    ("moe", (True, True, 9), "full/uniform/2", True, 1, False),
    # as a Megatron job's ranks are traced (remat.parallel.job_predict): CUDA kernels, DDP's hook drops each .grad
    ("llama", (True, False, 10), "full/block/4", True, 2, True, "cuda", True),
    ("llama", (False, False, 10), "plan", False, 2, True, "cuda", True),
    ("gpt", (False, True, 9), "selective/core_attn", True, 1, False, "cuda", True),
]
CONFIGS = {"gpt": GPT, "llama": LLAMA, "moe": MOE}


@pytest.fixture(scope="module", autouse=True)
def _frozen_gc():
    gc.freeze()
    yield
    gc.unfreeze()


def assert_same_chunk(composed: ChunkTrace, full: ChunkTrace) -> None:
    a, b = composed.timeline, full.timeline
    assert a.num_events == b.num_events
    for name in ("nbytes", "alloc_at", "free_at", "category", "module", "phase_index", "phases"):
        assert getattr(a, name) == getattr(b, name), name
    assert a.meta["phase_flops"] == b.meta["phase_flops"]
    for name in ("params", "forward", "backward_first", "backward_next", "input_bytes", "input_category",
                 "output_bytes", "bounds", "kept_rows", "batch_in_forward"):
        assert getattr(composed, name) == getattr(full, name), name


def case_id(case: tuple) -> str:
    name, kind, layout, in_forward, tp, sp, *rest = case
    return f"{name}-{kind}-{layout}-bif{int(in_forward)}-tp{tp}{'sp' if sp else ''}" + "".join(f"-{r}" for r in rest)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_composed_chunk_equals_full_trace(case: tuple) -> None:
    name, kind, layout, in_forward, tp, sp, *rest = case
    config = CONFIGS[name]
    recompute = PLAN if layout == "plan" else Policy.parse(layout)
    options = dict(zip(("kernels", "drop_grads"), rest))
    composed = trace_chunk(config, kind, recompute, "cpu", tp, sp, batch_in_forward=in_forward, **options)
    assert composed.composed_from is not None and composed.composed_from < kind[2], composed.composed_from
    full = trace_chunk(config, kind, recompute, "cpu", tp, sp, batch_in_forward=in_forward, compose_layers=False,
                       **options)
    assert full.composed_from is None
    assert_same_chunk(composed, full)


def test_offloading_and_shallow_chunks_are_traced_whole() -> None:
    offload = Plan.from_units([Unit("offload", 2), KEEP, KEEP, KEEP, KEEP, KEEP])
    assert trace_chunk(GPT, (False, False, 7), offload).composed_from is None
    assert trace_chunk(GPT, (False, False, 2), "none").composed_from is None  # no shallower stand-in


def test_a_step_cut_where_no_phase_starts_is_refused() -> None:
    trace = trace_chunk(GPT, (False, False, 2), "none")
    bounds = list(trace.bounds)
    bounds[1] -= 1  # the first forward's end moved inside it
    with pytest.raises(CompositionError, match="do not start a phase"):
        microbatch_step(trace.timeline, bounds, 1, {})
