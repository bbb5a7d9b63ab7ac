"""``adapipe sweep sweep=NAME [sweep.KEY=VALUE ...] [overrides]``: run a grid, then its report.

``sweep.KEY=VALUE`` changes the grid (e.g. ``sweep.seeds=[0]``, ``sweep.dir=DIR``); any other
override goes to every cell's ``adapipe train`` (e.g. ``train.max_steps=100``).
"""

from __future__ import annotations

import sys

from . import signals
from .errors import fail, hydra_message

HELP = """usage: adapipe sweep sweep=NAME [sweep.KEY=VALUE ...] [overrides]

Runs every cell (depth x batch size x method x seed) of conf/sweep/NAME.yaml as a job of
`adapipe train -m` in SWEEP_DIR (sweep.dir, default outputs/sweeps/NAME), one directory per cell,
sweep.jobs cells at a time (default: the number of cores), then writes results.csv, results.md and
plots there (adapipe report SWEEP_DIR). Rerunning resumes: done cells are skipped.

grids: {grids}
grid keys: {keys}
other overrides: those of adapipe train (adapipe train --help)"""


def sweep_command(args: list[str]) -> int:
    from ..config import ConfigError
    from ..config.schema import SweepConfig, field_names
    from ..data import DataError
    from ..sweep.grid import grid_names, load_grid

    if any(a in ("-h", "--help") for a in args):
        keys = ", ".join(f"sweep.{k}" for k in field_names(SweepConfig))
        print(HELP.format(grids=", ".join(grid_names()), keys=keys))
        return 0
    try:
        grid = load_grid(args)
    except ConfigError as e:
        fail(str(e))
    except Exception as e:  # Hydra's composition errors: one line each
        fail(hydra_message(e, "sweep"))
    _check_cells(grid)
    from ..sweep.report import write_report
    from ..sweep.run import SweepRunner

    previous = signals.install()  # SIGTERM (kill, a job scheduler) stops the sweep as Ctrl-C does
    try:
        failed = SweepRunner(grid).run()
    except (ConfigError, DataError) as e:
        fail(str(e))
    except KeyboardInterrupt as e:
        word, code = signals.interrupt_exit(e)
        fail(f"{word}; rerun the same command to resume ({grid.dir})", code=code)
    finally:
        signals.restore(previous)
    try:
        paths = write_report(grid.dir)
    except ConfigError as e:  # the runs are kept: say how to write the report once the cause is fixed
        fail(f"report: {e} (the runs are done: adapipe report {grid.dir})", code=1)
    print(f"report: {', '.join(p.name for p in paths)} in {grid.dir}", file=sys.stderr)
    for name, reason in failed.items():
        print(f"adapipe: failed: {name}: {reason}", file=sys.stderr)
    print(f"results: {grid.dir / 'results.md'}")
    return 1 if failed else 0


def _check_cells(grid) -> None:
    """Compose and validate each cell's config before anything runs, so that a bad override or an
    impossible cell (e.g. more stages than blocks) is one line now rather than a failed run per
    cell. Seeds do not change validity: one cell per (depth, batch size, method) is checked."""
    from .compose import compose_or_fail

    fixed = grid.cfg.target.rule == "fixed"
    checked = set()
    for cell in grid.cells():
        if (cell.stages, cell.microbatches, cell.method) in checked:
            continue
        checked.add((cell.stages, cell.microbatches, cell.method))
        # a target derived from sync is not known yet: check the cell with a stand-in
        compose_or_fail(grid.overrides(cell, target=grid.cfg.target.ppl if fixed else 2.0), prefix=f"cell {cell.name}: ")
