import gc

import pytest
import torch

from remat.recompute.engines import add_observer, remove_observer

# The test models are tiny: one thread is as fast as two and keeps timings steady on a shared 2-core machine.
torch.set_num_threads(1)


class Recorder:
    """A checkpoint observer: which regions saved inputs, which were recomputed (in backward)."""

    def __init__(self) -> None:
        self.checkpointed: list[object] = []
        self.recomputed: list[object] = []

    def on_checkpoint_inputs(self, region, tensors) -> None:
        self.checkpointed.append(region)

    def on_recompute(self, region, begin) -> None:
        if begin:
            self.recomputed.append(region)


@pytest.fixture
def recorder():
    rec = Recorder()
    add_observer(rec)
    yield rec
    remove_observer(rec)


@pytest.fixture(scope="module", autouse=True)
def _frozen_gc():
    """Move every object alive when a test module starts (torch, megatron-core, pytest, earlier modules' caches)
    out of the cycle collector's way: otherwise each full collection, automatic or a measurement's gc.collect(),
    rescans millions of them (a third of the CPU time of the measuring modules). Objects the module's tests make
    are collected as usual."""
    gc.freeze()
    yield
