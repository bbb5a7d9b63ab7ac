"""How wrong is the prior efficiency that prices gain's first probe? (AdaPipe #13)

``heuristic=gain`` starts from a prior E_d = 1 / (1 + k d) for async's statistical efficiency (its
progress per step over sync's; d = (p - 1) / m the gradient delay in steps, k by optimizer:
:meth:`adapipe_cli.adaptive.probing.Prober.delay_efficiency`) and a spread that decides whether a
first probe is worth its cost. This script measures the prior's error on the cells of
``scripts/bench_adapipe.py`` outputs: for each cell and seed set, the efficiency that counts is

    E = G / R,   G = sync-zb's time to the target / pipedream+predict's,   R = t_sync / t_async

(G: async's progress per second over sync's; R: the predicted step-time ratio of AdaPipe's two
phases, ZB-H1 and pipedream+predict, from the cell's cost profile), and the error in the units of a
spread in logit E, z = (E - E_d) / (E_d (1 - E_d)), beside the relative error (E - E_d) / E_d. The
root mean square of z over the cells is ``heuristic.prior_logit_sd``.

    python scripts/calibrate_prior.py docs/results/bench_adapipe/results.json \\
        docs/results/bench_adapipe/heldout/results.json --out docs/results/prior

A results file holds medians over its seeds; each file counts once per cell. A cell whose async
never reached the target has E = 0. The profiles are the ones beside the results (``CELL/
profile.json`` in the results file's folder) or else measured here into ``--profiles``, one after
another: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_adapipe as bench  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# the method comparison's settings that a cell's name does not carry (bench_adapipe's defaults)
BENCH = argparse.Namespace(model="gpt-micro", micro_size=2, steps=200)


def cell_context(cell: tuple, profile: Path) -> tuple[float, float]:
    """(R, E_d) of a bench cell (data, optim, p, m): AdaPipe's predicted step-time ratio and its
    delay prior, as the run's own set-up computes them."""
    data, optim, p, m = cell
    return run_context(bench.cell_overrides(BENCH, data, optim, p, m) + [f"pipeline.profile={profile}"]
                       + bench.methods(p, m, [])["adapipe-gain+predict"])


def run_context(overrides: list[str]) -> tuple[float, float]:
    """(R, E_d) of the AdaPipe run that ``adapipe train OVERRIDES`` sets up (nothing trained)."""
    from adapipe_cli.cli.compose import compose_config
    from adapipe_cli.train.setup import RunSetup

    with tempfile.TemporaryDirectory() as d:
        setup = RunSetup(compose_config(overrides), Path(d))
        setup.runtime.close()
    ctx = setup.ctx
    return ctx.sync_step_time / ctx.async_step_time, setup.heuristic.delay_efficiency()


def profile_of(name: str, cell: tuple, results: Path, profiles: Path) -> Path:
    """The cell's profile beside the results (either layout bench_adapipe writes), else measured."""
    for beside in (results.parent / name / "profile.json", results.parent / name / "sync_s0" / "profile.json"):
        if beside.is_file():
            return beside
    return bench.measure_cell_profile(profiles, BENCH, *cell)


def errors(files: list[Path], profiles: Path) -> list[dict]:
    rows, context = [], {}
    for f in files:
        cells: dict[str, dict[str, float | None]] = {}
        fields: dict[str, tuple] = {}
        for r in json.loads(f.read_text()):
            cells.setdefault(r["cell"], {})[r["method"]] = r["ttt_median"]
            fields[r["cell"]] = (r["data"], r["optim"], r["stages"], r["microbatches"])
        for name, ttt in cells.items():
            if ttt.get("sync-zb") is None or "pipedream+predict" not in ttt:
                print(f"  {f}: {name} left out (sync-zb did not reach the target, or no pipedream+predict)")
                continue
            cell = fields[name]
            if name not in context:  # one profile per cell, whichever file names it first
                context[name] = cell_context(cell, profile_of(name, cell, f, profiles))
            R, e_d = context[name]
            pp = ttt["pipedream+predict"]
            # async never reached the target: E = 0 stands for a bound (its E is below what the budget shows)
            G = ttt["sync-zb"] / pp if pp else 0.0
            E = G / R
            _, optim, p, m = cell
            rows.append({"file": str(f), "cell": name, "optim": optim, "d": (p - 1) / m, "R": R, "E_d": e_d,
                         "G": G, "E": E, "relative": (E - e_d) / e_d, "z": (E - e_d) / (e_d * (1 - e_d))})
    return rows


def rms(xs: list[float]) -> float:
    return math.sqrt(sum(x * x for x in xs) / len(xs)) if xs else float("nan")


def report(rows: list[dict]) -> str:
    lines = ["| results | cell | d | R | E_d | G | E | (E - E_d) / E_d | z = (E - E_d) / (E_d (1 - E_d)) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {Path(r['file']).parent.name} | {r['cell']} | {r['d']:.3f} | {r['R']:.3f} | {r['E_d']:.3f} | "
                     f"{r['G']:.3f} | {r['E']:.3f} | {r['relative']:+.2f} | {r['z']:+.2f} |")
    lines += ["", "| delays | rows | rms relative error | rms z |", "|---|---|---|---|"]
    reached = lambda r: r["G"] > 0  # noqa: E731 (async reached the target: E measured, not a bound)
    for name, keep in (("d < 1", lambda r: r["d"] < 1), ("d >= 1", lambda r: r["d"] >= 1), ("all", lambda r: True),
                       ("d >= 1, async reached", lambda r: r["d"] >= 1 and reached(r)),
                       ("all, async reached", reached)):
        sel = [r for r in rows if keep(r)]
        lines.append(f"| {name} | {len(sel)} | {rms([r['relative'] for r in sel]):.2f} | {rms([r['z'] for r in sel]):.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", type=Path, help="results.json files of scripts/bench_adapipe.py")
    ap.add_argument("--profiles", type=Path, default=REPO / "outputs" / "calibrate_prior",
                    help="where the cells' profiles are measured when none lies beside the results")
    ap.add_argument("--out", type=Path, default=None, help="write prior.md and prior.json here")
    args = ap.parse_args()
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false")
    missing = [str(f) for f in args.results if not f.is_file()]
    if missing:
        ap.error(f"no such results file: {missing[0]}")
    rows = errors(args.results, args.profiles)
    text = report(rows)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "prior.md").write_text(text)
        (args.out / "prior.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
