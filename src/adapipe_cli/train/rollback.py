"""The divergence guard's rollback: back to the last good state, then replay.

A step the guard trips (:meth:`.guard.DivergenceGuard.check`) is not accepted: the run goes back to
the newest snapshot at least ``lag`` steps older (the phases decided since then are replayed
unchanged), the metrics written after it are cut off, the time of the discarded steps stays on
the clock (``RunState.offset``) and the next ``heuristic.guard_cooldown`` undecided steps are sync.
"""

from __future__ import annotations

import copy

from .. import checkpoint
from ..optim import rate_keys
from ..runtime.base import StepResult
from ..runtime.errors import TrainingDiverged
from ..schedules import ASYNC
from .state import RunState
from .summary import phase_times


class Rollback:
    """The guard's snapshots and rollback (a mixin of :class:`.loop.Trainer`, on
    :class:`.state.RunStates`' state)."""

    def _keep_snapshot(self, step: int) -> None:
        """Keep the run after step ``step`` (a good one) for a later rollback."""
        self.guard.keep(step, copy.deepcopy(self._full_state()))

    def _rollback(self, step: int, res: StepResult, reason: str) -> int:
        """Restore the last good state after step ``step`` tripped the guard; returns the next step."""
        kept = self.guard.restore_point(step, self.lag)
        if kept is None:
            raise TrainingDiverged(f"training diverged at step {step} ({reason}) with no good state to go back to: "
                                   f"lower {rate_keys(self.cfg.optim)} or schedule.async_lr_scale")
        good, state = kept
        lost = (res.time_s + self.st.offset) - state["trainer"]["run"]["time_s"]
        by_phase = self._lost_by_phase(state["trainer"], lost, res.phase)
        run = dict(state["trainer"]["run"], wall_before=self.st.wall_before)  # wall time runs on
        self._load_state(copy.deepcopy(state))
        # (a tentative probe under way is not undone after this: it goes on as an ordinary probe, as
        # the guard's rollbacks of any probe do, and its undo is recorded as missed)
        self.probe_from = self.probe_point = self.undo_from = None
        self.st = RunState(**copy.deepcopy(run))
        self.st.offset += lost
        self.st.forced_until = self.plan.decided() + self.guard.cooldown
        self.guard.events += 1
        self.log.truncate(state["trainer"]["lines"])
        self.log.write({"kind": "event", "event": "guard", "step": step, "restored_step": good + 1, "reason": reason,
                        "lost_time_s": lost, "lost_by_phase": by_phase, "sync_until_step": self.st.forced_until})
        self.console.say(f"adapipe: step {step}: {reason}; restored step {good + 1}, sync until step {self.st.forced_until}")
        return good + 1

    def _lost_by_phase(self, kept: dict, lost: float, last: str) -> dict[str, float]:
        """The clock time ``lost`` to a rollback or undo, by the phase it was spent in: each discarded
        step's increment (the step records written since the ``kept`` trainer state), the rest (a
        step the guard tripped, never written) in ``last``. The summary counts it in those phases'
        time (the next step's increment holds it)."""
        spent = phase_times(self.log.records[kept["lines"]:], start=kept["run"]["time_s"])
        out = {ph: v["time_s"] for ph, v in spent.items()}
        out[last] += lost - sum(out.values())
        return out

    def _keep_probe_state(self, step: int) -> None:
        """Keep the run after step ``step`` as the state to undo the tentative probe just decided to."""
        self._keep_snapshot(step)
        self.probe_from, self.probe_point = None, step

    def _undo_probe(self) -> tuple[int, bool]:
        """Undo the tentative probe that began at step ``undo_from`` (``heuristic.undo_probes``):
        back to the run's state before it (kept when the probe was decided, ``lag`` steps ahead),
        with the phases decided then, the metrics written since cut off and the probe's switch
        dropped; the time spent since stays on the clock. The heuristic keeps what it learnt (only
        its observations of the discarded steps go) and decides the probe's first step again.
        Returns the next step, and whether a checkpoint is owed there (one due at the restored step,
        put off again by a new tentative probe decided here)."""
        start, good = self.undo_from, self.probe_point
        self.undo_from = self.probe_point = None
        kept = self.guard.restore_point(good + 1 + self.lag, self.lag)  # (no snapshot is kept after it)
        if kept is None or kept[0] != good:  # (none is kept after it while the probe is under way)
            raise RuntimeError(f"the state kept for the probe from step {start} is gone (newest: {kept and kept[0]})")
        state = copy.deepcopy(kept[1])
        tr = state["trainer"]
        lost = self.st.time_s - tr["run"]["time_s"]
        by_phase = self._lost_by_phase(tr, lost, ASYNC)  # (the probe's steps are all written)
        del tr["phases"][start:]  # (the probe's first step was decided with the snapshot)
        self._load_state(state, heuristic=False)
        self.st = RunState(**dict(tr["run"], wall_before=self.st.wall_before))
        self.st.offset += lost
        self.st.time_s += lost  # (the next step's own time is its step time, as a heuristic observes it)
        self.log.truncate(tr["lines"], drop=lambda r: r.get("event") == "switch" and r.get("step") == start)
        self.log.write({"kind": "event", "event": "undo", "step": start, "restored_step": good + 1, "lost_time_s": lost,
                        "lost_by_phase": by_phase, **self.undo_verdict})
        self.console.say(f"adapipe: the probe of async from step {start} lost: undone, restored step {good + 1} "
                         f"({lost:.3g} s of the clock lost)")
        self.heuristic.rewind(good)
        for u in range(start, min(good + self.lag + 1, self.cfg.train.max_steps)):  # (decided through good + lag again)
            self._decide(u)
        # the kept state of the probe held its phases and a heuristic in the middle of it: a later
        # guard rollback goes back to the run as it is now instead
        self.guard.snapshots.pop()
        due = checkpoint.due(self.cfg.train, good + 1, start=0)  # (put off when the probe was decided)
        if self.probe_from is not None:  # (a new tentative probe decided just now: this is its state)
            self._keep_probe_state(good)
            return good + 1, due
        self._keep_snapshot(good)
        if due:
            self.save_checkpoint()
        return good + 1, False
