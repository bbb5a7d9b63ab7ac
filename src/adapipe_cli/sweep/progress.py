"""One line per cell on stderr: started, done, failed or skipped, with the sweep's elapsed time.

The sweep prints the lines of cells it skips; the lines of cells it runs come from
:class:`CellProgress`, a Hydra callback added to each multirun (``hydra.callbacks.progress``),
which sees every job start and end.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from hydra.experimental.callback import Callback

from .state import cell_status, read_json


def elapsed(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def cell_line(index: int, total: int, start: float, verb: str, name: str, detail: str = "") -> None:
    """``[ 3/12  0m41s] done     p2_b4_sync_s0  12.3s, best val ppl 5.21``"""
    width = len(str(total))
    print(f"[{index:>{width}}/{total} {elapsed(time.time() - start):>9}] {verb:<8} {name}  {detail}".rstrip(),
          file=sys.stderr, flush=True)


class CellProgress(Callback):
    """Prints a line when a job of the multirun starts and when it ends. ``first``: cells of the
    sweep before this multirun; ``start``: the sweep's start (seconds since the epoch)."""

    def __init__(self, total: int, first: int, start: float):
        self.total, self.index, self.start = total, first, start
        self._t0 = 0.0

    def on_job_start(self, config, **kwargs) -> None:
        self.index += 1
        self._t0 = time.time()
        cell_line(self.index, self.total, self.start, "start", Path(config.hydra.runtime.output_dir).name)

    def on_job_end(self, config, job_return, **kwargs) -> None:
        run_dir = Path(config.hydra.runtime.output_dir)
        status, reason = cell_status(run_dir)
        took = f"{time.time() - self._t0:.1f}s"
        if status == "done":
            best = (read_json(run_dir / "summary.json") or {}).get("best_val_ppl")
            detail = f"{took}, best val ppl {best:.3f}" if best is not None else took
            cell_line(self.index, self.total, self.start, "done", run_dir.name, detail)
        else:
            cell_line(self.index, self.total, self.start, "failed", run_dir.name, f"{took}: {reason}")
