"""Trend-corrected progress rates of the two phases, from a window of recent observations.

Loss falls faster early in training, so a rate measured a while ago is not comparable with one
measured now. We fit the window's loss curve with one shared trend and one rate per phase:

    dL/dx = -r_phase * g(x),   g(x) = exp(beta * (x_end - x) / span)

where ``x`` is the progress variable (seconds of the run's clock for ``rate``, steps for
``goodput``), ``span`` the window's length in it, and ``g`` the deceleration common to both
phases (``g = 1`` at the end of the window, so the rates are the ones *now*; beta from -3, a
curve that steepens 20-fold, to 6, one whose slope falls 400-fold across the window). Integrated
over the steps,

    L_i = a - r_sync * S_i - r_async * A_i,   S_i = sum over sync steps j <= i of dx_j g(x_j)

(``A_i`` likewise), linear in (a, r_sync, r_async) for a given ``beta``, which is found by a
grid search on the residual. The curve's shape is absorbed by ``a`` and ``beta``, so only the
phases' own rates are compared; their ratio is unbiased under a multiplicative slow-down.
Where the ratio itself changes across the window (async's efficiency E rising as training goes
on), the one E fitted is about its average: for a probe of sync from async with E rising from 0.3
to 0.85 over the window, 0.68 on an exponential curve (E at the window's middle) and 0.81 on a
power law, not the window end's 0.85 (``tests/test_heuristics.py``).
Standard errors come from the residuals, so a heuristic can ignore differences noise could explain.

Why exponential: early in training the loss's slope falls by 10 to 60 times across one window
(gpt-micro on the method comparison's synthetic data, steps 20 to 107: from 0.08 to 0.005 per
step). The linear deceleration used before 2026-12-03 (``g = 1 + gamma (x - x_end)``, at most
5-fold) could not follow it and put the misfit into the phases' rates: labelling stretches of
runs without a switch as a probe's window (true E = 1, an A/A test), their training losses gave a
median E of 1.81 for probes of sync and 0.57 for probes of async (0.95 and 1.19 with the
exponential). AdaPipe's own verdict at step 107 of one such run (depth 4, 8 microbatches, dev
seed 3) read E = 2.11 from its signal before and 1.11 with the exponential.

Correlated residuals: the heuristics' held-out signal (a fixed batch's loss; the default until
2026-12-04, now the training loss) wanders with the weights, so consecutive residuals are strongly correlated, and least squares' standard errors,
which assume them independent, were several times too small: on that signal |E - 1| / se
exceeded 2 in 58% of the A/A windows (68% with the linear trend). The variance is inflated by
(1 + rho) / (1 - rho) (:func:`ar1_inflation`, the AR(1) factor for a slope; median 26, and rho
at its cap of 0.95 in 42% of the windows), which brings it to 6% (5% if exact).
``scripts/probe_estimator.py`` runs the A/A test (docs/results/estimator/).

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
    jump_ses: tuple[float, ...] = ()  # the standard error of each jump
    inflation: float = 1.0  # the factor the variance was inflated by for correlated residuals

    @property
    def diff(self) -> float:
        return self.async_ - self.sync

    def switch_jumps(self, confidence: float) -> float:
        """The loss the window's switches cost: the sum of the jumps beyond ``confidence`` standard
        errors (a jump within its noise, or a fall, counts as nothing; since 2026-12-04 every
        heuristic's, before which every positive jump counted however noisy)."""
        return sum(j for j, se in zip(self.jumps, self.jump_ses) if j > confidence * se)


# the common trend's family: the grid of its parameter and g at u = (x - x_end) / span in [-1, 0]
TRENDS = {
    "exp": (np.linspace(-3.0, 6.0, 91), lambda b, u: np.exp(-b * u)),  # g(x_start) = e^b: 0.05 to 403
    # before 2026-12-03 (with ar1=False), kept for scripts/probe_estimator.py's comparison: g(x_start) = 1 - b, 5 to 0.1
    "linear": (np.linspace(-4.0, 0.9, 80), lambda b, u: 1 + b * u),
}


def fit_rates(phases: list[str], losses: list[float], dx: list[float], min_each: int = 3,
              transients: bool = False, settle: int | dict[str, int] = 0, trend: str = "exp",
              ar1: bool = True) -> Rates | None:
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
    grid, g = TRENDS[trend]
    u = (x - span) / span  # x in units of the window's length

    def fit_at(b: float):
        w = d * g(b, u) / span
        design = np.column_stack([np.ones(n), -np.cumsum(w * (1 - is_async)), -np.cumsum(w * is_async), *steps])[keep]
        coef, *_ = np.linalg.lstsq(design, y[keep], rcond=None)
        resid = y[keep] - design @ coef
        return float(resid @ resid), coef, design, resid

    best = None
    # the trend's parameter: the grid's least squared error (the first, on a tie). The fits of the
    # whole grid at once (QR, stacked) pick the few candidates that the exact fit then compares: the
    # same choice as fitting every point exactly (their errors differ by far less than the grid's
    # neighbours' squared errors do), at about a quarter of the cost
    for i in _closest_candidates(grid, g, u, d / span, is_async, steps, keep, y[keep]):
        fit = fit_at(grid[i])
        if best is None or fit[0] < best[0]:
            best = fit
    sse, coef, design, resid = best
    sigma2 = sse / max(1, len(design) - design.shape[1] - 1)  # one more degree of freedom for the trend
    # residuals that follow one another are correlated (a fixed batch's loss moves with the
    # weights, which change a little each step): the variance of a slope is then (1 + rho) / (1 - rho)
    # times the independent one, rho the lag-1 autocorrelation of consecutive kept residuals
    inflation = ar1_inflation(resid, np.flatnonzero(keep)) if ar1 else 1.0
    sigma2 *= inflation
    try:
        cov = sigma2 * np.linalg.inv(design.T @ design)
    except np.linalg.LinAlgError:
        return None
    var_diff = cov[2, 2] + cov[1, 1] - 2 * cov[1, 2]
    return Rates(sync=coef[1] / span, async_=coef[2] / span, diff_se=float(np.sqrt(max(var_diff, 0.0))) / span, n=n,
                 jumps=tuple(float(c) for c in coef[3:]),
                 jump_ses=tuple(float(np.sqrt(max(cov[k, k], 0.0))) for k in range(3, len(coef))), inflation=inflation)


CANDIDATES = 5  # the grid points fitted exactly (fit_rates)


def _closest_candidates(grid: np.ndarray, g, u: np.ndarray, dw: np.ndarray, is_async: np.ndarray,
                        steps: list[np.ndarray], keep: np.ndarray, yk: np.ndarray) -> list[int]:
    """The indices, in grid order, of the :data:`CANDIDATES` grid points whose least-squares fits
    have the smallest squared errors, all fits solved at once (a stacked QR); every index where a
    stacked fit is (near) rank-deficient or not finite, so that the exact fits decide."""
    w = dw[None, :] * g(grid[:, None], u[None, :])  # (grid, n)
    cols = [np.broadcast_to(np.ones(len(u)), w.shape), -np.cumsum(w * (1 - is_async), axis=1),
            -np.cumsum(w * is_async, axis=1), *(np.broadcast_to(s, w.shape) for s in steps)]
    design = np.stack(cols, axis=2)[:, keep, :]  # (grid, kept, columns)
    if design.shape[1] < design.shape[2]:
        return list(range(len(grid)))
    q, r = np.linalg.qr(design)
    diag = np.abs(np.diagonal(r, axis1=1, axis2=2))
    if not np.all(diag.min(axis=1) > 1e-8 * diag.max(axis=1)):  # (near) rank-deficient: every point exactly
        return list(range(len(grid)))
    with np.errstate(all="ignore"):
        coef = np.linalg.solve(r, np.einsum("gkc,k->gc", q, yk)[..., None])[..., 0]
        resid = yk[None, :] - np.einsum("gkc,gc->gk", design, coef)
        sse = np.einsum("gk,gk->g", resid, resid)
    if not np.all(np.isfinite(sse)):
        return list(range(len(grid)))
    return sorted(np.argsort(sse, kind="stable")[:CANDIDATES].tolist())


RHO_CAP = 0.95  # the largest lag-1 autocorrelation ar1_inflation believes (an inflation of 39)


def ar1_inflation(resid: np.ndarray, index: np.ndarray, cap: float = RHO_CAP) -> float:
    """(1 + rho) / (1 - rho) for the lag-1 autocorrelation rho of the residuals over pairs of
    consecutive steps (``index``: each residual's step; a gap, such as the steps left out after a
    switch, breaks a pair), rho clipped to [0, ``cap``]: the variance inflation of a least-squares
    slope under AR(1) noise, 1 for independent noise."""
    ss = float(resid @ resid)
    if ss <= 0 or len(resid) < 3:
        return 1.0
    pairs = np.flatnonzero(np.diff(index) == 1)
    rho = float(resid[pairs] @ resid[pairs + 1]) / ss
    # a stretch's own level is fitted, which biases rho low by about (1 + 3 rho) / n for a stretch
    # of n steps (Kendall's approximation): undone for the mean stretch length, where stretches are
    # long enough for it (a probe's window has stretches of 20 to 30 steps)
    n = len(resid) / (len(resid) - len(pairs))
    if n >= 10:
        rho = (n * rho + 1) / (n - 3)
    rho = min(max(rho, 0.0), cap)
    return (1 + rho) / (1 - rho)

