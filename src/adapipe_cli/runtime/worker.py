"""One stage of a distributed run, in its own process: the worker.

A worker builds only its own stage (module, optimizer, update policy, stage program) from the
run's spec on the board, then executes its action list with the shared :class:`StageExecutor`
over a :class:`DistTransport`. Three things tie it to the driver (the Trainer's process):

- the plan: phases are read from the board when the program first needs them (``phase/{u}``);
- the gate: before ``U(t)`` the worker waits until the driver has started step ``t``
  (``go/{t}``). A stop after step ``t - 1`` (target reached, time limit) therefore finds every
  stage exactly after ``U(t - 1)``, holding the same version, whatever it has run ahead of that
  (forwards and backwards of later microbatches change no weights and are dropped). The gate
  costs nothing at a synchronous update (a collective anyway), nor in an asynchronous stream
  with ``m >= p - 1`` (the first stage's ``U(t - 1)`` precedes every stage's ``U(t)``); with
  fewer microbatches the last stages run more than a step ahead and wait at it;
- evaluations: an ``E`` of version ``v`` runs where the program places it, or just before
  ``U(v)`` if the program places it later (which it does on stages ``s >= m`` of a stream), so
  that the driver has every evaluation of step ``t`` before it opens the gate of ``t + 1``.

After each ``U(t)`` a worker reports its step statistics and times (``rep/{t}/{rank}``); a thread
puts the reports and fetches the next gate's verdict ahead (:mod:`.driver_link`), and a verdict
carries the phases decided so far, so the driver costs a worker no round trip in a steady step. When the
driver ends the run, every worker evaluates the final version if asked, meets the others at a
barrier (so that no message still needed is lost) and exits.

Checkpoints (:mod:`..checkpoint`): the cut is the gate. At the gate of ``U(k)`` a stage
has run exactly the actions before ``U(k)`` in its order, whatever the timing, so its state there
is a function of the run; where the training loop writes a checkpoint after ``k`` steps
(:func:`~..checkpoint.due`, and :func:`~..checkpoint.due_at_end` when the run ends
at that gate), each worker writes its stage's part into the temporary folder the driver names
(``save/{k}``) and reports the part's manifest entry (``part/{k}/{rank}``); the driver writes the
manifest last. What crosses this cut between stages ``s`` and ``s + 1``:

- gradients: none. ``U(k)`` comes right after the backward of the last microbatch of step ``k``
  and backwards run in microbatch order, so at their gates both stages have run the backwards of
  exactly the microbatches of steps ``<= k``: every gradient ``s + 1`` sent, ``s`` received.
- evaluations: none. ``E(v)`` needs version ``v`` and runs before ``U(v)`` (see above), so at the
  gate of ``U(k)`` every stage has run ``E(v)`` for every ``v <= k`` and none after.
- activations: those of the microbatches ``s`` has forwarded and ``s + 1`` has not, all still in
  flight at ``s`` (their backward at ``s`` needs ``s + 1``'s). Nobody's state holds them: on
  resume ``s + 1`` publishes the first microbatch it expects (``resume/expect/{s + 1}``) and ``s``
  sends the outputs of those microbatches again, recomputed from their saved inputs, before
  anything else on that channel. A receive that gloo had posted ahead at ``s + 1`` (see
  :class:`.dist_transport.DistTransport`) is not part of the state: whether or not its message
  had arrived, no forward consumed it, so the resent copy takes its place.

The heuristics' held-out signal (``signal_rows`` in the spec): right after each ``U(t)`` every
stage runs ``S(t + 1)``, the forward of the held-out batch with the new weights, on the
evaluation channel (``S(v)`` follows ``U(v - 1)`` and precedes ``E(v)`` at every stage, so both
ends of the channel see one order); the last stage puts its loss on the board (``signal/{v}``).
Its seconds (``signal_s``, waits for the stage before included) stay on the wall clock: it is the
heuristic's own work, not an evaluation.
Without ``pipeline.profile`` each worker measures its own stage's cost profile before it reports
ready (``profile/{rank}``), on its own device, all workers at once: they start at a barrier and
each keeps computing until the last is done (:func:`all_measured`), so that the profile times
each stage beside its peers computing, as it runs.

The divergence guard: the gate is its cut too. The verdict ``snap`` keeps this stage's state
(as a checkpoint part, in memory) before ``go``; ``back`` rolls back to a kept one: the driver
names it (``back``, ``back/{n}``), each stage drops the activations its previous stage had sent
and it had not taken (``back/{n}/now/{rank}``: microbatches forwarded and which carried a table),
restores its snapshot, sends again the activations in flight at it (``back/{n}/expect/{rank}``),
reports (``back/{n}/done/{rank}``) and waits until the driver has cleared the discarded steps'
keys (``back/{n}/go``).

Interleaved 1F1B (``schedule.chunks = v > 1``, and AdaPipe's async phase over the same chunks):
the worker of rank ``d`` holds the virtual stages ``d, d + p, ..., d + (v - 1) p``, each an
executor with its own program, and runs them in its device's order
(:class:`..schedules.interleaved.DevicePicks`). The order marks the device's cut of each step
``t`` (the end of a sync step; in an async stream ``d`` backward slots after its last ``U(t)``,
where every chunk holds version ``t + 1``): there the rank reports the step, then runs the
held-out signal and the evaluation of version ``t + 1`` due, each in chunk order (each chunk needs
only the previous chunk's; the cuts are closed under the order's dependencies, so every rank
reaches its own without waiting for another's evaluations). ``E(0)`` runs before the first action.
The gate is before the first of the rank's updates of a step (after its cut of the step before).
A checkpoint's or snapshot's cut is the gate: a sync step is flushed, so nothing crosses it; an
async stream over chunks is not, and a dist run of it refuses checkpoints and the divergence
guard's rollback (the resent activations are one chunk's).

Its entry points (the driver's spawn, torchrun's other ranks) are in :mod:`.launch`; fault
injection for tests in :mod:`.faults`.
"""

