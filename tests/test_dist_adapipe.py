"""AdaPipe on the distributed runtime is AdaPipe on the local one: with ``pipeline.clock=profiled``
and one profile, the replayed clock gives the local runtime's times, the held-out signal runs
through the workers, and the divergence guard rolls every worker back; same records, bitwise."""

from __future__ import annotations

import json

import pytest

from adapipe_cli.runtime.dist import DistRuntime
from adapipe_cli.runtime.local import LocalRuntime
from adapipe_cli.runtime.profile import join_profiles
from adapipe_cli.schedules import ASYNC, SYNC, Plan, ScheduleSpec
from adapipe_cli.simulator.clock import CostProfile
from adapipe_cli.simulator.replay import Replay
from adapipe_cli.train.loop import train
from helpers import local_runtime, make_data


def all_records(run_dir) -> list[dict]:
    """Every line of metrics.jsonl but its wall time (which no two runs share)."""
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "wall_s"} for r in recs]


# -- fast: the pieces ------------------------------------------------------------------------------
@pytest.mark.parametrize("weights", ["stash", "2bw"])
def test_the_replayed_clock_gives_the_local_runtimes_times(weights):
    """Replay.run_step(t) (no tensors) against the local runtime's clock on the same plan and an
    uneven profile, through two switches; and after going back to a state taken midway."""
    p, m = 3, 2
    phases = [SYNC] * 3 + [ASYNC] * 5 + [SYNC] * 3 + [ASYNC] * 4
    prof = CostProfile([0.01, 0.02, 0.015], [0.02, 0.05, 0.03], [0.001, 0.002, 0.003], copy=[1e-4] * 3,
                       predict=[2e-4] * 3)
    rt = local_runtime(p, m, phases, make_data(len(phases)), weights=weights, profile=prof)
    local = [(r.time_s, r.bubble) for r in (rt.run_step(t) for t in range(len(phases)))]
    rep = Replay(ScheduleSpec(p, m, "1f1b", weights), Plan(len(phases), list(phases)), prof)
    times, state = [], None
    for t in range(len(phases)):
        times.append(rep.run_step(t)[0])
        if t == 5:
            state = rep.state_dict()
    assert times == [t for t, _ in local]
    rep.load_state_dict(state)
    assert [rep.run_step(t)[0] for t in range(6, len(phases))] == times[6:]


def test_joined_profiles_keep_each_stages_measurement():
    parts = [CostProfile([f], [2 * f], [0.1], 64.0, {"device": d, "spread": {"forward": [s]}}, memory={"params": [b]})
             for f, d, s, b in ((1.0, "cuda:0", 0.0, 10.0), (3.0, "cuda:1", 0.5, 30.0))]
    warned = []
    prof = join_profiles(parts, warn=warned.append)
    assert (prof.forward, prof.backward, prof.update, prof.act_bytes) == ([1.0, 3.0], [2.0, 6.0], [0.1, 0.1], 64.0)
    assert prof.memory == {"params": [10.0, 30.0]} and prof.meta["devices"] == ["cuda:0", "cuda:1"]
    assert len(warned) == 1 and "stage 1's forward" in warned[0]  # 1.5x between its passes
    join_profiles(parts, warn=warned.append, shared=(4, 2))  # (workers taking turns on the cores: the cause named)
    assert len(warned) == 2 and "stage 1's forward" in warned[1] and "(the workers' 4 threads share 2 cores)" in warned[1]


def test_joined_profile_of_workers_with_two_chunks_is_in_virtual_stage_order():
    """Worker d measured its chunks d and d + p: virtual stage c is entry c // p of part c % p."""
    parts = [CostProfile([1.0, 3.0], [2.0, 6.0], [0.1, 0.3], 8.0, {"device": "cpu"}, memory={"params": [10.0, 30.0]}),
             CostProfile([2.0, 4.0], [4.0, 8.0], [0.2, 0.4], 8.0, {"device": "cpu"}, memory={"params": [20.0, 40.0]})]
    prof = join_profiles(parts, warn=lambda line: None, chunks=2)
    assert (prof.forward, prof.backward, prof.update) == ([1.0, 2.0, 3.0, 4.0], [2.0, 4.0, 6.0, 8.0], [0.1, 0.2, 0.3, 0.4])
    assert prof.memory == {"params": [10.0, 20.0, 30.0, 40.0]} and prof.meta["devices"] == ["cpu"] * 4


