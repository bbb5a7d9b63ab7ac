"""The distributed runtime: worker processes on gloo give the local runtime's numbers; the
worker's action order cannot deadlock; faults end the run in one line and leave no process;
torchrun; gradients equal torch.distributed.pipelining's."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from adapipe_cli.config import ConfigError
from adapipe_cli import checkpoint
from adapipe_cli.runtime.action_times import warm_steps
from adapipe_cli.simulator.clock import CostProfile
from adapipe_cli.runtime.device import usable_cores
from adapipe_cli.runtime.dist import STARTUP_S, WorkerFailed, choose_backend, nonfinite_part
from adapipe_cli.schedules.walk import walk
from adapipe_cli.runtime.worker import EvalOrder
from adapipe_cli.schedules import BACKWARD, EVAL, FORWARD, INPUT, SYNC, UPDATE, WEIGHT, Plan, ScheduleSpec, StageProgram
from adapipe_cli.train.loop import train
from conftest import TINY, drawn_plots, fixed_clock
from pipelining_rank import pipelining_rank
from procs import ENV, alive, comm, descendants, records, run_ranks



def local_and_dist(make_cfg, tmp_path, *overrides, drawn: bool = False, local_clock: bool = False):
    """Runs the same config locally and distributed (one thread per process); their records.
    ``drawn``: the dist run draws and writes its plots; ``local_clock``: the local run is on a
    uniform cost profile rather than measuring one (the numbers compared do not depend on it)."""
    local_only = []
    if local_clock:
        stages = int(next(o for o in overrides if o.startswith("pipeline.stages=")).split("=")[1])
        local_only = [fixed_clock(tmp_path, stages)]
    local = train(make_cfg(*overrides, *local_only), tmp_path / "local")
    with drawn_plots() if drawn else contextlib.nullcontext():
        dist = train(make_cfg(*overrides, "pipeline.runtime=dist", "pipeline.timeout_s=60"), tmp_path / "dist")
    return (local, *records(tmp_path / "local")), (dist, *records(tmp_path / "dist"))


def rss_now_mb() -> float:
    """This process's resident set size now (VmRSS), in MB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


# -- exactness ---------------------------------------------------------------------------------
# Bitwise, not merely close: each worker runs its stage's actions in the local runtime's order of
# operations, with one thread, and a collective sums in stage order.
SWITCHES = "heuristic.plan=[[async,3],[sync,2],[async,null]]"  # decided by the driver, applied by every worker
# the fast case's sync stretches are 1F1B (AdaPipe's sync schedule) and its async ones PipeDream;
# m < p: evaluations moved before updates
FAST = [("adapipe", 4, 2, SWITCHES)]
SLOW = [("1f1b", 2, 2, ""), ("zbh1", 2, 2, ""), ("adapipe", 3, 2, SWITCHES + " schedule.sync=zbh1"),
        ("zbh2", 3, 8, "optim.grad_clip=0"), ("zbh2", 2, 4, ""), ("adapipe", 3, 2, SWITCHES + " schedule.sync=zbh2 optim.grad_clip=0"), ("gpipe", 2, 2, ""), ("pipedream", 2, 2, ""), ("2bw", 2, 2, ""), ("1f1b", 4, 4, ""), ("gpipe", 4, 2, ""),
        ("pipedream", 4, 2, ""), ("2bw", 4, 4, ""),
        # interleaved 1F1B: two chunks per worker (chunk c on rank c % p), tied embeddings across ranks
        ("interleaved", 2, 4, "model.tie_embeddings=true"), ("interleaved", 3, 6, "model.n_layer=6 train.batch_size=12")]


