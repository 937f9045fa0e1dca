"""remat.job: a whole Megatron training job, its validation, and Megatron-LM's command line."""

from __future__ import annotations

import warnings
from fractions import Fraction

import pytest

from remat.config import ModelConfig
from remat.job import Job, JobError, parse_megatron_args
from remat.job_flags import (
    IGNORED_FLAGS,
    REFUSED_FLAGS,
    classify_megatron_flag,
    load_megatron_args,
    shown_flag,
    suggest_flag,
)
from remat.job_model import DEFAULT_VOCAB_SIZE
from remat.policy import Policy

BASE = ("--num-layers 8 --hidden-size 256 --num-attention-heads 8 --seq-length 512 --micro-batch-size 2 "
        "--vocab-size 1000")


def parse(extra: str = "", base: str = BASE) -> Job:
    return parse_megatron_args(f"{base} {extra}")[0]


def refused(extra: str, *fragments: str, base: str = BASE) -> str:
    with pytest.raises(JobError) as info:
        parse(extra, base)
    msg = str(info.value)
    for fragment in fragments:
        assert fragment in msg, f"{fragment!r} not in {msg!r}"
    return msg


def model(**kw) -> ModelConfig:
    fields = dict(num_layers=8, hidden_size=256, num_attention_heads=8, seq_length=512, micro_batch_size=2,
                  vocab_size=1024)
    return ModelConfig(**{**fields, **kw})


# --------------------------------------------------------------------------- model flags
def test_megatron_defaults():
    job, ignored = parse_megatron_args(BASE)
    assert ignored == []
    assert job.model == ModelConfig(num_layers=8, hidden_size=256, num_attention_heads=8, seq_length=512,
                                    micro_batch_size=2, vocab_size=1024, activation="gelu", normalization="layernorm",
                                    position="learned", attention="sdpa", hidden_dropout=0.1, attention_dropout=0.1,
                                    dtype="fp32", tie_embeddings=True, add_bias_linear=True,
                                    cross_entropy="megatron")  # Megatron's loss at every tp (remat.job_loss)
    assert (job.tp, job.sp, job.pp, job.vpp, job.cp, job.dp, job.ep, job.etp) == (1, False, 1, None, 1, 1, 1, None)
    assert (job.num_microbatches, job.schedule, job.precision, job.accumulate_grads_in_fp32) == (1, "1f1b", "fp32",
                                                                                                 True)
    assert (job.optimizer, job.sgd_momentum, job.distributed_optimizer) == ("adam", 0.0, False)
    assert job.policy == Policy.parse("none")


def test_llama_style_model_flags():
    job = parse_megatron_args(
        "--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --group-query-attention --num-query-groups 8 "
        "--kv-channels 128 --ffn-hidden-size 14336 --seq-length 8192 --max-position-embeddings 131072 "
        "--position-embedding-type rope --swiglu --normalization RMSNorm --untie-embeddings-and-output-weights "
        "--disable-bias-linear --hidden-dropout 0.0 --attention-dropout 0 --micro-batch-size 1 "
        "--padded-vocab-size 128256 --attention-backend fused --bf16")[0]
    assert job.model == ModelConfig(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                                    ffn_hidden_size=14336, vocab_size=128256, seq_length=8192, micro_batch_size=1,
                                    activation="swiglu", normalization="rmsnorm", position="rope", attention="sdpa",
                                    hidden_dropout=0.0, attention_dropout=0.0, dtype="bf16", tie_embeddings=False,
                                    add_bias_linear=False, cross_entropy="megatron")


def test_swiglu_default_ffn_is_megatrons_rounding_down():
    # Megatron: int((4h * 2/3) / 64) * 64 = 10880 for h = 4096 (remat's own default rounds up to 10944)
    job = parse("--swiglu", base=BASE.replace("--hidden-size 256", "--hidden-size 4096"))
    assert job.model.ffn_size == 10880 and job.model.ffn_hidden_size == 10880
    assert parse().model.ffn_size == 4 * 256 and parse().model.ffn_hidden_size is None


@pytest.mark.parametrize("extra, attention", [
    ("", "sdpa"), ("--use-flash-attn", "sdpa"), ("--attention-backend flash", "sdpa"),
    ("--attention-backend auto", "sdpa"), ("--attention-backend unfused", "math"),
    ("--transformer-impl transformer_engine", "sdpa")])
def test_attention_backend(extra, attention):
    assert parse(extra).model.attention == attention


@pytest.mark.parametrize("extra", ["--attention-softmax-in-fp32", "--apply-query-key-layer-scaling --bf16"])
def test_flags_te_attention_never_reads_are_ignored_with_unfused(extra):
    # TEDotProductAttention passes neither to TE (NVTE_APPLY_QK_LAYER_SCALING only rescales fp16 scores)
    job, ignored = parse_megatron_args(f"{BASE} --attention-backend unfused {extra}")
    assert job.model.attention == "math" and extra.split()[0] in ignored


@pytest.mark.parametrize("extra", ["--attention-backend local", "--transformer-impl local"])
def test_megatrons_local_layers_read_their_softmax_flags(extra):
    # remat.memory.local_layers: DotProductAttention reads the flags TE's attention never sees
    job, ignored = parse_megatron_args(f"{BASE} {extra} --apply-query-key-layer-scaling --no-masked-softmax-fusion")
    m = job.model
    assert m.transformer_impl == "local" and m.apply_query_key_layer_scaling and not m.masked_softmax_fusion
    assert not m.attention_softmax_in_fp32 and "--no-masked-softmax-fusion" not in ignored


@pytest.mark.parametrize("extra, vocab", [
    ("", 1024), ("--make-vocab-size-divisible-by 1", 1000), ("--no-pad-vocab-size", 1000),
    ("--tensor-model-parallel-size 4 --make-vocab-size-divisible-by 512", 2048), ("--padded-vocab-size 1003", 1003),
    ("--make-vocab-size-divisible-by 64 --tensor-model-parallel-size 2", 1024)])
def test_vocab_padding(extra, vocab):
    assert parse(extra).model.vocab_size == vocab


def test_missing_vocab_warns_and_assumes_gpt2():
    with pytest.warns(UserWarning, match="--vocab-size"):
        job = parse(base=BASE.replace("--vocab-size 1000", ""))
    assert DEFAULT_VOCAB_SIZE == 50257 and job.model.vocab_size == 50304


def test_rotary_legacy_flag_and_gqa_default_groups():
    job = parse("--use-rotary-position-embeddings --group-query-attention")
    assert job.model.position == "rope" and job.model.num_query_groups == 1


