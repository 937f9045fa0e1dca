"""The planner's unit model is traced with the active kernel profile (remat.memory.kernels.use_kernels), as the
exact predictions it is checked against: a job plan prices GPU ranks, whose attention keeps no [b, heads, s, s]
scores (the CPU kernels' do)."""

from __future__ import annotations

from remat.config import ModelConfig
from remat.memory.kernels import use_kernels
from remat.memory.predict import predict_config
from remat.plan.unit_model import unit_model
from remat.policy import Policy
from remat.recompute.plan_format import Plan

GPT = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=64, micro_batch_size=2,
                  vocab_size=64, attention="sdpa")


def test_the_unit_model_prices_the_cuda_kernels_as_predict_does() -> None:
    with use_kernels("cuda"):
        model = unit_model(GPT)
        for text in ("none", "selective/core_attn"):
            policy = Policy.parse(text)
            cuda = predict_config(GPT, policy).peak_bytes
            assert model.peak(Plan.from_policy(policy, GPT.num_layers).units()) == cuda, text
            # the CPU kernels keep the attention scores: another peak, so the profile did change the trace
            assert predict_config(GPT, policy, kernels="cpu").peak_bytes > cuda, text
