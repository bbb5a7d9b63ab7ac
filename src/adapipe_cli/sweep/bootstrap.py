"""Confidence intervals of a speedup over seeds: the percentile bootstrap.

The speedup of A over B is ``median(b) / median(a)`` over the seeds of each (time or steps to a
target, inf where a seed did not reach it). The bootstrap resamples each method's seeds with
replacement, independently (the runs of A and of B are separate runs), ``resamples`` times, and
takes the ratio of the resampled medians; the interval is its ``(1 - level)/2`` and
``(1 + level)/2`` quantiles. A resample where neither median is finite has no ratio and is left
out. Seeded, so a report is the same every time it is written. With 3 seeds the interval is coarse
(a median of 3 resampled values is one of the 3), which is what 3 seeds can say.

A speedup is *within noise* when its interval includes 1.
"""

from __future__ import annotations

import math

import numpy as np

RESAMPLES = 10_000
LEVEL = 0.95
SEED = 0


def speedup_ci(a: list[float], b: list[float], level: float = LEVEL, resamples: int = RESAMPLES,
               seed: int = SEED) -> tuple[float, float] | None:
    """(low, high) of the bootstrap interval of ``median(b) / median(a)``; None with fewer than two
    seeds on either side or no finite ratio. ``high`` is inf where B's median is often not reached."""
    if len(a) < 2 or len(b) < 2:
        return None
    rng = np.random.default_rng(seed)
    ma = np.median(rng.choice(np.asarray(a, dtype=float), (resamples, len(a))), axis=1)
    mb = np.median(rng.choice(np.asarray(b, dtype=float), (resamples, len(b))), axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = mb / ma  # inf / inf is nan: neither reached in that resample
    ratio = ratio[~np.isnan(ratio)]
    if not len(ratio):
        return None
    low, high = np.quantile(ratio, [(1 - level) / 2, (1 + level) / 2], method="inverted_cdf")
    return float(low), float(high)


def median_ci(xs: list[float], level: float = LEVEL, resamples: int = RESAMPLES,
              seed: int = SEED) -> tuple[float, float] | None:
    """(low, high) of the percentile bootstrap interval of ``median(xs)``, one sample resampled with
    replacement (paired measurements: the ratio of two timings taken side by side, one per pair);
    None with fewer than two values."""
    if len(xs) < 2:
        return None
    rng = np.random.default_rng(seed)
    med = np.median(rng.choice(np.asarray(xs, dtype=float), (resamples, len(xs))), axis=1)
    low, high = np.quantile(med, [(1 - level) / 2, (1 + level) / 2], method="inverted_cdf")
    return float(low), float(high)


def within_noise(ci: tuple[float, float] | None) -> bool:
    """There is an interval and it includes 1."""
    return ci is not None and ci[0] <= 1.0 <= ci[1]


def fmt_ci(ci: tuple[float, float] | None) -> str:
    """``[1.10, 1.50]``; ``[1.10, ∞]``."""
    if ci is None:
        return ""
    return "[" + ", ".join("∞" if math.isinf(x) else f"{x:.2f}" for x in ci) + "]"
