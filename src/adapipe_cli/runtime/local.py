"""The local runtime: every stage in one process, an exact emulation of a p-device pipeline.

Each stage is a :class:`StageExecutor` with its own parameters, optimizer, stashed versions and
activations; stages talk only through a :class:`LocalTransport`. :meth:`LocalRuntime.run_step`
runs every stage exactly up to its update of step ``t`` (in any dependency-respecting order), so
that afterwards every stage holds version ``t + 1`` and the model can be evaluated as is. The
pipeline clock times each action from its cost (profiled or measured).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch

from ..model import lm_loss
from ..schedules import BACKWARD, EVAL, FORWARD, INPUT, SYNC, UPDATE, Action, Plan, ScheduleSpec, StageProgram
from ..schedules.interleaved import DevicePicks
from ..simulator.clock import CostProfile, LinkModel, PipelineClock
from .. import checkpoint
from .base import StepResult, global_norm, stage_lrs
from .device import synchronize
from .errors import TrainingDiverged
from .stage import StageExecutor
from .transport import LocalTransport
from .walk import walk


class LocalRuntime:
    """Every stage in this process (:class:`.base.Runtime`)."""

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
    ):
        # p: stages (virtual stages with interleaving), each its own executor; devices: what the clock times
        self.p, self.m, self.devices = spec.virtual_stages, spec.microbatches, spec.stages
        self.plan, self.spec = plan, spec
        self.picks = DevicePicks(spec)
        self.transport = LocalTransport()
        self.programs = [StageProgram(s, spec, plan) for s in range(self.p)]
        self.executors = [
            StageExecutor(s, self.p, self.m, stages[s], optimizers[s], self.transport, batch, policy,
                          self.programs[s], grad_clip=grad_clip, seed=seed, tied=tied,
                          nbytes=profile.stage_bytes(s) if profile else None, precision=precision)
            for s in range(self.p)
        ]
        self.profile = profile  # None: each action's measured duration is its cost
        self.device = device or torch.device("cpu")  # every stage's; tensors pass between stages as they are
        self.clock = PipelineClock(self.devices, link, profile.act_bytes if profile else 0.0, spec.barrier,
                                   stage_device=[spec.device_of(s) for s in range(self.p)])
        self.updated = [-1] * self.p  # last step each stage has updated
        self.arrived: set[tuple[int, int]] = set()
        self.order = list(range(self.p)) if order == "forward" else list(reversed(range(self.p)))
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
    def _ready(self, s: int, a: Action) -> bool:
        if not self.picks.next_is(s):
            return False
        if a.kind == UPDATE and a.phase == SYNC and (s, a.step) not in self.arrived:
            self.arrived.add((s, a.step))
            self.clock.arrive(s, a.step)
            for c in self.picks.updates_after(s):  # the device's other chunks post their shares too
                self.executors[c].ready(a)
        return self.executors[s].ready(a)

    def _execute(self, s: int, a: Action) -> list[int]:
        measured = self.profile is None
        if measured:
            synchronize(self.device)  # (CUDA runs kernels asynchronously: time the action's own)
        t0 = time.perf_counter()
        work = self.executors[s].run(a)
        if measured:
            synchronize(self.device)
        cost = time.perf_counter() - t0 if measured else self.profile.cost(s, a.kind, work)
        self.clock.run(s, a, cost)
        woken = self.picks.advance(s)  # the device's next virtual stage (none without interleaving)
        if a.kind == UPDATE:
            self.updated[s] = a.step
            self.arrived.discard((s, a.step))
            return list(range(self.p)) if a.phase == SYNC else woken
        if a.kind in (FORWARD, EVAL):
            return woken + ([s + 1] if s + 1 < self.p else [])
        if a.kind in (BACKWARD, INPUT):
            return woken + ([s - 1] if s > 0 else [])
        return woken

    def run_step(self, t: int) -> StepResult:
        """Run every stage up to and including its update of step ``t``."""
        walk(self.programs, self.order, lambda s: self.updated[s] >= t, self._ready, self._execute, self.lifo)
        stats = [ex.take_stats(t) for ex in self.executors]
        delays = [d for st in stats for d in st.delays]
        now = self.clock.update_end.pop(t)
        busy = sum(self.clock.busy)
        span = now - self.last_time
        bubble = 1.0 - (busy - self.last_busy) / (self.devices * span) if span > 0 else 0.0
        self.last_time, self.last_busy = now, busy
        last = stats[-1]
        if self.eval_at(t):
            self._evals.append((t + 1, self.evaluate(self.val)))
        return StepResult(
            step=t,
            phase=self.plan.phases[t],
            loss=sum(last.losses) / max(1, len(last.losses)),
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
    def evaluate(self, batches) -> float:
        """Mean validation loss of the current weights (every stage holds the same version after
        ``run_step``)."""
        total = 0.0
        for x, y in batches:
            h = x
            for ex in self.executors:
                h = ex.eval_forward(ex.live, h)
            total += lm_loss(h.float(), y).item()
        return total / len(batches)

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The whole pipeline at the current step boundary: every stage's state, the messages in
        transit between stages, and the clock."""
        if self.transport.reductions:
            raise RuntimeError("a collective is in progress: state can only be taken between steps")
        return {
            "stages": [ex.state_dict() for ex in self.executors],
            "messages": {k: v.clone() for k, v in self.transport.box.items()},
            "clock": self.clock.state_dict(),
            "updated": list(self.updated), "last_time": self.last_time, "last_busy": self.last_busy,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a state taken by :meth:`state_dict`; the plan must already hold the phases that
        were decided when it was taken (the programs are regenerated from it)."""
        self.programs = [StageProgram(s, self.spec, self.plan) for s in range(self.p)]
        self.picks = DevicePicks(self.spec)  # (a step boundary: every device at the start of its order)
        for ex, prog, st in zip(self.executors, self.programs, state["stages"]):
            ex.load_state_dict(st, prog)
        self.transport.box = {tuple(k): v.to(self.device).clone() for k, v in state["messages"].items()}
        self.transport.reductions.clear()
        self.transport.taken.clear()
        self.clock.load_state_dict(state["clock"])
        self.updated = list(state["updated"])
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

    def memory(self) -> list[dict]:
        """Per stage, the ledger's peaks: activations, weight versions, parameter and gradient
        sets, and bytes (when the profile knows the sizes)."""
        return [ex.ledger.report() for ex in self.executors]

    def modules(self):
        return [ex.module for ex in self.executors]
