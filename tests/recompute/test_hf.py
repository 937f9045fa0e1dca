"""Hugging Face transformers models (built with ``AutoModelForCausalLM.from_config``, random weights, no download):
the layer stack is found, HF's own checkpointing is refused, selective names map onto each family's submodules
(the attention core through HF's AttentionInterface), gradients equal the plain model's with dropout on, and
measure and predict give the same peak."""

from __future__ import annotations

import functools
import subprocess
import sys
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_checks import assert_same_timeline, train_step  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    FalconConfig,
    GPT2Config,
    GPTNeoXConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    OPTConfig,
    Qwen2Config,
)

from remat.memory.measure import measure  # noqa: E402
from remat.memory.predict import predict  # noqa: E402
from remat.recompute import hf  # noqa: E402
from remat.recompute.apply import applied, apply, find_layer_stack, remove  # noqa: E402
from remat.recompute.region import ApplyError  # noqa: E402

transformers.logging.set_verbosity_error()
P = 0.1  # every dropout the family has
SIZE = dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=128)


def config(family: str, attn: str = "sdpa"):
    cfg = {
        "gpt2": lambda: GPT2Config(n_layer=4, n_embd=64, n_head=4, n_positions=64, vocab_size=128, resid_pdrop=P,
                                   embd_pdrop=P, attn_pdrop=P, bos_token_id=0, eos_token_id=0),
        "llama": lambda: LlamaConfig(**SIZE, intermediate_size=128, num_key_value_heads=2, attention_dropout=P,
                                     max_position_embeddings=64),
        "mistral": lambda: MistralConfig(**SIZE, intermediate_size=128, num_key_value_heads=2, attention_dropout=P,
                                         max_position_embeddings=64, sliding_window=16),
        "qwen2": lambda: Qwen2Config(**SIZE, intermediate_size=128, num_key_value_heads=2, attention_dropout=P),
        "neox": lambda: GPTNeoXConfig(**SIZE, intermediate_size=128, attention_dropout=P, hidden_dropout=P),
        "opt": lambda: OPTConfig(**SIZE, ffn_dim=128, word_embed_proj_dim=64, dropout=P, attention_dropout=P,
                                 max_position_embeddings=64),
        "falcon": lambda: FalconConfig(**SIZE, attention_dropout=P, hidden_dropout=P),
    }[family]()
    cfg._attn_implementation = attn
    return cfg


def build(family: str, attn: str = "sdpa"):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config(family, attn)).train()


IDS = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
BATCH = {"input_ids": IDS, "labels": IDS}  # use_cache stays at HF's default (True), as people train

FAMILIES = ["gpt2", "llama", "mistral", "qwen2", "neox", "opt", "falcon"]
STACKS = {"gpt2": "transformer.h", "llama": "model.layers", "mistral": "model.layers", "qwen2": "model.layers",
          "neox": "gpt_neox.layers", "opt": "model.decoder.layers", "falcon": "transformer.h"}
# Per family: selective module -> the submodules of layer 0 it recomputes (None: refused, with the reason).
SELECTIVE = {
    "gpt2": {"core_attn": ["attn.core_attention"], "mlp": ["mlp"], "layernorm": ["ln_1", "ln_2"], "act": ["mlp.act"]},
    "llama": {"core_attn": ["self_attn.core_attention"], "mlp": ["mlp"],
              "layernorm": ["input_layernorm", "post_attention_layernorm"], "act": ["mlp.act_fn"]},
    "neox": {"core_attn": ["attention.core_attention"], "mlp": ["mlp"],
             "layernorm": ["input_layernorm", "post_attention_layernorm"], "act": ["mlp.act"]},
    "opt": {"core_attn": ["self_attn.core_attention"], "mlp": None,
            "layernorm": ["self_attn_layer_norm", "final_layer_norm"], "act": ["activation_fn"]},
    "falcon": {"core_attn": None, "mlp": ["mlp"], "layernorm": ["input_layernorm"], "act": ["mlp.act"]},
}
SELECTIVE["mistral"] = SELECTIVE["qwen2"] = SELECTIVE["llama"]
REFUSED = {("opt", "mlp"): "no MLP submodule", ("falcon", "core_attn"): "AttentionInterface"}
RMSNORM = {"llama", "mistral", "qwen2"}

