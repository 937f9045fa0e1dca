"""Megatron-LM's TP communication overlap (``--tp-comm-overlap``, TransformerEngine userbuffers): the flags read into
``Job.tp_comm_overlap`` and checked here; the buffers it allocates outside PyTorch's allocator and what it changes
inside it are :mod:`remat.memory.tp_overlap` (NOTE [TP communication overlap] there).

Facts from Megatron-LM d98e8a64:

* the flags: ``--tp-comm-overlap`` and the ``ModelParallelConfig`` fields made into flags by
  ``ArgumentGroupFactory`` (training/argument_utils.py:146-152: a field defaulting to True is turned off by
  ``--no-NAME`` / ``--disable-NAME``): ``tp_comm_bulk_wgrad``, ``tp_comm_bulk_dgrad``, ``tp_comm_overlap_ag``,
  ``tp_comm_overlap_rs`` (True), ``tp_comm_overlap_rs_dgrad`` (False), ``tp_comm_split_ag`` / ``_rs`` (read by TE
  < 1.5 only), ``tp_comm_bootstrap_backend`` (core/model_parallel_config.py:265-340); ``--tp-comm-overlap-cfg`` a
  YAML file (arguments.py:2880) read with ``yaml.safe_load`` into TE's ``ub_cfgs`` (initialize.py:211-215);
* ``--tp-comm-overlap`` needs ``--sequence-parallel`` (arguments.py:1441-1442), which Megatron turns off when
  tp = 1 (arguments.py:1433-1439): so it needs tp > 1 too;
* TE's ``_Linear`` raises ``NotImplementedError`` for a delayed weight gradient with userbuffers
  (layernorm_linear.py:1022-1032, TE 2.17.1); TE's userbuffers take no blockwise-FP8 tensor (module/base.py:720
  ``Unsupported quantizer for Userbuffers``); the buffers are bf16 (initialize_ub's ``dtype`` default: Megatron
  passes none, initialize.py:240-246), so an fp32 activation cannot be copied in (pytorch/csrc/extensions/
  comm_gemm_overlap.cpp:332 checks the element size).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from remat.config import ModelConfig
from remat.job_flags import JobError
from remat.limits import read_input_text

# TE 2.17.1 module/base.py:311-336 (initialize_ub): the GEMMs with a buffer each, and their default methods
UB_METHODS: dict[str, tuple[str, ...]] = {
    "ring_exchange": ("qkv_fprop", "fc1_fprop", "proj_dgrad", "fc2_dgrad"),
    "pipeline": ("proj_fprop", "fc2_fprop"),
    "bulk": ("qkv_dgrad", "qkv_wgrad", "fc1_dgrad", "fc1_wgrad"),
    "external": ("proj_wgrad", "fc2_wgrad"),
}
UB_NAMES = tuple(n for names in UB_METHODS.values() for n in names)
# add_ub's keyword arguments (base.py:373-389): a YAML key outside them makes TE raise TypeError
UB_CFG_KEYS = ("method", "is_reduce_scatter", "num_sm", "cga_size", "set_sm_margin", "num_splits", "aggregate",
               "atomic_gemm", "use_ce", "fp8_buf", "comm_priority", "gemm_priority", "pipeline_rs_overlap_first_gemm")
_DISABLE = {"bulk_wgrad": "tp-comm-bulk-wgrad", "bulk_dgrad": "tp-comm-bulk-dgrad", "ag": "tp-comm-overlap-ag",
            "rs": "tp-comm-overlap-rs"}
IDLE_FLAGS = ("--no-tp-comm-split-ag", "--disable-tp-comm-split-ag", "--no-tp-comm-split-rs",
              "--disable-tp-comm-split-rs", "--tp-comm-bootstrap-backend")
# the flags this module reads (listed in remat.job_flags.MODELLED_FLAGS)
TP_OVERLAP_FLAGS = ("--tp-comm-overlap-cfg", "--tp-comm-overlap-rs-dgrad", *IDLE_FLAGS,
                    *(f"--{prefix}-{name}" for name in _DISABLE.values() for prefix in ("no", "disable")))


@dataclass(frozen=True)
class TpCommOverlap:
    """``--tp-comm-overlap`` and its options (Megatron's ``ModelParallelConfig`` defaults)."""

    ag: bool = True  # tp_comm_overlap_ag: all-gather overlapped with the column-parallel fprop / row dgrad GEMMs
    rs: bool = True  # tp_comm_overlap_rs: reduce-scatter overlapped with the row-parallel fprop GEMM
    rs_dgrad: bool = False  # tp_comm_overlap_rs_dgrad: reduce-scatter overlapped with the column dgrad GEMM
    bulk_dgrad: bool = True  # tp_comm_bulk_dgrad: the input all-gather overlapped with the dgrad GEMM
    bulk_wgrad: bool = True  # tp_comm_bulk_wgrad: the dgrad reduce-scatter overlapped with the wgrad GEMM
    cfg: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = ()  # --tp-comm-overlap-cfg: {GEMM: {key: value}}
    cfg_path: str | None = None

    def __post_init__(self) -> None:
        for name in ("ag", "rs", "rs_dgrad", "bulk_dgrad", "bulk_wgrad"):
            if not isinstance(getattr(self, name), bool):
                raise JobError(f"tp_comm_overlap.{name}={getattr(self, name)!r}: must be True or False")
        for name, items in self.cfg:
            gemm = dict(items)
            for key in gemm:
                if key not in UB_CFG_KEYS:
                    raise JobError(f"--tp-comm-overlap-cfg: {name}.{key} is not a userbuffers option (TE's add_ub "
                                   f"raises TypeError on it, base.py:373-389): use {', '.join(UB_CFG_KEYS)}")
            method = gemm.get("method")
            if method is not None and method not in UB_METHODS:
                raise JobError(f"--tp-comm-overlap-cfg: {name}.method {method!r}: TE's methods are "
                               f"{', '.join(UB_METHODS)}")
            if gemm.get("atomic_gemm"):  # base.py:395-409, comm_gemm_overlap.cpp:964 (cudaMallocAsync per GEMM)
                raise JobError(f"--tp-comm-overlap-cfg: {name}.atomic_gemm is not modelled (TE's beta atomic-GEMM "
                               "overlap stages each GEMM's output in a cudaMallocAsync buffer, "
                               "comm_gemm_overlap.cpp:964): set it false")

    def gemm_cfg(self, name: str) -> dict[str, Any]:
        """The YAML's options for one GEMM (``{}`` when it names none)."""
        return dict(dict(self.cfg).get(name, ()))

    def linear_modes(self) -> tuple[str, ...]:
        """What the overlap changes in the layer linears' PyTorch tensors (NOTE [TP communication overlap]):
        ``ag`` (gathered inputs and output gradients in the buffers), ``bulk_dgrad`` / ``bulk_wgrad`` (the column
        linears' backward); TE turns the bulk overlaps off under ``rs_dgrad`` (layernorm_linear.py:1343-1353)."""
        return (("ag",) * self.ag + ("bulk_dgrad",) * (self.bulk_dgrad and not self.rs_dgrad)
                + ("bulk_wgrad",) * (self.bulk_wgrad and not self.rs_dgrad))


def read_ub_cfg(path: str) -> tuple[tuple[str, tuple[tuple[str, Any], ...]], ...]:
    """The ``--tp-comm-overlap-cfg`` YAML as TE reads it (``yaml.safe_load``, initialize.py:212-213), canonical:
    ``((gemm, ((key, value), ...)), ...)`` sorted. GEMM names TE does not configure are kept (TE ignores them)."""
    import yaml  # a dependency (pyproject.toml); imported only for a job that gives the file

    try:
        data = yaml.safe_load(read_input_text(path))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise JobError(f"--tp-comm-overlap-cfg {path}: cannot read it as YAML ({str(err).splitlines()[0]}): give "
                       "the userbuffers config file Megatron reads") from None
    data = {} if data is None else data
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise JobError(f"--tp-comm-overlap-cfg {path}: TE needs a mapping of GEMM names (qkv_fprop, ...) to option "
                       "mappings (initialize_ub's ub_cfgs)")
    return tuple(sorted((str(k), tuple(sorted((str(o), v) for o, v in gemm.items()))) for k, gemm in data.items()))


def tp_overlap_fields(got: dict[str, Any], ignored: list[str]) -> dict[str, Any]:
    """``{'tp_comm_overlap': TpCommOverlap}`` for ``--tp-comm-overlap`` in ``got`` (flag -> parsed value), else
    ``{}`` (its option flags then listed in ``ignored``, as Megatron reads them only under it).

    Example:
        >>> tp_overlap_fields({"--tp-comm-overlap": True, "--disable-tp-comm-bulk-wgrad": True}, [])[
        ...     "tp_comm_overlap"].linear_modes()
        ('ag', 'bulk_dgrad')
    """
    options = [flag for flag in TP_OVERLAP_FLAGS if flag in got]
    ignored += [flag for flag in options if flag in IDLE_FLAGS]
    if not got.get("--tp-comm-overlap"):
        ignored += [flag for flag in options if flag not in IDLE_FLAGS]
        return {}
    if got.get("--deterministic-mode"):  # training/determinism.py:24, 143-148
        raise JobError("--tp-comm-overlap with --deterministic-mode: Megatron asserts '--deterministic-mode requires: "
                       "tp_comm_overlap' (training/determinism.py:24, 146-148); drop one of them")
    off = {name: not any(f"--{p}-{flag}" in got for p in ("no", "disable")) for name, flag in _DISABLE.items()}
    path = got.get("--tp-comm-overlap-cfg")
    return {"tp_comm_overlap": TpCommOverlap(**off, rs_dgrad=bool(got.get("--tp-comm-overlap-rs-dgrad")),
                                             cfg=read_ub_cfg(path) if path else (), cfg_path=path)}


def tp_overlap_args(overlap: TpCommOverlap | None) -> list[str]:
    """The flags of ``overlap`` (:func:`tp_overlap_fields` reads them back)."""
    if overlap is None:
        return []
    args = ["--tp-comm-overlap"] + ["--tp-comm-overlap-rs-dgrad"] * overlap.rs_dgrad
    args += [f"--disable-{flag}" for name, flag in _DISABLE.items() if not getattr(overlap, name)]
    return args + ["--tp-comm-overlap-cfg", overlap.cfg_path] * (overlap.cfg_path is not None)


def quantization_modes(fp8_recipe: str | None, fp8_layers: tuple[int, ...] | None) -> tuple[str, ...]:
    """The userbuffer sets Megatron asks for (initialize.py:228-238): ``fp8`` under FP8, plus ``none`` when some
    layers run in bf16 (``--first-last-layers-bf16`` with a count > 0); ``none`` without FP8."""
    if fp8_recipe is None:
        return ("none",)
    return ("fp8", "none") if fp8_layers is not None and 0 in fp8_layers else ("fp8",)


def check_tp_overlap(overlap: TpCommOverlap | None, model: ModelConfig, *, tp: int, sp: bool, precision: str,
                     delay_wgrad: bool) -> tuple[str, ...]:
    """The model's ``tp_comm_overlap`` (:meth:`TpCommOverlap.linear_modes`; none under the local layers, which
    ignore the buffers TE still allocates, initialize.py:164-166); refuses, naming the flag and the fix, a
    ``--tp-comm-overlap`` job Megatron or TE refuses, or remat does not model."""
    if overlap is None:
        return ()
    fp8_recipe = model.fp8_recipe
    if not isinstance(overlap, TpCommOverlap):
        raise JobError(f"tp_comm_overlap={overlap!r}: must be a TpCommOverlap or None")
    if tp == 1 or not sp:
        why = ("Megatron turns --sequence-parallel off at tp = 1 (arguments.py:1433-1439)" if tp == 1 else
               "it overlaps the sequence-parallel all-gathers and reduce-scatters")
        raise JobError("--tp-comm-overlap needs --sequence-parallel with --tensor-model-parallel-size > 1 (Megatron "
                       f"asserts 'Tensor parallel communication/GEMM overlap can happen only when sequence "
                       f"parallelism is enabled', arguments.py:1441; {why}): add them, or drop --tp-comm-overlap")
    if precision == "fp32":
        raise JobError("--tp-comm-overlap in an fp32 job: TE's userbuffers are bf16 (Megatron passes no dtype to "
                       "initialize_ub) and copying an fp32 activation in fails (csrc/extensions/"
                       "comm_gemm_overlap.cpp:332): add --bf16")
    if fp8_recipe == "blockwise":
        raise JobError("--tp-comm-overlap with --fp8-recipe blockwise: TE's userbuffers take no blockwise FP8 tensor "
                       "('Unsupported quantizer for Userbuffers', module/base.py:720): use --fp8-recipe tensorwise "
                       "or delayed, or drop --tp-comm-overlap")
    if model.multi_latent_attention:
        raise JobError("--tp-comm-overlap with --multi-latent-attention is not modelled: Megatron turns the overlap "
                       "off in the shared config at MLA's first q/kv projection (transformer_engine.py:1176-1186, "
                       "the names are not qkv/proj/fc1/fc2), so only the first layer's projection built on each "
                       "rank overlaps; drop --tp-comm-overlap to price the rest")
    if delay_wgrad and overlap.bulk_wgrad and not overlap.rs_dgrad:
        raise JobError("--delay-wgrad-compute with --tp-comm-overlap: TE raises NotImplementedError ('Delayed weight "
                       "grad computation is not supported with Userbuffers', layernorm_linear.py:1022-1032); add "
                       "--disable-tp-comm-bulk-wgrad or drop one of them")
    for kind in ("qkv", "fc1"):  # base.py:491-511: a non-bulk dgrad moves its wgrad's reduce-scatter to the dgrad
        method = overlap.gemm_cfg(f"{kind}_dgrad").get("method", "bulk")
        if method != "bulk" and overlap.gemm_cfg(f"{kind}_wgrad"):
            raise JobError(f"--tp-comm-overlap-cfg sets {kind}_wgrad beside a {method} {kind}_dgrad: TE raises "
                           f"ValueError (base.py:500-504); drop {kind}_wgrad from the file")
        if method == "ring_exchange" and not overlap.rs_dgrad and overlap.bulk_dgrad:
            raise JobError(f"--tp-comm-overlap-cfg makes {kind}_dgrad ring_exchange while the bulk dgrad overlap is "
                           "on: TE then runs a bulk overlap on a ring-exchange buffer and fails ('Operation is not "
                           "implemented', comm_gemm_overlap.h:136); add --tp-comm-overlap-rs-dgrad")
    ub_gemms(overlap, quantization_modes(fp8_recipe, model.fp8_layers))  # the YAML checked as initialize_ub does
    return overlap.linear_modes() if model.transformer_impl == "transformer_engine" else ()


@dataclass(frozen=True)
class UbGemm:
    """One GEMM's userbuffer as TE's ``initialize_ub`` configures it."""

    mode: str  # the quantization mode: 'fp8' or 'none' (UserBufferQuantizationMode)
    name: str  # e.g. 'qkv_fprop'
    method: str  # ring_exchange, pipeline, bulk or external
    is_reduce_scatter: bool
    fp8_buf: bool  # a uint8 buffer (FP8 mode only)


def ub_gemms(overlap: TpCommOverlap, modes: tuple[str, ...]) -> list[UbGemm]:
    """The userbuffers ``initialize_ub`` makes (TE 2.17.1 module/base.py:311-547): for each quantization mode, each
    of the 12 GEMMs with its default method (:data:`UB_METHODS`) or the YAML's, reduce-scatter for proj/fc2 fprop
    and qkv/fc1 wgrad (a non-bulk qkv/fc1 dgrad takes their reduce-scatter, :491-511), and an FP8 (uint8) buffer
    for the all-gather GEMMs or a YAML ``fp8_buf`` of a pipeline GEMM (:536-545). Raises :class:`JobError` where
    ``add_ub`` raises (a pipelined all-gather, an external wgrad whose dgrad is not ring_exchange).

    Example:
        >>> [g.name for g in ub_gemms(TpCommOverlap(), ("none",)) if g.is_reduce_scatter]
        ['proj_fprop', 'fc2_fprop', 'qkv_wgrad', 'fc1_wgrad']
    """
    all_gather = ["qkv_fprop", "qkv_dgrad", "proj_dgrad", "proj_wgrad", "fc1_fprop", "fc1_dgrad", "fc2_dgrad",
                  "fc2_wgrad"]
    reduce_scatter = ["proj_fprop", "fc2_fprop", "qkv_wgrad", "fc1_wgrad"]
    methods = {k: list(v) for k, v in UB_METHODS.items()}
    moved = [n for n in ("qkv_dgrad", "fc1_dgrad") if overlap.gemm_cfg(n).get("method", "bulk") != "bulk"]
    if moved and len(modes) > 1:  # the second mode's list.remove finds the name gone (base.py:506)
        raise JobError(f"--tp-comm-overlap-cfg moves {moved[0]} off 'bulk' in a job with FP8 and bf16 layers "
                       "(--first-last-layers-bf16): TE's initialize_ub then raises ValueError on the second "
                       "quantization mode (base.py:506); keep it bulk or drop --first-last-layers-bf16")
    for name in ("qkv_dgrad", "fc1_dgrad"):  # the loop runs once: the lists are shared by the modes (:491-511)
        new = overlap.gemm_cfg(name).get("method", "bulk")
        if new != "bulk":
            reduce_scatter.remove(name.replace("dgrad", "wgrad"))
            all_gather.remove(name)
            reduce_scatter.append(name)
            methods["bulk"].remove(name)
            methods[new].append(name)
    gemms = []
    for mode in modes:
        for method in ("ring_exchange", "pipeline", "bulk", "external"):
            for name in methods[method]:
                user = overlap.gemm_cfg(name)
                use = user.get("method", method)
                is_rs = bool(user.get("is_reduce_scatter", name in reduce_scatter))
                fp8_buf = name in all_gather or (bool(user.get("fp8_buf")) and name in methods["pipeline"])
                if not is_rs and use == "pipeline":  # base.py:410-413
                    raise JobError(f"--tp-comm-overlap-cfg: {name} uses 'pipeline', which TE does not support for "
                                   "an all-gather (base.py:410-413): use ring_exchange or bulk")
                if name in ("proj_wgrad", "fc2_wgrad"):  # base.py:435-446
                    dgrad = name.replace("wgrad", "dgrad")
                    if use != "external" or dgrad not in methods["ring_exchange"]:
                        raise JobError(f"--tp-comm-overlap-cfg: {name} must stay 'external' (TE raises ValueError, "
                                       "base.py:435-446): change the file")
                gemms.append(UbGemm(mode, name, use, is_rs, mode == "fp8" and fp8_buf))
    return gemms
