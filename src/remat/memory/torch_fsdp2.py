"""What a torch-FSDP2 rank holds (``--use-torch-fsdp2``, :class:`remat.job_fsdp.TorchFsdp2Config`), to the byte.

NOTE [torch FSDP2] (Megatron-LM d98e8a64 megatron/core/distributed/torch_fully_sharded_data_parallel.py, training/
training.py, training/arguments.py; torch 2.13 torch/distributed/fsdp/_fully_shard/, files named below):
* units: Megatron calls ``fully_shard`` on every TransformerLayer, LanguageModelEmbedding, RotaryEmbedding (no
  parameters) and, with TE layers, tensor_parallel.ColumnParallelLinear (the output layer; the local layers' linears
  are of that class, so it is left out there, 114-120), then on the root module (148): the root's own parameters are
  the rest (the final norm; the output layer under ``--transformer-impl local``). Each unit shards over the
  data-parallel x context-parallel group (76-77), with ``reshard_after_forward`` from
  ``--torch-fsdp2-no-reshard-after-forward`` (82-85, training.py:2627-2629) given explicitly, so the root reshards
  too (_fsdp_state.py:203-207 keeps the root gathered only when it is not given);
* no MixedPrecisionPolicy is passed: the parameters keep the dtype Megatron built them in (``Float16Module``
  converts them to bf16/fp16 before the wrap, training.py:2467-2470), so the gathers, the gradients and their
  reduce-scatter run in that dtype (_fsdp_param.py:586-601: param_dtype and reduce_dtype None);
  ``--accumulate-allreduce-grads-in-fp32`` is not read (training.py:2627-2629 builds the FSDP config from
  ``reshard_after_forward`` alone);
* sharded parameters (_fsdp_param.py:298-330): each parameter is chunked on dim 0 with ``torch.chunk`` over the
  shards and each rank keeps ``new_zeros(chunks[0].size())``, the padded chunk ceil(d0 / shards) x the other dims,
  its own allocation; rank 0's chunk is never short, so it holds the most;
* the optimizer: without the distributed optimizer (arguments.py:1038) a bf16/fp16 job runs
  ``Float16OptimizerWithFloat16Params`` (optimizer.py:1012 ``param.detach().clone().float()``: an fp32 master copy of
  each local shard) with Adam's two fp32 moments per element; its step copies each sharded gradient to an fp32
  ``main_param.grad`` and drops the model's (1092-1105), the fp32 copies alive until the next step's
  ``zero_grad(set_to_none=True)`` (1048); an fp32 job's FP32Optimizer steps the sharded gradients themselves;
* forward (_fsdp_param_group.py:372-489, _fsdp_collectives.py:325-378, 431-491): a unit's pre-forward allocates one
  flat all-gather output (shards x its padded shards, ``torch.empty``: PyTorch's allocator) and copies it out into
  one unsharded tensor per parameter (shards x its padded chunk, ``init_all_gather_outputs``, 616-628); the flat
  buffer is freed at the next unit's pre-forward (its copy-out overlaps that all-gather: ``all_gather_state``,
  430-432) or the root's post-forward (_fsdp_state.py:335-342); post-forward frees the unsharded tensors unless
  ``reshard_after_forward`` is False (499-510);
* backward: a unit's pre-backward gathers it again (when resharded) and prefetches the unit before it in forward
  order (``_backward_prefetch``, 795-830; Megatron sets the same prefetch explicitly under recompute, 138-143), whose
  flat buffer lives until that unit's copy-out; autograd's weight gradients (the unit's parameters' shapes, the
  parameters' dtype: no gradient-accumulation fusion, arguments.py:1040) stay on the unsharded parameters until the
  unit's post-backward (588-720), which reshards, then allocates the reduce-scatter input (shards x its padded
  shards), copies the gradients in and frees them, and reduce-scatters into a flat output of its padded shards: the
  first microbatch's becomes the sharded gradients (views of it, _fsdp_collectives.py:702-760), later ones are added
  to them and freed; the reduce-scatter input is kept until the next unit's post-backward (641-658, one buffer:
  ``reduce_scatter_max_input_buffers`` 1) or the root's final callback (_fsdp_state.py:395-431).
* initialisation (:func:`model_init_bytes`): the model is built on the GPU (training.py:2457-2470) and each unit's
  parameters give way to their chunks as ``fully_shard`` runs; one event before the step (the process's peak counts
  it), the whole model and the embedding's chunks, or with ``--use-cpu-initialization`` one unit at a time.
Counted as upper bounds: a unit's weight gradients from the start of its backward (autograd makes them one by one,
the last at its end), beside the trace's own transient of each one (the DDP hook's, ``trace_chunk(drop_grads=True)``)
except the output layer's and the word embedding's, whose traced gradient is kept to the unit's backward end
instead. All of these are
PyTorch allocations (``DefaultAllocMixin``, _fsdp_collectives.py:51-59): nothing outside the caching allocator.
Two of them are made on side streams, whose blocks the caching allocator keeps in those streams' own pools (NOTE
[streams' pools] in :mod:`remat.memory.allocator`; :data:`ALLOCATION_STREAMS`, which the reserved replay reads): the
flat all-gather output, allocated under ``all_gather_copy_in_stream`` (_fsdp_collectives.py:336-347) in FORWARD and
PRE_BACKWARD state (_fsdp_param_group.py:116-126: every gather here, the backward prefetch included), and the
reduce-scatter output, under ``reduce_scatter_stream`` (_fsdp_collectives.py:611-616), so the sharded gradients too;
the unsharded parameters (copied out on the current stream, 431-491) and the reduce-scatter input (596-600) are the
default stream's.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass

from remat.config import DTYPES
from remat.job import Job
from remat.memory.fsdp_state import OUTPUT_WEIGHT, megatron_params
from remat.memory.rank_state import BufferLayout, ParamInfo, RankState
from remat.timeline import Phase, Timeline
from remat.units import round_up

GATHERED_MODULE = "torch_fsdp2.unsharded_params"  # a unit's all-gathered parameters (one tensor each)
ALL_GATHER_MODULE = "torch_fsdp2.all_gather_output"  # the flat all-gather buffer
UNSHARDED_GRADS_MODULE = "torch_fsdp2.unsharded_grads"  # autograd's weight gradients before the reduce-scatter
REDUCE_SCATTER_MODULE = "torch_fsdp2.reduce_scatter_input"
REDUCE_OUTPUT_MODULE = "torch_fsdp2.reduce_scatter_output"  # a later microbatch's, added to the sharded gradients
SHARDED_GRADS_MODULE = "torch_fsdp2.sharded_grads"
INIT_MODULE = "torch_fsdp2.model_init"  # the model as built, before fully_shard shards it
COMMUNICATION_MODULES = (ALL_GATHER_MODULE, REDUCE_SCATTER_MODULE, REDUCE_OUTPUT_MODULE)
# the rows allocated on a side stream, by module: the stream's name in _fsdp_collectives.py (NOTE [torch FSDP2])
ALLOCATION_STREAMS = {ALL_GATHER_MODULE: "all_gather_copy_in_stream", REDUCE_OUTPUT_MODULE: "reduce_scatter_stream",
                      SHARDED_GRADS_MODULE: "reduce_scatter_stream"}
_LAYER = re.compile(r"^layers\.(\d+)\.")
# the [vocab / tp, h] weights, whose traced gradient (of a size no activation near it has) is kept, not added again
VOCAB_WEIGHTS = (OUTPUT_WEIGHT, "embedding.word_embeddings.weight")


def padded_shard(p: ParamInfo, shards: int) -> int:
    """Elements of ``p``'s padded dim-0 chunk (_fsdp_param.py:298-307): ceil(d0 / shards) x the other dims.

    Example:
        >>> padded_shard(ParamInfo("w", 10 * 3, shape=(10, 3)), 4), padded_shard(ParamInfo("b", 5, shape=(5,)), 4)
        (9, 2)
    """
    d0 = p.shape[0] if p.shape else p.numel
    return -(-d0 // shards) * (p.numel // d0 if d0 else 0)


@dataclass(frozen=True)
class Fsdp2Unit:
    """One ``fully_shard`` call's parameter group (NOTE [torch FSDP2])."""

    name: str  # "root", "embedding", "layer N", "output"
    region: str  # the timeline region its forward and backward run in ("" for the root: the whole step)
    params: tuple[ParamInfo, ...]  # Megatron's parameters (TE's grouped experts as weight0..)
    shards: int

    @property
    def shard_elements(self) -> int:
        """The padded shards' elements: the sharded parameters, the sharded gradients, rank 0's master copy."""
        return sum(padded_shard(p, self.shards) for p in self.params)

    def gathered_bytes(self, itemsize: int, block: int = 1) -> int:
        """The unsharded parameters: one all-gather output per parameter, shards x its padded chunk."""
        return sum(round_up(padded_shard(p, self.shards) * self.shards * itemsize, block) for p in self.params)

    def flat_bytes(self, itemsize: int, block: int = 1) -> int:
        """The flat all-gather output, or the reduce-scatter input: shards x the padded shards, one tensor."""
        return round_up(self.shard_elements * self.shards * itemsize, block)

    def grad_bytes(self, itemsize: int, block: int = 1, skip: frozenset[str] = frozenset()) -> int:
        """Autograd's unsharded weight gradients (one per parameter, its shape), but those named in ``skip``."""
        return sum(round_up(p.numel * itemsize, block) for p in self.params if p.name not in skip)


