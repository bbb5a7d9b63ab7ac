"""The simulator against closed forms (uniform costs), the link model, cost profiles, the timeline
drawing and ``adapipe simulate`` end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from adapipe_cli.schedules import ASYNC, SYNC, Plan, ScheduleSpec
from adapipe_cli.simulator.clock import CostProfile, LinkModel
from adapipe_cli.simulator.simulate import min_steady_steps, simulate
from adapipe_cli.simulator.timeline import draw_timeline

F, B = 1.0, 2.0
# (p, m): m < p, m = p, m > p and m = 1 among them
SHAPES = [(1, 1), (2, 1), (4, 1), (4, 2), (4, 3), (4, 4), (4, 8), (8, 3), (3, 8), (6, 16)]


def run(p, m, phases, sync="1f1b", weights="stash", f=F, b=B, u=0.0, link=None, record=False):
    spec = ScheduleSpec(p, m, sync, weights)
    spec.check()
    return simulate(spec, Plan(len(phases), list(phases)), CostProfile.uniform(p, f, b, u), link, record=record)


def approx(x):
    return pytest.approx(x, rel=1e-9, abs=1e-9)


# -- synchronous: GPipe and 1F1B ----------------------------------------------------------------
@pytest.mark.parametrize("sync", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", SHAPES)
def test_sync_bubble_and_step_time(sync, p, m):
    """Bubble (p - 1) / (m + p - 1) and step time (m + p - 1)(f + b) + u, from the first step."""
    r = run(p, m, [SYNC] * 3, sync)
    assert r.step_time == approx((m + p - 1) * (F + B))
    assert r.bubble_fraction == approx((p - 1) / (m + p - 1))
    assert r.run_bubble_fraction == approx((p - 1) / (m + p - 1))
    assert r.steady and r.steps == 3
    assert r.update_end == approx([(t + 1) * (m + p - 1) * (F + B) for t in range(3)])
    assert r.utilization == approx([m / (m + p - 1)] * p)
    # non-integer costs and an update (a collective that ends the step)
    f, b, u = 0.7, 1.9, 0.45
    r = run(p, m, [SYNC] * 2, sync, f=f, b=b, u=u)
    assert r.step_time == approx((m + p - 1) * (f + b) + u)
    assert r.steps == 2 and run(p, m, [SYNC], sync, f=f, b=b, u=u).step_time == approx(r.step_time)


# -- asynchronous: PipeDream and 2BW --------------------------------------------------------------
def latest_recomputes(p: int, s: int, m: int, n: int) -> int:
    """Backwards of an n-step async run that ``weights=latest`` recomputes at stage ``s``: those
    with an update between their forward and their backward. In a 1F1B stream F(j) comes right
    before B(j - w), w = p - s - 1, so the backwards between F(j) and B(j) are B(j-w) .. B(j-1),
    and an update follows B(k) when (k + 1) % m == 0."""
    w = p - s - 1
    return sum(1 for j in range(n * m) if any((k + 1) % m == 0 for k in range(max(0, j - w), j)))


@pytest.mark.parametrize("weights", ["stash", "latest", "vertical", "2bw"])
@pytest.mark.parametrize("p,m", SHAPES)
def test_async_steady_state_has_no_bubble(weights, p, m):
    """Steady state: step time m (f + b) (+ u), every stage busy; with ``latest`` a stage's
    recomputed forwards are on its clock too, and the busiest stage sets the step."""
    if weights == "2bw" and m < p - 1:
        pytest.skip("2bw needs m >= p - 1")
    n = min_steady_steps(p, m) + 2
    r = run(p, m, [ASYNC] * n, weights=weights)
    assert r.steady
    if weights == "latest":
        # every recomputed forward is on its stage's clock; the step is at least the busiest stage's
        busy = [u * r.makespan for u in r.utilization]
        assert busy == approx([n * m * (F + B) + latest_recomputes(p, s, m, n) * F for s in range(p)])
        assert r.step_time >= m * (F + B) + max(latest_recomputes(p, s, m, n) for s in range(p)) * F / n - 1e-9
        return
    assert r.step_time == approx(m * (F + B))
    assert r.bubble_fraction == approx(0.0)
    # the fill and the drain are the only idle time of the run
    assert r.run_bubble_fraction == approx(1 - n * m * (F + B) / r.makespan)
    r = run(p, m, [ASYNC] * n, weights=weights, u=0.5)
    assert r.step_time == approx(m * (F + B) + 0.5)
    assert r.bubble_fraction == approx(0.0)


def test_too_few_async_steps_are_flagged():
    p, m = 4, 1
    assert not run(p, m, [ASYNC] * (min_steady_steps(p, m) - 1)).steady
    assert run(p, m, [ASYNC] * min_steady_steps(p, m)).steady


def test_2bw_with_too_few_microbatches_is_rejected():
    from adapipe_cli.schedules import ScheduleError

    with pytest.raises(ScheduleError, match="2bw needs"):
        ScheduleSpec(4, 2, "1f1b", "2bw").check()


def test_phase_switch_costs_a_drain_and_a_fill():
    """async -> sync drains the stream, sync -> async refills it: the round trip takes longer than
    its steps take in their steady states."""
    p, m, k = 4, 4, 6
    a = run(p, m, [ASYNC] * (3 * k))
    trip = run(p, m, [ASYNC] * k + [SYNC] * k + [ASYNC] * k)
    sync_t, async_t = (m + p - 1) * (F + B), m * (F + B)
    assert trip.makespan > a.makespan + k * (sync_t - async_t) - 1e-9
    assert trip.steps == 3 * k


# -- the link --------------------------------------------------------------------------------------
@pytest.mark.parametrize("p,m", SHAPES)
def test_link_latency_adds_a_round_trip_to_the_sync_step(p, m):
    """A flushed step crosses p - 1 links forwards and p - 1 backwards, and its update's all-gather
    (a ring over p stages) p - 1 more: GPipe's step grows by exactly 3 (p - 1) latency. 1F1B's
    strict alternation cannot hide the round trip (the forward of microbatch j + w + 1 waits for
    the backward of j), so its step grows by exactly that only for m <= 2, and by more beyond."""
    lat = 0.25
    base = (m + p - 1) * (F + B)
    assert run(p, m, [SYNC] * 2, "gpipe", link=LinkModel(lat)).step_time == approx(base + 3 * (p - 1) * lat)
    one = run(p, m, [SYNC] * 2, "1f1b", link=LinkModel(lat)).step_time
    if m <= 2:
        assert one == approx(base + 3 * (p - 1) * lat)
    else:
        assert one >= base + 3 * (p - 1) * lat - 1e-9


def test_link_bandwidth_adds_transfer_time():
    p, m, lat, nbytes, bw = 4, 3, 0.1, 200.0, 1000.0
    profile = CostProfile.uniform(p, F, B, 0.0, act_bytes=nbytes)
    r = simulate(ScheduleSpec(p, m, "gpipe"), Plan(1, [SYNC]), profile, LinkModel(lat, bw))
    assert r.step_time == approx((m + p - 1) * (F + B) + 2 * (p - 1) * (lat + nbytes / bw) + (p - 1) * lat)


def test_the_link_is_the_configured_one_else_the_measured_one_else_free():
    """A dist run's measured link (the profile's ``link``) times the simulation unless a link is
    configured; a profile without one leaves communication free (the local runtime's clock)."""
    p, m = 2, 2
    measured = CostProfile.uniform(p, F, B, 0.0, act_bytes=100.0)
    measured.link = {"latency_s": 0.25, "bandwidth": 400.0}
    assert LinkModel.choose(0.0, 0.0, measured) == LinkModel(0.25, 400.0)
    assert LinkModel.choose(0.5, 0.0, measured) == LinkModel(0.5, 0.0)
    assert LinkModel.choose(0.0, 0.0, CostProfile.uniform(p)) == LinkModel()
    free = simulate(ScheduleSpec(p, m, "gpipe"), Plan(1, [SYNC]), measured).step_time
    assert free == approx((m + p - 1) * (F + B))
    linked = simulate(ScheduleSpec(p, m, "gpipe"), Plan(1, [SYNC]), measured, LinkModel.choose(0, 0, measured))
    assert linked.step_time == approx(free + 2 * (0.25 + 100.0 / 400.0) + 0.25)


def test_a_measured_link_survives_save_and_load_but_not_the_fingerprint(tmp_path):
    from adapipe_cli.train.fingerprint import profile_fingerprint

    prof = CostProfile.uniform(2)
    before = profile_fingerprint(prof)
    prof.link = {"latency_s": 1e-4, "bandwidth": 1e9}
    prof.save(tmp_path / "profile.json")
    assert CostProfile.load(tmp_path / "profile.json").link == prof.link
    assert profile_fingerprint(prof) == before  # (the link has a fingerprint of its own: fingerprint.LINK)


# -- cost profiles -----------------------------------------------------------------------------------
def test_profile_with_the_wrong_number_of_stages_is_rejected(tmp_path):
    path = tmp_path / "profile.json"
    CostProfile.uniform(2).save(path)
    prof = CostProfile.load(path)
    with pytest.raises(ValueError, match="2 stages"):
        simulate(ScheduleSpec(4, 4), Plan(1, [SYNC]), prof)


def test_uneven_profile_is_limited_by_its_slowest_stage():
    """With one stage k times slower, async steady state runs at that stage's pace."""
    p, m = 4, 4
    prof = CostProfile([1.0, 1.0, 3.0, 1.0], [2.0, 2.0, 6.0, 2.0], [0.0] * p)
    n = min_steady_steps(p, m) + 2
    r = simulate(ScheduleSpec(p, m), Plan(n, [ASYNC] * n), prof)
    assert r.step_time == approx(m * (3.0 + 6.0))
    assert r.bubble_fraction == approx(1 - (3 * m * 3.0 + m * 9.0) / (p * r.step_time))


# -- the timeline -----------------------------------------------------------------------------------
def test_timeline_records_every_action_in_order():
    p, m = 3, 2
    r = run(p, m, [SYNC] * 2, record=True)
    assert len(r.timeline) == 2 * p * (2 * m + 1)
    for s in range(p):
        rows = [b for b in r.timeline if b[0] == s]
        assert all(a[5] <= b[4] + 1e-12 for a, b in zip(rows, rows[1:]))  # a stage runs one at a time


def test_draw_timeline_boxes_and_downsampled(tmp_path):
    r = run(4, 4, [ASYNC] * 6, u=0.0, record=True)
    note = draw_timeline(r.timeline, 4, tmp_path / "small.png", "small")
    assert "one box each" in note and (tmp_path / "small.png").stat().st_size > 0
    note = draw_timeline(r.timeline, 4, tmp_path / "big.png", "big", max_boxes=10, columns=200)
    assert "downsampled" in note and (tmp_path / "big.png").stat().st_size > 0


def test_timeline_fits_a_screen_and_draws_free_updates_as_lines(tmp_path):
    from adapipe_cli.simulator.timeline import MAX_WIDTH_IN, shapes

    free = run(4, 8, [SYNC] * 8, u=0.0, record=True)  # the simulate command's default picture
    draw_timeline(free.timeline, 4, tmp_path / "t.png")
    width = int.from_bytes((tmp_path / "t.png").read_bytes()[16:20], "big")  # PNG header: width in pixels
    assert width <= MAX_WIDTH_IN * 100 + 200  # the axes at most MAX_WIDTH_IN inches, plus the legend
    work, _, updates, lines, _ = shapes(free.timeline)
    assert updates == [] and len(lines) == 8 * 4 and len(work) == 8 * 4 * 2 * 8
    assert all(a[0] == b[0] for (a, b) in lines)  # zero width: drawn at the update's time
    paid = run(2, 1, [SYNC], u=0.25, record=True)
    _, _, updates, lines, _ = shapes(paid.timeline)
    assert lines == [] and [round(u[2][0] - u[0][0], 9) for u in updates] == [0.25, 0.25]


# -- adapipe simulate -------------------------------------------------------------------------------
def simulate_cfg(*overrides: str):
    from adapipe_cli.cli.compose import compose_config
    from adapipe_cli.config.schema import register_simulate_config

    register_simulate_config()
    return compose_config(list(overrides), config_name="simulate")


def test_adapipe_phases_follow_the_fixed_plan():
    from adapipe_cli.cli.simulate import prepare

    cfg = simulate_cfg("schedule=adapipe", "heuristic.plan=[[async,2],[sync,1],[async,null]]", "steps=5",
                       "pipeline.stages=2", "pipeline.microbatches=2")
    assert prepare(cfg).plan.phases == [ASYNC, ASYNC, SYNC, ASYNC, ASYNC]
    cfg = simulate_cfg("schedule=adapipe", "heuristic.plan=[[async,1],[sync,1]]", "steps=4")
    assert prepare(cfg).plan.phases == [ASYNC, SYNC, SYNC, SYNC]  # the last phase continues
    assert prepare(simulate_cfg("schedule=2bw", "steps=3", "pipeline.microbatches=4")).plan.phases == [ASYNC] * 3
    assert prepare(simulate_cfg("schedule=gpipe", "steps=2")).plan.phases == [SYNC] * 2


def test_cli_profile_stage_mismatch_is_one_line(tmp_path, capsys):
    from adapipe_cli.cli.simulate import prepare

    path = tmp_path / "profile.json"
    CostProfile.uniform(2).save(path)
    with pytest.raises(SystemExit) as e:
        prepare(simulate_cfg(f"pipeline.profile={path}", "pipeline.stages=4"))
    assert e.value.code != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "2 stages" in err[0]
    assert prepare(simulate_cfg(f"pipeline.profile={path}", "pipeline.stages=2")).source == str(path)


def test_action_table_formats_versions_of_async_actions():
    from adapipe_cli.cli.simulate import action_table

    sync = action_table(ScheduleSpec(2, 2), Plan(1, [SYNC])).splitlines()
    assert sync[0].split("|")[1].split() == ["F0", "F1", "B0", "B1", "U0"]
    asyn = action_table(ScheduleSpec(2, 1), Plan(2, [ASYNC, ASYNC])).splitlines()
    assert asyn[0].split("|")[1].split() == ["F0@v0", "F1@v0", "B0@v0", "U0", "B1@v0", "U1"]
    assert "more" in action_table(ScheduleSpec(2, 8), Plan(1, [SYNC]), limit=4)


def test_action_table_wraps_into_blocks_of_aligned_columns():
    from adapipe_cli.cli.simulate import action_table

    plan = Plan(8, [SYNC] * 8)
    text = action_table(ScheduleSpec(4, 8), plan, width=100)
    blocks = text.split("\n\n")
    assert max(map(len, text.splitlines())) <= 100 and len(blocks) > 3
    assert all(len(b.splitlines()) == 4 for b in blocks)  # every block holds every stage
    unwrapped = action_table(ScheduleSpec(4, 8), plan, width=10**6).splitlines()
    for s in range(4):  # the blocks of a stage put together are its unwrapped row
        joined = [a for b in blocks for a in b.splitlines()[s].split("|")[1].split()]
        assert joined == unwrapped[s].split("|")[1].split() and len(joined) == 8 * (2 * 8 + 1)


def adapipe(*args: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("adapipe")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "adapipe_cli.cli.main"]
    env = {**os.environ, "HYDRA_FULL_ERROR": "0"}
    return subprocess.run([*cmd, *args], capture_output=True, text=True, env=env, timeout=120)


SIMULATE = ["schedule=pipedream", "pipeline.stages=4", "pipeline.microbatches=4", "steps=8", "print=true"]


def check_simulation_outputs(run_dir: Path, stdout: str) -> None:
    sim = json.loads((run_dir / "simulation.json").read_text())
    for key in ("step_time", "bubble_fraction", "utilization", "per_stage"):
        assert key in sim
    assert sim["step_time"] == approx(4 * (F + B)) and sim["bubble_fraction"] == approx(0.0)
    assert [s["peak_activations"] for s in sim["per_stage"]] == [4, 3, 2, 1]
    assert all("weight_versions" in s for s in sim["per_stage"])
    assert (run_dir / "timeline.png").stat().st_size > 0
    assert "F4@v0" in stdout and "bubble fraction" in stdout
    assert stdout.strip().splitlines()[-1] == f"results: {run_dir}"


def test_cli_writes_simulation_json_and_timeline_in_process(tmp_path, capsys):
    from adapipe_cli.cli.main import main

    assert main(["simulate", *SIMULATE, f"hydra.run.dir={tmp_path}"]) == 0
    check_simulation_outputs(tmp_path, capsys.readouterr().out)


def test_cli_simulates_adapipe_with_its_default_sync_phase_zbh1(tmp_path, capsys, monkeypatch):
    """``adapipe simulate schedule=adapipe`` times ZB-H1's sync steps (its default), says so, and
    is faster than the same plan with ``schedule.sync=1f1b`` (ZB-H1's smaller bubble)."""
    from matplotlib.figure import Figure

    from adapipe_cli.cli.main import main

    # the timelines are built but not written (a second each on 2 busy cores), as a run's plots
    # (tests/conftest.py): this test reads simulation.json; the test above checks timeline.png
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: None)
    args = ["schedule=adapipe", "heuristic.plan=[[sync,2],[async,3],[sync,null]]", "pipeline.stages=4",
            "pipeline.microbatches=4", "steps=7"]
    assert main(["simulate", *args, f"hydra.run.dir={tmp_path / 'zb'}"]) == 0
    assert capsys.readouterr().out.startswith("schedule adapipe-fixed(zbh1/pipedream+predict) (sync+async)")
    assert main(["simulate", *args, "schedule.sync=1f1b", f"hydra.run.dir={tmp_path / '1f1b'}"]) == 0
    zb, plain = (json.loads((tmp_path / d / "simulation.json").read_text()) for d in ("zb", "1f1b"))
    assert (zb["sync"], plain["sync"]) == ("zbh1", "1f1b")
    assert zb["makespan"] < plain["makespan"]


