"""Composing the config from the command line's overrides, with one-line errors."""

from __future__ import annotations

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig

from ..config import ConfigError, conf_dir, register_configs, validate
from .errors import fail, hydra_message

HELP_FLAGS = {"--help", "-h", "--hydra-help", "--info", "-i", "--cfg", "-c", "--resolve", "-p", "--package",
              "--shell-completion", "-sc", "--version"}


def compose_config(overrides: list[str], config_name: str = "config") -> DictConfig:
    """The composed config for ``overrides`` (raises Hydra's exceptions)."""
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3", job_name="adapipe"):
        return compose(config_name=config_name, overrides=overrides)


def compose_or_fail(overrides: list[str], config_name: str = "config", check: bool = True,
                    prefix: str = "") -> DictConfig:
    """Compose and validate, or print one line (after ``prefix``) saying what to change and exit 2."""
    try:
        cfg = compose_config(overrides, config_name)
    except Exception as e:  # Hydra and OmegaConf raise many kinds; each becomes one line
        fail(prefix + hydra_message(e, "simulate" if config_name == "simulate" else "train"))
    if check:
        try:
            validate(cfg)
        except ConfigError as e:
            fail(prefix + str(e))
    return cfg
