"""How fast does async's statistical efficiency drift during a run? (AdaPipe #13)

``heuristic=gain`` widens its belief about async's efficiency E by an unseen drift per doubling of
the step, relative to E or to break-even 1/R, whichever is larger: ``heuristic.delay_drift`` x k d
(k d = 1 / E_d - 1, E_d the delay's prior: :meth:`adapipe_cli.adaptive.probing.Prober.delay_efficiency`).
This script measures that drift on the run folders of ``scripts/bench_adapipe.py``: for each cell
and seed, from the validation curves of sync-zb and pipedream+predict (the two phases of AdaPipe),
the local efficiency between successive loss levels,

    E_j = sync-zb's steps from level j to j + 1 / pipedream+predict's steps between the same levels,

over ``--bands`` equal bands of loss from the higher of the two curves' values at step 40 (past
the learning-rate warm-up) to the higher of their last values (the target), each placed at sync's
mean step in the band. The slope b of E_j on log2(step) (least squares) is the drift per doubling;
relative to max(mean E, 1 / R) (R the cell's predicted step-time ratio, from its profile) and
divided by k d it is the ``delay_drift`` that cell implies (its size), and with its sign the
``delay_trend`` (E's expected rise per doubling: a drift that has a direction).

    python scripts/calibrate_drift.py /path/to/bench_out [...] --out docs/results/drift

Each bench output folder holds ``CELL/METHOD_sSEED/metrics.jsonl`` and ``CELL/profile.json``
(bench_adapipe's layout; the runs are not in the repository's results, only their summaries). A
folder may also be an ``adapipe sweep`` directory (its ``sweep.json`` names the runs, their
overrides and each depth's profile): each setting (depth, batch) is a cell, named
``GRID_pP_bB``, with ``sync`` as its sync curve where it ran (1F1B trains exactly as ZB-H1, and
runs its whole budget, where sync-zb stops at the late target), else ``sync-zb``, against
``pipedream+predict``; R and E_d are those of its ``adapipe-gain+predict`` (or any AdaPipe method
of the grid) set up on the same overrides.
A seed with fewer than two usable bands (a curve that does not fall through them, e.g. a run
stopped early), a cell without delay (k d = 0: one stage) and a folder that is not a cell are
left out, and said so.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from calibrate_prior import cell_context, run_context  # noqa: E402

START = 40  # steps: past the learning-rate warm-up of every method comparison cell
SYNC, ASYNC = "sync-zb", "pipedream+predict"


def curve(run: Path) -> tuple[np.ndarray, np.ndarray]:
    """(steps, best validation loss so far) of a run's evaluations."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    ev = [r for r in rows if r["kind"] == "eval"]
    steps = np.array([r["step"] for r in ev], float)
    return steps, np.minimum.accumulate(np.array([r["val_loss"] for r in ev]))


def step_at(steps: np.ndarray, loss: np.ndarray, level: float) -> float | None:
    """The step at which a curve first reaches ``level`` (linear between evaluations), or None."""
    i = int(np.argmax(loss <= level))
    if loss[i] > level:
        return None
    if i == 0:
        return float(steps[0])
    return float(steps[i - 1] + (steps[i] - steps[i - 1]) * (loss[i - 1] - level) / (loss[i - 1] - loss[i]))


def local_efficiency(sync: tuple, asyn: tuple, bands: int) -> list[tuple[float, float]]:
    """[(sync's mean step in band j, E_j)] over the bands (see the module docstring)."""
    (ss, ls), (sa, la) = sync, asyn
    at = lambda s, loss: loss[min(len(loss) - 1, int(np.searchsorted(s, START)))]  # noqa: E731
    levels = np.linspace(max(at(ss, ls), at(sa, la)), max(ls[-1], la[-1]), bands + 1)
    out = []
    for hi, lo in zip(levels[:-1], levels[1:]):
        s1, s2, a1, a2 = (step_at(ss, ls, hi), step_at(ss, ls, lo), step_at(sa, la, hi), step_at(sa, la, lo))
        if None in (s1, s2, a1, a2) or a2 <= a1:
            continue
        out.append((0.5 * (s1 + s2), (s2 - s1) / (a2 - a1)))
    return out


