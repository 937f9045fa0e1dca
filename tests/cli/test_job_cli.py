"""The whole-job path of the command line: ``--megatron-args`` and the job flags on predict, compare, explain and
plan; every part of every rank; impossible parallel sizes refused naming the flag and the fix."""

from __future__ import annotations

import json

import pytest

from remat.cli import main
from remat.config import ModelConfig
from remat.job import Job
from remat.parallel.job_predict import PARTS, predict_job, predict_stage, stage_state
from remat.policy import Policy
from remat.presets import get_preset
from remat.recompute.plan_format import Plan
from remat.units import GIB

TINY = ["--layers", "2", "--hidden", "32", "--heads", "2", "--seq", "16", "--batch", "1", "--vocab", "64"]
SMALL = ["--layers", "4", "--hidden", "64", "--heads", "4", "--seq", "32", "--batch", "2", "--vocab", "128",
         "--attention", "sdpa"]
SMALL_CONFIG = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, micro_batch_size=2,
                           vocab_size=128, attention="sdpa")
MEGATRON = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
            "--vocab-size 128 --make-vocab-size-divisible-by 16 --bf16 --lr 1e-4 --attention-backend flash")
LAYOUT = ("--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2 "
          "--global-batch-size 16 --world-size 8 --use-distributed-optimizer")


def _json(capsys, argv, code=0):
    assert main([*argv, "--json"]) == code
    return json.loads(capsys.readouterr().out)


def _rows(prediction, policy):
    return [{"policy": policy, **row} for row in prediction.rows()]


def _drop_seconds(rows):
    return [{k: v for k, v in row.items() if k != "seconds"} for row in rows]


# ------------------------------------------------------------------------------------------------ plan
def test_70b_at_tp8_no_longer_fits_40gib_and_counts_every_state_part(capsys):
    # issue 11: this answered "keep nothing recomputed ... fits" counting only the bf16 parameters
    argv = ["plan", "--budget", "40GiB", "--preset", "llama3-70b", "--tp", "8", "--sp"]
    report = _json(capsys, argv, code=1)
    job = Job.build(get_preset("llama3-70b"), precision="bf16", tp=8, sp=True)
    state = stage_state(job, 0)
    assert report["fits"] is False and report["uniform"] is None
    assert report["stages"][0]["state"] == state.parts() and report["stages"][0]["state_bytes"] == state.total
    assert state.gradients == 2 * state.parameters  # the fp32 main-grad buffer
    assert state.optimizer_state == 2 * state.master_parameters == 4 * state.parameters  # fp32 Adam moments
    assert state.total > 40 * GIB
    assert "--optimizer adam (fp32 moments)" in report["assumed"]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "does not fit 40.00 GiB" in out and "fits 40" not in out
    for part in ("parameters 16.43 GiB", "gradients 32.86 GiB", "master_parameters 32.86 GiB",
                 "optimizer_state 65.72 GiB"):
        assert part in out
    assert "assumed" in out and "--reserve sets aside nothing" in out and "not counted" in out


