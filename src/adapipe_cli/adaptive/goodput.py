"""``heuristic=goodput``: run async while its goodput beats sync's, E x R > 1 + margin.

- E, the statistical efficiency of async: progress per *step* in async relative to sync. Each
  probe gives an estimate from the trend-corrected per-step slopes of a window holding both phases
  (:mod:`.estimate` with one unit of x per step): ``E_hat = e_async / e_sync``. The running
  estimate is updated after every probe, ``E <- (1 - beta) E + beta E_hat`` with
  ``beta = 1 - heuristic.smoothing`` (the first probe sets it), so that E follows the slow drift
  of training without jumping on one noisy probe.
- R, the throughput ratio: sync step time / async step time. Deterministic on the pipeline clock:
  the median observed step time of each phase in the window (transition steps excluded), and the
  simulator's prediction for the same cost profile until both have been seen.

Progress per second in async relative to sync is E x R. Async becomes current when
E x R > 1 + margin + c, sync when E x R < 1 - margin - c (a dead band against flapping), where c
is the cost of a round trip of switches as a fraction of the horizon until the next probe: the
loss jumps measured at the probe's switches (the transition spike, see :mod:`.estimate`; only
jumps beyond ``confidence`` standard errors, since 2026-12-04) and the
predicted drain and fill, in sync steps. E comes from the steady slopes, so the transient does not
count twice. A probe whose E_hat is within ``confidence`` standard errors of the break-even 1/R
leaves the current phase in place.
"""

from __future__ import annotations

from .base import ASYNC, SYNC, Context, Observation
from .estimate import fit_rates
from .probing import CLEAR, DECISIVE, UNCLEAR, Prober


class Goodput(Prober):
    name = "goodput"

    def __init__(self, cfg, ctx: Context):
        super().__init__(cfg, ctx)
        self.E: float | None = None

    def judge(self, window: list[Observation], current: str, probed: str) -> tuple[str, str, dict, int]:
        c = self.cfg
        rates = fit_rates([o.phase for o in window], [o.loss for o in window], [1.0] * len(window),
                          transients=True, settle=self.settle)
        R = self.step_time_ratio(window, SYNC, ASYNC)
        if rates is None or rates.sync <= 0:
            return current, "no measurable sync progress in the window", {"R": R, "E": self.E}, UNCLEAR
        e_hat = rates.async_ / rates.sync
        beta = 1.0 - c.smoothing
        self.E = e_hat if self.E is None else (1 - beta) * self.E + beta * e_hat
        goodput = self.E * R
        sync_t = self.ctx.sync_step_time or 1.0
        jumps = rates.switch_jumps(c.confidence) / rates.sync  # in sync steps of progress (only jumps beyond their noise)
        cost = (jumps + self.ctx.switch_time / sync_t) / max(1, self.interval)
        # is the difference from break-even (async per-step progress = sync's / R) significant?
        significant = bool(abs(rates.async_ - rates.sync / R) > c.confidence * rates.diff_se)
        info = {"E": self.E, "E_probe": e_hat, "E_probe_se": rates.diff_se / rates.sync, "R": R, "goodput": goodput,
                "switch_cost": cost, "switch_steps": jumps, "significant": significant}
        decisive = goodput > 2 or goodput < 0.5  # one phase at least twice as fast
        if significant and goodput > 1 + c.margin + cost:
            return ASYNC, f"E x R = {self.E:.3f} x {R:.3f} = {goodput:.3f} > 1 + margin + {cost:.3f}", info, \
                DECISIVE if decisive else CLEAR
        if significant and goodput < 1 - c.margin - cost:
            return SYNC, f"E x R = {self.E:.3f} x {R:.3f} = {goodput:.3f} < 1 - margin - {cost:.3f}", info, \
                DECISIVE if decisive else CLEAR
        # keeping the current phase needs less evidence to count as clear: one standard error
        keep_clear = abs(rates.async_ - rates.sync / R) > rates.diff_se and (
            (current == ASYNC and goodput > 1 + c.margin) or (current == SYNC and goodput < 1 - c.margin))
        level = UNCLEAR if not keep_clear else DECISIVE if decisive else CLEAR
        return current, f"{current} kept: E x R = {goodput:.3f}" + ("" if significant else " (not significant)"), info, level

    def state_dict(self) -> dict:
        return {**super().state_dict(), "E": self.E}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.E = state.get("E")
