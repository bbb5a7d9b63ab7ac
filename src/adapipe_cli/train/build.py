"""Turning a config into the pieces of a run: schedule spec and plan, heuristic, model stages,
optimizers, update policy and batches. Shared by the training loop and the workers of the
distributed runtime, so that every process builds the same thing."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from .. import checkpoint
from ..adaptive.base import Constant, Context, Heuristic, build_heuristic
from ..model import GPTConfig, build_stages, partition
from ..runtime.device import resolve_device
from ..runtime.profile import measure_profile
from ..schedules import ASYNC, SYNC, Plan, ScheduleSpec, lookahead
from ..schedules.program import SYNC_SCHEDULES
from ..schedules.mitigations import UpdatePolicy
from ..optim import StageOptimizer


@dataclass
class ScheduleChoice:
    spec: ScheduleSpec
    phase: str | None  # the one phase of a plain schedule; None for adapipe


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
    return ScheduleChoice(ScheduleSpec(p, m, s.sync, weights, barrier=update_barrier(cfg, s.sync), chunks=v), None)


def virtual_stages(cfg) -> int:
    """Model chunks of the run: ``pipeline.stages``, times ``schedule.chunks`` when interleaved."""
    return cfg.pipeline.stages * (cfg.schedule.chunks if cfg.schedule.name == "interleaved" else 1)


def update_barrier(cfg, sync: str) -> bool:
    """Whether a sync update waits for every stage: always, except ZB-H2's when there is no global
    norm to clip by and no tied embedding to sum (the zero-bubble paper drops the optimizer's
    synchronization; an exact update that clips needs it)."""
    tied = cfg.model.tie_embeddings and cfg.pipeline.stages > 1
    return sync != "zbh2" or cfg.optim.grad_clip > 0 or tied


def model_config(cfg, vocab_size: int) -> GPTConfig:
    m = cfg.model
    return GPTConfig(vocab_size=m.vocab_size or vocab_size, block_size=m.block_size, n_layer=m.n_layer,
                     n_head=m.n_head, d_model=m.d_model, d_ff=m.d_ff, dropout=m.dropout, bias=m.bias,
                     tie_embeddings=m.tie_embeddings, init_std=m.init_std)


def stage_bounds(cfg, gcfg: GPTConfig) -> list[tuple[int, int]]:
    return partition(gcfg, virtual_stages(cfg), cfg.pipeline.partition)


def make_stages(cfg, gcfg: GPTConfig, which: list[int] | None = None, device: torch.device | None = None):
    """The stage modules (all, or only those in ``which``), on ``device`` (None: the CPU), and
    their optimizers (made after the move, so that their state is born on the device)."""
    bounds = stage_bounds(cfg, gcfg)
    stages = build_stages(gcfg, bounds, cfg.seed)
    if which is not None:
        stages = [stages[i] for i in which]
    if device is not None and device.type != "cpu":
        stages = [st.to(device) for st in stages]
    return stages, [StageOptimizer(list(st.named_parameters()), cfg.optim) for st in stages]


def make_heuristic(cfg, choice: ScheduleChoice, ctx: Context) -> Heuristic:
    if choice.phase is not None:
        return Constant(choice.phase, ctx)
    return build_heuristic(cfg.heuristic, ctx)


def make_policy(cfg, plan: Plan) -> UpdatePolicy:
    return UpdatePolicy(cfg.optim, cfg.schedule, plan, cfg.train.max_steps)


def profile_meta(cfg, microbatch_size: int) -> dict:
    """What a cost profile is measured for: a profile fits a run only if every entry but ``threads``
    matches (:func:`profile_mismatch`)."""
    m = cfg.model
    return {"model": m.name, "stages": virtual_stages(cfg), "microbatch_size": int(microbatch_size),
            "seq_len": m.block_size, "optimizer": cfg.optim.name,
            "model_shape": {"n_layer": m.n_layer, "n_head": m.n_head, "d_model": m.d_model, "d_ff": m.d_ff},
            "partition": cfg.pipeline.partition, "threads": torch.get_num_threads(),
            "precision": cfg.train.precision, "device": str(resolve_device(cfg.pipeline.device))}


# the entries of a profile's meta that decide whether it fits a run (threads and the device only
# change its speed, and a checkpoint may resume on another device with its own run's clock)
FITTING = ("model", "model_shape", "stages", "microbatch_size", "seq_len", "optimizer", "partition", "precision")


def profile_mismatch(meta: dict, expected: dict) -> str | None:
    """The first entry of :data:`FITTING` in which a profile's ``meta`` differs from the run's
    ``expected`` one, as ``"model: gpt-nano in the profile, gpt-micro in this run"``; None if it
    fits. Entries an older profile lacks are not compared."""
    for key in FITTING:
        have, want = meta.get(key), expected.get(key)
        if key == "model_shape" and isinstance(have, dict):
            bad = [k for k in want if k in have and have[k] != want[k]]
            if bad:
                k = bad[0]
                return f"model.{k}: {have[k]} in the profile, {want[k]} in this run"
        elif have is not None and have != want:
            return f"{key}: {have} in the profile, {want} in this run"
    return None


def measure_stage_profile(cfg, stages, x: torch.Tensor, y: torch.Tensor, **kw):
    """The cost profile of ``stages`` on the microbatch (x, y), labelled with what it was measured
    for (a run measures its own; a sweep measures one per depth and gives it to every run; a dist
    worker its own stage's). ``kw``: :func:`measure_profile`'s ``warn``."""
    return measure_profile(stages, lambda named: StageOptimizer(named, cfg.optim), x, y,
                           reps=cfg.pipeline.profile_reps, meta=profile_meta(cfg, int(x.shape[0])),
                           precision=cfg.train.precision, **kw)


class Batches:
    """``batch(step, i)``: microbatch ``i`` of step ``step``, rows ``i*b/m .. (i+1)*b/m`` of the
    step's batch, on ``device`` (None: where the data makes them). Recent steps' batches are
    cached (the first stage reads inputs, the last targets, each once per microbatch)."""

    def __init__(self, data, batch_size: int, microbatches: int, keep: int = 8, device: torch.device | None = None):
        self.data, self.b, self.m = data, batch_size, microbatches
        self.device = None if device is None or device.type == "cpu" else device
        self.mb = batch_size // microbatches
        self.keep = keep
        self.cache: OrderedDict[int, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()

    def __call__(self, step: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        xy = self.cache.get(step)
        if xy is None:
            xy = self.data.train_batch(step, self.b)
            if self.device is not None:
                xy = tuple(z.to(self.device) for z in xy)
            self.cache[step] = xy
            if len(self.cache) > self.keep:
                self.cache.popitem(last=False)
        x, y = xy
        return x[i * self.mb:(i + 1) * self.mb], y[i * self.mb:(i + 1) * self.mb]


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
    return lookahead(cfg.pipeline.stages, cfg.pipeline.microbatches) + 2
