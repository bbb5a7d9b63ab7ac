"""The schedule a config chooses: its spec, its one phase (or None for adapipe, which switches),
the model chunks it places and the update policy of its optimizer steps. Shared by the training
loop and the workers of the distributed runtime, so that every process builds the same thing."""

from __future__ import annotations

from dataclasses import dataclass

from .actions import ASYNC, SYNC, Plan
from .mitigations import UpdatePolicy
from .program import SYNC_SCHEDULES, ScheduleSpec


# ``schedule.sync=auto`` (adapipe): the faster of these on the run's cost profile. They compute the
# same gradients and updates (ZB-H1 splits 1F1B's backward into its input and weight parts and
# moves the weight part into the bubble), so the pick changes the clock, never the numbers.
AUTO_SYNC = ("1f1b", "zbh1")


@dataclass
class ScheduleChoice:
    spec: ScheduleSpec
    phase: str | None  # the one phase of a plain schedule; None for adapipe
    # schedule.sync=auto: the spec's sync is ZB-H1 until :func:`..train.build.pick_sync` has the profile
    auto: bool = False


def schedule_choice(cfg) -> ScheduleChoice:
    s, p, m = cfg.schedule, cfg.pipeline.stages, cfg.pipeline.microbatches
    name = s.name
    v = s.chunks  # (ScheduleSpec.check refuses chunks > 1 but with interleaved)
    if name in SYNC_SCHEDULES:
        return ScheduleChoice(ScheduleSpec(p, m, name, "stash", barrier=update_barrier(cfg, name), chunks=v), SYNC)
    if name == "pipedream":
        return ScheduleChoice(ScheduleSpec(p, m, "1f1b", s.weights, chunks=v), ASYNC)
    if name == "2bw":
        return ScheduleChoice(ScheduleSpec(p, m, "1f1b", "2bw", chunks=v), ASYNC)
    weights = "2bw" if s["async"] == "2bw" else s.weights
    auto = s.sync == "auto"
    sync = "zbh1" if auto else s.sync
    return ScheduleChoice(ScheduleSpec(p, m, sync, weights, barrier=update_barrier(cfg, sync), chunks=v), None, auto)


def chunks(cfg) -> int:
    """Model chunks per device: ``schedule.chunks`` when interleaved (``schedule=interleaved``, or
    adapipe with ``schedule.sync=interleaved``, whose placement holds in both phases), else 1."""
    s = cfg.schedule
    interleaved = s.name == "interleaved" or (s.name == "adapipe" and s.sync == "interleaved")
    return s.chunks if interleaved else 1


def virtual_stages(cfg) -> int:
    """Model chunks of the run: ``pipeline.stages``, times ``schedule.chunks`` when interleaved."""
    return cfg.pipeline.stages * chunks(cfg)


def microbatch_size(cfg) -> int:
    """Sequences in one microbatch of one replica: ``train.batch_size / (microbatches x replicas)``."""
    return cfg.train.batch_size // (cfg.pipeline.microbatches * cfg.pipeline.get("replicas", 1))


def signal_rows(cfg) -> int:
    """Sequences in AdaPipe's held-out signal: ``heuristic.signal_tokens`` over the sequence length,
    at least one."""
    return max(1, cfg.heuristic.signal_tokens // cfg.model.block_size)


def follows_held_out(cfg) -> bool:
    """Whether a run evaluates AdaPipe's held-out signal after every update (its forward on the
    clock): a switching schedule whose heuristic follows ``heuristic.signal=heldout``; the fixed
    schedules and the training-loss signal evaluate nothing."""
    return schedule_choice(cfg).phase is None and cfg.heuristic.signal == "heldout"


def update_barrier(cfg, sync: str) -> bool:
    """Whether a sync update waits for every stage: always, except ZB-H2's when there is no global
    norm to clip by and no tied embedding to sum (the zero-bubble paper drops the optimizer's
    synchronization; an exact update that clips needs it)."""
    tied = cfg.model.tie_embeddings and cfg.pipeline.stages > 1
    return sync != "zbh2" or cfg.optim.grad_clip > 0 or tied


def make_policy(cfg, plan: Plan) -> UpdatePolicy:
    return UpdatePolicy(cfg.optim, cfg.schedule, plan, cfg.train.max_steps)
