"""The pieces of a run that only the training loop builds from a config: the heuristic, the clock
and the decision lag. (What the workers build too lives below: the schedule in
``schedules/choice.py``, the stages in ``model/build.py``, the batches in ``data/batches.py``, the
profile's label in ``runtime/profile_meta.py``.)"""

from __future__ import annotations

from dataclasses import replace

from .. import checkpoint
from ..adaptive.base import Constant, Context, Heuristic, build_heuristic
from ..schedules import lookahead
from ..schedules.choice import AUTO_SYNC, ScheduleChoice, chunks
from ..simulator.simulate import steady_step_times


def make_heuristic(cfg, choice: ScheduleChoice, ctx: Context) -> Heuristic:
    if choice.phase is not None:
        return Constant(choice.phase, ctx)
    return build_heuristic(cfg.heuristic, ctx)


def heuristic_context(cfg, sync_t: float, async_t: float, switch_t: float) -> Context:
    """What a run's heuristic knows before it starts: the pipeline's shape, the budget, the
    decision lag and the predicted steady step times of the two phases and of a switch."""
    p, t = cfg.pipeline, cfg.train
    return Context(p.stages, p.microbatches, t.max_steps, decision_lag(cfg) - 1, sync_t, async_t, switch_t,
                   lr_warmup=cfg.optim.warmup_steps,
                   extra={"optimizer": cfg.optim.name, "open_ended": bool(t.stop_at_target and t.target_ppl)})


def pick_sync(choice: ScheduleChoice, profile, link, mitigations, allreduce=None) -> ScheduleChoice:
    """``schedule.sync=auto``: ``choice`` with the sync schedule of :data:`AUTO_SYNC` whose steady
    step the simulator predicts fastest on ``profile`` (1F1B on a tie: no split backward); any other
    choice as it is. On a CPU where the split backward's input and weight parts cost more than
    the whole backward, ZB-H1's smaller bubble can lose to 1F1B; only the profile tells. (The
    all-reduce of replicas is timed from the profile's parameter bytes.)"""
    if not choice.auto:
        return choice
    step = {name: steady_step_times(replace(choice.spec, sync=name), profile, link, list(mitigations), allreduce)[0]
            for name in AUTO_SYNC}
    best = min(AUTO_SYNC, key=lambda name: step[name])  # (min keeps the first of equals: 1f1b)
    return replace(choice, spec=replace(choice.spec, sync=best))


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
