"""Megatron-core's own TransformerBlock, run on CPU: which recompute settings save the attention mask for the
backward (its CheckpointFunction saves every argument), against remat.parallel.stages.keeps_layer_inputs, which
keeps the dataloader's mask to the micro-batch's backward in a job's prediction (NOTE [Megatron's batch on the
device] in remat.parallel.pipeline_runtime)."""

from __future__ import annotations

import pytest
import torch

from remat.megatron.compat import MegatronUnavailable, require_megatron_core

try:
    require_megatron_core()
except MegatronUnavailable as err:
    pytest.skip(str(err), allow_module_level=True)

from remat.megatron.cpu_patches import megatron_on_cpu  # noqa: E402
from remat.megatron.world import ParallelSizes, megatron_world  # noqa: E402
from remat.parallel.stages import keeps_layer_inputs  # noqa: E402
from remat.policy import Policy  # noqa: E402

SEQ, BATCH, HIDDEN, LAYERS = 16, 2, 32, 2


def _nodes_saving_the_mask(policy: Policy) -> list[str]:
    """The autograd nodes of a megatron-core TransformerBlock's training forward under ``policy`` that saved the
    attention mask it was given."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_config import TransformerConfig

    recompute = {}
    if policy.recomputes_layers:
        recompute = {"recompute_granularity": "full", "recompute_method": policy.method,
                     "recompute_num_layers": policy.num_layers}
    elif policy.is_selective:
        recompute = {"recompute_granularity": "selective", "recompute_modules": list(policy.modules)}
    with megatron_on_cpu(), megatron_world(ParallelSizes(), 0, backend="gloo"):
        config = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=4,
                                   use_cpu_initialization=True, **recompute)
        block = TransformerBlock(config, get_gpt_layer_local_spec()).train()
        mask = torch.ones(BATCH, 1, SEQ, SEQ, dtype=torch.bool).triu_(1)
        out = block(torch.randn(SEQ, BATCH, HIDDEN, requires_grad=True), mask)
        found, seen, todo = [], set(), [out.grad_fn]
        while todo:
            node = todo.pop()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            saved = getattr(node, "saved_tensors", None) or ()
            found += [type(node).__name__ for t in saved if isinstance(t, torch.Tensor)
                      and t.untyped_storage().data_ptr() == mask.untyped_storage().data_ptr()]
            todo.extend(next_node for next_node, _ in node.next_functions)
    return found


@pytest.mark.parametrize("policy", ["none", "full/uniform/1", "full/uniform/2", "full/block/1", "selective/core_attn",
                                    "selective/mlp", "selective/layernorm"])
def test_megatrons_checkpoints_keep_the_mask_where_remat_keeps_it(policy):
    parsed = Policy.parse(policy)
    nodes = _nodes_saving_the_mask(parsed)
    assert bool(nodes) == keeps_layer_inputs(parsed, LAYERS), nodes
    assert set(nodes) <= {"CheckpointFunctionBackward"}  # the checkpoints, not the attention's own kernels
