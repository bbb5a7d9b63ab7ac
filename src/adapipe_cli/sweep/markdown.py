"""``results.md``: the comparison tables of a sweep (per target: time and steps to it, speedups with
their bootstrap intervals, the cells within noise), with its clock, targets and caveats stated."""

from __future__ import annotations

import math
from pathlib import Path

from .bootstrap import LEVEL, RESAMPLES, fmt_ci, speedup_ci, within_noise
from .results import PREFIX, MethodStats, Spread, clock_label, speedup

NOT_REACHED = "n.r."


def fmt_time(x: float) -> str:
    """Seconds with three significant digits, without an exponent."""
    if math.isnan(x):
        return "–"
    if math.isinf(x):
        return NOT_REACHED
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}"


def fmt_steps(x: float) -> str:
    if math.isnan(x):
        return "–"
    return NOT_REACHED if math.isinf(x) else f"{x:.0f}"


def fmt_spread(s: MethodStats, spread: Spread, fmt=fmt_time) -> str:
    """``12.3 (10.1–13.0)``; ``12.3 (10.1–n.r.)`` when a seed did not reach it;
    ``n.r. (best 5.43)`` when most seeds did not; ``n=2/3`` when seeds are missing."""
    if s.runs == 0:
        return "no run"
    if not spread.ok:
        text = f"{NOT_REACHED} (best {s.best_ppl:.4g})"
    elif s.runs == 1:
        text = fmt(spread.median)
    else:
        text = f"{fmt(spread.median)} ({fmt(spread.min)}–{fmt(spread.max)})"
    return text + (f" n={s.runs}/{s.planned}" if s.runs < s.planned else "")


def fmt_ttt(s: MethodStats) -> str:
    return fmt_spread(s, s.time)


def fmt_speedup(x: tuple[str, float] | None) -> str:
    if x is None:
        return "–"
    rel, v = x  # a bound: the unreached run's true time is at least what it ran for
    return f"{'' if rel == '=' else rel + '='}{v:.2f}x"


def fmt_speedup_ci(a: Spread, b: Spread) -> str:
    """``1.32x [1.10, 1.50]``: the speedup of a over b and its bootstrap interval."""
    text = fmt_speedup(speedup(a, b))
    ci = speedup_ci(a.values, b.values) if text != "–" else None
    return f"{text} {fmt_ci(ci)}".rstrip()


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


def render(state: dict, rows: list[dict], stats: dict[str, dict]) -> str:
    """The Markdown report of a sweep: ``state`` is its sweep.json, ``rows`` its results.csv rows,
    ``stats`` their :func:`.results.table` for each target the sweep has ({early: ..., late: ...})."""
    compare = state["compare"]
    clocks = {r["clock"] for r in rows if r["clock"]}
    done = sum(r["status"] == "done" for r in rows)
    pct = f"{LEVEL:.0%}"
    lines = [f"# Sweep `{state['name']}`: time and steps to target perplexity", "",
             f"{done} of {len(rows)} runs done. {clock_sentence(clocks)}", "",
             "Time-to-target and steps-to-target: median over seeds (min–max) of the time (the optimizer steps) of "
             f"the first evaluation at or below the setting's target; {NOT_REACHED}: not reached within the step "
             "budget (best validation perplexity given). A run that never reaches a target counts as not reached "
             "(infinitely slow), never as dropped. Steps-to-target is the statistical efficiency (what an update is "
             "worth), time-to-target the product of it and the hardware efficiency (what a user waits for). "
             f"Speedup of {compare} over X = median(X) / median({compare}); >=x or <=x: a bound, where most seeds of one "
             "of the two did not reach the target (their time counted as the time they ran for). "
             f"In brackets the {pct} bootstrap interval over seeds (each method's seeds "
             f"resampled with replacement, {RESAMPLES} times, seeded); a speedup whose interval includes 1 is *within "
             "noise*.", ""]
    lines += [f"- {_target_sentence(state, which)}" for which in stats] + [""]
    profiles = state.get("profiles") or {}
    if profiles:
        lines += ["Cost profiles (one per depth, the clock of all its runs): "
                  + ", ".join(f"{k} `{Path(v).parent.name}/{Path(v).name}`" for k, v in profiles.items()) + ".", ""]
    for which, table in stats.items():
        lines += _target_section(state, rows, which, table)
    lines += _goal_section(state, stats)
    lines += _exceptions(rows, list(stats))
    return "\n".join(lines) + "\n"