def fsdp2_units(job: Job, params: list[ParamInfo]) -> list[Fsdp2Unit]:
    """The rank's FSDP2 units in forward order, the root first (NOTE [torch FSDP2]).

    Example:
        >>> from remat.config import ModelConfig
        >>> from remat.job_fsdp import TorchFsdp2Config
        >>> job = Job.build(ModelConfig(tie_embeddings=False), precision="bf16", dp=2,
        ...                 gradient_accumulation_fusion=False, torch_fsdp2=TorchFsdp2Config())
        >>> [u.name for u in fsdp2_units(job, [ParamInfo("embedding.word_embeddings.weight", 8, shape=(4, 2)),
        ...                                    ParamInfo("layers.0.w", 6, shape=(3, 2)),
        ...                                    ParamInfo("head.final_layernorm.weight", 2, shape=(2,)),
        ...                                    ParamInfo(OUTPUT_WEIGHT, 8, shape=(4, 2))])]
        ['root', 'embedding', 'layer 0', 'output']
    """
    shards = job.dp * job.cp  # parallel_state.get_data_parallel_group(with_context_parallel=True), :77
    te_output = job.model.transformer_impl != "local"  # ColumnParallelLinear is not wrapped with local layers
    grouped: dict[tuple[str, str], list[ParamInfo]] = {("root", ""): []}
    for p in megatron_params(params):
        m = _LAYER.match(p.name)
        key = ((f"layer {m.group(1)}",) * 2 if m else ("embedding", "embedding") if p.name.startswith("embedding.")
               else ("output", "head") if p.name.startswith("head.output_layer.") and te_output else ("root", ""))
        grouped.setdefault(key, []).append(p)
    return [Fsdp2Unit(name, region, tuple(ps), shards) for (name, region), ps in grouped.items()
            if ps or name == "root"]


