"""The pieces of a run that only the training loop builds from a config: the heuristic, the clock
and the decision lag. (What the workers build too lives below: the schedule in
``schedules/choice.py``, the stages in ``model/build.py``, the batches in ``data/batches.py``, the
profile's label in ``runtime/profile_meta.py``.)"""

from __future__ import annotations

from .. import checkpoint
from ..adaptive.base import Constant, Context, Heuristic, build_heuristic
from ..schedules import lookahead
from ..schedules.choice import ScheduleChoice, chunks


def make_heuristic(cfg, choice: ScheduleChoice, ctx: Context) -> Heuristic:
    if choice.phase is not None:
        return Constant(choice.phase, ctx)
    return build_heuristic(cfg.heuristic, ctx)


def clock_mode(cfg, runtime: str) -> str:
    """The clock of a run on ``runtime`` (``local`` or ``dist``): ``profiled`` (pipeline time from the
    cost profile, on both), ``measured`` (local: each action timed as it runs) or ``wall`` (dist: the
    workers' wall time); ``auto`` is the runtime's own (:data:`..checkpoint.DEFAULT_CLOCK`)."""
    from ..config.validate import ConfigError

    clock = checkpoint.clock_of(cfg.pipeline.clock, runtime)
    if runtime == "local" and clock == "wall":
        raise ConfigError("pipeline.clock=wall is the dist runtime's (one process per stage): use profiled or measured "
                          "on the local runtime")
    if runtime == "dist" and clock == "measured":
        raise ConfigError("pipeline.clock=measured is the local runtime's: use wall (the workers' wall time) or profiled "
                          "on the dist runtime")
    return clock


def decision_lag(cfg) -> int:
    """The phase of step ``u`` is decided after step ``u - lag`` has been observed. The pipeline
    needs phases ``lookahead`` steps ahead; one more step of slack lets a distributed runtime
    deliver each decision before the first stage needs it, without a stall."""
    return lookahead(cfg.pipeline.stages, cfg.pipeline.microbatches, chunks(cfg)) + 2