def test_clock_choices(make_cfg):
    from adapipe_cli.config import ConfigError
    from adapipe_cli.train.build import clock_mode

    cfg = make_cfg()  # (composed once, its clock set below: a compose costs 0.3-1 s on 2 busy cores)
    assert clock_mode(cfg, "local") == "profiled" and clock_mode(cfg, "dist") == "wall"
    cfg.pipeline.clock = "profiled"
    assert clock_mode(cfg, "dist") == "profiled"
    for clock, runtime in (("wall", "local"), ("measured", "dist")):
        cfg.pipeline.clock = clock
        with pytest.raises(ConfigError, match=f"pipeline.clock={clock} is the"):
            clock_mode(cfg, runtime)


# -- slow: runs against runs -----------------------------------------------------------------------
def uniform_profile(tmp_path, stages: int, link: dict | None = None):
    path = tmp_path / "uniform.json"  # a fixed clock: the same decisions on any machine, at any load
    prof = CostProfile.uniform(stages, forward=0.01, backward=0.02, update=0.001)
    if link:
        prof.link = link
    prof.save(path)
    return path


ADAPIPE = ["schedule=adapipe", "heuristic=goodput", "pipeline.stages=2", "pipeline.microbatches=1", "optim.lr=3e-3",
           "heuristic.start=sync", "heuristic.sync_warmup=0", "heuristic.window=6", "heuristic.probe_steps=6", "heuristic.probe_every=12",
           "train.max_steps=30", "train.eval_every=10", "pipeline.clock=profiled",
           "heuristic.signal=heldout"]  # (the held-out signal, on both clocks: not the default since 2026-12-04)


@pytest.mark.slow  # a dist run of about 10 s
@pytest.mark.parametrize("link", [None, {"latency_s": 1e-3, "bandwidth": 1e9}], ids=["no-link", "link"])
def test_adapipe_on_dist_takes_the_local_runs_decisions(make_cfg, tmp_path, link):
    """goodput, following the held-out signal, probes async and goes back: two switches, the same
    on both runtimes, with the same times, signals, losses and evaluations, bitwise; with a profile
    that holds a link too (the dist run charges the profile's link, not the one it measures)."""
    args = [*ADAPIPE, f"pipeline.profile={uniform_profile(tmp_path, 2, link)}"]
    ls = train(make_cfg(*args), tmp_path / "local")
    ds = train(make_cfg(*args, "pipeline.runtime=dist", "pipeline.timeout_s=60"), tmp_path / "dist")
    local, dist = all_records(tmp_path / "local"), all_records(tmp_path / "dist")
    assert dist == local
    assert ls["switches"] == ds["switches"] >= 2
    steps = [r for r in dist if r["kind"] == "step"]
    assert {r["phase"] for r in steps} == {SYNC, ASYNC} and all("signal" in r for r in steps)
    assert all(r["signal"] != r["loss"] for r in steps)  # the held-out loss, not the training loss
    assert (ds["clock"], ds["clock_mode"], ds["time_s"]) == ("pipeline", "profiled", ls["time_s"])
    assert "clock=pipeline (profiled)" in (tmp_path / "dist" / "run.log").read_text()


def inject_nan(monkeypatch, cls, at: int):
    """Make step ``at`` of runtime ``cls`` report a NaN loss the first time it runs."""
    real, done = cls.run_step, set()

    def run_step(self, t):
        res = real(self, t)
        if t == at and t not in done:
            done.add(t)
            res.loss = float("nan")
        return res

    monkeypatch.setattr(cls, "run_step", run_step)


GUARDED = ["schedule=pipedream", "pipeline.stages=3", "pipeline.microbatches=2", "train.max_steps=30",
           "heuristic.guard_every=5", "heuristic.guard_cooldown=6"]


