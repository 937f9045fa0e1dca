"""Megatron-LM's TransformerEngine CUDA graphs (``--cuda-graph-impl transformer_engine``, ``--cuda-graph-modules``,
``--cuda-graph-warmup-steps``): read into ``Job.cuda_graph_modules`` and checked here; what a rank then holds is
:mod:`remat.parallel.cuda_graphs` (NOTE [TE CUDA graphs] there).

Facts from Megatron-LM d98e8a64: ``--cuda-graph-impl`` is ``none`` (the default), ``local``, ``transformer_engine``
or ``full_iteration``; ``--cuda-graph-modules`` takes words (``nargs='+'``, ``training/arguments.py:2050``) among
``CudaGraphModule``'s names (``transformer/enums.py:61``), the deprecated ``full`` alone meaning every layer whole
(``transformer/cuda_graph_config.py:39-41``), as does an empty list; ``cuda_graph_warmup_steps`` defaults to 3
(``transformer_config.py:1066``, an argparse flag through ``ArgumentGroupFactory(TransformerConfig)``,
``arguments.py:2373``); the TE graphs are captured at the start of the training iteration whose index past the
start is that count (``training/training.py:4632-4645``): that many eager steps (their optimizer steps included)
run first. ``moe_preprocess`` needs ``moe_router`` (``transformer_config.py:2821-2824``); a selective recompute
module must lie wholly inside or outside the graphs (``transformer_config.py:2858-2870``): ``moe_act`` runs in the
routed experts, which the modelled scopes leave eager.
"""

from __future__ import annotations

from typing import Any

from remat.job_flags import JobError

# CudaGraphModule's members (megatron/core/transformer/enums.py:61) and what remat models of them
MEGATRON_MODULES = ("attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba")
MODELLED_MODULES = ("attn", "mlp", "moe_router", "moe_preprocess")
# selective recompute modules outside every modelled graph: the routed experts' activation (moe_layer.py:536-600,
# eager under the moe_router scope, transformer_layer.py:1376-1428)
EAGER_RECOMPUTE_MODULES = ("moe_act",)
DEFAULT_WARMUP_STEPS = 3  # transformer_config.py:1066


def parse_cuda_graph_modules(words: list[str]) -> tuple[str, ...]:
    """The scopes of ``--cuda-graph-modules WORD...`` (``[a b]``, ``a,b`` and ``a b`` alike); ``full`` or nothing:
    ``()``, every layer whole (cuda_graph_config.py:39-41).

    Example:
        >>> parse_cuda_graph_modules(["[attn", "mlp]"]), parse_cuda_graph_modules(["full"])
        (('attn', 'mlp'), ())
    """
    names = [w for word in words for w in word.strip("[]").replace(",", " ").split() if w]
    if names == ["full"]:
        return ()
    if "full" in names:  # cuda_graph_config.py:40
        raise JobError("--cuda-graph-modules full cannot be used with other scopes (Megatron asserts it): give "
                       "'full' alone, or the scopes alone")
    for name in names:
        if name not in MEGATRON_MODULES:
            raise JobError(f"--cuda-graph-modules {name}: Megatron's scopes are {', '.join(MEGATRON_MODULES)} "
                           "(or full); give those")
    return tuple(dict.fromkeys(names))


def cuda_graph_fields(got: dict[str, Any], ignored: list[str]) -> dict[str, Any]:
    """The Job fields of the CUDA-graph flags in ``got`` (flag -> parsed value): ``{'cuda_graph_modules': ...}``
    with TE graphs, ``{}`` without (the other flags then listed in ``ignored``, as Megatron reads them only with
    an implementation). Refuses, naming the flag and the fix, what remat does not model.

    Example:
        >>> cuda_graph_fields({"--cuda-graph-impl": "transformer_engine", "--cuda-graph-modules": ("[attn]",),
        ...                    "--cuda-graph-warmup-steps": 0}, [])
        {'cuda_graph_modules': ('attn',), 'cuda_graph_warmup_steps': 0}
    """
    impl = got.get("--cuda-graph-impl", "none")
    if impl == "none":
        ignored += [f for f in ("--cuda-graph-modules", "--cuda-graph-warmup-steps") if f in got]
        return {}
    modules = parse_cuda_graph_modules(list(got.get("--cuda-graph-modules", ())))
    unmodelled = [m for m in modules if m not in MODELLED_MODULES]
    if unmodelled:
        raise JobError(f"--cuda-graph-modules {' '.join(unmodelled)}: remat models TE CUDA graphs of whole layers "
                       f"and of the {', '.join(MODELLED_MODULES)} scopes; the moe scope needs drop-padding MoE "
                       "(transformer_config.py:2824-2829), which remat does not model yet: price the job with "
                       "--cuda-graph-modules attn moe_router, or without the graphs")
    warmup = got.get("--cuda-graph-warmup-steps", DEFAULT_WARMUP_STEPS)
    return {"cuda_graph_modules": tuple(modules), "cuda_graph_warmup_steps": warmup}