def fsdp2_rank_state(job: Job, params: list[ParamInfo]) -> RankState:
    """What a torch-FSDP2 rank (dp rank 0, the fullest shards) holds for the whole step: its padded parameter shards
    (one allocation each, as ``layouts`` of one parameter), the fp32 master copies and the optimizer state of those
    shards. The sharded gradients are made by the first backward and replaced by fp32 copies at the optimizer step:
    they are rows of the step's timeline (:func:`add_fsdp2_transients`), not ``gradients`` here."""
    assert job.torch_fsdp2 is not None
    units = fsdp2_units(job, params)
    size = DTYPES[job.precision].itemsize
    shard = sum(u.shard_elements for u in units)
    n = sum(p.numel for p in params)
    layouts = tuple(BufferLayout(padded_shard(p, u.shards), p.numel, ((0, padded_shard(p, u.shards)),),
                                 ((0, p.numel),)) for u in units for p in u.params)
    moments = {"adam": 8, "sgd": 4 if job.sgd_momentum > 0 else 0, "none": 0}[job.optimizer]
    master = 4 * shard if job.precision != "fp32" and job.optimizer != "none" else 0  # no optimizer: no copies
    return RankState(num_parameters=n, parameters=n * size, parameter_padding=(shard - n) * size, gradients=0,
                     master_parameters=master, optimizer_state=moments * shard,
                     dp_rank=0, shard_elements=shard, layouts=layouts, param_buffer=True, param_itemsize=size)


