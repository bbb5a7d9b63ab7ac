"""Composing the config from the command line's overrides, with one-line errors."""

from __future__ import annotations

from typing import Callable

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig

from ..config import ConfigError, conf_dir, register_configs, validate
from .errors import fail, hydra_message

HELP_FLAGS = {"--help", "-h", "--hydra-help", "--info", "-i", "--cfg", "-c", "--resolve", "-p", "--package",
              "--shell-completion", "-sc", "--version"}


def compose_config(overrides: list[str], config_name: str = "config", hydra: bool = False,
                   job_name: str = "adapipe") -> DictConfig:
    """The composed config for ``overrides`` (raises Hydra's exceptions); ``hydra``: with Hydra's
    own node (``hydra.run.dir`` ...), ``hydra.job.name`` being ``job_name``."""
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3", job_name=job_name):
        return compose(config_name=config_name, overrides=overrides, return_hydra_config=hydra)


def without_hydra(cfg: DictConfig) -> DictConfig:
    """A copy of ``cfg`` without Hydra's node, as a run's task gets it."""
    import copy

    from omegaconf import open_dict, read_write

    out = copy.deepcopy(cfg)
    with read_write(out), open_dict(out):
        del out["hydra"]
    return out


def one_job(cfg: DictConfig, args: list[str]) -> bool:
    """Whether :func:`run_composed` runs ``args`` (``cfg`` their config, with Hydra's node) as
    ``hydra.main`` would: not with Hydra's own flags (``--config-dir`` ..., parsed by hydra.main,
    which refuses unknown ones), a multirun mode, or Hydra's verbose report."""
    from hydra.types import RunMode

    return (not any(a.startswith("-") for a in args) and cfg.hydra.mode in (None, RunMode.RUN)
            and not cfg.hydra.verbose)


def run_composed(cfg: DictConfig, task: Callable[[DictConfig], None]) -> None:
    """Run ``task`` as ``hydra.main`` runs one job, on ``cfg`` composed already with Hydra's node:
    the run directory and its ``.hydra/`` files, Hydra's logging and callbacks, and Hydra's report
    of an exception the task raises (a trimmed traceback, exit 1). ``hydra.main`` would compose
    twice more (once to read the mode, once for the run; 0.3-1 s each on 2 cores)."""
    from hydra._internal.utils import run_and_report
    from hydra._internal.callbacks import Callbacks
    from hydra.core.utils import configure_log, run_job
    from hydra.types import HydraContext, RunMode
    from omegaconf import open_dict

    def run() -> None:
        if cfg.hydra.mode is None:
            with open_dict(cfg):  # as hydra.main records the mode it chose
                cfg.hydra.mode = RunMode.RUN
                cfg.hydra.overrides.hydra.append("hydra.mode=RUN")
        configure_log(cfg.hydra.hydra_logging, cfg.hydra.verbose)
        callbacks = Callbacks(cfg)
        config_name = cfg.hydra.job.config_name
        callbacks.on_run_start(config=cfg, config_name=config_name)
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3", job_name=cfg.hydra.job.name):
            context = HydraContext(config_loader=GlobalHydra.instance().config_loader(), callbacks=callbacks)
            ret = run_job(task_function=task, config=cfg, job_dir_key="hydra.run.dir", job_subdir_key=None,
                          hydra_context=context, configure_logging=True)
        callbacks.on_run_end(config=cfg, config_name=config_name, job_return=ret)
        _ = ret.return_value  # raises what the task raised

    run_and_report(run)


def check_overrides(args: list[str]) -> None:
    """One line for a word that is not an override, e.g. ``pipeline.stages 4`` (Hydra would say only
    "Error parsing override"). ``~key`` deletes a key and needs no value."""
    if any(a in HELP_FLAGS for a in args):  # (some flags take a value: --cfg job, --info searchpath)
        return
    words = [a for a in args if not a.startswith("-")]
    for i, a in enumerate(words):
        if "=" not in a and not a.startswith("~"):
            value = words[i + 1] if i + 1 < len(words) and "=" not in words[i + 1] else "VALUE"
            fail(f"'{a}' is not an override: write key=value with no spaces, e.g. {a}={value}")


def compose_or_fail(overrides: list[str], config_name: str = "config", check: bool = True,
                    prefix: str = "", hydra: bool = False, job_name: str = "adapipe") -> DictConfig:
    """Compose and validate, or print one line (after ``prefix``) saying what to change and exit 2;
    ``hydra``: with Hydra's own node (``job_name``: its ``hydra.job.name``)."""
    check_overrides(overrides)
    try:
        cfg = compose_config(overrides, config_name, hydra=hydra, job_name=job_name)
    except Exception as e:  # Hydra and OmegaConf raise many kinds; each becomes one line
        fail(prefix + hydra_message(e, "simulate" if config_name == "simulate" else "train"))
    if check:
        try:
            validate(cfg)
        except ConfigError as e:
            fail(prefix + str(e))
    return cfg
