"""The mixture-of-experts and multi-latent-attention part of a Megatron-LM job's flags: read into
:class:`~remat.config.ModelConfig` fields (:func:`moe_mla_fields`) and written back (:func:`moe_mla_args`), so that
:func:`remat.job.parse_megatron_args` and :meth:`remat.job.Job.to_megatron_args` round-trip MoE and MLA models.

Decisions (Megatron-LM's ``pretrain_gpt.py`` flags, megatron-core 0.16 layer specs):

* ``--num-experts`` makes the model MoE; every other ``--moe-*`` flag below needs it. Defaults are Megatron's:
  top-2 softmax routing, experts of ``--ffn-hidden-size``, MoE in every layer, no shared expert, no capacity
  factor, aux-loss coefficient 0.
* The token dispatcher (``moe_token_dispatcher_type``): ``alltoall``, or Megatron's default ``allgather``
  (:mod:`remat.models.allgather_dispatch`: every tp x ep rank's tokens gathered; on one rank it permutes as the
  all-to-all one). ``--moe-router-dtype`` fp32/fp64 sets ``moe_router_dtype`` (fp32 logits and probabilities).
* ``--qk-layernorm`` sets ``qk_layernorm``: the standard attention's per-head q/k norms, or MLA's q/kv norms, which
  Megatron's MLA layer spec builds only with it (``q_layernorm=qk_norm if qk_layernorm else IdentityOp``); stored
  as None when it equals the attention's default (MLA: norms; standard: none), so the round trip is exact.
  ``--kv-lora-rank`` must be given with MLA
  (remat does not assume a default); ``--qk-head-dim`` 128, ``--qk-pos-emb-head-dim`` 64 and ``--v-head-dim`` 128
  default to megatron-core's ``MLATransformerConfig`` values.
* The routing assumption (``moe_routing_assumption``) is remat's prediction setting, not a training flag: it is
  neither read nor written here.
"""

from __future__ import annotations

import math
from typing import Any

from remat.config import ConfigError, ModelConfig, parse_layer_freq
from remat.job_flags import JobError

# ranks HybridEP / DeepEP reach over NVLink on an H100/H200 node (DeepEP configs.cuh:3 NUM_MAX_NVL_PEERS; HybridEP
# detects the peers it can map, hybrid_ep_buffer.py:61-72): beyond them both add RDMA buffers remat does not model
NVLINK_DOMAIN = 8

_MOE_FLAGS = ("--moe-router-topk", "--moe-ffn-hidden-size", "--moe-shared-expert-intermediate-size",
              "--moe-grouped-gemm", "--moe-layer-freq", "--moe-router-score-function",
              "--moe-expert-capacity-factor", "--moe-aux-loss-coeff", "--moe-token-dispatcher-type",
              "--moe-router-dtype", "--moe-router-pre-softmax", "--moe-router-enable-expert-bias", "--moe-z-loss-coeff",
              "--moe-router-num-groups", "--moe-router-group-topk",
              "--moe-flex-dispatcher-backend",
              "--moe-pad-expert-input-to-capacity", "--moe-permute-fusion", "--moe-enable-deepep")
_MLA_FLAGS = ("--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim", "--v-head-dim")


