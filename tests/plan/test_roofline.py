"""GPU roofline presets of the time objective (PlanOptions.roofline, ``remat plan --roofline``)."""

from __future__ import annotations

import pytest

from remat.cli import main
from remat.config import ModelConfig
from remat.plan.costs import ROOFLINES
from remat.plan.options import PlanOptions
from remat.recompute.plan_format import PlanError

CFG = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, micro_batch_size=2,
                  vocab_size=128)


@pytest.mark.parametrize("name", sorted(ROOFLINES))
def test_preset_replaces_throughput_and_bandwidth(name: str) -> None:
    cost = PlanOptions(objective="time", roofline=name).cost_model(CFG)
    assert (cost.flops_per_second, cost.memory_bandwidth) == ROOFLINES[name]
    assert cost.objective == "time"
    with pytest.raises(PlanError, match=r"PlanOptions.flops_per_second=1.0: roofline=.* sets it"):  # not ignored
        PlanOptions(objective="time", roofline=name, flops_per_second=1.0, memory_bandwidth=1.0)


def test_h200_has_more_bandwidth_than_h100_and_the_same_flops() -> None:
    assert ROOFLINES["h200"][0] == ROOFLINES["h100"][0] and ROOFLINES["h200"][1] > ROOFLINES["h100"][1]


def test_unknown_preset_names_the_field_and_the_choices() -> None:
    with pytest.raises(PlanError, match=r"PlanOptions.roofline='b200': use one of h100, h200, a100, mi300x or None"):
        PlanOptions(roofline="b200")


def test_cli_flag(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "32", "--batch", "2", "--vocab",
            "128", "--budget", "64MiB", "--objective", "time", "--roofline", "mi300x", "--json"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "1307 TFLOP/s" in out and "5300 GB/s" in out
