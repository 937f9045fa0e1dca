"""How remat treats each Megatron-LM training flag: modelled, recompute, ignored (does not change memory), or refused.

:func:`remat.job.parse_megatron_args` reads a ``pretrain_gpt.py`` command line through these tables; a flag in none
of them is refused, so nothing that changes memory is ever silently dropped.
"""

from __future__ import annotations

import difflib
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from remat.limits import ceiling_problem, read_input_text
from remat.units import ascii_float, ascii_int


class JobError(ValueError):
    """A training job remat (or Megatron-LM) refuses; the message names the field or flag and the fix."""


def _table(groups: dict[str, str]) -> dict[str, str]:
    return {flag: reason for reason, flags in groups.items() for flag in flags.split()}


FLEX_REASON = (
    "runs Megatron's flex token dispatcher with NCCL EP (token_dispatcher.py:1471 _NCCLEPManager: TE's ep_bootstrap "
    "and symmetric-memory buffers); remat models the flex dispatcher with --moe-flex-dispatcher-backend hybridep or "
    "deepep (remat.models.flex_dispatch, remat.models.deepep_dispatch)")
# Flags that change a rank's memory in a way remat cannot model yet: refused by name, with the reason.
REFUSED_FLAGS: dict[str, str] = _table({
    "changes the MoE layers in a way remat's reference MoE (Megatron's all-to-all or allgather dispatcher, dropless "
    "or capacity routing, probabilities applied in the experts' activation) does not model":
        "--moe-extended-tp --moe-apply-probs-on-input "
        "--moe-input-jitter-eps --moe-router-padding-for-quantization --moe-use-legacy-grouped-gemm",
    "trains in FP8/FP4 (quantised copies of weights and activations)":
        "--fp4-format --fp4-recipe --fp4-param-gather --reuse-grad-buf-for-mxfp8-param-ag --te-precision-config-file",
    # remat.memory.fp8 models the layers' linears in FP8 (attention and the output layer in bf16); not these
    "runs FP8 attention or an FP8 output layer (remat models the layers' linears in FP8, attention and the output "
    "layer in bf16)": "--fp8-dot-product-attention --fp8-multi-head-attention --fp8-output-proj",
    # training/arguments.py:2320 leaves cpu_offloading out of the generated flags, :120 allow_abbrev=False
    "is not a flag of Megatron-LM at d98e8a64 (training/arguments.py:2320 leaves cpu_offloading out of the flags it "
    "generates and the parser takes no abbreviation, :120: Megatron stops with 'unrecognized arguments'; "
    "--cpu-offloading-num-layers N turns TransformerEngine's layer offloading on, :1950-1951: remat models it, "
    "remat.recompute.layer_offload)": "--cpu-offloading",
    "offloads activations or optimizer state to host memory":
        "--activation-offload-fraction --delta-offload-bytes-across-pp-ranks --optimizer-cpu-offload "
        "--optimizer-offload-fraction --use-torch-optimizer-for-cpu-offload --overlap-cpu-optimizer-d2h-h2d",
    # remat.job_fsdp models Megatron-FSDP (--use-megatron-fsdp and its strategy/dtype flags) and torch FSDP2
    # (--use-torch-fsdp2, --torch-fsdp2-no-reshard-after-forward); not this:
    "shards parameters and gradients with Megatron-FSDP's hybrid (outer data-parallel) sharding":
        "--outer-dp-sharding-strategy",
    # fsdp param_and_grad_buffer.py:835-836: a bucket outside the double buffers gets its own persistent tensor
    "keeps the buckets of the FSDP units outside the double buffers (and the non-unit ones) persistently, which "
    "remat does not model (it models --fsdp-double-buffer's fallback: allocated and freed per use)":
        "--fsdp-db-use-persist-buf-on-alloc-fail",
    "sets the gradient buckets from the parameter count (each bucket is padded; give --ddp-bucket-size)":
        "--ddp-num-buckets",
    "changes the optimizer's state layout": "--use-precision-aware-optimizer "
        "--main-grads-dtype --main-params-dtype --exp-avg-dtype --exp-avg-sq-dtype "
        "--ddp-reduce-scatter-with-fp32-accumulation",
    # megatron/core/optimizer/__init__.py:806-813: Muon's non-matrix parameters go to this optimizer (Lion keeps one
    # moment, not Adam's two); training/arguments.py:3161-3169: the legacy layer-wise path keeps every parameter in
    # one unpadded buffer and gathers them with flatten/unflatten copies
    "changes the Muon optimizer's state or buffers (remat models Adam as its scalar optimizer and the layer-wise "
    "parameter layout)": "--muon-scalar-optimizer --no-use-layer-wise-param-layout",
    # remat.job_cuda_graphs models --cuda-graph-impl transformer_engine with --cuda-graph-modules; not these
    "keeps static CUDA-graph buffers": "--enable-cuda-graph --external-cuda-graph "
        "--cuda-graph-scope --optimizer-cuda-graph",
    "changes the logits/cross-entropy working set": "--fp16-lm-cross-entropy --output-logit-dtype",
    "changes context-parallel attention (remat models the p2p ring)": "--cp-comm-type "
        "--hierarchical-context-parallel-sizes --hybrid-context-parallel --max-seqlen-per-dp-cp-rank",
    "describes layers remat's reference GPT does not have":
        "--qk-l2-norm --attention-output-gate --squared-relu "
        "--openai-gelu --experimental-attention-variant "
        "--apply-residual-connection-post-layernorm --fp32-residual-connection "
        "--hybrid-layer-pattern --hybrid-override-pattern --is-hybrid-model --enable-mhc-connections "
        "--heterogeneous-layers-config-path --heterogeneous-layers-config-encoded-json --spec "
        "--encoder-num-layers --decoder-num-layers --encoder-seq-length --decoder-seq-length "
        "--mlp-chunks-for-training --tensor-parallel-num-weight-shards",
    "takes the model or batch from elsewhere (give the flags themselves)": "--yaml-cfg --use-checkpoint-args "
        "--use-mp-args-from-checkpoint-args --decrease-batch-size-if-needed",
    "is an old Megatron flag (use --tensor-model-parallel-size / --micro-batch-size)":
        "--model-parallel-size --batch-size",
})
REFUSED_PREFIXES: dict[str, str] = {
    "--moe-": REFUSED_FLAGS["--moe-extended-tp"],
    "--fp8-": "is an FP8 option remat does not model (remat.memory.fp8 models --fp8-format, --fp8-recipe "
              "delayed|tensorwise|blockwise, --fp8-param-gather and the amax flags)",
    # --mtp-num-layers is modelled; the other --mtp- flags change the MTP block (repeated layer, detached heads,
    # hidden-state mixing) in ways remat does not model
    "--fp4-": REFUSED_FLAGS["--fp4-format"], "--mtp-": "changes the multi-token-prediction block",
    "--mla-": REFUSED_FLAGS["--spec"], "--mamba-": REFUSED_FLAGS["--spec"], "--dsa-": REFUSED_FLAGS["--spec"],
    "--mhc-": REFUSED_FLAGS["--spec"],
    "--megatron-fsdp-": "is a Megatron-FSDP option remat does not model (remat.job_fsdp models --use-megatron-fsdp "
                        "with its sharding strategy, dtype and double-buffer flags)",
}
# Values of modelled flags refused with their own reason.
REFUSED_CHOICES: dict[tuple[str, str], str] = {("--moe-flex-dispatcher-backend", "ncclep"): FLEX_REASON,
                                               **{
    ("--cuda-graph-impl", impl): "keeps static CUDA-graph buffers (remat models --cuda-graph-impl transformer_engine)"
    for impl in ("local", "full_iteration")}}
