"""The unit model: a layer's memory cut from fake traces into units that a plan keeps, recomputes or offloads."""

from __future__ import annotations

import bisect
import re
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from remat.config import ModelConfig
from remat.memory import disk_cache
from remat.memory.kernels import resolve_kernels
from remat.plan.space import SELECTIVE_SETS, contraction_sets
from remat.plan.unit_trace import UnitMarks, layer_contractions, marked_trace
from remat.policy import ENGINES
from remat.recompute.plan_format import KEEP, PlanError, Unit, checkpoints_layer_inputs
from remat.timeline import Timeline

NO_EVENT = -(1 << 62)  # the "highest point" of a block without events
SIDE_MASK, SIDE_ROTARY = "mask", "rotary"  # side inputs of a layer a unit may depend on


def unit_holds(unit: Unit, classes: Iterable[str]) -> frozenset[str]:
    """The side inputs ``unit`` keeps for its backward. Every layer keeps the rotary tables (rope multiplies the
    queries and keys by them outside the attention core, and a checkpoint keeps its inputs); the causal mask is
    kept only by checkpoints whose inputs include it: groups, and selective layers that recompute core_attn or
    checkpoint the whole layer (non_matmul, keep_ops)."""
    out = set()
    whole_or_core = unit.is_group or (unit.mode == "selective" and checkpoints_layer_inputs(unit.modules))
    for c in classes:
        if c == SIDE_ROTARY or (c == SIDE_MASK and whole_or_core):
            out.add(c)
    return frozenset(out)


@dataclass(frozen=True)
class Block:
    """A run of a step's events: ``net`` bytes it leaves allocated, ``high`` its highest point (both relative to
    the live bytes when it starts; ``high`` is :data:`NO_EVENT` for an empty block)."""

    net: int
    high: int

    @staticmethod
    def of(deltas: np.ndarray) -> Block:
        if len(deltas) == 0:
            return Block(0, NO_EVENT)
        c = np.cumsum(deltas)
        return Block(int(c[-1]), int(c.max()))

    def then(self, other: Block) -> Block:
        high = self.high if other.high == NO_EVENT else max(self.high, self.net + other.high)
        return Block(self.net + other.net, high)


@dataclass(frozen=True)
class UnitShape:
    """What one unit does to the live bytes: its forward block, its backward block (recomputation included, side
    inputs alive throughout), and the FLOPs it recomputes."""

    forward: Block
    backward: Block
    recompute_flops: int
    recompute_bytes: int = 0  # bytes the recomputation allocates (a proxy for its element-wise work)


@dataclass
class _Piece:
    offset: int | None  # layer within the unit (None: before its first layer's phases)
    block: Block
    flops: int          # FLOPs recomputed in it
    remat_bytes: int    # bytes allocated by recomputation in it


def _deltas(tl: Timeline) -> np.ndarray:
    d = np.zeros(tl.num_events, dtype=np.int64)
    nbytes = np.asarray(tl.nbytes, dtype=np.int64)
    np.add.at(d, np.asarray(tl.alloc_at, dtype=np.int64), nbytes)
    free = np.asarray(tl.free_at, dtype=np.int64)
    freed = free >= 0
    np.add.at(d, free[freed], -nbytes[freed])
    return d


def _pieces(tl: Timeline, d: np.ndarray, lo: int, hi: int, first_layer: int) -> list[_Piece]:
    """The events ``lo .. hi-1`` cut at the recorder's phase starts; each piece names its layer within the unit."""
    flops = tl.meta.get("phase_flops", [0] * len(tl.phases))
    starts = [p.start for p in tl.phases]
    cuts = sorted({lo, hi, *(s for s in starts if lo < s < hi)})
    out = []
    for a, b in zip(cuts, cuts[1:]):
        p = max(0, bisect.bisect_right(starts, a) - 1)
        phase = tl.phases[p]
        offset = int(phase.region[6:]) - first_layer if phase.region.startswith("layer ") else None
        if offset is not None and offset < 0:
            offset = None
        counted = flops[p] if phase.kind == "recompute" and phase.start == a else 0
        remat = int(d[a:b][d[a:b] > 0].sum()) if phase.kind == "recompute" else 0
        out.append(_Piece(offset, Block.of(d[a:b]), counted, remat))
    return out


