"""AdaPipe: phase switches are exact, recorded and plotted; the heuristics switch end to end."""

from __future__ import annotations

import copy
import json

import pytest

from adapipe_cli.schedules import ASYNC, SYNC
from adapipe_cli.train.loop import train
from helpers import local_runtime, make_data, optim_cfg, run_losses


def test_switch_continuity_sync_then_async():
    """adapipe with the plan "sync for k steps, then async" gives the same per-step losses as a sync
    run of k steps followed by an async run started from that state."""
    k, n = 4, 10
    data = make_data(n)
    ocfg = optim_cfg(decay="constant", warmup_steps=0)  # the second run restarts its step count
    mixed = run_losses(local_runtime(4, 2, [SYNC] * k + [ASYNC] * (n - k), data, ocfg=ocfg), n)

    first = local_runtime(4, 2, [SYNC] * k, data, ocfg=copy.deepcopy(ocfg))
    before = run_losses(first, k)
    second = local_runtime(4, 2, [ASYNC] * (n - k), data[k:], ocfg=copy.deepcopy(ocfg))
    for src, dst in zip(first.executors, second.executors):
        dst.module.load_state_dict(src.module.state_dict())
        dst.opt.load_state_dict(src.opt.state_dict())
        # the last sync step's exact gradient norms (async clipping), in the second run's step numbers
        dst.known = [(step - k, sq) for step, sq in src.known]
    after = run_losses(second, n - k)
    assert mixed == before + after


def test_async_to_sync_drains_and_releases_stashed_versions():
    phases = [ASYNC] * 5 + [SYNC] * 2
    rt = local_runtime(4, 1, phases, make_data(len(phases)))
    held = []
    for t in range(len(phases)):
        rt.run_step(t)
        held.append(max(ex.versions_held() for ex in rt.executors))
        if phases[t] == SYNC:  # flushed: nothing in flight, only the live weights
            assert all(not ex.inflight and not ex.copies and not ex.grads for ex in rt.executors)
    assert max(held[:4]) > 1 and held[-1] == 1


# no sync warm-up: 120 steps are shorter than AdamW's default 300
TINY_ADAPIPE = ["schedule=adapipe", "pipeline.stages=4", "pipeline.microbatches=1", "optim.lr=3e-3", "heuristic.start=sync",
                "heuristic.sync_warmup=0", "heuristic.window=10", "heuristic.probe_steps=10", "heuristic.probe_every=40",
                "train.max_steps=120", "train.eval_every=10", "train.target_ppl=6",
                "train.stop_at_target=true",  # (at step 80: the switches and the phases' shares are decided by then)
                # the held-out loss, of one row (its forward, on the clock, an eighth of a microbatch's), so the
                # charged signal is exercised (with the training loss, the default, gain adopts async too, at
                # step 61: E x R = 3.6, sd 1.4; before its switch costs counted only jumps beyond their noise,
                # that probe's noisy jumps kept it in sync)
                "heuristic.signal=heldout", "heuristic.signal_tokens=16"]


def tiny_adapipe_run(heuristic, extra, run, compose):
    """A TINY_ADAPIPE run of ``heuristic`` in ``run`` on a fixed clock (the decisions must not depend on
    this machine's load), its config where ``adapipe train`` (Hydra) writes it; its summary."""
    from omegaconf import OmegaConf

    from adapipe_cli.simulator.clock import CostProfile

    run.mkdir(parents=True)
    profile = run.parent / f"{run.name}-uniform.json"
    CostProfile.uniform(4, forward=0.01, backward=0.02, update=0.001).save(profile)
    cfg = compose(*TINY_ADAPIPE, f"heuristic={heuristic}", f"pipeline.profile={profile}", *extra)
    summary = train(cfg, run)
    (run / ".hydra").mkdir()
    OmegaConf.save(cfg, run / ".hydra" / "config.yaml")
    return summary


def gain_run(tmp_path_factory):
    """The gain case's run (its plots drawn and written), trained once per session: the test below and
    tests/test_replay_heuristic.py (its replays) read the same run, 4-7 s of training on 2 busy cores.
    It lives in the session's temporary folder (its two modules are two module objects here: the
    folder, not a variable, is what they share); a run left unfinished is trained again."""
    import shutil

    from adapipe_cli.cli.compose import compose_config
    from conftest import TINY

    base = tmp_path_factory.getbasetemp()
    run, done = base / "adapipe-gain-run", base / "adapipe-gain-run.summary.json"
    if not done.is_file():
        shutil.rmtree(run, ignore_errors=True)
        with pytest.MonkeyPatch.context() as m:  # the cache folder the tests' runs use (tests/conftest.py)
            m.setenv("ADAPIPE_CACHE", str(base / "adapipe-cache"))
            summary = tiny_adapipe_run("gain", [], run, lambda *o: compose_config([*TINY, *o]))
        done.write_text(json.dumps(summary))
    return run, json.loads(done.read_text())


