"""The memory timeline of one training step (:class:`Timeline`): the data model that measure and predict both
return, every report reads, and that is saved as JSON."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from remat.files import write_atomic

# What the bytes alive at a moment are, in the order reports list them.
CATEGORIES = (
    "parameters",         # parameters and buffers
    "gradients",          # parameter gradients (.grad)
    "optimizer_state",    # made by optimizer.step()
    "group_inputs",       # tensors kept by checkpoints: a recomputed region's inputs
    "saved_activations",  # made in forward and kept for backward (regions not recomputed)
    "recompute",          # made while a region is recomputed in backward
    "head_loss",          # made by the final norm, output layer and loss, forward or backward (logits, their grads)
    "other",              # activation gradients and temporaries of backward, the batch, ...
)
PHASE_KINDS = ("setup", "forward", "backward", "recompute", "optimizer")
FORMAT_VERSION = 1


class TimelineError(ValueError):
    """A timeline file that cannot be read; the message names the field."""


@dataclass(frozen=True)
class Phase:
    """A span of events: from ``start`` until the next phase's start."""

    start: int
    kind: str       # one of PHASE_KINDS
    region: str     # "embedding", "layer 3", "head", "" (model code outside those)
    detail: str = ""  # e.g. the checkpoint group being recomputed

    @property
    def label(self) -> str:
        text = f"{self.kind} {self.region}".strip()
        return f"{text} [{self.detail}]" if self.detail else text


def _alive(alloc: np.ndarray, free: np.ndarray, event: int) -> np.ndarray:
    """The rows allocated at or before ``event`` and not freed by it."""
    return np.nonzero((alloc <= event) & ((free < 0) | (free > event)))[0]


