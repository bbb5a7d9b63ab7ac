"""The target perplexities of a setting and the time (and steps) each run takes to reach them.

Two targets, set the way MLPerf and AlgoPerf set theirs, from the baseline's (sync's) own runs:

- early (``sync_fraction``): the median over seeds of the perplexity the baseline reached at a
  fraction of a step budget, e.g. 3/4 of 300 steps; early in training, where async often leads;
- late (``sync_best``): the median over seeds of the best perplexity the baseline reaches in a
  budget long enough for its curve to flatten.

Time-to-target is read from a run's evaluation records, not from its summary: the first
evaluation with ``val_ppl <= target`` gives ``time_s`` (the run's clock). Any run can then be
measured against a target decided after it ran, such as the baseline's own runs under the
``sync_fraction`` rule.
"""

from __future__ import annotations

import math
from pathlib import Path
from statistics import median

from ..train.metrics import read_jsonl


def evals(run_dir: Path) -> list[dict]:
    """The evaluation records of a run, in step order."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [r for r in read_jsonl(path) if r.get("kind") == "eval" and r.get("val_ppl") is not None]


def async_spans(run_dir: Path) -> list[tuple[float, float]]:
    """The (start, end) clock times of a run's stretches of async steps, in order (AdaPipe's
    phases, for the curves)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    spans, start, prev = [], None, 0.0
    for r in read_jsonl(path):
        if r.get("kind") != "step":
            continue
        if r.get("phase") == "async" and start is None:
            start = prev
        elif r.get("phase") != "async" and start is not None:
            spans.append((start, prev))
            start = None
        prev = r["time_s"]
    if start is not None:
        spans.append((start, prev))
    return spans


def time_to_target(records: list[dict], target: float | None) -> tuple[float | None, int | None]:
    """(time_s, step) of the first evaluation at or below ``target``; (None, None) if none is."""
    if target is None:
        return None, None
    for r in records:
        if r["val_ppl"] <= target:
            return r["time_s"], r["step"]
    return None, None


def ppl_at_fraction(records: list[dict], budget: int, fraction: float) -> float | None:
    """The validation perplexity of the last evaluation at or before step ``fraction x budget``:
    what the run had reached by that fraction of its step budget."""
    upto = [r for r in records if r["step"] <= math.ceil(fraction * budget)]
    return upto[-1]["val_ppl"] if upto else None


def derive_target(baseline_runs: dict[str, tuple[list[dict], int]], fraction: float) -> dict | None:
    """The ``sync_fraction`` target of a setting from its baseline's runs ({cell: (evals, step
    budget)}): the median over seeds of :func:`ppl_at_fraction`. None when no run has one."""
    per_run = {name: ppl_at_fraction(ev, budget, fraction) for name, (ev, budget) in baseline_runs.items()}
    per_run = {k: v for k, v in per_run.items() if v is not None}
    if not per_run:
        return None
    return {"ppl": median(per_run.values()), "rule": "sync_fraction", "fraction": fraction, "from": per_run}


def best_target(baseline_runs: dict[str, tuple[list[dict], int]]) -> dict | None:
    """The ``sync_best`` target from the baseline's runs: the median over seeds of each run's best
    validation perplexity. None when no run has an evaluation."""
    per_run = {name: min(r["val_ppl"] for r in ev) for name, (ev, _) in baseline_runs.items() if ev}
    if not per_run:
        return None
    return {"ppl": median(per_run.values()), "rule": "sync_best", "from": per_run}


def derive(target, baseline_runs: dict[str, tuple[list[dict], int]]) -> dict | None:
    """The record of a derived target (``target``: a sweep.target node, rule sync_fraction or
    sync_best) from the baseline's runs ({cell: (evals, step budget)})."""
    if target.rule == "sync_best":
        record = best_target(baseline_runs)
    else:
        budget = target.get("budget")
        runs = {k: (ev, budget or b) for k, (ev, b) in baseline_runs.items()}
        record = derive_target(runs, target.fraction)
        if record is not None and budget:
            record["budget"] = budget
    if record is not None:
        record["baseline"] = target.baseline
    return record
