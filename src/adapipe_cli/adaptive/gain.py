"""``heuristic=gain``: goodput's verdicts, with every probe priced by what it can still gain.

The estimates are ``goodput``'s (:mod:`.goodput`): G = E x R, async's progress per second of the
run's clock relative to sync's, from the probes' trend-corrected slopes. What changes is *when*
to probe, and what a probe that wins decisively does.

**Value of a probe.** Measure progress in seconds of sync's progress: sync makes 1 per second,
async G. Running the worse phase for a time T loses ``|G - 1| T``. After a verdict at step s the
heuristic believes G(t) ~ Normal(mu(t), sd(t)^2) for a later step t, with

    mu(t)   = G_s + b (t - s)                  b: slope of the last probes' G over steps, its
                                               prior's mean E's expected rise (after two probes)
              + tau max(|G_s|, 1) log2(t / s)  tau: E's expected rise (before two probes; then 0),
                                               each up to E = 1 (G = R)
    sd(t)^2 = se_s^2 + u (delta max(|G_s|, 1) log2(t / s))^2
                                               u: the share of the trend not pinned down (below)

``se_s`` the standard error of the smoothed estimate, ``delta`` the relative drift per doubling
of the step: training changes as much between steps 100 and 200 as between 1000 and 2000, so
without news the belief widens with log-time and the probes of a dominated phase come at about
geometric intervals. The drift is relative to G or to break-even, whichever is larger: relative
to G alone, an async phase found far behind early (G = 0.3, as AdamW's stale gradients at the
start of training) could never drift back to 1 and would not be probed again, however much its
efficiency rose.

**The trend b has the drift as its prior** (since 2026-12-04): b is the weighted least-squares
slope of the last four probes' G (weights 1 / se^2) with a normal prior, mean
``rise x max(|G_s|, 1) / s`` (E's expected rise per doubling as a slope from step s, below; 0
until 2026-12-05) and sd
``sigma_b = delta max(|G_s|, 1) / s`` (the drift per doubling as a slope from step s; the drift
was measured as the spread of E's slope per doubling over runs), se_b^2 its posterior variance,
and ``u = se_b^2 / sigma_b^2`` the share of the prior's variance the probes left (1 before two
probes, where b = 0, or without a drift, where b is the prior's mean). Probes as noisy as the belief leave b near its prior
mean and u near 1: the belief moves by the expected rise and widens by the drift, much as before
two probes; precise probes set their own slope and u near 0: what they pinned down is no longer
unseen drift. sd(t) grows with t either way.
Before it, b was the plain weighted slope and sd(t)^2 held se_b^2 (t - s)^2 beside the whole
drift: two probes of which one was useless (the AdamW grid's depth 4: a standard error in E of
0.45 to 1813, median 2.2, against a belief's spread of 0.25) gave a steep slope with an unbounded
variance, which priced a probe of sync every 100 to 300 steps to the end of the run. Until
2026-12-05 the prior's mean was 0, so from the second probe on the expected rise stopped counting
however noisy the probes: on the training loss at the AdamW grid's depth 4, where a probe after the
sync warm-up measures nothing usable (31 of 55 windows a standard error in E over twice the
belief's sd, 24 without measurable sync progress), two useless probes kept held-out seed 12 in
sync for 94% of its time.

**The drift grows with the delay**: ``delta = heuristic.delay_drift x k d``, k d = 1 / E_d - 1 the
delay's sensitivity (E_d below). Measured (``scripts/calibrate_drift.py``, docs/results/drift/: E
between successive loss bands of sync-zb's and pipedream+predict's validation curves, its slope
per doubling, relative to max(E, 1/R); seeds 9-11 of the four AdamW and four Muon cells that start
in async, and dev seed 3): with AdamW at d = 3 E rose from 0.26-0.39 to 0.85 between
steps 30 and 120 (relative drift 0.42-0.48 per doubling), at d = 3/8 on synthetic data it stayed
at 0.96-1.05 (0.02-0.05); over 8 cells with AdamW and Muon the median drift over k d is 0.33. Not
every cell fits: at d = 3/8 on tinyshakespeare with AdamW E rose from 0.59-0.84 to 0.91-1.02
(0.13-0.32 per doubling, 0.78-1.87 x k d), a drift the default underrates 3 times. The
default 0.37 is the relative drift of 0.25 that gain used at every delay until 2026-12-03, at the
observation streams' d = 3/2, whose crossing needs it (tests/test_heuristics.py); a drift that
did not shrink with the delay brought a probe of sync at 8 microbatches before the target in
every held-out run that started in async (7 to 12% of a run at depth 8).

**Up to a point**: with AdamW at d = 7 (k d = 3.15) async's efficiency stays low with little
trend: 0.1-0.5 between loss bands over sync's steps 20-670 of the AdamW grid's depth-8 setting
(seeds 3-5), 0.03-0.08 on the synthetic method comparison's 8/1 cell (seeds 9-11, where async
never reaches the target); 0.002-0.17 relative per doubling, median 0.02, 0-0.054 x k d, against
0.42-0.48 at d = 3 on synthetic data; docs/results/drift_long/). So the
drift and the rise grow with k d only up to ``heuristic.drift_taper_kd[0]`` (1.35, AdamW's d = 3,
the longest delay where they were measured to grow), fall linearly to none at ``[1]`` (3.15, d = 7)
and stay none beyond: between the two the shape is not measured. Below 1.35 nothing changes (Muon's
k d is below it up to d = 9). Without a drift the trend's prior has no spread, so from 3.15 on the
probes' slope is not used either (b = 0).

**The drift has a direction**: async's efficiency rises as training goes on, in 22 of the 25
measured runs above (the gradients' change per step, and with it what a stale gradient misses,
shrinks as the loss flattens). Until two probes give their own trend b (whose prior mean it then
is), the belief's mean moves up
by ``tau = heuristic.delay_trend x k d`` per doubling of the step (relative, as the drift), up to
E = 1 (a stale gradient is expected to do no better than a fresh one), in the Kalman step and in
the value of the next probe (after two probes both move by the probes' trend b, whose prior mean
the rise then is; until 2026-12-05 the Kalman step had no trend after two probes and b entered
only the value of a probe, so a belief pulled down by noisy probes never rose again); the default
0.24 is the median over the 8 cells of E's signed slope over k d (``scripts/calibrate_drift.py``). In a run that starts in async
it puts off a probe of sync that the unseen drift alone would bring on (at d = 3, where the drift
is 0.50 per doubling); where E falls instead (the observation streams' crossings), the first two
probes overrule it through their trend (precise there).

**The prior's spread is in logit E** = log(E / (1 - E)), which for E = 1 / (1 + k d) is
-log(k d): an uncertain sensitivity k of the training to the gradient delay d. In E it is
``heuristic.prior_logit_sd`` times E_d (1 - E_d) (the delta method), E_d = 1 / (1 + k d) the
delay's prior (:meth:`.Prober.delay_efficiency`): wide for a long delay, where async may lose half
its progress or all of it, narrow for a short one, where async is nearly sync whatever the data
(E -> 1 as d -> 0). Measured on the method comparison's seeds 0-5 (``scripts/calibrate_prior.py``,
docs/results/prior/: 20 rows over 16 cells, seeds 0-2 at synthetic and tinyshakespeare, AdamW and
Muon, depths 4 and 8, 1 and 8 microbatches, seeds 3-5 at synthetic AdamW), (E - E_d) / (E_d (1 -
E_d)) has a root mean square of 1.10 at d < 1 and 0.91 at d >= 1 (1.01 in all: the default 1.0;
0.78 and 0.97 without the two rows where async never reached the target, whose E = 0 is a bound),
while E's error relative to E_d has 0.20 and 0.56: the relative spread before (0.5 x E) was 2.5
times too wide at 8 microbatches.

A probe at t switches only if the other phase is better, so it is worth its expected improvement
(the normal's partial expectation beyond break-even),

    EI(t) = s phi(z) - m Phi(-z),   m = how far mu(t) is on the current phase's side of 1, z = m / s

with s the spread of what the probe can reveal, ``s = sd^2 / sqrt(sd^2 + n^2)`` for a probe as
noisy as the last ones (standard error n, below; the preposterior spread of a normal belief): a probe of a
flat stretch of the loss, as noisy as the belief, is worth little. Before the first probe n is
``heuristic.probe_se`` x R, by default the A/A test's median on the run's signal
(:data:`PROBE_SE`): until 2026-12-03 it was 0, which valued a first probe as if it
revealed E exactly, while the A/A test of the estimator on the held-out signal (dev seed 3,
depth 4, docs/results/estimator/signal/) gives a probe's E a standard error of 0.49 at the median
of 62 windows (0.62 for the 16 at step 50, the first probe's place): wider than the calibrated
prior at 8 microbatches, so that a first probe there can change little. On the training loss,
the default signal since 2026-12-04, the same test gives 0.90 (docs/results/estimator/training_loss/),
which applies since 2026-12-05; before, the held-out signal's 0.5 did.
After that, n is the lower median of the last three probes' standard errors (since 2026-12-04;
before, the last probe's), a window where sync's progress could not be measured counting as
infinitely noisy (it gives no estimate of E; before, it was passed over). So one useless probe
neither stops the probing (a standard error of 1813 in E, the AdamW grid's depth 4, seed 0, used
to price every later probe at nothing) nor leaves it as it was; two of the last three do (n
infinite: s = 0, so a probe is worth only what the belief already holds, nothing where the
current phase is believed the better one; in the margin's dead band, where the current phase is
kept while believed the worse, it still is). On the
training loss late in a run such windows came one after another (Muon depth 8, held-out seed 3:
three probes of sync in a row, 123 steps apart, each without measurable sync progress); until a
probe has measured anything, n stays that prior noise.

over the time left, ``V(t) = EI(t) x H(t) x step time of the current phase``, H(t) the steps left
(to ``max_steps``; in a run that stops at a target, whose end is unknown, as many as have passed,
at most that). It costs
``C = max(0, m) x leg x step time of the probed phase`` (the probe runs the phase believed worse;
nothing if the probed phase is believed the better one) plus its two switches (drain and fill,
predicted, and the loss jumps measured at the last probe's switches). The next probe is at the first t, at least ``window`` steps on, with V(t) >= C: soon
when the estimate is uncertain or drifts toward break-even (the late phase, where async's
efficiency falls as the loss flattens), rarely or never when one phase dominates or too little of
the run remains to profit. The first probe is priced the same way, from the prior
(:meth:`.Prober.prior_phase`) with a spread of ``heuristic.prior_logit_sd`` in logit E.

**Switch costs.** A switch costs its drain and fill (predicted) and the loss jumps measured at
the last probe's switches (:mod:`.estimate`'s level terms), in steps of sync's progress: jump /
sync's rate. A jump counts only beyond ``heuristic.confidence`` standard errors (since
2026-12-04; before, every positive jump counted). On the training loss late in a run the jumps
are mostly noise: on the AdamW grid's depth 4 (seeds 1 and 2, steps 400 to 800) they were -0.36
to 0.39 with standard errors of 0.08 to 0.53, and divided by a sync rate of 3e-5 to 9e-3 per
step they priced one switch at up to 3,600 steps of sync, which kept a run in sync where its
own verdict had async ahead (E x R = 1.20). Counting every positive jump, as before, charged
pure noise at half the switches; a negative jump still counts as nothing.

**A decisive probe is adopted at once** (a probe of sync: after the first verdict). At the end of a probe's leg the probe is judged on the
steps before it and those of its own steps observed by then (decisions run ``lag`` steps ahead
of the observations, so the last ``lag`` steps of the leg are not seen yet: 12 of 20 at depth 8
with one microbatch). If the probed phase wins decisively (at least twice the
goodput, beyond the confidence), it stays current at once, without the return leg to the current
phase that an interpolating verdict needs (which costs a round trip of switches). A probe of
sync at the run's first verdict (a run that starts in async) always has its return leg: it comes
earliest in training, where a trend
in the phases' merits, which that extrapolation reads as a difference, is steepest, and a run that
adopts sync then seldom probes async again (:meth:`.Prober.judge_at_leg_end`). With
``heuristic.undo_probes`` a probe of async from sync is settled there: kept and adopted if async
wins it clearly, otherwise undone (the run goes back to its state before the probe, the belief
keeping the probe's estimate). Otherwise the probe goes on as in ``goodput``.
"""

