"""Hugging Face models whose layers take different side inputs (config.layer_types: Gemma 2/3 and Qwen2's sliding-window
and global attention layers, each kind with its own mask, Gemma 3's with their own rotary tables): a Megatron-style
group of several layers runs layer by layer, its checkpoint keeping each layer's own inputs (NOTE [groups of layers
with their own inputs] in remat.recompute.region); gradients equal the plain model's bit for bit and every step is
predicted row for row as it is measured."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from hf_checks import assert_same_timeline, train_step  # noqa: E402
from transformers import AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, LlamaConfig, Qwen2Config  # noqa: E402

import remat.recompute.hf as hf  # noqa: E402
from remat.memory.measure import measure  # noqa: E402
from remat.memory.predict import predict  # noqa: E402
from remat.recompute.apply import apply, find_layer_stack  # noqa: E402
from remat.recompute.region import ApplyError  # noqa: E402

transformers.logging.set_verbosity_error()
SIZE = dict(num_hidden_layers=3, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
            vocab_size=128, max_position_embeddings=64, attention_dropout=0.1)
SLIDING, FULL = "sliding_attention", "full_attention"
KINDS = {"gemma2": [SLIDING, FULL, SLIDING], "gemma3": [SLIDING, SLIDING, FULL], "qwen2": [FULL, SLIDING, SLIDING]}


def config(family: str):
    cfg = {  # a window of 4 tokens in a 16-token batch: the sliding layers get a mask of their own
        "gemma2": lambda: Gemma2Config(**SIZE, head_dim=8, sliding_window=4),  # eager: HF refuses sdpa for it
        "gemma3": lambda: Gemma3TextConfig(**SIZE, head_dim=8, sliding_window=4, layer_types=KINDS["gemma3"]),
        "qwen2": lambda: Qwen2Config(**SIZE, sliding_window=4, use_sliding_window=True, layer_types=KINDS["qwen2"]),
        "llama": lambda: LlamaConfig(**SIZE),
    }[family]()
    cfg._attn_implementation = "eager" if family == "gemma2" else "sdpa"
    return cfg


def build(family: str):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config(family)).train()


IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
BATCH = {"input_ids": IDS, "labels": IDS}


def step(model):
    return train_step(model, BATCH)


@functools.cache
def plain_step(family: str):
    return step(build(family))


def assert_same_step(got, want) -> None:
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(got[1][name], grad) for name, grad in want[1].items())


@pytest.mark.parametrize("family", [*KINDS, "llama"])
def test_side_input_kinds_are_the_layer_types(family):
    model = build(family)
    assert hf.side_input_kinds(model, find_layer_stack(model)[1]) == KINDS.get(family)


def test_the_masks_differ():
    """The premise: the loop gives a sliding layer another mask than a full one (so a group run with its first
    layer's inputs would compute something else)."""
    model = build("gemma2")
    masks = []
    hooks = [layer.register_forward_pre_hook(lambda m, a, kw: masks.append(kw["attention_mask"]), with_kwargs=True)
             for layer in model.model.layers]
    model(**BATCH)
    for hook in hooks:
        hook.remove()
    assert masks[0] is masks[2] and not torch.equal(masks[0], masks[1])


POLICIES = ["full/uniform/2", "full/uniform/3", "full/uniform/3@non-reentrant", "full/uniform/2@non-reentrant"]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("family", KINDS)
def test_groups_give_the_plain_models_gradients(family, policy, recorder):
    model = build(family)
    state = apply(model, policy)
    groups = [r for r in state.regions if len(r.modules) > 1]
    assert groups and all(r.per_layer_inputs == (len({KINDS[family][i] for i in r.layer_indices}) > 1)
                          for r in groups)
    assert_same_step(step(model), plain_step(family))
    assert {id(r) for r in state.regions} == {id(r) for r in recorder.recomputed}


PREDICTED = [("gemma2", p) for p in ("none", "full/uniform/2", "full/uniform/3@non-reentrant", "full/block/2",
                                     "selective/core_attn", "selective/non_matmul")]
PREDICTED += [(f, p) for f in ("gemma3", "qwen2") for p in ("none", "full/uniform/3", "full/uniform/2@non-reentrant")]


@pytest.mark.parametrize("family, policy", PREDICTED)
def test_step_is_predicted_as_measured(family, policy):
    model = build(family)
    apply(model, policy)
    torch.manual_seed(0)
    measured = measure(model, BATCH)
    assert_same_timeline(predict(functools.partial(build, family), policy, batch=BATCH), measured)
    if policy != "none":
        assert any(p.kind == "recompute" for p in measured.phases)


@pytest.mark.parametrize("policy", ["full/uniform/2", "full/uniform/3@non-reentrant"])
def test_a_group_run_layer_by_layer_is_the_group_run_at_once(policy, monkeypatch):
    """On a model whose layers all take the same inputs, a group run layer by layer keeps, frees and recomputes
    exactly what the group run as one call does: the same timeline, row for row, and the same gradients."""
    runs = {}
    for layer_by_layer in (False, True):
        if layer_by_layer:
            monkeypatch.setattr(hf, "side_input_kinds", lambda model, stack: ["a", "b"] * len(stack))
        model = build("llama")
        state = apply(model, policy)
        assert all(r.per_layer_inputs == layer_by_layer for r in state.regions if len(r.modules) > 1)
        torch.manual_seed(0)
        runs[layer_by_layer] = measure(model, BATCH), step(model)
    assert_same_timeline(runs[True][0], runs[False][0])
    assert_same_step(runs[True][1], runs[False][1])


def test_inference_runs_each_layer_on_its_own_inputs():
    model, plain = build("gemma2"), build("gemma2")
    apply(model, "full/uniform/3")
    with torch.no_grad():
        assert torch.equal(model.eval()(input_ids=IDS).logits, plain.eval()(input_ids=IDS).logits)


@pytest.mark.parametrize("policy", ["full/uniform/3", "full/uniform/3@non-reentrant"])
def test_an_error_inside_a_group_leaves_nothing_open(policy):
    """A layer that raises mid-group: the group is dropped (torch's checkpoint closed, its saved-tensor hooks
    popped) and the next step is exact."""
    model = build("gemma2")
    apply(model, policy)

    def fail(module, args):
        raise RuntimeError("boom")

    hook = model.model.layers[1].mlp.register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="boom"):
        model(**BATCH)
    hook.remove()
    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None
    assert_same_step(step(model), plain_step("gemma2"))