def test_plan_of_tp_with_pp_picks_per_stage_plans_with_every_part(capsys):
    job = Job.build(SMALL_CONFIG, precision="bf16", tp=2, sp=True, pp=2, num_microbatches=4, dp=2,
                    distributed_optimizer=True)
    keep = predict_job(job)
    full = predict_job(job.replace(policy=Policy.parse("full/block/2")))
    budget = (keep.worst.peak_bytes + full.worst.peak_bytes) // 2
    assert full.worst.peak_bytes < budget < keep.worst.peak_bytes
    report = _json(capsys, ["plan", "--budget", str(budget), *SMALL, "--tp", "2", "--sp", "--pp", "2",
                            "--microbatches", "4", "--dp", "2", "--distributed-optimizer", "--precision", "bf16"])
    assert report["fits"] is True and report["format"] == "remat.plan-job"
    uniform = Policy.parse(report["uniform"]["policy"])
    assert report["uniform"]["megatron_args"] == uniform.to_megatron_args()
    expected = predict_job(job.replace(policy=uniform))
    assert report["uniform"]["rows"] == [{"rank": r.rank, "stage": r.stage, "peak_bytes": r.peak_bytes, **r.parts,
                                          "reserved": r.reserved} for r in expected.ranks]
    for row in report["stages"]:
        assert row["peak_bytes"] <= budget and sum(row[p] for p in PARTS) == row["peak_bytes"]
        assert row["state"] == stage_state(job, row["stage"]).parts()
        assert row["master_parameters"] == row["state"]["master_parameters"] > 0
        ext, meg = row["extended"], row["megatron"]
        assert ext["peak_bytes"] == row["peak_bytes"] and ext["cost"] <= meg["cost"]
        assert meg["megatron_policy"] == row["policy"] and meg["peak_bytes"] <= budget
        exact = predict_stage(job, row["stage"], layout=Plan.from_dict(ext["plan_json"]))
        assert exact.peak_bytes == row["peak_bytes"] and exact.parts == {p: row[p] for p in PARTS}


def test_plan_search_flags_shape_a_job_plan(capsys, tmp_path):
    job = Job.build(SMALL_CONFIG, precision="bf16", pp=2, num_microbatches=4)
    budget = (predict_job(job).worst.peak_bytes + predict_job(job.replace(policy=Policy.parse(
        "full/uniform/1"))).worst.peak_bytes) // 2
    # one run: the text on stdout, the JSON report in --out
    assert main(["plan", "--budget", str(budget), *SMALL, "--pp", "2", "--microbatches", "4", "--precision", "bf16",
                 "--objective", "time", "--no-offload", "--selective-modules", "core_attn,mlp",
                 "--out", str(tmp_path / "plan.json")]) == 0
    report = json.loads((tmp_path / "plan.json").read_text())
    assert report["fits"] is True and report["objective"] == "time"
    for row in report["stages"]:
        for seg in row["extended"]["plan_json"]["segments"]:
            assert seg["mode"] != "offload" and set(seg.get("modules") or ()) <= {"core_attn", "mlp"}
    out = capsys.readouterr().out
    assert "with a plan per stage" in out and "stage 1 (layers 2-3, 1 in flight)" in out
    assert "one Megatron setting for every stage" in out and "not counted" in out


def test_fp32_plan_without_job_flags_is_the_single_process_plan(capsys):
    report = _json(capsys, ["plan", "--budget", "1GiB", *TINY])
    assert report["format"] == "remat.plan-result"


# ------------------------------------------------------------------------------------------------ predict
def test_predict_megatron_args_and_the_file_give_every_rank(capsys, tmp_path):
    argv = f"{MEGATRON} {LAYOUT}"
    report = _json(capsys, ["predict", "--megatron-args", argv])
    expected = predict_job(Job.from_megatron_args(argv))
    assert report["rows"] == _rows(expected, "none") and report["ignored_flags"] == ["--lr"]
    assert [r["peak_bytes"] for r in report["rows"]] == sorted((r["peak_bytes"] for r in report["rows"]),
                                                               reverse=True)
    assert report["job"]["tp"] == 2 and report["job"]["pp"] == 2 and report["job"]["dp"] == 2
    for row in report["rows"]:
        assert sum(row[p] for p in PARTS) == row["peak_bytes"] and {"rank", "stage"} <= set(row)
    path = tmp_path / "job.args"
    path.write_text("# the same job, one flag per line\n" + argv.replace(" --", " \\\n--") + "\n")
    assert _json(capsys, ["predict", "--megatron-args", f"@{path}"])["rows"] == report["rows"]


