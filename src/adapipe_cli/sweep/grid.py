"""A grid: the ``conf/sweep/NAME.yaml`` composed with the command line's overrides, and its cells.

A cell is one run: depth p, m microbatches of a fixed microbatch size (batch size =
microbatch_size x m, so that every method of a depth shares one cost profile), a method (a named
list of overrides, e.g. ``adapipe: [schedule=adapipe, heuristic=goodput]``) and a seed. Its name,
``p4_b16_adapipe_s0``, is also its run directory under the sweep directory. A *setting* is a
(depth, batch size) pair, ``p4_b16``: the methods and seeds of one setting are compared on one
clock and one target.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from ..config import ConfigError, conf_dir
from ..config.schema import register_sweep_config

# keys the sweep sets for every cell; the grid's axes and its target rule choose them
RESERVED = {
    "pipeline.stages": "sweep.stages", "pipeline.microbatches": "sweep.microbatches",
    "train.batch_size": "sweep.microbatch_size and sweep.microbatches", "seed": "sweep.seeds",
    "train.target_ppl": "sweep.target", "pipeline.profile": "sweep.profile",
}
TARGET_RULES = ("fixed", "sync_fraction", "sync_best")


def override_key(override: str) -> str:
    """The key an override sets: ``+model.n_layer=2`` -> ``model.n_layer``."""
    return override.split("=", 1)[0].lstrip("+~")


def merge_overrides(*lists: list[str]) -> list[str]:
    """One override per key, a later list's winning (Hydra would apply both, the last last)."""
    merged: dict[str, str] = {}
    for overrides in lists:
        for o in overrides:
            merged.pop(override_key(o), None)
            merged[override_key(o)] = o
    return list(merged.values())


@dataclass(frozen=True)
class Cell:
    stages: int
    microbatches: int
    batch_size: int
    method: str
    seed: int

    @property
    def setting(self) -> str:
        return f"p{self.stages}_b{self.batch_size}"

    @property
    def name(self) -> str:
        return f"{self.setting}_{self.method}_s{self.seed}"


