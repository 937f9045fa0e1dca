"""What a Megatron rank holds with TransformerEngine CUDA graphs (``--cuda-graph-impl transformer_engine``,
``Job.cuda_graph_modules``): the capture before the first step, the static buffers, and the steady steps whose
graphed parts allocate nothing (after the eager warm-up steps, when there are some).

NOTE [TE CUDA graphs]
Sources: Megatron-LM d98e8a64 ``megatron/core/transformer/cuda_graphs.py`` (``TECudaGraphHelper``),
``transformer/transformer_layer.py``, ``transformer/module.py``, ``training/training.py``; TransformerEngine 2.17.1
(4329ff84) ``pytorch/graph.py``; PyTorch's ``c10/cuda/CUDACachingAllocator.cpp`` (a private pool's blocks are
counted in ``allocated_bytes`` like any other while a tensor holds them).

* When: with ``--cuda-graph-warmup-steps 0`` the graphs are captured at the start of the first iteration
  (training.py:4632-4645), before any optimizer step: Adam's moments (made by the first ``step()``) do not exist yet;
  the parameters, main grads, master parameters, the libraries' workspaces and FP8 weight copies do (TE's warm-up runs
  each callable eagerly first, graph.py:452-540). With ``--cuda-graph-warmup-steps N`` (Megatron's default 3,
  transformer_config.py:1066) N eager steps run first, optimizer steps included, and the capture comes at the start of
  step N + 1: the run is then the last warm-up step (a steady eager step for N >= 2; the first step, whose optimizer
  step makes the moments at its end, for N = 1), the capture with the moments, and the graphed steps. The peak since
  the process started is at least the eager step's.
* What is graphed: ``_layer_is_graphable`` (cuda_graphs.py:2134-2174): with ``attn`` every transformer layer's
  ``input_layernorm``, ``self_attention`` and its residual add (``_te_cuda_graph_capture`` runs
  ``_forward_attention``, transformer_layer.py:1283-1290), the MLP / MoE running eagerly after the replay
  (:1436-1455); with ``mlp`` a dense layer's ``pre_mlp_layernorm``, MLP and residual add; with ``moe_router`` a MoE
  layer's ``pre_mlp_layernorm``, shared experts and router, and with ``moe_preprocess`` the dispatcher's preprocess
  (moe_layer.py:656-674: the MoE forward returns early, moe_utils.py:1550-1598); the dispatch, routed experts, combine
  and residual add run eagerly after the replay (transformer_layer.py:1376-1428); with no scope the whole layer. The
  last chunk also graphs each MTP depth's ``mtp_model_layer`` (cuda_graphs.py:2265-2270) with the same scopes and its
  own static inputs (the last layer's spec); ``fp8_enabled`` per callable (cuda_graphs.py:2697-2712: the first/last
  bf16 layers in bf16, the MTP layers, index -1, in FP8, fp8_utils.py:711-727) is what the eager trace already runs
  (``ModelConfig.fp8_layers``; the MTP layers FP8). Where a graph and eager code interleave (``moe_router``, the MTP
  layer) the rows are told apart by module in the forward and, in the backward, by the saved tensor autograd frees
  next (:func:`split_graphed_rows`). Selective recompute of ``moe_act`` runs in the eager routed experts
  (transformer_config.py:2858-2870 allows a module wholly outside the graphs), so its rows stay eager. One graph per
  (layer, microbatch) (cuda_graphs.py:2815-2842), all in one private memory pool (graph.py:413), captured in the
  schedule's order (``convert_schedule_table_to_order``, cuda_graphs.py:2891: the same order as the step's; with pp =
  1 one microbatch only, cuda_graphs.py:2598-2601, replayed by every microbatch, module.py:321).
* The capture: each graph's forward allocates in the pool what the eager forward of its part allocates, its saved
  tensors alive until its backward is captured (the same events as the eager step's, in the same order); nothing
  outside the graphed parts runs. So the capture's live bytes are the model state (no moments before the first step),
  the static buffers and the graphed parts' tensors of the step. ``mem-max-allocated-bytes`` is the peak since the
  process started and may be the capture's.
* Static inputs (cuda_graphs.py:2322-2565, ``get_layer_static_inputs``, module.py:246-272 and
  transformer_layer.py:1212-1232): a bf16 ``hidden_states`` [s/cp (/tp under SP), b, h] per graph and, when the
  attention is graphed, a bool causal mask [b, 1, s/cp, s]; a (layer, microbatch) reuses the buffers of one whose
  backward has run (same shapes), so a rank holds as many sets as the schedule has graphed layer-forwards in flight at
  most (:func:`static_input_sets`). They stay allocated for the whole run (the graphs keep them). With rope (not MLA)
  a graph also takes ``rotary_pos_emb`` (cuda_graphs.py:2395-2427): the table ``RotaryEmbedding.forward`` caches
  (``lru_cache``, rotary_pos_embedding.py:177), the same tensor the layers read eagerly, so nothing more is held.
* Static grad outputs: one set per output signature, made outside the pool (``torch.empty_like``, graph.py:666-680
  with ``_reuse_graph_input_output_buffers``, which Megatron sets, cuda_graphs.py:2686): one hidden-sized bf16 tensor
  for a layer's output; a ``moe_router`` graph's outputs are the routed hidden states and probs, the shared experts'
  output and the residual (:func:`grad_output_bytes`). Static outputs and grad inputs live in the pool and are weak
  references once their backward is captured (graph.py:719-748), except the last backward's grad input, still held
  (one hidden-sized tensor).
* Steady steps: a replay allocates nothing; its outputs are views of pool memory (``o.detach()`` of weak references,
  graph.py:866). So the graphed parts' saved tensors and outputs never count again, and a graphed layer's input
  (copied into the static buffer, graph.py:842-848) is no longer kept for its backward: it dies when the replay
  returns, unless something outside the graph holds it.
* Not modelled: the private pool's segments stay reserved for the graphs after the capture (the eager step cannot use
  them), which the caching-allocator replay (remat.memory.reserved) does not keep apart: a graphed rank's reserved
  figure is a lower bound. With ``moe_preprocess`` the preprocess's forward rows (remat's permute of the routed copies
  and their probs, the row map, the count exchange: ``tp_moe.py`` before the first all-to-all) are not told apart from
  the eager dispatch's by module: they stay eager in the steady step (an upper bound by them) and out of the capture
  (their backward rows, freed before the router's saved tensors, are the graph's).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from remat.config import ModelConfig
from remat.job import Job
from remat.parallel.schedule import Action, ChunkSpec
from remat.timeline import Phase, Timeline
from remat.units import round_up

MODULE = "cuda_graphs.static_buffers"  # the static inputs, grad outputs and last grad input (whole run)
# submodules of a transformer layer outside the attention part (transformer_layer.py _forward_mlp)
_MLP_PARTS = ("pre_mlp_layernorm", "mlp", "mlp_bda")


# what a MoE layer's graph holds of its MLP part under the moe_router scope (transformer_layer.py:1296-1306 runs
# ``_forward_mlp``; moe_layer.py:656-674: shared_experts_compute, route, [preprocess], then the early return)
_ROUTER_PARTS = ("pre_mlp_layernorm", "mlp.router", "mlp.shared_experts")


@dataclass(frozen=True)
class GraphedLayer:
    """One layer Megatron graphs: its global index (-1 - depth for an MTP depth's ``mtp_model_layer``) and whether
    the graph holds its attention / its whole MLP / (a MoE layer under ``moe_router``) its pre-MLP layernorm,
    router and shared experts."""

    layer: int
    attention: bool
    mlp: bool
    router: bool = False


def graphed_layers(config: ModelConfig, modules: tuple[str, ...], specs: Sequence[ChunkSpec]) -> dict[int, list[
        GraphedLayer]]:
    """Each chunk's graphed layers (``_layer_is_graphable``, cuda_graphs.py:2134): ``()`` every layer whole; with
    ``attn`` every transformer layer's attention; with ``mlp`` every dense layer's MLP; with ``moe_router`` every
    MoE layer's pre-MLP layernorm, router and shared experts. The last chunk also graphs each MTP depth's
    ``mtp_model_layer`` (index ``-1 - depth``; cuda_graphs.py:2265-2270), built with the last layer's spec.

    Example:
        >>> from remat.parallel.schedule import partition
        >>> c = ModelConfig(num_layers=2)
        >>> [(g.layer, g.attention, g.mlp, g.router) for g in graphed_layers(c, ("attn",), partition(c, 1))[0]]
        [(0, True, False, False), (1, True, False, False)]
    """
    moe = config.moe_layer_pattern()
    out: dict[int, list[GraphedLayer]] = {}

    def graphed(k: int, index: int) -> GraphedLayer | None:
        attention = not modules or "attn" in modules
        mlp = not modules or ("mlp" in modules and not moe[k])
        router = "moe_router" in modules and moe[k]  # cuda_graphs.py:2163-2168
        return GraphedLayer(index, attention, mlp, router) if attention or mlp or router else None
    for spec in specs:
        layers = [g for k in range(spec.layer_offset, spec.layer_offset + spec.num_layers)
                  if (g := graphed(k, k)) is not None]
        if spec.is_last:  # each MTP depth's mtp_model_layer (cuda_graphs.py:2265-2270), the last layer's spec
            layers += [g for d in range(config.mtp_num_layers) if (g := graphed(config.num_layers - 1, -1 - d))]
        out[spec.index] = layers
    return out


def static_input_sets(actions: Sequence[Action], signatures: dict[int, list[tuple[int, ...]]]) -> dict[
        tuple[int, ...], int]:
    """How many static input sets of each signature Megatron allocates (``_get_sample_arguments``,
    cuda_graphs.py:2450-2563): along the order, a chunk's forward takes one set per graphed layer, reusing one
    whose backward has run (first in, first out) before allocating; a chunk's backward returns its oldest
    forward's sets.

    Args:
        actions: the capture's order (the step's actions; one microbatch with pp = 1).
        signatures: each chunk's graphed layers' input signatures (any hashable, in layer order).

    Example:
        >>> from remat.parallel.schedule import schedule_actions
        >>> acts = schedule_actions("1f1b", 2, 4, rank=0, runtime="megatron")  # 1 warm-up forward: 2 in flight
        >>> static_input_sets(acts, {0: [(1,), (1,)]})
        {(1,): 4}
    """
    queues: dict[int, list[tuple[tuple[int, ...], int]]] = {}
    consumed: dict[tuple[int, ...], int] = {}
    made: dict[tuple[int, ...], int] = {}
    for a in actions:
        sigs = signatures.get(a.chunk, [])
        if a.kind == "F":
            for sig in sigs:
                queues.setdefault(a.chunk, []).append((sig, 0))
                if consumed.get(sig):
                    consumed[sig] -= 1
                else:
                    made[sig] = made.get(sig, 0) + 1
        else:
            queue = queues.get(a.chunk, [])
            for sig, _ in queue[:len(sigs)]:
                consumed[sig] = consumed.get(sig, 0) + 1
            queues[a.chunk] = queue[len(sigs):]
    return made


def static_bytes(job: Job, block: int) -> tuple[int, int]:
    """(hidden_states bytes, causal-mask bytes) of one static input set, each rounded to ``block``
    (module.py:257-272: bf16 [s/cp (/tp with SP), b, h]; transformer_layer.py:1226-1231: bool [b, 1, s/cp, s])."""
    m = job.model
    s = m.seq_length // job.cp
    hidden = (s // job.tp if job.sp else s) * m.micro_batch_size * m.hidden_size * 2
    mask = m.micro_batch_size * s * m.seq_length

    def rounded(n: int) -> int:
        return round_up(n, block)
    return rounded(hidden), rounded(mask)


def grad_output_bytes(job: Job, g: GraphedLayer, block: int) -> tuple[int, ...]:
    """The signature (bytes of each tensor, rounded to ``block``) of a graph's static grad outputs, one per output
    that requires grad (graph.py:666-680): the layer's output; under ``moe_router`` (moe_utils.py:1550-1598 and
    transformer_layer.py:1376-1395) the routed path's hidden states and probs (the permuted copies and their fp32
    probs with ``moe_preprocess``; else the pre-MLP layernorm's output and the [tokens, experts] fp32 probs; the
    routing map and the dispatcher's attributes need no grad), the shared experts' output and the residual."""
    m = job.model
    hidden = static_bytes(job, block)[0]
    if not g.router:
        return (hidden,)
    tokens = hidden // (2 * m.hidden_size)

    def rounded(n: int) -> int:
        return round_up(n, block)
    routed = ((rounded(hidden * m.moe_router_topk), rounded(4 * tokens * m.moe_router_topk))
              if "moe_preprocess" in (job.cuda_graph_modules or ()) else
              (hidden, rounded(4 * tokens * (m.num_moe_experts or 1))))
    shared = (hidden,) if m.moe_shared_expert_intermediate_size is not None else ()
    return (*routed, *shared, hidden)


def _layer_of(region: str) -> int | None:
    parts = region.split()
    return int(parts[1]) if len(parts) == 2 and parts[0] == "layer" and parts[1].isdigit() else None


def _is_mlp_part(module: str) -> bool:
    parts = module.split(".")
    return any(p in _MLP_PARTS for p in parts)


def graphed_rows(tl: Timeline, graphed: dict[int, GraphedLayer]) -> tuple[set[int], dict[int, int]]:
    """The rows a graphed part makes (forward and backward), and the early frees of rows the graphs no longer keep.

    A layer's forward runs its attention, then its MLP (transformer_layer.py:798-894): the attention part is the
    rows made before the layer's first MLP row. Its backward runs the MLP's first: the attention part starts where
    the first tensor saved by the attention part's forward is freed. A row made elsewhere and freed inside a graphed
    backward part was kept only by the graph's saved tensors: it now dies where the matching forward part ends.

    Returns:
        (row indices made inside graphs, {row: new free event}).
    """
    by_phase: dict[int, list[int]] = {}
    for row, p in enumerate(tl.phase_index):
        by_phase.setdefault(p, []).append(row)
    spans = {i: (p.start, tl.phases[i + 1].start if i + 1 < len(tl.phases) else tl.num_events)
             for i, p in enumerate(tl.phases)}
    forward_of = {(p.region, p.detail): i for i, p in enumerate(tl.phases) if p.kind == "forward"}
    inside: set[int] = set()
    fwd_part: dict[int, tuple[int, int]] = {}  # forward phase -> graphed event span
    bwd_part: dict[int, tuple[int, int, int]] = {}  # backward phase -> (graphed span start, end, forward phase)
    for i, p in enumerate(tl.phases):
        k = _layer_of(p.region)
        if k is None or k not in graphed or p.kind not in ("forward", "backward"):
            continue
        g = graphed[k]
        rows = by_phase.get(i, [])
        start, end = spans[i]
        if p.kind == "forward":
            split = min((tl.alloc_at[r] for r in rows if _is_mlp_part(tl.module[r])), default=end)
            span = (start, end) if g.attention and g.mlp else (start, split) if g.attention else (split, end)
            fwd_part[i] = span
            inside.update(r for r in rows if span[0] <= tl.alloc_at[r] < span[1])
            continue
        f = forward_of.get((p.region, p.detail))
        if f is None:
            continue
        f_start, f_end = spans[f]
        f_split = min((tl.alloc_at[r] for r in by_phase.get(f, []) if _is_mlp_part(tl.module[r])), default=f_end)
        attention_frees = [tl.free_at[r] for r in by_phase.get(f, []) if tl.alloc_at[r] < f_split
                           and start <= tl.free_at[r] < end]
        split = min(attention_frees, default=end)
        span = (start, end) if g.attention and g.mlp else (split, end) if g.attention else (start, split)
        bwd_part[i] = (span[0], span[1], f)
        inside.update(r for r in rows if span[0] <= tl.alloc_at[r] < span[1])
    early: dict[int, int] = {}
    alloc, free = np.asarray(tl.alloc_at, dtype=np.int64), np.asarray(tl.free_at, dtype=np.int64)
    outside = np.ones(len(tl.nbytes), dtype=bool)
    outside[list(inside)] = False
    for lo, hi, f in bwd_part.values():
        if f not in fwd_part:
            continue
        f_lo, f_hi = fwd_part[f]
        for row in np.nonzero(outside & (free >= lo) & (free < hi) & (alloc < f_lo))[0]:
            early[int(row)] = max(f_hi - 1, int(alloc[row]) + 1)
    return inside, early


def _prefix(module: str) -> str | None:
    """The graph callable a row's module lies in: ``[chunkC.]layers.J`` or ``[chunkC.]mtp.D.mtp_model_layer``."""
    match = re.match(r"((?:chunk\d+\.)?(?:layers\.\d+|mtp\.\d+\.mtp_model_layer))(?:\.|$)", module)
    return match.group(1) if match else None


