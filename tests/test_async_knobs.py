"""Async that pays: optimizers through every schedule, the transition warm-up, the divergence guard."""

from __future__ import annotations

import json

import pytest
import torch

from adapipe_cli.cli.main import main
from adapipe_cli.model import build_full_model
from adapipe_cli.runtime.local import LocalRuntime
from adapipe_cli.schedules import ASYNC, SYNC, Plan
from adapipe_cli.schedules.mitigations import UpdatePolicy
from adapipe_cli import checkpoint
from adapipe_cli.train.loop import train
from adapipe_cli.optim import StageOptimizer, is_hidden_matrix
from conftest import TINY, fixed_clock
from helpers import GCFG, optim_cfg, sched_cfg


@pytest.fixture(scope="module")
def uniform_clock(tmp_path_factory) -> str:
    """A cost profile of two stages given to the runs (pipeline.profile), so that none measures its
    own at start-up (up to a third of a short run; runs that measure theirs: test_train, test_profile)."""
    return fixed_clock(tmp_path_factory.mktemp("profile"), 2)


SCHEDULES = [["schedule=1f1b"], ["schedule=gpipe"], ["schedule=pipedream"], ["schedule=2bw"],
             ["schedule=pipedream", "schedule.weights=vertical"],
             ["schedule=adapipe", "heuristic=fixed", "heuristic.plan=[[sync,5],[async,null]]"]]


def _sid(schedule: list[str]) -> str:
    return "-".join(x.split("=")[1] for x in schedule[:2])


# The fast suite trains each schedule with one optimizer (muon and nadamw through a sync and an
# async schedule; adamw, the default, here through an async one and through 1f1b in test_train);
# the other pairs are slow (make test-all). The optimizer sees only the stage's gradient and the lr
# scale (no transition steps by default), whatever the schedule: the fast pair of a schedule runs
# its code, and the fast pairs of an optimizer run its update.
FAST_PAIRS = {"1f1b": "muon", "pipedream": "nadamw", "2bw": "muon", "pipedream-vertical": "adamw", "adapipe-fixed": "nadamw"}


# GPipe's runs are slow: a sync step's update sees the same mean gradient in any order of its
# microbatches, so they train 1F1B's numbers (the fast twin below checks it for each optimizer)
@pytest.mark.parametrize("schedule,optim", [
    pytest.param(s, o, id=f"{_sid(s)}-{o}", marks=() if FAST_PAIRS.get(_sid(s)) == o else pytest.mark.slow)
    for s in SCHEDULES for o in ("adamw", "nadamw", "muon")])
def test_every_optimizer_trains_through_every_schedule(optim, schedule, make_cfg, tmp_path, uniform_clock):
    # one block per stage, 12 steps at lr 1e-2: each pair ends at 0.30-0.47 of the initial
    # perplexity (four blocks, 24 steps at 3e-3: 0.42-0.52) at a third of the cost; a given profile
    # (the run's start-up measurement is not what is tested)
    s = train(make_cfg(f"optim={optim}", *schedule, "pipeline.stages=2", "pipeline.microbatches=2", "model.n_layer=2",
                       "train.max_steps=12", "train.eval_every=12", "optim.lr=1e-2",
                       uniform_clock), tmp_path)
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [r["val_ppl"] for r in recs if r["kind"] == "eval"]
    assert evals[-1] < 0.6 * evals[0], (optim, schedule, evals)
    assert s["optimizer"] == optim


@pytest.mark.parametrize("optim", ["adamw", "nadamw", "muon"])
def test_gpipe_trains_the_numbers_of_1f1b_with_every_optimizer(optim):
    from helpers import local_runtime, make_data, run_losses

    from dataclasses import replace

    data, gcfg = make_data(4), replace(GCFG, n_layer=2)  # (one block per stage)
    losses = {sync: run_losses(local_runtime(2, 2, [SYNC] * 4, data, sync=sync, ocfg=optim_cfg(name=optim, lr=3e-3), gcfg=gcfg), 4)
              for sync in ("1f1b", "gpipe")}
    assert losses["gpipe"] == losses["1f1b"] and len(set(losses["gpipe"])) == 4


def test_muon_gets_only_the_hidden_matrices():
    model = build_full_model(GCFG, 0)
    named = list(model.named_parameters())
    opt = StageOptimizer(named, optim_cfg(name="muon"))
    muon, adamw = opt.optimizers
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    in_muon = {id(p) for g in muon.param_groups for p in g["params"]}
    names = {n for n, p in named if id(p) in in_muon}
    assert names == {n for n, p in named if p.dim() == 2 and n.startswith("blocks.")}
    assert all(".qkv.weight" in n or ".proj.weight" in n or ".fc.weight" in n for n in names)
    assert not any(is_hidden_matrix(n, p) for n, p in named if "embed" in n or "head" in n or p.dim() == 1)
    assert len(in_muon) + sum(len(g["params"]) for g in adamw.param_groups) == len(named)