@pytest.mark.parametrize("schedule,stages,micro,extra", FAST + [pytest.param(*c, marks=pytest.mark.slow) for c in SLOW])
def test_dist_losses_equal_local(make_cfg, tmp_path, capsys, schedule, stages, micro, extra):
    rss_before_mb = rss_now_mb()
    (ls, lsteps, levals), (ds, dsteps, devals) = local_and_dist(
        make_cfg, tmp_path, f"schedule={schedule}", f"pipeline.stages={stages}", f"pipeline.microbatches={micro}",
        *([*extra.split(), "heuristic=fixed"] if extra else []),  # (the default heuristic follows each runtime's clock)
        drawn=True,  # (the dist run's plot files are checked: the local run's are not drawn)
        local_clock=schedule != "interleaved")  # (its numbers do not depend on its clock: no profile to measure)
    # one worker of one thread per stage: they share the cores where there are more stages than cores
    assert capsys.readouterr().err.count(f"{stages} workers x 1 thread share") == (stages > usable_cores())
    assert dsteps == lsteps
    assert devals == levals and [v for v, _ in devals] == [0, 4, 8, 12]
    assert (ds["runtime"], ds["backend"], ds["clock"]) == ("dist", "gloo", "wall")
    assert ds["final_val_loss"] == ls["final_val_loss"] and ds["time_s"] > 0
    n = stages * (2 if schedule == "interleaved" else 1)  # virtual stages (schedule.chunks=2)
    assert [m["stage"] for m in ds["memory"]] == list(range(n))
    assert [m["rank"] for m in ds["memory"]] == [c % stages for c in range(n)]
    # peak RSS in MB: each worker's (torch alone is > 50 MB), one per worker (its chunks' rows share
    # it); the driver's is this process's peak, so at least its RSS before the runs
    assert all(50 < m["peak_rss_mb"] < 1e5 for m in ds["memory"])
    assert all(m["peak_rss_mb"] == n["peak_rss_mb"] for m in ds["memory"] for n in ds["memory"] if m["rank"] == n["rank"])
    # (1 MB of slack: the kernel syncs its per-thread RSS counters lazily, so VmRSS read
    # earlier can exceed ru_maxrss by a few pages; seen: 457.09 against 456.96)
    assert 50 < rss_before_mb <= ds["driver_peak_rss_mb"] + 1.0 < 1e5
    assert "runtime=dist backend=gloo clock=wall" in (tmp_path / "dist" / "run.log").read_text()
    # the cost profile measured by the workers, each its own stages where they run
    prof = json.loads((tmp_path / "dist" / "profile.json").read_text())
    assert prof["meta"]["devices"] == ["cpu"] * n and all(f > 0 for f in prof["forward"])
    # ... with their thread CPU seconds per kind (at most the wall seconds), the cores the workers
    # shared, and the transport threads' CPU per message end (for simulator.shared)
    cpu = prof["meta"]["cpu"]
    assert all(len(cpu[k]) == n and all(0 < c <= w + 1e-4 for c, w in zip(cpu[k], prof[k])) for k in ("forward", "backward"))
    assert prof["meta"]["host"] == {"cores": usable_cores(), "workers": stages, "threads": 1}
    assert prof["link"]["thread_cpu_s"] >= 0 and all("thread_cpu_s" in pair for pair in prof["link"]["pairs"])
    assert (tmp_path / "dist" / "curves.png").stat().st_size > 0
    # where the time went: each stage's actions over the window (the reports after U(warm - 1) and
    # after the last update) against what the profile charges for them
    at, window = ds["action_times"], ds["steps"] - warm_steps(ds["steps"])
    rows = {(r["stage"], r["kind"]): r for r in at["actions"]}
    assert {"F", "U"} <= {k for _, k in rows} <= {"F", "B", "I", "W", "U"} and {s for s, _ in rows} == set(range(n))
    assert all(r["run_s"] > 0 and r["cpu_s"] > 0 and r["profiled_s"] > 0 for r in rows.values())
    assert all(0 <= r["run_sd_s"] < 10 * r["run_s"] for r in rows.values())  # (the spread of real timings)
    costs = {"F": "forward", "B": "backward", "I": "input", "W": "weight", "U": "update"}
    held = prof["held"]  # (measured by the workers: the in-flight factors at 1 and 4 microbatches)
    assert held["depths"] == [1, 4] and len(held["forward"]) == len(held["backward"]) == n
    for (s, k), r in rows.items():  # the charge: the kind's cost at the actions' mean in-flight count, and the extra work the ledger counted, at the profile's costs
        extra = sum(r.get(w, 0) * prof["forward" if w == "recompute" else w][s] for w in ("copy", "predict", "recompute", "accumulate", "data"))
        factor = 1.0 if k == "U" else float(np.interp(r["held"], held["depths"], held["forward" if k == "F" else "backward"][s]))
        assert (k == "U") == ("held" not in r) and (r.get("held", 1) >= 1)
        assert r["profiled_s"] == pytest.approx(prof[costs[k]][s] * factor + extra)
    for s in range(n):  # every backward (or W) but a step's first accumulates; the end stages make each step's batch
        grads = [rows[(s, k)] for k in "BW" if (s, k) in rows]
        assert 0 < sum(r["count"] * r.get("accumulate", 0) for r in grads) < sum(r["count"] for r in grads)
        assert ("data" in rows[(s, "F")]) == (s in (0, n - 1))
    if schedule == "1f1b":  # flushed steps: the window's actions exactly; every backward but a step's first accumulates
        for s in range(stages):
            assert [rows[(s, k)]["count"] for k in "FBU"] == [window * micro, window * micro, window]
            assert rows[(s, "B")]["accumulate"] == (micro - 1) / micro
            # in flight: the first k = min(p - s, m) forwards hold 1..k, the rest k; the backwards the same
            # numbers in the other order
            k = min(stages - s, micro)
            assert rows[(s, "F")]["held"] == rows[(s, "B")]["held"] == pytest.approx((k * (k + 1) / 2 + (micro - k) * k) / micro)
            fb = [float(np.interp(rows[(s, x)]["held"], held["depths"], held[name][s])) for x, name in (("F", "forward"), ("B", "backward"))]
            assert rows[(s, "B")]["profiled_s"] == pytest.approx(prof["backward"][s] * fb[1] + (micro - 1) / micro * prof["accumulate"][s])
            assert rows[(s, "U")]["profiled_s"] == pytest.approx(prof["update"][s])
            ends = s in (0, stages - 1)  # (the first stage makes each step's batch for its inputs, the last for its targets)
            assert rows[(s, "F")]["profiled_s"] == pytest.approx(prof["forward"][s] * fb[0] + ends * prof["data"][s] / micro)
    # profile_in_run.json charges each stage's actions of each kind in the window what they took in the
    # run (one rank per stage here), unless their extra work at its scaled costs alone exceeds that (the
    # kind's own cost then 0)
    inrun = CostProfile.load(tmp_path / "dist" / "profile_in_run.json")
    work = lambda r: {w: r.get(w, 0) for w in ("copy", "predict", "recompute", "accumulate", "data", "held")}  # noqa: E731
    for (s, k), r in rows.items():
        charged = inrun.cost(s, k, work(r))
        assert charged == pytest.approx(r["run_s"]) if getattr(inrun, costs[k])[s] > 0 else charged >= r["run_s"]
    assert inrun.meta["in_run"] and inrun.link == CostProfile.load(tmp_path / "dist" / "profile.json").link
    assert not (tmp_path / "local" / "profile_in_run.json").exists()  # (a local run times no actions apart)
    assert [r["rank"] for r in at["ranks"]] == list(range(stages)) and all(r["steps"] == window for r in at["ranks"])
    assert all(r["step_s"] > r["wait_peer_s"] >= 0 and r["other_threads_cpu_s"] >= 0 for r in at["ranks"])


