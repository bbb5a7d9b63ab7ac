"""Switching heuristics on synthetic observation streams with known rates."""

from __future__ import annotations

import math

import numpy as np
import pytest
from omegaconf import OmegaConf

from adapipe_cli.adaptive.base import Context, Observation, build_heuristic
from adapipe_cli.adaptive.estimate import fit_rates
from adapipe_cli.config.schema import HeuristicConfig

LAG = 3


class Env:
    """A training run in miniature: a phase advances 'progress' by ``gain[phase]`` per step and
    takes ``time[phase]`` seconds; the loss is 1 + 4 exp(-k progress) plus Gaussian noise."""

    def __init__(self, gain, time, noise=0.01, k=0.002, seed=0):
        self.gain, self.time, self.noise, self.k = gain, time, noise, k
        self.rng = np.random.default_rng(seed)
        self.progress = self.t = 0.0
        self.step = 0

    def run(self, phase: str) -> Observation:
        self.progress += self.gain[phase]
        dt = self.time[phase]
        self.t += dt
        loss = 1 + 4 * math.exp(-self.k * self.progress) + self.noise * self.rng.normal()
        obs = Observation(self.step, phase, loss, self.t, dt, 1.0 if phase == "async" else 0.0)
        self.step += 1
        return obs


def heuristic(name, switch_time=0.0, **overrides):
    cfg = OmegaConf.structured(HeuristicConfig)
    cfg.name = name
    overrides.setdefault("start", "sync")  # the streams below start in sync unless a test says otherwise
    for k, v in overrides.items():
        cfg[k] = v
    ctx = Context(stages=4, microbatches=2, max_steps=10_000, lookahead=LAG - 1, sync_step_time=1.0,
                  async_step_time=0.5, switch_time=switch_time)
    return build_heuristic(cfg, ctx)


def drive(h, env: Env, steps: int) -> tuple[list[str], list[str]]:
    """The training loop's protocol: phases decided LAG steps ahead. Returns the phases run and
    the heuristic's current phase after each decision (what it settled on, probes aside)."""
    phases = [h.decide(u).phase for u in range(LAG)]
    settled = []
    for t in range(steps):
        h.observe(env.run(phases[t]))
        phases.append(h.decide(t + LAG).phase)
        settled.append(h.current)
    return phases[:steps], settled


def adoptions(settled: list[str]) -> int:
    return sum(a != b for a, b in zip(settled, settled[1:]))


ASYNC_WINS = dict(gain={"sync": 1.0, "async": 0.8}, time={"sync": 1.0, "async": 0.5})  # 1.6 vs 1 per second
SYNC_WINS = dict(gain={"sync": 1.0, "async": 0.3}, time={"sync": 1.0, "async": 0.5})  # 0.6 vs 1
EQUAL = dict(gain={"sync": 1.0, "async": 0.5}, time={"sync": 1.0, "async": 0.5})  # 1 vs 1


@pytest.mark.parametrize("name", ["rate", "goodput"])
def test_a_clearly_faster_async_is_chosen_within_a_bounded_number_of_windows(name):
    h = heuristic(name)
    phases, settled = drive(h, Env(**ASYNC_WINS), 600)
    first_async = settled.index("async")
    assert first_async <= h.cfg.window + h.leg("sync") + h.leg("async") + 2 * LAG  # after the warm-up and one probe
    assert phases[300:].count("async") / 300 > 0.85
    assert adoptions(settled) == 1


@pytest.mark.parametrize("name", ["rate", "goodput"])
def test_a_clearly_faster_sync_is_chosen_starting_from_async(name):
    h = heuristic(name, start="async")
    phases, settled = drive(h, Env(**SYNC_WINS), 600)
    assert settled.index("sync") <= h.cfg.window + h.leg("sync") + h.leg("async") + 2 * LAG
    assert phases[300:].count("sync") / 300 > 0.85  # probes of async remain, fewer and fewer
    assert adoptions(settled) == 1


