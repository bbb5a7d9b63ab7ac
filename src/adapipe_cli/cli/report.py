"""``adapipe report SWEEP_DIR [--cell p8_b4]``: tables and plots of a finished or partial sweep."""

from __future__ import annotations

import argparse
from pathlib import Path

from .errors import fail


def report_command(args: list[str]) -> int:
    from ..config import ConfigError
    from ..sweep.report import write_report

    parser = argparse.ArgumentParser(prog="adapipe report", description=__doc__.split(":", 1)[1].strip())
    parser.add_argument("sweep_dir", type=Path, help="the directory adapipe sweep wrote (outputs/sweeps/NAME)")
    parser.add_argument("--cell", help="the setting whose validation curves to draw, e.g. p8_b4 (default: the "
                                       "grid's sweep.curves when the sweep has that setting, else the deepest "
                                       "pipeline at its smallest batch)")
    ns = parser.parse_args(args)
    try:
        paths = write_report(ns.sweep_dir, ns.cell)
    except ConfigError as e:
        fail(str(e))
    for p in paths:
        print(p)
    return 0
