"""``results.md``: the comparison table of a sweep, with its clock, targets and caveats stated."""

from __future__ import annotations

import math
from pathlib import Path

from .results import MethodStats, clock_label, speedup

NOT_REACHED = "n.r."


def fmt_time(x: float) -> str:
    """Seconds with three significant digits, without an exponent."""
    if math.isnan(x):
        return "–"
    if math.isinf(x):
        return NOT_REACHED
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}"


def fmt_ttt(s: MethodStats) -> str:
    """``12.3 (10.1–13.0)``; ``12.3 (10.1–n.r.)`` when a seed did not reach it;
    ``n.r. (best 5.43)`` when most seeds did not; ``n=2/3`` when seeds are missing."""
    if s.runs == 0:
        return "no run"
    if not s.ok:
        text = f"{NOT_REACHED} (best {s.best_ppl:.4g})"
    elif s.runs == 1:
        text = fmt_time(s.ttt_median)
    else:
        text = f"{fmt_time(s.ttt_median)} ({fmt_time(s.ttt_min)}–{fmt_time(s.ttt_max)})"
    return text + (f" n={s.runs}/{s.planned}" if s.runs < s.planned else "")


def fmt_speedup(x: tuple[str, float] | None) -> str:
    if x is None:
        return "–"
    rel, v = x
    return f"{'' if rel == '=' else rel}{v:.2f}x"


def clock_sentence(clocks: set[str]) -> str:
    if clocks == {"wall"}:
        return "Times are seconds of **wall clock** (distributed runtime, one process per stage)."
    if clocks == {"pipeline-profiled"}:
        return ("Times are seconds on the **pipeline clock** of the local runtime: the time a pipeline of p devices, "
                "each as fast as this machine, takes to run the schedule, timed from the cost profile shared by every "
                "run of a depth (speedups compare runs on one profile; times of different depths come from different "
                "profiles).")
    labels = ", ".join(clock_label(c) for c in sorted(clocks)) or "none"
    return f"Times are on {labels}: runs timed as they ran, not on one shared profile; compare with care."


def render(state: dict, rows: list[dict], stats: dict) -> str:
    """The Markdown report of a sweep: ``state`` is its sweep.json, ``rows`` its results.csv rows,
    ``stats`` their :func:`.results.table`."""
    methods, compare = state["methods"], state["compare"]
    others = [m for m in methods if m != compare]
    clocks = {r["clock"] for r in rows if r["clock"]}
    done = sum(r["status"] == "done" for r in rows)
    lines = [f"# Sweep `{state['name']}`: time to target perplexity", "",
             f"{done} of {len(rows)} runs done. {clock_sentence(clocks)}", "",
             "Time-to-target: median over seeds (min–max) of the time of the first evaluation at or below the "
             f"setting's target; {NOT_REACHED}: not reached within the step budget (best validation perplexity "
             f"given). Speedup of {compare} over X = median time(X) / median time({compare}); >x or <x: a bound, "
             "where one of the two did not reach the target.", ""]
    lines += [_target_sentence(state), ""]
    profiles = state.get("profiles") or {}
    if profiles:
        lines += ["Cost profiles (one per depth, the clock of all its runs): "
                  + ", ".join(f"{k} `{Path(v).parent.name}/{Path(v).name}`" for k, v in profiles.items()) + ".", ""]
    head = ["depth", "batch (m)", "target ppl", *methods, *(f"{compare} vs {o}" for o in others),
            f"{compare} async time", f"{compare} switches"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (p, b), by_method in stats.items():
        m = next(r["microbatches"] for r in rows if r["stages"] == p and r["batch_size"] == b)
        target = next((r["target_ppl"] for r in rows if r["stages"] == p and r["batch_size"] == b), None)
        c = by_method[compare]
        cells = [str(p), f"{b} ({m})", f"{target:.4g}" if target else "–", *(fmt_ttt(by_method[x]) for x in methods),
                 *(fmt_speedup(speedup(c, by_method[o])) for o in others),
                 f"{c.async_fraction:.0%}" if c.runs else "–", f"{c.switches:g}" if c.runs else "–"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += _exceptions(rows)
    return "\n".join(lines) + "\n"


def _target_sentence(state: dict) -> str:
    rule = state.get("definition", {}).get("target", {})
    if rule.get("rule") == "fixed":
        return f"Target: validation perplexity {rule.get('ppl'):g} in every setting (fixed)."
    return (f"Target per setting: the median over seeds of the validation perplexity that {rule.get('baseline')} "
            f"reached at {rule.get('fraction'):g} of its step budget, decided after its runs and before the others'.")


def _exceptions(rows: list[dict]) -> list[str]:
    """Runs that did not reach the target, and runs that failed or are missing: named, not dropped."""
    out = []
    unreached = [r for r in rows if r["status"] == "done" and not r["reached"]]
    if unreached:
        out += ["", "Runs that did not reach the target:", ""]
        out += [f"- `{r['cell']}`: best val ppl {r['best_val_ppl']:.4g} > target {r['target_ppl']:.4g}"
                if r["target_ppl"] else f"- `{r['cell']}`: no target" for r in unreached]
    bad = [r for r in rows if r["status"] != "done"]
    if bad:
        out += ["", "Runs failed or missing (left out of the statistics):", ""]
        out += [f"- `{r['cell']}`: {r['status']}" + (f": {r['error']}" if r["error"] else "") for r in bad]
    return out