# --------------------------------------------------------------------------- parallel flags
@pytest.mark.parametrize("extra, expected", [
    ("--tensor-model-parallel-size 4", dict(tp=4, dp=1)),
    ("--tensor-model-parallel-size 2 --sequence-parallel", dict(tp=2, sp=True)),
    ("--pipeline-model-parallel-size 4", dict(pp=4, vpp=None, schedule="1f1b")),
    ("--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 --global-batch-size 4",
     dict(pp=2, vpp=2, schedule="interleaved", num_microbatches=2)),
    ("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 --global-batch-size 4",
     dict(pp=2, vpp=4, schedule="interleaved")),
    ("--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 1", dict(vpp=None, schedule="1f1b")),
    ("--context-parallel-size 4", dict(cp=4)),
    ("--expert-model-parallel-size 1 --expert-tensor-parallel-size 2 --tensor-model-parallel-size 2",
     dict(ep=1, etp=2)),
    ("--world-size 16 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2", dict(dp=4)),
    ("--data-parallel-size 3", dict(dp=3, num_microbatches=1)),
    ("--world-size 24 --data-parallel-size 6 --context-parallel-size 4", dict(dp=6, cp=4)),
    ("--world-size 8 --global-batch-size 64", dict(dp=8, num_microbatches=4)),
])
def test_parallel_flags(extra, expected):
    job = parse(extra)
    assert {k: getattr(job, k) for k in expected} == expected
    assert job.world_size == job.tp * job.pp * job.cp * job.dp
    assert job.global_batch_size == job.num_microbatches * job.model.micro_batch_size * job.dp


def test_inline_equals_values():
    assert parse("--tensor-model-parallel-size=2 --recompute-granularity=full --recompute-method=block "
                 "--recompute-num-layers=3").tp == 2


# --------------------------------------------------------------------------- precision and optimizer
@pytest.mark.parametrize("extra, precision, accumulate, main_grad", [
    ("", "fp32", True, "fp32"), ("--accumulate-allreduce-grads-in-fp32", "fp32", True, "fp32"),
    ("--bf16", "bf16", True, "fp32"), ("--bf16 --accumulate-allreduce-grads-in-fp32", "bf16", True, "fp32"),
    ("--bf16 --grad-reduce-in-bf16", "bf16", False, "bf16"), ("--fp16", "fp16", False, "fp16"),
    ("--fp16 --accumulate-allreduce-grads-in-fp32", "fp16", True, "fp32")])
def test_precision_flags(extra, precision, accumulate, main_grad):
    job = parse(extra)
    assert (job.precision, job.model.dtype, job.param_dtype) == (precision, precision, precision)
    assert (job.accumulate_grads_in_fp32, job.main_grad_dtype) == (accumulate, main_grad)


@pytest.mark.parametrize("extra, optimizer, momentum, distributed", [
    ("", "adam", 0.0, False), ("--optimizer adam --use-distributed-optimizer", "adam", 0.0, True),
    ("--optimizer sgd", "sgd", 0.9, False), ("--optimizer sgd --sgd-momentum 0", "sgd", 0.0, False),
    ("--optimizer sgd --sgd-momentum 0.5 --use-distributed-optimizer", "sgd", 0.5, True)])
def test_optimizer_flags(extra, optimizer, momentum, distributed):
    job = parse(extra)
    assert (job.optimizer, job.sgd_momentum, job.distributed_optimizer) == (optimizer, momentum, distributed)


def test_sgd_momentum_is_ignored_with_adam():
    job, ignored = parse_megatron_args(f"{BASE} --sgd-momentum 0.5")
    assert job.sgd_momentum == 0.0 and ignored == ["--sgd-momentum"]


# --------------------------------------------------------------------------- recompute flags
@pytest.mark.parametrize("extra, policy", [
    ("", "none"), ("--recompute-activations", "selective/core_attn"),
    ("--recompute-granularity selective", "selective/core_attn"),
    ("--recompute-granularity selective --recompute-modules core_attn mlp layernorm",
     "selective/core_attn+mlp+layernorm"),
    ("--recompute-granularity full --recompute-method uniform --recompute-num-layers 2", "full/uniform/2"),
    ("--recompute-granularity full --recompute-method block --recompute-num-layers 0", "full/block/0"),
    ("--recompute-granularity full --recompute-method block --recompute-num-layers 8", "full/block/8"),
    ("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 "
     "--distribute-saved-activations --tensor-model-parallel-size 2", "full/uniform/1,distribute")])
def test_recompute_flags(extra, policy):
    assert parse(extra).policy == Policy.parse(policy)


@pytest.mark.parametrize("extra, fragments", [
    ("--checkpoint-activations", ["--checkpoint-activations", "--recompute-granularity full"]),
    ("--recompute-granularity full", ["--recompute-method"]),
    ("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 "
     "--distribute-saved-activations", ["--distribute-saved-activations", "tp > 1"]),
    ("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 "
     "--distribute-saved-activations --tensor-model-parallel-size 2 --sequence-parallel",
     ["--distribute-saved-activations", "--sequence-parallel"]),
    ("--recompute-granularity full --recompute-method block --recompute-num-layers 5 "
     "--pipeline-model-parallel-size 2", ["--recompute-num-layers 5", "at most 4"]),
    ("--recompute-granularity", ["--recompute-granularity needs one value"]),
    ("--recompute-activations yes", ["--recompute-activations takes no value"]),
    ("--recompute-foo 1", ["--recompute-foo"]),
    ("--moe-layer-recompute", ["'moe'", "--moe-layer-recompute", "MoE layers", "add --num-experts"]),
])
def test_recompute_refusals(extra, fragments):
    refused(extra, *fragments)