def _expand(pieces: list[_Piece], size: int, traced_size: int) -> tuple[Block, int, int]:
    """A group's block for ``size`` layers from the pieces of a traced group of ``traced_size`` >= 3 layers: the
    pieces of its middle layers (offsets 1 .. traced_size-2) stand for any middle layer."""
    if traced_size < 3 or size < 3:
        raise ValueError("group expansion needs traced and target groups of at least 3 layers")
    block, flops, remat = Block(0, NO_EVENT), 0, 0
    i = 0
    while i < len(pieces):
        piece = pieces[i]
        if piece.offset is not None and 1 <= piece.offset <= traced_size - 2:
            run = [piece]
            while i + 1 < len(pieces) and pieces[i + 1].offset is not None and \
                    1 <= pieces[i + 1].offset <= traced_size - 2:
                i += 1
                run.append(pieces[i])
            # the run covers traced_size-2 middle layers, in order or reversed; one layer's share repeats
            per_layer = [p for p in run if p.offset == run[0].offset]
            for _ in range(size - 2):
                for p in per_layer:
                    block, flops, remat = block.then(p.block), flops + p.flops, remat + p.remat_bytes
        else:
            block, flops, remat = block.then(piece.block), flops + piece.flops, remat + piece.remat_bytes
        i += 1
    return block, flops, remat


