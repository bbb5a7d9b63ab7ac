"""``schedule.sync=auto``: AdaPipe's sync phase is whichever of 1F1B and ZB-H1 the run's cost profile
makes faster. The two compute the same numbers, so the pick changes the clock and never the loss.

The reference is the zero-bubble paper's closed forms (Qi et al. 2024, section 3, where F = I = W)
with F = I = W = 1 and a whole backward B = 1.5 (the split costs more than the whole, as it does on
some CPUs): for m >= p, 1F1B's step is (m + p - 1)(F + B) = 2.5(m + p - 1) and ZB-H1's
m(F + I + W) + (p - 1)(F + I - W) = 3m + (p - 1). At p = 4 that is 17.5 against 15 at m = 4 (ZB-H1
faster) and 47.5 against 51 at m = 16 (1F1B faster)."""

from __future__ import annotations

import json

import pytest

from adapipe_cli.schedules import SYNC, Plan, ScheduleSpec
from adapipe_cli.schedules.choice import schedule_choice
from adapipe_cli.simulator.clock import CostProfile, LinkModel
from adapipe_cli.simulator.simulate import simulate
from adapipe_cli.train.build import pick_sync
from adapipe_cli.train.loop import train

P = 4


def split_profile(p: int = P) -> CostProfile:
    return CostProfile([1.0] * p, [1.5] * p, [0.0] * p, input=[1.0] * p, weight=[1.0] * p)


def closed_form(m: int, p: int = P) -> dict[str, float]:
    return {"1f1b": 2.5 * (m + p - 1), "zbh1": 3 * m + (p - 1)}


def adapipe_cfg(make_cfg, sync: str, m: int):
    """AdaPipe on P stages with schedule.sync=``sync`` and ``m`` microbatches: one compose (cached)
    for every case, the two keys set on it (a compose is 0.4 s on 2 busy cores)."""
    cfg = make_cfg("schedule=adapipe", f"pipeline.stages={P}")
    cfg.schedule.sync, cfg.pipeline.microbatches = sync, m
    return cfg


@pytest.mark.parametrize("m,faster", [(4, "zbh1"), (16, "1f1b")])
def test_auto_picks_the_schedule_the_closed_forms_make_faster(m, faster, make_cfg):
    cfg = adapipe_cfg(make_cfg, "auto", m)
    choice = schedule_choice(cfg)
    assert choice.auto
    prof = split_profile()
    for name, step in closed_form(m).items():  # the simulator the pick uses agrees with the paper here
        spec = ScheduleSpec(P, m, name, "stash")
        assert simulate(spec, Plan(3, [SYNC] * 3), prof, record=False).step_time == pytest.approx(step)
    picked = pick_sync(choice, prof, LinkModel(), [])
    assert picked.spec.sync == faster == min(closed_form(m), key=closed_form(m).get)
    assert picked.spec.stages == P and picked.spec.microbatches == m and picked.spec.weights == choice.spec.weights


def test_a_named_sync_schedule_is_kept(make_cfg):
    cfg = adapipe_cfg(make_cfg, "zbh1", 8)
    choice = schedule_choice(cfg)
    assert not choice.auto and pick_sync(choice, split_profile(), LinkModel(), []) is choice


def test_auto_runs_as_its_pick_end_to_end(make_cfg, tmp_path):
    """At p = 2 the profile makes 1F1B faster at m = 4 (12.5 against ZB-H1's 13; p = 4 needs m = 16
    for that, 8 times the actions, where the picks above are checked): the auto run runs on 1F1B's
    clock, and the summary names the pick. (The losses cannot tell the two apart: 1F1B and ZB-H1
    give the same.)"""
    profile = tmp_path / "split.json"
    split_profile(2).save(profile)
    assert closed_form(4, 2) == {"1f1b": 12.5, "zbh1": 13}
    base = ["schedule=adapipe", "heuristic=gain", "pipeline.stages=2", "pipeline.microbatches=4",
            "train.batch_size=4", "train.max_steps=4", "train.eval_every=2", f"pipeline.profile={profile}", "heuristic.start=sync",
            "heuristic.signal=train"]  # (all 4 steps in the sync warm-up of a sync start; no held-out signal on the clock)
    runs = {sync: train(make_cfg(*base, f"schedule.sync={sync}"), tmp_path / sync) for sync in ("auto", "zbh1")}
    evals = {k: [json.loads(x)["val_loss"] for x in (tmp_path / k / "metrics.jsonl").read_text().splitlines()
                 if '"val_loss"' in x] for k in runs}
    assert evals["auto"] and evals["auto"] == evals["zbh1"]
    assert runs["auto"]["time_s"] == pytest.approx(4 * 12.5)  # 1F1B's step, 4 times
    assert runs["zbh1"]["time_s"] == pytest.approx(4 * 13)
    assert runs["auto"]["method"] == "adapipe-gain(auto:1f1b/pipedream+predict)"
    assert runs["auto"]["phase_schedules"]["sync"] == "auto:1f1b" and runs["auto"]["sync_schedule"] == "1f1b"


@pytest.mark.parametrize("m,kinds", [(4, {"F", "B"}), pytest.param(2, {"F", "I", "W"}, marks=pytest.mark.slow)])
def test_the_dist_workers_run_the_pick(m, kinds, make_cfg, tmp_path):
    """On dist the driver picks from ``pipeline.profile`` and the workers run what it picked: at p = 2
    the profile makes 1F1B faster at m = 4 (12.5 against 13) and ZB-H1 at m = 2 (7.5 against 7), and
    the workers' own action times show a whole backward (B) or a split one (I and W)."""
    profile = tmp_path / "split.json"
    split_profile(2).save(profile)
    s = train(make_cfg("schedule=adapipe", "schedule.sync=auto", "heuristic=gain", "pipeline.stages=2", f"pipeline.microbatches={m}",
                       "train.max_steps=3", "train.eval_every=3", f"pipeline.profile={profile}", "pipeline.runtime=dist",
                       "pipeline.timeout_s=60", "heuristic.start=sync"), tmp_path / "run")  # (the 3 steps in sync: the pick)
    ran = {row["kind"] for row in s["action_times"]["actions"]}
    assert s["sync_schedule"] == min(closed_form(m, 2), key=closed_form(m, 2).get)
    assert kinds <= ran and not ({"B", "I", "W"} - kinds) & ran, ran


def test_auto_on_dist_without_a_profile_is_refused_in_one_line(make_cfg, tmp_path):
    from adapipe_cli.config.validate import ConfigError

    cfg = make_cfg("schedule=adapipe", "schedule.sync=auto", "pipeline.stages=2", "pipeline.runtime=dist")
    with pytest.raises(ConfigError, match="pipeline.profile=FILE"):
        train(cfg, tmp_path / "run")
    assert not (tmp_path / "run" / "profile.json").exists()