# Accepted (and reported as ignored) only with Megatron's default value.
DEFAULT_ONLY_FLAGS: dict[str, str] = {"--cp-comm-type": "p2p",
                                      "--mlp-chunks-for-training": "1", "--outer-dp-sharding-strategy": "no_shard",
                                      "--muon-scalar-optimizer": "adam"}
# Flags known not to change what a rank holds during a training step: accepted and reported.
IGNORED_FLAGS: dict[str, str] = _table({
    "run length, data and tokenizer": "--train-iters --train-samples --seed --data-path --split --train-data-path "
        "--valid-data-path --test-data-path --data-args-path --per-split-data-args-path --data-cache-path "
        "--mock-data --num-workers --dataloader-type --no-mmap-bin-files --eod-mask-loss --reset-position-ids "
        "--reset-attention-mask --num-dataset-builder-threads "
        "--object-storage-cache-path --vocab-file --merge-file --vocab-extra-ids --trust-remote-code "
        "--chat-template --iterations-to-skip --skip-train",
    "ramps the batch up (memory peaks at the final --global-batch-size, which remat models)": "--rampup-batch-size",
    "learning rate, weight decay and optimizer hyper-parameters": "--lr --min-lr --warmup --decoupled-lr "
        "--decoupled-min-lr --override-opt_param-scheduler --override-opt-param-scheduler "
        "--use-checkpoint-opt_param-scheduler --use-checkpoint-opt-param-scheduler --start-weight-decay "
        "--end-weight-decay --weight-decay-incr-style --weight-decay --clip-grad --adam-beta1 --adam-beta2 "
        "--adam-eps --apply-wd-to-qk-layernorm --no-weight-decay-cond-type --loss-scale --initial-loss-scale "
        "--min-loss-scale --loss-scale-window --hysteresis",
    "initialisation and numerics (same tensors, other values)": "--init-method-std --embedding-init-method-std "
        "--init-method-xavier-uniform --use-cpu-initialization --data-parallel-random-init --no-initialization "
        "--norm-epsilon --apply-layernorm-1p --rotary-base --rotary-percent --rotary-interleaved "
        "--rotary-seq-len-interpolation-factor --use-rope-scaling --rope-scaling-factor --calculate-per-token-loss "
        "--use-mup --disable-bf16-reduced-precision-matmul --flash-attention-version "
        "--mtp-loss-scaling-factor",
    # remat.job_experts.check_op_fuser refuses where the op fuser keeps other tensors
    "runs the grouped experts as TransformerEngine ops that keep the tensors of TE's grouped MLP on Hopper (TE "
    "2.17 ops/basic/grouped_linear.py, swiglu.py; Blackwell's fused CuteDSL kernel is not modelled)":
        "--use-transformer-engine-op-fuser",
    "fused kernels of the same operations (remat prices the reference operations)": "--no-masked-softmax-fusion "
        "--no-bias-gelu-fusion --no-bias-swiglu-fusion --no-bias-dropout-fusion --no-rope-fusion "
        "--no-persist-layer-norm --disable-jit-fuser --use-mcore-models",
    "communication scheduling (the buffers are allocated either way)":
        "--overlap-param-gather-with-optimizer-step --no-align-grad-reduce "
        "--no-align-param-gather --ddp-average-in-collective "
        "--no-gradient-reduce-div-fusion "
        "--overlap-p2p-communication-warmup-flush "
        "--distributed-backend --distributed-timeout-minutes --distributed-timeout-seconds-after-init "
        "--local-rank --nccl-communicator-config-path --use-sharp --sharp-enabled-group --use-tp-pp-dp-mapping "
        "--disable-gloo-process-groups --high-priority-stream-groups --no-overlap-p2p-communication",
    "checkpointing, evaluation (no grad), logging and profiling": "--save --load --save-interval "
        "--persistent-save-interval --save-retain-interval --finetune --pretrained-checkpoint --ckpt-step "
        "--no-load-optim --no-load-rng --no-save-optim --no-save-rng --exit-on-missing-checkpoint --async-save "
        "--async-strategy --use-persistent-ckpt-worker --use-dist-ckpt --auto-detect-ckpt-format --verify-integrity "
        "--no-ckpt-fully-parallel-save --no-ckpt-fully-parallel-load --async-ckpt-use-cpu-shm "
        "--override-ckpt-iteration --eval-iters --eval-interval --start-eval-at-iter --eval-global-batch-size "
        "--eval-micro-batch-size --full-validation --multiple-validation-sets --validation-set-names "
        "--timing-log-level --timing-log-option --logging-level --no-barrier-with-level-1-timing --profile "
        "--profile-step-start --profile-step-end --profile-ranks --use-pytorch-profiler --record-memory-history "
        "--memory-snapshot-path --record-shapes --nvtx-ranges --no-one-logger --app-tag-run-name "
        "--app-tag-run-version --config-logger-dir --run-workload-inspector-server",
    "MoE routing details that change which experts take the tokens, not how many (remat's routing assumption sets "
    "the counts), fused kernels of the same operations, overlap scheduling or initialisation":
        "--moe-router-force-load-balancing "
        "--moe-router-topk-scaling-factor --moe-router-bias-update-rate --moe-token-drop-policy "
        "--moe-router-fusion --moe-shared-expert-overlap --moe-per-layer-logging --moe-use-upcycling "
        "--moe-upcycling-granularity --rotary-scaling-factor --mscale --mscale-all-dim",
    "the load-balancing loss's variant (remat prices the switch loss on the same [tokens, experts] scores when "
    "--moe-aux-loss-coeff > 0)": "--moe-router-load-balancing-type",
    "run control (garbage collection, allocator cache, restarts, checks)": "--manual-gc --manual-gc-interval "
        "--no-manual-gc-eval --empty-unused-memory-level --train-sync-interval "
        "--check-weight-hash-across-dp-replicas-interval --no-check-for-nan-in-loss-and-grad "
        "--check-for-large-grads --check-for-spiky-loss --rerun-mode --error-injection-rate --error-injection-type "
        "--adlr-autoresume --adlr-autoresume-interval --enable-ft-package --calc-ft-timeouts --ft-num-warmup-iters "
        "--enable-msc --disable-msc",
    # megatron/core/transformer/attention.py:1938-1939 runs run_realtime_tests (:1753-1818) in each attention forward:
    # with --qk-layernorm it all-gathers the q/k norms' 4 x [head_dim] weights and biases over dp and tp and compares
    # them (a few 512-byte blocks, freed before the core attention; nothing saved for backward); :1364 only forces
    # the split-QKV path, which q/k norms force already (issue 27: the qk_layernorm_test_mode gap was TE's q/k norms)
    "self-tests that keep no tensors": "--test-mode",
    # fsdp param_and_grad_buffer.py:2163-2260: when and how NCCL registers the pool's buffers (its own memory)
    "how NCCL registers Megatron-FSDP's buffers (when, and as symmetric windows or not): the buffers are the same":
        "--fsdp-manual-registration --disable-symmetric-registration",
    # training/models/dist_utils.py:98-100 builds the model on the meta device; Megatron-FSDP then initialises each
    # module into the buffers it allocates either way (fsdp param_and_grad_buffer.py:2884-2920)
    "initialises the model on the meta device (module by module into Megatron-FSDP's buffers): the buffers a step "
    "runs with are the same, only initialisation's transient memory is smaller": "--init-model-with-meta-device",
    # fused_a2a.py:383-435, hybrid_ep.cu:313-317: the fused permute-dispatch writes the same pre-allocated outputs;
    # token_dispatcher.py:1073-1091 pads to the group's largest token count, which every rank has in remat's model
    "changes HybridEP's kernels (block counts, fused permute), not its tensors or buffers":
        "--moe-hybridep-num-blocks-permute --moe-hybridep-num-blocks-unpermute --moe-permute-fusion-into-hybridep "
        "--moe-hybridep-pad-uneven-dispatch-inputs",
    # TE cpu_offload.py:286-304, 446-452: reuses the pinned host copies from one iteration to the next
    "keeps TransformerEngine's pinned host copies of offloaded activations between iterations (host memory only; "
    "without --cpu-offloading-num-layers nothing is offloaded)": "--cpu-offloading-retain-pinned-cpu-buffers",
    # megatron/core/tensor_parallel/random.py: TE's tracker keeps each RNG state as a few 16-byte CUDA tensors
    "the RNG tracker's implementation (a few bytes of generator state either way)": "--te-rng-tracker",
})
IGNORED_PREFIXES: dict[str, str] = {
    **dict.fromkeys(("--log-", "--tensorboard-", "--wandb-", "--one-logger-", "--otel-", "--straggler-",
                     "--pytorch-profiler-", "--flight-recorder-"), IGNORED_FLAGS["--profile"]),
    **dict.fromkeys(("--lr-", "--muon-", "--lion-", "--mup-"), IGNORED_FLAGS["--lr"]),
    **dict.fromkeys(("--tokenizer-", "--tiktoken-", "--null-tokenizer-", "--fim-"), IGNORED_FLAGS["--data-path"]),
    **dict.fromkeys(("--ckpt-", "--dist-ckpt-", "--non-persistent-"), IGNORED_FLAGS["--save"]),
    **dict.fromkeys(("--exit-", "--inprocess-", "--fault-injector-"), IGNORED_FLAGS["--manual-gc"]),
}
_POSITIVE_INT = ("--num-layers --hidden-size --num-attention-heads --num-query-groups --ffn-hidden-size --kv-channels "
                 "--seq-length --max-position-embeddings --micro-batch-size --global-batch-size --vocab-size "
                 "--padded-vocab-size --make-vocab-size-divisible-by --tensor-model-parallel-size "
                 "--pipeline-model-parallel-size --num-layers-per-virtual-pipeline-stage "
                 "--num-virtual-stages-per-pipeline-rank --context-parallel-size --expert-model-parallel-size "
                 "--expert-tensor-parallel-size --world-size --data-parallel-size --ddp-bucket-size "
                 "--decoder-first-pipeline-num-layers --decoder-last-pipeline-num-layers "
                 "--microbatch-group-size-per-virtual-pipeline-stage --num-distributed-optimizer-instances")
