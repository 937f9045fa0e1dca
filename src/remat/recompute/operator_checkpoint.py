"""The engine of operator-level regions (``selective/non_matmul`` and ``selective/keep_ops(...)``): a selective
activation checkpoint that keeps the outputs of the operators a rule picks (matrix multiplies; operators by index)
and recomputes every other operator of the region in backward."""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils.checkpoint
from torch._C._autograd import _make_saved_tensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import SAC_IGNORED_OPS

from remat.models.collectives import in_collective, replaying
from remat.recompute.operators import MATMUL_OVERLOADS, contraction

Keeps = Callable[[Any, tuple[Any, ...]], bool]


class OperatorCheckpointError(RuntimeError):
    """The recomputation of an operator-level region did not replay its forward; the message says what to change."""


# NOTE [the operator checkpoint]
# checkpoint_operators has the semantics of torch.utils.checkpoint.checkpoint(use_reentrant=False) with
# create_selective_checkpoint_contexts, and the same tensors live at every moment (so measured and predicted bytes
# are those of torch's selective checkpointing), with less Python work per operator. torch's pair of dispatch modes
# keys a cache by operator and count, builds a SelectiveCheckpointContext and calls the policy at every operator in
# forward, and looks every operator up in the cache in the recomputation, each call wrapped in a dynamo-disable
# frame; its checkpoint keeps a holder, a handle and weak dictionaries per saved tensor and searches the mode stack
# and autocast state per call. Measured (CPU time, one thread) on an 8-layer toy GPT (h=32, 64 operators a layer)
# whose operators cost almost nothing: torch's selective checkpointing added 30 ms to a 6 ms step, this engine 18 ms
# (its checkpoint alone, without the modes, 6 ms where torch's non-reentrant checkpoint takes 10 ms; the modes ~9 us
# per operator, a Python dispatch mode's floor); on bench_step_time's model (h=256) 9-15 ms less per step.
#
# Here, in forward the region runs under saved-tensor hooks that keep nothing but a _Slot per saved tensor, and under
# _Keep, which runs every operator and keeps (detached: the same storage and version counter) the output of each
# candidate operator the rule keeps, in order. The first unpack in backward recomputes the region: the RNG state
# (CPU, and the CUDA devices of the inputs once CUDA is initialised), autocast and default device of the forward
# restored, grad on, under saved-tensor hooks that fill the slots in order and stop the recomputation right after
# the last one (torch's early stop), and under _Reuse, which hands back the kept outputs in order instead of running
# those operators, checking that each is the same operator and that its output was not modified in place, and lets
# go of each as it is used. A slot lets go of its tensor when it is unpacked or when autograd frees it.
class _Slot:
    """What autograd holds in place of one tensor saved in the forward: the recomputed tensor, once recomputed."""

    __slots__ = ("__weakref__", "value")

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None


class _Kept:
    """A kept operator output: the operator, its output (detached tensors) and their versions (None: not checked,
    an in-place operator's output, whose version the recomputation itself moves on)."""

    __slots__ = ("func", "value", "versions")

    def __init__(self, func: Any, out: Any, check: bool = True):
        self.func = func
        if isinstance(out, torch.Tensor):
            self.value: Any = _alias(out)
            self.versions: Any = out._version
        else:  # a tuple of outputs (attention kernels: output and logsumexp)
            self.value = type(out)(_alias(o) if isinstance(o, torch.Tensor) else o for o in out)
            self.versions = tuple(o._version if isinstance(o, torch.Tensor) else None for o in out)
        if not check:
            self.versions = None

    def modified(self) -> bool:
        if self.versions is None:
            return False
        if isinstance(self.value, torch.Tensor):
            return self.value._version != self.versions
        return any(v is not None and o._version != v for o, v in zip(self.value, self.versions))

    def seal(self) -> None:
        """Take the versions as they are now (the end of the forward: kept in-place operators have run)."""
        if self.versions is None:
            return
        if isinstance(self.value, torch.Tensor):
            self.versions = self.value._version
        else:
            self.versions = tuple(o._version if isinstance(o, torch.Tensor) else None for o in self.value)


def _alias(t: torch.Tensor) -> torch.Tensor:
    # Inside a dispatch mode the ADInplaceOrView key is excluded; with it, the alias shares the output's version
    # counter (so an in-place change of the output is seen) and has no autograd metadata (so autograd can make it
    # the output of the recomputed operator), as torch's selective checkpointing does.
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return t.detach()


