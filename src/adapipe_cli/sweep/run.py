"""Running a grid: every cell a job of a Hydra multirun of ``adapipe train``.

How cells map onto Hydra's multirun: Hydra's basic sweeper runs the cartesian product of the
values it is given, but a grid is not one product (a method is a *set* of overrides, and a
setting's target is known only after its baseline ran). Within one (depth, batch size, method),
though, the cells differ only by seed, so the sweep launches one ``adapipe train -m`` per
(depth, batch size, method) over the seeds still to run, in this process, through the same
``train_command`` a user's ``adapipe train -m`` goes through, with

    hydra.sweep.dir=SWEEP_DIR  hydra.sweep.subdir=p4_b16_adapipe_s${seed}  seed=0,1,2

so each cell is a job directory (``.hydra/``, ``metrics.jsonl``, ``summary.json``, plots) named
after the cell. Order: for each depth, its cost profile is measured once (:mod:`.profile`); for
each batch size, the baseline's cells run first when the target is derived from them
(:mod:`.target`), then every other method with ``train.target_ppl`` set. A custom Hydra sweeper
taking an explicit cell list would need a ``hydra_plugins`` package; per-(setting, method)
multiruns need nothing beyond Hydra's own sweeper.

Resuming: done cells are skipped (one line each); the profile and target recorded in
``sweep.json`` are reused, so a resumed sweep compares its runs on the same clock and target.
A failing cell writes ``error.txt`` in its directory and the others go on; the sweep ends with
the report and one line per failed cell, exit status 1.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from omegaconf import OmegaConf

from ..cli.compose import compose_config
from .grid import Cell, Grid
from .progress import CellProgress, cell_line
from .profile import measure_depth_profile
from .state import SweepState
from .target import derive_target, evals


class SweepRunner:
    """Runs the cells of a grid into its directory, depth by depth and setting by setting."""

    def __init__(self, grid: Grid):
        self.grid = grid
        self.state = SweepState(grid)
        self.cells = grid.cells(only=True)  # the cells this sweep runs
        self.start = time.time()
        self.seen = 0  # cells skipped or launched so far
        self.failed: dict[str, str] = {}  # cell -> reason

    def run(self) -> dict[str, str]:
        """Run every cell that is not done; returns the failed cells and their reasons."""
        g = self.grid
        print(f"adapipe sweep {g.name}: {len(self.cells)} cells into {g.dir}", file=sys.stderr, flush=True)
        for p in g.cfg.stages:
            profile = self.profile(p) if g.cfg.profile else None
            for m in g.cfg.microbatches:
                self.run_setting(p, m, profile)
        return self.failed

    def profile(self, stages: int) -> Path:
        """The depth's cost profile: recorded in sweep.json, or measured now."""
        path = self.state.profile(stages)
        if path is None:
            mbs = self.grid.cfg.microbatch_size
            first = next(c for c in self.cells if c.stages == stages)
            cfg = compose_config(self.grid.overrides(Cell(stages, 1, mbs, first.method, first.seed)))
            path = self.grid.dir / "profiles" / f"p{stages}_mb{mbs}.json"
            t0 = time.time()
            prof = measure_depth_profile(cfg, path)
            step = sum(prof.forward) + sum(prof.backward)
            print(f"profile p{stages}: {step * 1e3:.1f} ms of forward+backward per microbatch over all stages, "
                  f"measured in {time.time() - t0:.1f}s -> {path}", file=sys.stderr, flush=True)
            self.state.set_profile(stages, path)
        return path

    def run_setting(self, p: int, m: int, profile: Path | None) -> None:
        """The cells of depth p with m microbatches: the target first (fixed, recorded, or derived from
        the baseline's cells, run now), then every method's cells with that target."""
        g, t = self.grid, self.grid.cfg.target
        cells = [c for c in self.grid.cells() if c.stages == p and c.microbatches == m]
        setting = cells[0].setting
        if t.rule == "fixed" and self.state.target(setting) is None:
            self.state.set_target(setting, {"ppl": t.ppl, "rule": "fixed"})
        methods = g.selected
        if t.rule == "sync_fraction" and self.state.target(setting) is None:
            self.launch([c for c in cells if c.method == t.baseline], profile, None)
            if t.baseline in methods:
                methods.remove(t.baseline)
            self.derive(setting, [c for c in cells if c.method == t.baseline])
        target = self.state.target(setting)
        for method in methods:
            todo = [c for c in cells if c.method == method]
            if target is None:
                for c in todo:
                    self.seen += 1
                    self.failed[c.name] = f"no target: no {t.baseline} run of {setting} completed"
                    cell_line(self.seen, len(self.cells), self.start, "failed", c.name, self.failed[c.name])
                continue
            self.launch(todo, profile, target)

    def derive(self, setting: str, baseline: list[Cell]) -> None:
        """Record the setting's sync_fraction target from its done baseline cells (none done: no target)."""
        runs = {}
        for c in baseline:
            if self.state.status(c)[0] == "done":
                runs[c.name] = (evals(self.grid.dir / c.name), self._budget(c))
        record = derive_target(runs, self.grid.cfg.target.fraction)
        if record is not None:
            record["baseline"] = self.grid.cfg.target.baseline
            self.state.set_target(setting, record)
            print(f"target {setting}: val ppl {record['ppl']:.4g} (median over {len(record['from'])} "
                  f"{record['baseline']} runs at {record['fraction']:g} of their steps)", file=sys.stderr, flush=True)

    def _budget(self, cell: Cell) -> int:
        """The cell's step budget, train.max_steps of the config it ran with."""
        return int(OmegaConf.load(self.grid.dir / cell.name / ".hydra" / "config.yaml").train.max_steps)

    def launch(self, cells: list[Cell], profile: Path | None, target: float | None) -> None:
        """Skip the done cells; run the others (one setting and method) as one multirun over seeds."""
        todo = []
        for c in cells:
            if self.state.status(c)[0] == "done":
                self.seen += 1
                cell_line(self.seen, len(self.cells), self.start, "skip", c.name, "(done)")
            else:
                todo.append(c)
        if not todo:
            return
        from ..cli.train import train_command

        c0 = todo[0]
        overrides = [o for o in self.grid.overrides(c0, profile, target) if not o.startswith("seed=")]
        overrides += [
            "seed=" + ",".join(str(c.seed) for c in todo),
            f"hydra.sweep.dir={self.grid.dir}", f"hydra.sweep.subdir={c0.setting}_{c0.method}_s${{seed}}",
            f"+hydra.callbacks.progress._target_={CellProgress.__module__}.{CellProgress.__qualname__}",
            f"+hydra.callbacks.progress.total={len(self.cells)}", f"+hydra.callbacks.progress.first={self.seen}",
            f"+hydra.callbacks.progress.start={self.start}",
        ]
        argv = sys.argv
        try:
            code = train_command(["-m", *overrides])
        finally:
            sys.argv = argv
        if code == 130:  # a run was interrupted: stop the sweep, not only that run
            raise KeyboardInterrupt
        self.seen += len(todo)
        for c in todo:
            status, reason = self.state.status(c)
            if status != "done":
                self.failed[c.name] = reason or status