# --------------------------------------------------------------------------- round trip
ROUND_TRIP = [
    Job(model=model()),
    Job.build(model(activation="swiglu"), precision="bf16", tp=2, sp=True, dp=4, num_microbatches=3,
              distributed_optimizer=True, policy=Policy.parse("selective/core_attn+mlp")),
    Job.build(model(num_query_groups=2, position="rope", normalization="rmsnorm", tie_embeddings=True,
                    add_bias_linear=False, attention="math", hidden_dropout=0.0, attention_dropout=0.25,
                    vocab_size=50257, ffn_hidden_size=700),
              precision="fp16", tp=2, pp=2, vpp=2, cp=2, dp=3, num_microbatches=4, accumulate_grads_in_fp32=True,
              optimizer="sgd", sgd_momentum=0.9, policy=Policy.parse("full/uniform/2,distribute")),
    Job.build(model(num_query_groups=8, ffn_hidden_size=1024), precision="bf16", accumulate_grads_in_fp32=False,
              pp=4, num_microbatches=7, etp=1, policy=Policy.parse("full/block/2")),
    Job.build(model(), precision="fp16", optimizer="sgd", sgd_momentum=0.0, cp=4, dp=2,
              policy=Policy.parse("selective/layernorm")),
    Job.build(model(num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=512, activation="swiglu",
                    num_query_groups=2, kv_channels=64), precision="bf16", ep=4, dp=4, distributed_optimizer=True,
              policy=Policy.parse("selective/moe")),
    Job.build(model(num_moe_experts=16, moe_router_topk=4, moe_ffn_hidden_size=128, moe_grouped_gemm=True,
                    moe_shared_expert_intermediate_size=256, moe_layer_freq=(0, 0, 1, 1, 1, 1, 1, 1),
                    moe_router_score_function="sigmoid", moe_expert_capacity_factor=1.25, moe_aux_loss_coeff=0.001,
                    multi_latent_attention=True, position="rope", q_lora_rank=64, kv_lora_rank=32, qk_head_dim=32,
                    qk_pos_emb_head_dim=16, v_head_dim=32), precision="bf16", ep=8, dp=8, pp=2, num_microbatches=4,
              policy=Policy.parse("selective/moe_act+mla_up_proj")),
    # Megatron's groups of 4 microbatches per model chunk: m = 7 = 4 + a last group of 3 >= pp
    Job.build(model(), precision="bf16", pp=2, vpp=2, num_microbatches=7, microbatch_group_size=4),
]


def test_microbatch_group_size_only_with_vpp():
    assert parse("--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 --global-batch-size 10 "
                 "--microbatch-group-size-per-virtual-pipeline-stage 5").microbatch_group_size == 5
    # Megatron reads it only in the interleaved schedule
    assert parse("--microbatch-group-size-per-virtual-pipeline-stage 5").microbatch_group_size is None
    with pytest.raises(JobError, match="for the interleaved schedule"):
        Job.build(model(), microbatch_group_size=2)


@pytest.mark.parametrize("job", ROUND_TRIP, ids=range(len(ROUND_TRIP)))
def test_round_trip(job):
    args = job.to_megatron_args()
    back, ignored = parse_megatron_args(args)
    assert back == job and ignored == []
    assert parse_megatron_args(" ".join(args))[0] == job
    assert "--world-size" not in job.to_megatron_args(include_world_size=False)


@pytest.mark.parametrize("job, fragment", [
    (Job(model=model(), schedule="gpipe"), "gpipe"), (Job(model=model(), optimizer="none"), "optimizer='none'"),
    (Job(model=model(), policy=Policy.parse("full/uniform/1@non-reentrant")), "reentrant"),
    (Job(model=model(), policy=Policy.parse("selective/act")), "'act'")])
def test_to_megatron_args_refuses_what_megatron_cannot_run(job, fragment):
    with pytest.raises(JobError, match=fragment):
        job.to_megatron_args()


# --------------------------------------------------------------------------- refusals of the command line
@pytest.mark.parametrize("extra, fragments", [
    ("--frobnicate 3", ["remat does not know whether --frobnicate changes memory", "remove it"]),
    ("--fp4-format e2m1", ["--fp4-format", "FP4", "remove it"]),
    ("--moe-router-topk 2", ["--moe-router-topk", "MoE", "add --num-experts"]),
    ("--num-experts 8 --moe-extended-tp", ["--moe-extended-tp", "does not model", "remove it"]),
    ("--num-experts 8 --moe-input-jitter-eps 0.1", ["--moe-input-jitter-eps", "remove it"]),
    ("--cpu-offloading", ["--cpu-offloading", "unrecognized arguments", "--cpu-offloading-num-layers N"]),
    ("--use-torch-fsdp2", ["--use-torch-fsdp2", "add --no-gradient-accumulation-fusion"]),
    ("--fp16-lm-cross-entropy", ["--fp16-lm-cross-entropy", "cross-entropy"]),
    ("--cross-entropy-loss-fusion --cross-entropy-fusion-impl te", ["--cross-entropy-fusion-impl te", "stability"]),
    ("--cp-comm-type a2a", ["--cp-comm-type", "--cp-comm-type p2p"]),
    ("--use-checkpoint-args", ["--use-checkpoint-args", "give the flags themselves"]),
    ("--optimizer lion", ["--optimizer lion", "adam, sgd, muon"]),
    ("--position-embedding-type yarn", ["--position-embedding-type yarn", "learned_absolute, rope"]),
    ("--expert-model-parallel-size 2", ["ep (--expert-model-parallel-size)=2", "no experts", "use ep=1"]),
    ("--bf16 --fp16", ["--bf16 and --fp16", "keep one"]),
    ("--grad-reduce-in-bf16", ["--grad-reduce-in-bf16", "--bf16"]),
    ("--num-query-groups 2", ["--num-query-groups", "--group-query-attention"]),
    ("--max-position-embeddings 256", ["--max-position-embeddings 256", "--max-position-embeddings 512"]),
    ("--max-position-embeddings 1024", ["learned position table", "--max-position-embeddings 512"]),
    ("--attention-backend unfused --use-flash-attn", ["--use-flash-attn", "keep one"]),
    ("--attention-backend unfused --apply-query-key-layer-scaling --fp16",
     ["--apply-query-key-layer-scaling", "fp16", "drop it"]),
    ("--tensor-model-parallel-size", ["--tensor-model-parallel-size needs one value"]),
    ("--tensor-model-parallel-size 2 4", ["--tensor-model-parallel-size needs one value", "got 2"]),
    ("--tensor-model-parallel-size two", ["--tensor-model-parallel-size needs a positive integer", "'two'"]),
    ("--tensor-model-parallel-size 0", ["--tensor-model-parallel-size needs a positive integer"]),
    ("--sequence-parallel 1", ["--sequence-parallel takes no value"]),
    ("--tensor-model-parallel-size 2 --tensor-model-parallel-size 2", ["given twice"]),
    ("--hidden-dropout 1.5", ["hidden_dropout=1.5", "[0, 1)"]),
    ("--num-layers-per-virtual-pipeline-stage 1 --num-virtual-stages-per-pipeline-rank 2", ["give one of"]),
    ("--num-layers-per-virtual-pipeline-stage 3 --pipeline-model-parallel-size 2",
     ["--num-layers-per-virtual-pipeline-stage 3", "divide"]),
    ("--pipeline-model-parallel-size 3 --num-virtual-stages-per-pipeline-rank 2 --no-overlap-p2p-communication",
     ["--num-layers", "pp*vpp=6"]),
    ("--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 --no-overlap-p2p-communication "
     "--global-batch-size 4", ["--no-overlap-p2p-communication", "> 2"]),
])
def test_command_line_refusals(extra, fragments):
    refused(extra, *fragments)


