"""Issue 26's acceptance corpus: Megatron-LM's own example launch scripts through ``remat predict --megatron-script``.

The scripts are vendored as data in ``benchmarks/data/megatron_scripts/`` (``SOURCES.json``: each file's path in
Megatron-LM, the commit and its sha256); nothing is fetched. Each is read as written (in remat's sandbox: nothing it
calls runs), with a world size on remat's command line, and the first lines of remat's answer are printed, or its
refusal. A refused job is priced again with the ``--allow-unmodelled`` list the refusal proposes (the answer is then
a lower bound, stamped on every line), so both are shown, e.g. for FP8. Then the acceptance count over the 61 dev
cases of ``data/megatron_golden_h100_dev.json`` (their flags as ``bench_megatron_golden.py`` passes them): how many
remat reads without refusing (each refusal listed).

* ``examples/gpt3/train_gpt3_175b_distributed.sh`` is refused as Megatron refuses it (its unquoted
  ``${TRAINING_ARGS[@]}`` splits the ``--step-batch-size-schedule`` string, and it gives ``--global-batch-size``
  too: training/arguments.py:698); it is priced again with Megatron's two fixes (the array quoted,
  ``--global-batch-size`` dropped), at the schedule's final batch;
* ``examples/gptoss/02_train.sh`` sets pp to the world size: at its default 8 GPUs Megatron itself refuses 12 layers
  over pp = 8, and remat refuses it the same way; with ``--distributed-config-file`` giving 4 GPUs per node (the
  README's ``distributed_config.env`` with ``GPUS_PER_NODE=4``) it is predicted;
* ``examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh`` submits its job with ``sbatch`` (a heredoc running ``srun
  ... bash -c "$TRAINING_CMD"``): remat reads the job script sbatch would submit, and the command string srun's
  shell would run, in place (remat.megatron_script), so its launch is ``srun ... python pretrain_gpt.py ...``; the
  same script with the submission replaced by ``eval "$TRAINING_CMD"`` (its own training command) is read too, for
  comparison.

    python benchmarks/bench_megatron_scripts.py              # every script, then the dev cases
    python benchmarks/bench_megatron_scripts.py --only llama # scripts whose name contains it
    python benchmarks/bench_megatron_scripts.py --lines 12   # more of each answer
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import sys
import tempfile
import time
import warnings
from pathlib import Path

from remat.cli import main as remat
from remat.job_input import read_megatron_job

HERE = Path(__file__).resolve().parent
SCRIPTS = HERE / "data" / "megatron_scripts" / "examples"
GOLDEN = HERE / "data" / "megatron_golden_h100_dev.json"
SUBMISSION = "# SLURM settings"  # sbatch_mfsdp_deepseek_v3.sh: the submission starts at this line


def deepseek_training_script(folder: Path) -> Path:
    """sbatch_mfsdp_deepseek_v3.sh up to its submission, then ``eval "$TRAINING_CMD"`` (its own training command)."""
    text = (SCRIPTS / "megatron_fsdp" / "sbatch_mfsdp_deepseek_v3.sh").read_text()
    head = text[:text.index(SUBMISSION)]
    path = folder / "sbatch_mfsdp_deepseek_v3_training_cmd.sh"
    path.write_text(head + '# remat bench: the training command the script submits, run in place of "sbatch"\n'
                    'eval "${TRAINING_CMD}"\n')
    return path


def deepseek_deepep_script(folder: Path) -> Path:
    """The DeepSeek-V3 training command with the flex dispatcher's DeepEP backend (Megatron's default) in place of
    the script's HybridEP."""
    text = deepseek_training_script(folder).read_text()
    assert text.count("--moe-flex-dispatcher-backend hybridep") == 1
    path = folder / "sbatch_mfsdp_deepseek_v3_training_cmd_deepep.sh"
    path.write_text(text.replace("--moe-flex-dispatcher-backend hybridep", "--moe-flex-dispatcher-backend deepep"))
    return path


def gpt3_fixed_script(folder: Path) -> Path:
    """train_gpt3_175b_distributed.sh with Megatron's two fixes: ``"${TRAINING_ARGS[@]}"`` quoted (the schedule one
    word) and no ``--global-batch-size`` (the schedule sets the batch)."""
    text = (SCRIPTS / "gpt3" / "train_gpt3_175b_distributed.sh").read_text()
    fixed = text.replace("    --global-batch-size 1536\n", "").replace("    ${TRAINING_ARGS[@]} \\",
                                                                          '    "${TRAINING_ARGS[@]}" \\')
    assert fixed.count("--global-batch-size") == 0 and '"${TRAINING_ARGS[@]}"' in fixed
    path = folder / "train_gpt3_175b_distributed_fixed.sh"
    path.write_text(fixed)
    return path