# NOTE [the unit model]: built from three fake traces (FakeTensorMode, once per model shape): two profile stacks that
# hold each kind of unit once above a checkpointed layer (a kept layer, a selective layer per module set, and
# checkpoint/offload groups of 1, 2 and 3 layers, larger groups repeating a middle layer's events; in two stacks that
# two cores trace side by side, remat.plan.unit_prefetch: layer_stack, group_stack), cut at unit boundaries marked by
# module hooks (remat.plan.unit_trace.marked_trace) into per-unit forward and backward event blocks (each block's net
# bytes, its highest point and the FLOPs it recomputes), and a plain two-layer stack for the head when no unit keeps the
# attention mask. A step's live bytes are then a sum of blocks in execution order (setup and embedding, each unit's
# forward bottom-up, the head's forward and backward, each unit's backward top-down, the embedding's backward), plus two
# non-local terms handled exactly: parameter gradients accumulate (a fixed amount per layer) and the attention mask /
# rotary tables live until the lowest unit that keeps them has run its backward. The one known approximation: those side
# inputs are taken to be freed at the *end* of their lowest holder's backward, which can only over-estimate, by their
# bytes. With tp/sp the traces are of one tensor-parallel rank (remat.models.tensor_parallel on a simulated group).
@dataclass
class UnitModel:
    """The memory model of one training step of the reference GPT, assembled from unit blocks (NOTE [the unit
    model]). Built by :func:`unit_model` from fake traces; exact where the tests say so."""

    config: ModelConfig
    device: str
    engine: str
    setup_fixed: int                 # bytes allocated before the forward outside the layers (embedding, head...)
    setup_per_layer: int             # ... and per layer (parameters, buffers)
    embedding: Block                 # the embedding's forward
    head_forward: dict[frozenset[str], Block]  # by the side inputs some unit keeps
    head_backward: Block
    tail: Block                      # the embedding's backward to the end of the step
    grad_per_layer: int              # bytes a layer leaves allocated after its forward and backward (its .grad)
    side: dict[str, int]             # bytes of each side input
    hidden_bytes: int                # one group input (the hidden states): what offloading moves
    layer_forward_flops: int
    layer_backward_flops: int
    contractions: tuple[int, ...] = ()  # the layer's matmul contraction sizes (its matmul_k<K> options)
    tp: int = 1                         # one tensor-parallel rank of tp (sp: sequence-parallel)
    sp: bool = False
    shapes: dict[Unit, UnitShape] = field(default_factory=dict)
    group_pieces: dict[str, tuple[list[_Piece], list[_Piece], int]] = field(default_factory=dict)
    build_seconds: float = 0.0
    _holds: dict[Unit, frozenset[str]] = field(default_factory=dict, compare=False, repr=False)

    def setup(self, num_layers: int) -> int:
        return self.setup_fixed + self.setup_per_layer * num_layers

    def holds(self, unit: Unit) -> frozenset[str]:
        found = self._holds.get(unit)
        if found is None:
            found = self._holds[unit] = unit_holds(unit, self.side)
        return found

    def shape(self, unit: Unit) -> UnitShape:
        """The unit's shape; groups larger than the traced ones are expanded from their middle layers."""
        found = self.shapes.get(unit)
        if found is not None:
            return found
        if not unit.is_group or unit.mode not in self.group_pieces:
            raise PlanError(f"the unit model has no {unit} (engine {self.engine})")
        fwd_pieces, bwd_pieces, traced = self.group_pieces[unit.mode]
        fwd, _, _ = _expand(fwd_pieces, unit.size, traced)
        bwd, flops, remat = _expand(bwd_pieces, unit.size, traced)
        shape = UnitShape(fwd, bwd, flops, remat)
        self.shapes[unit] = shape
        return shape

    def peak(self, units: Sequence[Unit]) -> int:
        """The modelled peak of the plan ``units`` (bottom-up): the step's blocks in execution order."""
        return self.walk(units)[0]

    def beyond_rank(self, units: Sequence[Unit]) -> int:
        """The most bytes the modelled peak of ``units`` holds that a Megatron rank does not:
        :meth:`held_beyond_rank` of the layers whose backward has begun by then (NOTE [the Megatron screen of a
        stage] in remat.plan.megatron_screen)."""
        return self.held_beyond_rank(self.walk(units)[2])

    def held_beyond_rank(self, layers: int) -> int:
        """The most bytes the model holds that a Megatron rank does not once ``layers`` layers' backwards have begun:
        their .grad (the rank's DDP hook moves it to the main-gradient buffer) and the side inputs; with every layer
        of a stack, the most at any point of its step (a screen's whole slack)."""
        return layers * self.grad_per_layer + sum(self.side.values())

    def walk(self, units: Sequence[Unit]) -> tuple[int, str, int]:
        """``(peak, where, begun)``: the modelled peak, the block it is in and how many layers' backwards have
        begun by then."""
        L = sum(u.size for u in units)
        level = self.setup(L)
        best, tag = level + max(self.embedding.high, 0), ("forward embedding", -1)
        begun = begun_at_best = 0

        def visit(block: Block, at: tuple[str, int]) -> None:  # the block's label is made only for the answer
            nonlocal level, best, tag, begun_at_best
            if block.high != NO_EVENT and level + block.high > best:
                best, tag, begun_at_best = level + block.high, at, begun
            level += block.net

        visit(self.embedding, ("forward embedding", -1))
        shapes: list[UnitShape] = []
        holds: list[frozenset[str]] = []
        prev = None
        for u in units:  # plans repeat the same Unit object in runs: look each run up once
            if u is not prev:
                shape, hold, prev = self.shape(u), self.holds(u), u
            shapes.append(shape)
            holds.append(hold)
        for j, shape in enumerate(shapes):
            visit(shape.forward, ("forward", j))
        below: list[frozenset[str]] = []
        held: frozenset[str] = frozenset()
        for h in holds:
            below.append(held)
            held = held | h
        visit(self.head_forward[held], ("forward head", -1))
        visit(self.head_backward, ("backward head", -1))
        for j in reversed(range(len(units))):
            begun += units[j].size
            visit(shapes[j].backward, ("backward", j))
            for c in holds[j] - below[j]:  # the lowest holder frees the side input at its end
                level -= self.side[c]
        visit(self.tail, ("backward embedding", -1))
        kind, j = tag
        return best, kind if j < 0 else f"{kind} {units[j]} at layer {sum(u.size for u in units[:j])}", begun_at_best


UNIT_MODELS: dict[tuple[ModelConfig, str, str, int, bool], UnitModel] = {}
# unit models being built elsewhere (remat.plan.unit_prefetch): for each key, what waits for it (None: build here)
PENDING: dict[tuple[ModelConfig, str, str, int, bool], Callable[[], UnitModel | None]] = {}


def unit_model_key(config: ModelConfig, device: str, engine: str, tp: int, sp: bool) -> tuple[Any, ...]:
    """What :func:`unit_model` keeps its answer under (:data:`UNIT_MODELS`, :data:`PENDING`)."""
    return (config.replace(num_layers=1), device, engine, tp, sp)


def unit_model_disk_key(key: tuple[Any, ...]) -> dict[str, Any]:
    """What :func:`unit_model` keeps its answer under on disk (:mod:`remat.memory.disk_cache`)."""
    return {"config": key[0].to_dict(), "device": key[1], "engine": key[2], "tp": key[3], "sp": key[4],
            "kernels": resolve_kernels(None, key[1])}


