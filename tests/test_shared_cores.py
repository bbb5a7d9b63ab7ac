"""simulator.shared: stages sharing fewer cores than they are, against closed forms."""

from __future__ import annotations

import math

import pytest

from adapipe_cli.schedules import ASYNC, SYNC, Plan, ScheduleSpec
from adapipe_cli.simulator.clock import CostProfile
from adapipe_cli.simulator.shared import cpu_profile, scaled, simulate_shared, slowdown
from adapipe_cli.simulator.simulate import simulate

F, B = 1.0, 2.0


def spec(p: int, m: int, chunks: int = 1) -> ScheduleSpec:
    s = ScheduleSpec(p, m, "interleaved" if chunks > 1 else "1f1b", "stash", chunks=chunks)
    s.check()
    return s


def test_slowdown_is_one_over_the_mean_rate_while_a_stage_computes():
    # stage 0 computes over [0, 2], stage 1 over [1, 3]: each is alone half its time (rate 1 on one
    # core) and paired half (rate 1/2): 1.5 s of work in 2 s
    assert slowdown([[(0.0, 2.0)], [(1.0, 3.0)]], cores=1) == pytest.approx([4 / 3, 4 / 3])
    assert slowdown([[(0.0, 2.0)], [(1.0, 3.0)]], cores=2) == pytest.approx([1.0, 1.0])
    # a background of 1 core on 2: paired, 2 / 3; alone, 1
    assert slowdown([[(0.0, 2.0)], [(1.0, 3.0)]], cores=2, background=1.0) == pytest.approx([2 / (1 + 2 / 3)] * 2)
    # copies: each stage's replica computes at the same times (two stages alone are two on one core)
    assert slowdown([[(0.0, 1.0)], []], cores=1, copies=2) == pytest.approx([2.0, 2.0])
    # a stage never busy gets the rate it would have alone
    assert slowdown([[(0.0, 1.0), (1.0, 2.0)], [], [(0.5, 1.5)]], cores=1) == pytest.approx([4 / 3, 1.0, 2.0])


@pytest.mark.parametrize("p,m,cores", [(4, 4, 2), (4, 8, 2), (2, 4, 1), (8, 3, 4)])
def test_an_async_stream_computing_all_the_time_takes_stages_over_cores_its_cpu_time(p, m, cores):
    """In the steady state every stage of an async stream computes all the time: each runs at
    cores / p of a core, so the step is p / cores of the one on a device each."""
    prof = CostProfile.uniform(p, F, B, 0.25)
    plan = Plan(20, [ASYNC] * 20)
    own = simulate(spec(p, m), plan, prof, record=False).step_time
    r = simulate_shared(spec(p, m), plan, prof, cores)
    assert own == pytest.approx(m * (F + B) + 0.25)
    assert r.step_time == pytest.approx(own * p / cores, rel=1e-5)
    assert r.factors == pytest.approx([p / cores] * p, rel=1e-5)


@pytest.mark.parametrize("phase", [SYNC, ASYNC])
def test_a_core_per_stage_changes_nothing(phase):
    prof = CostProfile.uniform(4, F, B, 0.5)
    plan = Plan(30, [phase] * 30)
    r = simulate_shared(spec(4, 4), plan, prof, cores=4)
    assert r.factors == [1.0] * 4 and r.rounds == 1 and r.background == 0.0
    assert r.step_time == pytest.approx(simulate(spec(4, 4), plan, prof, record=False).step_time)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (3, 5)])
def test_on_one_core_a_synchronous_step_is_all_its_work(p, m):
    """On one core a 1F1B pipeline always has a stage ready, so the core never idles: the step
    is every stage's work, p (m (F + B) + U) (on a device each it is (m + p - 1)(F + B) + U)."""
    u = 0.1
    r = simulate_shared(spec(p, m), Plan(16, [SYNC] * 16), CostProfile.uniform(p, F, B, u), cores=1)
    assert r.step_time == pytest.approx(p * (m * (F + B) + u), rel=1e-5)


def test_two_chunks_per_worker_share_their_device_and_the_cores():
    """Interleaved 1F1B, 2 workers of 2 chunks each, on one core: all the work of a step, as above."""
    prof = CostProfile.uniform(4, F, B, 0.0)
    r = simulate_shared(spec(2, 4, chunks=2), Plan(20, [SYNC] * 20), prof, cores=1)
    assert len(r.factors) == 2
    assert r.step_time == pytest.approx(4 * 4 * (F + B), rel=1e-5)


def test_the_background_takes_its_share_of_the_cores():
    """4 stages always computing on 2 cores, plus background work of b cores: each runs at
    2 / (4 + b), b = (other CPU a step) / step. With 4.8 s of other CPU a step over a 12 s CPU
    step, f = (4 + 0.4 / f) / 2, so f^2 - 2 f - 0.2 = 0; the same from the transport's CPU per
    message end: 4 m (p - 1) = 48 ends a step of 0.1 s each."""
    prof = CostProfile.uniform(4, F, B, 0.0)
    plan = Plan(20, [ASYNC] * 20)
    f = 1 + math.sqrt(1.2)
    other = simulate_shared(spec(4, 4), plan, prof, cores=2, other_cpu_s=4.8)
    messages = simulate_shared(spec(4, 4), plan, prof, cores=2, message_cpu_s=0.1)
    for r in (other, messages):
        assert r.step_time == pytest.approx(12 * f, rel=1e-5)
        assert r.background == pytest.approx(0.4 / f, rel=1e-5)