def _target_section(state: dict, rows: list[dict], which: str, table: dict) -> list[str]:
    methods, compare = state["methods"], state["compare"]
    others = [m for m in methods if m != compare]
    key = PREFIX[which] + "target_ppl"
    lines = [f"## {which.capitalize()} target", "", "Time to target (s):", ""]
    head = ["depth", "batch (m)", "target ppl", *methods, *(f"{compare} vs {o}" for o in others),
            f"{compare} async time", f"{compare} switches"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    noise: dict[str, list[str]] = {"time": [], "steps": []}
    unsure: set[str] = set()  # speedups without an interval: fewer than two seeds done
    for (p, b), by_method in table.items():
        m = next(r["microbatches"] for r in rows if r["stages"] == p and r["batch_size"] == b)
        target = next((r[key] for r in rows if r["stages"] == p and r["batch_size"] == b), None)
        c = by_method[compare]
        cells = [str(p), f"{b} ({m})", f"{target:.4g}" if target else "–", *(fmt_ttt(by_method[x]) for x in methods),
                 *(fmt_speedup_ci(c.time, by_method[o].time) for o in others),
                 f"{c.async_fraction:.0%}" if c.runs else "–", f"{c.switches:g}" if c.runs else "–"]
        lines.append("| " + " | ".join(cells) + " |")
        for o in others:
            for kind in noise:
                a, x = getattr(c, kind), getattr(by_method[o], kind)
                if speedup(a, x) is None:
                    continue
                ci = speedup_ci(a.values, x.values)
                if ci is None:
                    unsure.add(f"p{p}_b{b} {compare} vs {o}")
                elif within_noise(ci):
                    noise[kind].append(f"p{p}_b{b} {compare} vs {o}")
    lines += ["", "Steps to target (optimizer steps):", ""]
    head = ["depth", "batch (m)", *methods, *(f"{compare} vs {o}" for o in others)]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (p, b), by_method in table.items():
        m = next(r["microbatches"] for r in rows if r["stages"] == p and r["batch_size"] == b)
        c = by_method[compare]
        cells = [str(p), f"{b} ({m})", *(fmt_spread(by_method[x], by_method[x].steps, fmt_steps) for x in methods),
                 *(fmt_speedup_ci(c.steps, by_method[o].steps) for o in others)]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [""]
    for kind in noise:
        cells = ", ".join(noise[kind]) or "none"
        lines.append(f"Within noise in {kind} to the {which} target (the interval includes 1): {cells}.")
    if unsure:
        lines.append(f"No interval, so not known to be outside the noise (fewer than two seeds done): "
                     f"{', '.join(sorted(unsure))}.")
    return lines + [""]


def adaptive_methods(state: dict) -> list[str]:
    """The methods that switch phases (``schedule=adapipe`` among their overrides); the others are fixed."""
    defined = (state.get("definition") or {}).get("methods") or {}
    return [m for m in state["methods"]
            if "schedule=adapipe" in defined.get(m, []) or (m not in defined and m.startswith("adapipe"))]


def best_fixed(by_method: dict[str, MethodStats], fixed: list[str]) -> str | None:
    """The fixed method with the least median time to the target (a bound's value where none of
    its seeds' median is reached); None when no fixed method has a run."""
    ran = [m for m in fixed if by_method[m].runs]
    if not ran:
        return None
    return min(ran, key=lambda m: (not by_method[m].time.ok, by_method[m].time.median if by_method[m].time.ok
                                   else by_method[m].time.lower))


def goal_verdict(rel: str, ratio: float, goal: float) -> str:
    """``met`` / ``missed`` for a time ratio to the best fixed method, or ``unknown`` where the
    ratio is a bound on the wrong side of the goal (``<``: at most ``ratio``; ``>``: at least)."""
    if rel == "=" or (rel == "<" and ratio <= goal) or (rel == ">" and ratio > goal):
        return f"{'met' if ratio <= goal else 'missed'} ({'<=' if ratio <= goal else '>'} {goal:g})"
    return f"unknown (a bound, goal {goal:g})"


GOAL, CROSSING_GOAL = 1.02, 0.95  # issue 13: at most 1.02x the best fixed method; 5% faster than both where they cross


def _goal_section(state: dict, stats: dict[str, dict]) -> list[str]:
    """Each adaptive method's median time to each target over the best fixed method's, per
    setting, against the goal: at most 1.02x everywhere, and at most 0.95x in a setting whose
    fixed methods cross (a different one is best at the two targets)."""
    adaptive = adaptive_methods(state)
    fixed = [m for m in state["methods"] if m not in adaptive]
    if not adaptive or not fixed:
        return []
    head = ["depth", "batch", "target", "best fixed (s)", *(f"{a} / best" for a in adaptive), "goal"]
    lines = ["## Against the best fixed method", "",
             "Median time to target over the best fixed method's (the one of "
             + ", ".join(f"`{m}`" for m in fixed) + " with the least median time at that target), with its "
             f"{LEVEL:.0%} bootstrap interval; below 1: faster. Goal: at most {GOAL:g} in every setting and "
             f"target, and at most {CROSSING_GOAL:g} (faster than both) where the fixed methods cross (sync is "
             "best at one target, async at the other). `<=x` / `>=x`: a bound (most seeds of one side did not reach the "
             "target).", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    settings = list(next(iter(stats.values())))
    for p, b in settings:
        bests = {which: best_fixed(table[(p, b)], fixed) for which, table in stats.items()}
        # crossing: sync leads at one target and async at the other (sync and sync-zb are one kind)
        kinds = {which: table[(p, b)][m].async_fraction > 0.5 for which, table in stats.items() if (m := bests[which])}
        crossing = len(kinds) > 1 and len(set(kinds.values())) > 1
        for which, table in stats.items():
            by_method, best = table[(p, b)], bests[which]
            if best is None:
                continue
            bt = by_method[best].time
            cells = [str(p), str(b), which + (" (crossing)" if crossing else ""),
                     f"{best} {fmt_ttt(by_method[best])}"]
            verdicts = []
            for a in adaptive:
                ratio = speedup(bt, by_method[a].time)  # median(adaptive) / median(best)
                cells.append(f"{fmt_speedup_ci(bt, by_method[a].time).replace('x', '', 1)}" if ratio else "–")
                if ratio:
                    verdicts.append(f"{a}: {goal_verdict(*ratio, CROSSING_GOAL if crossing else GOAL)}")
            cells.append("; ".join(verdicts) or "–")
            lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


def _target_sentence(state: dict, which: str) -> str:
    definition = state.get("definition", {})
    rule = definition.get("target" if which == "early" else "late_target") or {}
    name = f"{which.capitalize()} target"
    if rule.get("rule") == "fixed":
        return f"{name}: validation perplexity {rule.get('ppl'):g} in every setting (fixed)."
    if rule.get("rule") == "sync_best":
        return (f"{name}: per setting, the median over seeds of the best validation perplexity {rule.get('baseline')} "
                "reached in its whole step budget (long enough for its curve to flatten), decided after its runs and "
                "before the others'.")
    budget = f"{rule['budget']} steps" if rule.get("budget") else "its step budget"
    return (f"{name}: per setting, the median over seeds of the validation perplexity that {rule.get('baseline')} "
            f"reached at {rule.get('fraction'):g} of {budget}, decided after its runs and before the others'.")


def _exceptions(rows: list[dict], targets: list[str]) -> list[str]:
    """Runs that did not reach a target, and runs that failed or are missing: named, not dropped."""
    out = []
    for which in targets:
        k = PREFIX[which]
        unreached = [r for r in rows if r["status"] == "done" and not r[k + "reached"]]
        if unreached:
            out += [f"Runs that did not reach the {which} target:", ""]
            out += [f"- `{r['cell']}`: best val ppl {r['best_val_ppl']:.4g} > target {r[k + 'target_ppl']:.4g}"
                    if r[k + "target_ppl"] else f"- `{r['cell']}`: no target" for r in unreached]
            out += [""]
    bad = [r for r in rows if r["status"] != "done"]
    if bad:
        out += ["Runs failed or missing (left out of the statistics):", ""]
        out += [f"- `{r['cell']}`: {r['status']}" + (f": {r['error']}" if r["error"] else "") for r in bad]
    return out
