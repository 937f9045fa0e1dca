"""Tests for remat.predict (fake traces, composition), remat.presets (named configs, YAML/JSON files) and the
``remat predict`` / ``remat compare`` commands.

Fast by design (tiny models; the whole file well under a minute on 2 cores): the composed-vs-full check covers
its grid with a design in which every policy runs with each engine, and the two runs of a policy are on
*complementary* configs (other style, other dtype, other depth), so every policy meets both styles, both dtypes,
both depths and both engines. ``REMAT_FULL_GRID=1`` runs the whole product instead (a few minutes);
``benchmarks/bench_predict.py`` runs a bigger predicted-vs-measured grid.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from remat.cli import main
from remat.cli.compare import part_errors
from remat.config import ConfigError, ModelConfig
from remat.memory.measure import measure
from remat.memory.optimizer import adam_steady_state
from remat.memory.predict import predict, predict_config
from remat.models.gpt import build_model, sample_batch
from remat.plan.megatron import megatron_sweep
from remat.policy import Policy
from remat.presets import PRESETS, config_from_mapping, get_preset, load_config
from remat.recompute.apply import apply
from remat.timeline import Timeline

FULL_GRID = os.environ.get("REMAT_FULL_GRID") == "1"

GPT = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16, micro_batch_size=2,
                  vocab_size=64)
LLAMA = GPT.replace(num_query_groups=2, activation="swiglu", normalization="rmsnorm", position="rope",
                    attention="sdpa", hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False)
STYLES = {"gpt": GPT, "llama": LLAMA}
ENGINES = ("reentrant", "non-reentrant")


def with_engine(policy: str, engine: str) -> str:
    return policy if engine == "reentrant" or policy == "none" else f"{policy}@{engine}"


# ================================================================================ composed == full fake trace
# The grid's full traces are the slowest part of this file, so they run in a background process, started by the
# first test of the module, while the other tests run here; the grid's tests come last and read its results.
GRID_CONFIGS = [(style, dtype, depth) for style in STYLES for dtype in ("fp32", "bf16") for depth in (10, 13)]
GRID_SELECTIVE = ["selective/core_attn", "selective/mlp", "selective/layernorm+act", "selective/non_matmul",
                  "selective/core_attn+non_matmul",
                  "selective/core_attn+mlp+layernorm"]


def grid_policies(depth: int) -> list[str]:
    """none, uniform k = 1, 2, 3, 4, L-1, L, block k = 1, 3, L, selective sets (the same count at any depth)."""
    uniform = [f"full/uniform/{k}" for k in (1, 2, 3, 4, depth - 1, depth)]
    block = [f"full/block/{k}" for k in (1, 3, depth)]
    return ["none", *uniform, *block, *GRID_SELECTIVE]


def grid_cases() -> list[tuple[str, str, int, int, str]]:
    """(style, dtype, depth, policy index, engine): see the module docstring for the design."""
    cases = []
    for i in range(len(grid_policies(10))):
        for e, engine in enumerate(ENGINES):
            if FULL_GRID:
                if not (i == 0 and e):  # none has no engine
                    cases += [(*c, i, engine) for c in GRID_CONFIGS]
            else:
                # configs are indexed by 3 bits (style, dtype, depth); the other engine gets the complement
                c = GRID_CONFIGS[(i * 3) % 8 if e == 0 else 7 - (i * 3) % 8]
                cases.append((*c, i, engine))
    return cases


def grid_case_id(case: tuple[str, str, int, int, str]) -> str:
    style, dtype, depth, index, engine = case
    return f"{style}-{dtype}-L{depth}-{with_engine(grid_policies(depth)[index], engine)}"


def assert_same_timeline(composed: Timeline, full: Timeline) -> None:
    assert composed.num_events == full.num_events, (composed.num_events, full.num_events)
    assert np.array_equal(composed.live_bytes(), full.live_bytes()), "live curves differ"
    assert composed.peak_bytes == full.peak_bytes, (composed.peak_bytes, full.peak_bytes)
    assert composed.peak_event == full.peak_event, (composed.peak_event, full.peak_event)
    assert composed.peak_phase.label == full.peak_phase.label, (composed.peak_phase, full.peak_phase)
    assert composed.at_peak == full.at_peak, (composed.at_peak, full.at_peak)
    assert composed.meta["flops"] == full.meta["flops"], (composed.meta["flops"], full.meta["flops"])


def check_grid_case(case: tuple[str, str, int, int, str]) -> str:
    """'' when predict_config's composition equals the full fake trace for ``case``, else what differs."""
    style, dtype, depth, index, engine = case
    config = STYLES[style].replace(num_layers=depth, dtype=dtype)
    policy = with_engine(grid_policies(depth)[index], engine)
    try:
        composed = predict_config(config, policy)
        assert "composition_refused" not in composed.meta, composed.meta["composition_refused"]
        assert "composed_from" in composed.meta, "not composed: traced in full"
        assert composed.meta["composed_from"]["num_layers"] < depth, composed.meta["composed_from"]
        full = predict_config(config, policy, compose_layers=False)
        assert "composed_from" not in full.meta
        assert_same_timeline(composed, full)
    except Exception as err:  # reported by the test of this case
        return f"{type(err).__name__}: {err}"
    return ""


