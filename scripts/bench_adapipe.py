"""Time-to-perplexity of sync, async and AdaPipe on the pipeline clock (the method comparison).

For every cell (data, optimizer, depth p, microbatches m) the script

0. measures every cell's cost profile first, one after another with nothing else running (the
   cell's ``profile.json``, measured as a run measures its own; an existing one is reused): each
   is the cell's one clock, given to every run of the cell through ``pipeline.profile``, so work
   started on the machine after these first minutes slows the runs but cannot change their times;
1. runs sync 1F1B for ``--steps`` steps;
2. fixes the cell's target before any other method runs: the validation perplexity that sync
   reaches (median over seeds) at ``--target-at`` of its steps;
3. runs sync ZB-H1 (``sync-zb``: 1F1B's numbers with a smaller bubble, the strongest sync
   schedule; it stops at the target), async (pipedream+predict; 2bw+predict where m >= p - 1) and
   AdaPipe (heuristics rate, goodput and gain; its sync phase ZB-H1, its async phase
   pipedream+predict) until they reach the target (at most ``--budget`` x the sync steps): async
   needs more, cheaper steps;
4. prints and writes (``results.json``, ``results.md``) the median time-to-target per method, its
   spread over seeds, its ratio to sync 1F1B and, for AdaPipe, its ratio to the best fixed method
   of the cell (the fastest of sync, sync-zb, pipedream+predict and 2bw+predict at the median)
   with a 95% bootstrap interval over seeds (``adapipe_cli.sweep.bootstrap``). A method that never
   reaches the target is marked with its best perplexity; a seed that does not counts as infinite
   time.

The learning rate is constant after its warm-up, so a method's trajectory does not depend on its
step budget; every async schedule runs with weight prediction (``+predict`` in its name).

Example (the README's table): python scripts/bench_adapipe.py --out outputs/bench_adapipe
Quick check: python scripts/bench_adapipe.py --data synthetic --optims adamw --depths 4 --micro 1 --seeds 1 --steps 100
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from adapipe_cli.sweep.bootstrap import fmt_ci, speedup_ci
from adapipe_cli.sweep.target import time_to_target

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"

DATA = {
    "synthetic": ["data=synthetic"],
    "tinyshakespeare": ["data=tinyshakespeare", f"data.path={os.environ.get('ADAPIPE_SHAKESPEARE', SHARED / 'tinyshakespeare')}"],
}


PREDICT = "schedule.mitigation=[predict]"


def methods(p: int, m: int, budget: list[str]) -> dict[str, list[str]]:
    """The compared methods, named in full: every async schedule (and AdaPipe's async phase) with
    weight prediction, set explicitly (``schedule=pipedream`` alone is PipeDream without it)."""
    out = {
        "sync": ["schedule=1f1b"],
        # ZB-H1: 1F1B's numbers with a smaller bubble (the strongest sync schedule; AdaPipe's sync phase)
        "sync-zb": ["schedule=zbh1", "train.stop_at_target=true"],
        "pipedream+predict": ["schedule=pipedream", PREDICT, *budget],
        "adapipe-rate+predict": ["schedule=adapipe", "heuristic=rate", PREDICT, *budget],
        "adapipe-goodput+predict": ["schedule=adapipe", "heuristic=goodput", PREDICT, *budget],
        "adapipe-gain+predict": ["schedule=adapipe", "heuristic=gain", PREDICT, *budget],
        # gain whose losing probes of async are undone (heuristic.undo_probes), and so no sync warm-up
        "adapipe-gain-undo+predict": ["schedule=adapipe", "heuristic=gain", "heuristic.undo_probes=true", PREDICT, *budget],
    }
    if m >= p - 1:
        out["2bw+predict"] = ["schedule=2bw", PREDICT, *budget]
    return out


FIXED = ("sync", "sync-zb", "pipedream+predict", "2bw+predict")  # the fixed methods AdaPipe is held against


def run_one(job: tuple[str, list[str]]) -> dict:
    """One training run in this worker process; returns its summary and evaluation records."""
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false")
    from adapipe_cli.cli.compose import compose_config
    from adapipe_cli.sweep.target import evals
    from adapipe_cli.train.loop import train

    run_dir, overrides = job
    summary_file = Path(run_dir) / "summary.json"
    if summary_file.is_file():  # resumable: a finished run is not repeated
        summary = json.loads(summary_file.read_text())
    else:
        summary = train(compose_config(overrides), Path(run_dir))
    return {"dir": run_dir, "summary": summary, "evals": evals(run_dir)}


def time_to(run: dict, target: float) -> float | None:
    """Time of the run's first evaluation at or below ``target``."""
    return time_to_target(run["evals"], target)[0]


def ppl_at(records: list[dict], frac: float) -> float:
    """Validation perplexity at the evaluation closest to ``frac`` of the run's last evaluation time."""
    t_end = records[-1]["time_s"]
    return min(records, key=lambda r: abs(r["time_s"] - frac * t_end))["val_ppl"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "outputs" / "bench_adapipe"))
    ap.add_argument("--data", nargs="+", default=["synthetic", "tinyshakespeare"], choices=list(DATA))
    ap.add_argument("--optims", nargs="+", default=["adamw", "muon"])
    ap.add_argument("--depths", nargs="+", type=int, default=[4, 8])
    ap.add_argument("--micro", nargs="+", type=int, default=[1, 8], help="microbatches per step")
    ap.add_argument("--micro-size", type=int, default=2, help="sequences per microbatch")
    ap.add_argument("--steps", type=int, default=200, help="sync's steps")
    ap.add_argument("--budget", type=float, default=3.0, help="step budget of the other methods, x sync's")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--first-seed", type=int, default=0,
                    help="seeds FIRST to FIRST + SEEDS - 1 (held-out seeds: another range than the reported one)")
    ap.add_argument("--target-at", type=float, default=0.75, help="fraction of sync's steps that sets the target")
    ap.add_argument("--jobs", type=int, default=2, help="runs in parallel (one thread each)")
    ap.add_argument("--model", default="gpt-micro")
    ap.add_argument("--report", default=None, help="rewrite results.md (and results.json) of a results.json, run nothing")
    ap.add_argument("--skip", nargs="+", default=[], metavar="METHOD",
                    help="AdaPipe variants to leave out (the fixed methods always run: AdaPipe is held against them)")
    args = ap.parse_args()
    known = set(methods(8, 8, []))
    bad = [x for x in args.skip if x not in known or not x.startswith("adapipe")]
    if bad:
        ap.error(f"--skip {bad[0]}: name an AdaPipe variant, one of {', '.join(sorted(k for k in known if k.startswith('adapipe')))}")
    if args.report:  # (the comparison with the best fixed method recomputed from each run's time)
        path = Path(args.report)
        return write(path.parent, against_best_fixed(json.loads(path.read_text())))
    out = Path(args.out)
    rows = []
    t0 = time.time()
    cells = [(data, optim, p, m) for data in args.data for optim in args.optims for p in args.depths for m in args.micro]
    for cell in cells:  # every clock first, on a quiet machine (nothing else of this script runs yet)
        measure_cell_profile(out, args, *cell)
    print(f"{len(cells)} cost profiles ready ({time.time() - t0:.0f}s); the runs can share the machine from now on")
    with ProcessPoolExecutor(args.jobs) as pool:
        for data in args.data:
            for optim in args.optims:
                for p in args.depths:
                    for m in args.micro:
                        rows += bench_cell(pool, out, args, data, optim, p, m, t0)
                        write(out, rows)
    print(f"\nwrote {out / 'results.md'} and results.json ({time.time() - t0:.0f}s)")


