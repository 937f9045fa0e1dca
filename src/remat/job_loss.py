"""The loss part of a Megatron-LM job's flags: ``--cross-entropy-loss-fusion`` and ``--cross-entropy-fusion-impl``
read into :attr:`~remat.config.ModelConfig.cross_entropy`, ``--mtp-num-layers`` (the multi-token-prediction losses,
NOTE [multi-token prediction] in :mod:`remat.models.gpt`) into ``mtp_num_layers`` (:func:`loss_fields`) and written back
(:func:`loss_args`), so that :func:`remat.job.parse_megatron_args` and :meth:`remat.job.Job.to_megatron_args`
round-trip it. The implementations themselves: :mod:`remat.models.cross_entropy`.

Decisions (NVIDIA/Megatron-LM at d98e8a64):

* Every Megatron rank computes the loss with Megatron's cross-entropy, tp = 1 included
  (megatron/core/models/common/language_module/language_module.py::compute_language_model_loss): a Job's model
  never keeps ``torch`` (:func:`megatron_loss` turns it into ``megatron``).
* ``--cross-entropy-loss-fusion`` picks ``--cross-entropy-fusion-impl``, default ``native``
  (megatron/core/model_parallel_config.py): ``megatron_fused``; without the fusion the impl is not read (ignored).
* ``--cross-entropy-fusion-impl te`` with the fusion is refused, as megatron/training/arguments.py::validate_args
  asserts; a Job built with ``cross_entropy='te'`` (megatron-core's TransformerConfig only warns) is predicted,
  and has no Megatron-LM command line.
"""

from __future__ import annotations

from typing import Any

from remat.config import ModelConfig
from remat.job_flags import JobError

TE_REFUSED = ("--cross-entropy-fusion-impl te with --cross-entropy-loss-fusion: Megatron-LM refuses it "
              "('Transformer Engine cross entropy loss fusion is disabled due to stability issues', "
              "megatron/training/arguments.py::validate_args); use --cross-entropy-fusion-impl native, or omit "
              "--cross-entropy-loss-fusion")


def loss_fields(got: dict[str, Any], ignored: list[str]) -> dict[str, Any]:
    """The ModelConfig field of the loss flags in ``got`` (flag -> value); an idle impl goes to ``ignored``.

    Example:
        >>> loss_fields({"--cross-entropy-loss-fusion": True}, [])
        {'cross_entropy': 'megatron_fused'}
    """
    fusion, impl = bool(got.get("--cross-entropy-loss-fusion")), got.get("--cross-entropy-fusion-impl")
    if fusion and impl == "te":
        raise JobError(TE_REFUSED)
    if impl is not None and not fusion:
        ignored.append("--cross-entropy-fusion-impl")  # language_module.py reads it only with the fusion
    return {"cross_entropy": "megatron_fused" if fusion else "megatron",
            "mtp_num_layers": got.get("--mtp-num-layers", 0)}


def loss_args(model: ModelConfig) -> list[str]:
    """The flags that give ``model.cross_entropy`` back (none for ``megatron``); ``te`` has none Megatron-LM takes.

    Example:
        >>> loss_args(ModelConfig(cross_entropy="megatron_fused"))
        ['--cross-entropy-loss-fusion']
    """
    if model.cross_entropy == "te":
        raise JobError(f"cross_entropy='te' has no Megatron-LM command line: {TE_REFUSED}")
    return ["--cross-entropy-loss-fusion"] * (model.cross_entropy == "megatron_fused") + [
        "--mtp-num-layers", str(model.mtp_num_layers)] * (model.mtp_num_layers > 0)


def check_multi_token_prediction(model: ModelConfig, layout: str | None, policy: Any) -> None:
    """Refuse what Megatron refuses with ``--mtp-num-layers``, and what remat does not model with it yet.

    Megatron: rope (or no) positions only (megatron/training/arguments.py:882-886); a layout must place the MTP
    layers with ``m`` (pipeline_parallel_layer_layout.py:112; remat takes them before the loss, where it builds the MTP
    depths, :func:`remat.job_pipeline.parse_layout`). Recompute and offloading act on the MTP layers too in
    Megatron: selective modules and the offload groups in their transformer layer (which :func:`remat.apply`
    follows), full recompute through ``_checkpointed_forward`` (multi_token_prediction.py:1492, which it does not
    yet: refused)."""
    if not model.mtp_num_layers:
        return
    if model.position != "rope":
        raise JobError("--mtp-num-layers with learned absolute positions: Megatron supports multi-token prediction "
                       "only with --position-embedding-type rope (or none); use rope")
    if layout is not None and "m" not in layout:
        raise JobError("--mtp-num-layers with a --pipeline-model-parallel-layout that places no MTP layer: Megatron "
                       "needs them in the layout (m, before the loss: ...tmL); add them")
    if policy.granularity == "full":
        raise JobError("--mtp-num-layers with full recompute: Megatron checkpoints the MTP layers too, projection and "
                       "norms with them (multi_token_prediction.py:1492 _checkpointed_forward), which remat does not "
                       "model yet; use selective recompute (which remat applies to the MTP layers as Megatron does) or "
                       "drop the --recompute-* flags")


def megatron_loss(model: ModelConfig) -> dict[str, str]:
    """The field change that makes ``model``'s loss Megatron's (``torch`` -> ``megatron``), or none."""
    return {"cross_entropy": "megatron"} if model.cross_entropy == "torch" else {}
