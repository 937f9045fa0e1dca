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
from remat.config import ConfigError, ModelConfig
from remat.job_experts import check_op_fuser, moe_mla_fields
from remat.job_flags import JobError

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
            vocab = -(-vocab // multiple) * multiple
    try:
        model = ModelConfig(**job_loss.loss_fields(got, ignored),
            num_layers=L, hidden_size=h, num_attention_heads=a, num_query_groups=got.get("--num-query-groups", 1)
            if gqa else None, ffn_hidden_size=ffn, vocab_size=vocab, seq_length=s, micro_batch_size=mbs,
            activation="swiglu" if swiglu else "gelu", normalization=got.get("--normalization", "LayerNorm").lower(),
            position="rope" if pe == "rope" else "learned", attention="math" if unfused else "sdpa",
            hidden_dropout=got.get("--hidden-dropout", 0.1), attention_dropout=got.get("--attention-dropout", 0.1),
            dtype=precision, tie_embeddings=not got.get("--untie-embeddings-and-output-weights"),
            add_bias_linear=not got.get("--disable-bias-linear"), kv_channels=kv, **local_fields,
            **moe_mla_fields(got, tp=tp))
    except ConfigError as err:
        raise JobError(f"the model flags describe an invalid model: {err}") from None
    check_op_fuser(got, ignored, model)
    return model