def test_missing_required_flag():
    refused("", "--seq-length is missing", "add --seq-length N", base=BASE.replace("--seq-length 512", ""))


def test_unclosed_quote_is_a_job_error():
    with pytest.raises(JobError, match="close"):
        parse_megatron_args(f"{BASE} --data-path 'unclosed")


def test_stray_value_refused():
    with pytest.raises(JobError, match="unexpected 'oops'"):
        parse_megatron_args(["oops", *BASE.split()])


# --------------------------------------------------------------------------- impossible sizes
@pytest.mark.parametrize("extra, fragments", [
    ("--tensor-model-parallel-size 3", ["tp", "--tensor-model-parallel-size", "num_attention_heads=8",
                                        "1, 2, 4, 8"]),
    ("--tensor-model-parallel-size 4 --group-query-attention --num-query-groups 2",
     ["tp (--tensor-model-parallel-size)=4 does not divide num_query_groups=2", "replicating"]),
    ("--tensor-model-parallel-size 2 --ffn-hidden-size 1001", ["does not divide the FFN size=1001"]),
    ("--context-parallel-size 3", ["cp (--context-parallel-size)=3", "2*cp=6", "--seq-length"]),
    ("--context-parallel-size 512", ["2*cp=1024"]),
    ("--tensor-model-parallel-size 8 --sequence-parallel --context-parallel-size 128", ["s/cp=4", "tp=8"]),
    ("--pipeline-model-parallel-size 16", ["pp=16 pipeline chunks exceed num_layers=8"]),
    ("--pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-rank 4",
     ["pp*vpp=16 pipeline chunks exceed num_layers=8", "--num-layers"]),
    ("--pipeline-model-parallel-size 3", ["num_layers=8 (--num-layers) is not divisible by pp=3"]),
    ("--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 --global-batch-size 6",
     ["num_microbatches (--global-batch-size)=3", "multiple of pp=2"]),
    # schedules.py:1160-1180: the group size lies in [pp, m]; a last group of fewer than pp microbatches is refused
    ("--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 --global-batch-size 6 "
     "--microbatch-group-size-per-virtual-pipeline-stage 4",
     ["microbatch group size 4 (--microbatch-group-size-per-virtual-pipeline-stage)", "[pp, microbatches] = [2, 3]",
      "use 3"]),
    ("--pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-rank 2 --global-batch-size 16 "
     "--microbatch-group-size-per-virtual-pipeline-stage 5", ["last group of 3 < pp=4"]),
    ("--world-size 12 --tensor-model-parallel-size 8", ["--world-size 12", "8", "multiple of 8"]),
    ("--world-size 16 --data-parallel-size 4 --tensor-model-parallel-size 2", ["--world-size 16",
                                                                              "--data-parallel-size 4"]),
    ("--world-size 4 --global-batch-size 12", ["--global-batch-size 12", "x data-parallel size 4 = 8",
                                               "multiple of 8"]),
])
def test_impossible_sizes(extra, fragments):
    refused(extra, *fragments)


@pytest.mark.parametrize("fields, fragments", [
    (dict(tp=True), ["tp (--tensor-model-parallel-size)=True", "positive integer"]),
    (dict(dp=0), ["dp", "positive integer"]), (dict(vpp=2.0), ["vpp", "or None"]),
    (dict(num_microbatches=0), ["num_microbatches", "positive integer"]),
    (dict(schedule="zb"), ["schedule", "gpipe, 1f1b, interleaved"]),
    (dict(precision="bf16"), ["model.dtype='fp32'", "precision='bf16'", "Job.build"]),
    (dict(vpp=2, pp=2), ["vpp=2 needs schedule='interleaved'"]),
    (dict(schedule="interleaved", pp=2), ["schedule='interleaved' needs vpp"]),
    (dict(vpp=1, schedule="interleaved"), ["vpp=1", "vpp=None"]),
    (dict(vpp=2, schedule="interleaved"), ["needs pp > 1"]),
    (dict(accumulate_grads_in_fp32=False), ["fp32 parameters always have fp32 gradients"]),
    (dict(sgd_momentum=0.9), ["sgd_momentum=0.9 only applies to optimizer='sgd'"]),
    (dict(optimizer="sgd", sgd_momentum=-1), ["sgd_momentum", ">= 0"]),
    (dict(optimizer="none", distributed_optimizer=True), ["--use-distributed-optimizer", "optimizer='none'"]),
    (dict(ep=2), ["no experts"]), (dict(sp=1), ["sp", "True or False"]),
])
def test_job_validation(fields, fragments):
    with pytest.raises(JobError) as info:
        Job(model=model(), **fields)
    for fragment in fragments:
        assert fragment in str(info.value)


# --------------------------------------------------------------------------- derived values
@pytest.mark.parametrize("dp", [1, 2, 3, 8, 64, 1000])
def test_state_bytes_match_megatron_estimator(dp):
    job = Job.build(model(), precision="bf16", dp=dp)
    assert job.state_bytes_per_param() == {"parameters": 2, "gradients": 4, "master_parameters": 4,
                                           "optimizer_state": 8}
    assert job.bytes_per_param_static() == 18
    sharded = job.replace(distributed_optimizer=True).state_bytes_per_param()
    assert all(isinstance(v, Fraction) for v in sharded.values())
    assert sum(sharded.values()) == 6 + Fraction(12, dp)
    assert sharded["master_parameters"] == Fraction(4, dp) and sharded["optimizer_state"] == Fraction(8, dp)


@pytest.mark.parametrize("fields, total", [
    (dict(precision="fp32"), 16), (dict(precision="fp32", distributed_optimizer=True, dp=4), 4 + 4 + 2),
    (dict(precision="fp16"), 2 + 2 + 4 + 8), (dict(precision="fp16", accumulate_grads_in_fp32=True), 18),
    (dict(precision="bf16", accumulate_grads_in_fp32=False), 2 + 2 + 12),
    (dict(precision="bf16", optimizer="sgd"), 2 + 4 + 4), (dict(precision="bf16", optimizer="sgd", sgd_momentum=0.9),
                                                           2 + 4 + 4 + 4),
    (dict(precision="bf16", optimizer="none"), 6), (dict(precision="fp32", optimizer="none"), 8),
    (dict(precision="bf16", distributed_optimizer=True, dp=2, cp=2), 6 + 3)])
def test_state_bytes_other_setups(fields, total):
    assert Job.build(model(), **fields).bytes_per_param_static() == total