def test_early_stops_end_every_stage_at_the_same_step(make_cfg, tmp_path):
    """A stop at the target and a stop at the time limit (which evaluates the final weights
    outside the schedule) train exactly the steps the local runtime trains, although the workers
    run ahead of the driver (the last of 4 stages by two steps with one microbatch)."""
    # (no profile to measure: the stops and the numbers do not depend on it)
    common = ("schedule=pipedream", "pipeline.stages=4", "pipeline.microbatches=1", "train.batch_size=4",
              fixed_clock(tmp_path, 4))
    (ls, lsteps, levals), (ds, dsteps, devals) = local_and_dist(
        make_cfg, tmp_path / "target", *common, "train.target_ppl=1000", "train.stop_at_target=true")
    assert ds["stopped"] == ls["stopped"] == "target" and ds["steps"] == ls["steps"] == 4
    assert (dsteps, devals) == (lsteps, levals)
    (ls, lsteps, levals), (ds, dsteps, devals) = local_and_dist(
        make_cfg, tmp_path / "time", *common, "train.max_time_s=1e-9")
    assert ds["stopped"] == ls["stopped"] == "max_time" and ds["steps"] == ls["steps"] == 1
    assert (dsteps, devals) == (lsteps, levals) and [v for v, _ in devals] == [0, 1]