def moe_mla_fields(got: dict[str, Any], *, tp: int) -> dict[str, Any]:
    """The :class:`ModelConfig` fields the MoE and MLA flags in ``got`` (flag -> parsed value) set.

    ``expert_model_parallel_size`` is not among them: the job sets it from ``--expert-model-parallel-size``
    (:meth:`remat.job.Job.build`). Raises :class:`JobError` naming the flag for what Megatron or remat refuses.
    """
    out: dict[str, Any] = {}
    experts = got.get("--num-experts")
    if experts is None:
        stray = [f for f in _MOE_FLAGS if f in got]
        if stray:
            raise JobError(f"{stray[0]} needs MoE layers: add --num-experts N, or drop {stray[0]}")
    else:
        out.update(moe_token_dispatcher_type=got.get("--moe-token-dispatcher-type", "allgather"),
                   # read by Megatron only under flex (token_dispatcher.py:1831-1860); its default is deepep
                   moe_flex_dispatcher_backend=got.get("--moe-flex-dispatcher-backend", "deepep")
                   if got.get("--moe-token-dispatcher-type") == "flex" else "deepep",
                   moe_router_dtype=got.get("--moe-router-dtype"),
                   num_moe_experts=experts, moe_router_topk=got.get("--moe-router-topk", 2),
                   moe_ffn_hidden_size=got.get("--moe-ffn-hidden-size"),
                   moe_shared_expert_intermediate_size=got.get("--moe-shared-expert-intermediate-size"),
                   moe_grouped_gemm=bool(got.get("--moe-grouped-gemm")),
                   moe_layer_freq=_layer_freq(got.get("--moe-layer-freq", 1), got["--num-layers"]),
                   moe_router_score_function=got.get("--moe-router-score-function", "softmax"),
                   moe_expert_capacity_factor=got.get("--moe-expert-capacity-factor"),
                   moe_pad_expert_input_to_capacity=bool(got.get("--moe-pad-expert-input-to-capacity")),
                   moe_permute_fusion=bool(got.get("--moe-permute-fusion")),
                   moe_aux_loss_coeff=got.get("--moe-aux-loss-coeff", 0.0),
                   moe_router_pre_softmax=bool(got.get("--moe-router-pre-softmax")),
                   moe_router_enable_expert_bias=bool(got.get("--moe-router-enable-expert-bias")),
                   moe_z_loss_coeff=got.get("--moe-z-loss-coeff"),
                   # read by Megatron only with a group top-k (moe_utils.py compute_topk: group-limited routing)
                   moe_router_num_groups=got.get("--moe-router-num-groups") if got.get("--moe-router-group-topk")
                   else None, moe_router_group_topk=got.get("--moe-router-group-topk") or None)
        if got.get("--moe-enable-deepep") and out["moe_token_dispatcher_type"] != "flex":
            raise JobError("--moe-enable-deepep needs --moe-token-dispatcher-type flex (DeepEP is a flex backend, "
                           "transformer_config.py:1743-1745): add it, or drop --moe-enable-deepep")
        if got.get("--moe-enable-deepep") and out["moe_flex_dispatcher_backend"] != "deepep":
            raise JobError("--moe-enable-deepep with --moe-flex-dispatcher-backend hybridep: Megatron runs one backend "
                           "(transformer_config.py:1746-1747); drop one")
        # --enable-experimental changes a job only through DeepEP's fused multihot conversion, under
        # --moe-permute-fusion (token_dispatcher.py:1425); elsewhere it is listed as ignored (remat.job_model)
        out["enable_experimental"] = bool(got.get("--enable-experimental")) and out["moe_permute_fusion"] and \
            (out["moe_token_dispatcher_type"], out["moe_flex_dispatcher_backend"]) == ("flex", "deepep")
        # --deterministic-mode changes a job only through the unfused unpermute of the combine (NOTE [the combine's
        # saved source]): not under --moe-permute-fusion, nor with HybridEP, whose kernels unpermute
        out["deterministic_algorithms"] = bool(got.get("--deterministic-mode")) and not out["moe_permute_fusion"] \
            and (out["moe_token_dispatcher_type"], out["moe_flex_dispatcher_backend"]) != ("flex", "hybridep")
        if out["moe_permute_fusion"] and out["moe_token_dispatcher_type"] == "allgather":
            raise JobError("--moe-permute-fusion with --moe-token-dispatcher-type allgather: remat models "
                           "TransformerEngine's fused permute for the all-to-all dispatcher (NOTE [the permutation "
                           "maps] in remat.models.permute), not for the allgather one; use "
                           "--moe-token-dispatcher-type alltoall, or drop --moe-permute-fusion")
    mla, qk_norm = bool(got.get("--multi-latent-attention")), bool(got.get("--qk-layernorm"))
    if qk_norm != mla:  # None: the attention's own default (remat.config.ModelConfig.has_qk_norms)
        out["qk_layernorm"] = qk_norm
    if not mla:
        stray = [f for f in _MLA_FLAGS if f in got]
        if stray:
            raise JobError(f"{stray[0]} needs --multi-latent-attention: add it, or drop {stray[0]}")
        if got.get("--rope-type", "rope") != "rope":  # argument_utils.py:339-341 asserts it
            raise JobError(f"--rope-type {got['--rope-type']}: Megatron's standard attention supports rope only "
                           "(argument_utils.py:339); use --rope-type rope, or add --multi-latent-attention")
        return out
    if "--kv-lora-rank" not in got:
        raise JobError("--multi-latent-attention needs --kv-lora-rank (the key/value compression rank, 512 for "
                       "DeepSeek-V3): add it")
    out.update(multi_latent_attention=True, q_lora_rank=got.get("--q-lora-rank"),
               kv_lora_rank=got["--kv-lora-rank"], qk_head_dim=got.get("--qk-head-dim", 128),
               qk_pos_emb_head_dim=got.get("--qk-pos-emb-head-dim", 64), v_head_dim=got.get("--v-head-dim", 128),
               mla_rope_type=got.get("--rope-type", "yarn"))  # MLATransformerConfig.rope_type's default
    return out


