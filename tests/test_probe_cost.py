"""scripts/probe_cost.py: a probe's cost on the clock, against a hand-made run."""

from __future__ import annotations

import json

import pytest

from _scripts import load_script

pc = load_script("probe_cost")


def write_run(path, phases_and_steps):
    """A metrics.jsonl of step records: (phase, seconds the step took) each, an eval between."""
    path.mkdir()
    t, lines = 0.0, [json.dumps({"kind": "eval", "step": 0, "time_s": 0.0})]
    for i, (phase, dt) in enumerate(phases_and_steps):
        t += dt
        lines.append(json.dumps({"kind": "step", "step": i, "phase": phase, "time_s": t}))
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_a_probe_costs_its_steps_over_async_pace(tmp_path):
    # 10 async steps of 1 s, a drain step of 3 s, 4 sync steps of 2.5 s, a fill of 2 s, 5 async steps
    run = tmp_path / "run"
    write_run(run, [("async", 1.0)] * 10 + [("sync", 3.0)] + [("sync", 2.5)] * 4 + [("async", 2.0)]
              + [("async", 1.0)] * 5)
    c = pc.probe_cost(run)
    # the steps after an async step that are not async: the drain and the 4 sync steps; then the fill
    assert c["async_step_s"] == pytest.approx(1.0)
    assert c["sync_steps"] == 5
    assert c["extra_s"] == pytest.approx((3.0 - 1) + 4 * (2.5 - 1) + (2.0 - 1))
    assert c["time_s"] == pytest.approx(10 + 3 + 10 + 2 + 5)
    # up to a time: only the steps that ended by then
    assert pc.probe_cost(run, until=14.0)["extra_s"] == pytest.approx(2.0)
    # a sync step worth 1/E = 2 async steps: each of the 5 sync-phase steps is charged 2 s less
    # than its time (the fill, an async step, as before)
    assert pc.probe_cost(run, efficiency=0.5)["extra_s"] == pytest.approx((3.0 - 2) + 4 * (2.5 - 2) + (2.0 - 1))
    with pytest.raises(SystemExit, match="in \\(0, 1\\]"):
        pc.probe_cost(run, efficiency=1.5)


def test_a_run_without_async_pace_is_refused(tmp_path):
    run = tmp_path / "sync"
    write_run(run, [("sync", 1.0)] * 5)
    with pytest.raises(SystemExit, match="no two async steps"):
        pc.probe_cost(run)
    with pytest.raises(SystemExit, match="no metrics.jsonl here"):
        pc.probe_cost(tmp_path / "elsewhere")


def test_perplexity_against_the_async_run_at_the_same_steps(tmp_path):
    for name, ppls in (("a", {0: 100.0, 10: 50.0, 20: 40.0}), ("b", {0: 100.0, 10: 40.0, 30: 30.0})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(
            json.dumps({"kind": "eval", "step": t, "val_ppl": v}) + "\n" for t, v in ppls.items()))
    assert pc.perplexity_ratio(tmp_path / "a", tmp_path / "b") == [(0, 1.0), (10, 1.25)]
