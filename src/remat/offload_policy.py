"""Megatron-LM's fine-grained activation offloading as a part of a :class:`~remat.policy.Policy`: which modules'
saved tensors wait for backward in host memory, the minimum size of an offloaded tensor, their short form
(``,offload:core_attn+attn_proj``) and their Megatron-LM flags (``--fine-grained-activation-offloading
--offload-modules ... --min-offloaded-tensor-size N``).

The semantics (megatron-core 0.16.1, ``pipeline_parallel/fine_grained_activation_offload.py``), which
:mod:`remat.recompute.activation_offload` reproduces: inside each chosen module's forward every tensor autograd saves
is tagged; when the module's *group* commits (its forward ends; ``attn_norm`` and ``mlp_norm`` wait for the
residual add after the attention / MLP, ``moe_act`` for the experts' fc2) each saved tensor of at least
``min_offloaded_tensor_size`` elements (parameters excepted) is copied to pinned host memory on a side stream and
its device memory is released; smaller tensors stay on the device. In backward each group's start function brings
back the top group of its forward's reload stack (or of the next backward's, once its own is empty), a tensor needed
earlier comes back alone, and the copies are freed once used (NOTE [when offloaded groups come back] there). In
Megatron's steady state (every iteration after the first) the last group of each module name is not offloaded, so
that backward never waits for it.
"""

from __future__ import annotations

import numbers
import re
from collections.abc import Sequence

# Megatron's allowed offload_modules (transformer_config.py), in the order a layer runs them
OFFLOAD_MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act")
MIN_OFFLOADED_TENSOR_SIZE = 1024 * 1024  # Megatron's default min_offloaded_tensor_size, in elements
FINE_GRAINED_FLAG = "--fine-grained-activation-offloading"
MODULES_FLAG = "--offload-modules"
MIN_SIZE_FLAG = "--min-offloaded-tensor-size"
OFFLOAD_FLAGS = (FINE_GRAINED_FLAG, MODULES_FLAG, MIN_SIZE_FLAG)

OFFLOAD_GRAMMAR = """\
',offload:M1+M2+...'   Megatron's fine-grained activation offloading of modules M from attn_norm, qkv_linear,
                        core_attn, attn_proj, mlp_norm, expert_fc1, moe_act (attn_proj needs core_attn),
                        e.g. selective/core_attn,offload:attn_norm+qkv_linear or none,offload:core_attn+attn_proj
',offload_min:N'        with offload: tensors under N elements stay on the device (--min-offloaded-tensor-size,
                        default 1048576)"""


class OffloadPolicyError(ValueError):
    """An offload setting Megatron-LM (or remat) refuses; :class:`~remat.policy.Policy` re-raises it as a
    :class:`~remat.policy.PolicyError` with the same message."""


def normalise_offload_modules(value: object) -> tuple[str, ...]:
    """Offload module names checked (Megatron's allowed set), deduplicated and sorted in :data:`OFFLOAD_MODULES`
    order; ``attn_proj`` without ``core_attn`` is refused as Megatron refuses it."""
    if isinstance(value, (str, bytes, bool)) or not isinstance(value, (list, tuple, set, frozenset)):
        raise OffloadPolicyError(f"offload_modules must be a list or tuple of names such as ('core_attn', 'attn_proj'),"
                                 f" got {value!r}")
    names = set()
    for name in value:
        key = name.strip().lower() if isinstance(name, str) else name
        if key not in OFFLOAD_MODULES:
            hint = " (separate modules with spaces in Megatron flags, '+' in remat)" if isinstance(key, str) and \
                "," in key else ""
            raise OffloadPolicyError(f"unknown offload module {name!r}{hint}: valid modules are "
                                     f"{', '.join(OFFLOAD_MODULES)} (Megatron's --offload-modules)")
        names.add(key)
    if "attn_proj" in names and "core_attn" not in names:
        raise OffloadPolicyError("offload module attn_proj needs core_attn (Megatron refuses attn_proj alone: its "
                                 "input is core_attn's output, which core_attn's backward needs): add core_attn "
                                 "(--offload-modules core_attn attn_proj; in remat ',offload:core_attn+attn_proj')")
    return tuple(m for m in OFFLOAD_MODULES if m in names)


