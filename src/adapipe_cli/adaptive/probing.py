"""Exploit one phase, probe the other now and then, and judge from a window that holds both.

The common skeleton of ``rate`` and ``goodput``: after ``heuristic.sync_warmup`` steps in sync
(:meth:`Prober.sync_warmup`: an async stretch early in training does lasting damage), then the
learning-rate warm-up and ``window`` more steps in ``heuristic.start`` (the loss falls too steeply
at first for two stretches of it to be compared), run the *current* phase; every ``interval`` steps run the other phase for a leg of
``probe_steps`` steps plus its settling (the steps after a switch the rates leave out: a few times
the staleness into async, one staleness into sync), return to the current phase for a leg of its
own, and once those have been observed let ``judge`` (the heuristic's own rule) say which phase
becomes current, from the window [``window`` steps before the probe, the probe, the steps after
it]. The current phase on both sides of the probe pins down the common trend of the loss curve
(interpolation rather than extrapolation), which keeps the comparison's standard errors honest;
the price is one extra round trip when a probe wins.

How often: ``probe_every`` steps, times the step-time ratio of the probed phase to the current one
when the probed phase is slower (a probe of sync from async in a deep pipeline costs several async
steps per step; probing then takes the same share of the time as ``probe_every`` would at equal
speeds). A decisive verdict (one phase at least twice as fast), or a clear one (significant and
beyond the margin) that confirms the previous one, doubles the interval to the next probe (never
the first verdict: it comes earliest in training, where the phases' merits change fastest), up to
``backoff`` times that base: a phase that dominates costs little probing. An unclear one (near
break-even, where the choice matters least but can change) resets it to the base.

With ``heuristic.undo_probes`` a probe of async from sync is tentative: it is judged at the end of
its leg (:meth:`Prober.judge_at_leg_end`); if async won it clearly it is kept and adopted at once,
otherwise the training loop takes the run back to its state before the probe (the probe's time
stays on the clock).

Decisions are made ``lag`` steps ahead (``decide(u)`` sees observations up to ``u - lag``).
"""

from __future__ import annotations

import copy
from collections import deque
from statistics import median

from .base import ASYNC, SYNC, Context, Decision, Heuristic, Observation


UNCLEAR, CLEAR, DECISIVE = 0, 1, 2  # how strongly a verdict speaks


def other(phase: str) -> str:
    return ASYNC if phase == SYNC else SYNC


