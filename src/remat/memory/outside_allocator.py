"""GPU memory a rank holds outside PyTorch's caching allocator: libraries' own communication buffers.

Some libraries Megatron-LM runs allocate their buffers with ``cudaMalloc`` / ``cuMemCreate`` themselves (HybridEP /
DeepEP for the flex token dispatcher, TransformerEngine's userbuffers for TP communication overlap). Those bytes are
not in ``torch.cuda.max_memory_allocated`` nor ``max_memory_reserved`` (Megatron's ``mem-max-allocated-bytes``
leaves them out too), but the GPU holds them for the whole run, so a "fits" answer must count them. Each mechanism
sizes its :class:`OutsideBuffer` list from the job alone as the library sizes it, with the source it follows
(:mod:`remat.memory.flex_buffers`, :mod:`remat.memory.tp_overlap`); a rank's are gathered by
:func:`remat.parallel.job_predict.outside_allocator_buffers`.

Other bytes outside the allocator (the CUDA context and kernels, NCCL's communicator buffers) are not modelled:
``remat plan``'s ``--reserve`` keeps room for them.
"""

from __future__ import annotations

from typing import NamedTuple


class OutsideBuffer(NamedTuple):
    """One library buffer held for the whole run outside PyTorch's caching allocator."""

    name: str  # what it is, e.g. "HybridEP expert token buffer (dispatch and combine)"
    nbytes: int
    source: str  # the source lines that size it

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "bytes": self.nbytes, "source": self.source}


def outside_bytes(buffers: tuple[OutsideBuffer, ...]) -> int:
    """The bytes of ``buffers`` together."""
    return sum(b.nbytes for b in buffers)
