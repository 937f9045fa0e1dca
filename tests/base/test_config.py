"""Tests for remat.config, remat.presets (named configs, YAML/JSON config files) and the reference model's construction
(remat.models.gpt.build_model, sample_batch)."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from tiny_models import GPT as SMALL_GPT

from remat.config import ConfigError, ModelConfig
from remat.models.gpt import GPT, build_model, sample_batch
from remat.presets import PRESETS, config_from_mapping, get_preset, load_config

TINY = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=8, micro_batch_size=3,
                   vocab_size=20)
POSITIVE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length",
                   "micro_batch_size")


# ------------------------------------------------------------------------ refused configurations
def test_hidden_not_divisible_by_heads_names_both_fields():
    with pytest.raises(ConfigError, match="hidden_size=65") as err:
        ModelConfig(hidden_size=65, num_attention_heads=4)
    assert "num_attention_heads=4" in str(err.value)
    assert "multiple" in str(err.value)


def test_heads_not_divisible_by_query_groups_names_both_fields():
    with pytest.raises(ConfigError, match="num_query_groups=3") as err:
        ModelConfig(hidden_size=64, num_attention_heads=4, num_query_groups=3)
    assert "num_attention_heads=4" in str(err.value)


@pytest.mark.parametrize("name", POSITIVE_FIELDS + ("num_query_groups", "ffn_hidden_size"))
@pytest.mark.parametrize("value", [0, -1, 2.5, True, "8"])
def test_sizes_must_be_positive_integers(name, value):
    with pytest.raises(ConfigError, match=rf"^{name}=") as err:
        ModelConfig(**{name: value})
    assert "positive integer" in str(err.value)


@pytest.mark.parametrize("name, value", [("dtype", "fp8"), ("dtype", torch.float32), ("activation", "relu"),
                                         ("normalization", "batchnorm"), ("position", "alibi"),
                                         ("attention", "flash")])
def test_unknown_choice_names_field_and_choices(name, value):
    with pytest.raises(ConfigError, match=rf"^{name}=") as err:
        ModelConfig(**{name: value})
    valid = {"dtype": "fp32", "activation": "swiglu", "normalization": "rmsnorm", "position": "rope",
             "attention": "sdpa"}[name]
    assert valid in str(err.value)


@pytest.mark.parametrize("name", ["hidden_dropout", "attention_dropout"])
@pytest.mark.parametrize("value", [1.0, -0.1, 1.5, True, "0.1", None])
def test_dropout_out_of_range(name, value):
    with pytest.raises(ConfigError, match=rf"^{name}=") as err:
        ModelConfig(**{name: value})
    assert "[0, 1)" in str(err.value)


@pytest.mark.parametrize("name", ["hidden_dropout", "attention_dropout"])
def test_dropout_bounds_accepted(name):
    assert getattr(ModelConfig(**{name: 0}), name) == 0
    assert getattr(ModelConfig(**{name: 0.999}), name) == 0.999


def test_rope_needs_even_head_dim():
    with pytest.raises(ConfigError, match="rope") as err:
        ModelConfig(hidden_size=12, num_attention_heads=4, position="rope")  # head dim 3
    assert "3" in str(err.value) and "hidden_size" in str(err.value)
    assert ModelConfig(hidden_size=12, num_attention_heads=4, position="learned").head_dim == 3
    assert ModelConfig(hidden_size=16, num_attention_heads=4, position="rope").head_dim == 4


def test_replace_revalidates():
    with pytest.raises(ConfigError, match="hidden_size"):
        TINY.replace(hidden_size=17)
    assert TINY.replace(num_layers=5).num_layers == 5
    assert TINY.num_layers == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        TINY.num_layers = 3


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)


# ------------------------------------------------------------------------ from_dict / to_dict
def test_from_dict_refuses_unknown_keys_by_name():
    data = TINY.to_dict() | {"hidden": 64, "n_layer": 2}
    with pytest.raises(ConfigError, match="unknown config field") as err:
        ModelConfig.from_dict(data)
    assert "'hidden'" in str(err.value) and "'n_layer'" in str(err.value)
    assert "hidden_size" in str(err.value)  # the known fields are listed


def test_from_dict_refuses_non_mapping():
    with pytest.raises(ConfigError, match="mapping"):
        ModelConfig.from_dict([("num_layers", 2)])


def test_dict_round_trip_and_validation_through_from_dict():
    assert ModelConfig.from_dict(TINY.to_dict()) == TINY
    assert ModelConfig.from_dict({"num_layers": 3}) == ModelConfig(num_layers=3)
    with pytest.raises(ConfigError, match="num_layers"):
        ModelConfig.from_dict({"num_layers": 0})


# ------------------------------------------------------------------------ derived sizes
def test_ffn_size_defaults():
    assert ModelConfig(hidden_size=64).ffn_size == 256  # gelu: 4h
    assert ModelConfig(hidden_size=96, num_attention_heads=4).ffn_size == 384
    # swiglu: 8h/3 rounded up to a multiple of 64
    assert ModelConfig(hidden_size=96, num_attention_heads=4, activation="swiglu").ffn_size == 256  # 8*96/3 = 256
    assert ModelConfig(hidden_size=64, activation="swiglu").ffn_size == 192  # 170.7 -> 192
    assert ModelConfig(hidden_size=256, activation="swiglu").ffn_size == 704  # 682.7 -> 704
    for h in (64, 128, 192, 256, 320, 4096):
        f = ModelConfig(hidden_size=h, num_attention_heads=4, activation="swiglu").ffn_size
        assert f % 64 == 0 and 8 * h / 3 <= f < 8 * h / 3 + 64
    assert ModelConfig(hidden_size=64, ffn_hidden_size=100, activation="swiglu").ffn_size == 100
    assert ModelConfig(hidden_size=64, ffn_hidden_size=100).ffn_size == 100


def test_head_dim_and_query_groups():
    c = ModelConfig(hidden_size=64, num_attention_heads=8)
    assert c.head_dim == 8 and c.query_groups == 8
    assert c.replace(num_query_groups=2).query_groups == 2


def test_torch_dtype():
    assert ModelConfig(dtype="bf16").torch_dtype is torch.bfloat16
    assert ModelConfig(dtype="fp16").torch_dtype is torch.float16
    assert ModelConfig().torch_dtype is torch.float32


# ------------------------------------------------------------------------ build_model
def expected_parameters(c: ModelConfig) -> int:
    """The reference GPT's parameter count, from its definition."""
    h, v, d, a, g, f = c.hidden_size, c.vocab_size, c.head_dim, c.num_attention_heads, c.query_groups, c.ffn_size
    b = 1 if c.add_bias_linear else 0
    norm = 2 * h if c.normalization == "layernorm" else h
    embedding = v * h + (c.seq_length * h if c.position == "learned" else 0)
    qkv = h * (a + 2 * g) * d + b * (a + 2 * g) * d
    proj = a * d * h + b * h
    fc1_out = f * (2 if c.activation == "swiglu" else 1)
    mlp = h * fc1_out + b * fc1_out + f * h + b * h
    layer = 2 * norm + qkv + proj + mlp
    head = norm + (0 if c.tie_embeddings else v * h)
    return embedding + c.num_layers * layer + head


