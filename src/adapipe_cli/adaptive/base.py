"""The interface every switching heuristic implements.

After each step the training loop calls ``observe`` with what the step measured, then ``decide``
for a later step (the pipeline needs each phase ``lookahead(p, m) + 1`` steps in advance, so the
decision for step ``u`` sees observations up to step ``u - lookahead - 1``). A heuristic is a
single file ``adaptive/NAME.py`` defining a subclass with ``name = "NAME"``, selected with
``heuristic=NAME`` (plus ``conf/heuristic/NAME.yaml``; its own keys go under
``heuristic.options``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ..schedules import ASYNC, SYNC


@dataclass
class Observation:
    step: int
    phase: str
    loss: float
    time_s: float  # the run's clock at the end of the step
    step_time: float  # time_s minus the previous step's time_s
    staleness: float  # mean gradient delay of the step, in steps


@dataclass
class Context:
    """What a heuristic may know about the run before it starts."""

    stages: int
    microbatches: int
    max_steps: int
    lookahead: int
    # predicted steady-state step times of the two phases (simulator, same cost profile)
    sync_step_time: float = 0.0
    async_step_time: float = 0.0
    switch_time: float = 0.0  # predicted drain + fill time of one switch
    lr_warmup: int = 0  # steps of the learning-rate warm-up (its steep start is no time to compare phases)
    extra: dict = field(default_factory=dict)


class Decision(NamedTuple):
    phase: str
    reason: str = ""
    info: dict = {}
    # a tentative probe (``heuristic.undo_probes``): the loop keeps the run's state from before
    # this step, so that the probe can be undone
    tentative: bool = False
    # undo the tentative probe that began at this step: the run goes back to its state before the
    # probe (the probe's time stays on the clock), the heuristic keeping what it learnt from it
    undo: int | None = None


class Heuristic:
    name = "base"
    # a tentative probe (Decision.tentative) is in progress and not yet settled: the training loop
    # keeps the state from before it while this is true (a heuristic that makes tentative probes
    # keeps it up to date)
    tentative = False

    def __init__(self, cfg: Any, ctx: Context):
        self.cfg, self.ctx = cfg, ctx

    def observe(self, obs: Observation) -> None:
        """Record one step's measurements."""

    def rewind(self, step: int) -> None:
        """The run went back to its state after step ``step`` (an undone probe): forget the
        observations of later steps, which will be made again."""

    def decide(self, step: int) -> Decision:
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class Constant(Heuristic):
    """One phase throughout: the plain sync and async schedules."""

    name = "constant"

    def __init__(self, phase: str, ctx: Context):
        super().__init__(None, ctx)
        self.phase = phase

    def decide(self, step: int) -> Decision:
        return Decision(self.phase)


def build_heuristic(cfg: Any, ctx: Context) -> Heuristic:
    """The heuristic class named ``cfg.name``, from ``adaptive/<name>.py``."""
    try:
        module = importlib.import_module(f"{__package__}.{cfg.name}")
    except ModuleNotFoundError as e:
        raise ValueError(f"unknown heuristic {cfg.name!r}: no adaptive/{cfg.name}.py") from e
    for obj in vars(module).values():
        if isinstance(obj, type) and issubclass(obj, Heuristic) and getattr(obj, "name", None) == cfg.name:
            return obj(cfg, ctx)
    raise ValueError(f"unknown heuristic {cfg.name!r}: adaptive/{cfg.name}.py defines no Heuristic named {cfg.name!r}")


__all__ = ["ASYNC", "SYNC", "Context", "Constant", "Decision", "Heuristic", "Observation", "build_heuristic"]
