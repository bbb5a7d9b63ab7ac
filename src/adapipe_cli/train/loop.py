"""The training loop of ``adapipe train``: one experiment, start to summary.

Each step the runtime trains every stage up to the step's update; the loop then hands the step's
measurements to the heuristic, which decides the phase of a step ``lag`` steps ahead (the
pipeline needs phases that far in advance), logs the step, evaluates every ``train.eval_every``
steps and stops at ``train.max_steps``, ``train.max_time_s`` or, with ``train.stop_at_target``, at
the target perplexity. The run is built by :mod:`.setup`, its state kept and restored by
:mod:`.state` and :mod:`.rollback`, and reported by :mod:`.summary`.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from omegaconf import OmegaConf

from .. import checkpoint
from ..adaptive.base import Decision, Observation
from ..config.validate import ConfigError
from ..data import DataError
from ..optim import rate_keys
from ..runtime.base import StepResult
from ..runtime.errors import TrainingDiverged
from ..schedules import SYNC
from .metrics import RunLog
from .progress import Progress
from .rollback import Rollback
from .setup import RunSetup
from .state import RunState, RunStates
from .summary import final_line, first_line, plot_run, run_summary, save_in_run_profile, step_record


class Trainer(RunSetup, RunStates, Rollback):
    """A built run (:class:`.setup.RunSetup`) and its loop."""

    def run(self) -> dict:
        cfg, t, rt = self.cfg, self.cfg.train, self.runtime
        self.st = RunState()
        # a tentative probe (heuristic.undo_probes): the step it begins at until the run's state
        # before it is kept, that state's step while the probe is undecided, the probe to undo
        self.probe_from = self.probe_point = self.undo_from = None
        resume = self.resume
        try:
            self.log = RunLog(self.dir, cfg.logger, OmegaConf.to_container(cfg, resolve=True),
                              keep_lines=resume[1]["trainer_lines"] if resume else None)
        except BaseException:  # (wandb refused to start: the dist runtime's workers must still stop)
            rt.close()
            raise
        self.console.say(first_line(cfg, rt, self.clock, self.device, self.data.describe(), self.choice.spec.sync))
        self.wall0 = time.perf_counter()
        progress = Progress(t.max_steps, t.progress, self.console)
        try:
            if resume:
                self._restore(*resume)
                self.console.say(f"adapipe: resumed from {resume[0]} at step {self.st.steps}")
                # a run continued past its old train.max_steps has not decided the steps after it yet
                for u in range(self.plan.decided(), min(self.st.steps + self.lag, t.max_steps)):
                    self._decide(u)
            else:
                for u in range(min(self.lag, t.max_steps)):
                    self._decide(u)
                self._collect()
            # a tentative probe decided before any step of this session: its state is now
            if self.probe_from is not None:
                self._keep_probe_state(self.st.steps - 1)
            progress.start_at(self.st.steps)
            step = self.st.steps
            owed = False  # a checkpoint put off by a tentative probe
            while step < t.max_steps:
                res = rt.run_step(step)
                reason = self.guard.check(res.phase, res.loss)
                if reason:
                    step = self._rollback(step, res, reason)
                    owed = False  # (one put off by a probe comes due again in the replay)
                    continue
                if not math.isfinite(res.loss):
                    raise TrainingDiverged(f"training diverged at step {step} (loss {res.loss}): lower {rate_keys(cfg.optim)} or "
                                           f"schedule.async_lr_scale, or keep heuristic.guard=true")
                self.guard.accept(res.loss)
                ev = self._after_step(step, res)
                progress.update(res, ev, self.st.tokens / self.st.time_s if self.st.time_s > 0 else 0.0)
                step += 1
                # (step >= 1 here: never the resumed-from step). A checkpoint due while a tentative probe
                # is decided or under way is written once it is settled (by the undo, if it is undone):
                # one of a run that may be undone would not be the run's
                owed = owed or checkpoint.due(t, step, start=0)
                if owed and self.probe_from is None and self.probe_point is None and self.undo_from is None:
                    self.save_checkpoint()
                    owed = False
                if self.probe_from is not None:  # the run before a tentative probe, kept to undo it
                    self._keep_probe_state(step - 1)
                elif self.guard.due(step - 1) and self.probe_point is None:  # (none that would push it out)
                    self._keep_snapshot(step - 1)
                if self.undo_from is not None:
                    step, owed = self._undo_probe()  # (a checkpoint put off comes due again in the replay)
                    continue
                if ev and t.stop_at_target and ev["val_ppl"] <= t.target_ppl:
                    self.st.stopped = "target"
                    break
                if t.max_time_s and self.st.time_s >= t.max_time_s:
                    self.st.stopped = "max_time"
                    break
            if self.st.evals[-1]["step"] != self.st.steps:
                rt.evaluate_now(self.st.steps)
                self._collect()
            if checkpoint.due_at_end(t, self.st.steps):
                self.save_checkpoint()
            progress.close()
            wall = self.wall()
            rt.close()  # (before the summary: a dist worker's peak memory counts its final evaluation and checkpoint)
            summary = run_summary(cfg, self.log.records, self.st.evals, self.st, wall, runtime=rt,
                                  clock=self.clock, device=self.device, phase=self.choice.phase, ctx=self.ctx,
                                  min_ppl=getattr(self.data, "min_ppl", None), sync=self.choice.spec.sync)
            self.log.summary(summary)
            save_in_run_profile(summary.get("action_times"), self.profile, self.dir, self.console.say)
        finally:
            progress.close()
            rt.close()
            self.log.close()
        plot_run(cfg, self.clock, self.log.records, self.dir, self.choice.spec.sync)
        self.console.say(final_line(summary))
        return summary

    def wall(self) -> float:
        return self.st.wall_before + time.perf_counter() - self.wall0

    def _after_step(self, step: int, res: StepResult) -> dict | None:
        """Account, observe, decide ahead, log and collect evaluations of a finished step."""
        st = self.st
        time_s = res.time_s + st.offset
        prev = st.time_s
        st.tokens, st.time_s, st.steps = st.tokens + self.tokens_per_step, time_s, step + 1
        st.step_time[step + 1] = time_s
        signal = self.runtime.evaluate(self.signal, signal=True) if self.signal else res.loss
        self.heuristic.observe(Observation(step, res.phase, signal, time_s, time_s - prev, res.staleness_mean))
        if step + self.lag < self.cfg.train.max_steps:
            self._decide(step + self.lag)
        rec = step_record(res, time_s, st.tokens, self.wall())
        if self.signal:
            rec["signal"] = signal  # the held-out loss the heuristic follows
        self.log.write(rec)
        return self._collect()

    def _collect(self) -> dict | None:
        last = None
        for version, loss in self.runtime.evaluations():
            last = {"kind": "eval", "step": version, "val_loss": loss, "val_ppl": math.exp(min(loss, 50.0)),
                    "time_s": self.st.step_time[version], "wall_s": self.wall(), "tokens": version * self.tokens_per_step}
            self.log.write(last)
            self.st.evals.append(last)
        return last

    def _decide(self, u: int) -> None:
        if u < self.st.forced_until:
            d = Decision(SYNC, "divergence guard cooldown")
        else:
            d = self.heuristic.decide(u)
        if d.tentative:
            self.probe_from = u
        elif d.undo is not None and self.probe_point is not None:
            self.undo_from, self.undo_verdict = d.undo, {"reason": d.reason, "decided_after_step": u - self.lag, **d.info}
        elif d.undo is not None:  # (its state is gone: a guard rollback to before the probe)
            self.log.write({"kind": "event", "event": "undo_missed", "step": u, "probe_start": d.undo})
        if not d.tentative and d.undo is None and not self.heuristic.tentative:
            self.probe_point = None  # the probe was kept: its state is an ordinary snapshot now
        prev = self.plan.phases[u - 1] if u > 0 else None
        self.runtime.decide(u, d.phase)
        if prev is not None and d.phase != prev:
            self.log.write({"kind": "event", "event": "switch", "step": u, "from": prev, "to": d.phase,
                            "reason": d.reason, "decided_after_step": u - self.lag, **d.info})
            self.console.say(f"adapipe: switch {prev} -> {d.phase} at step {u} ({d.reason})")
        elif d.info:  # a verdict that kept the phase: recorded too, with its estimates
            self.log.write({"kind": "event", "event": "verdict", "step": u, "phase": d.phase, "reason": d.reason,
                            "decided_after_step": u - self.lag, **d.info})


def train(cfg, run_dir: Path) -> dict:
    """Run one experiment into ``run_dir``; returns its summary."""
    return Trainer(cfg, run_dir).run()


__all__ = ["ConfigError", "DataError", "Trainer", "TrainingDiverged", "train"]
