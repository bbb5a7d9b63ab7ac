"""``adapipe sweep`` and ``adapipe report``: grid composition, resuming, failures, and the report's
statistics on hand-made runs."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from adapipe_cli.cli.compose import compose_config
from adapipe_cli.cli.main import main
from adapipe_cli.config import ConfigError, validate
from adapipe_cli.sweep.grid import load_grid, merge_overrides
from adapipe_cli.sweep.report import write_report
from adapipe_cli.sweep.results import COLUMNS
from adapipe_cli.sweep.bootstrap import median_ci, speedup_ci, within_noise
from adapipe_cli.sweep.target import derive, derive_target, time_to_target
from conftest import built_not_drawn

GRIDS = {"smoke": (2, 2, 3, 1), "cpu": (3, 4, 3, 3), "gpu": (3, 5, 3, 3),  # depths, batches, methods, seeds
         "cpu-adamw": (2, 1, 7, 3), "cpu-muon": (2, 1, 6, 3), "gpu1": (2, 2, 3, 1)}


# (a compose per method of each grid: 1-2 s each on 2 busy cores) fast: a grid of each branch below,
# cpu-adamw (the cpu grids' and make reproduce's checks, with the most methods), gpu, gpu1; slow
# (make test-all): cpu and cpu-muon, which go through cpu-adamw's, and smoke, which goes through the
# checks gpu and gpu1 make too (no ZB-H1 or gain methods, heuristic goodput, no cpu branch; its grid
# is loaded by the TINY_GRID sweeps below, and run end to end by test_smoke_sweep_end_to_end)
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in ("cpu", "cpu-muon", "smoke") else n
                                  for n in GRIDS])
def test_shipped_grids_compose_into_their_cells(name):
    grid = load_grid([f"sweep={name}"])
    depths, batches, methods, seeds = GRIDS[name]
    cells = grid.cells()
    assert len(cells) == depths * batches * methods * seeds == len({c.name for c in cells})
    # named in full; the grids of make reproduce also have the strongest sync schedule, ZB-H1
    # and AdaPipe with heuristic=gain beside goodput
    # (and the AdamW grid gain with its losing probes of async undone)
    # (and gain following a 64-token held-out loss, on the clock, beside the training loss it follows by default)
    zb = {"sync-zb", "adapipe-gain+predict", "adapipe-gain-heldout64+predict"} if name in ("cpu-adamw", "cpu-muon") else set()
    zb |= {"adapipe-gain-undo+predict"} if name == "cpu-adamw" else set()
    assert set(grid.methods) == {"sync", "pipedream+predict", "adapipe+predict"} | zb
    for c in cells:
        assert c.batch_size == grid.cfg.microbatch_size * c.microbatches
    # the deepest pipeline at its largest batch, for each method: composes and validates
    deepest = [c for c in cells if c.stages == max(grid.cfg.stages) and c.microbatches == max(grid.cfg.microbatches)
               and c.seed == grid.cfg.seeds[0]]
    composed = {}
    for cell in deepest:
        overrides = grid.overrides(cell, target=None if grid.cfg.target.rule == "fixed" else 50.0)
        if name == "gpu1" and not torch.cuda.is_available():  # validating checks that the device exists
            overrides = [*overrides, "pipeline.device=cpu"]
        cfg = composed[cell.method] = compose_config(overrides)
        validate(cfg)
        assert (cfg.pipeline.stages, cfg.train.batch_size, cfg.seed) == (cell.stages, cell.batch_size, cell.seed)
    assert cfg.schedule.name == "adapipe" and cfg.heuristic.name == ("gain" if zb else "goodput")
    if name.startswith("cpu"):
        assert cfg.model.n_layer >= 8 and cfg.data.path.endswith(os.path.join("shared", "data", "tinyshakespeare"))
    if name in ("cpu-adamw", "cpu-muon"):  # the two grids of make reproduce: two targets, one optimizer each
        assert cfg.optim.name == name.split("-")[1] and cfg.train.stop_at_target
        assert grid.cfg.target.budget == 300 and grid.cfg.late_target.rule == "sync_best"
        sync = composed["sync"]  # (a method's step budget is the same at every depth)
        assert cfg.train.max_steps == 2 * sync.train.max_steps and sync.schedule.name == "1f1b"
    if name == "gpu":
        assert cfg.pipeline.runtime == "dist" and cfg.model.name == "gpt2-small" and not grid.cfg.profile
    if name == "gpu1":  # one GPU: the local runtime on it, in bf16, a profile shared per depth
        assert "pipeline.device=cuda" in overrides and cfg.pipeline.runtime == "local" and grid.cfg.profile
        assert cfg.model.name == "gpt2-small" and cfg.train.precision == "bf16" and grid.cfg.jobs == 1
        assert cfg.data.name == "tinyshakespeare" and cfg.data.path.endswith(os.path.join("shared", "data", "tinyshakespeare"))


def test_grid_overrides_and_checks(monkeypatch, tmp_path):
    monkeypatch.setenv("ADAPIPE_SHARED_DATA", str(tmp_path))
    grid = load_grid(["sweep=cpu", "sweep.seeds=[5]", "train.max_steps=7", "schedule.async_lr_scale=0.5"])
    cell = grid.cells()[0]
    o = grid.overrides(cell, tmp_path / "p.json", 12.5)
    assert "train.max_steps=7" in o and "train.max_steps=300" not in o  # the user's override wins
    assert f"data.path={tmp_path / 'tinyshakespeare'}" in o
    assert o[-2:] == [f"pipeline.profile={tmp_path / 'p.json'}", "train.target_ppl=12.5"]
    assert cell.name == "p2_b4_sync_s5"
    assert merge_overrides(["a=1", "+b=2"], ["b=3"]) == ["a=1", "b=3"]
    for bad, msg in [(["seed=3"], "sweep.seeds"), (["sweep.compare=nope"], "sweep.compare"),
                     (["sweep.target.rule=fixed"], "sweep.target.ppl"), (["sweep.target.baseline=x"], "baseline"),
                     (["+sweep.methods.a_b=['schedule=1f1b']"], "method name")]:
        with pytest.raises(ConfigError, match=msg):
            load_grid(["sweep=smoke", *bad])


@pytest.mark.parametrize("args,message", [
    (["sweep", "sweep=nope"], "unknown sweep 'nope': choose one of cpu, cpu-adamw, cpu-muon, gpu, gpu1, smoke"),
    (["sweep"], "adapipe sweep sweep=NAME"),
    (["sweep", "sweep=smoke", "pipeline.stages=2"], "use sweep.stages"),
    (["sweep", "sweep=smoke", "sweep.stagez=[2]"], "unknown config key 'sweep.stagez'"),
    # (depth 4 alone: its first cell is the first checked, not the 7th, each check a compose)
    (["sweep", "sweep=smoke", "sweep.stages=[4]", "model.n_layer=3"], "cell p4_b2_sync_s0: pipeline.stages=4 is more than"),
    (["report", "/nonexistent/sweep"], "does not exist"),
])
def test_bad_input_is_one_line_and_exit_2(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_time_to_target_and_derived_target():
    evals = [{"step": s, "val_ppl": 100.0 / (1 + s), "time_s": 0.5 * s} for s in range(0, 101, 10)]
    assert time_to_target(evals, 100 / 31) == (15.0, 30)
    assert time_to_target(evals, 0.5) == (None, None)
    slower = [dict(r, val_ppl=r["val_ppl"] * 2) for r in evals]
    rec = derive_target({"a": (evals, 100), "b": (slower, 100), "c": (slower, 100)}, 0.45)  # last eval <= step 45: 40
    assert rec["ppl"] == pytest.approx(200 / 41) and rec["from"]["a"] == pytest.approx(100 / 41)


TINY_GRID = ["sweep=smoke", "sweep.stages=[2]", "sweep.microbatches=[2]", "model.n_layer=2", "model.d_model=32",
             "model.n_head=2", "model.block_size=16", "data.vocab_size=64", "data.eval_tokens=256", "train.max_steps=4",
             "train.eval_every=2", "pipeline.profile_reps=1", "sweep.jobs=1"]


def _lines(err: str, verb: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("[") and f"] {verb} " in line]


@pytest.mark.slow  # a subprocess run of more than 8 s (fast suite: under 5 min on 2 busy cores)
def test_sweep_resumes_only_the_deleted_cell(tmp_path, capsys):
    out = tmp_path / "sw"
    late = "sweep.late_target.rule=sync_best"
    assert main(["sweep", *TINY_GRID, late, f"sweep.dir={out}"]) == 0
    err = capsys.readouterr().err
    assert len(_lines(err, "done")) == 3
    state = json.loads((out / "sweep.json").read_text())
    target, best = state["targets"]["p2_b4"], state["late_targets"]["p2_b4"]
    assert target["rule"] == "sync_fraction" and target["ppl"] == target["from"]["p2_b4_sync_s0"]
    sync_evals = [json.loads(r) for r in (out / "p2_b4_sync_s0" / "metrics.jsonl").read_text().splitlines()]
    assert best["ppl"] == min(r["val_ppl"] for r in sync_evals if r.get("kind") == "eval") <= target["ppl"]
    # the others stop at the lower of the two targets, having passed both
    assert f"train.target_ppl={best['ppl']!r}" in (out / "p2_b4_pipedream+predict_s0" / ".hydra" / "overrides.yaml").read_text()
    assert state["profiles"]["p2"].endswith("p2_mb2.json")
    overrides = (out / "p2_b4_adapipe+predict_s0" / ".hydra" / "overrides.yaml").read_text()
    assert f"pipeline.profile={state['profiles']['p2']}" in overrides and "train.target_ppl=" in overrides
    stamp = {d.name: (d / "summary.json").stat().st_mtime_ns for d in out.glob("p2_*")}
    for f in (out / "p2_b4_pipedream+predict_s0").iterdir():
        if f.is_file():
            f.unlink()
    assert main(["sweep", *TINY_GRID, late, f"sweep.dir={out}"]) == 0
    err = capsys.readouterr().err
    assert [line.split()[-1] for line in _lines(err, "start")] == ["p2_b4_pipedream+predict_s0"]
    assert len(_lines(err, "skip")) == 2 and "profile p2" not in err and "target p2" not in err
    assert all((out / n / "summary.json").stat().st_mtime_ns == t for n, t in stamp.items() if n != "p2_b4_pipedream+predict_s0")
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3 and list(rows[0]) == COLUMNS and {r["status"] for r in rows} == {"done"}


@pytest.mark.slow
def test_results_do_not_depend_on_jobs(tmp_path, capsys):
    """The same grid with jobs=1 (in this process) and jobs=2 (two worker processes) on one cost
    profile: identical results.csv and evaluation records, and a start and an end line per cell."""
    one, two = tmp_path / "one", tmp_path / "two"
    grid = [a for a in TINY_GRID if not a.startswith("sweep.jobs")]
    assert main(["sweep", *grid, "sweep.jobs=1", f"sweep.dir={one}"]) == 0
    capsys.readouterr()
    state = json.loads((one / "sweep.json").read_text())  # the clock: the second sweep reuses the profile
    two.mkdir()
    (two / "sweep.json").write_text(json.dumps({"definition": state["definition"], "profiles": state["profiles"]}))
    assert main(["sweep", *grid, "sweep.jobs=2", f"sweep.dir={two}"]) == 0
    err = capsys.readouterr().err
    assert "3 cells" in err and "2 at a time" in err and "profile p2" not in err
    assert len(_lines(err, "start")) == 3 and len(_lines(err, "done")) == 3
    assert (one / "results.csv").read_text() == (two / "results.csv").read_text()
    for cell in (c["name"] for c in state["cells"]):
        a, b = ([{k: r[k] for k in ("step", "val_ppl", "time_s")} for r in map(json.loads, (d / cell / "metrics.jsonl")
                 .read_text().splitlines()) if r.get("kind") == "eval"] for d in (one, two))
        assert a == b and len(a) >= 2, cell  # a run stopping at its target has fewer


@pytest.mark.slow  # a subprocess run of more than 8 s (fast suite: under 5 min on 2 busy cores)
def test_only_runs_the_selected_methods_and_the_baseline_a_target_needs(tmp_path, capsys):
    out = tmp_path / "sw"
    assert main(["sweep", *TINY_GRID, "sweep.only=[adapipe+predict]", f"sweep.dir={out}"]) == 0
    err = capsys.readouterr().err
    assert [line.split()[-1] for line in _lines(err, "start")] == ["p2_b4_sync_s0", "p2_b4_adapipe+predict_s0"]
    assert not (out / "p2_b4_pipedream+predict_s0").exists()
    assert main(["sweep", *TINY_GRID, "sweep.only=[pipedream+predict]", f"sweep.dir={out}"]) == 0  # same directory
    assert [line.split()[-1] for line in _lines(capsys.readouterr().err, "start")] == ["p2_b4_pipedream+predict_s0"]
    assert main(["sweep", *TINY_GRID, "sweep.only=[nope]", f"sweep.dir={out}"]) == 2
    assert "sweep.only: nope is not one of the methods" in capsys.readouterr().err


def test_a_grid_without_its_curves_setting_still_reports(tmp_path, capsys, monkeypatch):
    """sweep.curves names a setting the narrowed grid lacks: the sweep ends with its report and the
    curves of the setting there is (the first, here the only one); adapipe report does the same."""
    from adapipe_cli.sweep import plots

    # the speedup and time-to-target plots, which this test does not check, are built but not laid
    # out, drawn or written, as a run's (tests/conftest.py): 1-2 s of two reports on 2 busy cores;
    # the curves it checks are drawn and written. (test_report_medians_spreads_speedups_and_unreached_targets
    # checks every file of a report, drawn.)
    for name in ("plot_speedup", "plot_ttt"):
        monkeypatch.setattr(plots, name, built_not_drawn(getattr(plots, name)))
    out = tmp_path / "sw"
    assert main(["sweep", *TINY_GRID, "sweep.only=[sync]", "sweep.compare=sync",
                 "sweep.curves=p8_b4", f"sweep.dir={out}"]) == 0
    assert (out / "results.md").is_file() and (out / "curves_p2_b4.png").is_file()
    assert "--cell" not in capsys.readouterr().err
    (out / "curves_p2_b4.png").unlink()
    assert main(["report", str(out)]) == 0 and (out / "curves_p2_b4.png").is_file()
    assert main(["report", str(out), "--cell", "p8_b4"]) == 2  # typed by the user: refused, with the choices
    assert "--cell p8_b4: not a setting of this sweep; use one of p2_b4" in capsys.readouterr().err


@pytest.mark.slow  # a subprocess run of more than 8 s (fast suite: under 5 min on 2 busy cores)
def test_a_failing_cell_does_not_stop_the_others(tmp_path, capsys):
    out = tmp_path / "sw"
    args = ["sweep", *TINY_GRID, f"sweep.dir={out}", "sweep.target.rule=fixed",
            "sweep.target.ppl=60", "sweep.only=[sync,adapipe]",
            "+sweep.methods.adapipe=['schedule=adapipe','data=text','data.train=/nonexistent/train.txt']"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "adapipe: failed: p2_b4_adapipe_s0:" in err and len(_lines(err, "done")) == 1
    assert "nonexistent" in (out / "p2_b4_adapipe_s0" / "error.txt").read_text()
    assert "`p2_b4_adapipe_s0`: failed" in (out / "results.md").read_text()
    assert main(args) == 1  # resumed: the done cell is skipped, the failed one is run again
    err = capsys.readouterr().err
    assert len(_lines(err, "skip")) == 1 and [line.split()[-1] for line in _lines(err, "start")] == ["p2_b4_adapipe_s0"]


def _run(d, evals: list[tuple[int, float, float]], **summary):
    d.mkdir(parents=True)
    d.joinpath("metrics.jsonl").write_text("".join(
        json.dumps({"kind": "eval", "step": s, "val_ppl": p, "time_s": t}) + "\n" for s, p, t in evals))
    best = min(p for _, p, _ in evals)
    base = {"completed": True, "clock": "pipeline", "clock_mode": "profiled", "best_val_ppl": best,
            "final_val_ppl": evals[-1][1], "time_s": evals[-1][2], "steps": evals[-1][0], "async_fraction": 0.0,
            "switches": 0}
    d.joinpath("summary.json").write_text(json.dumps({**base, **summary}))


def reached(t):
    return [(0, 100.0, 0.0), (10, 9.0, t), (20, 8.0, t + 5)]


def unreached(t_end, best):
    return [(0, 100.0, 0.0), (10, 20.0, t_end / 2), (20, best, t_end)]


def test_bootstrap_interval_of_one_samples_median_by_hand():
    # two values: a resample's median is either value (both drawn) or their mean, with chances
    # 1/4, 1/4 and 1/2; the 95% interval spans both ends, a 40% one only the middle
    assert median_ci([1.0, 3.0]) == (1.0, 3.0)
    assert median_ci([1.0, 3.0], level=0.4) == (2.0, 2.0)
    assert median_ci([2.0, 2.0, 2.0]) == (2.0, 2.0)
    assert median_ci([1.0]) is None


def test_bootstrap_interval_of_a_ratio_of_medians_by_hand():
    """a = [1, 1], b = [2, 4]: a resampled median of a is 1; of b 2, 3 or 4 with probabilities 1/4,
    1/2, 1/4 (the mean of two draws). The 95% interval is [2, 4]; the 40% one (30th to 70th
    percentiles) is [3, 3]. Seeded: the same every time. One seed: no interval."""
    assert speedup_ci([1, 1], [2, 4]) == (2.0, 4.0) == speedup_ci([1, 1], [2, 4])
    assert speedup_ci([1, 1], [2, 4], level=0.4) == (3.0, 3.0)
    assert speedup_ci([1], [2, 4]) is None
    assert speedup_ci([1, 1, 1], [2, 2, math.inf]) == (2.0, math.inf)  # B not reached in 7/27 of resamples
    assert within_noise((0.9, 1.2)) and not within_noise((1.01, 1.2)) and not within_noise(None)


def _hand_sweep(tmp_path):
    """Two settings, three methods, three seeds; an early target 10 and a late target 8.5."""
    methods = ["sync", "async", "adapipe"]
    cells = [{"name": f"p{p}_b4_{m}_s{s}", "setting": f"p{p}_b4", "stages": p, "microbatches": 2, "batch_size": 4,
              "method": m, "seed": s} for p in (2, 4) for m in methods for s in range(3)]
    state = {"name": "hand", "methods": methods, "compare": "adapipe", "curves": None, "cells": cells,
             "definition": {"target": {"rule": "fixed", "ppl": 10.0, "baseline": "sync"},
                            "late_target": {"rule": "sync_best", "baseline": "sync"}},
             "profiles": {}, "targets": {"p2_b4": {"ppl": 10.0}, "p4_b4": {"ppl": 10.0}},
             "late_targets": {"p2_b4": {"ppl": 8.5}, "p4_b4": {"ppl": 8.5}}}
    (tmp_path / "sweep.json").write_text(json.dumps(state))
    for s, t in enumerate((10, 12, 14)):
        _run(tmp_path / f"p2_b4_sync_s{s}", reached(t))
        _run(tmp_path / f"p4_b4_sync_s{s}", reached(20))
    for s, t in enumerate((8, 9)):
        _run(tmp_path / f"p2_b4_async_s{s}", reached(t), async_fraction=1.0)
    _run(tmp_path / "p2_b4_async_s2", unreached(20, 12.5), async_fraction=1.0)
    for s, (t, frac, sw) in enumerate([(6, 0.2, 2), (7, 0.4, 4), (8, 0.3, 3)]):
        _run(tmp_path / f"p2_b4_adapipe_s{s}", reached(t), async_fraction=frac, switches=sw)
    _run(tmp_path / "p4_b4_adapipe_s0", reached(10))
    _run(tmp_path / "p4_b4_adapipe_s1", unreached(30, 11.0))
    _run(tmp_path / "p4_b4_adapipe_s2", unreached(30, 13.0))


def test_report_medians_spreads_speedups_and_unreached_targets(tmp_path):
    """Hand-computed, early target 10 (first eval <= 10: step 10 at time t): p2_b4 sync ttt 10, 12, 14
    -> 12 (10–14); async 8, 9, not reached -> 9 (8–n.r.); adapipe 6, 7, 8 -> 7; speedups 12/7 = 1.71
    and 9/7 = 1.29. Intervals: a resampled median of 3 values is the smallest or the largest with
    probability 7/27 each, so the extreme ratios (10/8 = 1.25, 14/6 = 2.33; 8/8 = 1 and inf, async's
    unreached seed) each have probability >= (7/27)^2 = 0.067 > 0.025: [1.25, 2.33] and [1.00, ∞]
    (within noise). p4_b4: sync 20 x3; adapipe reaches in one seed of three -> n.r., bound
    median(10, 30, 30) = 30 -> <=20/30 = 0.67 [0, 2]; async has no run. Steps: all reached at step 10;
    p4 adapipe's bound median(10, 20, 20) = 20 -> <=0.50. Late target 8.5 (step 20 at t + 5): p2
    sync 15, 17, 19 -> 17, async 13, 14, n.r. -> 14, adapipe 11, 12, 13 -> 12."""
    _hand_sweep(tmp_path)
    paths = write_report(tmp_path)
    assert {p.name for p in paths} == {"results.csv", "results.md", "speedup.png", "ttp.png", "speedup_late.png",
                                       "ttp_late.png", "curves_p4_b4.png"}
    assert all(p.stat().st_size > 0 for p in paths)
    md = (tmp_path / "results.md").read_text()
    early, late = md.split("## Early target")[1].split("## Late target")
    assert ("| 2 | 4 (2) | 10 | 12 (10–14) | 9 (8–n.r.) | 7 (6–8) | 1.71x [1.25, 2.33] | 1.29x [1.00, ∞] | 30% | 3 |"
            in early), md
    assert "| 4 | 4 (2) | 10 | 20 (20–20) | no run | n.r. (best 11) | <=0.67x [0.00, 2.00] | – |" in early, md
    assert "| 2 | 4 (2) | 10 (10–10) | 10 (10–n.r.) | 10 (10–10) | 1.00x [1.00, 1.00] | 1.00x [1.00, ∞] |" in early
    assert "| 4 | 4 (2) | 10 (10–10) | no run | n.r. (best 11) | <=0.50x [0.00, 1.00] | – |" in early
    assert "Within noise in time to the early target (the interval includes 1): p2_b4 adapipe vs async, " \
           "p4_b4 adapipe vs sync." in early
    assert "| 2 | 4 (2) | 8.5 | 17 (15–19) | 14 (13–n.r.) | 12 (11–13) | 1.42x" in late, md
    assert "`p2_b4_async_s2`: best val ppl 12.5 > target 10" in md and "`p4_b4_async_s0`: missing" in md
    assert "Runs that did not reach the late target" in md and "best validation perplexity sync" in md
    assert "pipeline clock" in md
    assert "In brackets the 95% bootstrap interval over seeds" in md and "10000 times" in md and "{" not in md
    with open(tmp_path / "results.csv") as f:
        rows = {r["cell"]: r for r in csv.DictReader(f)}
    assert len(rows) == 18
    assert float(rows["p2_b4_sync_s1"]["time_to_target_s"]) == 12 and rows["p2_b4_async_s2"]["reached"] == "False"
    assert float(rows["p2_b4_sync_s1"]["late_time_to_target_s"]) == 17 and rows["p2_b4_sync_s1"]["late_step_to_target"] == "20"
    assert rows["p4_b4_async_s0"]["status"] == "missing"


def test_targets_early_at_a_fraction_of_a_budget_and_late_at_the_best():
    from omegaconf import OmegaConf

    evals = [{"step": s, "val_ppl": 100.0 / (1 + s), "time_s": 0.5 * s} for s in range(0, 101, 10)]
    slower = [dict(r, val_ppl=r["val_ppl"] * 2) for r in evals]
    runs = {"a": (evals, 100), "b": (slower, 100), "c": (slower, 100)}
    early = derive(OmegaConf.create({"rule": "sync_fraction", "fraction": 0.75, "budget": 40, "baseline": "sync"}), runs)
    assert early["ppl"] == pytest.approx(200 / 31) and early["budget"] == 40  # step 30 = 3/4 of 40, not of 100
    late = derive(OmegaConf.create({"rule": "sync_best", "baseline": "sync"}), runs)
    assert late["ppl"] == pytest.approx(200 / 101) and late["from"]["a"] == pytest.approx(100 / 101)


@pytest.mark.slow
def test_ctrl_c_stops_a_parallel_sweep_in_one_line(tmp_path):
    """Ctrl-C (SIGINT to the whole process group) while two cells run in worker processes: exit 130,
    one line saying how to resume, no traceback, no process left behind."""
    import signal
    import time

    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    exe = os.path.join(os.path.dirname(sys.executable), "adapipe")
    p = subprocess.Popen([exe, "sweep", "sweep=smoke", "sweep.jobs=2", f"sweep.dir={tmp_path / 'sw'}"],
                         stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env, cwd=tmp_path,
                         start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = []
    for line in p.stderr:  # until both workers run a cell
        seen.append(line)
        if sum("] start " in x for x in seen) == 2:
            break
    os.killpg(p.pid, signal.SIGINT)
    err = "".join(seen) + p.stderr.read()
    assert p.wait(timeout=120) == 130, err
    assert "interrupted; rerun the same command to resume" in err and "Traceback" not in err, err
    with pytest.raises(ProcessLookupError):  # the workers are gone too (within 10 s)
        for _ in range(50):
            os.killpg(p.pid, 0)
            time.sleep(0.2)


@pytest.mark.slow
def test_sigterm_to_the_sweep_alone_stops_its_cells(tmp_path):
    """kill PID (SIGTERM to the sweep process only, as a job scheduler sends it) while two cells run
    in worker processes: the workers' cells stop as terminated runs, the sweep exits 143 with one
    line, and no process is left."""
    import signal
    import time

    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    exe = os.path.join(os.path.dirname(sys.executable), "adapipe")
    p = subprocess.Popen([exe, "sweep", "sweep=smoke", "sweep.jobs=2", f"sweep.dir={tmp_path / 'sw'}"],
                         stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env, cwd=tmp_path,
                         start_new_session=True)
    seen = []
    for line in p.stderr:
        seen.append(line)
        if sum("] start " in x for x in seen) == 2:
            break
    time.sleep(2)  # the cells are training
    p.send_signal(signal.SIGTERM)
    err = "".join(seen) + p.stderr.read()
    assert p.wait(timeout=120) == 143, err
    assert "terminated; rerun the same command to resume" in err and "Traceback" not in err, err
    with pytest.raises(ProcessLookupError):  # nothing of the sweep's process group is left (within 5 s)
        for _ in range(25):
            os.killpg(p.pid, 0)
            time.sleep(0.2)


@pytest.mark.slow
def test_smoke_sweep_end_to_end(tmp_path):
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    exe = os.path.join(os.path.dirname(sys.executable), "adapipe")
    r = subprocess.run([exe, "sweep", "sweep=smoke", f"sweep.dir={tmp_path / 'smoke'}"], capture_output=True, text=True,
                       env=env, cwd=tmp_path, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "smoke"
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 12 and list(rows[0]) == COLUMNS and {r["status"] for r in rows} == {"done"}
    for name in ("results.md", "speedup.png", "ttp.png", "curves_p4_b2.png"):
        assert (out / name).is_file(), name
    assert "No interval, so not known to be outside the noise (fewer than two seeds done): p2_b2" in \
        (out / "results.md").read_text()  # one seed: no bootstrap interval, and the report says so


def test_a_grid_may_add_methods_to_a_sweep_directory_but_not_change_them():
    from adapipe_cli.sweep.state import extends

    old = {"fixed": ["model=gpt-nano"], "methods": {"sync": ["schedule=1f1b"]}, "microbatch_size": 4}
    added = {**old, "methods": {"sync": ["schedule=1f1b"], "gain": ["heuristic=gain"]}}
    assert extends(old, old) and extends(added, old)
    assert not extends({**old, "methods": {"sync": ["schedule=gpipe"]}}, old)  # a method changed
    assert not extends({**old, "methods": {"gain": ["heuristic=gain"]}}, old)  # one left out
    assert not extends({**added, "microbatch_size": 8}, old)


def test_async_spans_are_the_clock_times_of_the_async_stretches(tmp_path):
    from adapipe_cli.sweep.target import async_spans

    phases = ["sync", "sync", "async", "async", "sync", "async"]
    (tmp_path / "metrics.jsonl").write_text("\n".join(
        [json.dumps({"kind": "eval", "step": 0, "val_ppl": 9.0, "time_s": 0.0})]
        + [json.dumps({"kind": "step", "step": i, "phase": ph, "time_s": float(i + 1)}) for i, ph in enumerate(phases)]))
    # step i runs from time i to i + 1: async over [2, 4] and [5, 6]
    assert async_spans(tmp_path) == [(2.0, 4.0), (5.0, 6.0)]
    assert async_spans(tmp_path / "missing") == []


def test_setting_curves_shade_a_switching_methods_async_stretches(tmp_path):
    from adapipe_cli.sweep import plots

    recs = [{"time_s": float(t), "val_ppl": 100.0 / (1 + t)} for t in range(10)]
    path = tmp_path / "curves.png"
    plots.plot_setting_curves({"sync": [(0, recs)], "adapipe+predict": [(0, recs)]}, [20.0, 12.0], "pipeline-profiled",
                              "t", path, phases={"adapipe+predict": (0, [(1.0, 3.0), (5.0, 9.0)])})
    assert path.stat().st_size > 0


def test_a_sweep_without_an_added_method_saving_last_keeps_it(tmp_path):
    """Two sweeps into one directory, the second with a method the first lacks: whichever saves
    last, sweep.json keeps both grids' methods (the report reads them from there)."""
    from adapipe_cli.sweep.state import SweepState

    d = f"sweep.dir={tmp_path / 'sw'}"
    first = SweepState(load_grid([*TINY_GRID, d]))
    SweepState(load_grid([*TINY_GRID, d, "+sweep.methods.extra=['schedule=gpipe']"]))
    first.save()
    saved = json.loads((tmp_path / "sw" / "sweep.json").read_text())
    assert "extra" in saved["methods"] and "extra" in saved["definition"]["methods"]
    assert set(load_grid([*TINY_GRID, d]).methods) <= set(saved["methods"])


