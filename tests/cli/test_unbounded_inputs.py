"""Huge values end at once (issue 25, "Unbounded"): every size is checked against its ceiling (remat.limits) before
any work, a repetition's length before it is written out, a user's file is read up to a size cap and its YAML
aliases are bounded, and a pipeline measurement that would not fit in memory is refused before it starts.

Each command line must exit 2 with one ``remat: error: ...`` line naming the flag, within CASE_SECONDS (the
alarm below) and without growing the process's peak memory by a GiB; before these bounds, each ran for minutes or
until it had taken several GiB. The jobs of the README stay accepted.
"""

from __future__ import annotations

import resource
import time
from pathlib import Path

import numpy as np
import pytest

import remat.memory.comparison as comparison
from remat.cli import main
from remat.config import ConfigError, ModelConfig, parse_layer_freq
from remat.job import Job
from remat.job_flags import JobError, load_megatron_args
from remat.job_pipeline import parse_layout
from remat.limits import CEILINGS, MAX_INPUT_FILE_BYTES, MAX_YAML_ALIASES, ceiling_problem, shorten
from remat.memory.rank_state import ParamInfo, buffer_layout, rank_state, shard_elements, shard_elements_of
from remat.presets import get_preset, load_config

CASE_SECONDS = 30  # each case ends in well under a second; the alarm only stops one that would not end
TINY = ["--layers", "2", "--hidden", "32", "--heads", "2", "--seq", "16", "--batch", "1", "--vocab", "64"]
MB = "--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --micro-batch-size 1 --vocab-size 64"
BOMB = "bomb.yaml"  # written into the test's folder by the fixture below


def _case(argv, names):
    return pytest.param(argv, names, id=" ".join(argv)[:90])


CASES = [
    # job construction listed the divisors of the FFN size for an error text on every job (past 120 s)
    _case(["predict", "--megatron-args", "--num-layers 2 --hidden-size 4000000000 --num-attention-heads 1 "
           "--seq-length 16 --micro-batch-size 1 --vocab-size 64"], ["--hidden-size", "ceiling"]),
    _case(["predict", "--hidden", "1000000000", "--heads", "1", "--layers", "2", "--dp", "2"], ["--hidden"]),
    # repetitions written out before their length was checked (over 6 GiB in 40 s)
    _case(["predict", *TINY, "--pp", "2", "--pipeline-model-parallel-layout", "Et*4000000000|L"],
          ["--pipeline-model-parallel-layout", "4,096"]),
    _case(["predict", "--megatron-args", MB + " --pipeline-model-parallel-size 2 --pipeline-model-parallel-layout "
           "Et*4000000000|L"], ["--pipeline-model-parallel-layout"]),
    _case(["predict", "--megatron-args", MB + " --pipeline-model-parallel-size 2 --pipeline-model-parallel-layout "
           "(t*100000|)*100000L"], ["--pipeline-model-parallel-layout"]),
    _case(["predict", "--megatron-args", MB + " --num-experts 2 --moe-layer-freq ([1]*500000000)"],
          ["--moe-layer-freq"]),
    # files read whole (/dev/zero: over 6 GiB in 20 s; the alias bomb: past 120 s and 5.6 GiB)
    _case(["predict", "--config", "/dev/zero"], ["/dev/zero", "bytes"]),
    _case(["predict", "--megatron-args", "@/dev/zero"], ["/dev/zero", "bytes"]),
    _case(["predict", "--config", BOMB], [BOMB, "aliases"]),
    # work sized by a flag before it was checked
    _case(["predict", *TINY, "--dp", "1000000000", "--distributed-optimizer"], ["--dp", "ceiling"]),
    _case(["predict", "--megatron-args", MB + " --world-size 1000000000 --use-distributed-optimizer"],
          ["--world-size"]),
    _case(["predict", "--pp", "2", "--layers", "100000", "--microbatches", "100000"], ["--layers"]),
    _case(["plan", "--layers", "100000", "--budget", "1GiB"], ["--layers"]),
    _case(["plan", "--pp", "2", "--microbatches", "10000000", "--budget", "1GiB"], ["--microbatches"]),
    _case(["measure", "--pp", "2", "--microbatches", "10000000"], ["--microbatches"]),
    _case(["predict", "--seq", "100000000"], ["--seq"]),
    _case(["predict", "--hidden", "1000000000", "--heads", "1", "--layers", "1"], ["--hidden"]),
    _case(["predict", "--vocab", "10000000000"], ["--vocab"]),
    _case(["predict", "--megatron-args", MB.replace("--seq-length 16", "--seq-length 100000000")], ["--seq-length"]),
    _case(["predict", *TINY, "--pp", "2", "--microbatches", "2000000"], ["--microbatches"]),
    _case(["predict", *TINY, "--tp", "100000"], ["--tp"]),
    _case(["compare", *TINY, "--pp", "2000"], ["--pp"]),
    # within the ceilings, but more microbatches than a composed step holds: refused before the work, not after
    # it (a whole-job plan took 6 GiB in 90 s; a pipeline plan 30 s; a measurement would have run them for real)
    _case(["plan", "--preset", "llama3-8b", "--layers", "4", "--pp", "2", "--microbatches", "1048576", "--budget",
           "h100-80g"], ["--microbatches", "2048"]),
    _case(["predict", "--megatron-args", MB + " --global-batch-size 100000"], ["--global-batch-size", "2048"]),
    _case(["plan", *TINY, "--pp", "2", "--microbatches", "1048576", "--budget", "1GiB"], ["--microbatches", "2048"]),
    _case(["measure", *TINY, "--pp", "2", "--microbatches", "1048576"], ["--microbatches", "2048"]),
    _case(["compare", *TINY, "--pp", "2", "--dp", "2", "--microbatches", "4096"], ["--microbatches", "2048"]),
]


