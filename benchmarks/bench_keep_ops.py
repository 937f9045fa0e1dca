#!/usr/bin/env python
"""What a ``selective/keep_ops(...)`` layer adds to a layer's step: remat's operator checkpoint against torch's
selective activation checkpointing with the same policy (how keep_ops layers ran before), side by side.

One layer of bench_plan's model (h=128, s=256, b=4 by default; dropout 0.1), forward + backward of the layer, one
thread, variants interleaved in a random order each round: the plain layer; for each kept set, the layer as a
keep_ops layer on remat's engine (``remat.apply``: :func:`remat.recompute.operator_checkpoint
.checkpoint_kept_operators`) and on torch's ``create_selective_checkpoint_contexts`` with the index policy remat
used before (the in-place and random-draw checks included). Kept sets: every operator a plan may keep ("all": what
is left is the dispatch cost plus the operators never kept: views and the layer's output), the planner's middle
kind, and nothing. Each extra is the median over rounds of (variant - plain of the same round), in process CPU
time (steadier than wall-clock time on a shared machine) and wall-clock time; ``torch/remat`` is the ratio of the
extras. Beside them, the forward time of the keepable operators the set recomputes, timed operator by operator
(``measure_layer_times``' ``op_<i>``: what the planner charges on top of ``sac_overhead``). Gradients of all three
are asserted equal bit for bit before timing.

Usage: ``python benchmarks/bench_keep_ops.py [--rounds 30] [--hidden 128]`` (about a minute).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spin-waiting OpenMP threads collapse on a shared machine

import argparse
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint as cp

from remat import ModelConfig, apply, build_model
from remat.plan.costs import CostModel, measure_layer_times
from remat.plan.operator_space import layer_operators, operator_kinds
from remat.recompute.plan_format import Plan, Unit, keep_ops_token, kept_operators


def torch_contexts(kept: frozenset[int]) -> Callable[[], Any]:
    """The selective-checkpoint contexts remat's keep_ops layers used before (torch's dispatch modes, this policy)."""
    def contexts() -> Any:
        decisions: list[cp.CheckpointPolicy] = []
        storages: set[int] = set()
        drawn = [-1]

        def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> cp.CheckpointPolicy:
            i = len(decisions)
            keep = i in kept
            if func._schema.is_mutable and args and isinstance(args[0], torch.Tensor):
                if args[0].untyped_storage()._cdata in storages and not keep:
                    raise ValueError(f"operator {i} mutates a kept output")
            if torch.Tag.nondeterministic_seeded in func.tags:
                if keep:
                    drawn[0] = i
                elif drawn[0] >= 0:
                    raise ValueError(f"operator {i} draws after a kept draw")
            if keep:
                for out in (ctx.op_output if isinstance(ctx.op_output, (tuple, list)) else (ctx.op_output,)):
                    if isinstance(out, torch.Tensor):
                        storages.add(out.untyped_storage()._cdata)
            decisions.append(cp.CheckpointPolicy.MUST_SAVE if keep else cp.CheckpointPolicy.PREFER_RECOMPUTE)
            return decisions[-1]

        return cp.create_selective_checkpoint_contexts(policy, allow_cache_entry_mutation=True)
    return contexts


def layers_for(cfg: ModelConfig, kept: frozenset[int]) -> tuple[torch.nn.Module, torch.nn.Module]:
    ours = build_model(cfg, seed=0)
    apply(ours, Plan.from_units([Unit("selective", 1, (keep_ops_token(kept),))]))
    theirs = build_model(cfg, seed=0).layers[0]
    forward = theirs.forward
    theirs.__dict__["forward"] = lambda *a: cp.checkpoint(forward, *a, use_reentrant=False,
                                                          context_fn=torch_contexts(kept))
    return ours.layers[0], theirs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = ModelConfig(num_layers=1, hidden_size=args.hidden, num_attention_heads=4, seq_length=args.seq,
                      micro_batch_size=args.batch, vocab_size=512)
    ops = layer_operators(cfg)
    kinds = operator_kinds(ops, CostModel("time").operator_price())
    sets = {"all": frozenset(op.index for op in ops if op.item >= 0),
            "middle": kept_operators(kinds[len(kinds) // 2]) or frozenset(), "none": frozenset()}
    b, s, h = cfg.micro_batch_size, cfg.seq_length, cfg.hidden_size
    hidden = torch.randn(b, s, h, requires_grad=True)
    mask = torch.ones(s, s, dtype=torch.bool).tril_().view(1, 1, s, s)
    rotary = build_model(cfg).rotary_tables(s, torch.device("cpu"))
    grad = torch.randn(b, s, h)
    variants: dict[str, torch.nn.Module] = {"plain": build_model(cfg, seed=0).layers[0]}
    for name, kept in sets.items():
        variants[f"{name}/remat"], variants[f"{name}/torch"] = layers_for(cfg, kept)

    def step(layer: torch.nn.Module) -> list[torch.Tensor]:
        layer.zero_grad(set_to_none=True)
        hidden.grad = None
        torch.manual_seed(0)
        layer(hidden, mask, rotary).backward(grad)
        return [hidden.grad, *(p.grad for p in layer.parameters())]

    plain = step(variants["plain"])
    for name, layer in variants.items():
        assert all(torch.equal(a, b) for a, b in zip(step(layer), plain)), f"{name}: gradients differ"
    times = measure_layer_times(cfg)  # op_<i>: what the planner charges for recomputing operator i
    recomputed = {name: sum(times.get(f"op_{i}", 0.0) for i in sets["all"] - kept) for name, kept in sets.items()}
    cpu: dict[str, list[float]] = {k: [] for k in variants}
    wall: dict[str, list[float]] = {k: [] for k in variants}
    rng = random.Random(0)
    for r in range(args.rounds + 1):
        order = list(variants)
        rng.shuffle(order)
        for name in order:
            c0, w0 = time.process_time(), time.perf_counter()
            step(variants[name])
            if r:  # round 0 warms up
                cpu[name].append(time.process_time() - c0)
                wall[name].append(time.perf_counter() - w0)

    def extra(times: dict[str, list[float]], name: str) -> float:
        return statistics.median(a - p for a, p in zip(times[name], times["plain"]))

    print(f"one layer h={h} s={s} b={b}, {len(ops)} operators ({len(sets['all'])} keepable), {args.rounds} rounds; "
          f"plain step {statistics.median(cpu['plain']) * 1e3:.2f} ms CPU, "
          f"{statistics.median(wall['plain']) * 1e3:.2f} ms wall; load {os.getloadavg()[0]:.1f}")
    print("| kept set | kept ops | recomputed ops' forward ms | remat extra CPU ms | torch extra CPU ms | "
          "torch/remat | remat wall ms | torch wall ms |")
    print("|---|---|---|---|---|---|---|---|")
    for name, kept in sets.items():
        ours, theirs = extra(cpu, f"{name}/remat"), extra(cpu, f"{name}/torch")
        print(f"| {name} | {len(kept)} | {recomputed[name] * 1e3:.2f} | {ours * 1e3:+.2f} | {theirs * 1e3:+.2f} | "
              f"{theirs / ours if ours > 0 else float('nan'):.2f} | {extra(wall, f'{name}/remat') * 1e3:+.2f} | "
              f"{extra(wall, f'{name}/torch') * 1e3:+.2f} |")


if __name__ == "__main__":
    main()
