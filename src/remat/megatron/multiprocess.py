"""Measure a megatron-core model for real on CPU with one gloo process per rank (TP, PP, ...), to compare with
:func:`remat.megatron.predict_megatron_core` rank by rank.

The processes are started, watched and always ended as :mod:`remat.parallel.launch` does for remat's own models
(its store folder, failure naming, SIGTERM clean-up and timeout); each runs :mod:`remat.megatron.rank_worker`,
which rebuilds the ``TransformerConfig`` from JSON (:mod:`remat.megatron.config_json`) and records its rank's step
with the same code as a prediction, only with real tensors and the gloo backend.
"""

from __future__ import annotations

from typing import Any

from remat.config import RoutingAssumption
from remat.megatron.compat import MegatronSettingError
from remat.megatron.config_json import config_to_json
from remat.megatron.routing import routing_assumption
from remat.megatron.world import ParallelSizes
from remat.parallel.launch import launch_job
from remat.timeline import Timeline

DEFAULT_TIMEOUT = 180.0
RANK_WORKER = ("remat.megatron.rank_worker",)  # python -m <this> FOLDER RANK LAUNCHER_PID


def measure_megatron_core_distributed(config: Any, *, seq_length: int, micro_batch_size: int, vocab_size: int,
                                      tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, etp: int | None = None,
                                      dp: int | None = None, ddp: bool = False, use_distributed_optimizer: bool = False,
                                      optimizer: str = "none", routing: RoutingAssumption | str | None = None,
                                      timeout: float = DEFAULT_TIMEOUT) -> dict[int, Timeline]:
    """Run one training step of a megatron-core GPT for real on CPU, one gloo process per rank, and measure
    every rank.

    Args:
        config: a ``TransformerConfig`` (or ``MLATransformerConfig``) whose fields travel as JSON (see
            :mod:`remat.megatron.config_json`); the default local layer spec.
        seq_length, micro_batch_size, vocab_size, tp, pp, cp, ep, etp, dp, ddp, use_distributed_optimizer,
            optimizer, routing: as :func:`remat.megatron.predict_megatron_core`.
        timeout: seconds for the whole run; past it every process is killed and :class:`DistributedError` names
            the rank that stopped making progress (since when, in which phase) and the ranks waiting on it
            (:func:`remat.parallel.launch.stall_report`).

    Returns:
        ``{rank: Timeline}`` for every rank of the job (``meta['backend'] == 'cpu'``, ``meta['pid']``).

    Raises:
        DistributedError: a rank failed (the first failure is named) or the run timed out; every process has
            ended when it is raised.

    Example::

        >>> config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
        ...                            tensor_model_parallel_size=2, use_cpu_initialization=True)
        >>> measured = measure_megatron_core_distributed(config, seq_length=32, micro_batch_size=2,
        ...                                              vocab_size=128, tp=2)
        >>> sorted(measured)
        [0, 1]
    """
    sizes = ParallelSizes(tp, pp, cp, ep, etp, dp)
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise MegatronSettingError(f"timeout={timeout!r}: give the run's limit in seconds, > 0")
    routing = routing_assumption(routing)
    job = {"config": config_to_json(config), "seq_length": seq_length, "micro_batch_size": micro_batch_size,
           "vocab_size": vocab_size, "sizes": {"tp": tp, "pp": pp, "cp": cp, "ep": ep, "etp": etp, "dp": dp},
           "ddp": ddp, "use_distributed_optimizer": use_distributed_optimizer, "optimizer": optimizer,
           "routing": str(routing) if routing is not None else None, "timeout": float(timeout)}
    results = launch_job(job, sizes.world_size, float(timeout), worker=RANK_WORKER)
    return {rank: Timeline.from_dict(data) for rank, data in enumerate(results)}
