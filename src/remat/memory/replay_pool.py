"""Caching-allocator replays of predicted steps made beside the next prediction (:class:`BackgroundReplays`).

A large job's ranks take a second or so to replay (:func:`remat.memory.reserved.reserved_figures`, pure Python); a
sweep predicts one policy after another. Where a core stands idle, each policy's replays run in a process forked
as soon as its ranks are predicted (the timelines are inherited, never pickled; only the figures come back) while
this process predicts the next policy, and :meth:`BackgroundReplays.wait` collects them; on a busy machine, or for
a small job, they run here. The figures are the same either way: a replay the child could not send is made here.
"""

from __future__ import annotations

import multiprocessing
import signal
import sys
from collections.abc import Sequence
from typing import Any, Protocol

from remat.memory.allocator import AllocatorConfig
from remat.memory.reserved import reserved_figures, stored_figures
from remat.memory.trace_pool import idle_workers, run_forked

# rows (about 0.17 s of replay on a 2-core machine) from which replays are worth another process: a job plan's 8
# replays of 119k rows took 0.26-0.34 s here, 0.17-0.23 s in two forked workers
PARALLEL_REPLAY_ROWS = 100_000


class Replayed(Protocol):
    """What is replayed: a step's ``timeline``, and where its figures go (``reserved``)."""

    timeline: Any
    reserved: dict[str, Any] | None


def replay_now(items: Sequence[Replayed], allocator: AllocatorConfig | None = None) -> None:
    """Set each item's ``reserved`` (:func:`~remat.memory.reserved.reserved_figures` under ``allocator``): from the
    disk cache where it holds the replay, else replayed, side by side on the idle cores (forked workers,
    :func:`~remat.memory.trace_pool.run_forked`) when there are :data:`PARALLEL_REPLAY_ROWS` rows or more. Each item
    once; one already replayed under these options is kept."""
    todo = _todo(items, allocator)
    rows = sum(len(it.timeline.nbytes) for it in todo)
    workers = idle_workers() if len(todo) > 1 and rows >= PARALLEL_REPLAY_ROWS else 1
    for it, figures in zip(todo, run_forked([_task(it, allocator) for it in todo], workers)):
        it.reserved = figures


class BackgroundReplays:
    """Replays of several predictions' steps, each started beside the next prediction (module docstring).

    Example::

        >>> from types import SimpleNamespace
        >>> step = SimpleNamespace(timeline=SimpleNamespace(nbytes=[3 << 20], alloc_at=[0], free_at=[-1],
        ...                                                 peak_bytes=3 << 20), reserved=None)
        >>> replays = BackgroundReplays()
        >>> replays.add([step]); replays.wait()
        >>> step.reserved["max_memory_reserved"] >> 20
        20
    """

    def __init__(self, allocator: AllocatorConfig | None = None):
        self.allocator = allocator
        self.pending: list[tuple[list[Replayed], Any, Any]] = []  # (items, process, connection)
        self.beside: bool | None = None  # whether a core stands idle for them (asked once, at the first large add)

    def add(self, items: Sequence[Replayed]) -> None:
        """Replay ``items`` beside what this process does next (a forked child), or here and now."""
        todo = _todo(items, self.allocator)
        if sum(len(it.timeline.nbytes) for it in todo) < PARALLEL_REPLAY_ROWS or \
                "fork" not in multiprocessing.get_all_start_methods():
            replay_now(todo, self.allocator)
            return
        if self.beside is None:
            self.beside = idle_workers() > 1
        if not self.beside:
            replay_now(todo, self.allocator)
            return
        self.wait()  # one child at a time beside this process (the last one has had a prediction's time)
        ctx = multiprocessing.get_context("fork")
        for stream in (sys.stdout, sys.stderr):  # the child flushes what it inherits: nothing twice
            stream.flush()
        receive, send = ctx.Pipe(duplex=False)
        process = ctx.Process(target=_replay_child, args=(todo, self.allocator, send))
        process.start()
        send.close()
        self.pending.append((todo, process, receive))

    def wait(self) -> None:
        """Collect every replay started (those a child could not send are made here)."""
        while self.pending:
            self._collect(self.pending.pop(0))

    def _collect(self, entry: tuple[list[Replayed], Any, Any]) -> None:
        """Take a child's figures as it sends them (first item first) while this process replays from the last
        item down, until the two meet: the last replays take half the time instead of this process waiting on
        them (each item's figures are the same whoever replays it). A child that stops sending leaves the rest
        here."""
        items, process, receive = entry
        done = 0  # items[:done] came from the child
        back = len(items)  # items[back:] were replayed here
        sending = True  # the child sends in order, then ends; anything else: it stopped, the rest is made here
        try:
            while done < back:
                while sending and done < back and receive.poll():
                    try:
                        index, figures = receive.recv()
                    except Exception:  # it ended (EOF) or died mid-way
                        sending = False
                        break
                    if index != done:
                        sending = False
                        break
                    items[done].reserved, done = figures, done + 1
                if done < back:
                    back -= 1
                    items[back].reserved = reserved_figures(items[back].timeline, self.allocator)
        finally:
            receive.close()
            process.join(0.1)
            if process.is_alive():  # replaying an item made here meanwhile
                process.terminate()
                process.join()


def _todo(items: Sequence[Replayed], allocator: AllocatorConfig | None) -> list[Replayed]:
    """The items (each once) not replayed under ``allocator`` yet; those the disk cache holds get their figures."""
    conf = (allocator or AllocatorConfig()).text()
    unique = list({id(it): it for it in items if (it.reserved or {}).get("alloc_conf") != conf}.values())
    for it in unique:
        it.reserved = stored_figures(it.timeline, allocator)
    return [it for it in unique if it.reserved is None]


def _task(item: Replayed, allocator: AllocatorConfig | None) -> Any:
    return lambda: reserved_figures(item.timeline, allocator)


def _replay_child(items: Sequence[Replayed], allocator: AllocatorConfig | None, send: Any) -> None:
    """Send ``(index, figures)`` of each item in order, as each is replayed (the parent takes them while it replays
    from the other end, :meth:`BackgroundReplays._collect`). Ended by SIGTERM once the parent has them all: raised
    as SystemExit, so that a disk-cache entry being written is removed, not left half-written."""
    signal.signal(signal.SIGTERM, _exit)
    try:
        for index, it in enumerate(items):
            send.send((index, reserved_figures(it.timeline, allocator)))
    except Exception:  # the parent closed its end (it has them all), or replays the rest itself
        pass
    finally:
        send.close()


def _exit(signum: int, frame: Any) -> None:
    raise SystemExit(0)
