"""Per-stage optimizers and the learning-rate schedule.

Each pipeline stage owns an optimizer over its own parameters (a pipeline never gathers the
model). ``optim=adamw`` (default), ``optim=nadamw`` (Adam with Nesterov momentum and decoupled
weight decay) and ``optim=muon`` (``torch.optim.Muon`` on the hidden weight matrices, AdamW on
embeddings, head, norms and biases).
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.nn as nn

OPTIMIZERS = ("adamw", "nadamw", "muon")


def lr_factor(step: int, warmup: int, total: int, min_ratio: float, decay: str = "cosine") -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to ``min_ratio``:
    ``f(t) = (t+1)/warmup`` for ``t < warmup``, else
    ``min_ratio + (1 - min_ratio) * (1 + cos(pi * (t - warmup) / (total - warmup))) / 2``."""
    if step < warmup:
        return (step + 1) / warmup
    if decay == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class NAdamW(torch.optim.Optimizer):
    """Adam with Nesterov momentum and decoupled weight decay (the NAdamW of AlgoPerf):

    ``m = b1 m + (1-b1) g``, ``v = b2 v + (1-b2) g^2``,
    ``w -= lr * ((b1 m + (1-b1) g) / (1-b1^(t+1)) / (sqrt(v / (1-b2^t)) + eps) + wd w)``.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102
        for group in self.param_groups:
            b1, b2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    st["m"] = torch.zeros_like(p)
                    st["v"] = torch.zeros_like(p)
                st["step"] += 1
                t, m, v, g = st["step"], st["m"], st["v"], p.grad
                m.lerp_(g, 1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                look = (m * b1 + g * (1 - b1)) / (1 - b1 ** (t + 1))
                denom = (v / (1 - b2**t)).sqrt_().add_(eps)
                p.mul_(1 - lr * wd)
                p.addcdiv_(look, denom, value=-lr)
        return None


def is_hidden_matrix(name: str, p: torch.Tensor) -> bool:
    """Muon's parameters: the 2-D weights of the blocks (not embeddings, head, norms, biases)."""
    return p.dim() == 2 and ".blocks." in f".{name}" and "embed" not in name and "head" not in name


def _adamw_groups(named: list[tuple[str, nn.Parameter]], wd: float) -> list[dict]:
    decay = [p for n, p in named if p.dim() >= 2]
    no_decay = [p for n, p in named if p.dim() < 2]
    return [g for g in ({"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}) if g["params"]]


class StageOptimizer:
    """The optimizers of one stage. ``step(lr_scale, beta1)`` sets every group's learning rate to
    its base rate times ``lr_scale`` (and optionally overrides the first-moment/momentum
    coefficient for this step), steps, and clears the gradients."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], cfg) -> None:
        self.name = cfg.name
        adam_kw = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
        self.optimizers: list[torch.optim.Optimizer] = []
        rest = named_params
        if cfg.name == "muon":
            hidden = [p for n, p in named_params if is_hidden_matrix(n, p)]
            rest = [(n, p) for n, p in named_params if not is_hidden_matrix(n, p)]
            if hidden:
                self.optimizers.append(torch.optim.Muon(
                    hidden, lr=cfg.muon_lr, momentum=cfg.muon_momentum, weight_decay=cfg.weight_decay))
        if rest:
            groups = _adamw_groups(rest, cfg.weight_decay)
            if cfg.name == "nadamw":
                self.optimizers.append(NAdamW(groups, **adam_kw))
            else:
                self.optimizers.append(torch.optim.AdamW(groups, foreach=True, **adam_kw))
        for opt in self.optimizers:
            for g in opt.param_groups:
                g["base_lr"] = g["lr"]
        self.params = [p for _, p in named_params]

    def step(self, lr_scale: float, beta1: float | None = None) -> None:
        for opt in self.optimizers:
            for g in opt.param_groups:
                g["lr"] = g["base_lr"] * lr_scale
                if beta1 is not None:
                    if "betas" in g:
                        g.setdefault("base_betas", g["betas"])
                        g["betas"] = (beta1, g["base_betas"][1])
                    elif "momentum" in g:
                        g.setdefault("base_momentum", g["momentum"])
                        g["momentum"] = beta1
                else:
                    if "base_betas" in g:
                        g["betas"] = g["base_betas"]
                    if "base_momentum" in g:
                        g["momentum"] = g["base_momentum"]
            opt.step()
        for p in self.params:
            p.grad = None

    def current_lr(self) -> float:
        return self.optimizers[-1].param_groups[0]["lr"] if self.optimizers else 0.0

    def state_dict(self) -> list[dict]:
        return [opt.state_dict() for opt in self.optimizers]

    def load_state_dict(self, states: list[dict]) -> None:
        for opt, st in zip(self.optimizers, states):
            opt.load_state_dict(st)
