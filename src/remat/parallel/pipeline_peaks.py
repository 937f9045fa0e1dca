"""Per-stage peaks of a pipeline step of any length, at a cost that does not grow with the microbatch count."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from remat.config import ModelConfig
from remat.parallel.pipeline_predict import MAX_COMPOSED_MICROBATCHES, predict_stage
from remat.parallel.pipeline_report import stage_summary
from remat.parallel.schedule import (
    PipelineError,
    check_partial,
    check_policy_fits,
    check_schedule,
    partition,
    warmup_forwards,
)
from remat.policy import Policy
from remat.units import CUDA_BLOCK, format_bytes, format_mib

# Up to this many microbatches a stage is composed in full; past it, its peak is extended from three shorter steps.
EXACT_MICROBATCHES = 64
# The numbers a stage summary extends (the rest is text built from them).
_EXTENDED = ("peak_bytes", "max_in_flight", "in_flight_at_peak", "saved_bytes_at_peak", "kept_bytes_at_peak")

# NOTE [Periodic pipeline steps]
# Past its warm-up a stage repeats itself: 1F1B runs one forward and one backward per microbatch, GPipe one forward
# then (later) one backward, interleaved 1F1B the same per group of pp microbatches; Megatron's partial
# checkpointing repeats every window of forwards. So a step of m + P microbatches (P: the stage's period) is the
# step of m with one more period of the same events (microbatch numbers shifted), and what grows with m grows by
# the same bytes per period: torch.distributed.pipelining's receive buffers (one per microbatch, kept), the whole
# batch of token ids, the losses kept to the end, GPipe's in-flight activations. Each stage's peak, and what is in
# flight there, is then an affine function of m on m = m0 (mod P) once m0 is past the warm-up. stage_peaks
# composes the stage at m0, m0 + P and m0 + 2P, checks that the three summaries lie on a line (else it refuses),
# and extends that line to m. tests/parallel/test_pipeline_peaks.py compares the extension with the full
# composition for every schedule and runtime.


def stage_period(schedule: str, pp: int, vpp: int, rank: int, partial: int | None, runtime: str,
                 config: ModelConfig, device: str) -> int:
    """Microbatches after which stage ``rank``'s step repeats (see NOTE [Periodic pipeline steps])."""
    period = pp if schedule == "interleaved" else 1  # interleaved runs microbatches in groups of pp
    if partial is not None:  # forward k runs the policy iff k % window >= partial; k counts virtual forwards
        window = warmup_forwards(schedule, pp, pp << 10, vpp, rank, "megatron") + 1  # past any warm-up
        per_microbatch = vpp if schedule == "interleaved" else 1
        period = math.lcm(period, window // math.gcd(window, per_microbatch * period) * period)
    if device == "cuda" and runtime == "torch":  # the whole batch of token ids is one storage in 512-byte blocks
        token_bytes = config.micro_batch_size * config.seq_length * 8
        period = math.lcm(period, CUDA_BLOCK // math.gcd(CUDA_BLOCK, token_bytes))
    return period


def stage_peaks(config: ModelConfig, policy: Policy | str, pp: int, microbatches: int, schedule: str = "1f1b",
                vpp: int = 1, layout: Sequence[int] | None = None, partial_checkpoint_microbatches: int | None = None,
                *, runtime: str = "torch", device: str = "cpu") -> list[dict[str, Any]]:
    """Each stage's summary (:func:`~remat.parallel.pipeline_report.stage_summary`) of a predicted step, for any
    number of microbatches.

    Args:
        config, policy, pp, microbatches, schedule, vpp, layout, partial_checkpoint_microbatches, runtime, device:
            as for :func:`remat.parallel.pipeline_predict.predict_pipeline`.

    Returns:
        One dict per stage: ``stage``, ``policy``, ``schedule``, ``microbatches``, ``peak_bytes``, ``peak_phase``,
        ``max_in_flight``, ``in_flight_at_peak``, ``saved_bytes_at_peak``, ``kept_bytes_at_peak``, ``why``. Up to
        :data:`EXACT_MICROBATCHES` microbatches they summarise the composed timelines; past it they are extended
        from three shorter steps (see NOTE [Periodic pipeline steps]) and also hold ``extended_from``.

    Example::

        >>> rows = stage_peaks(ModelConfig(num_layers=4), "full/uniform/1", pp=2, microbatches=1_000_000)
        >>> rows[0]["in_flight_at_peak"]
        2
    """
    policy = Policy.parse(policy) if isinstance(policy, str) else policy
    schedule = check_schedule(schedule, pp, microbatches, vpp, runtime)
    partial = check_partial(partial_checkpoint_microbatches)
    specs = partition(config, pp, vpp, layout)
    check_policy_fits(policy, specs)

    def summaries(rank: int, m: int) -> dict[str, Any]:
        row = stage_summary(predict_stage(config, policy, specs, rank, pp, m, schedule, vpp, partial,
                                          runtime=runtime, device=device))
        row["policy"] = str(policy)
        return row

    out = []
    for rank in range(pp):
        period = stage_period(schedule, pp, vpp, rank, partial, runtime, config, device)
        start = 2 * pp * vpp + 2 * period  # past every warm-up (at most 2 pp + (vpp - 1) pp forwards)
        if microbatches <= max(EXACT_MICROBATCHES, start + 2 * period):
            out.append(summaries(rank, microbatches))
            continue
        m0 = start + (microbatches - start) % period
        points = [m0, m0 + period, m0 + 2 * period]
        if points[-1] > MAX_COMPOSED_MICROBATCHES:
            raise PipelineError(f"microbatches={microbatches}: stage {rank} repeats only every {period} microbatches, "
                                f"too long to extend from steps of at most {MAX_COMPOSED_MICROBATCHES}; use "
                                f"--microbatches <= {MAX_COMPOSED_MICROBATCHES}")
        out.append(_extend([summaries(rank, m) for m in points], points, microbatches, rank))
    return out


def _extend(rows: list[dict[str, Any]], points: list[int], m: int, rank: int) -> dict[str, Any]:
    """The summary at ``m`` on the line through three summaries at evenly spaced ``points``."""
    steps = (m - points[0]) // (points[1] - points[0])
    row = dict(rows[0], microbatches=m, extended_from=points)
    for key in _EXTENDED:
        a, b, c = (r[key] for r in rows)
        if c - b != b - a:
            raise PipelineError(f"microbatches={m}: stage {rank}'s {key} is not periodic in the microbatch count "
                                f"({a}, {b}, {c} at {points}); use --microbatches <= {MAX_COMPOSED_MICROBATCHES}")
        row[key] = a + steps * (b - a)
    row["peak_phase"] = _extend_label([r["peak_phase"] for r in rows], steps, m, rank)
    slope = rows[1]["peak_bytes"] - rows[0]["peak_bytes"]
    saved = format_mib(row["saved_bytes_at_peak"], 2)
    row["why"] = (
        f"Stage {rank} peaks at {format_mib(row['peak_bytes'], 2)} during {row['peak_phase']}, with "
        f"{row['in_flight_at_peak']} microbatch(es) in flight there holding {saved} of saved activations and "
        f"checkpoint inputs. Extended from the composed steps of "
        f"{', '.join(map(str, points))} microbatches: past the warm-up every {points[1] - points[0]} more "
        f"microbatch(es) repeat the same forwards and backwards and add {format_bytes(slope)} to this stage's peak.")
    return row


def _extend_label(labels: list[str], steps: int, m: int, rank: int) -> str:
    """A phase label whose numbers (layer, microbatch, chunk) move on the same line as the peak."""
    texts = [re.split(r"(\d+)", label) for label in labels]
    if any(len(t) != len(texts[0]) or t[0::2] != texts[0][0::2] for t in texts):
        raise PipelineError(f"microbatches={m}: stage {rank} peaks in different phases ({'; '.join(labels)}); use "
                            f"--microbatches <= {MAX_COMPOSED_MICROBATCHES}")
    out = list(texts[0])
    for i in range(1, len(out), 2):
        a, b, c = (int(t[i]) for t in texts)
        if c - b != b - a:
            raise PipelineError(f"microbatches={m}: stage {rank}'s peak moves irregularly ({'; '.join(labels)}); "
                                f"use --microbatches <= {MAX_COMPOSED_MICROBATCHES}")
        out[i] = str(a + steps * (b - a))
    return "".join(out)