def pipeline_cfg(make_cfg, **pipeline):
    """The tiny config with ``pipeline.stages=2`` and these ``pipeline`` keys set on it (one compose,
    cached, for every variant: a compose is 0.4 s on 2 busy cores)."""
    cfg = make_cfg("pipeline.stages=2")
    for key, value in pipeline.items():
        cfg.pipeline[key] = value
    return cfg


def test_backend_choice_and_device_errors(make_cfg):
    def choose(**pipeline):
        return choose_backend(pipeline_cfg(make_cfg, **pipeline), launched=False)

    assert choose()[0] == ("nccl" if torch.cuda.device_count() >= 2 else "gloo")
    assert choose(backend="gloo", devices=["cpu", "cpu"]) == ("gloo", ["cpu", "cpu"])
    with pytest.raises(ConfigError, match="one per stage"):
        choose(devices=["cpu"])
    with pytest.raises(ConfigError, match="CUDA|two ranks"):
        choose(backend="nccl", devices=["cuda:0", "cuda:0"])
    with pytest.raises(ConfigError, match="gloo runs on CPUs"):
        choose(backend="gloo", devices=["cuda:0", "cuda:1"])


@pytest.mark.parametrize("replicas,gpus,advice", [(1, 1, "use fewer stages, or pipeline.backend=gloo"),
                                                  (2, 3, "use fewer stages or replicas, or pipeline.backend=gloo")])
def test_nccl_gpu_shortfall_says_what_to_lower(make_cfg, monkeypatch, replicas, gpus, advice):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    with pytest.raises(ConfigError) as e:
        choose_backend(pipeline_cfg(make_cfg, replicas=replicas, backend="nccl"), launched=False)
    assert f"{gpus} for 2 stages" in str(e.value) and str(e.value).endswith(f"({advice})")


def test_a_checkpoint_refused_for_non_finite_weights_names_the_chunk_and_the_replica():
    ok = {"file": "stage-0.pt", "bytes": 1}
    assert nonfinite_part([ok, ok], 2, 1) is None
    assert nonfinite_part([ok, {"nonfinite": 1}], 2, 1) == (1, None)
    # p=2, R=2, two chunks per worker: rank 3 is replica 1's stage 1, holding virtual stages 1 and 3
    assert nonfinite_part([ok, ok, ok, {"nonfinite": 3}], 2, 2) == (3, 1)
    assert nonfinite_part([ok, ok, None, ok], 2, 2) == (0, 1)  # (a worker that reported nothing: its rank's stage)
    assert checkpoint.refusal(7, 3, 1) == ("refusing to write a checkpoint at step 7: stage 3 of replica 1 has "
                                           "non-finite weights (training diverged)")
    assert "step 7: stage 3 has" in checkpoint.refusal(7, 3)


@pytest.mark.parametrize("key,rank", [("rep/7/5", 5), ("ready/3", 3), ("done/0", 0), ("part/4/5", 5),
                                      ("eval/12", 2), ("signal/12", 2),  # versions: replica 0's last stage
                                      ("grad_bytes/7", 1), ("grad_bytes/2", 2)])  # virtual stages, c % p
def test_the_watchdog_names_the_rank_that_writes_a_board_key(key, rank):
    from adapipe_cli.runtime.watchdog import _rank_of
    assert _rank_of(key, 3) == rank  # p = 3 (with R = 2: ranks 0-5; with 3 chunks: virtual stages 0-8)


