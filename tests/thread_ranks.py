"""Ranks of a collective as threads of the test process: a real exchange of values behind barriers that time out,
for checking a parallel layer's arithmetic against the unsplit layer without starting processes."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from remat.models.expert_parallel import ExpertParallelGroup
from remat.models.tp_layers import TensorParallelGroup


class Mailbox:
    """What ``size`` thread ranks exchange, behind a barrier that times out (never hangs)."""

    def __init__(self, size: int):
        self.size, self.box = size, [None] * size
        self.barrier = threading.Barrier(size, timeout=20)

    def exchange(self, rank: int, items: Sequence[Any]) -> list[Any]:
        """Hand ``items[s]`` to rank s; return what each rank handed to ``rank`` (tensors cloned)."""
        self.box[rank] = items
        self.barrier.wait()
        got = [self.box[s][rank] for s in range(self.size)]
        got = [g.clone() if isinstance(g, torch.Tensor) else g for g in got]
        self.barrier.wait()
        return got


def run_ranks(size: int, boxes: Sequence[Mailbox], rank_fn: Callable[[int], Any]) -> list[Any]:
    """``rank_fn(r)`` for r < ``size``, each on its own thread; their results in rank order. An error on one rank
    breaks the others' barriers and is raised here (as an assertion naming every rank's error)."""
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            results[r] = rank_fn(r)
        except BaseException as err:  # noqa: BLE001 - reported below; the other threads' barriers break
            for box in boxes:
                box.barrier.abort()
            errors.append(err)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "a thread rank did not end within 60 s"
    return results


class ThreadTP(TensorParallelGroup):
    """Tensor-parallel ranks as threads: real sums (in rank order) and gathers, of equal or unequal splits. Its
    collectives dispatch other operators than the simulated group's (cat, chunk, clone), as a real backend's do."""

    def __init__(self, mailbox: Mailbox, rank: int):
        self.mailbox, self.size, self.rank = mailbox, mailbox.size, rank

    def _sum(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        return total

    def _all_reduce_into(self, x: torch.Tensor, op: str) -> None:
        got = self.mailbox.exchange(self.rank, [x] * self.size)
        x.copy_(torch.stack(got).amax(0) if op == "max" else self._sum(got))

    def _all_gather_into(self, out: torch.Tensor, x: torch.Tensor) -> None:
        out.copy_(torch.cat(self.mailbox.exchange(self.rank, [x] * self.size)))

    def _reduce_scatter_into(self, out: torch.Tensor, x: torch.Tensor) -> None:
        out.copy_(self._sum(self.mailbox.exchange(self.rank, list(x.chunk(self.size)))))

    def _all_gather_v_into(self, out: torch.Tensor, x: torch.Tensor, splits: list[int]) -> None:
        self._all_gather_into(out, x)

    def _reduce_scatter_v_into(self, out: torch.Tensor, x: torch.Tensor, splits: list[int]) -> None:
        out.copy_(self._sum(self.mailbox.exchange(self.rank, list(x.split(splits)))))


class ThreadCounts(ExpertParallelGroup):
    """Expert-parallel ranks as threads: the exchange of every rank's tokens per expert."""

    def __init__(self, mailbox: Mailbox, rank: int):
        self.mailbox, self.size, self.rank = mailbox, mailbox.size, rank

    def _gather_counts(self, gathered: torch.Tensor, local: torch.Tensor, counts: list[int]) -> list[list[int]]:
        return self.mailbox.exchange(self.rank, [list(counts)] * self.size)
