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