def check_min_size(value: object, modules: Sequence[str]) -> int:
    """``min_offloaded_tensor_size`` as an int >= 0; a non-default value without offload modules is refused (it
    would do nothing)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise OffloadPolicyError(f"min_offloaded_tensor_size must be an integer >= 0 (elements), got {value!r}: e.g. "
                                 f"{MIN_SIZE_FLAG} {MIN_OFFLOADED_TENSOR_SIZE}")
    if not modules and int(value) != MIN_OFFLOADED_TENSOR_SIZE:
        raise OffloadPolicyError(f"min_offloaded_tensor_size={value} has no effect without offload modules: drop it "
                                 f"({MIN_SIZE_FLAG}), or add {FINE_GRAINED_FLAG} {MODULES_FLAG} M... (in remat "
                                 "',offload:M1+M2')")
    return int(value)


def check_offload_combination(offload_modules: Sequence[str], granularity: str, method: str | None,
                              modules: Sequence[str], engine: str) -> None:
    """Refuse offloading beside recompute settings that leave it nothing to offload (Megatron accepts them and
    offloads nothing): full/uniform and non_matmul save nothing in the layers' forward, and the non-reentrant
    checkpoint of a module that is also offloaded keeps that module's inputs itself."""
    if not offload_modules:
        return
    fix = "drop the offload modules, or "
    if granularity == "full" and method == "uniform":
        raise OffloadPolicyError("full/uniform checkpoints every layer, which then saves nothing for backward, so "
                                 f"fine-grained offloading would offload nothing: {fix}use full/block/K or selective")
    if "non_matmul" in modules:
        raise OffloadPolicyError("selective non_matmul runs every layer under torch's selective checkpointing, which "
                                 f"keeps what it saves itself, so offloading would offload nothing: {fix}drop "
                                 "non_matmul")
    overlap = [m for m, r in (("attn_norm", "layernorm"), ("mlp_norm", "layernorm"), ("core_attn", "core_attn"))
               if m in offload_modules and r in modules]
    if overlap and engine == "non-reentrant":
        raise OffloadPolicyError(f"offload module {overlap[0]} is also recomputed, and the non-reentrant checkpoint "
                                 "keeps its inputs itself, so nothing would be offloaded: use the reentrant engine "
                                 f"(Megatron's; drop '@non-reentrant'), or stop offloading {overlap[0]}")


def format_offload(modules: Sequence[str], min_size: int) -> str:
    """The short-form options of an offload setting: ``''`` without modules, else ``,offload:M1+M2`` and, when
    ``min_size`` is not Megatron's default, ``,offload_min:N``."""
    if not modules:
        return ""
    text = ",offload:" + "+".join(modules)
    return text if min_size == MIN_OFFLOADED_TENSOR_SIZE else f"{text},offload_min:{min_size}"


def parse_offload_option(option: str, fields: dict) -> bool:
    """Read one short-form option (``offload:M1+M2`` or ``offload_min:N``) into ``fields``
    (``offload_modules`` / ``min_offloaded_tensor_size``); False when ``option`` is not an offload option."""
    name, colon, value = option.partition(":")
    if name not in ("offload", "offload_min"):
        return False
    key = "offload_modules" if name == "offload" else "min_offloaded_tensor_size"
    if key in fields:
        raise OffloadPolicyError(f"',{name}:' is given twice: keep one")
    if not colon or not value:
        example = "offload:core_attn+attn_proj" if name == "offload" else "offload_min:1048576"
        raise OffloadPolicyError(f"',{name}' needs a value after ':', e.g. ',{example}'")
    if name == "offload":
        mods = value.split("+")
        if "" in mods:
            raise OffloadPolicyError(f"empty offload module name in ',offload:{value}'")
        fields[key] = tuple(mods)
    else:
        if not re.fullmatch(r"[0-9]{1,18}", value):
            raise OffloadPolicyError(f"',offload_min:{value}': write the minimum size in elements with digits 0-9, "
                                     "e.g. ',offload_min:1048576'")
        fields[key] = int(value)
    return True