def test_derived_properties():
    job = Job.build(model(num_layers=16), precision="bf16", tp=2, pp=2, vpp=2, cp=2, dp=3, num_microbatches=4)
    assert (job.world_size, job.global_batch_size, job.layers_per_chunk) == (24, 4 * 2 * 3, 4)
    assert (job.param_dtype, job.main_grad_dtype, job.optimizer_shards, job.schedule) == ("bf16", "fp32", 1,
                                                                                          "interleaved")
    assert job.replace(distributed_optimizer=True).optimizer_shards == 6


def test_model_is_stored_canonically():
    m = model(ffn_hidden_size=1024, num_query_groups=8)
    job = Job(model=m)
    assert job.model == model(cross_entropy="megatron") and job.model.ffn_size == m.ffn_size
    assert job.model.query_groups == 8  # and the loss is Megatron's (remat.job_loss)


def test_replace_follows_derived_fields():
    job = Job(model=model(), optimizer="sgd", sgd_momentum=0.9)
    bf16 = job.replace(precision="bf16")
    assert bf16.model.dtype == "bf16" and bf16.accumulate_grads_in_fp32 is True
    assert bf16.replace(precision="fp16").accumulate_grads_in_fp32 is False
    assert job.replace(optimizer="adam").sgd_momentum == 0.0
    inter = job.replace(pp=2, vpp=2, num_microbatches=2)
    assert inter.schedule == "interleaved" and inter.replace(vpp=None).schedule == "1f1b"
    with pytest.raises(JobError, match="precision='x'"):
        job.replace(precision="x")


# --------------------------------------------------------------------------- files, launchers, tables
def test_args_file(tmp_path):
    path = tmp_path / "job.args"
    path.write_text("# a Megatron job\n--num-layers 8 --hidden-size 256 \\\n  --num-attention-heads 8  # heads\n"
                    "--seq-length 512 --micro-batch-size 2\n--vocab-size 1000 --bf16 --lr 3e-4\n")
    tokens = load_megatron_args(path)
    assert tokens[:2] == ["--num-layers", "8"] and "#" not in " ".join(tokens) and "\n" not in tokens
    job, ignored = parse_megatron_args([f"@{path}", "--tensor-model-parallel-size", "2"])
    assert job == parse("--bf16 --tensor-model-parallel-size 2") and ignored == ["--lr"]


def test_args_file_errors(tmp_path):
    with pytest.raises(JobError, match="cannot read the Megatron args file"):
        load_megatron_args(tmp_path / "missing.args")
    (tmp_path / "bad.args").write_text("--data-path 'x\n")
    with pytest.raises(JobError, match="close"):
        load_megatron_args(tmp_path / "bad.args")
    (tmp_path / "nested.args").write_text("@other.args\n")
    with pytest.raises(JobError, match="nested"):
        load_megatron_args(tmp_path / "nested.args")


def test_pasted_launcher_line_and_ignored_flags():
    line = (f"torchrun --nproc_per_node 8 --nnodes 1 pretrain_gpt.py {BASE} --bf16 --lr 6e-5 --min-lr 6e-6 "
            "--lr-decay-style cosine --train-iters 500000 --seed 1234 --data-path /data/x_text_document "
            "--tokenizer-type GPT2BPETokenizer --vocab-file v.json --merge-file m.txt --log-interval 100 "
            "--save /ckpt --load /ckpt --eval-iters 10 --tensorboard-dir /tb --use-mcore-models "
            "--overlap-grad-reduce --cp-comm-type p2p --world-size 8 --global-batch-size 64")
    job, ignored = parse_megatron_args(line)
    assert (job.dp, job.num_microbatches, job.precision) == (8, 4, "bf16")
    assert ignored == ["torchrun --nproc_per_node 8 --nnodes 1 pretrain_gpt.py", "--lr", "--min-lr",
                       "--lr-decay-style", "--train-iters", "--seed", "--data-path", "--tokenizer-type",
                       "--vocab-file", "--merge-file", "--log-interval", "--save", "--load", "--eval-iters",
                       "--tensorboard-dir", "--use-mcore-models", "--cp-comm-type"]
    assert job.overlap_grad_reduce and job.ddp_bucket_size is None and not job.pad_buckets_for_high_nccl_busbw


