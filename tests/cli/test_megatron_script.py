"""``remat predict --megatron-script train.sh ARGS`` (remat.megatron_script: a launch script read in a sandbox where
nothing runs) and ``--world-size`` / ``--allow-unmodelled`` (remat.job_input)."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest

from remat.cli import main
from remat.job_flags import JobError
from remat.job_input import LOWER_BOUND_TAG, read_megatron_job, stamp_report, stamp_text
from remat.megatron_script import ScriptError, read_launch_script

TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --micro-batch-size 1 "
        "--vocab-size 64 --bf16")
SCRIPTS = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "megatron_scripts"


def _script(tmp_path: Path, body: str, name: str = "train.sh") -> Path:
    path = tmp_path / name
    path.write_text("#!/bin/bash\n" + body)
    return path


# ------------------------------------------------------------------------------------------------ the sandbox
def test_reading_a_script_does_not_act_on_the_machine(tmp_path):
    victim = tmp_path / "x"
    victim.mkdir()
    (victim / "keep").write_text("data")
    outside, appended, made = tmp_path / "outside", tmp_path / "appended", tmp_path / "made"
    script = _script(tmp_path, f"""
rm -rf {victim}
/bin/rm -rf {victim}
cd /
echo pwn > {outside}
echo pwn >> {appended}
mkdir -p {made}
kill -0 $$
exec /bin/true
nvidia-smi
torchrun --nproc_per_node 2 pretrain_gpt.py {TINY}
""")
    launch = read_launch_script(script, timeout=5)
    assert (victim / "keep").read_text() == "data"  # neither rm ran
    assert not outside.exists() and not appended.exists() and not made.exists()
    assert launch.argv[:4] == ["torchrun", "--nproc_per_node", "2", "pretrain_gpt.py"]
    assert launch.command.where == "train.sh line 12"
    skipped = [c.argv[0] for c in launch.skipped]
    assert skipped == ["rm", "cd", "mkdir", "kill", "nvidia-smi"]  # /bin/rm, > and exec: refused by bash -r
    lines = launch.lines()
    assert lines[0].startswith("launch read from train.sh line 12 (nothing ran): torchrun --nproc_per_node 2")
    assert lines[1].startswith("skipped while reading train.sh (not run): rm -rf /")
    assert "... (line 3); cd / (line 5);" in lines[1] and lines[1].endswith("; nvidia-smi (line 11)")


def test_a_script_that_loops_ends_at_the_timeout_with_its_line(tmp_path):
    script = _script(tmp_path, "echo warming up\nwhile true; do\n  X=1\ndone\n")
    started = time.monotonic()
    with pytest.raises(ScriptError) as err:
        read_launch_script(script, timeout=2)
    assert time.monotonic() - started < 10  # 2 s, then SIGTERM (its trap records the line)
    message = str(err.value)
    assert "still running after the 2 s timeout at train.sh line" in message
    assert "without calling a launcher (torchrun" in message and "warming up" in message


def test_a_script_that_fails_says_its_own_error_and_line(tmp_path):
    script = _script(tmp_path, 'mkdir -p out\necho "Error: no data at $1" >&2\nexit 3\ntorchrun pretrain_gpt.py\n')
    with pytest.raises(ScriptError, match=r"ended \(exit status 3\) at train.sh line 4 without calling a launcher.*"
                                          r"Error: no data at /data.*skipped: mkdir -p out"):
        read_launch_script(script, ["/data"], timeout=5)


def test_a_script_without_a_launcher_is_refused(tmp_path):
    with pytest.raises(ScriptError, match=r"ended \(exit status 0\) .* without calling a launcher .*hello"):
        read_launch_script(_script(tmp_path, "echo hello\n"), timeout=5)


@pytest.mark.parametrize("line,expected", [
    ("torchrun --nproc_per_node 8 pretrain_gpt.py other.py --num-layers 2", "names 2 training scripts "
                                                                            "(pretrain_gpt.py, other.py)"),
    ("python -c 'import torch'", "its launch names no training script"),
    ("torchrun pretrain_mamba.py --num-layers 2", "runs pretrain_mamba.py, Megatron-LM's entry for Mamba"),
    ("torchrun pretrain_gpt.py --a\npython pretrain_gpt.py --b", "launches training 2 times (train.sh line 2"),
])
def test_a_launch_with_two_training_scripts_or_none_is_refused_naming_it(tmp_path, line, expected):
    with pytest.raises(ScriptError, match="train.sh") as err:
        read_launch_script(_script(tmp_path, line + "\n"), timeout=5)
    assert expected in str(err.value)


def test_files_the_script_sources_are_read_from_copies(tmp_path):
    (tmp_path / "common.sh").write_text("NNODES=2\n")
    config = tmp_path / "conf" / "dist.env"
    config.parent.mkdir()
    config.write_text("GPUS=4\n")
    script = _script(tmp_path, """
