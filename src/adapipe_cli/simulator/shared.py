"""Stages that share cores: the step of a CPU pipeline whose workers outnumber the cores they run on.

:func:`.simulate.simulate` gives every stage a device of its own, the pipeline adapipe models (a
GPU per stage). A distributed run on one CPU machine with more single-threaded workers than cores
(gloo, 4 stages on 2 cores) is not that: while more stages compute than there are cores, each
computes more slowly, and the transport's own threads (gloo's, which move the bytes) take their
share too. This module predicts such a run's step, so that the simulator can be checked against
the dist runtime on the machine a user has:

- each action costs its **CPU seconds** (its work on one core, without the time it waited for
  one): :func:`cpu_profile`, from a profile whose ``meta["cpu"]`` the dist workers measured at
  start-up (``measure_profile(cpu_time=True)``), or any profile of CPU times;
- **processor sharing**, solved by a fixed point: while ``k`` stages compute, each progresses at
  the rate ``min(1, cores / (R k + b))``, and every action of (device) stage d costs its CPU
  seconds times ``f_d``, one over d's mean rate while it computes. ``R`` is the replicas of the
  pipeline (each computes what this one does, at the same times), and ``b`` the background in
  cores: the transport's CPU per
  message end (the link's ``thread_cpu_s``, measured at start-up) times the message ends of a
  step (each activation and each gradient between neighbouring stages has two: ``4 m (n - 1)``
  per step for ``m`` microbatches and ``n`` stages, virtual ones with interleaving, per
  replica), plus ``other_cpu_s`` a step, over the step. The timeline is simulated again with the
  new factors, each round moving them half way, until they move by less than :data:`SETTLED` (at
  most :data:`ROUNDS` rounds);
- the factor is per stage, a mean over the steady window: a stage whose actions meet different
  concurrency in different phases (AdaPipe's sync and async stretches) gets one mean factor.
  Two closed forms hold (tests): stages that all compute all the time (an async stream) take
  ``(R p + b) / cores`` times their CPU seconds, and on one core a pipeline that always has a
  stage ready takes the sum of all its work.

With ``cv`` (:func:`simulate_shared_jitter`), each action's CPU seconds are drawn around their
mean as :mod:`.jitter` draws them, the same draws in every round of the fixed point.

Not modelled: the driver's CPU (its round trips with the workers; about 1.7 ms a step on this
project's 2-core machines, measured ad hoc), which a run's profile does not measure; the caches
the stages share; and which stage the operating system runs when more are ready than cores.
"""

from __future__ import annotations

import copy
import statistics
from dataclasses import dataclass

from ..schedules import Plan, ScheduleSpec, lookahead
from .clock import ALLREDUCE, EXTRA_WORK, AllReduceModel, CostProfile, LinkModel
from .jitter import SAMPLES, gamma_factors
from .simulate import SimResult, simulate, steady_bounds

COSTS = ("forward", "backward", "update", "input", "weight", *EXTRA_WORK)  # the costs that are CPU work
ROUNDS, SETTLED = 100, 1e-6


def cpu_profile(profile: CostProfile) -> CostProfile | None:
    """``profile`` with each kind of work at its measured CPU seconds (``meta["cpu"]``) in place of
    its wall seconds (kinds it lacks keep their wall seconds; the in-flight factors stay); None
    when the profile measured no CPU time."""
    cpu = profile.meta.get("cpu")
    if not cpu:
        return None
    out = copy.deepcopy(profile)
    for kind in (*COSTS, "signal"):
        if kind in cpu and (kind != "signal" or out.signal):
            setattr(out, kind, list(cpu[kind]))
    return out


def scaled(profile: CostProfile, factors: list[float], device_of=lambda s: s) -> CostProfile:
    """``profile`` with every cost of (virtual) stage s multiplied by ``factors[device_of(s)]``
    (the held-out signal's forward too, where the profile measured one)."""
    out = copy.deepcopy(profile)
    for name in (*COSTS, "signal"):
        setattr(out, name, [c * factors[device_of(s)] for s, c in enumerate(getattr(out, name))])
    return out


def slowdown(intervals: list[list[tuple[float, float]]], cores: float, copies: int = 1, background: float = 0.0) -> list[float]:
    """Per stage, its actions' time over their CPU seconds if the cores were shared as ``intervals``
    say: 1 / the mean over its busy time of its rate ``min(1, cores / (copies k(t) + background))``,
    ``k(t)`` the stages computing at t (itself included)."""
    events = sorted((t, +1 if i == 0 else -1, s) for s, ivs in enumerate(intervals) for iv in ivs for i, t in enumerate(iv))
    progress, busy = [0.0] * len(intervals), [0.0] * len(intervals)
    active: dict[int, int] = {}
    last = events[0][0] if events else 0.0
    for t, kind, s in events:
        if t > last:
            running = sum(1 for n in active.values() if n > 0)
            rate = min(1.0, cores / (copies * running + background))
            for a, n in active.items():
                if n > 0:
                    progress[a] += (t - last) * rate
                    busy[a] += t - last
        last = t
        active[s] = active.get(s, 0) + kind
    alone = 1.0 / min(1.0, cores / (copies + background))
    return [b / w if w > 0 else alone for w, b in zip(progress, busy)]