def test_megatron_llama_example_parses():
    # examples/llama/train_llama3_8b_h100_fp8.sh (bf16 path, without its fused cross entropy)
    args = ("--use-mcore-models --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 "
            "--group-query-attention --num-query-groups 8 --kv-channels 128 --seq-length 8192 "
            "--max-position-embeddings 8192 --position-embedding-type rope --rotary-base 1000000 "
            "--rotary-percent 1.0 --attention-dropout 0.0 --hidden-dropout 0.0 --swiglu --normalization RMSNorm "
            "--init-method-std 0.0134 --attention-backend fused --apply-layernorm-1p "
            "--untie-embeddings-and-output-weights --disable-bias-linear --micro-batch-size 1 "
            "--global-batch-size 128 --train-samples 1953125000 --lr 0.00015 --min-lr 0.00001 "
            "--lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16 "
            "--grad-reduce-in-bf16 --calculate-per-token-loss --manual-gc --empty-unused-memory-level 1 "
            "--tensor-model-parallel-size 2 --context-parallel-size 2 --sequence-parallel "
            "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --tokenizer-type "
            "HuggingFaceTokenizer --tokenizer-model meta-llama/Meta-Llama-3-8B --vocab-size 128256 --world-size 16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        job = Job.from_megatron_args(args)
    assert (job.tp, job.cp, job.dp, job.sp, job.num_microbatches) == (2, 2, 4, True, 32)
    assert job.model.vocab_size == 128256 and job.main_grad_dtype == "bf16"
    assert job.state_bytes_per_param() == {"parameters": 2, "gradients": 2, "master_parameters": Fraction(4, 8),
                                           "optimizer_state": 1}


def test_flag_tables():
    assert not set(REFUSED_FLAGS) & set(IGNORED_FLAGS)
    assert classify_megatron_flag("--lr") == ("ignored", IGNORED_FLAGS["--lr"])
    assert classify_megatron_flag("--log-interval=5")[0] == "ignored"
    assert classify_megatron_flag("--moe-grouped-gemm")[0] == "modelled"
    assert classify_megatron_flag("--moe-extended-tp")[0] == "refused"
    assert classify_megatron_flag("--tensor-model-parallel-size")[0] == "modelled"
    assert classify_megatron_flag("--recompute-modules")[0] == "recompute"
    assert classify_megatron_flag("--cp-comm-type")[0] == "default-only"
    assert classify_megatron_flag("--no-such-flag")[0] == "unknown"


# --------------------------------------------------------------------------- MoE and MLA flags
DEEPSEEK_LIKE = ("--num-experts 16 --moe-router-topk 4 --moe-ffn-hidden-size 128 --moe-grouped-gemm "
                 "--moe-shared-expert-intermediate-size 256 --moe-layer-freq ([0]*2+[1]*6) "
                 "--moe-router-score-function sigmoid --moe-token-dispatcher-type alltoall "
                 "--multi-latent-attention --qk-layernorm --q-lora-rank 64 --kv-lora-rank 32 --qk-head-dim 32 "
                 "--qk-pos-emb-head-dim 16 --v-head-dim 32 --position-embedding-type rope --bf16 "
                 "--world-size 8 --expert-model-parallel-size 8 --use-distributed-optimizer")


def test_moe_and_mla_flags_set_the_model_fields():
    job, ignored = parse_megatron_args(f"{BASE} {DEEPSEEK_LIKE} --moe-router-load-balancing-type seq_aux_loss "
                                       "--moe-layer-recompute")
    m = job.model
    assert (m.num_moe_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.moe_grouped_gemm) == (16, 4, 128, True)
    assert (m.moe_shared_expert_intermediate_size, m.moe_layer_freq) == (256, (0, 0, 1, 1, 1, 1, 1, 1))
    assert (m.multi_latent_attention, m.q_lora_rank, m.kv_lora_rank, m.v_head_dim) == (True, 64, 32, 32)
    assert (job.ep, m.expert_model_parallel_size, job.dp, job.expert_data_parallel) == (8, 8, 8, 1)
    assert job.policy == Policy.parse("selective/moe") and ignored == ["--moe-router-load-balancing-type"]
    # Megatron's defaults: top-2 softmax routing, experts of --ffn-hidden-size, every layer MoE
    plain = parse("--num-experts 4").model
    assert (plain.moe_router_topk, plain.moe_ffn_size, plain.moe_layer_freq) == (2, plain.ffn_size, 1)
    assert parse("--kv-channels 64").model.head_dim == 64


@pytest.mark.parametrize("extra, fragments", [
    ("--num-experts 6 --expert-model-parallel-size 4 --world-size 4 --moe-token-dispatcher-type alltoall",
     ["ep (--expert-model-parallel-size)=4", "num_moe_experts=6", "use ep from 1, 2, 3, 6"]),
    ("--num-experts 8 --expert-model-parallel-size 4 --world-size 2 --moe-token-dispatcher-type alltoall",
     ["ep (--expert-model-parallel-size)=4", "raise dp", "multiple of 4"]),
    # the flex dispatcher: NCCL EP, and what remat does not model with HybridEP or DeepEP
    ("--num-experts 8 --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep --bf16 --fp8-format e4m3 "
     "--fp8-recipe tensorwise --expert-model-parallel-size 2 --world-size 2",
     ["with FP8 (--fp8-format)", "pad_multiple 16", "--moe-token-dispatcher-type alltoall"]),
    ("--num-experts 8 --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend ncclep",
     ["--moe-flex-dispatcher-backend", "NCCL EP", "hybridep"]),
    ("--num-experts 16 --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep "
     "--expert-model-parallel-size 16 --world-size 16", ["over 16 ranks", "NVLink domain", "RDMA"]),
    ("--num-experts 8 --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep "
     "--expert-model-parallel-size 2 --tensor-model-parallel-size 2 --expert-tensor-parallel-size 2 "
     "--sequence-parallel --world-size 4 --disable-bias-linear",
     ["--expert-tensor-parallel-size 2", "--expert-tensor-parallel-size 1"]),
    ("--num-experts 8 --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep "
     "--moe-expert-capacity-factor 1.0", ["--moe-expert-capacity-factor", "drop the capacity factor"]),
    ("--num-experts 8 --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep "
     "--cuda-graph-impl transformer_engine --cuda-graph-modules moe_router moe_preprocess",
     ["--cuda-graph-modules moe_preprocess with --moe-token-dispatcher-type flex", "graph moe_router only"]),
    ("--position-embedding-type rope --multi-latent-attention --qk-layernorm", ["needs --kv-lora-rank"]),
    ("--kv-lora-rank 32", ["--kv-lora-rank needs --multi-latent-attention"]),
    ("--recompute-granularity selective --recompute-modules mla_up_proj",
     ["'mla_up_proj'", "multi-latent attention", "add --multi-latent-attention"]),
])
def test_moe_and_mla_refusals_name_the_flag_and_the_fix(extra, fragments):
    refused(extra, *fragments)


# --------------------------------------------------------------------------- what Megatron itself accepts
@pytest.mark.parametrize("extra, ignored, check", [
    # arguments.py::validate_args turns sequence parallelism off at tp = 1 (with a warning)
    ("--sequence-parallel", ["--sequence-parallel"], lambda job: not job.sp and job.tp == 1),
    # transformer_config.py checks --recompute-method / --recompute-num-layers only under a granularity
    ("--recompute-num-layers 1", ["--recompute-num-layers"], lambda job: str(job.policy) == "none"),
    ("--recompute-method uniform --recompute-num-layers 2", ["--recompute-method", "--recompute-num-layers"],
     lambda job: str(job.policy) == "none"),
    # a dense model has no expert to split: the expert groups exist but hold nothing
    ("--tensor-model-parallel-size 2 --expert-tensor-parallel-size 4 --world-size 8", ["--expert-tensor-parallel-size"],
     lambda job: job.etp is None and job.tp == 2),
    # checkpointing, self-tests and the RNG tracker's implementation keep no tensors in a training step
    ("--verify-integrity --no-ckpt-fully-parallel-save --async-ckpt-use-cpu-shm --test-mode --te-rng-tracker",
     ["--verify-integrity", "--no-ckpt-fully-parallel-save", "--async-ckpt-use-cpu-shm", "--test-mode",
      "--te-rng-tracker"], lambda job: str(job.policy) == "none"),
    # dist_utils.py:98 meta-device init: the same buffers once initialised; global_vars.py:168 --enable-experimental
    # only switches kernels of refused flags (the flex dispatcher, --moe-router-padding-for-quantization)
    # fsdp param_and_grad_buffer.py:2163-2260: how NCCL registers the buffers, not which buffers
    ("--init-model-with-meta-device --enable-experimental --use-megatron-fsdp --world-size 2 --use-nccl-ub "
     "--fsdp-manual-registration --disable-symmetric-registration",
     ["--init-model-with-meta-device", "--enable-experimental", "--fsdp-manual-registration",
      "--disable-symmetric-registration"], lambda job: job.fsdp is not None and job.fsdp.double_buffer),
])
def test_flags_megatron_accepts_without_effect_are_listed_as_ignored(extra, ignored, check):
    job, listed = parse_megatron_args(f"{BASE} {extra}")
    assert check(job)
    assert set(ignored) <= set(listed)
    assert "--recompute-num-layers" not in parse_megatron_args(
        f"{BASE} --recompute-granularity full --recompute-method uniform --recompute-num-layers 2")[1]


@pytest.mark.parametrize("extra, fragment", [
    ("--external-cuda-graph", "CUDA-graph"),  # --cuda-graph-impl transformer_engine: tests/base/test_job_cuda_graphs.py
])
def test_flags_that_change_memory_unmodelled_are_refused_by_name(extra, fragment):
    refused(extra, extra.split()[0], fragment, "remove it")


def test_the_op_fuser_prices_the_grouped_mlp_where_it_keeps_its_tensors():
    # remat.job_experts.check_op_fuser: TE's GroupedLinear/ScaledSwiGLU ops keep the grouped MLP's tensors on Hopper
    moe = f"{BASE} --moe-router-topk 1 --moe-grouped-gemm --swiglu --disable-bias-linear --num-experts "
    moe += "4"  # 2 x 512 routed tokens: 256 per expert, a multiple of 256
    plain, _ = parse_megatron_args(moe)
    fused, ignored = parse_megatron_args(f"{moe} --use-transformer-engine-op-fuser")
    assert fused == plain and "--use-transformer-engine-op-fuser" in ignored
    assert parse_megatron_args(f"{BASE} --use-transformer-engine-op-fuser")[0] == parse_megatron_args(BASE)[0]
    for args, fragment in ((moe[:-1] + "8", "multiple of 256"),  # 128 per expert: padded
                           (f"{moe} --tensor-model-parallel-size 2 --sequence-parallel --world-size 2",
                            "tensor parallelism")):
        with pytest.raises(JobError, match=fragment):
            parse_megatron_args(f"{args} --use-transformer-engine-op-fuser")
    with pytest.raises(JobError, match="--moe-grouped-gemm and --swiglu"):
        parse_megatron_args(f"{moe.replace(' --swiglu', '')} --use-transformer-engine-op-fuser")


def test_qk_layernorm_is_read_for_both_attentions_and_round_trips():
    # standard attention: per-head q/k norms (Megatron's --qk-layernorm); MLA: its q/kv norms only with the flag
    job, _ = parse_megatron_args(f"{BASE} --qk-layernorm")
    assert job.model.qk_layernorm is True and job.model.has_qk_norms
    assert parse_megatron_args(job.to_megatron_args())[0] == job
    mla = ("--multi-latent-attention --kv-lora-rank 64 --q-lora-rank 96 --qk-head-dim 16 --qk-pos-emb-head-dim 8 "
           "--v-head-dim 16")
    without, _ = parse_megatron_args(f"{BASE} {mla}")
    with_norms, _ = parse_megatron_args(f"{BASE} {mla} --qk-layernorm")
    assert without.model.qk_layernorm is False and not without.model.has_qk_norms
    assert with_norms.model.qk_layernorm is None and with_norms.model.has_qk_norms  # MLA's default
    for j in (without, with_norms):
        assert parse_megatron_args(j.to_megatron_args())[0] == j
    from remat.models.gpt import build_model

    small = job.model.replace(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=8, vocab_size=128)
    count = lambda m: sum(p.numel() for p in build_model(m).parameters())  # noqa: E731
    # a LayerNorm (weight and bias) over head_dim = 16 for q and for k, per layer
    assert count(small) - count(small.replace(qk_layernorm=None)) == 2 * 2 * 2 * 16


@pytest.mark.parametrize("launcher, world", [
    ("torchrun --nproc_per_node 8 --nnodes 2 pretrain_gpt.py", 16),
    ("torchrun --nnodes=1:4 --nproc-per-node=8 pretrain_gpt.py", 32),  # elastic: the size the job reaches
    ("python -m torch.distributed.run --nproc-per-node 4 pretrain_gpt.py", 4),
    ("srun -N 2 --ntasks-per-node 8 python pretrain_gpt.py", 16),
    ("srun --ntasks 24 python pretrain_gpt.py", 24),
    ("mpirun -np 8 python pretrain_gpt.py", 8),
    ("deepspeed --num_nodes 2 --num_gpus 4 pretrain_gpt.py", 8),
])
def test_a_pasted_launch_line_gives_the_world_size(launcher, world):
    job, ignored = parse_megatron_args(f"{launcher} {BASE} --global-batch-size {2 * world}")
    assert job.world_size == world and ignored[0] == launcher
    # remat's own --world-size wins over the launcher's (scripts often take the node count from the scheduler)
    assert parse_megatron_args(f"{launcher} {BASE} --world-size 2 --global-batch-size 4")[0].world_size == 2


@pytest.mark.parametrize("launcher", ["torchrun --nproc_per_node $GPUS pretrain_gpt.py", "python pretrain_gpt.py",
                                      "torchrun --nproc-per-node gpu pretrain_gpt.py"])
def test_a_launch_line_that_does_not_say_leaves_one_data_rank(launcher):
    assert parse_megatron_args(f"{launcher} {BASE}")[0].world_size == 1


def test_every_refused_flag_is_named_at_once():
    msg = refused("--fp4-format e2m1 --squared-relu --no-such-flag 3", "3 flags stop the prediction",
                  "(1) --fp4-format", "(2) --squared-relu", "(3) remat does not know whether --no-such-flag")
    assert "\n" not in msg


@pytest.mark.parametrize("flag, meant", [
    ("--num-layer", "--num-layers"), ("--tensor-parallel-size", "--tensor-model-parallel-size"),
    ("--sequence_parallel", "--sequence-parallel"), ("--Micro-Batch-Size", "--micro-batch-size"),
    ("--frobnicate", None), ("--a\nb", None),
])
def test_a_misspelled_megatron_flag_names_the_flag_meant(flag, meant):
    assert suggest_flag(flag) == meant
    with pytest.raises(JobError) as err:
        parse_megatron_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                             "--seq-length", "32", "--micro-batch-size", "1", flag])
    message = str(err.value)
    assert "\n" not in message and f"remat does not know whether {shown_flag(flag)} changes memory" in message
    assert (f"did you mean {meant}?" in message) == (meant is not None)


