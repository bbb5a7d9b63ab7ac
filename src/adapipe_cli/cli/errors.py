"""Turning what goes wrong at the command line into one line on stderr and a non-zero exit."""

from __future__ import annotations

import re
import sys
from typing import NoReturn

from ..config import RETIRED_KEYS

EXIT_USAGE = 2


def fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    print(f"adapipe: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def _chain(e: BaseException):
    while e is not None:
        yield e
        e = e.__cause__ or e.__context__


def hydra_message(e: BaseException, command: str = "train") -> str:
    """One line for a Hydra/OmegaConf composition error: which key or option, and what to do."""
    text = "\n".join(str(x) for x in _chain(e))
    m = re.search(r"Could not find '([\w/.-]+)/([^']+)'", text)
    if m:
        group, option = m.groups()
        avail = re.search(r"Available options in '[\w/]+':\s*((?:\n\s+\S+)+)", text)
        # "base" is each group's schema node, not an option to choose
        opts = ", ".join(o for o in avail.group(1).split() if o != "base") if avail else ""
        return f"unknown {group} '{option}'" + (f": choose one of {opts}" if opts else "")
    m = re.search(r"Could not override '([^']+)'", text) or re.search(r"Key '([^']+)' (?:is )?not in struct", text)
    if m:
        key = re.search(r"full_key: (\S+)", text)
        name = key.group(1) if key else m.group(1)
        if name in RETIRED_KEYS:
            return f"config key '{name}' was retired: use {RETIRED_KEYS[name]}"
        return f"unknown config key '{name}': check its spelling (adapipe {command} --help lists the groups and keys)"
    m = re.search(r"Value '([^']*)'.*?could not be converted to (\w+)", text, re.S)
    if m:
        key = re.search(r"full_key: (\S+)", text)
        where = key.group(1) if key else "a key"
        return f"{where}: '{m.group(1)}' is not a valid {m.group(2).lower()}"
    m = re.search(r"mismatched input|no viable alternative|extraneous input|Error parsing override", text)
    if m:
        return f"cannot parse an override ({text.splitlines()[0]}): write overrides as key=value"
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(e).__name__)
    return first