def _layer_freq(text: str | int, num_layers: int) -> int | tuple[int, ...]:
    """``--moe-layer-freq`` read (:func:`remat.config.parse_layer_freq`: its length is checked before any
    repetition is written out), its refusal naming the flag."""
    try:
        return parse_layer_freq(text, num_layers) if isinstance(text, str) else text
    except ConfigError as err:
        raise JobError(str(err).replace("moe_layer_freq=", "--moe-layer-freq ", 1)) from None


def layer_freq_text(freq: int | tuple[int, ...]) -> str:
    """``--moe-layer-freq`` as Megatron writes it: an integer, or runs such as ``([0]*3+[1]*58)``.

    Example:
        >>> layer_freq_text((0, 0, 1, 1, 1))
        '([0]*2+[1]*3)'
    """
    if isinstance(freq, int):
        return str(freq)
    runs: list[list[int]] = []
    for x in freq:
        if runs and runs[-1][0] == x:
            runs[-1][1] += 1
        else:
            runs.append([x, 1])
    return "(" + "+".join(f"[{x}]*{n}" for x, n in runs) + ")"


def moe_mla_args(model: ModelConfig) -> list[str]:
    """The Megatron flags of ``model``'s MoE and MLA fields (empty for a dense model with standard attention);
    :func:`moe_mla_fields` reads them back to the same fields."""
    args: list[str] = []
    m = model
    if m.is_moe:
        args += ["--num-experts", str(m.num_moe_experts), "--moe-router-topk", str(m.moe_router_topk),
                 "--moe-ffn-hidden-size", str(m.moe_ffn_size), "--moe-token-dispatcher-type",
                 m.moe_token_dispatcher_type]
        if m.moe_token_dispatcher_type == "flex":
            args += ["--moe-flex-dispatcher-backend", m.moe_flex_dispatcher_backend]
        if m.moe_router_dtype is not None:
            args += ["--moe-router-dtype", m.moe_router_dtype]
        if m.moe_shared_expert_intermediate_size is not None:
            args += ["--moe-shared-expert-intermediate-size", str(m.moe_shared_expert_intermediate_size)]
        args += ["--moe-grouped-gemm"] * m.moe_grouped_gemm
        if m.moe_layer_freq != 1:
            args += ["--moe-layer-freq", layer_freq_text(m.moe_layer_freq)]
        if m.moe_router_score_function != "softmax":
            args += ["--moe-router-score-function", m.moe_router_score_function]
        if m.moe_expert_capacity_factor is not None:
            args += ["--moe-expert-capacity-factor", repr(float(m.moe_expert_capacity_factor))]
        args += ["--moe-pad-expert-input-to-capacity"] * m.moe_pad_expert_input_to_capacity
        args += ["--moe-permute-fusion"] * m.moe_permute_fusion
        args += ["--enable-experimental"] * m.enable_experimental
        args += ["--deterministic-mode"] * m.deterministic_algorithms
        if m.moe_aux_loss_coeff:
            args += ["--moe-aux-loss-coeff", repr(float(m.moe_aux_loss_coeff))]
        args += ["--moe-router-pre-softmax"] * m.moe_router_pre_softmax
        args += ["--moe-router-enable-expert-bias"] * m.moe_router_enable_expert_bias
        if m.moe_z_loss_coeff is not None:
            args += ["--moe-z-loss-coeff", repr(float(m.moe_z_loss_coeff))]
        if m.moe_router_group_topk:
            args += ["--moe-router-num-groups", str(m.moe_router_num_groups),
                     "--moe-router-group-topk", str(m.moe_router_group_topk)]
    args += ["--qk-layernorm"] * m.has_qk_norms
    if m.multi_latent_attention:
        args += ["--multi-latent-attention"]
        if m.q_lora_rank is not None:
            args += ["--q-lora-rank", str(m.q_lora_rank)]
        args += ["--kv-lora-rank", str(m.kv_lora_rank), "--qk-head-dim", str(m.qk_head_dim),
                 "--qk-pos-emb-head-dim", str(m.qk_pos_emb_head_dim), "--v-head-dim", str(m.v_head_dim)]
        args += ["--rope-type", "rope"] * (m.mla_rope_type == "rope")
    return args


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def model_with_ep(model: ModelConfig, ep: Any) -> ModelConfig:
    """``model`` with ``expert_model_parallel_size=ep``; a bad ep is refused naming the job's flag."""
    if model.expert_model_parallel_size == ep:
        return model
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise JobError(f"ep (--expert-model-parallel-size)={ep!r}: must be a positive integer")
    if not model.is_moe:
        raise JobError(f"ep (--expert-model-parallel-size)={ep}: the model has no experts; give --num-experts "
                       "(num_moe_experts), or use ep=1")
    experts = int(model.num_moe_experts or 1)
    if experts % ep:
        raise JobError(f"ep (--expert-model-parallel-size)={ep} does not divide num_moe_experts={experts} "
                       f"(--num-experts): Megatron gives every expert-parallel rank the same number of experts; use "
                       f"ep from {_divisors(experts)}")
    return model.replace(expert_model_parallel_size=ep)