@dataclass
class SharedResult:
    step_time: float  # the steady step with the stages sharing the cores
    factors: list[float]  # per device: its actions' cost over their CPU seconds
    background: float  # cores taken by the transport's threads and other work, at the fixed point
    rounds: int  # fixed-point rounds run
    sim: SimResult  # the last simulation (its costs scaled by the factors)


def steady_window(n: int, spec: ScheduleSpec) -> tuple[int, int]:
    """(lo, hi): the steps between whose updates a steady step is measured, as :func:`.simulate.simulate`
    leaves out the fill and the drain (``lookahead + 1`` steps at either end when the run is long enough)."""
    return steady_bounds(n, lookahead(spec.stages, spec.microbatches, spec.chunks) + 1)


def simulate_shared(spec: ScheduleSpec, plan: Plan, profile: CostProfile, cores: float, *, replicas: int = 1,
                    message_cpu_s: float = 0.0, other_cpu_s: float = 0.0, link: LinkModel | None = None,
                    mitigations: tuple[str, ...] | list[str] = (), allreduce: AllReduceModel | None = None,
                    signal: list[float] | None = None, window: tuple[int, int] | None = None,
                    cv: dict[str, list[float]] | None = None, seed: int = 0) -> SharedResult:
    """The steady step of ``plan`` under ``spec`` with its stages (``replicas`` copies of them)
    sharing ``cores`` cores (see the module docstring). ``profile``: each action's CPU seconds
    (:func:`cpu_profile`); ``message_cpu_s``: the transport's CPU per message end;
    ``other_cpu_s``: other CPU work per step on the same cores; ``signal``: per stage, the
    held-out signal's forward after each update (CPU seconds); ``window``: (lo, hi), the steps
    whose updates bound the steady step (default :func:`steady_window`); ``cv``, ``seed``: each
    action's CPU seconds drawn around the profile's (:func:`.jitter.gamma_factors`); ``link``,
    ``mitigations``, ``allreduce``: :func:`.simulate.simulate`'s."""
    if cores <= 0:
        raise ValueError(f"cores must be positive, got {cores}")
    n_steps = len(plan.phases)
    lo, hi = window or steady_window(n_steps, spec)
    if hi <= lo:
        raise ValueError(f"a steady window needs two updates, got steps {lo} to {hi}")
    devices, n = spec.stages, spec.virtual_stages
    ends = 4 * spec.microbatches * (n - 1) * replicas  # message ends a step (see the module docstring)

    def run(factors: list[float]) -> tuple[SimResult, float, list[list[tuple[float, float]]]]:
        sig = [c * factors[spec.device_of(s)] for s, c in enumerate(signal)] if signal else None
        sim = simulate(spec, plan, scaled(profile, factors, spec.device_of), link, record=True,
                       mitigations=mitigations, allreduce=allreduce, signal=sig,
                       jitter=gamma_factors(cv, seed) if cv else None)
        t0, t1 = sim.update_end[lo], sim.update_end[hi]
        intervals: list[list[tuple[float, float]]] = [[] for _ in range(devices)]
        for dev, kind, _, _, start, end in sim.timeline:
            if kind != ALLREDUCE and end > t0 and start < t1 and end > start:  # (the all-reduce is a wait, not CPU)
                intervals[dev].append((max(start, t0), min(end, t1)))
        return sim, (t1 - t0) / (hi - lo), intervals

    factors, background, rounds = [1.0] * devices, 0.0, 0
    for rounds in range(1, ROUNDS + 1):
        _, step, intervals = run(factors)
        background = (ends * message_cpu_s + other_cpu_s) / step if step > 0 else 0.0
        new = slowdown(intervals, cores, replicas, background)
        moved = max(abs(a - b) for a, b in zip(factors, new))
        factors = [(a + b) / 2 for a, b in zip(factors, new)]
        if moved < SETTLED:
            break
    sim, step, _ = run(factors)
    return SharedResult(step, factors, background, rounds, sim)


def simulate_shared_jitter(spec: ScheduleSpec, plan: Plan, profile: CostProfile, cores: float,
                           cv: dict[str, list[float]], samples: int = SAMPLES, seed: int = 0,
                           **kw) -> tuple[float, list[float]]:
    """(mean over ``samples`` runs, each run's) steady step of :func:`simulate_shared` with each
    action's CPU seconds drawn around the profile's with coefficients of variation ``cv`` (seeds
    ``seed``, ``seed + 1``, ...); ``kw``: :func:`simulate_shared`'s."""
    if samples < 1:
        raise ValueError(f"samples must be at least 1 (got {samples})")
    steps = [simulate_shared(spec, plan, profile, cores, cv=cv, seed=seed + i, **kw).step_time for i in range(samples)]
    return statistics.fmean(steps), steps
