"""Per-stage optimizers and the learning-rate schedule.

Each pipeline stage owns an optimizer over its own parameters (a pipeline never gathers the
model). ``optim=adamw`` (default), ``optim=nadamw`` (Adam with Nesterov momentum and decoupled
weight decay) and ``optim=muon`` (:class:`Muon`, ``torch.optim.Muon`` with its Newton-Schulz
iteration in a dtype that is fast on the device, on the hidden weight matrices; AdamW on
embeddings, head, norms and biases).
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.nn as nn
from torch.optim._muon import _adjust_lr

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


NS_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def fast_bf16(device: torch.device) -> bool:
    """Whether bf16 matrix products are fast on ``device``: CUDA, or a CPU with AVX512-BF16 or AMX.
    Elsewhere (e.g. AVX2 CPUs) bf16 is emulated and a bf16 matmul is tens of times slower than fp32."""
    if device.type == "cuda":
        return True
    if device.type != "cpu":
        return False
    cpu = torch.cpu
    return any(bool(getattr(cpu, f, lambda: False)()) for f in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


def ns_dtype(device: torch.device, choice: str = "auto") -> torch.dtype:
    """The dtype of Muon's Newton-Schulz iteration: ``choice`` (``float32``, ``bfloat16``), or for
    ``auto`` bf16 where it is fast (as torch.optim.Muon always uses) and fp32 elsewhere."""
    if choice != "auto":
        return NS_DTYPES[choice]
    return torch.bfloat16 if fast_bf16(device) else torch.float32


def zeropower_newton_schulz(g: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                            dtype: torch.dtype) -> torch.Tensor:
    """torch.optim.Muon's quintic Newton-Schulz orthogonalization of ``g``, computed in ``dtype``:
    ``X <- X / max(||X||_F, eps)``, then ``steps`` times ``A = X X^T``, ``X <- a X + (b A + c A^2) X``
    (on the wide orientation of ``g``). In bf16 it is torch's, operation for operation."""
    a, b, c = coefficients
    x = g.to(dtype)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)  # (not in place: with fp32, x may be the caller's momentum buffer)
    for _ in range(steps):
        gram = x @ x.T
        update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, update, x, beta=a)
    return x.T if tall else x


class Muon(torch.optim.Muon):
    """``torch.optim.Muon`` whose Newton-Schulz iteration runs in :func:`ns_dtype` of each gradient's
    device (``ns_dtype="auto"``) rather than always in bf16. Update, per 2-D parameter W with
    gradient g and momentum buffer B: ``B <- mu B + (1-mu) g``, ``U = NS(g + mu (B - g))`` (Nesterov)
    or ``NS(B)``, ``W <- W (1 - lr wd) - lr sqrt(max(1, rows/cols)) U``."""

    def __init__(self, params, ns_dtype: str = "auto", **kwargs) -> None:
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, bufs = [], [], []
            self._init_group(group, params, grads, bufs)
            lr, wd, mu = float(group["lr"]), group["weight_decay"], group["momentum"]
            for p, g, buf in zip(params, grads, bufs):
                buf.lerp_(g, 1 - mu)
                u = g.lerp(buf, mu) if group["nesterov"] else buf
                u = zeropower_newton_schulz(u, group["ns_coefficients"], group["ns_steps"], group["eps"],
                                            ns_dtype(g.device, self.ns_dtype))
                p.mul_(1 - lr * wd)
                p.add_(u, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))
        return loss


def rate_keys(cfg) -> str:
    """The learning rates a user can lower, for a message: ``optim.lr``, and with Muon first
    ``optim.muon_lr`` (Muon's rate on the hidden matrices, AdamW's ``optim.lr`` on the rest)."""
    return "optim.muon_lr or optim.lr" if cfg.name == "muon" else "optim.lr"


def overflowing_lr(cfg, scale: float = 1.0) -> str | None:
    """The key, ``optim.lr`` or ``optim.muon_lr``, whose rate times ``scale`` makes a first update
    overflow float32, else None. The first step is the largest: Adam's is ``lr / (1 - beta1)``
    (bias correction), Muon's ``lr sqrt(max(1, rows/cols))``; tried on a zero 4x1 block matrix
    (the largest ratio, an MLP's up projection) and a zero bias with unit gradients."""
    named = [("blocks.0.fc.weight", nn.Parameter(torch.zeros(4, 1))), ("blocks.0.fc.bias", nn.Parameter(torch.zeros(4)))]
    opt = StageOptimizer(named, cfg)
    for _, p in named:
        p.grad = torch.ones_like(p)
    for o in opt.optimizers:
        for g in o.param_groups:
            g["lr"] = g["base_lr"] * scale
        try:
            o.step()
            finite = all(bool(torch.isfinite(p).all()) for g in o.param_groups for p in g["params"])
        except RuntimeError:  # torch: "value cannot be converted to type float without overflow"
            finite = False
        if not finite:
            return "optim.muon_lr" if isinstance(o, Muon) else "optim.lr"
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
                self.optimizers.append(Muon(hidden, ns_dtype=cfg.muon_ns_dtype, lr=cfg.muon_lr,
                                            momentum=cfg.muon_momentum, weight_decay=cfg.weight_decay))
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

    def base_lr(self) -> float:
        """The base learning rate of the group :meth:`current_lr` reports."""
        return self.optimizers[-1].param_groups[0]["base_lr"] if self.optimizers else 0.0

    def state_dict(self) -> list[dict]:
        return [opt.state_dict() for opt in self.optimizers]

    def load_state_dict(self, states: list[dict]) -> None:
        for opt, st in zip(self.optimizers, states):
            opt.load_state_dict(st)
