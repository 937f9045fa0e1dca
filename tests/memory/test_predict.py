"""Tests for remat.memory.predict (fake traces of the reference GPT and of user models, predicted against measured).
The composition of deep stacks from shallow traces is tested in test_compose.py; the ``remat predict`` / ``remat
compare`` commands in tests/cli/.

Fast by design (tiny models): each policy and engine is measured on one config and its other engine on the
complementary config (other style, size and dtype). ``REMAT_FULL_GRID=1`` runs the whole product instead;
``benchmarks/bench_predict.py`` runs a bigger predicted-vs-measured grid.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from tiny_models import ENGINES, GPT, STYLES, with_engine
from torch import nn

from remat.config import ModelConfig
from remat.memory.comparison import part_errors
from remat.memory.measure import MeasureError, measure
from remat.memory.optimizer import adam_steady_state
from remat.memory.predict import predict
from remat.models.gpt import build_model, sample_batch
from remat.plan.megatron import megatron_sweep
from remat.policy import Policy
from remat.presets import get_preset
from remat.recompute.apply import apply
from remat.timeline import Timeline

FULL_GRID = os.environ.get("REMAT_FULL_GRID") == "1"


# ================================================================================ predicted == measured (CPU)
MEASURE_CONFIGS = [(style, size, dtype) for style in STYLES for size in ("small", "wide") for dtype in ("fp32", "bf16")]
SIZES = {"small": {}, "wide": {"hidden_size": 64, "seq_length": 24, "micro_batch_size": 1, "vocab_size": 96}}


def measure_policies() -> list[str]:
    base = ["full/uniform/1", "full/uniform/2", "full/uniform/3", "full/uniform/4", "full/block/1", "full/block/2",
            "full/block/4", "selective/core_attn", "selective/layernorm+act", "selective/core_attn+mlp+layernorm",
            "selective/non_matmul"]
    if FULL_GRID:  # sets made of parts the others run (the MLP alone, a union): the same kernels
        base += ["selective/mlp", "selective/core_attn+mlp+non_matmul"]
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


@pytest.mark.parametrize("micro_batch_size", [1, 3])
def test_the_reference_batch_made_fake_is_the_sample_batch_converted(micro_batch_size: int) -> None:
    """A config's trace makes its batch inside the fake mode (remat.models.gpt.empty_batch): every row (bytes,
    category, module, allocation and free) and phase equal to converting the real sample batch. With one sequence a
    microbatch, tokens and labels are contiguous slices sharing one storage; with three, two copies."""
    config = ModelConfig(num_layers=2, seq_length=16, vocab_size=128, micro_batch_size=micro_batch_size)
    made, converted = predict(config, "selective"), predict(config, "selective", batch=sample_batch(config))

    def rows(t: Timeline) -> list[tuple[int, str, str, int, int]]:
        return [(int(t.nbytes[i]), t.category[i], t.module[i], int(t.alloc_at[i]), int(t.free_at[i]))
                for i in range(len(t.nbytes))]
    assert rows(made) == rows(converted) and made.phases == converted.phases
    batch = [int(n) for n, c in zip(made.nbytes, made.category) if c == "other"][:micro_batch_size // 2 + 1]
    assert batch == ([8 * 17] if micro_batch_size == 1 else [8 * 3 * 16, 8 * 3 * 16])


def test_factory_model_without_batch_is_refused() -> None:
    with pytest.raises(MeasureError, match="batch="):
        predict(TinyNet, "none")


@pytest.mark.parametrize("factory,pattern", [
    (lambda: 5, r"the factory returned int, not a torch.nn.Module: it must build and return the model"),
    (lambda: None, r"the factory returned NoneType"),
    (TinyNet(), r"got TinyNet \(a TinyNet instance: pass the function that builds it"),
    (42, r"takes a ModelConfig or a zero-argument function that builds the model, got int"),
])
def test_a_factory_that_builds_no_module_is_refused(factory, pattern: str) -> None:
    with pytest.raises(MeasureError, match=pattern):
        predict(factory, "none", batch=(torch.randn(8, 16),))


def test_predict_refuses_a_step_without_gradients() -> None:
    with torch.no_grad(), pytest.raises(MeasureError, match=r"gradients are disabled .*torch.no_grad"):
        predict(TinyNet, "none", batch=(torch.randn(8, 16),))

    def frozen() -> nn.Module:
        return TinyNet().requires_grad_(False)

    with pytest.raises(MeasureError, match=r"every parameter of TinyNet has requires_grad=False"):
        predict(frozen, "none", batch=(torch.randn(8, 16),))


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
