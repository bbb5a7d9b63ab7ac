"""``adapipe train`` end to end: outputs, learning, determinism, the console script, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from adapipe_cli.cli.main import main
from adapipe_cli.train.loop import train
from conftest import TINY, built_not_drawn, drawn_plots, fixed_clock

STEP_KEYS = {"step", "phase", "loss", "lr", "tokens", "time_s", "wall_s", "staleness", "bubble"}
EVAL_KEYS = {"step", "val_loss", "val_ppl", "time_s", "wall_s"}
SUMMARY_KEYS = {"final_val_ppl", "best_val_ppl", "target_ppl", "time_to_target_s", "steps", "tokens",
                "tokens_per_s", "time_s", "wall_s", "clock"}


def read(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.plots  # checks the plot files: drawn and written (tests/conftest.py)
def test_synthetic_loss_goes_down_and_outputs_are_written(make_cfg, tmp_path):
    cfg = make_cfg("train.max_steps=40", "train.eval_every=10", "optim.lr=3e-3", "pipeline.stages=2",
                   "pipeline.microbatches=2")
    summary = train(cfg, tmp_path)
    recs = read(tmp_path)
    steps = [r for r in recs if r["kind"] == "step"]
    evals = [r for r in recs if r["kind"] == "eval"]
    assert len(steps) == 40 and all(STEP_KEYS <= r.keys() for r in steps)
    assert [r["step"] for r in evals] == [0, 10, 20, 30, 40] and all(EVAL_KEYS <= r.keys() for r in evals)
    assert evals[-1]["val_ppl"] < 0.5 * evals[0]["val_ppl"]
    assert SUMMARY_KEYS <= summary.keys()
    assert summary == json.loads((tmp_path / "summary.json").read_text())
    assert summary["clock"] == "pipeline" and summary["tokens"] == 40 * 8 * 16
    assert summary["steps"] == 40 and summary["final_val_ppl"] == evals[-1]["val_ppl"]
    assert summary["min_ppl"] > 1
    for f in ("curves.png", "profile.json", "metrics.jsonl"):
        assert (tmp_path / f).stat().st_size > 0
    times = [r["time_s"] for r in steps]
    assert all(b > a for a, b in zip(times, times[1:]))  # the pipeline clock moves forward


def test_same_seed_and_profile_give_the_same_metrics(make_cfg, tmp_path):
    from adapipe_cli.train import summary

    run = ("train.max_steps=8", "pipeline.stages=2", "schedule=pipedream")
    # (only this run's phases.png is checked: drawn and written; its curves.png, which
    # test_synthetic_loss_goes_down_and_outputs_are_written checks, and the others' plots are not drawn)
    with drawn_plots(), pytest.MonkeyPatch.context() as m:
        m.setattr(summary, "plot_curves", built_not_drawn(summary.plot_curves))
        a = train(make_cfg(*run), tmp_path / "a")
    assert (tmp_path / "a" / "phases.png").stat().st_size > 0  # one phase, shaded: every run writes it

    a_clock = f"pipeline.profile={tmp_path / 'a' / 'profile.json'}"
    b = train(make_cfg(*run, a_clock), tmp_path / "b")

    def strip(recs):
        return [{k: v for k, v in r.items() if k != "wall_s"} for r in recs]

    assert strip(read(tmp_path / "a")) == strip(read(tmp_path / "b"))
    assert a["time_s"] == b["time_s"]
    # another seed (on a's clock: no profile of its own to measure, and the losses do not depend on it)
    c = train(make_cfg(*run, "seed=1", a_clock), tmp_path / "c")
    assert c["final_val_loss"] != a["final_val_loss"]


def test_target_and_stop_at_target(make_cfg, tmp_path):
    cfg = make_cfg("train.max_steps=60", "train.eval_every=5", "optim.lr=3e-3", "train.target_ppl=40",
                   "train.stop_at_target=true", "pipeline.stages=2", fixed_clock(tmp_path, 2))
    s = train(cfg, tmp_path / "run")
    assert s["time_to_target_s"] is not None and s["stopped"] == "target"
    assert s["steps"] == s["step_to_target"] < 60
    evals = [r for r in read(tmp_path / "run") if r["kind"] == "eval"]
    first = next(r for r in evals if r["val_ppl"] <= 40)
    assert s["time_to_target_s"] == first["time_s"]


def run_cli(*args, cwd=None):
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    exe = os.path.join(os.path.dirname(sys.executable), "adapipe")
    return subprocess.run([exe, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=300)


@pytest.mark.slow  # a subprocess run of more than 8 s (fast suite: under 5 min on 2 busy cores)
def test_console_script_runs_and_prints_where_results_are(tmp_path):
    out = tmp_path / "run"
    r = run_cli("train", *TINY, "train.max_steps=4", f"hydra.run.dir={out}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"results: {out}" in r.stdout
    assert (out / "summary.json").is_file() and (out / "curves.png").is_file()
    assert "runtime=local" in r.stderr.splitlines()[0]


def test_a_single_run_composes_once_and_writes_what_hydra_main_writes(tmp_path, monkeypatch):
    """``adapipe train`` composes a single run's config once (``hydra.main`` would compose twice
    more), and its run directory holds the ``.hydra`` files ``hydra.main`` writes: the task's config,
    the overrides given, and Hydra's node with the run directory, the job's name and the mode."""
    import yaml
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    from adapipe_cli.cli import compose

    monkeypatch.setattr(compose, "compose_config", compose.compose_config.__wrapped__)  # not the tests' cache
    calls, real = [], ConfigLoaderImpl.load_configuration
    monkeypatch.setattr(ConfigLoaderImpl, "load_configuration", lambda self, *a, **k: calls.append(k) or real(self, *a, **k))
    out, clock = tmp_path / "run", fixed_clock(tmp_path)
    assert main(["train", *TINY, "train.max_steps=2", clock, f"hydra.run.dir={out}"]) == 0
    assert len(calls) == 1
    assert yaml.safe_load((out / ".hydra" / "overrides.yaml").read_text()) == [*TINY, "train.max_steps=2", clock]
    node = yaml.safe_load((out / ".hydra" / "hydra.yaml").read_text())["hydra"]
    assert node["overrides"]["hydra"] == [f"hydra.run.dir={out}", "hydra.mode=RUN"] and node["mode"] == "RUN"
    assert node["job"]["name"] == "train" and node["runtime"]["output_dir"] == str(out)
    config = yaml.safe_load((out / ".hydra" / "config.yaml").read_text())
    assert "hydra" not in config and config["train"]["max_steps"] == 2 and (out / "summary.json").is_file()
    # a run directory given relative is recorded as given, a mode given once; Hydra's flags go to
    # hydra.main, which refuses one it does not know, before anything is written
    monkeypatch.chdir(tmp_path)
    assert main(["train", *TINY, "train.max_steps=2", clock, "hydra.run.dir=rel/run", "hydra.mode=RUN"]) == 0
    node = yaml.safe_load((tmp_path / "rel" / "run" / ".hydra" / "hydra.yaml").read_text())["hydra"]
    assert node["run"]["dir"] == "rel/run" and node["overrides"]["hydra"] == ["hydra.run.dir=rel/run", "hydra.mode=RUN"]
    assert main(["train", *TINY, "hydra.run.dir=rel/flag", "--no-such-flag"]) == 2 and not (tmp_path / "rel" / "flag").exists()


def test_help_lists_commands_and_groups(capsys):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    assert all(c in text for c in ("train", "simulate", "sweep", "report"))
    assert main(["train", "--help"]) == 0
    text = capsys.readouterr().out
    groups = dict(line.strip().split(": ", 1) for line in text.split("Config groups")[1].split("\n\n")[0].splitlines()[1:])
    assert set(groups) == {"data", "heuristic", "logger", "model", "optim", "pipeline", "schedule"}  # no sweep
    assert groups["schedule"] == "1f1b, 2bw, adapipe, gpipe, interleaved, pipedream, zbh1, zbh2" and groups["data"].startswith("synthetic")
    assert not any("base" in options.split(", ") for options in groups.values())
    assert "pipeline:\n  stages: 4" in text  # the composed config follows
    assert main(["simulate", "--help"]) == 0  # the same for adapipe simulate: no bases
    text = capsys.readouterr().out
    assert text.startswith("usage: adapipe simulate") and "steps: 8" in text
    assert "base" not in text.split("Config groups")[1].split("\n\n")[0]


# a case whose check a fast case makes too, with another key or value (a compose each, 0.4 s on 2
# busy cores): slow (make test-all); the comment beside each names the fast one
SAME = pytest.mark.slow
BAD = [
    (["pipeline.stagez=4"], "unknown config key 'pipeline.stagez'"),
    (["schedule=1f1bb"], "unknown schedule '1f1bb'"),
    pytest.param(["heuristic=nope"], "unknown heuristic 'nope'", marks=SAME),  # (fast: schedule=1f1bb)
    (["pipeline.stages=four"], "pipeline.stages"),
    (["pipeline.stages=0"], "pipeline.stages must be at least 1"),
    (["pipeline.stages=5"], "more than the 4 blocks"),
    (["train.batch_size=10", "pipeline.microbatches=4"], "not divisible"),
    (["optim.lr=0"], "optim.lr must be positive"),
    (["optim.lr=-1e-3"], "optim.lr must be positive"),
    (["optim.lr=1e39"], "optim.lr=1e+39 is too large: the optimizer's first step overflows float32; lower optim.lr"),
    (["optim=muon", "optim.muon_lr=1e39"], "optim.muon_lr=1e+39 is too large"),
    (["optim.lr=1e37", "schedule.async_lr_scale=100"], "optim.lr=1e+37 is too large: the optimizer's first step (times 100"),
    (["train.max_steps=0"], "train.max_steps must be positive"),
    (["train.target_ppl=1"], "target_ppl must be greater than 1"),
    (["schedule.name=zigzag"], "unknown schedule 'zigzag'"),
    (["schedule=2bw", "pipeline.stages=4", "pipeline.microbatches=2"], "2bw needs pipeline.microbatches"),
    (["schedule=pipedream", "schedule.weights=fresh"], "schedule.weights"),
    (["schedule=pipedream", "schedule.mitigation=[magic]"], "unknown mitigation 'magic'"),
    (["pipeline.profile=/nonexistent/profile.json"], "does not exist"),
    (["heuristic=fixed", "heuristic.plan=[[sync,200],[asyn,null]]"], "heuristic.plan: unknown phase 'asyn'"),
    (["heuristic=fixed", "heuristic.plan=[sync,async]"], "heuristic.plan"),
    (["pipeline.stages", "4"], "'pipeline.stages' is not an override: write key=value with no spaces, e.g. pipeline.stages=4"),
    (["heuristic.start=soon"], "heuristic.start='soon'"),
    (["heuristic=gain", "heuristic.delay_drift=-0.1"], "heuristic.delay_drift=-0.1: give a spread >= 0"),
    (["heuristic=gain", "heuristic.drift=0.25"], "config key 'heuristic.drift' was retired: use heuristic.delay_drift"),
    (["heuristic=gain", "heuristic.prior_logit_sd=-1"], "heuristic.prior_logit_sd=-1.0: give a spread >= 0"),
    (["heuristic=gain", "heuristic.probe_se=inf"], "heuristic.probe_se=inf: give a spread >= 0"),
    (["heuristic=gain", "heuristic.delay_trend=nan"], "heuristic.delay_trend=nan: give a rise >= 0"),
    (["heuristic=gain", "heuristic.delay_trend=-0.2"], "heuristic.delay_trend=-0.2: give a rise >= 0"),
    (["heuristic=gain", "heuristic.drift_taper_kd=[3.15,1.35]"], "heuristic.drift_taper_kd=[3.15, 1.35]: give [from, to]"),
    (["heuristic=gain", "heuristic.drift_taper_kd=[1.35]"], "heuristic.drift_taper_kd=[1.35]: give [from, to]"),
    (["heuristic=gain", "heuristic.drift_taper_kd=[-1,2]"], "heuristic.drift_taper_kd=[-1.0, 2.0]: give [from, to]"),
    pytest.param(["heuristic=gain", "heuristic.prior_spread=0.5"],
                 "config key 'heuristic.prior_spread' was retired: use heuristic.prior_logit_sd", marks=SAME),  # (fast: heuristic.drift)
    (["heuristic=gain", "heuristic.sync_warmup=-5"], "heuristic.sync_warmup=-5: give a number of steps >= 0"),
    (["schedule=adapipe", "heuristic.signal=heldot"], "unknown heuristic.signal='heldot': use train or heldout"),
    (["heuristic.signal_tokens=0"], "heuristic.signal_tokens=0: give a positive number"),
    (["optim.beta1=1.5"], "optim.beta1=1.5: give a value in [0, 1)"),
    (["optim.eps=-1"], "optim.eps=-1: give a value >= 0"),
    (["optim=muon", "optim.muon_momentum=-1"], "optim.muon_momentum=-1: give a value >= 0"),
    (["optim=muon", "optim.muon_lr=20"], "optim.muon_lr x optim.weight_decay = 20 x 0.1 >= 1: each step would multiply the hidden matrices"),
    (["optim.weight_decay=1e45"], "optim.lr x optim.weight_decay = 0.001 x 1e+45 >= 1"),
    (["optim.lr=10"], "optim.lr x optim.weight_decay = 10 x 0.1 >= 1"),
    (["optim.weight_decay=-0.1"], "optim.weight_decay=-0.1: give a value >= 0"),
    (["schedule=1f1b", "schedule.chunks=2"], "schedule.chunks=2 needs schedule=interleaved"),
    (["schedule=interleaved", "pipeline.stages=2", "pipeline.microbatches=1"], "multiple of pipeline.stages=2"),
    (["schedule=interleaved", "pipeline.stages=4", "pipeline.microbatches=4"], "8 chunks is more than the 4 blocks"),
    (["schedule=interleaved", "pipeline.stages=1", "pipeline.microbatches=2", "pipeline.runtime=dist"],
     "needs pipeline.stages >= 2"),
    (["schedule=adapipe", "schedule.sync=interleaved"], "schedule.sync=interleaved needs schedule.chunks >= 2"),
    (["schedule=adapipe", "schedule.sync=interleaved", "schedule.chunks=2", "schedule.async=2bw"],
     "use schedule.async=pipedream schedule.weights=stash"),
    (["schedule=adapipe", "schedule.sync=interleaved", "schedule.chunks=2", "schedule.weights=latest"],
     "use schedule.async=pipedream schedule.weights=stash"),
    (["schedule=adapipe", "schedule.sync=interleaved", "schedule.chunks=2", "pipeline.stages=2", "pipeline.runtime=dist"],
     "does not roll back yet: use heuristic.guard=false"),  # (found while the runtime is built, before any worker)
    (["schedule=adapipe", "schedule.sync=interleaved", "schedule.chunks=2", "pipeline.stages=2", "pipeline.runtime=dist",
      "heuristic.guard=false", "train.checkpoint_every=5"], "does not write or resume checkpoints yet"),
]


# refused before validate() (by Hydra composing the config, or by the command line: the override
# itself) or after it (by the run's set-up): checked through adapipe train alone
NOT_BY_VALIDATE = {
    "unknown config key 'pipeline.stagez'", "unknown schedule '1f1bb'", "unknown heuristic 'nope'", "pipeline.stages",
    "'pipeline.stages' is not an override: write key=value with no spaces, e.g. pipeline.stages=4",
    "heuristic.start='soon'", "config key 'heuristic.drift' was retired: use heuristic.delay_drift",
    "config key 'heuristic.prior_spread' was retired: use heuristic.prior_logit_sd",
    "does not roll back yet: use heuristic.guard=false", "does not write or resume checkpoints yet"}
# validate()'s refusals all take one path through adapipe train (compose, validate, one line, exit 2,
# nothing written), a compose each (0.4 s on 2 busy cores): these three take it in the fast suite,
# the others in make test-all; every one of them is refused fast by validate() itself, on the
# composed config (test_validate_refuses_each_bad_value below)
VALIDATE_THROUGH_THE_CLI = {"pipeline.stages must be at least 1", "does not exist",
                            "optim.lr=1e+39 is too large: the optimizer's first step overflows float32; lower optim.lr"}


def _values(case):
    return case.values if hasattr(case, "values") else case


def _through_the_cli(case):
    overrides, message = _values(case)
    slow = message not in NOT_BY_VALIDATE | VALIDATE_THROUGH_THE_CLI
    return pytest.param(overrides, message, id=message[:30], marks=(*getattr(case, "marks", ()), *([pytest.mark.slow] if slow else [])))


# refused after the run's runtime is built: given a profile, it measures none (0.7 s on 2 busy cores)
AFTER_THE_RUNTIME = {"heuristic.start='soon'"}


@pytest.mark.parametrize("overrides,message", [_through_the_cli(b) for b in BAD])
def test_bad_input_is_one_line_and_exit_2(overrides, message, capsys, tmp_path):
    clock = [fixed_clock(tmp_path)] if message in AFTER_THE_RUNTIME else []
    assert main(["train", *TINY, *overrides, *clock, f"hydra.run.dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "run").exists()  # rejected before anything is written


@pytest.mark.parametrize("overrides,message", [pytest.param(*_values(b), id=_values(b)[1][:30]) for b in BAD
                                               if _values(b)[1] not in NOT_BY_VALIDATE])
def test_validate_refuses_each_bad_value(overrides, message, make_cfg):
    """validate() refuses each bad value of BAD that it is for, in one line (on the composed config:
    the compose does not validate)."""
    from adapipe_cli.config import ConfigError, validate

    cfg = make_cfg(*overrides)
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert len(str(e.value).splitlines()) == 1 and message in str(e.value), e.value


@pytest.mark.parametrize("optim, rate", [([], "lower optim.lr or"),
                                         (["optim=muon", "optim.lr=1e30", "optim.muon_lr=1e30"], "lower optim.muon_lr or optim.lr or")])
def test_a_huge_learning_rate_within_float32_diverges_in_one_line(capsys, tmp_path, optim, rate):
    """optim.lr=1e30 (no weight decay: lr x weight_decay >= 1 is refused up front): the first step
    fits float32, the loss after it does not; the run says so in one line naming the rates to
    lower (with Muon its own first), exit 1, and keeps what it wrote (it ran)."""
    assert main(["train", *TINY, "optim.lr=1e30", *optim, "optim.weight_decay=0", "pipeline.stages=2", "train.max_steps=3",
                 fixed_clock(tmp_path, 2), f"hydra.run.dir={tmp_path / 'run'}"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("adapipe: error: training diverged at step 1") and rate in err[-1], err
    assert not any("Traceback" in line for line in err) and (tmp_path / "run" / "metrics.jsonl").is_file()


@pytest.fixture(scope="module")
def bad_data_folder(tmp_path_factory):
    """The folder of the cases below: the same paths for each, so the same overrides, composed once
    (tests/conftest.py keeps a compose per overrides: 0.4 s on 2 busy cores); each case writes its
    own train.txt there (or none), and a refused run leaves no run directory."""
    return tmp_path_factory.mktemp("bad-data")


@pytest.mark.parametrize("case", ["missing", "empty", "tiny", "smaller than a microbatch"])
def test_bad_data_files(case, capsys, bad_data_folder):
    folder = bad_data_folder
    path = folder / "train.txt"
    path.unlink(missing_ok=True)
    if case == "empty":
        path.write_text("")
    elif case == "tiny":
        path.write_text("to be or not")
    elif case == "smaller than a microbatch":  # a few sequences, fewer than the 8 rows of a microbatch
        path.write_text("the quick brown fox jumps over the lazy dog; " * 4)
    assert main(["train", *TINY, "data=text", f"data.train={path}", "data.vocab_size=300",
                 f"data.cache_dir={folder / 'cache'}", f"hydra.run.dir={folder / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data" in err[0], err
    assert not (folder / "run").exists()


def test_a_refused_run_removes_the_folders_it_made_and_only_those(capsys, tmp_path, tmp_path_factory, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # (refused after the runtime is built: its profile, given, is not measured each time)
    late = ["heuristic.start=soon", fixed_clock(tmp_path_factory.mktemp("profile"))]
    assert main(["train", *TINY, *late]) == 2  # the default outputs/DATE/TIME-SCHEDULE
    assert main(["train", *TINY, *late, f"hydra.run.dir={tmp_path / 'a' / 'b'}"]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    kept = tmp_path / "existing"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    assert main(["train", *TINY, *late, f"hydra.run.dir={kept}"]) == 2
    assert (kept / "notes.txt").read_text() == "mine"
    assert len(capsys.readouterr().err.strip().splitlines()) == 3


def test_wandb_without_an_api_key_says_how_to_log_in(capsys, tmp_path, monkeypatch):
    if "wandb" in sys.modules:  # wandb keeps the settings an earlier test's run read (offline mode) until torn down
        sys.modules["wandb"].teardown()
    for var in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no wandb settings
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    assert main(["train", *TINY, "logger=wandb", fixed_clock(tmp_path), f"hydra.run.dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "wandb login" in err[0] and "WANDB_MODE=offline" in err[0], err
    assert not (tmp_path / "run").exists()


def test_bad_input_in_a_subprocess_has_no_traceback(tmp_path):
    """The installed command (about 1 s: a value refused before the checks that need torch does not
    import it)."""
    r = run_cli("train", "pipeline.stages=0", f"hydra.run.dir={tmp_path / 'run'}")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "pipeline.stages must be at least 1" in r.stderr and not (tmp_path / "run").exists()


def test_the_command_line_and_the_checks_import_torch_only_where_they_need_it():
    """What ``adapipe --help`` and a refused value run (the CLI, the schema, the checks before the
    device's) stays torch-free: torch's import is 3-5 s of a refusal on 2 cores."""
    code = "import sys, adapipe_cli.cli.main, adapipe_cli.cli.train, adapipe_cli.config; print('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stdout + r.stderr


@pytest.mark.parametrize("mode", ["offline", "disabled"])
def test_wandb_logger_works_without_network(mode, make_cfg, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", mode)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    s = train(make_cfg("logger=wandb", "train.max_steps=3", fixed_clock(tmp_path)), tmp_path / "run")
    assert s["steps"] == 3 and (tmp_path / "run" / "summary.json").is_file()
    if mode == "offline":  # the offline run holds the logged history, ready for `wandb sync`
        runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
        assert runs and any(runs[0].glob("*.wandb"))


@pytest.mark.slow  # builds a wheel in a subprocess (about 5 s)
def test_a_built_wheel_carries_the_configs(tmp_path):
    """A non-editable install finds its configs inside the package (adapipe_cli/conf)."""
    import zipfile
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(tmp_path), str(repo)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    (wheel,) = tmp_path.glob("adapipe-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for f in ("adapipe_cli/conf/config.yaml", "adapipe_cli/conf/schedule/adapipe.yaml", "adapipe_cli/conf/sweep/cpu.yaml",
              "adapipe_cli/sweep/run.py", "adapipe_cli/runtime/worker.py"):
        assert f in names, f
    target = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(target)
    env = {**os.environ, "PYTHONPATH": str(target)}
    r = subprocess.run([sys.executable, "-c", "import adapipe_cli.config as c; print(c.conf_dir())"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == str(target / "adapipe_cli" / "conf"), r.stdout + r.stderr
