"""Run megatron-core's model code on CPU and under FakeTensorMode, inside a context that undoes itself.

megatron-core assumes a GPU in a handful of places (listed in :data:`WORKAROUNDS`, each with the test in
tests/megatron/test_cpu_patches.py that fails if megatron-core's behaviour changes). :func:`megatron_on_cpu`
replaces exactly those attributes while it is active and puts every original back on exit, together with the
CPU random-number generator's state; nothing is patched at import time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from remat.megatron.compat import MegatronUnavailable, require_megatron_core

# NOTE [the "CUDA" generator is the CPU generator]
# Megatron keeps named CUDA RNG states (data-parallel, model-parallel, expert-parallel) and forks between them so
# that dropout differs between tensor-parallel ranks; checkpoints save and restore those states. On CPU the ops
# draw from torch's CPU generator, so the "CUDA" state Megatron reads and writes is redirected to the CPU
# generator: its forks then govern CPU dropout exactly as they govern GPU dropout, and recomputation replays the
# same masks. Megatron's fork() also warns when the CPU state changed inside it (always true here) by comparing
# two states with ``.item()``, which fails under FakeTensorMode; the replacement fork keeps the state switching
# and drops that check.


@dataclass(frozen=True)
class Workaround:
    """One attribute of megatron-core (or torch) replaced while :func:`megatron_on_cpu` is active."""

    owner: str        # dotted path of the module or class that holds the attribute
    attribute: str
    why: str          # what megatron-core does on a CPU-only build without it
    test: str         # the test that fails if megatron-core's behaviour changes
    absent: bool = False  # the attribute is missing from megatron-core (the bug) and is added for the context


WORKAROUNDS = (
    Workaround("torch.cuda", "current_device",
               "GlobalMemoryBuffer and others allocate on torch.cuda.current_device(); answered with 'cpu'",
               "test_global_memory_buffer_needs_a_device"),
    Workaround("torch.cuda", "get_rng_state", "the RNG tracker's add() reads the CUDA generator (CPU generator)",
               "test_rng_tracker_add_needs_cuda"),
    Workaround("torch.cuda", "manual_seed", "model_parallel_cuda_manual_seed seeds the CUDA generator (CPU "
               "generator)", "test_rng_tracker_add_needs_cuda"),
    Workaround("megatron.core.tensor_parallel.random", "_get_cuda_rng_state",
               "checkpoints save the CUDA generator state (CPU generator)", "test_get_cuda_rng_state_needs_cuda"),
    Workaround("megatron.core.tensor_parallel.random", "_set_cuda_rng_state",
               "goes through torch.cuda._lazy_call, which on a CPU build silently never runs: recompute would not "
               "replay dropout", "test_set_cuda_rng_state_is_silently_skipped"),
    Workaround("megatron.core.tensor_parallel.random.CudaRNGStatesTracker", "fork",
               "compares two RNG states with .item(), which fails under FakeTensorMode",
               "test_rng_fork_fails_under_fake_tensors"),
    Workaround("megatron.core.tensor_parallel.random.CheckpointWithoutOutput", "__init__",
               "sets self.fp8 = (fp8 is not None), so fp8=False means fp8 and needs TransformerEngine "
               "(recompute_modules layernorm / moe_act / mla_up_proj)", "test_checkpoint_without_output_fp8_flag"),
    Workaround("megatron.core.transformer.utils", "get_default_causal_mask",
               "builds the causal mask with device='cuda'", "test_default_causal_mask_is_on_cuda"),
    Workaround("megatron.core.fusions.fused_softmax", "get_default_causal_mask",
               "imported by name from transformer.utils", "test_default_causal_mask_is_on_cuda"),
    Workaround("megatron.core.parallel_state", "_GLOBAL_MEMORY_BUFFER",
               "keeps its tensors across builds ('Mixing fake modes' when a fake trace follows another): "
               "emptied, so initialize_model_parallel makes a fresh one per rank",
               "test_global_memory_buffer_keeps_tensors"),
    Workaround("megatron.core.transformer.moe.moe_utils", "te_general_gemm",
               "never defined without TransformerEngine, yet the router's gating reads it: NameError in every MoE "
               "forward; defined as None (the torch matmul path)", "test_moe_router_reads_undefined_te_gemm",
               absent=True),
    Workaround("megatron.core.transformer.multi_latent_attention", "HAVE_TE",
               "True without TransformerEngine (its TELinear is a MagicMock stand-in), so MLA's isinstance(..., "
               "TELinear) raises TypeError; set False", "test_mla_believes_te_is_installed"),
    Workaround("megatron.core.transformer.dot_product_attention.DotProductAttention", "__init__",
               "MLA passes k_channels/v_channels, which the local (non-TransformerEngine) core attention does not "
               "take; accepted, with the output width set from v_channels", "test_local_attention_refuses_k_channels"),
)


def _resolve(path: str) -> Any:
    import importlib

    parts = path.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(path)


def _causal_mask_on_cpu(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


def _get_cpu_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    torch.set_rng_state(new_state)


def _fork_without_item_check(original_name: str) -> Callable[..., Any]:
    @contextlib.contextmanager
    def fork(self: Any, name: str = original_name) -> Iterator[None]:
        # megatron-core 0.16.1's CudaRNGStatesTracker.fork, minus the CPU-state check (see the NOTE above)
        if name not in self.states_:
            raise Exception(f"cuda rng state {name} is not added")
        orig_state = torch.get_rng_state()
        orig_name = self._current_state_name
        if orig_name != "default-rng":
            self.states_[orig_name] = orig_state
        torch.set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            if orig_name != "default-rng":
                orig_state = self.states_[orig_name]
            torch.set_rng_state(orig_state)
            self._current_state_name = orig_name
    return fork


def _checkpoint_without_output_init(original: Callable[..., None]) -> Callable[..., None]:
    def __init__(self: Any, fp8: Any = False) -> None:
        original(self, fp8)
        self.fp8 = fp8 is not None and fp8 is not False  # what megatron-core means: fp8 only when asked for
    return __init__


def _attention_with_head_widths(original: Callable[..., None]) -> Callable[..., None]:
    def __init__(self: Any, *args: Any, k_channels: int | None = None, v_channels: int | None = None,
                 **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if v_channels is not None:  # the context's width is heads x v_channels (MLA: v_head_dim), not kv_channels
            self.hidden_size_per_attention_head = v_channels
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition
    return __init__


def _replacements() -> dict[tuple[str, str], Any]:
    random = _resolve("megatron.core.tensor_parallel.random")
    return {
        ("torch.cuda", "current_device"): lambda: "cpu",
        ("torch.cuda", "get_rng_state"): _get_cpu_rng_state,
        ("torch.cuda", "manual_seed"): torch.manual_seed,
        ("megatron.core.tensor_parallel.random", "_get_cuda_rng_state"): _get_cpu_rng_state,
        ("megatron.core.tensor_parallel.random", "_set_cuda_rng_state"): _set_cpu_rng_state,
        ("megatron.core.tensor_parallel.random.CudaRNGStatesTracker", "fork"):
            _fork_without_item_check(random._MODEL_PARALLEL_RNG_TRACKER_NAME),
        ("megatron.core.tensor_parallel.random.CheckpointWithoutOutput", "__init__"):
            _checkpoint_without_output_init(random.CheckpointWithoutOutput.__init__),
        ("megatron.core.transformer.utils", "get_default_causal_mask"): _causal_mask_on_cpu,
        ("megatron.core.fusions.fused_softmax", "get_default_causal_mask"): _causal_mask_on_cpu,
        ("megatron.core.parallel_state", "_GLOBAL_MEMORY_BUFFER"): None,  # initialize_model_parallel makes one
        ("megatron.core.transformer.moe.moe_utils", "te_general_gemm"): None,
        ("megatron.core.transformer.multi_latent_attention", "HAVE_TE"): False,
        ("megatron.core.transformer.dot_product_attention.DotProductAttention", "__init__"):
            _attention_with_head_widths(_resolve("megatron.core.transformer.dot_product_attention")
                                        .DotProductAttention.__init__),
    }


_MISSING = object()


@contextlib.contextmanager
def replaced(owner: Any, replacements: dict[str, Any]) -> Iterator[None]:
    """Set attributes of ``owner`` for the duration of the context; the originals (or their absence) come back."""
    saved = {name: owner.__dict__.get(name, _MISSING) if isinstance(owner, type) else getattr(owner, name, _MISSING)
             for name in replacements}
    try:
        for name, value in replacements.items():
            setattr(owner, name, value)
        yield
    finally:
        for name, value in saved.items():
            if value is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, value)


@contextlib.contextmanager
def megatron_on_cpu(allow_untested: bool = False) -> Iterator[None]:
    """Apply every :data:`WORKAROUNDS` entry, so megatron-core's models build, run and recompute on CPU and under
    ``FakeTensorMode``; on exit every attribute and the CPU RNG state are as they were.

    Args:
        allow_untested: accept a megatron-core version other than :data:`remat.megatron.compat.TESTED_VERSIONS`.

    Example::

        >>> with megatron_on_cpu():
        ...     model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=128, max_sequence_length=64)
    """
    require_megatron_core(allow_untested)
    by_owner: dict[str, dict[str, Any]] = {}
    for (owner, attribute), value in _replacements().items():
        by_owner.setdefault(owner, {})[attribute] = value
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng(devices=[]))
        for owner_path, values in by_owner.items():
            owner = _resolve(owner_path)
            absent = {(w.owner, w.attribute) for w in WORKAROUNDS if w.absent}
            for attribute in values:
                if (owner_path, attribute) not in absent and not hasattr(owner, attribute):
                    raise MegatronUnavailable(f"{owner_path}.{attribute} is gone from this megatron-core: the CPU "
                                              "workaround for it must be revisited (remat.megatron.cpu_patches)")
            stack.enter_context(replaced(owner, values))
        yield


def patched_attributes() -> list[tuple[Any, str]]:
    """(owner object, attribute name) of every :data:`WORKAROUNDS` entry (what the restore test compares)."""
    require_megatron_core(allow_untested=True)
    return [(_resolve(w.owner), w.attribute) for w in WORKAROUNDS]
