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
# TransformerEngine's layer-level CPU offloading: Megatron's --cpu-offloading-num-layers N > 0 sets cpu_offloading
# (training/arguments.py:1950-1951); remat.recompute.layer_offload runs it (NOTE [TE's layer offloading] there)
CPU_OFFLOAD_FLAG = "--cpu-offloading-num-layers"

OFFLOAD_GRAMMAR = """\
',offload:M1+M2+...'   Megatron's fine-grained activation offloading of modules M from attn_norm, qkv_linear,
                        core_attn, attn_proj, mlp_norm, expert_fc1, moe_act (attn_proj needs core_attn),
                        e.g. selective/core_attn,offload:attn_norm+qkv_linear or none,offload:core_attn+attn_proj
',offload_min:N'        with offload: tensors under N elements stay on the device (--min-offloaded-tensor-size,
                        default 1048576)
',cpu_offload:N'        TransformerEngine's CPU offloading of the first N layers (--cpu-offloading-num-layers N;
                        granularity none, no offload modules)"""


class OffloadPolicyError(ValueError):
    """An offload setting Megatron-LM (or remat) refuses; :class:`~remat.policy.Policy` re-raises it as a
    :class:`~remat.policy.PolicyError` with the same message."""


# the example value each integer flag's error shows, and what it counts
_INT_FLAGS = {CPU_OFFLOAD_FLAG: ("2", "layers"), MIN_SIZE_FLAG: ("1048576", "elements")}


def _value(tokens: Sequence[str], i: int, name: str) -> str:
    """The value after flag ``name`` (``tokens[i]``), refused when there is none."""
    if i >= len(tokens) or tokens[i].startswith("--"):
        raise OffloadPolicyError(f"{name} needs a value, e.g. {name} {_INT_FLAGS[name][0]}")
    return tokens[i]


def _count(text: str, name: str) -> int:
    """An integer flag's value: digits 0-9 only."""
    if not re.fullmatch(r"[0-9]{1,18}", text.strip()):
        example, unit = _INT_FLAGS[name]
        raise OffloadPolicyError(f"{name} needs an integer >= 0 ({unit}, digits 0-9), got {text!r}: e.g. "
                                 f"{name} {example}")
    return int(text.strip())


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


def check_cpu_offload(layers: object, offload_modules: Sequence[str], granularity: str) -> int:
    """``cpu_offloading_num_layers`` as an int >= 0 (0: none), refused where Megatron refuses it: beside recompute
    (transformer_config.py:1896-1899) or fine-grained offloading (:2127-2129). The layer count and the pipeline
    are the job's to check (:1884-1894)."""
    if isinstance(layers, bool) or not isinstance(layers, numbers.Integral) or layers < 0:
        raise OffloadPolicyError(f"cpu_offloading_num_layers must be an integer >= 0 (layers), got {layers!r}: e.g. "
                                 f"{CPU_OFFLOAD_FLAG} 2")
    if layers and granularity != "none":
        raise OffloadPolicyError(f"{CPU_OFFLOAD_FLAG} with activation recompute: Megatron raises 'CPU offloading does "
                                 "not work when activation recomputation is enabled' (transformer_config.py:1896): "
                                 "drop the recompute flags, or the offloading")
    if layers and offload_modules:
        raise OffloadPolicyError(f"{CPU_OFFLOAD_FLAG} with {FINE_GRAINED_FLAG}: Megatron asserts "
                                 "'fine_grained_activation_offloading cannot be enabled with cpu_offloading' "
                                 "(transformer_config.py:2127-2129): keep one")
    return int(layers)


def cpu_offload_job_problem(layers: int, num_layers: int, pp: int) -> str | None:
    """Why Megatron refuses ``--cpu-offloading-num-layers layers`` in a job of ``num_layers`` layers over ``pp``
    pipeline stages (transformer_config.py:1884-1894), or None."""
    if layers and layers >= num_layers:
        return (f"{CPU_OFFLOAD_FLAG} {layers} with --num-layers {num_layers}: Megatron raises 'CPU offloading can be "
                f"done only for layers less than {num_layers}' (transformer_config.py:1884-1889; TransformerEngine "
                f"keeps the last layer on the device, cpu_offload.py:843-847): use at most {num_layers - 1}")
    if layers and pp > 1:
        return (f"{CPU_OFFLOAD_FLAG} with pipeline parallelism (pp={pp}): Megatron raises 'Currently there is no "
                "support for Pipeline parallelism with CPU offloading' (transformer_config.py:1891-1894): use "
                "--pipeline-model-parallel-size 1, or drop the offloading")
    return None


