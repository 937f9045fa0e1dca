"""Timing machinery of bench_step_time.py: interleaved rounds of step variants (forward + loss + backward), medians,
per-round ratios with bootstrap intervals, and PASS / FAIL? / FAIL verdicts (see that script's docstring)."""

from __future__ import annotations

import gc
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


# ------------------------------------------------------------------------------------------ timing helpers
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def quartiles(xs: list[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return (xs[0], xs[0]) if xs else (float("nan"), float("nan"))
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def spread(xs: list[float]) -> float:
    """Interquartile range relative to the median (a noise gauge)."""
    lo, hi = quartiles(xs)
    m = median(xs)
    return (hi - lo) / m if m else float("nan")


def bootstrap_ci(xs: list[float], n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval of the median of xs (nan below 5 samples: too few to say anything)."""
    if len(xs) < 5:
        return float("nan"), float("nan")
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


def paired_ratio(new: list[float], base: list[float]) -> str:
    """``new/base M (L-H)``: the median of the per-round ratios of two timings run side by side, with its 95%
    bootstrap interval."""
    ratios = [n / b for n, b in zip(new, base)]
    low, high = bootstrap_ci(ratios)
    return f"new/base {median(ratios):.3f} ({low:.3f}-{high:.3f})"


def verdict(ratio: float, ci: tuple[float, float], limit: float) -> str:
    """PASS: the median ratio is within the limit; FAIL: even the low end of its 95% interval is over it;
    FAIL?: over the limit, but not beyond the noise."""
    if ratio <= limit:
        return "PASS"
    return "FAIL" if ci[0] > limit else "FAIL?"


def overall(verdicts: list[str]) -> str:
    if all(v == "PASS" for v in verdicts):
        return "PASS"
    return "FAIL" if "FAIL" in verdicts else "FAIL? (over the limit within the noise: rerun on a quieter machine)"


@dataclass
class Variant:
    """One way of running the step; ``setup`` prepares the model and returns the forward to time."""

    name: str
    setup: Callable[[], Forward]
    teardown: Callable[[], None] = lambda: None
    forward_times: list[float] = field(default_factory=list)
    backward_times: list[float] = field(default_factory=list)
    cpu_times: list[float] = field(default_factory=list)  # process CPU seconds of the whole step

    @property
    def step_times(self) -> list[float]:
        return [f + b for f, b in zip(self.forward_times, self.backward_times)]


class Bench:
    def __init__(self, model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor, device: torch.device,
                 seed: int):
        self.model, self.tokens, self.labels, self.device, self.seed = model, tokens, labels, device, seed

    def step(self, forward: Forward) -> tuple[float, float, float]:
        """One forward + loss + backward; returns (forward seconds, backward seconds, process CPU seconds)."""
        self.model.zero_grad(set_to_none=True)
        gc.collect()
        torch.manual_seed(self.seed)  # the same dropout masks for every variant
        sync(self.device)
        c0 = time.process_time()
        t0 = time.perf_counter()
        loss = forward(self.tokens, self.labels)
        sync(self.device)
        t1 = time.perf_counter()
        loss.backward()
        sync(self.device)
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1, time.process_time() - c0

    def run_variant(self, v: Variant, record: bool) -> None:
        forward = v.setup()
        try:
            f, b, c = self.step(forward)
        finally:
            v.teardown()
        if record:
            v.forward_times.append(f)
            v.backward_times.append(b)
            v.cpu_times.append(c)

    def rounds(self, schedule: Callable[[random.Random], list[Variant]], repeats: int, warmup: int,
               max_seconds: float, label: str, rng: random.Random) -> int:
        """Run ``warmup`` unrecorded then up to ``repeats`` recorded rounds, but (after 3) none that would end
        past ``max_seconds``, judging by the rounds so far."""
        gc.collect()
        gc.freeze()  # long-lived objects out of the collector's way: the per-step gc.collect() is then ~10 us
        gc.disable()
        try:
            for _ in range(warmup):
                for v in schedule(rng):
                    self.run_variant(v, record=False)
            start = time.perf_counter()
            done = 0
            for r in range(repeats):
                for v in schedule(rng):
                    self.run_variant(v, record=True)
                done = r + 1
                elapsed = time.perf_counter() - start
                print(f"\r  {label}: round {done}/{repeats}  {elapsed:5.0f} s", end="", file=sys.stderr,
                      flush=True)
                if done >= 3 and elapsed * (done + 1) / done > max_seconds:
                    break
            print(file=sys.stderr)
            return done
        finally:
            gc.enable()
            gc.unfreeze()
