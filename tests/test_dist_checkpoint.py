"""Checkpoints of the distributed runtime: each worker writes its own stage's part, a resumed run
gives the uninterrupted run's numbers (activations in flight across the cut are sent again), a
damaged part falls back to the previous checkpoint, and kills while writing never leave a partial
checkpoint behind."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from adapipe_cli.cli.main import main
from adapipe_cli import checkpoint
from conftest import TINY, fixed_clock
from procs import ENV, check_resumed_from, cli, comm, cut_at, descendants, records, verifies

DIST = ["pipeline.runtime=dist", "pipeline.timeout_s=60"]
# steps 0-1 sync, 2-6 async, 7-9 sync, 10- async: cuts before a drain (6), before a fill (9) and in
# a stream (12); weight prediction keeps weights that are no stashed version
SWITCHES = ["schedule=adapipe", "heuristic=fixed", "heuristic.plan=[[sync,2],[async,5],[sync,3],[async,null]]",
            "schedule.mitigation=[predict]"]
CASES = {
    "pipedream-p4-m1": ["schedule=pipedream", "pipeline.stages=4", "pipeline.microbatches=1", "train.batch_size=4"],
    "pipedream-p4-m2": ["schedule=pipedream", "pipeline.stages=4", "pipeline.microbatches=2"],
    "2bw-p4-m4": ["schedule=2bw", "pipeline.stages=4", "pipeline.microbatches=4"],
    "adapipe-p4-m2": [*SWITCHES, "pipeline.stages=4", "pipeline.microbatches=2"],
    "vertical-p3-m2": ["schedule=pipedream", "schedule.weights=vertical", "pipeline.stages=3",
                       "pipeline.microbatches=2"],
    "latest-p3-m1-gpipe": [*SWITCHES[:3], "schedule.weights=latest", "schedule.sync=gpipe", "pipeline.stages=3",
                           "pipeline.microbatches=1", "train.batch_size=4"],
}


def run(run_dir: Path, *overrides: str) -> int:
    return main(["train", *TINY, *overrides, f"hydra.run.dir={run_dir}"])


def crossing(folder: Path, stages: int) -> int:
    """Activations in flight at a stage but not yet forwarded by the next one, at the cut."""
    forwarded = [torch.load(folder / f"stage-{s}.pt", weights_only=False)["forwarded"] for s in range(stages)]
    return sum(a - b for a, b in zip(forwarded, forwarded[1:]))


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory):
    """``whole_run(*overrides)``: the folder of an uninterrupted run of TINY with these overrides,
    trained once per module (cut copies of it are resumed, see procs.cut_at): the fast resume test
    and the damaged part's test resume the same dist run (a run of 4 workers, 8 steps)."""
    runs = {}

    def whole(*overrides: str) -> Path:
        if overrides not in runs:
            d = tmp_path_factory.mktemp("whole") / "run"
            assert run(d, *overrides) == 0
            runs[overrides] = d
        return runs[overrides]

    return whole


# -- exactness ---------------------------------------------------------------------------------
SLOW = [("adapipe-p4-m2", [6, 12]), ("pipedream-p4-m1", [3, 7]), ("adapipe-p4-m2", [9, 11]), ("vertical-p3-m2", [4, 8]),
        ("latest-p3-m1-gpipe", [3, 6, 9])]


# one fast case keeps the path in the fast suite; the others are slow (the suite's time on 2 busy cores)
@pytest.mark.parametrize("case,stops", [("pipedream-p4-m1", [1]),
                                        *(pytest.param(*c, marks=pytest.mark.slow)
                                          for c in [("pipedream-p4-m2", [5]), ("2bw-p4-m4", [4]), *SLOW])])