# -- the worker's order --------------------------------------------------------------------------
def run_worker_orders(p: int, m: int, phases: list[str], sync: str, weights: str, every: int,
                      barrier: bool = True) -> list[list[int]]:
    """Walks every stage's worker order (:class:`EvalOrder`) with the driver's gate (``U(t)``
    waits until every stage has applied ``U(t-1)`` and the last stage has evaluated version
    ``t`` when it was due); returns each stage's evaluated versions. Raises on a deadlock."""
    n = len(phases)
    plan = Plan(n, phases)

    def eval_at(t):
        return t == -1 or (t + 1) % every == 0 or t + 1 == n

    spec = ScheduleSpec(p, m, sync, weights, barrier)
    orders = [EvalOrder(StageProgram(s, spec, plan, eval_at), eval_at) for s in range(p)]
    done: set[tuple] = set()
    updates, evals, arrived = [0] * p, [[] for _ in range(p)], {}

    def ready(s, a):
        if a.kind == FORWARD:
            return s == 0 or ("F", s - 1, a.mb) in done
        if a.kind in (BACKWARD, INPUT):
            return s == p - 1 or (a.kind, s + 1, a.mb) in done
        if a.kind == WEIGHT:
            return True
        if a.kind == EVAL:
            return s == 0 or ("E", s - 1, a.version) in done
        if min(updates) < a.step or (eval_at(a.step - 1) and ("E", p - 1, a.step) not in done):
            return False  # the gate
        if a.phase == SYNC and barrier:
            arrived.setdefault(a.step, set()).add(s)
            return len(arrived[a.step]) == p
        return True

    def execute(s, a):
        done.add((a.kind, s, a.version if a.kind == EVAL else a.mb))
        if a.kind == EVAL:
            assert updates[s] == a.version, f"stage {s} evaluates {a} holding version {updates[s]}"
            evals[s].append(a.version)
        if a.kind == UPDATE:
            updates[s] += 1
        return range(p)

    walk(orders, range(p), lambda s: orders[s].peek() is None, ready, execute)
    return evals


@pytest.mark.parametrize("p,m", [(2, 1), (3, 2), (4, 1), (4, 2), (4, 4), (5, 3)])
def test_worker_order_with_the_gate_cannot_deadlock(p, m):
    mixed = ["sync", "async", "async", "sync", "async", "async", "async", "sync"]
    for sync, weights, barrier in (("1f1b", "stash", True), ("gpipe", "stash", True), ("zbh1", "stash", True),
                                   ("zbh2", "stash", True), ("zbh2", "stash", False), ("1f1b", "2bw", True),
                                   ("1f1b", "vertical", True)):
        if weights == "2bw" and m < p - 1:
            continue
        for phases in (["async"] * 8, ["sync"] * 8, mixed):
            for every in (1, 3):
                evals = run_worker_orders(p, m, phases, sync, weights, every, barrier)
                want = sorted({0, *(t + 1 for t in range(8) if (t + 1) % every == 0 or t == 7)})
                assert evals == [want] * p


# -- faults ------------------------------------------------------------------------------------
RUN = [*TINY, "pipeline.runtime=dist", "pipeline.stages=3", "pipeline.microbatches=2", "train.max_steps=3000",
       "train.eval_every=1000"]


class Run:
    """``adapipe train`` in a subprocess, watched: its process tree and its progress."""

    def __init__(self, tmp_path, *overrides, fault: str | None = None, session: bool = False):
        self.dir = tmp_path / "run"
        env = dict(ENV, ADAPIPE_FAULT=fault) if fault else ENV
        exe = os.path.join(os.path.dirname(sys.executable), "adapipe")
        # session: its own process group, which a signal to the group (a terminal's Ctrl-C) reaches
        self.proc = subprocess.Popen([exe, "train", *RUN, *overrides, f"hydra.run.dir={self.dir}"], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=session)
        self.seen: set[int] = set()

    def steps(self) -> int:
        path = self.dir / "metrics.jsonl"
        return path.read_text().count('"kind": "step"') if path.exists() else 0

    def wait_for(self, cond, timeout: float = 120.0) -> float:
        """Polls until ``cond()`` or the process ends; returns the time it held."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.seen |= descendants(self.proc.pid)
            if cond() or self.proc.poll() is not None:
                return time.monotonic()
            time.sleep(0.05)
        raise AssertionError("timed out waiting")

    def finish(self, timeout: float = 60.0) -> tuple[int, str]:
        _, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, err

    def assert_no_process_left(self, least: int = 3) -> None:
        """Nothing the run started is alive 2 s after the driver's exit (which this follows)."""
        assert len(self.seen) >= least, "the workers were never seen"
        deadline = time.monotonic() + 2.0
        while any(alive(p) for p in self.seen) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p for p in self.seen if alive(p)]