source "$(dirname "$0")/common.sh"
[ -f "$1" ] || { echo "no config $1"; exit 1; }
source "$1"
source /etc/profile
torchrun --nproc_per_node $GPUS --nnodes $NNODES pretrain_gpt.py --num-layers 2
""")
    launch = read_launch_script(script, [str(config)], timeout=5)
    assert launch.argv[:5] == ["torchrun", "--nproc_per_node", "4", "--nnodes", "2"]
    assert [c.text() for c in launch.skipped] == ["source /etc/profile"]  # not in the sandbox: not read


def test_the_script_environment_of_the_launch_is_kept(tmp_path):
    script = _script(tmp_path, "export CUDA_DEVICE_MAX_CONNECTIONS=1\n"
                               "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True torchrun pretrain_gpt.py --x 1\n")
    launch = read_launch_script(script, timeout=5)
    assert launch.env == {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def test_command_reaches_the_path_shims_which_record_the_same(tmp_path):
    script = _script(tmp_path, 'D=$(command dirname "/a/b/c.sh")\nexport X=1\n'
                               'command python3 pretrain_gpt.py --num-layers 2 --data "$D"\n')
    launch = read_launch_script(script, timeout=5)  # `command` skips functions: the PATH shims answer
    assert launch.argv == ["python3", "pretrain_gpt.py", "--num-layers", "2", "--data", "/a/b"]
    assert launch.command.where == "train.sh line 4" and launch.env == {"X": "1"}


def test_sbatch_reads_the_job_script_it_submits_in_the_same_sandbox(tmp_path):
    # a heredoc job script (as examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh): its srun runs bash -c CMD
    victim = tmp_path / "x"
    victim.mkdir()
    (victim / "keep").write_text("data")
    outside = tmp_path / "outside"
    script = _script(tmp_path, f"""
