"""What an AdaPipe run's probes cost on its clock: the time its steps took over async's.

Every step that is not an async step after an async step (a drain, a sync step, a fill) is
charged its time over the run's median async step; the sum is what the run paid for leaving
async, against the same steps at async's pace. Its share of the run's time to a target says how
many probes a goal of "at most x times the async method's time" leaves room for.

    python scripts/probe_cost.py RUN_DIR... [--until SECONDS]

RUN_DIR: an ``adapipe train`` run directory (its ``metrics.jsonl``); ``--until``: count only the
steps that ended by then (the time to a target, for example).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def probe_cost(run: Path, until: float | None = None) -> dict:
    """{"async_step_s", "sync_steps", "extra_s", "time_s"} of the run at ``run``, up to ``until``."""
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
    extra = sum(b["time_s"] - a["time_s"] - pace for a, b in pairs if not a["phase"] == b["phase"] == "async")
    return {"async_step_s": pace, "sync_steps": sum(r["phase"] == "sync" for r in steps), "extra_s": extra,
            "time_s": steps[-1]["time_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--until", type=float, help="count the steps that ended by this time (s) only")
    a = ap.parse_args()
    for run in a.runs:
        c = probe_cost(run, a.until)
        print(f"{run}: async step {c['async_step_s'] * 1e3:.2f} ms; {c['sync_steps']} sync steps; "
              f"{c['extra_s']:.2f} s over async's pace, {100 * c['extra_s'] / c['time_s']:.1f}% of {c['time_s']:.2f} s")


if __name__ == "__main__":
    main()