def error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("adapipe: error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err, err
    return lines[0]


def workers_alive() -> list[int]:
    return [p for p in descendants(os.getpid()) if comm(p).startswith("adapipe-stage") and alive(p)]


@pytest.mark.parametrize("kind,cause", [("kill", "died: killed by signal SIGKILL"),
                                        ("raise", "failed: RuntimeError: injected fault at step 6")])
def test_a_failing_worker_ends_the_run(make_cfg, tmp_path, monkeypatch, kind, cause):
    """In the test's process (the CLI's exit status and single line are tested below)."""
    monkeypatch.setenv("ADAPIPE_FAULT", f"1:6:{kind}")
    clock = fixed_clock(tmp_path, 3)  # (given: the workers measure none before training)
    t0 = time.monotonic()
    with pytest.raises(WorkerFailed, match=rf"^stage 1 \(rank 1\) {cause}"):
        train(make_cfg(*RUN[len(TINY):], clock), tmp_path / "run")
    # ended by the failure (the message says so; a timeout's would not), and not after start-up's
    # timeout (STARTUP_S, 120 s; a worker lost mid-run would be waited for without end): start-up
    # included, which took 17.5 s beside 6 busy loops on a 2-core Xeon (2026-12-06), and a slower CPU
    # (this suite ran 2.5 times as long on a 2-core EPYC) may take more than half that timeout
    assert time.monotonic() - t0 < STARTUP_S
    assert len(records(tmp_path / "run")[0]) == 6  # steps 0..5
    assert not workers_alive()


@pytest.mark.slow
def test_a_worker_killed_from_outside_ends_the_run(tmp_path):
    run = Run(tmp_path)
    run.wait_for(lambda: run.steps() >= 3)
    workers = [p for p in run.seen if comm(p) == "adapipe-stage1"]
    assert len(workers) == 1
    os.kill(workers[0], signal.SIGKILL)
    killed = time.monotonic()
    code, err = run.finish()
    assert time.monotonic() - killed < 10
    assert code == 1
    assert "stage 1 (rank 1) died: killed by signal SIGKILL" in error_line(err)
    run.assert_no_process_left()


@pytest.mark.slow
def test_a_worker_that_exits_ends_the_run(tmp_path):
    run = Run(tmp_path, fault="0:5:exit")
    run.wait_for(lambda: False, timeout=60)
    code, err = run.finish()
    assert code == 1 and "stage 0 (rank 0) died: exited with status 3" in error_line(err)
    run.assert_no_process_left()


@pytest.mark.slow  # a subprocess run of more than 8 s (fast suite: under 5 min on 2 busy cores)
def test_a_hanging_worker_is_caught_by_the_timeout(tmp_path):
    run = Run(tmp_path, "pipeline.timeout_s=2", fault="1:10:hang")
    seen = run.wait_for(lambda: run.steps() >= 10)
    code, err = run.finish()
    assert time.monotonic() - seen < 2 + 10
    assert code == 1
    line = error_line(err)
    assert "stage 1 (rank 1) made no progress for 2s" in line and "step 10" in line
    run.assert_no_process_left()


def forkserver_seen(run: Run) -> bool:
    return any("forkserver" in _cmdline(p) for p in run.seen)


def workers_seen(run: Run) -> bool:
    return any(comm(p).startswith("adapipe-stage") for p in run.seen)


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""


# when the signal comes: while the forkserver imports torch, once the workers exist (connecting,
# building their stages), after 3 steps of training; and whom it reaches: the driver, or the group
MOMENTS = {"forkserver": (forkserver_seen, 2), "workers": (workers_seen, 3),
           "training": (lambda run: run.steps() >= 3, 3)}
SIGNALS = {"SIGTERM": (signal.SIGTERM, 143, "terminated"), "SIGINT": (signal.SIGINT, 130, "interrupted")}



@pytest.mark.slow  # each a subprocess run of about 10 s
@pytest.mark.parametrize("group", [False, True])
@pytest.mark.parametrize("moment", list(MOMENTS))
@pytest.mark.parametrize("name", list(SIGNALS))
def test_a_signal_stops_every_process_in_one_line(tmp_path, name, moment, group):
    """SIGTERM or SIGINT, to the driver alone or to its whole process group, at start-up or in
    training: exit 143 or 130 with one line and no traceback (from no process), and no worker,
    forkserver or resource tracker left 2 s after the driver's exit."""
    sig, code, word = SIGNALS[name]
    seen, least = MOMENTS[moment]
    run = Run(tmp_path, session=group)
    run.wait_for(lambda: seen(run))
    assert run.proc.poll() is None
    os.killpg(run.proc.pid, sig) if group else run.proc.send_signal(sig)
    run.wait_for(lambda: False, timeout=60)  # watches the process tree until the driver exits
    got, err = run.finish()
    assert got == code and word in error_line(err)
    run.assert_no_process_left(least)


# -- torchrun ------------------------------------------------------------------------------------
@pytest.mark.slow  # a subprocess run of more than 8 s (fast suite: under 5 min on 2 busy cores)
def test_torchrun_gives_the_local_losses(make_cfg, tmp_path):
    args = ["pipeline.stages=2", "pipeline.microbatches=2", "schedule=pipedream"]
    train(make_cfg(*args), tmp_path / "local")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "adapipe_cli.cli.main", "train", *TINY, *args, "pipeline.runtime=dist", "pipeline.timeout_s=60",
           f"hydra.run.dir={tmp_path / 'torchrun'}"]
    out = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert records(tmp_path / "torchrun") == records(tmp_path / "local")
    summary = json.loads((tmp_path / "torchrun" / "summary.json").read_text())
    assert (summary["runtime"], summary["backend"]) == ("dist", "gloo")


