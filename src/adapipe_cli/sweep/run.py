"""Running a grid: every cell a one-job Hydra multirun of ``adapipe train``, ``sweep.jobs`` at once.

Each cell runs through the same ``train_command`` a user's ``adapipe train -m`` goes through, with

    hydra.sweep.dir=SWEEP_DIR  hydra.sweep.subdir=p4_b16_adapipe_s0

so each cell is a job directory (``.hydra/``, ``metrics.jsonl``, ``summary.json``, plots) named
after the cell, and a failing cell writes ``error.txt`` there while the others go on.

Order: first the cost profile of every depth (:mod:`.profile`), measured in this process while
nothing else runs; then the cells, ``sweep.jobs`` at a time, each in a worker process of its own
(one in this process when ``jobs=1``). A setting's targets are derived from its baseline's cells
(:mod:`.target`), so those cells are queued first, and the setting's other cells are queued once
they have all ended and the targets are recorded; those cells run with ``train.target_ppl`` the
lowest of the setting's targets, so that a run stopping at it has passed them all. The results do
not depend on ``jobs``: a cell's clock is the depth's shared profile, not the time it took.

Resuming: done cells are skipped (one line each); the profiles and targets recorded in
``sweep.json`` are reused, so a resumed sweep compares its runs on the same clock and targets. The
sweep ends with the report and one line per failed cell, exit status 1.
"""

from __future__ import annotations

import multiprocessing
import signal
import sys
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from pathlib import Path

from omegaconf import OmegaConf

from ..cli.compose import compose_config
from ..cli.signals import Terminated
from .grid import Cell, Grid
from .progress import cell_line, cell_result
from .profile import measure_depth_profile
from .state import SweepState
from .target import derive, evals


def run_cell(overrides: list[str]) -> int:
    """Run one cell (``adapipe train -m`` with one job); its exit status. Runs in a worker process."""
    from ..cli.train import train_command

    argv = sys.argv
    try:
        return train_command(["-m", *overrides])
    finally:
        sys.argv = argv