class _FrameMode(TorchDispatchMode):
    """A dispatch mode over one frame (the forward's or the recomputation's side of a checkpoint call)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # otherwise torch wraps __torch_dispatch__ in a dynamo-disable frame, a few microseconds per operator;
        # regions under torch.compile use torch's own selective checkpointing (checkpoint_operators)
        return False

    def __init__(self, frame: Any):
        super().__init__()
        self.frame = frame


class _Keep(_FrameMode):
    """Forward: run every operator; keep the output of each candidate operator the frame's rule keeps."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        out = func(*args, **kwargs) if kwargs else func(*args)
        frame = self.frame
        if func in frame.candidates and not in_collective() and frame.keeps(func, args):
            frame.kept.append(_Kept(func, out))
        return out


class _Reuse(_FrameMode):
    """Recomputation: hand back the kept outputs in order; run every other operator."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        frame = self.frame
        if func in frame.candidates and not in_collective() and frame.keeps(func, args):
            return frame.reuse(func)
        return func(*args, **kwargs) if kwargs else func(*args)


class _StopRecomputation(Exception):
    """Raised by the recomputation's pack hook once the last saved tensor is recomputed (torch's early stop)."""


class _Frame:
    """One call of checkpoint_operators: its inputs and forward state, the kept outputs and the slots."""

    def __init__(self, run: Callable[..., Any], tensors: Sequence[torch.Tensor], keeps: Keeps,
                 candidates: frozenset[Any], label: str):
        self.run, self.keeps, self.candidates, self.label = run, keeps, candidates, label
        # as torch's checkpoint keeps its inputs: saved variables (an in-place change is caught at unpack; saved-
        # tensor hooks active around the region see them)
        self.inputs = [_make_saved_tensor(t, is_output=False) for t in tensors]
        self.cpu_rng = torch.get_rng_state()
        self.cuda_devices = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"}) \
            if torch.cuda.is_initialized() else []
        self.cuda_rng = [torch.cuda.get_rng_state(d) for d in self.cuda_devices]
        device_type = next((t.device.type for t in tensors if t.device.type != "cpu"), "cpu")
        self.autocast = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                         for d in dict.fromkeys((device_type, "cpu")) if torch.amp.is_autocast_available(d)]
        self.autocast_cache = torch.is_autocast_cache_enabled()
        self.default_device = torch.get_default_device()
        self.kept: list[_Kept | None] = []
        self.slots: list[weakref.ref[_Slot]] = []
        self.reused = 0
        # storage -> weak reference to it, of the kept outputs handed back (a weak reference keeps a freed storage's
        # address from being a new one's while it is held)
        self.reused_outputs: dict[int, StorageWeakRef] = {}
        self.recomputed = False

    # -- forward ------------------------------------------------------------------------------------------
    def pack(self, tensor: torch.Tensor) -> _Slot:
        slot = _Slot()
        self.slots.append(weakref.ref(slot))
        return slot

    # -- backward -----------------------------------------------------------------------------------------
    def unpack(self, slot: _Slot) -> torch.Tensor:
        if not self.recomputed:
            self.recompute()
        value = slot.value
        if value is None:
            raise OperatorCheckpointError(
                f"{self.label}: a tensor it saved was asked for a second time (a second backward through the layer, "
                "e.g. retain_graph=True): an operator-level (non_matmul, keep_ops) layer is recomputed once, so it "
                "can be backpropagated once; use full recompute or none for repeated backward passes")
        slot.value = None
        return value

    def reuse(self, func: Any) -> Any:
        i = self.reused
        entry = self.kept[i] if i < len(self.kept) else None
        if entry is None or entry.func is not func:
            kept = "nothing more" if entry is None else f"the output of {entry.func}"
            raise OperatorCheckpointError(
                f"{self.label}: the recomputation ran {func} where the forward kept {kept} (kept operator {i}): the "
                "layer's forward ran other operators in backward than in forward (it depends on state that changed); "
                "use full recompute for this layer")
        if entry.modified():
            raise OperatorCheckpointError(
                f"{self.label}: the output of {func}, kept for the recomputation, was modified in place after the "
                "forward made it: operator-level recompute needs the kept outputs unchanged; use "
                "full recompute for this layer, or make the model's operation on it out-of-place")
        self.kept[i] = None  # its last holder is now the recomputed graph, as the forward's was its graph
        self.reused = i + 1
        values = entry.value if isinstance(entry.value, (tuple, list)) else (entry.value,)
        self.reused_outputs.update((v.untyped_storage()._cdata, StorageWeakRef(v.untyped_storage())) for v in values
                                   if isinstance(v, torch.Tensor))
        return entry.value

    def holds_kept(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is (a view of) a kept output this recomputation has handed back."""
        ref = self.reused_outputs.get(tensor.untyped_storage()._cdata)
        return ref is not None and not ref.expired()

    def reuse_mode(self) -> TorchDispatchMode:
        """The dispatch mode of the recomputation: hands back the kept outputs."""
        return _Reuse(self)

    def recompute(self) -> None:
        self.recomputed = True
        slots = self.slots
        total = len(slots)
        count = 0

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            nonlocal count
            tensor = tensor.detach() if tensor.requires_grad else tensor
            slot = slots[count]() if count < total else None
            count += 1
            if slot is not None:  # a slot autograd already freed needs nothing
                slot.value = tensor
            if count >= total:
                raise _StopRecomputation
            return tensor

        inputs = [saved.unpack() for saved in self.inputs]
        try:
            with torch.random.fork_rng(devices=self.cuda_devices), contextlib.ExitStack() as stack:
                torch.set_rng_state(self.cpu_rng)
                for device, state in zip(self.cuda_devices, self.cuda_rng):
                    torch.cuda.set_rng_state(state, device)
                self._restore_forward_state(stack)
                # an in-place collective on a kept output is not run again (NOTE [collectives are not operators])
                with torch.autograd.graph.saved_tensors_hooks(pack, _same), torch.enable_grad(), \
                        replaying(self.holds_kept), self.reuse_mode():
                    self.run(*inputs)
        except _StopRecomputation:
            pass
        finally:
            self.reused_outputs.clear()
        if count != total:
            raise OperatorCheckpointError(
                f"{self.label}: the recomputation saved {count} tensors for backward where the forward saved {total}: "
                "the layer's forward is not the same when rerun (it depends on state that changed); use full "
                "recompute for this layer")

    def _restore_forward_state(self, stack: contextlib.ExitStack) -> None:
        """Enter the forward's autocast state and default device on ``stack`` where they differ now (in a backward
        outside autocast and device contexts, nothing to do)."""
        if any(enabled or torch.is_autocast_enabled(d) for d, enabled, _ in self.autocast):
            for device, enabled, dtype in self.autocast:
                stack.enter_context(torch.amp.autocast(device, dtype=dtype, enabled=enabled,
                                                       cache_enabled=self.autocast_cache))
        if torch.get_default_device() != self.default_device:
            stack.enter_context(self.default_device)


