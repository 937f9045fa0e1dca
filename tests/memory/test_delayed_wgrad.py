"""--delay-wgrad-compute (remat.memory.delayed_wgrad, NOTE [delayed weight gradients]): what TE's linears keep until
their layer's backward_dw, and Megatron's rules for the flag."""

from __future__ import annotations

import pytest
import torch

from remat.config import ModelConfig
from remat.job import Job, JobError, parse_megatron_args
from remat.memory.delayed_wgrad import delay_wgrads, delayed_linears
from remat.models.gpt import GPT
from remat.parallel.chunk_trace import trace_chunk
from remat.parallel.pipeline_report import same_step

DENSE = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=128,
                    micro_batch_size=2, dtype="bf16")
MOE_FLAGS = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --micro-batch-size 2 "
             "--vocab-size 1000 --bf16 --world-size 4 --global-batch-size 16 --num-experts 4 "
             "--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall --moe-grouped-gemm ")


def _freed(delay: bool) -> dict[str, int]:
    """Where microbatch 0's forward tensors of the one-layer chunk are freed, by the module that made them."""
    tl = trace_chunk(DENSE, (False, False, 1), "none", drop_grads=True, delay_wgrad=delay,
                     compose_layers=False).timeline
    out: dict[str, int] = {}
    for row in range(len(tl.nbytes)):
        phase = tl.phases[tl.phase_index[row]]
        if phase.kind == "forward" and "microbatch 0" in phase.detail:
            out.setdefault(tl.module[row], tl.free_at[row])
    return out


def test_linears_keep_input_until_their_nodes_backward_dw() -> None:
    plain = trace_chunk(DENSE, (False, False, 1), "none", drop_grads=True, compose_layers=False).timeline
    delayed = trace_chunk(DENSE, (False, False, 1), "none", drop_grads=True, delay_wgrad=True,
                          compose_layers=False).timeline
    # the same tensors are made (the weight gradient too, only earlier than TE's backward_dw): the same bytes
    assert sorted(plain.nbytes) == sorted(delayed.nbytes) and plain.num_events == delayed.num_events
    before, after = _freed(False), _freed(True)
    # linear_fc2's input (the activation's output) is kept past fc2's backward, to the MLP node's backward_dw,
    # right after linear_fc1's input gradient (model_chunk_schedule_plan.py: mlp.backward, mlp.backward_dw)
    assert after["layers.0.mlp.activation"] > before["layers.0.mlp.activation"]
    # linear_proj's input (the attention's output) waits for the layer's pre_dispatch backward_dw, after the whole
    # attention backward: past where linear_qkv's input (the input norm's output) goes without the flag
    assert after["layers.0.self_attention"] > before["layers.0.input_layernorm"] > before["layers.0.self_attention"]
    assert after["layers.0.mlp.activation"] < after["layers.0.self_attention"]
    # where the plain trace frees linear_proj's input the delayed one holds more (that input, [2, 32, 64] bf16)
    at = before["layers.0.self_attention"]
    assert _live(delayed, at) - _live(plain, at) > 8192 // 2


def _live(tl, event: int) -> int:  # noqa: ANN001
    return sum(n for n, a, f in zip(tl.nbytes, tl.alloc_at, tl.free_at) if a <= event and (f == -1 or f > event))


def test_nodes_of_moe_layers_and_grads_unchanged() -> None:
    job = Job.from_megatron_args(MOE_FLAGS + "--moe-shared-expert-intermediate-size 32 --moe-layer-freq [0,1]")
    config = job.model.replace(expert_model_parallel_size=1)
    nodes = delayed_linears(GPT(config))
    # routed experts: the MoE layer's mlp node (moe_layer.py:81); shared experts and attention: pre_dispatch
    # (utils.py:379-426 _BackwardDWWrapper); a dense MLP: its own mlp node; the output layer is not delayed
    assert nodes["layers.1.mlp.experts.linear_fc1"] == "layers.1.mlp.experts"
    assert nodes["layers.1.mlp.shared_experts.linear_fc2"] == "layers.1"
    assert nodes["layers.1.self_attention.linear_proj"] == "layers.1"
    assert nodes["layers.0.mlp.linear_fc2"] == "layers.0.mlp"
    assert not any("output_layer" in name for name in nodes)
    # the hooks change when tensors go, not the gradients
    small = ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8, vocab_size=32,
                        micro_batch_size=1, hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    a = GPT(small)
    b = GPT(small)
    b.load_state_dict(a.state_dict())
    delay_wgrads(b)
    tokens = torch.randint(0, 32, (1, 8))
    for model in (a, b):
        model(tokens, tokens).sum().backward()
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(p.grad, q.grad), name


def test_flag_rules_and_round_trip() -> None:
    with pytest.raises(JobError, match="--overlap-moe-expert-parallel-comm"):
        parse_megatron_args(MOE_FLAGS + "--delay-wgrad-compute")  # transformer_config.py:3073-3077
    with pytest.raises(JobError, match="Transformer Engine"):
        parse_megatron_args(MOE_FLAGS + "--delay-wgrad-compute --overlap-moe-expert-parallel-comm "
                            "--transformer-impl local")  # arguments.py:1903-1905
    job = parse_megatron_args(MOE_FLAGS + "--delay-wgrad-compute --overlap-moe-expert-parallel-comm")[0]
    assert job.delay_wgrad_compute and Job.from_megatron_args(job.to_megatron_args()) == job


def test_a_deep_chunk_laid_out_from_a_shallow_one_keeps_them_too() -> None:
    deep = DENSE.replace(num_layers=8)
    composed = trace_chunk(deep, (False, True, 8), "none", drop_grads=True, delay_wgrad=True)
    whole = trace_chunk(deep, (False, True, 8), "none", drop_grads=True, delay_wgrad=True, compose_layers=False)
    # each layer's stash is dropped inside that layer's backward, so the deep chunk composes from a shallow trace
    assert composed.composed_from is not None and same_step(composed.timeline, whole.timeline) is None