def format_offload(modules: Sequence[str], min_size: int, cpu_layers: int = 0) -> str:
    """The short-form options of an offload setting: ``''`` without modules, else ``,offload:M1+M2`` and, when
    ``min_size`` is not Megatron's default, ``,offload_min:N``; ``,cpu_offload:N`` for TE's layer offloading."""
    if cpu_layers:
        return f",cpu_offload:{cpu_layers}"
    if not modules:
        return ""
    text = ",offload:" + "+".join(modules)
    return text if min_size == MIN_OFFLOADED_TENSOR_SIZE else f"{text},offload_min:{min_size}"


def parse_offload_option(option: str, fields: dict) -> bool:
    """Read one short-form option (``offload:M1+M2`` or ``offload_min:N``) into ``fields``
    (``offload_modules`` / ``min_offloaded_tensor_size``); False when ``option`` is not an offload option."""
    name, colon, value = option.partition(":")
    if name not in ("offload", "offload_min", "cpu_offload"):
        return False
    key = {"offload": "offload_modules", "offload_min": "min_offloaded_tensor_size",
           "cpu_offload": "cpu_offloading_num_layers"}[name]
    if key in fields:
        raise OffloadPolicyError(f"',{name}:' is given twice: keep one")
    if not colon or not value:
        example = {"offload": "offload:core_attn+attn_proj", "offload_min": "offload_min:1048576",
                   "cpu_offload": "cpu_offload:2"}[name]
        raise OffloadPolicyError(f"',{name}' needs a value after ':', e.g. ',{example}'")
    if name == "offload":
        mods = value.split("+")
        if "" in mods:
            raise OffloadPolicyError(f"empty offload module name in ',offload:{value}'")
        fields[key] = tuple(mods)
    else:
        if not re.fullmatch(r"[0-9]{1,18}", value):
            what, example = ("layer count", 2) if name == "cpu_offload" else ("minimum size in elements", 1048576)
            raise OffloadPolicyError(f"',{name}:{value}': write the {what} with digits 0-9, e.g. ',{name}:{example}'")
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
    cpu_layers = 0
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
        elif name in (CPU_OFFLOAD_FLAG, MIN_SIZE_FLAG):
            if not eq:
                inline, i = _value(tokens, i, name), i + 1
            count = _count(inline, name)
            cpu_layers, min_size = (count, min_size) if name == CPU_OFFLOAD_FLAG else (cpu_layers, count)
    if not switch:
        if modules is not None or min_size is not None:
            given = MODULES_FLAG if modules is not None else MIN_SIZE_FLAG
            raise OffloadPolicyError(f"{given} without {FINE_GRAINED_FLAG} offloads nothing (Megatron ignores it): add "
                                     f"{FINE_GRAINED_FLAG}, or drop {given}")
        return {"cpu_offloading_num_layers": cpu_layers} if cpu_layers else {}
    if cpu:
        raise OffloadPolicyError(f"{FINE_GRAINED_FLAG} cannot be combined with --cpu-offloading (Megatron refuses it): "
                                 "drop --cpu-offloading (transformer_config.py:2127-2129)")
    if not modules:
        raise OffloadPolicyError(f"{FINE_GRAINED_FLAG} needs {MODULES_FLAG} with at least one module (Megatron "
                                 f"asserts it), e.g. {MODULES_FLAG} core_attn attn_proj; valid modules are "
                                 f"{', '.join(OFFLOAD_MODULES)}")
    fields: dict = {"offload_modules": tuple(modules)}
    if min_size is not None:
        fields["min_offloaded_tensor_size"] = min_size
    if cpu_layers:
        fields["cpu_offloading_num_layers"] = cpu_layers  # refused beside the modules by check_cpu_offload
    return fields


def offload_to_megatron(modules: Sequence[str], min_size: int, cpu_layers: int = 0) -> list[str]:
    """Megatron-LM flags of an offload setting ([] without modules); the minimum size only when not the default;
    ``--cpu-offloading-num-layers N`` for TE's layer offloading."""
    if cpu_layers:
        return [CPU_OFFLOAD_FLAG, str(cpu_layers)]
    if not modules:
        return []
    args = [FINE_GRAINED_FLAG, MODULES_FLAG, *modules]
    return args if min_size == MIN_OFFLOADED_TENSOR_SIZE else [*args, MIN_SIZE_FLAG, str(min_size)]
