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
  (``_root_post_backward`` -> ``GradReducePipeline.reset``, megatron_fsdp.py:901). An untied output layer's
  (unfused) weight gradient is its group's first ``main_grad`` access (``_grad_acc``, megatron_fsdp.py:635-682), so
  that group's bucket is made there, not where the head's backward starts (a tied weight is shared: its gradient
  waits for the root post-backward hook, 742, 867: the group's bucket is then made by the final norm's weight
  gradient, the head backward's last, through its post-accumulate-grad hook, 1136-1143);
* the process's first forward: a non-unit module's pre-forward hook (registered on every module outside a unit,
  megatron_fsdp.py:1086) gathers its direct parameters' bucket with forward prefetch unless its state is
  PRE_BACKWARD (794-813); the root pre-backward sets every module's state to PRE_BACKWARD (936-953) and only the
  units' return to IDLE (704), so the non-units prefetch in the first forward only; there the final norm's hook
  prefetches, from the non-unit bucket 0 on, the units' buckets their post-forward released (param_and_grad_buffer.py
  4441-4516, up to the prefetch limit; a non-unit gather prefetches nothing with ``--fsdp-double-buffer``, 4441-4449):
  they are gathered again at the head's forward and held to each unit's backward release (the measured peak is the
  run's maximum, so the first step's first microbatch counts; priced in the modelled step, beside Adam's moments:
  an upper bound where the first step has none yet);
* with ``--overlap-param-gather`` the optimizer step ends in ``start_param_sync`` (distrib_optimizer.py:3181-3185,
  megatron_fsdp.py:1284-1308): the first parameter's bucket (the embedding's non-unit one) and those it prefetches
  in forward order (:func:`start_param_sync_buckets`) are gathered, and stay so after the step (the preserved
  non-unit buckets refreshed in place); the next forward finds them gathered;
* ``--overlap-moe-expert-parallel-comm``'s per-submodule hooks (mcore_fsdp_adapter.py:211-233,
  megatron_fsdp.py:560-600) gather whole buckets with the same prefetch, and its schedule releases a layer's after
  its forward and backward (``set_fsdp_reshard_hooks``, model_chunk_schedule_plan.py:178-221; after its
  ``backward_dw`` with ``--delay-wgrad-compute``, models/common/utils.py:312-365): the units' phases here.

NOTE [Megatron-FSDP double buffers] (``--fsdp-double-buffer``, or ``--use-nccl-ub`` which turns it on; same file):
* ``FixedPoolAllocator`` (647-884, chosen at 2524-2576 for the weight and the gradient buckets): the units whose
  buckets match one another (count, dtype and parameter elements of each bucket, ``_is_two_bucket_group_equal``)
  form classes; the largest class (the first in unit order on a tie) is double-buffered
  (:func:`double_buffer_units`); its buckets come from two buffer groups, each one persistent tensor per bucket
  offset in Megatron's global memory buffer (``get_global_memory_buffer().get_tensor``, allocated at its first use
  and never freed: a steady step holds the ones it uses from its first event to after its end; the first step, priced
  the same, is an upper bound); the other units (and the non-unit buckets) are allocated and freed as without it
  (the ``StorageResizeBasedBucketAllocator`` fallback, 740);
* at most two double-buffered units at once: the all-gather's prefetch stops where the units it would hold (the
  current one when double-buffered, then each prefetched one) pass two (``need_skip_prefetch``, 4475-4484), and a
  unit's first ``main_grad`` access first waits for the reduces that would leave more than two units' gradient
  buckets (``_enforce_double_buffer_limit``, 3956-3978, from 3099);
* ``--use-nccl-ub`` (2046-2131): the buffers are allocated inside NCCL's ``torch.cuda.MemPool`` (a private pool of
  PyTorch's caching allocator: counted in its allocated bytes like the others) and registered with NCCL; what NCCL
  itself allocates for the registration is NCCL's (not counted, like its other buffers).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from remat.config import DTYPES