def test_predict_flags_build_the_same_job_and_recompute_flags_set_the_policy(capsys):
    report = _json(capsys, ["predict", *SMALL, "--tp", "2", "--sp", "--pp", "2", "--microbatches", "4", "--dp", "2",
                            "--distributed-optimizer", "--precision", "bf16", "--policy", "full/uniform/1"])
    job = Job.build(SMALL_CONFIG, precision="bf16", tp=2, sp=True, pp=2, num_microbatches=4, dp=2,
                    distributed_optimizer=True)
    assert report["rows"][:2] == _rows(predict_job(job), "none")
    assert report["rows"][2:] == _rows(predict_job(job.replace(policy=Policy.parse("full/uniform/1"))),
                                       "full/uniform/1")
    recompute = _json(capsys, ["predict", "--megatron-args", f"{MEGATRON} --recompute-granularity full "
                               "--recompute-method uniform --recompute-num-layers 1"])
    assert {r["policy"] for r in recompute["rows"]} == {"full/uniform/1"}


def test_tp_with_pp_is_a_job_not_silently_dropped(capsys):
    report = _json(capsys, ["predict", *TINY, "--tp", "2", "--pp", "2"])
    assert report["format"] == "remat.predict-job" and (report["job"]["tp"], report["job"]["pp"]) == (2, 2)
    assert any("--optimizer adam" in a for a in report["assumed"])
    assert report["rows"][0]["optimizer_state"] > 0


def test_text_report_has_the_worst_rank_parts_and_what_is_not_counted(capsys):
    assert main(["predict", *SMALL, "--pp", "2", "--microbatches", "4", "--cp", "2", "--precision", "bf16"]) == 0
    out = capsys.readouterr().out
    # every stage of the cuda kernel profile keeps two torch cuBLAS workspaces (forward and backward threads,
    # remat.memory.workspaces): 64 MiB beside each rank's state, stage 0's activations make it the worst
    assert "worst rank 0 (stage 0)" in out and "workspaces 64.00 MiB" in out
    for part in ("parameters", "gradients", "master_parameters", "optimizer_state", "activations",
                 "communication", "workspaces"):
        assert part in out.split("worst rank")[1].splitlines()[0]
    assert "not counted: the CUDA context" in out and "--reserve (default 10%" in out


def test_single_process_predict_is_unchanged_without_job_flags(capsys):
    assert _json(capsys, ["predict", *TINY, "--policy", "none"])["format"] == "remat.predict"


# ------------------------------------------------------------------------------------------------ bad input
def _err(capsys, argv, *words):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("remat: error:") and err.count("\n") == 1, err
    for word in words:
        assert word in err, (word, err)


@pytest.mark.parametrize("extra, words", [
    ("--tensor-model-parallel-size 3", ["tp (--tensor-model-parallel-size)=3", "num_attention_heads=4",
                                        "use a tp from 1, 2, 4"]),
    ("--group-query-attention --num-query-groups 2 --tensor-model-parallel-size 4",
     ["does not divide num_query_groups=2", "use a tp from 1, 2"]),
    ("--context-parallel-size 3", ["cp (--context-parallel-size)=3", "--seq-length"]),
    ("--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 4 --global-batch-size 4",
     ["pp*vpp=8", "--num-layers", "use pp*vpp <= 4"]),
    ("--tensor-model-parallel-size 4 --world-size 6", ["--world-size 6", "use a multiple of 4"]),
    ("--global-batch-size 5", ["--global-batch-size 5", "use a multiple of 2"]),
    ("--fp4-format e2m1", ["--fp4-format", "remove it"]),
    ("--no-such-flag", ["--no-such-flag", "remove it"]),
])
def test_impossible_megatron_jobs_are_refused_naming_the_flag(capsys, extra, words):
    _err(capsys, ["predict", "--megatron-args", f"{MEGATRON} {extra}"], *words)
    _err(capsys, ["plan", "--budget", "80GiB", "--megatron-args", f"{MEGATRON} {extra}"], *words)


