"""An A/A test of the heuristics' rate estimator (``adapipe_cli.adaptive.estimate.fit_rates``).

For every run given that never switched (one phase throughout, so the true efficiency E of one
"phase" against the other is exactly 1), the script lays a probe's window over the loss the
heuristics follow (the held-out batch's ``signal`` where the run logged it, else the training
loss) as a heuristic would (``window`` steps of the current phase, a probe leg of
the other, a return leg; the legs' lengths and the steps left out after each switch are the
heuristic defaults' for the run's depth and microbatches), labels the steps with those phases
and fits the rates, at probe starts every ``--every`` steps from ``--first`` on, for a probe of
sync and one of async. A calibrated estimator gives E near 1 with |E - 1| / se above 2 in about 5%
of windows. Three variants of the fit side by side: today's (exponential trend, standard error
inflated for AR(1) residuals), without the inflation, and the one before 2026-12-03 (linear
deceleration, no inflation).

    python scripts/probe_estimator.py outputs/bench_adapipe --out outputs/probe_estimator

A bench's fixed schedules log only their training loss. To test the heuristics' own signal,
``--runs-from BENCH_OUT`` first trains, for every cell folder of a ``scripts/bench_adapipe.py``
output (on its ``profile.json``), AdaPipe with a one-phase plan (``heuristic=fixed``: sync ZB-H1
throughout, then pipedream+predict throughout; ``--steps`` steps, seed ``--seed``) into
``FOLDER/CELL/PHASE_sSEED`` of the first folder given, then tests those runs:

    python scripts/probe_estimator.py outputs/aa_signal --runs-from outputs/bench_adapipe --seed 3

It reads ``*/metrics.jsonl`` under the folders given (and their ``summary.json`` for the depth,
microbatches and switches), and writes ``estimator.md`` and ``estimator.json`` to ``--out``.
Only step losses are read: nothing is timed, so the machine's load does not matter.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from types import SimpleNamespace

from omegaconf import OmegaConf

from adapipe_cli.adaptive.base import Context
from adapipe_cli.adaptive.estimate import RHO_CAP, fit_rates
from adapipe_cli.adaptive.probing import Prober
from adapipe_cli.config.schema import HeuristicConfig
from adapipe_cli.schedules import ASYNC, SYNC, lookahead


# the estimator's variants compared: (trend family, AR(1) inflation of the standard error)
VARIANTS = {"exp+ar1": ("exp", True), "exp": ("exp", False), "linear (before 2026-12-03)": ("linear", False)}


def losses(metrics: Path, series: str) -> dict[int, float] | None:
    """Each step's ``signal`` (the held-out batch's loss that AdaPipe's heuristics follow, logged by
    ``schedule=adapipe`` runs, e.g. with ``heuristic=fixed 'heuristic.plan=[[sync,null]]'``) or its
    training ``loss``; with ``auto`` the signal where the run logged it. None: the run has no such
    series."""
    steps = []
    with metrics.open() as f:
        for line in f:
            e = json.loads(line)
            if e.get("kind") == "step":
                steps.append(e)
    has_signal = bool(steps) and all("signal" in e for e in steps)
    key = ("signal" if has_signal else "loss") if series == "auto" else series
    if key == "signal" and not has_signal:
        return None
    return {e["step"]: e[key] for e in steps}


def windows(summary: dict, L: dict[int, float], first: int, every: int):
    """(probed phase, probe start, phases, losses) of every A/A window that fits in the run of
    ``summary`` (its ``summary.json``), with the heuristics' default window, legs and settling."""
    p, m = summary["stages"], summary["microbatches"]
    # the heuristics' Context.lookahead: the decision lag (train.build.decision_lag) less one
    ctx = Context(p, m, max(L) + 1, lookahead(p, m, summary.get("chunks", 1)) + 1)
    h = Prober(OmegaConf.structured(HeuristicConfig(start=SYNC)), ctx)
    for probed, current in ((SYNC, ASYNC), (ASYNC, SYNC)):
        start = first
        while True:
            steps = range(start - h.cfg.window, start + h.leg(probed) + h.leg(current))
            if not all(s in L for s in steps):
                break
            phases = [probed if start <= s < start + h.leg(probed) else current for s in steps]
            yield probed, start, phases, [L[s] for s in steps], h.settle
            start += every