def cases(folder: Path) -> list[tuple[str, list[str], list[str]]]:
    """(name, remat's flags, the script and its arguments) of each run."""
    gptoss = SCRIPTS / "gptoss"
    gptoss_args = [str(gptoss / "02_train.sh"), "--checkpoint-path", str(gptoss), "--distributed-config-file"]
    return [
        ("gpt3 175B", ["--world-size", "1024"],
         [str(SCRIPTS / "gpt3" / "train_gpt3_175b_distributed.sh"), "ckpt", "tb", "vocab.json", "merges.txt", "data"]),
        ("gpt3 175B, schedule quoted, no --global-batch-size", ["--world-size", "1024"],
         [str(gpt3_fixed_script(folder)), "ckpt", "tb", "vocab.json", "merges.txt", "data"]),
        ("llama3 8B fp8", ["--world-size", "8"], [str(SCRIPTS / "llama" / "train_llama3_8b_h100_fp8.sh")]),
        ("mixtral 8x7B", ["--world-size", "32"],
         [str(SCRIPTS / "mixtral" / "train_mixtral_8x7b_distributed.sh"), "ckpt", "tokenizer.model", "data"]),
        ("gpt-oss 02_train.sh, 8 GPUs", ["--world-size", "8"], [*gptoss_args, str(gptoss / "distributed_config.env")]),
        ("gpt-oss 02_train.sh, 4 GPUs", ["--world-size", "4"],
         [*gptoss_args, str(gptoss / "distributed_config_4gpu.env")]),
        ("deepseek-v3 megatron-fsdp, as written (sbatch)", ["--world-size", "256"],
         [str(SCRIPTS / "megatron_fsdp" / "sbatch_mfsdp_deepseek_v3.sh")]),
        ("deepseek-v3 megatron-fsdp, its training command", ["--world-size", "256"],
         [str(deepseek_training_script(folder))]),
        ("deepseek-v3 megatron-fsdp, its training command with DeepEP", ["--world-size", "256"],
         [str(deepseek_deepep_script(folder))]),
    ]


def run(argv: list[str]) -> tuple[int, str, str, float]:
    out, err = io.StringIO(), io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = remat(argv)
    return code, out.getvalue(), err.getvalue(), time.perf_counter() - start


def show(argv: list[str], lines: int, width: int) -> str | None:
    """Runs ``remat predict`` and prints the first lines of its answer or its refusal; returns the
    ``--allow-unmodelled`` list a refusal proposes (None otherwise)."""
    code, out, err, seconds = run(["predict", *argv])
    shown = " ".join(a if " " not in a else repr(a) for a in argv).replace(str(HERE.parent) + "/", "")
    print(f"$ remat predict {shown}   [{seconds:.1f} s, exit {code}]")
    if code:
        message = err.strip().removeprefix("remat: error: ")
        print(f"  refused: {message}")
        proposed = re.search(r"--allow-unmodelled ([^\s;]+)", message)
        return proposed.group(1) if proposed and "--allow-unmodelled" not in argv else None
    for line in [line for line in out.splitlines() if line.strip()][:lines]:
        print("  " + (line if len(line) <= width else line[:width - 3] + "..."))
    return None


def golden_acceptance() -> None:
    sys.path.insert(0, str(HERE))
    from bench_megatron_golden import megatron_argv  # the dev cases' flags, as that benchmark passes them

    golden = json.loads(GOLDEN.read_text())["cases"]
    refused, bounded = [], 0
    for case in golden:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                read_megatron_job(megatron_argv(case))
        except ValueError as err:
            why = str(err).splitlines()[0]
            refused.append((case["case"], why))
            proposed = re.search(r"--allow-unmodelled ([^\s;]+)", why)
            try:  # the same, priced without the flags the refusal proposes to leave out (a lower bound)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    read_megatron_job(megatron_argv(case), allow_unmodelled=proposed.group(1).split(","))
                bounded += 1
            except (ValueError, AttributeError):
                pass
    accepted = len(golden) - len(refused)
    print(f"\ndev cases of {GOLDEN.name} accepted (read without a refusal): {accepted}/{len(golden)} "
          f"({accepted / len(golden):.0%}; target >= 95%); with the --allow-unmodelled list each refusal proposes "
          f"(lower bounds): {accepted + bounded}/{len(golden)}")
    for name, why in refused:
        print(f"  refused {name}: {why[:240]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="scripts whose name contains this")
    parser.add_argument("--lines", type=int, default=10, help="lines of each answer to print (default 10)")
    parser.add_argument("--width", type=int, default=240, help="characters of each line (default 240)")
    parser.add_argument("--no-golden", action="store_true", help="skip the dev cases' acceptance count")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags, script in cases(Path(tmp)):
            if args.only not in name:
                continue
            print(f"\n=== {name}")
            allow = show([*flags, "--megatron-script", *script], args.lines, args.width)
            if allow:
                show([*flags, f"--allow-unmodelled={allow}", "--megatron-script", *script], args.lines, args.width)
    if not args.no_golden:
        golden_acceptance()


if __name__ == "__main__":
    main()
