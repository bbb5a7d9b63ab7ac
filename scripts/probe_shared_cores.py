"""Do shared cores explain a distributed run's step? A diagnostic for runs with more workers than cores.

The simulator gives every stage a device of its own. With 4 workers on 2 cores (bench_dist's
4-stage runs on this machine) that is not so: while more stages compute than there are cores,
each computes slower, and the transport's threads (gloo's) take their share too. This script
predicts a finished dist run's steady step three ways and prints the measured step over each:

- ``own device, wall``: each action at its in-run wall time (``runtime.action_times.in_run_profile``),
  every stage on its own device: bench_dist's "at the run's own action costs";
- ``own core, CPU``: each action at its in-run main-thread CPU time (its work on one core, the
  waits for a core left out), every stage on its own core;
- ``shared``: the same CPU costs with the stages sharing ``--cores`` cores, a processor-sharing
  model solved by a fixed point: each stage's costs are multiplied by max(1, the mean number of
  stages computing while it computes, plus the background, over the cores), the timeline
  simulated again, each round moving the factors half way to the new ones, until they move by
  less than 1e-6 (at most 100 rounds). The background is the
  run's own other-thread CPU (``other_threads_cpu_s``, summed over the workers) per predicted step,
  in cores; the driver's CPU is not in a run's summary and is left out.

The factor is per stage, from the steady window's mean: a stage whose actions meet different
concurrency in different phases (an AdaPipe run's sync and async stretches) gets one mean factor.
An AdaPipe run that followed the held-out signal is charged its forward after every update, as
bench_dist charges it. Not modelled: interleaved runs (a worker's chunks are rows of their own;
``shared`` is left out, nan) and replicas (refused).

    python scripts/probe_shared_cores.py RUN_DIR... [--cores 2]

RUN_DIR: a dist run's directory (its ``.hydra/config.yaml``, ``metrics.jsonl``, ``profile.json``
and ``summary.json`` with ``action_times``), e.g. the runs bench_dist keeps (``runs in DIR``).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

from omegaconf import OmegaConf

from adapipe_cli.runtime.action_times import in_run_profile
from adapipe_cli.schedules.choice import microbatch_size, schedule_choice, signal_rows
from adapipe_cli.simulator.clock import EXTRA_WORK, CostProfile
from adapipe_cli.simulator.simulate import simulate
from adapipe_cli.train.build import pick_sync

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_dist import finished_run  # noqa: E402  (the steady steps bench_dist measures)

COSTS = ("forward", "backward", "update", "input", "weight", *EXTRA_WORK)
ROUNDS, SETTLED = 100, 1e-6


def scaled(profile: CostProfile, factors: list[float]) -> CostProfile:
    """``profile`` with every cost of stage s multiplied by ``factors[s]`` (the held-out signal's
    forward too, where the profile measured one)."""
    out = copy.deepcopy(profile)
    for name in (*COSTS, "signal"):
        setattr(out, name, [c * factors[s] for s, c in enumerate(getattr(out, name))])
    return out


def concurrency(intervals: list[list[tuple[float, float]]], background: float = 0.0) -> list[float]:
    """Per stage, the mean number of stages computing (itself included) while it computes, plus
    ``background``: the time average over its own busy time (1.0 for a stage never busy).
    ``intervals[s]``: stage s's (start, end) of each action."""
    events = sorted((t, +1 if i == 0 else -1, s) for s, ivs in enumerate(intervals) for iv in ivs for i, t in enumerate(iv))
    weighted, busy = [0.0] * len(intervals), [0.0] * len(intervals)
    active: dict[int, int] = {}
    last = events[0][0] if events else 0.0
    for t, kind, s in events:
        if t > last:
            running = sum(1 for n in active.values() if n > 0)
            for a, n in active.items():
                if n > 0:
                    weighted[a] += (t - last) * (running + background)
                    busy[a] += t - last
        last = t
        active[s] = active.get(s, 0) + kind
    return [w / b if b > 0 else 1.0 for w, b in zip(weighted, busy)]


