import gc

import pytest
import torch

from remat.recompute.engines import add_observer, remove_observer

# The test models are tiny: one thread is as fast as two and keeps timings steady on a shared 2-core machine.
torch.set_num_threads(1)


class Recorder:
    """A checkpoint observer: which regions saved inputs, which were recomputed (in backward)."""

    def __init__(self) -> None:
        self.checkpointed: list[object] = []
        self.recomputed: list[object] = []

    def on_checkpoint_inputs(self, region, tensors) -> None:
        self.checkpointed.append(region)

    def on_recompute(self, region, begin) -> None:
        if begin:
            self.recomputed.append(region)


# The slow checks: real multi-process runs on gloo (a launch per test, every rank a fresh Python that imports torch),
# headless Chromium, torch.compile, and whole-job answers recomputed against their saved copies. Each takes seconds
# (together about half the suite's CPU time), so plain `pytest` deselects them (pyproject.toml: -m "not slow") and
# `pytest -m slow` runs them; CI runs both. A node id here names a test file, or a test with all its parameters.
SLOW = (
    "tests/cli/test_saved_answers.py",
    "tests/cli/test_profile_cli.py",  # a whole job's command profiled twice (benchmarks/profile_cli.py)
    "tests/cli/test_megatron_script.py::test_the_deepseek_v3_script_is_predicted_as_written",
    "tests/memory/test_torch_fsdp2.py::test_chunks_and_buffers_are_torch_fsdp2s_own",
    "tests/parallel/test_job_measure.py::test_pp2_dp2_distributed_optimizer_measured_equals_predicted",
    "tests/parallel/test_job_measure.py::test_tp2_pp2_measured_equals_predicted_per_rank",
    "tests/parallel/test_job_measure.py::test_checkpointed_layers_measured_equal_predicted_with_the_mask_kept_to_the_",
    "tests/models/test_cross_entropy.py::test_a_job_measures_as_predicted",
    "tests/parallel/test_uneven_pipeline.py::test_an_uneven_layout_measured_equals_predicted_per_stage",
    "tests/parallel/test_offload_pipeline.py::test_pp2_offload_measured_equals_predicted_per_rank_device_and_host",
    "tests/parallel/test_pipeline.py::test_real_",
    "tests/parallel/test_pipeline.py::test_hung_rank_stops_the_run_within_the_timeout",
    "tests/parallel/test_pipeline.py::test_failing_rank_stops_the_run_with_its_message",
    "tests/parallel/test_launch.py::test_a_killed_worker_is_reported_by_rank_and_signal",
    "tests/parallel/test_launch.py::test_an_ended_launcher_leaves_no_folder_and_no_worker",
    "tests/parallel/test_tensor_parallel.py::test_real_two_rank_runs_match_prediction",
    "tests/parallel/test_expert_tp_layouts.py::test_tp2_sp_ep2_etp1_measured_equals_predicted_per_rank",
    "tests/parallel/test_expert_parallel.py::test_ep2_",
    "tests/megatron/test_megatron_multiprocess.py::test_tensor_parallel_two_processes_per_rank",
    "tests/plan/test_plan.py::test_tensor_parallel_plans_fit_on_real_ranks",
    "tests/cli/test_job_cli.py::test_compare_",
    "tests/cli/test_output_faults.py::test_sigterm_while_explain_writes_its_folder_keeps_the_previous_one",
    "tests/cli/test_output_faults.py::test_sigkill_while_measure_writes_its_folder_keeps_the_previous_one",
    "tests/analysis/test_html.py::test_chromium_renders_the_page",
    "tests/analysis/test_job_html.py::test_chromium_renders_the_job_page",
    "tests/plan/test_compiled_plan.py",
    "tests/recompute/test_compiled_regions.py",
    # the slowest single checks of the default run (5-9 s each on 2 busy cores): forked tracing, a real Megatron rank
    "tests/plan/test_moe_units.py::test_moe_units_traced_side_by_side_are_those_traced_here",
    "tests/plan/test_moe_units.py::test_every_core_attn_set_on_an_mla_moe_layer_is_priced_as_measured",
    "tests/plan/test_job_plan.py::test_tracing_ahead_while_the_unit_model_is_built_changes_no_answer",
    "tests/plan/test_plan_reserved.py::test_plan_reserved_fits_reserved_memory_where_plain_planning_would_not",
    "tests/recompute/test_layer_offload.py::test_a_real_megatron_rank_measures_what_is_predicted",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.startswith(SLOW):
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def recorder():
    rec = Recorder()
    add_observer(rec)
    yield rec
    remove_observer(rec)


@pytest.fixture(scope="module", autouse=True)
def _frozen_gc():
    """Move every object alive when a test module starts (torch, megatron-core, pytest, earlier modules' caches)
    out of the cycle collector's way: otherwise each full collection, automatic or a measurement's gc.collect(),
    rescans millions of them (a third of the CPU time of the measuring modules). Objects the module's tests make
    are collected as usual."""
    gc.freeze()
    yield
