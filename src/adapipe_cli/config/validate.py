"""Checks of a composed config that the schema's types cannot express. Each failure is one line
that says what to change."""

from __future__ import annotations

import math

import os

from omegaconf import OmegaConf

from ..adaptive.fixed import parse_plan
from ..schedules.program import SYNC_SCHEDULES, WEIGHT_RULES

# The checks that need torch (the device, the optimizer's first step, the mitigations) import it
# where they run: a value refused before them, and ``adapipe --help``, cost a second, not torch's
# import (3-5 s on 2 cores).

SCHEDULES = ("1f1b", "gpipe", "zbh1", "zbh2", "interleaved", "pipedream", "2bw", "adapipe")
# AdaPipe's sync phase (interleaved: its placement in both phases; auto: 1F1B or ZB-H1, whichever the
# run's profile makes faster, schedules/choice.py)
ADAPIPE_SYNC = (*SYNC_SCHEDULES, "auto")
ASYNC_SCHEDULES = ("pipedream", "2bw")
RUNTIMES = ("local", "dist", "auto")
BACKENDS = ("auto", "gloo", "nccl")
CLOCKS = ("auto", "profiled", "measured", "wall")
PARTITIONS = ("flops", "params", "uniform")
SIGNALS = ("train", "heldout")  # heuristic.signal


