"""Configuration: the typed schema, where the YAML files are, and semantic checks."""

from .paths import conf_dir
from .schema import RETIRED_DEFAULTS, RETIRED_KEYS, Config, register_configs
from .validate import ConfigError, validate

__all__ = ["RETIRED_DEFAULTS", "RETIRED_KEYS", "Config", "ConfigError", "conf_dir", "register_configs", "validate"]