@pytest.mark.slow  # the installed command in a subprocess (5 s); the fast twin above runs in process
def test_cli_writes_simulation_json_and_timeline(tmp_path):
    out = adapipe("simulate", *SIMULATE, f"hydra.run.dir={tmp_path}")
    assert out.returncode == 0, out.stderr
    check_simulation_outputs(tmp_path, out.stdout)


BAD_SIMULATE = [(["schedule=nonesuch"], "schedule"),
                (["schedule=2bw", "pipeline.stages=4", "pipeline.microbatches=2"], "2bw needs")]


@pytest.mark.parametrize("args,words", BAD_SIMULATE)
def test_cli_bad_input_is_one_line_in_process(tmp_path, capsys, args, words):
    from adapipe_cli.cli.main import main

    assert main(["simulate", *args, f"hydra.run.dir={tmp_path / 'run'}"]) == 2
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], out.err
    assert "Traceback" not in out.err + out.out
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # the installed command in a subprocess (5 s each); the fast twin above runs in process
@pytest.mark.parametrize("args,words", BAD_SIMULATE)
def test_cli_bad_input_is_one_line(tmp_path, args, words):
    out = adapipe("simulate", *args, f"hydra.run.dir={tmp_path / 'run'}")
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], out.stderr
    assert "Traceback" not in out.stderr + out.stdout
    assert not (tmp_path / "run").exists()