def shared_step(simulate_step, profile: CostProfile, cores: float, other_cpu_per_step: float = 0.0) -> tuple[float, list[float]]:
    """The steady step with the stages sharing ``cores`` cores (see the module docstring) and its
    per-stage factors. ``simulate_step(profile)`` returns (step, per-stage busy intervals of the
    steady window)."""
    factors = [1.0] * profile.stages
    for _ in range(ROUNDS):
        step, intervals = simulate_step(scaled(profile, factors))
        background = other_cpu_per_step / step if step > 0 else 0.0
        new = [max(1.0, c / cores) for c in concurrency(intervals, background)]
        moved = max(abs(a - b) for a, b in zip(factors, new))
        factors = [(a + b) / 2 for a, b in zip(factors, new)]
        if moved < SETTLED:
            break
    return simulate_step(scaled(profile, factors))[0], factors


def predict(run: Path, cores: float) -> dict:
    cfg = OmegaConf.load(run / ".hydra" / "config.yaml")
    if cfg.pipeline.get("replicas", 1) > 1:
        raise SystemExit(f"{run}: a run with pipeline.replicas > 1 is not modelled here; give a run of one pipeline")
    table = json.loads((run / "summary.json").read_text()).get("action_times")
    if not table or not table.get("actions"):
        raise SystemExit(f"{run}: its summary.json has no action_times (a dist run of a version that times its actions)")
    lo, hi, measured, prof, plan, link = finished_run(run)
    spec = pick_sync(schedule_choice(cfg), prof, link, cfg.schedule.mitigation).spec  # (as the run picked)
    p = spec.virtual_stages

    # an AdaPipe run that follows the held-out loss evaluates it after every update (as bench_dist charges it)
    held_out = cfg.schedule.name == "adapipe" and cfg.heuristic.signal == "heldout"

    def simulate_step(costs: CostProfile) -> tuple[float, list[list[tuple[float, float]]]]:
        signal = costs.signal_costs(signal_rows(cfg), microbatch_size(cfg)) if held_out else None
        sim = simulate(spec, plan, costs, link, record=True, mitigations=list(cfg.schedule.mitigation), signal=signal)
        t0, t1 = sim.update_end[lo], sim.update_end[hi]
        intervals: list[list[tuple[float, float]]] = [[] for _ in range(spec.stages)]
        for stage, _, _, _, start, end in sim.timeline:
            if end > t0 and start < t1:
                intervals[stage % spec.stages].append((max(start, t0), min(end, t1)))
        return (t1 - t0) / (hi - lo), intervals

    cpu_table = copy.deepcopy(table)
    for row in cpu_table["actions"]:
        row["run_s"] = row["cpu_s"]
    cpu = in_run_profile(cpu_table, prof)
    other = sum(r["other_threads_cpu_s"] for r in table["ranks"])
    shared, factors = shared_step(simulate_step, cpu, cores, other) if p == spec.stages else (float("nan"), [])
    return {"run": str(run), "measured_s": measured, "own_device_wall_s": simulate_step(in_run_profile(table, prof))[0],
            "own_core_cpu_s": simulate_step(cpu)[0], "shared_s": shared, "factors": factors,
            "other_threads_cpu_s": other}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--cores", type=float, default=2.0)
    a = ap.parse_args()
    for run in a.runs:
        r = predict(run, a.cores)
        m = r["measured_s"]
        print(f"{run}: measured {m * 1e3:.1f} ms; measured over predicted: own device, wall {m / r['own_device_wall_s']:.3f}; "
              f"own core, CPU {m / r['own_core_cpu_s']:.3f}; shared by {a.cores:g} cores {m / r['shared_s']:.3f} "
              f"(factors {' '.join(f'{f:.2f}' for f in r['factors'])}; other threads {r['other_threads_cpu_s'] * 1e3:.1f} ms a step)",
              flush=True)


if __name__ == "__main__":
    main()
