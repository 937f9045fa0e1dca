"""A whole Megatron-LM training job: model, parallel layout, batch, precision, optimizer and recompute policy.

A :class:`Job` holds everything later code needs to predict every byte one rank holds (see "Memory of a whole rank"
in the Megatron reference notes). It is built directly, with :meth:`Job.build` (which sets the model's dtype from
``precision``), or from Megatron-LM's own ``pretrain_gpt.py`` command line with :meth:`Job.from_megatron_args` /
:func:`parse_megatron_args`; :meth:`Job.to_megatron_args` writes the flags back (``parse(to_args(job)) == job``).

Decisions (facts from NVIDIA/Megatron-LM at d98e8a6, August 2026; files cited where used):

* ``model.dtype`` must equal ``precision`` (a bf16 job runs a bf16 model); ``Job(...)`` refuses a mismatch naming
  both fields, ``Job.build`` and ``Job.replace(precision=...)`` derive it.
* The model is stored canonically: ``ffn_hidden_size``/``num_query_groups`` equal to their defaults become None
  (the same model; ``ffn_size`` and ``query_groups`` are unchanged), so that the round trip is exact.
* ``accumulate_grads_in_fp32=None`` resolves to Megatron's default in ``__post_init__``: on for bf16 (forced unless
  ``--grad-reduce-in-bf16``), off for fp16, and always on for fp32 (fp32 parameters have fp32 gradients).
* Megatron pads the vocabulary to a multiple of ``--make-vocab-size-divisible-by`` (128) x TP
  (``megatron/core/tokenizers/utils/build_tokenizer.py::vocab_size_with_padding``); ``model.vocab_size`` is the
  padded size the rank holds, so a Job does not require TP to divide it. The model flags (vocabulary, attention
  backend, loss, MoE and MLA) are read by :mod:`remat.job_model`.
* ``--world-size`` and ``--data-parallel-size`` are remat's own flags (Megatron reads the world size from the
  launcher); without either, dp = 1. Tokens up to the script (``torchrun ... pretrain_gpt.py``) are the launcher's.
* MoE and MLA flags (``--num-experts``, ``--moe-*``, ``--multi-latent-attention``, ...) and the expert layout
  (``--expert-model-parallel-size``): :mod:`remat.job_experts`; the loss (Megatron's at every tp): remat.job_loss.
* Every other flag is modelled, ignored (known not to change memory: :data:`remat.job_flags.IGNORED_FLAGS`), or
  refused by name (changes memory in a way remat cannot model yet: ``REFUSED_FLAGS``); an unlisted flag is refused.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from remat import job_fsdp, job_loss, job_pipeline
from remat.config import DTYPES, ModelConfig
from remat.job_argv import megatron_argv
from remat.job_cuda_graphs import check_cuda_graphs, cuda_graph_fields
from remat.job_experts import check_expert_layout, check_moe_overlap, check_recompute_modules, model_with_ep
from remat.job_flags import (
    DEFAULT_ONLY_FLAGS,
    RECOMPUTE_FLAGS,
    JobError,
    check_value_count,
    classify_megatron_flag,
    flag_groups,
    flag_tokens,
    flag_value,
    unknown_flag_message,
    without_idle_recompute_flags,
)
from remat.job_fp8 import check_fp8, fp8_fields
from remat.job_fsdp import FsdpConfig, check_fsdp, fsdp_from_flags
from remat.job_launch import launcher_world_size
from remat.job_model import global_batch_size, model_from_flags
from remat.job_optimizer import check_muon
from remat.job_tp_overlap import TpCommOverlap, check_tp_overlap, tp_overlap_fields
from remat.limits import ceiling_problem
from remat.offload_policy import cpu_offload_job_problem
from remat.policy import Policy, PolicyError

SCHEDULES = ("gpipe", "1f1b", "interleaved")
PRECISIONS = ("fp32", "bf16", "fp16")
OPTIMIZERS = ("adam", "sgd", "muon", "none")
_FLAG_OF = {
    "tp": "--tensor-model-parallel-size", "sp": "--sequence-parallel", "pp": "--pipeline-model-parallel-size",
    "vpp": "--num-virtual-stages-per-pipeline-rank", "cp": "--context-parallel-size",
    "dp": "--data-parallel-size/--world-size", "ep": "--expert-model-parallel-size",
    "distributed_optimizer_instances": "--num-distributed-optimizer-instances",
    "etp": "--expert-tensor-parallel-size", "num_microbatches": "--global-batch-size",
    "schedule": "no flag: Megatron runs interleaved exactly when vpp is set", "precision": "--bf16/--fp16",
    "accumulate_grads_in_fp32": "--accumulate-allreduce-grads-in-fp32/--grad-reduce-in-bf16",
    "optimizer": "--optimizer", "sgd_momentum": "--sgd-momentum", "world_size": "--world-size",
    "distributed_optimizer": "--use-distributed-optimizer", "overlap_grad_reduce": "--overlap-grad-reduce",
    "gradient_accumulation_fusion": "--no-gradient-accumulation-fusion",
    "ddp_bucket_size": "--ddp-bucket-size", "pad_buckets_for_high_nccl_busbw": "--ddp-pad-buckets-for-high-nccl-busbw",
    "fp8_param_gather": "--fp8-param-gather", "fp8_amax_history_len": "--fp8-amax-history-len",
}


def _f(name: str) -> str:
    return f"{name} ({_FLAG_OF[name]})"


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise JobError(message)


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


@dataclass(frozen=True, kw_only=True)
class Job:
    """One Megatron-LM training job, as seen by one rank. Every size is validated in ``__post_init__`` (each at most
    its ceiling in :data:`remat.limits.CEILINGS`, refused before any work)."""

    model: ModelConfig
    """The decoder (``micro_batch_size`` and ``seq_length`` included); its ``dtype`` must equal ``precision``."""
    tp: int = 1
    """Tensor-parallel size (``--tensor-model-parallel-size``): splits heads, query groups and the FFN."""
    sp: bool = False
    """Sequence parallelism (``--sequence-parallel``): norms/dropout hold s/tp tokens; needs tp > 1."""
    pp: int = 1
    """Pipeline-parallel size (``--pipeline-model-parallel-size``): layers split over pp stages (evenly by default)."""
    vpp: int | None = None
    """Model chunks per pipeline rank (``--num-virtual-stages-per-pipeline-rank``), >= 2; needs interleaved."""
    cp: int = 1
    """Context-parallel size (``--context-parallel-size``): each rank holds s/cp tokens of every sequence."""
    dp: int = 1
    """Data-parallel size (world size / (tp*pp*cp)); also shards the distributed optimizer."""
    ep: int = 1
    """Expert-parallel size (``--expert-model-parallel-size``): each rank holds num_moe_experts / ep experts; it
    must equal ``model.expert_model_parallel_size`` (:meth:`build` and :meth:`replace` set it)."""
    etp: int | None = None
    """Expert tensor-parallel size (``--expert-tensor-parallel-size``); None means tp, as in Megatron."""
    num_microbatches: int = 1
    """Microbatches per step per pipeline: global batch = num_microbatches * micro_batch_size * dp."""
    schedule: str = "1f1b"
    """Pipeline schedule: gpipe (not in Megatron), 1f1b, or interleaved (exactly when vpp is set)."""
    microbatch_group_size: int | None = None
    """``--microbatch-group-size-per-virtual-pipeline-stage`` (interleaved only); None: Megatron's default, pp."""
    precision: str = "fp32"
    """fp32, or Megatron mixed precision bf16/fp16 (``--bf16``/``--fp16``): 2-byte params, fp32 master params."""
    accumulate_grads_in_fp32: bool | None = None
    """fp32 main-gradient buffer (``--accumulate-allreduce-grads-in-fp32``); None: Megatron's default (resolved)."""
    optimizer: str = "adam"
    """adam (Adam/AdamW: two fp32 moments), sgd (one fp32 buffer when momentum > 0), muon (Muon's fp32 momentum on
    matrices, Adam on the rest: :mod:`remat.memory.muon`; 'dist_muon' reads as muon + distributed_optimizer) or none."""
    sgd_momentum: float = 0.0
    """SGD momentum (``--sgd-momentum``); > 0 adds one fp32 buffer per parameter. sgd only."""
    distributed_optimizer: bool = False
    """``--use-distributed-optimizer``: fp32 master params and optimizer state sharded over dp * cp ranks."""
    distributed_optimizer_instances: int = 1
    gradient_accumulation_fusion: bool = True
    """Megatron's default (``--no-gradient-accumulation-fusion`` turns it off): on a GPU, TE's linears add their weight
    gradients into the fp32 main grads, with cached dummy gradients instead (:mod:`remat.memory.wgrad_fusion`)."""
    """``--num-distributed-optimizer-instances``: the dp * cp ranks hold that many copies of the sharded optimizer,
    each sharded over dp * cp / instances ranks (megatron/core/parallel_state.py: intra_partial_data_parallel)."""
    overlap_grad_reduce: bool = False
    """``--overlap-grad-reduce``: the gradient buffer is split into buckets (each padded with the distributed
    optimizer) on the first pipeline stage's first model chunk; without it, one bucket per buffer."""
    overlap_param_gather: bool = False
    """``--overlap-param-gather``: Megatron-FSDP then gathers the next step's first buckets right after the optimizer
    step (NOTE [Megatron-FSDP buffers] in :mod:`remat.memory.fsdp_state`); DDP's buffers are the same either way."""
    ddp_bucket_size: int | None = None
    """``--ddp-bucket-size`` in elements (with overlap_grad_reduce); None: Megatron's max(40M, 1M x dp)."""
    pad_buckets_for_high_nccl_busbw: bool = False
    """``--ddp-pad-buckets-for-high-nccl-busbw``: with the distributed optimizer, bucket ends pad to 2^16 too."""
    fsdp: FsdpConfig | None = None
    """``--use-megatron-fsdp`` and its sharding flags (:mod:`remat.job_fsdp`); None: Megatron's DDP."""
    torch_fsdp2: job_fsdp.TorchFsdp2Config | None = None
    """``--use-torch-fsdp2`` (:mod:`remat.memory.torch_fsdp2`); None: not torch FSDP2."""
    # Uneven pipeline splits, as Megatron's flags of these names (remat.job_pipeline); all unset: an even split.
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    embedding_wgrad_deferral: int | None = None
    """``--defer-embedding-wgrad-compute`` with ``--wgrad-deferral-limit N`` (0: all microbatches); None: off."""
    pipeline_model_parallel_layout: str | None = None
    """A layout string, e.g. ``'Et|(tt|)*3L'`` (implies vpp); :attr:`chunk_layers` has every chunk's layers."""
    overlap_moe_expert_parallel_comm: bool = False
    """``--overlap-moe-expert-parallel-comm``: the combined 1F1B schedule (NOTE [the combined 1F1B schedule])."""
    create_attention_mask: bool = True
    """The dataloader's dense causal masks (off: ``--no-create-attention-mask-in-dataloader``; NOTE [Megatron's batch
    on the device] in :mod:`remat.parallel.pipeline_runtime`)."""
    delay_wgrad_compute: bool = False
    """``--delay-wgrad-compute``: TE's linears keep their weight-gradient inputs until their layer's ``backward_dw``
    (NOTE [delayed weight gradients] in :mod:`remat.memory.delayed_wgrad`; needs the combined 1F1B schedule)."""
    fp8_param_gather: bool = False
    """``--fp8-param-gather``: the FP8 linears' weights are FP8 parameters (with ``model.fp8_recipe``; needs the
    distributed optimizer), NOTE [FP8 linears on Hopper] in :mod:`remat.memory.fp8`."""
    fp8_amax_history_len: int = 1
    cuda_graph_modules: tuple[str, ...] | None = None
    """``--cuda-graph-impl transformer_engine`` with ``--cuda-graph-modules``: the scopes TE graphs per layer and
    microbatch (``()``: whole layers; None: no CUDA graphs), NOTE [TE CUDA graphs] in
    :mod:`remat.parallel.cuda_graphs`."""
    cuda_graph_warmup_steps: int = 0
    """``--cuda-graph-warmup-steps`` (Megatron's default 3; here 0, the capture before the first step): the eager
    steps that run before the graphs are captured (training.py:4632-4645)."""
    """``--fp8-amax-history-len``: rows of each FP8 module's amax history (the delayed recipe only)."""
    tp_comm_overlap: TpCommOverlap | None = None
    """``--tp-comm-overlap`` and its options (:mod:`remat.job_tp_overlap`); None: no TE userbuffers."""
    policy: Policy = field(default_factory=lambda: Policy.parse("none"))
    """Activation recompute policy (the ``--recompute-*`` flags)."""

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        _require(isinstance(self.model, ModelConfig), f"model must be a ModelConfig, got {self.model!r}")
        check_fsdp(self.fsdp, precision=self.precision, pp=self.pp, vpp=self.vpp, cp=self.cp,
                   instances=self.distributed_optimizer_instances,
                   moe_overlap=self.overlap_moe_expert_parallel_comm)
        job_fsdp.check_torch_fsdp2(self)  # Megatron's assertions on --use-torch-fsdp2 (arguments.py:1031-1045)
        _require(isinstance(self.policy, Policy), f"policy must be a Policy (e.g. Policy.parse('full/uniform/1')), "
                 f"got {self.policy!r}")
        problem = cpu_offload_job_problem(self.policy.cpu_offloading_num_layers, self.model.num_layers, self.pp)
        _require(problem is None, str(problem))  # TE's layer offloading (remat.recompute.layer_offload)
        for name in ("tp", "pp", "cp", "dp", "ep", "num_microbatches", "vpp", "etp", "ddp_bucket_size",
                     "distributed_optimizer_instances"):
            v, optional = getattr(self, name), name in ("vpp", "etp", "ddp_bucket_size")
            _require((v is None and optional) or (isinstance(v, int) and not isinstance(v, bool) and v >= 1),
                     f"{_f(name)}={v!r}: must be a positive integer" + " or None" * optional)
        for name in ("tp", "pp", "cp", "dp", "ep", "etp", "vpp", "num_microbatches", "world_size"):  # remat.limits
            _require(not (bad := ceiling_problem(name, getattr(self, name))), f"{_f(name)}={getattr(self, name)} {bad}")
        for name in ("sp", "distributed_optimizer", "overlap_grad_reduce", "pad_buckets_for_high_nccl_busbw",
                     "gradient_accumulation_fusion", "fp8_param_gather"):
            v = getattr(self, name)
            _require(isinstance(v, bool), f"{_f(name)}={v!r}: must be True or False")
        if self.optimizer in ("muon", "dist_muon"):  # dist_muon: muon + the distributed optimizer (job_optimizer)
            set_(self, "distributed_optimizer", check_muon(self.model, self.optimizer, self.precision,
                 self.distributed_optimizer, self.distributed_optimizer_instances, self.ep, self.fsdp is not None))
            set_(self, "optimizer", "muon")
        check_fp8(self.model, param_gather=self.fp8_param_gather, amax_history_len=self.fp8_amax_history_len,
                  distributed_optimizer=self.distributed_optimizer, fsdp=self.fsdp is not None,
                  precision=self.precision)
        check_cuda_graphs(self.cuda_graph_modules, is_moe=self.model.is_moe,
                          has_dense=not all(self.model.moe_layer_pattern()),
                          overlap_moe=self.overlap_moe_expert_parallel_comm, delay_wgrad=self.delay_wgrad_compute,
                          recompute=not self.policy.is_none,
                          fsdp=self.fsdp is not None, warmup_steps=self.cuda_graph_warmup_steps,
                          selective_modules=(self.policy.modules if self.policy.is_selective and not
                                             self.policy.offloads else None))
        for name, choices in (("schedule", SCHEDULES), ("precision", PRECISIONS), ("optimizer", OPTIMIZERS)):
            _require(getattr(self, name) in choices,
                     f"{_f(name)}={getattr(self, name)!r}: must be one of {', '.join(choices)}")
        m, prec = self.model, self.precision
        _require(m.dtype == prec, f"model.dtype={m.dtype!r} but precision={prec!r}: a {prec} job runs a {prec} model; "
                 f"use Job.build(model, precision=...) (which sets model.dtype) or model.replace(dtype={prec!r})")
        canon = {"ffn_hidden_size": None} if m.ffn_hidden_size == m.replace(ffn_hidden_size=None).ffn_size else {}
        if m.num_query_groups == m.num_attention_heads:
            canon["num_query_groups"] = None
        if m.moe_ffn_hidden_size is not None and m.moe_ffn_hidden_size == m.ffn_size:
            canon["moe_ffn_hidden_size"] = None
        ub = check_tp_overlap(self.tp_comm_overlap, m, tp=self.tp, sp=self.sp, precision=prec,
                              delay_wgrad=self.delay_wgrad_compute)  # the linears' modes (remat.job_tp_overlap)
        canon |= {"tp_comm_overlap": ub} if ub != m.tp_comm_overlap else {}
        if canon := canon | job_loss.megatron_loss(m):  # and Megatron's cross-entropy, at every tp
            set_(self, "model", m := m.replace(**canon))

        acc, mom = self.accumulate_grads_in_fp32, self.sgd_momentum
        _require(acc is None or isinstance(acc, bool), f"{_f('accumulate_grads_in_fp32')}={acc!r}: must be True, "
                 "False or None")
        _require(prec != "fp32" or acc is not False, "accumulate_grads_in_fp32=False with precision='fp32': fp32 "
                 "parameters always have fp32 gradients; drop it (or use None)")
        if acc is None:
            set_(self, "accumulate_grads_in_fp32", prec != "fp16")
        _require(isinstance(mom, (int, float)) and not isinstance(mom, bool) and 0 <= mom < math.inf,
                 f"{_f('sgd_momentum')}={mom!r}: must be a number >= 0")
        _require(not mom or self.optimizer == "sgd", f"sgd_momentum={mom} only applies to optimizer='sgd', not "
                 f"{self.optimizer!r}: drop it (Megatron ignores --sgd-momentum for other optimizers)")
        _require(not (self.distributed_optimizer and self.optimizer == "none"), "distributed_optimizer=True "
                 "(--use-distributed-optimizer) shards optimizer state, but optimizer='none' has none: drop it")

        tp, s, cp = self.tp, m.seq_length, self.cp
        for what, n in (("num_attention_heads", m.num_attention_heads), ("num_query_groups", m.query_groups),
                        ("the FFN size", m.ffn_size)):
            extra = (" (recent Megatron also accepts tp a multiple of num_query_groups by replicating K/V heads, "
                     "which remat does not model yet)" if what == "num_query_groups" else "")
            if n % tp:  # the divisors are listed only for the error: n may be large
                raise JobError(f"{_f('tp')}={tp} does not divide {what}={n}: Megatron splits it over the "
                               f"tensor-parallel ranks; use a tp from {_divisors(n)}{extra}")
        _require(not self.sp or tp > 1, "sp=True (--sequence-parallel) needs tp > 1 (Megatron silently turns it "
                 "off): drop it, or set tp (--tensor-model-parallel-size) > 1")
        # megatron/training/arguments.py::validate_args: "seq-length should be a multiple of 2 *
        # context-parallel-size if context-parallel-size > 1" (the load-balanced ring gives each rank 2 chunks).
        _require(cp == 1 or s % (2 * cp) == 0, f"{_f('cp')}={cp}: Megatron needs seq_length={s} (--seq-length) to "
                 f"be a multiple of 2*cp={2 * cp}; use a cp with 2*cp dividing {s}, or change --seq-length")
        # megatron/core/tensor_parallel/mappings.py::_split_along_first_dim: the s/cp tokens split over tp.
        _require(not self.sp or (s // cp) % tp == 0, f"sp=True (--sequence-parallel) splits the s/cp={s // cp} "
                 f"tokens over tp={tp} ranks, which does not divide them: change tp, cp or --seq-length")
        check_expert_layout(self.model, ep=self.ep, etp=self.expert_tp, tp=tp, cp=cp, dp=self.dp, sp=self.sp)
        job_loss.check_multi_token_prediction(m, self.pipeline_model_parallel_layout, self.policy)
        check_moe_overlap(self)
        shards = self.distributed_optimizer_instances  # megatron/core/parallel_state.py asserts both divisions
        _require(self.dp * cp % shards == 0 and self.expert_data_parallel % shards == 0,
                 f"{_f('distributed_optimizer_instances')}={shards} must divide dp x cp = {self.dp * cp} and the "
                 f"expert data-parallel size {self.expert_data_parallel}: use a divisor of both")

        vpp, pp = self.vpp, self.pp
        _require(vpp is None or vpp >= 2, "vpp=1 (--num-virtual-stages-per-pipeline-rank 1) is no virtual "
                 "pipeline: use vpp=None")
        _require(vpp is None or self.schedule == "interleaved", f"vpp={vpp} needs schedule='interleaved' "
                 f"(Megatron's only schedule with model chunks), not {self.schedule!r}: set it, or vpp=None")
        _require(vpp is not None or self.schedule != "interleaved", "schedule='interleaved' needs vpp >= 2 model "
                 "chunks per rank (--num-virtual-stages-per-pipeline-rank): set vpp, or use schedule='1f1b'")
        _require(vpp is None or pp > 1, f"vpp={vpp} needs pp > 1 (Megatron's interleaved schedule pipelines chunks "
                 "over ranks): set pp (--pipeline-model-parallel-size) > 1, or vpp=None")
        job_pipeline.check_pipeline_split(self)  # even, uneven first/last, embedding/loss counted, or a layout
        job_pipeline.check_microbatch_groups(self)  # the interleaved schedule's groups of microbatches must fit
        pol = self.policy
        check_recompute_modules(m, pol.modules)
        _require(not pol.distribute_saved_activations or (tp > 1 and not self.sp), "--distribute-saved-activations "
                 "splits checkpoints over the tensor-parallel ranks: Megatron needs tp > 1 and refuses it with "
                 "--sequence-parallel; drop one of them")
        deepest = self.layers_per_chunk  # a shorter chunk (uneven split) recomputes all its layers, as Megatron
        _require(not pol.recomputes_layers or pol.num_layers <= deepest, f"--recompute-num-layers "
                 f"{pol.num_layers} exceeds the {deepest} layers of a model chunk (the deepest): use at most "
                 f"{deepest}")

    # ------------------------------------------------------------------ derived
    @property
    def expert_tp(self) -> int:
        """The experts' tensor-parallel size: ``etp``, or tp when unset (Megatron's default)."""
        return self.tp if self.etp is None else self.etp

    @property
    def expert_data_parallel(self) -> int:
        """The expert data-parallel size, tp x cp x dp / (ep x expert tp): the ranks holding the same experts, over
        which Megatron reduces (and, with the distributed optimizer, shards) the expert parameters' gradients."""
        return self.tp * self.cp * self.dp // (self.ep * self.expert_tp)

    @property
    def world_size(self) -> int:
        """Ranks in the job: tp * pp * cp * dp."""
        return self.tp * self.pp * self.cp * self.dp

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step: num_microbatches * micro_batch_size * dp."""
        return self.num_microbatches * self.model.micro_batch_size * self.dp

    @property
    def layers_per_chunk(self) -> int:
        """Transformer layers in one model chunk (a pipeline stage, or a virtual stage under vpp); the most any
        chunk has under an uneven split."""
        return max(self.chunk_layers)

    @property
    def chunk_layers(self) -> tuple[int, ...]:
        """Decoder layers of every model chunk in global order (chunk g on stage g % pp), as Megatron splits."""
        return job_pipeline.job_chunk_layers(self)

    @property
    def param_dtype(self) -> str:
        """dtype name of the model's parameters (and activations): the precision."""
        return self.precision

    @property
    def main_grad_dtype(self) -> str:
        """dtype name of Megatron's contiguous gradient buffer (main grads)."""
        return "fp32" if self.accumulate_grads_in_fp32 else self.precision

    @property
    def optimizer_shards(self) -> int:
        """Ranks the distributed optimizer shards master params and state over: dp * cp (else 1).

        Megatron builds it on the intra data-parallel group *with* context parallel
        (``megatron/core/optimizer/__init__.py``: ``data_parallel_group=intra_dp_cp_group``); its estimator
        (``theoretical_memory_usage.py``) writes 12/DP, the same when cp = 1.
        """
        return self.dp * self.cp // self.distributed_optimizer_instances if self.distributed_optimizer else 1

    def state_bytes_per_param(self) -> dict[str, Fraction]:
        """Bytes per parameter of model state that a rank holds for the whole step, by kind.

        Returns:
            ``{"parameters", "gradients", "master_parameters", "optimizer_state"}`` as exact Fractions: parameters
            in the precision, main grads per :attr:`main_grad_dtype`, fp32 master copies (mixed precision with an
            optimizer only) and optimizer state (Adam 8, SGD with momentum 4, Muon 4 on the matrices it owns: its
            embeddings, norms and biases take Adam's 8, counted by remat.memory.rank_state), the last two divided
            by :attr:`optimizer_shards`. Padding of buffers and shards is not included.

        Example:
            >>> job = Job.build(ModelConfig(), precision="bf16", dp=8, distributed_optimizer=True)
            >>> sum(job.state_bytes_per_param().values())  # 6 + 12/8
            Fraction(15, 2)
        """
        size = {name: DTYPES[name].itemsize for name in PRECISIONS}
        shards = self.optimizer_shards
        master = 4 if self.precision != "fp32" and self.optimizer != "none" else 0
        state = {"adam": 8, "sgd": 4 if self.sgd_momentum > 0 else 0, "muon": 4, "none": 0}[self.optimizer]
        return {"parameters": Fraction(size[self.param_dtype]), "gradients": Fraction(size[self.main_grad_dtype]),
                "master_parameters": Fraction(master, shards), "optimizer_state": Fraction(state, shards)}

    def bytes_per_param_static(self) -> Fraction:
        """Bytes of model state per parameter for the whole step.

        Returns:
            The sum of :meth:`state_bytes_per_param`: 18 for bf16 + Adam, 6 + 12/dp with the distributed optimizer.

        Example:
            >>> Job.build(ModelConfig(), precision="bf16").bytes_per_param_static()
            Fraction(18, 1)
        """
        return sum(self.state_bytes_per_param().values(), Fraction(0))

    # ------------------------------------------------------------------ building
    @classmethod
    def build(cls, model: ModelConfig, **fields: Any) -> Job:
        """A Job whose model dtype follows ``precision`` (default: the model's dtype).

        Args:
            model: the decoder; its dtype is replaced by ``precision``, its ``expert_model_parallel_size`` by
                ``ep`` (default: the model's).
            **fields: any other Job fields; ``vpp`` without ``schedule`` selects the interleaved schedule.

        Returns:
            The validated Job.

        Example:
            >>> Job.build(ModelConfig(), precision="bf16", tp=2).model.dtype
            'bf16'
        """
        precision = fields.setdefault("precision", model.dtype)
        if precision not in PRECISIONS:
            raise JobError(f"precision={precision!r} (--bf16/--fp16): must be one of {', '.join(PRECISIONS)}")
        if fields.get("pipeline_model_parallel_layout") is not None and "vpp" not in fields:  # implied, as Megatron
            fields["vpp"] = job_pipeline.layout_vpp(fields["pipeline_model_parallel_layout"], fields.get("pp", 1))
        if fields.get("vpp") is not None:
            fields.setdefault("schedule", "interleaved")
        ep = fields.setdefault("ep", model.expert_model_parallel_size)
        return cls(model=model_with_ep(model.replace(dtype=precision), ep), **fields)

    def replace(self, **changes: Any) -> Job:
        """A copy with ``changes``; derived fields follow unless given.

        Args:
            **changes: Job fields. ``precision`` also sets ``model.dtype`` (unless ``model`` is given) and resets
                ``accumulate_grads_in_fp32`` to its default; ``ep`` sets ``model.expert_model_parallel_size``;
                ``vpp`` picks the schedule (interleaved, or 1f1b when set to None); an ``optimizer`` other than sgd
                resets ``sgd_momentum`` to 0.

        Returns:
            The validated Job.

        Example:
            >>> Job(model=ModelConfig()).replace(precision="bf16").main_grad_dtype
            'fp32'
        """
        if "precision" in changes:
            if changes["precision"] not in PRECISIONS:
                raise JobError(f"precision={changes['precision']!r}: must be one of {', '.join(PRECISIONS)}")
            changes.setdefault("model", self.model.replace(dtype=changes["precision"]))
            changes.setdefault("accumulate_grads_in_fp32", None)
        if "ep" in changes:
            changes["model"] = model_with_ep(changes.get("model", self.model), changes["ep"])
        if "vpp" in changes and "schedule" not in changes:
            vpp = changes["vpp"]
            changes["schedule"] = "interleaved" if vpp is not None else (
                "1f1b" if self.schedule == "interleaved" else self.schedule)
        if changes.get("optimizer", "sgd") != "sgd":
            changes.setdefault("sgd_momentum", 0.0)
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_megatron_args(cls, argv: Sequence[str] | str) -> Job:
        """The job a Megatron-LM ``pretrain_gpt.py`` command line describes.

        Args:
            argv: the flags (tokens, or one shell-like string); see :func:`parse_megatron_args`.

        Returns:
            The validated Job (the ignored flags are dropped; use :func:`parse_megatron_args` to see them).

        Example:
            >>> Job.from_megatron_args("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 128 "
            ...                        "--micro-batch-size 2 --vocab-size 1000 --bf16 --world-size 2").dp
            2
        """
        return parse_megatron_args(argv)[0]

    def to_megatron_args(self, include_world_size: bool = True) -> list[str]:
        """Megatron-LM flags for this job; ``parse_megatron_args(job.to_megatron_args())[0] == job``.

        Args:
            include_world_size: add remat's ``--world-size`` (needed for the round trip); pass False for a line
                Megatron's own parser accepts (it reads the world size from the launcher).

        Returns:
            The flags, model first. Raises :class:`JobError` for what Megatron cannot run: the gpipe schedule,
            optimizer 'none', a non-reentrant policy, and remat-only recompute modules.

        Example:
            >>> Job(model=ModelConfig(num_layers=2)).to_megatron_args()[:2]
            ['--num-layers', '2']
        """
        return megatron_argv(self, include_world_size)


def parse_megatron_args(argv: Sequence[str] | str) -> tuple[Job, list[str]]:
    """The job a Megatron-LM ``pretrain_gpt.py`` command line describes, and the flags remat ignored.

    Args:
        argv: the flags, as a list of tokens or one string (split like a shell line, ``#`` comments allowed). A
            token ``@path`` is replaced by :func:`load_megatron_args` of that file; tokens up to a ``*.py`` script
            are the launcher's and are skipped.

    Returns:
        ``(job, ignored)``: ``ignored`` lists the accepted flags that do not change memory (and the launcher
        command, if any), in order. Refused, unknown or inconsistent flags raise :class:`JobError` naming the flag.

    Example:
        >>> job, ignored = parse_megatron_args("--num-layers 4 --hidden-size 64 --num-attention-heads 4 "
        ...     "--seq-length 128 --micro-batch-size 2 --vocab-size 1000 --lr 1e-4 --tensor-model-parallel-size 2")
        >>> job.tp, job.model.vocab_size, ignored
        (2, 1024, ['--lr'])
    """
    tokens, ignored = flag_tokens(argv)
    got: dict[str, Any] = {}
    recompute: list[str] = []
    refusals: list[str] = []  # every flag that stops the prediction, reported together
    for name, vals in flag_groups(tokens):
        kind, reason = classify_megatron_flag(name, vals)
        if kind == "recompute":
            if name in RECOMPUTE_FLAGS:
                check_value_count(name, vals, RECOMPUTE_FLAGS[name])
            recompute += [name, *vals]
        elif kind == "modelled":
            if name in got and vals:  # a switch given twice is the same switch (argparse's store_true)
                raise JobError(f"{name} is given twice: keep one")
            got[name] = flag_value(name, vals)
        elif kind == "ignored" or (kind == "default-only" and vals == [DEFAULT_ONLY_FLAGS[name]]):
            ignored.append(name)
        elif kind == "unknown":
            refusals.append(unknown_flag_message(name))
        else:
            default = f" (or give Megatron's default, {name} {DEFAULT_ONLY_FLAGS[name]})" if kind != "refused" else ""
            refusals.append(f"{name} {reason}, which remat cannot model yet: remove it{default}")
    if refusals:
        raise JobError(refusals[0] if len(refusals) == 1 else f"{len(refusals)} flags stop the prediction: " +
                       "; ".join(f"({i}) {r}" for i, r in enumerate(refusals, 1)))
    world = launcher_world_size(ignored[0]) if ignored else None  # torchrun's --nnodes x --nproc-per-node, ...
    if world is not None and "--world-size" not in got and "--data-parallel-size" not in got:
        got["--world-size"] = world
    job = _job(got, recompute, ignored)  # may add conditionally ignored flags
    return job, list(dict.fromkeys(ignored))


def _job(got: dict[str, Any], recompute: list[str], ignored: list[str]) -> Job:
    for req in ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length", "--micro-batch-size"):
        if req not in got:
            raise JobError(f"{req} is missing: Megatron requires it; add {req} N")
    L, h, a, s, mbs = (got[k] for k in ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length",
                                        "--micro-batch-size"))
    tp, pp, cp = (got.get(k, 1) for k in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                                          "--context-parallel-size"))
    if got.get("--bf16") and got.get("--fp16"):
        raise JobError("--bf16 and --fp16 are both given (Megatron asserts at most one): keep one")
    precision = "bf16" if got.get("--bf16") else "fp16" if got.get("--fp16") else "fp32"
    acc = True if got.get("--accumulate-allreduce-grads-in-fp32") else None
    if got.get("--grad-reduce-in-bf16"):
        if precision != "bf16" or acc:
            raise JobError("--grad-reduce-in-bf16 (bf16 main grads) needs --bf16 and contradicts "
                           "--accumulate-allreduce-grads-in-fp32: add --bf16 / drop one of them")
        acc = False

    model = model_from_flags(got, ignored, precision)
    fp8_model, fp8_job = fp8_fields(got, ignored)
    model = model.replace(**fp8_model) if fp8_model else model

    vpp, split = job_pipeline.pipeline_split_fields(got, L, pp)  # Megatron: a virtual pipeline size of 1 is None
    if vpp is not None and "--no-overlap-p2p-communication" in ignored and pp <= 2:
        raise JobError("the interleaved schedule with --no-overlap-p2p-communication needs "
                       "--pipeline-model-parallel-size > 2 (Megatron asserts it): drop the flag or raise pp")
    base, world, dp = tp * pp * cp, got.get("--world-size"), got.get("--data-parallel-size")
    if world is not None:
        if world % base or (dp is not None and dp * base != world):
            raise JobError(f"--world-size {world} is not tp*pp*cp ({tp}*{pp}*{cp} = {base}) times "
                           f"{'--data-parallel-size ' + str(dp) if dp else 'a whole data-parallel size'}: "
                           f"use a multiple of {base} (or drop --data-parallel-size)")
        dp = world // base
    dp = dp or 1
    gb = global_batch_size(got, mbs, dp)  # or --step-batch-size-schedule's largest batch
    if gb % (mbs * dp):  # megatron/core/num_microbatches_calculator.py: a whole number of microbatches
        raise JobError(f"--global-batch-size {gb} is not divisible by --micro-batch-size {mbs} x data-parallel "
                       f"size {dp} = {mbs * dp}: Megatron needs whole microbatches; use a multiple of {mbs * dp}")
    optimizer, momentum = got.get("--optimizer", "adam"), 0.0
    if optimizer == "sgd":
        momentum = got.get("--sgd-momentum", 0.9)  # Megatron's default momentum
    elif "--sgd-momentum" in got:
        ignored.append("--sgd-momentum")
    try:
        policy = Policy.from_megatron_args(without_idle_recompute_flags(recompute, ignored))
    except PolicyError as err:
        raise JobError(str(err)) from None
    ep, sp = got.get("--expert-model-parallel-size", 1), bool(got.get("--sequence-parallel")) and tp > 1
    ignored += ["--sequence-parallel"] * (bool(got.get("--sequence-parallel")) and tp == 1)  # arguments.py: turned off
    etp = got.get("--expert-tensor-parallel-size")
    etp = etp if model.is_moe or etp == tp else None  # a dense model has no expert to split: the size is idle
    ignored += ["--expert-tensor-parallel-size"] * ("--expert-tensor-parallel-size" in got and etp is None)
    return Job(model=model_with_ep(model, ep), tp=tp, sp=sp, pp=pp, vpp=vpp, cp=cp,
               dp=dp, ep=ep, etp=etp,
               num_microbatches=gb // (mbs * dp), schedule="interleaved" if vpp else "1f1b", precision=precision,
               accumulate_grads_in_fp32=acc, optimizer=optimizer, sgd_momentum=momentum,
               distributed_optimizer=bool(got.get("--use-distributed-optimizer") or got.get("--use-megatron-fsdp")),
               distributed_optimizer_instances=got.get("--num-distributed-optimizer-instances", 1),
               gradient_accumulation_fusion=not got.get("--no-gradient-accumulation-fusion"),
               overlap_grad_reduce=bool(got.get("--overlap-grad-reduce")), ddp_bucket_size=got.get("--ddp-bucket-size"),
               overlap_param_gather=bool(got.get("--overlap-param-gather")),
               pad_buckets_for_high_nccl_busbw=bool(got.get("--ddp-pad-buckets-for-high-nccl-busbw")), policy=policy,
               overlap_moe_expert_parallel_comm=bool(got.get("--overlap-moe-expert-parallel-comm")),
               delay_wgrad_compute=bool(got.get("--delay-wgrad-compute")),
               create_attention_mask=not got.get("--no-create-attention-mask-in-dataloader"),
               fsdp=fsdp_from_flags(got), torch_fsdp2=job_fsdp.torch_fsdp2_from_flags(got, ignored), **fp8_job,
               **cuda_graph_fields(got, ignored), **tp_overlap_fields(got, ignored),
               **split)
