"""The unfused rotary embedding in the reference layers (NOTE [unfused rope] in remat.models.blocks): each
application keeps its own cos/sin tables, in the dense attention and in MLA, and a recompute makes them again."""

from __future__ import annotations

from collections import Counter

import pytest
from layer_rows import kept_by_layer

from remat.config import ModelConfig
from remat.memory.predict import trace

MLA = dict(multi_latent_attention=True, q_lora_rank=48, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4,
           v_head_dim=8)


@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("tp", [1, 2])
def test_each_rotation_keeps_its_own_tables(mla, tp) -> None:
    config = ModelConfig(num_layers=3, hidden_size=64, num_attention_heads=4, seq_length=32, micro_batch_size=2,
                         vocab_size=128, position="rope", dtype="bf16", hidden_dropout=0.0, attention_dropout=0.0,
                         **(MLA if mla else {}))
    assert config.apply_rope_fusion  # Megatron's default
    kept = {}
    for fusion in (True, False):
        model = config.replace(apply_rope_fusion=fusion)
        if tp == 1:
            kept[fusion] = kept_by_layer(trace(model, "none"))
        else:
            from remat.memory.predict import trace_rank

            kept[fusion] = kept_by_layer(trace_rank(model, "none", tp=tp, sp=True))
    table = config.seq_length * config.rotary_dim * 2  # [s, d] bf16 (Megatron's [s, 1, 1, d])
    assert kept[False] - kept[True] == Counter({table: 4})  # cos_ and sin_ of q's and of k's rotation
    assert kept[True] - kept[False] == Counter()


def test_a_recomputed_layer_makes_its_tables_again_and_keeps_none_across_the_step() -> None:
    config = ModelConfig(num_layers=3, hidden_size=64, num_attention_heads=4, seq_length=32, micro_batch_size=2,
                         vocab_size=128, position="rope", dtype="bf16", hidden_dropout=0.0, attention_dropout=0.0)
    table = config.seq_length * config.rotary_dim * 2
    made, kept = {}, {}
    for fusion in (True, False):
        tl = trace(config.replace(apply_rope_fusion=fusion), "full/uniform/1")
        kept[fusion] = kept_by_layer(tl)
        made[fusion] = Counter(tl.nbytes[r] for r in range(len(tl)) if (tl.phases[tl.phase_index[r]].kind,
                               tl.phases[tl.phase_index[r]].region) == ("recompute", "layer 1"))
    assert kept[False] == kept[True]  # the checkpointed layer keeps only its input
    # the four kept tables made again, each through two fp32 [s, d] tables (torch.cos(freqs) * mscale); the
    # rotations' own temporaries differ in shape (Megatron's t * cos_ + rotate_half(t) * sin_)
    tables = lambda counts: (counts[table], counts[2 * table])  # noqa: E731
    assert tables(made[False]) == (tables(made[True])[0] + 4, tables(made[True])[1] + 8)