_SWITCHES = ("--group-query-attention --swiglu --untie-embeddings-and-output-weights --disable-bias-linear "
             "--use-flash-attn --use-rotary-position-embeddings --no-pad-vocab-size --disable-pad-vocab-size "
             "--sequence-parallel --bf16 --fp16 --accumulate-allreduce-grads-in-fp32 --grad-reduce-in-bf16 "
             "--use-distributed-optimizer --overlap-grad-reduce --ddp-pad-buckets-for-high-nccl-busbw "
             "--attention-softmax-in-fp32 --apply-query-key-layer-scaling --moe-grouped-gemm --multi-latent-attention "
             "--qk-layernorm --account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split "
             "--no-gradient-accumulation-fusion --overlap-moe-expert-parallel-comm --delay-wgrad-compute "
             "--overlap-param-gather --add-qkv-bias --no-create-attention-mask-in-dataloader")
# MoE and MLA (remat.config's NOTE [MoE fields]; Megatron's names)
_MOE_MLA_INT = ("--num-experts --moe-router-topk --moe-ffn-hidden-size --moe-shared-expert-intermediate-size "
                "--moe-router-num-groups --moe-router-group-topk "
                "--q-lora-rank --kv-lora-rank --qk-head-dim --qk-pos-emb-head-dim --v-head-dim")
