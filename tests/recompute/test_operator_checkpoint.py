"""Tests for remat.recompute.operator_checkpoint, the engine of non_matmul and keep_ops layers: the same tensors alive
at every moment as torch's selective activation checkpointing with the same policy, gradients equal to the plain
model's bit for bit (dropout on), predicted peaks equal to measured ones, and errors that name the layer and the fix."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

from remat.config import ModelConfig
from remat.memory.measure import measure
from remat.memory.predict import trace
from remat.models.gpt import build_model, sample_batch
from remat.plan.operator_space import layer_operators
from remat.recompute.apply import apply
from remat.recompute.operator_checkpoint import (
    OperatorCheckpointError,
    checkpoint_kept_operators,
    checkpoint_operators,
)
from remat.recompute.operators import MATMUL_OPS, MATMUL_OVERLOADS
from remat.recompute.plan_format import Plan, Unit, keep_ops_token

SMALL = ModelConfig(num_layers=3, hidden_size=64, num_attention_heads=4, seq_length=32, micro_batch_size=2,
                    vocab_size=96, hidden_dropout=0.1, attention_dropout=0.1)
LLAMA = SMALL.replace(activation="swiglu", normalization="rmsnorm", position="rope", num_query_groups=2,
                      attention="sdpa", dtype="bf16")


def torch_selective(model: nn.Module, kept: frozenset[int] | None = None) -> nn.Module:
    """Each layer of the reference GPT under torch's own selective activation checkpointing, keeping what a
    non_matmul layer keeps (the outputs of MATMUL_OPS), or with ``kept`` what a keep_ops(kept) layer keeps (operator
    i by index, as remat's plans did before keep_ops moved to remat's engine)."""
    def policy(ctx, func, *args, **kwargs):
        keep = func.overloadpacket in MATMUL_OPS
        return torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE if keep else \
            torch.utils.checkpoint.CheckpointPolicy.PREFER_RECOMPUTE

    def by_index():
        seen = [0]

        def keep_index(ctx, func, *args, **kwargs):
            seen[0] += 1
            return torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE if seen[0] - 1 in kept else \
                torch.utils.checkpoint.CheckpointPolicy.PREFER_RECOMPUTE
        return torch.utils.checkpoint.create_selective_checkpoint_contexts(keep_index, allow_cache_entry_mutation=True)

    def checkpointed(forward, *args):
        return torch.utils.checkpoint.checkpoint(
            forward, *args, use_reentrant=False, preserve_rng_state=True,
            context_fn=by_index if kept is not None else
            functools.partial(torch.utils.checkpoint.create_selective_checkpoint_contexts, policy))

    for layer in model.layers:
        layer.__dict__["forward"] = functools.partial(checkpointed, layer.forward)
    return model


def allocations(model: nn.Module, config: ModelConfig) -> tuple[int, list[tuple[int, int, int]]]:
    torch.manual_seed(0)
    tl = measure(model, sample_batch(config, seed=1))
    return tl.peak_bytes, list(zip(tl.nbytes, tl.alloc_at, tl.free_at))


@pytest.mark.parametrize("config", [SMALL, LLAMA], ids=["gpt", "llama-bf16"])
def test_same_allocations_as_torch_selective_checkpointing(config: ModelConfig) -> None:
    """Every storage allocated and freed in the step, in order, with its size: the same as under torch's selective
    activation checkpointing with the same policy (so measured and predicted bytes do not change)."""
    ours = build_model(config, seed=0)
    apply(ours, "selective/non_matmul")
    theirs = torch_selective(build_model(config, seed=0))
    peak, rows = allocations(ours, config)
    assert (peak, rows) == allocations(theirs, config)
    plain_peak, _ = allocations(build_model(config, seed=0), config)
    assert peak < plain_peak


def test_candidates_are_every_overload_of_the_matmul_operators() -> None:
    assert {f.overloadpacket for f in MATMUL_OVERLOADS} == set(MATMUL_OPS)
    assert torch.ops.aten.addmm.default in MATMUL_OVERLOADS and torch.ops.aten.mm.out in MATMUL_OVERLOADS
    assert torch.ops.aten.add.Tensor not in MATMUL_OVERLOADS


class Net(nn.Module):
    """x -> (x @ w1) -> gelu -> dropout -> (@ w2): two kept matmuls with non-matmul operators around them."""

    def __init__(self, scale_in_place: bool = False):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(8, 16))
        self.w2 = nn.Parameter(torch.randn(16, 4))
        self.scale_in_place = scale_in_place
        self.branch = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.w1
        if self.scale_in_place:
            h.mul_(0.5)  # modifies a kept output
        h = torch.nn.functional.dropout(torch.nn.functional.gelu(h), p=0.3)
        return (h @ self.w2 if self.branch else h[:, :4] * 2).sin()


def run(net: Net, x: torch.Tensor) -> torch.Tensor:
    return checkpoint_operators(net, [x], lambda func, args: True, MATMUL_OVERLOADS, "net")


def test_gradients_equal_the_plain_run_bit_for_bit() -> None:
    net, x = Net(), torch.randn(5, 8, requires_grad=True)
    grads = []
    for forward in (net, functools.partial(run, net)):
        torch.manual_seed(3)
        forward(x).sum().backward()
        grads.append([t.grad.clone() for t in (x, net.w1, net.w2)])
        for t in (x, net.w1, net.w2):
            t.grad = None
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_the_recomputation_runs_under_the_forward_autocast() -> None:
    """A forward under CPU autocast (bf16 matmuls) and a backward outside it: the recomputed operators run in the
    forward's dtypes, so the gradients still equal the plain run's bit for bit."""
    net, x = Net(), torch.randn(5, 8, requires_grad=True)
    grads = []
    for forward in (net, functools.partial(run, net)):
        torch.manual_seed(3)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = forward(x)
        out.float().sum().backward()
        grads.append([t.grad.clone() for t in (x, net.w1, net.w2)])
        for t in (x, net.w1, net.w2):
            t.grad = None
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_a_second_backward_is_refused_with_the_fix() -> None:
    net, x = Net(), torch.randn(5, 8, requires_grad=True)
    loss = run(net, x).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(OperatorCheckpointError, match="net: .*second time.*backpropagated once.*full recompute"):
        loss.backward()


def test_a_kept_output_modified_in_place_is_refused() -> None:
    net, x = Net(scale_in_place=True), torch.randn(5, 8, requires_grad=True)
    loss = run(net, x).sum()
    with pytest.raises(OperatorCheckpointError, match="net: the output of aten.mm.default.*modified in place.*full "
                                                      "recompute"):
        loss.backward()


def test_a_recomputation_that_runs_other_operators_is_refused() -> None:
    net, x = Net(), torch.randn(5, 8, requires_grad=True)
    loss = run(net, x).sum()
    net.branch = False  # the recomputation skips the second matmul
    with pytest.raises(OperatorCheckpointError, match="net: the recomputation saved .* tensors .* where the forward "
                                                      "saved .*use full recompute"):
        loss.backward()


def test_nothing_is_kept_without_grad() -> None:
    net, x = Net(), torch.randn(5, 8)
    with torch.no_grad():
        out = run(net, x)
    assert out.grad_fn is None


# ------------------------------------------------------------------------------------------------ keep_ops
def plain_grads(model: nn.Module, config: ModelConfig) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    model(*sample_batch(config, seed=1)).backward()
    return [p.grad for p in model.parameters()]


def in_use_at_allocations(rows: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """(bytes allocated, bytes in use just after) at every allocation, in order: where a peak can be."""
    return [(n, sum(m for m, a, f in rows if a <= at and (f < 0 or f > at))) for n, at, _ in rows]


def test_keep_ops_same_allocations_as_torch_selective_checkpointing_and_exact() -> None:
    """keep_ops layers on remat's engine (every keepable operator; only the last dropout mask, a kept draw after
    recomputed ones; nothing): the allocations of torch's selective checkpointing with the same policy, each with the
    bytes in use after it (keeping everything, two frees of equal size, and the frees of kept outputs no backward
    used when the graph goes, come in another order), the predicted peak (fake-tensor trace) equal to the measured
    one, and the plain model's gradients bit for bit with dropout on."""
    config = SMALL.replace(num_layers=2)
    ops = layer_operators(config)
    last_mask = [op.index for op in ops if op.item == max(o.item for o in ops if o.random)]
    plain = plain_grads(build_model(config, seed=0), config)
    for kept in ([op.index for op in ops if op.item >= 0], last_mask, []):
        plan = Plan.from_units([Unit("selective", 1, (keep_ops_token(kept),))] * config.num_layers)
        ours = build_model(config, seed=0)
        apply(ours, plan)
        peak, rows = allocations(ours, config)
        torch_peak, torch_rows = allocations(torch_selective(build_model(config, seed=0), frozenset(kept)), config)
        assert peak == torch_peak and in_use_at_allocations(rows) == in_use_at_allocations(torch_rows), kept
        assert peak == trace(config, plan).peak_bytes, kept
        assert all(torch.equal(a, b) for a, b in zip(plain_grads(ours, config), plain)), kept