def unit_model(config: ModelConfig, *, device: str = "cpu", engine: str = "reentrant", tp: int = 1,
               sp: bool = False) -> UnitModel:
    """The :class:`UnitModel` of ``config``'s layers (any depth), built from three fake traces and cached; with
    ``tp``/``sp``, of one tensor-parallel rank."""
    key = unit_model_key(config, device, engine, tp, sp)
    if key in UNIT_MODELS:
        return UNIT_MODELS[key]
    if device not in ("cpu", "cuda"):
        raise PlanError(f"device={device!r}: plans are predicted for 'cpu' (exact bytes) or 'cuda' (512-byte blocks)")
    if engine not in ENGINES:
        raise PlanError(f"unknown engine {engine!r}: use {' or '.join(ENGINES)}")
    disk_key = unit_model_disk_key(key)
    waiting = PENDING.pop(key, None)
    if waiting is not None:  # being built elsewhere (remat.plan.unit_prefetch)
        model = waiting()
        if model is not None:
            UNIT_MODELS[key] = model
            disk_cache.store("unit_model", disk_key, model_to_dict(model))
            return model
    stored = disk_cache.load("unit_model", disk_key)
    if stored is not None:
        try:
            UNIT_MODELS[key] = model_from_dict(stored)
            return UNIT_MODELS[key]
        except (KeyError, TypeError, ValueError) as err:
            warnings.warn(f"remat cache: a stored unit model is malformed ({err}); rebuilding it", stacklevel=2)
    UNIT_MODELS[key] = model = _build_unit_model(config, device, engine, tp, sp)
    disk_cache.store("unit_model", disk_key, model_to_dict(model))
    return model


# the selective sets at the end of SELECTIVE_SETS traced in the group stack, so that the two stacks' traces take about
# as long (the layer stack's process also traces the plain stack): the same shapes either way (each unit is cut from
# its own layer's events above a checkpointed one)
SETS_WITH_GROUPS = 3


def _selective_sets(config: ModelConfig) -> tuple[tuple[str, ...], ...]:
    # an MoE layer has no dense MLP activation to recompute ('act'; Megatron's moe_act is its experts' own)
    return tuple(s for s in SELECTIVE_SETS if not (config.is_moe and "act" in s))


def layer_stack(config: ModelConfig, contractions: tuple[int, ...]) -> list[Unit]:
    """The first profile stack of a unit model (NOTE [the unit model]): a checkpointed layer at the bottom (it keeps
    every side input, so no unit above is the lowest holder), a kept layer, the selective sets but the last
    :data:`SETS_WITH_GROUPS`, the matmul sets of the layer's ``contractions``."""
    sets = _selective_sets(config)[:-SETS_WITH_GROUPS] + contraction_sets(contractions)
    return [Unit("checkpoint", 1), KEEP, *(Unit("selective", 1, s) for s in sets)]


def group_stack(config: ModelConfig, engine: str) -> list[Unit]:
    """The second profile stack of a unit model, above a checkpointed layer: the last :data:`SETS_WITH_GROUPS`
    selective sets, then checkpoint (and, with the reentrant engine, offload) groups of 1, 2 and 3 layers (a middle
    layer first appears at 3)."""
    modes = ("checkpoint", "offload") if engine == "reentrant" else ("checkpoint",)
    sets = _selective_sets(config)[-SETS_WITH_GROUPS:]
    return [Unit("checkpoint", 1), *(Unit("selective", 1, s) for s in sets),
            *(Unit(m, k) for m in modes for k in (1, 2, 3))]


StackShapes = tuple[dict[Unit, UnitShape], dict[str, tuple[list[_Piece], list[_Piece], int]]]


def stack_shapes(config: ModelConfig, stack: Sequence[Unit], *, device: str, engine: str, tp: int,
                 sp: bool) -> StackShapes:
    """The shapes of ``stack``'s units above its bottom layer, and the pieces of its 3-layer groups (expanded to
    larger groups), from one marked trace."""
    tl, marks = marked_trace(config, stack, device=device, engine=engine, tp=tp, sp=sp)
    return _cut_units(tl, _deltas(tl), marks, stack)


