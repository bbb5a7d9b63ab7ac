"""summary.json's action_times: a worker's counters over its window, against the profile's charge."""

from __future__ import annotations

import itertools

import pytest

from adapipe_cli.runtime.action_times import ActionTimes, action_table, in_run_profile, warm_steps
from adapipe_cli.simulator.clock import CostProfile


def test_warm_steps_leave_out_five_or_a_quarter():
    assert [warm_steps(n) for n in (0, 3, 4, 12, 20, 100)] == [0, 0, 1, 3, 5, 5]


def test_the_table_is_the_window_between_the_first_kept_report_and_the_last(monkeypatch):
    from adapipe_cli.runtime import action_times

    walls = itertools.count(0.0, 10.0)  # (the snapshots' wall clock: 10 s a step)
    monkeypatch.setattr(action_times.time, "perf_counter", lambda: next(walls))
    times = ActionTimes()
    waits = {"wait_peer": 0.0, "wait_driver": 0.0, "eval": 0.0, "save": 0.0, "signal": 0.0}
    times.add(1, "F", 9.0, 9.0, {})  # before the window: left out
    times.mark(0, 2, waits)  # step 0 < warm - 1: not the start
    times.mark(1, 2, waits)  # the window starts after U(1)
    for step in (2, 3):
        times.add(1, "F", 0.5, 0.4, {"copy": 1})
        times.add(1, "F", 0.7, 0.6, {})
        times.add(1, "B", 1.2, 1.0, {"accumulate": 1})
        times.add(1, "E", 5.0, 5.0, {})  # evaluations are not on the clock: not counted
        times.clocks["execute"] += 2.5
        times.mark(step, 2, {**waits, "wait_peer": 0.25 * step, "signal": 0.125 * step})
    w = times.window()
    assert w["steps"] == 2 and set(w["acts"]) == {"1/F", "1/B"}
    assert w["acts"]["1/F"] == pytest.approx([4, 2.4, 2.0, 2, 0, 0, 0, 0, 0, 2 * (0.25 + 0.49)])
    assert w["acts"]["1/B"] == pytest.approx([2, 2.4, 2.0, 0, 0, 0, 2, 0, 0, 2 * 1.44])
    assert w["clocks"]["execute"] == pytest.approx(2.5) and w["clocks"]["wait_peer"] == pytest.approx(0.75 / 2)
    prof = CostProfile([1.0, 0.3], [2.0, 0.8], [0.1, 0.2], copy=[0.0, 0.05], accumulate=[0.0, 0.02])
    table = action_table([None, w], prof)
    f, b = table["actions"]
    assert (f["rank"], f["stage"], f["kind"], f["count"]) == (1, 1, "F", 4)
    assert f["run_s"] == pytest.approx(0.6) and f["cpu_s"] == pytest.approx(0.5)
    assert f["run_sd_s"] == pytest.approx(0.1)  # 0.5 and 0.7 twice each, about 0.6
    assert b["run_sd_s"] == pytest.approx(0.0, abs=1e-6)  # every backward 1.2
    assert f["profiled_s"] == pytest.approx(0.3 + 0.05 / 2) and f["copy"] == 0.5  # half the forwards copied
    assert f["ratio"] == pytest.approx(0.6 / 0.325)
    assert b["kind"] == "B" and b["profiled_s"] == pytest.approx(0.8 + 0.02) and b["accumulate"] == 1
    (r,) = table["ranks"]
    assert r["rank"] == 1 and r["steps"] == 2 and r["wait_peer_s"] == pytest.approx(0.375)
    assert r["signal_s"] == pytest.approx(0.375 / 2)  # the held-out signal's seconds per step, out of between_s:
    assert r["between_s"] == pytest.approx(10.0 - 2.5 - 0.375 / 2)  # wall - execute - signal (the rest 0)


def test_no_window_no_table():
    times = ActionTimes()
    assert times.window() is None and action_table([None, None], None) is None
    times.mark(4, 2, {"wait_peer": 0.0, "wait_driver": 0.0, "eval": 0.0, "save": 0.0, "signal": 0.0})
    assert times.window() is None  # one report: no step between


