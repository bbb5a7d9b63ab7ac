"""The simulator: times a schedule's action lists with the pipeline clock, computing nothing.

It reports the steady-state step time, the bubble fraction and utilisation, and per stage the
peak number of live activations (microbatches in flight) and of weight versions held.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..runtime.walk import walk
from ..schedules import BACKWARD, EVAL, FORWARD, SYNC, UPDATE, Action, Plan, ScheduleSpec, StageProgram, lookahead
from .clock import CostProfile, LinkModel, PipelineClock


@dataclass
class SimResult:
    stages: int
    microbatches: int
    steps: int
    step_time: float  # steady-state seconds per step
    makespan: float  # end of the last update
    bubble_fraction: float  # steady state: 1 - busy / (p * step_time)
    run_bubble_fraction: float  # whole run, fill and drain included
    utilization: list[float]  # per stage, whole run
    peak_activations: list[int]
    weight_versions: list[int]
    update_end: list[float]  # per step
    timeline: list[tuple[int, str, int, int, float, float]] = field(default_factory=list)  # stage, kind, mb, step, start, end

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "timeline"}
        d["per_stage"] = [
            {"stage": s, "utilization": self.utilization[s], "peak_activations": self.peak_activations[s],
             "weight_versions": self.weight_versions[s]}
            for s in range(self.stages)
        ]
        return d


def simulate(spec: ScheduleSpec, plan: Plan, profile: CostProfile, link: LinkModel | None = None, record: bool = True) -> SimResult:
    """Time ``plan``'s steps under ``spec`` with per-action costs from ``profile``."""
    p = spec.stages
    if profile.stages != p:
        raise ValueError(f"the cost profile has {profile.stages} stages, the pipeline {p}: measure a profile for this depth")
    programs = [StageProgram(s, spec, plan) for s in range(p)]
    clock = PipelineClock(p, link, profile.act_bytes)
    inflight: list[dict[int, int]] = [{} for _ in range(p)]
    live = [0] * p
    peak_act = [0] * p
    peak_ver = [1] * p
    arrived: dict[int, set[int]] = {}
    f_done: set[tuple[int, int]] = set()
    b_done: set[tuple[int, int]] = set()
    timeline: list = []

    def ready(s: int, a: Action) -> bool:
        if a.kind == FORWARD:
            return s == 0 or (s - 1, a.mb) in f_done
        if a.kind == BACKWARD:
            return s == p - 1 or (s + 1, a.mb) in b_done
        if a.kind == UPDATE and a.phase == SYNC:
            waiting = arrived.setdefault(a.step, set())
            if s not in waiting:
                waiting.add(s)
                clock.arrive(s, a.step)
            return len(waiting) == p
        return True

    def execute(s: int, a: Action) -> list[int]:
        start, end = clock.run(s, a, profile.cost(s, a.kind))
        if record and a.kind != EVAL:
            timeline.append((s, a.kind, a.mb, a.step, start, end))
        woken: list[int] = []
        if a.kind == FORWARD:
            inflight[s][a.mb] = a.version
            f_done.discard((s - 1, a.mb))
            if s + 1 < p:
                f_done.add((s, a.mb))
                woken = [s + 1]
        elif a.kind == BACKWARD:
            inflight[s].pop(a.mb)
            b_done.discard((s + 1, a.mb))
            if s > 0:
                b_done.add((s, a.mb))
                woken = [s - 1]
        elif a.kind == UPDATE:
            live[s] += 1
            if a.phase == SYNC:
                woken = list(range(p))
        peak_act[s] = max(peak_act[s], len(inflight[s]))
        floor = programs[s].floor_version()
        held = {live[s], *inflight[s].values(), *range(min(floor, live[s]), live[s])}
        peak_ver[s] = max(peak_ver[s], len(held))
        return woken

    walk(programs, range(p), lambda s: programs[s].peek() is None, ready, execute)
    n = len(clock.update_end)
    ends = [clock.update_end[t] for t in range(n)]
    makespan = ends[-1] if ends else 0.0
    step_time = _steady_step_time(ends, lookahead(p, spec.microbatches) + 1)
    work = sum(spec.microbatches * (profile.forward[s] + profile.backward[s]) + profile.update[s] for s in range(p))
    bubble = 1.0 - work / (p * step_time) if step_time > 0 else 0.0
    busy = clock.busy
    return SimResult(
        stages=p,
        microbatches=spec.microbatches,
        steps=n,
        step_time=step_time,
        makespan=makespan,
        bubble_fraction=max(0.0, bubble),
        run_bubble_fraction=1.0 - sum(busy) / (p * makespan) if makespan > 0 else 0.0,
        utilization=[b / makespan if makespan > 0 else 0.0 for b in busy],
        peak_activations=peak_act,
        weight_versions=peak_ver,
        update_end=ends,
        timeline=timeline,
    )


def _steady_step_time(ends: list[float], skip: int) -> float:
    """Mean time between consecutive updates, leaving out ``skip`` steps at either end (the fill
    and the drain) when the run is long enough."""
    if len(ends) < 2:
        return ends[0] if ends else 0.0
    lo, hi = (skip, len(ends) - 1 - skip) if len(ends) > 2 * skip + 2 else (0, len(ends) - 1)
    if lo == 0:
        return ends[hi] / (hi + 1)
    return (ends[hi] - ends[lo]) / (hi - lo)


def steady_step_times(spec: ScheduleSpec, profile: CostProfile, link: LinkModel | None = None) -> tuple[float, float, float]:
    """(sync step time, async step time, cost of one switch) predicted for ``spec`` with
    ``profile``. The switch cost is half the extra time of a round trip async -> sync -> async
    (a drain and a fill) over what its steps cost in their steady states."""
    from ..schedules import ASYNC

    k = 2 * (lookahead(spec.stages, spec.microbatches) + 2)
    n = 3 * k
    sync = simulate(spec, Plan(n, [SYNC] * n), profile, link, record=False)
    asyn = simulate(spec, Plan(n, [ASYNC] * n), profile, link, record=False)
    trip = simulate(spec, Plan(n, [ASYNC] * k + [SYNC] * k + [ASYNC] * k), profile, link, record=False)
    extra = trip.makespan - asyn.makespan - k * (sync.step_time - asyn.step_time)
    return sync.step_time, asyn.step_time, max(0.0, extra / 2)
