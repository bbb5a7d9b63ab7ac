"""Where the configs are: inside the installed package, or conf/ at the top of a checkout."""

from __future__ import annotations

import os
from pathlib import Path


def conf_dir() -> Path:
    here = Path(__file__).resolve().parent.parent
    for candidate in (here / "conf", here.parent.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise FileNotFoundError("adapipe's configs were not found (looked in the package and in conf/ of the checkout)")


def shared_data(name: str) -> str:
    """``${adapipe.shared_data:NAME}`` in a grid or an override: ``$ADAPIPE_SHARED_DATA/NAME``, else
    ``NAME`` in the ``shared/data`` folder beside the checkout (``../shared/data`` from the
    repository root)."""
    root = os.environ.get("ADAPIPE_SHARED_DATA") or str(conf_dir().parent.parent / "shared" / "data")
    return str(Path(root) / name)
