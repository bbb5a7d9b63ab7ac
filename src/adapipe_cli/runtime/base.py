"""The runtime interface the training loop drives, and the plain data a runtime is built from.

Both :class:`.local.LocalRuntime` (every stage in this process) and :class:`.dist.DistRuntime`
(a worker process per stage) implement :class:`Runtime`. A step ``t`` is driven as
``decide`` (phases ``lag`` steps ahead), ``run_step(t)`` (every stage up to and including
``U(t)``), then ``evaluations()`` (the validation losses due by then). The loop never asks a
runtime what it is: what differs between runtimes is declared here (``snapshots``, ``heldout``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol, runtime_checkable

from ..schedules import Plan, ScheduleSpec
from ..simulator.clock import CostProfile, LinkModel


@dataclass
class StepResult:
    """What a runtime reports of step ``step`` once every stage has applied ``U(step)``."""

    step: int
    phase: str
    loss: float
    time_s: float  # the runtime's clock when the step's last update ended
    staleness_mean: float
    staleness_max: int
    bubble: float
    grad_norm: float  # global norm of the step's gradient before clipping (every stage's share)
    lr: float  # the schedule's learning rate of the step
    versions_max: int
    inflight_max: int
    lr_stages: list[float] | None = None  # each stage's own, where they differ (PipeMare rescheduling)
    param_sets_max: int = 1  # parameter sets (live, copies, predictions) the fullest stage holds


def global_norm(shares: list[float]) -> float:
    """``sqrt(sum of the stages' squared shares)``: the norm of the whole step's gradient."""
    return math.sqrt(sum(shares))


def stage_lrs(lrs: list[float]) -> list[float] | None:
    """The stages' own learning rates, or None when they are all the same."""
    return None if len(set(lrs)) <= 1 else list(lrs)


@dataclass
class RunSpec:
    """What a runtime needs to know of a run, as data: its resolved config, the plan it reads its
    phases from (the loop decides, the runtime applies), when to evaluate, where the run lives,
    the checkpoint it resumes from (folder, verified manifest) or None, and the clock's pieces."""

    cfg: object  # the run's (resolved) DictConfig
    plan: Plan
    eval_at: Callable[[int], bool]  # evaluate the weights after step t (t = -1: the initial weights)
    run_dir: Path
    resume: tuple[Path, dict] | None = None
    schedule: ScheduleSpec | None = None
    link: LinkModel | None = None
    profile: CostProfile | None = None  # given (pipeline.profile, a resumed run's); None: measured where the stages run
    clock: str = "wall"  # "wall" or "profiled" (the pipeline clock from the profile)
    signal_rows: int | None = None  # rows of the held-out batch evaluated after each update (None: no signal)
    snapshots_kept: int = 0  # the divergence guard's snapshots kept at once (0: the guard is off)


@runtime_checkable
class Runtime(Protocol):
    name: str  # "local" or "dist"
    backend: str | None  # the process group's backend (None in one process)
    clock_name: str  # "pipeline" (the simulator's time of a p-device pipeline) or "wall"
    snapshots: bool  # whether state_dict/load_state_dict work between steps (the divergence guard's rollback)
    heldout: bool  # whether evaluate(batches) gives the heuristic a held-out loss after each step
    link: dict | None  # the link between stages measured at start-up (latency_s, bandwidth), or None

    def decide(self, step: int, phase: str) -> None:
        """Record the phase of ``step`` (the loop decides ``lag`` steps ahead)."""

    def run_step(self, t: int) -> StepResult:
        """Train every stage up to and including its update of step ``t``."""

    def evaluations(self) -> list[tuple[int, float]]:
        """(version, mean validation loss) of the evaluations due so far that were not returned yet."""

    def evaluate_now(self, version: int) -> None:
        """Evaluate the current weights (``version``) outside the schedule: the run ends here."""

    def evaluate(self, batches, signal: bool = False) -> float:
        """Mean loss of the current weights on ``batches`` (where ``heldout``; the dist runtime's
        workers evaluate the spec's held-out batch, which ``batches`` must be). ``signal``: it is
        the heuristic's held-out signal, whose forward is on the clock."""

    def state_dict(self) -> dict:
        """The whole pipeline at the current step boundary (where ``snapshots``)."""

    def load_state_dict(self, state: dict) -> None:
        """Go back to a state of :meth:`state_dict` (where ``snapshots``)."""

    def write_checkpoint_parts(self, folder: Path, step: int) -> dict[str, dict]:
        """Write the pipeline's parts of the checkpoint after ``step`` steps into ``folder``; their
        manifest entries by part name. Raises :class:`.errors.TrainingDiverged` (and removes
        ``folder``) for weights that are not finite."""

    def restore_checkpoint(self, folder: Path, manifest: dict, run: dict) -> None:
        """Continue from the checkpoint in ``folder`` once the loop has restored its own state
        (``run``: its RunState, whose clock the runtime's continues)."""

    def memory(self) -> list[dict]:
        """Peak memory of each stage: activations and weight versions held (and RSS, device MB)."""

    def action_times(self) -> dict | None:
        """Per stage and action kind, the seconds the run's actions took against what its cost
        profile charges (the dist runtime's, after close; None where the clock is the profile's own)."""

    def close(self) -> None:
        """End the run and release its stages (workers); safe to call twice."""


__all__ = ["Runtime", "RunSpec", "StepResult", "global_norm", "stage_lrs"]
