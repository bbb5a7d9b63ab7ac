"""``adapipe train``: one experiment, configured by Hydra, in a Hydra run directory."""

from __future__ import annotations

import os
import shutil
import sys
import traceback
from pathlib import Path

from ..config import RETIRED_KEYS
from . import signals
from .compose import HELP_FLAGS, check_overrides, compose_or_fail, one_job, run_composed, without_hydra
from .errors import EXIT_USAGE, fail


_FAILED: list[str] = []  # jobs of this process's multirun that failed: "RUN_DIR: reason"


def _in_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.get().mode == RunMode.MULTIRUN


def _job_failed(run_dir: Path, message: str, code: int, detail: str = "") -> None:
    """A single run exits with ``code``. A job of a multirun writes ``error.txt`` (its last line the
    reason) into its directory and returns, so that the other jobs run; the multirun then exits 1
    with one line per failed job."""
    if not _in_multirun():
        fail(message, code)
    (run_dir / "error.txt").write_text(detail + message + "\n")
    print(f"adapipe: error: {message}", file=sys.stderr)
    _FAILED.append(f"{run_dir}: {message}")


def _task(cfg) -> None:
    from hydra.core.hydra_config import HydraConfig

    from ..checkpoint import CheckpointError
    from ..config import ConfigError
    from ..data import DataError
    from ..runtime.dist import WorkerFailed
    from ..train.loop import TrainingDiverged, train

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    (run_dir / "error.txt").unlink(missing_ok=True)  # a rerun's directory shows only its own failure
    try:
        train(cfg, run_dir)
    except (ConfigError, DataError, CheckpointError) as e:
        return _job_failed(run_dir, str(e), 2)
    except (TrainingDiverged, WorkerFailed) as e:
        if isinstance(e, WorkerFailed) and signals.received():  # the group's SIGTERM reached a worker first
            _interrupted(None, run_dir)
        return _job_failed(run_dir, str(e), 1)
    except KeyboardInterrupt as e:
        _interrupted(e, run_dir)
    except Exception as e:  # a bug: a single run shows the traceback, a multirun records it and goes on
        if not _in_multirun():
            raise
        return _job_failed(run_dir, f"{type(e).__name__}: {e}", 1, traceback.format_exc())
    print(f"results: {run_dir}")  # (the Trainer printed the final line)


def _interrupted(e: BaseException | None, run_dir: Path) -> None:
    word, code = signals.interrupt_exit(e)
    fail(f"{word}; partial results are in {run_dir}", code=code)


def _torchrun_rank(cfg) -> int | None:
    """This process's rank when torchrun (or a launcher setting the same variables) started it,
    else None; under torchrun the run must be distributed."""
    from ..runtime.launch import torchrun_env
    from ..train.setup import runtime_kind

    env = torchrun_env()
    if env is None:
        return None
    if runtime_kind(cfg) != "dist":
        fail("under torchrun every process is one pipeline stage: add pipeline.runtime=dist")
    return int(env["RANK"])


def _resume_overrides(overrides: list[str]) -> list[str]:
    """``train.resume=RUN_DIR``: the run's own overrides (from RUN_DIR/.hydra/overrides.yaml, less
    any of :data:`..config.RETIRED_KEYS`), then the ones given now, and Hydra's output directory
    set to RUN_DIR, so that the run continues in place with its own configuration."""
    given = [a.split("=", 1)[1] for a in overrides if a.startswith("train.resume=")]
    if not given or given[-1] in ("", "null"):
        return overrides
    run_dir = Path(given[-1]).resolve()
    if not run_dir.is_dir():
        fail(f"train.resume={given[-1]}: no such directory: give the run directory of an earlier adapipe train")
    if not (run_dir / "checkpoints").is_dir():
        fail(f"train.resume={given[-1]}: no checkpoints in that directory (is it a run directory of adapipe train?)")
    saved_file = run_dir / ".hydra" / "overrides.yaml"
    import yaml

    saved = yaml.safe_load(saved_file.read_text()) if saved_file.is_file() else []
    # (a retired key the run was given is dropped: the checkpoint's comparison passes over it too)
    keep = [a for a in saved if not a.startswith(("hydra.", "train.resume="))
            and a.split("=", 1)[0].lstrip("+~") not in RETIRED_KEYS]
    out = [*keep, *(a if not a.startswith("train.resume=") else f"train.resume={run_dir}" for a in overrides)]
    if not any(a.startswith("hydra.run.dir=") for a in out):
        out.append(f"hydra.run.dir={run_dir}")
    return out


