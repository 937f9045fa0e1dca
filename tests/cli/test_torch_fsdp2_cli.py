"""``remat predict --megatron-args "... --use-torch-fsdp2"``: accepted and priced with FSDP2's buffers, or refused
with Megatron's assertion and the fix (remat.memory.torch_fsdp2)."""

from __future__ import annotations

import json

from remat.job import parse_megatron_args
from remat.parallel.job_predict import PARTS, predict_job

ARGS = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --micro-batch-size 2 "
        "--vocab-size 1000 --bf16 --global-batch-size 16 --untie-embeddings-and-output-weights "
        "--no-gradient-accumulation-fusion --use-torch-fsdp2 --ckpt-format torch_dist")
LAUNCH = "torchrun --nproc_per_node 4 pretrain_gpt.py "  # the world size from the launcher: dp = 4


def test_predict_accepts_torch_fsdp2(run_cli) -> None:
    code, out, err = run_cli("predict", "--megatron-args", LAUNCH + ARGS, "--json")
    assert code == 0, err
    report = json.loads(out)
    text = json.dumps(report)
    assert "--use-torch-fsdp2" not in text or "ignored" in text  # accepted, not refused
    rows = predict_job(parse_megatron_args(LAUNCH + ARGS)[0]).rows()
    (row,) = rows
    assert row["communication"] > 0 and row["peak_bytes"] == sum(row[p] for p in PARTS)  # FSDP2's flat buffers
    code, out, _ = run_cli("predict", "--megatron-args", LAUNCH + ARGS)
    assert code == 0 and "torch FSDP2 over dp x cp (bf16 sharded parameters and gradients, resharded" in out


def test_predict_refuses_torch_fsdp2_with_fusion_naming_the_fix(run_cli) -> None:
    code, out, err = run_cli("predict", "--megatron-args",
                             LAUNCH + ARGS.replace("--no-gradient-accumulation-fusion ", ""))
    assert code != 0 and "--use-torch-fsdp2" in err and "add --no-gradient-accumulation-fusion" in err
