"""The model of a config: its GPT shape, its cut into (virtual) stages, and the stage modules with
their optimizers. Shared by the training loop and the workers of the distributed runtime, so that
every process builds the same stages from the same seed."""

from __future__ import annotations

import torch

from ..optim import StageOptimizer
from ..schedules.choice import virtual_stages
from .gpt import GPTConfig, build_stages
from .partition import partition


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