def add_fsdp2_transients(timeline: Timeline, job: Job, params: list[ParamInfo], block: int = 1) -> None:
    """Add torch FSDP2's gathered parameters, gradients and communication buffers to a stage timeline (in place),
    following its phases (NOTE [torch FSDP2]): per microbatch, each unit's flat all-gather buffer and unsharded
    parameters in forward and (gathered again when resharded) in backward or in its recompute, its unsharded weight
    gradients, the reduce-scatter input and output, and the sharded gradients from the unit's first reduce-scatter
    to the optimizer step (kept after it in an fp32 job, whose optimizer steps them)."""
    assert job.torch_fsdp2 is not None
    reshard = job.torch_fsdp2.reshard_after_forward
    units = fsdp2_units(job, params)
    root, rest = units[0], units[1:]
    size = DTYPES[job.precision].itemsize
    last = timeline.num_events - 1  # the optimizer step (remat.parallel.job_predict.add_model_state)
    # Megatron's explicit backward prefetch under recompute (torch_fully_sharded_data_parallel.py:138-143): each
    # wrapped module prefetches the one wrapped before it, and the first layer's is the RotaryEmbedding (no
    # parameters), so the embedding is not prefetched
    explicit = job.policy.granularity in ("full", "selective")
    rows: list[tuple[int, str, str, int, int]] = []  # bytes, module, category, alloc event, free event (-1: never)
    flats: list[tuple[int, int, int, int | None]] = []  # a FORWARD-state copy-out's flat buffer: its copy-out
    # event, bytes, alloc event and free bound

    def row(nbytes: int, module: str, category: str, at: int, free: int) -> None:
        free = free if free == -1 else min(free, last)
        if nbytes > 0 and (free == -1 or free > at):
            rows.append((nbytes, module, category, at, free))

    spans: dict[str, list[tuple[str, str, int, int]]] = {}  # microbatch -> (kind, region, start, end)
    for phase, start, end in timeline.phase_spans():
        mb = re.search(r"microbatch (\d+)", phase.detail)
        if mb and phase.kind in ("forward", "backward", "recompute"):
            spans.setdefault(mb.group(1), []).append((phase.kind, phase.region, start, end))
    for index, phases in enumerate(spans.values()):
        fwd = {u.name: _span(phases, u.region, ("forward",)) for u in rest}
        bwd = {u.name: _span(phases, u.region, ("backward", "recompute")) for u in rest}
        hook = {u.name: _span(phases, u.region, ("backward",)) for u in rest}  # its pre-backward hook's
        f_all, b_all = _span(phases, None, ("forward",)), _span(phases, None, ("backward", "recompute"))
        if f_all is None or b_all is None:
            continue
        order = sorted((u for u in rest if fwd[u.name] and bwd[u.name] and hook[u.name]),
                       key=lambda u: fwd[u.name][0])
        # forward: the root's pre-forward first, then each unit's; a copy-out in FORWARD state keeps its flat buffer
        # to the next one (_fsdp_param_group.py:430-432, 478-489) or the root's post-forward (_fsdp_state.py:335)
        row(root.gathered_bytes(size, block), GATHERED_MODULE, "parameters", f_all[0],
            f_all[1] if reshard else b_all[1])
        flats.append((f_all[0], 0, f_all[0], f_all[1]))
        # the root's own flat buffer, copied out at once (the embedding's copy-out follows): held for one event
        row(root.flat_bytes(size, block) * (root.shards > 1), ALL_GATHER_MODULE, "other", f_all[0], f_all[0] + 1)
        for u in order:
            start, end = fwd[u.name]
            flats.append((start, u.flat_bytes(size, block) * (u.shards > 1), start, f_all[1]))
            row(u.gathered_bytes(size, block), GATHERED_MODULE, "parameters", start, end if reshard else bwd[u.name][1])
        # backward, in reverse order: the root's pre-backward gathers it and prefetches the last unit
        if reshard:  # its flat all-gather buffer, freed at its copy-out (as each unit's below)
            row(root.gathered_bytes(size, block), GATHERED_MODULE, "parameters", b_all[0], b_all[1])
            row(root.flat_bytes(size, block) * (root.shards > 1), ALL_GATHER_MODULE, "other", b_all[0], b_all[0] + 1)
        back = order[::-1]
        for j, u in enumerate(back):
            start, end = bwd[u.name]  # gathered at its recompute (FORWARD state) or at its pre-backward hook
            if reshard:
                issued = hook[back[j - 1].name][0] if j else b_all[0]  # the prefetch, at the later unit's hook
                at = issued if issued < start and not (explicit and u.name == "embedding") else start
                if start < hook[u.name][0]:  # a recompute's pre-forward: the flat buffer is held as in forward
                    flats.append((start, u.flat_bytes(size, block) * (u.shards > 1), at, None))
                else:
                    row(u.flat_bytes(size, block) * (u.shards > 1), ALL_GATHER_MODULE, "other", at, start)
                row(u.gathered_bytes(size, block), GATHERED_MODULE, "parameters", start, end)
            kept = frozenset(p.name for p in u.params if p.name in VOCAB_WEIGHTS and
                             _keep_traced_grad(timeline, round_up(p.numel * size, block), hook[u.name][0], end))
            row(u.grad_bytes(size, block, kept), UNSHARDED_GRADS_MODULE, "gradients", hook[u.name][0], end)
            # freed by the next unit's post-backward; the last's (the embedding's, whose inputs need no gradient, so
            # its post-backward runs in the root's final callback: _fsdp_state.py:395-431) right after it
            nxt = bwd[back[j + 1].name][1] if j + 1 < len(back) else max(end, b_all[1]) + 1
            row(u.flat_bytes(size, block), REDUCE_SCATTER_MODULE, "other", end, nxt)
            _reduced(row, u, size, block, end, index, last, job.precision)
        # the root's post-backward, from the final callback at the end of the backward
        row(root.grad_bytes(size, block), UNSHARDED_GRADS_MODULE, "gradients", b_all[0], b_all[1])
        row(root.flat_bytes(size, block), REDUCE_SCATTER_MODULE, "other", b_all[1], b_all[1] + 1)
        _reduced(row, root, size, block, b_all[1], index, last, job.precision)
    flats.sort(key=lambda f: f[0])  # program order (the microbatches run one after another: pp = 1)
    for i, (_, nbytes, at, bound) in enumerate(flats):
        nxt = flats[i + 1][0] if i + 1 < len(flats) else None  # the next copy-out in FORWARD state frees it
        if bound is not None:
            row(nbytes, ALL_GATHER_MODULE, "other", at, min(bound, nxt) if nxt is not None else bound)
        elif nxt is not None:
            row(nbytes, ALL_GATHER_MODULE, "other", at, nxt)
        elif flats:  # held past the step: the next step's first forward frees it (and this step's, the previous)
            row(nbytes, ALL_GATHER_MODULE, "other", at, -1)
            row(nbytes, ALL_GATHER_MODULE, "other", 0, flats[0][0])
    for nbytes, module, category, at, free in rows:
        timeline.add_row(nbytes, at, free, module, category)
    prepend_model_init(timeline, model_init_bytes(job, units, size, block))