@pytest.mark.parametrize("argv, words", [
    (["predict", *TINY, "--tp", "4", "--dp", "2"], ["tp (--tensor-model-parallel-size)=4", "use a tp from 1, 2"]),
    (["predict", *TINY, "--cp", "3"], ["cp (--context-parallel-size)=3"]),
    (["predict", *TINY, "--pp", "2", "--vpp", "2", "--schedule", "interleaved", "--microbatches", "2",
      "--precision", "fp32"], ["pp*vpp=4", "use pp*vpp <= 2"]),
    (["predict", *TINY, "--pp", "3", "--optimizer", "sgd"], ["pp=3", "num_layers=2"]),
    (["plan", "--budget", "1GiB", *TINY, "--tp", "3", "--pp", "2"], ["tp (--tensor-model-parallel-size)=3"]),
    (["predict", "--megatron-args", MEGATRON, "--tp", "2"], ["--tp with --megatron-args",
                                                            "--tensor-model-parallel-size"]),
    (["predict", "--megatron-args", MEGATRON, "--preset", "llama3-8b"], ["--preset with --megatron-args"]),
    (["predict", "--megatron-args", ""], ["--megatron-args is empty"]),
    (["predict", "--megatron-args", "@/nonexistent/job.args"], ["/nonexistent/job.args", "UTF-8 text file"]),
    (["predict", *TINY, "--adam", "--pp", "2"], ["--adam with --pp", "--optimizer adam"]),
    (["predict", *TINY, "--adam", "--dp", "2"], ["--adam with a whole job", "--optimizer adam"]),
    (["predict", *TINY, "--dp", "2", "--layout", "1,1", "--pp", "2"], ["--layout"]),
    (["predict", *TINY, "--dp", "2", "--pp", "2", "--pipeline-runtime", "torch"], ["--pipeline-runtime torch"]),
    (["predict", "--megatron-args", f"{MEGATRON} --recompute-activations", "--policy", "none"],
     ["--policy/--sweep with --recompute-* flags"]),
    (["explain", *TINY, "--dp", "2", "--megatron-args", MEGATRON], ["--megatron-args --dp", "remat predict"]),
    (["plan", "--budget", "1GiB", *TINY, "--dp", "2", "--budget-reserved", "--budget-allocated"],
     ["--budget-reserved with --budget-allocated", "drop one"]),
    (["plan", "--budget", "1GiB", *TINY, "--tp", "2", "--dp", "2", "--measured-times"],
     ["measured_times (--measured-times)", "tp=2", "drop it"]),
    (["plan", "--budget", "1GiB", "--megatron-args", f"{MEGATRON} --recompute-activations"],
     ["--recompute-* flags", "remat plan chooses"]),
    (["compare", *TINY, "--dp", "2", "--cp", "2", "--precision", "fp32"], ["cp=2", "cp=1"]),
    (["compare", *TINY, "--dp", "2", "--device", "cuda"], ["--device cuda"]),
    (["compare", *TINY, "--dp", "2", "--kernels", "cuda"], ["--kernels cuda", "drop --kernels"]),
])
def test_job_flags_refused_with_the_fix(capsys, argv, words):
    _err(capsys, argv, *words)


# ------------------------------------------------------------------------------------------------ compare
def test_compare_runs_every_rank_of_a_data_parallel_job_beside_its_prediction(capsys):
    report = _json(capsys, ["compare", *TINY, "--dp", "2", "--distributed-optimizer", "--precision", "bf16"])
    job = Job.build(ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=2, seq_length=16,
                                micro_batch_size=1, vocab_size=64), precision="bf16", dp=2, distributed_optimizer=True)
    predicted = predict_job(job, kernels="cpu").worst  # its ranks run on CPU: the CPU kernels
    assert report["format"] == "remat.compare-job" and report["kernels"] == "cpu"
    assert sorted(r["rank"] for r in report["rows"]) == [0, 1]
    priced = next(r for r in report["rows"] if r["dp_rank"] == predicted.state.dp_rank)
    assert priced["predicted_bytes"] == predicted.peak_bytes and priced["predicted_parts"] == predicted.parts
    assert all(r["measured_bytes"] > 0 and r["policy"] == "none" for r in report["rows"])


