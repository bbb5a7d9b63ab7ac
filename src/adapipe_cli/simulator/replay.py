"""The stage programs of a run walked without computing: the simulator's engine, and the pipeline
clock of a run whose stages compute elsewhere (the dist runtime with ``pipeline.clock=profiled``).

:class:`Replay` holds one program and one buffer ledger per stage (:mod:`..schedules.ledger`,
the one the stage executor drives) and the :class:`.clock.PipelineClock`. Each action costs
``profile.cost(stage, kind, work)`` with the ledger's extra work, exactly as the local runtime's
clock charges it, so ``run_step(t)`` gives the time the local runtime gives for step ``t`` with
the same plan and profile.
"""

from __future__ import annotations

import copy
from typing import Callable

from ..schedules.walk import walk
from ..schedules import BACKWARD, EVAL, FORWARD, INPUT, SYNC, UPDATE, Action, Plan, ScheduleSpec, StageProgram
from ..schedules.interleaved import DevicePicks
from ..schedules.ledger import Ledger
from .clock import ALLREDUCE, SIGNAL, CostProfile, LinkModel, PipelineClock


class Replay:
    """Every stage's program of ``plan`` under ``spec``, timed from ``profile``; ``record`` keeps
    the timeline (stage, kind, mb, step, start, end) of every action but evaluations (and of the
    all-reduce before each update, ``allreduce`` seconds per stage, with replicas, and of the
    held-out signal's forward after it, ``signal`` seconds per stage, with a signal). ``jitter``:
    ``(stage, kind) -> factor``, drawn once per action, each action's cost times it on the clock
    (:mod:`.jitter`; None: every action at its profiled cost)."""

    def __init__(self, spec: ScheduleSpec, plan: Plan, profile: CostProfile, link: LinkModel | None = None,
                 mitigations=(), record: bool = False, allreduce: list[float] | None = None,
                 signal: list[float] | None = None, jitter: Callable[[int, str], float] | None = None):
        p = spec.virtual_stages  # (interleaved: every virtual stage's program, on its device's clock)
        if profile.stages != p:
            raise ValueError(f"the cost profile has {profile.stages} stages, the pipeline {p}: measure a profile for this depth")
        self.spec, self.plan, self.profile, self.p = spec, plan, profile, p
        self.mit = set(mitigations)
        self.record = record
        self.jitter = jitter
        self.programs = [StageProgram(s, spec, plan) for s in range(p)]
        self.picks = DevicePicks(spec, plan)
        self.clock = PipelineClock(spec.stages, link, profile.act_bytes, spec.barrier,
                                   [spec.device_of(s) for s in range(p)], allreduce=allreduce, signal=signal)
        self.ledgers = [Ledger(s, predict="predict" in self.mit, keep_before=bool(self.mit & {"predict", "nesterov"}),
                               nbytes=profile.stage_bytes(s), reads_data=s in (0, p - 1),
                               microbatches=spec.microbatches) for s in range(p)]
        self.updated = [-1] * p  # last step each stage has updated
        self.arrived: dict[int, set[int]] = {}  # step -> stages at its synchronous update
        self.f_done: set[tuple[int, int]] = set()  # (stage, mb) forwarded, not yet taken by the next stage
        self.b_done: set[tuple[int, int]] = set()
        self.extra: dict[int, float] = {}  # step -> seconds of extra work (copies, predictions, recomputes)
        self.toll: dict[int, float] = {}  # step -> seconds of the in-flight toll (CostProfile.held_factor)
        self.signal: dict[int, float] = {}  # step -> seconds of the held-out signal's forwards after its updates
        self.timeline: list = []

    def ready(self, s: int, a: Action) -> bool:
        kind = a.kind
        if self.picks.on and not self.picks.next_is(s):  # (with chunks: the device's turn)
            return False
        if kind == FORWARD:
            return s == 0 or (s - 1, a.mb) in self.f_done
        if kind in (BACKWARD, INPUT):
            return s == self.p - 1 or (s + 1, a.mb) in self.b_done
        if kind == UPDATE and a.phase == SYNC:
            waiting = self.arrived.setdefault(a.step, set())
            for c in (s, *self.picks.updates_after(s)):  # (a device reaches all its chunks' updates at once)
                if c not in waiting:
                    waiting.add(c)
                    self.clock.arrive(c, a.step)
            return len(waiting) == self.p or not self.spec.barrier
        return True

    def execute(self, s: int, a: Action) -> list[int]:
        kind, p = a.kind, self.p
        led, prog = self.ledgers[s], self.programs[s]
        if kind == UPDATE:
            floor = prog.floor_version()
            work = led.run(a, floor, led.needed(led.live, floor), self.mit)
        else:  # (the floor matters only to a copy that could go: the ledger asks for it then)
            work = led.run(a, prog.floor_version, False, self.mit)
        base, own, cost = self.profile.costs(s, kind, work)  # (own: at its in-flight count)
        if own != base:  # the in-flight microbatches' toll: busy time too
            self.toll[a.step] = self.toll.get(a.step, 0.0) + own - base
        if len(work) > ("held" in work):  # (work beyond the in-flight count)
            self.extra[a.step] = self.extra.get(a.step, 0.0) + cost - own
        clock, record = self.clock, self.record
        start, end = clock.run(s, a, cost * self.jitter(s, kind) if self.jitter and kind != EVAL else cost)
        if kind == UPDATE:  # (the timeline: its all-reduce, the update, the held-out signal's forward)
            if record and clock.last_allreduce:
                self.timeline.append((s, ALLREDUCE, -1, a.step, *clock.last_allreduce))
            if record:
                self.timeline.append((self.spec.device_of(s), kind, a.mb, a.step, start, end))
            if clock.last_signal:
                s0, s1 = clock.last_signal
                self.signal[a.step] = self.signal.get(a.step, 0.0) + s1 - s0
                if record:
                    self.timeline.append((self.spec.device_of(s), SIGNAL, -1, a.step, s0, s1))
        elif record and kind != EVAL:
            self.timeline.append((self.spec.device_of(s), kind, a.mb, a.step, start, end))
        woken = self.picks.advance(s) if self.picks.on else []  # the device's next virtual stage (with chunks)
        if kind == FORWARD:
            self.f_done.discard((s - 1, a.mb))
            if s + 1 < p:
                self.f_done.add((s, a.mb))
                woken.append(s + 1)
        elif kind in (BACKWARD, INPUT):
            self.b_done.discard((s + 1, a.mb))
            if s > 0:
                self.b_done.add((s, a.mb))
                woken.append(s - 1)
        elif kind == UPDATE:
            self.updated[s] = a.step
            if a.phase == SYNC:
                if all(u >= a.step for u in self.updated):
                    self.arrived.pop(a.step, None)
                return list(range(p))
        return woken

    def run_all(self) -> None:
        """Every action of the plan."""
        self.picks.until = float("inf")
        walk(self.programs, range(self.p), None, self.ready, self.execute)

    def run_step(self, t: int) -> tuple[float, float]:
        """Every stage up to and including its ``U(t)``; (the end of step ``t``'s last update, the
        stages' busy seconds so far)."""
        self.picks.until = t  # (with chunks each device stops at its cut of t, as in the local runtime)
        done = (lambda s: self.updated[s] >= t) if self.spec.chunks == 1 else (lambda s: self.picks.at_cut(s % self.spec.stages, t) or self.programs[s].peek() is None)
        walk(self.programs, range(self.p), done, self.ready, self.execute)
        return self.clock.update_end.pop(t), sum(self.clock.busy)

    # -- state (the divergence guard's rollback) -----------------------------------------------
    def state_dict(self) -> dict:
        return {"popped": [prog.popped for prog in self.programs], "clock": self.clock.state_dict(),
                "ledgers": [copy.deepcopy(led.state_dict()) for led in self.ledgers],
                "rest": copy.deepcopy({k: getattr(self, k) for k in ("updated", "arrived", "f_done", "b_done", "extra", "toll", "signal")})}

    def load_state_dict(self, state: dict) -> None:
        """Go back to ``state``; the plan must hold the phases decided when it was taken."""
        self.programs = [StageProgram(s, self.spec, self.plan) for s in range(self.p)]
        for prog, n in zip(self.programs, state["popped"]):
            prog.skip(n)
        self.picks = DevicePicks(self.spec, self.plan, self.programs)  # (each device where its chunks are)
        self.clock.load_state_dict(state["clock"])
        for led, st in zip(self.ledgers, state["ledgers"]):
            led.load_state_dict(copy.deepcopy(st))
        for k, v in copy.deepcopy(state["rest"]).items():
            setattr(self, k, v)
