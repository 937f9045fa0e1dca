"""Megatron-core's own all-to-all token dispatcher, run on CPU: what it still holds after a layer's forward and
backward, against what remat counts for it (NOTE [the all-to-all dispatcher's attributes] in
remat.memory.workspaces)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from remat.megatron.compat import MegatronUnavailable, require_megatron_core

try:
    require_megatron_core()
except MegatronUnavailable as err:
    pytest.skip(str(err), allow_module_level=True)

from remat.config import ModelConfig  # noqa: E402
from remat.job import Job  # noqa: E402
from remat.megatron.cpu_patches import megatron_on_cpu  # noqa: E402
from remat.megatron.world import ParallelSizes, megatron_world  # noqa: E402
from remat.memory.workspaces import MODULE_ALLTOALL, alltoall_kept_bytes, stage_workspaces  # noqa: E402
from remat.units import CUDA_BLOCK, round_up  # noqa: E402

SEQ, BATCH, HIDDEN, EXPERTS, TOPK = 32, 2, 64, 4, 2
TOKENS = SEQ * BATCH
# made on the host unless --moe-permute-fusion (permute_idx_device, or moved there at the dtoh point): the chunk-sort
# indices and the counts per local expert
HOST_SIDE = {"sort_input_by_local_experts", "restore_output_by_local_experts", "num_global_tokens_per_local_expert"}


def _held_after_a_step(router_dtype: str | None) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The tensors megatron-core's MoEAlltoAllTokenDispatcher holds once its layer's forward and backward are done."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe import token_dispatcher
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.moe_utils import maybe_move_tensor_to_cpu

    def to_host(self, point, tokens_per_expert=None):  # _maybe_dtoh_and_synchronize without its CUDA side stream
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            tokens_per_expert = maybe_move_tensor_to_cpu(tokens_per_expert)
            for name in ("input_splits", "output_splits", "output_splits_tp"):
                setattr(self, name, maybe_move_tensor_to_cpu(getattr(self, name), as_numpy=True))
        return tokens_per_expert

    dispatcher = token_dispatcher.MoEAlltoAllTokenDispatcher
    with megatron_on_cpu(), megatron_world(ParallelSizes(), 0, backend="gloo"), \
            mock.patch.object(dispatcher, "cuda_dtoh_stream", object()), \
            mock.patch.object(dispatcher, "_maybe_dtoh_and_synchronize", to_host):
        config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, add_bias_linear=False,
                                   use_cpu_initialization=True, num_moe_experts=EXPERTS, moe_router_topk=TOPK,
                                   moe_token_dispatcher_type="alltoall", moe_router_dtype=router_dtype)
        spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False)
        layer = MoELayer(config, spec.submodules.mlp.submodules)
        for _ in range(2):  # a second step replaces what the first left
            output, _ = layer(torch.randn(SEQ, BATCH, HIDDEN, requires_grad=True))
            output.sum().backward()
            del output
        return {name: (tuple(value.shape), value.dtype) for name, value in vars(layer.token_dispatcher).items()
                if isinstance(value, torch.Tensor)}


@pytest.mark.parametrize("router_dtype", [None, "fp64"])
def test_megatrons_alltoall_dispatcher_holds_the_dense_routing_remat_counts(router_dtype):
    held = _held_after_a_step(router_dtype)
    probs_dtype = torch.float64 if router_dtype == "fp64" else torch.float32  # the logits' dtype (an fp32 model)
    on_device = {name: value for name, value in held.items() if name not in HOST_SIDE}
    assert on_device == {
        "probs": ((TOKENS, EXPERTS), probs_dtype),
        "routing_map": ((TOKENS, EXPERTS), torch.bool),
        "reversed_local_input_permutation_mapping": ((TOKENS * TOPK,), torch.int64),  # the unfused permute's map
    }
    counted = sum(round_up(torch.Size(shape).numel() * dtype.itemsize, CUDA_BLOCK)  # in whole CUDA blocks
                  for shape, dtype in on_device.values())
    cfg = ModelConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, seq_length=SEQ, micro_batch_size=BATCH,
                      num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_token_dispatcher_type="alltoall",
                      moe_router_dtype=router_dtype)
    job = Job.build(cfg, precision="fp32")
    assert alltoall_kept_bytes(job, 0) == counted
    assert (MODULE_ALLTOALL, counted) in stage_workspaces(job, 0)