def test_weight_copies_are_busy_time_not_bubble():
    """PipeDream's steady state with a copy cost: every stage copies one version per step, so the
    step grows by the copy and the bubble stays 0."""
    p, m = 4, 2
    n = min_steady_steps(p, m) + 2
    prof = CostProfile.uniform(p, F, B, 0.0, copy=0.25)
    r = simulate(ScheduleSpec(p, m), Plan(n, [ASYNC] * n), prof, record=False)
    assert r.step_time == approx(m * (F + B) + 0.25)
    assert r.bubble_fraction == approx(0.0)


# -- microbatches in flight ------------------------------------------------------------------------
HELD = {"depths": [1, 4, 8], "forward": [[1.0, 1.3, 1.5]], "backward": [[1.0, 1.6, 1.6]]}


def held_profile(p: int, f: float = F, b: float = B) -> CostProfile:
    prof = CostProfile.uniform(p, f, b)
    prof.held = {"depths": HELD["depths"], "forward": HELD["forward"] * p, "backward": HELD["backward"] * p}
    return prof


def test_an_actions_cost_grows_with_the_microbatches_its_stage_holds(tmp_path):
    """The in-flight factor by hand: linear between the measured depths, flat beyond the last, 1 at
    one microbatch, for an update and without a table; I and W take the backward's. A GPipe step
    of one stage and 4 microbatches holds 1, 2, 3, 4 at its forwards and 4, 3, 2, 1 at its
    backwards; 1F1B holds one at each: f (1 + 1.1 + 1.2 + 1.3) + b (1.6 + 1.4 + 1.2 + 1) against
    4 (f + b). PipeDream with one microbatch holds p - s at stage s, so at depth 4 its step is stage
    0's f 1.3 + b 1.6, where 1F1B's (one in flight) stays (m + p - 1)(f + b). The toll is busy time,
    not bubble."""
    prof = held_profile(1)
    assert [prof.held_factor(0, "F", h) for h in (0, 1, 2, 4, 6, 8, 20)] == approx([1, 1, 1.1, 1.3, 1.4, 1.5, 1.5])
    assert [prof.held_factor(0, k, 2.5) for k in ("B", "I", "W", "U")] == approx([1.3, 1.3, 1.3, 1.0])
    assert prof.cost(0, "B", {"held": 4, "accumulate": 1}) == approx(B * 1.6)  # (accumulating is free here)
    assert CostProfile.uniform(1, F, B).cost(0, "F", {"held": 8}) == F
    gpipe = simulate(ScheduleSpec(1, 4, "gpipe"), Plan(2, [SYNC] * 2), prof)
    assert gpipe.step_time == approx(F * (1 + 1.1 + 1.2 + 1.3) + B * (1.6 + 1.4 + 1.2 + 1.0))
    assert gpipe.bubble_fraction == approx(0.0)  # (the toll is busy time: one stage is never idle)
    assert simulate(ScheduleSpec(1, 4, "1f1b"), Plan(2, [SYNC] * 2), prof).step_time == approx(4 * (F + B))
    p = 4
    n = min_steady_steps(p, 1) + 2
    r = simulate(ScheduleSpec(p, 1, "1f1b", "stash"), Plan(n, [ASYNC] * n), held_profile(p))
    assert r.steady and r.step_time == approx(F * 1.3 + B * 1.6)
    # stages 1 to 3 hold 3, 2, 1 and wait for stage 0: busy F (1.3 + 1.2 + 1.1 + 1) + B (1.6 + 1.4 + 1.2 + 1)
    assert r.bubble_fraction == approx(1 - (F * 4.6 + B * 5.2) / (p * r.step_time))
    assert simulate(ScheduleSpec(p, 1, "1f1b"), Plan(3, [SYNC] * 3), held_profile(p)).step_time == approx(p * (F + B))
    prof.save(tmp_path / "p.json")
    assert CostProfile.load(tmp_path / "p.json").held == prof.held


