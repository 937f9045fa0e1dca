"""torch's own selective-activation-checkpointing planner as a peer of ``remat plan`` (benchmarks/bench_plan.py).

torch.distributed._tools: :class:`MemTracker` (per-module memory), :class:`RuntimeEstimator` and
:class:`SACEstimator` (per-operator memory and time, with the piecewise-linear trade-off curve of each module) under
FakeTensorMode, :func:`aggregate_stats` + :func:`parse_module_info` into a module graph, and :func:`sac_milp`
(PuLP/CBC) for a discard ratio per layer; each chosen layer then saves the operators
:func:`get_optimal_checkpointing_policy_per_module` keeps for its ratio (a knapsack over its operators) under
``torch.utils.checkpoint`` with a selective-checkpoint policy. Operators are priced with the price remat is given
(:func:`roofline`), replacing torch's CUDA-only roofline, so both planners optimise the same objective.

Needs ``pulp`` and ``pwlf`` (``.venv/bin/pip install pulp pwlf``); :func:`missing` says what is absent.
:func:`probe_rockmate` says whether the other peer bench_plan.py knows of, rockmate, imports here.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from torch.utils.flop_counter import FlopCounterMode

GIB = 1 << 30


def missing() -> str | None:
    """Why the peer cannot run here (a package to install), or None."""
    for name in ("pulp", "pwlf"):
        if importlib.util.find_spec(name) is None:
            return f"torch's SAC ILP needs '{name}': .venv/bin/pip install pulp pwlf"
    return None


def roofline(flops_per_second: float, memory_bandwidth: float) -> Callable[..., tuple[Any, float]]:
    """An operator's milliseconds as ``max(FLOPs / flops_per_second, bytes read and written / memory_bandwidth)``
    (torch's own roofline, with the given device instead of the CUDA device torch's asks for)."""
    def nbytes(tree: Any) -> int:
        flat, _ = torch.utils._pytree.tree_flatten(tree)
        return sum(t.untyped_storage().nbytes() if t.is_contiguous() else t.numel() * t.element_size()
                   for t in flat if isinstance(t, torch.Tensor))

    def estimate(func: Any, args: Any, kwargs: Any) -> tuple[Any, float]:
        kwargs = kwargs or {}
        counter = FlopCounterMode(display=False)
        with counter:
            out = func(*args, **kwargs)
        seconds = max(counter.get_total_flops() / flops_per_second,
                      (nbytes(args) + nbytes(kwargs) + nbytes(out)) / memory_bandwidth)
        return out, 1e3 * seconds
    return estimate


class TorchSAC:
    """The statistics torch's planner collects for one model, once; :meth:`plan` then answers any budget."""

    def __init__(self, build: Callable[[], nn.Module], batch: tuple[torch.Tensor, ...],
                 flops_per_second: float = 400e12, memory_bandwidth: float = 3e12):
        from torch.distributed._tools.ilp_utils import aggregate_stats, parse_module_info
        from torch.distributed._tools.mem_tracker import MemTracker
        from torch.distributed._tools.runtime_estimator import RuntimeEstimator
        from torch.distributed._tools.sac_estimator import SACEstimator

        price = roofline(flops_per_second, memory_bandwidth)
        saved = RuntimeEstimator._roofline_estimate
        RuntimeEstimator._roofline_estimate = classmethod(lambda cls, f, a, k: price(f, a, k))  # type: ignore
        try:
            with FakeTensorMode(allow_non_fake_inputs=False) as fake:
                model = build()
                fbatch = tuple(fake.from_tensor(t) for t in batch)
                tracker = MemTracker()
                tracker.track_external(model)
                with tracker:
                    for i in range(2):  # the second iteration's stats: gradients exist as in a steady step
                        model(*fbatch).backward()
                        if i == 0:
                            tracker.reset_mod_stats()
                runtime = RuntimeEstimator()
                with runtime("operator-level-cost-model"):
                    model(*fbatch).backward()
                sac = SACEstimator()
                with sac("operator-level-cost-model"):
                    model(*fbatch)
                info = aggregate_stats(model, tracker, runtime, sac, torch.device("cpu"))
        finally:
            RuntimeEstimator._roofline_estimate = saved  # type: ignore[method-assign]
        self.info, self.sac = info, sac
        self.parse = parse_module_info
        self.layer_fqns = [s["fqn"] for s in info["mod_stats"] if s["fqn"].count(".") == 1 and
                           s["fqn"].split(".")[1] == "layers"] or [
            s["fqn"] for s in info["mod_stats"] if s["fqn"].split(".")[-2:-1] == ["layers"]]

    def plan(self, budget_bytes: int) -> tuple[dict[str, float], float, int]:
        """``sac_milp`` at ``budget_bytes``: (discard ratio per layer fqn, its recompute ms, its peak estimate;
        -1 when the ILP finds no solution)."""
        from torch.distributed._tools.sac_ilp import sac_milp

        graph = self.parse(self.info)
        return sac_milp(graph, memory_budget=budget_bytes / GIB, world_size=1, ac_units=self.layer_fqns)

    def apply(self, model: nn.Module, decisions: dict[str, float]) -> dict[str, int]:
        """Wrap each layer of ``model`` that ``decisions`` names in a selective checkpoint saving the operators
        torch's per-module knapsack keeps at ``1 - ratio`` of its activation memory; returns the operators saved
        per layer."""
        from torch.distributed._tools.sac_estimator import OPS_TO_ALWAYS_SKIP
        from torch.distributed._tools.sac_ilp import get_optimal_checkpointing_policy_per_module

        modules = dict(model.named_modules())
        root = next(iter(self.sac.sac_mod_stats)).split(".")[0] if self.sac.sac_mod_stats else ""
        saved = {}
        for fqn, ratio in decisions.items():
            stats = self.sac.sac_mod_stats[fqn]
            keep = get_optimal_checkpointing_policy_per_module(stats, memory_budget=max(0.0, min(1.0, 1 - ratio)))
            name = fqn[len(root) + 1:] if fqn.startswith(root + ".") else fqn
            layer = modules[name]
            saved[fqn] = sum(keep)
            layer.forward = _selective(layer.forward, keep, OPS_TO_ALWAYS_SKIP)  # type: ignore[method-assign]
        return saved


