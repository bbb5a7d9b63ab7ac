"""The local runtime: every stage in one process, an exact emulation of a p-device pipeline.

Each stage is a :class:`StageExecutor` with its own parameters, optimizer, stashed versions and
activations; stages talk only through a :class:`LocalTransport`. :meth:`LocalRuntime.run_step`
runs every stage exactly up to its update of step ``t`` (in any dependency-respecting order), so
that afterwards every stage holds version ``t + 1`` and the model can be evaluated as is. The
pipeline clock times each action from its cost (profiled or measured).

With ``replicas`` (data parallel x pipeline, :mod:`.replicas`) it emulates R x p devices: R
pipelines, each with its own transport, stages, optimizers and share of every step's batch, walked
together; stage s of every replica all-reduces its gradient with its copies through one more
transport. The replicas stay bitwise identical, so evaluation and memory are replica 0's, and the
clock follows replica 0 (every replica runs the same lists at the same costs under a profile).
"""

from __future__ import annotations

import copy
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..model import lm_loss
from ..schedules import BACKWARD, EVAL, FORWARD, INPUT, SYNC, UPDATE, Action, Plan, ScheduleSpec, StageProgram
from ..schedules.interleaved import DevicePicks
from ..schedules.walk import walk
from ..simulator.clock import AllReduceModel, CostProfile, LinkModel, PipelineClock, allreduce_times
from .. import checkpoint
from .base import StepResult, global_norm, stage_lrs
from .device import synchronize
from .errors import TrainingDiverged
from .replicas import ReplicaGroup, replica_seed
from .stage import StageExecutor
from .transport import LocalTransport


# what replica r > 0 does not save: the same as replica 0's (the replicas stay bitwise identical)
SHARED_STATE = ("params", "optimizer", "copies", "predicted", "policy")


@dataclass
class Replica:
    """One more replica of the pipeline: its own stage modules and optimizers (the same initial
    weights as replica 0's), update policy (:meth:`UpdatePolicy.replica`) and batch function (its
    share of each step, :func:`.replicas.replica_batch`)."""

    stages: list
    optimizers: list
    policy: object
    batch: object


