"""What a run tells its user while it trains: lines on stderr, the same lines in ``RUN_DIR/run.log``.

On a terminal the progress is a tqdm bar (step, loss, validation perplexity, phase, tokens/s). Off
a terminal (a pipe, a log file, ``make train`` in CI) a bar would print nothing until the end, so
a plain line is printed every :data:`PLAIN_EVERY_S` seconds instead. ``run.log`` gets the plain
lines either way, with every other line of the run (header, events, final line).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from tqdm import tqdm

PLAIN_EVERY_S = 5.0  # seconds between plain progress lines


class Console:
    """``say(line)``: one line on stderr (above the bar when there is one) and in ``run.log``."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / "run.log"

    def say(self, line: str, stderr: bool = True) -> None:
        if stderr:
            tqdm.write(line, file=sys.stderr)
        self.log(line)

    def log(self, line: str) -> None:
        with open(self.path, "a") as f:  # (a line every few seconds: no handle kept open)
            f.write(line + "\n")


class Progress:
    """Progress of a run of ``total`` steps. ``mode``: ``on`` (a bar), ``off`` (nothing on stderr)
    or ``auto`` (a bar on a terminal, plain lines elsewhere)."""

    def __init__(self, total: int, mode: str = "auto", console: Console | None = None,
                 every_s: float | None = None, clock=time.monotonic):
        tty = sys.stderr.isatty()
        enabled = mode == "on" or (mode == "auto" and tty)
        self.plain_on_stderr = mode == "auto" and not tty
        self.bar = tqdm(total=total, file=sys.stderr, dynamic_ncols=True, disable=not enabled, unit="step")
        self.total, self.console, self.clock = total, console, clock
        self.every_s = PLAIN_EVERY_S if every_s is None else every_s
        self.val_ppl: float | None = None
        self.step = 0
        self.t0 = self.last = clock()

    def start_at(self, steps: int) -> None:
        """A resumed run starts after ``steps`` steps."""
        self.step = steps
        self.bar.update(steps)

    def update(self, res, ev: dict | None, tokens_per_s: float) -> None:
        if ev is not None:
            self.val_ppl = ev["val_ppl"]
        self.step = res.step + 1  # (a guard's rollback goes back)
        post = {"loss": f"{res.loss:.3f}", "phase": res.phase, "tok/s": f"{tokens_per_s:,.0f}"}
        if self.val_ppl is not None:
            post["val_ppl"] = f"{self.val_ppl:.2f}"
        self.bar.set_postfix(post, refresh=False)
        self.bar.update(1)
        now = self.clock()
        if self.console is not None and now - self.last >= self.every_s:
            self.last = now
            self.console.say(self.line(res, tokens_per_s, now - self.t0), stderr=self.plain_on_stderr)

    def line(self, res, tokens_per_s: float, wall_s: float) -> str:
        """``adapipe: step 40/200 (20%) loss 3.214 val ppl 45.21 phase async 12,345 tok/s, 23 s``"""
        ppl = f" val ppl {self.val_ppl:.2f}" if self.val_ppl is not None else ""
        return (f"adapipe: step {self.step}/{self.total} ({100 * self.step // max(1, self.total)}%) "
                f"loss {res.loss:.3f}{ppl} phase {res.phase} {tokens_per_s:,.0f} tok/s, {wall_s:.0f} s")

    def close(self) -> None:
        self.bar.close()