def _rule_contexts(keeps: Keeps, candidates: frozenset[Any]) -> Any:
    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> torch.utils.checkpoint.CheckpointPolicy:
        keep = func in candidates and keeps(func, args)
        return torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE if keep else \
            torch.utils.checkpoint.CheckpointPolicy.PREFER_RECOMPUTE

    return torch.utils.checkpoint.create_selective_checkpoint_contexts(policy)


def checkpoint_matmuls(run: Callable[..., Any], tensors: Sequence[torch.Tensor], max_contraction: int = 0) -> Any:
    """A ``selective/non_matmul`` layer under ``torch.compile``: torch's selective activation checkpoint
    (``use_reentrant=False``) whose policy keeps the output of every matrix multiply
    (:data:`~remat.recompute.operators.MATMUL_OVERLOADS`) whose contraction dimension is above ``max_contraction``
    (or that has none) and recomputes every other operator: the rule of :func:`checkpoint_operators` for a layer
    without core_attn/mlp (``matmul_k<N>``: ``max_contraction=N``). Dynamo turns it into the
    tag_activation_checkpoint operator, so the policy runs once, when the graph is traced. Outside ``torch.compile``
    it is torch's eager selective checkpoint (use :func:`checkpoint_operators` there: the same tensors, less
    Python work)."""
    return torch.utils.checkpoint.checkpoint(run, *tensors, use_reentrant=False, preserve_rng_state=True,
                                             context_fn=functools.partial(_matmul_contexts, max_contraction))