def seed_range(args) -> range:
    return range(args.first_seed, args.first_seed + args.seeds)


def cell_overrides(args, data: str, optim: str, p: int, m: int) -> list[str]:
    """The overrides every run of the cell shares."""
    return [f"model={args.model}", *DATA[data], f"optim={optim}", "optim.decay=constant", f"pipeline.stages={p}",
            f"pipeline.microbatches={m}", f"train.batch_size={args.micro_size * m}", f"train.max_steps={args.steps}",
            f"train.eval_every={max(1, args.steps // 30)}", "pipeline.threads=1", "pipeline.profile_reps=20",
            "train.progress=off"]


def measure_cell_profile(out: Path, args, data: str, optim: str, p: int, m: int) -> Path:
    """The cell's cost profile (``OUT/CELL/profile.json``), measured in this process unless it exists
    (an ``--out`` written before the profiles came first keeps its clock: sync seed 0's profile)."""
    path = out / f"{data}_{optim}_p{p}_m{m}" / "profile.json"
    older = path.parent / "sync_s0" / "profile.json"
    if path.is_file() or older.is_file():
        return path if path.is_file() else older
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    from adapipe_cli.cli.compose import compose_config
    from adapipe_cli.sweep.profile import measure_depth_profile

    measure_depth_profile(compose_config(cell_overrides(args, data, optim, p, m)), path)
    print(f"  profile {path}", flush=True)
    return path