from __future__ import annotations

import copy
import os
import resource
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from ..data.batches import Batches
from ..model.build import make_stages, model_config
from ..schedules import EVAL, SYNC, UPDATE, Action, Plan, StageProgram
from ..schedules.choice import make_policy, microbatch_size, schedule_choice, virtual_stages
from ..schedules.interleaved import CUT, DevicePicks
from .. import checkpoint
from .action_times import ActionTimes, warm_steps
from .dist_transport import ENDINGS, Board, DistAllReduce, DistTransport, build_groups
from .driver_link import DriverLink
from .faults import inject_fault
from .profile_meta import measure_stage_profile
from .replicas import ReplicaGroup, replica_batch, replica_seed, where
from .stage import StageExecutor

STARTING, COMPUTING, WAIT_PEER, WAIT_DRIVER, FINISHED = range(5)
SIGNAL = -1  # the batch index that marks the held-out signal's messages on the evaluation channel
STATE_NAMES = ("starting", "computing", "waiting for a neighbour", "waiting for the driver", "finished")


class Ended(Exception):
    """The driver ended the run: ``verdict`` is ``end``, ``eval`` (end after evaluating the
    final weights) or ``abort``."""

    def __init__(self, verdict: str):
        super().__init__(verdict)
        self.verdict = verdict


class Status:
    """What each local worker is doing, in shared memory, so that the driver can say which stage
    hangs: (state, step) per rank."""

    def __init__(self, array, rank: int):
        self.array, self.i = array, 2 * rank

    def set(self, state: int, step: int | None = None) -> None:
        if self.array is not None:
            self.array[self.i] = state
            if step is not None:
                self.array[self.i + 1] = step


class BoardPlan(Plan):
    """A replica of the driver's plan, filled from the board as the stage program asks."""

    def __init__(self, max_steps: int, board: Board, status: Status):
        super().__init__(max_steps)
        self.board, self.status = board, status
        self.wait_s = 0.0  # seconds spent fetching phases

    def phase(self, step: int) -> str | None:
        while step < self.max_steps and step >= len(self.phases):
            self.status.set(WAIT_DRIVER)
            t0 = time.perf_counter()
            value = self.board.get(f"phase/{len(self.phases)}")
            self.wait_s += time.perf_counter() - t0
            self.status.set(COMPUTING)
            if value in ENDINGS:
                raise Ended(value)
            self.decide(len(self.phases), value)
        return super().phase(step)

    def learn(self, first: int, phases: list[str]) -> None:
        """The phases of steps ``first, first + 1, ...`` that a gate's verdict carried: those not
        known yet are decided here, without a fetch each."""
        for u, phase in enumerate(phases, first):
            if u == len(self.phases):
                self.decide(u, phase)


