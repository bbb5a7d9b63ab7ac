"""The results of a sweep: one row per cell (``results.csv``), and per setting, target and method
the statistics over seeds that the report compares.

Each target (early, late) gives two efficiencies, reported separately, as PipeDream did:
steps-to-target (statistical efficiency: how much an update is worth) and time-to-target
(hardware x statistical: what a user waits for). For each, over the seeds of a setting and method
(done runs only):

- median and spread (min-max). A run that never reached the target counts as not reached
  (infinitely slow), never as dropped: the median is "not reached" when most seeds did not reach
  it, and a lower bound of the median replaces each unreached run's time (steps) by the time
  (steps) it ran for.
- speedup of method A over method B: the ratio of medians, ``median(B) / median(A)``. Where B
  never reached the target and A did, ``median lower bound(B) / median(A)`` is a lower bound
  (shown ``>=x``); the other way round an upper bound (``<=x``). Its confidence interval is the
  bootstrap over seeds of :mod:`.bootstrap`.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path
from statistics import median

from .state import TARGET_KEYS, cell_status, read_json
from .target import evals, time_to_target

TARGETS = ("early", "late")
PREFIX = {"early": "", "late": "late_"}  # a target's columns: target_ppl, late_target_ppl, ...
PER_TARGET = ["target_ppl", "reached", "time_to_target_s", "step_to_target"]
COLUMNS = ["cell", "setting", "stages", "batch_size", "microbatches", "method", "seed", "status",
           *(PREFIX[t] + c for t in TARGETS for c in PER_TARGET), "best_val_ppl", "final_val_ppl", "time_s", "steps",
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
        row = {"cell": c["name"], "setting": c["setting"], "stages": c["stages"], "batch_size": c["batch_size"],
               "microbatches": c["microbatches"], "method": c["method"], "seed": c["seed"], "status": status,
               "profile": state.get("profiles", {}).get(f"p{c['stages']}"), "error": error or None}
        for t in TARGETS:
            row[PREFIX[t] + "target_ppl"] = state.get(TARGET_KEYS[t], {}).get(c["setting"], {}).get("ppl")
        if status == "done":
            s = read_json(run_dir / "summary.json")
            records = evals(run_dir)
            for t in TARGETS:
                target = row[PREFIX[t] + "target_ppl"]
                ttt, step = time_to_target(records, target)
                if target is not None:
                    row.update({PREFIX[t] + "reached": ttt is not None, PREFIX[t] + "time_to_target_s": ttt,
                                PREFIX[t] + "step_to_target": step})
            row.update(best_val_ppl=s.get("best_val_ppl"), final_val_ppl=s.get("final_val_ppl"), time_s=s.get("time_s"),
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
class Spread:
    """Time (or steps) to a target over the done seeds: inf for a seed that did not reach it."""

    values: list[float]
    lower: float  # the median with each unreached seed's value replaced by what it ran for

    @property
    def median(self) -> float:
        return median(self.values) if self.values else math.nan

    @property
    def min(self) -> float:
        return min(self.values) if self.values else math.nan

    @property
    def max(self) -> float:
        return max(self.values) if self.values else math.nan

    @property
    def ok(self) -> bool:
        """Reached by most seeds: the median is finite."""
        return math.isfinite(self.median)


@dataclass
class MethodStats:
    """Statistics of one method at one setting, for one target, over its done seeds."""

    planned: int  # seeds in the grid
    runs: int  # seeds done
    reached: int
    time: Spread  # time to target (the run's clock)
    steps: Spread  # optimizer steps to target
    best_ppl: float  # median best validation perplexity
    async_fraction: float
    switches: float

    @property
    def ok(self) -> bool:
        return self.time.ok


def method_stats(rows: list[dict], target: str = "early") -> MethodStats:
    k = PREFIX[target]
    done = [r for r in rows if r["status"] == "done" and r[k + "target_ppl"] is not None]
    reached = [bool(r[k + "reached"]) for r in done]

    def spread(key: str, total: str) -> Spread:
        return Spread([r[k + key] if ok else math.inf for r, ok in zip(done, reached)],
                      median(r[k + key] if ok else r[total] for r, ok in zip(done, reached)) if done else math.nan)

    if not done:
        nan = math.nan
        return MethodStats(len(rows), 0, 0, spread("time_to_target_s", "time_s"), spread("step_to_target", "steps"),
                           nan, nan, nan)
    return MethodStats(len(rows), len(done), sum(reached), spread("time_to_target_s", "time_s"),
                       spread("step_to_target", "steps"), median(r["best_val_ppl"] for r in done),
                       median(r["async_fraction"] or 0.0 for r in done), median(r["switches"] or 0 for r in done))


def speedup(a: Spread, b: Spread) -> tuple[str, float] | None:
    """Speedup of ``a`` over ``b`` (median(b) / median(a)): (relation, value), relation ``=``, ``>``
    or ``<``; None when neither reached the target (or a method has no run)."""
    if not a.values or not b.values:
        return None
    if a.ok and b.ok:
        return "=", b.median / a.median
    if a.ok:
        return ">", b.lower / a.median
    if b.ok:
        return "<", b.median / a.lower
    return None


def settings(rows: list[dict]) -> list[tuple[int, int, int]]:
    """(depth, batch size, microbatches) of every setting, in grid order."""
    seen: dict[tuple[int, int, int], None] = {}
    for r in rows:
        seen[(r["stages"], r["batch_size"], r["microbatches"])] = None
    return list(seen)


def table(rows: list[dict], methods: list[str], target: str = "early") -> dict[tuple[int, int], dict[str, MethodStats]]:
    """{(depth, batch size): {method: stats to ``target``}} in grid order."""
    def runs(p: int, b: int, m: str) -> list[dict]:
        return [r for r in rows if r["stages"] == p and r["batch_size"] == b and r["method"] == m]

    return {(p, b): {m: method_stats(runs(p, b, m), target) for m in methods} for p, b, _ in settings(rows)}


def targets_of(rows: list[dict]) -> list[str]:
    """The targets the sweep has: early, and late when any setting has one."""
    return [t for t in TARGETS if any(r[PREFIX[t] + "target_ppl"] is not None for r in rows)]
