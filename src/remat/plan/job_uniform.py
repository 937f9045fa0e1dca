"""One Megatron setting for every pipeline stage of a whole job (what Megatron's flags express): the cheapest whose
exact whole-rank prediction fits the budget on every stage (:func:`uniform_setting`).

NOTE [the uniform screen]: the job's twin of the Megatron screen of a stage (NOTE [the Megatron screen of a stage] in
remat.plan.megatron_screen). The candidates are the Megatron settings of the job's deepest chunk
(remat.plan.moe_modules.job_policies), each what Megatron runs on every stage's chunks (NOTE [uneven splits]), in the
order of their cost (the slowest stage's), then of their estimated peak (the highest stage's); a setting that runs on
every stage what a cheaper-listed one runs is left out. A setting fits iff every stage's exact peak fits. On each stage
the premise of the stage's screen holds (exact - modelled peak = c - g, c one constant of the stage, g at the modelled
peak <= the bytes the setting holds there beyond the rank: the .grad of the layers whose backward has begun and the side
inputs), so a setting's exact peak there is >= its modelled peak + the largest exact - modelled seen on the stage (from
its calibration on "nothing recomputed" and every setting already predicted there, e.g. by the stage's own screen) -
those bytes. A setting over the budget by that lower bound on any stage cannot fit and is skipped without predicting it;
so is one cheaper than a stage's own cheapest fitting Megatron setting (none cheaper fits that stage; only stages whose
screen the time cap did not cut). The others are predicted exactly in cost order (an exact peak already predicted is
read, not predicted again), stage by stage (a known peak first, then the highest bound, the rest predicted side by side
ahead where there are cores), a setting dropped at its first stage that does not fit, until the first setting that fits
every stage: the cheapest that fits. An exact peak under its bound (the premise broken) screens again with the
calibrations alone (not raised by what was seen) and each stage's whole slack (every layer's .grad and the side inputs).
The search is capped by time (:data:`UNIFORM_SECONDS`, after at least one exact prediction of its own): when the cap
cuts it, ``stats['uniform_search_cut']`` says so and the answer is ``full/uniform/1`` (every layer recomputed:
Megatron's lowest peak) if that fits every stage, else none; a cheaper setting may fit.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from remat.cache_state import not_repeatable
from remat.parallel.job_predict import RankPrediction
from remat.plan.costs import CostModel
from remat.plan.job_result import JobPlan, JobStagePlan
from remat.plan.job_stages import rank_config
from remat.plan.moe_modules import job_policies
from remat.plan.unit_model import UnitModel
from remat.policy import Policy
from remat.recompute.plan_format import Plan, Unit

UNIFORM_SECONDS = 120.0  # exact predictions of the uniform screen stop after this long (at least one is made)


class ExactPredictions(Protocol):
    """The job's exact whole-rank predictions (remat.plan.job_plan), each computed once."""

    done: dict[tuple[int, str], RankPrediction]  # (stage, str(policy)) -> its prediction, for those made or read

    def __call__(self, stage: int, plan: Plan | Policy) -> RankPrediction: ...

    def prefetch(self, wanted: Sequence[tuple[int, Plan | Policy]]) -> None: ...


class StageEstimate(Protocol):
    """A stage's estimate of its exact peak (remat.plan.job_plan): unit model + microbatches in flight."""

    model: UnitModel
    cost: CostModel

    @property
    def num_layers(self) -> int: ...

    def policy_plan(self, policy: Policy) -> Plan: ...

    def plan_cost(self, plan: Plan) -> int: ...

    def modelled(self, units: Sequence[Unit]) -> int: ...


@dataclass
class UniformScreen:
    """What the uniform screen found (NOTE [the uniform screen])."""

    policy: Policy | None  # the cheapest setting whose exact peak fits every stage; None: none (or the cap cut it)
    ranks: list[RankPrediction] = field(default_factory=list)  # its exact prediction on every stage
    cut: bool = False  # the time cap stopped the search before it found a fit or ran out of settings
    skipped: int = 0  # settings ruled out by a bound or a stage's own cheapest fit, without predicting them
    bound_broken: bool = False  # an exact peak came out under its bound: screened again on the calibrations alone


@dataclass
class _Row:
    policy: Policy
    cost: int  # the slowest stage's
    modelled: dict[int, int]  # stage -> the modelled peak of what it runs (stages with decoder layers)
    held: dict[int, int] = field(default_factory=dict)  # stage -> bytes that peak holds beyond the rank


def uniform_setting(result: JobPlan, stage_models: Sequence[StageEstimate | None], exact: ExactPredictions,
                    engine: str, seconds: float | None = None) -> UniformScreen:
    """The cheapest Megatron setting whose exact whole-rank peak fits ``result.budget_bytes`` on every stage
    (NOTE [the uniform screen]); sets ``result.uniform``, ``result.uniform_ranks`` (worst first) and
    ``result.stats['uniform_search_cut']``, and records every exact peak it reads in the stage's ``tried``.

    Args:
        result: the job's plan, each stage's own Megatron setting already searched (``megatron``,
            ``megatron_search_cut``).
        stage_models: per stage (``result.stages``' order) its calibrated estimate; None: the stage has no decoder
            layer (its peak is predicted exactly, with no bound).
        exact: the job's exact predictions, ``exact(stage, policy)`` the stage's whole rank under ``policy``.
        engine: the checkpoint engine of the settings.
        seconds: no further exact prediction starts after this long (the first one always does); None:
            :data:`UNIFORM_SECONDS` as it is at the call.
    """
    found = _screen(result, stage_models, exact, engine, UNIFORM_SECONDS if seconds is None else seconds)
    result.uniform, result.uniform_ranks = found.policy, sorted(found.ranks, key=lambda r: (-r.peak_bytes, r.stage))
    result.stats["uniform_search_cut"] = found.cut
    return found


