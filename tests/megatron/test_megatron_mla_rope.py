"""Megatron-core's own MLA attention, run on CPU: the rotary tables each layer keeps after a forward and backward,
against what remat counts for them (NOTE [MLA's rotary tables] in remat.memory.workspaces)."""

from __future__ import annotations

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
from remat.memory.workspaces import MODULE_MLA_ROPE, mla_rope_bytes, stage_workspaces  # noqa: E402
from remat.units import CUDA_BLOCK, round_up  # noqa: E402

SEQ, BATCH, HIDDEN, POS_DIM = 32, 2, 64, 8


def _kept_by_megatron(rope_type: str, layers: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor ``layers`` MLA attentions of megatron-core hold after a step (unfused rope): their rotary
    embeddings' tensors and buffers, and the tables their forward's lru_cache keeps."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    with megatron_on_cpu(), megatron_world(ParallelSizes(), 0, backend="gloo"):
        config = MLATransformerConfig(num_layers=layers, hidden_size=HIDDEN, num_attention_heads=4,
                                      use_cpu_initialization=True, add_bias_linear=False, q_lora_rank=32,
                                      kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=POS_DIM, v_head_dim=16,
                                      apply_rope_fusion=False, rope_type=rope_type)
        spec = get_gpt_layer_local_spec(multi_latent_attention=True).submodules.self_attention
        cache = (YarnRotaryEmbedding if rope_type == "yarn" else RotaryEmbedding).forward
        cache.cache_clear()  # one cache for every instance
        attentions = [MLASelfAttention(config, spec.submodules, layer_number=i + 1,
                                       attn_mask_type=spec.params["attn_mask_type"]) for i in range(layers)]
        for attention in attentions:
            output, _ = attention(torch.randn(SEQ, BATCH, HIDDEN, requires_grad=True), attention_mask=None)
            output.sum().backward()
        assert cache.cache_info().currsize == layers  # one table per layer, made at its first forward
        kept = []
        for attention in attentions:
            rotary = attention.rotary_pos_emb
            kept += [(tuple(t.shape), t.dtype) for t in vars(rotary).values() if isinstance(t, torch.Tensor)]
            kept += [(tuple(t.shape), t.dtype) for t in rotary.buffers()]
            table = rotary(SEQ, packed_seq=False)  # a hit (the key MLA calls it with): the cached table
            table = table[0] if isinstance(table, tuple) else table
            kept.append((tuple(table.shape), table.dtype))
        assert cache.cache_info().currsize == layers
        return kept


@pytest.mark.parametrize("rope_type", ["yarn", "rope"])
def test_megatrons_mla_layers_keep_the_rotary_tables_remat_counts(rope_type):
    kept = _kept_by_megatron(rope_type, layers=2)
    table = ((SEQ, 1, 1, POS_DIM), torch.float32)
    frequencies = ((POS_DIM // 2,), torch.float32)
    if rope_type == "yarn":  # inv_freq_extra, inv_freq_inter, inv_freq; cos_cached, sin_cached; the cached table
        per_layer = [frequencies] * 3 + [((4096, 1, 1, POS_DIM), torch.float32)] * 2 + [table]
    else:
        per_layer = [frequencies, table]
    assert sorted(kept, key=str) == sorted(per_layer * 2, key=str)
    cfg = ModelConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, seq_length=SEQ, micro_batch_size=BATCH,
                      multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=32, qk_head_dim=16,
                      qk_pos_emb_head_dim=POS_DIM, v_head_dim=16, apply_rope_fusion=False, mla_rope_type=rope_type)
    job = Job.build(cfg, precision="bf16")
    counted = sum(round_up(torch.Size(shape).numel() * dtype.itemsize, CUDA_BLOCK) for shape, dtype in kept)
    assert mla_rope_bytes(job, 0) == counted
    assert (MODULE_MLA_ROPE, counted) in stage_workspaces(job, 0)
