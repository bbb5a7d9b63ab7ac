"""Time the simulator on a deep pipeline: ``simulate()`` of p stages x m microbatches, sync 1F1B
and async PipeDream (and 2BW), best of a few repeats. Goal: 64 x 1024, one step, under a second.

    python scripts/bench_sim.py                      # 64 stages x 1024 microbatches, 1 step
    python scripts/bench_sim.py --steps 4 --record   # also record the timeline, as the CLI does
"""

from __future__ import annotations

import argparse
import time

from adapipe_cli.schedules import ASYNC, SYNC, Plan, ScheduleSpec
from adapipe_cli.simulator.clock import CostProfile, LinkModel
from adapipe_cli.simulator.simulate import simulate

CASES = {
    "1f1b (sync)": ("1f1b", "stash", SYNC),
    "gpipe (sync)": ("gpipe", "stash", SYNC),
    "pipedream (async, stash)": ("1f1b", "stash", ASYNC),
    "2bw (async)": ("1f1b", "2bw", ASYNC),
}


def bench(p: int, m: int, steps: int, sync: str, weights: str, phase: str, record: bool,
          repeats: int) -> tuple[float, object]:
    """Best wall seconds of ``repeats`` runs, and the last result."""
    best, res = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        res = simulate(ScheduleSpec(p, m, sync, weights), Plan(steps, [phase] * steps), CostProfile.uniform(p),
                       LinkModel(), record=record)
        best = min(best, time.perf_counter() - t0)
    return best, res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--record", action="store_true", help="record the timeline (the CLI does, for the plot)")
    ap.add_argument("--goal", type=float, default=1.0, help="seconds per run to stay under")
    args = ap.parse_args()
    p, m, n = args.stages, args.microbatches, args.steps
    actions = n * p * (2 * m + 1)
    print(f"simulate(): {p} stages x {m} microbatches x {n} steps = {actions} actions, "
          f"best of {args.repeats}{', timeline recorded' if args.record else ''}")
    worst = 0.0
    for name, (sync, weights, phase) in CASES.items():
        if weights == "2bw" and m < p - 1:
            continue
        secs, res = bench(p, m, n, sync, weights, phase, args.record, args.repeats)
        worst = max(worst, secs)
        print(f"  {name:<26} {secs:7.3f} s  ({actions / secs / 1e6:.2f} M actions/s; "
              f"step time {res.step_time:g}, bubble {res.bubble_fraction:.4f})")
    verdict = "ok" if worst < args.goal * n else "SLOWER THAN THE GOAL"
    print(f"slowest {worst:.3f} s, goal {args.goal:g} s per step: {verdict}")
    return 0 if worst < args.goal * n else 1


if __name__ == "__main__":
    raise SystemExit(main())
