"""Fixtures of the command-line tests: run ``remat`` in-process, parse the pipeline flags alone, stand the
prediction in for a real multi-process pipeline run."""

from __future__ import annotations

import argparse
import signal
from collections.abc import Callable

import pytest

import remat.cli.pipeline as cli_pipeline
import remat.parallel.pipeline_measure as pipeline_measure
from remat.cli import main
from remat.cli.common import add_measure_arguments, add_model_arguments, add_pipeline_arguments
from remat.parallel.pipeline_predict import predict_pipeline


@pytest.fixture
def run_cli(capsys: pytest.CaptureFixture) -> Callable[..., tuple[int, str, str]]:
    """``run_cli("predict", "--layers", "2", ...)`` -> ``(exit code, stdout, stderr)`` of ``remat.cli.main``."""

    def run(*argv: str) -> tuple[int, str, str]:
        code = main(list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture
def pipeline_namespace() -> Callable[[list[str]], argparse.Namespace]:
    """``pipeline_namespace(["--pp", "2", ...])``: the parsed model, measurement and pipeline flags of a 4-layer
    model, plus ``--policies``, ``--json`` and ``--out``, as the ``remat.cli.pipeline`` runners read them."""

    def parse(extra: list[str]) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        add_model_arguments(parser)
        add_measure_arguments(parser)
        add_pipeline_arguments(parser)
        parser.add_argument("--policies")
        parser.add_argument("--json", action="store_true")
        parser.add_argument("--out")
        model = "--layers 4 --hidden 64 --heads 4 --seq 32 --batch 2 --vocab 128".split()
        return parser.parse_args(model + extra)

    return parse


@pytest.fixture
def measured_by_prediction(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """Replace the real multi-process pipeline measurement (``measure_pipeline_many``, as ``remat measure`` and
    ``remat compare --pp`` call it) by the prediction: the real runs are tests/parallel/test_pipeline.py's. Returns
    the list, filled as they come, of the policies each measurement is asked for."""
    calls: list[list[str]] = []

    def fake_measure(config, policies, pp, m, schedule, vpp, layout, partial, **_):
        calls.append([str(p) for p in policies])
        return [predict_pipeline(config, p, pp, m, schedule, vpp, layout, partial) for p in policies]

    monkeypatch.setattr(pipeline_measure, "measure_pipeline_many", fake_measure)
    monkeypatch.setattr(cli_pipeline, "measure_pipeline_many", fake_measure)
    return calls


@pytest.fixture
def alarm(request: pytest.FixtureRequest):
    """Each case ends within its module's CASE_SECONDS (an unbounded one raises here instead of hanging the
    suite)."""
    seconds = request.module.CASE_SECONDS

    def expired(signum, frame):
        raise TimeoutError(f"the case ran for more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)
