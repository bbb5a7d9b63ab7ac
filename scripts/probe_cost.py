"""What an AdaPipe run's probes of sync cost on its clock, against staying in async.

A sync step makes the progress of 1/E async steps (E: async's statistical efficiency, sync's
steps to a target over async's), so the time lost to a step of the run that is not a steady
async step (a drain, a sync step, a fill) is its time less what async would take for the same
progress: ``dt - pace / E`` for a step in the sync phase, ``dt - pace`` for a fill's async step,
``pace`` the run's median time of an async step after an async step. Summed, and with its share
of the run's time: how many probes a goal of "at most x times the async method's time" leaves
room for. E = 1 (the default) charges a sync step as if it were worth no more than an async one:
the most a probe can cost; give the cell's measured E for what it did cost.

    python scripts/probe_cost.py RUN_DIR... [--efficiency E] [--until SECONDS] [--against ASYNC_RUN...]

RUN_DIR: an ``adapipe train`` run directory (its ``metrics.jsonl``); ``--until``: count only the
steps that ended by then (the time to a target, for example). ``--against``: the async method's
run of the same seed for each RUN_DIR (an AdaPipe run that starts in async computes its numbers
until its first probe): the run's validation perplexity over that run's at the same steps, to
see what a probe did to the trajectory besides its time.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from adapipe_cli.sweep.target import evals


def probe_cost(run: Path, until: float | None = None, efficiency: float = 1.0) -> dict:
    """{"async_step_s", "sync_steps", "extra_s", "time_s"} of the run at ``run``, up to ``until``,
    with a sync step worth 1 / ``efficiency`` async steps."""
    if not 0 < efficiency <= 1:
        raise SystemExit(f"--efficiency {efficiency}: give async's statistical efficiency E, in (0, 1]")
    if not (run / "metrics.jsonl").is_file():
        raise SystemExit(f"{run}: no metrics.jsonl here; give the directory of an adapipe train run")
    steps = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "step"]
    if until is not None:
        steps = [r for r in steps if r["time_s"] <= until]
    pairs = list(zip(steps, steps[1:]))
    in_async = [b["time_s"] - a["time_s"] for a, b in pairs if a["phase"] == b["phase"] == "async"]
    if not in_async:
        raise SystemExit(f"{run}: no two async steps in a row to take async's pace from")
    pace = statistics.median(in_async)
    worth = {"sync": pace / efficiency, "async": pace}  # the async time of a step's progress
    extra = sum(b["time_s"] - a["time_s"] - worth[b["phase"]] for a, b in pairs
                if not a["phase"] == b["phase"] == "async")
    return {"async_step_s": pace, "sync_steps": sum(r["phase"] == "sync" for r in steps), "extra_s": extra,
            "time_s": steps[-1]["time_s"]}


def perplexity_ratio(run: Path, other: Path) -> list[tuple[int, float]]:
    """(step, run's validation perplexity over ``other``'s) at every step both evaluated."""
    def ppl(d: Path) -> dict[int, float]:
        if not (d / "metrics.jsonl").is_file():
            raise SystemExit(f"{d}: no metrics.jsonl here; give the directory of an adapipe train run")
        return {r["step"]: r["val_ppl"] for r in evals(d)}
    a, b = ppl(run), ppl(other)
    return [(t, a[t] / b[t]) for t in sorted(set(a) & set(b))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--efficiency", type=float, default=1.0,
                    help="async's statistical efficiency E: a sync step is worth 1/E async steps (default 1)")
    ap.add_argument("--until", type=float, help="count the steps that ended by this time (s) only")
    ap.add_argument("--against", nargs="+", type=Path, help="the async method's run of each RUN_DIR's seed")
    a = ap.parse_args()
    if a.against and len(a.against) != len(a.runs):
        raise SystemExit(f"--against: give one run per RUN_DIR ({len(a.runs)}), got {len(a.against)}")
    for i, run in enumerate(a.runs):
        c = probe_cost(run, a.until, a.efficiency)
        print(f"{run}: async step {c['async_step_s'] * 1e3:.2f} ms; {c['sync_steps']} sync steps; at E = "
              f"{a.efficiency:g}, {c['extra_s']:.2f} s lost against async, {100 * c['extra_s'] / c['time_s']:.1f}% "
              f"of {c['time_s']:.2f} s")
        if a.against:
            ratios = perplexity_ratio(run, a.against[i])
            every = max(1, len(ratios) // 12)  # about a dozen of the common evaluations
            print("  validation perplexity over the async run's, at the same step: "
                  + " ".join(f"{t}: {r:.3f}" for t, r in ratios[::every]))


if __name__ == "__main__":
    main()
