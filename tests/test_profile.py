"""Cost profiles: refused when measured for another run, measured so that a busy machine cannot
inflate one kind of work unseen, and written by ``adapipe profile`` for runs and sweeps to share."""

from __future__ import annotations

import json

import pytest
import torch

from adapipe_cli.cli.main import main
from conftest import TINY

# what the tiny run of TINY with 2 stages is: gpt-nano reshaped, 2 microbatches of 4 sequences of 16 tokens
FITS = {"model": "gpt-nano", "stages": 2, "microbatch_size": 4, "seq_len": 16, "optimizer": "adamw",
        "model_shape": {"n_layer": 4, "n_head": 2, "d_model": 32, "d_ff": None}, "partition": "flops", "threads": 3}


def _profile_file(path, **meta):
    path.write_text(json.dumps({"forward": [1e-3, 1e-3], "backward": [2e-3, 2e-3], "update": [1e-4, 1e-4],
                                "copy": [5e-5, 5e-5], "predict": [3e-5, 3e-5], "act_bytes": 0.0, "meta": {**FITS, **meta}}))
    return path


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    """(profile file, run directory) of the refused runs below, the same for each: so are their
    overrides, composed once (tests/conftest.py keeps a compose per overrides: 0.4 s on 2 busy
    cores). Each test writes its own profile there; a refused run leaves no directory."""
    folder = tmp_path_factory.mktemp("refused")
    return folder / "p.json", folder / "r"


