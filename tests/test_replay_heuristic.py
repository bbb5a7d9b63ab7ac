"""scripts/replay_heuristic.py: a finished run's observations, fed back through its heuristic, make
the run's decisions again; a changed setting shows where they would part."""

from __future__ import annotations

import json
import shutil

import pytest
from omegaconf import OmegaConf

from adapipe_cli.train.loop import train
from tests._scripts import load_script
from tests.test_adapipe import gain_run as shared_gain_run

replay_heuristic = load_script("replay_heuristic")


def hydra_run(make_cfg, run, *overrides):
    """A run as ``adapipe train`` writes it, its config in .hydra/config.yaml (Hydra's)."""
    cfg = make_cfg(*overrides)
    summary = train(cfg, run)
    (run / ".hydra").mkdir()
    OmegaConf.save(cfg, run / ".hydra" / "config.yaml")
    return summary


@pytest.fixture(scope="module")
def gain_run(tmp_path_factory):
    """A gain run of TINY_ADAPIPE on a fixed clock (the run does not depend on this machine's load), as
    ``adapipe train`` writes it: tests/test_adapipe.py's end-to-end gain run, trained once per session."""
    return shared_gain_run(tmp_path_factory)


def test_a_replay_makes_every_decision_of_the_run(gain_run):
    run, summary = gain_run
    assert summary["switches"] >= 2  # (a probe at least: decisions that depend on what was observed)
    r = replay_heuristic.replay(run)
    assert r["divergence"] is None and r["steps"] == summary["steps"]


def test_a_changed_setting_diverges_where_its_first_decision_differs(gain_run):
    run, _ = gain_run
    r = replay_heuristic.replay(run, ["heuristic.start=async"])  # the run started in sync
    assert (r["divergence"], r["run_phase"], r["replay_phase"]) == (0, "sync", "async")
    # a later difference: the run's first switch is a probe decided from the first window; a
    # window twice as long puts the first probe later, so the replay parts from the run there
    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    first = next(x["step"] for x in steps if x.get("event") == "switch")
    r = replay_heuristic.replay(run, ["heuristic.window=20"])
    assert r["divergence"] == first and r["run_phase"] == "async" and r["replay_phase"] == "sync"


def test_what_cannot_be_replayed_is_said(make_cfg, tmp_path, gain_run, capsys):
    def short(*overrides):  # two steps: what is refused does not depend on the run's length
        cfg = make_cfg(*overrides)
        cfg.train.max_steps = 2
        return cfg

    fixed = tmp_path / "fixed"
    hydra_run(short, fixed, "schedule=1f1b")
    assert replay_heuristic.replay(fixed)["skipped"] == "a fixed schedule (no heuristic)"
    bare = tmp_path / "bare"
    train(short("schedule=adapipe"), bare)  # not written by Hydra: no config beside it
    assert "no .hydra/config.yaml" in replay_heuristic.replay(bare)["skipped"]
    with pytest.raises(SystemExit, match="only the heuristic's own settings"):
        replay_heuristic.replay(gain_run[0], ["heuristic.signal=train"])
    with pytest.raises(SystemExit, match="only the heuristic's own settings"):
        replay_heuristic.replay(gain_run[0], ["train.max_steps=10"])
    assert replay_heuristic.main([str(tmp_path / "nowhere")]) == 2
    assert "no such run directory" in capsys.readouterr().err
    out = tmp_path / "replays.json"
    assert replay_heuristic.main([str(gain_run[0]), str(fixed), "--out", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].endswith(f"the same decisions at all {gain_run[1]['steps']} steps")
    assert "not replayed: a fixed schedule" in printed[1]
    assert [r.get("divergence", "skipped") for r in json.loads(out.read_text())] == [None, "skipped"]


def test_a_resumed_run_and_bad_settings_are_refused(gain_run, tmp_path):
    run, _ = gain_run
    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    cfg = OmegaConf.load(resumed / ".hydra" / "config.yaml")
    cfg.train.resume = str(run)
    OmegaConf.save(cfg, resumed / ".hydra" / "config.yaml")
    assert replay_heuristic.replay(resumed)["skipped"].startswith("a resumed run")
    for bad, why in (("heuristic.marign=0.1", "heuristic has no setting 'marign'"),
                     ("heuristic.margin", "give it as heuristic.KEY=VALUE"),
                     ("heuristic.undo_probes=true", "the training loop acts on it"),
                     ("heuristic.guard_cooldown=5", "the training loop acts on it")):
        with pytest.raises(SystemExit, match=why):
            replay_heuristic.replay(run, [bad])
    with pytest.raises(SystemExit, match="could not be converted"):
        replay_heuristic.replay(run, ["heuristic.margin=abc"])
    with pytest.raises(SystemExit, match="heuristic.start='bogus'"):
        replay_heuristic.replay(run, ["heuristic.start=bogus"])


def test_a_replayed_undo_is_a_divergence(gain_run, monkeypatch):
    """The loop rewinds a run at an undo, which the replay cannot: it parts from the run there even
    where the phase decided is the run's."""
    from adapipe_cli.adaptive.base import Decision

    run, _ = gain_run
    make = replay_heuristic.build.make_heuristic

    def undoing(cfg, choice, ctx):
        h = make(cfg, choice, ctx)
        decide = h.decide
        h.decide = lambda u: Decision(decide(u).phase, "undo", undo=3) if u == 20 else decide(u)
        return h

    monkeypatch.setattr(replay_heuristic.build, "make_heuristic", undoing)
    r = replay_heuristic.replay(run)
    assert r["divergence"] == 20 and "undoing the probe from step 3" in r["replay_phase"]