def bench_cell(pool, out: Path, args, data: str, optim: str, p: int, m: int, t0: float) -> list[dict]:
    cell = f"{data}_{optim}_p{p}_m{m}"
    base = cell_overrides(args, data, optim, p, m)
    ms = methods(p, m, [f"train.max_steps={int(args.budget * args.steps)}", "train.stop_at_target=true"])
    shared = base + [f"pipeline.profile={measure_cell_profile(out, args, data, optim, p, m)}"]
    jobs = [(str(out / cell / f"sync_s{s}"), shared + ms["sync"] + [f"seed={s}"]) for s in seed_range(args)]
    sync_runs = list(pool.map(run_one, jobs))
    target = statistics.median(ppl_at(r["evals"], args.target_at) for r in sync_runs)
    jobs = [(str(out / cell / f"{name}_s{s}"), shared + ov + [f"seed={s}", f"train.target_ppl={target!r}"])
            for name, ov in ms.items() if name != "sync" and name not in args.skip for s in seed_range(args)]
    results = {"sync": sync_runs}
    for job, res in zip(jobs, pool.map(run_one, jobs)):
        results.setdefault(Path(job[0]).name.rsplit("_s", 1)[0], []).append(res)
    rows = []
    ttt_sync = median_ttt([time_to(r, target) for r in results["sync"]])
    print(f"\n{cell}: target ppl {target:.2f} (sync at {args.target_at:.0%} of its budget)   [{time.time() - t0:.0f}s]")
    print(f"  {'method':<22} {'ttt median':>10} {'spread':>17} {'vs sync':>8} {'async frac':>10} {'switches':>8}")
    for name, runs in results.items():
        ttts = [time_to(r, target) for r in runs]
        med = median_ttt(ttts)
        reached = [x for x in ttts if x is not None]
        spread = f"{min(reached):.2f}-{max(reached):.2f}" if reached else "-"
        best = min(e["val_ppl"] for r in runs for e in r["evals"])
        ratio = med / ttt_sync if med is not None and ttt_sync else None
        af = statistics.median(r["summary"]["async_fraction"] for r in runs)
        sw = statistics.median(r["summary"]["switches"] for r in runs)
        shown = f"{med:.2f}" if med is not None else f"n/r({best:.1f})"
        print(f"  {name:<22} {shown:>10} {spread:>17} {(f'{ratio:.3f}' if ratio else '-'):>8} {af:>10.2f} {sw:>8.1f}")
        rows.append({"cell": cell, "data": data, "optim": optim, "stages": p, "microbatches": m, "target_ppl": target,
                     "method": name, "ttt_median": med, "ttt_all": ttts, "ratio_to_sync": ratio, "best_ppl": best,
                     "async_fraction": af, "switches": sw, "reached": len(reached), "runs": len(runs)})
    sys.stdout.flush()
    return against_best_fixed(rows)


def against_best_fixed(rows: list[dict]) -> list[dict]:
    """Each AdaPipe row of a cell with its median time over the cell's best fixed method's (the
    fixed method of :data:`FIXED` with the least median time; a seed that did not reach the target
    counts as infinite time) and the 95% bootstrap interval of that ratio over seeds: ``best_fixed``,
    ``vs_best_fixed`` (None where AdaPipe's median or every fixed method's is not reached, see
    ``best_fixed_reached``) and ``vs_best_fixed_ci`` (an end that is infinite is None)."""
    inf = lambda xs: [x if x is not None else math.inf for x in xs]  # noqa: E731
    finite = lambda x: x if math.isfinite(x) else None  # noqa: E731 (JSON has no inf: null)
    for cell in dict.fromkeys(r["cell"] for r in rows):
        mine = [r for r in rows if r["cell"] == cell]
        fixed = {r["method"]: inf(r["ttt_all"]) for r in mine if r["method"] in FIXED}
        best = min(fixed, key=lambda n: statistics.median(fixed[n]))  # the fastest fixed method at the median
        theirs = statistics.median(fixed[best])
        for r in mine:
            if not r["method"].startswith("adapipe"):
                continue
            times = inf(r["ttt_all"])
            ours = statistics.median(times)
            ci = speedup_ci(fixed[best], times)  # (median(times) / median(theirs): a time ratio, below 1 faster)
            over = ours / theirs if math.isfinite(ours) and math.isfinite(theirs) else None
            r.update(best_fixed=best, best_fixed_reached=math.isfinite(theirs), vs_best_fixed=over,
                     vs_best_fixed_ci=[finite(x) for x in ci] if ci else None)
    return rows


def median_ttt(ttts: list[float | None]) -> float | None:
    """Median time-to-target over seeds (None: not reached); None unless more than half reached it."""
    reached = sorted(x for x in ttts if x is not None)
    if len(reached) * 2 <= len(ttts):
        return None
    ttts = sorted(x if x is not None else float("inf") for x in ttts)
    return statistics.median(ttts)


def write(out: Path, rows: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    lines = ["| data | optim | p | m | target | method | ttt (s, median) | vs sync | vs best fixed [95% CI] | "
             "async frac | switches |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ttt = f"{r['ttt_median']:.2f}" if r["ttt_median"] is not None else f"not reached (best {r['best_ppl']:.1f})"
        ratio = f"{r['ratio_to_sync']:.3f}" if r["ratio_to_sync"] else "-"
        vs = "-"
        if r.get("best_fixed"):
            ci = r.get("vs_best_fixed_ci")
            ci = " " + fmt_ci(tuple(math.inf if x is None else x for x in ci)) if ci else ""
            if r.get("vs_best_fixed") is not None:
                vs = f"{r['vs_best_fixed']:.3f}{ci} of {r['best_fixed']}"
            elif not r.get("best_fixed_reached", True):
                vs = ("faster than every fixed method: none reached the target" if r["ttt_median"] is not None
                      else "neither it nor any fixed method reached the target")
            else:
                vs = f"not reached ({r['best_fixed']} did){ci}"
        lines.append(f"| {r['data']} | {r['optim']} | {r['stages']} | {r['microbatches']} | {r['target_ppl']:.2f} | "
                     f"{r['method']} | {ttt} | {ratio} | {vs} | {r['async_fraction']:.2f} | {r['switches']:.0f} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
