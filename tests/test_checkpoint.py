"""Checkpoints: exact resume, damaged checkpoints, foreign configs, and kills while writing."""

from __future__ import annotations

import json
import random
import shutil
import signal
import time

import pytest

from adapipe_cli.cli.main import main
from adapipe_cli import checkpoint
from conftest import TINY, fixed_clock
from procs import check_resumed_from, cli, cut_at, verifies

MIXED = ["schedule=adapipe", "heuristic=fixed", "heuristic.plan=[[sync,4],[async,6],[sync,3],[async,null]]",
         "pipeline.stages=4", "pipeline.microbatches=2", "schedule.mitigation=[predict]"]


def records(run_dir):
    return [{k: v for k, v in json.loads(x).items() if k != "wall_s"}
            for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run(run_dir, *overrides):
    return main(["train", *TINY, *overrides, f"hydra.run.dir={run_dir}"])


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished 4-step run on 2 stages with checkpoints at steps 2 and 4, shared by the tests
    of refused resumes (a refused resume writes nothing, which they check); a test whose resume
    succeeds works on a copy."""
    d = tmp_path_factory.mktemp("finished") / "run"
    with pytest.MonkeyPatch.context() as m:  # (set up before the test's own fixtures: conftest's cache, here too)
        m.setenv("ADAPIPE_CACHE", str(tmp_path_factory.getbasetemp() / "adapipe-cache"))
        assert run(d, "pipeline.stages=2", "train.max_steps=4", "train.checkpoint_every=2") == 0
    return d


# cuts in the first async stretch (5), where it drains into sync (10), in the last async stream (15)
@pytest.mark.parametrize("stop", [pytest.param(5, marks=pytest.mark.slow), 10, pytest.param(15, marks=pytest.mark.slow)])
def test_resume_gives_the_uninterrupted_run(tmp_path, stop):
    whole = tmp_path / "whole"
    assert run(whole, *MIXED, "train.max_steps=16", "train.checkpoint_every=5", "train.keep_checkpoints=4") == 0
    cut = cut_at(whole, tmp_path / "cut", stop)  # as if stopped right after that step
    assert main(["train", f"train.resume={cut}"]) == 0
    assert records(cut) == records(whole)
    s_whole, s_cut = (json.loads((d / "summary.json").read_text()) for d in (whole, cut))
    assert s_cut["time_s"] == s_whole["time_s"] and s_cut["final_val_ppl"] == s_whole["final_val_ppl"]


def test_damaged_checkpoint_falls_back_to_the_previous_one(tmp_path, capsys, finished_run):
    d = tmp_path / "run"
    shutil.copytree(finished_run, d)  # (its checkpoints at steps 2 and 4; damaged and resumed: a copy)
    newest = checkpoint.complete(d)[-1]
    part = newest / "pipeline.pt"
    part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])  # truncated
    folder, manifest = checkpoint.load_latest(d, warn=print)
    assert folder.name == "step-0000002" and manifest["step"] == 2
    assert "step-0000004 is unusable" in capsys.readouterr().out
    assert main(["train", f"train.resume={d}"]) == 0
    assert capsys.readouterr().err.count("step-0000004 is unusable") == 1  # said once


def test_a_checkpoint_of_another_configuration_is_refused(tmp_path, capsys, finished_run):
    d = finished_run
    capsys.readouterr()
    before = {p.name: p.stat().st_mtime for p in d.rglob("*")}
    assert main(["train", f"train.resume={d}", "pipeline.stages=4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pipeline.stages=2 in the checkpoint, 4 now" in err[0]
    capsys.readouterr()
    assert main(["train", f"train.resume={tmp_path / 'nothing'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nothing: no such directory" in err[0], err
    assert main(["train", f"train.resume={tmp_path}"]) == 2  # a folder, but no run's
    assert "no checkpoints in that directory" in capsys.readouterr().err
    assert {p.name: p.stat().st_mtime for p in d.rglob("*") if p.name in before} == before  # nothing touched


def test_a_finished_sync_run_with_a_constant_lr_continues_for_more_steps(tmp_path):
    """Sync (a flush every step) with optim.decay=constant: 3 steps, then resumed to 6, trains what a
    6-step run trains; the only extra record is the 3-step run's final evaluation (evaluations
    every 4 steps: the 6-step run's are at 0, 4 and 6)."""
    sync = ["schedule=1f1b", "pipeline.stages=2", "pipeline.microbatches=2", "optim.decay=constant",
            fixed_clock(tmp_path, 2)]  # (one clock for both)
    whole, d = tmp_path / "whole", tmp_path / "run"
    assert run(whole, *sync, "train.max_steps=6") == 0
    assert run(d, *sync, "train.max_steps=3", "train.save_final=true") == 0
    assert main(["train", f"train.resume={d}", "train.max_steps=6"]) == 0
    extended = [r for r in records(d) if not (r["kind"] == "eval" and r["step"] == 3)]
    assert extended == records(whole)
    assert json.loads((d / "summary.json").read_text())["steps"] == 6


def test_more_steps_of_an_async_or_cosine_run_are_refused_saying_how(capsys, finished_run):
    d = finished_run  # AdaPipe (async stretches) with a cosine decay, finished at step 4
    capsys.readouterr()
    before = {p: p.stat().st_mtime for p in d.rglob("*")}
    assert main(["train", f"train.resume={d}", "train.max_steps=12"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.max_steps=4 in the checkpoint, 12 now" in err[0], err
    assert "synchronous schedule (1f1b, gpipe) and optim.decay=constant" in err[0]
    assert "start a new run with train.max_steps=12, or resume with train.max_steps=4" in err[0]
    assert {p: p.stat().st_mtime for p in d.rglob("*")} == before  # (the run is shared: nothing written)


def test_final_state_only(tmp_path):
    d = tmp_path / "run"
    assert run(d, "train.max_steps=3", "train.checkpoint_every=0", "train.save_final=true", fixed_clock(tmp_path, 4)) == 0
    assert [f.name for f in checkpoint.complete(d)] == ["step-0000003"]
    manifest = checkpoint.verify(checkpoint.complete(d)[0])
    assert set(manifest["parts"]) == {"trainer", "pipeline"} and manifest["step"] == 3


def _kill_while_writing(tmp_path, kills: int, seed: int):
    """Start, SIGKILL at a random moment once checkpoints are being written (slowed down so that
    most kills land inside a write), resume, repeat; finally let it finish."""
    rng = random.Random(seed)
    args = [*TINY, *MIXED, "train.max_steps=30", "train.checkpoint_every=1", "train.keep_checkpoints=2"]
    whole = tmp_path / "whole"
    assert run(whole, *args) == 0
    d = tmp_path / "killed"
    slow = {"ADAPIPE_TEST_CHECKPOINT_DELAY": "0.05"}
    proc = cli([*args, f"hydra.run.dir={d}", f"pipeline.profile={whole / 'profile.json'}"], slow)  # one clock
    candidates = None  # the checkpoints a resume may use: the newest complete one or the one before
    for _ in range(kills):
        deadline = time.time() + 60
        while not checkpoint.complete(d) and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(rng.uniform(0.05, 0.6))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        check_resumed_from(proc.stderr.read(), candidates)
        if (d / "summary.json").exists():
            break
        assert not [p for p in (d / "checkpoints").iterdir() if p.name.startswith("step-") and not verifies(p)
                    and (p / checkpoint.MANIFEST).exists() and p != checkpoint.complete(d)[-1]]
        candidates = {f.name for f in checkpoint.complete(d)[-2:]}
        assert candidates, "a kill left no checkpoint"
        proc = cli([f"train.resume={d}"], slow)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    check_resumed_from(err, candidates)
    assert records(d) == records(whole)


@pytest.mark.slow  # a subprocess run of more than 8 s (fast suite: under 5 min on 2 busy cores)
def test_sigkill_while_writing_checkpoints(tmp_path):
    _kill_while_writing(tmp_path, kills=3, seed=0)


@pytest.mark.slow
def test_sigkill_while_writing_checkpoints_many_times(tmp_path):
    _kill_while_writing(tmp_path, kills=15, seed=1)


def test_no_temporary_or_partial_checkpoint_is_ever_listed(tmp_path):
    d = tmp_path / "run"
    (d / "checkpoints" / ".tmp-step-0000009-1-2").mkdir(parents=True)
    (d / "checkpoints" / "step-0000010").mkdir()  # no manifest: not complete
    assert checkpoint.complete(d) == []
    with pytest.raises(checkpoint.CheckpointError):
        checkpoint.load_latest(d)
    checkpoint.clean_partial(d)
    assert not (d / "checkpoints" / ".tmp-step-0000009-1-2").exists()


def _write(d, step, payload, keep=3):
    folder = checkpoint.begin(d, step)
    parts = {"trainer": checkpoint.write_part(folder, "trainer", payload)}
    return checkpoint.commit(d, folder, step, parts, {}, keep)


def _payload(d):
    folder, manifest = checkpoint.load_latest(d)
    return folder.name, checkpoint.read_part(folder, manifest, "trainer")


def test_a_step_written_again_replaces_its_checkpoint(tmp_path):
    d = tmp_path / "run"
    _write(d, 2, {"v": "old"})
    _write(d, 2, {"v": "new"})
    assert _payload(d) == ("step-0000002", {"v": "new"})
    assert sorted(p.name for p in checkpoint.root(d).iterdir()) == ["step-0000002"]


@pytest.mark.parametrize("step", [2, 12_345_678])  # (a name of 8 digits)
def test_a_crash_while_a_step_is_written_again_keeps_the_old_checkpoint(tmp_path, monkeypatch, step):
    """The only checkpoint (keep=1) of a step is written again, and the run dies between moving
    the old one aside and renaming the new one into place: the old one is still listed and
    verified (a resume's preflight reads it so), and cleaning up puts it back under its name."""
    d = tmp_path / "run"
    name = f"step-{step:07d}"
    _write(d, step, {"v": "old"}, keep=1)
    real_rename, calls = checkpoint.os.rename, []

    def dies_at_the_second_rename(a, b):
        calls.append((a, b))
        if len(calls) == 2:
            raise KeyboardInterrupt  # (the process stops here)
        real_rename(a, b)

    monkeypatch.setattr(checkpoint.os, "rename", dies_at_the_second_rename)
    with pytest.raises(KeyboardInterrupt):
        _write(d, step, {"v": "new"}, keep=1)
    monkeypatch.setattr(checkpoint.os, "rename", real_rename)
    assert not (checkpoint.root(d) / name).exists()
    assert [p.name.startswith(checkpoint.REPLACED) for p in checkpoint.complete(d)] == [True]
    assert _payload(d)[1] == {"v": "old"}
    checkpoint.clean_partial(d)
    assert sorted(p.name for p in checkpoint.root(d).iterdir()) == [name]
    assert _payload(d) == (name, {"v": "old"})


def test_a_crash_after_the_replacement_arrived_leaves_the_new_checkpoint(tmp_path, monkeypatch):
    d = tmp_path / "run"
    _write(d, 2, {"v": "old"})
    monkeypatch.setattr(checkpoint.shutil, "rmtree", lambda *a, **k: None)  # the old one is never removed
    _write(d, 2, {"v": "new"})
    monkeypatch.undo()
    assert len(list(checkpoint.root(d).iterdir())) == 2  # the new one and the old one moved aside
    assert _payload(d) == ("step-0000002", {"v": "new"})
    checkpoint.clean_partial(d)
    assert sorted(p.name for p in checkpoint.root(d).iterdir()) == ["step-0000002"]
    assert _payload(d) == ("step-0000002", {"v": "new"})


def _text_run(tmp_path, text: str):
    """A finished 4-step run with a checkpoint, on a local text file; returns (run dir, its overrides)."""
    train_file = tmp_path / "a" / "train.txt"
    train_file.parent.mkdir()
    train_file.write_text(text)
    args = ["data=text", "data.vocab_size=300", f"data.cache_dir={tmp_path / 'cache'}", "train.max_steps=4",
            "train.checkpoint_every=2", "train.batch_size=4", "pipeline.stages=2", fixed_clock(tmp_path, 2)]
    d = tmp_path / "run"
    assert run(d, *args, f"data.train={train_file}") == 0
    return d, train_file


TEXT = "".join(f"line {i}: the quick brown fox jumps over the lazy dog number {i % 7}.\n" for i in range(400))


def test_resume_refuses_a_changed_data_file_and_accepts_it_moved(tmp_path, capsys):
    d, train_file = _text_run(tmp_path, TEXT)
    (d / "summary.json").unlink()
    moved = tmp_path / "b" / "train.txt"  # the same file at another path: the same numbers
    moved.parent.mkdir()
    shutil.copy(train_file, moved)
    train_file.write_text(TEXT.replace("lazy", "sleepy"))  # the original path now holds other text
    capsys.readouterr()
    before = {p: p.stat().st_mtime_ns for p in d.rglob("*")}
    assert main(["train", f"train.resume={d}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"the train data of data.train={train_file} differs" in err[0], err
    assert {p: p.stat().st_mtime_ns for p in d.rglob("*")} == before  # a refused resume changes nothing
    assert main(["train", f"train.resume={d}", f"data.train={moved}", "train.max_steps=4"]) == 0
    assert json.loads((d / "summary.json").read_text())["steps"] == 4


def test_resume_refuses_another_cost_profile(tmp_path, capsys, finished_run):
    d = tmp_path / "run"
    shutil.copytree(finished_run, d)  # (resumed at the end: a copy of the shared run)
    prof = json.loads((d / "profile.json").read_text())
    same, other = tmp_path / "same.json", tmp_path / "other.json"
    same.write_text(json.dumps(prof))
    other.write_text(json.dumps(dict(prof, update=[u * 2 + 1e-3 for u in prof["update"]])))
    capsys.readouterr()
    assert main(["train", f"train.resume={d}", f"pipeline.profile={other}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"the cost profile of pipeline.profile={other} differs" in err[0], err
    assert main(["train", f"train.resume={d}", f"pipeline.profile={same}"]) == 0  # the same numbers elsewhere


@pytest.mark.slow
def test_resume_refuses_a_profile_with_another_link(tmp_path, capsys):
    """The profiled clock charges the link a profile holds: the same numbers with another link, or
    none, are another clock (a hand-made pair of profiles; the same link elsewhere resumes)."""
    from adapipe_cli.simulator.clock import CostProfile

    paths = {name: tmp_path / f"{name}.json" for name in ("linked", "moved", "slower", "none")}
    links = {"linked": {"latency_s": 1e-3, "bandwidth": 1e8}, "moved": {"latency_s": 1e-3, "bandwidth": 1e8},
             "slower": {"latency_s": 1e-3, "bandwidth": 5e7}, "none": {}}
    for name, path in paths.items():
        prof = CostProfile.uniform(2, 1e-3, 2e-3, 1e-4, act_bytes=4096.0)
        prof.link = links[name]
        prof.save(path)
    d = tmp_path / "run"
    assert run(d, "pipeline.stages=2", "train.max_steps=4", "train.checkpoint_every=2",
               f"pipeline.profile={paths['linked']}") == 0
    before = {p: p.stat().st_mtime_ns for p in d.rglob("*")}
    for name in ("slower", "none"):
        capsys.readouterr()
        assert main(["train", f"train.resume={d}", f"pipeline.profile={paths[name]}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and (f"the link between stages (latency, bandwidth) in the cost profile of "
                                  f"pipeline.profile={paths[name]} differs from the checkpoint's") in err[0], err
    assert {p: p.stat().st_mtime_ns for p in d.rglob("*")} == before  # a refused resume changes nothing
    assert main(["train", f"train.resume={d}", f"pipeline.profile={paths['moved']}"]) == 0


def test_a_profile_with_another_link_is_another_clock(make_cfg):
    """The same numbers with another link, or none, are refused in one line that names the link; a
    checkpoint written before the link had its own fingerprint is compared on the rest only."""
    from adapipe_cli.simulator.clock import CostProfile
    from adapipe_cli.train import fingerprint

    def profile(link: dict) -> CostProfile:
        prof = CostProfile.uniform(2, 1e-3, 2e-3, 1e-4, act_bytes=4096.0)
        prof.link = link
        return prof

    linked = fingerprint.profile_fingerprints(profile({"latency_s": 1e-3, "bandwidth": 1e8}))
    assert fingerprint.profile_fingerprints(profile({"latency_s": 1e-3, "bandwidth": 1e8})) == linked
    cfg = make_cfg("pipeline.profile=/x/slower.json")
    for link in ({"latency_s": 1e-3, "bandwidth": 5e7}, {"latency_s": 2e-3, "bandwidth": 1e8}, {}):
        now = fingerprint.profile_fingerprints(profile(link))
        assert now[fingerprint.PROFILE] == linked[fingerprint.PROFILE]
        line = fingerprint.refusal(cfg, "CK", {"fingerprints": linked}, now)
        assert line == ("checkpoint CK ran on another clock: the link between stages (latency, bandwidth) in the cost "
                        "profile of pipeline.profile=/x/slower.json differs from the checkpoint's; resume with the "
                        "profile the run used (its profile.json)")
        assert fingerprint.refusal(cfg, "CK", {"fingerprints": {fingerprint.PROFILE: linked[fingerprint.PROFILE]}},
                                   now) is None  # (an older checkpoint)
    # a configured link (pipeline.link_latency_s / link_bandwidth) is what the clock charges: the
    # profile's link then does not matter
    assert fingerprint.link_configured(make_cfg("pipeline.link_latency_s=1e-4"))
    assert not fingerprint.link_configured(cfg)
    configured = fingerprint.profile_fingerprints(profile({"latency_s": 1e-3, "bandwidth": 1e8}), True)
    for link in ({"latency_s": 1e-3, "bandwidth": 5e7}, {}):
        now = fingerprint.profile_fingerprints(profile(link), True)
        assert fingerprint.refusal(cfg, "CK", {"fingerprints": configured}, now) is None
    assert fingerprint.refusal(cfg, "CK", {"fingerprints": configured}, linked) is not None


def test_resume_refuses_another_thread_count(capsys, finished_run):
    d = finished_run
    before = {p: p.stat().st_mtime_ns for p in d.rglob("*")}
    capsys.readouterr()
    assert main(["train", f"train.resume={d}", "pipeline.threads=2"]) == 2
    assert "pipeline.threads=1 in the checkpoint, 2 now" in capsys.readouterr().err
    assert {p: p.stat().st_mtime_ns for p in d.rglob("*")} == before  # (the run is shared: nothing written)


def test_paths_are_free_only_where_the_checkpoint_has_fingerprints():
    """An older checkpoint, without fingerprints, cannot tell a moved file from a changed one."""
    saved, now = {"data": {"train": "/a/train.txt"}}, {"data": {"train": "/b/train.txt"}}
    old = checkpoint.config_differences(saved, now, checkpoint.free_keys({}))
    assert old == ["data.train='/a/train.txt' in the checkpoint, '/b/train.txt' now"]
    assert checkpoint.config_differences(saved, now, checkpoint.free_keys({"fingerprints": {"train data": "x"}})) == []


def test_a_checkpoint_from_before_chunks_and_gain_resumes_at_their_defaults():
    """schedule.chunks (interleaved) and gain's heuristic.delay_drift / delay_trend / drift_taper_kd / prior_logit_sd are newer than
    some checkpoints: leaving them at their defaults resumes, changing them is a difference; the
    relative prior spread and drift that prior_logit_sd and delay_drift replaced, held by a
    checkpoint (the drift at its default), are no difference."""
    old = {"schedule": {"name": "adapipe"}, "heuristic": {"name": "goodput"}}
    now = {"schedule": {"name": "adapipe", "chunks": 1},
           "heuristic": {"name": "goodput", "delay_drift": 0.37, "delay_trend": 0.24, "drift_taper_kd": [1.35, 3.15],
                         "prior_logit_sd": 1.0}}
    assert checkpoint.config_differences(old, now) == []
    now["heuristic"]["drift_taper_kd"] = None  # (what a run from before the taper did: none)
    assert checkpoint.config_differences(old, now) == []
    now["heuristic"]["drift_taper_kd"] = [1.0, 2.0]
    assert checkpoint.config_differences(old, now) == ["heuristic.drift_taper_kd=None in the checkpoint, [1.0, 2.0] now"]
    now["heuristic"]["drift_taper_kd"] = [1.35, 3.15]
    # a run that chose no taper (null, held by its checkpoint) is not a run from before the key
    assert checkpoint.config_differences({"heuristic": {"drift_taper_kd": None}}, {"heuristic": {"drift_taper_kd": [1.35, 3.15]}}) \
        == ["heuristic.drift_taper_kd=None in the checkpoint, [1.35, 3.15] now"]
    now["heuristic"]["delay_trend"] = 0.0
    assert checkpoint.config_differences(old, now) == ["heuristic.delay_trend=None in the checkpoint, 0.0 now"]
    now["heuristic"]["delay_trend"] = 0.24
    retired = {"schedule": {"name": "adapipe"}, "heuristic": {"name": "goodput", "drift": 0.25, "prior_spread": 0.5}}
    assert checkpoint.config_differences(retired, now) == []
    now["heuristic"]["delay_drift"] = 0.1
    assert checkpoint.config_differences(old, now) == ["heuristic.delay_drift=None in the checkpoint, 0.1 now"]
    # a drift the run chose (not the default it was retired at) cannot go on under another rule: refused
    now["heuristic"]["delay_drift"] = 0.37
    chose = {"schedule": {"name": "adapipe"}, "heuristic": {"name": "goodput", "drift": 0.1}}
    assert checkpoint.config_differences(chose, now) == [
        "heuristic.drift=0.1 in the checkpoint, a key retired since: heuristic.delay_drift, gain's drift per doubling "
        "of the step per unit of the delay's k d since 2026-12-03 (the drift is delay_drift x k d; default 0.37, "
        "which is 0.25 at d = 1.5)"]


def test_a_profile_measured_before_the_later_entries_keeps_its_fingerprint():
    """A profile with accumulate and data all zero and no in-flight table (measured before they
    existed) hashes as the fields it had then did (written out here, field by field, as the old
    rule); non-zero or present, they count."""
    import hashlib
    import json

    from adapipe_cli.simulator.clock import CostProfile
    from adapipe_cli.train import fingerprint

    prof = CostProfile.uniform(2, 1e-3, 2e-3, 1e-4, act_bytes=4096.0)
    old = {"forward": [1e-3, 1e-3], "backward": [2e-3, 2e-3], "update": [1e-4, 1e-4], "act_bytes": 4096.0,
           "copy": [0.0, 0.0], "predict": [0.0, 0.0], "memory": {}, "input": [1e-3, 1e-3], "weight": [1e-3, 1e-3]}
    digest = hashlib.sha256(json.dumps(old, sort_keys=True).encode()).hexdigest()
    assert all(x == 0 for x in prof.accumulate) and all(x == 0 for x in prof.data) and prof.held == {}
    assert fingerprint.profile_fingerprint(prof) == digest
    prof.held = {"depths": [1, 4], "forward": [[1.0, 1.1]] * 2, "backward": [[1.0, 1.2]] * 2}
    assert fingerprint.profile_fingerprint(prof) != digest
    prof.held = {}
    prof.accumulate = [1e-5, 1e-5]
    assert fingerprint.profile_fingerprint(prof) != digest


def test_a_resume_drops_a_retired_key_the_run_was_given(tmp_path):
    """A run started with heuristic.prior_spread (retired) resumes: its replayed overrides leave the
    retired key out (naming it now is refused, see tests/test_train.py), the others stay."""
    from adapipe_cli.cli.train import _resume_overrides

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / ".hydra").mkdir()
    (run / ".hydra" / "overrides.yaml").write_text(
        "- schedule=adapipe\n- heuristic=gain\n- heuristic.prior_spread=0.3\n- +heuristic.prior_spread=0.3\n- seed=3\n")
    out = _resume_overrides([f"train.resume={run}", "train.max_steps=20"])
    assert out == ["schedule=adapipe", "heuristic=gain", "seed=3", f"train.resume={run.resolve()}", "train.max_steps=20",
                   f"hydra.run.dir={run.resolve()}"]


def test_a_checkpoint_from_before_a_changed_default_is_refused_with_the_override_that_resumes_it():
    """heuristic.signal's default became train on 2026-12-04: a checkpoint holding the old default
    (heldout) differs from a run at the new one, and the line names the override that resumes it;
    another value gets no hint."""
    from adapipe_cli import checkpoint

    now = {"heuristic": {"signal": "train"}}
    assert checkpoint.config_differences({"heuristic": {"signal": "heldout"}}, now) == [
        "heuristic.signal='heldout' in the checkpoint, 'train' now (the default until 2026-12-04: resume with "
        "heuristic.signal=heldout)"]
    assert checkpoint.config_differences({"heuristic": {"signal": "train"}}, {"heuristic": {"signal": "heldout"}}) == [
        "heuristic.signal='train' in the checkpoint, 'heldout' now"]
    # gain's probe_se: 0.5 until 2026-12-05, now null (the A/A median of the run's signal)
    assert checkpoint.config_differences({"heuristic": {"probe_se": 0.5}}, {"heuristic": {"probe_se": None}}) == [
        "heuristic.probe_se=0.5 in the checkpoint, None now (the default until 2026-12-05: resume with "
        "heuristic.probe_se=0.5)"]


def test_probe_se_binds_only_a_gain_run_on_resume():
    """heuristic.probe_se prices only gain's probes: a checkpoint of another run holding its old
    default (0.5) resumes under the new one (null); a gain run's is refused (its next probes would
    be priced otherwise)."""
    from adapipe_cli import checkpoint

    def cfg(schedule, heuristic, se):
        return {"schedule": {"name": schedule}, "heuristic": {"name": heuristic, "probe_se": se},
                "optim": {"decay": "constant"}, "pipeline": {"clock": "auto"}, "train": {"max_steps": 10}}

    for schedule, heuristic in (("1f1b", "goodput"), ("adapipe", "goodput"), ("adapipe", "rate")):
        old, now = cfg(schedule, heuristic, 0.5), cfg(schedule, heuristic, None)
        free = checkpoint.resume_free_keys({"config": old}, now)
        assert checkpoint.config_differences(old, now, free) == []
    old, now = cfg("adapipe", "gain", 0.5), cfg("adapipe", "gain", None)
    for c in (old, now):
        c["heuristic"]["signal"] = "train"
    free = checkpoint.resume_free_keys({"config": old}, now)
    assert checkpoint.config_differences(old, now, free) == [
        "heuristic.probe_se=0.5 in the checkpoint, None now (the default until 2026-12-05: resume with "
        "heuristic.probe_se=0.5)"]
    # on the held-out signal null means 0.5: the same run
    for c in (old, now):
        c["heuristic"]["signal"] = "heldout"
    assert checkpoint.config_differences(old, now, checkpoint.resume_free_keys({"config": old}, now)) == []
