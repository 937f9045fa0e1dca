"""Recompute policies with Megatron-LM's semantics: :class:`Policy` (which activations of a layer stack are kept
for backward and which are recomputed), its short form (``full/uniform/2``) and its Megatron-LM flags."""

from __future__ import annotations

import numbers
import re
import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from remat.offload_policy import (
    MIN_OFFLOADED_TENSOR_SIZE,
    OFFLOAD_GRAMMAR,
    OffloadPolicyError,
    check_cpu_offload,
    check_min_size,
    check_offload_combination,
    format_offload,
    normalise_offload_modules,
    offload_from_megatron,
    offload_to_megatron,
    parse_offload_option,
)
from remat.units import MAX_DIGITS, ascii_int

GRANULARITIES = ("none", "full", "selective")
METHODS = ("uniform", "block")
# act = the dense MLP's activation function; moe_act, moe, shared_experts (MoE layers) and mla_up_proj (MLA) are
# Megatron's modules for the models that have those parts
SELECTIVE_MODULES = ("core_attn", "mlp", "layernorm", "act", "moe_act", "moe", "shared_experts", "mla_up_proj",
                     "non_matmul")
MOE_MODULES = ("moe_act", "moe", "shared_experts")
# Modules whose output is discarded once consumed and rematerialised in backward (Megatron's
# CheckpointWithoutOutput); the others are checkpointed whole
OUTPUT_DISCARDING_MODULES = ("moe_act", "mla_up_proj")
# non_matmul already recomputes these (they hold no matrix multiply)
NON_MATMUL_INCLUDES = ("layernorm", "act", "moe_act")
# selective modules whose checkpoint takes the attention mask (non_matmul recomputes the masked softmax)
MASK_CHECKPOINTING_MODULES = ("core_attn", "non_matmul")
ENGINES = ("reentrant", "non-reentrant")
DEFAULT_SELECTIVE_MODULES = ("core_attn",)

# Megatron recompute modules for parts remat's reference model does not have.
_MEGATRON_ONLY_MODULES = {"mhc": "hyper-connection", "gdn": "GatedDeltaNet", "gdn_norm_out": "GatedDeltaNet"}
_FLAG_PREFIXES = ("--recompute", "--distribute-saved-activations")
_EXAMPLES = {"--recompute-granularity": "full", "--recompute-method": "uniform", "--recompute-num-layers": "1"}

GRAMMAR = """\
expected one of:
  none
  full/uniform/K        checkpoint groups of K >= 1 consecutive layers, e.g. full/uniform/1
  full/block/K          checkpoint the first K >= 0 layers one by one, e.g. full/block/4
  selective             the same as selective/core_attn
  selective/M1+M2+...   M from core_attn, mlp, layernorm, act, moe_act, moe, shared_experts, mla_up_proj,
                        non_matmul, e.g. selective/core_attn+mlp;
                        with non_matmul also matmul_k<N>, e.g. selective/non_matmul+matmul_k128
optionally followed by ',distribute' (full only) and by
""" + OFFLOAD_GRAMMAR + """
then '@reentrant' or '@non-reentrant', e.g. full/block/4,distribute@non-reentrant"""


class PolicyError(ValueError):
    """A recompute policy Megatron-LM (or remat) refuses; the message says how to fix it."""


