"""The model part of a Megatron-LM command line: the flags that shape the GPT each rank builds, read into a
:class:`~remat.config.ModelConfig` (:func:`model_from_flags`); :func:`remat.job.parse_megatron_args` reads the rest.

Decisions (facts from NVIDIA/Megatron-LM at d98e8a6, files cited where they matter): Megatron's defaults for an
absent ``--ffn-hidden-size`` (swiglu: ``int(8h/3 / 64) * 64``, else 4h) and ``--kv-channels`` (h / heads); the
vocabulary padded to ``--make-vocab-size-divisible-by`` x tp (GPT-2's 50257 tokens assumed, with a warning, when
the command line names only a tokenizer file); ``--attention-backend unfused`` is TransformerEngine's unfused
attention (remat's ``math``), every other backend its fused kernels (``sdpa``); ``--transformer-impl local`` (or
``--attention-backend local``) is Megatron's local layers (``transformer_impl='local'``, traced with the ``local``
kernel profile, :mod:`remat.memory.local_layers`), whose attention reads ``--no-masked-softmax-fusion``,
``--attention-softmax-in-fp32`` and ``--apply-query-key-layer-scaling``; the loss is Megatron's
(:mod:`remat.job_loss`); MoE and MLA flags are :mod:`remat.job_experts`'.
"""

from __future__ import annotations

import warnings
from typing import Any

from remat import job_loss
from remat.config import ConfigError, ModelConfig, parse_layer_freq
from remat.job_experts import check_op_fuser, moe_mla_fields
from remat.job_flags import JobError
from remat.units import round_up

DEFAULT_VOCAB_SIZE = 50257  # GPT-2 BPE, the tokenizer of Megatron's GPT examples


