"""remat.parallel.schedule's interleaved order against megatron-core's own functions (get_pp_rank_microbatches,
get_schedule_table; the same source at d98e8a64 and in the installed 0.16.1)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from remat.megatron.compat import MegatronUnavailable, require_megatron_core
from remat.parallel.schedule import schedule_actions, schedule_table, warmup_forwards

try:
    require_megatron_core()
except MegatronUnavailable as err:
    pytest.skip(str(err), allow_module_level=True)

from megatron.core.pipeline_parallel.schedules import (  # noqa: E402
    get_pp_rank_microbatches,
    get_schedule_table,
)

CASES = [  # (pp, vpp, m, group or None for Megatron's default pp)
    (4, 3, 4, None), (4, 2, 8, None), (4, 2, 4, None), (2, 2, 2, None), (2, 3, 6, None), (4, 3, 5, 5),
    (4, 2, 9, 5), (2, 2, 7, 4), (8, 2, 16, None), (4, 4, 12, 6),
]


def _communicator(pp: int, rank: int, vpp: int) -> SimpleNamespace:
    group = SimpleNamespace(size=lambda: pp, rank=lambda: rank)
    return SimpleNamespace(pp_group=group, virtual_pipeline_model_parallel_size=vpp)


@pytest.mark.parametrize("pp,vpp,m,group", CASES)
def test_interleaved_order_is_megatron_cores(pp, vpp, m, group):
    g = pp if group is None else group
    table = get_schedule_table(m, vpp, g)
    assert schedule_table(m, vpp, g) == table
    for rank in range(pp):
        _, _, warmup, _ = get_pp_rank_microbatches(m, vpp, g, p2p_communicator=_communicator(pp, rank, vpp))
        assert warmup_forwards("interleaved", pp, m, vpp, rank, "megatron", group=group) == warmup
        acts = schedule_actions("interleaved", pp, m, vpp, rank, runtime="megatron", group=group)
        # forward k runs table[k]; backward k the mirrored chunk (get_model_chunk_id(k, forward=False)), whose
        # inputs pop first in, first out: the k-th backward of that chunk is its microbatch table[k][0]
        forwards = [(a.microbatch, a.chunk) for a in acts if a.kind == "F"]
        backwards = [(a.microbatch, a.chunk) for a in acts if a.kind == "B"]
        assert forwards == [(mb, c * pp + rank) for mb, c in table]
        assert backwards == [(mb, (vpp - 1 - c) * pp + rank) for mb, c in table]
        # warm-up forwards, then forward k + warmup and backward k alternate, then the rest of the backwards
        kinds = "".join(a.kind for a in acts)
        total = m * vpp
        assert kinds == "F" * warmup + "FB" * (total - warmup) + "B" * warmup