def _cut_units(tl: Timeline, d: np.ndarray, marks: UnitMarks, stack: Sequence[Unit]) -> StackShapes:
    n = len(stack)
    shapes: dict[Unit, UnitShape] = {}
    pieces: dict[str, tuple[list[_Piece], list[_Piece], int]] = {}
    at = stack[0].size
    for u in range(1, n):  # the bottom copy is the lowest holder of the side inputs: its shape is not a unit's
        fwd = _pieces(tl, d, marks.forward[u], marks.forward[u + 1] if u + 1 < n else marks.head, at)
        bwd = _pieces(tl, d, marks.backward[u], marks.backward[u - 1], at)
        shapes[stack[u]] = UnitShape(_chain(fwd), _chain(bwd), sum(p.flops for p in bwd),
                                     sum(p.remat_bytes for p in bwd))
        if stack[u].is_group and stack[u].size == 3:
            pieces[stack[u].mode] = (fwd, bwd, 3)
        at += stack[u].size
    return shapes, pieces


def _build_unit_model(config: ModelConfig, device: str, engine: str, tp: int, sp: bool) -> UnitModel:
    start = time.perf_counter()
    model = base_unit_model(config, device=device, engine=engine, tp=tp, sp=sp)
    groups = stack_shapes(config, group_stack(config, engine), device=device, engine=engine, tp=tp, sp=sp)
    return finish_unit_model(model, groups, time.perf_counter() - start)


def base_unit_model(config: ModelConfig, *, device: str, engine: str, tp: int, sp: bool) -> UnitModel:
    """A unit model without the units of the group stack (:func:`finish_unit_model` adds them): the step's blocks
    outside the layers and the units of :func:`layer_stack`, from its trace and a plain two-layer stack's."""
    contractions = layer_contractions(config, tp, sp)
    units = layer_stack(config, contractions)
    tl, marks = marked_trace(config, units, device=device, engine=engine, tp=tp, sp=sp)
    d = _deltas(tl)
    n = len(units)
    L = sum(u.size for u in units)
    head_bwd = next(p.start for p in tl.phases if p.kind == "backward" and p.region == "head")

    # the plain two-layer stack: what the head does when no unit keeps the mask, and the side inputs' bytes
    plain, plain_marks = marked_trace(config, [KEEP, KEEP], device=device, engine=engine, tp=tp, sp=sp)
    pd = _deltas(plain)
    plain_head_bwd = next(p.start for p in plain.phases if p.kind == "backward" and p.region == "head")
    side = {SIDE_MASK: 0, SIDE_ROTARY: 0}
    setup_end = next(p.start for p in plain.phases if p.kind == "forward")
    for row in range(len(plain)):
        a, f = plain.alloc_at[row], plain.free_at[row]
        if setup_end <= a < plain_marks.forward[0] and plain.module[row] == "" and (
                f < 0 or f >= plain_marks.forward[0]):
            side[SIDE_MASK if plain_marks.head <= f < plain_head_bwd else SIDE_ROTARY] += plain.nbytes[row]
    side = {c: b for c, b in side.items() if b}

    setup_rows = [r for r in range(len(tl)) if tl.alloc_at[r] < setup_end_of(tl)]
    per_layer = sum(tl.nbytes[r] for r in setup_rows if re.match(r"layers\.0(\.|$)", tl.module[r]))
    setup_total = int(d[:setup_end_of(tl)].sum())
    model = UnitModel(
        config=config.replace(num_layers=1), device=device, engine=engine,
        setup_fixed=setup_total - per_layer * L, setup_per_layer=per_layer,
        embedding=Block.of(d[setup_end_of(tl):marks.forward[0]]),
        head_forward={}, head_backward=Block.of(d[head_bwd:marks.backward[n - 1]]),
        tail=Block.of(d[marks.embedding:]), grad_per_layer=0, side=side, hidden_bytes=0,
        layer_forward_flops=0, layer_backward_flops=0, contractions=contractions, tp=tp, sp=sp)
    all_held = frozenset(side)
    model.head_forward[all_held] = Block.of(d[marks.head:head_bwd])
    plain_held = unit_holds(KEEP, side)
    if plain_held != all_held:
        model.head_forward[plain_held] = Block.of(pd[plain_marks.head:plain_head_bwd])
        freed = sum(side[c] for c in all_held - plain_held)
        if model.head_forward[plain_held].net != model.head_forward[all_held].net - freed:
            raise RuntimeError("remat.plan: the head's forward frees other bytes than the unkept side inputs; the "
                               "unit model does not describe this model")
    model.shapes, model.group_pieces = _cut_units(tl, d, marks, units)
    flops, starts = tl.meta.get("phase_flops", [0] * len(tl.phases)), [p.start for p in tl.phases]
    u = units.index(KEEP)
    fwd_end, bwd_end = marks.forward[u + 1] if u + 1 < n else marks.head, marks.backward[u - 1]
    for p, phase in enumerate(tl.phases):
        if marks.forward[u] <= starts[p] < fwd_end and phase.kind == "forward":
            model.layer_forward_flops += flops[p]
        if marks.backward[u] <= starts[p] < bwd_end and phase.kind == "backward":
            model.layer_backward_flops += flops[p]
    keep = model.shapes[KEEP]
    model.grad_per_layer = keep.forward.net + keep.backward.net
    return model