MODELLED_FLAGS: dict[str, Any] = {
    **dict.fromkeys(_POSITIVE_INT.split(), int), **dict.fromkeys(_SWITCHES.split(), bool),
    **dict.fromkeys(_MOE_MLA_INT.split(), int), "--moe-layer-freq": str, "--pipeline-model-parallel-layout": str,
    **dict.fromkeys(("--moe-expert-capacity-factor", "--moe-aux-loss-coeff"), float),
    "--moe-router-score-function": ("softmax", "sigmoid"),
    "--rope-type": ("rope", "yarn"),  # MLA's rotary embedding (NOTE [MLA's rotary tables] in remat.memory.workspaces)
    "--moe-token-dispatcher-type": ("alltoall", "allgather", "flex"),  # remat.models.flex_dispatch
    "--moe-flex-dispatcher-backend": ("deepep", "hybridep"),
    "--moe-router-dtype": ("fp32", "fp64"),  # remat.models.moe.RouterGatingLinear
    # the last stage's deferred output-layer weight gradients (remat.job_pipeline.check_wgrad_deferral)
    "--defer-embedding-wgrad-compute": bool, "--wgrad-deferral-limit": lambda v: ascii_int(v, signed=False),
    # remat.models.moe.Router.top_k / z_loss
    "--moe-router-pre-softmax": bool, "--moe-router-enable-expert-bias": bool, "--moe-z-loss-coeff": float,
    "--moe-pad-expert-input-to-capacity": bool,  # remat.models.moe NOTE [padding to capacity]
    "--moe-permute-fusion": bool,  # remat.models.permute NOTE [the permutation maps]
    # training/global_vars.py:168-169 set_experimental_flag: at d98e8a64 the flag only unlocks experimental APIs and,
    # with --moe-permute-fusion, fused kernels of the flex dispatcher and of --moe-router-padding-for-quantization
    # (token_dispatcher.py:651, 1415, 1425): DeepEP's multihot conversion (remat.models.deepep_dispatch) and
    # --moe-router-padding-for-quantization (refused on its own flag); ignored by any other job (remat.job_experts)
    "--enable-experimental": bool,
    # transformer_config.py:1743-1752: deprecated, the deepep backend of the flex dispatcher (its default): ignored
    # once checked (remat.job_experts.moe_mla_fields)
    "--moe-enable-deepep": bool,
    # training/arguments.py:1112-1120: torch.use_deterministic_algorithms(True); changes a rank's memory only through
    # the MoE combine's unfused unpermute (index_add_ instead of scatter_add_: NOTE [the combine's saved source] in
    # remat.models.permute), ignored by any other job (remat.job_model)
    "--deterministic-mode": bool,
    **dict.fromkeys(("--hidden-dropout", "--attention-dropout", "--sgd-momentum"), float),
    "--normalization": ("LayerNorm", "RMSNorm"), "--position-embedding-type": ("learned_absolute", "rope"),
    "--attention-backend": ("auto", "flash", "fused", "unfused", "local"),
    "--transformer-impl": ("transformer_engine", "local"), "--optimizer": ("adam", "sgd", "muon", "dist_muon"),
    # the loss's implementation (remat.models.cross_entropy)
    "--cross-entropy-loss-fusion": bool, "--cross-entropy-fusion-impl": ("native", "te"),
    "--mtp-num-layers": int,  # remat.models.gpt NOTE [multi-token prediction]
    # NOTE [gpt-oss layers] in remat.models.blocks (remat.job_model.gpt_oss_fields)
    "--quick-geglu": bool, "--glu-linear-offset": float, "--activation-func-clamp-value": float,
    "--softmax-type": ("vanilla", "off-by-one", "learnable"), "--window-size": str, "--window-attn-skip-freq": str,
    # read where they matter, else listed as ignored (remat.job_model): the position table's switch, the ModelOpt
    # builder's flags, the batch schedule (its largest batch is priced)
    "--no-position-embedding": bool, "--export-force-local-attention": bool, "--enable-gpt-oss": bool,
    "--step-batch-size-schedule": str,
    # FP8 linears (remat.job_fp8, remat.memory.fp8): Hopper's and Blackwell's recipes (custom refused)
    "--fp8-format": ("e4m3", "hybrid"), "--fp8-recipe": ("delayed", "tensorwise", "blockwise", "mxfp8"),
    "--fp8-param-gather": bool, "--first-last-layers-bf16": bool,
    **dict.fromkeys(("--num-layers-at-start-in-bf16", "--num-layers-at-end-in-bf16"),
                    lambda v: ascii_int(v, signed=False)),
    "--fp8-amax-history-len": int, "--fp8-amax-compute-algo": ("max", "most_recent"), "--fp8-margin": int,
    "--fp8-interval": int,
    # TE CUDA graphs (remat.job_cuda_graphs; --cuda-graph-modules takes words, read by flag_value)
    "--cuda-graph-impl": ("none", "transformer_engine"), "--cuda-graph-modules": str,
    "--cuda-graph-warmup-steps": lambda v: ascii_int(v, signed=False),
    # TP communication overlap (remat.job_tp_overlap): TE's userbuffers and what they change in the linears
    "--tp-comm-overlap": bool, "--tp-comm-overlap-cfg": str, "--tp-comm-overlap-rs-dgrad": bool,
    **{f"--{p}-tp-comm-{n}": bool for p in ("no", "disable")
       for n in ("bulk-wgrad", "bulk-dgrad", "overlap-ag", "overlap-rs", "split-ag", "split-rs")},
    "--tp-comm-bootstrap-backend": ("nccl", "mpi", "gloo"),
    # Megatron-FSDP (remat.job_fsdp); no_shard and low-precision main weights are refused by the choices
    "--use-megatron-fsdp": bool, "--data-parallel-sharding-strategy": ("optim", "optim_grads", "optim_grads_params"),
    "--megatron-fsdp-main-params-dtype": ("fp32",), "--fsdp-double-buffer": bool, "--use-nccl-ub": bool,
    **dict.fromkeys(("--megatron-fsdp-main-grads-dtype", "--megatron-fsdp-grad-comm-dtype"),
                    ("fp32", "bf16", "fp16", "auto")),
    # torch FSDP2 (remat.job_fsdp, remat.memory.torch_fsdp2); --ckpt-format is read for Megatron's checks on it
    "--use-torch-fsdp2": bool, "--torch-fsdp2-no-reshard-after-forward": bool, "--ckpt-format": str,
}
# The size each integer flag sets (a key of remat.limits.CEILINGS): refused above its ceiling as it is read
SIZE_OF_FLAG: dict[str, str] = {
    "--num-layers": "num_layers", "--num-layers-per-virtual-pipeline-stage": "num_layers",
    "--decoder-first-pipeline-num-layers": "num_layers", "--decoder-last-pipeline-num-layers": "num_layers",
    "--mtp-num-layers": "num_layers", "--hidden-size": "hidden_size", "--kv-channels": "hidden_size",
    **dict.fromkeys(("--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim", "--v-head-dim"),
                    "hidden_size"),
    **dict.fromkeys(("--ffn-hidden-size", "--moe-ffn-hidden-size", "--moe-shared-expert-intermediate-size"),
                    "ffn_hidden_size"),
    "--num-attention-heads": "num_attention_heads", "--num-query-groups": "num_attention_heads",
    "--seq-length": "seq_length", "--max-position-embeddings": "seq_length", "--micro-batch-size": "micro_batch_size",
    **dict.fromkeys(("--vocab-size", "--padded-vocab-size", "--make-vocab-size-divisible-by"), "vocab_size"),
    "--num-experts": "num_moe_experts", "--moe-router-topk": "num_moe_experts",
    "--moe-router-num-groups": "num_moe_experts", "--moe-router-group-topk": "num_moe_experts",
    "--tensor-model-parallel-size": "tp", "--expert-tensor-parallel-size": "tp", "--pipeline-model-parallel-size": "pp",
    "--num-virtual-stages-per-pipeline-rank": "vpp", "--context-parallel-size": "cp",
    "--expert-model-parallel-size": "ep", "--world-size": "world_size", "--data-parallel-size": "dp",
    "--num-distributed-optimizer-instances": "dp",
    "--microbatch-group-size-per-virtual-pipeline-stage": "num_microbatches",
    "--wgrad-deferral-limit": "num_microbatches",
}
# Recompute flags go to Policy.from_megatron_args (value counts checked here; other --recompute-* there).
RECOMPUTE_FLAGS = {"--recompute-granularity": 1, "--recompute-method": 1, "--recompute-num-layers": 1,
              "--recompute-modules": "+", "--recompute-activations": 0, "--distribute-saved-activations": 0,
              "--checkpoint-activations": 0, "--moe-layer-recompute": 0,
              # Megatron's fine-grained activation offloading is a part of the Policy too (remat.offload_policy)
              "--fine-grained-activation-offloading": 0, "--offload-modules": "+", "--min-offloaded-tensor-size": 1,
              # and TransformerEngine's layer offloading (remat.recompute.layer_offload)
              "--cpu-offloading-num-layers": 1}