class LocalRuntime:
    """Every stage in this process (:class:`.base.Runtime`); ``replicas``: the pipeline's other
    replicas (replica 0 is made of ``stages``, ``optimizers``, ``policy`` and ``batch``), and
    ``allreduce`` the cost model of their all-reduce on the clock."""

    name = "local"

    def __init__(
        self,
        stages,
        optimizers,
        spec: ScheduleSpec,
        plan: Plan,
        policy,
        batch,
        profile: CostProfile | None,
        link: LinkModel,
        grad_clip: float,
        seed: int,
        tied: bool,
        order: str = "forward",
        eval_at=None,
        val_batches=None,
        precision: str = "fp32",
        device: torch.device | None = None,
        replicas: list[Replica] | None = None,
        allreduce: AllReduceModel | None = None,
        signal: list[float] | None = None,
    ):
        # p: stages (virtual stages with interleaving), each its own executor; devices: what the clock times
        self.p, self.m, self.devices = spec.virtual_stages, spec.microbatches, spec.stages
        self.plan, self.spec = plan, spec
        parts = [Replica(stages, optimizers, policy, batch), *(replicas or [])]
        self.R = len(parts)
        self.replica_picks = [DevicePicks(spec, plan) for _ in parts]
        self.picks = self.replica_picks[0]
        self.dp = LocalTransport()  # the all-reduces of the stages' copies across replicas
        self.transports = [LocalTransport() for _ in parts]
        self.replica_programs = [[StageProgram(s, spec, plan) for s in range(self.p)] for _ in parts]
        self.replica_executors = [
            [StageExecutor(s, self.p, self.m, r.stages[s], r.optimizers[s], self.transports[i], r.batch, r.policy,
                           self.replica_programs[i][s], grad_clip=grad_clip,
                           seed=replica_seed(seed, i),
                           tied=tied, nbytes=profile.stage_bytes(s) if profile else None, precision=precision,
                           dp=ReplicaGroup(s, i, self.R, self.dp))
             for s in range(self.p)]
            for i, r in enumerate(parts)
        ]
        self.transport, self.programs, self.executors = self.transports[0], self.replica_programs[0], self.replica_executors[0]
        self._flat_programs = [prog for progs in self.replica_programs for prog in progs]
        self._flat = [ex for exs in self.replica_executors for ex in exs]  # walk index i = replica * p + stage
        self.profile = profile  # None: each action's measured duration is its cost
        self.device = device or torch.device("cpu")  # every stage's; tensors pass between stages as they are
        # the all-reduce before each update, of the stage's gradient bytes (a parameter set's)
        grad_bytes = [float(sum(q.numel() * q.element_size() for q in ex.params)) for ex in self.executors]
        ar = allreduce_times(allreduce, grad_bytes) if self.R > 1 else None
        # ``signal``: per stage, the held-out signal's forward after each update (charged by the clock
        # from the profile; with measured costs, :meth:`evaluate` charges what it measures)
        self.clock = PipelineClock(self.devices, link, profile.act_bytes if profile else 0.0, spec.barrier,
                                   stage_device=[spec.device_of(s) for s in range(self.p)], allreduce=ar,
                                   signal=signal if profile else None)
        self.updated = [-1] * (self.R * self.p)  # last step each stage (of each replica) has updated
        self.arrived: set[tuple[int, int]] = set()
        stage_order = list(range(self.p)) if order == "forward" else list(reversed(range(self.p)))
        self.order = [r * self.p + s for r in range(self.R) for s in stage_order]
        self.lifo = order == "reverse"
        self.last_time = 0.0
        self.last_busy = 0.0
        self.eval_at = eval_at or (lambda t: False)
        self.val = val_batches or []
        self._evals: list[tuple[int, float]] = []
        if self.eval_at(-1):
            self._evals.append((0, self.evaluate(self.val)))

    # -- the interface the training loop drives (:class:`.base.Runtime`) ----------------------
    backend = None
    clock_name = "pipeline"
    snapshots = True
    heldout = True
    link = None  # stages exchange tensors in memory: nothing to measure

    def decide(self, step: int, phase: str) -> None:
        self.plan.decide(step, phase)

    def evaluations(self) -> list[tuple[int, float]]:
        """(version, mean validation loss) of the evaluations finished since the last call."""
        out, self._evals = self._evals, []
        return out

    def evaluate_now(self, version: int) -> None:
        """Evaluate the current weights (version ``version``) outside the eval schedule, e.g. when
        a run stops early."""
        self._evals.append((version, self.evaluate(self.val)))

    def close(self) -> None:
        pass

    # -- the walk ------------------------------------------------------------------------------
    def _ready(self, i: int, a: Action) -> bool:
        r, s = divmod(i, self.p)
        picks = self.replica_picks[r]
        if not picks.next_is(s):
            return False
        if a.kind == UPDATE and a.phase == SYNC:
            for c in (s, *picks.updates_after(s)):  # (a device reaches all its chunks' updates at once, as in the simulator)
                if (r * self.p + c, a.step) not in self.arrived:
                    self.arrived.add((r * self.p + c, a.step))
                    if r == 0:
                        self.clock.arrive(c, a.step)
            # the device's other chunks post their shares too, at every poll: a chunk's share of the
            # norm follows its tied embedding's sum, which may complete only later
            for c in picks.updates_after(s):
                self._flat[r * self.p + c].ready(a)
        return self._flat[i].ready(a)

    def _execute(self, i: int, a: Action) -> list[int]:
        r, s = divmod(i, self.p)
        measured = self.profile is None
        if measured:
            synchronize(self.device)  # (CUDA runs kernels asynchronously: time the action's own)
        t0 = time.perf_counter()
        work = self._flat[i].run(a)
        if measured:
            synchronize(self.device)
        if r == 0:  # (the clock follows replica 0)
            cost = time.perf_counter() - t0 if measured else self.profile.cost(s, a.kind, work)
            self.clock.run(s, a, cost)
        base = r * self.p
        woken = [base + c for c in self.replica_picks[r].advance(s)]  # the device's next virtual stage (none without interleaving)
        if a.kind == UPDATE:
            self.updated[i] = a.step
            self.arrived.discard((i, a.step))
            return list(range(base, base + self.p)) if a.phase == SYNC else woken
        if a.kind in (FORWARD, EVAL):
            return woken + ([i + 1] if s + 1 < self.p else [])
        if a.kind in (BACKWARD, INPUT):
            return woken + ([i - 1] if s > 0 else [])
        return woken

    def _done(self, t: int):
        """When the walk of step ``t`` may leave stage ``i``: once it has updated; with chunks, once
        its device is at its cut of step ``t`` (its chunks' ``U(t)`` run, and in an async stream the
        actions up to the cut that the other devices need for theirs: see ``interleaved.stream_order``)."""
        if self.spec.chunks == 1:
            return lambda i: self.updated[i] >= t
        # (or, at the plan's end, once its own list has: the device's other chunks finish theirs)
        return lambda i: (self.replica_picks[i // self.p].at_cut(i % self.p % self.devices, t)
                          or self._flat_programs[i].peek() is None)

    def run_step(self, t: int) -> StepResult:
        """Run every stage (of every replica) up to and including its update of step ``t``. The
        step's loss is the mean over the replicas' shares of the batch."""
        for picks in self.replica_picks:
            picks.until = t
        walk(self._flat_programs, self.order, self._done(t), self._ready, self._execute, self.lifo)
        stats = [ex.take_stats(t) for ex in self.executors]
        lasts = [stats[-1]] + [exs[-1].take_stats(t) for exs in self.replica_executors[1:]]
        for exs in self.replica_executors[1:]:
            for ex in exs[:-1]:
                ex.take_stats(t)
        delays = [d for st in stats for d in st.delays]
        now = self.clock.update_end.pop(t)
        busy = sum(self.clock.busy)
        span = now - self.last_time
        bubble = 1.0 - (busy - self.last_busy) / (self.devices * span) if span > 0 else 0.0
        self.last_time, self.last_busy = now, busy
        last = stats[-1]
        replica_losses = [sum(st.losses) / max(1, len(st.losses)) for st in lasts]
        if self.eval_at(t):
            self._evals.append((t + 1, self.evaluate(self.val)))
        return StepResult(
            step=t,
            phase=self.plan.phases[t],
            loss=sum(replica_losses) / len(replica_losses),
            time_s=now,
            staleness_mean=sum(delays) / max(1, len(delays)),
            staleness_max=max(delays, default=0),
            bubble=max(0.0, bubble),
            grad_norm=global_norm([st.grad_sq for st in stats]),
            lr=last.lr,
            versions_max=max(ex.versions_held() for ex in self.executors),
            inflight_max=max(len(ex.inflight) for ex in self.executors),
            lr_stages=stage_lrs([st.lr_stage for st in stats]),
            param_sets_max=max(ex.param_sets() for ex in self.executors),
        )

    @torch.no_grad()
    def evaluate(self, batches, signal: bool = False) -> float:
        """Mean validation loss of the current weights (every stage holds the same version after
        ``run_step``). ``signal``: the heuristic's held-out signal, which is on the clock: with a
        profile the clock charged it after each update; with measured costs each stage's share is
        charged here, as measured (without chunks every stage is at its update, where ``run_step``
        stops it; with chunks a device stops at its cut of the step, so the share comes after the
        actions it ran past the update; the last stage's loss is not timed)."""
        total = 0.0
        charge = signal and self.profile is None
        for x, y in batches:
            h = x
            for s, ex in enumerate(self.executors):
                if charge:
                    synchronize(self.device)
                t0 = time.perf_counter()
                h = ex.eval_forward(ex.live, h)
                if charge:
                    synchronize(self.device)
                    self.clock.occupy(s, time.perf_counter() - t0)
            total += lm_loss(h.float(), y).item()
        return total / len(batches)

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The whole pipeline at the current step boundary: every stage's state, the messages in
        transit between stages, and the clock. Replicas r > 0 add what is their own (in-flight
        inputs, unfinished gradients, messages), not a second copy of the weights."""
        if self.dp.reductions or any(t.reductions for t in self.transports):
            raise RuntimeError("a collective is in progress: state can only be taken between steps")
        state = {
            "stages": [ex.state_dict() for ex in self.executors],
            "messages": {k: v.clone() for k, v in self.transport.box.items()},
            "clock": self.clock.state_dict(),
            "updated": self.updated[:self.p], "last_time": self.last_time, "last_busy": self.last_busy,
        }
        if self.R > 1:
            state["replicas"] = [self._replica_state(r, state["stages"]) for r in range(1, self.R)]
        return state

    def _replica_state(self, r: int, first: list[dict]) -> dict:
        stages = []
        for ex, st0 in zip(self.replica_executors[r], first):
            st = ex.state_dict()
            if not all(torch.equal(a, b) for a, b in zip(st["params"], st0["params"])):
                raise RuntimeError(f"replica {r} of stage {ex.s} has other weights than replica 0's")
            stages.append({k: v for k, v in st.items() if k not in SHARED_STATE})
        return {"stages": stages, "messages": {k: v.clone() for k, v in self.transports[r].box.items()},
                "updated": self.updated[r * self.p:(r + 1) * self.p]}

    def load_state_dict(self, state: dict) -> None:
        """Restore a state taken by :meth:`state_dict`; the plan must already hold the phases that
        were decided when it was taken (the programs are regenerated from it)."""
        others = state.get("replicas", [])
        if len(others) != self.R - 1:
            raise ValueError(f"a state of {len(others) + 1} replicas does not fit pipeline.replicas={self.R}")
        first = {"stages": state["stages"], "messages": state["messages"], "updated": state["updated"]}
        self.updated = []
        for r, rep in enumerate([first, *others]):
            self.replica_programs[r] = [StageProgram(s, self.spec, self.plan) for s in range(self.p)]
            for ex, prog, st, st0 in zip(self.replica_executors[r], self.replica_programs[r], rep["stages"], state["stages"]):
                shared = {k: st0[k] for k in SHARED_STATE}
                # (an optimizer keeps the tensors it loads: each replica needs its own)
                ex.load_state_dict({**(copy.deepcopy(shared) if r else shared), **st}, prog)
            t = self.transports[r]
            t.box = {tuple(k): v.to(self.device).clone() for k, v in rep["messages"].items()}
            t.reductions.clear()
            t.taken.clear()
            self.updated += list(rep["updated"])
        # every device at the position its chunks' programs were restored to
        self.replica_picks = [DevicePicks(self.spec, self.plan, progs) for progs in self.replica_programs]
        self.picks = self.replica_picks[0]
        self.dp.reductions.clear()
        self.dp.taken.clear()
        self.programs = self.replica_programs[0]
        self._flat_programs = [prog for progs in self.replica_programs for prog in progs]
        self.clock.load_state_dict(state["clock"])
        self.last_time, self.last_busy = state["last_time"], state["last_busy"]
        self.arrived = set()
        self._evals = []

    def write_checkpoint_parts(self, folder: Path, step: int) -> dict[str, dict]:
        """The whole pipeline is one part, ``pipeline``; refused for weights that are not finite."""
        state = self.state_dict()
        for stage in state["stages"]:
            if not checkpoint.finite(stage["params"]):
                shutil.rmtree(folder, ignore_errors=True)
                raise TrainingDiverged(checkpoint.refusal(step, stage["stage"]))
        return {"pipeline": checkpoint.write_part(folder, "pipeline", state)}

    def restore_checkpoint(self, folder: Path, manifest: dict, run: dict) -> None:
        self.load_state_dict(checkpoint.read_part(folder, manifest, "pipeline"))

    def action_times(self) -> None:
        return None  # the clock charges the actions' profiled (or measured) durations themselves

    def memory(self) -> list[dict]:
        """Per stage, the ledger's peaks: activations, weight versions, parameter and gradient
        sets, and bytes (when the profile knows the sizes)."""
        return [ex.ledger.report() for ex in self.executors]

    def modules(self):
        return [ex.module for ex in self.executors]