def worker_ready() -> None:
    """A :class:`CellPool` worker's initializer: Ctrl-C reaches it again now that its interpreter has
    started. One that came while it started is dropped here (ignoring a pending signal discards it);
    the sweep had it too and stops the worker (:func:`stop_workers`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.default_int_handler)


class CellPool(ProcessPoolExecutor):
    """``jobs`` spawned worker processes, each running cells. A worker starts at a submit, and SIGINT
    is blocked meanwhile: the worker inherits the block, so a Ctrl-C that arrives while its
    interpreter is still starting waits instead of interrupting the start (which printed a fatal
    error and a traceback) until :func:`worker_ready`; in this process the signal is only held
    back for the milliseconds of the start, not lost."""

    def __init__(self, jobs: int):
        super().__init__(jobs, multiprocessing.get_context("spawn"), initializer=worker_ready)

    def submit(self, fn, /, *args, **kwargs) -> Future:
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            return super().submit(fn, *args, **kwargs)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)


class InlineExecutor:
    """``jobs=1``: each cell runs in this process at submit, as a pool of one would run it."""

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        future.set_result(fn(*args))
        return future

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        pass


def stop_workers(ex, grace_s: float = 5.0, wait_s: float = 60.0) -> None:
    """Stop the cells running in the pool's worker processes when the sweep is interrupted. After
    Ctrl-C in a terminal they have the signal too and end within ``grace_s`` (a worker that was still
    starting dropped it: :func:`worker_ready`); a signal to the sweep
    alone (``kill PID``) reaches only this process, so the workers left then get SIGTERM (each cell
    stops as a terminated run, its partial results kept), and SIGKILL after ``wait_s``."""
    procs = list((getattr(ex, "_processes", None) or {}).values())  # ProcessPoolExecutor's workers
    ex.shutdown(wait=False, cancel_futures=True)
    for stage, deadline in ((None, grace_s), ("terminate", wait_s), ("kill", 5.0)):
        if stage:
            for p in procs:
                if p.is_alive():
                    getattr(p, stage)()
        end = time.time() + deadline
        for p in procs:
            p.join(max(0.0, end - time.time()))
        if not any(p.is_alive() for p in procs):
            return


class SweepRunner:
    """Runs the cells of a grid into its directory."""

    def __init__(self, grid: Grid):
        self.grid = grid
        self.state = SweepState(grid)
        self.total = 0  # the cells this sweep runs or skips
        self.start = time.time()
        self.seen = 0  # cells skipped or started so far
        self.failed: dict[str, str] = {}  # cell -> reason
        self.profiles: dict[int, Path | None] = {}

    def run(self) -> dict[str, str]:
        """Run every cell that is not done; returns the failed cells and their reasons."""
        g = self.grid
        queue: list[Cell] = []
        self.waiting: dict[str, list[Cell]] = {}  # setting -> its cells that wait for its targets
        self.pending: dict[str, set[str]] = {}  # setting -> its baseline cells not ended yet
        for p in g.cfg.stages:
            for m in g.cfg.microbatches:
                setting, baseline, others = self.plan_setting(p, m)
                if baseline:
                    queue += baseline
                    self.waiting[setting] = others
                else:
                    queue += others
        queue.sort(key=lambda c: c.method != g.baseline)  # baselines first (stable): they unlock the rest
        # the cells this sweep runs or skips: sweep.only's, and the baseline's that a target needs
        self.total = len(queue) + sum(map(len, self.waiting.values()))
        jobs = min(g.jobs, max(1, self.total))
        print(f"adapipe sweep {g.name}: {self.total} cells into {g.dir}, {jobs} at a time",
              file=sys.stderr, flush=True)
        for p in g.cfg.stages:  # before any cell runs: a profile measured beside a running cell would be slower
            self.profiles[p] = self.profile(p) if g.cfg.profile else None
        ex = InlineExecutor() if jobs == 1 else CellPool(jobs)
        try:
            self._drain(ex, queue, jobs)
        except KeyboardInterrupt:
            stop_workers(ex)
            raise
        ex.shutdown()
        return self.failed

    def plan_setting(self, p: int, m: int) -> tuple[str, list[Cell], list[Cell]]:
        """(setting, the baseline cells to run first, the cells that wait for them): fixed targets are recorded
        now; when a derived target is still unknown, the baseline's cells (all of them, ``sweep.only``
        or not) come first."""
        g = self.grid
        cells = [c for c in g.cells() if c.stages == p and c.microbatches == m]
        setting = cells[0].setting
        for which, t in g.targets.items():
            if t.rule == "fixed" and self.state.target(setting, which) is None:
                self.state.set_target(setting, {"ppl": t.ppl, "rule": "fixed"}, which)
        selected = [c for c in cells if c.method in g.selected]
        if all(self.state.target(setting, w) is not None for w in g.targets):
            return setting, [], selected
        baseline = [c for c in cells if c.method == g.baseline]
        self.pending[setting] = {c.name for c in baseline}
        return setting, baseline, [c for c in selected if c.method != g.baseline]

    def _drain(self, ex, queue: list[Cell], jobs: int) -> None:
        running: dict[Future, tuple[Cell, int, float]] = {}
        while queue or running:
            while queue and len(running) < jobs:
                c = queue.pop(0)
                if self.state.status(c)[0] == "done":
                    self.seen += 1
                    cell_line(self.seen, self.total, self.start, "skip", c.name, "(done)")
                    queue += self.ended(c)
                    continue
                target = self.cell_target(c)
                if target is False:
                    continue
                self.seen += 1
                cell_line(self.seen, self.total, self.start, "start", c.name)
                running[ex.submit(run_cell, self.overrides(c, target))] = (c, self.seen, time.time())
            if not running:
                continue
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                c, index, t0 = running.pop(future)
                try:
                    code = future.result()
                except Exception as e:  # the worker process died (killed, out of memory)
                    code = 1
                    (self.grid.dir / c.name).mkdir(parents=True, exist_ok=True)
                    (self.grid.dir / c.name / "error.txt").write_text(f"worker process failed: {e!r}\n")
                if code in (130, 143):  # a run was interrupted or terminated: stop the sweep, not only that run
                    raise Terminated() if code == 143 else KeyboardInterrupt()
                status, reason = self.state.status(c)
                cell_result(index, self.total, self.start, self.grid.dir / c.name, time.time() - t0)
                if status != "done":
                    self.failed[c.name] = reason or status
                queue += self.ended(c)

    def cell_target(self, c: Cell) -> float | None | bool:
        """The ``train.target_ppl`` of a cell: None for the baseline's cells while its setting's targets
        are derived, else the lowest of the setting's targets; False when a target could not be set
        (the cell is failed without running)."""
        targets = [self.state.target(c.setting, w) for w in self.grid.targets]
        if c.setting in self.pending and c.method == self.grid.baseline:
            return None
        if None in targets:
            self.seen += 1
            self.failed[c.name] = f"no target: no {self.grid.baseline} run of {c.setting} completed"
            cell_line(self.seen, self.total, self.start, "failed", c.name, self.failed[c.name])
            return False
        return min(targets)

    def ended(self, c: Cell) -> list[Cell]:
        """The cells that ``c``'s end releases: once every baseline cell of its setting has ended, the
        setting's targets are derived and its other cells queued."""
        pending = self.pending.get(c.setting)
        if pending is None or c.name not in pending:
            return []
        pending.discard(c.name)
        if pending:
            return []
        del self.pending[c.setting]
        self.derive(c.setting)
        return self.waiting.pop(c.setting, [])

    def derive(self, setting: str) -> None:
        """Record the setting's derived targets from its done baseline cells (none done: no target)."""
        g = self.grid
        runs = {c.name: (evals(g.dir / c.name), self._budget(c)) for c in g.cells()
                if c.setting == setting and c.method == g.baseline and self.state.status(c)[0] == "done"}
        for which, t in g.targets.items():
            if t.rule == "fixed" or self.state.target(setting, which) is not None:
                continue
            record = derive(t, runs)
            if record is None:
                continue
            self.state.set_target(setting, record, which)
            how = (f"best val ppl of its {len(record['from'])} runs" if t.rule == "sync_best" else
                   f"{record['fraction']:g} of {record.get('budget') or 'their'} steps of {len(record['from'])} runs")
            print(f"target {setting} ({which}): val ppl {record['ppl']:.4g} (median over seeds of {t.baseline}'s "
                  f"{how})", file=sys.stderr, flush=True)

    def _budget(self, cell: Cell) -> int:
        """The cell's step budget, train.max_steps of the config it ran with."""
        return int(OmegaConf.load(self.grid.dir / cell.name / ".hydra" / "config.yaml").train.max_steps)

    def profile(self, stages: int) -> Path:
        """The depth's cost profile: recorded in sweep.json, put in place before the sweep (by
        ``adapipe profile --out SWEEP_DIR/profiles/pP_mbB.json``; every run checks that it fits), or
        measured now."""
        path = self.state.profile(stages)
        if path is None:
            mbs = self.grid.cfg.microbatch_size
            path = self.grid.dir / "profiles" / f"p{stages}_mb{mbs}.json"
            if path.is_file():
                print(f"profile p{stages}: {path} (there already)", file=sys.stderr, flush=True)
                self.state.set_profile(stages, path)
                return path
            first = next(c for c in self.grid.cells() if c.stages == stages)
            cfg = compose_config(self.grid.overrides(Cell(stages, 1, mbs, first.method, first.seed)))
            t0 = time.time()
            prof = measure_depth_profile(cfg, path)
            step = sum(prof.forward) + sum(prof.backward)
            print(f"profile p{stages}: {step * 1e3:.1f} ms of forward+backward per microbatch over all stages, "
                  f"measured in {time.time() - t0:.1f}s -> {path}", file=sys.stderr, flush=True)
            self.state.set_profile(stages, path)
        return path

    def overrides(self, c: Cell, target: float | None) -> list[str]:
        """The ``adapipe train -m`` overrides of one cell: a one-job multirun into its directory."""
        return [*self.grid.overrides(c, self.profiles.get(c.stages), target),
                f"hydra.sweep.dir={self.grid.dir}", f"hydra.sweep.subdir={c.name}"]