def test_torchrun_without_the_dist_runtime_is_one_line_in_process(tmp_path, monkeypatch, capsys):
    """The fast twin of the subprocess test below: under torchrun's variables, the local runtime is
    refused in one line naming pipeline.runtime=dist, exit 2."""
    from adapipe_cli.cli.main import main

    for k, v in dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="1").items():
        monkeypatch.setenv(k, v)
    assert main(["train", *TINY, "pipeline.stages=2", f"hydra.run.dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pipeline.runtime=dist" in err[0], err


@pytest.mark.slow  # an adapipe train subprocess (5 s): the fast twin above runs in process
def test_torchrun_needs_the_dist_runtime(tmp_path):
    env = dict(ENV, RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    exe = os.path.join(os.path.dirname(sys.executable), "adapipe")
    out = subprocess.run([exe, "train", *TINY, "pipeline.stages=2", f"hydra.run.dir={tmp_path}"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "pipeline.runtime=dist" in error_line(out.stderr)


# -- torch.distributed.pipelining ------------------------------------------------------------------
@pytest.mark.parametrize("schedule", ["1f1b", pytest.param("gpipe", marks=pytest.mark.slow)])
def test_sync_gradients_equal_torch_pipelining(tmp_path, schedule):
    import torch.distributed as dist

    from adapipe_cli.runtime.dist import worker_context

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = worker_context()
    procs = [ctx.Process(target=pipelining_rank, args=(r, store.port, schedule, str(tmp_path))) for r in range(2)]
    run_ranks(procs, 120)
    for r in range(2):
        g = torch.load(tmp_path / f"rank{r}.pt")
        assert len(g["theirs"]) == len(g["ours"])
        for a, b in zip(g["ours"], g["theirs"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