def model_from_flags(got: dict[str, Any], ignored: list[str], precision: str) -> ModelConfig:
    """The model ``got`` (flag -> parsed value) describes, in ``precision``; flags accepted without effect are
    appended to ``ignored``. The five required flags (``--num-layers`` ...) are in ``got``.

    Example:
        >>> model_from_flags({"--num-layers": 2, "--hidden-size": 64, "--num-attention-heads": 4,
        ...                   "--seq-length": 32, "--micro-batch-size": 1, "--vocab-size": 1000}, [], "bf16").vocab_size
        1024
    """
    L, h, a, s, mbs = (got[k] for k in ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length",
                                        "--micro-batch-size"))
    tp = got.get("--tensor-model-parallel-size", 1)
    swiglu, gqa = bool(got.get("--swiglu")), bool(got.get("--group-query-attention"))
    if "--num-query-groups" in got and not gqa:
        raise JobError("--num-query-groups without --group-query-attention: Megatron ignores it (one K/V group per "
                       "head); add --group-query-attention or drop it")
    ffn = got.get("--ffn-hidden-size")
    if ffn is None:  # megatron/training/arguments.py::validate_args: swiglu -> int(8h/3 / 64) * 64, else 4h
        ffn = int((4 * h * 2 / 3) / 64) * 64 if swiglu else 4 * h
        if ffn < 1:
            raise JobError(f"Megatron's default --ffn-hidden-size for --swiglu with --hidden-size {h} is 0: "
                           "give --ffn-hidden-size")
    kv = got.get("--kv-channels")
    kv = None if kv is not None and h % a == 0 and kv == h // a else kv  # the default head dimension
    pe = "rope" if got.get("--use-rotary-position-embeddings") else got.get("--position-embedding-type",
                                                                            "learned_absolute")
    if got.get("--no-position-embedding"):  # args.add_position_embedding: no megatron-core module reads it
        if pe != "rope":  # (LanguageModelEmbedding derives its own from position_embedding_type, :47)
            raise JobError("--no-position-embedding without rope: Megatron raises '--no-position-embedding is "
                           "deprecated, use --position-embedding-type' (training/arguments.py:1633): use "
                           "--position-embedding-type rope, or drop it")
        ignored.append("--no-position-embedding")
    maxpos = got.get("--max-position-embeddings", s)
    if maxpos < s or (maxpos > s and pe == "learned_absolute"):
        raise JobError(f"--max-position-embeddings {maxpos} with --seq-length {s}: Megatron requires >= and its "
                       f"learned position table has that many rows (remat's: {s}); use --max-position-embeddings {s}")
    # --attention-backend local needs the local spec (megatron/training/arguments.py:436): either flag builds
    # Megatron's local layers (remat.memory.local_layers), whose attention reads the softmax flags below
    local = "local" in (got.get("--attention-backend"), got.get("--transformer-impl"))
    local_fields = {"transformer_impl": "local", "masked_softmax_fusion": "--no-masked-softmax-fusion" not in ignored,
                    "attention_softmax_in_fp32": bool(got.get("--attention-softmax-in-fp32")),
                    "apply_query_key_layer_scaling": bool(got.get("--apply-query-key-layer-scaling"))} if local else {}
    if local:
        ignored[:] = [n for n in ignored if n != "--no-masked-softmax-fusion"]  # read by the local attention
    if (unfused := got.get("--attention-backend") == "unfused") and got.get("--use-flash-attn"):
        raise JobError("--use-flash-attn contradicts --attention-backend unfused: keep one")
    te_fp16_scaling = unfused and precision == "fp16" and not local  # TE: rescales fp16 scores only
    if got.get("--apply-query-key-layer-scaling") and te_fp16_scaling:
        raise JobError("--apply-query-key-layer-scaling rescales TE's unfused fp16 attention scores (an fp32 copy "
                       "when its fused softmax cannot run), which remat does not model: drop it")
    # TEDotProductAttention never passes attention_softmax_in_fp32 to TE (Megatron's local attention reads it)
    ignored += [n for n in ("--attention-softmax-in-fp32", "--apply-query-key-layer-scaling") if got.get(n)
                and not local]
    if "--padded-vocab-size" in got:
        vocab = got["--padded-vocab-size"]
    else:
        vocab = got.get("--vocab-size")
        if vocab is None:
            warnings.warn(f"no --vocab-size (Megatron reads it from the tokenizer, which remat cannot): assuming "
                          f"GPT-2's {DEFAULT_VOCAB_SIZE} tokens; give --vocab-size or --padded-vocab-size",
                          stacklevel=3)
            vocab = DEFAULT_VOCAB_SIZE
        if not (got.get("--no-pad-vocab-size") or got.get("--disable-pad-vocab-size")):
            multiple = got.get("--make-vocab-size-divisible-by", 128) * tp  # build_tokenizer.vocab_size_with_padding
            vocab = round_up(vocab, multiple)
    activation = "swiglu" if swiglu else "quick_geglu" if got.get("--quick-geglu") else "gelu"
    # the unfused rotary embedding (NOTE [unfused rope] in remat.models.blocks): --no-rope-fusion, and any position
    # type but rope (arguments.py:1628-1629 turns the fusion off), which matters to MLA: it rotates either way
    rotates = pe == "rope" or bool(got.get("--multi-latent-attention"))
    rope_fusion = not rotates or (pe == "rope" and "--no-rope-fusion" not in ignored)
    if rotates:
        ignored[:] = [n for n in ignored if n != "--no-rope-fusion"]
    qkv_bias = bool(got.get("--add-qkv-bias"))  # attention.py:1698: linear_qkv's bias only
    if qkv_bias and got.get("--multi-latent-attention"):  # MLA's projections read add_bias_linear only (:226, 517-611)
        ignored.append("--add-qkv-bias")
        qkv_bias = False
    try:
        model = ModelConfig(**job_loss.loss_fields(got, ignored),
            num_layers=L, hidden_size=h, num_attention_heads=a, num_query_groups=got.get("--num-query-groups", 1)
            if gqa else None, ffn_hidden_size=ffn, vocab_size=vocab, seq_length=s, micro_batch_size=mbs,
            activation=activation, normalization=got.get("--normalization", "LayerNorm").lower(),
            position="rope" if pe == "rope" else "learned", attention="math" if unfused else "sdpa",
            hidden_dropout=got.get("--hidden-dropout", 0.1), attention_dropout=got.get("--attention-dropout", 0.1),
            dtype=precision, tie_embeddings=not got.get("--untie-embeddings-and-output-weights"),
            add_bias_linear=not got.get("--disable-bias-linear"), add_qkv_bias=qkv_bias, kv_channels=kv,
            apply_rope_fusion=rope_fusion, **local_fields,
            **moe_mla_fields(got, tp=tp), **gpt_oss_fields(got, ignored))
    except ConfigError as err:
        raise JobError(f"the model flags describe an invalid model: {err}") from None
    check_op_fuser(got, ignored, model)
    if "--enable-experimental" in got and not model.enable_experimental:  # remat.job_experts.moe_mla_fields
        ignored.append("--enable-experimental")
    if "--deterministic-mode" in got and not model.deterministic_algorithms:  # remat.job_experts.moe_mla_fields
        ignored.append("--deterministic-mode")
    if got.get("--moe-enable-deepep"):  # the flex dispatcher's default backend, checked by moe_mla_fields
        ignored.append("--moe-enable-deepep")
    if "--moe-flex-dispatcher-backend" in got and model.moe_token_dispatcher_type != "flex":
        ignored.append("--moe-flex-dispatcher-backend")  # read only under flex (token_dispatcher.py:1831-1860)
    check_gpt_oss_job(got, ignored, model)
    return model