def count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_parameter_count_by_hand():
    # h=8, 2 heads (d=4), 1 layer, vocab 10, seq 4, gelu (ffn 32), layernorm, learned positions, biases:
    # embedding 10*8 + 4*8 = 112; layer: norms 2*16 = 32, qkv 8*24+24 = 216, proj 8*8+8 = 72,
    # fc1 8*32+32 = 288, fc2 32*8+8 = 264 -> 872; head: norm 16 + output 8*10 = 96. Total 1080.
    c = ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=2, vocab_size=10, seq_length=4)
    assert count(build_model(c)) == 1080
    assert expected_parameters(c) == 1080


@pytest.mark.parametrize("changes", [
    {},
    {"activation": "swiglu", "normalization": "rmsnorm", "position": "rope", "num_query_groups": 2},
    {"add_bias_linear": False, "tie_embeddings": True},
    {"num_query_groups": 1, "ffn_hidden_size": 40, "activation": "swiglu"},
])
def test_parameter_count_formula(changes):
    c = ModelConfig(num_layers=3, hidden_size=32, num_attention_heads=4, vocab_size=50, seq_length=16, **changes)
    model = build_model(c)
    assert count(model) == expected_parameters(c)
    assert len(model.layers) == 3


def test_tied_embeddings_share_one_tensor():
    model = build_model(TINY.replace(tie_embeddings=True))
    assert model.head.output_layer.weight is model.embedding.word_embeddings.weight


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_build_model_dtype_mode_and_seed(dtype):
    c = TINY.replace(dtype=dtype)
    a, b = build_model(c, seed=3), build_model(c, seed=3)
    assert isinstance(a, GPT) and a.training
    assert all(p.dtype == c.torch_dtype for p in a.parameters())
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    other = build_model(c, seed=4)
    assert not torch.equal(a.layers[0].mlp.linear_fc1.weight, other.layers[0].mlp.linear_fc1.weight)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_forward_returns_fp32_scalar_loss(dtype):
    c = TINY.replace(dtype=dtype)
    loss = build_model(c)(*sample_batch(c))
    assert loss.shape == () and loss.dtype == torch.float32 and torch.isfinite(loss)