from __future__ import annotations

import math

from .base import ASYNC, SYNC, Context, Decision, Observation
from .estimate import fit_rates
from .probing import CLEAR, DECISIVE, UNCLEAR, Prober, other


# The standard error in E a probe has on each signal before one has measured anything: the median
# of the estimator's A/A test (``scripts/probe_estimator.py``: stretches of runs without a switch
# labelled as a probe's window, dev seed 3, gpt-micro, AdamW, depth 4 with 1 and 8 microbatches,
# synthetic data and tinyshakespeare; docs/results/estimator/), a window without measurable sync
# progress counting as infinitely noisy: 0.497 over 64 windows of the held-out signal, 0.904 over
# 102 of the training loss (0.80 over its 88 fitted windows; at tinyshakespeare with one
# microbatch, the grids' kind of cell, 10 of its 14 probes of sync measured nothing). Until
# 2026-12-05 the held-out signal's 0.5 applied to the training loss too.
PROBE_SE = {"heldout": 0.5, "train": 0.9}


def prior_probe_se(heuristic) -> float:
    """A heuristic config's (or its dict's) ``probe_se``, or by default the median standard error in
    E of the estimator's A/A test on its signal (:data:`PROBE_SE`)."""
    if heuristic.get("probe_se") is not None:
        return float(heuristic["probe_se"])
    return PROBE_SE[heuristic.get("signal", "train")]