def test_compare_of_a_moe_job_says_its_routing_and_predicts_the_runs_own_counts_exactly(capsys, tmp_path):
    """A MoE job routes for real: compare says the prediction assumed balanced routing and gives the --moe-routing
    counts of what the run routed; predicted with those, every rank's peak is the measured one to the byte."""
    moe = SMALL_CONFIG.replace(num_layers=2, num_moe_experts=4, moe_ffn_hidden_size=32, hidden_dropout=0.0,
                               attention_dropout=0.0)
    path = tmp_path / "moe.json"
    path.write_text(json.dumps(moe.to_dict()))
    argv = ["compare", "--config", str(path), "--precision", "fp32", "--dp", "1"]
    first = _json(capsys, argv)
    routing = first["moe_routing"]
    assert routing["predicted"] == "balanced (remat's default)" and routing["measured"].startswith("counts:")
    assert len(routing["measured"].split(";")) == 2  # both layers are MoE layers
    again = _json(capsys, [*argv, "--moe-routing", routing["measured"]])
    assert again["moe_routing"] == {"predicted": routing["measured"], "measured": routing["measured"]}
    assert all(r["predicted_bytes"] == r["measured_bytes"] for r in again["rows"])
    assert main(["predict", *TINY, "--moe-routing", "counts:1,x"]) == 2
    assert "--moe-routing 'counts:1,x': write" in capsys.readouterr().err


def test_a_moe_jobs_answer_names_its_routing_and_the_setting_that_prices_a_skew(capsys, tmp_path):
    """Megatron routes by the data: a balanced answer says so and names --moe-routing capacity:F; a given routing is
    named; a dense job, or experts padded to their capacity, say nothing of it."""
    moe = SMALL_CONFIG.replace(num_layers=2, num_moe_experts=4, moe_ffn_hidden_size=32)
    path = tmp_path / "moe.json"
    path.write_text(json.dumps(moe.to_dict()))
    argv = ["predict", "--config", str(path), "--precision", "bf16", "--dp", "1", "--device", "cuda"]
    balanced = _json(capsys, argv)["moe_routing_assumed"]
    assert "balanced assumed" in balanced and "without bound (dropless)" in balanced and \
        "--moe-routing capacity:F" in balanced
    assert main(argv) == 0 and balanced in capsys.readouterr().out.splitlines()
    given = _json(capsys, [*argv, "--moe-routing", "capacity:1.5"])
    assert given["moe_routing_assumed"] == ("MoE routing: capacity:1.5 (as given: --moe-routing, or "
                                            "moe_routing_assumption)")
    assert given["rows"][0]["peak_bytes"] > _json(capsys, argv)["rows"][0]["peak_bytes"]  # the skew it prices
    dropping = path.with_name("dropping.json")
    dropping.write_text(json.dumps(moe.replace(moe_expert_capacity_factor=1.25).to_dict()))
    capped = _json(capsys, [*argv[:2], str(dropping), *argv[3:]])["moe_routing_assumed"]
    assert "up to 1.25 times its share" in capped
    padded = path.with_name("padded.json")
    padded.write_text(json.dumps(moe.replace(moe_expert_capacity_factor=1.25,
                                             moe_pad_expert_input_to_capacity=True).to_dict()))
    assert "moe_routing_assumed" not in _json(capsys, [*argv[:2], str(padded), *argv[3:]])
    assert "moe_routing_assumed" not in _json(capsys, ["predict", *TINY, "--dp", "1"])
    assert "DeepEP" not in balanced
    # DeepEP: the tokens a rank receives depend on which tokens share a destination, which no routing sets
    deepep = path.with_name("deepep.json")
    deepep.write_text(json.dumps(moe.replace(moe_token_dispatcher_type="flex", expert_model_parallel_size=2,
                                             moe_flex_dispatcher_backend="deepep").to_dict()))
    line = _json(capsys, [*argv[:2], str(deepep), "--precision", "bf16", "--dp", "2", "--ep", "2", "--device",
                          "cuda"])["moe_routing_assumed"]
    assert line.startswith(balanced) and "DeepEP's received tokens" in line and "an upper bound" in line