def test_a_profile_whose_in_flight_table_does_not_fit_is_refused(tmp_path):
    """A held table with a row per stage of a factor per depth loads; one whose rows are short or
    missing, or whose depths do not start at 1, is refused in one ValueError naming the file; a
    profile without a table loads and charges no toll."""
    path = tmp_path / "p.json"
    good = held_profile(2)
    good.held = {"depths": [1, 4], "forward": [[1.0, 1.1]] * 2, "backward": [[1.0, 1.2]] * 2}
    good.save(path)
    assert CostProfile.load(path).held == good.held
    for bad in ({"depths": [1, 4], "forward": [[1.0, 1.1, 1.2]] * 2, "backward": [[1.0, 1.2]] * 2},
                {"depths": [1, 4], "forward": [[1.0, 1.1]], "backward": [[1.0, 1.2]]},
                {"forward": [[1.0, 1.1]] * 2, "backward": [[1.0, 1.2]] * 2},
                {"depths": [2, 4], "forward": [[1.0, 1.1]] * 2, "backward": [[1.0, 1.2]] * 2}):
        d = json.loads(path.read_text())
        d["held"] = bad
        (tmp_path / "bad.json").write_text(json.dumps(d))
        with pytest.raises(ValueError, match="in-flight table"):
            CostProfile.load(tmp_path / "bad.json")
    d = json.loads(path.read_text())
    del d["held"]
    (tmp_path / "old.json").write_text(json.dumps(d))
    old = CostProfile.load(tmp_path / "old.json")
    assert old.held == {} and old.cost(0, "B", {"held": 4}) == B


