"""Small builders shared by the engine tests: a tiny GPT, fixed data, a local runtime."""

from __future__ import annotations

import dataclasses

import torch
from omegaconf import OmegaConf

from adapipe_cli.config.schema import OptimConfig, ScheduleConfig
from adapipe_cli.model import GPTConfig, build_stages, partition
from adapipe_cli.runtime.local import LocalRuntime
from adapipe_cli.schedules import Plan, ScheduleSpec
from adapipe_cli.schedules.mitigations import UpdatePolicy
from adapipe_cli.simulator.clock import CostProfile, LinkModel
from adapipe_cli.optim import StageOptimizer

V, T, B = 64, 16, 8
GCFG = GPTConfig(vocab_size=V, block_size=T, n_layer=4, d_model=32, n_head=2)


def one_block_per_stage(n: int, gcfg: GPTConfig = GCFG) -> GPTConfig:
    """``gcfg`` with ``n`` blocks, one per (virtual) stage: where what a test checks does not depend
    on a stage's number of blocks (what it holds, its versions, its numbers against a reference of
    the same stages), a step through fewer blocks costs less."""
    return dataclasses.replace(gcfg, n_layer=n)


def make_data(steps: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        seq = torch.randint(0, V, (B, T + 1), generator=g)
        out.append((seq[:, :-1], seq[:, 1:]))
    return out


def batch_fn(data, m: int):
    def batch(step: int, i: int):
        x, y = data[step]
        mb = B // m
        return x[i * mb:(i + 1) * mb], y[i * mb:(i + 1) * mb]

    return batch


def optim_cfg(**kw):
    cfg = OmegaConf.structured(OptimConfig)
    cfg.warmup_steps = 2
    for k, v in kw.items():
        cfg[k] = v
    return cfg


def sched_cfg(**kw):
    cfg = OmegaConf.structured(ScheduleConfig)
    for k, v in kw.items():
        cfg[k] = v
    return cfg


def local_runtime(p: int, m: int, phases: list[str], data, *, sync="1f1b", weights="stash", gcfg=GCFG,
                  ocfg=None, scfg=None, clip=1.0, order="forward", seed=0, profile=None,
                  precision="fp32", barrier=None, chunks=1, signal=None, measured=False):
    """``barrier`` (None: as a run would choose, see schedules/choice.py): whether sync updates wait;
    ``chunks``: model chunks per device (interleaved: the model is cut into ``p * chunks``);
    ``signal``: the held-out signal's cost per stage after each update; ``measured``: the clock
    takes measured costs (no profile)."""
    steps = len(phases)
    plan = Plan(steps, list(phases))
    ocfg = ocfg if ocfg is not None else optim_cfg()
    scfg = scfg if scfg is not None else sched_cfg()
    ocfg.grad_clip = clip
    stages = build_stages(gcfg, partition(gcfg, p * chunks), seed)
    opts = [StageOptimizer(list(s.named_parameters()), ocfg) for s in stages]
    policy = UpdatePolicy(ocfg, scfg, plan, steps)
    if barrier is None:
        barrier = sync != "zbh2" or clip > 0 or (gcfg.tie_embeddings and p > 1)
    return LocalRuntime(stages, opts, ScheduleSpec(p, m, sync, weights, barrier, chunks), plan, policy, batch_fn(data, m),
                        None if measured else profile or CostProfile.uniform(p * chunks), LinkModel(), clip, seed,
                        gcfg.tie_embeddings, order, precision=precision, signal=signal)


def run_losses(rt, steps: int) -> list[float]:
    return [rt.run_step(t).loss for t in range(steps)]


def rel_close(a: list[float], b: list[float], tol: float) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol * max(abs(y), 1e-12) for x, y in zip(a, b))
