"""Trend-corrected progress rates of the two phases, from a window of recent observations.

Loss falls faster early in training, so a rate measured a while ago is not comparable with one
measured now. We fit the window's loss curve with one shared trend and one rate per phase:

    dL/dx = -r_phase * g(x),   g(x) = 1 + gamma * (x - x_end)

where ``x`` is the progress variable (seconds of the run's clock for ``rate``, steps for
``goodput``) and ``g`` the deceleration common to both phases (``g = 1`` at the end of the
window, so the rates are the ones *now*). Integrated over the steps,

    L_i = a - r_sync * S_i - r_async * A_i,   S_i = sum over sync steps j <= i of dx_j g(x_j)

(``A_i`` likewise), linear in (a, r_sync, r_async) for a given ``gamma``, which is found by a
grid search on the residual. The curve's shape is absorbed by ``a`` and ``gamma``, so only the
phases' own rates are compared; their ratio is unbiased under a multiplicative slow-down.
Standard errors come from the residuals, so a heuristic can ignore differences noise could explain.

A switch has a one-time cost on top of the rates: the pipeline drains or fills, and a switch into
async trains on weights that become stale all at once, which stirs an oscillation that takes a
few times the staleness to settle. With ``transients=True`` every phase change k in the window
adds a level term ``delta_k * [i >= k]`` and the ``settle`` observations that follow it are left
out of the fit (their time still counts; ``settle`` may depend on the phase switched into), so the rates come from the slopes of each stretch's
steady part (what a longer stay would see) and the jumps ``delta_k`` (positive: the loss rose)
measure what each switch cost, its transient included.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..schedules import ASYNC


@dataclass
class Rates:
    sync: float  # loss decrease per unit of x in sync
    async_: float  # ... in async
    diff_se: float  # standard error of async_ - sync
    n: int
    jumps: tuple[float, ...] = ()  # loss jump at each phase change in the window, in order

    @property
    def diff(self) -> float:
        return self.async_ - self.sync


def fit_rates(phases: list[str], losses: list[float], dx: list[float], min_each: int = 3,
              transients: bool = False, settle: int | dict[str, int] = 0) -> Rates | None:
    """Fit the model above to consecutive observations (phase, loss, x-increment of the step).
    Returns None unless both phases have at least ``min_each`` observations. The standard error is
    trustworthy when the window has the same phase on both sides of the other (see
    :mod:`.probing`); with one block of each, trend and phase difference are confounded."""
    n = len(losses)
    is_async = np.array([p == ASYNC for p in phases], dtype=float)
    if n < 6 or is_async.sum() < min_each or (n - is_async.sum()) < min_each:
        return None
    d = np.asarray(dx, dtype=float)
    y = np.asarray(losses, dtype=float)
    x = np.cumsum(d)
    span = x[-1] if x[-1] > 0 else 1.0
    changes = [i for i in range(1, n) if phases[i] != phases[i - 1]] if transients else []
    steps = [(np.arange(n) >= k).astype(float) for k in changes]
    keep = np.ones(n, dtype=bool)
    for k in changes:  # settle: a number of steps, or one per phase switched into
        keep[k:k + (settle[phases[k]] if isinstance(settle, dict) else settle)] = False
    kept_async = (is_async * keep).sum()
    if kept_async < min_each or keep.sum() - kept_async < min_each:
        return None
    best = None
    for gs in np.linspace(-4.0, 0.9, 80):  # gamma * span: g(0) = 1 - gs, from 5 (slowing down) to 0.1
        w = d * (1 + gs * (x - span) / span) / span  # x in units of the window's length
        design = np.column_stack([np.ones(n), -np.cumsum(w * (1 - is_async)), -np.cumsum(w * is_async), *steps])[keep]
        coef, *_ = np.linalg.lstsq(design, y[keep], rcond=None)
        resid = y[keep] - design @ coef
        sse = float(resid @ resid)
        if best is None or sse < best[0]:
            best = (sse, coef, design)
    sse, coef, design = best
    sigma2 = sse / max(1, len(design) - design.shape[1] - 1)  # one more degree of freedom for gamma
    try:
        cov = sigma2 * np.linalg.inv(design.T @ design)
    except np.linalg.LinAlgError:
        return None
    var_diff = cov[2, 2] + cov[1, 1] - 2 * cov[1, 2]
    return Rates(sync=coef[1] / span, async_=coef[2] / span, diff_se=float(np.sqrt(max(var_diff, 0.0))) / span, n=n,
                 jumps=tuple(float(c) for c in coef[3:]))
