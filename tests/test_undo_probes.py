"""heuristic.undo_probes end to end: an undone probe of async leaves the numbers of a run that never
probed (its sync schedule's, step by step), and its time on the clock."""

from __future__ import annotations

import json

import pytest

from adapipe_cli.adaptive.base import Decision, Heuristic
from adapipe_cli.schedules import ASYNC, SYNC
from adapipe_cli.simulator.clock import CostProfile
from adapipe_cli.train import build
from adapipe_cli.train.loop import train

# the probe of async: its first step, its steps, the step decided with its undo (with 4 stages and 2
# microbatches the decision lag is 4: the probe is decided after step 2, its undo after step 8, its
# last; few steps, each ~0.1 s of the tests' time on 2 busy cores)
START, LEG, VERDICT = 6, 3, 12


class Scripted(Heuristic):
    """A probe of async from step START for LEG steps, undone with the decision of step VERDICT
    (made after step VERDICT - lag ran); sync everywhere else. Records what the loop asked."""

    name = "scripted"

    def __init__(self, ctx):
        super().__init__(None, ctx)
        self.tentative, self.undone, self.rewound, self.asked, self.observed = False, False, [], [], []

    def decide(self, step: int) -> Decision:
        self.asked.append(step)
        if not self.undone and step == START:
            self.tentative = True
            return Decision(ASYNC, "probe", tentative=True)
        if not self.undone and START < step < START + LEG:
            return Decision(ASYNC, "probe")
        if not self.undone and step == VERDICT:
            self.tentative, self.undone = False, True
            return Decision(SYNC, "lost", {"E": 0.1}, undo=START)
        return Decision(SYNC)

    def rewind(self, step: int) -> None:
        self.rewound.append(step)

    def observe(self, obs) -> None:
        self.observed.append(obs)