def check_expert_layout(model: ModelConfig, *, ep: int, etp: int, tp: int, cp: int, dp: int,
                        sp: bool = False) -> None:
    """Megatron's rules for the expert layout (megatron/training/arguments.py::validate_args and parallel_state's
    expert rank generator: ep x etp must divide tp x cp x dp; MoE layers under tensor parallelism need sequence
    parallelism, megatron/core/transformer/moe/moe_layer.py; biases only with etp = 1,
    transformer_config.py), each refused naming the flag and the fix.

    Args:
        model: the model (its ``expert_model_parallel_size`` must be ``ep``).
        ep, tp, cp, dp: the job's sizes.
        etp: the experts' tensor-parallel size (``--expert-tensor-parallel-size``, default tp).
        sp: sequence parallelism (``--sequence-parallel``).
    """
    if not model.is_moe:
        if etp != tp:
            raise JobError(f"etp (--expert-tensor-parallel-size)={etp}: expert tensor parallelism applies to MoE "
                           "layers and the model has no experts (--num-experts); drop it (or set it to tp)")
        if ep != 1:
            raise JobError(f"ep (--expert-model-parallel-size)={ep}: the model has no experts; give --num-experts, "
                           "or use ep=1")
    if model.expert_model_parallel_size != ep:
        raise JobError(f"model.expert_model_parallel_size={model.expert_model_parallel_size} but ep "
                       f"(--expert-model-parallel-size)={ep}: the job's ep shards the model's experts; use "
                       f"Job.build(model, ep=...) (which sets the field) or model.replace(expert_model_parallel_size="
                       f"{ep})")
    if not model.is_moe:
        return
    model_with_ep(model.replace(expert_model_parallel_size=1), ep)  # ep divides the experts
    if tp > 1 and not sp:
        raise JobError(f"tp (--tensor-model-parallel-size)={tp} with MoE layers needs --sequence-parallel: Megatron's "
                       "MoELayer raises 'During training, performance may degrade if MoE and tensor parallelism are "
                       "enabled without also enabling sequence parallelism'; add --sequence-parallel, or use tp=1")
    if etp > 1 and model.add_bias_linear:
        raise JobError(f"etp (--expert-tensor-parallel-size)={etp} with linear biases: Megatron asserts 'Bias in Moe "
                       "is only supported when ETP==1'; add --disable-bias-linear, or --expert-tensor-parallel-size 1")
    if model.moe_ffn_size % etp:
        raise JobError(f"etp (--expert-tensor-parallel-size)={etp} does not divide the experts' FFN size "
                       f"{model.moe_ffn_size} (--moe-ffn-hidden-size): use an etp that divides it")
    check_flex_dispatcher(model, ep=ep, etp=etp)
    inner = tp * cp * dp
    if inner % (ep * etp):
        raise JobError(f"ep (--expert-model-parallel-size)={ep} x expert tensor-parallel size {etp} does not divide "
                       f"tp x cp x dp = {inner}: Megatron lays the expert-parallel groups out inside the data-parallel "
                       f"ranks; raise dp (--data-parallel-size/--world-size) to a multiple of "
                       f"{ep * etp // math.gcd(ep * etp, tp * cp)}")