def test_transition_warmup_changes_lr_and_momentum_as_configured():
    """After each switch into async, transition_steps steps ramp the learning rate from
    transition_lr_scale to 1 and use transition_momentum; never in sync, nor when a run starts async."""
    phases = [SYNC] * 3 + [ASYNC] * 6 + [SYNC] * 2 + [ASYNC] * 3
    o = optim_cfg(decay="constant", warmup_steps=0)
    c = sched_cfg(async_lr_scale=0.5, transition_steps=4, transition_lr_scale=0.25, transition_momentum=0.5)
    pol = UpdatePolicy(o, c, Plan(len(phases), phases), len(phases))
    got = [pol.update_scale(0, t, phases[t], 0.0) for t in range(len(phases))]
    ramp = [0.25 + 0.75 * k / 4 for k in range(4)]
    expect = ([(1.0, None)] * 3 + [(0.5 * r, 0.5) for r in ramp] + [(0.5, None)] * 2 + [(1.0, None)] * 2
              + [(0.5 * r, 0.5) for r in ramp[:3]])
    assert [g[0] for g in got] == pytest.approx([e[0] for e in expect])
    assert [g[1] for g in got] == [e[1] for e in expect]
    pure = UpdatePolicy(o, c, Plan(4, [ASYNC] * 4), 4)
    assert [pure.update_scale(0, t, ASYNC, 0.0) for t in range(4)] == [(0.5, None)] * 4


def test_knobs_of_long_async_phases_match_a_scan_of_the_whole_phase():
    """The policy looks back only as far as its knobs reach (transition_steps, PipeMare's
    lr_reschedule_steps); over long, mixed plans its every scale and momentum equal those computed
    from each async phase's first step, found by scanning the whole plan back."""
    import random

    rng = random.Random(7)
    phases = [rng.choice([SYNC, ASYNC, ASYNC, ASYNC]) for _ in range(40)] + [ASYNC] * 150 + [SYNC] + [ASYNC] * 30
    o = optim_cfg(decay="constant", warmup_steps=0)
    cases = [(3, 5, SYNC, True), (0, 40, ASYNC, True), (12, 2, ASYNC, True), (0, 1, SYNC, True), (4, 0, SYNC, True),
             (5, 3, ASYNC, False)]
    for ramp, anneal, start, reschedule in cases:
        plan = [start] + phases
        c = sched_cfg(async_lr_scale=0.5, transition_steps=ramp, transition_lr_scale=0.25, transition_momentum=0.7,
                      mitigation=["lr_reschedule"] if reschedule else [], lr_reschedule_steps=anneal)
        pol = UpdatePolicy(o, c, Plan(len(plan), plan), len(plan))
        for t, phase in enumerate(plan):
            first = t
            while first > 0 and plan[first - 1] == ASYNC:
                first -= 1
            k, delay = t - first, t % 3  # (a delay of 0: no rescheduling)
            shared, beta1 = 1.0, None  # the scale every stage shares (schedule_scale)
            if phase == ASYNC:
                shared = 0.5
                if first > 0 and k < ramp:
                    shared, beta1 = shared * (0.25 + 0.75 * k / ramp), 0.7
            scale = shared
            if phase == ASYNC and reschedule and delay > 0:
                scale *= (1 + delay) ** -(1 - min(k / max(1, anneal), 1.0))
            assert pol.update_scale(0, t, phase, delay) == (pytest.approx(scale, rel=1e-15), beta1), (ramp, anneal, t)
            assert pol.schedule_scale(t, phase) == pytest.approx(shared, rel=1e-15), (ramp, anneal, t)


def test_transition_momentum_reaches_the_optimizer():
    """The optimizer really steps with the overridden beta1 during a transition, and its own after."""
    from helpers import local_runtime, make_data

    phases = [SYNC, SYNC, ASYNC, ASYNC, ASYNC]
    seen = []
    rt = local_runtime(2, 1, phases, make_data(5), ocfg=optim_cfg(decay="constant", warmup_steps=0),
                       scfg=sched_cfg(transition_steps=2, transition_momentum=0.3))
    opt = rt.executors[0].opt.optimizers[0]
    original = opt.step

    def spy(*a, **k):
        seen.append(opt.param_groups[0]["betas"][0])
        return original(*a, **k)

    opt.step = spy
    for t in range(len(phases)):
        rt.run_step(t)
    assert seen == [0.9, 0.9, 0.3, 0.3, 0.9]