def offload_from_megatron(tokens: Sequence[str]) -> dict:
    """The offload fields of a Megatron-LM command line (``offload_modules``, ``min_offloaded_tensor_size``; {}
    without offload flags).

    Reads ``--fine-grained-activation-offloading``, ``--offload-modules`` (several values, or one with ``=``) and
    ``--min-offloaded-tensor-size N``; other flags are skipped. Refused, as Megatron refuses them: the switch
    without modules and the switch with ``--cpu-offloading``; refused by remat (Megatron silently ignores them):
    modules or a minimum size without the switch.
    """
    switch = cpu = False
    modules: list[str] | None = None
    min_size: int | None = None
    i = 0
    while i < len(tokens):
        name, eq, inline = tokens[i].partition("=")
        i += 1
        if name in (FINE_GRAINED_FLAG, "--cpu-offloading"):
            if eq:
                raise OffloadPolicyError(f"{name} takes no value, got {tokens[i - 1]!r}: write just {name}")
            switch, cpu = switch or name == FINE_GRAINED_FLAG, cpu or name == "--cpu-offloading"
        elif name == MODULES_FLAG:
            values = [inline] if eq else []
            while not eq and i < len(tokens) and not tokens[i].startswith("-"):
                values.append(tokens[i])
                i += 1
            modules = values
        elif name == MIN_SIZE_FLAG:
            if not eq:
                if i >= len(tokens) or tokens[i].startswith("--"):
                    raise OffloadPolicyError(f"{MIN_SIZE_FLAG} needs a value, e.g. {MIN_SIZE_FLAG} 1048576")
                inline, i = tokens[i], i + 1
            if not re.fullmatch(r"[0-9]{1,18}", inline.strip()):
                raise OffloadPolicyError(f"{MIN_SIZE_FLAG} needs an integer >= 0 (elements, digits 0-9), got "
                                         f"{inline!r}: e.g. {MIN_SIZE_FLAG} 1048576")
            min_size = int(inline.strip())
    if not switch:
        if modules is not None or min_size is not None:
            given = MODULES_FLAG if modules is not None else MIN_SIZE_FLAG
            raise OffloadPolicyError(f"{given} without {FINE_GRAINED_FLAG} offloads nothing (Megatron ignores it): add "
                                     f"{FINE_GRAINED_FLAG}, or drop {given}")
        return {}
    if cpu:
        raise OffloadPolicyError(f"{FINE_GRAINED_FLAG} cannot be combined with --cpu-offloading (Megatron refuses it): "
                                 "drop --cpu-offloading (remat models only the fine-grained offloading)")
    if not modules:
        raise OffloadPolicyError(f"{FINE_GRAINED_FLAG} needs {MODULES_FLAG} with at least one module (Megatron "
                                 f"asserts it), e.g. {MODULES_FLAG} core_attn attn_proj; valid modules are "
                                 f"{', '.join(OFFLOAD_MODULES)}")
    fields: dict = {"offload_modules": tuple(modules)}
    if min_size is not None:
        fields["min_offloaded_tensor_size"] = min_size
    return fields


def offload_to_megatron(modules: Sequence[str], min_size: int) -> list[str]:
    """Megatron-LM flags of an offload setting ([] without modules); the minimum size only when not the default."""
    if not modules:
        return []
    args = [FINE_GRAINED_FLAG, MODULES_FLAG, *modules]
    return args if min_size == MIN_OFFLOADED_TENSOR_SIZE else [*args, MIN_SIZE_FLAG, str(min_size)]