def _markdown(d):
    """results.md's text for sweep directory ``d``, without the plots."""
    from adapipe_cli.sweep.markdown import render
    from adapipe_cli.sweep.report import load_state
    from adapipe_cli.sweep.results import collect, table, targets_of

    state = load_state(d)
    rows = collect(d, state)
    return render(state, rows, {w: table(rows, state["methods"], w) for w in targets_of(rows)})


def test_report_against_the_best_fixed_method(tmp_path):
    """The hand sweep: p2_b4 async is the best fixed method at both targets (early 9 against sync's
    12: adapipe 7/9 = 0.78; late 14 against 17: 12/14 = 0.86): no crossing, goal 1.02, met.
    p4_b4: async has no run, sync 20; adapipe's median is not reached, so its ratio is at least
    median(10, 30, 30) / 20 = 1.50: missed. A crossing sweep (sync best early at 10 against async's
    14, async best late at 20 against sync's 30): goal 0.95; adapipe 11/10 = 1.10 missed early,
    18/20 = 0.90 met late. Its p4_b4: no fixed method reaches the early target (sync ran 10 s, the
    best), adapipe does at 15: the ratio is at most 15/10 = 1.5, a bound above the goal: unknown."""
    (tmp_path / "a").mkdir()
    _hand_sweep(tmp_path / "a")
    md = _markdown(tmp_path / "a").split("## Against the best fixed method")[1]
    assert "| 2 | 4 | early | async 9 (8–n.r.) | 0.78 [" in md and "adapipe: met (<= 1.02) |" in md, md
    assert "| 2 | 4 | late | async 14 (13–n.r.) | 0.86 [" in md, md
    assert "| 4 | 4 | early | sync 20 (20–20) | >=1.50 [" in md and "adapipe: missed (> 1.02) |" in md, md

    d = tmp_path / "b"
    methods = ["sync", "async", "adapipe"]
    cells = [{"name": f"p{p}_b4_{m}_s{s}", "setting": f"p{p}_b4", "stages": p, "microbatches": 2, "batch_size": 4,
              "method": m, "seed": s} for p in (2, 4) for m in methods for s in range(3)]
    state = {"name": "cross", "methods": methods, "compare": "adapipe", "curves": None, "cells": cells,
             "definition": {"target": {"rule": "fixed", "ppl": 10.0, "baseline": "sync"},
                            "late_target": {"rule": "sync_best", "baseline": "sync"},
                            "methods": {"sync": ["schedule=1f1b"], "async": ["schedule=pipedream"],
                                        "adapipe": ["schedule=adapipe"]}},
             "profiles": {}, "targets": {"p2_b4": {"ppl": 10.0}, "p4_b4": {"ppl": 10.0}},
             "late_targets": {"p2_b4": {"ppl": 8.5}, "p4_b4": {"ppl": 8.5}}}
    d.mkdir()
    (d / "sweep.json").write_text(json.dumps(state))
    for m, (early, late), frac in (("sync", (10, 30), 0.0), ("async", (14, 20), 1.0), ("adapipe", (11, 18), 0.6)):
        for s in range(3):
            _run(d / f"p2_b4_{m}_s{s}", [(0, 100.0, 0.0), (10, 9.0, early), (20, 8.0, late)], async_fraction=frac)
    for s in range(3):
        _run(d / f"p4_b4_sync_s{s}", unreached(10, 12.0))
        _run(d / f"p4_b4_async_s{s}", unreached(12, 12.0), async_fraction=1.0)
        _run(d / f"p4_b4_adapipe_s{s}", [(0, 100.0, 0.0), (10, 9.0, 15), (20, 8.0, 25)], async_fraction=0.5)
    md = _markdown(d).split("## Against the best fixed method")[1]
    assert "| 2 | 4 | early (crossing) | sync 10 (10–10) | 1.10 [1.10, 1.10] | adapipe: missed (> 0.95) |" in md, md
    assert "| 2 | 4 | late (crossing) | async 20 (20–20) | 0.90 [0.90, 0.90] | adapipe: met (<= 0.95) |" in md, md
    assert "| 4 | 4 | early | sync n.r. (best 12) | <=1.50 [" in md and "adapipe: unknown (a bound, goal 1.02) |" in md, md