CMD="cd /megatron; export PYTHONPATH=/megatron; python pretrain_gpt.py --num-layers $1"
sbatch <<EOF
#!/bin/bash
#SBATCH --nodes=2
rm -rf {victim}
/bin/rm -rf {victim}
echo pwn > {outside}
srun -N 2 --ntasks-per-node 4 bash -x -c "${{CMD}}" 2>&1 | tee log
EOF
echo submitted
""")
    launch = read_launch_script(script, ["3"], timeout=5)
    assert (victim / "keep").read_text() == "data" and not outside.exists()  # nothing but the shims ran
    assert launch.argv == ["srun", "-N", "2", "--ntasks-per-node", "4", "python", "pretrain_gpt.py", "--num-layers",
                           "3"]  # the launcher's words, then the launch its command string makes
    assert launch.command.where == "train.sh line 4" and launch.env == {"PYTHONPATH": "/megatron"}
    assert [c.argv[0] for c in launch.skipped] == ["cd", "rm", "tee"]  # one line's: by their words
    assert launch.lines()[-1] == ("sbatch at train.sh line 4: nothing submitted; the job script on its input was "
                                  "read in place")
    job = read_megatron_job(launch.argv + TINY.split()[2:])
    assert job.job.world_size == 8 and job.world_size_source == "launcher"  # srun -N 2 --ntasks-per-node 4


@pytest.mark.parametrize("submit,where", [
    ("sbatch --partition batch --wrap 'torchrun --nproc_per_node 2 pretrain_gpt.py --num-layers 2'", "train.sh line 2"),
    ("sbatch --wrap='torchrun --nproc_per_node 2 pretrain_gpt.py --num-layers 2'", "train.sh line 2"),
    ('sbatch -p batch "$(dirname "$0")/job.sbatch" 2', "job.sbatch line 3"),
])
def test_sbatch_reads_a_wrapped_command_or_a_job_script_file(tmp_path, submit, where):
    (tmp_path / "job.sbatch").write_text("#!/bin/bash\n#SBATCH -N 1\ntorchrun --nproc_per_node $1 pretrain_gpt.py "
                                         "--num-layers 2\n")
    launch = read_launch_script(_script(tmp_path, submit + "\nexit 0\n"), timeout=5)
    assert launch.argv == ["torchrun", "--nproc_per_node", "2", "pretrain_gpt.py", "--num-layers", "2"]
    assert launch.command.where == where
    assert "nothing submitted" in launch.lines()[-1]


def test_sbatch_without_a_job_script_it_can_read_launches_nothing(tmp_path):
    with pytest.raises(ScriptError, match=r"without calling a launcher .*no job script in the sandbox.*"
                                          r"skipped: sbatch /elsewhere/job.sh"):
        read_launch_script(_script(tmp_path, "sbatch /elsewhere/job.sh\n"), timeout=5)


def test_a_missing_script_is_refused(tmp_path):
    with pytest.raises(ScriptError, match="cannot read the launch script"):
        read_launch_script(tmp_path / "nope.sh")


# ------------------------------------------------------------------------------------------------ the world size
def test_the_world_size_comes_from_the_script_and_world_size_overrides_it(tmp_path, capsys):
    script = _script(tmp_path, f"NODES=$2\ntorchrun --nproc_per_node 4 --nnodes $NODES pretrain_gpt.py {TINY}\n")
    assert main(["predict", "--json", "--megatron-script", str(script), "--nodes", "2"]) == 0  # its arguments
    report = json.loads(capsys.readouterr().out)
    assert report["job"]["world_size"] == 8 and report["job"]["dp"] == 8
    assert report["input"]["world_size_source"] == "launcher"
    assert report["input"]["script"]["launch_from"] == "train.sh line 3"
    assert main(["predict", "--world-size", "16", "--megatron-script", str(script), "--json", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "world size 16 (--world-size; the launch line gives 8)"
    assert out[1].startswith("launch read from train.sh line 3 (nothing ran): torchrun --nproc_per_node 4 --nnodes 2")
    assert "(16 ranks)" in out[2]


def test_an_unknown_world_size_is_assumed_in_the_first_line(capsys):
    assert main(["predict", "--megatron-args", f"python pretrain_gpt.py {TINY} --tensor-model-parallel-size 2"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == ("world size 2 assumed (tp x pp x cp: one data-parallel rank): the launch line does not give it; "
                     "give it with --world-size N")


# ------------------------------------------------------------------------------------------------ lower bounds
def test_allow_unmodelled_stamps_every_line_and_row(tmp_path, capsys):
    # layers remat's reference GPT does not have, which save no memory: priced without them, a lower bound
    script = _script(tmp_path, f'torchrun --nproc_per_node 2 pretrain_gpt.py {TINY} --qk-l2-norm --squared-relu\n')
    assert main(["predict", "--megatron-script", str(script)]) == 2
    err = capsys.readouterr().err
    assert "2 flags stop the prediction" in err and "--allow-unmodelled --qk-l2-norm,--squared-relu" in err
    argv = ["predict", "--allow-unmodelled", "qk-l2-*,squared-*", "--megatron-script", str(script)]
    assert main(argv) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert all(line.startswith(LOWER_BOUND_TAG) for line in lines)
    assert "LOWER BOUND: priced without --qk-l2-norm, --squared-relu" in "\n".join(lines[:3])
    assert main(["predict", "--json", *argv[1:]]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["lower_bound"]["unmodelled_flags"] == ["--qk-l2-norm", "--squared-relu"]
    assert report["input"]["unmodelled_flags"] == ["--qk-l2-norm", "--squared-relu"]
    assert report["rows"] and all(row["lower_bound"] is True for row in report["rows"])


def test_a_lower_bound_never_says_plainly_that_it_fits():
    text = stamp_text("fits 80.00 GiB with a plan per stage\n  does not fit 1 GiB: x\n\nrow", ["--fp8-format"])
    assert text.splitlines() == [
        "[lower bound] the lower bound fits (the job may not: what the unmodelled flags add is not counted) 80.00 GiB "
        "with a plan per stage", "[lower bound]   does not fit (even its lower bound) 1 GiB: x", "",
        "[lower bound] row"]
    report = stamp_report({"fits": True, "stages": [{"fits": False, "peak": 1}], "job": {"dp": 2}}, ["--fp8-format"])
    assert "fits" not in report and report["fits_lower_bound"] is True
    assert report["stages"] == [{"fits_lower_bound": False, "peak": 1, "lower_bound": True}]
    assert report["lower_bound"]["unmodelled_flags"] == ["--fp8-format"]
    assert stamp_text("fits", []) == "fits" and stamp_report({"fits": True}, []) == {"fits": True}


@pytest.mark.parametrize("extra,allow,message", [
    ("--fp4-format e2m1", "--fp4-recipe", "--allow-unmodelled --fp4-recipe: the job has no such flag (the flags it "
                                          "holds that remat cannot model: --fp4-format)"),
    ("--fp4-format e2m1 --lr 1", "--lr", "remat does not refuse --lr for being unmodelled (it is ignored)"),
    ("--cpu-offloading", "--cpu-offloading", "could overstate its memory, not bound it from below"),
    ("--position-embedding-type relative", "--position-embedding-type", "could overstate its memory"),
    ("--fp4-format e2m1", "--fp4-format", "quantised saved activations can be smaller"),  # either way: no bound
])
def test_allow_unmodelled_names_what_cannot_be_left_out(extra, allow, message):
    with pytest.raises(JobError) as err:
        read_megatron_job(f"{TINY} {extra}", allow_unmodelled=[allow])
    assert message in str(err.value)


def test_allow_unmodelled_leaves_out_unmodelled_values_and_rope_position_flags():
    read = read_megatron_job(f"{TINY} --position-embedding-type rope --no-position-embedding "
                             "--qk-l2-norm --num-experts 2", allow_unmodelled=["--qk-l2-norm"])
    assert read.unmodelled == ("--qk-l2-norm",)
    assert read.job.model.num_moe_experts == 2
    assert "--no-position-embedding" in read.ignored  # beside rope Megatron builds the same model (remat.job_model)


def test_every_refusal_comes_with_megatrons_own_refusal_of_the_rest():
    with pytest.raises(JobError) as err:
        read_megatron_job(f"{TINY.replace('--num-layers 2', '--num-layers 3')} --pipeline-model-parallel-size 2 "
                          "--qk-l2-norm --squared-relu")
    message = str(err.value)
    assert message.startswith("2 flags stop the prediction: (1) --qk-l2-norm")
    assert "or price the job without them as a lower bound: --allow-unmodelled --qk-l2-norm,--squared-relu" \
        in message
    assert "and without them, the job is still refused: num_layers=3 (--num-layers) is not divisible by pp=2" in message


# ------------------------------------------------------------------------------------------------ the corpus
def test_the_vendored_example_scripts_are_read_as_written():
    sources = json.loads((SCRIPTS / "SOURCES.json").read_text())
    assert sources["commit"] == "d98e8a64ddf34856e74b24714e3bedb2f5a39553"
    for name, entry in sources["files"].items():
        assert hashlib.sha256((SCRIPTS / name).read_bytes()).hexdigest() == entry["sha256"], name
    llama = read_launch_script(SCRIPTS / "examples/llama/train_llama3_8b_h100_fp8.sh", timeout=5)
    assert llama.command.where == "train_llama3_8b_h100_fp8.sh line 187"
    fp8 = read_megatron_job(llama.argv).job  # delayed scaling, FP8 parameters (remat.memory.fp8)
    assert (fp8.model.fp8_recipe, fp8.fp8_param_gather, fp8.fp8_amax_history_len) == ("delayed", True, 1024)
    gptoss = SCRIPTS / "examples/gptoss"
    with pytest.raises(ScriptError, match="Checkpoint path does not exist"):
        read_launch_script(gptoss / "02_train.sh", timeout=5)
    args = ["--checkpoint-path", str(gptoss), "--distributed-config-file"]
    for config, pp in (("distributed_config.env", "8"), ("distributed_config_4gpu.env", "4")):
        launch = read_launch_script(gptoss / "02_train.sh", [*args, str(gptoss / config)], timeout=5)
        assert launch.argv[launch.argv.index("--pipeline-model-parallel-size") + 1] == pp
    with pytest.raises(JobError, match="num_layers=12 .* pp=8"):
        read_megatron_job(read_launch_script(gptoss / "02_train.sh", [*args, str(gptoss / "distributed_config.env")],
                                             timeout=5).argv)


def _without_fp8(argv: list[str]) -> list[str]:
    """``argv`` less its --fp8-* flags and their values (FP8 is modelled elsewhere: this reads the rest)."""
    out: list[str] = []
    skipping = False
    for token in argv:
        skipping = token.startswith("--fp8-") or (skipping and not token.startswith("--"))
        out += [] if skipping else [token]
    return out


def test_the_gpt3_mixtral_and_gpt_oss_example_scripts_are_read():
    gpt3 = read_launch_script(SCRIPTS / "examples/gpt3/train_gpt3_175b_distributed.sh",
                              ["ckpt", "tb", "vocab.json", "merges.txt", "data"], timeout=5)
    # as written, ${TRAINING_ARGS[@]} unquoted splits the schedule: Megatron's argparse refuses the rest of it
    with pytest.raises(JobError, match="unrecognized arguments: 2.4B:320"):
        read_megatron_job(gpt3.argv, world_size=1024)
    at = gpt3.argv.index("--step-batch-size-schedule")
    quoted = [*gpt3.argv[:at + 1], " ".join(gpt3.argv[at + 1:at + 7]), *gpt3.argv[at + 7:]]
    with pytest.raises(JobError, match="Cannot specify both --step-batch-size-schedule and --global-batch-size"):
        read_megatron_job(quoted, world_size=1024)  # training/arguments.py:698
    at = quoted.index("--global-batch-size")
    read = read_megatron_job(quoted[:at] + quoted[at + 2:], world_size=1024)
    assert (read.job.dp, read.job.num_microbatches) == (8, 1536 // 8)  # the schedule's final batch, 12B:1536
    mixtral = read_launch_script(SCRIPTS / "examples/mixtral/train_mixtral_8x7b_distributed.sh",
                                 ["ckpt", "tokenizer.model", "data"], timeout=5)
    read = read_megatron_job(mixtral.argv, world_size=32)
    assert read.job.model.position == "rope" and "--no-position-embedding" in read.ignored and not read.unmodelled
    gptoss = SCRIPTS / "examples/gptoss"
    args = ["--checkpoint-path", str(gptoss), "--distributed-config-file"]
    launch = read_launch_script(gptoss / "02_train.sh", [*args, str(gptoss / "distributed_config_4gpu.env")],
                                timeout=5)
    read = read_megatron_job(_without_fp8(launch.argv))
    m = read.job.model
    assert (read.job.pp, m.activation, m.glu_linear_offset, m.activation_func_clamp_value) == (4, "quick_geglu", 1.0,
                                                                                               7.0)
    assert (m.softmax_type, m.window_size, m.window_attn_skip_freq, m.bias_activation_fusion) == (
        "learnable", (127, 0), 2, False)
    assert {"--export-force-local-attention", "--enable-gpt-oss"} <= set(read.ignored)
    launch = read_launch_script(gptoss / "02_train.sh", [*args, str(gptoss / "distributed_config.env")], timeout=5)
    with pytest.raises(JobError, match=r"num_layers=12 \(--num-layers\) is not divisible by pp=8.*use pp from 1, 2, "
                                       r"3, 4, 6, 12, or an uneven split"):
        read_megatron_job(_without_fp8(launch.argv))


DEEPSEEK = SCRIPTS / "examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh"


def test_the_deepseek_v3_script_reads_as_the_flex_dispatcher_with_hybridep():
    from remat.memory.flex_buffers import flex_kept_bytes, flex_outside_buffers

    read = read_megatron_job(read_launch_script(DEEPSEEK, timeout=5).argv, world_size=256)
    m = read.job.model
    assert (m.moe_token_dispatcher_type, m.moe_flex_dispatcher_backend, read.job.ep) == ("flex", "hybridep", 8)
    # HybridEP's buffers for T = 4 x 4096 tokens, G = 8 ranks, L = 32 local experts, h = 7168 (M = 131,072 tokens)
    buffers = flex_outside_buffers(read.job, 0)
    assert [b.nbytes for b in buffers[:4]] == [131072 * 7168 * 2, 131072 * 256 * 4, 131072 * 56 * 4, 256 * 16384 * 8]
    # 58 MoE layers and the MTP depth keep routing map + fp32 probabilities [T, 256] and fp32 probabilities [T x 8]
    handle = 16384 * 8 * 4 + 16384 + 131072 * 32 + 4 + 256 * 8 * 4 + 131072 * 32 * 4 + 32 * 4  # one micro-batch's
    assert flex_kept_bytes(read.job, 0) == 59 * (16384 * 256 * 5 + 16384 * 8 * 4 + handle)


def test_the_deepseek_v3_script_is_predicted_as_written(capsys):
    assert main(["predict", "--world-size", "256", "--megatron-script", str(DEEPSEEK)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "world size 256 (--world-size)"
    assert "outside PyTorch's allocator: rank" in out and "HybridEP expert token buffer (dispatch and combine) " \
        "1.75 GiB (DeepEP hybrid-ep@94a9f8f6 csrc/hybrid_ep/buffer/intranode.cu:126-129, 204-208, 255-260)" in out