def test_add_qkv_bias_is_linear_qkvs_bias_and_round_trips():
    # training/arguments.py:1609-1610 (add_bias_linear turns add_qkv_bias on) and attention.py:1698 (linear_qkv's bias
    # is add_bias_linear or add_qkv_bias); MLA's projections read add_bias_linear only (multi_latent_attention.py:226)
    job, ignored = parse_megatron_args(f"{BASE} --disable-bias-linear --add-qkv-bias")
    assert job.model.add_qkv_bias and job.model.qkv_bias and not job.model.add_bias_linear and ignored == []
    assert parse_megatron_args(job.to_megatron_args())[0] == job
    assert parse().model.qkv_bias and not parse("--disable-bias-linear").model.qkv_bias
    mla = ("--multi-latent-attention --kv-lora-rank 64 --q-lora-rank 96 --qk-head-dim 16 --qk-pos-emb-head-dim 8 "
           "--v-head-dim 16 --disable-bias-linear")
    mla_job, mla_ignored = parse_megatron_args(f"{BASE} {mla} --add-qkv-bias")
    assert "--add-qkv-bias" in mla_ignored and mla_job == parse(mla)


@pytest.mark.parametrize("backend", ["hybridep", "deepep"])
def test_the_flex_dispatcher_is_read_with_its_backend_and_round_trips(backend):
    # transformer_config.py:891-902: --moe-token-dispatcher-type flex with --moe-flex-dispatcher-backend
    flags = (f"{BASE} --num-experts 4 --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend {backend} "
             "--expert-model-parallel-size 2 --world-size 2 --moe-permute-fusion-into-hybridep")
    job, ignored = parse_megatron_args(flags)
    assert (job.model.moe_token_dispatcher_type, job.model.moe_flex_dispatcher_backend) == ("flex", backend)
    assert "--moe-permute-fusion-into-hybridep" in ignored
    assert parse_megatron_args(job.to_megatron_args())[0] == job


