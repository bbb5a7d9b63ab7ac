"""Data parallel x pipeline (``pipeline.replicas=R``) on the dist runtime: R x p worker processes
on gloo give the local runtime's emulation of R x p devices, bitwise (one thread per worker; the
emulation is tested against single-process training in test_replicas); a killed worker of a
replica ends the run, names its stage, replica and rank, and leaves no process; the placement of
ranks, and the bad settings that are refused in one line."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch

from adapipe_cli.config import ConfigError
from adapipe_cli.runtime.dist import choose_backend, worker_name
from adapipe_cli.runtime.replicas import split_pipelines, where, who
from adapipe_cli.train.loop import train
from conftest import TINY
from procs import comm, records
from test_dist import SWITCHES, Run, _cmdline, error_line, local_and_dist

R2 = ["pipeline.replicas=2", "pipeline.stages=2", "pipeline.microbatches=2"]


def assert_same_run(local, dist, replicas=2, stages=2, chunks=1):
    (ls, lsteps, levals), (ds, dsteps, devals) = local, dist
    assert dsteps == lsteps
    assert devals == levals and [v for v, _ in devals] == [0, 4, 8, 12]
    assert ds["final_val_loss"] == ls["final_val_loss"] and ds["replicas"] == replicas
    # a row per (virtual) stage of each replica; virtual stage c on its replica's rank c % p
    assert [(m["replica"], m["stage"], m["rank"]) for m in ds["memory"]] == [
        (r, c, r * stages + c % stages) for r in range(replicas) for c in range(stages * chunks)]


@pytest.mark.slow  # two runs of 4 worker processes each, over 10 s on 2 busy cores
@pytest.mark.parametrize("schedule,extra", [
    ("1f1b", []),  # sync: exactly single-process training on the whole batch (test_replicas)
    ("pipedream", []),  # async: each stage's update applies the replicas' mean, with the schedule's delays
    ("adapipe", [SWITCHES, "heuristic=fixed"]),  # every replica switches at the same steps
    ("gpipe", ["model.tie_embeddings=true", "optim.grad_clip=0.05"]),  # tied ends, clip by the mean's norm
    ("2bw", ["optim.grad_clip=0.05"]),  # async clipping by the gossiped estimate of the mean's norm
    ("interleaved", ["model.tie_embeddings=true"]),  # 2 chunks per worker, each all-reduced with its copy
])
def test_dist_replicas_equal_the_local_emulation(make_cfg, tmp_path, schedule, extra):
    local, dist = local_and_dist(make_cfg, tmp_path, *R2, f"schedule={schedule}", *extra)
    assert_same_run(local, dist, chunks=2 if schedule == "interleaved" else 1)
    assert (tmp_path / "dist" / "workers" / "replica1-stage0.log").is_file()
    assert "replicas=2" in (tmp_path / "dist" / "run.log").read_text().splitlines()[0]


@pytest.mark.slow
def test_early_stops_end_every_replica_at_the_same_step(make_cfg, tmp_path):
    """A stop at the target and at the time limit (which evaluates the final weights outside the
    schedule, in every replica) train exactly the local emulation's steps, although the last of 3
    stages runs a step ahead with one microbatch."""
    common = ("pipeline.replicas=2", "schedule=pipedream", "pipeline.stages=3", "pipeline.microbatches=1",
              "train.batch_size=4")
    (ls, lsteps, levals), (ds, dsteps, devals) = local_and_dist(
        make_cfg, tmp_path / "target", *common, "train.target_ppl=1000", "train.stop_at_target=true")
    assert ds["stopped"] == ls["stopped"] == "target" and ds["steps"] == ls["steps"]
    assert (dsteps, devals) == (lsteps, levals)
    (ls, lsteps, levals), (ds, dsteps, devals) = local_and_dist(make_cfg, tmp_path / "time", *common, "train.max_time_s=1e-9")
    assert ds["stopped"] == ls["stopped"] == "max_time" and ds["steps"] == ls["steps"] == 1
    assert (dsteps, devals) == (lsteps, levals) and [v for v, _ in devals] == [0, 1]


@pytest.mark.slow
def test_three_replicas_of_three_stages(make_cfg, tmp_path):
    """R = 3: the all-gather's sum in replica order is the emulation's (not only a + b = b + a)."""
    local, dist = local_and_dist(make_cfg, tmp_path, "pipeline.replicas=3", "pipeline.stages=3",
                                 "pipeline.microbatches=2", "train.batch_size=12", "schedule=pipedream")
    assert_same_run(local, dist, replicas=3, stages=3)


def test_placement_keeps_a_pipeline_on_consecutive_ranks():
    assert [where(g, 2) for g in range(6)] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert who(3, 2, 2) == "stage 1 of replica 1 (rank 3)" and who(1, 2, 1) == "stage 1 (rank 1)"
    assert worker_name(3, 2, 2) == ("adapipe-r1s1", "replica1-stage1.log")
    assert worker_name(1, 2, 1) == ("adapipe-stage1", "stage1.log")
    assert len(worker_name(999, 10, 100)[0]) <= 15  # (what ps shows)


def test_devices_are_one_per_worker(make_cfg):
    cfg = make_cfg(*R2, "pipeline.backend=gloo", "pipeline.devices=[cpu,cpu,cpu,cpu]")
    assert choose_backend(cfg, launched=False) == ("gloo", ["cpu"] * 4)
    with pytest.raises(ConfigError, match=r"give one per worker, 4, in rank order"):
        choose_backend(make_cfg(*R2, "pipeline.devices=[cpu,cpu]"), launched=False)


# -- faults ------------------------------------------------------------------------------------
FAULTY = [*R2, "pipeline.runtime=dist", "train.max_steps=3000", "train.eval_every=1000"]
HELPERS = ("forkserver", "resource_tracker")  # the driver's multiprocessing helpers


@pytest.mark.slow  # 4 worker processes under an ``adapipe train`` subprocess
@pytest.mark.parametrize("rank,kind,cause", [(3, "kill", "stage 1 of replica 1 (rank 3) died: killed by signal SIGKILL"),
                                             (2, "raise", "stage 0 of replica 1 (rank 2) failed: RuntimeError: injected")])
def test_a_failing_worker_of_a_replica_ends_the_run(tmp_path, rank, kind, cause):
    """The run exits 1 in one line naming the stage, the replica and the rank, and no worker (of
    either replica), forkserver or resource tracker is left (issue 17)."""
    run = Run(tmp_path, *FAULTY[:3], "train.max_steps=30", "train.eval_every=10", fault=f"{rank}:6:{kind}")
    helpers: set[str] = set()  # (told by their command lines, readable only while they live)
    run.wait_for(lambda: helpers.update(h for q in run.seen for h in HELPERS if f"multiprocessing.{h} import" in _cmdline(q)),
                 timeout=60)  # (None: watches the process tree until the driver exits)
    code, err = run.finish()
    assert code == 1 and error_line(err).startswith(f"adapipe: error: {cause}")
    assert len(records(run.dir)[0]) == 6  # steps 0..5: no replica updated step 6
    assert helpers == set(HELPERS)
    run.assert_no_process_left(least=6)  # 4 workers, the forkserver and the resource tracker


@pytest.mark.slow
def test_a_worker_of_a_replica_killed_from_outside_ends_the_run_with_no_process_left(tmp_path):
    """SIGKILL to replica 1's stage 0 while the run trains: the driver exits 1 in one line that
    names the stage, the replica and the rank, and no worker (of either replica), forkserver or
    resource tracker is left."""
    run = Run(tmp_path, *FAULTY[:3])
    run.wait_for(lambda: run.steps() >= 3)
    victims = [p for p in run.seen if comm(p) == "adapipe-r1s0"]
    assert len(victims) == 1 and len([p for p in run.seen if comm(p).startswith("adapipe-r")]) == 4
    os.kill(victims[0], signal.SIGKILL)
    killed = time.monotonic()
    code, err = run.finish()
    assert time.monotonic() - killed < 10
    assert code == 1
    line = error_line(err)
    assert "stage 0 of replica 1 (rank 2) died: killed by signal SIGKILL" in line
    assert "replica1-stage0.log" in line
    run.assert_no_process_left(least=5)


# -- checkpoints -----------------------------------------------------------------------------
@pytest.mark.slow  # three runs of 4 worker processes
def test_dist_replicas_resume_gives_the_uninterrupted_run(tmp_path):
    """Each worker writes its own part (replica 0's ``stage-S``, the others' ``replica-R-stage-S``);
    a run resumed after step 3 (an async stream: activations in flight in both replicas cross the
    cut) and after step 6 (sync) gives the whole run's numbers, which are the local emulation's."""
    from adapipe_cli import checkpoint
    from adapipe_cli.cli.main import main
    from procs import cut_at

    args = [*TINY, *R2, "schedule=adapipe", "heuristic=fixed", "heuristic.plan=[[async,5],[sync,2],[async,null]]",
            "train.max_steps=10", "train.checkpoint_every=3", "train.eval_every=5", "train.keep_checkpoints=5"]
    whole, local = tmp_path / "whole", tmp_path / "local"
    assert main(["train", *args, "pipeline.runtime=dist", "pipeline.timeout_s=60", f"hydra.run.dir={whole}"]) == 0
    assert main(["train", *args, f"hydra.run.dir={local}"]) == 0
    assert records(whole) == records(local)
    folder = whole / "checkpoints" / "step-0000003"
    manifest = checkpoint.verify(folder)
    assert set(manifest["parts"]) == {"trainer", "stage-0", "stage-1", "replica-1-stage-0", "replica-1-stage-1"}
    for name in ("stage-", "replica-1-stage-"):  # activations in flight from stage 0 to stage 1 at the cut
        fwd = [torch.load(folder / f"{name}{s}.pt", weights_only=False)["forwarded"] for s in (0, 1)]
        assert fwd[0] > fwd[1], name
    for k in (3, 6):
        cut = cut_at(whole, tmp_path / f"cut{k}", k)
        assert main(["train", f"train.resume={cut}"]) == 0
        assert records(cut) == records(whole), f"resumed after step {k}"


# -- AdaPipe on the pipeline clock -------------------------------------------------------------
@pytest.mark.slow  # two runs of 4 worker processes
def test_adapipe_with_replicas_takes_the_local_runs_decisions(make_cfg, tmp_path):
    """goodput on the profiled clock, with the all-reduce on it (pipeline.dp_bandwidth): the same
    switches at the same steps in every replica, the same times, signals and losses, bitwise."""
    from test_dist_adapipe import ADAPIPE, all_records, uniform_profile

    args = [*ADAPIPE, "pipeline.replicas=2", "pipeline.dp_bandwidth=2e6", "pipeline.dp_latency_s=1e-3",
            f"pipeline.profile={uniform_profile(tmp_path, 2)}"]
    ls = train(make_cfg(*args), tmp_path / "local")
    ds = train(make_cfg(*args, "pipeline.runtime=dist", "pipeline.timeout_s=60"), tmp_path / "dist")
    assert all_records(tmp_path / "dist") == all_records(tmp_path / "local")
    assert ls["switches"] == ds["switches"] >= 2 and ds["time_s"] == ls["time_s"]
    no_ar = train(make_cfg(*args[:-3], args[-1]), tmp_path / "free")
    assert ls["time_s"] > no_ar["time_s"]  # (the all-reduce is on the clock)


@pytest.mark.slow
def test_interleaved_replicas_on_the_pipeline_clock_are_the_local_run(make_cfg, tmp_path):
    """Interleaved 1F1B (2 chunks per worker) with replicas on the profiled clock: every virtual
    stage's all-reduce on the replayed clock, the local run's times and numbers, bitwise."""
    from test_dist_adapipe import all_records, uniform_profile

    args = [*R2, "schedule=interleaved", "pipeline.clock=profiled", "pipeline.dp_bandwidth=2e6",
            f"pipeline.profile={uniform_profile(tmp_path, 4)}"]
    ls = train(make_cfg(*args), tmp_path / "local")
    ds = train(make_cfg(*args, "pipeline.runtime=dist", "pipeline.timeout_s=60"), tmp_path / "dist")
    assert all_records(tmp_path / "dist") == all_records(tmp_path / "local") and ds["time_s"] == ls["time_s"]


@pytest.mark.slow
def test_a_guard_rollback_with_replicas_is_the_local_one(make_cfg, tmp_path, monkeypatch):
    """A NaN at step 17: every worker of both replicas goes back to its snapshot, and the run
    replays the local emulation's trajectory."""
    from adapipe_cli.runtime.dist import DistRuntime
    from adapipe_cli.runtime.local import LocalRuntime
    from test_dist_adapipe import GUARDED, all_records, inject_nan, uniform_profile

    args = [*GUARDED, "pipeline.replicas=2", "pipeline.clock=profiled", f"pipeline.profile={uniform_profile(tmp_path, 3)}"]
    inject_nan(monkeypatch, LocalRuntime, 17)
    inject_nan(monkeypatch, DistRuntime, 17)
    ls = train(make_cfg(*args), tmp_path / "local")
    ds = train(make_cfg(*args, "pipeline.runtime=dist", "pipeline.timeout_s=60"), tmp_path / "dist")
    assert all_records(tmp_path / "dist") == all_records(tmp_path / "local")
    assert ls["guard_events"] == ds["guard_events"] == 1 and ds["steps"] == 30


