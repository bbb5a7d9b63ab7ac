"""What a sweep directory knows: ``sweep.json`` (the grid, its cells, the cost profile of each
depth and the targets of each setting, early in ``targets`` and late in ``late_targets``, written
before the runs that use them) and the status of each cell's run directory.

A cell is *done* when its ``summary.json`` says ``completed: true``; *failed* when its directory
holds an ``error.txt`` (written by ``adapipe train`` in a multirun) or an incomplete run; *missing*
when it has no directory. Rerunning a sweep skips done cells and runs the others.
"""

from __future__ import annotations

import fcntl
import json
from dataclasses import asdict
from pathlib import Path

from ..config import ConfigError
from ..train.metrics import write_json
from .grid import Cell, Grid

STATE = "sweep.json"
TARGET_KEYS = {"early": "targets", "late": "late_targets"}  # which target -> its key in sweep.json


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def cell_status(run_dir: Path) -> tuple[str, str]:
    """(``done`` | ``failed`` | ``missing``, a reason for a failed cell)."""
    run_dir = Path(run_dir)
    summary = read_json(run_dir / "summary.json")
    if summary and summary.get("completed"):
        return "done", ""
    if not run_dir.is_dir():
        return "missing", ""
    error = run_dir / "error.txt"
    if error.is_file():
        lines = error.read_text().strip().splitlines()
        return "failed", lines[-1] if lines else "error"
    return "failed", "no complete summary.json (interrupted or crashed)"


def extends(new: dict, old: dict) -> bool:
    """Whether a grid of definition ``new`` may resume a directory of definition ``old``: the same
    in everything, except that it may add methods (each old method with its overrides unchanged)."""
    if {k: v for k, v in new.items() if k != "methods"} != {k: v for k, v in old.items() if k != "methods"}:
        return False
    return all(new.get("methods", {}).get(m) == o for m, o in old.get("methods", {}).items())


class SweepState:
    """``sweep.json`` of one sweep directory; every change is written at once (atomically)."""

    def __init__(self, grid: Grid):
        self.grid, self.path = grid, grid.dir / STATE
        old = read_json(self.path) or {}
        if old and not extends(grid.definition(), old.get("definition") or {}):
            changed = sorted(k for k, v in grid.definition().items() if old["definition"].get(k) != v)
            raise ConfigError(f"{grid.dir} holds a sweep with other {', '.join(changed)}: "
                              f"give another sweep.dir, or delete it to start again")
        self.profiles: dict[str, str] = old.get("profiles", {})
        self.targets: dict[str, dict[str, dict]] = {w: old.get(TARGET_KEYS[w], {}) for w in TARGET_KEYS}
        grid.dir.mkdir(parents=True, exist_ok=True)
        self.save()

    def save(self) -> None:
        """Write ``sweep.json``, merged with what is on disk: sweeps of disjoint parts of one grid
        (e.g. ``sweep.stages=[8]`` and ``sweep.stages=[2,4]``) can run at once into one directory,
        each adding its cells, profiles and targets."""
        g = self.grid
        with open(self.path.with_name(STATE + ".lock"), "w") as lock:  # read-merge-write, one sweep at a time
            fcntl.flock(lock, fcntl.LOCK_EX)
            old = read_json(self.path) or {}
            self.profiles = {**old.get("profiles", {}), **self.profiles}
            self.targets = {w: {**old.get(k, {}), **self.targets[w]} for w, k in TARGET_KEYS.items()}
            cells = {c["name"]: c for c in old.get("cells", [])}
            cells.update({c.name: {"name": c.name, "setting": c.setting, **asdict(c)} for c in g.cells()})
            # methods: the union (a sweep of the grid without an added method may save last)
            definition = g.definition()
            old_def = old.get("definition") or {}
            if extends(old_def, definition):  # the directory's grid has added methods: keep them
                definition = {**definition, "methods": {**definition["methods"], **old_def["methods"]}}
            write_json(self.path, {
                "name": g.name, "definition": definition, "methods": list(definition["methods"]),
                "compare": g.cfg.compare, "curves": g.cfg.curves,
                "cells": list(cells.values()), "profiles": self.profiles,
                **{k: self.targets[w] for w, k in TARGET_KEYS.items()},
            })

    def profile(self, stages: int) -> Path | None:
        path = self.profiles.get(f"p{stages}")
        return Path(path) if path and Path(path).is_file() else None

    def set_profile(self, stages: int, path: Path) -> None:
        self.profiles[f"p{stages}"] = str(path)
        self.save()

    def target(self, setting: str, which: str = "early") -> float | None:
        return self.targets[which].get(setting, {}).get("ppl")

    def set_target(self, setting: str, record: dict, which: str = "early") -> None:
        self.targets[which][setting] = record
        self.save()

    def status(self, cell: Cell) -> tuple[str, str]:
        return cell_status(self.grid.dir / cell.name)