@pytest.mark.slow  # a dist run of about 10 s
def test_a_guard_rollback_on_dist_is_the_local_one(make_cfg, tmp_path, monkeypatch):
    """A NaN at step 17 of an async run: every worker goes back to its snapshot at the gate, the
    activations in flight are dropped and those of the snapshot sent again, and the run replays
    the local run's trajectory, guard event and cooldown included."""
    args = [*GUARDED, "pipeline.clock=profiled", f"pipeline.profile={uniform_profile(tmp_path, 3)}"]
    inject_nan(monkeypatch, LocalRuntime, 17)
    inject_nan(monkeypatch, DistRuntime, 17)
    ls = train(make_cfg(*args), tmp_path / "local")
    ds = train(make_cfg(*args, "pipeline.runtime=dist", "pipeline.timeout_s=60"), tmp_path / "dist")
    local, dist = all_records(tmp_path / "local"), all_records(tmp_path / "dist")
    assert dist == local
    (ev,) = [r for r in dist if r.get("event") == "guard"]
    assert ev["step"] == 17 and ev["restored_step"] in (11, 16)
    assert ls["guard_events"] == ds["guard_events"] == 1 and ds["steps"] == 30


@pytest.mark.slow  # a dist run of about 10 s
def test_a_guard_rollback_on_the_wall_clock(make_cfg, tmp_path, monkeypatch):
    """On wall time the lost steps stay on the clock and the time runs on; the losses are still
    the local run's."""
    inject_nan(monkeypatch, LocalRuntime, 12)
    inject_nan(monkeypatch, DistRuntime, 12)
    train(make_cfg(*GUARDED), tmp_path / "local")
    ds = train(make_cfg(*GUARDED, "pipeline.runtime=dist", "pipeline.timeout_s=60"), tmp_path / "dist")
    local, dist = all_records(tmp_path / "local"), all_records(tmp_path / "dist")
    pick = lambda recs: [(r["step"], r["phase"], r["loss"]) for r in recs if r["kind"] == "step"]  # noqa: E731
    assert pick(dist) == pick(local) and ds["clock"] == "wall"
    (ev,) = [r for r in dist if r.get("event") == "guard"]
    assert ev["lost_time_s"] > 0
    times = [r["time_s"] for r in dist if r["kind"] == "step"]
    assert all(b > a for a, b in zip(times, times[1:]))


@pytest.mark.slow  # two dist runs of about 10 s
def test_a_resumed_dist_run_on_the_profiled_clock_repeats_itself(tmp_path):
    """The replayed clock of a resumed run goes on from the checkpoint's time, so goodput decides
    the same after the cut (here inside the async probe) as in the uninterrupted run."""
    from adapipe_cli.cli.main import main
    from conftest import TINY
    from procs import cut_at

    args = [*TINY, *ADAPIPE, f"pipeline.profile={uniform_profile(tmp_path, 2)}", "pipeline.runtime=dist",
            "pipeline.timeout_s=60", "train.checkpoint_every=13"]
    whole = tmp_path / "whole"
    assert main(["train", *args, f"hydra.run.dir={whole}"]) == 0
    cut = cut_at(whole, tmp_path / "cut", 13)
    assert main(["train", f"train.resume={cut}"]) == 0
    steps = lambda d: [r for r in all_records(d) if r["kind"] == "step"]  # noqa: E731
    assert steps(cut) == steps(whole) and {r["phase"] for r in steps(whole)[:13]} == {SYNC, ASYNC}


@pytest.mark.slow  # two runs, one of them dist, of about 10 s
def test_interleaved_on_dist_with_the_profiled_clock_is_the_local_run(make_cfg, tmp_path):
    """Interleaved 1F1B (two chunks per worker) on the pipeline clock of a uniform profile of the
    four virtual stages: every record of the dist run, times and evaluations included, is the local run's."""
    args = ["schedule=interleaved", "pipeline.stages=2", "pipeline.microbatches=4", "pipeline.clock=profiled",
            f"pipeline.profile={uniform_profile(tmp_path, 4)}"]
    ls = train(make_cfg(*args), tmp_path / "local")
    ds = train(make_cfg(*args, "pipeline.runtime=dist", "pipeline.timeout_s=60"), tmp_path / "dist")
    assert all_records(tmp_path / "dist") == all_records(tmp_path / "local")
    assert (ds["clock"], ds["time_s"]) == ("pipeline", ls["time_s"])
