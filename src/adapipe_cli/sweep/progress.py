"""One line per cell on stderr: started, done, failed or skipped, with the sweep's elapsed time,
printed by the sweep's own process as it starts cells and sees them end (whichever process ran them)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

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


def cell_result(index: int, total: int, start: float, run_dir: Path, took: float) -> None:
    """The line of a cell that ended: done with its best perplexity, or failed with the reason."""
    status, reason = cell_status(run_dir)
    if status == "done":
        best = (read_json(run_dir / "summary.json") or {}).get("best_val_ppl")
        detail = f"{took:.1f}s, best val ppl {best:.3f}" if best is not None else f"{took:.1f}s"
        cell_line(index, total, start, "done", run_dir.name, detail)
    else:
        cell_line(index, total, start, "failed", run_dir.name, f"{took:.1f}s: {reason}")