def _matmul_contexts(max_contraction: int) -> Any:
    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> torch.utils.checkpoint.CheckpointPolicy:
        if func in MATMUL_OVERLOADS:
            k = contraction(func, args)
            if k is None or k > max_contraction:
                return torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE
        return torch.utils.checkpoint.CheckpointPolicy.PREFER_RECOMPUTE

    return torch.utils.checkpoint.create_selective_checkpoint_contexts(policy)


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def checkpoint_operators(run: Callable[..., Any], tensors: Sequence[torch.Tensor], keeps: Keeps,
                         candidates: frozenset[Any], label: str) -> Any:
    """Run ``run(*tensors)`` under a selective activation checkpoint (NOTE [the operator checkpoint]).

    The forward keeps the output of every operator in ``candidates`` (aten overloads) for which ``keeps(func,
    args)`` is true, and nothing else autograd would save; the first time backward needs a saved tensor, the region
    is run again (RNG state, autocast and default device of the forward, grad enabled) with each kept operator
    replaced by its kept output, until the last saved tensor is recomputed. ``keeps`` must decide the same in the
    recomputation as in the forward (it sees the recomputed arguments). Gradients equal the plain run's bit for bit
    and the tensors alive at every moment are those of ``torch.utils.checkpoint.checkpoint(run, *tensors,
    use_reentrant=False, context_fn=<selective contexts of the same policy>)``; under ``torch.compile`` that is
    what runs.

    Args:
        run: the region; called with ``tensors``, in forward and once more in backward.
        tensors: the region's tensor inputs (kept as torch's checkpoint keeps its inputs).
        keeps: whether to keep a candidate operator's output, given the operator and its arguments.
        candidates: the operators ``keeps`` is asked about (others are always recomputed).
        label: how errors name the region (``'non_matmul in layers.3'``).

    Returns:
        What ``run`` returns.

    Raises:
        OperatorCheckpointError: in backward, when the recomputation does not replay the forward (other kept
            operators, another number of saved tensors, a kept output modified in place) or when the region is
            backpropagated a second time.
    """
    if not torch.is_grad_enabled():  # nothing is saved for backward: run it as it is (as torch's checkpoint does)
        return run(*tensors)
    if torch.compiler.is_compiling():  # dynamo takes a context_fn that is a partial of a module-level function
        return torch.utils.checkpoint.checkpoint(
            run, *tensors, use_reentrant=False, preserve_rng_state=True,
            context_fn=functools.partial(_rule_contexts, keeps, candidates))
    frame = _Frame(run, tensors, keeps, candidates, label)
    with torch.autograd.graph.saved_tensors_hooks(frame.pack, frame.unpack), _Keep(frame):
        return run(*tensors)


# NOTE [kept operators by index]
# A keep_ops(...) layer (remat.recompute.plan_format NOTE [operator sets]) runs on the same engine with a rule by
# operator index: operator i is the i-th operator the layer's forward dispatches, not counting SAC_IGNORED_OPS (as
# torch's selective checkpointing and remat.plan.operator_space count them) nor what collectives dispatch (NOTE
# [collectives are not operators] in remat.models.collectives), and it is kept iff i is in the set. The
# rule is one set lookup per operator; each operator overload's kind (does it mutate its first argument, does it draw
# random numbers) is looked up once per process (_kind), and only those few operators are checked as they run:
#   * an operator that changes a kept output in place must be kept too (else the recomputation would change the kept
#     tensor a second time), and a kept in-place operator must change a kept output (else the recomputation would
#     hand back the forward's tensor where the layer's code goes on with the recomputed one);
#   * the recomputation restores the RNG state of the forward's start and skips the kept draws, so the draws must be
#     recomputed ones first, kept ones after: a recomputed draw after a kept one would get other numbers.
# A refused plan raises ``refused`` (remat.apply passes its ApplyError) in the first forward. Under these rules a kept
# dropout mask (empty_like, bernoulli_, div_: one tensor) comes back from the recomputation as the forward left it and
# every recomputed draw gets the forward's numbers, so gradients equal the plain model's bit for bit with dropout on.
# The kept outputs' versions are taken when the forward ends and checked when the recomputation takes them back (the
# outputs of kept in-place operators, aliases of an earlier kept output, are checked through that one). Nothing of
# the rule depends on the layer's shapes, so there is no per-shape table to build: the checks cost about 1 us per
# kept operator, against ~10 us per operator and pass of the dispatch modes themselves. Measured (process CPU time,
# one thread, interleaved, benchmarks/bench_keep_ops.py) on bench_plan's layer (h=128, s=256, b=4, 63 operators)
# keeping all 30 keepable operators: +3.3-5.5 ms over the plain layer's 40 ms step, where torch's selective
# checkpointing with remat's former index policy added +5.2-7.2 ms; on a toy layer whose operators cost nothing
# (h=32, s=16) +1.7-1.8 ms against +3.0-3.4 ms.
_IGNORED, _MUTATES, _DRAWS = -1, 1, 2
_KIND: dict[Any, int] = {}  # one lookup per operator (an OpOverload's hash is a Python call)


