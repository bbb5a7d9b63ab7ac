"""scripts/calibrate_drift.py's drift of async's efficiency, on hand-made validation curves."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load():
    sys.path.insert(0, str(SCRIPTS))  # (it imports calibrate_prior beside it)
    try:
        spec = importlib.util.spec_from_file_location("calibrate_drift", SCRIPTS / "calibrate_drift.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(SCRIPTS))


def write_run(folder: Path, loss_at) -> None:
    """A run folder whose evaluations every 2 steps from 0 to 400 have loss ``loss_at(step)``."""
    folder.mkdir(parents=True)
    rows = [{"kind": "eval", "step": s, "val_loss": loss_at(s)} for s in range(0, 401, 2)]
    (folder / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def sync_loss(step: float) -> float:
    return 1.0 + 4.0 / math.sqrt(1.0 + step)  # falls all the way, flattening


def test_a_constant_efficiency_has_no_drift_and_a_rising_one_has_its_slope(tmp_path, monkeypatch):
    cal = load()
    monkeypatch.setattr(cal, "cell_context", lambda cell, profile: (2.0, 0.8))  # R, E_d: k d = 0.25
    # cell 1: async makes 0.5 of sync's progress per step all along: its curve is sync's at step t / 2
    c1 = tmp_path / "bench" / "synthetic_adamw_p4_m8"
    write_run(c1 / "sync-zb_s0", sync_loss)
    write_run(c1 / "pipedream+predict_s0", lambda s: sync_loss(0.5 * s))
    # cell 2: async's efficiency rises with log2 of the step, E(t) = 0.2 log2(t) - 0.6 (0.6 at step 8 ... ):
    # its curve is sync's at the step tau(t) with d tau / dt = E(t), tau from step 1
    c2 = tmp_path / "bench" / "synthetic_adamw_p8_m1"
    write_run(c2 / "sync-zb_s0", sync_loss)
    tau, taus = 0.0, {0: 0.0}
    for t in range(1, 401):
        tau += max(0.05, 0.2 * math.log2(t) - 0.6)
        taus[t] = tau
    write_run(c2 / "pipedream+predict_s0", lambda s: sync_loss(taus[s]))
    (c1 / "profile.json").write_text("{}")
    (c2 / "profile.json").write_text("{}")
    # a cell without a profile is not a cell; a seed without its async run is left out and said so
    write_run(c1 / "sync-zb_s1", sync_loss)
    rows, left_out = cal.measure([tmp_path / "bench"], bands=4)
    assert left_out == ["bench/synthetic_adamw_p4_m8 seed 1: a run is missing"]
    flat = next(r for r in rows if r["cell"] == "synthetic_adamw_p4_m8")
    assert flat["E"] == pytest.approx([0.5] * 4, abs=0.02) and abs(flat["slope"]) < 0.01
    # relative to max(mean E, 1/R) = 0.5 (both), over k d = 0.25
    assert flat["kd"] == pytest.approx(0.25) and flat["implied"] == pytest.approx(abs(flat["slope"]) / 0.5 / 0.25, rel=0.01)
    rising = next(r for r in rows if r["cell"] == "synthetic_adamw_p8_m1")
    # E_j measured between levels is E at about sync's step in the band mapped to async's step: it rises
    # by 0.2 per doubling of async's step; sync's step grows faster than async's here, so per doubling
    # of sync's step a little less
    assert all(b > a for a, b in zip(rising["E"], rising["E"][1:]))
    assert 0.1 < rising["slope"] < 0.2


def test_no_usable_folder_is_one_line_and_exit_2(tmp_path, capsys):
    cal = load()
    assert cal.main([str(tmp_path / "nowhere"), "--out", str(tmp_path / "out")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert cal.main([str(tmp_path / "empty"), "--out", str(tmp_path / "out")]) == 2
    assert "no cell" in capsys.readouterr().err and not (tmp_path / "out").exists()