def test_a_qwen2_job_with_add_qkv_bias_is_predicted(capsys):
    # issue 26: every Qwen2 launch line has --add-qkv-bias. MODEL_ARGS of Megatron-LM's own Qwen2.5-7B config
    # (examples/post_training/modelopt/conf/Qwen/Qwen2.5-7B-Instruct.sh at d98e8a64), 4 of its 28 layers, 1024 tokens
    model_args = ("--save-interval 100000 --micro-batch-size 1 --bf16 --no-masked-softmax-fusion --disable-bias-linear "
                  "--add-qkv-bias --position-embedding-type rope --no-rope-fusion --normalization RMSNorm --swiglu "
                  "--num-layers 4 --hidden-size 3584 --ffn-hidden-size 18944 --num-attention-heads 28 "
                  "--group-query-attention --num-query-groups 4 --kv-channels 128 --seq-length 1024 "
                  "--max-position-embeddings 32768 --tokenizer-type HuggingFaceTokenizer --padded-vocab-size 152064 "
                  "--make-vocab-size-divisible-by 1 --use-mcore-models --rotary-percent 1.0 --rotary-base 1000000 "
                  "--no-bias-swiglu-fusion --untie-embeddings-and-output-weights")
    qwen2 = (f"torchrun --nproc_per_node 8 pretrain_gpt.py {model_args} --global-batch-size 16 "
             "--tensor-model-parallel-size 4 --sequence-parallel --pipeline-model-parallel-size 2 "
             "--use-distributed-optimizer --lr 1e-5")
    report = _json(capsys, ["predict", "--megatron-args", qwen2])
    assert report["job"]["tp"] == 4 and report["job"]["dp"] == 1 and "--add-qkv-bias" not in report["ignored_flags"]
    job = Job.from_megatron_args(qwen2)
    assert job.model.add_qkv_bias and not job.model.add_bias_linear
    # the flag changes only the parameters (and their gradients, master copies and moments): 2 layers per stage,
    # (28 + 2 x 4) heads x 128 / tp 4 = 1152 bias values per layer on a rank
    without = predict_job(Job.from_megatron_args(qwen2.replace(" --add-qkv-bias", "")))
    for rank, other in zip(predict_job(job).ranks, without.ranks, strict=True):
        assert rank.state.num_parameters - other.state.num_parameters == 2 * 1152


def test_a_tp_comm_overlap_job_is_predicted_with_its_userbuffers(capsys):
    # issue 26: --tp-comm-overlap is accepted; TE's userbuffers are named beside the peak (outside PyTorch's
    # allocator): 12 bf16 buffers of [seq x mbs, hidden] = [64, 64] (8 KiB each, 2 MiB once rounded for cuMemCreate)
    line = (f"torchrun --nproc_per_node 4 pretrain_gpt.py {MEGATRON} --tensor-model-parallel-size 2 "
            "--sequence-parallel --tp-comm-overlap")
    assert main(["predict", "--megatron-args", line]) == 0
    out = capsys.readouterr().out
    assert "outside PyTorch's allocator" in out and "TE userbuffers (--tp-comm-overlap): 12 GEMM buffers [64, 64] " \
        "(bf16) 24.00 MiB" in out
    assert main(["predict", "--megatron-args", line.replace(" --sequence-parallel", "")]) == 2
    assert "--tp-comm-overlap needs --sequence-parallel" in capsys.readouterr().err