def test_a_profile_without_copy_and_prediction_costs_is_refused(refused, capsys):
    """A profile from before the clock charged weight copies and predictions would charge them
    nothing: refused in one line."""
    prof, run_dir = refused
    _profile_file(prof)
    data = json.loads(prof.read_text())
    del data["copy"], data["predict"]
    prof.write_text(json.dumps(data))
    assert main(["train", *TINY, "pipeline.stages=2", f"pipeline.profile={prof}", f"hydra.run.dir={run_dir}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no cost for weight copies and predictions" in err[0], err
    assert not run_dir.exists()


@pytest.mark.parametrize("meta,named", [
    ({"model": "gpt-micro"}, "model: gpt-micro in the profile, gpt-nano in this run"),
    ({"microbatch_size": 8}, "microbatch_size: 8 in the profile, 4 in this run"),
    ({"seq_len": 64}, "seq_len: 64 in the profile, 16 in this run"),
    ({"optimizer": "muon"}, "optimizer: muon in the profile, adamw in this run"),
    ({"model_shape": dict(FITS["model_shape"], d_model=128)}, "model.d_model: 128 in the profile, 32 in this run"),
])
def test_a_profile_measured_for_another_run_is_refused(meta, named, refused, capsys):
    prof, run_dir = refused
    _profile_file(prof, **meta)
    assert main(["train", *TINY, "pipeline.stages=2", f"pipeline.profile={prof}", f"hydra.run.dir={run_dir}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0] and "was measured for another run" in err[0], err


def test_a_fitting_profile_is_used_and_threads_do_not_matter(tmp_path):
    prof = _profile_file(tmp_path / "p.json")  # measured with 3 threads, run with 1
    old = _profile_file(tmp_path / "old.json")  # a profile of an older version: fewer meta entries
    data = json.loads(old.read_text())
    data["meta"] = {k: data["meta"][k] for k in ("model", "stages", "microbatch_size", "seq_len")}
    old.write_text(json.dumps(data))
    for p in (prof, old):
        run = tmp_path / p.stem
        assert main(["train", *TINY, "pipeline.stages=2", "train.max_steps=2", f"pipeline.profile={p}",
                     f"hydra.run.dir={run}"]) == 0
        assert json.loads((run / "profile.json").read_text())["forward"] == [1e-3, 1e-3]


class FakeClock:
    """A timer whose time moves only when the fake work says: ``work(name)`` returns a callable that
    advances it by the next of ``durations[name]`` (the first one is the warm-up call)."""

    def __init__(self, durations: dict):
        self.t, self.left = 0.0, {k: list(v) for k, v in durations.items()}

    def __call__(self) -> float:
        return self.t

    def work(self, name):
        def run(*_):
            self.t += self.left[name].pop(0)
        return run


def test_interleaved_timing_keeps_the_minimum_and_the_passes_spread():
    from adapipe_cli.runtime.profile import Work, time_interleaved

    # warm-up, then 2 passes x 3 rounds; B's second pass is slowed throughout, U has one slow round
    durations = {"F": [9, 4, 3, 5, 3, 4, 6], "B": [9, 8, 6, 7, 12, 13, 12], "U": [9, 2, 40, 2, 2, 2, 2]}
    clock = FakeClock(durations)
    built = []  # the backward's setup runs before each of its calls, off the clock
    work = {"F": clock.work("F"), "B": Work(clock.work("B"), setup=lambda: built.append(clock.t)), "U": clock.work("U")}
    t = time_interleaved(work, rounds=3, passes=2, timer=clock)
    assert t["F"] == (3, 0.0)  # min over every round; both passes' minima are 3
    assert t["B"] == (6, 12 / 6 - 1)  # pass minima 6 and 12
    assert t["U"] == (2, 0.0)  # one slow round changes nothing
    assert len(built) == 7 and all(not v for v in clock.left.values())  # every duration consumed, in order


def test_interleaved_timing_keeps_the_median_when_asked_and_the_minimum_by_default():
    from adapipe_cli.runtime.profile import time_interleaved

    # warm-up, then 2 passes x 3 rounds: F's rounds 4 3 8 | 5 3 6 (median of all 4.5, of the passes 4 and 5)
    durations = {"F": [9, 4, 3, 8, 5, 3, 6], "B": [9, 6, 6, 6, 6, 6, 6]}
    clock = FakeClock(durations)
    med = time_interleaved({k: clock.work(k) for k in durations}, rounds=3, passes=2, timer=clock, statistic="median")
    assert med["F"] == (4.5, 5 / 4 - 1) and med["B"] == (6, 0.0)
    clock = FakeClock(durations)
    low = time_interleaved({k: clock.work(k) for k in durations}, rounds=3, passes=2, timer=clock)
    assert low["F"] == (3, 0.0) and low["B"] == (6, 0.0)


def test_interleaved_timing_gives_each_calls_spread_when_asked(monkeypatch):
    """``cv``: the timed calls' sd over mean; ``cpu_cv`` the same of their thread CPU seconds (here
    a thread CPU clock that moves with the fake work at half its pace: a thread that computes for
    half of each call)."""
    import statistics
    from types import SimpleNamespace

    from adapipe_cli.runtime import profile
    from adapipe_cli.runtime.profile import time_interleaved

    # warm-up (left out), then F's rounds 4 3 8 | 5 3 6; B always 6
    durations = {"F": [9, 4, 3, 8, 5, 3, 6], "B": [9, 6, 6, 6, 6, 6, 6]}
    cv, cpu, cpu_cv = {}, {}, {}
    clock = FakeClock(durations)
    monkeypatch.setattr(profile, "time", SimpleNamespace(thread_time=lambda: clock.t / 2))
    time_interleaved({k: clock.work(k) for k in durations}, rounds=3, passes=2, timer=clock, cv=cv, cpu=cpu, cpu_cv=cpu_cv)
    calls = [4, 3, 8, 5, 3, 6]
    assert cv["F"] == pytest.approx(statistics.pstdev(calls) / statistics.fmean(calls)) and cv["B"] == 0.0
    assert cpu["F"] == 1.5 and cpu_cv == pytest.approx(cv)  # (the CPU clock runs at half the pace: the same spread)


def test_a_median_profile_holds_the_median_and_says_so_in_its_method(make_cfg):
    from adapipe_cli.runtime.profile import measure_profile
    from adapipe_cli.model.build import make_stages, model_config
    from adapipe_cli.optim import StageOptimizer

    # (one stage, the first of the 2-stage config the tests here share: composed once, tests/conftest.py)
    cfg = make_cfg("pipeline.stages=2")
    stages = make_stages(cfg, model_config(cfg, 64))[0][:1]
    x = torch.randint(0, 64, (2, 16))
    spread = [1, 3, 2]  # round r's every call lasts spread[r % 3] ms (median 2, min 1)
    durations = lambda i: 1e-3 * spread[(i // 13) % 3] if i >= 13 else 5e-3  # noqa: E731  (13 pieces of work; warm-up 5 ms)
    opt = lambda named: StageOptimizer(named, cfg.optim)  # noqa: E731
    med = measure_profile(stages, opt, x, x, reps=3, timer=_scripted_timer(durations), statistic="median")
    low = measure_profile(stages, opt, x, x, reps=3, timer=_scripted_timer(durations))
    approx = pytest.approx
    assert med.forward == approx([2e-3]) and med.backward == approx([2e-3]) and med.update == approx([2e-3])
    assert low.forward == approx([1e-3]) and low.backward == approx([1e-3]) and low.update == approx([1e-3])
    assert med.meta["statistic"] == "median" and med.meta["method"].startswith("median over 2 passes x 3")
    assert low.meta["statistic"] == "min" and low.meta["method"].startswith("min over 2 passes x 3")


def _scripted_timer(durations):
    """A timer for measure_profile: the i-th timed call lasts durations(i) seconds (warm-up calls
    are timed too: the first 3p calls)."""
    state = {"i": 0, "t": 0.0, "start": True}

    def timer():
        if state["start"]:
            state["start"] = False
            return state["t"]
        state["t"] += durations(state["i"])
        state["i"] += 1
        state["start"] = True
        return state["t"]
    return timer


@pytest.mark.parametrize("inflate", ["one round", "a whole pass", "the pass of a 1-round profile"])
def test_the_profile_warns_once_when_a_pass_of_one_kind_was_inflated(inflate, make_cfg):
    from adapipe_cli.runtime.profile import measure_profile
    from adapipe_cli.model.build import make_stages, model_config
    from adapipe_cli.optim import StageOptimizer

    cfg = make_cfg("pipeline.stages=2")
    stages, _ = make_stages(cfg, model_config(cfg, 64))
    x = torch.randint(0, 64, (2, 16))
    # per round: stage 0's F, B, U, copy, predict, I, W, accumulate, data, its F and B with 1 and 4
    # microbatches in flight, then stage 1's
    p, per = 2, 26
    rounds = 1 if "1-round" in inflate else 3
    base = {0: 1e-3, 1: 2e-3, 2: 5e-4, 3: 1e-4, 4: 5e-5, 5: 9e-4, 6: 1.1e-3, 7: 3e-5, 8: 7e-4,  # (the update slowed 40x: 19.5 ms more)
            9: 1e-3, 10: 2e-3, 11: 1e-3, 12: 2e-3}

    def durations(i):
        kind, stage = (i % per) % 13, (i % per) // 13
        r = i // per - 1  # -1: the warm-up
        slow = stage == 1 and kind == 2 and (r == 4 if inflate == "one round" else r >= rounds)
        return base[kind] * (40 if slow else 1)

    lines = []
    prof = measure_profile(stages, lambda named: StageOptimizer(named, cfg.optim), x, x, reps=rounds,
                           timer=_scripted_timer(durations), warn=lines.append)
    approx = pytest.approx
    assert prof.forward == approx([1e-3] * p) and prof.backward == approx([2e-3] * p)  # the minima
    assert prof.update == approx([5e-4] * p)
    assert prof.copy == approx([1e-4] * p) and prof.predict == approx([5e-5] * p)
    assert prof.input == approx([9e-4] * p) and prof.weight == approx([1.1e-3] * p)
    assert prof.accumulate == approx([3e-5] * p) and prof.data == [0.0] * p  # (no data source given: free)
    if inflate == "one round":
        assert lines == [] and prof.meta["spread"]["update"] == approx([0.0, 0.0], abs=1e-3)
    elif rounds == 1:  # no quiet minimum to compare with: recorded, not warned about
        assert lines == [] and prof.meta["spread"]["update"] == approx([0.0, 39.0], abs=1e-3)
    else:
        assert prof.meta["spread"]["update"] == approx([0.0, 39.0], abs=1e-3)
        assert prof.meta["spread"]["forward"] == approx([0.0, 0.0], abs=1e-3)
        assert len(lines) == 1 and "stage 1's update took 40.0x" in lines[0]
        assert "pipeline.threads=1" in lines[0] and "adapipe profile" in lines[0] and "pipeline.profile=FILE" in lines[0]


def test_adapipe_profile_writes_a_profile_that_runs_share(tmp_path, capsys):
    from adapipe_cli.simulator.clock import CostProfile

    out = tmp_path / "shared" / "profile.json"
    assert main(["profile", *TINY, "pipeline.stages=2", "--out", str(out)]) == 0
    cap = capsys.readouterr()
    assert cap.out.strip() == str(out) and f"pipeline.profile={out}" in cap.err
    prof = CostProfile.load(out)
    assert prof.stages == 2 and all(t > 0 for t in prof.forward + prof.backward + prof.update)
    assert {k: prof.meta[k] for k in ("model", "stages", "microbatch_size", "seq_len")} == \
        {"model": "gpt-nano", "stages": 2, "microbatch_size": 4, "seq_len": 16}
    assert set(prof.meta["spread"]) == {"forward", "backward", "update", "copy", "predict", "input", "weight", "accumulate", "data"}
    assert all(t > 0 for t in prof.copy + prof.predict + prof.accumulate + prof.data) and prof.memory["params"][0] > 0
    for seed in (0, 1):  # two runs on the one clock: the file's numbers, not their own
        run = tmp_path / f"run{seed}"
        assert main(["train", *TINY, "pipeline.stages=2", "train.max_steps=2", f"seed={seed}",
                     f"pipeline.profile={out}", f"hydra.run.dir={run}"]) == 0
        assert CostProfile.load(run / "profile.json").forward == prof.forward
    capsys.readouterr()
    assert main(["train", *TINY, "pipeline.stages=2", "model.d_model=64", f"pipeline.profile={out}",
                 f"hydra.run.dir={tmp_path / 'other'}"]) == 2  # another model: refused
    assert "model.d_model: 32 in the profile, 64 in this run" in capsys.readouterr().err


@pytest.mark.parametrize("args,message", [
    (["pipeline.stages=0"], "pipeline.stages"),
    (["--out"], "--out needs a file name"),
    (["pipeline.stagez=2"], "unknown config key 'pipeline.stagez'"),
])
def test_adapipe_profile_bad_input_is_one_line(args, message, capsys):
    assert main(["profile", *TINY, *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_a_sweep_uses_a_profile_put_in_place_by_adapipe_profile(tmp_path, capsys, monkeypatch):
    from matplotlib.figure import Figure

    from adapipe_cli.simulator.clock import CostProfile
    from test_sweep import TINY_GRID

    # the report's plots are built but not drawn or written, as a run's (tests/conftest.py): this test
    # checks the profile; tests/test_sweep.py checks the report's files
    monkeypatch.setattr(Figure, "tight_layout", lambda self, *a, **k: None)
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: None)

    out = tmp_path / "sw"
    shape = [a for a in TINY_GRID if a.startswith(("model.", "data.vocab_size"))]
    placed = out / "profiles" / "p2_mb2.json"  # the depth's profile where the sweep keeps it
    # (one round a pass, as TINY_GRID's: the rounds change how steady the numbers are, not whether the
    # profile fits the sweep's runs, nor that they use it)
    assert main(["profile", *shape, "pipeline.stages=2", "pipeline.microbatches=1", "train.batch_size=2",
                 "pipeline.threads=1", "pipeline.profile_reps=1", "--out", str(placed)]) == 0
    assert main(["sweep", *TINY_GRID, "sweep.only=[sync]", f"sweep.dir={out}"]) == 0
    assert f"profile p2: {placed} (there already)" in capsys.readouterr().err
    assert CostProfile.load(out / "p2_b4_sync_s0" / "profile.json").forward == CostProfile.load(placed).forward


def test_microsecond_jitter_does_not_hide_a_slow_forwards_spread():
    """The warning looks at the work whose spread matters (over 25% and 1 ms): a weight copy of a
    few microseconds jittering 10x must not mask a forward that took 1.5x in one pass."""
    from adapipe_cli.runtime.profile import unsteady

    spread = {"forward": [0.0, 0.5], "copy": [10.0, 0.0]}
    times = {"forward": [0.01, 0.01], "copy": [2e-6, 2e-6]}
    line = unsteady(spread, times)
    assert line is not None and "stage 1's forward took 1.5x" in line
    assert unsteady({"copy": [10.0]}, {"copy": [2e-6]}) is None
    assert "other work on this machine?" in line


def test_an_unsteady_profile_of_workers_sharing_cores_names_the_sharing():
    """Dist workers that need more threads than the machine has cores take turns on them: the
    warning and its advice name that, not other work, and a launch that shares cores says so once."""
    from adapipe_cli.runtime.dist import shared_cores
    from adapipe_cli.runtime.profile import unsteady

    line = unsteady({"forward": [0.0, 2.0]}, {"forward": [0.01, 0.01]}, shared=(4, 2))
    assert "stage 1's forward took 3.0x" in line and "(the workers' 4 threads share 2 cores)" in line
    assert "other work" not in line and "at most 2 single-threaded stages" in line
    assert shared_cores(4, 1, "gloo", 2) == (4, 2) and shared_cores(2, 2, "gloo", 2) == (4, 2)
    assert shared_cores(2, 1, "gloo", 2) is None and shared_cores(1, 2, "gloo", 2) is None  # (fits)
    assert shared_cores(8, 1, "nccl", 2) is None  # (a GPU per worker: the cores only launch its kernels)


def test_dist_workers_time_each_stage_beside_its_peers_and_the_prediction_uses_it(make_cfg):
    """Two workers (threads) measure their stages as a dist run's do: from a barrier, each going on
    computing until both are done (worker.all_measured). A timed call costs twice its alone cost
    while the other worker computes. Worker 0 times 1 round per pass, worker 1 (slowed a little
    in real time, so worker 0 is done long before) 3: every one of worker 1's rounds still sees
    worker 0 computing, so both profiles hold the together costs, and the simulator's 1F1B step
    from the joined profile is (m + p - 1)(F + B) at those costs, twice the alone one's."""
    import threading
    import time as clock

    from adapipe_cli.model.build import make_stages, model_config
    from adapipe_cli.optim import StageOptimizer
    from adapipe_cli.runtime.dist_transport import Board
    from adapipe_cli.runtime.profile import join_profiles, measure_profile
    from adapipe_cli.runtime.worker import all_measured
    from adapipe_cli.schedules import SYNC, Plan, ScheduleSpec
    from adapipe_cli.simulator.simulate import simulate

    cfg = make_cfg("pipeline.stages=2")
    stages, _ = make_stages(cfg, model_config(cfg, 64))
    x = torch.randint(0, 64, (2, 16))
    # F, B, U, copy, predict, I, W, accumulate, data, then F and B with 1 and 4 microbatches in flight
    alone = [1e-3, 2e-3, 5e-4, 1e-4, 5e-5, 9e-4, 1.1e-3, 3e-5, 7e-4, 1e-3, 2e-3, 1e-3, 2e-3]
    busy = [False, False]  # worker r computes (from the barrier until its measurement returns)
    start, parts = threading.Barrier(2), [None, None]
    server = Board("127.0.0.1", 0, "test", server=True)

    def worker(r: int, rounds: int) -> None:
        state = {"i": 0, "t": 0.0, "start": True}

        def timer():  # the i-th timed call lasts its kind's cost, doubled while the other worker computes
            if state["start"]:
                state["start"] = False
                return state["t"]
            if r == 1:
                clock.sleep(0.002)
            state["t"] += alone[state["i"] % 13] * (2 if busy[1 - r] else 1)
            state["i"] += 1
            state["start"] = True
            return state["t"]

        busy[r] = True
        start.wait()
        parts[r] = measure_profile([stages[r]], lambda named: StageOptimizer(named, cfg.optim), x, x, reps=rounds,
                                   timer=timer, until=all_measured(server.client(), 2))
        busy[r] = False

    threads = [threading.Thread(target=worker, args=(r, n)) for r, n in ((0, 1), (1, 3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    prof = join_profiles(parts)
    approx = pytest.approx
    assert prof.forward == approx([2e-3] * 2) and prof.backward == approx([4e-3] * 2)  # together: twice alone
    assert prof.update == approx([1e-3] * 2) and prof.weight == approx([2.2e-3] * 2)
    p, m = 2, 4
    prof.update, prof.data, prof.accumulate = [0.0] * p, [0.0] * p, [0.0] * p  # the closed form's step: F and B only
    spec = ScheduleSpec(p, m, "1f1b", "stash")
    step = simulate(spec, Plan(3, [SYNC] * 3), prof, record=False).step_time
    assert step == approx((m + p - 1) * (2e-3 + 4e-3))


def test_the_in_flight_table_times_each_depth_with_that_many_graphs_alive(make_cfg):
    """The profile's ``held`` table: per stage the forward's and backward's time with 4
    microbatches in flight over their time with one, from the same rounds, never below 1 (scripted
    times: forward 1 and 0.95 ms at depths 1 and 4, backward 2 and 2.4 ms). And the timed calls do
    hold d graphs: before a timed forward d - 1 others are alive, before a timed backward d - 1
    besides its own."""
    from adapipe_cli.runtime.profile import HELD_DEPTHS, Work, measure_profile, stage_work
    from adapipe_cli.model.build import make_stages, model_config
    from adapipe_cli.optim import StageOptimizer

    cfg = make_cfg("pipeline.stages=2")
    stages, _ = make_stages(cfg, model_config(cfg, 64))
    x = torch.randint(0, 64, (2, 16))
    opt = lambda named: StageOptimizer(named, cfg.optim)  # noqa: E731
    assert HELD_DEPTHS == (1, 4)
    per_stage = [1e-3, 2e-3, 5e-4, 1e-4, 5e-5, 9e-4, 1.1e-3, 3e-5, 7e-4, 1e-3, 2e-3, 0.95e-3, 2.4e-3]
    prof = measure_profile(stages, opt, x, x, reps=3, timer=_scripted_timer(lambda i: per_stage[i % 13]))
    assert prof.held["depths"] == [1, 4]
    assert prof.held["forward"] == [pytest.approx([1.0, 1.0])] * 2
    assert prof.held["backward"] == [pytest.approx([1.0, 1.2])] * 2
    for s in (0, 1):  # (the first stage has no input gradient, the last ends in the loss)
        work, _ = stage_work(stages[s], opt, x, x)
        for d in HELD_DEPTHS:
            fwd, bwd = work[("held_forward", d)], work[("held_backward", d)]
            seen = []
            Work(lambda q: (seen.append(len(q)), fwd.run(q)), setup=fwd.setup)(lambda: 0.0)
            Work(lambda y: (seen.append(len(bwd.setup.__defaults__[0]) + 1), bwd.run(y)), setup=bwd.setup)(lambda: 0.0)
            assert seen == [d - 1, d]


def test_the_profile_times_the_held_out_signals_forward(make_cfg):
    """With ``signal_rows`` the profile times each stage's forward of AdaPipe's held-out signal:
    that many rows, no graph kept for a backward, the loss at the last stage; its rows go in the
    meta. Without, the profile has none (the clock then scales the training forward). Joined
    per-stage parts keep it only if every part has it."""
    from adapipe_cli.runtime.profile import join_profiles, measure_profile, stage_work
    from adapipe_cli.model.build import make_stages, model_config
    from adapipe_cli.optim import StageOptimizer

    cfg = make_cfg("pipeline.stages=2")
    stages, _ = make_stages(cfg, model_config(cfg, 64))
    x = torch.randint(0, 64, (2, 16))
    opt = lambda named: StageOptimizer(named, cfg.optim)  # noqa: E731
    for s, rows in ((0, 5), (1, 3)):
        out = stage_work(stages[s], opt, x, x, signal_rows=rows)[0]["signal"].run()
        if s == 0:
            assert out.shape[:2] == (rows, 16) and not out.requires_grad
        else:  # (the last stage: the loss over the signal's rows)
            assert out.dim() == 0 and not out.requires_grad
    prof = measure_profile(stages, opt, x, x, reps=1, signal_rows=3)
    assert len(prof.signal) == 2 and all(c > 0 for c in prof.signal) and prof.meta["signal_rows"] == 3
    assert prof.signal_costs(6) == pytest.approx([2 * c for c in prof.signal])
    plain = measure_profile(stages, opt, x, x, reps=1)
    assert plain.signal == [] and "signal_rows" not in plain.meta
    parts = [measure_profile([st], opt, x, x, reps=1, signal_rows=3) for st in stages]
    assert join_profiles(parts, rounds=1).signal == [parts[0].signal[0], parts[1].signal[0]]
    mixed = join_profiles([parts[0], measure_profile([stages[1]], opt, x, x, reps=1)], rounds=1)
    assert mixed.signal == [] and "signal_rows" not in mixed.meta


def test_the_cpu_time_of_each_call_is_the_threads_own_not_its_wait():
    """``time_interleaved(cpu=...)`` keeps the same statistic of each call's thread CPU seconds:
    a call that sleeps has a wall time but almost no CPU time, one that computes has both."""
    import time

    from adapipe_cli.runtime.profile import time_interleaved

    def spin():  # (4 ms on both clocks: its CPU seconds, held to its wall seconds, are at least that)
        c0, t0 = time.thread_time(), time.perf_counter()
        while time.thread_time() - c0 < 0.004 or time.perf_counter() - t0 < 0.004:
            pass

    cpu: dict = {}
    t = time_interleaved({"sleep": lambda: time.sleep(0.005), "spin": spin}, rounds=2, passes=2, cpu=cpu)
    assert t["sleep"][0] >= 0.005 and cpu["sleep"] < 0.002
    assert cpu["spin"] >= 0.004  # (and at most its wall seconds, per call: the clamp's own test, below)
    assert time_interleaved({"sleep": lambda: time.sleep(0.001)}, rounds=1, passes=1).keys() == {"sleep"}


def test_a_thread_clock_that_reads_more_than_the_call_lasted_is_held_to_the_call(monkeypatch):
    """One thread cannot compute for longer than a call lasts: where the thread clock reads more
    over a call than the timer (two kernel clocks that disagree; seen once in CI, over a
    backward), its CPU seconds are the call's seconds; where it reads less, they are as read."""
    import itertools

    from adapipe_cli.runtime import profile

    for step, expected in ((0.003, 0.001), (0.0004, 0.0004)):
        reads = itertools.count(0.0, step)  # the thread clock moves ``step`` per read
        monkeypatch.setattr(profile.time, "thread_time", lambda: next(reads))
        ticks = itertools.count(0.0, 0.001)  # the timer moves 1 ms per read
        cpu: list[float] = []
        t = profile.Work(lambda: None)(lambda: next(ticks), cpu)
        assert t == 0.001 and cpu == [pytest.approx(expected)]


def test_a_profile_measured_with_cpu_time_holds_it_per_kind_and_joins_it_per_stage(make_cfg):
    """``measure_profile(cpu_time=True)`` puts each kind's thread CPU seconds in ``meta["cpu"]``
    (at most its wall seconds: the same statistic, the minimum, over the same calls); joined
    per-stage parts keep them in stage order, and a profile measured without has none."""
    from adapipe_cli.runtime.profile import KINDS, join_profiles, measure_profile
    from adapipe_cli.model.build import make_stages, model_config
    from adapipe_cli.optim import StageOptimizer

    cfg = make_cfg("pipeline.stages=2")
    stages, _ = make_stages(cfg, model_config(cfg, 64))
    x = torch.randint(0, 64, (2, 16))
    opt = lambda named: StageOptimizer(named, cfg.optim)  # noqa: E731
    prof = measure_profile(stages, opt, x, x, reps=2, cpu_time=True, signal_rows=3)
    cpu = prof.meta["cpu"]
    assert set(cpu) == {*KINDS, "signal"} and all(len(v) == 2 for v in cpu.values())
    assert cpu["data"] == [0.0, 0.0]  # (no data source given: data costs nothing, as its wall time)
    for kind in ("forward", "backward", "update", "input", "weight", "copy", "predict", "accumulate"):
        wall = getattr(prof, kind)
        # (each call's CPU seconds are held to its wall seconds, so the same statistic over the same
        # calls is too: this holds unless a kind's or a stage's figures are joined to another's)
        assert all(0 <= c <= w for c, w in zip(cpu[kind], wall)), kind
    assert cpu["forward"][0] > 0 and cpu["backward"][1] > 0
    assert "cpu" not in measure_profile(stages, opt, x, x, reps=1).meta
    parts = [measure_profile([st], opt, x, x, reps=1, cpu_time=True) for st in stages]
    joined = join_profiles(parts, rounds=1).meta["cpu"]
    assert joined["forward"] == [parts[0].meta["cpu"]["forward"][0], parts[1].meta["cpu"]["forward"][0]]
    assert "cpu" not in join_profiles([parts[0], measure_profile([stages[1]], opt, x, x, reps=1)], rounds=1).meta


def test_a_profile_measured_with_its_spread_holds_it_per_kind_and_joins_it_per_stage(make_cfg):
    """``measure_profile(spread_cv=True)``: each kind's calls' sd over mean in ``meta["cv"]``, per
    stage, joined in stage order; simulator.jitter reads it by action kind."""
    from adapipe_cli.runtime.profile import KINDS, join_profiles, measure_profile
    from adapipe_cli.model.build import make_stages, model_config
    from adapipe_cli.optim import StageOptimizer
    from adapipe_cli.simulator.jitter import cv_from_profile

    cfg = make_cfg("pipeline.stages=2")
    stages, _ = make_stages(cfg, model_config(cfg, 64))
    x = torch.randint(0, 64, (2, 16))
    opt = lambda named: StageOptimizer(named, cfg.optim)  # noqa: E731
    quiet = lambda line: None  # noqa: E731  (real calls on a busy machine: an unsteady warning is no failure here)
    parts = [measure_profile([st], opt, x, x, reps=3, spread_cv=True, warn=quiet) for st in stages]
    assert set(parts[0].meta["cv"]) == set(KINDS) and all(c >= 0 for v in parts[0].meta["cv"].values() for c in v)
    assert parts[0].meta["cv"]["forward"][0] > 0  # (real calls vary)
    joined = join_profiles(parts, rounds=1)
    assert joined.meta["cv"]["backward"] == [parts[0].meta["cv"]["backward"][0], parts[1].meta["cv"]["backward"][0]]
    cv = cv_from_profile(joined)
    assert cv["F"] == joined.meta["cv"]["forward"] and cv["U"] == joined.meta["cv"]["update"] and set(cv) == set("FBIWU")
    assert "cv" not in measure_profile([stages[0]], opt, x, x, reps=1).meta and cv_from_profile(parts[0]) is not None
    assert cv_from_profile(measure_profile([stages[0]], opt, x, x, reps=1)) is None
    # with cpu_time, the thread CPU seconds' spread too, in meta["cpu_cv"], joined the same way
    assert "cpu_cv" not in parts[0].meta
    parts = [measure_profile([st], opt, x, x, reps=3, spread_cv=True, cpu_time=True, warn=quiet) for st in stages]
    joined = join_profiles(parts, rounds=1)
    assert set(joined.meta["cpu_cv"]) == set(KINDS) and all(c >= 0 for v in joined.meta["cpu_cv"].values() for c in v)
    assert joined.meta["cpu_cv"]["forward"] == [parts[0].meta["cpu_cv"]["forward"][0], parts[1].meta["cpu_cv"]["forward"][0]]
    assert cv_from_profile(joined, "cpu_cv")["B"] == joined.meta["cpu_cv"]["backward"]


def test_the_profiled_update_steps_on_a_gradient_of_the_stages_own_backward(make_cfg):
    """The profile times the optimizer as a run uses it, not on zero gradients (with which Adam's
    second moment stays 0, and torch's sqrt of zeros is many times slower than of other values
    on some CPUs: the update was overcharged): one untimed step on a dense gradient first, so every
    moment is nonzero (a run's are wherever its gradients have been), then each timed update on a
    fresh copy of the stage's own backward's gradient on the profile's microbatch (the clipping
    multiply halves it in place). A recording optimizer against a gradient of a copy of the stage
    computed here (one stage: its input and loss are the microbatch's)."""
    import copy

    from adapipe_cli.runtime.profile import stage_work
    from adapipe_cli.model import lm_loss
    from adapipe_cli.model.build import make_stages, model_config

    class Recording:
        def __init__(self, named):
            self.params, self.steps = [p for _, p in named], []

        def step(self, lr_scale, beta1=None):
            self.steps.append([p.grad.clone() for p in self.params])
            for p in self.params:
                p.grad = None

    cfg = make_cfg("pipeline.stages=1")
    (stage,), _ = make_stages(cfg, model_config(cfg, 64))
    x = torch.randint(0, 64, (2, 16))
    made = []
    work, _ = stage_work(stage, lambda named: made.append(Recording(named)) or made[-1], x, x, grad_clip=1.0)
    opt = made[0]
    assert len(opt.steps) == 1  # the dense step, made before any timing
    assert all(bool((g != 0).all()) for g in opt.steps[0])
    ref = copy.deepcopy(stage)
    want = torch.autograd.grad(lm_loss(ref(x), x), list(ref.parameters()), allow_unused=True)
    for call in (1, 2):
        work["update"](lambda: 0.0)
        assert len(opt.steps) == 1 + call
        for got, w in zip(opt.steps[-1], want):
            assert torch.allclose(got, 0.5 * w, rtol=1e-5, atol=1e-8), call
    assert sum(int((g != 0).sum()) for g in opt.steps[-1]) > 0.5 * sum(g.numel() for g in opt.steps[-1])