def gpt_oss_fields(got: dict[str, Any], ignored: list[str]) -> dict[str, Any]:
    """The ModelConfig fields of NOTE [gpt-oss layers] (remat.models.blocks) ``got`` gives: ``--quick-geglu`` with
    its offset, clamp and fusion (``--no-bias-gelu-fusion`` read from ``ignored``), ``--softmax-type``,
    ``--window-size`` and ``--window-attn-skip-freq``; the ModelOpt builder's flags go to ``ignored``."""
    for flag in ("--export-force-local-attention", "--enable-gpt-oss"):
        if got.get(flag):
            if "--load" in ignored:  # a ModelOpt checkpoint there switches the builder; remat cannot tell
                raise JobError(f"{flag} with --load: when --load holds a ModelOpt checkpoint, pretrain_gpt.py builds "
                               "ModelOpt's layer spec (model_provider.py:55, post_training/utils.py:25), which reads "
                               f"{flag} (post_training/model_builder.py:298 YaRN rope, :353 local attention) and "
                               "which remat does not model; without one it is never read: drop the flag")
            ignored.append(flag)  # read only by post_training/model_builder.py; gpt_builder never reads it
    fields: dict[str, Any] = {}
    if got.get("--quick-geglu"):
        if got.get("--swiglu"):
            raise JobError("--quick-geglu with --swiglu: Megatron asserts not both (training/argument_utils.py:324): "
                           "keep one")
        fields = {"glu_linear_offset": got.get("--glu-linear-offset", 0.0),
                  "activation_func_clamp_value": got.get("--activation-func-clamp-value"),
                  "bias_activation_fusion": "--no-bias-gelu-fusion" not in ignored}  # argument_utils.py:320
    else:
        for flag in ("--glu-linear-offset", "--activation-func-clamp-value"):
            if flag in got:
                raise JobError(f"{flag} without --quick-geglu: remat models it for --quick-geglu only (SwiGLU's clamp "
                               "and offset run other kernels): drop it, or add --quick-geglu")
    fields["softmax_type"] = got.get("--softmax-type", "vanilla")
    if "--window-size" in got:
        text = got["--window-size"]
        try:  # training/arguments.py:377 tuple_type
            window = tuple(int(w) for w in text.strip("()").split(","))
        except ValueError:
            window = ()
        if len(window) != 2 or min(window) < -1:
            raise JobError(f"--window-size {text!r}: give two integers >= -1, left and right, e.g. 127,0")
        fields["window_size"] = window
        if "--window-attn-skip-freq" in got:
            try:
                fields["window_attn_skip_freq"] = parse_layer_freq(got["--window-attn-skip-freq"], got["--num-layers"])
            except ConfigError as err:
                raise JobError(f"--window-attn-skip-freq: {err}") from None
    elif "--window-attn-skip-freq" in got:
        ignored.append("--window-attn-skip-freq")  # utils.py:535: no window, no window layer
    return fields