def _in_graph(rel: str, attention_part: bool, g: GraphedLayer) -> bool:
    """Whether a row of submodule ``rel`` of a graphed layer is made inside its graph."""
    if attention_part:
        return g.attention
    return g.mlp or (g.router and any(rel == p or rel.startswith(p + ".") for p in _ROUTER_PARTS))


def split_graphed_rows(tl: Timeline, graphed: dict[int, GraphedLayer]) -> tuple[set[int], dict[int, int]]:
    """:func:`graphed_rows` for the graphs whose forward and backward interleave with eager code: MoE layers under
    ``moe_router`` and the MTP depths' layers (whose rows share their chunk's phases).

    Forward: a row is the graph's by its module (the attention part: the rows before the layer's first MLP row;
    then the pre-MLP layernorm, router and shared experts, :data:`_ROUTER_PARTS`). In graph mode the replay runs
    them all before the eager dispatch (transformer_layer.py:1376-1428), so the replay returns at the layer's first
    eager row. Backward: autograd frees a node's saved tensors when the node is done, so a backward row belongs to
    the part whose forward row is freed next; where that and the part whose forward row was freed last in the
    backward disagree (a node that saved nothing, between the eager part and the graph's) the row is eager, and
    once all are freed the last part's (the graph's grad input). In graph mode the graph's
    backward (``Graphed.backward``, graph.py:870-895) runs once autograd has run the eager parts that consume its
    outputs; its rows never count in a steady step, so their order does not matter there. A row made
    before the graph and freed in its backward (attributed by the saved tensor freed just before it) was kept only
    by the graph: it now dies when the replay returns (graph.py:842-848). Recomputed rows are eager (the modelled
    recompute modules lie outside the graphs, :data:`remat.job_cuda_graphs.EAGER_RECOMPUTE_MODULES`).

    Args:
        tl: the rank's eager step.
        graphed: the graphed layers by global index (-1 - depth for MTP depths); others are ignored here.

    Returns:
        (row indices made inside graphs, {row: new free event}).
    """
    by_phase: dict[int, list[int]] = {}
    for row, p in enumerate(tl.phase_index):
        by_phase.setdefault(p, []).append(row)
    key = [(p.detail or "").split(":")[0] for p in tl.phases]
    # (forward phase, layer (-1: an MTP depth), its graph's forward rows, their first event, the replay's return)
    instances: list[tuple[int, int, set[int], int, int]] = []
    for i, p in enumerate(tl.phases):
        if p.kind != "forward":
            continue
        layer = _layer_of(p.region)
        groups: dict[str, list[int]] = {}
        for r in by_phase.get(i, []):
            prefix = _prefix(tl.module[r])
            if prefix is not None:
                groups.setdefault(prefix, []).append(r)
        for prefix, rows in groups.items():
            depth = re.search(r"(?:^|\.)mtp\.(\d+)\.", prefix)
            index = -1 - int(depth.group(1)) if depth else layer
            g = graphed.get(index) if index is not None else None
            if g is None or not (g.router or depth):
                continue
            rows.sort(key=lambda r: tl.alloc_at[r])
            rel = {r: tl.module[r][len(prefix) + 1:] for r in rows}
            split = min((tl.alloc_at[r] for r in rows if _is_mlp_part(rel[r])), default=tl.num_events)
            inside = {r for r in rows if _in_graph(rel[r], tl.alloc_at[r] < split, g)}
            if not inside:
                continue
            first = min(tl.alloc_at[r] for r in inside)
            eager = [tl.alloc_at[r] for r in rows if r not in inside and tl.alloc_at[r] > first]
            end = min(eager, default=max(tl.alloc_at[r] for r in inside) + 1)
            instances.append((i, -1 if depth else int(index), inside, first, end))
    owner = {r: n for n, inst in enumerate(instances) for r in inst[2]}
    inside_all: set[int] = set(owner)
    frees: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}  # forward phase -> (free event, owner, row)
    for i in {inst[0] for inst in instances}:
        kept = sorted((tl.free_at[r], owner.get(r, -1), r) for r in by_phase[i] if tl.free_at[r] != -1)
        frees[i] = (np.array([f for f, _, _ in kept], dtype=np.int64), np.array([o for _, o, _ in kept], dtype=int),
                    np.array([r for _, _, r in kept], dtype=int))
    # each instance's backward phases: its key's, in its layer's region (an MTP depth: outside the layers')
    backward_of: dict[tuple[str, int], int] = {(key[inst[0]], inst[1]): inst[0] for inst in instances}
    phases_of: dict[int, list[int]] = {}
    for i, p in enumerate(tl.phases):
        layer = _layer_of(p.region)
        f = backward_of.get((key[i], layer if layer is not None else -1))
        if p.kind == "backward" and f is not None:
            phases_of.setdefault(f, []).append(i)
    for f, phases in phases_of.items():
        at, own, _ = frees[f]
        begin = tl.phases[phases[0]].start
        for r in (r for i in phases for r in by_phase.get(i, [])):
            j = int(np.searchsorted(at, tl.alloc_at[r]))  # the saved tensors freed next and last (in the backward)
            after = int(own[j]) >= 0 if j < len(at) else None
            before = int(own[j - 1]) >= 0 if j > 0 and at[j - 1] >= begin else None
            # between a part's nodes both agree; a node that saved nothing between an eager part and the graph's
            # (the dispatch's all-to-all, the combine's sum) is eager: counted
            if (after if before is None else before if after is None else after and before):
                inside_all.add(r)
    early: dict[int, int] = {}
    alloc, free = np.asarray(tl.alloc_at, dtype=np.int64), np.asarray(tl.free_at, dtype=np.int64)
    starts = np.array([p.start for p in tl.phases], dtype=np.int64)
    for n, (i, _, _, first, end) in enumerate(instances):
        at, own, row_of = frees[i]
        lo = at[own == n].min(initial=tl.num_events)
        for row in np.nonzero((alloc < first) & (free >= lo))[0]:
            row = int(row)
            phase = int(np.searchsorted(starts, free[row], side="right")) - 1
            region = _layer_of(tl.phases[phase].region)
            if (row in inside_all or row in early or tl.phases[phase].kind != "backward"
                    or backward_of.get((key[phase], region if region is not None else -1)) != i):
                continue
            j = int(np.searchsorted(at, free[row], side="right")) - 1  # the saved tensor freed just before it
            while j >= 0 and int(row_of[j]) == row:
                j -= 1
            if j >= 0 and int(own[j]) == n:
                early[row] = max(end - 1, int(alloc[row]) + 1)
    return inside_all, early


