"""What the MLA layers' rotary embeddings of a rank keep (NOTE [MLA's rotary tables] in remat.memory.workspaces):
per MLA layer and MTP depth of the stage, by rope type and fusion, in whole CUDA blocks; megatron-core's own MLA
attention is read in tests/megatron/test_megatron_mla_rope.py."""

from __future__ import annotations

from remat.config import ModelConfig
from remat.job import Job
from remat.memory.workspaces import MODULE_MLA_ROPE, mla_rope_bytes, stage_workspaces

MIB = 2**20
MLA = ModelConfig(num_layers=4, hidden_size=256, num_attention_heads=4, vocab_size=128, seq_length=4096,
                  micro_batch_size=1, multi_latent_attention=True, q_lora_rank=64, kv_lora_rank=64, qk_head_dim=32,
                  qk_pos_emb_head_dim=64, v_head_dim=32, position="rope")
FREQUENCIES = 512  # an fp32 [32] vector, one CUDA block


def test_yarn_keeps_fp32_init_tables_and_a_cached_one_unfused():
    job = Job.build(MLA.replace(apply_rope_fusion=False), precision="bf16", pp=2, num_microbatches=2)
    per_layer = 3 * FREQUENCIES + 2 * MIB + MIB  # cos_cached, sin_cached fp32 [4096, 1, 1, 64]; the cached table
    assert mla_rope_bytes(job, 0) == 2 * per_layer
    mtp = job.replace(model=job.model.replace(mtp_num_layers=1))  # an MTP depth's layer is an MLA layer too
    assert mla_rope_bytes(mtp, 1) == 3 * per_layer and mla_rope_bytes(mtp, 0) == 2 * per_layer
    assert (MODULE_MLA_ROPE, 2 * per_layer) in stage_workspaces(job, 0)
    cp = Job.build(MLA.replace(apply_rope_fusion=False), precision="bf16", cp=2)  # the table of this CP rank's half
    assert mla_rope_bytes(cp, 0) == 4 * (3 * FREQUENCIES + 2 * MIB + MIB // 2)
    assert mla_rope_bytes(Job.build(MLA.replace(multi_latent_attention=False), precision="bf16"), 0) == 0


def test_the_fused_path_remakes_the_tables_in_the_activations_dtype():
    fused = Job.build(MLA, precision="bf16")
    assert mla_rope_bytes(fused, 0) == 4 * (3 * FREQUENCIES + 2 * MIB // 2 + MIB)  # bf16 cos/sin [4096], fp32 table
    fp32 = Job.build(MLA, precision="fp32")  # fp32 within 4096 positions: the init's tables serve, no forward call
    assert mla_rope_bytes(fp32, 0) == 4 * (3 * FREQUENCIES + 2 * MIB)


def test_rope_type_rope_keeps_one_frequency_vector_and_the_cached_table_up_to_32_layers():
    rope = MLA.replace(apply_rope_fusion=False, mla_rope_type="rope")
    assert mla_rope_bytes(Job.build(rope, precision="bf16"), 0) == 4 * (FREQUENCIES + MIB)
    deep = Job.build(rope.replace(num_layers=40), precision="bf16")  # lru_cache(maxsize=32): one cache for all
    assert mla_rope_bytes(deep, 0) == 40 * FREQUENCIES + 32 * MIB
