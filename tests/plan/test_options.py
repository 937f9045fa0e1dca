"""Tests for remat.plan's option objects (PlanOptions, ParallelOptions) and the one definition of Megatron's
settings (remat.plan.megatron) that the CLI's --sweep uses."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json

import pytest

import remat.cli.common as cli_common
from remat.cli import build_parser, main
from remat.cli.plan import plan_options
from remat.config import ModelConfig
from remat.plan import MEGATRON_MODULES, megatron_policies, megatron_sweep
from remat.plan.api import plan
from remat.plan.megatron import SWEEP_DESCRIPTION, SWEEPS
from remat.plan.options import MEASURED_KEYS, ParallelOptions, PlanOptions
from remat.plan.pipeline import plan_pipeline
from remat.plan.space import selective_sets
from remat.recompute.plan_format import PlanError

TINY = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, micro_batch_size=2,
                   vocab_size=128)
FLAGS = ["--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "32", "--batch", "2", "--vocab", "128"]


@pytest.mark.parametrize("kind", [PlanOptions, ParallelOptions])
def test_options_are_frozen_keyword_only_and_every_field_is_documented(kind):
    fields = [f.name for f in dataclasses.fields(kind)]
    with pytest.raises(TypeError):
        kind(*[getattr(kind(), f) for f in fields[:1]])  # keyword-only
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(kind(), fields[0], getattr(kind(), fields[0]))
    body = ast.parse(inspect.getsource(kind)).body[0].body
    documented = {stmt.target.id for stmt, after in zip(body, body[1:]) if isinstance(stmt, ast.AnnAssign)
                  and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                  and isinstance(after.value.value, str) and after.value.value.strip()}
    assert documented == set(fields)


@pytest.mark.parametrize("kwargs, message", [
    ({"objective": "fast"}, "PlanOptions.objective='fast': use 'extra_flops' or 'time'"),
    ({"engine": "magic"}, "PlanOptions.engine='magic': use 'reentrant' or 'non-reentrant'"),
    ({"device": "tpu"}, "PlanOptions.device='tpu': use 'cpu' or 'cuda'"),
    ({"offload": "yes"}, "PlanOptions.offload='yes': give True or False"),
    ({"reserve": "garbage"}, "PlanOptions.reserve='garbage': "),
    ({"reserve": 1.5}, "PlanOptions.reserve=1.5: "),
    ({"selective_sets": "core_attn,attention"}, "valid modules are"),
    ({"selective_sets": ["core_attn"]}, "PlanOptions.selective_sets=['core_attn']: give a comma list"),
    ({"selective_sets": [("attention",)]}, "PlanOptions.selective_sets names 'attention'"),
    ({"measured_times": {"layer": 1.0}}, "PlanOptions.measured_times lacks core_attn"),
    ({"measured_times": 3}, "PlanOptions.measured_times=3: give True, False or the dict"),
    ({"flops_per_second": 0}, "PlanOptions.flops_per_second=0: give a positive finite number"),
    ({"bandwidth": float("inf")}, "PlanOptions.bandwidth=inf: give a positive finite number"),
    ({"memory_bandwidth": True}, "PlanOptions.memory_bandwidth=True"),
    ({"max_resolves": -1}, "PlanOptions.max_resolves=-1: give a count >= 0"),
    ({"operator_sets": -2}, "PlanOptions.operator_sets=-2: give a count >= 0 (0: no keep_ops kinds) or None"),
    ({"operator_sets": 2.5}, "PlanOptions.operator_sets=2.5: give a count"),
    # measured times: seconds, finite, >= 0, and a layer time to divide by (all zero: ZeroDivisionError before)
    *[({"measured_times": {**dict.fromkeys(MEASURED_KEYS, 1e-3), key: value}},
       f"PlanOptions.measured_times[{key!r}]={value!r}: give seconds, a finite number >= 0")
      for key, value in (("layer", 0.0), ("layer", -1.0), ("mlp", -1e-3), ("core_attn", float("nan")),
                         ("act", float("inf")), ("mlp", "fast"))],
    # a roofline replaces the throughput and memory bandwidth: given beside it, they would be ignored
    ({"roofline": "h100", "flops_per_second": 2e15}, "PlanOptions.flops_per_second=2000000000000000.0: roofline="),
    ({"roofline": "a100", "memory_bandwidth": 1e12}, "PlanOptions.memory_bandwidth=1000000000000.0: roofline="),
    # the FLOP objective is not priced in time: a roofline or measured times would be ignored
    ({"objective": "extra_flops", "roofline": "h100"}, "PlanOptions.roofline='h100': prices recompute in time"),
    ({"objective": "extra_flops", "measured_times": True}, "PlanOptions.measured_times=True: prices recompute in"),
])
def test_plan_options_refuse_bad_fields_naming_field_and_fix(kwargs, message):
    with pytest.raises(PlanError) as info:
        PlanOptions(**kwargs)
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("kwargs, message", [
    ({"tp": 0}, "ParallelOptions.tp=0: give the tensor-parallel size, an int >= 1"),
    ({"sp": 1}, "ParallelOptions.sp=1: give True or False"),
    ({"pp": 0}, "ParallelOptions.pp=0: give the number of pipeline stages"),
    ({"pp": 2, "microbatches": 0}, "ParallelOptions.microbatches=0: give the microbatches per step"),
    ({"microbatches": 4}, "ParallelOptions.microbatches=4: given without pp: set pp"),
    ({"schedule": "gpipe"}, "ParallelOptions.schedule='gpipe': a pipeline schedule, given without pp"),
    ({"vpp": 0}, "ParallelOptions.vpp=0"),
    ({"tp": 2, "pp": 2}, "not both"),
    ({"sp": True, "pp": 2}, "not both"),
])
def test_parallel_options_refuse_bad_fields(kwargs, message):
    with pytest.raises(PlanError, match=message):
        ParallelOptions(**kwargs)


def test_plan_options_normalise_and_price():
    assert PlanOptions(selective_sets="core_attn,mlp").selective_sets == selective_sets("core_attn,mlp")
    assert PlanOptions(selective_sets=iter([["mlp"], ("core_attn", "mlp")])).selective_sets == (
        ("mlp",), ("core_attn", "mlp"))
    times = {k: 0.1 for k in ("layer", "core_attn", "mlp", "layernorm", "act", "non_matmul", "core_attn_matmuls",
                              "mlp_matmuls")}
    cost = PlanOptions(measured_times=times, flops_per_second=1e12).cost_model(TINY)
    assert cost.objective == "time" and dict(cost.measured) == times and cost.flops_per_second == 1e12
    assert PlanOptions().objective == "time" and PlanOptions().cost_model(TINY).objective == "time"  # the default
    assert PlanOptions(objective="extra_flops").cost_model(TINY).objective == "extra_flops"
    assert PlanOptions().operator_sets == 16 and PlanOptions(operator_sets=None).operator_sets is None
    assert PlanOptions().budget("1KiB") == (1024, "1.00 KiB")
    assert ParallelOptions(pp=4).num_microbatches == 4 and ParallelOptions(pp=4, microbatches=8).num_microbatches == 8


def test_plan_refuses_keyword_soup_and_wrong_objects():
    with pytest.raises(TypeError):
        plan(TINY, "1MiB", objective="time")  # the old keyword arguments are gone
    with pytest.raises(PlanError, match=r"options=\{'objective': 'time'\}: give a PlanOptions"):
        plan(TINY, "1MiB", {"objective": "time"})
    with pytest.raises(PlanError, match="parallel=.*give a ParallelOptions"):
        plan(TINY, "1MiB", PlanOptions(), PlanOptions())
    with pytest.raises(PlanError, match="budget=-5: give bytes"):
        plan(TINY, -5)
    with pytest.raises(PlanError, match="measured_times .* drop measured_times"):
        plan(TINY, "1MiB", PlanOptions(measured_times=True), ParallelOptions(tp=2))
    with pytest.raises(PlanError, match="give ParallelOptions\\(pp=<stages>"):
        plan_pipeline(TINY, "1MiB", ParallelOptions())
    with pytest.raises(PlanError, match="ParallelOptions.vpp=2: per-stage plans need one model chunk"):
        plan_pipeline(TINY, "1MiB", ParallelOptions(pp=2, vpp=2))


def test_cli_bad_plan_flags_name_the_flag(capsys):
    assert main(["plan", "--budget", "70GiB", "--reserve", "garbage", *FLAGS]) == 2
    assert "remat: error: --reserve garbage: cannot read 'garbage'" in capsys.readouterr().err
    assert main(["plan", "--budget", "70GiB", "--pp", "0", *FLAGS]) == 2
    assert "argument --pp: must be a positive integer" in capsys.readouterr().err
    assert main(["plan", "--budget", "70GiB", "--microbatches", "4", *FLAGS]) == 2
    err = capsys.readouterr().err
    assert "--microbatches 4: given without pp" in err and "Options" not in err


# ------------------------------------------------------------------------------------------------ Megatron's settings
def test_one_definition_of_the_megatron_sweep():
    """The strings of --sweep megatron are the Policy objects plan() searches, and the CLI takes its sweep names and
    their description from remat.plan.megatron."""
    for layers in (1, 3, 5):
        for engine in ("reentrant", "non-reentrant"):
            policies = megatron_policies(layers, engine)
            assert megatron_sweep(layers, engine) == ["none", *(str(p) for p in policies[1:])]
        assert len(megatron_policies(layers)) == 1 + 2 * layers + 2 ** len(MEGATRON_MODULES) - 1
    assert MEGATRON_MODULES == ("core_attn", "mlp", "layernorm")
    assert {m for p in megatron_policies(2) for m in p.modules} == set(MEGATRON_MODULES)
    assert cli_common.SWEEPS is SWEEPS and not hasattr(cli_common, "MEGATRON_SELECTIVE_MODULES")
    assert "(core_attn, mlp, layernorm)" in SWEEP_DESCRIPTION
    source = inspect.getsource(cli_common)
    assert "core_attn, mlp, layernorm" not in source and "SWEEPS = " not in source
    with pytest.raises(ValueError, match="num_layers=0"):
        megatron_policies(0)



def test_cli_operator_sets_and_default_objective(capsys):
    """`remat plan` minimises predicted step time by default; --operator-sets 0 leaves keep_ops kinds out of the
    search, -1 offers all of them; a bad count names the flag."""
    assert main(["plan", "--budget", "64MiB", *FLAGS, "--json", "--operator-sets", "0"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["objective"] == "time" and report["stats"]["operator_kinds"] == 0
    assert report["extended"]["step_time_ratio"] == 1.0
    ns = build_parser().parse_args(["plan", "--budget", "1GiB", *FLAGS, "--operator-sets", "-1"])
    assert plan_options(ns).operator_sets is None and plan_options(ns).objective == "time"
    assert main(["plan", "--budget", "64MiB", *FLAGS, "--operator-sets", "-5"]) == 2
    assert "argument --operator-sets: must be a count >= 0, or -1 for all, got '-5'" in capsys.readouterr().err


def test_selective_modules_none_plans_without_selective_layers():
    """The refusal of an unknown module says to give none: none is accepted (as an empty list)."""
    assert selective_sets("none") == selective_sets("") == () == PlanOptions(selective_sets="none").selective_sets
    with pytest.raises(PlanError, match="or none alone, to plan without selective layers"):
        selective_sets("everything")
    with pytest.raises(PlanError, match="'none'"):
        selective_sets("none,mlp")  # none with modules: a contradiction, not a module