def test_layers_called_out_of_order_are_refused():
    model = build("gemma2")
    apply(model, "full/uniform/3")
    layers = model.model.layers
    hidden = torch.randn(2, 16, 32, requires_grad=True)
    with pytest.raises(ApplyError, match="model.layers.1 was called before the first module of its group"):
        layers[1](hidden)


class _Layout:
    """A layout whose first group's input would be offloaded (as a remat.plan offload segment)."""

    engine = "reentrant"

    def layer_groups(self, depth):
        return [(0, 1), (2,)]

    def selective_modules(self, layer):
        return ()

    def offload_groups(self, depth):
        return [(0, 1)]


def test_offloading_a_group_of_several_kinds_is_refused():
    with pytest.raises(ApplyError, match="group 0 .* its layers take different side inputs .* cannot be offloaded"):
        apply(build("gemma2"), _Layout())


class _Scaled(nn.Module):
    """Makes a tensor from Python data in its forward (torch.tensor), as HF's sliding-window KV cache layers do."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x) * torch.tensor([2.0])
        return x.square().mean()


def test_tensors_made_from_data_are_recorded_once():
    """Under fake tensors torch.tensor(data) makes a real constant and its fake copy: the trace counts the copy
    only, as the real step has one tensor."""
    batch = (torch.randn(4, 8),)
    assert_same_timeline(predict(_Scaled, "none", batch=batch), measure(_Scaled(), batch))