from remat.job import Job
from remat.memory.rank_state import BufferLayout, ParamInfo, RankState, shard_elements_of
from remat.timeline import Phase, Timeline
from remat.units import round_up

GATHER_MODULE = "fsdp.unsharded_params"  # a unit's all-gathered weights
PRESERVED_MODULE = "fsdp.unsharded_params.preserved"  # non-unit buckets, gathered once and kept
GRAD_BUCKET_MODULE = "fsdp.unsharded_grads"
# --fsdp-double-buffer's persistent pools (NOTE [Megatron-FSDP double buffers])
POOL_MODULES = {GATHER_MODULE: "fsdp.double_buffer.params", GRAD_BUCKET_MODULE: "fsdp.double_buffer.grads"}
_LAYER = re.compile(r"^layers\.(\d+)\.")
OUTPUT_WEIGHT = "head.output_layer.weight"
FINAL_NORM = "head.final_layernorm.weight"


@dataclass(frozen=True)
class FsdpGroup:
    """One Megatron-FSDP parameter group (= bucket)."""

    unit: int | None  # the decoder layer (FSDP unit) it belongs to; None: the non-unit parameters
    expert: bool
    numel: int  # parameter elements
    size: int  # the bucket's padded size (elements)
    shards: int  # ranks it is sharded over
    items: tuple[tuple[int, int], ...]  # [start, end) of each parameter in the bucket
    names: tuple[str, ...] = ()  # its parameters (Megatron-FSDP's names), in bucket order

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
        size = round_up(used, shards * chunk)  # _pad_if_needed (285)
        out.append(FsdpGroup(unit, expert, sum(p.numel for p in group), size, shards, tuple(items),
                             tuple(p.name for p in group)))
    return out