@dataclass
class Timeline:
    """The memory of one training step: every allocation, when it was made and freed, and the phases of the step.

    A timeline is a table of *allocations*, one row per storage (the list fields below, all of the same length),
    plus the list of *phases* (forward of layer i, head, backward of layer i, recompute of a group, ...). Events
    are numbered 0, 1, 2, ...: every allocation and every free is one event. The bytes live after event t are
    those of the rows with ``alloc_at <= t < free_at`` (``free_at == -1``: still alive when the step ended).
    Everything else - the live curve, the peak, what is alive at the peak, per-phase peaks - is derived from that
    table, so the parts always add up to the total.

    Args:
        nbytes: bytes of each allocation (rounded to the allocator's blocks where the backend has them).
        alloc_at: the event at which each row was allocated.
        free_at: the event at which each row was freed, or -1.
        phase_index: index into ``phases`` of the phase that made each row.
        module: the module (qualified name) that made each row.
        category: each row's category, one of :data:`CATEGORIES`.
        phases: the step's :class:`Phase` list, in event order.
        num_events: how many events the step had.
        meta: what made the timeline (policy, config, backend, FLOPs per phase, ...); JSON-serialisable.

    Example::

        >>> tl = Timeline(nbytes=[100, 40], alloc_at=[0, 1], free_at=[-1, 2], phase_index=[0, 1],
        ...               module=["w", "h"], category=["parameters", "saved_activations"],
        ...               phases=[Phase(0, "setup", ""), Phase(1, "forward", "layer 0")], num_events=3)
        >>> tl.live_bytes().tolist(), tl.peak_bytes, tl.peak_event, tl.peak_phase.label
        ([100, 140, 100], 140, 1, 'forward layer 0')
        >>> tl.at_peak["saved_activations"], sum(tl.at_peak.values())
        (40, 140)
    """

    nbytes: list[int] = field(default_factory=list)
    alloc_at: list[int] = field(default_factory=list)
    free_at: list[int] = field(default_factory=list)
    phase_index: list[int] = field(default_factory=list)
    module: list[str] = field(default_factory=list)
    category: list[str] = field(default_factory=list)
    phases: list[Phase] = field(default_factory=list)
    num_events: int = 0
    meta: dict[str, Any] = field(default_factory=dict)

    def add_row(self, nbytes: int, alloc_at: int, free_at: int, module: str, category: str,
                phase: int | None = None) -> None:
        """Append one allocation (in place): made at ``alloc_at``, freed at ``free_at`` (-1: never), in phase index
        ``phase`` (None: the phase ``alloc_at`` falls in, :meth:`phase_at`)."""
        self.nbytes.append(nbytes)
        self.alloc_at.append(alloc_at)
        self.free_at.append(free_at)
        self.phase_index.append(self.phases.index(self.phase_at(alloc_at)) if phase is None else phase)
        self.module.append(module)
        self.category.append(category)

    # -- derived views ------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.nbytes)

    def live_bytes(self) -> np.ndarray:
        """The live curve: an int64 array of length ``num_events`` whose entry t is the bytes alive after event t
        (the rows with ``alloc_at <= t`` and ``free_at`` -1 or ``> t``)."""
        return self._live(*self._columns())

    def _columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``nbytes``, ``alloc_at`` and ``free_at`` as int64 arrays."""
        return (np.asarray(self.nbytes, dtype=np.int64), np.asarray(self.alloc_at, dtype=np.int64),
                np.asarray(self.free_at, dtype=np.int64))

    def _live(self, nbytes: np.ndarray, alloc: np.ndarray, free: np.ndarray) -> np.ndarray:
        delta = np.zeros(self.num_events + 1, dtype=np.int64)
        np.add.at(delta, alloc, nbytes)
        freed = free >= 0
        np.add.at(delta, free[freed], -nbytes[freed])
        return np.cumsum(delta[:-1])

    def _parts(self, rows: np.ndarray) -> dict[str, int]:
        parts = dict.fromkeys(CATEGORIES, 0)
        category, nbytes = self.category, self.nbytes
        for row in rows.tolist():
            parts[category[row]] += nbytes[row]
        return parts

    def peak_parts(self) -> tuple[int, dict[str, int]]:
        """(:attr:`peak_event`, :attr:`at_peak`) from one conversion of the columns (a sweep asks it of every
        policy's step)."""
        if not self.num_events:
            return 0, dict.fromkeys(CATEGORIES, 0)
        nbytes, alloc, free = self._columns()
        event = int(np.argmax(self._live(nbytes, alloc, free)))
        return event, self._parts(_alive(alloc, free, event))

    def peak(self) -> tuple[int, int]:
        """(:attr:`peak_event`, :attr:`peak_bytes`) from one live curve (each property makes its own)."""
        if not self.num_events:
            return 0, 0
        live = self.live_bytes()
        event = int(np.argmax(live))
        return event, int(live[event])

    @property
    def peak_event(self) -> int:
        """The first event after which live bytes are highest."""
        return self.peak()[0]

    @property
    def peak_bytes(self) -> int:
        """The highest point of :meth:`live_bytes` (0 for an empty step)."""
        return self.peak()[1]

    def alive_at(self, event: int) -> np.ndarray:
        """Row indices of the allocations alive after ``event``."""
        return _alive(np.asarray(self.alloc_at, dtype=np.int64), np.asarray(self.free_at, dtype=np.int64), event)

    def breakdown(self, event: int) -> dict[str, int]:
        """Bytes alive after ``event`` by category.

        Args:
            event: an event number in ``[0, num_events)``.

        Returns:
            ``{category: bytes}`` for every category of :data:`CATEGORIES`, in that order (0 where none is
            alive); the values add up to ``live_bytes()[event]`` exactly.
        """
        return self._parts(self.alive_at(event))

    @property
    def at_peak(self) -> dict[str, int]:
        """:meth:`breakdown` at :attr:`peak_event`: what the peak is made of; adds up to :attr:`peak_bytes`."""
        return self.peak_parts()[1]

    @property
    def forward_end(self) -> int:
        """The last event of the forward (loss included): the one before the first backward phase starts."""
        starts = [p.start for p in self.phases if p.kind in ("backward", "recompute")]
        return max(0, (min(starts) if starts else self.num_events) - 1)

    def phase_at(self, event: int) -> Phase:
        """The phase ``event`` belongs to (the last phase starting at or before it)."""
        starts = [p.start for p in self.phases]
        return self.phases[max(0, int(np.searchsorted(starts, event, side="right")) - 1)]

    @property
    def peak_phase(self) -> Phase:
        """The phase of :attr:`peak_event`."""
        return self.phase_at(self.peak_event)

    def phase_spans(self) -> list[tuple[Phase, int, int]]:
        """(phase, first event, one past the last event) for every non-empty phase."""
        spans = []
        for i, phase in enumerate(self.phases):
            end = self.phases[i + 1].start if i + 1 < len(self.phases) else self.num_events
            if end > phase.start:
                spans.append((phase, phase.start, end))
        return spans

    def peak_in(self, kinds: tuple[str, ...] | str) -> tuple[int, int] | None:
        """The highest live point inside phases of the given kind(s).

        Args:
            kinds: one kind of :data:`PHASE_KINDS` (``'backward'``) or a tuple of them.

        Returns:
            ``(event, bytes)`` (the first such event on ties), or None when no phase of those kinds has events.
        """
        kinds = (kinds,) if isinstance(kinds, str) else kinds
        live = self.live_bytes()
        best: tuple[int, int] | None = None
        for phase, start, end in self.phase_spans():
            if phase.kind in kinds:
                i = start + int(np.argmax(live[start:end]))
                if best is None or live[i] > best[1]:
                    best = (i, int(live[i]))
        return best

    def top_allocations(self, event: int, n: int = 10) -> list[dict[str, Any]]:
        """The ``n`` largest allocations alive after ``event``, with where they were made."""
        rows = sorted(self.alive_at(event), key=lambda r: -self.nbytes[r])[:n]
        return [{"nbytes": self.nbytes[r], "category": self.category[r], "module": self.module[r],
                 "phase": self.phases[self.phase_index[r]].label} for r in rows]

    # -- JSON ---------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The JSON form (``format: 'remat.timeline'``, ``version`` :data:`FORMAT_VERSION`): the allocation table
        as columns, modules and categories as indices into ``modules`` / ``categories`` tables, phases as
        ``[start, kind, region, detail]``, plus ``meta``, ``num_events`` and ``peak_bytes``."""
        modules = sorted(set(self.module))
        module_id = {m: i for i, m in enumerate(modules)}
        return {
            "format": "remat.timeline",
            "version": FORMAT_VERSION,
            "meta": self.meta,
            "num_events": self.num_events,
            "peak_bytes": self.peak_bytes,
            "phases": [[p.start, p.kind, p.region, p.detail] for p in self.phases],
            "modules": modules,
            "categories": list(CATEGORIES),
            "allocations": {
                "nbytes": self.nbytes,
                "alloc_at": self.alloc_at,
                "free_at": self.free_at,
                "phase": self.phase_index,
                "module": [module_id[m] for m in self.module],
                "category": [CATEGORIES.index(c) for c in self.category],
            },
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Timeline:
        """Read :meth:`to_dict`'s form back, checked by :meth:`validate`.

        Raises:
            TimelineError: not a remat timeline, another version, a missing or malformed field, an index outside
                its table; the message names the field.
        """
        if not isinstance(data, dict) or data.get("format") != "remat.timeline":
            raise TimelineError("not a remat timeline: the field 'format' must be 'remat.timeline'")
        if data.get("version") != FORMAT_VERSION:
            raise TimelineError(f"timeline 'version' {data.get('version')!r} is not supported; this remat "
                                f"reads version {FORMAT_VERSION}")
        try:
            rows = data["allocations"]
            modules, categories = data["modules"], data["categories"]
            for field_name, table in (("module", modules), ("category", categories)):
                bad = [i for i in rows[field_name] if not isinstance(i, int) or not 0 <= i < len(table)]
                if bad:
                    raise TimelineError(f"allocations.{field_name}: index {bad[0]!r} is not in the "
                                        f"{len(table)}-entry '{field_name}s' table")
            phases = [Phase(int(s), str(k), str(r), str(d)) for s, k, r, d in data["phases"]]
            timeline = cls(
                nbytes=[int(x) for x in rows["nbytes"]],
                alloc_at=[int(x) for x in rows["alloc_at"]],
                free_at=[int(x) for x in rows["free_at"]],
                phase_index=[int(x) for x in rows["phase"]],
                module=[str(modules[i]) for i in rows["module"]],
                category=[str(categories[i]) for i in rows["category"]],
                phases=phases,
                num_events=int(data["num_events"]),
                meta=dict(data.get("meta", {})),
            )
        except (KeyError, TypeError, ValueError, IndexError) as err:
            raise TimelineError(f"malformed timeline: {type(err).__name__}: {err}") from err
        timeline.validate()
        return timeline

    def validate(self) -> None:
        """Check the table's invariants: every column has one entry per row, bytes are >= 0, categories are
        known, every allocation is inside the step and freed after it was made, every phase index exists.

        Raises:
            TimelineError: the first violation, naming the field (and the row).
        """
        n = len(self.nbytes)
        for name in ("alloc_at", "free_at", "phase_index", "module", "category"):
            if len(getattr(self, name)) != n:
                raise TimelineError(f"timeline field {name!r} has {len(getattr(self, name))} rows, expected {n}")
        if n > 64 and self._rows_valid():  # the usual case, checked at once; else the first bad row is named
            return
        for row in range(n):
            if self.nbytes[row] < 0:
                raise TimelineError(f"allocation {row}: nbytes {self.nbytes[row]} is negative")
            if self.category[row] not in CATEGORIES:
                raise TimelineError(f"allocation {row}: unknown category {self.category[row]!r}")
            if not 0 <= self.alloc_at[row] < max(self.num_events, 1):
                raise TimelineError(f"allocation {row}: alloc_at {self.alloc_at[row]} outside the step")
            if self.free_at[row] != -1 and not self.alloc_at[row] < self.free_at[row] < self.num_events:
                raise TimelineError(f"allocation {row}: free_at {self.free_at[row]} is not after alloc_at "
                                    f"{self.alloc_at[row]} and inside the step ({self.num_events} events), nor -1")
            if not 0 <= self.phase_index[row] < len(self.phases):
                raise TimelineError(f"allocation {row}: phase_index {self.phase_index[row]} names no phase (there are "
                                    f"{len(self.phases)})")

    def _rows_valid(self) -> bool:
        """Whether every row passes :meth:`validate`'s checks (on whole columns at once)."""
        if not set(self.category) <= _KNOWN_CATEGORIES:
            return False
        try:
            nbytes, alloc, free, phase = (np.asarray(c, dtype=np.int64) for c in (
                self.nbytes, self.alloc_at, self.free_at, self.phase_index))
        except (TypeError, ValueError, OverflowError):  # not whole numbers: the row walk names the row
            return False
        events = self.num_events
        return bool((nbytes >= 0).all() and (alloc >= 0).all() and (alloc < max(events, 1)).all()
                    and ((free == -1) | ((alloc < free) & (free < events))).all()
                    and (phase >= 0).all() and (phase < len(self.phases)).all())

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write :meth:`to_dict` as compact JSON to ``path`` atomically (:func:`write_atomic`, folders made as
        needed); returns the path. :meth:`load` reads it back equal."""
        return write_atomic(path, json.dumps(self.to_dict(), separators=(",", ":")))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Timeline:
        """Read a file :meth:`save` wrote (:meth:`from_dict`); :class:`TimelineError` names the file when it is
        not UTF-8 JSON."""
        with open(path, encoding="utf-8") as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as err:
                raise TimelineError(f"{path}: not valid JSON ({err})") from err
            except UnicodeDecodeError as err:  # a binary file (a pickle, an image)
                raise TimelineError(f"{path}: not valid JSON, not even UTF-8 text ({err.reason} at byte "
                                    f"{err.start}): give a timeline file that Timeline.save wrote") from err
        return cls.from_dict(data)


_KNOWN_CATEGORIES = frozenset(CATEGORIES)