def finish_unit_model(model: UnitModel, groups: StackShapes, seconds: float) -> UnitModel:
    """``model`` (:func:`base_unit_model`) with the shapes ``groups`` of the group stack's units (:func:`stack_shapes`
    of :func:`group_stack`) added, and every unit checked; ``seconds`` the time the two took."""
    model.shapes.update(groups[0])
    model.group_pieces.update(groups[1])
    for unit, shape in model.shapes.items():
        if shape.forward.net + shape.backward.net != model.grad_per_layer * unit.size:
            raise RuntimeError(f"remat.plan: unit {unit} leaves {shape.forward.net + shape.backward.net} bytes after "
                               f"its step, not {unit.size} x {model.grad_per_layer}; the unit model does not describe "
                               "this model")
    model.hidden_bytes = model.shapes[Unit("checkpoint", 1)].forward.net - (
        model.shapes[Unit("offload", 1)].forward.net if Unit("offload", 1) in model.shapes else 0)
    model.build_seconds = seconds
    return model


def add_traced_units(model: UnitModel, units: Sequence[Unit]) -> list[Unit]:
    """Add the shapes of the single-layer ``units`` ``model`` lacks (keep_ops kinds, remat.plan.operator_space),
    traced in one profile stack above a checkpointed layer as :func:`unit_model` traces its own kinds; cached
    on disk under the model's key and the units. Returns the ``units`` the model has now: a unit that leaves
    other bytes after its step than a layer's gradients (its blocks would depend on its neighbours) is left out."""
    todo = sorted({u for u in units if u not in model.shapes}, key=str)
    if not todo:
        return [u for u in units if u in model.shapes]
    key = {"config": model.config.to_dict(), "device": model.device, "engine": model.engine, "tp": model.tp,
           "sp": model.sp, "kernels": resolve_kernels(None, model.device), "units": [str(u) for u in todo]}
    stored = disk_cache.load("unit_shapes", key)
    try:
        shapes = None if stored is None else {_unit_of(u): UnitShape(_block_of(f), _block_of(b), int(fl), int(by))
                                              for u, f, b, fl, by in stored}
    except (KeyError, TypeError, ValueError):
        shapes = stored = None
    while shapes is None and todo:
        stack = [Unit("checkpoint", 1), *todo]  # the bottom layer keeps every side input, as in _build_unit_model
        shapes = stack_shapes(model.config, stack, device=model.device, engine=model.engine, tp=model.tp,
                              sp=model.sp)[0]
        # a unit that leaves other bytes after its step than a layer's gradients frees (or keeps) something of its
        # neighbour's, so its blocks and the one above's depend on the neighbours: leave it out and trace again
        odd = [u for u, sh in shapes.items() if sh.forward.net + sh.backward.net != model.grad_per_layer]
        if odd:
            todo, shapes = [u for u in todo if u not in odd], None
    if shapes is not None and stored is None:
        disk_cache.store("unit_shapes", key, [[_unit_json(u), [sh.forward.net, sh.forward.high], [
            sh.backward.net, sh.backward.high], sh.recompute_flops, sh.recompute_bytes] for u, sh in shapes.items()])
    model.shapes.update(shapes or {})
    return [u for u in units if u in model.shapes]


# ------------------------------------------------------------------------------------------------ JSON form
def _unit_json(unit: Unit) -> list[Any]:
    return [unit.mode, unit.size, list(unit.modules)]


def _unit_of(data: list[Any]) -> Unit:
    return Unit(str(data[0]), int(data[1]), tuple(str(m) for m in data[2]))