def unit_size(groups: list[FsdpGroup], params: list[ParamInfo]) -> int:
    """``suggested_communication_unit_size`` (megatron_fsdp.py:420-441): max(1e9, 2 x the units' mean elements)."""
    units = {g.unit for g in groups if g.unit is not None}
    in_units = sum(p.numel for p in params if _LAYER.match(p.name))
    return max(1_000_000_000, in_units // len(units) * 2 if units else 0)


def double_buffer_units(groups: list[FsdpGroup]) -> frozenset[int]:
    """The units ``FixedPoolAllocator`` double-buffers (param_and_grad_buffer.py:676-697): the largest class of units
    whose buckets have the same parameter elements in the same order (every bucket of a rank has one dtype here),
    the first such class in unit order on a tie.

    Example:
        >>> g = lambda unit, numel: FsdpGroup(unit, False, numel, numel, 1, ((0, numel),))
        >>> sorted(double_buffer_units([g(0, 8), g(1, 4), g(2, 4), g(None, 2)]))
        [1, 2]
    """
    buckets: dict[int, list[int]] = {}
    for g in groups:
        if g.unit is not None:
            buckets.setdefault(g.unit, []).append(g.numel)
    best: list[int] = []
    for sizes in buckets.values():
        same = [u for u, other in buckets.items() if other == sizes]
        if len(same) > len(best):
            best = same
    return frozenset(best)


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
        return round_up(n * size, block)

    pooled = double_buffer_units(groups) if fsdp.double_buffer else frozenset()
    unit_elems: dict[int, int] = {}
    for g in groups:
        if g.unit is not None:
            unit_elems[g.unit] = unit_elems.get(g.unit, 0) + g.size
    order = sorted(unit_elems)
    # the output layer's unfused weight gradient (parameters' dtype): where its group's grad bucket is first touched
    out_weight = next((p for p in params if p.name == OUTPUT_WEIGHT), None)
    wgrad_bytes = nbytes(out_weight.numel, w_size) if out_weight is not None else -1
    wgrads_at = sorted(a for a, n in zip(timeline.alloc_at, timeline.nbytes) if n == wgrad_bytes)
    rows: list[tuple[int, str, int, int]] = []  # bytes, module, alloc event, free event (-1: never)
    pool_spans: dict[str, list[tuple[int, int]]] = {GATHER_MODULE: [], GRAD_BUCKET_MODULE: []}

    def unit_row(unit: int, module: str, at: int, free: int) -> None:  # a double-buffered unit's: its pool's
        if unit in pooled:
            pool_spans[module].append((at, free))
        else:
            rows.append((nbytes(unit_elems[unit], w_size if module == GATHER_MODULE else g_size), module, at, free))

    spans: dict[str, list[tuple[str, str, int, int]]] = {}  # microbatch -> (kind, region, start, end)
    for phase, start, end in timeline.phase_spans():
        mb = re.search(r"microbatch (\d+)", phase.detail)
        if mb and phase.kind in ("forward", "backward"):
            spans.setdefault(mb.group(1), []).append((phase.kind, phase.region, start, end))
    first_forward = gather and not pooled  # the process's first forward's non-unit prefetch (NOTE)
    for phases in spans.values():
        alive: dict[int, int] = {}  # unit -> gathered at
        queue: list[tuple[int, int]] = []  # (unit, bucket alloc) in reduce order
        last_bwd = max((e for k, _, _, e in phases if k == "backward"), default=None)
        non_unit_grads = None
        for kind, region, start, end in phases:
            m = re.fullmatch(r"layer (\d+)", region)
            if kind == "backward" and non_unit_grads is None and region in ("head", "embedding"):
                non_unit_grads = start
            if first_forward and kind == "forward" and region == "head":
                # the final norm's pre-forward (megatron_fsdp.py:794-813) prefetches from the non-unit bucket 0 in
                # forward order while its state is not PRE_BACKWARD, i.e. only before the first root pre-backward
                # (936-953; only units return to IDLE, 704): every unit re-gathered, kept to its backward's release
                first_forward, fetched = False, 0
                for nxt in order:
                    if fetched >= limit // 2:
                        break
                    fetched += unit_elems[nxt]
                    alive.setdefault(nxt, start)
            if m is None or int(m.group(1)) not in unit_elems:
                continue
            unit = int(m.group(1))
            if gather and unit not in alive:
                ahead = order[order.index(unit) + 1:] if kind == "forward" else order[:order.index(unit)][::-1]
                fetched = 0
                alive[unit] = start
                held = {unit} & pooled  # need_skip_prefetch (4475): at most two double-buffered units
                for nxt in ahead:  # prefetch while the prefetched elements are under the limit (4480)
                    if fetched >= limit // 2:
                        break
                    held.add(nxt)
                    if pooled and len(held) > 2:
                        break
                    fetched += unit_elems[nxt]
                    alive.setdefault(nxt, start)
            if kind == "backward" and grads and unit not in dict(queue):
                if pooled:  # _enforce_double_buffer_limit (3956): keep the newest reduces of at most two units
                    held, keep = {unit} & pooled, 0
                    for u, _ in reversed(queue):
                        held.add(u)
                        if len(held) > 2:
                            break
                        keep += 1
                    while len(queue) > keep:
                        u, at = queue.pop(0)
                        unit_row(u, GRAD_BUCKET_MODULE, at, max(start, at + 1))
                queue.append((unit, start))
            if gather and unit in alive and _last_phase(phases, kind, region, end):
                unit_row(unit, GATHER_MODULE, alive.pop(unit), end)
            if kind == "backward" and grads and _last_phase(phases, kind, region, end):
                while sum(unit_elems[u] for u, _ in queue) > limit:  # wait_for_previous_grad_reduce (3939)
                    u, at = queue.pop(0)
                    unit_row(u, GRAD_BUCKET_MODULE, at, end)
        end_bwd = last_bwd if last_bwd is not None else timeline.num_events - 1
        for u, at in queue:
            unit_row(u, GRAD_BUCKET_MODULE, at, end_bwd)
        for u, at in alive.items():
            unit_row(u, GATHER_MODULE, at, end_bwd)
        if grads and non_unit_grads is not None:
            first_grad = _output_layer_wgrad(phases, wgrads_at)
            norm_grad = _final_norm_wgrad(phases)
            rows += [(nbytes(g.size, g_size), GRAD_BUCKET_MODULE,
                      first_grad if first_grad is not None and OUTPUT_WEIGHT in g.names else
                      norm_grad if norm_grad is not None and FINAL_NORM in g.names else non_unit_grads, end_bwd)
                     for g in groups if g.unit is None]
    if pooled:  # the double-buffered units' buckets are the pools' (NOTE [Megatron-FSDP double buffers])
        rows += pool_rows(groups, pooled, pool_spans, w_size, g_size, block)
    steps = [(s, e) for phases in spans.values() for _, _, s, e in phases]
    if gather and steps:
        # the non-unit buckets are gathered at the embedding's forward and kept (4339 PRESERVED); the golden H100
        # resident (mem-allocated-bytes after the step, gpt3_mcore_te_tp2_zp_z3_resume_fsdp_dtensor) holds none of
        # them, so they are counted over the forward-backward passes only
        # them, so they are counted over the forward-backward passes only; with --overlap-param-gather the step
        # ends in start_param_sync (distrib_optimizer.py:3181-3185), which gathers the first parameter's bucket and
        # prefetches the next ones (megatron_fsdp.py:1284-1308): those stay gathered after the step (NOTE)
        kept = set(start_param_sync_buckets(groups, limit)) if job.overlap_param_gather else set()
        rows += [(nbytes(g.size, w_size), PRESERVED_MODULE, min(steps)[0], -1 if i in kept else
                  max(e for _, e in steps)) for i, g in enumerate(groups) if g.unit is None]
        if kept:
            timeline.phases.append(Phase(timeline.num_events, "setup", "fsdp start_param_sync", ""))
            rows += [(nbytes(groups[i].size, w_size), GATHER_MODULE, timeline.num_events, -1)
                     for i in sorted(kept) if groups[i].unit is not None and groups[i].unit not in pooled]
            timeline.num_events += 1
    for n, module, at, free in rows:
        _add_row(timeline, n, module, at, free)
    timeline.validate()


def start_param_sync_buckets(groups: list[FsdpGroup], limit: int) -> list[int]:
    """The buckets Megatron-FSDP's ``start_param_sync`` gathers under ``--overlap-param-gather`` (megatron_fsdp.py:
    1284-1308): the first parameter's (bucket 0: the groups are made in ``named_parameters`` order,
    param_and_grad_buffer.py:1790-1825) and, in forward order, the next ones while the prefetched elements are under
    ``suggested_AG_prefetch_size`` = ``limit`` // 2 (param_and_grad_buffer.py:4418-4516, megatron_fsdp.py:444).

    Example:
        >>> g = [FsdpGroup(None, False, 8, 8, 2, ()), FsdpGroup(0, False, 6, 6, 2, ()),
        ...      FsdpGroup(1, False, 6, 6, 2, ())]
        >>> start_param_sync_buckets(g, 2_000_000_000), start_param_sync_buckets(g, 12)
        ([0, 1, 2], [0, 1])
    """
    taken, fetched = [0], 0
    for nxt in range(1, len(groups)):
        if fetched >= limit // 2:
            break
        taken.append(nxt)
        fetched += groups[nxt].size
    return taken if groups else []


def _output_layer_wgrad(phases: list[tuple[str, str, int, int]], made_at: list[int]) -> int | None:
    """The event where the output layer's weight gradient is made in this microbatch's head backward: the first of
    ``made_at`` (the events allocating its bytes, sorted) there. Megatron-FSDP's post-accumulate-grad hook
    ``_grad_acc`` copies that unfused gradient into the group's unsharded bucket, allocating the bucket on this
    first ``main_grad`` access (megatron_fsdp.py:635-682, param_and_grad_buffer.py:3094). None when the head's
    backward does not run here or makes no such tensor (fused into ``main_grad``); a weight tied to the embedding
    is not looked for (shared: its gradient waits for the root post-backward hook, megatron_fsdp.py:742, 867)."""
    span = next(((s, e) for k, r, s, e in phases if k == "backward" and r == "head"), None)
    if span is None:
        return None
    k = bisect.bisect_left(made_at, span[0])
    return made_at[k] if k < len(made_at) and made_at[k] < span[1] else None


def _final_norm_wgrad(phases: list[tuple[str, str, int, int]]) -> int | None:
    """The event where the final norm's weight gradient is made: the last of the head's backward (the head runs
    final_layernorm -> output_layer -> loss, so its backward ends with the norm's). Its post-accumulate-grad hook is
    the first ``main_grad`` access of the non-unit group when the output weight is tied (a shared weight's gradient
    waits for the root post-backward hook, megatron_fsdp.py:742, 867), allocating the bucket there
    (megatron_fsdp.py:635-682, 1136-1143; param_and_grad_buffer.py:3094). None when no head backward runs here."""
    ends = [e for k, r, _, e in phases if k == "backward" and r == "head"]
    return max(ends) - 1 if ends else None


def pool_rows(groups: list[FsdpGroup], pooled: frozenset[int], spans: dict[str, list[tuple[int, int]]],
              w_size: int, g_size: int, block: int = 1) -> list[tuple[int, str, int, int]]:
    """The double buffers' rows (bytes, module, alloc event, free event -1: never) from the [start, end) spans of the
    pooled units' all-gathered weights (``spans[GATHER_MODULE]``) and gradient buckets (``GRAD_BUCKET_MODULE``):
    each pool's buffer group is one tensor per bucket offset (the size of a pooled unit's bucket there), made at its
    first use and never freed (NOTE [Megatron-FSDP double buffers]), so a steady step holds the ones it uses
    (:func:`buffers_used`) from its first event to its end.

    Example:
        >>> g = FsdpGroup(0, False, 6, 8, 2, ((0, 6),))
        >>> rows = pool_rows([g], frozenset({0}), {GATHER_MODULE: [(1, 4), (3, 6)], GRAD_BUCKET_MODULE: [(5, 7)]},
        ...                  2, 4)
        >>> [(n, module.rsplit(".", 1)[1], at, free) for n, module, at, free in rows]
        [(16, 'params', 0, -1), (16, 'params', 0, -1), (32, 'grads', 0, -1)]
    """
    offsets = [g for g in groups if g.unit == min(pooled)]  # every pooled unit's buckets match these
    out = []
    for module, size in ((GATHER_MODULE, w_size), (GRAD_BUCKET_MODULE, g_size)):
        out += [(round_up(g.size * size, block), POOL_MODULES[module], 0, -1)
                for _ in range(buffers_used(spans.get(module, []))) for g in offsets]
    return out


def buffers_used(spans: list[tuple[int, int]]) -> int:
    """How many of a two-buffer pool's buffer groups the [start, end) spans it serves use: none without a span,
    two when a span starts while another is held (``FixedPoolAllocator.allocate`` takes an idle group), else one.

    Example:
        >>> buffers_used([(0, 5), (5, 9), (7, 12)]), buffers_used([(0, 5), (5, 9)]), buffers_used([])
        (2, 1, 0)
    """
    ordered = sorted(spans)
    if any(e > s for i, (s, _) in enumerate(ordered) for _, e in ordered[:i]):
        return 2
    return 1 if spans else 0


def _last_phase(phases: list[tuple[str, str, int, int]], kind: str, region: str, end: int) -> bool:
    """Whether the phase ending at ``end`` is the microbatch's last of ``kind`` in ``region``."""
    return end == max(e for k, r, _, e in phases if k == kind and r == region)


def _add_row(timeline: Timeline, nbytes: int, module: str, alloc: int, free: int) -> None:
    category = "gradients" if module in (GRAD_BUCKET_MODULE, POOL_MODULES[GRAD_BUCKET_MODULE]) else "parameters"
    timeline.add_row(nbytes, alloc, free if free < timeline.num_events else -1, module, category)


def fsdp_summary(groups: list[FsdpGroup]) -> dict[str, Any]:
    """JSON-ready: each group's unit, expert flag, elements, padded size and shards."""
    return {"groups": [[g.unit, g.expert, g.numel, g.size, g.shards] for g in groups]}
