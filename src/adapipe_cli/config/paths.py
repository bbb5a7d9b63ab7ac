"""Where the configs are: inside the installed package, or conf/ at the top of a checkout."""

from __future__ import annotations

from pathlib import Path


def conf_dir() -> Path:
    here = Path(__file__).resolve().parent.parent
    for candidate in (here / "conf", here.parent.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise FileNotFoundError("adapipe's configs were not found (looked in the package and in conf/ of the checkout)")