# -- torchrun across nodes -----------------------------------------------------------------------
def test_a_pipeline_spans_nodes_only_when_the_ranks_force_it():
    assert split_pipelines(2, 4, per_node=4) == []  # 2 pipelines per node
    assert split_pipelines(2, 3, per_node=3) == [1]  # ranks 0-2 | 3-5: replica 1 is ranks 2, 3
    assert split_pipelines(4, 2, per_node=2) == [0, 1]  # a pipeline needs two nodes whatever the order
    assert split_pipelines(3, 1, per_node=8) == []


def test_torchrun_needs_a_process_per_stage_of_each_replica(make_cfg, tmp_path, monkeypatch):
    for k, v in dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1").items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError, match=r"torchrun started 2 processes for pipeline.stages=2 x pipeline.replicas=2: "
                                          r".*nnodes x nproc-per-node = 4"):
        train(make_cfg(*R2, "pipeline.runtime=dist"), tmp_path)


@pytest.mark.slow  # two torchrun agents of 2 processes each, about a minute on 2 busy cores
def test_torchrun_on_two_nodes_keeps_each_replica_on_one_node(make_cfg, tmp_path):
    """Two torchrun agents on this machine play two nodes (--nnodes 2 --nproc-per-node 2): each
    replica's pipeline is on one node, the dp all-reduce crosses them, and the run gives the local
    emulation's numbers."""
    import subprocess
    import sys

    from procs import ENV

    args = [*R2, "schedule=pipedream"]  # (not the default AdaPipe: it follows each runtime's clock)
    train(make_cfg(*args), tmp_path / "local")
    port = 29400 + os.getpid() % 500
    cmd = lambda node: [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",  # noqa: E731
                        "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
                        "-m", "adapipe_cli.cli.main", "train", *TINY, *args, "pipeline.runtime=dist",
                        "pipeline.timeout_s=60", f"hydra.run.dir={tmp_path / 'torchrun'}"]
    nodes = [subprocess.Popen(cmd(n), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for n in (0, 1)]
    outs = [p.communicate(timeout=300) for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], outs
    assert records(tmp_path / "torchrun") == records(tmp_path / "local")
    summary = json.loads((tmp_path / "torchrun" / "summary.json").read_text())
    assert [(m["replica"], m["stage"], m["node"]) for m in summary["memory"]] == [(0, 0, 0), (0, 1, 0), (1, 0, 1), (1, 1, 1)]
    assert "span nodes" not in outs[0][1]
