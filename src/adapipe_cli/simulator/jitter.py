"""Actions that vary: the steady step of a pipeline whose actions do not all take their mean time.

:func:`.simulate.simulate` times every action at its profiled cost, a mean. Real actions vary
from call to call (the CPU's other work, caches, the allocator), and where stages depend on each
other a late action delays its neighbours while an early one does not hurry them: the step of a
pipeline of varying actions is longer than that of its mean costs. In an asynchronous stream of
balanced stages this is most of what a simulator of means misses: the stages take turns being
the slowest, and each waits for the other (a 2-stage PipeDream run on this project's 2-core
machines: both workers waiting 5 to 32 ms a step on each other).

:func:`simulate_jitter` draws each action's cost as its profiled cost times a factor of mean 1
and coefficient of variation ``cv[kind][stage]`` (a gamma variate: positive, and the
exponential's at cv 1), and averages the steady step over ``samples`` simulated runs, each with
its own seeded draws. :func:`cv_from_table` takes the coefficients from a dist run's
``action_times`` (each row's ``run_sd_s`` over its ``run_s``, pooled over the ranks of a stage),
:func:`cv_from_profile` from a profile that measured them (``meta["cv"]``: a dist run's start-up
profile, its calls' spread, drift between its passes included).
The draws are independent from action to action: a machine that slows down for a while slows
consecutive actions together, which this leaves out.
"""

from __future__ import annotations

import random
import statistics
from typing import Callable

from ..schedules import Plan, ScheduleSpec
from .clock import CostProfile
from .simulate import simulate

SAMPLES = 8


def gamma_factors(cv: dict[str, list[float]], seed: int) -> Callable[[int, str], float]:
    """``(stage, kind) -> factor``: a gamma variate of mean 1 and coefficient of variation
    ``cv[kind][stage]`` (1 where the kind or the stage has none, or a cv of 0), seeded. Each
    (stage, kind) draws from a stream of its own, so the n-th action of a kind at a stage gets the
    same factor whatever order the simulator visits the stages in (and so in every round of
    :func:`.shared.simulate_shared`'s fixed point)."""
    streams: dict[tuple[int, str], random.Random] = {}

    def draw(stage: int, kind: str) -> float:
        c = cv.get(kind, [])
        c = c[stage] if stage < len(c) else 0.0
        if c <= 0:
            return 1.0
        rng = streams.get((stage, kind))
        if rng is None:
            rng = streams[(stage, kind)] = random.Random(f"{seed}:{stage}:{kind}")
        shape = 1.0 / (c * c)
        return rng.gammavariate(shape, 1.0 / shape)
    return draw


def simulate_jitter(spec: ScheduleSpec, plan: Plan, profile: CostProfile, cv: dict[str, list[float]],
                    samples: int = SAMPLES, seed: int = 0, window: tuple[int, int] | None = None,
                    **kw) -> tuple[float, list[float]]:
    """(mean over ``samples`` runs, each run's) steady step time of ``plan`` under ``spec`` with
    each action's cost drawn around ``profile``'s (:func:`gamma_factors` of ``cv``, seeds
    ``seed``, ``seed + 1``, ...). ``window``: the steps (lo, hi) between whose updates the step is
    measured (default :func:`.simulate.steady_bounds` with the simulator's skip); ``kw``:
    :func:`.simulate.simulate`'s (link, mitigations, allreduce, signal)."""
    if samples < 1:
        raise ValueError(f"samples must be at least 1 (got {samples})")
    steps = []
    for i in range(samples):
        sim = simulate(spec, plan, profile, record=False, jitter=gamma_factors(cv, seed + i), **kw)
        if window is None:
            steps.append(sim.step_time)
        else:
            lo, hi = window
            steps.append((sim.update_end[hi] - sim.update_end[lo]) / (hi - lo))
    return statistics.fmean(steps), steps


def cv_from_table(table: dict, stages: int) -> dict[str, list[float]]:
    """Per kind, per stage: the coefficient of variation of a dist run's actions (``action_times``
    rows: ``count``, ``run_s``, ``run_sd_s``), the rows of a stage's ranks (replicas) pooled; 0
    where a stage has no row of the kind or the run did not time the spread (before 2026-12-05)."""
    out: dict[str, list[float]] = {}
    for kind in sorted({r["kind"] for r in table.get("actions", [])}):
        row = []
        for s in range(stages):
            mine = [r for r in table["actions"] if r["kind"] == kind and r["stage"] == s and "run_sd_s" in r]
            n = sum(r["count"] for r in mine)
            if not n:
                row.append(0.0)
                continue
            mean = sum(r["count"] * r["run_s"] for r in mine) / n
            second = sum(r["count"] * (r["run_sd_s"] ** 2 + r["run_s"] ** 2) for r in mine) / n
            row.append(max(0.0, second - mean * mean) ** 0.5 / mean if mean > 0 else 0.0)
        out[kind] = row
    return out


ACTION_KIND = {"forward": "F", "backward": "B", "input": "I", "weight": "W", "update": "U"}


def cv_from_profile(profile: CostProfile, key: str = "cv") -> dict[str, list[float]] | None:
    """Per action kind, per stage: the spread of the profile's calls (``meta["cv"]``, which
    ``measure_profile(spread_cv=True)`` records; ``key="cpu_cv"``: of their thread CPU seconds,
    with ``cpu_time=True``); None for a profile without it."""
    cv = profile.meta.get(key)
    if not cv:
        return None
    return {ACTION_KIND[k]: list(v) for k, v in cv.items() if k in ACTION_KIND}