def _selective(forward: Callable[..., Any], keep: list[int], skipped: set[Any]) -> Callable[..., Any]:
    """``forward`` under torch's selective checkpoint: the i-th operator (as SACEstimator counted them) is saved
    when ``keep[i]``, else recomputed in backward."""
    def contexts() -> Any:
        seen = {False: 0, True: 0}

        def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            if func in skipped:
                return CheckpointPolicy.PREFER_RECOMPUTE
            i = seen[ctx.is_recompute]
            seen[ctx.is_recompute] += 1
            return CheckpointPolicy.MUST_SAVE if i < len(keep) and keep[i] else CheckpointPolicy.PREFER_RECOMPUTE
        return create_selective_checkpoint_contexts(policy)

    @functools.wraps(forward)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, context_fn=contexts, **kwargs)
    return wrapped


def probe_rockmate(python: str | None) -> dict[str, Any]:
    """Whether rockmate imports here (and in ``python``), with the exact error when it does not."""
    code = (
        "import importlib.metadata as md, sys\n"
        "out = {'python': sys.executable}\n"
        "try:\n"
        "    out['rockmate_version'] = md.version('rockmate')\n"
        "    out['rkgb_version'] = md.version('rkgb')\n"
        "    out['rkgb_files'] = sorted(str(f) for f in (md.files('rkgb') or []) if str(f).endswith('.py'))\n"
        "except Exception as e:\n"
        "    out['metadata_error'] = f'{type(e).__name__}: {e}'\n"
        "try:\n"
        "    import rockmate\n"
        "    out['import'] = 'ok'\n"
        "except Exception as e:\n"
        "    out['import'] = f'{type(e).__name__}: {e}'\n"
        "import json; print(json.dumps(out))\n")
    results = {}
    for name, exe in (("this interpreter", sys.executable), ("--rockmate-python", python)):
        if exe is None:
            continue
        try:
            done = subprocess.run([exe, "-c", code], capture_output=True, text=True, timeout=300)
            results[name] = json.loads(done.stdout.strip().splitlines()[-1]) if done.stdout.strip() else {
                "import": f"interpreter failed: {done.stderr.strip()[-300:]}"}
        except Exception as err:  # noqa: BLE001 - report whatever stops the probe
            results[name] = {"import": f"{type(err).__name__}: {err}"}
    return results
