"""The exact whole-rank predictions a job plan makes (:class:`ExactStages`): each (stage, plan or policy) predicted
once (:func:`remat.parallel.job_predict.predict_stage`), kept on disk, and made ahead in forked workers where cores
are free."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from remat.job import Job
from remat.memory import disk_cache
from remat.memory.alloc_config import AllocatorConfig
from remat.memory.rank_state import RankState
from remat.memory.replay_pool import BackgroundReplays
from remat.memory.trace_pool import idle_workers, run_forked
from remat.parallel.chunk_trace import keep_shallow_chunks, shallow_chunk_keys, shallow_chunks_since
from remat.parallel.job_predict import (
    JobPrediction,
    RankPrediction,
    add_replays,
    add_reserved,
    chunk_config,
    job_kernels,
    outside_allocator_buffers,
    predict_stage,
    replays_wanted,
    stage_state,
)
from remat.plan.job_stages import rank_config, stage_chunks
from remat.policy import Policy
from remat.recompute.plan_format import Plan
from remat.timeline import Timeline, TimelineError


class ExactStages:
    """Exact whole-rank predictions of (stage, plan or policy), each computed once, and kept on disk
    (:mod:`remat.memory.disk_cache`, keyed by the job, the stage and the plan) for the next run."""

    def __init__(self, job: Job, device: str, engine: str, states: Sequence[RankState], *, kernels: str | None = None,
                 env: Mapping[str, str] | None = None, gpu: str | None = None, disk: bool = True):
        self.job, self.device, self.engine, self.states = job, device, engine, states
        self.env, self.gpu, self.disk = env, gpu, disk  # disk: read and keep predictions in the disk cache
        self.done: dict[tuple[int, str], RankPrediction] = {}
        self.made: set[tuple[int, str]] = set()  # of those, predicted here (not read from the disk cache)
        self.spare: dict[tuple[int, str], Any] = {}  # made ahead in forked workers (prefetch), taken when asked for
        self.side_by_side = True  # whether forked workers may predict (not when the disk cache answers: warm runs)
        self.job_key = repr(job.replace(policy=Policy()))
        self.kernels = job_kernels(kernels)  # plan_job's profile (one for the search and every exact prediction)

    def __call__(self, stage: int, plan: Plan | Policy) -> RankPrediction:
        key, policy = self.key(stage, plan)
        if key not in self.done:
            if key in self.spare:
                entry, chunks = self.spare.pop(key)
                self.adopt([entry])
                keep_shallow_chunks(chunks)
            else:
                self.done[key] = self._predict(stage, plan, policy, key[1])
        return self.done[key]

    @staticmethod
    def key(stage: int, plan: Plan | Policy) -> tuple[tuple[int, str], Policy | None]:
        """((stage, the setting's or plan's name), the Megatron policy it is, if one): a plan that is a Megatron
        setting is that setting's prediction."""
        policy = plan if isinstance(plan, Policy) else plan.megatron_policy()[0]  # a Policy: fine-grained offloading
        return (stage, str(policy) if policy is not None else f"plan {plan}@{plan.engine}"), policy

    def prefetch(self, wanted: Sequence[tuple[int, Plan | Policy]], *, alike: bool = False,
                 finish: Callable[[RankPrediction], None] | None = None) -> None:
        """Predict those of ``wanted`` not predicted yet side by side in forked workers, when there are two or more
        and several cores; each is taken (kept, counted) only when asked for, so that what the caller then asks
        for, and in which order, is all that counts, as without the prefetch.

        Only one of the stages whose chunks are alike is predicted ahead (:meth:`groups`); with ``alike`` the
        others are too, each handed to a worker once the shallow traces the first one made have come back (NOTE
        [alike stages ahead]). ``finish(prediction)`` runs in the worker on each prediction it makes (e.g. its
        caching-allocator replay, :func:`~remat.parallel.job_predict.add_reserved`), so what it sets comes back
        with it."""
        groups = self.groups(wanted)
        todo = [first for first, _ in groups]
        after: dict[int, int] = {}  # each alike stage waits for its group's first (its shallow traces)
        for g, (_, others) in enumerate(groups if alike else ()):
            for other in others:
                after[len(todo)] = g
                todo.append(other)
        workers = min(idle_workers(), len(todo)) if self.side_by_side and len(todo) > 1 else 1
        if workers > 1:
            tasks = [self.ahead(s, p, finish) for s, p in todo]
            self.keep_ahead(run_forked(tasks, workers, after=after, share=lambda answer: answer[1],
                                       receive=lambda chunk: keep_shallow_chunks([chunk])))

    def groups(self, wanted: Sequence[tuple[int, Plan | Policy]],
               ) -> list[tuple[tuple[int, Plan | Policy], list[tuple[int, Plan | Policy]]]]:
        """Those of ``wanted`` neither predicted nor made ahead yet, each once, grouped by the kinds and layers of
        their chunks under their setting: stages of one group lay their chunks out from the same shallow traces, so
        the first one's prediction makes them and the others' only lay out. Each group: (its first, the others)."""
        out: dict[Any, tuple[tuple[int, Plan | Policy], list[tuple[int, Plan | Policy]]]] = {}
        seen: set[tuple[int, str]] = set()
        config = rank_config(self.job)
        for s, p in wanted:
            key = self.key(s, p)[0]
            if key in self.done or key in self.spare or key in seen:
                continue
            seen.add(key)
            # a chunk's kind and its own layers' config (dense or MoE, windows, FP8: chunk_config): a chunk mixing
            # dense and MoE layers is traced whole, one of MoE layers only laid out from a shallow MoE chunk
            sig = (key[1], tuple((c.kind, chunk_config(config, c)) for c in stage_chunks(self.job, s)))
            if sig in out:
                out[sig][1].append((s, p))
            else:
                out[sig] = ((s, p), [])
        return list(out.values())

    def ahead(self, stage: int, plan: Plan | Policy,
              finish: Callable[[RankPrediction], None] | None = None) -> Callable[[], Any]:
        """A task predicting (stage, plan) in a forked worker, for :meth:`keep_ahead`: its prediction, and the
        shallow chunk traces it made (for the parent and the other workers)."""
        def run() -> Any:
            known = shallow_chunk_keys()
            pred, key = self(stage, plan), self.key(stage, plan)[0]
            if finish is not None:
                finish(pred)
            return (key, pred, key in self.made), shallow_chunks_since(known)
        return run

    def keep_ahead(self, answers: Sequence[Any]) -> None:
        """Keep what :meth:`ahead` tasks sent back, each prediction taken only when asked for."""
        for entry, chunks in answers:
            keep_shallow_chunks(chunks)  # the same chunks whichever shallow trace they are laid out from
            if entry[0] not in self.done:
                self.spare.setdefault(entry[0], (entry, []))

    @property
    def count(self) -> int:
        """Predictions made (not read from the disk cache)."""
        return len(self.made)

    def made_since(self, known: frozenset[tuple[int, str]]) -> list[tuple[tuple[int, str], RankPrediction, bool]]:
        """The predictions not among ``known``, each with whether it was made (not read from the disk cache)."""
        return [(key, pred, key in self.made) for key, pred in self.done.items() if key not in known]

    def adopt(self, found: Sequence[tuple[tuple[int, str], RankPrediction, bool]]) -> None:
        """Take predictions another process made (:meth:`made_since`): each is the same whoever makes it."""
        for key, pred, made in found:
            self.done.setdefault(key, pred)
            if made:
                self.made.add(key)

    def _predict(self, stage: int, plan: Plan | Policy, policy: Policy | None, layout: str) -> RankPrediction:
        disk_key = {"job": self.job_key, "stage": stage, "layout": layout, "device": self.device,
                    "kernels": self.kernels, **({"env": dict(self.env)} if self.env else {}),
                    **({"gpu": self.gpu} if self.gpu else {})}
        stored = disk_cache.load("job_stage", disk_key) if self.disk else None
        if stored is not None:
            try:
                return RankPrediction(stage, int(stored["rank"]), int(stored["ranks"]), self.states[stage],
                                      Timeline.from_dict(stored["timeline"]),
                                      outside=outside_allocator_buffers(self.job, stage))
            except (KeyError, TypeError, ValueError, TimelineError) as err:
                warnings.warn(f"remat cache: a stored stage prediction is malformed ({err}); predicting it again",
                              stacklevel=2)
        self.made.add((stage, layout))
        where = {"device": self.device, "kernels": self.kernels, "env": self.env, "gpu": self.gpu}
        pred = predict_stage(self.job.replace(policy=policy), stage, **where) if policy is not None \
            else predict_stage(self.job, stage, layout=plan, **where)
        if self.disk:
            disk_cache.store("job_stage", disk_key, {"rank": pred.rank, "ranks": pred.ranks,
                                                     "timeline": pred.timeline.to_dict()})
        return pred