def classify_megatron_flag(name: str, values: Sequence[str] | None = None) -> tuple[str, str]:
    """How remat treats one Megatron-LM flag.

    Args:
        name: the flag, e.g. ``"--lr"`` (a ``=value`` part is dropped).
        values: its values, when known: a modelled flag whose one value is a choice remat does not model
            (``--moe-token-dispatcher-type flex``) is ``refused``, like the flags remat does not model.

    Returns:
        ``(kind, reason)`` with kind ``recompute``, ``modelled``, ``default-only`` (ignored with Megatron's default
        value, refused otherwise), ``ignored``, ``refused`` or ``unknown`` (refused too).

    Example:
        >>> classify_megatron_flag("--fp4-format")[0], classify_megatron_flag("--fp8-recipe", ["custom"])[0]
        ('refused', 'refused')
    """
    name = name.partition("=")[0]
    if name in RECOMPUTE_FLAGS or name.startswith("--recompute-"):
        return "recompute", "a recompute flag (remat.policy)"
    if name in MODELLED_FLAGS:
        spec = MODELLED_FLAGS[name]
        if isinstance(spec, tuple) and values is not None and len(values) == 1 and values[0] not in spec:
            if (name, values[0]) in REFUSED_CHOICES:
                return "refused", f"{shown_flag(values[0])} {REFUSED_CHOICES[name, values[0]]}"
            return "refused", (f"{shown_flag(values[0])} (remat models only {', '.join(spec)}: the others change "
                               "memory in ways remat does not model)")
        return "modelled", "part of the Job"
    if name in DEFAULT_ONLY_FLAGS:
        return "default-only", REFUSED_FLAGS[name]
    for kind, table in (("refused", REFUSED_FLAGS), ("ignored", IGNORED_FLAGS)):
        if name in table:
            return kind, table[name]
    for kind, prefixes in (("refused", REFUSED_PREFIXES), ("ignored", IGNORED_PREFIXES)):
        for prefix, reason in prefixes.items():
            if name.startswith(prefix):
                return kind, reason
    return "unknown", "not classified"


