"""``adapipe report SWEEP_DIR``: ``results.csv``, ``results.md`` and the plots of a sweep, from
its ``sweep.json`` and its runs' summaries and metrics. Works on a partial sweep: failed and
missing runs are listed, never silently dropped."""

from __future__ import annotations

import re
from pathlib import Path

from ..config import ConfigError
from . import plots
from .markdown import render
from .results import PREFIX, collect, table, targets_of, write_csv
from .state import STATE, read_json
from .target import async_spans, evals


def load_state(sweep_dir: Path) -> dict:
    if not sweep_dir.is_dir():
        raise ConfigError(f"sweep directory {sweep_dir} does not exist: give the directory adapipe sweep wrote "
                          f"(outputs/sweeps/NAME by default)")
    state = read_json(sweep_dir / STATE)
    if state is None:
        raise ConfigError(f"{sweep_dir} is not a sweep directory (no readable {STATE}): give the directory "
                          f"adapipe sweep wrote")
    return state


def _setting(name: str | None) -> tuple[int, int] | None:
    """``p8_b4`` (or a cell name such as ``p8_b4_sync_s0``) -> (8, 4); None if it is not one."""
    m = re.match(r"p(\d+)_b(\d+)", name or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def curves_setting(state: dict, rows: list[dict], choice: str | None) -> tuple[int, int]:
    """The (depth, batch size) whose curves to draw: ``choice`` (``--cell``: ``p8_b4`` or a cell
    name such as ``p8_b4_sync_s0``; refused when it is not a setting of the sweep), else the grid's
    ``curves`` when the sweep has that setting (a grid narrowed on the command line may not), else
    the deepest pipeline at its smallest batch, where a synchronous pipeline's bubble is largest."""
    settings = sorted({(r["stages"], r["batch_size"]) for r in rows})
    if choice:
        if _setting(choice) not in settings:
            raise ConfigError(f"--cell {choice}: not a setting of this sweep; use one of "
                              f"{', '.join(f'p{p}_b{b}' for p, b in settings)}")
        return _setting(choice)
    if _setting(state.get("curves")) in settings:
        return _setting(state.get("curves"))
    deepest = max(p for p, _ in settings)
    return deepest, min(b for p, b in settings if p == deepest)


def write_report(sweep_dir: Path, cell: str | None = None) -> list[Path]:
    """Write the report files into ``sweep_dir``; returns their paths."""
    sweep_dir = Path(sweep_dir)
    state = load_state(sweep_dir)
    rows = collect(sweep_dir, state)
    p, b = curves_setting(state, rows, cell)
    out = [sweep_dir / "results.csv", sweep_dir / "results.md"]
    methods, compare = state["methods"], state["compare"]
    stats = {which: table(rows, methods, which) for which in targets_of(rows) or ["early"]}
    write_csv(rows, out[0])
    out[1].write_text(render(state, rows, stats))
    if not any(r["status"] == "done" for r in rows):
        return out
    clock = next(r["clock"] for r in rows if r["clock"])
    baseline = state["definition"]["target"].get("baseline")
    over = baseline if baseline in methods and baseline != compare else next((m for m in methods if m != compare), None)
    reference = baseline if baseline in methods else methods[0]
    for which, by_setting in stats.items():
        tail = "" if which == "early" else f"_{which}"
        if over is not None:
            out.append(sweep_dir / f"speedup{tail}.png")
            plots.plot_speedup(by_setting, compare, over, clock, out[-1], which)
        if any(by_method[reference].ok for by_method in by_setting.values()):  # bars are relative to its times
            out.append(sweep_dir / f"ttp{tail}.png")
            plots.plot_ttt(by_setting, methods, reference, clock, out[-1], which)
    here = [r for r in rows if r["stages"] == p and r["batch_size"] == b and r["status"] == "done"]
    curves = {m: [(r["seed"], evals(sweep_dir / r["cell"])) for r in here if r["method"] == m] for m in methods}
    target = [t for w in stats if (t := next((r[PREFIX[w] + "target_ppl"] for r in here), None))]
    out.append(sweep_dir / f"curves_p{p}_b{b}.png")
    # each switching method's first seed: where it ran async (its phases, as bands under the curves)
    phases = {}
    for m in methods:
        runs = sorted((r for r in here if r["method"] == m and r.get("switches")), key=lambda r: r["seed"])
        if runs:
            phases[m] = (runs[0]["seed"], async_spans(sweep_dir / runs[0]["cell"]))
    plots.plot_setting_curves(curves, target, clock,
                              f"{state['name']}: depth {p}, batch size {b}", out[-1], phases)
    return out