def drift_row(points: list[tuple[float, float]], R: float, e_d: float) -> dict:
    """The slope of E per doubling of the step, relative to max(mean E, 1/R), and over k d."""
    x = np.log2([s for s, _ in points])
    y = np.array([e for _, e in points])
    slope = float(np.polyfit(x, y, 1)[0])  # (the caller gives at least two distinct steps)
    relative = abs(slope) / max(float(y.mean()), 1.0 / R)
    kd = 1.0 / e_d - 1.0
    return {"E": [round(e, 3) for _, e in points], "steps": [round(s) for s, _ in points], "slope": slope,
            "relative": relative, "kd": kd, "implied": relative / kd, "implied_trend": math.copysign(relative, slope) / kd}


def cell_key(name: str) -> tuple:
    """(data, optim, p, m) of a bench cell folder's name, e.g. synthetic_adamw_p4_m8."""
    data, optim, p, m = name.split("_")
    return data, optim, int(p[1:]), int(m[1:])


def sweep_cells(folder: Path, left_out: list[str]) -> list[tuple[str, tuple[float, float], dict[int, tuple[Path, Path]]]]:
    """[(GRID_pP_bB, (R, E_d), {seed: (sync run, async run)})] of an ``adapipe sweep`` directory's
    settings (see the module docstring); a setting without an AdaPipe method, a profile or a seed
    with both runs is left out, and said so in ``left_out``."""
    from adapipe_cli.sweep.grid import merge_overrides

    state = json.loads((folder / "sweep.json").read_text())
    definition, out = state["definition"], []
    adaptive = next((m for m in ("adapipe-gain+predict", *definition["methods"])
                     if m in definition["methods"] and any("schedule=adapipe" in o for o in definition["methods"][m])), None)
    settings = sorted({(c["setting"], c["stages"], c["microbatches"], c["batch_size"]) for c in state["cells"]})
    for setting, p, m, batch in settings:
        runs = {(c["method"], c["seed"]): folder / c["name"] for c in state["cells"] if c["setting"] == setting}
        sync = "sync" if any(k[0] == "sync" for k in runs) else "sync-zb"
        pairs = {seed: (run, runs[(ASYNC, seed)]) for (method, seed), run in runs.items()
                 if method == sync and (ASYNC, seed) in runs}
        profile = state["profiles"].get(f"p{p}")
        why = ("no AdaPipe method in the grid" if adaptive is None else f"no seed with both {sync} and {ASYNC}"
               if not pairs else "no profile of its depth in sweep.json" if profile is None else None)
        if why:
            left_out.append(f"{folder.name}/{state['name']}_{setting}: {why}")
            continue
        axes = [f"pipeline.stages={p}", f"pipeline.microbatches={m}", f"train.batch_size={batch}", f"pipeline.profile={profile}",
                "train.stop_at_target=false"]  # (no target is set: R and E_d do not depend on it)
        context = run_context(merge_overrides(definition["fixed"], definition["methods"][adaptive], axes))
        out.append((f"{state['name']}_{setting}", context, pairs))
    return out


def bench_cells(folder: Path, left_out: list[str]) -> list[tuple[str, tuple[float, float], dict[int, tuple[Path, Path]]]]:
    """[(CELL, (R, E_d), {seed: (sync-zb run, async run)})] of a bench_adapipe output folder."""
    out = []
    for cell in sorted(c for c in folder.iterdir() if (c / "profile.json").exists()):
        try:
            key = cell_key(cell.name)
        except ValueError:
            left_out.append(f"{folder.name}/{cell.name}: not a bench cell's name (DATA_OPTIM_pP_mM)")
            continue
        seeds = sorted({int(r.name.rsplit("_s", 1)[1]) for r in cell.glob(f"{SYNC}_s*")})
        out.append((cell.name, cell_context(key, cell / "profile.json"),
                    {s: (cell / f"{SYNC}_s{s}", cell / f"{ASYNC}_s{s}") for s in seeds}))
    return out