class Grid:
    """The resolved grid (``self.cfg``: the sweep node) and the overrides the user added for every cell."""

    def __init__(self, cfg, extra: list[str]):
        self.cfg = cfg
        self.name: str = cfg.name
        self.dir = Path(cfg.dir or Path("outputs") / "sweeps" / cfg.name).resolve()
        self.methods: dict[str, list[str]] = {k: list(v) for k, v in cfg.methods.items()}
        self.fixed = merge_overrides(list(cfg.fixed), extra)
        self._check(extra)

    def _check(self, extra: list[str]) -> None:
        c, t = self.cfg, self.cfg.target

        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(msg)

        need(c.stages and c.microbatches and c.seeds and self.methods,
             "sweep.stages, sweep.microbatches, sweep.seeds and sweep.methods must not be empty")
        need(c.microbatch_size >= 1, f"sweep.microbatch_size must be positive (got {c.microbatch_size})")
        for name in self.methods:
            # '+' names a mitigation (pipedream+predict); '_' separates a cell name's parts
            need(re.fullmatch(r"[A-Za-z0-9+-]+", name) is not None,
                 f"method name {name!r}: use letters, digits, '-' and '+' (it is part of run directory names)")
        for o in [*extra, *c.fixed, *(o for v in self.methods.values() for o in v)]:
            key = override_key(o)
            need(key not in RESERVED and not key.startswith("hydra.sweep"),
                 f"{key} is set by the sweep for every cell: use {RESERVED.get(key, 'sweep.dir')} instead")
        methods = ", ".join(self.methods)
        need(c.compare in self.methods, f"sweep.compare={c.compare} is not one of the methods ({methods})")
        for name in c.only or []:
            need(name in self.methods, f"sweep.only: {name} is not one of the methods ({methods})")
        need(c.jobs is None or c.jobs >= 1, f"sweep.jobs must be at least 1 (got {c.jobs})")
        for which, t in self.targets.items():
            key = "sweep.target" if which == "early" else "sweep.late_target"
            need(t.rule in TARGET_RULES, f"unknown {key}.rule={t.rule!r}: use {', '.join(TARGET_RULES)}")
            if t.rule == "fixed":
                need(t.ppl is not None and t.ppl > 1, f"{key}.rule=fixed needs {key}.ppl > 1")
                continue
            need(t.baseline in self.methods, f"{key}.baseline={t.baseline} is not one of the methods ({methods})")
            if t.rule == "sync_fraction":
                need(0 < t.fraction <= 1, f"{key}.fraction must be in (0, 1] (got {t.fraction})")
                need(t.budget is None or t.budget >= 1, f"{key}.budget must be a positive step count or null")
        need(len({t.baseline for t in self.targets.values() if t.rule != "fixed"}) <= 1,
             "sweep.target and sweep.late_target derived from runs must share one baseline")

    @property
    def targets(self) -> dict:
        """{``early``: sweep.target, ``late``: sweep.late_target unless its rule is ``none``}."""
        out = {"early": self.cfg.target}
        if self.cfg.late_target.rule != "none":
            out["late"] = self.cfg.late_target
        return out

    @property
    def baseline(self) -> str | None:
        """The method whose runs the targets are derived from; None when every target is fixed."""
        return next((t.baseline for t in self.targets.values() if t.rule != "fixed"), None)

    @property
    def jobs(self) -> int:
        """Cells run at once: sweep.jobs, else the cores this process may use."""
        from ..runtime.device import usable_cores  # (torch: only when the default is asked for)

        if self.cfg.jobs is not None:
            return int(self.cfg.jobs)
        return usable_cores()

    @property
    def selected(self) -> list[str]:
        """The methods this sweep runs: ``sweep.only``, or all."""
        return [m for m in self.methods if self.cfg.only is None or m in self.cfg.only]

    def cells(self, only: bool = False) -> list[Cell]:
        """Every cell, depth-major: for each depth, batch size, method and seed (``only``: of the
        methods ``sweep.only`` selects)."""
        c = self.cfg
        methods = self.selected if only else list(self.methods)
        return [Cell(p, m, c.microbatch_size * m, method, s)
                for p in c.stages for m in c.microbatches for method in methods for s in c.seeds]

    def overrides(self, cell: Cell, profile: Path | None = None, target: float | None = None) -> list[str]:
        """The overrides of ``adapipe train`` that run ``cell``."""
        axes = [f"pipeline.stages={cell.stages}", f"pipeline.microbatches={cell.microbatches}",
                f"train.batch_size={cell.batch_size}", f"seed={cell.seed}"]
        if profile is not None:
            axes.append(f"pipeline.profile={profile}")
        if target is not None:
            axes.append(f"train.target_ppl={target!r}")
        return merge_overrides(self.fixed, self.methods[cell.method], axes)

    def definition(self) -> dict:
        """What the runs of a cell depend on besides its axes: a sweep directory resumed with another
        definition would mix incomparable runs."""
        out = {"fixed": self.fixed, "methods": self.methods, "microbatch_size": self.cfg.microbatch_size,
               "target": OmegaConf.to_container(self.cfg.target), "profile": self.cfg.profile}
        if "late" in self.targets:  # absent otherwise: sweeps from before it existed resume
            out["late_target"] = OmegaConf.to_container(self.cfg.late_target)
        return out


def compose_grid(overrides: list[str]):
    """The composed sweep node for ``sweep=NAME`` and ``sweep.KEY=VALUE`` overrides (Hydra's errors)."""
    from ..cli.compose import compose_config

    register_sweep_config()
    return compose_config(overrides, config_name=None).sweep


def load_grid(args: list[str]) -> Grid:
    """The grid of ``adapipe sweep`` arguments: ``sweep=NAME``, ``sweep.KEY=VALUE`` overrides of the
    grid (``+sweep.methods.NAME=[...]`` adds a method; ``sweep.only`` selects methods, also those
    whose names hold a ``+``, which Hydra keys cannot), and training overrides given to every cell.
    Raises Hydra's errors and ConfigError."""
    names = [a for a in args if a.split("=", 1)[0] == "sweep"]
    if not names:
        raise ConfigError(f"name a grid: adapipe sweep sweep=NAME (one of {', '.join(grid_names())})")
    of_grid = [a for a in args if override_key(a).startswith("sweep.")]
    cfg = compose_grid([f"+{a}" for a in names] + of_grid)
    OmegaConf.resolve(cfg)
    return Grid(cfg, [a for a in args if a not in names and a not in of_grid])


def grid_names() -> list[str]:
    return sorted(p.stem for p in (conf_dir() / "sweep").glob("*.yaml"))