def check_flex_dispatcher(model: ModelConfig, *, ep: int, etp: int) -> None:
    """What remat models of Megatron's flex token dispatcher (NOTE [the flex dispatcher] in
    remat.models.flex_dispatch), each other case refused naming the flag and the fix."""
    if model.moe_token_dispatcher_type != "flex":
        return
    flag = "--moe-token-dispatcher-type flex"
    if model.fp8_recipe is not None:
        raise JobError(f"{flag} with FP8 (--fp8-format): each local expert's tokens are then padded to the FP8 "
                       "GEMM alignment (pad_multiple 16, 32 for mxfp8: token_dispatcher.py:1142-1144, "
                       "fp8_utils.py:356-361), which remat does not model; train in bf16 or use "
                       "--moe-token-dispatcher-type alltoall")
    if etp != 1:
        raise JobError(f"{flag} with --expert-tensor-parallel-size {etp}: remat models the flex dispatcher with "
                       "--expert-tensor-parallel-size 1 (its tp x ep group then is the ep ranks); set it")
    if ep * etp > NVLINK_DOMAIN:
        raise JobError(f"{flag} over {ep * etp} ranks (--expert-model-parallel-size x --expert-tensor-parallel-size): "
                       f"beyond one NVLink domain ({NVLINK_DOMAIN} GPUs) HybridEP adds RDMA buffers (csrc/hybrid_ep/"
                       "buffer/internode*.cu) that remat does not model; use at most "
                       f"--expert-model-parallel-size {NVLINK_DOMAIN}")
    if model.moe_expert_capacity_factor is not None:
        raise JobError(f"{flag} with --moe-expert-capacity-factor: the flex dispatcher then drops tokens by capacity "
                       "(HybridEP sizes its outputs from it, token_dispatcher.py:1115-1127; DeepEP masks them, "
                       ":1301-1303), which remat does not model; drop the capacity factor")


def check_flex_graphs(job: Any) -> None:
    """Refuse ``--cuda-graph-modules moe_preprocess`` with the flex dispatcher: its graph then ends with the
    dispatch manager's routing map and probabilities as static outputs (token_dispatcher.py:1840, 1848
    ``cudagraph_attrs``), which remat's CUDA-graph model (the alltoall dispatcher's preprocess) does not hold."""
    if job.model.moe_token_dispatcher_type == "flex" and "moe_preprocess" in (job.cuda_graph_modules or ()):
        raise JobError("--cuda-graph-modules moe_preprocess with --moe-token-dispatcher-type flex: the graphed "
                       "dispatch preprocess keeps the flex manager's routing map and probabilities as static "
                       "outputs, which remat does not model; graph moe_router only, or drop moe_preprocess")


# recompute module -> (what the model needs, the flag that adds it)
_MODULE_NEEDS = {"moe": ("MoE layers", "--num-experts"), "moe_act": ("MoE layers", "--num-experts"),
                 "shared_experts": ("a shared expert", "--moe-shared-expert-intermediate-size"),
                 "mla_up_proj": ("multi-latent attention", "--multi-latent-attention")}


def check_recompute_modules(model: ModelConfig, modules: tuple[str, ...]) -> None:
    """Refuse a selective recompute module whose layers the model does not have, naming it and the flag that adds
    them (``--moe-layer-recompute`` is selective ``moe``)."""
    has = {"moe": model.is_moe, "moe_act": model.is_moe,
           "shared_experts": model.moe_shared_expert_intermediate_size is not None,
           "mla_up_proj": model.multi_latent_attention}
    for module in modules:
        if module in has and not has[module]:
            what, flag = _MODULE_NEEDS[module]
            alias = " / --moe-layer-recompute" if module == "moe" else ""
            raise JobError(f"recompute module {module!r} (--recompute-modules{alias}) recomputes {what}, which the "
                           f"model does not have: add {flag}, or drop {module}")


OP_FUSER_FLAG = "--use-transformer-engine-op-fuser"
OP_FUSER_ALIGN = 256  # moe_utils.get_align_size_for_quantization: TE's grouped-tensor path pads segments to it