def _screen(result: JobPlan, stage_models: Sequence[StageEstimate | None], exact: ExactPredictions, engine: str,
            seconds: float) -> UniformScreen:
    started = time.perf_counter()
    budget, stages = result.budget_bytes, result.stages
    if any(st.megatron is None for st in stages):  # a stage no Megatron setting fits: no setting fits them all
        return UniformScreen(None)
    models = {st.stage: sm for st, sm in zip(stages, stage_models) if sm is not None}
    none = Policy(engine=engine)
    calibration = {s: exact(s, none).peak_bytes - sm.modelled(sm.policy_plan(none).units()) for s, sm in
                   models.items()}
    slack = {s: sm.model.held_beyond_rank(sm.num_layers) for s, sm in models.items()}
    rows = _rows(result, models, calibration, engine)
    # no setting cheaper than a stage's own cheapest fit fits it (unless the time cap cut that stage's screen)
    least = max((_own_cost(st) for st in stages if not st.megatron_search_cut), default=0)
    predicted = [False]  # whether this screen has made an exact prediction yet (the cap applies after the first)

    def known(s: int, row: _Row) -> RankPrediction | None:
        return exact.done.get((s, str(row.policy)))

    def run(raise_offset: bool) -> UniformScreen:
        seen, skipped = dict(calibration), 0

        def bound(s: int, row: _Row) -> int | None:
            if s not in row.modelled:
                return None
            return row.modelled[s] + seen[s] - (row.held[s] if raise_offset else slack[s])

        def see(s: int, row: _Row, peak: int) -> bool:
            """Raise the stage's offset by ``peak``; False when ``peak`` is under its bound (the premise broken)."""
            if not raise_offset or s not in row.modelled:
                return True
            b = bound(s, row)
            seen[s] = max(seen[s], peak - row.modelled[s])
            return b is None or peak >= b
        for row in rows:  # what is already known, e.g. from the stages' own screens, first
            for s in row.modelled:
                if (pred := known(s, row)) is not None and not see(s, row, pred.peak_bytes):
                    return UniformScreen(None, bound_broken=True)
        for row in rows:
            if row.cost < least or any((b := bound(st.stage, row)) is not None and b > budget for st in stages
                                       if known(st.stage, row) is None):
                skipped += 1
                continue
            ready = {st.stage: p for st in stages if (p := known(st.stage, row)) is not None}
            if over := [s for s, p in ready.items() if p.peak_bytes > budget]:  # known not to fit
                stages[over[0]].tried[str(row.policy)] = ready[over[0]].peak_bytes
                continue
            todo = sorted((st.stage for st in stages if st.stage not in ready), key=lambda s: -(bound(s, row) or 0))
            if todo and predicted[0] and time.perf_counter() - started > seconds:
                not_repeatable()  # the answer depends on this machine's speed: not stored as the command's
                return UniformScreen(None, cut=True, skipped=skipped)
            if len(todo) > 1:
                exact.prefetch([(s, row.policy) for s in todo])
            preds = []
            for s in list(ready) + todo:
                pred = ready.get(s)
                if pred is None:
                    pred, predicted[0] = exact(s, row.policy), True
                stages[s].tried[str(row.policy)] = pred.peak_bytes
                if not see(s, row, pred.peak_bytes):
                    return UniformScreen(None, skipped=skipped, bound_broken=True)
                if pred.peak_bytes > budget:
                    break
                preds.append(pred)
            else:
                return UniformScreen(row.policy, preds, skipped=skipped)
        return UniformScreen(None, skipped=skipped)

    found = run(True)
    if found.bound_broken:
        found = run(False)
        found.bound_broken = True
    if found.cut:  # every layer recomputed, Megatron's lowest peak: the answer when the cap cut the search
        full, preds = Policy("full", "uniform", 1, engine=engine), []
        for st in stages:
            pred = exact(st.stage, full)
            st.tried[str(full)] = pred.peak_bytes
            if pred.peak_bytes > budget:
                break
            preds.append(pred)
        else:
            found.policy, found.ranks = full, preds
    return found


def _own_cost(st: JobStagePlan) -> int:
    """The cost of the stage's cheapest recompute-only Megatron setting that fits (NOTE [offloading in a job])."""
    choice = st.megatron_without_offload or st.megatron
    return 0 if choice is None else choice.cost


def _rows(result: JobPlan, models: dict[int, StageEstimate], calibration: dict[int, int], engine: str) -> list[_Row]:
    """The settings of the job's deepest chunk, each once per what it runs on the stages, in the screen's order."""
    if not models:  # no stage has a decoder layer: recompute changes nothing
        return [_Row(Policy(engine=engine), 0, {})]
    first = next(iter(models.values()))
    keyed, seen = [], set()
    for policy in job_policies(result.job.layers_per_chunk, engine, rank_config(result.job), first.cost,
                               [sm.model for sm in models.values()]):
        plans = {s: sm.policy_plan(policy) for s, sm in models.items()}
        if tuple(plans.values()) in seen:  # the same on every stage as a cheaper-listed one (full/block/L, ...)
            continue
        seen.add(tuple(plans.values()))
        row = _Row(policy, max(models[s].plan_cost(p) for s, p in plans.items()),
                   {s: models[s].modelled(p.units()) for s, p in plans.items()},
                   {s: models[s].model.beyond_rank(p.units()) for s, p in plans.items()})
        keyed.append(((row.cost, max(m + calibration[s] for s, m in row.modelled.items()), str(policy)), row))
    keyed.sort(key=lambda k: k[0])
    return [row for _, row in keyed]