# ------------------------------------------------------------------------ sample_batch
def test_sample_batch_shapes_and_shift():
    tokens, labels = sample_batch(TINY, seed=5)
    assert tokens.shape == labels.shape == (TINY.micro_batch_size, TINY.seq_length)
    assert tokens.dtype == labels.dtype == torch.int64
    assert torch.equal(labels[:, :-1], tokens[:, 1:])
    assert int(tokens.min()) >= 0 and int(max(tokens.max(), labels.max())) < TINY.vocab_size
    assert tokens.is_contiguous() and labels.is_contiguous()


def test_sample_batch_is_seeded():
    a, b, c = sample_batch(TINY, seed=1), sample_batch(TINY, seed=1), sample_batch(TINY, seed=2)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    before = torch.get_rng_state()
    sample_batch(TINY, seed=1)
    assert torch.equal(before, torch.get_rng_state())  # the global RNG is untouched


# ------------------------------------------------------------------------ presets and config files
def test_presets_have_the_published_shapes() -> None:
    assert PRESETS["gpt-small"] == ModelConfig()
    gpt3 = PRESETS["gpt3-175b"]
    assert (gpt3.num_layers, gpt3.hidden_size, gpt3.num_attention_heads, gpt3.seq_length, gpt3.vocab_size) == \
        (96, 12288, 96, 2048, 51200)
    assert (gpt3.activation, gpt3.normalization, gpt3.position, gpt3.dtype, gpt3.micro_batch_size) == \
        ("gelu", "layernorm", "learned", "bf16", 1)
    assert gpt3.hidden_dropout == gpt3.attention_dropout == 0.1 and gpt3.ffn_size == 4 * 12288
    for name, layers, h, heads, ffn in (("llama3-8b", 32, 4096, 32, 14336), ("llama3-70b", 80, 8192, 64, 28672)):
        c = PRESETS[name]
        assert (c.num_layers, c.hidden_size, c.num_attention_heads, c.query_groups, c.ffn_size) == \
            (layers, h, heads, 8, ffn)
        assert (c.vocab_size, c.seq_length, c.micro_batch_size, c.dtype) == (128256, 8192, 1, "bf16")
        assert (c.activation, c.normalization, c.position, c.attention) == ("swiglu", "rmsnorm", "rope", "sdpa")
        assert c.hidden_dropout == c.attention_dropout == 0.0 and not c.add_bias_linear and not c.tie_embeddings
    with pytest.raises(ConfigError, match="llama3-8b"):
        get_preset("llama-9b")