def known_megatron_flags() -> list[str]:
    """Every flag the tables name (modelled, recompute, ignored, default-only, refused), sorted."""
    return sorted({*MODELLED_FLAGS, *RECOMPUTE_FLAGS, *IGNORED_FLAGS, *DEFAULT_ONLY_FLAGS, *REFUSED_FLAGS})


def shown_flag(name: str, limit: int = 60) -> str:
    """``name`` as a message shows it: as typed when printable, else its repr (a newline inside would cut the
    one-line message); cut to ``limit`` characters."""
    text = name if name.isprintable() else repr(name)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def suggest_flag(name: str, known: Sequence[str] = ()) -> str | None:
    """The known flag ``name`` most likely misspells (``'--num-layer'`` -> ``'--num-layers'``,
    ``'--sequence_parallel'`` -> ``'--sequence-parallel'``), or None.

    Args:
        name: a flag none of the tables name (a ``=value`` part is dropped).
        known: the flags to choose from (default :func:`known_megatron_flags`).
    """
    flag = name.partition("=")[0].strip()
    if not flag.isprintable() or len(flag) > 100:
        return None
    known = list(known) or known_megatron_flags()
    dashed = "--" + flag.lstrip("-").replace("_", "-").lower()  # Megatron's names use dashes
    if dashed in known and dashed != flag:
        return dashed
    close = difflib.get_close_matches(dashed, known, n=1, cutoff=0.8)
    return close[0] if close else None


