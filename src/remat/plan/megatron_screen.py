"""The Megatron screen of a whole-job stage: the cheapest of a cost-ordered list of settings whose exact prediction
fits, with the unit model's estimate used only as a lower bound to skip settings that cannot fit.

NOTE [the Megatron screen of a stage]: the candidates come in the plan's cost order (cheapest first). Each has its
modelled peak (unit model + microbatches in flight); the stage's calibration offset (exact - modelled peak of
"nothing recomputed") makes it the estimate. Beside what the rank holds, the unit model of one process holds
bytes that the rank does not (each layer's bf16 .grad once its backward has begun, until the end of the step,
where the rank's DDP hook moves it to the main-gradient buffer; the side inputs: NOTE [the unit model]): at any
moment of the step, modelled live bytes = shared + g, and the rank's = shared + c, c one constant of the stage (what
the unit model leaves out: the model state, the rest of the rank; the premise). At the modelled peak, g is at most
the candidate's ``held`` bytes (UnitModel.beyond_rank: the .grad of the layers whose backward has begun there,
and the side inputs), and never more than ``slack`` (every layer's .grad and the side inputs). So a candidate's
exact peak is >= the rank's bytes at that moment = modelled - g + c >= modelled + (largest exact - modelled seen,
the calibration offset among them, each <= c) - held: a lower bound of it; a candidate above the budget by it
cannot fit and is skipped without predicting it. The others are predicted exactly, in cost order, until the first
that fits: the cheapest that fits. Should a prediction come out under its bound (the premise broken), the screen
runs again with the calibration offset alone (not raised by what was seen) and the whole ``slack``. Checked against
every setting's exact peak on a 70B stage stack (tp=8, sp, pp=4: 192 settings, the bound 66 MiB to 5 GiB under
the exact peak) and a small tp=2 job (tests/plan/test_job_plan.py).
The search is capped by time, not by count (``seconds``, after at least one prediction): when the cap cuts it the
answer says so (``cut``), and the setting chosen after it may not be the cheapest that fits.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from remat.cache_state import not_repeatable

SCREEN_SECONDS = 120.0  # exact predictions per stage stop after this long (at least one is made)


@dataclass
class Screen:
    """What :func:`cheapest_fit` found."""

    chosen: int | None  # the index of the cheapest candidate whose exact peak fits; None: none (or the cap cut it)
    peaks: dict[int, int] = field(default_factory=dict)  # candidate index -> exact peak, in the order predicted
    cut: bool = False  # the time cap stopped the search before it found a fit or ran out of candidates
    skipped: int = 0  # candidates the lower bound ruled out without an exact prediction
    bound_broken: bool = False  # an exact peak came out under its bound: screened again without raising the offset


def cheapest_fit(modelled: Sequence[int], offset: int, slack: int, budget: int, predict: Callable[[int], int],
                 seconds: float | None = None, held: Sequence[int] | None = None) -> Screen:
    """The first (cheapest) of ``modelled``'s candidates whose exact peak ``predict(i)`` is <= ``budget``
    (NOTE [the Megatron screen of a stage]).

    Args:
        modelled: each candidate's modelled peak (bytes, without the calibration offset), cheapest candidate first.
        offset: the stage's calibration offset (exact - modelled peak of a predicted plan).
        slack: the most bytes the model may hold beyond the rank at any point (>= 0).
        budget: bytes.
        predict: the exact peak of candidate ``i`` (called once per candidate; the caller may cache it).
        seconds: no further prediction starts after this long (the first one always does); None:
            :data:`SCREEN_SECONDS` as it is at the call.
        held: per candidate, the most bytes its modelled peak holds beyond the rank (<= ``slack``); None: ``slack``
            for every one.
    """
    started = time.perf_counter()
    seconds = SCREEN_SECONDS if seconds is None else seconds
    peaks: dict[int, int] = {}

    def run(raise_offset: bool) -> Screen:
        seen, skipped = offset, 0
        for i, m in enumerate(modelled):
            bound = m + seen - (held[i] if held is not None and raise_offset else slack)
            if bound > budget:
                skipped += 1
                continue
            if peaks and i not in peaks and time.perf_counter() - started > seconds:
                not_repeatable()  # the answer depends on this machine's speed: not stored as the command's
                return Screen(None, peaks, True, skipped)
            if i not in peaks:
                peaks[i] = predict(i)
            if raise_offset and peaks[i] < bound:
                return Screen(None, peaks, False, skipped, bound_broken=True)
            if peaks[i] <= budget:
                return Screen(i, peaks, False, skipped)
            if raise_offset:
                seen = max(seen, peaks[i] - m)
        return Screen(None, peaks, False, skipped)

    found = run(True)
    if found.bound_broken:
        found = run(False)
        found.bound_broken = True
    return found