def test_in_run_profile_charges_each_stage_and_kind_what_the_run_took():
    prof = CostProfile([1.0, 0.5], [2.0, 1.0], [0.1, 0.2], copy=[0.01, 0.02], accumulate=[0.03, 0.04],
                       data=[0.5, 0.0], input=[1.2, 0.6], weight=[1.0, 0.5])
    # profiled_s as action_table writes it: the kind's cost plus the extra work per action
    table = {"actions": [
        # stage 0: forwards at 2x with a batch made at one in four, backwards at 1x with accumulations
        {"rank": 0, "stage": 0, "kind": "F", "count": 4, "run_s": 2.25, "profiled_s": 1.125, "data": 0.25},
        {"rank": 0, "stage": 0, "kind": "B", "count": 4, "run_s": 2.0225, "profiled_s": 2.0225, "accumulate": 0.75},
        # stage 1 on two ranks (replicas), backwards recomputing their forward (weights=latest) and copying
        {"rank": 1, "stage": 1, "kind": "B", "count": 10, "run_s": 2.4, "profiled_s": 1.52, "recompute": 1, "copy": 1},
        {"rank": 2, "stage": 1, "kind": "B", "count": 30, "run_s": 1.6, "profiled_s": 1.52, "recompute": 1, "copy": 1},
        {"rank": 1, "stage": 1, "kind": "F", "count": 40, "run_s": 0.6, "profiled_s": 0.5},
        {"rank": 1, "stage": 1, "kind": "U", "count": 1, "run_s": 0.9, "profiled_s": 0.0},  # charged nothing, took 0.9
    ], "ranks": []}
    got = in_run_profile(table, prof)
    for s in (0, 1):
        for kind in ("F", "B", "U"):
            rows = [r for r in table["actions"] if r["stage"] == s and r["kind"] == kind]
            work = lambda r: {k: r.get(k, 0) for k in ("copy", "predict", "recompute", "accumulate", "data")}  # noqa: E731
            charged = sum(r["count"] * got.cost(s, kind, work(r)) for r in rows)
            assert charged == pytest.approx(sum(r["count"] * r["run_s"] for r in rows)), (s, kind)
    # extra work at the stage's run / charged over all its actions: stage 0 17.09 / 12.59
    ratio0 = (4 * 2.25 + 4 * 2.0225) / (4 * 1.125 + 4 * 2.0225)
    assert got.data[0] == pytest.approx(0.5 * ratio0) and got.accumulate[0] == pytest.approx(0.03 * ratio0)
    assert got.forward[0] == pytest.approx(2.25 - 0.25 * 0.5 * ratio0)
    # a kind the stage did not run is scaled as its extra work: stage 0's update
    assert got.update == pytest.approx([0.1 * ratio0, 0.9])
    # I and W, at stages that ran whole backwards, as the backwards: stage 0 2.0225 / 2.0225 = 1,
    # stage 1 (10 x 2.4 + 30 x 1.6) / (40 x 1.52)
    b1 = (10 * 2.4 + 30 * 1.6) / (40 * 1.52)
    assert got.input == pytest.approx([prof.input[0], prof.input[1] * b1])
    assert got.weight == pytest.approx([prof.weight[0], prof.weight[1] * b1])
    assert prof.forward == [1.0, 0.5] and prof.copy == [0.01, 0.02]  # the run's profile itself is left alone
    assert "in_run" in got.meta and "in_run" not in prof.meta
    assert in_run_profile({"actions": [], "ranks": []}, prof) is None


def test_the_in_run_profile_scales_the_held_out_signal_as_its_stages_actions():
    """The held-out signal's forward is not a row of the table: the in-run profile scales it by
    its stage's run over charged time, as the extra work."""
    prof = CostProfile([1.0, 0.5], [2.0, 1.0], [0.1, 0.2], signal=[0.4, 0.3], meta={"signal_rows": 8})
    table = {"actions": [
        {"rank": 0, "stage": 0, "kind": "F", "count": 2, "run_s": 2.0, "profiled_s": 1.0},
        {"rank": 0, "stage": 0, "kind": "B", "count": 2, "run_s": 4.0, "profiled_s": 2.0},
        {"rank": 1, "stage": 1, "kind": "F", "count": 2, "run_s": 0.5, "profiled_s": 0.5},
    ], "ranks": []}
    got = in_run_profile(table, prof)
    assert got.signal == pytest.approx([0.8, 0.3]) and prof.signal == [0.4, 0.3]  # (the given profile untouched)