def test_dist_resume_gives_the_uninterrupted_run(tmp_path, whole_run, case, stops):
    every = 3 if all(k % 3 == 0 for k in stops) else 1
    n = 8 if max(stops) < 4 else 14  # (a cut early on: 8 steps, as in the damaged part's test below)
    whole = whole_run(*CASES[case], *DIST, f"train.max_steps={n}", f"train.checkpoint_every={every}", "train.keep_checkpoints=20")
    steps, evals = records(whole)
    assert len(steps) == n and [v for v, _ in evals] == [*range(0, n, 4), n]
    stages = int(next(a for a in CASES[case] if a.startswith("pipeline.stages=")).split("=")[1])
    # in-flight microbatches do cross a cut tested (in a stream; none where a drain or a flush ends)
    assert any(crossing(whole / "checkpoints" / f"step-{k:07d}", stages) > 0 for k in stops)
    for k in stops:
        cut = cut_at(whole, tmp_path / f"cut{k}", k)
        assert main(["train", f"train.resume={cut}"]) == 0
        assert records(cut) == (steps, evals), f"resumed after step {k}"
        times = [json.loads(x)["time_s"] for x in (cut / "metrics.jsonl").read_text().splitlines()
                 if json.loads(x)["kind"] == "step"]
        assert times == sorted(times)  # the wall clock goes on from the checkpoint's time


