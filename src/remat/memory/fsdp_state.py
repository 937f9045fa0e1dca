"""What a Megatron-FSDP rank holds (``--use-megatron-fsdp``, :class:`remat.job_fsdp.FsdpConfig`), to the byte.

NOTE [Megatron-FSDP buffers] (Megatron-LM d98e8a64, megatron/core/distributed/fsdp/src/megatron_fsdp/
param_and_grad_buffer.py unless said otherwise):
* parameter groups (``_get_parameter_groups``, 1731): the parameters, in ``named_parameters`` order, grouped by
  (dtype, expert = ``".experts." in name``, requires_grad, FSDP unit); the units are the TransformerLayers
  (mcore_fsdp_adapter.py:170); the non-unit parameters (embeddings, final norm, output layer) form one group, split
  at the DDP bucket size (None without --overlap-grad-reduce: training.py:2179); each group's chunk size factor is
  its parameters' largest ``shape[1:].numel()`` (lcm'd where they do not divide); a unit's routed experts are its
  expert group, sharded over the expert data-parallel ranks (``get_fsdp_group(is_expert_parallel=True)``, 2608), with
  its own all-gather and reduce-scatter buckets (coalesced per (unit, expert), 1948); TE's grouped experts
  (TEGroupedMLP, experts.py:216-255) hold one ``weight{i}`` [out, in] per local expert (TransformerEngine 4329ff84
  grouped_linear.py:1346-1356), so remat's [experts, in, out] grouped weight is laid out as those matrices
  (:func:`megatron_params`);
* each group is one buffer (``build_data_parallel_buffer_index``, 258): items that are not multiples of the chunk
  factor are padded to it (two remainders may share a chunk, small items fill the gaps), and the whole is padded
  to shards x chunk factor; a rank's shard is the size / shards (the data-parallel size, the expert data-parallel
  size for expert groups);
* per strategy (2330): the model weight buffer (param dtype) is sharded with optim_grads_params, else it holds the
  whole bucket; the fp32 main weight buffer is sharded; the main grad buffer is sharded with optim_grads(_params);
  the optimizer's parameters are the items' slices in the main weight shard (3295), so Adam's moments cover no
  padding;
* transients: optim_grads_params all-gathers a unit's whole bucket before its forward and backward
  (``AllGatherPipeline.all_gather_params``, 4388) and prefetches the next buckets while the prefetched size is under
  ``suggested_AG_prefetch_size`` = max(1e9, 2 x the mean unit size) / 2 elements (megatron_fsdp.py:420-444: the
  "cap" is a floor, so a model under 500M elements per rank gathers every unit at its first layer); a unit's bucket
  is freed after its forward (megatron_fsdp.py:1000) and after its backward; non-unit buckets stay gathered
  (``reset(preserve_non_fsdp_units=True)``, 4339; counted over the forward-backward only, see
  :func:`add_fsdp_transients`); with sharded grads each group's first ``main_grad`` access
  allocates its unsharded bucket in the comm dtype (3094), reduce-scattered in place (4083) and freed when the
  reduce queue passes ``suggested_RS_queue_capacity`` (the same unit size, 3924) or at the end of the backward
  (``_root_post_backward`` -> ``GradReducePipeline.reset``, megatron_fsdp.py:901).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from remat.config import DTYPES
from remat.job import Job
from remat.memory.rank_state import BufferLayout, ParamInfo, RankState, shard_elements_of
from remat.timeline import Timeline

GATHER_MODULE = "fsdp.unsharded_params"  # a unit's all-gathered weights
PRESERVED_MODULE = "fsdp.unsharded_params.preserved"  # non-unit buckets, gathered once and kept
GRAD_BUCKET_MODULE = "fsdp.unsharded_grads"
_LAYER = re.compile(r"^layers\.(\d+)\.")


@dataclass(frozen=True)
class FsdpGroup:
    """One Megatron-FSDP parameter group (= bucket)."""

    unit: int | None  # the decoder layer (FSDP unit) it belongs to; None: the non-unit parameters
    expert: bool
    numel: int  # parameter elements
    size: int  # the bucket's padded size (elements)
    shards: int  # ranks it is sharded over
    items: tuple[tuple[int, int], ...]  # [start, end) of each parameter in the bucket

    @property
    def shard(self) -> int:
        return self.size // self.shards

    def shard_elements(self, rank: int) -> int:
        """Parameter elements in shard ``rank`` (the optimizer's, no padding)."""
        lo, hi = rank * self.shard, (rank + 1) * self.shard
        return sum(max(0, min(hi, e) - max(lo, s)) for s, e in self.items)


def _factor(p: ParamInfo) -> int:
    return math.prod(p.shape[1:]) if len(p.shape) > 1 else 1


def buffer_items(params: list[ParamInfo], chunk: int) -> tuple[int, list[tuple[int, int]]]:
    """``build_data_parallel_buffer_index`` (param_and_grad_buffer.py:258) before the final padding: the used size
    and each parameter's [start, end), in ``params`` order.

    Example:
        >>> buffer_items([ParamInfo("a", 6, shape=(3, 2)), ParamInfo("b", 1, shape=(1,))], 4)
        (8, [(0, 6), (6, 7)])
    """
    regular = [(i, p.numel) for i, p in enumerate(params) if p.numel >= chunk]
    fragments = [(i, p.numel) for i, p in enumerate(params) if p.numel < chunk]  # their sort is discarded (309)
    where: dict[int, tuple[int, int]] = {}
    index = 0
    while regular:
        i, n = regular.pop(0)
        where[i] = (index, index + n)
        if n % chunk == 0:
            index += n
            continue
        gap = index + n
        index += (n // chunk + 1) * chunk
        remain = n % chunk
        space = chunk - remain
        rhs = next(((j, m) for j, m in regular if m % chunk and remain + m % chunk <= chunk), None)
        if rhs is not None:  # the two remainders share one chunk
            regular.remove(rhs)
            j, m = rhs
            where[j] = (index - m % chunk, index - m % chunk + m)
            space -= m % chunk
            index += m // chunk * chunk
        for frag in list(fragments):
            if frag[1] <= space:
                where[frag[0]] = (gap, gap + frag[1])
                space -= frag[1]
                gap += frag[1]
                fragments.remove(frag)
    for i, n in fragments:
        where[i] = (index, index + n)
        index += n
    return index, [where[i] for i in range(len(params))]


def megatron_params(params: list[ParamInfo]) -> list[ParamInfo]:
    """``params`` as Megatron-FSDP's ``named_parameters`` sees them: each grouped expert weight [experts, in, out]
    (remat's GroupedLinear) becomes TE GroupedLinear's ``weight0`` .. ``weight{experts-1}``, each [out, in]
    (NOTE [Megatron-FSDP buffers]), which sets the expert group's chunk factor (``in``, not ``in x out``).

    Example:
        >>> [(p.name, p.shape) for p in megatron_params([ParamInfo("layers.0.mlp.experts.linear_fc1.weight", 24,
        ...                                                        shape=(2, 3, 4))])]
        [('layers.0.mlp.experts.linear_fc1.weight0', (4, 3)), ('layers.0.mlp.experts.linear_fc1.weight1', (4, 3))]
    """
    out = []
    for p in params:
        if len(p.shape) == 3 and ".experts." in p.name:
            experts, fan_in, fan_out = p.shape
            out += [dataclasses.replace(p, name=f"{p.name}{i}", numel=fan_in * fan_out, shape=(fan_out, fan_in))
                    for i in range(experts)]
        else:
            out.append(p)
    return out


def fsdp_groups(job: Job, params: list[ParamInfo], bucket_size: int | None = None) -> list[FsdpGroup]:
    """The rank's Megatron-FSDP groups in bucket order (NOTE [Megatron-FSDP buffers]).

    Example:
        >>> from remat.config import ModelConfig
        >>> from remat.job_fsdp import FsdpConfig
        >>> job = Job.build(ModelConfig(), precision="bf16", dp=2, fsdp=FsdpConfig(), distributed_optimizer=True)
        >>> [(g.unit, g.size) for g in fsdp_groups(job, [ParamInfo("layers.0.w", 6, shape=(3, 2))])]
        [(0, 8)]
    """
    keyed: dict[tuple[int | None, bool], list[ParamInfo]] = {}
    for p in megatron_params(params):
        m = _LAYER.match(p.name)
        keyed.setdefault((int(m.group(1)) if m else None, ".experts." in p.name), []).append(p)
    buckets: list[tuple[int | None, bool, list[ParamInfo]]] = []
    for (unit, expert), group in keyed.items():
        current: list[ParamInfo] = []
        for p in group:
            if p.shared_embedding:  # its own bucket (1774)
                buckets += [(unit, expert, current)] * bool(current) + [(unit, expert, [p])]
                current = []
                continue
            current.append(p)
            if unit is None and bucket_size and sum(q.numel for q in current) >= bucket_size:
                buckets.append((unit, expert, current))
                current = []
        if current:
            buckets.append((unit, expert, current))
    out = []
    for unit, expert, group in buckets:
        ordered = sorted(group, key=_factor, reverse=True)  # step 3 (1866): by shape[1:], stable
        chunk = _factor(ordered[0])
        for p in ordered:
            f = _factor(p)
            if not (f == chunk or (chunk % f == 0 and p.numel % chunk == 0) or p.numel < chunk):
                chunk = math.lcm(chunk, f)
        shards = job.expert_data_parallel if expert else job.dp * job.cp
        used, items = buffer_items(ordered, chunk)
        size = -(-used // (shards * chunk)) * shards * chunk  # _pad_if_needed (285)
        out.append(FsdpGroup(unit, expert, sum(p.numel for p in group), size, shards, tuple(items)))
    return out


def unit_size(groups: list[FsdpGroup], params: list[ParamInfo]) -> int:
    """``suggested_communication_unit_size`` (megatron_fsdp.py:420-441): max(1e9, 2 x the units' mean elements)."""
    units = {g.unit for g in groups if g.unit is not None}
    in_units = sum(p.numel for p in params if _LAYER.match(p.name))
    return max(1_000_000_000, in_units // len(units) * 2 if units else 0)


def fsdp_rank_state(job: Job, params: list[ParamInfo]) -> tuple[RankState, list[FsdpGroup]]:
    """The persistent model state of a Megatron-FSDP rank holding ``params`` (one chunk), as a :class:`RankState`
    whose layouts are the groups' persistent weight buffers (``parameters + parameter_padding`` is the weight
    buffer's bytes: negative padding under optim_grads_params, whose weights are a shard), and its groups."""
    assert job.fsdp is not None
    fsdp, prec = job.fsdp, job.precision
    bucket_size = (job.ddp_bucket_size or max(40_000_000, 1_000_000 * job.dp)) if job.overlap_grad_reduce else None
    groups = fsdp_groups(job, params, bucket_size)
    weights_sharded = fsdp.strategy == "optim_grads_params"
    grads_sharded = fsdp.strategy != "optim"

    def held(g: FsdpGroup, sharded: bool) -> int:
        return g.shard if sharded and g.shards > 1 else g.size  # is_data_distributed needs a group > 1 (2640)

    # every rank at once (a job may have a million), and as max() of (elements, rank): the last of the fullest
    ranks = np.arange(max((g.shards for g in groups), default=1), dtype=np.int64)
    per_rank = sum((shard_elements_of(BufferLayout(g.size, g.numel, ((0, g.size),), g.items), g.shards,
                                      ranks % g.shards) for g in groups), np.zeros(len(ranks), dtype=np.int64))
    best = int(np.flatnonzero(per_rank == per_rank.max())[-1])
    elements = int(per_rank[best])
    n = sum(g.numel for g in groups)
    p_size = DTYPES[prec].itemsize
    weight = sum(held(g, weights_sharded) for g in groups)
    layouts = tuple(BufferLayout(held(g, weights_sharded), g.numel, ((0, g.size),), g.items, g.expert)
                    for g in groups)
    state = {"adam": 8, "sgd": 4 if job.sgd_momentum > 0 else 0, "none": 0}[job.optimizer]
    return RankState(num_parameters=n, parameters=n * p_size, parameter_padding=(weight - n) * p_size,
                     gradients=sum(held(g, grads_sharded) for g in groups) * DTYPES[fsdp.grads_dtype(prec)].itemsize,
                     master_parameters=sum(held(g, True) for g in groups) * 4,  # the fp32 main weight buffer
                     optimizer_state=state * elements, dp_rank=best, shard_elements=elements, layouts=layouts,
                     param_buffer=True), groups


def add_fsdp_transients(timeline: Timeline, job: Job, groups: list[FsdpGroup], params: list[ParamInfo],
                        block: int = 1) -> None:
    """Add Megatron-FSDP's unsharded weight and gradient buckets to a stage timeline (in place), following its
    phases (NOTE [Megatron-FSDP buffers]). The unit's weights are alive from their all-gather (at the first layer
    that prefetches them) to the end of the unit's forward or backward; the gradient buckets from the start of the
    unit's backward (the head's for the non-unit group when the chunk has the output layer) to their reduce's
    release. Upper bound: a bucket is counted from the start of the phase that first touches it."""
    assert job.fsdp is not None
    fsdp, prec = job.fsdp, job.precision
    w_size, g_size = DTYPES[prec].itemsize, DTYPES[fsdp.comm_dtype(prec)].itemsize
    gather = fsdp.strategy == "optim_grads_params"
    grads = fsdp.strategy != "optim"
    limit = unit_size(groups, params)

    def nbytes(n: int, size: int) -> int:
        return -(-n * size // block) * block

    unit_elems: dict[int, int] = {}
    for g in groups:
        if g.unit is not None:
            unit_elems[g.unit] = unit_elems.get(g.unit, 0) + g.size
    order = sorted(unit_elems)
    rows: list[tuple[int, str, int, int]] = []  # bytes, module, alloc event, free event (-1: never)
    spans: dict[str, list[tuple[str, str, int, int]]] = {}  # microbatch -> (kind, region, start, end)
    for phase, start, end in timeline.phase_spans():
        mb = re.search(r"microbatch (\d+)", phase.detail)
        if mb and phase.kind in ("forward", "backward"):
            spans.setdefault(mb.group(1), []).append((phase.kind, phase.region, start, end))
    for phases in spans.values():
        alive: dict[int, int] = {}  # unit -> gathered at
        queue: list[tuple[int, int]] = []  # (unit, bucket alloc) in reduce order
        last_bwd = max((e for k, _, _, e in phases if k == "backward"), default=None)
        non_unit_grads = None
        for kind, region, start, end in phases:
            m = re.fullmatch(r"layer (\d+)", region)
            if kind == "backward" and non_unit_grads is None and region in ("head", "embedding"):
                non_unit_grads = start
            if m is None or int(m.group(1)) not in unit_elems:
                continue
            unit = int(m.group(1))
            if gather and unit not in alive:
                ahead = order[order.index(unit) + 1:] if kind == "forward" else order[:order.index(unit)][::-1]
                fetched = 0
                alive[unit] = start
                for nxt in ahead:  # prefetch while the prefetched elements are under the limit (4480)
                    if fetched >= limit // 2:
                        break
                    fetched += unit_elems[nxt]
                    alive.setdefault(nxt, start)
            if kind == "backward" and grads and unit not in dict(queue):
                queue.append((unit, start))
            if gather and unit in alive and _last_phase(phases, kind, region, end):
                rows.append((nbytes(unit_elems[unit], w_size), GATHER_MODULE, alive.pop(unit), end))
            if kind == "backward" and grads and _last_phase(phases, kind, region, end):
                while sum(unit_elems[u] for u, _ in queue) > limit:  # wait_for_previous_grad_reduce (3939)
                    u, at = queue.pop(0)
                    rows.append((nbytes(unit_elems[u], g_size), GRAD_BUCKET_MODULE, at, end))
        end_bwd = last_bwd if last_bwd is not None else timeline.num_events - 1
        rows += [(nbytes(unit_elems[u], g_size), GRAD_BUCKET_MODULE, at, end_bwd) for u, at in queue]
        rows += [(nbytes(unit_elems[u], w_size), GATHER_MODULE, at, end_bwd) for u, at in alive.items()]
        if grads and non_unit_grads is not None:
            rows += [(nbytes(g.size, g_size), GRAD_BUCKET_MODULE, non_unit_grads, end_bwd)
                     for g in groups if g.unit is None]
    steps = [(s, e) for phases in spans.values() for _, _, s, e in phases]
    if gather and steps:
        # the non-unit buckets are gathered at the embedding's forward and kept (4339 PRESERVED); the golden H100
        # resident (mem-allocated-bytes after the step, gpt3_mcore_te_tp2_zp_z3_resume_fsdp_dtensor) holds none of
        # them, so they are counted over the forward-backward passes only
        rows += [(nbytes(g.size, w_size), PRESERVED_MODULE, min(steps)[0], max(e for _, e in steps))
                 for g in groups if g.unit is None]
    for n, module, at, free in rows:
        _add_row(timeline, n, module, at, free)
    timeline.validate()


def _last_phase(phases: list[tuple[str, str, int, int]], kind: str, region: str, end: int) -> bool:
    """Whether the phase ending at ``end`` is the microbatch's last of ``kind`` in ``region``."""
    return end == max(e for k, r, _, e in phases if k == kind and r == region)


def _add_row(timeline: Timeline, nbytes: int, module: str, alloc: int, free: int) -> None:
    category = "parameters" if module != GRAD_BUCKET_MODULE else "gradients"
    timeline.nbytes.append(nbytes)
    timeline.alloc_at.append(alloc)
    timeline.free_at.append(free if free < timeline.num_events else -1)
    timeline.phase_index.append(timeline.phases.index(timeline.phase_at(alloc)))
    timeline.module.append(module)
    timeline.category.append(category)


def fsdp_summary(groups: list[FsdpGroup]) -> dict[str, Any]:
    """JSON-ready: each group's unit, expert flag, elements, padded size and shards."""
    return {"groups": [[g.unit, g.expert, g.numel, g.size, g.shards] for g in groups]}
