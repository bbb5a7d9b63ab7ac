"""``heuristic=rate``: the thesis's idea, run the phase with the higher progress rate.

Progress rate = decrease of the training loss per second of the run's clock. Rates measured at
different times are not comparable (loss falls faster early on), so the two phases are compared
only within a window that holds a probe of the other phase next to recent steps of the current
one, and through a fit with a shared trend (see :mod:`.estimate`): the curvature of the recent
loss curve is common to both phases, and only the phases' own slopes are compared.

The probed phase becomes current when its rate beats the current one's by more than

    margin * |r_current| + (r_current * switch_time + jumps) / horizon + confidence * se

The rates are the steady ones (slopes within each stretch, see :mod:`.estimate`); ``jumps`` is
what the probe's two switches cost in loss (the transition's spike included; a jump counts only
beyond ``confidence`` standard errors, since 2026-12-04), ``switch_time`` the
predicted drain and fill (simulator, same cost profile), the horizon the time until the next
probe, and ``se`` the standard error of the difference (noise alone should not cause switches).
"""

from __future__ import annotations

from statistics import median

from .base import Observation
from .estimate import fit_rates
from .probing import CLEAR, DECISIVE, UNCLEAR, Prober


class Rate(Prober):
    name = "rate"

    def judge(self, window: list[Observation], current: str, probed: str) -> tuple[str, str, dict, int]:
        c = self.cfg
        rates = fit_rates([o.phase for o in window], [o.loss for o in window], [o.step_time for o in window],
                          transients=True, settle=self.settle)
        if rates is None:
            return current, "too few observations to compare", {}, UNCLEAR
        r = {"sync": rates.sync, "async": rates.async_}
        r_cur, r_new = r[current], r[probed]
        probe_times = [o.step_time for o in window if o.phase == probed]
        horizon = self.interval * (median(probe_times) if probe_times else 1.0)
        jumps = rates.switch_jumps(c.confidence)  # (only jumps beyond their noise)
        needed = (c.margin * abs(r_cur) + (max(r_cur, 0.0) * self.ctx.switch_time + jumps) / horizon
                  + c.confidence * rates.diff_se)
        info = {"rate_sync": rates.sync, "rate_async": rates.async_, "rate_diff_se": rates.diff_se,
                "switch_jumps": jumps, "needed_gain": needed, "window_steps": rates.n}
        if r_new - r_cur > needed:
            level = DECISIVE if r_new > 2 * max(r_cur, 0.0) else CLEAR
            return probed, f"{probed} rate {r_new:.4g}/s beats {current} {r_cur:.4g}/s by more than {needed:.3g}", info, level
        # keeping the current phase needs less evidence to count as clear: one standard error
        clear = r_cur - r_new > c.margin * abs(r_cur) + rates.diff_se
        level = UNCLEAR if not clear else DECISIVE if r_cur > 2 * max(r_new, 0.0) else CLEAR
        return current, f"{current} kept: {probed} rate {r_new:.4g}/s vs {r_cur:.4g}/s (needed gain {needed:.3g})", info, level