# rate asks its difference to be beyond 2 standard errors, which a probe of 10 steps here just misses
# (async 0.46/s against sync 0.13/s, se 0.17): it probes for 12. gain is fast, rate and goodput slow
# (make test-all): the loop drives every heuristic through the same calls, and rate's and goodput's
# own decisions stay fast on synthetic streams in tests/test_heuristics.py
@pytest.mark.plots  # checks the plot files: drawn and written (tests/conftest.py)
@pytest.mark.parametrize("heuristic, extra", [pytest.param("rate", ["heuristic.probe_steps=12"], marks=pytest.mark.slow),
                                              pytest.param("goodput", [], marks=pytest.mark.slow), ("gain", [])])
def test_heuristics_switch_and_reach_the_target(heuristic, extra, make_cfg, tmp_path, tmp_path_factory):
    """On 4 stages with one microbatch async has 4x sync's throughput on the pipeline clock and
    loses little per step on this data: every heuristic must adopt async, and reach the target."""
    if heuristic == "gain":  # (the run tests/test_replay_heuristic.py replays)
        tmp_path, s = gain_run(tmp_path_factory)
    else:
        s = tiny_adapipe_run(heuristic, extra, tmp_path / "run", make_cfg)
        tmp_path = tmp_path / "run"
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    switches = [r for r in recs if r.get("event") == "switch"]
    adopted = [r for r in switches if r["to"] == ASYNC and "probe" not in r["reason"]]
    assert adopted, [r["reason"] for r in switches]
    assert {"step", "from", "to", "reason"} <= switches[0].keys()
    assert s["switches"] == len(switches)
    assert s["time_to_target_s"] is not None and s["stopped"] == "target"
    assert s["phases"]["async"]["steps"] > s["phases"]["sync"]["steps"]
    assert s["phases"]["async"]["steps"] + s["phases"]["sync"]["steps"] == s["steps"]
    assert sum(p["time_s"] for p in s["phases"].values()) == pytest.approx(s["time_s"])
    assert s["tokens"] == s["steps"] * 8 * 16
    steps = [r for r in recs if r["kind"] == "step"]
    for sw in switches:  # each switch takes effect at the step it names
        assert steps[sw["step"]]["phase"] == sw["to"] and steps[sw["step"] - 1]["phase"] == sw["from"]
    assert (tmp_path / "phases.png").stat().st_size > 0


def test_fixed_plan_through_train(make_cfg, tmp_path):
    from conftest import fixed_clock

    # (the plan's phases do not depend on the clock: none is measured)
    s = train(make_cfg("schedule=adapipe", "heuristic=fixed", "heuristic.plan=[[sync,5],[async,null]]",
                       "pipeline.stages=2", "pipeline.microbatches=2", fixed_clock(tmp_path, 2)), tmp_path / "run")
    assert s["phases"]["sync"]["steps"] == 5 and s["phases"]["async"]["steps"] == 7 and s["switches"] == 1


def test_the_held_out_signal_is_charged_at_the_profiles_rows_or_scaled_with_a_warning(make_cfg, tmp_path, capsys):
    """A run whose held-out signal has the rows the profile timed it at is charged that, silently;
    one of another size is charged the cost scaled linearly, and one warning line says so. The
    training loss as the signal costs nothing: that run is the fixed plan's clock exactly."""
    from adapipe_cli.simulator.clock import CostProfile

    base = ["schedule=adapipe", "heuristic=fixed", "heuristic.plan=[[sync,null]]", "pipeline.stages=2",
            "pipeline.microbatches=1", "train.max_steps=4", "train.eval_every=2"]
    prof = CostProfile.uniform(2, forward=0.01, backward=0.02, update=0.001)
    prof.signal, prof.meta = [0.005, 0.007], {"signal_rows": 4}
    path = tmp_path / "p.json"
    prof.save(path)
    runs, composed = {}, make_cfg(*base, f"pipeline.profile={path}")  # (composed once: 0.3-1 s a compose)
    for name, signal in (("same", {"signal": "heldout", "signal_tokens": 64}),
                         ("double", {"signal": "heldout", "signal_tokens": 128}), ("train", {"signal": "train"})):
        cfg = copy.deepcopy(composed)
        cfg.heuristic.update(signal)
        rows = cfg.heuristic.signal_tokens // cfg.model.block_size
        capsys.readouterr()
        runs[name] = (train(cfg, tmp_path / name)["time_s"], rows, capsys.readouterr().err)
    (same, r1, err1), (double, r2, err2), (free, _, err3) = runs["same"], runs["double"], runs["train"]
    assert r1 == 4 and r2 == 8
    assert "held-out signal" not in err1 + err3
    assert err2.count("timed the held-out signal's forward at 4 rows and this run's is 8") == 1
    # its sync phase (ZB-H1) with one microbatch on 2 stages: each step after the first pays stage 0's share, as 1F1B (test_simulator)
    assert same == pytest.approx(free + 3 * 0.005) and double == pytest.approx(free + 3 * 0.010)