@pytest.mark.parametrize("name", ["rate", "goodput"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_equal_rates_with_noise_switch_rarely(name, seed):
    h = heuristic(name)
    phases, settled = drive(h, Env(**EQUAL, noise=0.02, seed=seed), 1500)
    assert adoptions(settled) <= 2
    # lost probes back off: far fewer probes than one per probe_every steps
    probes = sum(1 for a, b in zip(phases, phases[1:]) if a == "sync" and b == "async")
    assert probes <= 1500 // h.cfg.probe_every


def stretches(phases: list[str], phase: str) -> list[tuple[int, int]]:
    """(first step, length) of every maximal run of ``phase``."""
    out, start = [], None
    for i, ph in enumerate([*phases, None]):
        if ph == phase and start is None:
            start = i
        elif ph != phase and start is not None:
            out.append((start, i - start))
            start = None
    return out


@pytest.mark.parametrize("name", ["rate", "goodput"])
def test_a_slower_phase_is_probed_for_a_shorter_leg_and_less_often(name):
    """Async current and twice as fast per step: a probe of sync settles for one staleness, not
    the four of a switch into async, and the next probe comes after 2 x probe_every steps, so
    probing takes the share of time probe_every gives at equal speeds."""
    h = heuristic(name, start="async")
    assert h.leg("sync") == h.cfg.probe_steps + LAG < h.leg("async") == h.cfg.probe_steps + 4 * LAG
    phases, settled = drive(h, Env(**ASYNC_WINS), 700)
    assert settled[-1] == "async"
    probes = stretches(phases, "sync")
    assert [n for _, n in probes] == [h.leg("sync")] * len(probes) and len(probes) >= 2
    (s1, n1), (s2, _) = probes[:2]
    verdict = s1 + n1 + h.leg("async") - 1 + LAG  # the first verdict (never extending) ...
    assert s2 - verdict == pytest.approx(2 * h.cfg.probe_every, abs=LAG + 1)  # ... then 2 x probe_every


def test_rate_respects_the_cost_of_switching():
    """async is 15% faster: worth a switch when switching is free, not when a switch costs 10 s
    against a 50 s horizon (needed gain 0.05 + 0.2 of the sync rate)."""
    slight = dict(gain={"sync": 1.0, "async": 0.575}, time={"sync": 1.0, "async": 0.5}, noise=0.002)
    _, free = drive(heuristic("rate", switch_time=0.0), Env(**slight), 400)
    _, costly = drive(heuristic("rate", switch_time=10.0), Env(**slight), 400)
    assert "async" in free
    assert "async" not in costly


def test_switch_decisions_carry_their_estimates():
    h = heuristic("goodput")
    env = Env(**ASYNC_WINS)
    phases = [h.decide(u).phase for u in range(LAG)]
    reasons = []
    for t in range(120):
        h.observe(env.run(phases[t]))
        d = h.decide(t + LAG)
        phases.append(d.phase)
        if d.info:
            reasons.append(d)
    assert reasons and {"E", "R", "goodput"} <= reasons[0].info.keys()
    assert reasons[0].info["R"] == pytest.approx(2.0)
    assert reasons[0].info["E"] == pytest.approx(0.8, rel=0.2)


def test_trend_corrected_fit_recovers_the_phase_rates():
    """Loss decreasing along a decelerating curve; phases alternate in blocks. A naive comparison
    of each phase's mean slope favours whichever ran earlier; the fit does not."""
    rng = np.random.default_rng(0)
    phases, losses, dx = [], [], []
    progress = 0.0
    for i in range(80):
        ph = "sync" if (i // 20) % 2 == 0 else "async"
        progress += 1.0 if ph == "sync" else 0.6
        phases.append(ph)
        losses.append(5 * math.exp(-0.01 * progress) + 0.001 * rng.normal())
        dx.append(1.0)
    r = fit_rates(phases, losses, dx)
    assert r.async_ / r.sync == pytest.approx(0.6, rel=0.1)
    # and its standard error is roughly calibrated: with equal rates |z| > 2 rarely (5% if exact)
    zs = []
    for trial in range(200):
        progress, ph, ls, dxs = rng.uniform(0, 300), [], [], []
        for i in range(70):
            a = 30 <= i < 50
            progress += 0.5 if a else 1.0
            ph.append("async" if a else "sync")
            dxs.append(0.5 if a else 1.0)
            ls.append(1 + 4 * math.exp(-0.01 * progress) + 0.01 * rng.normal())
        fit = fit_rates(ph, ls, dxs)
        zs.append(fit.diff / fit.diff_se)
    assert 0.8 < np.std(zs) < 1.3 and np.mean(np.abs(zs) > 2) < 0.15
    assert fit_rates(["sync"] * 10, losses[:10], dx[:10]) is None


def test_start_auto_follows_the_predicted_throughput_ratio():
    h = heuristic("rate", start="auto")  # R = 2; p = 4, m = 2: mean delay 1.5 steps
    assert h.prior_efficiency() == pytest.approx(1 / (1 + 0.25 * 1.5)) and h.current == "async"
    assert heuristic("rate", start="auto", prior_efficiency=0.5).current == "sync"  # break-even
    assert heuristic("rate", start="auto", prior_efficiency=0.45).current == "sync"
    assert heuristic("rate", start="auto", prior_efficiency=0.8).current == "async"


def test_fixed_plan():
    h = heuristic("fixed", plan=[["sync", 5], ["async", 3], ["sync", None]])
    assert [h.decide(u).phase for u in range(10)] == ["sync"] * 5 + ["async"] * 3 + ["sync"] * 2
    with pytest.raises(ValueError):
        heuristic("fixed", plan=[["fast", 5]])


def test_a_user_heuristic_is_one_file(tmp_path, monkeypatch):
    import adapipe_cli.adaptive as pkg

    (tmp_path / "always_async.py").write_text(
        "from adapipe_cli.adaptive.base import Heuristic, Decision\n"
        "class AlwaysAsync(Heuristic):\n"
        "    name = 'always_async'\n"
        "    def decide(self, step):\n"
        "        return Decision('async', 'always')\n")
    monkeypatch.setattr(pkg, "__path__", [*pkg.__path__, str(tmp_path)])
    h = heuristic("always_async")
    assert h.decide(0).phase == "async"