def write_alias_bomb(path: Path, levels: int, width: int) -> Path:
    """A YAML "billion laughs": ``width ** levels`` ones under num_layers, from ``levels * width`` aliases."""
    lines = ["num_layers:", "  - &a0 [" + ", ".join(["1"] * width) + "]"]
    for level in range(1, levels):
        lines.append(f"  - &a{level} [" + ", ".join([f"*a{level - 1}"] * width) + "]")
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("argv,names", CASES)
def test_a_huge_value_is_refused_at_once(alarm, capsys, tmp_path, monkeypatch, argv, names):
    monkeypatch.chdir(tmp_path)
    write_alias_bomb(tmp_path / BOMB, levels=9, width=9)  # 9**9 ones from 72 aliases
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert main(argv) == 2
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - grown  # KiB; 0 when under an earlier peak
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("remat: error: "), err
    for name in names:
        assert name in lines[0], (name, lines[0])
    assert len(lines[0]) < 600  # the value is cut in the message, never printed whole
    assert grown < 1 << 20, f"the peak memory grew by {grown} KiB"


def test_a_measurement_too_large_for_this_machine_is_refused_before_it_starts(alarm, capsys, monkeypatch):
    # the 'measure --pp 2 --layers 8 --hidden 2048 --heads 4 --seq 4096 --batch 4' predicts about 69 GiB;
    # the same check on a toy model, with this machine said to have 1 KiB free (no process is started)
    monkeypatch.setattr(comparison, "available_memory", lambda device="cpu": 1 << 10)
    started = []
    monkeypatch.setattr("remat.parallel.pipeline_measure.launch_job", lambda *a, **k: started.append(a))
    assert main(["measure", *TINY, "--pp", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("remat: error: --layers 2 --hidden 32") and "--pp 2" in err, err
    assert "predicted peaks added" in err and "available on cpu" in err, err
    assert not started


# ------------------------------------------------------------------------------------------------ the library
def test_model_sizes_are_bounded_by_their_ceilings():
    ceiling = CEILINGS["num_layers"][0]
    assert ModelConfig(num_layers=ceiling).num_layers == ceiling
    with pytest.raises(ConfigError, match=r"num_layers=1025 is above remat's ceiling of 1,024 \(the largest real"):
        ModelConfig(num_layers=ceiling + 1)
    for field, value in (("hidden_size", 4_000_000_000), ("vocab_size", 10**12), ("seq_length", 10**8),
                         ("num_moe_experts", 10**6), ("ffn_hidden_size", 10**9), ("kv_channels", 10**9)):
        with pytest.raises(ConfigError, match=f"^{field}="):
            ModelConfig(**{field: value})
    with pytest.raises(ConfigError, match="tokens per micro-batch"):  # each within its ceiling, not together
        ModelConfig(seq_length=CEILINGS["seq_length"][0], micro_batch_size=2)
    with pytest.raises(ConfigError, match="<an integer of"):  # too long even to print
        ModelConfig(num_layers=10**5000)


def test_a_moe_layer_list_is_measured_before_it_is_written_out(alarm):
    started = time.perf_counter()
    with pytest.raises(ConfigError, match=r"moe_layer_freq='\(\[1\]\*300000000\)' lists more than num_layers=8"):
        ModelConfig(moe_layer_freq="([1]*300000000)", num_moe_experts=2)
    with pytest.raises(ConfigError, match="lists more than"):
        parse_layer_freq("[1]*" + "9" * 5000, 4)  # too long a count even for int()
    assert parse_layer_freq("([0]*3+[1]*5)", 8) == (0, 0, 0, 1, 1, 1, 1, 1)
    assert time.perf_counter() - started < CASE_SECONDS


def test_megatron_sizes_are_refused_by_flag(alarm):
    with pytest.raises(JobError, match="^--hidden-size 4000000000 is above remat's ceiling"):
        Job.from_megatron_args(MB.replace("--hidden-size 32", "--hidden-size 4000000000"))
    with pytest.raises(JobError, match="^--num-experts 100000 is above"):
        Job.from_megatron_args(MB + " --num-experts 100000")
    with pytest.raises(JobError, match=r"num_microbatches \(--global-batch-size\)=100000000 is above"):
        Job.from_megatron_args(MB + " --global-batch-size 100000000")
    with pytest.raises(JobError, match=r"^dp \(--data-parallel-size/--world-size\)=1000000000 is above"):
        Job.build(ModelConfig(), dp=10**9, distributed_optimizer=True)


def test_a_layout_is_measured_before_it_is_unrolled(alarm):
    for text in ("Et*4000000000|L", "E(t|)*99999999999L", "E" + "t" * 5000 + "L", "Et*" + "9" * 5000 + "|L"):
        with pytest.raises(JobError, match="unrolls to more than 4,096 items"):
            parse_layout(text, 2)
    assert [c.items for c in parse_layout("Et*3|(tt|)*2L", 2)] == ["Ettt", "tt", "tt", "L"]


def test_the_readme_jobs_stay_within_the_ceilings():
    deepseek = Job.build(get_preset("deepseek-v3"), pp=16, num_microbatches=32, dp=64, ep=64,
                         distributed_optimizer=True, decoder_first_pipeline_num_layers=1,
                         decoder_last_pipeline_num_layers=4)
    assert deepseek.world_size == 1024
    llama = Job.build(get_preset("llama3-70b"), tp=8, sp=True, pp=4, num_microbatches=8, dp=8,
                      distributed_optimizer=True)
    assert llama.world_size == 256
    # Llama 3 405B as Meta trained it: 126 layers, h=16384, 128 heads, tp 8 x pp 16 x dp 128 = 16,384 GPUs
    llama405 = get_preset("llama3-70b").replace(num_layers=126, hidden_size=16384, num_attention_heads=128,
                                                ffn_hidden_size=53248)
    job = Job.build(llama405, tp=8, pp=16, dp=128, num_microbatches=16, decoder_first_pipeline_num_layers=7,
                    decoder_last_pipeline_num_layers=7, distributed_optimizer=True)
    assert job.world_size == 16384
    for name, (ceiling, _) in CEILINGS.items():
        assert ceiling_problem(name, ceiling) is None and ceiling_problem(name, ceiling + 1).startswith("is above")


def test_a_million_data_parallel_ranks_are_priced_at_once(alarm):
    # every data-parallel rank's distributed-optimizer shard was priced one by one (a million ranks: minutes)
    params = [ParamInfo(f"p{i}", 1000 + 37 * i, shared_embedding=i == 0) for i in range(60)]
    for dp in (1, 3, 64, 257):  # the vectorised count is the one-by-one count
        for bucket in (None, 5000):
            layout = buffer_layout(params, distributed_optimizer=True, dp_size=dp, bucket_size=bucket)
            assert list(shard_elements_of(layout, dp, np.arange(dp))) == [
                shard_elements(layout, dp, r) for r in range(dp)]
    job = Job.build(ModelConfig(), precision="bf16", dp=CEILINGS["dp"][0], distributed_optimizer=True)
    started = time.perf_counter()
    state = rank_state(job, [params])
    # two buckets (the shared embedding's own, then the rest), each padded to 2**20 elements: one element of each
    assert state.shard_elements == 2 and state.dp_rank == 0
    assert time.perf_counter() - started < CASE_SECONDS


# ------------------------------------------------------------------------------------------------ files
def test_a_config_file_is_read_up_to_the_cap(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text("# " + "x" * MAX_INPUT_FILE_BYTES + "\nnum_layers: 2\n")
    for path in (big, Path("/dev/zero")):
        with pytest.raises(ConfigError, match=f"^{path}: cannot read the config file \\(more than 1,048,576 bytes"):
            load_config(path)
    with pytest.raises(JobError, match="more than 1,048,576 bytes"):
        load_megatron_args("/dev/zero")


def test_yaml_aliases_are_bounded(tmp_path, alarm):
    with pytest.raises(ConfigError, match=f"more than {MAX_YAML_ALIASES} aliases"):
        load_config(write_alias_bomb(tmp_path / "wide.yaml", levels=9, width=9))
    with pytest.raises(ConfigError, match="more than 100,000 values with its aliases expanded"):
        load_config(write_alias_bomb(tmp_path / "deep.yaml", levels=8, width=8))  # 56 aliases, 8**8 ones
    few = tmp_path / "few.yaml"
    few.write_text("hidden_size: &h 64\nffn_hidden_size: *h\nnum_layers: 2\n")
    assert load_config(few).ffn_hidden_size == 64
    deep = tmp_path / "nested.json"
    deep.write_text('{"num_layers": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ConfigError, match="nested too deeply"):
        load_config(deep)


def test_messages_cut_long_values():
    assert len(shorten("t" * 10**6)) < 100
    assert len(shorten([[1] * 10**6] * 10**3)) < 100
    with pytest.raises(ConfigError) as caught:
        ModelConfig(num_layers=[1] * 10**6)
    assert len(str(caught.value)) < 200


def test_the_limits_examples_hold():
    import doctest

    import remat.limits

    result = doctest.testmod(remat.limits)
    assert result.attempted >= 3 and result.failed == 0