def torch_gemms_in_graphs(job: Job) -> bool:
    """Whether a graphed part runs torch GEMMs (cuBLAS through PyTorch): TE's unfused attention (``baddbmm`` /
    ``bmm``) in a graphed attention, or Megatron's local layers."""
    modules = job.cuda_graph_modules or ()
    attention = not modules or "attn" in modules
    return job.model.transformer_impl == "local" or (attention and job.model.attention == "math")


def add_cuda_graphs(tl: Timeline, job: Job, specs: Sequence[ChunkSpec], capture: Sequence[Action], *, block: int,
                    moments_module: str, cublas_workspace: int = 0, cublas_module: str = "") -> Timeline:
    """The run of a graphed rank as one timeline (NOTE [TE CUDA graphs]): the capture, then a steady step.

    Args:
        tl: the rank's eager step with its model state (rows alive from event 0).
        job: the job (``job.cuda_graph_modules`` set).
        specs: the rank's chunks.
        capture: the capture's order (the step's actions; one microbatch with pp = 1).
        block: the allocator's block (static buffers are rounded to it).
        moments_module: the optimizer state's row module (made by the first step, after the capture).
        cublas_workspace: the bytes of one PyTorch cuBLAS workspace (per handle and stream, NOTE [GEMM
            workspaces]), when graphed parts run torch GEMMs (:func:`torch_gemms_in_graphs`); 0: none. TE's warm-up
            runs on a stream of its own (graph.py:452) and the capture on the capture stream (torch/cuda/graphs.py:
            423), each with the forward thread's and autograd's handles: four more workspaces, kept (the capture
            stream's in the pool until the graphs are reset: CUDAGraph.cpp ``clearCublasWorkspacesForStream``).
        cublas_module: the row module of those workspaces; the step's own (its main stream's, made from event 0
            in ``tl``) come with its first torch GEMM, after the capture. The other library buffers of ``tl``
            (TE's grouped-GEMM workspaces, the experts' dummy weight gradients) are counted from before the capture:
            an upper bound where only the step's eager parts make them.

    Returns:
        A timeline of ``(2 + w) x tl.num_events`` events, ``w`` = 1 when ``job.cuda_graph_warmup_steps`` > 0
        (else 0): the eager warm-up step (training.py:4632-4645: that many eager steps, their optimizer steps
        included, run before the capture; a step from the second on holds the moments, the first makes them at its
        end), the capture (the step's graphed rows at their own events, the state (the moments only after a
        warm-up), the static buffers), then the step without its graphed rows; ``meta['cuda_graphs']`` has the
        static buffers' counts and bytes.
    """
    modules = job.cuda_graph_modules or ()
    warmup = job.cuda_graph_warmup_steps
    layers = graphed_layers(job.model, modules, specs)
    graphed = {g.layer: g for chunk in layers.values() for g in chunk}
    hidden, mask = static_bytes(job, block)
    sigs = {c: [(hidden, mask if g.attention else 0) for g in chunk] for c, chunk in layers.items()}
    sets = static_input_sets(capture, sigs)
    inside, early = graphed_rows(tl, {k: g for k, g in graphed.items() if k >= 0 and not g.router})
    split_inside, split_early = split_graphed_rows(tl, graphed)
    inside |= split_inside
    early.update(split_early)
    n = tl.num_events
    o = n if warmup else 0  # the capture's first event
    first_layer = min((p.start for p in tl.phases if p.kind == "forward" and _layer_of(p.region) is not None),
                      default=0)
    out = Timeline(nbytes=[], alloc_at=[], free_at=[], phase_index=[], module=[], category=[], phases=[],
                   num_events=2 * n + o, meta=dict(tl.meta))
    if warmup:
        out.phases = list(tl.phases)
    out.phases += [Phase(p.start + o, "setup", f"cuda graph capture {p.region}".strip(),
                         p.detail and f"capture: {p.detail}") for p in tl.phases]
    out.phases[len(tl.phases) if warmup else 0] = Phase(o, "setup", "", "before the CUDA graph capture")
    cap = len(tl.phases) if warmup else 0  # the capture's first phase
    out.phases += [Phase(p.start + n + o, p.kind, p.region, p.detail) for p in tl.phases]
    base = cap + len(tl.phases)

    def add(nbytes: int, alloc: int, free: int, phase: int, module: str, category: str) -> None:
        out.add_row(nbytes, alloc, free, module, category, phase)

    for row in range(len(tl.nbytes)):
        nbytes, alloc, free = tl.nbytes[row], tl.alloc_at[row], tl.free_at[row]
        phase, module, category = tl.phase_index[row], tl.module[row], tl.category[row]
        moments = module == moments_module
        # the step's own torch cuBLAS workspaces (its main stream) come with its first torch GEMM
        late = moments or (module == cublas_module and alloc < first_layer)
        persistent = free == -1 and alloc < first_layer and not late
        if warmup:  # the eager warm-up step as it runs (the last of them); what it leaves goes on past the capture
            if persistent or late:  # with one warm-up step, the first: its optimizer step makes the moments and
                made = (n - 1 if moments else first_layer) if late and warmup == 1 else alloc  # its GEMMs the
                add(nbytes, made, -1, phase, module, category)  # torch cuBLAS workspaces
                continue
            add(nbytes, alloc, free if free != -1 else 2 * n, phase, module, category)  # held until the next step
        elif persistent:  # model state and what the warm-up made: alive through the capture
            add(nbytes, alloc, -1, phase, module, category)
            continue
        if row in inside:  # captured in the pool at its own events; never allocated by a replay
            add(nbytes, alloc + o, free + o if free != -1 else n - 1 + o if alloc < n - 1 else -1, phase + cap,
                module, category)
            continue
        if late:  # the moments: made by the first optimizer step
            add(nbytes, n, -1, base, module, category)
            continue
        free = early.get(row, free)
        add(nbytes, alloc + n + o, free + n + o if free != -1 else -1, phase + base, module, category)
    backward = min((p.start for p in tl.phases if p.kind == "backward"), default=0)
    for sig, count in sets.items():  # made before the capture (cuda_graphs.py:2803-2810), kept by the graphs
        add(count * sum(sig), o, -1, cap, MODULE, "other")
    forward = min((p.start for p in tl.phases if p.kind == "forward"), default=0)
    for event in (0, 0, forward, backward) if cublas_workspace else ():  # warm-up stream x 2, capture stream x 2
        add(cublas_workspace, event + o, -1, cap, cublas_module, "other")
    # one grad-output set per output signature (graph.py:666-680, _reuse_graph_input_output_buffers)
    outputs = {grad_output_bytes(job, g, block) for g in graphed.values()}
    add(sum(sum(sig) for sig in outputs), backward + o, -1, cap, MODULE, "other")
    add(hidden, n - 1 + o, -1, cap, MODULE, "other")  # the last captured backward's grad input (graph.py:735-748)
    out.meta["cuda_graphs"] = {"modules": list(modules), "graphed_layers": sorted(graphed),
                               "static_input_sets": sum(sets.values()), "hidden_bytes": hidden, "mask_bytes": mask,
                               "grad_output_bytes": sum(sum(sig) for sig in outputs),
                               "static_bytes": sum(c * sum(s) for s, c in sets.items())
                               + sum(sum(sig) for sig in outputs) + hidden,
                               "capture_events": n, "warmup_steps": warmup, "capture_start": o}
    out.validate()
    peak = out.peak_event  # where the run peaks: an eager warm-up step, the capture or a steady graphed step
    out.meta["cuda_graphs"]["peak_in"] = ("eager warm-up step" if peak < o else "capture" if peak < o + n
                                          else "steady step")
    return out
