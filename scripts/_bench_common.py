"""Helpers for the benchmark scripts: tiny timing utilities and model builders."""

from __future__ import annotations

import statistics
import time

import torch
from omegaconf import OmegaConf

from adapipe_cli.config.schema import OptimConfig, ScheduleConfig
from adapipe_cli.model import GPTConfig, build_full_model, build_stages, lm_loss, partition
from adapipe_cli.runtime.local import LocalRuntime
from adapipe_cli.schedules import Plan, ScheduleSpec
from adapipe_cli.schedules.mitigations import UpdatePolicy
from adapipe_cli.simulator.clock import CostProfile, LinkModel
from adapipe_cli.optim import StageOptimizer

MODELS = {
    "gpt-nano": dict(n_layer=4, n_head=4, d_model=128, block_size=64),
    "gpt-micro": dict(n_layer=8, n_head=4, d_model=128, block_size=64),
}


def gpt(name: str, vocab: int = 256) -> GPTConfig:
    return GPTConfig(vocab_size=vocab, **MODELS[name])


def batches(cfg: GPTConfig, batch: int, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        s = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), generator=g)
        out.append((s[:, :-1], s[:, 1:]))
    return out


def interleaved_median_steps(fns: dict, steps: int, warmup: int = 3) -> dict:
    """Each of ``fns``' step functions timed ``steps`` times in turn, one step of each per round (so
    that a machine whose speed drifts slows them alike); the median step time of each."""
    for t in range(warmup):
        for fn in fns.values():
            fn(t)
    times = {k: [] for k in fns}
    for t in range(warmup, warmup + steps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn(t)
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def bare_loop(cfg: GPTConfig, data, m: int = 1):
    """A plain PyTorch training step over the unpartitioned model (the baseline)."""
    model = build_full_model(cfg, 0)
    ocfg = OmegaConf.structured(OptimConfig)
    opt = torch.optim.AdamW(
        [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": ocfg.weight_decay},
         {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}],
        lr=ocfg.lr, betas=(ocfg.beta1, ocfg.beta2), foreach=True)

    def step(t: int) -> None:
        x, y = data[t % len(data)]
        mb = x.shape[0] // m
        for i in range(m):
            (lm_loss(model(x[i * mb:(i + 1) * mb]), y[i * mb:(i + 1) * mb]) / m).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def adapipe_local(cfg: GPTConfig, data, p: int, m: int, phase: str = "sync", steps: int = 10_000):
    """adapipe's local runtime stepping the same model and batches; returns step(t)."""
    ocfg = OmegaConf.structured(OptimConfig)
    plan = Plan(steps, [phase] * steps)
    stages = build_stages(cfg, partition(cfg, p), 0)
    opts = [StageOptimizer(list(s.named_parameters()), ocfg) for s in stages]
    policy = UpdatePolicy(ocfg, OmegaConf.structured(ScheduleConfig), plan, steps)

    def batch(step: int, i: int):
        x, y = data[step % len(data)]
        mb = x.shape[0] // m
        return x[i * mb:(i + 1) * mb], y[i * mb:(i + 1) * mb]

    rt = LocalRuntime(stages, opts, ScheduleSpec(p, m), plan, policy, batch, CostProfile.uniform(p), LinkModel(),
                      ocfg.grad_clip, 0, False)
    return lambda t: rt.run_step(t)