def _kind(func: Any) -> int:
    """_IGNORED for SAC_IGNORED_OPS (not counted), else _MUTATES | _DRAWS as they apply (0: neither)."""
    kind = _KIND.get(func)
    if kind is None:
        kind = _IGNORED if func in SAC_IGNORED_OPS else (_MUTATES if func._schema.is_mutable else 0) | \
            (_DRAWS if torch.Tag.nondeterministic_seeded in func.tags else 0)
        _KIND[func] = kind
    return kind


def _storage(value: Any) -> int | None:
    return value.untyped_storage()._cdata if isinstance(value, torch.Tensor) else None


class _KeepIndexed(_FrameMode):
    """Forward of a keep_ops layer: run every operator; keep the output of each operator whose index is kept."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        out = func(*args, **kwargs) if kwargs else func(*args)
        kind = _KIND.get(func)
        if kind is None:
            kind = _kind(func)
        if kind == _IGNORED or in_collective():
            return out
        frame = self.frame
        i = frame.count
        frame.count = i + 1
        keep = i in frame.keep_set
        if kind:
            frame.check(i, func, args, out, keep, kind)
        if keep:
            frame.keep(func, out)
        return out


class _ReuseIndexed(_FrameMode):
    """Recomputation of a keep_ops layer: hand back the kept outputs in order; run every other operator."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kind = _KIND.get(func)
        if (kind if kind is not None else _kind(func)) != _IGNORED and not in_collective():
            frame = self.frame
            i = frame.count
            frame.count = i + 1
            if i in frame.keep_set:
                return frame.reuse(func)
        return func(*args, **kwargs) if kwargs else func(*args)


class _IndexedFrame(_Frame):
    """One call of checkpoint_kept_operators (NOTE [kept operators by index])."""

    def __init__(self, run: Callable[..., Any], tensors: Sequence[torch.Tensor], kept: frozenset[int], label: str,
                 refused: type[Exception]):
        super().__init__(run, tensors, _never, frozenset(), label)
        self.keep_set, self.refused = kept, refused
        self.count = 0                      # operators seen so far (forward, then the recomputation)
        self.kept_storages: set[int] = set()
        self.kept_draw = -1                 # the last kept operator that draws random numbers

    def check(self, i: int, func: Any, args: tuple[Any, ...], out: Any, keep: bool, kind: int) -> None:
        if kind & _MUTATES and args:
            target = _storage(args[0])
            if target is not None and target in self.kept_storages:
                if not keep:
                    raise self.refused(f"{self.label}: operator {i} ({func}) mutates the output of a kept operator "
                                       f"in place: keep operator {i} too (keep_ops)")
            elif keep and target is not None and target == _storage(out):
                raise self.refused(f"{self.label}: operator {i} ({func}) is kept but changes in place a tensor no "
                                   "kept operator made: keep the operator that made it too, or drop operator "
                                   f"{i} (keep_ops)")
        if kind & _DRAWS:
            if keep:
                self.kept_draw = i
            elif self.kept_draw >= 0:  # the recomputation would skip the kept draw and shift this one's numbers
                raise self.refused(f"{self.label}: operator {self.kept_draw} draws random numbers and is kept, so "
                                   f"operator {i} ({func}), which draws after it, must be kept too (keep_ops)")

    def keep(self, func: Any, out: Any) -> None:
        outs = out if isinstance(out, (tuple, list)) else (out,)
        storages = [_storage(o) for o in outs]
        # an output that aliases a kept output (an in-place operator's: check() made sure) is checked through the
        # first one: the recomputation's in-place operators move the shared version on
        aliased = any(s in self.kept_storages for s in storages if s is not None)
        self.kept.append(_Kept(func, out, check=not aliased))
        self.kept_storages.update(s for s in storages if s is not None)

    def seal(self) -> None:
        """The forward is over: take the kept outputs' versions (kept in-place operators have run)."""
        for entry in self.kept:
            if entry is not None:
                entry.seal()
        self.count = 0

    def reuse_mode(self) -> TorchDispatchMode:
        self.count = 0
        return _ReuseIndexed(self)