def expected_improvement(m: float, sd: float) -> float:
    """E[max(0, -X)] for X ~ Normal(m, sd^2): how much a switch gains on average, when the current
    phase is believed ``m`` better (in goodput) with spread ``sd``."""
    if sd <= 0:
        return max(0.0, -m)
    z = m / sd
    return sd * math.exp(-0.5 * z * z) / math.sqrt(2 * math.pi) - m * 0.5 * math.erfc(z / math.sqrt(2))


def taper(kd: float, span) -> float:
    """1 up to ``span[0]``, 0 from ``span[1]`` on, linear in k d between (``span`` None: 1)."""
    if span is None:
        return 1.0
    lo, hi = span
    return 1.0 if kd <= lo else 0.0 if kd >= hi else (hi - kd) / (hi - lo)


class Gain(Prober):
    name = "gain"

    def __init__(self, cfg, ctx: Context):
        super().__init__(cfg, ctx)
        # the belief about E: the prior, then a Kalman filter over the probes' estimates
        self.E = self.prior_efficiency()
        e_d = self.delay_efficiency()
        self.var = (cfg.prior_logit_sd * e_d * (1.0 - e_d)) ** 2  # (E's sd per unit of logit E's: E_d (1 - E_d))
        # the relative drift per doubling of the step: heuristic.delay_drift x k d (k d = 1 / E_d - 1),
        # and E's expected rise per doubling, heuristic.delay_trend x k d
        # (both tapered off between the k d of heuristic.drift_taper_kd: gone at a long delay)
        kd = 1.0 / e_d - 1.0
        share = taper(kd, cfg.drift_taper_kd)
        self.drift, self.rise = cfg.delay_drift * kd * share, cfg.delay_trend * kd * share
        first = self.next_probe  # the warm-up and one window (Prober's)
        self.belief_step = max(1, first)
        self.probes: list[tuple[int, float, float]] = []  # (step, G of the probe, its standard error)
        self.noises: list[float] = []  # each probe window's standard error in G (inf: sync's progress not measurable)
        self.switch_steps = 0.0  # the loss jumps of the last probe's switches, in sync steps of progress
        R = self.R()
        self.next_probe = self.worth_probing(first, first, R * self.E, math.sqrt(self.var) * R, R, self.current, {})

    def R(self, window: list[Observation] | None = None) -> float:
        if window:
            return self.step_time_ratio(window, SYNC, ASYNC)
        return self.ctx.sync_step_time / self.ctx.async_step_time if self.ctx.async_step_time > 0 else 1.0

    def update(self, step: int, e_hat: float, se: float, R: float) -> None:
        """One Kalman step: since the last probe the belief rises by E's expected trend (``self.rise``
        per doubling of the step; after two probes, by their trend :meth:`trend`, whose prior mean
        that rise is) and widens by the unseen drift (``self.drift``), both relative to E or to
        break-even 1/R, whichever is larger; then it takes in the probe's estimate by its
        precision."""
        scale = max(abs(self.E), 1.0 / R if R > 0 else 0.0)
        doublings = math.log2(max(step, 1) / self.belief_step)
        widen = self.drift * scale * doublings
        if len(self.probes) < 2:
            move = self.rise * scale * doublings
        else:  # the probes' trend (G per step, its prior's mean the expected rise: see :meth:`trend`)
            # as a change per doubling from the belief's step, as the rise and the drift are
            move = self.trend(self.belief_step, R * scale)[0] * self.belief_step * doublings / R if R > 0 else 0.0
        # (a stale gradient is expected to do no better than a fresh one, and to make no negative
        # progress: a move stops at E = 1 going up and at E = 0 going down)
        prior_E = max(self.E, min(1.0, self.E + move)) if move > 0 else min(self.E, max(0.0, self.E + move))
        prior_var = self.var + widen * widen
        k = prior_var / (prior_var + se * se) if prior_var + se * se > 0 else 1.0
        self.E, self.var, self.belief_step = prior_E + k * (e_hat - prior_E), (1 - k) * prior_var, max(step, 1)

    def judge(self, window: list[Observation], current: str, probed: str):
        c = self.cfg
        rates = fit_rates([o.phase for o in window], [o.loss for o in window], [1.0] * len(window),
                          transients=True, settle=self.settle)
        R = self.R(window)
        if rates is None or rates.sync <= 0:
            self.noises.append(math.inf)  # (no estimate of E: as noisy as can be)
            return current, "no measurable sync progress in the window", {"R": R, "E": self.E}, UNCLEAR
        step = window[-1].step
        e_hat, se = rates.async_ / rates.sync, rates.diff_se / rates.sync
        self.update(step, e_hat, se, R)
        self.probes.append((step, e_hat * R, se * R))
        self.noises.append(se * R)
        # a switch's loss jump counts only where the window tells it from noise (beyond `confidence`
        # standard errors): see "Switch costs" above
        self.switch_steps = rates.switch_jumps(c.confidence) / rates.sync
        times = self.step_times(window, steady=False)
        g, sd = self.E * R, math.sqrt(self.var) * R
        # a switch pays once (drain and fill, and its loss jump) and profits over the rest of the run
        cost = (self.ctx.switch_time + self.switch_steps * times[SYNC]) / max(1e-9, self.horizon(step) * times[current])
        info = {"E": self.E, "E_sd": math.sqrt(self.var), "E_probe": e_hat, "E_probe_se": se, "R": R,
                "goodput": g, "switch_cost": cost, "switch_steps": self.switch_steps}
        z = abs(g - 1.0) / sd if sd > 0 else math.inf
        level = DECISIVE if z > c.confidence and (g > 2 or g < 0.5) else CLEAR if z > 1 else UNCLEAR
        if g > 1 + c.margin + cost:
            return ASYNC, f"E x R = {self.E:.3f} x {R:.3f} = {g:.3f} (sd {sd:.3f}) > 1 + margin + {cost:.3f}", info, level
        if g < 1 - c.margin - cost:
            return SYNC, f"E x R = {self.E:.3f} x {R:.3f} = {g:.3f} (sd {sd:.3f}) < 1 - margin - {cost:.3f}", info, level
        return current, f"{current} kept: E x R = {g:.3f} (sd {sd:.3f}) within margin + {cost:.3f} of 1", info, UNCLEAR

    def next_interval(self, step: int, window: list[Observation], winner: str, confirmed: bool) -> int:
        R = self.R(window)
        at = self.worth_probing(step, step + self.cfg.window, self.E * R, math.sqrt(self.var) * R, R, winner,
                                self.step_times(window, steady=False))
        return at - step

    def trend_prior_sd(self, now: int, scale: float) -> float:
        """The sd of the prior on the trend's slope (G per step): the unseen drift per doubling,
        ``drift x scale``, as a slope over the doubling from step ``now`` (``scale`` = max(|G|, 1))."""
        return self.drift * scale / max(now, 1)

    def trend_prior_mean(self, now: int, scale: float) -> float:
        """The mean of the prior on the trend's slope (G per step): E's expected rise per doubling,
        ``rise x scale``, as a slope over the doubling from step ``now``."""
        return self.rise * scale / max(now, 1)

    def trend(self, now: int, scale: float) -> tuple[float, float]:
        """Slope of G over steps from the last four probes and its variance: weighted least squares
        with a normal prior on the slope, mean :meth:`trend_prior_mean` and sd
        :meth:`trend_prior_sd`; (0, 0) before two probes, the prior's mean without a drift. The
        drift is the measured spread of E's slope per doubling over runs
        (``scripts/calibrate_drift.py``), so it is the slope's prior: probes as noisy as the belief (a flat stretch of the loss) leave the
        slope near its prior's mean (E's expected rise) with the drift's spread, instead of a steep
        slope from two noisy points whose variance, extrapolated over the steps to come, made every
        later probe look worth its cost (the AdamW grid's depth 4: a probe of sync every 100 to 300
        steps to the end, each with a standard error of 0.45 to 1813 in E)."""
        pts = self.probes[-4:]
        sd_prior = self.trend_prior_sd(now, scale)
        if len(pts) < 2:
            return 0.0, 0.0
        if sd_prior <= 0:  # (a prior without spread: its mean)
            return self.trend_prior_mean(now, scale), 0.0
        w = [1.0 / max(se, 1e-6) ** 2 for _, _, se in pts]
        sw = sum(w)
        xm = sum(wi * s for wi, (s, _, _) in zip(w, pts)) / sw
        ym = sum(wi * g for wi, (_, g, _) in zip(w, pts)) / sw
        sxx = sum(wi * (s - xm) ** 2 for wi, (s, _, _) in zip(w, pts))
        sxy = sum(wi * (s - xm) * (g - ym) for wi, (s, g, _) in zip(w, pts))
        precision = sxx + 1.0 / sd_prior ** 2
        return (sxy + self.trend_prior_mean(now, scale) / sd_prior ** 2) / precision, 1.0 / precision

    def worth_probing(self, now: int, earliest: int, g: float, se: float, R: float, current: str,
                      times: dict[str, float]) -> int:
        """The first step t >= ``earliest`` at which a probe's value V(t) reaches its cost C (see
        above), or ``max_steps`` (no more probes) if none does; ``g`` and ``se`` are goodput, E x ``R``."""
        ctx, c = self.ctx, self.cfg
        times = times or {SYNC: ctx.sync_step_time or 1.0, ASYNC: ctx.async_step_time or 1.0}
        probed = other(current)
        scale = max(abs(g), 1.0)  # (relative to G or to break-even: see below)
        b, var_b = self.trend(now, scale)
        # the share of the trend's prior variance the probes left (1: nothing learnt, as before two
        # probes): that much of the drift is still unseen; what they pinned down is b's
        share = var_b / self.trend_prior_sd(now, scale) ** 2 if var_b > 0 else 1.0
        sign = 1.0 if current == ASYNC else -1.0  # m > 0: the current phase is believed better
        rate = {SYNC: 1.0, ASYNC: max(g, 0.0)}
        # the probe's leg loses only where the probed phase is believed worse (a current phase kept
        # within the margin may be believed the worse one)
        cost = (max(0.0, sign * (g - 1.0)) * self.leg(probed) * times[probed]
                + 2 * ctx.switch_time * rate[current] + self.switch_steps * times[SYNC])
        # before any probe, the standard error a probe's estimate of E has on this signal
        # (heuristic.probe_se): a first probe reveals E no more exactly than later ones
        noise = self.probe_noise(R)
        stride = max(1, c.window // 3)
        # E's expected rise (heuristic.delay_trend) until two probes give their own trend b, then
        # b's prior mean; either up to E = 1 (a fresh gradient's progress)
        rise = self.rise if len(self.probes) < 2 else 0.0
        for t in range(earliest, ctx.max_steps, stride):
            dt = t - now
            # scale-free: as much per doubling of the step, relative to G or to break-even (1),
            # whichever is larger: a phase far behind can still come back
            doublings = math.log2(t / max(now, 1))
            up = max(0.0, min(rise * scale * doublings, R - g))  # up to E = 1 (G = R)
            m = sign * (g + min(b * dt, max(0.0, R - g)) + up - 1.0)
            unseen = self.drift * scale * doublings
            sd2 = se * se + share * unseen * unseen
            # what the probe can reveal: the spread of the estimate after it, a probe being as
            # noisy as the last ones (preposterior sd; a probe noisier than the belief tells little)
            sd = sd2 / math.sqrt(sd2 + noise * noise) if sd2 > 0 else 0.0
            value = expected_improvement(m, sd) * self.horizon(t) * times[current]
            if value >= cost:
                return t
        return ctx.max_steps

    def probe_noise(self, R: float) -> float:
        """The standard error (in G) the next probe is expected to have: the lower median of the last
        three probe windows' (one without measurable sync progress counting as infinite), or
        :func:`prior_probe_se` x R until a window has measured something."""
        if not any(math.isfinite(n) for n in self.noises):
            return prior_probe_se(self.cfg) * R
        last = sorted(self.noises[-3:])
        return last[(len(last) - 1) // 2]

    def horizon(self, t: int) -> int:
        """Steps left after step t: to ``max_steps``, or in a run that stops at a target (its end
        unknown) as many as have passed, at most that (a run is as likely to be half done as not)."""
        left = self.ctx.max_steps - t
        return min(left, t) if self.ctx.extra.get("open_ended") else left

    def early_verdict(self, step: int, probed: str) -> Decision | None:
        """Adopt a probed phase that wins decisively at the end of its leg; keep (and adopt) or undo
        a tentative probe of async there (:meth:`.Prober.judge_at_leg_end`)."""
        return self.judge_at_leg_end(step, probed, adopt=True)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "E": self.E, "var": self.var, "belief_step": self.belief_step,
                "probes": [list(p) for p in self.probes], "switch_steps": self.switch_steps,
                "noises": [n if math.isfinite(n) else None for n in self.noises]}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.E, self.var, self.belief_step = state["E"], state["var"], state["belief_step"]
        self.probes = [tuple(p) for p in state.get("probes", [])]
        self.switch_steps = state.get("switch_steps", 0.0)
        # (a state from before the noises were kept: the measured probes')
        noises = state.get("noises", [p[2] for p in self.probes])
        self.noises = [math.inf if n is None else n for n in noises]
