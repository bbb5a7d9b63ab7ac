"""scripts/calibrate_drift.py's drift of async's efficiency, on hand-made validation curves."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from _scripts import load_script


def load():
    return load_script("calibrate_drift")


def write_run(folder: Path, loss_at) -> None:
    """A run folder whose evaluations every 2 steps from 0 to 400 have loss ``loss_at(step)``."""
    folder.mkdir(parents=True)
    rows = [{"kind": "eval", "step": s, "val_loss": loss_at(s)} for s in range(0, 401, 2)]
    (folder / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def sync_loss(step: float) -> float:
    return 1.0 + 4.0 / math.sqrt(1.0 + step)  # falls all the way, flattening


def test_a_constant_efficiency_has_no_drift_and_a_rising_one_has_its_slope(tmp_path, monkeypatch):
    cal = load()
    # R and E_d of each cell: k d = 1 / E_d - 1
    context = {("synthetic", "adamw", 4, 8): (4.0, 0.8), ("synthetic", "adamw", 8, 1): (1.25, 0.5),
               ("synthetic", "adamw", 1, 1): (1.0, 1.0), ("synthetic", "adamw", 4, 1): (4.0, 0.5)}
    monkeypatch.setattr(cal, "cell_context", lambda cell, profile: context[cell])
    bench = tmp_path / "bench"
    # cell 1: async makes 0.5 of sync's progress per step all along: its curve is sync's at step t / 2
    c1 = bench / "synthetic_adamw_p4_m8"
    write_run(c1 / "sync-zb_s0", sync_loss)
    write_run(c1 / "pipedream+predict_s0", lambda s: sync_loss(0.5 * s))
    # cell 2: async's efficiency rises with log2 of the step, E(t) = 0.2 log2(t) - 0.6 (0.6 at step 8,
    # 1.0 at 32, 1.4 at 128): its curve is sync's at the step tau(t), d tau / dt = E(t)
    c2 = bench / "synthetic_adamw_p8_m1"
    write_run(c2 / "sync-zb_s0", sync_loss)
    tau, taus = 0.0, {0: 0.0}
    for t in range(1, 401):
        tau += max(0.05, 0.2 * math.log2(t) - 0.6)
        taus[t] = tau
    write_run(c2 / "pipedream+predict_s0", lambda s: sync_loss(taus[s]))
    # cell 3: falling as fast, E(t) = 1.6 - 0.2 log2(t) (1.0 at step 8, 0.6 at 32)
    c3 = bench / "synthetic_adamw_p4_m1"
    write_run(c3 / "sync-zb_s0", sync_loss)
    tau, taus3 = 0.0, {0: 0.0}
    for t in range(1, 401):
        tau += max(0.05, 1.6 - 0.2 * math.log2(t))
        taus3[t] = tau
    write_run(c3 / "pipedream+predict_s0", lambda s: sync_loss(taus3[s]))
    # left out, each said so: a seed without its async run, a cell without delay, a folder not named as a cell
    write_run(c1 / "sync-zb_s1", sync_loss)
    for cell in (c1, c2, c3, bench / "synthetic_adamw_p1_m1", bench / "notes"):
        cell.mkdir(exist_ok=True)
        (cell / "profile.json").write_text("{}")
    rows, left_out = cal.measure([bench], bands=4)
    assert left_out == ["bench/notes: not a bench cell's name (DATA_OPTIM_pP_mM)",
                        "bench/synthetic_adamw_p1_m1: no delay (k d = 0)",
                        "bench/synthetic_adamw_p4_m8 seed 1: a run is missing"]
    flat = next(r for r in rows if r["cell"] == "synthetic_adamw_p4_m8")
    assert flat["E"] == pytest.approx([0.5] * 4, abs=0.02) and abs(flat["slope"]) < 0.01
    # relative to max(mean E, 1/R) = mean E (1/R = 0.25), over k d = 0.25
    assert flat["kd"] == pytest.approx(0.25)
    assert flat["implied"] == pytest.approx(abs(flat["slope"]) / (sum(flat["E"]) / 4) / 0.25, rel=0.01)
    rising = next(r for r in rows if r["cell"] == "synthetic_adamw_p8_m1")
    # E_j measured between levels rises by 0.2 per doubling of async's step; sync's step grows faster
    # than async's where E < 1 and slower where E > 1, so per doubling of sync's step somewhat less
    assert all(b > a for a, b in zip(rising["E"], rising["E"][1:]))
    assert 0.1 < rising["slope"] < 0.2
    # relative to max(mean E, 1/R) = 1/R = 0.8 here (mean E below it), over k d = 1
    assert sum(rising["E"]) / 4 < 0.8 and rising["kd"] == pytest.approx(1.0)
    assert rising["implied"] == pytest.approx(rising["slope"] / 0.8)
    # the trend is the drift with its sign: up where E rises, down where it falls
    assert rising["implied_trend"] > 0 and rising["implied_trend"] == pytest.approx(rising["implied"])
    falling = next(r for r in rows if r["cell"] == "synthetic_adamw_p4_m1")
    assert all(b < a for a, b in zip(falling["E"], falling["E"][1:])) and falling["slope"] < -0.05
    assert falling["implied_trend"] < 0 and falling["implied_trend"] == pytest.approx(-falling["implied"])


def test_no_usable_folder_is_one_line_and_exit_2(tmp_path, capsys):
    cal = load()
    assert cal.main([str(tmp_path / "nowhere"), "--out", str(tmp_path / "out")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert cal.main([str(tmp_path / "empty"), "--out", str(tmp_path / "out")]) == 2
    assert "no cell" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_a_sweep_directory_is_read_per_setting_with_sync_against_pipedream(tmp_path, monkeypatch):
    """An ``adapipe sweep`` directory: each setting a cell, ``sync``'s curve (else sync-zb's) against
    pipedream+predict's, R and E_d from the grid's AdaPipe method set up on the setting's overrides."""
    cal = load()
    seen = []
    monkeypatch.setattr(cal, "run_context", lambda overrides: seen.append(overrides) or (4.0, 0.5))
    sweep = tmp_path / "grid"
    cells = [{"name": f"p8_b4_{m}_s{s}", "setting": "p8_b4", "stages": 8, "microbatches": 1, "batch_size": 4,
              "method": m, "seed": s} for m in ("sync", "sync-zb", "pipedream+predict") for s in (3, 4)]
    cells.append({"name": "p4_b4_sync_s3", "setting": "p4_b4", "stages": 4, "microbatches": 1, "batch_size": 4,
                  "method": "sync", "seed": 3})  # (no async run at depth 4: not a cell)
    definition = {"fixed": ["model=gpt-micro", "train.max_steps=1500"],
                  "methods": {"sync": ["schedule=1f1b"], "sync-zb": ["schedule=zbh1", "train.stop_at_target=true"],
                              "pipedream+predict": ["schedule=pipedream"],
                              "adapipe-gain+predict": ["schedule=adapipe", "heuristic=gain", "train.stop_at_target=true"]}}
    sweep.mkdir()
    (sweep / "sweep.json").write_text(json.dumps({"name": "cpu-adamw", "definition": definition, "cells": cells,
                                                  "profiles": {"p8": "/profiles/p8_mb4.json"}}))
    for s in (3, 4):
        write_run(sweep / f"p8_b4_sync_s{s}", sync_loss)
        write_run(sweep / f"p8_b4_sync-zb_s{s}", lambda t: sync_loss(2.0 * t))  # (not read: sync is there)
        write_run(sweep / f"p8_b4_pipedream+predict_s{s}", lambda t: sync_loss(0.5 * t))
    rows, left_out = cal.measure([sweep], bands=4)
    assert [(r["cell"], r["seed"]) for r in rows] == [("cpu-adamw_p8_b4", 3), ("cpu-adamw_p8_b4", 4)]
    assert left_out == ["grid/cpu-adamw_p4_b4: no seed with both sync and pipedream+predict"]
    assert all(r["E"] == pytest.approx([0.5] * 4, abs=0.02) and r["kd"] == pytest.approx(1.0) for r in rows)
    assert seen == [["model=gpt-micro", "train.max_steps=1500", "schedule=adapipe", "heuristic=gain", "pipeline.stages=8",
                     "pipeline.microbatches=1", "train.batch_size=4", "pipeline.profile=/profiles/p8_mb4.json",
                     "train.stop_at_target=false"]]