def _choice(kind: str, value: object, valid: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value.strip().lower() not in valid:
        raise PolicyError(f"unknown {kind} {value!r}: valid values are {', '.join(valid)}")
    return value.strip().lower()


CONTRACTION_PREFIX = "matmul_k"  # matmul_k<N>: also recompute matmuls whose contraction is <= N (non_matmul only)


def contraction_limit(modules: Sequence[str]) -> int:
    """N of a ``matmul_k<N>`` module in ``modules`` (0 when there is none)."""
    return max((int(m[len(CONTRACTION_PREFIX):]) for m in modules if m.startswith(CONTRACTION_PREFIX)), default=0)


def _module_name(name: object) -> str:
    if not isinstance(name, str):
        raise PolicyError(f"recompute module names must be strings, got {name!r}")
    key = name.strip().lower()
    if key in SELECTIVE_MODULES:
        return key
    if key.startswith(CONTRACTION_PREFIX):
        limit = ascii_int(key[len(CONTRACTION_PREFIX):], signed=False)
        if limit is None or limit < 1:
            raise PolicyError(f"recompute module {name!r}: write {CONTRACTION_PREFIX}<N> with N >= 1 in digits 0-9, "
                              "the largest contraction dimension of the matrix multiplies to recompute, e.g. "
                              "matmul_k128")
        return f"{CONTRACTION_PREFIX}{limit}"
    valid = f"valid modules are {', '.join(SELECTIVE_MODULES)} and, with non_matmul, {CONTRACTION_PREFIX}<N>"
    if key in _MEGATRON_ONLY_MODULES:
        kind = _MEGATRON_ONLY_MODULES[key]
        raise PolicyError(f"recompute module {key!r} is for Megatron's {kind} layers, which remat's "
                          f"reference model does not have: {valid}")
    hint = " (separate modules with spaces in Megatron flags, '+' in remat)" if "," in key else ""
    raise PolicyError(f"unknown recompute module {name!r}{hint}: {valid}")


def normalise_modules(value: object) -> tuple[str, ...]:
    """Recompute module names checked, deduplicated and sorted (SELECTIVE_MODULES order, matmul_k<N> last)."""
    if isinstance(value, (str, bytes, bool)) or not isinstance(value, (list, tuple, set, frozenset)):
        raise PolicyError(f"modules must be a list or tuple of names such as ('core_attn', 'mlp'), "
                          f"got {value!r}")
    names = {_module_name(m) for m in value}
    limits = sorted(m for m in names if m.startswith(CONTRACTION_PREFIX))
    if len(limits) > 1:
        raise PolicyError(f"recompute modules {', '.join(limits)}: give one {CONTRACTION_PREFIX}<N> (the largest "
                          "contraction to recompute)")
    if limits and "non_matmul" not in names:
        raise PolicyError(f"recompute module {limits[0]} recomputes matrix multiplies inside a non_matmul layer: add "
                          f"non_matmul (selective/non_matmul+{limits[0]})")
    return tuple(m for m in SELECTIVE_MODULES if m in names) + tuple(limits)


# NOTE [what remat refuses that Megatron accepts]
# remat refuses, with the fix in the message, some inputs Megatron silently accepts or ignores: method/num_layers
# without a granularity, modules with full granularity, an empty module list, --recompute-activations together
# with --recompute-granularity full (Megatron overrides it to selective) and, in Policy.layer_groups,
# num_layers above the stack's depth; for offloading, --offload-modules / --min-offloaded-tensor-size without
# --fine-grained-activation-offloading, offloading with full/uniform or non_matmul (nothing is saved to offload)
# and, with the non-reentrant engine, a module both recomputed and offloaded (torch's checkpoint keeps it).
@dataclass(frozen=True)
class Policy:
    """Which activations of a stack of ``depth`` transformer layers are kept for backward and which are dropped
    and recomputed. The granularities and methods are Megatron-LM's (``--recompute-granularity``,
    ``--recompute-method``, ``--recompute-num-layers``, ``--recompute-modules``,
    ``--distribute-saved-activations``):

    * ``none``: nothing is recomputed; every layer keeps all activations its backward needs.
    * ``full/uniform/K``: the layers are split into consecutive groups of ``K`` (the last group is shorter when
      ``K`` does not divide ``depth``: ``end = min(start + K, depth)``). Each group is one checkpoint: its forward
      runs without saving activations and only the group's input tensors (hidden states and side inputs such as
      the attention mask and rotary tensors) are kept. In backward the group's forward is re-run with the
      forward's RNG state restored, so all activations of its ``K`` layers exist at once, and are freed layer by
      layer as backward moves down the group.
    * ``full/block/K``: the first ``K`` layers of the stack (of each pipeline stage, or model chunk under
      virtual pipelining, in Megatron) are checkpointed one layer at a time; the remaining ``depth - K`` layers
      keep all activations. ``K = 0`` checkpoints nothing.
    * ``selective/M1+M2...``: in every layer, only the listed submodules are checkpointed; the rest of the layer
      keeps its activations. ``core_attn`` (Megatron's default) drops the attention scores, softmax and
      attention dropout (the terms quadratic in sequence length) and recomputes them from Q, K, V; ``mlp``
      checkpoints the whole dense MLP; ``layernorm`` discards the norms' outputs once consumed and
      rematerialises them in backward (Megatron's output-discarding ``CheckpointWithoutOutput``); ``act``
      discards the MLP activation function's output the same way. ``act`` is remat's own: Megatron only offers
      it for MoE experts (``moe_act``), so a policy using it has no Megatron flags.
    * MoE and MLA models (Megatron's modules): ``moe`` checkpoints each whole MoE layer (router, dispatch,
      experts, combine, shared expert); ``shared_experts`` checkpoints the shared expert; ``moe_act`` discards
      the grouped experts' activation output (scaled by the routing probabilities) once fc2 has used it and
      rematerialises it in backward (``CheckpointWithoutOutput``; Megatron takes it only with grouped-GEMM
      experts); ``mla_up_proj`` discards MLA's up-projected, rotated queries, keys and values once the attention
      core has used them. As in Megatron, ``mlp`` checkpoints dense MLPs only, not MoE layers.
    * ``non_matmul`` is remat's own too, and works at the level of operators rather than modules: the whole
      layer is one selective activation checkpoint (remat.recompute.operator_checkpoint: the semantics of torch's
      non-reentrant engine with ``create_selective_checkpoint_contexts``, whatever ``engine`` says) that keeps
      the outputs of its matrix multiplies (``mm``, ``addmm``, ``bmm``, ``baddbmm``, fused attention) and
      recomputes every other operator (norms, softmax, dropout, activations, rotary, residual adds) from them in
      backward. It recomputes no FLOPs (FLOP counters count only
      matmul-like operators) yet drops most of a layer's activations, much as a compiler's min-cut partitioner
      does. Combined with ``core_attn`` or ``mlp`` it also recomputes those modules' matrix multiplies;
      combined with ``layernorm`` or ``act`` it is refused (it already recomputes them). ``matmul_k<N>`` (with
      ``non_matmul`` only) also recomputes the matrix multiplies whose contraction dimension K is at most N: a
      matmul's output holds ``element_size / (2 K)`` bytes per FLOP, so the smallest K (the attention scores
      Q·K^T, K = head dim) frees the most bytes per recomputed FLOP, e.g. ``selective/non_matmul+matmul_k128``.

    ``engine`` picks the checkpoint implementation: ``reentrant`` is Megatron's ``CheckpointFunction`` (forward
    under ``no_grad`` keeping only inputs and RNG states, the whole segment re-run in backward);
    ``non-reentrant`` is ``torch.utils.checkpoint(use_reentrant=False)`` (saved-tensor hooks, recomputation
    triggered when backward first needs a dropped tensor). Megatron is always reentrant, so the engine is not a
    Megatron flag.

    ``distribute_saved_activations`` (full only) splits each checkpoint's saved input across the tensor-parallel
    ranks and all-gathers it before recompute; Megatron also requires TP > 1 and refuses it with sequence
    parallelism, which a policy alone cannot check.

    ``offload_modules`` is Megatron's fine-grained activation offloading (``--fine-grained-activation-offloading
    --offload-modules ...``, :mod:`remat.offload_policy`), combinable with any granularity but ``full/uniform``: in
    every layer, the tensors the named modules save for backward that have at least ``min_offloaded_tensor_size``
    elements wait in host memory from the module's forward until backward needs them (the last layer of each
    module keeps them, as in Megatron's steady state); :mod:`remat.recompute.activation_offload` runs it.

    Args:
        granularity: ``'none'``, ``'full'`` or ``'selective'`` (None means ``'none'``).
        method: full only: ``'uniform'`` or ``'block'``.
        num_layers: full only: the uniform group size K >= 1, or block's first K >= 0 layers.
        modules: selective only: names from :data:`SELECTIVE_MODULES` (and ``matmul_k<N>`` with ``non_matmul``);
            stored deduplicated, in :data:`SELECTIVE_MODULES` order.
        engine: ``'reentrant'`` (Megatron's) or ``'non-reentrant'``.
        distribute_saved_activations: full only; see above.
        offload_modules: names from :data:`~remat.offload_policy.OFFLOAD_MODULES`, stored deduplicated in that
            order (``attn_proj`` needs ``core_attn``, as in Megatron); ``()`` offloads nothing.
        min_offloaded_tensor_size: with offload_modules, saved tensors of fewer elements stay on the device
            (Megatron's ``--min-offloaded-tensor-size``, default 1048576).

    Raises:
        PolicyError: a field or combination Megatron-LM (or remat) refuses; the message says how to fix it.

    Example::

        >>> Policy("full", "uniform", 2) == Policy.parse("full/uniform/2")
        True
        >>> Policy("selective", modules=("mlp", "core_attn"))
        Policy(granularity='selective', method=None, num_layers=None, modules=('core_attn', 'mlp'), \
engine='reentrant', distribute_saved_activations=False, offload_modules=(), min_offloaded_tensor_size=1048576, \
cpu_offloading_num_layers=0)
        >>> str(Policy("selective", modules=("core_attn",), offload_modules=("attn_norm", "core_attn")))
        'selective/core_attn,offload:attn_norm+core_attn'
    """

    granularity: str = "none"
    method: str | None = None  # full only
    num_layers: int | None = None  # full only: uniform group size K >= 1; block: first K >= 0
    modules: tuple[str, ...] = ()  # selective only; sorted in SELECTIVE_MODULES order, deduplicated
    engine: str = "reentrant"
    distribute_saved_activations: bool = False  # full only
    offload_modules: tuple[str, ...] = ()  # Megatron's fine-grained activation offloading; OFFLOAD_MODULES order
    min_offloaded_tensor_size: int = MIN_OFFLOADED_TENSOR_SIZE  # elements; smaller saved tensors stay
    cpu_offloading_num_layers: int = 0  # TE's layer offloading of the first N layers (remat.recompute.layer_offload)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        g = "none" if self.granularity is None else self.granularity
        g = _choice("recompute granularity", g, GRANULARITIES)
        set_(self, "granularity", g)
        if self.method is not None:
            set_(self, "method", _choice("recompute method", self.method, METHODS))
        k = self.num_layers
        if k is not None:
            if isinstance(k, bool) or not isinstance(k, numbers.Integral):
                raise PolicyError(f"recompute num_layers must be an integer, got {k!r}")
            if abs(k) >= 10**MAX_DIGITS:  # the bound Policy.parse reads (NOTE [ASCII digits] in remat.units)
                raise PolicyError(f"recompute num_layers={k}: a layer count has at most {MAX_DIGITS} digits")
            set_(self, "num_layers", k := int(k))
        set_(self, "modules", normalise_modules(self.modules))
        set_(self, "engine", _choice("recompute engine", self.engine, ENGINES))
        if not isinstance(self.distribute_saved_activations, bool):
            raise PolicyError("distribute_saved_activations must be True or False, "
                              f"got {self.distribute_saved_activations!r}")
        try:
            set_(self, "offload_modules", normalise_offload_modules(self.offload_modules))
            set_(self, "min_offloaded_tensor_size", check_min_size(self.min_offloaded_tensor_size,
                                                                   self.offload_modules))
            check_offload_combination(self.offload_modules, g, self.method, self.modules, self.engine)
            set_(self, "cpu_offloading_num_layers", check_cpu_offload(self.cpu_offloading_num_layers,
                                                                       self.offload_modules, g))
        except OffloadPolicyError as err:
            raise PolicyError(str(err)) from None

        if g != "full" and self.distribute_saved_activations:
            raise PolicyError("--distribute-saved-activations only applies to full granularity: "
                              "drop it, or use --recompute-granularity full (in remat: "
                              "'full/uniform/K,distribute')")
        if g != "selective" and self.modules:
            raise PolicyError(f"recompute modules only apply to selective granularity, not {g}: "
                              "drop --recompute-modules, or use --recompute-granularity selective "
                              "(in remat: 'selective/" + "+".join(self.modules) + "')")
        if g == "none":
            if self.method is not None or k is not None:
                raise PolicyError("granularity none recomputes nothing, so --recompute-method/"
                                  "--recompute-num-layers have no effect: drop them, or add "
                                  "--recompute-granularity full (in remat: 'full/uniform/K')")
        elif g == "selective":
            if self.method is not None or k is not None:
                raise PolicyError("selective recomputes submodules of every layer; drop "
                                  "--recompute-method/--recompute-num-layers (in remat: "
                                  "'selective/core_attn+...')")
            if not self.modules:
                raise PolicyError("selective granularity needs at least one module: add "
                                  "--recompute-modules core_attn (Megatron's default; in remat: "
                                  "'selective' or modules=('core_attn',))")
            redundant = [m for m in NON_MATMUL_INCLUDES if m in self.modules]
            if "non_matmul" in self.modules and redundant:
                raise PolicyError(f"recompute module non_matmul already recomputes {' and '.join(redundant)} "
                                  f"(they hold no matrix multiply): drop {'+'.join(redundant)}")
        else:
            if self.method is None:
                raise PolicyError("full granularity needs a method: add --recompute-method "
                                  "uniform or block (in remat: 'full/uniform/K')")
            if k is None:
                raise PolicyError("full granularity needs a layer count: add "
                                  f"--recompute-num-layers K (in remat: 'full/{self.method}/K')")
            if self.method == "uniform" and k < 1:
                raise PolicyError(f"uniform recompute needs --recompute-num-layers >= 1 (layers per "
                                  f"checkpoint), got {k}: use e.g. 'full/uniform/1'")
            if self.method == "block" and k < 0:
                raise PolicyError(f"block recompute needs --recompute-num-layers >= 0 (layers to "
                                  f"checkpoint), got {k}: use e.g. 'full/block/0'")

    # ----------------------------------------------------------------- properties
    @property
    def is_none(self) -> bool:
        """True for the plain model: nothing is recomputed (granularity ``none``) and nothing offloaded."""
        return self.granularity == "none" and not self.offloads

    @property
    def offloads(self) -> bool:
        """True when saved tensors are offloaded to host memory (``offload_modules``, ``cpu_offloading_num_layers``)."""
        return bool(self.offload_modules or self.cpu_offloading_num_layers)

    @property
    def recomputes_layers(self) -> bool:
        """True for full granularity: whole layers are checkpointed."""
        return self.granularity == "full"

    @property
    def is_selective(self) -> bool:
        """True for selective granularity: submodules of every layer are checkpointed."""
        return self.granularity == "selective"

    # ----------------------------------------------------------------- short form
    def __str__(self) -> str:
        if self.granularity == "full":
            text = f"full/{self.method}/{self.num_layers}"
        elif self.granularity == "selective":
            text = "selective/" + "+".join(self.modules)
        else:
            text = "none"
        if self.distribute_saved_activations:
            text += ",distribute"
        text += format_offload(self.offload_modules, self.min_offloaded_tensor_size, self.cpu_offloading_num_layers)
        return text if self.engine == "reentrant" else f"{text}@{self.engine}"

    @classmethod
    def parse(cls, text: str) -> Policy:
        """Read a policy's short form (what ``str(policy)`` writes).

        The grammar (:data:`GRAMMAR`)::

            none | full/uniform/K | full/block/K | selective | selective/M1+M2+...
            followed optionally by ",distribute" (full only), ",offload:M1+M2..." and ",offload_min:N" (in any
            order), and then "@reentrant" or "@non-reentrant"

        Case and spaces around ``/ + , : @`` are ignored; ``selective`` alone means ``selective/core_attn``. The
        Megatron flags each form stands for: ``full/uniform/2`` is ``--recompute-granularity full
        --recompute-method uniform --recompute-num-layers 2``; ``selective/core_attn+mlp`` is
        ``--recompute-granularity selective --recompute-modules core_attn mlp``; ``,distribute`` is
        ``--distribute-saved-activations``; ``,offload:core_attn+attn_proj`` is ``--fine-grained-activation-offloading
        --offload-modules core_attn attn_proj`` and ``,offload_min:N`` is ``--min-offloaded-tensor-size N``.

        Args:
            text: the short form, e.g. ``'full/uniform/2'``, ``'full/block/4,distribute@non-reentrant'``,
                ``'selective/core_attn+mlp'``, ``'none,offload:core_attn+attn_proj,offload_min:65536'``.

        Returns:
            The :class:`Policy`; ``Policy.parse(str(p)) == p`` for every policy ``p``.

        Raises:
            PolicyError: text outside the grammar (the message quotes the grammar) or a policy the
                :class:`Policy` checks refuse (the message says the fix).

        Example::

            >>> Policy.parse("full/uniform/2")
            Policy(granularity='full', method='uniform', num_layers=2, modules=(), engine='reentrant', \
distribute_saved_activations=False, offload_modules=(), min_offloaded_tensor_size=1048576, \
cpu_offloading_num_layers=0)
            >>> str(Policy.parse(" Selective / MLP + core_attn @ non-reentrant "))
            'selective/core_attn+mlp@non-reentrant'
            >>> Policy.parse("none, offload: attn_proj + core_attn").offload_modules
            ('core_attn', 'attn_proj')
        """
        if not isinstance(text, str):
            raise PolicyError(f"a recompute policy string is expected, got {text!r}\n{GRAMMAR}")
        norm = re.sub(r"\s*([/@+,:])\s*", r"\1", text.strip().lower())

        def bad(reason: str) -> PolicyError:
            return PolicyError(f"cannot parse recompute policy {text!r}: {reason}\n{GRAMMAR}")

        if not norm or re.search(r"\s", norm):
            raise bad("empty text" if not norm else "unexpected whitespace")
        body, at, engine = norm.partition("@")
        if "@" in engine:
            raise bad("more than one '@engine' suffix")
        body, _, opts = body.partition(",")
        distribute = False
        fields: dict = {}
        for opt in opts.split(",") if opts else []:
            try:
                known = parse_offload_option(opt, fields)
            except OffloadPolicyError as err:
                raise bad(str(err)) from None
            if not known and (opt != "distribute" or distribute):
                raise bad(f"unknown option {opt!r} after ',' (distribute, offload:M1+M2, offload_min:N, cpu_offload:N)"
                          if opt != "distribute" else "',distribute' is given twice")
            distribute = distribute or opt == "distribute"
        parts = body.split("/")
        if parts == ["none"]:
            fields["granularity"] = "none"
        elif parts[0] == "full":
            if len(parts) != 3 or parts[1] not in METHODS:
                raise bad("full needs a method and a layer count, e.g. full/uniform/1")
            count = ascii_int(parts[2])
            if count is None:
                raise bad(f"layer count {parts[2]!r} is not an integer (digits 0-9)")
            fields.update(granularity="full", method=parts[1], num_layers=count)
        elif parts[0] == "selective" and len(parts) <= 2:
            mods = parts[1].split("+") if len(parts) == 2 else list(DEFAULT_SELECTIVE_MODULES)
            if "" in mods:
                raise bad("empty module name")
            fields.update(granularity="selective", modules=tuple(mods))
        else:
            raise bad(f"unknown granularity {parts[0]!r}" if len(parts) == 1 or parts[0] not in
                      GRANULARITIES else "too many '/' parts")
        if at:
            fields["engine"] = engine
        try:
            return cls(distribute_saved_activations=distribute, **fields)
        except PolicyError as err:
            raise PolicyError(f"invalid recompute policy {text!r}: {err}") from None

    # ----------------------------------------------------------------- Megatron flags
    @classmethod
    def from_megatron_args(cls, argv: Sequence[str] | str) -> Policy:
        """The policy a Megatron-LM command line asks for.

        Reads ``--recompute-granularity``, ``--recompute-method``, ``--recompute-num-layers``,
        ``--recompute-modules`` (several values, or one with ``=``), ``--recompute-activations`` (selective with
        Megatron's default module, core_attn) and ``--distribute-saved-activations``, as ``--flag value`` or
        ``--flag=value``. Flags not starting with ``--recompute`` or ``--distribute-saved-activations`` are
        ignored, so a whole pasted command line works; an unknown ``--recompute-*`` flag and the removed
        ``--checkpoint-activations`` are errors. The deprecated ``--moe-layer-recompute`` means selective with
        ``moe`` added to the modules (refused with full granularity, as Megatron does). Fine-grained activation
        offloading is read too: ``--fine-grained-activation-offloading``, ``--offload-modules`` and
        ``--min-offloaded-tensor-size`` (:func:`remat.offload_policy.offload_from_megatron`).

        Args:
            argv: the command line as one string (split like a shell: quotes group words) or a list of tokens.

        Returns:
            The :class:`Policy`, engine ``reentrant`` (Megatron's only engine); ``none`` without recompute flags.
            ``Policy.from_megatron_args(p.to_megatron_args())`` gives ``p`` back (with engine reentrant).

        Raises:
            PolicyError: argv that is neither a string nor a list of strings, a string with an unclosed quote, a
                flag without its value, or a combination Megatron (or remat) refuses; the message says the fix.

        Example::

            >>> str(Policy.from_megatron_args("pretrain_gpt.py --num-layers 24 --recompute-granularity full "
            ...                               "--recompute-method block --recompute-num-layers 4"))
            'full/block/4'
            >>> str(Policy.from_megatron_args(["--recompute-activations"]))
            'selective/core_attn'
            >>> str(Policy.from_megatron_args("--fine-grained-activation-offloading --offload-modules attn_norm"))
            'none,offload:attn_norm'
        """
        tokens = _megatron_tokens(argv)
        try:
            opts: dict = offload_from_megatron(tokens)
        except OffloadPolicyError as err:
            raise PolicyError(str(err)) from None
        activations = moe_layer = False
        i = 0
        while i < len(tokens):
            tok = tokens[i]
            i += 1
            if tok == "--checkpoint-activations":
                raise PolicyError("--checkpoint-activations was removed from Megatron: use "
                                  "--recompute-granularity full --recompute-method uniform "
                                  "--recompute-num-layers 1, or --recompute-activations")
            if tok.partition("=")[0] == "--moe-layer-recompute":
                if "=" in tok:
                    raise PolicyError(f"--moe-layer-recompute takes no value, got {tok!r}: write just "
                                      "--moe-layer-recompute")
                moe_layer = True
                continue
            if not tok.startswith(_FLAG_PREFIXES):
                continue
            name, eq, inline = tok.partition("=")
            if name in ("--recompute-activations", "--distribute-saved-activations"):
                if eq:
                    raise PolicyError(f"{name} takes no value, got {tok!r}: write just {name}")
                if name == "--recompute-activations":
                    activations = True
                else:
                    opts["distribute_saved_activations"] = True
            elif name == "--recompute-modules":
                if eq:
                    opts["modules"] = [inline]
                else:
                    values = []
                    while i < len(tokens) and not tokens[i].startswith("-"):
                        values.append(tokens[i])
                        i += 1
                    opts["modules"] = values
            elif name in ("--recompute-granularity", "--recompute-method", "--recompute-num-layers"):
                if not eq:
                    if i >= len(tokens) or tokens[i].startswith("--"):
                        raise PolicyError(f"{name} needs a value, e.g. {name} {_EXAMPLES[name]}")
                    inline = tokens[i]
                    i += 1
                key = name[len("--recompute-"):].replace("-", "_")
                opts[key] = inline
            else:
                raise PolicyError(f"unknown Megatron recompute flag {name!r}: remat understands "
                                  "--recompute-granularity, --recompute-method, "
                                  "--recompute-num-layers, --recompute-modules, "
                                  "--recompute-activations, --distribute-saved-activations")

        granularity = opts.pop("granularity", None)
        if granularity is not None:
            granularity = _choice("--recompute-granularity value", granularity, ("full", "selective"))
        if activations:
            if granularity == "full":
                raise PolicyError("--recompute-activations means selective granularity, but "
                                  "--recompute-granularity full was also given: drop one of them")
            granularity = "selective"
        if "num_layers" in opts:
            raw = opts["num_layers"]
            count = ascii_int(raw.strip())
            if count is None:
                raise PolicyError(f"--recompute-num-layers needs an integer (digits 0-9), got {raw!r}: e.g. "
                                  "--recompute-num-layers 1")
            opts["num_layers"] = count
        if moe_layer:  # Megatron: deprecated, the same as selective with moe added to the modules
            if granularity == "full":
                raise PolicyError("--moe-layer-recompute cannot be combined with --recompute-granularity full (as "
                                  "in Megatron): drop one of them; it means --recompute-granularity selective "
                                  "--recompute-modules moe")
            if granularity is None and "modules" not in opts:
                opts["modules"] = []
            granularity = "selective"
        if granularity == "selective" and "modules" not in opts:
            opts["modules"] = DEFAULT_SELECTIVE_MODULES
        if moe_layer and "moe" not in opts["modules"]:
            opts["modules"] = [*opts["modules"], "moe"]
        return cls(granularity=granularity or "none", **opts)

    def to_megatron_args(self) -> list[str]:
        """Megatron-LM flags reproducing this policy ([] for none), the offloading flags last.

        The engine is not a Megatron flag (Megatron is reentrant): a non-reentrant policy gets the
        flags of its reentrant twin. Raises :class:`PolicyError` for the ``act`` module, which
        Megatron has only for MoE experts, and for ``non_matmul`` (operator-level, remat's own).
        """
        return self._recompute_megatron_args() + offload_to_megatron(
            self.offload_modules, self.min_offloaded_tensor_size, self.cpu_offloading_num_layers)

    def _recompute_megatron_args(self) -> list[str]:
        if self.granularity == "none":
            return []
        if self.granularity == "full":
            args = ["--recompute-granularity", "full", "--recompute-method", str(self.method),
                    "--recompute-num-layers", str(self.num_layers)]
            if self.distribute_saved_activations:
                args.append("--distribute-saved-activations")
            return args
        if "non_matmul" in self.modules:
            raise PolicyError("recompute module 'non_matmul' (every operator but the matrix multiplies, "
                              "torch's selective activation checkpointing) has no Megatron flag: Megatron's "
                              "--recompute-modules checkpoints whole modules; use core_attn, mlp, layernorm")
        if "act" in self.modules:
            raise PolicyError("recompute module 'act' has no Megatron equivalent for dense MLPs "
                              "(Megatron's moe_act is for MoE experts only): use 'mlp' to "
                              "recompute the whole MLP instead")
        return ["--recompute-granularity", "selective", "--recompute-modules", *self.modules]

    # ----------------------------------------------------------------- layer layout
    def selective_modules(self, layer: int) -> tuple[str, ...]:
        """The submodules recomputed inside layer ``layer`` (the same for every layer)."""
        return self.modules if self.granularity == "selective" else ()

    def layer_groups(self, depth: int) -> list[tuple[int, ...]]:
        """The consecutive layer indices each whole-layer checkpoint covers in a ``depth`` stack.

        uniform K: ``(0..K-1), (K..2K-1), ...`` with a shorter last group; block K: ``(0,), (1,),
        ..., (K-1,)``; none and selective checkpoint no whole layers and give ``[]``.
        """
        if isinstance(depth, bool) or not isinstance(depth, numbers.Integral) or depth < 1:
            raise PolicyError(f"the layer stack needs depth >= 1 layers, got {depth!r}")
        depth = int(depth)
        if self.granularity != "full":
            return []
        k = int(self.num_layers)  # type: ignore[arg-type]
        if k > depth:
            raise PolicyError(f"recompute num_layers={k} but the layer stack has {depth} layers: "
                              f"use k <= {depth}")
        if self.method == "block":
            return [(i,) for i in range(k)]
        return [tuple(range(s, min(s + k, depth))) for s in range(0, depth, k)]


def _megatron_tokens(argv: object) -> list[str]:
    """The tokens of a Megatron command line given as one string (split like a shell) or a list of strings."""
    if isinstance(argv, str):
        try:
            return shlex.split(argv)
        except ValueError as err:  # shlex: "No closing quotation", "No escaped character"
            raise PolicyError(f"cannot split the Megatron command line {argv!r}: {err}; close the quote (or escape "
                              "the character), or pass the flags as a list of tokens") from None
    if isinstance(argv, Iterable) and not isinstance(argv, (bytes, bytearray, Mapping)):
        tokens = list(argv)
        if all(isinstance(tok, str) for tok in tokens):
            return tokens
    raise PolicyError(f"Megatron flags must be one string or a list of strings, got {type(argv).__name__} "
                      f"{argv!r:.60}: e.g. '--recompute-granularity full --recompute-method uniform "
                      "--recompute-num-layers 1'")