def test_keep_ops_in_place_chains_give_the_plain_gradients() -> None:
    """Net's operators: mm 0, mul_ 1, gelu 2, empty_like 3, bernoulli_ 4, div_ 5, mul 6, mm 7, sin 8. A kept
    matmul output scaled in place by a kept mul_ and a kept dropout mask (empty_like, bernoulli_, div_) come back
    from the recomputation as the forward left them."""
    net, x = Net(scale_in_place=True), torch.randn(5, 8, requires_grad=True)
    grads = []
    for kept in (None, frozenset({0, 1, 3, 4, 5, 7}), frozenset({3, 4, 5}), frozenset()):
        torch.manual_seed(3)
        (net(x) if kept is None else checkpoint_kept_operators(net, [x], kept, "net")).sum().backward()
        grads.append([t.grad.clone() for t in (x, net.w1, net.w2)])
        for t in (x, net.w1, net.w2):
            t.grad = None
    assert all(torch.equal(a, b) for g in grads[1:] for a, b in zip(grads[0], g))


@pytest.mark.parametrize("kept, message", [
    ({0}, r"net: operator 1 \(aten.mul_.Tensor\) mutates the output of a kept operator in place: keep operator 1 "
          r"too \(keep_ops\)"),
    ({4, 5}, r"net: operator 4 \(aten.bernoulli_.float\) is kept but changes in place a tensor no kept operator "
             r"made: keep the operator that made it too, or drop operator 4"),
])
def test_keep_ops_refuses_what_the_recomputation_cannot_replay(kept: set[int], message: str) -> None:
    net, x = Net(scale_in_place=True), torch.randn(5, 8, requires_grad=True)
    with pytest.raises(OperatorCheckpointError, match=message):
        checkpoint_kept_operators(net, [x], frozenset(kept), "net")