def check_gpt_oss_job(got: dict[str, Any], ignored: list[str], model: ModelConfig) -> None:
    """Refuse what Megatron or TransformerEngine 2.17.1 refuse for the gpt-oss layers, or what remat does not route."""
    sink, window = model.softmax_type != "vanilla", model.window_size is not None
    backend = got.get("--attention-backend", "auto")
    if model.activation == "quick_geglu" and model.bias_activation_fusion and (
            not all(model.moe_layer_pattern()) or model.moe_shared_expert_intermediate_size is not None):
        raise JobError("--quick-geglu with the bias-gelu fusion on (Megatron's default) in a dense MLP: Megatron "
                       "raises 'Only support fusion of gelu and swiglu' (transformer/mlp.py:297; remat models the "
                       "fused quick-geglu of the routed experts only): add --no-bias-gelu-fusion")
    if sink and backend == "flash":  # TE utils.py:1027: no FlashAttention for a sink; Megatron turns the rest off
        raise JobError(f"--softmax-type {model.softmax_type} with --attention-backend flash: TransformerEngine has no "
                       "flash kernel for attention sinks (dot_product_attention/utils.py:1027) and raises 'No dot "
                       "product attention backend is available': use --attention-backend auto")
    if window and backend == "fused" and model.attention_dropout > 0:  # utils.py:1257
        raise JobError("--window-size with --attention-backend fused and attention dropout: TransformerEngine's fused "
                       "attention takes a sliding window only without dropout (dot_product_attention/utils.py:1257) "
                       "and raises 'No dot product attention backend is available': use --attention-backend auto or "
                       "--attention-dropout 0")
    if (sink or window) and got.get("--context-parallel-size", 1) > 1:
        raise JobError("--softmax-type / --window-size with context parallelism: remat does not model TE's "
                       "context-parallel attention with sinks or windows: drop one")
    if sink and got.get("--deterministic-mode"):  # utils.py:1431: the unfused attention then, which remat does not
        raise JobError("--softmax-type with --deterministic-mode: TransformerEngine turns its fused attention off for "
                       "sinks when deterministic (dot_product_attention/utils.py:1431), which remat does not route: "
                       "drop one")


def global_batch_size(got: dict[str, Any], mbs: int, dp: int) -> int:
    """The global batch a step holds: ``--global-batch-size`` (default mbs x dp), or the largest batch of
    ``--step-batch-size-schedule`` (core/num_microbatches_calculator.py:402: 'THRESHOLD:BS ...', K/M/B/T suffixes;
    Megatron's global_batch_size is its last entry, :444), whose step runs the most microbatches."""
    text = got.get("--step-batch-size-schedule")
    if text is None:
        return got.get("--global-batch-size", mbs * dp)
    if "--global-batch-size" in got:
        raise JobError("--step-batch-size-schedule with --global-batch-size: Megatron raises 'Cannot specify both "
                       "--step-batch-size-schedule and --global-batch-size' (training/arguments.py:698): drop "
                       "--global-batch-size (the schedule sets each step's batch)")
    entries = [entry.partition(":") for entry in text.strip().replace(",", " ").split()]
    scale = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}
    try:  # _parse_numeric_value (:484): int(float(value) * multiplier)
        pairs = [tuple(int(float(v[:-1] if v[-1:] in scale else v) * scale.get(v[-1:], 1))
                       for v in (t.strip().upper(), b.strip().upper())) for t, colon, b in entries if colon]
    except (ValueError, OverflowError):
        pairs = []
    if not pairs or len(pairs) != len(entries) or min(pairs)[0] != 0 or min(b for _, b in pairs) < 1:
        raise JobError(f"--step-batch-size-schedule {text!r}: write 'THRESHOLD:BATCH ...' starting at threshold 0 "
                       "with positive batches, e.g. '0:16 2.4B:320 12B:1536'")
    batch = max(b for _, b in pairs)
    if batch % (mbs * dp):  # update(consistency_check=True), :590
        raise JobError(f"--step-batch-size-schedule: its batch {batch} is not divisible by --micro-batch-size {mbs} x "
                       f"data-parallel size {dp}: Megatron asserts whole microbatches; use multiples of {mbs * dp}")
    return batch
