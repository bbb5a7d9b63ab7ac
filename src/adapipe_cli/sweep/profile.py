"""One cost profile per (model, depth, microbatch size), measured once and given to every run.

The pipeline clock of the local runtime times each action from a cost profile measured at the
start of a run. Runs measured separately would each have their own clock, a few percent apart from
noise alone, which is the size of the differences a sweep compares. So the sweep measures the
profile of each depth once, the way a run does (:func:`..runtime.profile.measure_profile` on the
run's stages and a microbatch of its data), and every run of that depth gets
``pipeline.profile=FILE``: every method and seed of a depth is timed on the same clock.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..data import build_data
from ..data.batches import Batches
from ..config import ConfigError
from ..runtime.device import DeviceError, resolve_device
from ..simulator.clock import CostProfile
from ..model.build import make_stages, model_config
from ..schedules.choice import microbatch_size
from ..runtime.profile_meta import measure_stage_profile


def measure_depth_profile(cfg, path: Path) -> CostProfile:
    """Measure the profile of the stages ``cfg`` builds, with microbatches of ``cfg.train.batch_size
    / cfg.pipeline.microbatches`` sequences, and save it to ``path``."""
    if cfg.pipeline.threads > 0:
        torch.set_num_threads(cfg.pipeline.threads)
    torch.manual_seed(cfg.seed)
    data = build_data(cfg.data, cfg.model.block_size, cfg.seed)
    try:
        device = resolve_device(cfg.pipeline.device)  # where the cells' local runtimes compute
    except DeviceError as e:
        raise ConfigError(str(e)) from None
    stages, _ = make_stages(cfg, model_config(cfg, data.vocab_size), device=device)
    micro = microbatch_size(cfg)  # (a replica's microbatch)
    x, y = Batches(data, micro, 1, device=device)(0, 0)
    profile = measure_stage_profile(cfg, stages, x, y, data)
    path.parent.mkdir(parents=True, exist_ok=True)
    profile.save(path)
    return profile