class Prober(Heuristic):
    def __init__(self, cfg, ctx: Context):
        super().__init__(cfg, ctx)
        if cfg.start not in (SYNC, ASYNC, "auto"):
            raise ValueError(f"heuristic.start={cfg.start!r}: use sync, async or auto")
        self.current = cfg.start if cfg.start != "auto" else self.prior_phase()
        # observations after a switch left out of the rates, by the phase switched into: into
        # async, the oscillation that weights turned stale all at once start lasts a few times the
        # first stage's staleness (measured on gpt-micro at depth 8: about 30 steps of little
        # progress); into sync, only the drained microbatches' stale updates (one staleness)
        self.settle = {ASYNC: 4 * (ctx.lookahead + 1), SYNC: ctx.lookahead + 1}
        self.mode = "warmup"
        self.interval = cfg.probe_every
        self.sync_until = self.sync_warmup()
        # a start in async after the sync warm-up first settles (its switch's transient), then fills a window
        settled = self.sync_until + (self.settle[ASYNC] if self.sync_until and self.current == ASYNC else 0)
        self.next_probe = max(ctx.lr_warmup, settled) + cfg.window
        self.probe_start = -1
        # the probe in progress is tentative (heuristic.undo_probes: a probe of async from sync,
        # undone at the end of its leg unless async won it clearly)
        self.tentative = False
        self.last_winner: str | None = None  # the previous clear verdict
        self.verdicts = 0
        self.history: deque[Observation] = deque(maxlen=cfg.window + 2 * cfg.probe_steps + 8 * ctx.lookahead + 24)
        self.last_estimates: dict = {}

    def prior_phase(self) -> str:
        """``heuristic.start=auto``: async if its predicted throughput advantage R (simulator, same
        cost profile) times a prior statistical efficiency E exceeds 1, else sync. The first probe
        corrects a wrong prior, but a switch into async is expensive in a deep pipeline, so the
        start matters."""
        ctx = self.ctx
        r = ctx.sync_step_time / ctx.async_step_time if ctx.async_step_time > 0 else 1.0
        return ASYNC if r * self.prior_efficiency() > 1.0 else SYNC

    def sync_warmup(self) -> int:
        """``heuristic.sync_warmup``, or by default ``100 max(3, d)`` steps with the Adam family when
        the run starts in sync, d = (p - 1) / m the mean gradient delay of async in steps (300 up to
        depth 4 with one microbatch, 700 at depth 8); 0 with Muon, and 0 when the run starts in
        async (``heuristic.start=async``, or ``auto`` with the prior on async: the prior's E already
        charges the delay, and a start in async meets its first probe of sync after a window).

        Measured (AdamW, gpt-micro on tinyshakespeare, depth 4 and 8 with one microbatch of 4, seed
        7, not a grid seed): one probe of async, 40 steps at depth 4 (56 at 8) from step 50, leaves
        the run 120 steps behind sync at perplexity 211 and 170 behind at 150 (depth 8: 230 steps
        behind at 212.9), far more than the probe's own steps; the same 40 steps from step 300 or 600
        leave it 20 and 10 steps behind at perplexity 120, about what the probe's slower progress
        accounts for. At depth 8 (d = 7), 56 steps from step 300 still leave it 150 steps behind at
        perplexity 150 and it never catches up in 900 steps; from step 700 it is 40 steps behind at
        perplexity 120 and level at 105 (step 1210 both, and ahead on the clock): the damage lasts
        while the delay is long against the steps trained, so the warm-up grows with d. Below d = 3
        it is not measured and stays 300. With Muon async led from the start in every cell of the cpu
        grid, and its early damage is not measured: no warm-up. With ``heuristic.undo_probes`` the
        warm-up is the same, and a probe of async after it that async does not clearly win is undone,
        its damage with it.

        The start in async skips the warm-up since 2026-12-02: before, the warm-up forced sync
        whatever the start, so a prior on async (a short delay d, or synthetic data) only began
        after it, and on the method comparison's synthetic data that cost 32 to 45%. Until then
        ``undo_probes`` skipped the warm-up instead, which cost 14 to 23% where the run starts in
        sync: its first probe came early and was undone."""
        if self.cfg.get("sync_warmup") is not None:
            return int(self.cfg.sync_warmup)
        if self.ctx.extra.get("optimizer") == "muon" or self.current == ASYNC:
            return 0
        return round(100 * max(3.0, (self.ctx.stages - 1) / self.ctx.microbatches))

    def prior_efficiency(self) -> float:
        """``heuristic.prior_efficiency``, or by default E = 1 / (1 + k d): d = (p - 1) / m, the
        mean gradient delay of async in steps, and k measured on this kind of machine with weight
        prediction (the async default), as sync's steps to a target over async's.
        - Muon: k = 0.14 (E from 0.96 at d = 0.25 to 0.49 at d = 7), on gpt-micro/tinyshakespeare at
          depths 2 to 8 and 1 to 8 microbatches (not remeasured under global clipping).
        - The Adam family: k = 0.45, remeasured under global clipping on held-out seeds 7 and 8 (not
          grid seeds) at the grid's settings (AdamW, gpt-micro, one microbatch of 4 sequences, depths
          4 and 8, sync's steps to perplexity 211 at depth 4 and 212.9 at depth 8 over
          pipedream+predict's: E = 0.24 and 0.43 at d = 3, 0.25 and 0.28 at d = 7; k the least-squares
          fit of 1/E - 1 = k d). The form fits poorly: E hardly moves from d = 3 to 7 here. The
          earlier k = 0.25 came from per-stage clipping and an earlier target."""
        if self.cfg.prior_efficiency is not None:
            return float(self.cfg.prior_efficiency)
        return self.delay_efficiency()

    def delay_efficiency(self) -> float:
        """E_d = 1 / (1 + k d), the prior efficiency of the run's gradient delay d = (p - 1) / m
        and its optimizer's k (:meth:`prior_efficiency`), whatever ``heuristic.prior_efficiency``
        says."""
        k = 0.14 if self.ctx.extra.get("optimizer") == "muon" else 0.45
        return 1.0 / (1.0 + k * (self.ctx.stages - 1) / self.ctx.microbatches)

    def observe(self, obs: Observation) -> None:
        self.history.append(obs)

    def observed_through(self) -> int:
        return self.history[-1].step if self.history else -1

    def decide(self, step: int) -> Decision:
        c = self.cfg
        probed = other(self.current)
        if self.mode == "warmup":
            if step < self.sync_until:
                return Decision(SYNC, f"sync warm-up ({self.sync_until} steps)")
            if step < self.next_probe:
                return Decision(self.current, "warm-up")
            self.mode = "exploit"
        if self.mode == "exploit":
            if step < self.next_probe:
                return Decision(self.current, "exploit")
            self.mode, self.probe_start = "probe", step
            self.tentative = probed == ASYNC and self.undo_probes()
            if self.tentative:
                return Decision(probed, f"probe {probed} for {self.leg(probed)} steps, undone if it loses", tentative=True)
        if self.mode == "probe":
            if step < self.probe_start + self.leg(probed):
                return Decision(probed, f"probe {probed} for {self.leg(probed)} steps")
            early = self.early_verdict(step, probed)
            if early is not None:
                return early
            self.mode = "after"
        # back in the current phase until the steps after the probe have been observed
        if self.observed_through() < self.probe_start + self.leg(probed) + self.leg(self.current) - 1:
            return Decision(self.current, "after probe")
        window = [o for o in self.history if o.step >= self.probe_start - c.window]
        winner, reason, info, clear = self.judge(window, self.current, probed)
        self.last_estimates = info
        # a verdict extends the interval if it is decisive (one phase at least twice as fast), or
        # clear and the same as the one before: the first probes fall early in training, when the
        # phases' relative merit still changes fast
        first = self.verdicts == 0
        self.verdicts += 1
        confirmed = not first and (clear == DECISIVE or (bool(clear) and winner == self.last_winner))
        self.current, self.last_winner = winner, winner if clear else None
        self.interval = self.next_interval(step, window, winner, confirmed)
        self.mode, self.next_probe = "exploit", step + self.interval
        self.tentative = False  # (a tentative probe never gets here: it is kept or undone at the end of its leg)
        return Decision(winner, reason, info)

    def judge_at_leg_end(self, step: int, probed: str, adopt: bool) -> Decision | None:
        """Judge the probe at the end of its leg, on the steps before it and those of its own
        observed by then (the last ``lag`` are not yet). A tentative probe is kept only if async
        wins it clearly (beyond the margin, significantly), and is then adopted at once; otherwise
        it is undone, so a probe costs at most its own steps, never lasting damage (an unclear
        probe's progress is given up with it). With ``adopt`` a probed phase that wins decisively
        is adopted, except sync at the first verdict: judged on the steps before the probe and its
        own, a verdict extrapolates, and early in training, where the phases' merits change
        fastest, a trend in them reads as a difference (the return leg's interpolation cancels it),
        and a run that adopts sync early seldom probes async again. Measured
        on the method comparison's synthetic AdamW data at depth 4 with one microbatch (held-out
        seeds 3 and 4): async far behind in steps 20 to 50 and sync far ahead in steps 50 to 75
        adopted sync for good (G = 0.37 and 0.27), while pipedream+predict, 2x sync's progress per
        second past perplexity 30, reached the target in 0.74x sync-zb's time. A first probe of
        async from sync that wins decisively is still adopted at once: on the streams of
        tests/test_heuristics.py its return leg cost a leg of sync steps and more probes of sync
        later, for no better verdict. Otherwise every
        estimate stays as it was and None goes back to the current phase for the return leg."""
        window = [o for o in self.history if o.step >= self.probe_start - self.cfg.window]
        saved = copy.deepcopy(self.state_dict())
        winner, reason, info, clear = self.judge(window, self.current, probed)
        first = self.verdicts == 0
        if self.tentative:
            won = winner == probed and clear != UNCLEAR
        else:
            won = adopt and winner == probed and clear == DECISIVE and not (first and probed == SYNC)
        lost = self.tentative and not won
        if not (lost or won):
            self.load_state_dict(saved)
            return None
        self.last_estimates, self.verdicts = info, self.verdicts + 1
        confirmed = not first and (won or clear == DECISIVE or (bool(clear) and winner == self.last_winner))
        self.current, self.last_winner = (probed, probed) if won else (self.current, winner if clear else None)
        self.interval = self.next_interval(step, window, self.current, confirmed)
        self.mode, self.next_probe = "exploit", step + self.interval
        self.tentative = False
        if lost:
            return Decision(self.current, f"at the end of the probe: {reason}; the probe of async undone", info,
                            undo=self.probe_start)
        return Decision(self.current, f"{'clear' if clear != DECISIVE else 'decisive'} at the end of the probe: {reason}", info)

    def undo_probes(self) -> bool:
        """``heuristic.undo_probes``: probes of async from sync are tentative (undone unless async wins them clearly)."""
        return bool(self.cfg.get("undo_probes", False))

    def rewind(self, step: int) -> None:
        while self.history and self.history[-1].step > step:
            self.history.pop()

    def next_interval(self, step: int, window: list[Observation], winner: str, confirmed: bool) -> int:
        """Steps from the verdict at ``step`` to the next probe: ``probe_every`` steps of the probed
        phase's speed (a probe of a phase k times slower per step costs k times more, so it comes k
        times less often: probing costs a bounded share of the time, whichever phase is current),
        doubled after a confirmed verdict up to ``backoff`` times that base."""
        c = self.cfg
        base = round(c.probe_every * max(1.0, self.step_time_ratio(window, other(winner), winner)))
        return min(2 * self.interval, c.backoff * base) if confirmed else base

    def early_verdict(self, step: int, probed: str) -> Decision | None:
        """A verdict at the end of a probe's leg, before the leg of the current phase that follows
        it (None: go back to the current phase): a tentative probe is kept or undone there
        (:meth:`judge_at_leg_end`)."""
        return self.judge_at_leg_end(step, probed, adopt=False) if self.tentative else None

    def leg(self, phase: str) -> int:
        """Steps of a stretch of ``phase`` within a probe: ``probe_steps`` observed after its settling."""
        return self.cfg.probe_steps + self.settle[phase]

    def step_times(self, window: list[Observation], steady: bool = True) -> dict[str, float]:
        """Each phase's median step time over the window's steady steps (those after a full
        lookahead in one phase: no fill or drain; with ``steady=False`` every step), or the
        simulator's prediction for the run's cost profile for a phase not seen."""
        look = self.ctx.lookahead + 1
        if steady:
            window = [o for i, o in enumerate(window) if i > look and all(w.phase == o.phase for w in window[i - look:i])]
        t = {}
        for ph, predicted in ((SYNC, self.ctx.sync_step_time), (ASYNC, self.ctx.async_step_time)):
            seen = [o.step_time for o in window if o.phase == ph]
            t[ph] = median(seen) if seen else predicted
        return t

    def step_time_ratio(self, window: list[Observation], a: str, b: str) -> float:
        """Step time of phase ``a`` over that of ``b`` (:meth:`step_times`)."""
        t = self.step_times(window)
        return t[a] / t[b] if t[b] > 0 else 1.0

    def judge(self, window: list[Observation], current: str, probed: str) -> tuple[str, str, dict, int]:
        """Which phase becomes current, why, the estimates behind it, and how clear the verdict
        was: UNCLEAR, CLEAR (significant and beyond the margin) or DECISIVE (clear, and the winner
        at least twice as fast)."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {"current": self.current, "mode": self.mode, "interval": self.interval, "next_probe": self.next_probe,
                "sync_until": self.sync_until, "tentative": self.tentative,
                "last_winner": self.last_winner, "verdicts": self.verdicts,
                "probe_start": self.probe_start, "history": [o.__dict__ for o in self.history],
                "last_estimates": self.last_estimates}

    def load_state_dict(self, state: dict) -> None:
        self.current, self.mode, self.interval = state["current"], state["mode"], state["interval"]
        self.next_probe, self.probe_start = state["next_probe"], state["probe_start"]
        self.sync_until = state.get("sync_until", 0)  # a state saved before the warm-up existed had none
        self.last_winner = state.get("last_winner")
        self.tentative = state.get("tentative", False)
        self.verdicts = state.get("verdicts", 0)
        self.history.clear()
        self.history.extend(Observation(**o) for o in state["history"])
        self.last_estimates = state.get("last_estimates", {})