def test_shared_data_resolves_in_a_train_override(monkeypatch, tmp_path):
    """The grids' ``${adapipe.shared_data:NAME}`` also works typed into ``adapipe train`` (it was a
    Hydra traceback there: the resolver existed only while a grid was composed)."""
    from omegaconf import OmegaConf
    from adapipe_cli.cli.compose import compose_config
    monkeypatch.setenv("ADAPIPE_SHARED_DATA", str(tmp_path))
    OmegaConf.clear_resolver("adapipe.shared_data")  # as in a fresh `adapipe train`, where no grid was composed
    cfg = compose_config(["data=tinyshakespeare", "data.path=${adapipe.shared_data:tinyshakespeare}"])
    assert cfg.data.path == str(tmp_path / "tinyshakespeare")


def test_ttt_plot_bars_span_the_reached_seeds_and_count_the_unreached(tmp_path, monkeypatch):
    """A seed that did not reach the target has no finite time: the min-max bar spans the seeds that
    did, and an arrow above it counts the others (before, the bar stopped at the median)."""
    import matplotlib.axes

    from adapipe_cli.sweep.plots import plot_ttt, whiskers
    from adapipe_cli.sweep.results import MethodStats, Spread

    assert whiskers([2.0, 3.0, math.inf]) == (2.0, 3.0, 1)
    assert whiskers([1.0, 4.0, 2.0]) == (1.0, 4.0, 0)
    stat = lambda times: MethodStats(len(times), len(times), sum(map(math.isfinite, times)), Spread(times, 0.0), Spread(times, 0.0),  # noqa: E731
                                     1.0, 0.0, 0.0)
    stats = {(4, 8): {"sync": stat([4.0, 4.0, 4.0, 4.0]), "adapipe": stat([2.0, 3.0, 5.0, math.inf])}}
    notes, bars = [], []
    real_annotate, real_bar = matplotlib.axes.Axes.annotate, matplotlib.axes.Axes.bar
    monkeypatch.setattr(matplotlib.axes.Axes, "annotate", lambda ax, text, *a, **k: notes.append(text) or real_annotate(ax, text, *a, **k))
    monkeypatch.setattr(matplotlib.axes.Axes, "bar", lambda ax, x, h, *a, **k: bars.append((h, k.get("yerr"))) or real_bar(ax, x, h, *a, **k))
    plot_ttt(stats, ["sync", "adapipe"], "sync", "pipeline-profiled", tmp_path / "ttt.png")
    assert (tmp_path / "ttt.png").is_file() and notes == ["+1 n.r."]
    h, err = bars[1]  # adapipe: median 4 s of sync's 4 s, whiskers down to 2 s and up to 5 s (the reached seeds)
    assert h == pytest.approx(1.0) and err[0][0] == pytest.approx(0.5) and err[1][0] == pytest.approx(0.25)