class ConfigError(ValueError):
    """A user mistake in the configuration; the message is one line saying what to change."""


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def validate(cfg) -> None:
    """Raise :class:`ConfigError` for the first problem found in ``cfg``."""
    m, p, t, o, d = cfg.model, cfg.pipeline, cfg.train, cfg.optim, cfg.data
    _need(m.n_layer >= 1 and m.d_model >= 1 and m.n_head >= 1, "model.n_layer, model.d_model and model.n_head must be positive")
    _need(m.d_model % m.n_head == 0, f"model.d_model ({m.d_model}) must be divisible by model.n_head ({m.n_head})")
    _need(m.block_size >= 2, "model.block_size must be at least 2")
    _need(p.stages >= 1, f"pipeline.stages must be at least 1 (got {p.stages})")
    _need(p.stages <= m.n_layer,
          f"pipeline.stages={p.stages} is more than the {m.n_layer} blocks of model {m.name}: "
          f"use at most {m.n_layer} stages or a deeper model")
    _need(p.microbatches >= 1, f"pipeline.microbatches must be at least 1 (got {p.microbatches})")
    _need(t.batch_size >= 1, f"train.batch_size must be positive (got {t.batch_size})")
    _need(t.batch_size % p.microbatches == 0,
          f"train.batch_size={t.batch_size} is not divisible by pipeline.microbatches={p.microbatches}: "
          f"choose a batch size that is a multiple of the microbatch count")
    _need(p.replicas >= 1, f"pipeline.replicas must be at least 1 (got {p.replicas})")
    _need(t.batch_size % (p.replicas * p.microbatches) == 0,
          f"train.batch_size={t.batch_size} is not divisible by pipeline.replicas x pipeline.microbatches="
          f"{p.replicas} x {p.microbatches}: choose a batch size that is a multiple of {p.replicas * p.microbatches}")
    _need(p.dp_bandwidth >= 0 and p.dp_latency_s >= 0, "pipeline.dp_bandwidth and pipeline.dp_latency_s must be >= 0")
    _need(t.max_steps >= 1, f"train.max_steps must be positive (got {t.max_steps})")
    _need(t.max_time_s >= 0, f"train.max_time_s must be >= 0 (got {t.max_time_s}; 0 means no limit)")
    _need(t.eval_every >= 1, f"train.eval_every must be positive (got {t.eval_every})")
    _need(t.target_ppl is None or t.target_ppl > 1, f"train.target_ppl must be greater than 1 (got {t.target_ppl})")
    _need(not t.stop_at_target or t.target_ppl is not None, "train.stop_at_target=true needs a train.target_ppl")
    _need(t.checkpoint_every >= 0, "train.checkpoint_every must be >= 0 (0: no periodic checkpoints)")
    _need(o.lr > 0, f"optim.lr must be positive (got {o.lr})")
    _need(o.name != "muon" or o.muon_lr > 0, f"optim.muon_lr must be positive (got {o.muon_lr})")
    _need(o.muon_ns_dtype in ("auto", "float32", "bfloat16"),
          f"unknown optim.muon_ns_dtype={o.muon_ns_dtype!r}: use auto, float32 or bfloat16")
    _need(o.warmup_steps >= 0, "optim.warmup_steps must be >= 0")
    _need(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio must be in [0, 1]")
    _need(o.grad_clip >= 0, "optim.grad_clip must be >= 0 (0 disables clipping)")
    _need(o.name in ("adamw", "nadamw", "muon"), f"unknown optimizer optim.name={o.name!r}: use adamw, nadamw or muon")
    _need(p.runtime in RUNTIMES, f"unknown pipeline.runtime={p.runtime!r}: use local, dist or auto")
    _need(p.backend in BACKENDS, f"unknown pipeline.backend={p.backend!r}: use auto, gloo or nccl")
    _need(p.clock in CLOCKS, f"unknown pipeline.clock={p.clock!r}: use auto, profiled, measured or wall")
    _need(p.partition in PARTITIONS, f"unknown pipeline.partition={p.partition!r}: use flops, params or uniform")
    _need(p.order in ("forward", "reverse"), f"unknown pipeline.order={p.order!r}: use forward or reverse")
    _need(p.profile is None or os.path.isfile(p.profile), f"pipeline.profile={p.profile} does not exist: give a saved profile.json")
    _need(d.eval_tokens >= 1, "data.eval_tokens must be positive")
    from ..runtime.device import PRECISIONS, DeviceError, resolve_device

    _need(t.precision in PRECISIONS, f"unknown train.precision={t.precision!r}: use fp32 or bf16")
    try:
        resolve_device(p.device)
    except DeviceError as e:
        raise ConfigError(str(e)) from None
    _check_schedule(cfg)
    _check_step_size(cfg)


def _check_step_size(cfg) -> None:
    """The optimizer's arguments in range, and a first update that stays finite and keeps the
    weights' sign: a learning rate whose first step overflows float32 (e.g. optim.lr=1e39), or
    lr x weight_decay >= 1 (and muon_lr x weight_decay with Muon), is refused here in one line rather
    than inside the first step."""
    from ..optim import overflowing_lr

    o = cfg.optim
    for key in ("beta1", "beta2"):
        _need(0 <= o[key] < 1, f"optim.{key}={o[key]:g}: give a value in [0, 1)")
    _need(o.eps >= 0, f"optim.eps={o.eps:g}: give a value >= 0")
    _need(o.muon_momentum >= 0, f"optim.muon_momentum={o.muon_momentum:g}: give a value >= 0")
    _need(o.weight_decay >= 0, f"optim.weight_decay={o.weight_decay:g}: give a value >= 0")
    s = cfg.schedule
    scale = max(1.0, s.async_lr_scale * max(1.0, s.transition_lr_scale))  # the largest multiple of the rate a step uses
    times = f" (times {scale:g}: schedule.async_lr_scale x schedule.transition_lr_scale)" if scale > 1 else ""

    def finite_first_step(optim) -> None:
        key = overflowing_lr(optim, scale)
        if key is not None:
            raise ConfigError(f"{key}={cfg.optim[key.split('.')[1]]:g} is too large: the optimizer's first step{times} "
                              f"overflows float32; lower {key}")

    # the rates alone first (no weight decay), so that a huge decay is not blamed on the rate
    finite_first_step(OmegaConf.merge(o, {"weight_decay": 0.0}))
    decays = [("optim.lr", o.lr, "weights")]
    if o.name == "muon":  # Muon decays the hidden matrices at its own rate
        decays.append(("optim.muon_lr", o.muon_lr, "hidden matrices"))
    for key, lr, what in decays:
        _need(lr * scale * o.weight_decay < 1,
              f"{key} x optim.weight_decay = {lr:g} x {o.weight_decay:g}{times} >= 1: each step would multiply the "
              f"{what} by 1 - lr x weight_decay <= 0; lower {key} or optim.weight_decay")
    finite_first_step(o)


def _check_chunks(cfg) -> None:
    """Interleaved 1F1B: p * v chunks of at least one block each, m a multiple of p, two workers or
    more on the dist runtime; as AdaPipe's sync phase, v >= 2 and PipeDream (weight stashing) as
    its async phase over the virtual stages."""
    s, p, n = cfg.schedule, cfg.pipeline, cfg.model.n_layer
    adapipe = s.name == "adapipe" and s.sync == "interleaved"
    if s.name != "interleaved" and not adapipe:
        _need(s.chunks == 1, f"schedule.chunks={s.chunks} needs schedule=interleaved or schedule.sync=interleaved "
                             f"(other schedules hold one chunk per stage)")
        return
    _need(s.chunks >= 1, f"schedule.chunks must be at least 1 (got {s.chunks})")
    if adapipe:
        _need(s.chunks >= 2, f"schedule.sync=interleaved needs schedule.chunks >= 2 (got {s.chunks}; with one chunk per "
                             f"device use schedule.sync=1f1b)")
        _need(s["async"] == "pipedream" and s.weights == "stash",
              f"schedule.sync=interleaved runs PipeDream with weight stashing over the virtual stages: use "
              f"schedule.async=pipedream schedule.weights=stash (got async={s['async']} weights={s.weights})")
    _need(p.stages * s.chunks <= n, f"pipeline.stages x schedule.chunks = {p.stages * s.chunks} chunks is more than the "
                                    f"{n} blocks of model {cfg.model.name}: use fewer chunks or a deeper model")
    _need(p.microbatches % p.stages == 0, f"schedule=interleaved needs pipeline.microbatches to be a multiple of "
                                          f"pipeline.stages={p.stages} (got {p.microbatches})")
    _need(p.runtime != "dist" or p.stages > 1, "schedule=interleaved on pipeline.runtime=dist needs pipeline.stages >= 2 "
                                               "(a worker does not send to itself): use more stages or pipeline.runtime=local")


def _check_schedule(cfg) -> None:
    from ..schedules.mitigations import MITIGATIONS

    s, p = cfg.schedule, cfg.pipeline
    _need(s.name in SCHEDULES, f"unknown schedule {s.name!r}: use one of {', '.join(SCHEDULES)}")
    if s.name == "adapipe":
        _need(s.sync in ADAPIPE_SYNC, f"unknown schedule.sync={s.sync!r}: use {', '.join(ADAPIPE_SYNC)}")
        _need(s["async"] in ASYNC_SCHEDULES, f"unknown schedule.async={s['async']!r}: use pipedream or 2bw")
    _check_chunks(cfg)
    _need(s.weights in WEIGHT_RULES[:3], f"unknown schedule.weights={s.weights!r}: use stash, latest or vertical")
    for name in s.mitigation:
        _need(name in MITIGATIONS, f"unknown mitigation {name!r} in schedule.mitigation: use {', '.join(MITIGATIONS)}")
    _need(s.async_lr_scale > 0, "schedule.async_lr_scale must be positive")
    _need(s.transition_steps >= 0, "schedule.transition_steps must be >= 0")
    _need(s.transition_lr_scale > 0, "schedule.transition_lr_scale must be positive")
    uses_2bw = s.name == "2bw" or (s.name == "adapipe" and s["async"] == "2bw")
    _need(not uses_2bw or p.microbatches >= p.stages - 1,
          f"2bw needs pipeline.microbatches >= pipeline.stages - 1 (= {p.stages - 1}), got "
          f"{p.microbatches}: raise pipeline.microbatches or use schedule=pipedream")
    uses_async = s.name in ASYNC_SCHEDULES or s.name == "adapipe"
    _need(not (uses_async and cfg.model.tie_embeddings and p.stages > 1),
          "model.tie_embeddings=true needs a synchronous schedule when pipeline.stages > 1 (the first and last "
          "stage sum their embedding gradients at a flush): use schedule=1f1b, gpipe, zbh1 or zbh2, or untied embeddings")
    _need(cfg.heuristic.name.replace("_", "").isalnum(), f"unknown heuristic {cfg.heuristic.name!r}")
    for key in ("delay_drift", "prior_logit_sd", "probe_se"):  # spreads: a negative one would be squared into a valid-looking one
        if key == "probe_se" and cfg.heuristic[key] is None:  # (null: the run's signal's A/A median)
            continue
        _need(math.isfinite(cfg.heuristic[key]) and cfg.heuristic[key] >= 0, f"heuristic.{key}={cfg.heuristic[key]}: give a spread >= 0")
    _need(math.isfinite(cfg.heuristic.delay_trend) and cfg.heuristic.delay_trend >= 0,
          f"heuristic.delay_trend={cfg.heuristic.delay_trend}: give a rise >= 0 (E's per doubling per unit of k d; 0: none)")
    taper = cfg.heuristic.drift_taper_kd
    _need(taper is None or (len(taper) == 2 and all(math.isfinite(x) for x in taper) and 0 <= taper[0] < taper[1]),
          f"heuristic.drift_taper_kd={taper}: give [from, to], two k d values with 0 <= from < to, or null for no taper")
    _need(cfg.heuristic.signal in SIGNALS, f"unknown heuristic.signal={cfg.heuristic.signal!r}: use train or heldout")
    _need(cfg.heuristic.signal_tokens >= 1,
          f"heuristic.signal_tokens={cfg.heuristic.signal_tokens}: give a positive number (rounded down to whole sequences, at least one)")
    w = cfg.heuristic.sync_warmup
    _need(w is None or w >= 0, f"heuristic.sync_warmup={w}: give a number of steps >= 0 (0: none), or null for the optimizer's default")
    if s.name == "adapipe" and cfg.heuristic.name == "fixed":
        try:
            parse_plan(cfg.heuristic.plan)
        except (ValueError, TypeError) as e:
            raise ConfigError(str(e) if isinstance(e, ValueError) else
                              f"heuristic.plan={cfg.heuristic.plan}: write [[phase, steps], ...], e.g. [[sync,200],[async,null]]") from None
