"""What AdaPipe's held-out signal costs on the clock, per cost profile: the simulated steady step of
its sync phase (ZB-H1) and of its async phase (PipeDream with weight prediction), without the
signal and with it (each stage's share of the signal's forward after each of its updates,
``CostProfile.signal_costs``, at the profile's measured rows), and the ratio R = sync / async that
AdaPipe's decisions rest on. One microbatch per step, as in the grids. Deterministic: no timing.

Run: python scripts/bench_signal.py PROFILE.json [...] [--out FILE.md]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from adapipe_cli.schedules import ScheduleSpec
from adapipe_cli.simulator.clock import CostProfile
from adapipe_cli.simulator.simulate import steady_step_times


def row(path: Path) -> str:
    prof = CostProfile.load(path)
    rows = prof.meta.get("signal_rows")
    if not prof.signal or not rows:
        raise SystemExit(f"{path} has no measured signal cost: add one with scripts/signal_cost.py")
    spec = ScheduleSpec(prof.stages, 1, "zbh1", "stash")
    s0, a0, _ = steady_step_times(spec, prof, None, ["predict"])
    s1, a1, _ = steady_step_times(spec, prof, None, ["predict"], signal=prof.signal_costs(rows))
    share = max(prof.signal_costs(rows)) / max(f for f in prof.forward)
    return (f"| {path} | {prof.meta.get('optimizer')} | {prof.stages} | {rows} | {share:.2f} | {1e3 * s0:.2f} | "
            f"{1e3 * s1:.2f} (+{s1 / s0 - 1:.1%}) | {1e3 * a0:.2f} | {1e3 * a1:.2f} (+{a1 / a0 - 1:.1%}) | "
            f"{s0 / a0:.3f} | {s1 / a1:.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profiles", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=None, help="also write the table as Markdown to this file")
    args = ap.parse_args()
    head = ("| profile | optimizer | p | signal rows | largest share / largest forward | ZB-H1 ms | with the signal | "
            "pipedream+predict ms | with the signal | R | R with the signal |")
    lines = [head, "|" + "---|" * (head.count("|") - 1), *(row(p) for p in args.profiles)]
    print("\n".join(lines))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