POLICIES = ["full/uniform/1", "full/uniform/2", "full/uniform/3", "full/block/2", "selective/core_attn",
            "selective/mlp", "selective/layernorm", "selective/act", "selective/core_attn+mlp+layernorm+act",
            "selective/non_matmul", "selective/core_attn+non_matmul"]


def supported(family: str, policy: str) -> bool:
    modules = policy.split("/", 1)[1].split("+") if policy.startswith("selective/") else []
    return all(m == "non_matmul" or SELECTIVE[family][m] is not None for m in modules)


def step(model, seed: int = 5):
    return (*train_step(model, BATCH, seed), torch.get_rng_state())


@functools.cache
def plain_step(family: str, attn: str = "sdpa"):
    result = step(build(family, attn))
    assert all(g is not None for g in result[1].values())
    return result


def assert_same_step(got, want, exact: bool = True) -> None:
    assert torch.equal(got[0], want[0]), (got[0].item(), want[0].item())
    assert got[1].keys() == want[1].keys()
    for name, grad in want[1].items():
        if exact:
            assert torch.equal(got[1][name], grad), f"gradient of {name} differs"
        else:
            torch.testing.assert_close(got[1][name], grad, rtol=1e-5, atol=1e-7, msg=name)
    assert torch.equal(got[2], want[2]), "the step consumed the global RNG differently"


# ------------------------------------------------------------------------ the layer stack
@pytest.mark.parametrize("family", FAMILIES)
def test_layer_stack_is_found(family):
    model = build(family)
    path, layers = find_layer_stack(model)
    assert path == STACKS[family] and layers == list(model.get_submodule(path))


def test_dropout_is_on():
    """The premise of the exactness tests: a recompute that replayed other dropout masks would differ."""
    for family in ("gpt2", "llama", "neox"):
        a, b = plain_step(family), step(build(family), seed=6)
        assert not torch.equal(a[0], b[0]), family