def measure(folders: list[Path], bands: int) -> tuple[list[dict], list[str]]:
    rows, left_out = [], []
    for folder in folders:
        sweep = (folder / "sweep.json").exists()  # an adapipe sweep directory, else a bench output folder
        for name, (R, e_d), pairs in sweep_cells(folder, left_out) if sweep else bench_cells(folder, left_out):
            if e_d >= 1.0:
                left_out.append(f"{folder.name}/{name}: no delay (k d = 0)")
                continue
            for seed, runs in sorted(pairs.items()):
                if not all((r / "metrics.jsonl").exists() for r in runs):
                    left_out.append(f"{folder.name}/{name} seed {seed}: a run is missing")
                    continue
                points = local_efficiency(curve(runs[0]), curve(runs[1]), bands)
                if len({s for s, _ in points}) < 2:
                    left_out.append(f"{folder.name}/{name} seed {seed}: fewer than 2 bands with progress on both curves")
                    continue
                rows.append({"source": str(folder), "cell": name, "seed": seed, "R": R, **drift_row(points, R, e_d)})
    return rows, left_out


def markdown(rows: list[dict], left_out: list[str], cmd: str) -> str:
    lines = [f"# Drift of async's efficiency over a run\n\n`{cmd}`\n",
             "E between successive loss bands (sync-zb's steps over pipedream+predict's; in a sweep directory "
             "sync's, 1F1B's, which trains as ZB-H1), its slope per doubling "
             "of the step, relative to max(mean E, 1/R), and that over k d: the `heuristic.delay_drift` each "
             "seed implies, and with its sign the `heuristic.delay_trend`.\n",
             "| cell | seed | steps | E | slope / doubling | relative | k d | implied delay_drift | implied delay_trend |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['cell']} | {r['seed']} | {r['steps']} | {r['E']} | {r['slope']:+.3f} | {r['relative']:.3f} "
                     f"| {r['kd']:.3f} | {r['implied']:.3f} | {r['implied_trend']:+.3f} |")
    by_cell: dict[str, list[dict]] = {}
    for r in rows:
        by_cell.setdefault(r["cell"], []).append(r)
    med = lambda v, key: statistics.median(r[key] for r in v)  # noqa: E731
    lines += ["", "| cell | seeds | median implied delay_drift | median implied delay_trend |", "|---|---|---|---|"]
    lines += [f"| {c} | {len(v)} | {med(v, 'implied'):.3f} | {med(v, 'implied_trend'):+.3f} |" for c, v in by_cell.items()]
    if rows:
        rising = sum(r["slope"] > 0 for r in rows)
        for key, name in (("implied", "delay_drift"), ("implied_trend", "delay_trend")):
            lines += ["", f"{name}: median over the cells' medians {statistics.median(med(v, key) for v in by_cell.values()):+.3f}; "
                          f"over all {len(rows)} seeds {med(rows, key):+.3f}."]
        lines += ["", f"E rose in {rising} of {len(rows)} seeds."]
    if left_out:
        lines += ["", "Left out:"] + [f"- {x}" for x in left_out]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="+", type=Path, help="bench_adapipe output folders (with the run folders) "
                    "or adapipe sweep directories")
    ap.add_argument("--bands", type=int, default=4)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    for f in args.folders:
        if not f.is_dir():
            print(f"calibrate_drift: {f} is not a folder: give bench_adapipe output folders or sweep directories", file=sys.stderr)
            return 2
    rows, left_out = measure(args.folders, args.bands)
    if not rows:
        print("calibrate_drift: no cell with sync-zb and pipedream+predict runs in these folders", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    cmd = "python scripts/calibrate_drift.py " + " ".join(sys.argv[1:] if argv is None else argv)
    (args.out / "drift.json").write_text(json.dumps({"rows": rows, "left_out": left_out}, indent=1) + "\n")
    (args.out / "drift.md").write_text(markdown(rows, left_out, cmd))
    print(markdown(rows, left_out, cmd))
    return 0


if __name__ == "__main__":
    sys.exit(main())