# -- the divergence guard ----------------------------------------------------------------------

def inject(monkeypatch, at: int, kind: str):
    """Make step ``at`` report a NaN loss or a tenfold spike (only the first time it runs)."""
    real = LocalRuntime.run_step
    done = set()

    def run_step(self, t):
        res = real(self, t)
        if t == at and t not in done:
            done.add(t)
            res.loss = float("nan") if kind == "nan" else res.loss * 10
        return res

    monkeypatch.setattr(LocalRuntime, "run_step", run_step)


# 18 steps: snapshots after steps 0 and 5, a step 9 that trips the guard (restored from the
# snapshot after step 5: the steps up to 5 + 3 were decided before it, lag 3), six sync steps of
# cooldown (9-14), async steps after them; one block per stage
GUARD = ["schedule=pipedream", "pipeline.stages=2", "pipeline.microbatches=2", "model.n_layer=2", "train.max_steps=18",
         "heuristic.guard_every=5", "heuristic.guard_cooldown=6"]
GUARDED = [*TINY, *GUARD]


@pytest.mark.parametrize("kind", ["nan", "spike"])
def test_guard_restores_the_last_good_state_and_cools_down_in_sync(kind, monkeypatch, tmp_path, uniform_clock, make_cfg):
    inject(monkeypatch, 9, kind)
    # (train, not the CLI: a run directory of its own per call makes Hydra compose afresh, 1-2 s;
    # the CLI's exit codes are the two tests below)
    train(make_cfg(*GUARD, uniform_clock), tmp_path)
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    (ev,) = [r for r in recs if r.get("event") == "guard"]
    assert ev["step"] == 9 and ev["restored_step"] in (1, 6) and ev["lost_time_s"] > 0
    assert ("non-finite" in ev["reason"]) == (kind == "nan")
    steps = {r["step"]: r for r in recs if r["kind"] == "step"}
    assert sorted(steps) == list(range(18))  # the trajectory that survived, each step once
    cooldown = [t for t in steps if steps[t]["phase"] == SYNC]
    assert cooldown == list(range(ev["sync_until_step"] - 6, ev["sync_until_step"]))
    assert cooldown[0] >= ev["restored_step"] and cooldown[-1] < 17  # (async again after it)
    times = [steps[t]["time_s"] for t in range(18)]
    assert all(b > a for a, b in zip(times, times[1:]))
    r = ev["restored_step"]  # the discarded steps' time stays on the clock
    assert times[r] > times[r - 1] + ev["lost_time_s"] * 0.99
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["guard_events"] == 1 and summary["steps"] == 18
    # the discarded steps (pipedream's, and the tripped one) were all async: their time counts there
    assert ev["lost_by_phase"]["sync"] == 0 and ev["lost_by_phase"]["async"] == pytest.approx(ev["lost_time_s"])
    assert summary["phases"][SYNC]["time_s"] + summary["phases"]["async"]["time_s"] == pytest.approx(summary["time_s"])


def test_without_the_guard_divergence_stops_the_run(monkeypatch, tmp_path, capsys, uniform_clock):
    inject(monkeypatch, 6, "nan")
    assert main(["train", *GUARDED, "heuristic.guard=false", uniform_clock,
                 f"hydra.run.dir={tmp_path}"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert "training diverged at step 6" in err[-1]
    assert not (tmp_path / "summary.json").exists()


def test_no_checkpoint_is_written_from_diverged_weights(monkeypatch, tmp_path, uniform_clock, make_cfg):
    """Weights that went NaN while the loss still looked fine are refused at the next checkpoint;
    the checkpoints already written stay finite and loadable."""
    from adapipe_cli.runtime.errors import TrainingDiverged

    real = LocalRuntime.run_step

    def run_step(self, t):
        res = real(self, t)
        if t == 8:  # the last step before the checkpoint at 9
            with torch.no_grad():
                self.executors[0].params[0].fill_(float("nan"))
        return res

    monkeypatch.setattr(LocalRuntime, "run_step", run_step)
    # (train, not the CLI: the CLI's exit code and message for a diverged run are the test above's)
    with pytest.raises(TrainingDiverged, match="non-finite weights"):
        train(make_cfg(*GUARD, "heuristic.guard=false", "train.checkpoint_every=3", "train.keep_checkpoints=10",
                       uniform_clock), tmp_path)
    folders = checkpoint.complete(tmp_path)
    assert [f.name for f in folders] == ["step-0000003", "step-0000006"]
    for f in folders:
        state = checkpoint.read_part(f, checkpoint.verify(f), "pipeline")
        assert all(torch.isfinite(p).all() for st in state["stages"] for p in st["params"])
