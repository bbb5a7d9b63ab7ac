"""scripts/calibrate_prior.py's errors of the prior efficiency, on hand-made results."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from _scripts import load_script


def load():
    return load_script("calibrate_prior")


def test_the_errors_are_efficiency_over_the_prior_in_logit_units(tmp_path, monkeypatch):
    cal = load()
    # R and E_d of each cell, as the run's set-up would give them
    context = {("synthetic", "adamw", 4, 8): (1.25, 0.8), ("synthetic", "adamw", 8, 1): (4.0, 0.25)}
    monkeypatch.setattr(cal, "cell_context", lambda cell, profile: context[cell])
    monkeypatch.setattr(cal, "profile_of", lambda name, cell, results, profiles: Path("unused"))

    def row(cell, method, ttt):
        p, m = (4, 8) if cell.endswith("m8") else (8, 1)
        return {"cell": cell, "data": "synthetic", "optim": "adamw", "stages": p, "microbatches": m,
                "method": method, "ttt_median": ttt}

    rows = [
        row("synthetic_adamw_p4_m8", "sync-zb", 12.0),
        row("synthetic_adamw_p4_m8", "pipedream+predict", 10.0),
        row("synthetic_adamw_p8_m1", "sync-zb", 4.0),
        row("synthetic_adamw_p8_m1", "pipedream+predict", None),  # never reached
        row("synthetic_adamw_p8_m1", "adapipe-gain+predict", 4.0),
    ]
    f = tmp_path / "results.json"
    f.write_text(json.dumps(rows))
    out = cal.errors([f], tmp_path)
    short, long = out
    # G = 12 / 10, E = G / R = 0.96; z = (0.96 - 0.8) / (0.8 x 0.2) = 1.0; relative 0.2
    assert short["G"] == pytest.approx(1.2) and short["E"] == pytest.approx(0.96)
    assert short["z"] == pytest.approx(1.0) and short["relative"] == pytest.approx(0.2) and short["d"] == 3 / 8
    # async never reached the target: E = 0, z = -0.25 / (0.25 x 0.75)
    assert long["E"] == 0.0 and long["z"] == pytest.approx(-1 / 0.75) and long["relative"] == pytest.approx(-1.0)
    text = cal.report(out)
    rms_all = math.sqrt((1.0 + (1 / 0.75) ** 2) / 2)
    assert f"| all | 2 | {math.sqrt((0.04 + 1.0) / 2):.2f} | {rms_all:.2f} |" in text
    assert "| d < 1 | 1 | 0.20 | 1.00 |" in text
    assert "| all, async reached | 1 | 0.20 | 1.00 |" in text  # the bound left out