def unknown_flag_message(name: str) -> str:
    """The refusal of a flag none of the tables name: a likely misspelling is named first."""
    guess = suggest_flag(name)
    hint = f"did you mean {guess}? If not, " if guess else ""
    return (f"remat does not know whether {shown_flag(name)} changes memory; {hint}remove it, or have it classified "
            "in remat.job_flags (IGNORED_FLAGS if it does not change memory, REFUSED_FLAGS if it does)")


def split_flags(text: str, source: str) -> list[str]:
    text = text.replace("\\\r\n", " ").replace("\\\n", " ")
    try:
        return shlex.split(text, comments=True)
    except ValueError as err:
        raise JobError(f"cannot split {source} into flags: {err}: close (or escape) the quote") from None


def load_megatron_args(path: str | Path) -> list[str]:
    """The flags in a plain-text file (the ``--megatron-args @file`` form); nothing in it is executed.

    Args:
        path: a text file of Megatron flags, split like a shell line: ``#`` comments, newlines and backslash
            continuations allowed, no variable expansion. ``@file`` inside it is refused.

    Returns:
        The tokens, e.g. ``["--num-layers", "24", ...]``.

    Example:
        >>> load_megatron_args("llama.args")  # doctest: +SKIP
        ['--num-layers', '32', '--hidden-size', '4096']
    """
    try:
        text = read_input_text(path)  # at most MAX_INPUT_FILE_BYTES (remat.limits): @/dev/zero is refused
    except (OSError, UnicodeDecodeError) as err:
        raise JobError(f"cannot read the Megatron args file {str(path)!r} ({err}): give a UTF-8 text file of "
                       "flags") from None
    tokens = split_flags(text, f"the Megatron args file {str(path)!r}")
    nested = [t for t in tokens if t.startswith("@")]
    if nested:
        raise JobError(f"the Megatron args file {str(path)!r} names another file {nested[0]!r}: nested @files are "
                       "not supported; paste its flags in")
    return tokens