def test_the_held_out_signal_is_busy_time_after_each_update():
    """AdaPipe's held-out signal (``signal``): each stage computes its share of the signal's
    forward right after its update. 1F1B with one microbatch on 2 stages: the next step's first
    forward waits for stage 0's share, and stage 1's hides in its wait for that forward, so the
    step is 2 (f + b) + u + S_0. PipeDream: every stage does F, B, U and its share each step, so the
    step is f + b + u + max S and the other stage idles the difference, a bubble."""
    p, u, sig = 2, 0.5, [0.3, 0.4]
    prof = CostProfile.uniform(p, F, B, u)
    sync = simulate(ScheduleSpec(p, 1, "1f1b"), Plan(6, [SYNC] * 6), prof, signal=sig, record=True)
    ends = sync.update_end
    assert ends[0] == approx(2 * (F + B) + u)  # (no signal before the first step)
    assert [b - a for a, b in zip(ends, ends[1:])] == [approx(2 * (F + B) + u + sig[0])] * 5
    assert sorted((s, step) for s, kind, _mb, step, a, b in sync.timeline if kind == "S" and b - a == approx(sig[s])) == \
        [(s, t) for s in range(p) for t in range(6)]
    n = 4 * min_steady_steps(p, 1)
    asy = simulate(ScheduleSpec(p, 1, "1f1b", "stash"), Plan(n, [ASYNC] * n), prof, signal=sig)
    assert asy.step_time == approx(F + B + u + max(sig))
    assert asy.bubble_fraction == approx(1 - (p * (F + B + u) + sum(sig)) / (p * (F + B + u + max(sig))))
    assert simulate(ScheduleSpec(p, 1, "1f1b", "stash"), Plan(n, [ASYNC] * n), prof).step_time == approx(F + B + u)


