"""Data parallel x pipeline (``pipeline.replicas=R``) on the dist runtime: R x p worker processes
on gloo give the local runtime's emulation of R x p devices, bitwise (one thread per worker; the
emulation is tested against single-process training in test_replicas); a killed worker of a
replica ends the run, names its stage, replica and rank, and leaves no process; the placement of
ranks, and the bad settings that are refused in one line."""

from __future__ import annotations

import json

import pytest

from adapipe_cli.config import ConfigError
from adapipe_cli.runtime.dist import choose_backend, worker_name
from adapipe_cli.runtime.replicas import where, who
from test_dist import SWITCHES, local_and_dist

R2 = ["pipeline.replicas=2", "pipeline.stages=2", "pipeline.microbatches=2"]


def assert_same_run(local, dist, replicas=2, stages=2):
    (ls, lsteps, levals), (ds, dsteps, devals) = local, dist
    assert dsteps == lsteps
    assert devals == levals and [v for v, _ in devals] == [0, 4, 8, 12]
    assert ds["final_val_loss"] == ls["final_val_loss"] and ds["replicas"] == replicas
    assert [(m["replica"], m["stage"], m["rank"]) for m in ds["memory"]] == [
        (r, s, r * stages + s) for r in range(replicas) for s in range(stages)]


@pytest.mark.slow  # two runs of 4 worker processes each, over 10 s on 2 busy cores
@pytest.mark.parametrize("schedule,extra", [
    ("1f1b", []),  # sync: exactly single-process training on the whole batch (test_replicas)
    ("pipedream", []),  # async: each stage's update applies the replicas' mean, with the schedule's delays
    ("adapipe", [SWITCHES, "heuristic=fixed"]),  # every replica switches at the same steps
    ("gpipe", ["model.tie_embeddings=true", "optim.grad_clip=0.05"]),  # tied ends, clip by the mean's norm
    ("2bw", ["optim.grad_clip=0.05"]),  # async clipping by the gossiped estimate of the mean's norm
])
def test_dist_replicas_equal_the_local_emulation(make_cfg, tmp_path, schedule, extra):
    local, dist = local_and_dist(make_cfg, tmp_path, *R2, f"schedule={schedule}", *extra)
    assert_same_run(local, dist)
    assert (tmp_path / "dist" / "workers" / "replica1-stage0.log").is_file()
    assert "replicas=2" in (tmp_path / "dist" / "run.log").read_text().splitlines()[0]


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
