"""What a cost profile is measured for (model, depth, microbatch, optimizer, precision, device),
whether a profile fits a run, and measuring a run's stages with that label. Used by the training
loop, a sweep (one profile per depth) and each dist worker (its own stage's, on its device)."""

from __future__ import annotations

import torch

from ..optim import StageOptimizer
from ..schedules.choice import signal_rows, virtual_stages
from .device import resolve_device
from .profile import measure_profile


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


def measure_stage_profile(cfg, stages, x: torch.Tensor, y: torch.Tensor, data=None, **kw):
    """The cost profile of ``stages`` on the microbatch (x, y), labelled with what it was measured
    for (a run measures its own; a sweep measures one per depth and gives it to every run; a dist
    worker its own stage's); with ``data`` (the run's source), the making of one step's batch of
    ``train.batch_size`` rows timed too; and the forward of AdaPipe's held-out signal
    (``heuristic.signal_tokens`` over the sequence length, in rows), which a heuristic that follows
    the held-out loss pays after every step. ``kw``: :func:`measure_profile`'s ``warn``, ``until``
    and ``statistic``."""
    rows = cfg.train.batch_size
    kw["make_batch"] = None if data is None else (lambda t: data.train_batch(t, rows))
    return measure_profile(stages, lambda named: StageOptimizer(named, cfg.optim), x, y,
                           reps=cfg.pipeline.profile_reps, meta=profile_meta(cfg, int(x.shape[0])),
                           precision=cfg.train.precision, grad_clip=cfg.optim.grad_clip,
                           signal_rows=signal_rows(cfg), **kw)
