"""The results of a sweep: one row per cell (``results.csv``), and per setting and method the
statistics over seeds that the report compares.

Statistics over the seeds of a setting and method (done runs only):

- time-to-target: median and spread (min-max). A run that never reached the target counts as
  infinitely slow, so the median is "not reached" when most seeds did not reach it, and a lower
  bound of the median replaces each unreached run's time by the time it ran for.
- speedup of method A over method B: the ratio of medians, ``median ttt(B) / median ttt(A)``.
  Where B never reached the target and A did, ``median lower bound ttt(B) / median ttt(A)`` is
  a lower bound (shown ``>x``); the other way round an upper bound (``<x``).
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path
from statistics import median

from .state import cell_status, read_json
from .target import evals, time_to_target

COLUMNS = ["cell", "setting", "stages", "batch_size", "microbatches", "method", "seed", "status", "target_ppl",
           "reached", "time_to_target_s", "step_to_target", "best_val_ppl", "final_val_ppl", "time_s", "steps",
           "async_fraction", "switches", "clock", "profile", "error"]


def collect(sweep_dir: Path, state: dict) -> list[dict]:
    """One row per cell of ``sweep.json`` (``state``), from its run directory; by depth, batch size,
    method (in the grid's order) and seed, however the cells were run."""
    methods = state.get("methods", [])
    order = {m: i for i, m in enumerate(methods)}
    rows = []
    for c in sorted(state["cells"], key=lambda c: (c["stages"], c["batch_size"], order.get(c["method"], len(order)),
                                                   c["method"], c["seed"])):
        run_dir = sweep_dir / c["name"]
        status, error = cell_status(run_dir)
        target = state.get("targets", {}).get(c["setting"], {}).get("ppl")
        row = {"cell": c["name"], "setting": c["setting"], "stages": c["stages"], "batch_size": c["batch_size"],
               "microbatches": c["microbatches"], "method": c["method"], "seed": c["seed"], "status": status,
               "target_ppl": target, "profile": state.get("profiles", {}).get(f"p{c['stages']}"),
               "error": error or None}
        if status == "done":
            s = read_json(run_dir / "summary.json")
            ttt, step = time_to_target(evals(run_dir), target)
            row.update(reached=ttt is not None, time_to_target_s=ttt, step_to_target=step,
                       best_val_ppl=s.get("best_val_ppl"), final_val_ppl=s.get("final_val_ppl"), time_s=s.get("time_s"),
                       steps=s.get("steps"), async_fraction=s.get("async_fraction"), switches=s.get("switches"),
                       clock=_clock(s))
        rows.append({k: row.get(k) for k in COLUMNS})
    return rows


def _clock(summary: dict) -> str:
    """``wall`` (distributed runtime), or ``pipeline-profiled`` / ``pipeline-measured`` (local runtime)."""
    return "wall" if summary.get("clock") == "wall" else f"pipeline-{summary.get('clock_mode', 'profiled')}"


def clock_label(clock: str) -> str:
    """``pipeline-profiled`` -> ``pipeline clock (profiled)``."""
    kind, _, mode = clock.partition("-")
    return f"{kind} clock" + (f" ({mode})" if mode else "")


def write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows({k: ("" if v is None else v) for k, v in r.items()} for r in rows)


@dataclass
class MethodStats:
    """Statistics of one method at one setting over its done seeds."""

    planned: int  # seeds in the grid
    runs: int  # seeds done
    reached: int
    ttt_median: float  # inf: not reached by most seeds; nan: no run done
    ttt_min: float
    ttt_max: float
    ttt_lower: float  # median with each unreached run's time replaced by its total time
    best_ppl: float  # median best validation perplexity
    async_fraction: float
    switches: float

    @property
    def ok(self) -> bool:
        return math.isfinite(self.ttt_median)


def method_stats(rows: list[dict]) -> MethodStats:
    done = [r for r in rows if r["status"] == "done"]
    if not done:
        nan = math.nan
        return MethodStats(len(rows), 0, 0, nan, nan, nan, nan, nan, nan, nan)
    ttt = [r["time_to_target_s"] if r["reached"] else math.inf for r in done]
    lower = [r["time_to_target_s"] if r["reached"] else r["time_s"] for r in done]
    return MethodStats(len(rows), len(done), sum(1 for r in done if r["reached"]), median(ttt), min(ttt), max(ttt),
                       median(lower), median(r["best_val_ppl"] for r in done),
                       median(r["async_fraction"] or 0.0 for r in done), median(r["switches"] or 0 for r in done))


def speedup(a: MethodStats, b: MethodStats) -> tuple[str, float] | None:
    """Speedup of ``a`` over ``b``: (relation, value), relation ``=``, ``>`` or ``<``; None when
    neither reached the target (or a method has no run)."""
    if a.runs == 0 or b.runs == 0:
        return None
    if a.ok and b.ok:
        return "=", b.ttt_median / a.ttt_median
    if a.ok:
        return ">", b.ttt_lower / a.ttt_median
    if b.ok:
        return "<", b.ttt_median / a.ttt_lower
    return None


def settings(rows: list[dict]) -> list[tuple[int, int, int]]:
    """(depth, batch size, microbatches) of every setting, in grid order."""
    seen: dict[tuple[int, int, int], None] = {}
    for r in rows:
        seen[(r["stages"], r["batch_size"], r["microbatches"])] = None
    return list(seen)


def table(rows: list[dict], methods: list[str]) -> dict[tuple[int, int], dict[str, MethodStats]]:
    """{(depth, batch size): {method: stats}} in grid order."""
    def runs(p: int, b: int, m: str) -> list[dict]:
        return [r for r in rows if r["stages"] == p and r["batch_size"] == b and r["method"] == m]

    return {(p, b): {m: method_stats(runs(p, b, m)) for m in methods} for p, b, _ in settings(rows)}