# ------------------------------------------------------------------------ gradients
@pytest.mark.parametrize("engine", ["reentrant", "non-reentrant"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_equal_the_plain_model(family, policy, engine, recorder):
    if not supported(family, policy):
        pytest.skip(f"{policy} is refused for {family} (test_refused_selective_names)")
    if engine == "non-reentrant" and policy in ("full/uniform/3", "selective/mlp", "selective/act") \
            and family not in ("llama", "neox"):
        pytest.skip("covered by the reentrant engine and by llama/neox")
    model = build(family)
    state = apply(model, f"{policy}@{engine}")
    # RMSNorm's CPU kernel is composite (its input feeds pow and mul): a reentrant region around the norm alone sums
    # that input's gradient in another order than the plain graph (see tests/test_apply.py): last-bit differences.
    exact = not (engine == "reentrant" and family in RMSNORM and "layernorm" in policy)
    assert_same_step(step(model), plain_step(family), exact=exact)
    assert {id(r) for r in state.regions} == {id(r) for r in recorder.recomputed}  # every region really was recomputed


@pytest.mark.parametrize("family", ["gpt2", "llama", "neox", "opt"])
def test_core_attn_with_eager_attention(family, recorder):
    """Eager attention keeps the s x s probabilities: core_attn drops them and is still exact."""
    model = build(family, "eager")
    state = apply(model, "selective/core_attn")
    assert_same_step(step(model), plain_step(family, "eager"))
    assert {id(r) for r in state.regions} == {id(r) for r in recorder.recomputed}
    plain_peak = measure(build(family, "eager"), BATCH).peak_bytes
    assert measure(model, BATCH).peak_bytes < plain_peak


# ------------------------------------------------------------------------ selective mapping
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("module", ["core_attn", "mlp", "layernorm", "act"])
def test_selective_names_map_onto_the_family(family, module):
    model = build(family)
    expected = SELECTIVE[family][module]
    if expected is None:
        pytest.skip("refused: test_refused_selective_names")
    state = apply(model, f"selective/{module}")
    prefix = STACKS[family] + ".0."
    assert [r.names[0][len(prefix):] for r in state.regions if r.names[0].startswith(prefix)] == expected
    assert len(state.regions) == 4 * len(expected)


@pytest.mark.parametrize("family, module", sorted(REFUSED))
def test_refused_selective_names(family, module):
    model = build(family)
    with pytest.raises(ApplyError, match=REFUSED[family, module]):
        apply(model, f"selective/{module}")
    assert applied(model) is None


def test_core_attention_is_local_to_the_model():
    """The switch to remat's attention function is made on the attention modules' own config copies."""
    cfg = config("llama")
    other = AutoModelForCausalLM.from_config(cfg).train()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).train()
    keys = set(model.state_dict())
    apply(model, "selective/core_attn")
    attention = model.model.layers[0].self_attn
    assert isinstance(attention.core_attention, hf.CoreAttention)
    assert attention.config._attn_implementation == "remat:sdpa"
    assert model.config._attn_implementation == cfg._attn_implementation == "sdpa"
    assert set(model.state_dict()) == keys
    assert other.model.layers[0].self_attn.config._attn_implementation == "sdpa"
    apply(model, "none")
    assert "core_attention" not in attention._modules and attention.config is model.config
    assert_same_step(step(model), plain_step("llama"))
    apply(model, "selective/core_attn")
    remove(model)  # leaves the core in place, calling the original function: the plain model's numbers
    assert_same_step(step(model), plain_step("llama"))


# ------------------------------------------------------------------------ HF's own checkpointing, KV cache
def test_hf_gradient_checkpointing_is_refused():
    model = build("llama")
    model.activation_checkpointing_enable()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # remat does not touch HF's deprecated aliases
        with pytest.raises(ApplyError, match=r"enabled on 4 layer\(s\) \(model.layers.0, .*"
                                             r"call model.activation_checkpointing_disable\(\) first"):
            apply(model, "full/uniform/1")
        assert applied(model) is None
        with pytest.raises(ApplyError, match="activation_checkpointing_disable"):
            predict(lambda: _checkpointing(build("llama")), "none", batch=BATCH)
        model.activation_checkpointing_enable(every_n_layers=2)
        with pytest.raises(ApplyError, match=r"on 2 layer\(s\) \(model.layers.0, model.layers.2\)"):
            apply(model, "none")
        model.activation_checkpointing_disable()
        assert len(apply(model, "full/uniform/1").regions) == 4


def _checkpointing(model):
    model.activation_checkpointing_enable()
    return model


def test_hf_gradient_checkpointing_in_a_wrapper_is_refused():
    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm = build("gpt2")

        def forward(self, **batch):
            return self.lm(**batch)

    model = Wrapper()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.lm.gradient_checkpointing_enable()  # the deprecated spelling switches on the same flags
    with pytest.raises(ApplyError, match=r"Wrapper has Hugging Face gradient checkpointing .* "
                                         r"model.lm.activation_checkpointing_disable\(\)"):
        apply(model, "full/uniform/2")


@pytest.mark.parametrize("policy", ["full/uniform/2", "selective/non_matmul"])
def test_recomputed_layers_keep_out_of_the_kv_cache(policy):
    """Training builds a DynamicCache; a recomputed layer would append to it twice. Inference still fills it."""
    model = build("llama")
    apply(model, policy)
    out = model(**BATCH)
    assert out.cache is not None and out.cache.get_seq_length() == 0
    out.loss.backward()
    with torch.no_grad():
        plain = build("llama").eval()
        model.eval()
        got, want = model(input_ids=IDS, use_cache=True), plain(input_ids=IDS, use_cache=True)
    assert got.cache.get_seq_length() == want.cache.get_seq_length() == IDS.shape[1]
    assert torch.equal(got.logits, want.logits)


# ------------------------------------------------------------------------ measure and predict
# Every family with no recompute, full recompute and its attention core (Falcon: its MLP); the other policies on
# the families with the most distinct layer code.
MEASURED = [(f, p) for f in FAMILIES for p in ("none", "full/uniform/1",
                                               "selective/mlp" if f == "falcon" else "selective/core_attn")]
MEASURED += [(f, p) for f in ("gpt2", "neox") for p in ("full/uniform/4", "full/block/2", "selective/layernorm+act")]
MEASURED += [("llama", "selective/mlp+act@non-reentrant"), ("opt", "full/uniform/3"),
             ("llama", "selective/non_matmul"), ("gpt2", "selective/core_attn+non_matmul")]


@pytest.mark.parametrize("family, policy", MEASURED)
def test_measure_and_predict_give_the_same_peak(family, policy):
    model = build(family)
    apply(model, policy)
    torch.manual_seed(0)
    measured = measure(model, BATCH)
    predicted = predict(lambda: build(family), policy, batch=BATCH)
    assert measured.peak_bytes == predicted.peak_bytes
    assert measured.meta["num_layers"] == predicted.meta["num_layers"] == 4
    if policy != "none":
        assert any(p.kind == "recompute" for p in measured.phases)


# transformers decides from tensor values whether sdpa gets a built mask or is_causal (NOTE [HF masks in a fake
# trace]): without a KV cache it checks the position ids for packed sequences, and it checks an attention mask for
# padding. The predicted timeline must be the measured one row for row, whichever way the batch decides.
PADDED = torch.ones_like(IDS).index_fill_(1, torch.arange(27, 32), 0)
PACKED = torch.cat([torch.arange(20), torch.arange(12)]).expand(2, -1)
MASK_BATCHES = {
    "no cache": {},
    "all-ones mask": {"attention_mask": torch.ones_like(IDS)},
    "padded mask": {"attention_mask": PADDED},
    "packed positions": {"position_ids": PACKED},
}


# The mask is decided once per forward, before the layers, which recompute does not run again: every batch runs
# with recompute (its checkpoints keep the mask the model built), the plain step with the default batch.
MASK_CASES = [(inputs, "full/uniform/1") for inputs in MASK_BATCHES] + [("no cache", "none")]


@pytest.mark.parametrize("inputs, policy", MASK_CASES)
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_predicted_timeline_is_the_measured_one(family, policy, inputs):
    batch = {**BATCH, **MASK_BATCHES[inputs], "use_cache": False}
    measured = measure(_applied(build(family), policy), batch)
    predicted = predict(lambda: build(family), policy, batch=batch)
    assert_same_timeline(predicted, measured)


def test_gpu_check_hf_llama_is_predicted_to_the_byte():
    # benchmarks/gpu_check.py's model: bf16 parameters, GQA, use_cache=False in the config, no mask in the batch.
    # The fake trace used to build a (2, 1, 32, 32) mask and repeat_kv copies of keys and values (+5.6%).
    cfg = LlamaConfig(**SIZE, intermediate_size=176, num_key_value_heads=2, max_position_embeddings=64,
                      attn_implementation="sdpa", use_cache=False)

    def factory():  # parameters made in bf16: .to() cannot convert fake ones
        torch.manual_seed(0)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            return LlamaForCausalLM(cfg).train()
        finally:
            torch.set_default_dtype(previous)

    for policy in ("none", "full/uniform/1"):
        assert_same_timeline(predict(factory, policy, batch=BATCH), measure(_applied(factory(), policy), BATCH))


def test_batch_masks_come_from_the_real_batch():
    model = build("llama")
    assert hf.BatchMasks.of(model, BATCH) == hf.BatchMasks(unpadded=True, unpacked=True)
    assert hf.BatchMasks.of(model, {"input_ids": IDS, "attention_mask": PADDED}).unpadded is False
    assert hf.BatchMasks.of(model, {"input_ids": IDS, "position_ids": PACKED}).unpacked is False
    assert hf.BatchMasks.of(model, (IDS, PADDED)).unpadded is False  # positional: input_ids, attention_mask
    assert hf.BatchMasks.of(model, lambda: BATCH) == hf.BatchMasks()  # a batch made under the fake mode
    tracing = transformers.masking_utils.is_tracing
    predict(lambda: build("llama"), "none", batch=BATCH)
    assert transformers.masking_utils.is_tracing is tracing


def test_recompute_lowers_the_peak():
    peaks = {p: measure(_applied(build("llama"), p), BATCH).peak_bytes for p in ("none", "full/uniform/1")}
    assert peaks["full/uniform/1"] < peaks["none"]


def _applied(model, policy):
    apply(model, policy)
    return model


def test_nothing_is_imported_for_other_models():
    code = ("import sys, torch; from remat import apply, build_model, ModelConfig; "
            "m = build_model(ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=2, seq_length=8, "
            "vocab_size=32)); apply(m, 'selective/core_attn'); assert 'transformers' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
