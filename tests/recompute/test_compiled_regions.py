"""remat.apply then torch.compile (NOTE [regions under torch.compile] in remat.recompute.region): groups, selective
modules and non_matmul layers compile without a graph break as torch's checkpoint (the partitioner recomputes them),
keep_ops layers and non_matmul layers with core_attn/mlp run eagerly on remat's engine, and gradients equal the
compiled plain model's (and the eager one's) bit for bit, dropout on."""

from __future__ import annotations

from typing import Any

import torch
import torch._dynamo
from torch._dynamo.backends.debugging import aot_eager, boxed_nop
from torch._dynamo.utils import counters

from remat.config import ModelConfig
from remat.models.gpt import build_model, sample_batch
from remat.recompute.apply import apply
from remat.recompute.plan_format import Plan

TINY = ModelConfig(num_layers=3, hidden_size=32, num_attention_heads=4, seq_length=16, micro_batch_size=2,
                   vocab_size=64, hidden_dropout=0.1, attention_dropout=0.1)
MATMULS = {"mm", "addmm", "bmm", "baddbmm"}


def matmul_counting_backend(counts: dict[str, int]) -> Any:
    """aot_eager that counts the matrix multiplies of the forward and backward graphs it compiles."""
    def counting(kind: str) -> Any:
        def compiler(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
            counts[kind] = counts.get(kind, 0) + sum(
                1 for n in gm.graph.nodes if n.op == "call_function"
                and getattr(getattr(n.target, "overloadpacket", None), "__name__", None) in MATMULS)
            return boxed_nop(gm, example_inputs)
        return compiler

    return lambda gm, inputs, **kw: aot_eager(gm, inputs, fw_compiler=counting("fw"), bw_compiler=counting("bw"),
                                              **kw)


def compiled_step(plan: str | None, config: ModelConfig = TINY) -> tuple[list[torch.Tensor], int, dict[str, int]]:
    """(gradients, graph breaks, matmuls of the forward and backward graphs) of one compiled step of ``config``
    under ``plan``."""
    model = build_model(config, seed=0)
    if plan is not None:
        apply(model, Plan.parse(plan))
    counts: dict[str, int] = {}
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend=matmul_counting_backend(counts))
    torch.manual_seed(7)
    compiled(*sample_batch(config, seed=1)).backward()
    return [p.grad for p in model.parameters()], sum(counters["graph_break"].values()), counts


def eager_grads(config: ModelConfig = TINY) -> list[torch.Tensor]:
    model = build_model(config, seed=0)
    torch.manual_seed(7)
    model(*sample_batch(config, seed=1)).backward()
    return [p.grad for p in model.parameters()]


def test_compiled_plan_recomputes_in_the_graph_with_the_plain_gradients() -> None:
    """A one-layer group, a non_matmul+matmul_k32 layer and an mlp layer: no graph break; the backward graph runs
    recomputed matrix multiplies (the plain one has exactly two per forward matmul: the gradients of its two
    inputs); gradients equal the compiled plain model's and the eager one's bit for bit."""
    plain, plain_breaks, plain_mm = compiled_step(None)
    grads, breaks, mm = compiled_step("checkpoint 0/1, selective/non_matmul+matmul_k32 1, selective/mlp 2")
    assert plain_breaks == 0 and breaks == 0
    assert plain_mm["bw"] == 2 * plain_mm["fw"] and mm["fw"] == plain_mm["fw"]
    assert mm["bw"] - plain_mm["bw"] >= 6 + 3  # layer 0 (6 matmuls but fc2's output) + layer 1 + layer 2's fc1
    assert all(torch.equal(a, b) for a, b in zip(grads, plain))
    assert all(torch.equal(a, b) for a, b in zip(plain, eager_grads()))


def test_keep_ops_and_non_matmul_with_modules_run_eagerly_under_compile() -> None:
    """Their rules count an eager forward's operators / follow module hooks: the layers run on remat's engine, as a
    graph break each, with the plain gradients."""
    config = TINY.replace(num_layers=2)
    grads, breaks, _ = compiled_step("selective/keep_ops(3,19) 0, selective/core_attn+mlp+non_matmul 1", config)
    assert breaks >= 2
    assert all(torch.equal(a, b) for a, b in zip(grads, eager_grads(config)))
