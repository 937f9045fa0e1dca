"""Hugging Face MoE models, whose experts run through ``torch._grouped_mm``: a fake trace gives the operator the CPU
kernel's outputs (remat.memory.fake_ops, NOTE [grouped_mm in a fake trace]), so a Mixtral step is predicted row for
row as it is measured, fp32 and bf16, under every kind of policy; recompute keeps its gradients bit for bit."""

from __future__ import annotations

import functools

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

transformers = pytest.importorskip("transformers")

from hf_checks import assert_same_timeline, train_step  # noqa: E402
from transformers import AutoModelForCausalLM, MixtralConfig  # noqa: E402

from remat.memory.fake_ops import cpu_fake_ops  # noqa: E402
from remat.memory.measure import measure  # noqa: E402
from remat.memory.predict import predict  # noqa: E402
from remat.recompute.apply import apply  # noqa: E402

transformers.logging.set_verbosity_error()
IDS = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
BATCH = {"input_ids": IDS, "labels": IDS}


def build(dtype: torch.dtype = torch.float32):
    config = MixtralConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, vocab_size=128,
                           max_position_embeddings=32, attention_dropout=0.1)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters made in the dtype: .to() cannot convert fake ones
    try:
        return AutoModelForCausalLM.from_config(config).train()
    finally:
        torch.set_default_dtype(previous)


# ------------------------------------------------------------------------ the operator
OFFS = (3, 7, 10)
# (mat_a, mat_b, offs) shapes, and whether mat_b is the transpose of a contiguous tensor (HF's weight.transpose(-2, -1))
LAYOUTS = {
    "2d x 3d^T": ((10, 8), (3, 12, 8), True, OFFS),     # mat_b: (3, 12, 8).transpose(-2, -1), as HF passes weights
    "2d x 3d": ((10, 8), (3, 8, 16), False, (3, 7, 8)),  # rows past the last offset: left as they are
    "2d x 3d^T, N=6": ((10, 8), (3, 6, 8), True, OFFS),  # rows of 6 elements, padded to 16 bytes
    "2d x 2d": ((12, 16), (16, 8), False, OFFS),         # the weight gradient: one product per group
    "2d x 2d^T, N=6": ((12, 16), (6, 16), True, OFFS),
    "3d x 2d": ((3, 4, 16), (16, 16), False, OFFS),
    "3d x 3d": ((3, 4, 8), (3, 8, 16), False, None),
}


def _operands(layout: str, dtype: torch.dtype):
    a_shape, b_shape, transposed, offs = LAYOUTS[layout]
    a = torch.randn(a_shape, dtype=dtype)
    b = torch.randn(b_shape, dtype=dtype)
    if transposed:
        b = b.transpose(-2, -1)
    return a, b, None if offs is None else torch.tensor(offs, dtype=torch.int32)


def _layout(out: torch.Tensor):
    return tuple(out.shape), out.stride(), out.dtype, out.untyped_storage().nbytes()


def _real_and_fake(a, b, offs):
    try:
        real = _layout(torch._grouped_mm(a, b, offs=offs))
    except RuntimeError as err:
        real = ("refused", str(err).splitlines()[0])
    with FakeTensorMode() as mode, cpu_fake_ops(mode):
        args = [mode.from_tensor(t) if t is not None else None for t in (a, b, offs)]
        try:
            fake = _layout(torch._grouped_mm(args[0], args[1], offs=args[2]))
        except RuntimeError as err:
            fake = ("refused", str(err).splitlines()[0])
    return real, fake


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fake_grouped_mm_is_the_cpu_kernel(layout, dtype):
    """Shape, strides (rows padded to 16 bytes), dtype and storage bytes of the output, or the same refusal."""
    real, fake = _real_and_fake(*_operands(layout, dtype))
    assert fake == real and real[0] != "refused"


def test_fake_grouped_mm_refuses_what_the_cpu_kernel_refuses():
    a, b, offs = _operands("2d x 3d^T", torch.float32)
    cases = {"misaligned rows": (torch.randn(10, 6), torch.randn(3, 6, 12), offs),  # a row of 24 bytes
             "mixed dtypes": (a, b.bfloat16(), offs),
             "no offsets": (a, b, None)}
    for name, args in cases.items():
        real, fake = _real_and_fake(*args)
        assert real[0] == fake[0] == "refused", name


def test_only_remats_fake_mode_answers_for_the_cpu_kernel():
    """torch's meta implementation (the CUDA kernel's checks) is left as it is outside remat's trace."""
    a, b, offs = _operands("2d x 3d^T", torch.float32)
    with FakeTensorMode() as mode:
        args = [mode.from_tensor(t) for t in (a, b, offs)]
        with cpu_fake_ops(mode):
            assert torch._grouped_mm(*args[:2], offs=args[2]).shape == (10, 12)
        assert "dispatch" not in vars(mode)
        with pytest.raises(RuntimeError, match="Expected inputs of BF16 type"):
            torch._grouped_mm(*args[:2], offs=args[2])


# ------------------------------------------------------------------------ Mixtral
POLICIES = ["none", "full/uniform/2", "full/block/1", "full/uniform/2@non-reentrant", "selective/mlp",
            "selective/act", "selective/core_attn+layernorm", "selective/non_matmul"]


@pytest.mark.parametrize("policy", POLICIES)
def test_mixtral_step_is_predicted_as_measured(policy):
    model = build()
    apply(model, policy)
    torch.manual_seed(0)
    measured = measure(model, BATCH)
    assert_same_timeline(predict(build, policy, batch=BATCH), measured)
    if policy != "none":
        assert any(p.kind == "recompute" for p in measured.phases)


@pytest.mark.parametrize("policy", ["none", "full/uniform/2", "selective/act"])
def test_bf16_mixtral_step_is_predicted_as_measured(policy):
    factory = functools.partial(build, torch.bfloat16)
    model = factory()
    apply(model, policy)
    torch.manual_seed(0)
    assert_same_timeline(predict(factory, policy, batch=BATCH), measure(model, BATCH))


def step(model):
    return train_step(model, BATCH)


@functools.cache
def plain_step():
    return step(build())


@pytest.mark.parametrize("policy", ["full/uniform/2", "full/uniform/2@non-reentrant", "selective/mlp",
                                    "selective/act", "selective/non_matmul"])
def test_mixtral_gradients_equal_the_plain_model(policy, recorder):
    model = build()
    state = apply(model, policy)
    loss, grads = step(model)
    want_loss, want = plain_step()
    assert torch.equal(loss, want_loss)
    assert all(torch.equal(grads[name], grad) for name, grad in want.items())
    assert {id(r) for r in state.regions} == {id(r) for r in recorder.recomputed}