def launch_tokens(argv: Sequence[str] | str) -> tuple[list[str], list[str]]:
    """(the launcher's tokens up to and with the training script, Megatron's flags) of a command line (a string or
    tokens), ``@file`` tokens read."""
    if isinstance(argv, str):
        tokens = split_flags(argv, "the Megatron command line")
    elif isinstance(argv, Sequence) and all(isinstance(t, str) for t in argv):
        tokens = list(argv)
    else:
        raise JobError(f"Megatron args must be a string or a list of strings, got {argv!r}")
    tokens = [t for tok in tokens for t in (load_megatron_args(tok[1:]) if tok.startswith("@") else [tok])]
    script = next((i for i, t in enumerate(tokens) if t.endswith(".py")), None)
    return (tokens[:script + 1], tokens[script + 1:]) if script is not None else ([], tokens)


def flag_tokens(argv: Sequence[str] | str) -> tuple[list[str], list[str]]:
    """(Megatron's flags, [the launch line up to the training script] or [])."""
    launch, flags = launch_tokens(argv)
    return flags, [" ".join(launch)] if launch else []


def flag_groups(tokens: Sequence[str]) -> list[tuple[str, list[str]]]:
    """Megatron's flags as ``(flag, values)``: each ``--flag`` with the tokens up to the next ``--flag`` (or its
    ``=value``). A token before any flag raises :class:`JobError`."""
    groups: list[tuple[str, list[str]]] = []
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if not tok.startswith("--"):
            raise JobError(f"unexpected {tok!r}: Megatron takes only --flags, each followed by its value(s)")
        name, eq, inline = tok.partition("=")
        vals, i = ([inline] if eq else []), i + 1
        while not eq and i < len(tokens) and not tokens[i].startswith("--"):
            vals.append(tokens[i])
            i += 1
        groups.append((name, vals))
    return groups


def check_value_count(name: str, vals: list[str], n: int | str) -> None:
    if n == 0 and vals:
        raise JobError(f"{name} takes no value, got {' '.join(vals)!r}: write just {name}")
    if n == 1 and len(vals) != 1:
        raise JobError(f"{name} needs one value, got {len(vals)} ({' '.join(vals) or 'none'}): e.g. {name} 2")
    if n == "+" and not vals:
        raise JobError(f"{name} needs at least one value")


def flag_value(name: str, vals: list[str]) -> Any:
    spec = MODELLED_FLAGS[name]
    if name == "--step-batch-size-schedule" and len(vals) > 1:  # argparse: one string; the rest is unrecognized
        raise JobError(f"--step-batch-size-schedule got {len(vals)} words ({' '.join(vals)[:80]}): Megatron's argparse "
                       f"takes one and stops at 'unrecognized arguments: {' '.join(vals[1:])[:60]}' (an unquoted "
                       "expansion split it): quote the schedule, e.g. \"${TRAINING_ARGS[@]}\"")
    if name == "--cuda-graph-modules":  # nargs='+' (training/arguments.py:2050): the words (remat.job_cuda_graphs)
        return tuple(vals)
    check_value_count(name, vals, 0 if spec is bool else 1)
    if spec is bool:
        return True
    v = vals[0]
    if isinstance(spec, tuple):
        if v not in spec:
            raise JobError(f"{name} {v}: remat models only {', '.join(spec)} (the others change memory in ways "
                           "remat does not model)")
        return v
    # digits 0-9 only (NOTE [ASCII digits] in remat.units)
    out = ascii_int(v) if spec is int else ascii_float(v) if spec is float else spec(v)
    if out is None or (spec is int and out < 1):
        raise JobError(f"{name} needs {'a positive integer' if spec is int else 'a number'}, got {v!r}")
    if name in SIZE_OF_FLAG and (too_big := ceiling_problem(SIZE_OF_FLAG[name], out)):
        raise JobError(f"{name} {v} {too_big}")
    return out


# megatron/core/transformer/transformer_config.py::__post_init__ checks --recompute-method and
# --recompute-num-layers only inside ``if self.recompute_granularity is not None``: without a granularity they are
# accepted and do nothing (Megatron-LM's own gpt3_mcore_reruns_resume_check_grads test passes
# --recompute-num-layers 1 alone).
_GRANULARITY_FLAGS = ("--recompute-granularity", "--recompute-activations", "--checkpoint-activations")


def without_idle_recompute_flags(recompute: list[str], ignored: list[str]) -> list[str]:
    """``recompute`` (flags and values) less the method and layer count when no granularity is given, which
    Megatron ignores; those go to ``ignored``.

    Example:
        >>> ignored = []
        >>> without_idle_recompute_flags(["--recompute-num-layers", "1"], ignored), ignored
        ([], ['--recompute-num-layers'])
    """
    if any(flag in recompute for flag in _GRANULARITY_FLAGS):
        return recompute
    kept: list[str] = []
    tokens = iter(recompute)
    for token in tokens:
        if token in ("--recompute-method", "--recompute-num-layers"):
            ignored.append(token)
            next(tokens, None)
        else:
            kept.append(token)
    return kept