def model_init_bytes(job: Job, units: list[Fsdp2Unit], itemsize: int, block: int = 1) -> int:
    """The most a rank holds while Megatron builds and shards the model, before the optimizer exists: the whole
    model, built on the GPU (training.py:2457-2465; Float16Module converts it in place, 2467-2470), less each unit's
    parameters as ``fully_shard`` (in module order, the root last: torch_fully_sharded_data_parallel.py:128-148)
    replaces them by their padded chunks (_fsdp_param.py:307, the originals freed when it returns, 329-330); with
    ``--use-cpu-initialization`` ``fully_shard`` moves one unit at a time to the GPU first (_fsdp_init.py:369, 567
    ``_move_states_to_device``): the chunks so far, that unit and its chunks.

    Example:
        >>> from remat.config import ModelConfig
        >>> from remat.job_fsdp import TorchFsdp2Config
        >>> job = Job.build(ModelConfig(tie_embeddings=False), precision="bf16", dp=2,
        ...                 gradient_accumulation_fusion=False, torch_fsdp2=TorchFsdp2Config())
        >>> units = fsdp2_units(job, [ParamInfo("embedding.word_embeddings.weight", 8, shape=(4, 2)),
        ...                           ParamInfo("layers.0.w", 6, shape=(3, 2))])
        >>> model_init_bytes(job, units, 2)  # the whole model (28 bytes) and the embedding's chunk (8)
        36
    """
    assert job.torch_fsdp2 is not None
    order = units[1:] + units[:1]
    full = [sum(round_up(p.numel * itemsize, block) for p in u.params) for u in order]
    chunks = [sum(round_up(padded_shard(p, u.shards) * itemsize, block) for p in u.params) for u in order]
    if job.torch_fsdp2.cpu_initialization:
        return max(sum(chunks[:k]) + full[k] + chunks[k] for k in range(len(order)))
    return max(sum(full[k:]) + sum(chunks[:k + 1]) for k in range(len(order)))