def test_dist_checkpoints_equal_the_local_runs_numbers(tmp_path, capsys):
    """Same losses as the local runtime, each worker writes its own part, and the manifest lists
    every stage; a checkpoint of one runtime is refused by the other in one line."""
    # two stages (two workers: half the processes of 4 on 2 busy cores); 4 stages: the resume tests.
    # A given profile: neither run measures one (the dist resume tests' run does)
    # (4 steps, a checkpoint after step 2 and one at the end, as 8 steps with one after step 4 had)
    args = ["schedule=pipedream", "pipeline.stages=2", "pipeline.microbatches=2", "train.max_steps=4",
            "train.checkpoint_every=2", fixed_clock(tmp_path, 2)]
    assert run(tmp_path / "local", *args) == 0
    assert run(tmp_path / "dist", *args, *DIST) == 0
    assert records(tmp_path / "dist") == records(tmp_path / "local")
    folder = checkpoint.complete(tmp_path / "dist")[-1]
    manifest = checkpoint.verify(folder)
    assert set(manifest["parts"]) == {"trainer", "stage-0", "stage-1"}
    assert manifest["runtime"] == "dist" and manifest["step"] == 4
    for s in range(2):
        part = torch.load(folder / f"stage-{s}.pt", weights_only=False)
        assert part["step"] == 4 and part["executor"]["stage"] == s
    assert not list((tmp_path / "dist" / "checkpoints").glob(".tmp-*"))
    for d, other in (("local", "dist"), ("dist", "local")):
        capsys.readouterr()
        assert main(["train", f"train.resume={tmp_path / d}", f"pipeline.runtime={other}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"pipeline.runtime='{d}' in the checkpoint, '{other}' now" in err[0]


@pytest.mark.slow  # three dist runs of about 10 s
def test_dist_interleaved_checkpoints_resume_the_local_runs_numbers(tmp_path):
    """Interleaved 1F1B, two chunks per worker: the dist run gives the local run's numbers, each
    rank's part holds its two chunks (virtual stages r and r + 2), and a run resumed after step 6
    repeats the rest of the uninterrupted run."""
    args = ["schedule=interleaved", "pipeline.stages=2", "pipeline.microbatches=4", "train.max_steps=10",
            "train.checkpoint_every=3", "train.keep_checkpoints=20"]
    assert run(tmp_path / "local", *args) == 0
    whole = tmp_path / "dist"
    assert run(whole, *args, *DIST) == 0
    assert records(whole) == records(tmp_path / "local")
    folder = checkpoint.complete(whole)[-1]
    assert set(checkpoint.verify(folder)["parts"]) == {"trainer", "stage-0", "stage-1"}
    for r in range(2):
        part = torch.load(folder / f"stage-{r}.pt", weights_only=False)
        assert [part["executor"]["stage"], *(c["stage"] for c in part["chunks"])] == [r, r + 2]
    cut = cut_at(whole, tmp_path / "cut6", 6)
    assert main(["train", f"train.resume={cut}"]) == 0
    assert records(cut) == records(whole)


def test_local_resume_early_in_a_predicted_stream(tmp_path):
    """A microbatch forwarded before its stage's first update ran without weight prediction (no
    velocity yet): resumed after that update, it keeps its stashed weights (both runtimes)."""
    # (4 steps: stage 0 forwards microbatches 1-3 before its first update; in the checkpoint after the
    # first step all three are in flight on its stashed version-0 weights, their backwards are steps 1-3,
    # and those updates make the final evaluation at step 4)
    args = [*CASES["pipedream-p4-m1"], "schedule.mitigation=[predict]", "train.max_steps=4",
            "train.checkpoint_every=1", "train.keep_checkpoints=10", fixed_clock(tmp_path, 4)]
    whole = tmp_path / "whole"
    assert run(whole, *args) == 0
    cut = cut_at(whole, tmp_path / "cut", 1)
    assert main(["train", f"train.resume={cut}"]) == 0
    assert records(cut) == records(whole)


@pytest.mark.parametrize("damage", [pytest.param("missing", marks=pytest.mark.slow), "truncated"])  # (fast suite: one)
def test_a_damaged_stage_part_falls_back_to_the_previous_checkpoint(tmp_path, capsys, whole_run, damage):
    # (the fast resume test's run: a checkpoint after every step)
    whole = whole_run(*CASES["pipedream-p4-m1"], *DIST, "train.max_steps=8", "train.checkpoint_every=1",
                      "train.keep_checkpoints=20")
    cut = cut_at(whole, tmp_path / "cut", 6)
    part = cut / "checkpoints" / "step-0000006" / "stage-2.pt"
    if damage == "missing":
        part.unlink()
    else:
        part.write_bytes(part.read_bytes()[:-100])
    capsys.readouterr()
    assert main(["train", f"train.resume={cut}"]) == 0
    err = capsys.readouterr().err
    assert "checkpoint step-0000006 is unusable" in err and "step-0000005 at step 5" in err
    assert records(cut) == records(whole)


@pytest.mark.slow  # a subprocess run of more than 8 s (fast suite: under 5 min on 2 busy cores)
def test_final_checkpoints_of_runs_that_stop_early(tmp_path):
    """``train.save_final`` after a stop at the target (no final evaluation: the workers learn of
    the checkpoint at the end) and after a stop at the time limit (after the final evaluation);
    resumed without the stop, each continues as the run that never stopped."""
    common = [*CASES["pipedream-p4-m1"], *DIST, "train.max_steps=8", "train.save_final=true"]
    assert run(tmp_path / "whole", *common) == 0
    steps, _ = records(tmp_path / "whole")
    assert [f.name for f in checkpoint.complete(tmp_path / "whole")] == ["step-0000008"]
    for name, stop, at in (("target", ["train.target_ppl=1000", "train.stop_at_target=true"], 4),
                           ("time", ["train.max_time_s=1e-9"], 1)):
        d = tmp_path / name
        assert run(d, *common, *stop) == 0
        assert [f.name for f in checkpoint.complete(d)] == [f"step-{at:07d}"]
        again = ["train.stop_at_target=false"] if name == "target" else ["train.max_time_s=0"]
        assert main(["train", f"train.resume={d}", *again]) == 0
        assert records(d)[0] == steps


@pytest.mark.slow
def test_torchrun_writes_and_resumes_checkpoints(tmp_path):
    args = ["schedule=pipedream", "pipeline.stages=2", "pipeline.microbatches=1", "train.batch_size=4",
            "train.max_steps=8", "train.checkpoint_every=2", "train.keep_checkpoints=10"]
    assert run(tmp_path / "local", *args) == 0

    def torchrun(*overrides):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "adapipe_cli.cli.main", "train", *overrides]
        out = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr

    whole = tmp_path / "whole"
    torchrun(*TINY, *args, *DIST, f"hydra.run.dir={whole}")
    assert records(whole) == records(tmp_path / "local")
    cut = cut_at(whole, tmp_path / "cut", 4)
    torchrun(f"train.resume={cut}")
    assert records(cut) == records(whole)


# -- faults --------------------------------------------------------------------------------------
def _kill(proc, rng) -> str:
    """SIGKILL the driver, or one worker (the driver then fails in one line); returns which."""
    workers = [p for p in descendants(proc.pid) if comm(p).startswith("adapipe-stage")]
    if workers and rng.random() < 0.5:
        os.kill(rng.choice(workers), signal.SIGKILL)
        proc.wait(timeout=60)
        return "worker"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return "driver"


def _kill_while_writing(tmp_path, kills: int, seed: int, steps: int) -> int:
    """Start, SIGKILL the driver or a worker at a random moment once the process writes
    checkpoints (slowed down so that many kills land inside a write), resume, repeat; finally let
    it finish: every resume uses the newest complete checkpoint or the one before, and the run
    ends with the uninterrupted run's numbers. Returns how many kills landed inside a write."""
    rng = random.Random(seed)
    args = [*TINY, *CASES["adapipe-p4-m2"], *DIST, f"train.max_steps={steps}", "train.checkpoint_every=1",
            "train.keep_checkpoints=2"]
    whole = tmp_path / "whole"
    assert run(whole, *args[len(TINY):]) == 0
    d = tmp_path / "killed"
    slow = {"ADAPIPE_TEST_CHECKPOINT_DELAY": "0.05"}
    proc, started = cli([*args, f"hydra.run.dir={d}"], slow), time.time()
    candidates = None  # the checkpoints a resume may use: the newest complete one or the one before
    inside = 0
    for _ in range(kills):
        deadline = time.time() + 60
        while proc.poll() is None and time.time() < deadline and _last_commit(d) < started:
            time.sleep(0.02)  # until this process has written a checkpoint
        time.sleep(rng.uniform(0.0, 0.3))
        if proc.poll() is not None:
            break
        inside += any((d / "checkpoints").glob(".tmp-*"))
        who = _kill(proc, rng)
        err = proc.stderr.read()
        check_resumed_from(err, candidates)
        if who == "worker" and proc.returncode != -signal.SIGKILL:
            lines = [x for x in err.splitlines() if x.startswith("adapipe: error:")]
            assert proc.returncode == 1 and len(lines) == 1 and "killed by signal SIGKILL" in lines[0], err
        if (d / "summary.json").exists():
            break
        complete = checkpoint.complete(d)
        assert all(verifies(p) for p in complete[:-1])  # only the newest may be cut short (by a kill in commit)
        candidates = {f.name for f in complete[-2:]}
        assert candidates, "a kill left no checkpoint"
        proc, started = cli([f"train.resume={d}"], slow), time.time()
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    check_resumed_from(err, candidates)
    assert records(d) == records(whole)
    return inside


def _last_commit(run_dir: Path) -> float:
    """When the newest checkpoint was committed (0: none)."""
    return max(((f / checkpoint.MANIFEST).stat().st_mtime for f in checkpoint.complete(run_dir)), default=0.0)


@pytest.mark.slow  # a subprocess run of more than 8 s (fast suite: under 5 min on 2 busy cores)
def test_sigkill_while_writing_dist_checkpoints(tmp_path):
    _kill_while_writing(tmp_path, kills=1, seed=0, steps=16)


@pytest.mark.slow
def test_sigkill_while_writing_dist_checkpoints_many_times(tmp_path):
    assert _kill_while_writing(tmp_path, kills=12, seed=1, steps=40) >= 3


@pytest.mark.slow
def test_a_run_stopped_by_sigterm_resumes_exactly(tmp_path):
    """``kill`` (SIGTERM) during training: exit 143 in one line, and the run resumed from its last
    complete checkpoint ends with the uninterrupted run's numbers."""
    args = [*TINY, *CASES["adapipe-p4-m2"], *DIST, "train.max_steps=16", "train.checkpoint_every=2"]
    whole = tmp_path / "whole"
    assert run(whole, *args[len(TINY):]) == 0
    d = tmp_path / "stopped"
    slow = {"ADAPIPE_TEST_CHECKPOINT_DELAY": "0.2"}  # so that the signal lands well before the end
    proc, started = cli([*args, f"hydra.run.dir={d}"], slow), time.time()
    deadline = time.time() + 120
    while proc.poll() is None and time.time() < deadline and _last_commit(d) < started:
        time.sleep(0.02)  # until it has written a checkpoint
    assert proc.poll() is None, "the run ended before the signal"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    lines = [x for x in err.splitlines() if x.startswith("adapipe: error:")]
    assert proc.returncode == 143 and len(lines) == 1 and "terminated" in lines[0] and "Traceback" not in err, err
    assert not (d / "summary.json").exists()
    last = checkpoint.complete(d)[-1]
    assert int(last.name.split("-")[1]) < 16
    proc = cli([f"train.resume={d}"])
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    check_resumed_from(err, {last.name})
    assert records(d) == records(whole)
