"""The divergence guard: an async phase that blows up is rolled back instead of ending the run.

Every ``heuristic.guard_every`` good steps the training loop keeps the whole run's state in
memory (:mod:`.rollback` takes and restores it; this module decides when, and which). A step of an async phase whose loss is not finite, or exceeds ``guard_factor`` times the
running average of recent losses (an EMA, ``a <- 0.9 a + 0.1 loss``, over accepted steps), trips
the guard: the loop restores the last good state, runs sync for ``guard_cooldown`` steps and
records the event. The time spent on the discarded steps stays on the clock: a rollback is not
free. With ``heuristic.guard=false`` (or in a sync phase) a non-finite loss ends the run with a
clear message instead, and no checkpoint is written from diverged weights.
"""

from __future__ import annotations

import math
from collections import deque

from ..schedules import ASYNC


class DivergenceGuard:
    def __init__(self, cfg):
        self.enabled = bool(cfg.guard)
        self.factor, self.every, self.cooldown = cfg.guard_factor, cfg.guard_every, cfg.guard_cooldown
        self.average: float | None = None
        self.snapshots: deque = deque(maxlen=2)  # (step, state) of recent good steps, oldest first
        self.events = 0

    def keep_for(self, lag: int) -> None:
        """Keep enough snapshots that one is older than the ``lag`` steps already decided ahead."""
        self.snapshots = deque(self.snapshots, maxlen=2 + lag // max(1, self.every))

    def usable(self, step: int, lag: int):
        """The newest snapshot (g, state) from which step ``step`` is more than ``lag`` steps away:
        the steps up to g + lag were decided before g's state was kept, so a rollback to it would
        replay them unchanged."""
        return next((s for s in reversed(self.snapshots) if s[0] + lag < step), None)

    def keep(self, step: int, state) -> None:
        """Keep ``state``, the run after step ``step``, as the newest good one (the oldest goes)."""
        self.snapshots.append((step, state))

    def restore_point(self, step: int, lag: int):
        """The snapshot (g, state) a rollback of step ``step`` goes back to (:meth:`usable`), every
        later one dropped (they led here); None when there is none."""
        kept = self.usable(step, lag)
        if kept is not None:
            while self.snapshots and self.snapshots[-1][0] > kept[0]:
                self.snapshots.pop()
        return kept

    def check(self, phase: str, loss: float) -> str | None:
        """Why the step must be rolled back, or None if it is accepted."""
        if not self.enabled or phase != ASYNC:
            return None
        if not math.isfinite(loss):
            return f"non-finite loss ({loss})"
        if self.average is not None and loss > self.factor * self.average:
            return f"loss spike: {loss:.4g} > {self.factor:g} x running average {self.average:.4g}"
        return None

    def accept(self, loss: float) -> None:
        if math.isfinite(loss):
            self.average = loss if self.average is None else 0.9 * self.average + 0.1 * loss

    def due(self, step: int) -> bool:
        return self.enabled and (not self.snapshots or step % self.every == 0)

    def state_dict(self) -> dict:
        return {"average": self.average, "events": self.events}

    def load_state_dict(self, state: dict) -> None:
        self.average, self.events = state["average"], state["events"]