def prepend_model_init(timeline: Timeline, nbytes: int) -> None:
    """Put the model's initialisation (``nbytes``, :func:`model_init_bytes`) before the step: one event of its own,
    in a setup phase, so that the rank's peak (Megatron's ``mem-max-allocated-bytes`` counts from the process's
    start) and a "fits" answer count it."""
    timeline.phases[:] = [Phase(0, "setup", "", "torch_fsdp2 model init")] + [
        dataclasses.replace(p, start=p.start + 1) for p in timeline.phases]
    timeline.alloc_at[:] = [a + 1 for a in timeline.alloc_at]
    timeline.free_at[:] = [f if f == -1 else f + 1 for f in timeline.free_at]
    timeline.phase_index[:] = [i + 1 for i in timeline.phase_index]
    timeline.num_events += 1
    if isinstance(timeline.meta.get("phase_flops"), list):
        timeline.meta["phase_flops"] = [0, *timeline.meta["phase_flops"]]
    for field, value in (("nbytes", nbytes), ("alloc_at", 0), ("free_at", 1), ("phase_index", 0),
                         ("module", INIT_MODULE), ("category", "parameters")):
        getattr(timeline, field).append(value)
    timeline.validate()


def _reduced(row: Callable[[int, str, str, int, int], None], u: Fsdp2Unit, size: int, block: int, at: int,
             index: int, last: int, precision: str) -> None:
    """The reduce-scatter's flat output: the first microbatch's is the sharded gradients (until the optimizer step
    copies them to fp32, or for good in an fp32 job), a later one's is added to them and freed."""
    nbytes = round_up(u.shard_elements * size, block)
    if index == 0:
        row(nbytes, SHARDED_GRADS_MODULE, "gradients", at, last if precision != "fp32" else -1)
    else:
        row(nbytes, REDUCE_OUTPUT_MODULE, "other", at, at + 1)


def _span(phases: list[tuple[str, str, int, int]], region: str | None,
          kinds: tuple[str, ...]) -> tuple[int, int] | None:
    """[first start, last end) of the phases of ``kinds`` in ``region`` (None: any region)."""
    hit = [(s, e) for k, r, s, e in phases if k in kinds and (region is None or r == region)]
    return (min(s for s, _ in hit), max(e for _, e in hit)) if hit else None


def _keep_traced_grad(timeline: Timeline, nbytes: int, start: int, end: int) -> bool:
    """Keep a traced vocabulary weight's gradient (the first row of its bytes made in [start, end), its unit's
    backward) to ``end``, as an unsharded gradient: it stays on the unsharded parameter until the unit's
    post-backward. False: none traced."""
    for i, (n, at) in enumerate(zip(timeline.nbytes, timeline.alloc_at)):
        if n == nbytes and start <= at < end and timeline.category[i] not in ("parameters", "gradients"):
            free = timeline.free_at[i]
            timeline.free_at[i] = end if free != -1 and free < end else free
            timeline.category[i], timeline.module[i] = "gradients", UNSHARDED_GRADS_MODULE
            return True
    return False