# NOTE [alike stages ahead]: stages whose chunks are of the same kinds and layers under the same setting lay their
# chunks out from the same shallow traces; they still differ in what they hold (their place in the schedule, their
# model state), so each is composed and, for GPU bytes, replayed through the caching allocator: about 0.07 s a stage
# for DeepSeek-V3's (22k rows each). predict_policies hands them to the same forked workers as the first stage of
# each group, each once that stage's shallow traces have come back (sent along to the worker that takes it: NOTE
# [tasks that wait for another's answer] in remat.memory.trace_pool), each replay made in the worker beside its
# prediction: no worker waits for a second round, no second fork, and no core stands idle while one worker traces.
def predict_policies(job: Job, policies: Sequence[Policy], *, device: str = "cpu", kernels: str | None = None,
                     env: Mapping[str, str] | None = None, gpu: str | None = None,
                     allocator: AllocatorConfig | None = None,
                     replay: bool | BackgroundReplays = True) -> list[JobPrediction]:
    """:func:`remat.parallel.job_predict.predict_job` of ``job`` under each of ``policies``, the same predictions,
    made side by side: the distinct (stage, policy) pairs are predicted in forked workers where cores stand idle
    (:meth:`ExactStages.prefetch`), and the stages whose chunks are alike, laid out from the same shallow traces as
    they come back, each with its caching-allocator replay (NOTE [alike stages ahead]); on one free core, all here.
    Arguments as :func:`~remat.parallel.job_predict.predict_job`'s."""
    exact = ExactStages(job, device, "", [stage_state(job, s) for s in range(job.pp)], kernels=kernels, env=env,
                        gpu=gpu, disk=False)
    replayed_under = replay.allocator if isinstance(replay, BackgroundReplays) else allocator
    finish = ((lambda pred: add_reserved([pred], replayed_under)) if replays_wanted(exact.kernels, device, replay)
              else None)
    exact.prefetch([(stage, policy) for policy in policies for stage in range(job.pp)], alike=True, finish=finish)
    out = []
    for policy in policies:
        ranks = sorted((exact(stage, policy) for stage in range(job.pp)), key=lambda r: (-r.peak_bytes, r.stage))
        add_replays(ranks, exact.kernels, device, allocator, replay)
        out.append(JobPrediction(job.replace(policy=policy), ranks))
    return out
