"""simulator.jitter: a pipeline of varying actions, against a hand-written 2-stage stream."""

from __future__ import annotations

import random
import statistics

import pytest

from adapipe_cli.schedules import ASYNC, Plan, ScheduleSpec
from adapipe_cli.simulator.clock import CostProfile
from adapipe_cli.simulator.jitter import cv_from_table, gamma_factors, simulate_jitter
from adapipe_cli.simulator.simulate import simulate


def reference_pipedream(F, B, U, steps: int, cv: float, seed: int) -> dict[int, float]:
    """PipeDream's 2-stage, 1-microbatch stream written out by hand: stage 0 runs F(0), F(1), then
    B(t), U(t), F(t+2); stage 1 F(t), B(t), U(t); stage 1's F(t) waits for stage 0's, stage 0's
    B(t) for stage 1's. Each action's time is its cost times a gamma variate of mean 1 and
    coefficient of variation ``cv``. Returns each step's last update end."""
    rng = random.Random(seed)
    k = 1 / cv**2
    orders = [[("F", 0), ("F", 1)] + [a for t in range(steps)
                                      for a in (("B", t), ("U", t), *((("F", t + 2),) if t + 2 < steps else ()))],
              [a for t in range(steps) for a in (("F", t), ("B", t), ("U", t))]]
    cost = {"F": F, "B": B, "U": U}
    end, free, pos, update_end = {}, [0.0, 0.0], [0, 0], {}
    while pos[0] < len(orders[0]) or pos[1] < len(orders[1]):
        for s in (0, 1):
            while pos[s] < len(orders[s]):
                kind, t = orders[s][pos[s]]
                dep = {(1, "F"): (0, "F", t), (0, "B"): (1, "B", t)}.get((s, kind))
                if dep is not None and dep not in end:
                    break
                start = max(free[s], end[dep] if dep else 0.0)
                free[s] = end[(s, kind, t)] = start + cost[kind][s] * rng.gammavariate(k, 1 / k)
                if kind == "U":
                    update_end[t] = max(update_end.get(t, 0.0), free[s])
                pos[s] += 1
    return update_end


def test_varying_actions_slow_a_balanced_async_stream_as_the_hand_written_one():
    F, B, U = [1.0, 1.0], [2.0, 2.0], [0.3, 0.3]
    steps, cv, (lo, hi) = 1500, 0.3, (20, 1479)
    ref = []
    for seed in range(3):
        ends = reference_pipedream(F, B, U, steps, cv, 100 + seed)
        ref.append((ends[hi] - ends[lo]) / (hi - lo))
    prof, spec, plan = CostProfile(F, B, U), ScheduleSpec(2, 1, "1f1b", "stash"), Plan(steps, [ASYNC] * steps)
    mean, each = simulate_jitter(spec, plan, prof, {k: [cv, cv] for k in "FBU"}, samples=3, window=(lo, hi))
    assert len(each) == 3 and mean == pytest.approx(statistics.fmean(ref), rel=0.015)
    # at mean costs the stream's step is a stage's work, 3.3; varying actions wait on each other
    assert simulate(spec, plan, prof).step_time == pytest.approx(3.3)
    assert mean > 1.05 * 3.3


def test_without_spread_every_sample_is_the_simulator_of_means():
    prof, spec, plan = CostProfile([1.0, 0.5], [2.0, 1.5], [0.2, 0.1]), ScheduleSpec(2, 4), Plan(20, [ASYNC] * 20)
    plain = simulate(spec, plan, prof).step_time
    mean, each = simulate_jitter(spec, plan, prof, {"F": [0.0, 0.0]}, samples=2)
    assert each == [plain, plain] and mean == plain
    with pytest.raises(ValueError, match="samples"):
        simulate_jitter(spec, plan, prof, {}, samples=0)


def test_gamma_factors_have_mean_one_and_the_asked_spread():
    draw = gamma_factors({"F": [0.0, 0.4]}, seed=3)
    xs = [draw(1, "F") for _ in range(40000)]
    assert statistics.fmean(xs) == pytest.approx(1.0, abs=0.01)
    assert statistics.pstdev(xs) == pytest.approx(0.4, rel=0.03) and min(xs) > 0
    assert {draw(0, "F"), draw(1, "B"), draw(5, "F")} == {1.0}  # a cv of 0, no kind, no stage: its cost


def test_the_spread_of_a_stage_pools_its_ranks():
    table = {"actions": [
        {"rank": 1, "stage": 1, "kind": "F", "count": 2, "run_s": 1.0, "run_sd_s": 0.0},
        {"rank": 3, "stage": 1, "kind": "F", "count": 2, "run_s": 3.0, "run_sd_s": 0.0},
        {"rank": 0, "stage": 0, "kind": "B", "count": 5, "run_s": 2.0, "run_sd_s": 0.5},
        {"rank": 0, "stage": 0, "kind": "U", "count": 5, "run_s": 2.0},  # (a run before run_sd_s: no spread)
    ]}
    # stage 1's forwards: values 1, 1, 3, 3 (mean 2, sd 1); stage 0's backward 0.5 / 2
    assert cv_from_table(table, 2) == {"B": [0.25, 0.0], "F": [0.0, 0.5], "U": [0.0, 0.0]}


def test_a_stage_and_kind_draw_the_same_factors_in_any_visiting_order():
    a, b = gamma_factors({"F": [0.3, 0.3], "B": [0.2, 0.2]}, seed=7), gamma_factors({"F": [0.3, 0.3], "B": [0.2, 0.2]}, seed=7)
    first = [a(0, "F"), a(1, "F"), a(0, "B"), a(0, "F")]
    second = [b(0, "B"), b(1, "F"), b(0, "F"), b(0, "F")]
    assert (first[0], first[3], first[1], first[2]) == (second[2], second[3], second[1], second[0])
    assert len(set(first)) == 4  # (and the streams differ)