def _never(func: Any, args: tuple[Any, ...]) -> bool:
    return False


def checkpoint_kept_operators(run: Callable[..., Any], tensors: Sequence[torch.Tensor], kept: frozenset[int],
                              label: str, refused: type[Exception] = OperatorCheckpointError) -> Any:
    """Run ``run(*tensors)`` under a selective activation checkpoint that keeps the outputs of the operators whose
    index is in ``kept`` (NOTE [kept operators by index]; a ``keep_ops(...)`` layer) and recomputes every other one.

    The semantics are those of :func:`checkpoint_operators` with the rule "operator i is kept iff i in kept", i.e.
    of ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` with ``create_selective_checkpoint_contexts`` of
    that policy (``allow_cache_entry_mutation=True``): the same storages
    allocated, in the same order, with the same bytes in use after each (kept outputs that no backward used are let
    go when the graph goes, possibly in another order than torch's). Gradients equal the plain run's bit for bit,
    dropout included. Under ``torch.compile`` the call runs eagerly (a graph break): the indices count an eager
    forward's operators, which are not those of a traced one.

    Args:
        run: the region; called with ``tensors``, in forward and once more in backward.
        tensors: the region's tensor inputs (kept as torch's checkpoint keeps its inputs).
        kept: indices of the operators whose outputs are kept, counting every operator the forward dispatches but
            ``torch.utils.checkpoint.SAC_IGNORED_OPS`` and those of remat's collectives, from 0.
        label: how errors name the region (``'keep_ops(3,19) in layers.3'``).
        refused: the exception raised, in forward, for a set the recomputation cannot replay: an operator that
            changes a kept output in place and is not kept, a kept in-place operator whose tensor is not kept, a
            recomputed random draw after a kept one; the message names the operator to keep.

    Returns:
        What ``run`` returns.

    Raises:
        refused: see above.
        OperatorCheckpointError: in backward, as :func:`checkpoint_operators`.
    """
    if not torch.is_grad_enabled():
        return run(*tensors)
    if torch.compiler.is_compiling():
        return _eager_under_compile()(run, tensors, kept, label, refused)
    frame = _IndexedFrame(run, tensors, frozenset(kept), label, refused)
    with torch.autograd.graph.saved_tensors_hooks(frame.pack, frame.unpack):
        with _KeepIndexed(frame):
            out = run(*tensors)
        frame.seal()
    return out


def _kept_operators_eagerly(run: Callable[..., Any], tensors: Sequence[torch.Tensor], kept: frozenset[int],
                            label: str, refused: type[Exception]) -> Any:
    # Under torch.compile the operators a layer dispatches are not its eager ones (dropout is one native_dropout
    # where eager runs empty_like, bernoulli_, div_, mul; bmm outputs are views, not _unsafe_views), so eager operator
    # indices would keep other tensors: the layer runs eagerly, on this engine (a graph break).
    return checkpoint_kept_operators(run, tensors, kept, label, refused)


_EAGER_UNDER_COMPILE: list[Callable[..., Any]] = []


def prepare_kept_operators() -> None:
    """Make :func:`checkpoint_kept_operators`' eager fallback under ``torch.compile`` ahead of any compiled call.

    ``torch.compiler.disable`` imports ``torch._dynamo`` (about a second): done when a keep_ops region is made,
    not when this module is imported, and not inside a traced frame.
    """
    if not _EAGER_UNDER_COMPILE:
        _EAGER_UNDER_COMPILE.append(torch.compiler.disable(_kept_operators_eagerly))


def _eager_under_compile() -> Callable[..., Any]:
    prepare_kept_operators()  # a no-op when a region made it: only a direct call under compile gets here first
    return _EAGER_UNDER_COMPILE[0]