def test_the_signals_cost_is_measured_else_scaled_from_the_forward(tmp_path):
    """``signal_costs(rows)``: the measured costs at their rows, linear in rows from them; a profile
    without them (from before) charges the training forward scaled by rows over the microbatch's.
    A profile whose signal costs lack a stage or their rows is refused at load."""
    prof = CostProfile([1.0, 2.0], [2.0, 4.0], [0.1, 0.1], meta={"microbatch_size": 4})
    assert prof.signal_costs(8) == approx([2.0, 4.0]) and prof.signal_costs(2) == approx([0.5, 1.0])
    prof.signal, prof.meta["signal_rows"] = [1.7, 3.3], 8
    assert prof.signal_costs(8) == approx([1.7, 3.3]) and prof.signal_costs(4) == approx([0.85, 1.65])
    path = tmp_path / "p.json"
    prof.save(path)
    assert CostProfile.load(path).signal_costs(8) == approx([1.7, 3.3])
    assert CostProfile([1.0], [2.0], [0.1]).signal_costs(8, 2) == approx([4.0])  # (the run's microbatch rows)
    with pytest.raises(ValueError, match="microbatch"):
        CostProfile([1.0], [2.0], [0.1]).signal_costs(8)
    good = path.read_text()
    for bad in ({"signal": [1.7]}, {"meta": {"microbatch_size": 4}}):  # a stage short; no rows
        d = json.loads(good)
        d.update(bad)
        path.write_text(json.dumps(d))
        with pytest.raises(ValueError, match="signal"):
            CostProfile.load(path)
