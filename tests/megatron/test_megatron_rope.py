"""Megatron-core's own unfused rotary embedding (``_apply_rotary_pos_emb_bshd``, run under --no-rope-fusion) beside
remat's (NOTE [unfused rope] in remat.models.blocks): the same allocations in the same order, the same tensors kept
for the backward, the same result and gradient, bit for bit."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from remat.megatron.compat import MegatronUnavailable, require_megatron_core

try:
    require_megatron_core()
except MegatronUnavailable as err:
    pytest.skip(str(err), allow_module_level=True)

from remat.config import ModelConfig  # noqa: E402
from remat.models.blocks import apply_rotary, apply_rotary_unfused  # noqa: E402
from remat.models.gpt import rotary_tables  # noqa: E402

S, B, HEADS, D = 16, 2, 3, 8


class _Allocations(TorchDispatchMode):
    """The bytes of each operator output that is a new tensor (not a view of, nor written into, an input)."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes: list[int] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.nbytes.append(t.untyped_storage().nbytes())
        return out


def _run(rope: Any, t: torch.Tensor) -> tuple[torch.Tensor, list[int], list[int], torch.Tensor]:
    """``rope(t)``'s result, the bytes of its allocations in order, the bytes of the tensors autograd keeps (each
    storage once) and the gradient of ``t``."""
    kept: dict[int, int] = {}

    def pack(saved: torch.Tensor) -> torch.Tensor:
        kept.setdefault(saved.untyped_storage().data_ptr(), saved.untyped_storage().nbytes())
        return saved

    t = t.detach().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda saved: saved), _Allocations() as allocations:
        out = rope(t)
    grad = torch.arange(out.numel(), dtype=torch.float32).reshape(out.shape).sin().to(out.dtype)
    out.backward(grad)
    return out.detach(), allocations.nbytes, sorted(kept.values()), t.grad


@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_remat_unfused_rope_allocates_and_keeps_what_megatrons_does(mla, dtype) -> None:
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    config = ModelConfig(num_layers=1, hidden_size=HEADS * D, num_attention_heads=HEADS, seq_length=S,
                         position="rope", dtype=dtype)
    cos, sin = rotary_tables(config, S, torch.device("cpu"))
    # Megatron's RotaryEmbedding.forward: freqs = outer(positions, inv_freq), emb = cat((freqs, freqs)) [s, 1, 1, d]
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    angles = torch.outer(torch.arange(S, dtype=torch.float32), inv_freq)
    freqs = torch.cat((angles, angles), dim=-1)[:, None, None, :]
    t = torch.randn(S, B, HEADS, D, generator=torch.Generator().manual_seed(0)).to(config.torch_dtype)

    megatron = _run(lambda x: _apply_rotary_pos_emb_bshd(x, freqs, multi_latent_attention=mla), t)
    # remat's layout is [b, heads, s, d]: the same tensor through a permuted view
    remat = _run(lambda x: apply_rotary_unfused(x.permute(1, 2, 0, 3), cos, sin, mla_interleaved=mla)
                 .permute(2, 0, 1, 3), t)

    assert remat[1] == megatron[1]  # every allocation, in order
    element = config.torch_dtype.itemsize
    assert remat[2] == megatron[2] == [S * D * element] * 2  # cos_ and sin_, made at this application
    assert torch.equal(remat[0], megatron[0]) and torch.equal(remat[3], megatron[3])
    if not mla:  # the fused path's reference rotation: the same values, keeping only the shared tables
        fused = _run(lambda x: apply_rotary(x.permute(1, 2, 0, 3), cos, sin).permute(2, 0, 1, 3), t)
        assert torch.allclose(fused[0].float(), megatron[0].float(), atol=1e-2 if dtype == "bf16" else 1e-6)
        assert fused[2] == sorted([cos.untyped_storage().nbytes(), sin.untyped_storage().nbytes()])