def cuda_graph_args(modules: tuple[str, ...] | None, warmup_steps: int = 0) -> list[str]:
    """The Megatron flags of ``Job.cuda_graph_modules`` and ``Job.cuda_graph_warmup_steps`` (the inverse of
    :func:`cuda_graph_fields`).

    Example:
        >>> cuda_graph_args(("attn",))
        ['--cuda-graph-impl', 'transformer_engine', '--cuda-graph-modules', 'attn', '--cuda-graph-warmup-steps', '0']
    """
    if modules is None:
        return []
    return ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-modules", *(modules or ("full",)),
            "--cuda-graph-warmup-steps", str(warmup_steps)]


def check_cuda_graphs(modules: Any, *, is_moe: bool, has_dense: bool, overlap_moe: bool, delay_wgrad: bool,
                      recompute: bool, fsdp: bool, warmup_steps: Any = 0,
                      selective_modules: tuple[str, ...] | None = None) -> None:
    """Refuse a ``Job.cuda_graph_modules`` remat cannot price, naming the field and the fix.

    Args:
        recompute: whether the job recomputes or offloads anything.
        selective_modules: the recompute modules when that is selective recompute alone (no offloading); those
            outside every graph (:data:`EAGER_RECOMPUTE_MODULES`) are priced.
    """
    if modules is None:
        return
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise JobError(f"cuda_graph_warmup_steps={warmup_steps!r} (--cuda-graph-warmup-steps): give the number of "
                       "eager steps before the capture, an integer >= 0")
    if not isinstance(modules, tuple) or any(m not in MODELLED_MODULES for m in modules):
        raise JobError(f"cuda_graph_modules={modules!r}: give None (no CUDA graphs), () (whole layers) or a tuple "
                       f"of {', '.join(MODELLED_MODULES)}")
    if is_moe and modules == ():  # a whole MoE layer in a graph needs drop-padding MoE (transformer_config.py:2824)
        raise JobError("TE CUDA graphs of whole layers (--cuda-graph-modules full, or none given) in a MoE model: "
                       "Megatron graphs a MoE layer whole only with drop-padding MoE, which remat does not model; "
                       "give --cuda-graph-modules attn")
    if "moe_preprocess" in modules and "moe_router" not in modules:  # transformer_config.py:2821-2824
        raise JobError("--cuda-graph-modules moe_preprocess graphs MoELayer.preprocess only beside the router "
                       "(Megatron asserts it): add moe_router")
    if "moe_router" in modules and not is_moe:  # transformer_config.py:2825-2829
        raise JobError("--cuda-graph-modules moe_router graphs a MoE layer's router, and the model has no MoE layer "
                       "(Megatron asserts it): drop moe_router / moe_preprocess")
    if "mlp" in modules and not has_dense:  # transformer_config.py:2814-2820
        raise JobError("--cuda-graph-modules mlp graphs dense MLPs, and the model has none (Megatron asserts it): "
                       "drop mlp")
    for given, flag in ((overlap_moe, "--overlap-moe-expert-parallel-comm"), (delay_wgrad, "--delay-wgrad-compute"),
                        (recompute and not (selective_modules is not None and set(selective_modules)
                                            <= set(EAGER_RECOMPUTE_MODULES)),
                         "--recompute-* / offloading (a recompute or offload policy other than selective recompute "
                         f"of {', '.join(EAGER_RECOMPUTE_MODULES)}, which runs outside the graphs)"),
                        (fsdp, "--use-megatron-fsdp")):
        if given:
            raise JobError(f"TE CUDA graphs (--cuda-graph-impl transformer_engine) beside {flag}: remat does not "
                           "model what the graphs capture of it yet; drop one of them")