def _block_of(data: list[Any]) -> Block:
    return Block(int(data[0]), int(data[1]))


def _piece_json(p: _Piece) -> list[Any]:
    return [p.offset, p.block.net, p.block.high, p.flops, p.remat_bytes]


def _piece_of(data: list[Any]) -> _Piece:
    return _Piece(None if data[0] is None else int(data[0]), Block(int(data[1]), int(data[2])), int(data[3]),
                  int(data[4]))


def model_to_dict(model: UnitModel) -> dict[str, Any]:
    """The JSON form of ``model`` (what the disk cache keeps; :func:`model_from_dict` reads it back equal)."""
    return {
        "config": model.config.to_dict(), "device": model.device, "engine": model.engine,
        "setup_fixed": model.setup_fixed, "setup_per_layer": model.setup_per_layer,
        "embedding": [model.embedding.net, model.embedding.high],
        "head_forward": [[sorted(k), [b.net, b.high]] for k, b in model.head_forward.items()],
        "head_backward": [model.head_backward.net, model.head_backward.high],
        "tail": [model.tail.net, model.tail.high], "grad_per_layer": model.grad_per_layer, "side": model.side,
        "hidden_bytes": model.hidden_bytes, "layer_forward_flops": model.layer_forward_flops,
        "layer_backward_flops": model.layer_backward_flops, "contractions": list(model.contractions),
        "tp": model.tp, "sp": model.sp, "build_seconds": model.build_seconds,
        **stack_shapes_to_json((model.shapes, model.group_pieces)),
    }


def stack_shapes_to_json(found: StackShapes) -> dict[str, Any]:
    """The JSON form of unit shapes and group pieces (``shapes`` and ``group_pieces`` of :func:`model_to_dict`)."""
    shapes, pieces = found
    return {"shapes": [[_unit_json(u), [sh.forward.net, sh.forward.high], [sh.backward.net, sh.backward.high],
                        sh.recompute_flops, sh.recompute_bytes] for u, sh in shapes.items()],
            "group_pieces": {mode: [[_piece_json(p) for p in fwd], [_piece_json(p) for p in bwd], traced]
                             for mode, (fwd, bwd, traced) in pieces.items()}}


def stack_shapes_from_json(data: dict[str, Any]) -> StackShapes:
    """:func:`stack_shapes_to_json`'s form read back (KeyError/TypeError/ValueError when malformed)."""
    return ({_unit_of(u): UnitShape(_block_of(f), _block_of(b), int(fl), int(by))
             for u, f, b, fl, by in data["shapes"]},
            {str(mode): ([_piece_of(p) for p in fwd], [_piece_of(p) for p in bwd], int(traced))
             for mode, (fwd, bwd, traced) in data["group_pieces"].items()})


def model_from_dict(data: dict[str, Any]) -> UnitModel:
    """:func:`model_to_dict`'s form read back (KeyError/TypeError/ValueError when malformed)."""
    shapes, pieces = stack_shapes_from_json(data)
    return UnitModel(
        config=ModelConfig.from_dict(data["config"]), device=str(data["device"]), engine=str(data["engine"]),
        setup_fixed=int(data["setup_fixed"]), setup_per_layer=int(data["setup_per_layer"]),
        embedding=_block_of(data["embedding"]),
        head_forward={frozenset(k): _block_of(b) for k, b in data["head_forward"]},
        head_backward=_block_of(data["head_backward"]), tail=_block_of(data["tail"]),
        grad_per_layer=int(data["grad_per_layer"]), side={str(k): int(v) for k, v in data["side"].items()},
        hidden_bytes=int(data["hidden_bytes"]), layer_forward_flops=int(data["layer_forward_flops"]),
        layer_backward_flops=int(data["layer_backward_flops"]),
        contractions=tuple(int(k) for k in data["contractions"]), tp=int(data["tp"]), sp=bool(data["sp"]),
        shapes=shapes, group_pieces=pieces, build_seconds=float(data["build_seconds"]))


def setup_end_of(tl: Timeline) -> int:
    """The first event after setup (the forward's start)."""
    return next(p.start for p in tl.phases if p.kind == "forward")


def _chain(pieces: Sequence[_Piece]) -> Block:
    block = Block(0, NO_EVENT)
    for p in pieces:
        block = block.then(p.block)
    return block