def one_phase_runs(bench: Path, out: Path, seed: int, steps: int, model: str, micro_size: int, jobs: int) -> None:
    """AdaPipe held in one phase for the whole run, for every cell of a bench_adapipe output."""
    from bench_adapipe import PREDICT, cell_overrides, run_one  # this folder's method comparison

    args = SimpleNamespace(model=model, micro_size=micro_size, steps=steps)
    todo = []
    for profile in sorted(bench.glob("*/profile.json")):
        cell = profile.parent.name
        m = re.fullmatch(r"(\w+?)_(\w+)_p(\d+)_m(\d+)", cell)
        if not m:
            continue
        base = cell_overrides(args, m[1], m[2], int(m[3]), int(m[4])) + [f"pipeline.profile={profile}", f"seed={seed}",
                                                                        "schedule=adapipe", "heuristic=fixed", PREDICT,
                                                                        "heuristic.signal=heldout"]  # (logged: not the default since 2026-12-04)
        for phase in (SYNC, ASYNC):
            todo.append((str(out / cell / f"{phase}_s{seed}"), base + [f"heuristic.plan=[[{phase},null]]"]))
    if not todo:
        raise SystemExit(f"no cell folder with a profile.json under {bench}")
    with ProcessPoolExecutor(jobs) as pool:
        for done in pool.map(run_one, todo):  # (resumable: a finished run is not repeated)
            print(f"  {done['dir']}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", type=Path, help="folders holding run folders (searched recursively)")
    ap.add_argument("--first", type=int, default=50, help="first probe start (step)")
    ap.add_argument("--every", type=int, default=25, help="steps between probe starts")
    ap.add_argument("--series", choices=["auto", "signal", "loss"], default="auto",
                    help="the loss fitted: the heuristics' held-out signal, the training loss, or the signal where logged")
    ap.add_argument("--out", type=Path, default=Path("outputs/probe_estimator"))
    ap.add_argument("--runs-from", type=Path, help="a bench_adapipe output: train one-phase AdaPipe runs of its cells first")
    ap.add_argument("--seed", type=int, default=3, help="with --runs-from")
    ap.add_argument("--steps", type=int, default=200, help="with --runs-from (bench_adapipe's sync steps)")
    ap.add_argument("--model", default="gpt-micro", help="with --runs-from")
    ap.add_argument("--micro-size", type=int, default=2, help="with --runs-from")
    ap.add_argument("--jobs", type=int, default=2, help="with --runs-from: runs in parallel (one thread each)")
    args = ap.parse_args(argv)
    if args.runs_from:
        one_phase_runs(args.runs_from, args.folders[0], args.seed, args.steps, args.model, args.micro_size, args.jobs)
    runs = sorted({m.parent for f in args.folders for m in f.rglob("metrics.jsonl") if (m.parent / "summary.json").exists()})
    if not runs:
        print(f"no run folders (metrics.jsonl with summary.json) under {' '.join(map(str, args.folders))}", file=sys.stderr)
        return 2
    rows, seen = [], set()
    for run in runs:
        summary = json.loads((run / "summary.json").read_text())
        if summary.get("switches", 0) or summary.get("guard_events", 0) or "stages" not in summary:
            continue
        L = losses(run / "metrics.jsonl", args.series)
        # one trajectory once (1F1B and ZB-H1 compute the same numbers, as do pipedream and 2BW at
        # some depths)
        if L is None or tuple(L.items()) in seen:
            continue
        seen.add(tuple(L.items()))
        for probed, start, phases, ls, settle in windows(summary, L, args.first, args.every):
            row = {"run": str(run), "probed": probed, "start": start}
            for trend, (family, ar1) in VARIANTS.items():
                r = fit_rates(phases, ls, [1.0] * len(ls), transients=True, settle=settle, trend=family, ar1=ar1)
                if r is None or r.sync <= 0:
                    row[trend] = None
                    continue
                e, se = r.async_ / r.sync, r.diff_se / r.sync
                row[trend] = {"E": e, "se": se, "z": (e - 1) / se if se > 0 else float("inf"), "inflation": r.inflation}
            rows.append(row)
    if not rows:
        print("no run long enough without a switch for one window", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    cap = (1 + RHO_CAP) / (1 - RHO_CAP)
    lines = [f"A/A test of `fit_rates` on {len({r['run'] for r in rows})} distinct runs without a switch ({args.series} "
             f"series), {len(rows)} windows laid (a fit can fail: the tables count fits; probe starts from step {args.first} every {args.every}; windows overlap, "
             "so they are not independent); true E = 1. Inflation: the variance factor for correlated residuals "
             f"(median, and the share of windows at its cap, rho = {RHO_CAP}).", "",
             "| estimator | probed | windows | median E | median abs(E - 1) | median abs(z) | share abs(z) > 2 | inflation | at cap |",
             "|---|---|---|---|---|---|---|---|---|"]
    summary = {}
    for trend in VARIANTS:
        for probed in (SYNC, ASYNC, "both"):
            fits = [r[trend] for r in rows if r[trend] and probed in (r["probed"], "both")]
            if not fits:
                continue
            s = {"windows": len(fits), "median_E": statistics.median(f["E"] for f in fits),
                 "median_abs_err": statistics.median(abs(f["E"] - 1) for f in fits),
                 "median_abs_z": statistics.median(abs(f["z"]) for f in fits),
                 "share_abs_z_over_2": sum(abs(f["z"]) > 2 for f in fits) / len(fits),
                 "median_inflation": statistics.median(f["inflation"] for f in fits),
                 "share_at_cap": sum(f["inflation"] >= cap * (1 - 1e-9) for f in fits) / len(fits)}
            summary[f"{trend}/{probed}"] = s
            lines.append(f"| {trend} | {probed} | {s['windows']} | {s['median_E']:.3f} | {s['median_abs_err']:.3f} | "
                         f"{s['median_abs_z']:.2f} | {s['share_abs_z_over_2']:.2f} | {s['median_inflation']:.1f} | "
                         f"{s['share_at_cap']:.2f} |")
    cells = sorted({Path(r["run"]).parent.name for r in rows})
    if len(cells) > 1:  # by the folder holding the runs (a bench's cell)
        lines += ["", "| folder | estimator | windows | median E | median abs(z) | share abs(z) > 2 |", "|---|---|---|---|---|---|"]
        for cell in cells:
            for trend in VARIANTS:
                fits = [r[trend] for r in rows if r[trend] and Path(r["run"]).parent.name == cell]
                if fits:
                    lines.append(f"| {cell} | {trend} | {len(fits)} | {statistics.median(f['E'] for f in fits):.3f} | "
                                 f"{statistics.median(abs(f['z']) for f in fits):.2f} | "
                                 f"{sum(abs(f['z']) > 2 for f in fits) / len(fits):.2f} |")
    (args.out / "estimator.md").write_text("\n".join(lines) + "\n")
    (args.out / "estimator.json").write_text(json.dumps({"summary": summary, "windows": rows}, indent=1) + "\n")
    print("\n".join(lines))
    print(f"wrote {args.out / 'estimator.md'} and estimator.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