def _check_resume(cfg) -> None:
    """Refuse, before Hydra writes anything into the run directory, a resume whose configuration
    differs from its checkpoint's in a key that changes the numbers, or whose data or cost profile
    differ from those the checkpoint recorded."""
    from omegaconf import OmegaConf

    from .. import checkpoint
    from ..data import DataError, build_data
    from ..simulator.clock import CostProfile
    from ..train import fingerprint

    try:
        # (silent: the Trainer reports a damaged checkpoint when it resumes, once)
        folder, manifest = checkpoint.load_latest(Path(cfg.train.resume), warn=lambda m: None)
    except checkpoint.CheckpointError as e:
        fail(str(e))
    current = OmegaConf.to_container(cfg, resolve=True)
    diff = checkpoint.config_differences(manifest["config"], current, checkpoint.resume_free_keys(manifest, current))
    if len(diff) == 1 and diff[0].startswith("train.max_steps="):
        fail(f"checkpoint {folder}: {diff[0]}: only a run with a synchronous schedule (1f1b, gpipe) and "
             f"optim.decay=constant can be continued for another number of steps (a cosine decay spans max_steps, an "
             f"async pipeline drains at the last step): start a new run with train.max_steps={cfg.train.max_steps}, "
             f"or resume with train.max_steps={manifest['config']['train']['max_steps']}")
    if cfg.train.max_steps < manifest["step"]:
        fail(f"checkpoint {folder} is at step {manifest['step']}, beyond train.max_steps={cfg.train.max_steps}")
    if diff:
        more = f" (and {len(diff) - 1} more)" if len(diff) > 1 else ""
        fail(f"checkpoint {folder} belongs to another configuration: {diff[0]}{more}")
    if not manifest.get("fingerprints"):
        return
    try:
        now = fingerprint.data_fingerprints(build_data(cfg.data, cfg.model.block_size, cfg.seed))
    except DataError as e:
        fail(str(e))
    profile = Path(cfg.pipeline.profile or Path(cfg.train.resume) / "profile.json")
    if profile.is_file():
        try:
            loaded = CostProfile.load(profile)
        except ValueError as e:
            fail(f"pipeline.profile={profile}: {e}")
        now.update(fingerprint.profile_fingerprints(loaded, fingerprint.link_configured(cfg)))
    refusal = fingerprint.refusal(cfg, folder, manifest, now)
    if refusal:
        fail(refusal)


def _fix_run_dir(cfg) -> Path | None:
    """Fix ``hydra.run.dir`` in ``cfg`` (composed with Hydra's node) now, as if it had been given
    (its default name holds the time of day), and return the outermost folder of it that does not
    exist yet: what a refused run removes again (None when the run directory exists already, e.g. a
    resumed run's)."""
    from omegaconf import open_dict

    run_dir = Path(str(cfg.hydra.run.dir)).absolute()
    if not any(a.startswith("hydra.run.dir=") for a in cfg.hydra.overrides.hydra):  # (one given stays as given)
        with open_dict(cfg):
            cfg.hydra.overrides.hydra.append(f"hydra.run.dir={run_dir}")
            cfg.hydra.run.dir = str(run_dir)
    created = None
    for d in (run_dir, *run_dir.parents):
        if d.exists():
            break
        created = d
    return created


def help_text(overrides: list[str], command: str = "train", config_name: str = "config") -> str:
    """``adapipe train --help`` (or ``simulate``'s): the groups a user can choose from (not each
    group's schema ``base``, nor ``sweep``, which is adapipe sweep's) and the composed config."""
    from omegaconf import OmegaConf

    from ..config import conf_dir

    cfg = compose_or_fail([a for a in overrides if not a.startswith("-")], config_name=config_name, check=False)
    groups = sorted(d for d in conf_dir().iterdir() if d.is_dir() and d.name != "sweep" and any(d.glob("*.yaml")))
    lines = [f"usage: adapipe {command} [group=option ...] [key=value ...]   (-m: one run per comma-separated value)", "",
             "Config groups (group=option):"]
    lines += [f"  {d.name}: {', '.join(sorted(f.stem for f in d.glob('*.yaml')))}" for d in groups]
    lines += ["", "Config (override any key as key=value):", OmegaConf.to_yaml(cfg).rstrip(), "",
              f"Hydra's own flags: adapipe {command} --hydra-help"]
    return "\n".join(lines)


def train_command(overrides: list[str]) -> int:
    previous = signals.install()
    try:
        return _train_command(overrides)
    except KeyboardInterrupt as e:  # before the run started (composing, importing): nothing to keep
        word, code = signals.interrupt_exit(e)
        print(f"adapipe: error: {word}", file=sys.stderr)
        return code
    finally:
        signals.restore(previous)


def _train_command(overrides: list[str]) -> int:
    import hydra

    from ..config import conf_dir, register_configs

    if any(a in ("-h", "--help") for a in overrides):
        print(help_text(overrides))
        return 0
    overrides = _resume_overrides(overrides)
    wants_help = any(a in HELP_FLAGS for a in overrides)
    multirun = any(a in ("-m", "--multirun") for a in overrides)
    created = None  # what a refused single run removes
    if multirun:
        check_overrides(overrides)
    composed = None  # a single run's config with Hydra's node: composed once, checked, then run
    if not wants_help and not multirun:
        composed = compose_or_fail([a for a in overrides if not a.startswith("-")], hydra=True, job_name="train")
        created = _fix_run_dir(composed)
        cfg = without_hydra(composed)
        if cfg.train.resume:
            _check_resume(cfg)
        if "RANK" in os.environ and "MASTER_ADDR" in os.environ:
            rank = _torchrun_rank(cfg)
            if rank is not None and rank != 0:  # rank 0 runs the Trainer (and stage 0's worker) through Hydra
                from ..runtime.launch import torchrun_main

                torchrun_main(cfg.pipeline.timeout_s)
        if not one_job(composed, overrides):  # Hydra's own flags, mode or report: hydra.main's way
            if not any(a.startswith("hydra.run.dir=") for a in overrides):  # (the run directory fixed above)
                overrides = [*overrides, f"hydra.run.dir={composed.hydra.run.dir}"]
            composed = None
    _FAILED.clear()
    try:
        if composed is not None:
            run_composed(composed, _task)
        else:
            register_configs()
            sys.argv = ["adapipe train", *overrides]
            hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")(_task)()
    except SystemExit as e:
        if e.code == EXIT_USAGE and created is not None:  # a refused run leaves nothing behind
            shutil.rmtree(created, ignore_errors=True)
        return int(e.code or 0)
    for line in _FAILED:
        print(f"adapipe: failed: {line}", file=sys.stderr)
    return 1 if _FAILED else 0


__all__ = ["train_command", "fail"]
