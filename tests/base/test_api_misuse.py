"""A sweep of public API calls given the wrong kind of argument: each raises remat's own error type (a ValueError
subclass the CLI reports in one line) whose message names the argument, never a foreign AttributeError, TypeError,
ZeroDivisionError or UnicodeDecodeError from deep inside, and never a silent result."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from remat import (
    ApplyError,
    ConfigError,
    MeasureError,
    ModelConfig,
    Policy,
    PolicyError,
    Timeline,
    TimelineError,
    applied,
    apply,
    build_model,
    measure,
    predict_config,
    predict_many,
    remove,
    sample_batch,
)
from remat.config import RoutingAssumption
from remat.job import JobError
from remat.parallel.job_predict import predict_job
from remat.plan import PlanOptions, plan
from remat.plan.options import MEASURED_KEYS
from remat.recompute.plan_format import PlanError
from remat.units import ascii_float, ascii_int

C = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=2, seq_length=16, micro_batch_size=1,
                vocab_size=64)
DROPOUT = C.replace(hidden_dropout=0.1, attention_dropout=0.1)


def _model(config: ModelConfig = C, *, eval_mode: bool = False, meta: bool = False) -> torch.nn.Module:
    model = build_model(config)
    if eval_mode:
        model.eval()
    return model.to("meta") if meta else model


def _measure(**kwargs) -> Callable[[], object]:
    return lambda: measure(_model(), sample_batch(C), **kwargs)


def _binary_timeline(tmp_path: Path) -> Timeline:
    path = tmp_path / "timeline.json"
    path.write_bytes(b"\x80\x04\x95binary pickle\xff")
    return Timeline.load(path)


CASES = [  # (id, call, error type, what the message must name)
    ("apply layers=5", lambda: apply(_model(), "full/uniform/1", layers=5), ApplyError, ["layers=5"]),
    ("remove(5)", lambda: remove(5), ApplyError, ["remove(model=", "int"]),
    ("applied('x')", lambda: applied("x"), ApplyError, ["applied(model=", "str"]),
    ("measure optimizer='adam'", _measure(optimizer="adam"), MeasureError, ["optimizer='adam'", "torch.optim"]),
    ("measure loss_fn='mean'", _measure(loss_fn="mean"), MeasureError, ["loss_fn='mean'", "callable"]),
    ("measure a loss without grad", _measure(loss_fn=lambda output, batch: torch.tensor(1.0)), MeasureError,
     ["loss_fn", "requires grad"]),
    ("measure a model on meta", lambda: measure(_model(meta=True), sample_batch(C)), MeasureError, ["meta device"]),
    ("measure a model in eval mode", lambda: measure(_model(DROPOUT, eval_mode=True), sample_batch(DROPOUT)),
     MeasureError, ["eval mode", "model.train()"]),
    ("predict_config('gpt')", lambda: predict_config("gpt", "none"), ConfigError, ["config='gpt'", "ModelConfig"]),
    ("predict_config(C, 5)", lambda: predict_config(C, 5), PolicyError, ["policy=5"]),
    ("predict_many(C, [None])", lambda: predict_many(C, [None]), PolicyError, ["policies[0]=None"]),
    ("predict_many(C, 'none')", lambda: predict_many(C, "none"), PolicyError, ["policies='none'", "a list"]),
    ("plan('gpt', '1GiB')", lambda: plan("gpt", "1GiB"), ConfigError, ["config='gpt'", "ModelConfig"]),
    ("predict_job('job')", lambda: predict_job("job"), JobError, ["job='job'", "Job"]),
    ("plan with all-zero measured times",
     lambda: plan(C, "1GiB", PlanOptions(measured_times=dict.fromkeys(MEASURED_KEYS, 0.0))), PlanError,
     ["measured_times['layer']=0.0"]),
    ("PlanOptions with negative measured times",
     lambda: PlanOptions(measured_times=dict.fromkeys(MEASURED_KEYS, -1.0)), PlanError, ["measured_times"]),
    ("PlanOptions with nan measured times",
     lambda: PlanOptions(measured_times={**dict.fromkeys(MEASURED_KEYS, 1e-3), "mlp": float("nan")}), PlanError,
     ["measured_times['mlp']=nan"]),
    ("Policy with a count the parser refuses", lambda: Policy("full", "uniform", 2**70), PolicyError,
     ["num_layers=1180591620717411303424", "18 digits"]),
    ("MoE capacity factor nan", lambda: C.replace(num_moe_experts=2, moe_expert_capacity_factor=float("nan")),
     ConfigError, ["moe_expert_capacity_factor=nan", "--moe-expert-capacity-factor"]),
    ("MoE capacity factor inf", lambda: C.replace(num_moe_experts=2, moe_expert_capacity_factor=float("inf")),
     ConfigError, ["moe_expert_capacity_factor=inf"]),
    ("MoE aux-loss coefficient -0.5", lambda: C.replace(num_moe_experts=2, moe_aux_loss_coeff=-0.5), ConfigError,
     ["moe_aux_loss_coeff=-0.5", ">= 0"]),
    ("MoE aux-loss coefficient nan", lambda: C.replace(num_moe_experts=2, moe_aux_loss_coeff=float("nan")),
     ConfigError, ["moe_aux_loss_coeff=nan"]),
    ("MoE z-loss coefficient -0.5", lambda: C.replace(num_moe_experts=2, moe_z_loss_coeff=-0.5), ConfigError,
     ["moe_z_loss_coeff=-0.5"]),
    # numbers in text are written with the digits 0-9 (NOTE [ASCII digits] in remat.units)
    *[(f"routing {text}", lambda text=text: RoutingAssumption.parse(text), ConfigError,
       [f"moe_routing_assumption='{text}'"]) for text in ("counts:٣,1", "counts:1_0,2", "capacity:١.5")],
]


@pytest.mark.parametrize("call, error, names", [pytest.param(*case[1:], id=case[0]) for case in CASES])
def test_misuse_raises_remats_error_naming_the_argument(call, error, names):
    with pytest.raises(error) as info:
        call()
    assert isinstance(info.value, ValueError)  # what the CLI reports as one line
    for name in names:
        assert name in str(info.value), (name, str(info.value))


def test_a_binary_timeline_file_is_named(tmp_path):
    with pytest.raises(TimelineError, match=r"timeline\.json: not valid JSON, not even UTF-8 text"):
        _binary_timeline(tmp_path)


def test_the_policy_bound_is_the_parsers():
    """Policy holds the layer counts Policy.parse reads, and only those: str(p) always parses back."""
    largest = Policy("full", "uniform", 10**18 - 1)
    assert Policy.parse(str(largest)) == largest
    with pytest.raises(PolicyError, match="18 digits"):
        Policy("full", "block", 10**18)
    with pytest.raises(PolicyError, match="is not an integer"):
        Policy.parse(f"full/uniform/{10**18}")


def test_numbers_are_ascii_digits_only():
    """NOTE [ASCII digits]: int() and float() read '٣', '２' and '1_0'; remat's readers do not."""
    assert [ascii_int(t) for t in ("٣", "２", "1_0", "³", "", " 3", "3.0", "0x10", "1" * 19)] == [None] * 9
    assert [ascii_float(t) for t in ("٣", "２.5", "1_0.5", "1e1_0", "", "x", "٣.0")] == [None] * 7


def test_ascii_numbers_read_as_usual():
    assert (ascii_int("12"), ascii_int("-3"), ascii_int("+4"), ascii_int("-3", signed=False)) == (12, -3, 4, None)
    assert (ascii_float("1.5"), ascii_float("1e-3"), ascii_float("inf")) == (1.5, 1e-3, float("inf"))