def never(step: int) -> bool:
    """No evaluation (the programs' with chunks: the worker evaluates at its cuts)."""
    return False


class EvalOrder:
    """A stage program's actions in the order a worker runs them: the program's, except that
    ``E(v)`` runs right before ``U(v)`` when the program places it later."""

    def __init__(self, program: StageProgram, eval_at: Callable[[int], bool]):
        self.program, self.eval_at = program, eval_at
        self.done: set[int] = set()  # versions evaluated

    def peek(self) -> Action | None:
        while True:
            a = self.program.peek()
            if a is None:
                return None
            if a.kind == EVAL and a.version in self.done:  # ran early
                self.program.pop()
                continue
            if a.kind == UPDATE and self.eval_at(a.step - 1) and a.step not in self.done:
                return Action(EVAL, -1, a.step - 1, a.step, SYNC)
            return a

    def pop(self) -> Action | None:
        a = self.peek()
        if a is not None and a.kind == EVAL:
            self.done.add(a.version)
            if self.program.peek() != a:  # an early evaluation: the program's next is U(v)
                return a
        self.program.pop()
        return a


def all_measured(board: Board, n: int) -> Callable[[], bool]:
    """The ``until`` of a worker's start-up profile (:func:`.profile.time_interleaved`): its first
    call counts this worker's timed rounds done (``profiled`` on the board), and it is true once
    all ``n`` workers' are; until then the worker keeps computing, so that no peer's timed round
    runs beside an idle worker, which the run never does in its steady state (on this 2-core
    machine, quiet, a stage computed as fast beside its peer as alone, 0.96 to 1.02x, but not every
    machine's cores are independent)."""
    counted = []

    def until() -> bool:
        if not counted:
            counted.append(board.add("profiled", 1))
        return board.add("profiled", 0) >= n

    return until