def check_op_fuser(got: dict[str, Any], ignored: list[str], model: ModelConfig) -> None:
    """Refuse ``--use-transformer-engine-op-fuser`` where it keeps other tensors than the grouped MLP remat prices.

    The flag (megatron-core experts.py:287-905 at d98e8a64, TransformerEngine 2.17.1) runs a grouped-GEMM MoE layer's
    experts as TE ops: GroupedLinear (saves its input, a view, and the split sizes), ScaledSwiGLU (saves the fc1
    output and the probabilities; its unscaled output is a temporary) and GroupedLinear: the tensors TE's grouped MLP
    keeps. On Hopper that is what runs; TE fuses the three into one CuteDSL kernel only on compute capability 10
    (ops/fused/grouped_mlp.py:312), which remat does not model. Megatron asserts expert tensor parallelism 1, a
    gated SiLU (or quick-GELU / squared-ReLU) activation and grouped GEMM; the op fuser's grouped-tensor path also
    pads each expert's tokens to a multiple of 256 (a padded copy, experts.py:729-747), which remat models only when
    no padding is needed: every local expert's balanced share of the routed tokens a multiple of 256."""
    if OP_FUSER_FLAG not in ignored or not model.is_moe:  # listed as ignored (remat.job_flags) once read
        return  # a dense model: Megatron's op fuser changes only the grouped experts
    tp, ep, cp = (got.get(f, 1) for f in ("--tensor-model-parallel-size", "--expert-model-parallel-size",
                                          "--context-parallel-size"))
    if not model.moe_grouped_gemm or model.activation != "swiglu":
        raise JobError(f"{OP_FUSER_FLAG} needs --moe-grouped-gemm and --swiglu here (Megatron asserts its fused "
                       "GroupedMLP supports the layer: grouped GEMM, a gated activation): add them, or drop the flag")
    if got.get("--expert-tensor-parallel-size", tp) != 1 or tp != 1:
        raise JobError(f"{OP_FUSER_FLAG} with tensor parallelism: Megatron's fused GroupedMLP needs expert tensor "
                       "parallelism 1, and remat prices the op fuser at --tensor-model-parallel-size 1 only: use tp 1")
    routed = ep * model.micro_batch_size * (model.seq_length // cp) * model.moe_router_topk
    share, rest = divmod(routed, int(model.num_moe_experts or 1))
    if rest or share % OP_FUSER_ALIGN:
        raise JobError(f"{OP_FUSER_FLAG}: each expert's balanced share of the routed tokens ({routed} / "
                       f"{model.num_moe_experts} experts) is not a multiple of {OP_FUSER_ALIGN}, so TE's grouped "
                       "tensors would be padded (a padded copy of the experts' input), which remat does not model "
                       "yet: drop the flag, or use a batch whose shares are multiples of 256")


def check_moe_overlap(job: Any) -> None:
    """Megatron's rules for ``--overlap-moe-expert-parallel-comm`` (transformer_config.py:3002-3046 at d98e8a64),
    each refused naming the flag and the fix; and for ``--delay-wgrad-compute`` (transformer_config.py:3073-3077,
    training/arguments.py:1903-1905); and :func:`check_flex_graphs`, the other MoE rule that needs the whole job."""
    check_flex_graphs(job)
    if job.delay_wgrad_compute:
        if not job.overlap_moe_expert_parallel_comm:
            raise JobError("--delay-wgrad-compute needs --overlap-moe-expert-parallel-comm (Megatron asserts it: the "
                           "EP-overlap schedule runs the delayed weight gradients): add it, or drop the flag")
        if job.model.transformer_impl == "local":
            raise JobError("--delay-wgrad-compute needs Transformer Engine's layers (Megatron asserts it): drop "
                           "--transformer-impl local / --attention-backend local, or drop the flag")
        if getattr(job.model, "fp8_recipe", None) is not None:  # remat.memory.delayed_wgrad keeps bf16 inputs
            raise JobError("--delay-wgrad-compute with --fp8-format: TE then keeps the FP8 copies of the inputs and "
                           "gradients for the delayed GEMM, which remat does not model yet; drop one of them")
    if not job.overlap_moe_expert_parallel_comm:
        return
    flag, model, policy = "--overlap-moe-expert-parallel-comm", job.model, job.policy
    problems = [
        (not model.is_moe or job.ep < 2, "needs expert parallelism (--expert-model-parallel-size > 1)"),
        (job.pp > 1 and job.vpp is None, "with --pipeline-model-parallel-size > 1 needs the interleaved schedule "
         "(--num-virtual-stages-per-pipeline-rank or a --pipeline-model-parallel-layout)"),
        (model.is_moe and model.moe_token_dispatcher_type != "alltoall", "needs the alltoall token dispatcher "
         "(--moe-token-dispatcher-type alltoall; remat models the overlap with it only, not with flex)"),
        (policy.granularity == "full", "refuses full recompute (--recompute-granularity full)"),
        ("moe" in (policy.modules or ()), "refuses 'moe' in --recompute-modules"),
        (job.precision == "fp32", "needs --bf16 or --fp16"),
        ((model.mtp_num_layers or 0) > 1, "allows at most one MTP layer (--mtp-num-layers 1)"),
    ]
    for bad, why in problems:
        if bad:
            raise JobError(f"{flag} {why}: Megatron asserts it")
