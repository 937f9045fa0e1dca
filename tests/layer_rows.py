"""What a layer keeps from its forward to its backward, read off a timeline (``from layer_rows import kept_by_layer``:
pytest puts tests/ on the import path through tests/conftest.py)."""

from __future__ import annotations

from collections import Counter

from remat.timeline import Timeline


def kept_by_layer(tl: Timeline, region: str = "layer 1") -> Counter[int]:
    """The bytes of each tensor the ``region``'s forward makes and its backward frees."""
    kept: Counter[int] = Counter()
    for row in range(len(tl)):
        made, free = tl.phases[tl.phase_index[row]], tl.free_at[row]
        if (made.kind, made.region) == ("forward", region) and free >= 0 and \
                (tl.phase_at(free).kind, tl.phase_at(free).region) == ("backward", region):
            kept[tl.nbytes[row]] += 1
    return kept