class Worker:
    """Rank ``rank`` of the run described by ``spec`` (see :class:`..dist.DistRuntime`): stage
    ``s`` of replica ``r``, ``rank = r * p + s`` (:func:`.replicas.where`; ``r = 0`` without
    replicas). Board keys name the rank; the transport and the executor the stage. Every replica
    evaluates (the replicas hold the same weights), replica 0 reports the losses; replica 0 alone
    measures the cost profile and the link."""

    def __init__(self, board: Board, spec: dict, rank: int, device: torch.device, status: Status):
        from ..data import build_data

        self.board, self.rank, self.device, self.status = board, rank, device, status
        self.driver = DriverLink(board, rank)  # reports and the next gate's verdict, in the background
        cfg = self.cfg = OmegaConf.create(spec["config"])
        p, m, R = cfg.pipeline.stages, cfg.pipeline.microbatches, cfg.pipeline.get("replicas", 1)
        self.replica, self.stage = where(rank, p)
        s = self.stage
        self.p, self.last = p, s == p - 1
        self.reporter = self.replica == 0  # puts the losses of evaluations and of the held-out signal
        v = self.v = virtual_stages(cfg) // p  # model chunks on this worker
        self.chunks = [s + p * j for j in range(v)]  # its virtual stages
        self.picks: DevicePicks | None = None  # with chunks: the device's order of its chunks' turns (see _load)
        self.cut_done = -1  # with chunks: the last step whose cut this worker has passed (report, signal, evaluations)
        self.opened = -1  # the step whose gate this worker has passed
        torch.set_num_threads(spec["threads"])
        torch.manual_seed(cfg.seed)
        data = build_data(cfg.data, cfg.model.block_size, cfg.seed)
        gcfg = model_config(cfg, data.vocab_size)
        choice = schedule_choice(cfg)
        if choice.auto:  # schedule.sync=auto: the sync schedule the driver picked from the profile
            choice = replace(choice, spec=replace(choice.spec, sync=spec["sync"]))
        eval_steps = set(spec["eval_steps"])
        self.eval_at = eval_steps.__contains__
        self.plan = BoardPlan(cfg.train.max_steps, board, status)
        modules, opts = make_stages(cfg, gcfg, which=self.chunks)
        for module in modules:
            module.to(device)
        micro = microbatch_size(cfg)  # a replica's microbatch
        val = [(x.to(device), y.to(device)) for x, y in data.val_batches(micro)]
        rows = spec.get("signal_rows")  # the held-out batch whose loss the heuristic follows, or None
        self.signal = tuple(z.to(device) for z in data.val_batches(rows)[0]) if rows else None
        d, T = gcfg.d_model, cfg.model.block_size

        def shape(channel: str, key) -> tuple:
            if channel in ("actn", "gradn"):  # tables of gradient norms (see runtime/stage.py)
                return (p * v, 2)
            if channel == "eval":
                return ((self.signal if key[1] == SIGNAL else val[key[1]])[0].shape[0], T, d)
            return (micro, T, d)

        tied = cfg.model.tie_embeddings and p > 1
        # (the tables of gradient norms travel only in an async stream: interleaved 1F1B alone has none)
        groups = build_groups(p, tied, R, self.replica, v, tables=v == 1 or choice.phase != SYNC)
        self.transport = DistTransport(s, p, groups, shape, device, ahead=spec["backend"] == "gloo",
                                       on_block=lambda b: status.set(WAIT_PEER if b else COMPUTING),
                                       window=m + (v + 2) * p + len(val) + 1,  # (above any schedule's sends in flight)
                                       base=self.replica * p, chunks=v)
        # each chunk's all-reduce with its R copies, in the device's order on every replica: one group per device
        allreduce = DistAllReduce(groups[("dp", s)], self.transport) if R > 1 else None
        self.act_numel = micro * T * d
        # R x m microbatches per step; this replica's are shares r*m .. r*m + m - 1 (as on the local runtime)
        batches = replica_batch(Batches(data, cfg.train.batch_size, m * R), self.replica, m)
        batch = batches if device.type == "cpu" else (lambda t, i: tuple(z.to(device) for z in batches(t, i)))
        self.spec = choice.spec
        policy = make_policy(cfg, self.plan)  # (its state is per stage: one for the worker's chunks)
        # (with chunks the evaluations run at the device's cuts, not where a program would place them)
        self.prog_eval = self.eval_at if v == 1 else None
        self.programs = [StageProgram(c, choice.spec, self.plan, self.prog_eval) for c in self.chunks]
        self.exs = [StageExecutor(c, p * v, m, module, opt, self.transport, batch, policy, prog,
                                  grad_clip=cfg.optim.grad_clip, seed=replica_seed(cfg.seed, self.replica),
                                  tied=tied, precision=cfg.train.get("precision", "fp32"),
                                  dp=ReplicaGroup(c, self.replica, R, allreduce) if R > 1 else None)
                    for c, module, opt, prog in zip(self.chunks, modules, opts, self.programs)]
        for ex in self.exs:
            ex.val = val
        self.orders = [EvalOrder(prog, self.prog_eval or never) for prog in self.programs]
        self._new_picks()
        self.busy = 0.0  # seconds computing F, B and U (blocking in the transport excluded)
        self.eval_s = 0.0  # seconds in evaluations
        self.signal_s = 0.0  # seconds in the held-out signal's forwards (on the clock)
        self.gate_s = 0.0  # seconds waiting for the driver to open the gate of an update
        self.save_s = 0.0  # seconds at checkpoint gates: writing this stage's part, waiting for the driver's
        self.times = ActionTimes()  # per action kind, against the profile (summary.json's action_times)
        self.warm = warm_steps(cfg.train.max_steps)
        self.t0 = 0.0
        self.start = spec["start"]  # the step this session starts at (a resumed run's checkpoint)
        self.part = spec["parts"][rank] if spec["parts"] else None  # this stage's part of that checkpoint
        self.snapshots: dict[int, dict] = {}  # steps -> this stage's state at the gate of U(steps) (the guard's)
        self.keep = spec.get("snapshots_kept", 0)
        if spec.get("measure"):  # the cost profile of this stage, measured here, on this device, beside its peers
            x, y = batch(0, 0)
            dist.barrier()  # every worker (of every replica) starts measuring at once, as all compute in the run
            # the median call, not the quiet minimum: the prediction from this profile is of this run's steps
            prof = measure_stage_profile(cfg, modules, x, y, data, warn=lambda line: None,
                                         until=all_measured(board, dist.get_world_size()), statistic="median",
                                         cpu_time=True, spread_cv=True)
            prof.meta["device"] = str(device)
            prof.meta["method"] += ", every worker measuring at once"
            if self.reporter:
                board.put(f"profile/{rank}", asdict(prof))

    @property
    def ex(self) -> StageExecutor:
        """The executor of the rank's first chunk (its only one without interleaving)."""
        return self.exs[0]

    @property
    def program(self) -> StageProgram:
        return self.programs[0]

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> None:
        for ex in self.exs if self.reporter else []:  # the bytes each (virtual) stage all-reduces across replicas
            self.board.put(f"grad_bytes/{ex.s}", float(sum(q.numel() * q.element_size() for q in ex.params)))
        self.board.put(f"ready/{self.rank}", os.getpid())
        # before the restore, which waits for the driver, who waits for this (see DistRuntime.link)
        link = self.transport.measure_link(self.act_numel) if self.replica == 0 else None
        if link is not None:
            self.board.put(f"link/{self.rank}", link)
        resend = self._restore(self.part) if self.part is not None else []
        dist.barrier()  # a common start: every report's times count from here
        self.t0 = time.perf_counter()
        for mb in resend:  # in order, before any other activation
            self.ex.resend(mb)
        if self.v > 1 and self.part is None and self.eval_at(-1):  # (with chunks E(0) runs here, not in the programs)
            for j in range(self.v):
                self._execute(j, Action(EVAL, -1, -1, 0, SYNC))
        verdict = self._loop()
        if verdict == "abort":
            raise Ended("abort")
        if verdict == "eval":
            v = self.ex.live
            for j in range(self.v):
                self._execute(j, Action(EVAL, -1, v - 1, v, SYNC))
        if checkpoint.due_at_end(self.cfg.train, self.ex.live):  # the run's final checkpoint
            self._save(self.ex.live)
        self.status.set(WAIT_PEER)
        dist.barrier()  # every message that someone still needs has been received
        self.status.set(FINISHED)
        self.driver.flush()
        # its peaks at its end, its final evaluation and checkpoint included (its last report came before them)
        self.board.put(f"done/{self.rank}", {"steps": self.ex.live, "action_times": self.times.window() if self.device.type == "cpu" else None, **self._peaks()})

    def _loop(self) -> str:
        """Run the action list until the driver ends the run; returns its verdict."""
        while True:
            try:
                j, a = self._next()
            except Ended as e:  # the program asked for the phase of a step after the end
                if e.verdict == "abort":
                    return e.verdict
                a = None
            if a is None:  # the plan's last step is done
                verdict = self._gate(self.ex.live)
                if verdict == "back":
                    continue
                if verdict not in ENDINGS:
                    raise RuntimeError(f"rank {self.rank}: the driver released step {self.ex.live} after the end of the plan")
                return verdict
            self.status.set(COMPUTING, a.step)
            if a.kind == UPDATE and a.step != self.opened:  # (the rank's first update of the step)
                inject_fault(self.rank, a.step)
                verdict = self._gate(a.step)
                if verdict == "back":  # restored: the program's next action is another gate's
                    continue
                if verdict != "go":
                    return verdict
                self.opened = a.step
            self.orders[j].pop()
            if self.picks is not None:
                self.picks.advance(self.chunks[j])
            self._execute(j, a)

    def _next(self) -> tuple[int, Action | None]:
        """The local chunk to run next and its action: with chunks, the chunk whose turn it is in the
        device's order, once the cuts before it are passed (:meth:`_cut`); None at the order's end."""
        if self.picks is None:
            return 0, self.orders[0].peek()
        while (e := self.picks.entry(self.stage)) is not None and e[0] == CUT:
            self._cut(e[1])
            self.picks.pass_cut(self.stage)
        if e is None:
            return 0, None
        j = e[1] // self.p
        return j, self.orders[j].peek()

    def _cut(self, step: int) -> None:
        """The device's cut of ``step`` (with chunks; :func:`..schedules.interleaved.stream_order`):
        every chunk holds version ``step + 1``, and what the other devices need to reach theirs has
        run. The rank reports the step, runs the held-out signal and the evaluation of version
        ``step + 1`` due, each in chunk order (each chunk needs only the previous chunk's), once."""
        if step <= self.cut_done:
            return
        self.cut_done = step
        self._report(step)
        if self.signal is not None:
            self._signal(step + 1)
        if self.eval_at(step):
            for j in range(self.v):
                self._execute(j, Action(EVAL, -1, step, step + 1, SYNC))

    def _gate(self, step: int) -> str:
        """Wait for the driver's verdict on ``U(step)``: ``go`` (``snap``: keep a snapshot here
        first), ``back`` (a rollback, done when this returns), or an ending."""
        saving = checkpoint.due(self.cfg.train, step, self.start)
        t0 = time.perf_counter()
        if saving:
            self._save(step)
        self.status.set(WAIT_DRIVER, step)
        t1 = time.perf_counter()
        verdict = self.driver.verdict(step)
        if isinstance(verdict, tuple):  # go or snap, with the phases decided so far (driver_link.verdict_value)
            verdict, first, phases = verdict
            self.plan.learn(first, phases)
        # a checkpoint's whole pause (this part, the others, the driver's manifest) is not training time
        if saving:
            self.save_s += time.perf_counter() - t0
        else:
            self.gate_s += time.perf_counter() - t1
        self.status.set(COMPUTING)
        if verdict == "snap":
            self._snapshot(step)
            verdict = "go"
        elif verdict == "back":
            self._roll_back()
        return verdict

    def _execute(self, j: int, a: Action) -> None:
        t0, w0, c0 = time.perf_counter(), self.transport.wait_s, time.thread_time()
        ex = self.exs[j]
        if a.kind == UPDATE and a.phase == SYNC:  # the worker's later chunks post their shares of the collectives first
            for k in range(j + 1, self.v):  # (their updates follow this one in the device's order)
                nxt = self.programs[k].peek()
                if nxt is not None and nxt.kind == UPDATE and nxt.step == a.step:
                    self.exs[k].ready(nxt)
        if not ex.ready(a):  # a synchronous update runs its collectives here
            raise RuntimeError(f"stage {ex.s} (rank {self.rank}): {a} not ready on a blocking transport")
        work = ex.run(a)
        dt = time.perf_counter() - t0
        if a.kind == EVAL:
            self.eval_s += dt
            if ex.last:
                losses = ex.eval_losses.pop(a.version)
                if self.reporter:
                    self.board.put(f"eval/{a.version}", losses)
        else:
            computing = dt - (self.transport.wait_s - w0)
            self.busy += computing
            self.times.add(ex.s, a.kind, computing, time.thread_time() - c0, work)
            self.times.clocks["execute"] += dt
        if a.kind == UPDATE and self.v == 1:  # (with chunks the rank reports at its cut)
            self._report(a.step)
            if self.signal is not None:
                self._signal(a.step + 1)

    @torch.no_grad()
    def _signal(self, version: int) -> None:
        """``S(version)``, right after ``U(version - 1)``: the forward of the held-out batch with
        the new weights, passed on like an evaluation's; the last stage puts its loss on the board
        (``signal/{version}``), where the driver has it for the observation of step ``version - 1``,
        the lag of the local runtime. On the clock: the heuristic's own work, which the fixed
        schedules do not do (its seconds, ``signal_s``, are not taken off like evaluations'). (On the evaluation channel:
        every stage runs ``S(v)`` after ``U(v - 1)`` and ``E(v)`` after it, before ``U(v)``.)"""
        t0 = time.perf_counter()
        x, y = self.signal
        for ex in self.exs:  # (in chunk order: each needs only the previous chunk's)
            h = x if ex.first else self.transport.recv("eval", ex.s - 1, ex.s, (version, SIGNAL))
            out = ex.eval_forward(version, h)
            if ex.last:
                if self.reporter:
                    self.board.put(f"signal/{version}", ex._loss(out, y).item())
            else:
                self.transport.send("eval", ex.s, ex.s + 1, (version, SIGNAL), out.float())
        self.signal_s += time.perf_counter() - t0

    # -- the divergence guard ------------------------------------------------------------------
    def _snapshot(self, steps: int) -> None:
        """Keep this stage's state at the gate of ``U(steps)`` (the driver's snapshot after
        ``steps`` steps), the newest :data:`keep` of them, as the driver's guard keeps its own."""
        # (deep: the optimizer's state and the steps' statistics would otherwise go on changing)
        self.snapshots[steps] = copy.deepcopy(self._state())
        while len(self.snapshots) > max(1, self.keep):
            del self.snapshots[min(self.snapshots)]

    def _roll_back(self) -> None:
        """Go back to the snapshot the driver names (``back/{n}``: its steps and the phases decided
        then), from the gate this worker waits at. The activations in flight between stages now are
        received and dropped, those in flight at the snapshot sent again (as on resume), the
        driver told, and its word awaited: it clears the discarded steps' keys meanwhile."""
        n = self.board.get("back")
        order = self.board.get(f"back/{n}")
        to, key = order["to"], f"back/{n}"
        ex, r, s = self.ex, self.rank, self.stage  # (board keys name ranks; a replica's neighbours are r +- 1)
        self.board.put(f"{key}/now/{r}", {"forwarded": self.program.next_f,
                                          "tables": {mb: rec.table is not None for mb, rec in ex.inflight.items()}})
        if s > 0:  # the previous stage's activations that this one has not taken: drop them
            prev = self.board.get(f"{key}/now/{r - 1}")
            for mb in range(self.program.next_f, prev["forwarded"]):
                self.transport.recv("act", s - 1, s, mb)
                if prev["tables"].get(mb):
                    self.transport.recv("actn", s - 1, s, mb)
        snap = self.snapshots[to]
        for steps in [k for k in self.snapshots if k > to]:  # the driver drops these too
            del self.snapshots[steps]
        self.plan.phases[:] = order["phases"]
        self._load(copy.deepcopy(snap))  # (kept: a second rollback may need it)
        for o in self.orders:
            o.done.update(range(to + 1))  # E(v) for v <= to ran before the snapshot's gate
        ex = self.ex
        forwarded = snap["forwarded"]
        if s > 0:
            self.board.put(f"{key}/expect/{r}", forwarded)
        if not self.last:
            first = self.board.get(f"{key}/expect/{r + 1}")
            for mb in range(first, forwarded):
                ex.resend(mb)
        self.status.set(WAIT_DRIVER)
        self.board.put(f"{key}/done/{r}", True)
        self.board.get(f"{key}/go")
        self.status.set(COMPUTING)

    # -- checkpoints ---------------------------------------------------------------------------
    def _save(self, step: int) -> None:
        """Write this stage's part of the checkpoint after ``step`` steps (this worker waits at the
        gate of ``U(step)``) into the folder the driver names; report its manifest entry, or for
        weights that are not finite ``{"nonfinite": c}``, c the first such chunk's (virtual) stage
        (the driver then refuses the checkpoint)."""
        self.status.set(WAIT_DRIVER, step)
        folder = self.board.get(f"save/{step}")
        if folder is None:  # the driver gave up on the run
            raise Ended("abort")
        if folder == "skip":  # a rollback from this gate: the checkpoint comes when the run is here again
            return
        self.status.set(COMPUTING)
        state = self._state()
        nonfinite = [c for c, st in zip(self.chunks, [state["executor"], *state.get("chunks", [])])
                     if not checkpoint.finite(st["params"])]
        if nonfinite:
            entry = {"nonfinite": nonfinite[0]}
        else:
            part = {"step": step, **state}  # (state: the microbatches forwarded so far too)
            entry = checkpoint.write_part(Path(folder), checkpoint.stage_part(self.stage, self.replica), part)
        self.board.put(f"part/{step}/{self.rank}", entry)

    def _restore(self, path: str) -> list[int]:
        """Continue from this stage's part of the checkpoint after ``start`` steps (verified by the
        driver); returns the microbatches whose activations to send again, those the next stage had
        not received at the cut (see the module docstring)."""
        part = torch.load(path, map_location=self.device, weights_only=False)
        if part["step"] != self.start:
            raise RuntimeError(f"rank {self.rank}: {path} holds step {part['step']}, not {self.start}")
        self.status.set(WAIT_DRIVER)
        self.plan.phases[:] = self.board.get("resume/phases")  # decided before the checkpoint, restored by the driver
        self.status.set(COMPUTING)
        # fast-forwards the programs to the cut and recomputes the in-flight forwards
        self._load(part)
        # every evaluation of a version <= start ran before the cut, and the driver has its loss
        for o in self.orders:
            o.done.update(range(self.start + 1))
        forwarded = part["forwarded"]
        if self.stage > 0:
            self.board.put(f"resume/expect/{self.rank}", forwarded)
        if self.last:
            return []
        first = self.board.get(f"resume/expect/{self.rank + 1}")
        missing = [mb for mb in range(first, forwarded) if mb not in self.ex.inflight]
        if missing:
            raise RuntimeError(f"rank {self.rank}: microbatches {missing} crossed the cut but are not in flight")
        return list(range(first, forwarded))

    def _state(self) -> dict:
        """The rank's state at a gate: its first chunk's executor (``executor``), the microbatches it
        has forwarded, and with interleaving its other chunks' executors (``chunks``)."""
        state = {"executor": self.ex.state_dict(), "forwarded": self.program.next_f}  # microbatches forwarded so far
        if self.v > 1:
            state["chunks"] = [ex.state_dict() for ex in self.exs[1:]]
        return state

    def _load(self, state: dict) -> None:
        """Restore a state of :meth:`_state` into fresh programs of the plan (which holds the phases
        decided at its cut); the device's turn is at its first update (the gate)."""
        self.programs = [StageProgram(c, self.spec, self.plan, self.prog_eval) for c in self.chunks]
        for ex, prog, st in zip(self.exs, self.programs, [state["executor"], *state.get("chunks", [])]):
            ex.load_state_dict(st, prog)
        self.orders = [EvalOrder(prog, self.prog_eval or never) for prog in self.programs]
        self._new_picks()
        # at the gate of U(k): the cut of k - 1 passed (its report, signal and evaluations are the driver's)
        self.cut_done = min(prog.updates for prog in self.programs) - 1
        self.opened = -1

    def _new_picks(self) -> None:
        """With chunks, the device's order, at the position its chunks' programs are at; every cut shows."""
        if self.v > 1:
            self.picks = DevicePicks(self.spec, self.plan, self._all_programs())
            self.picks.until = -1

    def _all_programs(self) -> list:
        """The programs indexed by virtual stage (this device's; the others' None)."""
        out: list = [None] * (self.p * self.v)
        for c, prog in zip(self.chunks, self.programs):
            out[c] = prog
        return out

    def _report(self, step: int) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        end = time.perf_counter() - self.t0
        stats, exs, cuda = [ex.take_stats(step) for ex in self.exs], self.exs, self.device.type == "cuda"
        st = stats[-1]  # (the last chunk's: on the last rank, the last stage's losses)
        self.driver.report(step, {
            "t_end": end, "eval_s": self.eval_s, "save_s": self.save_s,
            "node": int(os.environ.get("GROUP_RANK", "0")),  # torchrun's index of this worker's node
            "busy": float("nan") if cuda else self.busy,
            "wait_peer_s": self.transport.wait_s, "wait_driver_s": self.gate_s + self.plan.wait_s,
            "delays": [d for x in stats for d in x.delays], "lr": st.lr, "losses": st.losses,
            "versions": max(ex.versions_held() for ex in exs), "inflight": max(len(ex.inflight) for ex in exs),
            "param_sets": max(ex.param_sets() for ex in exs),
            # per virtual stage: its share of the gradient's squared norm, its learning rate, its ledger's peaks
            "chunks": [{"grad_sq": x.grad_sq, "lr_stage": x.lr_stage, **ex.ledger.report()} for x, ex in zip(stats, exs)],
            **self._peaks(),
        })
        self.times.clocks["report"] += time.perf_counter() - self.t0 - end
        self.times.mark(step, self.warm, {"wait_peer": self.transport.wait_s, "wait_driver": self.gate_s + self.plan.wait_s,
                                          "eval": self.eval_s, "save": self.save_s, "signal": self.signal_s})

    def _peaks(self) -> dict:
        """This process's peak resident memory so far and, on CUDA, its device's peak allocation (MB)."""
        cuda = self.device.type == "cuda"
        return {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # (KiB on Linux)
                "peak_device_mb": torch.cuda.max_memory_allocated(self.device) / 2**20 if cuda else None}


__all__ = ["Ended", "EvalOrder", "BoardPlan", "Worker", "STATE_NAMES", "Status"]