def _grid_worker(out: str) -> None:
    torch.set_num_threads(1)
    gc.freeze()  # see _frozen_gc
    results = {grid_case_id(case): check_grid_case(case) for case in grid_cases()}
    Path(out).write_text(json.dumps(results))


class _Grid:
    def __init__(self, directory: Path):
        self.out = directory / "grid.json"
        self.proc = subprocess.Popen([sys.executable, __file__, "--grid-worker", str(self.out)],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "OMP_NUM_THREADS": "1"})
        self._results: dict[str, str] | None = None

    def results(self) -> dict[str, str]:
        if self._results is None:
            output, _ = self.proc.communicate(timeout=900)
            assert self.proc.returncode == 0, output
            self._results = json.loads(self.out.read_text())
        return self._results

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


@pytest.fixture(scope="module", autouse=True)
def _frozen_gc():
    """Move the objects alive now (torch, pytest, ...) out of the cycle collector's way: every recorded step starts
    with gc.collect() (remat.measure), which otherwise rescans them each time, ~0.1 s a step here."""
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture(scope="module", autouse=True)
def grid(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """The background grid run, started before this module's first test when any grid test is selected."""
    if not any(getattr(item, "originalname", "") == "test_composed_equals_full_trace"
               for item in request.session.items):
        yield None
        return
    running = _Grid(tmp_path_factory.mktemp("grid"))
    yield running
    running.stop()


def test_grid_design_covers_every_policy_engine_style_dtype_and_depth() -> None:
    seen: dict[str, set] = {}
    for style, dtype, depth, index, engine in grid_cases():
        name = grid_policies(10)[index].replace("/10", "/L").replace("/9", "/L-1")
        seen.setdefault(name, set()).update({style, dtype, depth, engine})
    assert len(seen) == len(grid_policies(10))
    for policy, values in seen.items():
        assert {"gpt", "llama", "fp32", "bf16", 10, 13, *ENGINES} <= values, policy
    assert len({grid_case_id(c) for c in grid_cases()}) == len(grid_cases())


# ================================================================================ predicted == measured (CPU)
MEASURE_CONFIGS = [(style, size, dtype) for style in STYLES for size in ("small", "wide") for dtype in ("fp32", "bf16")]
SIZES = {"small": {}, "wide": {"hidden_size": 64, "seq_length": 24, "micro_batch_size": 1, "vocab_size": 96}}


def measure_policies() -> list[str]:
    base = ["full/uniform/1", "full/uniform/2", "full/uniform/3", "full/uniform/4", "full/block/1", "full/block/2",
            "full/block/4", "selective/core_attn", "selective/mlp", "selective/layernorm+act",
            "selective/core_attn+mlp+layernorm", "selective/non_matmul", "selective/core_attn+mlp+non_matmul"]
    return [with_engine(p, e) for p in base for e in ENGINES]


def measure_cases() -> list[tuple[str, str, str, str]]:
    """Each (policy, engine) on one config, the policy's other engine on the complementary config (other style,
    size and dtype); the policies cycle through all eight configs. none on two complementary configs."""
    cases = [(*MEASURE_CONFIGS[0], "none"), (*MEASURE_CONFIGS[7], "none")]
    for i, policy in enumerate(measure_policies()):
        j = (i // 2 * 3) % 8
        cases.append((*MEASURE_CONFIGS[j if i % 2 == 0 else 7 - j], policy))
    if FULL_GRID:
        cases = [(*c, p) for c in MEASURE_CONFIGS for p in ["none", *measure_policies()]]
    return cases


def measured(config: ModelConfig, policy: str) -> Timeline:
    model = build_model(config, seed=0)
    apply(model, policy)
    torch.manual_seed(0)
    return measure(model, sample_batch(config))


@pytest.mark.parametrize("style,size,dtype,policy", measure_cases())
def test_predicted_matches_measured(style: str, size: str, dtype: str, policy: str) -> None:
    config = STYLES[style].replace(dtype=dtype, **SIZES[size])
    real = measured(config, policy)
    fake = predict(config, policy)
    assert fake.meta["backend"] == "fake" or "composed_from" in fake.meta
    assert abs(fake.peak_bytes - real.peak_bytes) <= 0.01 * real.peak_bytes
    errors = part_errors(fake.at_peak, real.at_peak, real.peak_bytes)
    assert max(abs(e) for e in errors.values()) <= 0.02, errors


def test_measure_cases_cover_every_config_and_policy() -> None:
    cases = measure_cases()
    assert {c[:3] for c in cases} == set(MEASURE_CONFIGS)
    assert {c[3] for c in cases} == {"none", *measure_policies()}


def test_megatron_sweep_lists_every_setting() -> None:
    names = megatron_sweep(4)
    assert names[0] == "none" and len(names) == 1 + 4 + 4 + 7 == len(set(names))
    assert "full/block/4" in names and "full/uniform/4" in names and "selective/core_attn+mlp+layernorm" in names
    assert all("@non-reentrant" in n for n in megatron_sweep(3, "non-reentrant")[1:])
    for name in names:
        Policy.parse(name).layer_groups(4)


# ================================================================================ large models stay cheap
SCRIPT_175B = textwrap.dedent("""
    import json, resource
    from remat.memory.predict import predict_config
    from remat.presets import get_preset
    config = get_preset("gpt3-175b")
    out = {}
    for policy in ("none", "full/uniform/1"):
        tl = predict_config(config, policy)
        out[policy] = {"peak": tl.peak_bytes, "at_peak": tl.at_peak, "composed": tl.meta.get("composed_from"),
                       "layers": tl.meta["num_layers"], "refused": tl.meta.get("composition_refused")}
    out["maxrss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps(out))
""")


def test_gpt3_175b_predicts_in_little_memory() -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT_175B], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["maxrss_kib"] * 1024 < 2 << 30, out["maxrss_kib"]
    c = get_preset("gpt3-175b")
    h, v, s, layers = c.hidden_size, c.vocab_size, c.seq_length, c.num_layers
    params = layers * (12 * h * h + 13 * h) + v * h + s * h + 2 * h  # tied output layer: counted once
    assert 174e9 < params < 176e9
    for policy in ("none", "full/uniform/1"):
        row = out[policy]
        assert row["layers"] == 96 and row["composed"] is not None and row["refused"] is None
        assert row["at_peak"]["parameters"] == 2 * params  # bf16
        assert row["peak"] > 2 * 2 * params  # parameters and their gradients, plus activations
    # full/uniform/1 keeps one [s, b, h] input per layer where none keeps everything: far fewer saved bytes
    assert out["full/uniform/1"]["at_peak"]["saved_activations"] < out["none"]["at_peak"]["saved_activations"]


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


# ================================================================================ user models, optimizer
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ff = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(x)


class TinyNet(nn.Module):
    """Not the reference GPT: an input projection, a ModuleList of residual blocks, a squared-mean loss."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.layers = nn.ModuleList(Block() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


@pytest.mark.parametrize("policy", ["none", "full/uniform/3@non-reentrant"])
def test_factory_model_with_batch(policy: str) -> None:
    x = torch.randn(8, 16)
    fake = predict(TinyNet, policy, batch=(x,))
    model = TinyNet()
    apply(model, policy)
    real = measure(model, (x,))
    assert abs(fake.peak_bytes - real.peak_bytes) <= 0.01 * real.peak_bytes
    assert max(abs(e) for e in part_errors(fake.at_peak, real.at_peak, real.peak_bytes).values()) <= 0.02
    assert fake.meta["num_layers"] == 3


def test_factory_model_with_batch_function() -> None:
    made = predict(TinyNet, "full/uniform/1", batch=lambda: (torch.randn(8, 16),))
    given = predict(TinyNet, "full/uniform/1", batch=(torch.randn(8, 16),))
    assert made.peak_bytes == given.peak_bytes and made.at_peak == given.at_peak


def test_factory_model_without_batch_is_refused() -> None:
    with pytest.raises(ValueError, match="batch="):
        predict(TinyNet, "none")


def _param_counts(config: ModelConfig) -> tuple[int, int]:
    model = build_model(config)
    params = list(model.parameters())
    return sum(p.numel() * p.element_size() for p in params), len(params)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_adam_adds_two_moments_and_step_counters(dtype: str) -> None:
    config = GPT.replace(num_layers=2, dtype=dtype)
    nbytes, count = _param_counts(config)
    tl = predict(config, "none", optimizer=torch.optim.Adam)
    assert tl.phases[-1].kind in ("optimizer", "setup")
    end = tl.breakdown(tl.num_events - 1)
    assert end["optimizer_state"] == 2 * nbytes + 4 * count  # exp_avg, exp_avg_sq in the param dtype; fp32 steps
    assert end["parameters"] == nbytes and end["gradients"] == nbytes
    assert tl.at_peak["optimizer_state"] >= 2 * nbytes  # the first step peaks inside optimizer.step()
    # a later step: the moments are alive from the start, through forward and backward
    steady = predict(config, "none", optimizer=adam_steady_state)
    first_forward = next(p.start for p in steady.phases if p.kind == "forward")
    assert steady.breakdown(first_forward)["optimizer_state"] == 2 * nbytes + 4 * count
    assert steady.peak_bytes >= tl.peak_bytes


# ================================================================================ configs
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
        GPT.replace(**fields)
    with pytest.raises(ConfigError, match=f"^cfg.yaml: .*{field}"):
        config_from_mapping({**GPT.to_dict(), **fields}, "cfg.yaml")


def test_load_yaml_and_json(tmp_path: Path) -> None:
    yaml_file = tmp_path / "model.yaml"
    yaml_file.write_text("num_layers: 3\nhidden_size: 32\nnum_attention_heads: 4\ndtype: bf16\n"
                         "tie_embeddings: true\nhidden_dropout: 0\n")
    assert load_config(yaml_file) == ModelConfig(num_layers=3, hidden_size=32, num_attention_heads=4, dtype="bf16",
                                                 tie_embeddings=True, hidden_dropout=0)
    json_file = tmp_path / "model.json"
    json_file.write_text(json.dumps(GPT.to_dict()))
    assert load_config(json_file) == GPT
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


# ================================================================================ CLI
# The GPT of the measured tests (4 layers): predict_config's cached stand-ins from those tests are reused here.
TINY_FLAGS = ["--layers", "4", "--hidden", "32", "--heads", "4", "--seq", "16", "--batch", "2", "--vocab", "64"]


def run_cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_predict_table(capsys: pytest.CaptureFixture) -> None:
    code, out, _ = run_cli(capsys, "predict", *TINY_FLAGS, "--policy", "full/uniform/1,selective")
    assert code == 0
    for text in ("policy", "peak KiB", "where", "saved act", "extra compute %", "full/uniform/1",
                 "selective/core_attn", "Korthikanti", "Megatron estimate", "traced (CPU kernels, exact)"):
        assert text in out


def test_cli_predict_json_and_out(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    out_file = tmp_path / "sub" / "predict.json"
    code, out, _ = run_cli(capsys, "predict", *TINY_FLAGS, "--policy", "none", "--policy", "full/uniform/2",
                           "--engine", "non-reentrant", "--json", "--out", str(out_file))
    assert code == 0
    report = json.loads(out)
    assert json.loads(out_file.read_text()) == {**report, "seconds": json.loads(out_file.read_text())["seconds"]}
    assert [r["policy"] for r in report["rows"]] == ["none", "full/uniform/2@non-reentrant"]
    for row in report["rows"]:
        assert {"policy", "peak_bytes", "peak_phase", "at_peak", "flops", "extra_compute_pct"} <= set(row)
        assert sum(row["at_peak"].values()) == row["peak_bytes"]
    assert report["rows"][1]["peak_bytes"] == predict(GPT, "full/uniform/2@non-reentrant").peak_bytes
    assert report["rows"][1]["extra_compute_pct"] > 0 and report["rows"][0]["extra_compute_pct"] == 0
    formulas = report["formulas"]
    assert formulas["traced_layer_bytes"] > 0 and len(formulas["differences"]) == 2
    for diff in formulas["differences"]:
        assert diff["unexplained_bytes"] == 0


def test_cli_predict_sweep_config_file_adam(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    cfg = tmp_path / "tiny.yaml"
    # the Llama of the measured tests, in bf16, from the llama3-8b preset
    cfg.write_text("preset: llama3-8b\nnum_layers: 2\nhidden_size: 32\nnum_attention_heads: 4\n"
                   "num_query_groups: 2\nffn_hidden_size: null\nseq_length: 16\nmicro_batch_size: 2\n"
                   "vocab_size: 64\n")
    assert load_config(cfg) == LLAMA.replace(num_layers=2, dtype="bf16")
    code, out, _ = run_cli(capsys, "predict", "--config", str(cfg), "--sweep", "megatron", "--json")
    assert code == 0
    rows = json.loads(out)["rows"]
    assert [r["policy"] for r in rows] == megatron_sweep(2)
    code, out, _ = run_cli(capsys, "predict", "--config", str(cfg), "--layers", "1", "--policy", "full/uniform/1",
                           "--adam", "--json")
    assert code == 0
    report = json.loads(out)
    assert report["config"]["num_layers"] == 1 and report["optimizer"]
    assert all(r["at_peak"]["optimizer_state"] > 0 for r in report["rows"])


def test_cli_compare(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    code, out, _ = run_cli(capsys, "compare", *TINY_FLAGS, "--policy", "full/uniform/1,full/block/2@non-reentrant",
                           "--policy", "selective/core_attn+mlp", "--json", "--out", str(tmp_path / "c.json"),
                           "--max-error", "0.01")
    assert code == 0
    rows = json.loads(out)
    assert rows == json.loads((tmp_path / "c.json").read_text())
    assert [r["policy"] for r in rows] == ["none", "full/uniform/1", "full/block/2@non-reentrant",
                                           "selective/core_attn+mlp"]
    for row in rows:
        assert {"policy", "predicted_bytes", "measured_bytes", "error", "part_errors", "worst_part"} <= set(row)
        assert abs(row["error"]) <= 0.01 and max(abs(e) for e in row["part_errors"].values()) <= 0.02
    code, out, _ = run_cli(capsys, "compare", *TINY_FLAGS, "--policy", "full/uniform/3", "--dtype", "bf16")
    assert code == 0 and "error %" in out and "worst peak error" in out


@pytest.mark.parametrize("argv", [
    ["predict", *TINY_FLAGS, "--policy", "full/uniform/9"],
    ["predict", *TINY_FLAGS, "--policy", "full/sideways/1"],
    ["predict", "--hidden", "30", "--heads", "4"],
    ["predict", "--preset", "gpt5"],
    ["predict", "--preset", "gpt-small", "--config", "x.yaml"],
    ["predict", "--config", "/nonexistent/model.yaml"],
    ["predict", "--sweep", "everything"],
    ["compare", *TINY_FLAGS, "--device", "cuda"] if not torch.cuda.is_available() else ["compare", "--layers", "0"],
    ["compare", "--preset", "llama3-70b", "--policy", "none"],
    ["compare", *TINY_FLAGS, "--max-error", "-1"],
])
def test_cli_bad_input_is_one_line_exit_2(capsys: pytest.CaptureFixture, argv: list[str]) -> None:
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    assert err.startswith("remat: error: ") and err.count("\n") == 1, err
    assert out == ""


def test_cli_bad_config_file_names_it(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    f = tmp_path / "m.yaml"
    f.write_text("num_layers: 2\nhidden: 64\n")
    code, _, err = run_cli(capsys, "predict", "--config", str(f))
    assert code == 2 and f"{f}: unknown field(s) 'hidden'" in err


# ================================================================================ composed == full: the results
@pytest.mark.parametrize("case", grid_cases(), ids=grid_case_id)
def test_composed_equals_full_trace(grid: _Grid, case: tuple[str, str, int, int, str]) -> None:
    """The background process's verdict; check_grid_case(case) reproduces a failure here, with its traceback."""
    assert grid.results()[grid_case_id(case)] == ""


if __name__ == "__main__" and sys.argv[1:2] == ["--grid-worker"]:
    _grid_worker(sys.argv[2])
