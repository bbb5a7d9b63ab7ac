"""Measuring the cost profile that the pipeline clock uses (``pipeline.clock=profiled``).

Each stage's forward, backward (one microbatch) and update are timed on copies of the stage and
its optimizer, so measuring changes neither the weights nor the random state of the run; the
median of ``reps`` repetitions after one warm-up is kept.
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Callable

import torch

from ..model import GPTStage, lm_loss
from ..simulator.clock import CostProfile
from ..train.optim import StageOptimizer


def _median_time(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_stage(stage: GPTStage, make_optimizer: Callable[[list], StageOptimizer], tokens: torch.Tensor, targets: torch.Tensor, reps: int) -> tuple[float, float, float, float]:
    """(forward s, backward s, update s, activation bytes) of one stage on one microbatch."""
    st = copy.deepcopy(stage)
    opt = make_optimizer(list(st.named_parameters()))
    params = list(st.parameters())
    rows, seq = tokens.shape
    x = tokens if st.first else torch.randn(rows, seq, st.cfg.d_model, requires_grad=True)

    def fwd():
        out = st(x)
        return lm_loss(out, targets) if st.last else out

    out = fwd()
    grad = None if st.last else torch.randn_like(out)
    inputs = params if st.first else [x, *params]
    f = _median_time(fwd, reps)
    # the backward alone: each repetition differentiates a graph built (untimed) just before
    times = []
    for _ in range(reps + 1):
        y = fwd()
        t0 = time.perf_counter()
        torch.autograd.grad(y, inputs, grad, allow_unused=True)
        times.append(time.perf_counter() - t0)
    bwd = statistics.median(times[1:])
    for p in params:
        p.grad = torch.zeros_like(p)

    def upd():
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step(1.0)

    u = _median_time(upd, reps)
    act_bytes = float(rows * seq * st.cfg.d_model * 4)
    return f, bwd, u, act_bytes


def measure_profile(stages: list[GPTStage], make_optimizer: Callable[[list], StageOptimizer], tokens: torch.Tensor, targets: torch.Tensor, reps: int = 5, meta: dict | None = None) -> CostProfile:
    """The cost profile of a pipeline: each stage measured on one microbatch."""
    state = torch.random.get_rng_state()
    try:
        rows = [measure_stage(s, make_optimizer, tokens, targets, reps) for s in stages]
    finally:
        torch.random.set_rng_state(state)
    return CostProfile([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows], rows[0][3], meta or {})
