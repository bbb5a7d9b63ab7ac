"""The simulator: times a schedule's action lists with the pipeline clock, computing nothing.

It reports the steady-state step time, the bubble fraction and utilisation, and per stage the
peaks of the buffer ledger the stage executor also uses (:mod:`..schedules.ledger`): live
activations (microbatches in flight), weight versions, parameter sets (live, stashed, shadow and
predicted) and gradient accumulators, and bytes when the profile gives the sizes. Each action
costs its kind's time plus the extra work the ledger says it did (weight copies, predictions,
recomputed forwards), exactly as the local runtime's clock charges it. With replicas of the
pipeline (``allreduce``), each update waits for its stage's gradient all-reduce, drawn as ``A``
boxes; that time is not compute, so it counts in the bubble.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..schedules import SYNC, Plan, ScheduleSpec, lookahead
from ..schedules.program import SPLIT_SCHEDULES
from .clock import AllReduceModel, CostProfile, LinkModel, allreduce_times
from .replay import Replay


@dataclass
class SimResult:
    stages: int
    microbatches: int
    steps: int
    step_time: float  # steady-state seconds per step
    makespan: float  # end of the last update
    bubble_fraction: float  # steady state: 1 - busy / (p * step_time)
    run_bubble_fraction: float  # whole run, fill and drain included
    utilization: list[float]  # per device (stage, without interleaving), whole run
    peak_activations: list[int]
    weight_versions: list[int]
    update_end: list[float]  # per step
    memory: list[dict] = field(default_factory=list)  # per stage: the ledger's peaks (see Ledger.report)
    timeline: list[tuple[int, str, int, int, float, float]] = field(default_factory=list)  # stage, kind, mb, step, start, end
    steady: bool = True  # False: too few steps for a steady state, step_time is the whole run's mean
    replicas: int = 1
    allreduce_s: list[float] = field(default_factory=list)  # per stage: seconds of each update's all-reduce

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "timeline"}
        d.pop("memory")
        d["per_stage"] = [
            {**self.memory[s], "utilization": self.utilization[s % len(self.utilization)],  # (its device's)
             "weight_versions": self.weight_versions[s]}
            for s in range(self.stages)
        ]
        return d


def simulate(spec: ScheduleSpec, plan: Plan, profile: CostProfile, link: LinkModel | None = None, record: bool = True,
             mitigations: tuple[str, ...] | list[str] = (), allreduce: AllReduceModel | None = None,
             grad_bytes: list[float] | None = None, signal: list[float] | None = None,
             jitter: Callable[[int, str], float] | None = None) -> SimResult:
    """Time ``plan``'s steps under ``spec`` with per-action costs from ``profile``; ``mitigations``
    (``schedule.mitigation``) change the buffers held and the work done; ``allreduce``: the
    pipeline's replicas and their all-reduce, over ``grad_bytes`` per (virtual) stage (None: the
    profile's parameter bytes); ``signal``: per stage, the held-out signal's forward after each
    update (AdaPipe's heuristics that follow the held-out loss; None: none); ``jitter``: each
    action's cost times a factor drawn for it (:class:`.replay.Replay`'s; :mod:`.jitter`)."""
    p, devices = spec.virtual_stages, spec.stages  # (p: stages, virtual with interleaving, as in the local runtime)
    ar = allreduce_times(allreduce, grad_bytes or [profile.stage_bytes(s).params for s in range(p)])
    rep = Replay(spec, plan, profile, link, mitigations, record=record, allreduce=ar, signal=signal, jitter=jitter)
    rep.run_all()
    clock, ledgers, extra, timeline = rep.clock, rep.ledgers, rep.extra, rep.timeline
    n = len(clock.update_end)
    ends = [clock.update_end[t] for t in range(n)]
    makespan = ends[-1] if ends else 0.0
    skip = lookahead(devices, spec.microbatches, spec.chunks) + 1
    step_time = _steady_step_time(ends, skip)
    split = spec.sync in SPLIT_SCHEDULES and all(ph == SYNC for ph in plan.phases[:n])
    back = [profile.input[s] + profile.weight[s] if split else profile.backward[s] for s in range(p)]
    work = sum(spec.microbatches * (profile.forward[s] + back[s]) + profile.update[s] for s in range(p))
    # the extra work (copies, predictions, recomputed forwards), the in-flight toll and the held-out
    # signal are busy time, not bubble: their mean per step over the steps the steady step time spans
    window = _steady_window(n, skip)
    busy_extra = (sum(extra.get(t, 0.0) + rep.toll.get(t, 0.0) + rep.signal.get(t, 0.0) for t in window) / len(window)
                  if window else 0.0)
    bubble = 1.0 - (work + busy_extra) / (devices * step_time) if step_time > 0 else 0.0
    busy = clock.busy
    return SimResult(
        stages=p,
        microbatches=spec.microbatches,
        steps=n,
        step_time=step_time,
        makespan=makespan,
        bubble_fraction=max(0.0, bubble),
        run_bubble_fraction=1.0 - sum(busy) / (devices * makespan) if makespan > 0 else 0.0,
        utilization=[b / makespan if makespan > 0 else 0.0 for b in busy],
        peak_activations=[led.peak.activations for led in ledgers],
        weight_versions=[led.peak.versions for led in ledgers],
        update_end=ends,
        memory=[led.report() for led in ledgers],
        timeline=timeline,
        steady=all(ph == SYNC for ph in plan.phases[:n]) or n >= min_steady_steps(devices, spec.microbatches, spec.chunks),
        replicas=allreduce.replicas if allreduce else 1,
        allreduce_s=ar or [0.0] * p,
    )


def min_steady_steps(stages: int, microbatches: int, chunks: int = 1) -> int:
    """Steps a run needs for its steady-state step time to leave out the fill and the drain:
    ``2 * (lookahead(p, m, v) + 1) + 3`` (a run of flushed sync steps is steady from its first)."""
    return 2 * (lookahead(stages, microbatches, chunks) + 1) + 3


def _steady_window(n: int, skip: int) -> range:
    """The steps whose time :func:`_steady_step_time` averages (it leaves ``skip`` at either end
    out when the run is long enough)."""
    if n < 2:
        return range(n)
    return range(skip + 1, n - skip) if n > 2 * skip + 2 else range(n)


def steady_bounds(n: int, skip: int) -> tuple[int, int]:
    """(lo, hi): the steps of an ``n``-step run between whose updates the steady step time is
    measured, ``skip`` left out at either end (the fill and the drain) when the run is long enough."""
    return (skip, n - 1 - skip) if n > 2 * skip + 2 else (0, n - 1)


def _steady_step_time(ends: list[float], skip: int) -> float:
    """Mean time between consecutive updates, leaving out ``skip`` steps at either end (the fill
    and the drain) when the run is long enough (:func:`steady_bounds`)."""
    if len(ends) < 2:
        return ends[0] if ends else 0.0
    lo, hi = steady_bounds(len(ends), skip)
    if lo == 0:
        return ends[hi] / (hi + 1)
    return (ends[hi] - ends[lo]) / (hi - lo)


def steady_step_times(spec: ScheduleSpec, profile: CostProfile, link: LinkModel | None = None,
                      mitigations: tuple[str, ...] | list[str] = (),
                      allreduce: AllReduceModel | None = None,
                      signal: list[float] | None = None) -> tuple[float, float, float]:
    """(sync step time, async step time, cost of one switch) predicted for ``spec`` with
    ``profile`` (and ``signal``, :func:`simulate`'s, paid by both phases). The switch cost is half
    the extra time of a round trip async -> sync -> async (a drain and a fill) over what its steps
    cost in their steady states."""
    from ..schedules import ASYNC

    k = 2 * (lookahead(spec.stages, spec.microbatches, spec.chunks) + 2)
    n = 3 * k
    sim = lambda phases: simulate(spec, Plan(n, phases), profile, link, record=False, mitigations=mitigations,  # noqa: E731
                                  allreduce=allreduce, signal=signal)
    sync = sim([SYNC] * n)
    asyn = sim([ASYNC] * n)
    trip = sim([ASYNC] * k + [SYNC] * k + [ASYNC] * k)
    extra = trip.makespan - asyn.makespan - k * (sync.step_time - asyn.step_time)
    return sync.step_time, asyn.step_time, max(0.0, extra / 2)
