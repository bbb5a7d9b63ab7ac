"""Composing the config from the command line's overrides, with one-line errors."""

from __future__ import annotations

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig

from ..config import ConfigError, conf_dir, register_configs, validate
from .errors import fail, hydra_message

HELP_FLAGS = {"--help", "-h", "--hydra-help", "--info", "-i", "--cfg", "-c", "--resolve", "-p", "--package",
              "--shell-completion", "-sc", "--version"}


def compose_config(overrides: list[str], config_name: str = "config", hydra: bool = False) -> DictConfig:
    """The composed config for ``overrides`` (raises Hydra's exceptions); ``hydra``: with Hydra's
    own node (``hydra.run.dir`` ...)."""
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3", job_name="adapipe"):
        return compose(config_name=config_name, overrides=overrides, return_hydra_config=hydra)


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
                    prefix: str = "", hydra: bool = False) -> DictConfig:
    """Compose and validate, or print one line (after ``prefix``) saying what to change and exit 2;
    ``hydra``: with Hydra's own node."""
    check_overrides(overrides)
    try:
        cfg = compose_config(overrides, config_name, hydra=hydra)
    except Exception as e:  # Hydra and OmegaConf raise many kinds; each becomes one line
        fail(prefix + hydra_message(e, "simulate" if config_name == "simulate" else "train"))
    if check:
        try:
            validate(cfg)
        except ConfigError as e:
            fail(prefix + str(e))
    return cfg