def records(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("runtime", ["local", pytest.param("dist", marks=pytest.mark.slow)])  # (dist: about 10 s)
def test_an_undone_probe_leaves_the_sync_schedules_numbers(runtime, make_cfg, tmp_path, monkeypatch):
    """An adapipe run whose probe of async is undone trains exactly what ZB-H1 (its sync phase)
    trains: the same loss at every step and the same evaluations. Its clock is ZB-H1's up to the
    state it went back to and ZB-H1's plus the undone stretch's time after it; the log keeps no
    trace of the probe but the undo event, and the summary counts it."""
    profile = tmp_path / "uniform.json"  # a fixed clock
    CostProfile.uniform(4, forward=0.01, backward=0.02, update=0.001).save(profile)
    # (the training loss as the signal: the held-out one's forward is on the clock, which ZB-H1's is not;
    # 14 steps: the probe's undo is decided after step 8, evaluations at 2 before the state it goes
    # back to (step 3) and at 4, 6, ... 14 after it)
    common = ["pipeline.stages=4", "pipeline.microbatches=2", "train.max_steps=14", "train.eval_every=2",
              "pipeline.clock=profiled", f"pipeline.profile={profile}", "heuristic.signal=train"]
    if runtime == "dist":
        common += ["pipeline.runtime=dist", "pipeline.timeout_s=60"]
    made = []

    def scripted(cfg, choice, ctx):
        made.append(Scripted(ctx))
        return made[-1]

    monkeypatch.setattr(build, "make_heuristic", scripted)
    cfg = make_cfg(*common, "schedule=adapipe", "heuristic=gain", "heuristic.undo_probes=true")
    lag = build.decision_lag(cfg)
    s = train(cfg, tmp_path / "undo")
    monkeypatch.undo()
    ref = train(make_cfg(*common, "schedule=zbh1"), tmp_path / "zbh1")
    h = made[0]
    recs, zrecs = records(tmp_path / "undo"), records(tmp_path / "zbh1")
    steps = [r for r in recs if r["kind"] == "step"]
    zsteps = [r for r in zrecs if r["kind"] == "step"]
    (ev,) = [r for r in recs if r.get("event") == "undo"]
    restored = ev["restored_step"]
    assert ev["reason"] == "lost" and ev["E"] == 0.1  # the verdict, with its estimates
    assert ev["step"] == START and restored == START - lag + 1
    assert h.rewound == [restored - 1] and h.asked.count(START) == 2  # the probe's first step decided again
    assert [r["step"] for r in steps] == list(range(14)) and all(r["phase"] == SYNC for r in steps)
    assert [r["loss"] for r in steps] == [r["loss"] for r in zsteps]
    evals = [(r["step"], r["val_loss"]) for r in recs if r["kind"] == "eval"]
    assert evals == [(r["step"], r["val_loss"]) for r in zrecs if r["kind"] == "eval"]
    assert not [r for r in recs if r.get("event") == "switch"]
    lost = ev["lost_time_s"]
    assert lost > LEG * 0.01  # at least the probe's async steps
    for r, z in zip(steps, zsteps):
        assert r["time_s"] == pytest.approx(z["time_s"] + (lost if r["step"] >= restored else 0.0), rel=1e-9)
    # the heuristic observes each kept step's own time, ZB-H1's: the lost time is on the clock before
    # the restored step (the clock it starts from holds it), not in that step's time
    seen = {o.step: o for o in h.observed}  # (the last observation of each step: the kept run's)
    assert sorted(seen) == list(range(14))
    ztimes = [0.0, *(z["time_s"] for z in zsteps)]
    for k, o in seen.items():
        assert o.step_time == pytest.approx(ztimes[k + 1] - ztimes[k], rel=1e-9), k
        assert o.time_s == pytest.approx(steps[k]["time_s"], rel=1e-9)
    assert s["undone_probes"] == 1 and s["undone_time_s"] == pytest.approx(lost)
    assert s["time_s"] == pytest.approx(ref["time_s"] + lost) and s["steps"] == 14
    # the undone stretch's time counts in the phases it was spent in: the probe's async steps in
    # async (none of them kept), the sync steps around them in sync
    by = ev["lost_by_phase"]
    assert sum(by.values()) == pytest.approx(lost) and by["async"] > LEG * 0.01 and by["sync"] > 0
    assert s["phases"]["async"] == {"steps": 0, "time_s": pytest.approx(by["async"])}
    assert s["phases"]["sync"] == {"steps": 14, "time_s": pytest.approx(ref["time_s"] + by["sync"])}
    assert s["async_fraction"] == pytest.approx(by["async"] / s["time_s"])


def test_an_undo_without_a_kept_state_keeps_the_probe(make_cfg, tmp_path, monkeypatch):
    """An undo whose probe's state is gone (as after a guard rollback to before the probe; here the
    probe was never marked tentative) is recorded as missed and the run goes on with the probe's
    async steps."""
    class Untentative(Scripted):
        def decide(self, step):
            d = super().decide(step)
            return d._replace(tentative=False)

    profile = tmp_path / "uniform.json"
    CostProfile.uniform(4, forward=0.01, backward=0.02, update=0.001).save(profile)
    monkeypatch.setattr(build, "make_heuristic", lambda cfg, choice, ctx: Untentative(ctx))
    s = train(make_cfg("pipeline.stages=4", "pipeline.microbatches=2", "train.max_steps=14", f"pipeline.profile={profile}",
                       "schedule=adapipe", "heuristic=gain", "heuristic.undo_probes=true"), tmp_path / "run")
    recs = records(tmp_path / "run")
    (ev,) = [r for r in recs if r.get("event") == "undo_missed"]
    assert ev["probe_start"] == START and s["undone_probes"] == 0
    phases = [r["phase"] for r in recs if r["kind"] == "step"]
    assert phases[START:START + LEG] == [ASYNC] * LEG and len(phases) == 14  # (the undo comes with step 12's phase)


class Resumable(Scripted):
    """Scripted, with its state in checkpoints."""

    def state_dict(self):
        return {"tentative": self.tentative, "undone": self.undone}

    def load_state_dict(self, state):
        self.tentative, self.undone = state["tentative"], state["undone"]


def test_a_checkpoint_due_in_a_tentative_probe_waits_and_the_run_resumes_exactly(tmp_path, monkeypatch):
    """A checkpoint that falls due while a tentative probe is undecided is not written then (it
    would hold a run that is undone); the replay after the undo writes it, and a run resumed from
    it gives the uninterrupted run's records."""
    from adapipe_cli import checkpoint
    from adapipe_cli.cli.main import main
    from conftest import TINY
    from procs import cut_at

    from adapipe_cli.train import loop

    profile = tmp_path / "uniform.json"
    CostProfile.uniform(4, forward=0.01, backward=0.02, update=0.001).save(profile)
    monkeypatch.setattr(build, "make_heuristic", lambda cfg, choice, ctx: Resumable(ctx))
    # every checkpoint written: its step, and whether a tentative probe was open then (decided, under
    # way or to be undone: the replay after the undo writes the same steps again, so the files alone
    # would not show one written inside the probe)
    writes, real_save = [], loop.Trainer.save_checkpoint

    def save_checkpoint(self):
        writes.append((self.st.steps, (self.probe_from, self.probe_point, self.undo_from) != (None, None, None)))
        return real_save(self)

    monkeypatch.setattr(loop.Trainer, "save_checkpoint", save_checkpoint)
    whole = tmp_path / "whole"
    # (13 steps: the undo is decided with step 12's phase; a checkpoint due when the probe is decided,
    # two inside it and one after its undo)
    args = [*TINY, "pipeline.stages=4", "pipeline.microbatches=2", "train.max_steps=13", "train.checkpoint_every=3",
            "train.keep_checkpoints=10", f"pipeline.profile={profile}", "schedule=adapipe", "heuristic=gain",
            "heuristic.undo_probes=true"]
    assert main(["train", *args, f"hydra.run.dir={whole}"]) == 0
    recs = records(whole)
    (ev,) = [r for r in recs if r.get("event") == "undo"]
    # step 3's checkpoint fell due when the probe was decided and was written by the undo, step 6's
    # and 9's fell inside the probe (9's as its last step ran) and were written in the replay
    assert ev["restored_step"] == 3 and START <= 6 < 9 == START + LEG < VERDICT
    assert [f.name for f in checkpoint.complete(whole)] == [f"step-{s:07d}" for s in (3, 6, 9, 12)]
    assert writes == [(3, False), (6, False), (9, False), (12, False)]  # each once, none while the probe was open
    strip = lambda rs: [{k: v for k, v in r.items() if k != "wall_s"} for r in rs]  # noqa: E731
    for stop in (3, 6):
        cut = cut_at(whole, tmp_path / f"cut{stop}", stop)
        assert main(["train", f"train.resume={cut}"]) == 0
        assert strip(records(cut)) == strip(recs)


def test_dist_refuses_periodic_checkpoints_with_undone_probes(make_cfg, tmp_path):
    """The dist workers write their parts at the gate of a due step, so a checkpoint cannot be put
    off through a tentative probe there: refused in one line before any worker starts."""
    from adapipe_cli.config.validate import ConfigError

    with pytest.raises(ConfigError, match="heuristic.undo_probes on pipeline.runtime=dist does not write periodic"):
        train(make_cfg("schedule=adapipe", "heuristic=gain", "heuristic.undo_probes=true", "pipeline.runtime=dist",
                       "pipeline.stages=2", "train.checkpoint_every=5"), tmp_path / "run")


def test_the_time_lost_is_split_by_the_phases_of_the_discarded_steps():
    """A rollback to a state from before an earlier rollback (3 s lost in async): the span
    discarded now holds that event, a sync step (1 s of its own) and an async one (2 s), and the
    tripped step's 0.5 s (async). Hand-counted: sync 1, async 3 + 2 + 0.5."""
    from types import SimpleNamespace

    from adapipe_cli.train.rollback import Rollback

    records = [{"kind": "step", "phase": SYNC, "time_s": 10.0},  # kept
               {"kind": "event", "event": "guard", "lost_time_s": 3.0, "lost_by_phase": {SYNC: 0.0, ASYNC: 3.0}},
               {"kind": "step", "phase": SYNC, "time_s": 14.0},  # (its increment holds the 3 s lost)
               {"kind": "step", "phase": ASYNC, "time_s": 16.0}]
    fake = SimpleNamespace(log=SimpleNamespace(records=records))
    kept = {"run": {"time_s": 10.0}, "lines": 1}
    by = Rollback._lost_by_phase(fake, kept, 16.5 - 10.0, ASYNC)
    assert by == {SYNC: pytest.approx(1.0), ASYNC: pytest.approx(5.5)}