@pytest.mark.parametrize("fields,field", [
    ({"hidden_size": 30, "num_attention_heads": 4}, "hidden_size"),
    ({"num_attention_heads": 4, "num_query_groups": 3}, "num_query_groups"),
    ({"num_layers": 0}, "num_layers"),
    ({"hidden_size": -64}, "hidden_size"),
    ({"seq_length": 0}, "seq_length"),
    ({"micro_batch_size": 0}, "micro_batch_size"),
    ({"vocab_size": -1}, "vocab_size"),
    ({"ffn_hidden_size": 0}, "ffn_hidden_size"),
    ({"dtype": "fp8"}, "dtype"),
    ({"hidden_dropout": 1.5}, "hidden_dropout"),
])
def test_bad_configs_name_the_field(fields: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        SMALL_GPT.replace(**fields)
    with pytest.raises(ConfigError, match=f"^cfg.yaml: .*{field}"):
        config_from_mapping({**SMALL_GPT.to_dict(), **fields}, "cfg.yaml")


def test_load_yaml_and_json(tmp_path: Path) -> None:
    yaml_file = tmp_path / "model.yaml"
    yaml_file.write_text("num_layers: 3\nhidden_size: 32\nnum_attention_heads: 4\ndtype: bf16\n"
                         "tie_embeddings: true\nhidden_dropout: 0\n")
    assert load_config(yaml_file) == ModelConfig(num_layers=3, hidden_size=32, num_attention_heads=4, dtype="bf16",
                                                 tie_embeddings=True, hidden_dropout=0)
    json_file = tmp_path / "model.json"
    json_file.write_text(json.dumps(SMALL_GPT.to_dict()))
    assert load_config(json_file) == SMALL_GPT
    yml = tmp_path / "dashes.yml"
    yml.write_text("num-layers: 2\nseq-length: 8\n")
    assert load_config(yml) == ModelConfig(num_layers=2, seq_length=8)


def test_load_preset_with_overrides(tmp_path: Path) -> None:
    f = tmp_path / "llama.yaml"
    f.write_text("preset: llama3-8b\nnum_layers: 4\nseq_length: 2048\n")
    assert load_config(f) == PRESETS["llama3-8b"].replace(num_layers=4, seq_length=2048)
    j = tmp_path / "gpt3.json"
    j.write_text('{"preset": "gpt3-175b", "micro_batch_size": 2}')
    assert load_config(j) == PRESETS["gpt3-175b"].replace(micro_batch_size=2)


@pytest.mark.parametrize("name,text,pattern", [
    ("unknown.yaml", "num_layers: 2\nhiden_size: 64\n", r"unknown\.yaml: unknown field\(s\) 'hiden_size'"),
    ("bad.yaml", "num_layers: [2\n", r"bad\.yaml: not valid YAML \(line"),
    ("bad.json", '{"num_layers": 2,}', r"bad\.json: not valid JSON \(line 1"),
    ("list.yaml", "- 1\n- 2\n", r"list\.yaml: expected a mapping"),
    ("empty.yaml", "", r"empty\.yaml: empty"),
    ("preset.yaml", "preset: gpt5\n", r"preset\.yaml: preset='gpt5': unknown preset"),
    ("type.yaml", "num_layers: eight\n", r"type\.yaml: num_layers='eight'"),
    ("float.yaml", "hidden_size: 64.0\n", r"float\.yaml: hidden_size=64\.0: must be an integer"),
    ("bool.yaml", "tie_embeddings: 3\n", r"bool\.yaml: tie_embeddings=3: must be true or false"),
    ("heads.yaml", "preset: llama3-8b\nnum_query_groups: 5\n", r"heads\.yaml: num_attention_heads=32 .*"
                                                                r"num_query_groups=5"),
    ("pickle.yaml", "!!python/object:os.system {}\n", r"pickle\.yaml: not valid YAML"),
])
def test_load_config_errors_name_file_and_field(tmp_path: Path, name: str, text: str, pattern: str) -> None:
    f = tmp_path / name
    f.write_text(text)
    with pytest.raises(ConfigError, match=f"^{tmp_path}/{pattern}"):
        load_config(f)


def test_load_config_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "nope.yaml")


@pytest.mark.parametrize("name,text,key", [
    ("twice.yaml", "num_layers: 2\nhidden_size: 64\nnum_layers: 4\n", "num_layers"),
    ("nested.yaml", "preset: llama3-8b\nseq_length: 8\npreset: gpt3-175b\n", "preset"),
    ("twice.json", '{"num_layers": 2, "num_layers": 3}', "num_layers"),
])
def test_a_key_given_twice_is_refused_naming_it(tmp_path, name, text, key):
    """YAML forbids duplicate keys and JSON discourages them; both parsers keep the last value silently."""
    f = tmp_path / name
    f.write_text(text)
    with pytest.raises(ConfigError, match=rf"^{tmp_path}/{name}: .*key '{key}' is given twice") as err:
        load_config(f)
    assert "line 3" in str(err.value) or name.endswith(".json")


def test_yaml_merge_keys_still_override(tmp_path):
    """A merge key (<<) is YAML's way to override on purpose: not a duplicate."""
    f = tmp_path / "merge.yaml"
    f.write_text("<<: {num_layers: 2, seq_length: 8}\nnum_layers: 3\n")
    assert load_config(f) == ModelConfig(num_layers=3, seq_length=8)