def test_enable_experimental_is_read_only_where_it_changes_the_job():
    # token_dispatcher.py:1425: DeepEP's fused multihot conversion, under --moe-permute-fusion; else ignored
    deepep = f"{BASE} --num-experts 4 --moe-token-dispatcher-type flex --expert-model-parallel-size 2 --world-size 2 "
    job, ignored = parse_megatron_args(deepep + "--moe-permute-fusion --enable-experimental")
    assert job.model.enable_experimental and "--enable-experimental" not in ignored
    assert parse_megatron_args(job.to_megatron_args())[0] == job
    for other in (deepep + "--enable-experimental", f"{BASE} --enable-experimental",
                  deepep + "--moe-flex-dispatcher-backend hybridep --moe-permute-fusion --enable-experimental"):
        job, ignored = parse_megatron_args(other)
        assert not job.model.enable_experimental and "--enable-experimental" in ignored, other


def test_moe_enable_deepep_is_the_default_flex_backend_checked_as_megatron_checks_it():
    flex = f"{BASE} --num-experts 4 --expert-model-parallel-size 2 --world-size 2 --moe-enable-deepep "
    job, ignored = parse_megatron_args(flex + "--moe-token-dispatcher-type flex")
    assert job.model.moe_flex_dispatcher_backend == "deepep" and "--moe-enable-deepep" in ignored
    with pytest.raises(JobError, match="needs --moe-token-dispatcher-type flex"):
        parse_megatron_args(flex + "--moe-token-dispatcher-type alltoall")
    with pytest.raises(JobError, match="Megatron runs one backend"):
        parse_megatron_args(flex + "--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep")


def test_a_flex_backend_without_the_flex_dispatcher_is_listed_as_ignored():
    # Megatron reads --moe-flex-dispatcher-backend only under --moe-token-dispatcher-type flex
    job, ignored = parse_megatron_args(f"{BASE} --num-experts 4 --moe-token-dispatcher-type alltoall "
                                       "--moe-flex-dispatcher-backend hybridep")
    assert job.model.moe_token_dispatcher_type == "alltoall" and "--moe-flex-dispatcher-backend" in ignored


def test_no_rope_fusion_is_read_where_a_layer_rotates_and_round_trips():
    # NOTE [unfused rope]: --no-rope-fusion, and MLA under any position type but rope (Megatron turns the fusion off,
    # training/arguments.py:1628-1629); without rotary positions the flag changes nothing and is listed as ignored
    job, ignored = parse_megatron_args(f"{BASE} --position-embedding-type rope --no-rope-fusion")
    assert not job.model.apply_rope_fusion and "--no-rope-fusion" not in ignored
    assert parse_megatron_args(job.to_megatron_args())[0] == job
    assert parse("--position-embedding-type rope").model.apply_rope_fusion
    learned, ignored = parse_megatron_args(f"{BASE} --no-rope-fusion")
    assert learned.model.apply_rope_fusion and "--no-rope-fusion" in ignored
    mla = ("--multi-latent-attention --kv-lora-rank 64 --q-lora-rank 96 --qk-head-dim 16 --qk-pos-emb-head-dim 8 "
           "--v-head-dim 16")
    assert not parse(mla).model.apply_rope_fusion  # learned absolute positions: MLA's rope is unfused
    assert parse(f"{mla} --position-embedding-type rope").model.apply_rope_fusion
    for j in (parse(mla), parse(f"{mla} --position-embedding-type rope --no-rope-fusion")):
        assert not j.model.apply_rope_fusion and parse_megatron_args(j.to_megatron_args())[0] == j
    with pytest.raises(ValueError, match="apply_rope_fusion=False .* set position='rope'"):
        ModelConfig(apply_rope_fusion=False)


def test_rope_type_sets_mlas_rotary_embedding_and_round_trips():
    # NOTE [MLA's rotary tables]: MLA's rotary embedding is yarn unless --rope-type rope (argument_utils.py:335-337),
    # which Megatron fuses only as yarn (transformer_config.py:3345); standard attention takes rope only (:339)
    mla = ("--multi-latent-attention --kv-lora-rank 64 --q-lora-rank 96 --qk-head-dim 16 --qk-pos-emb-head-dim 8 "
           "--v-head-dim 16")
    assert parse(mla).model.mla_rope_type == "yarn"
    rope = parse(f"{mla} --rope-type rope")  # learned absolute positions: unfused
    assert rope.model.mla_rope_type == "rope" and parse_megatron_args(rope.to_megatron_args())[0] == rope
    with pytest.raises(ValueError, match="mla_rope_type='rope' with apply_rope_fusion.*--no-rope-fusion"):
        parse(f"{mla} --rope-type rope --position-embedding-type rope")
    assert parse("--rope-type rope").model == parse("").model  # standard attention: rope, as without the flag
    with pytest.raises(ValueError, match="--rope-type yarn: Megatron's standard attention supports rope only"):
        parse("--rope-type yarn")
    with pytest.raises(ValueError, match="mla_rope_type='ntk'"):
        ModelConfig(multi_latent_attention=True, mla_rope_type="ntk")