def test_replicas_compute_beside_their_pipeline():
    """Two replicas of a 2-stage async stream on 2 cores: 4 stages always computing, 2x the step."""
    prof = CostProfile.uniform(2, F, B, 0.0)
    r = simulate_shared(spec(2, 4), Plan(20, [ASYNC] * 20), prof, cores=2, replicas=2)
    assert r.step_time == pytest.approx(2 * 4 * (F + B), rel=1e-5)


def test_bad_cores_and_windows_are_refused():
    prof = CostProfile.uniform(2, F, B, 0.0)
    with pytest.raises(ValueError, match="cores must be positive"):
        simulate_shared(spec(2, 2), Plan(10, [SYNC] * 10), prof, cores=0)
    with pytest.raises(ValueError, match="two updates"):
        simulate_shared(spec(2, 2), Plan(10, [SYNC] * 10), prof, cores=1, window=(3, 3))


def test_the_cpu_profile_takes_the_measured_cpu_seconds():
    prof = CostProfile.uniform(2, forward=1.0, backward=2.0, update=0.5)
    assert cpu_profile(prof) is None
    prof.meta["cpu"] = {"forward": [0.8, 0.9], "backward": [1.5, 1.6], "signal": [0.1, 0.1]}
    cpu = cpu_profile(prof)
    assert cpu.forward == [0.8, 0.9] and cpu.backward == [1.5, 1.6] and cpu.update == [0.5, 0.5]
    assert cpu.signal == []  # (a profile without the signal's wall time keeps none)
    assert prof.forward == [1.0, 1.0]  # (a copy)


def test_scaled_multiplies_every_cost_of_a_stage_the_signal_too():
    prof = CostProfile.uniform(2, forward=1.0, backward=2.0, update=0.5, copy=0.1)
    prof.signal = [0.2, 0.4]
    s = scaled(prof, [1.0, 3.0])
    assert (s.forward, s.backward, s.update, s.input) == ([1.0, 3.0], [2.0, 6.0], [0.5, 1.5], [1.0, 3.0])
    assert s.copy == pytest.approx([0.1, 0.3]) and s.signal == pytest.approx([0.2, 1.2])
    # with chunks: virtual stage s on device s % 2
    s = scaled(CostProfile.uniform(4, forward=1.0), [1.0, 2.0], lambda c: c % 2)
    assert s.forward == [1.0, 2.0, 1.0, 2.0]


def test_varying_actions_with_a_core_per_stage_are_the_jitter_simulator():
    """With a core per stage, nothing is shared: each sample is :func:`simulate_jitter`'s."""
    from adapipe_cli.simulator.jitter import simulate_jitter
    from adapipe_cli.simulator.shared import simulate_shared_jitter

    prof, sp, plan = CostProfile([1.0, 0.8], [2.0, 1.5], [0.3, 0.2]), spec(2, 2), Plan(40, [ASYNC] * 40)
    cv = {k: [0.3, 0.2] for k in "FBU"}
    shared, each = simulate_shared_jitter(sp, plan, prof, cores=2, cv=cv, samples=3, seed=5, window=(5, 35))
    alone, alone_each = simulate_jitter(sp, plan, prof, cv, samples=3, seed=5, window=(5, 35))
    assert each == pytest.approx(alone_each, rel=1e-9) and shared == pytest.approx(alone, rel=1e-9)
    assert len(set(each)) == 3  # (each sample its own draws)
    # no spread: the shared simulator of means, every sample
    plain = simulate_shared(sp, plan, prof, cores=1, window=(5, 35)).step_time
    assert simulate_shared_jitter(sp, plan, prof, cores=1, cv={"F": [0.0, 0.0]}, samples=2, window=(5, 35))[1] == [plain, plain]
    with pytest.raises(ValueError, match="samples"):
        simulate_shared_jitter(sp, plan, prof, cores=1, cv=cv, samples=0)


def test_on_one_core_varying_actions_leave_an_async_step_at_all_its_work():
    """On one core a 2-stage PipeDream stream always has a stage ready, so the core never idles:
    the step stays the sum of all its work whatever each action takes around its mean (exactly:
    the drawn CPU seconds in the window fill it), while with a core per stage the stages wait on
    each other's slow actions and the step grows."""
    from adapipe_cli.simulator.shared import simulate_shared_jitter

    prof, sp, plan = CostProfile([1.0, 1.0], [2.0, 2.0], [0.3, 0.3]), spec(2, 1), Plan(100, [ASYNC] * 100)
    cv, window = {k: [0.3, 0.3] for k in "FBU"}, (10, 90)
    r = simulate_shared(sp, plan, prof, cores=1, cv=cv, window=window)
    t0, t1 = r.sim.update_end[10], r.sim.update_end[90]
    cpu = sum((min(end, t1) - max(start, t0)) / r.factors[dev]
              for dev, _, _, _, start, end in r.sim.timeline if end > t0 and start < t1)
    assert cpu == pytest.approx(t1 - t0, rel=1e-5)  # (the one core never idles)
    assert r.step_time == pytest.approx(2 * 3.3, rel=0.03)  # (80 steps of draws around the mean)
    two_cores, _ = simulate_shared_jitter(sp, plan, prof, cores=2, cv=cv, samples=1, window=window)
    assert two_cores > 1.05 * 3.3
