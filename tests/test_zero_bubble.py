"""ZB-H1 and ZB-H2 (zero-bubble, backward split into I and W): exact synchronous training at depths
2, 4 and 8, AdaPipe's sync phase, the simulator's bubble against the zero-bubble paper's closed
forms, and the memory ledger (ZB-H1: 1F1B's first stage's peak; ZB-H2: 2p - 1 microbatches)."""

from __future__ import annotations

import functools

import pytest
import torch

from adapipe_cli.model import GPTConfig, build_full_model, lm_loss
from adapipe_cli.optim import StageOptimizer, lr_factor
from adapipe_cli.schedules import ASYNC, FORWARD, INPUT, SYNC, UPDATE, WEIGHT, Plan, ScheduleSpec, StageProgram
from adapipe_cli.schedules.ledger import StageBytes
from adapipe_cli.simulator.clock import CostProfile
from adapipe_cli.simulator.simulate import simulate
from helpers import GCFG, B, local_runtime, make_data, optim_cfg, rel_close, run_losses, one_block_per_stage

STEPS = 5
DEEP = GPTConfig(**{**GCFG.__dict__, "n_layer": 8})  # eight blocks: one per stage at depth 8


def steps_at(p: int, m: int = 1) -> int:
    """Steps compared at depth p with m microbatches: depth 8 compares 3 (its actions cost 8 times
    depth 1's; still steps that follow updates and, without clipping, overlap), and so do 8
    microbatches (a step costs 8 microbatches' overhead through every block)."""
    return 3 if p == 8 or m >= 8 else STEPS


# fast: no accumulation (2, 1), m > p (2, 3), m < p (4, 2), depth 8 with m = p (8, 8); slow (make
# test-all): (4, 4), m = p as (8, 8), and (8, 1), no accumulation as (2, 1) at depth 8
@pytest.mark.parametrize("p,m", [(2, 1), (2, 3), (4, 2), pytest.param(4, 4, marks=pytest.mark.slow),
                                 pytest.param(8, 1, marks=pytest.mark.slow), (8, 8)])
def test_zbh1_equals_single_process_gradient_accumulation(p, m):
    gcfg, steps = one_block_per_stage(p), steps_at(p, m)
    data = make_data(steps)
    ref, ref_norms = reference_of(m, 1.0, gcfg, steps)
    rt = local_runtime(p, m, [SYNC] * steps, data, sync="zbh1", gcfg=gcfg, clip=1.0)
    got = [rt.run_step(t) for t in range(steps)]
    assert rel_close([r.loss for r in got], ref, 1e-5), ([r.loss for r in got], ref)
    # and the same gradients (the split changes where they are computed, not what): the
    # single-process global norms (which 1F1B's equal: test_engine, and ZB-H2's below)
    assert rel_close([r.grad_norm for r in got], ref_norms, 1e-5), ([r.grad_norm for r in got], ref_norms)


MIXED = (SYNC, ASYNC, ASYNC, ASYNC, SYNC, SYNC, ASYNC, ASYNC, SYNC)  # every switch, both ways


@functools.lru_cache(maxsize=None)
def one_f_one_b_losses(phases: tuple[str, ...], clip: float) -> tuple[float, ...]:
    """The 1F1B run of the mixed plan that each sync schedule is compared with, computed once (read only)."""
    return tuple(run_losses(local_runtime(4, 2, list(phases), make_data(len(phases)), sync="1f1b", clip=clip), len(phases)))


def test_adapipe_with_a_zbh1_sync_phase_drains_and_fills_like_1f1b():
    """Sync steps are flushed segments whatever their inner order: with ZB-H1 as AdaPipe's sync
    phase, a mixed plan trains the same numbers as with 1F1B (up to float rounding)."""
    phases = list(MIXED)
    data = make_data(len(phases))
    zb = run_losses(local_runtime(4, 2, phases, data, sync="zbh1", clip=1.0), len(phases))
    base = list(one_f_one_b_losses(MIXED, 1.0))
    assert rel_close(zb, base, 1e-5), (zb, base)


@pytest.mark.parametrize("p,m", [(2, 2), (4, 4), (4, 8), (8, 8), (3, 7)])
def test_zbh1_bubble_is_the_papers_closed_form(p, m):
    """F = I = W = 1 (backward 2), m >= p: 1F1B's bubble per step is (p - 1)(F + I + W), ZB-H1's
    (p - 1)(F + I - W) (Qi et al. 2024, section 3): step time 3m + (p - 1), against 3m + 3(p - 1)."""
    prof = CostProfile.uniform(p, 1.0, 2.0, 0.0)
    assert prof.input == [1.0] * p and prof.weight == [1.0] * p
    zb = simulate(ScheduleSpec(p, m, "zbh1"), Plan(3, [SYNC] * 3), prof, record=False)
    one = simulate(ScheduleSpec(p, m, "1f1b"), Plan(3, [SYNC] * 3), prof, record=False)
    assert zb.step_time == pytest.approx(3 * m + (p - 1))
    assert one.step_time == pytest.approx(3 * m + 3 * (p - 1))
    assert zb.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1))
    # memory: every stage holds as many microbatches as 1F1B's first stage, p, and one weight set
    assert zb.peak_activations == [min(p, m)] * p == [max(one.peak_activations)] * p
    assert [d["peak_param_sets"] for d in zb.memory] == [1] * p


@pytest.mark.parametrize("p,m", [(2, 1), (4, 2), (5, 3)])
def test_zbh1_with_fewer_microbatches_than_stages_still_beats_1f1b(p, m):
    prof = CostProfile.uniform(p, 1.0, 2.0, 0.0)
    zb = simulate(ScheduleSpec(p, m, "zbh1"), Plan(3, [SYNC] * 3), prof, record=False)
    one = simulate(ScheduleSpec(p, m, "1f1b"), Plan(3, [SYNC] * 3), prof, record=False)
    assert 3 * m + (p - 1) <= zb.step_time < one.step_time


@pytest.mark.parametrize("p,m", [(3, 4), (4, 2)])
def test_zbh1_action_lists(p, m):
    """Each stage: every microbatch's F, then its I, then its W, the W trailing its I by ``s``
    microbatches, and one update after the last W."""
    spec = ScheduleSpec(p, m, "zbh1")
    for s in range(p):
        prog = StageProgram(s, spec, Plan(1, [SYNC]))
        acts = []
        while (a := prog.pop()) is not None:
            acts.append(a)
        kinds = [(a.kind, a.mb) for a in acts]
        assert kinds[-1][0] == "U" and len(acts) == 3 * m + 1
        for j in range(m):
            assert kinds.index(("F", j)) < kinds.index((INPUT, j)) < kinds.index((WEIGHT, j))
            if j + s < m:  # W(j) right after I(j + s)
                assert kinds.index((WEIGHT, j)) == kinds.index((INPUT, j + s)) + 1


# -- ZB-H2 ---------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def reference_of(m, clip, gcfg, steps=STEPS) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """``reference_with_norms`` on ``make_data(steps)``, computed once per (m, clip, model, steps):
    the cases of ZB-H1, ZB-H2 and interleaved 1F1B with the same ones share it (read only)."""
    losses, norms = reference_with_norms(make_data(steps), m, clip, gcfg, steps)
    return tuple(losses), tuple(norms)


def reference_with_norms(data, m, clip, gcfg, steps=STEPS):
    """Single-process gradient accumulation: per step, the mean loss and the global gradient norm
    before clipping."""
    model = build_full_model(gcfg, seed=0)
    params = [p for _, p in model.named_parameters()]
    opt = StageOptimizer(list(model.named_parameters()), optim_cfg(grad_clip=clip))
    losses, norms = [], []
    for t in range(steps):
        x, y = data[t]
        mb, total = B // m, 0.0
        for i in range(m):
            loss = lm_loss(model(x[i * mb:(i + 1) * mb]), y[i * mb:(i + 1) * mb])
            (loss / m).backward()
            total += loss.item()
        norms.append(float(torch.sqrt(sum(p.grad.pow(2).sum() for p in params))))
        if clip:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step(lr_factor(t, 2, steps, 0.1))  # (and sets every .grad to None)
        losses.append(total / m)
    return losses, norms


# clip 0: no barrier at the update (steps overlap), where the 2p - 1 limit binds (m >= 2p - 1) or not.
# fast: no accumulation (2, 1, 1.0); with the barrier, the limit not binding (4, 2, 1.0) and binding
# (4, 8, 1.0); without it, binding (4, 8, 0.0) and not, at depth 8 (8, 8, 0.0). Slow (make test-all):
# (2, 4, 1.0) and (2, 4, 0.0), binding as (4, 8, *); (8, 1, 1.0), no accumulation as (2, 1, 1.0);
# (8, 8, 1.0), the barrier with the limit not binding as (4, 2, 1.0)
SLOW_ZBH2 = {(2, 4, 1.0), (2, 4, 0.0), (8, 1, 1.0), (8, 8, 1.0)}


@pytest.mark.parametrize("p,m,clip", [pytest.param(*c, marks=pytest.mark.slow) if c in SLOW_ZBH2 else c for c in [
    (2, 1, 1.0), (2, 4, 1.0), (2, 4, 0.0), (4, 2, 1.0), (4, 8, 1.0), (4, 8, 0.0), (8, 1, 1.0), (8, 8, 1.0), (8, 8, 0.0)]])
def test_zbh2_equals_single_process_gradient_accumulation(p, m, clip):
    gcfg, steps = one_block_per_stage(p), steps_at(p, m)
    data = make_data(steps)
    ref_losses, ref_norms = reference_of(m, clip, gcfg, steps)
    rt = local_runtime(p, m, [SYNC] * steps, data, sync="zbh2", gcfg=gcfg, clip=clip)
    assert rt.spec.barrier == (clip > 0)
    got = [rt.run_step(t) for t in range(steps)]
    assert rel_close([r.loss for r in got], ref_losses, 1e-5), ([r.loss for r in got], ref_losses)
    assert rel_close([r.grad_norm for r in got], ref_norms, 1e-5), ([r.grad_norm for r in got], ref_norms)


# 0.0 (no barrier) is slow (make test-all): test_references' zbh2 case drains and fills a mixed plan
# without clipping, against the delayed-gradient loop
@pytest.mark.parametrize("clip", [1.0, pytest.param(0.0, marks=pytest.mark.slow)])
def test_adapipe_with_a_zbh2_sync_phase_drains_and_fills_like_1f1b(clip):
    """A switch into a ZB-H2 step drains the async stream first, a switch out of one starts a new
    fill; without the update's barrier a stage starts the next step while later stages finish
    theirs: the same numbers as with 1F1B."""
    phases = list(MIXED)
    data = make_data(len(phases))
    zb = run_losses(local_runtime(4, 2, phases, data, sync="zbh2", clip=clip), len(phases))
    base = list(one_f_one_b_losses(MIXED, clip))
    assert rel_close(zb, base, 1e-5), (zb, base)


def zbh2_lists(p, m):
    out = []
    for s in range(p):
        prog = StageProgram(s, ScheduleSpec(p, m, "zbh2"), Plan(1, [SYNC]))
        acts = []
        while (a := prog.pop()) is not None:
            acts.append(a)
        out.append([(a.kind, a.mb) for a in acts])
    return out


@pytest.mark.parametrize("p,m", [(2, 4), (3, 2), (4, 8), (4, 16)])
def test_zbh2_action_lists(p, m):
    """Stage s: min(m, 2(p - s) - 1) warm-up forwards before its first I; every microbatch's F, I,
    W in that order, each once; at most 2p - 1 microbatches forwarded and not yet through their W;
    one update at the end."""
    for s, kinds in enumerate(zbh2_lists(p, m)):
        assert kinds[-1][0] == UPDATE and len(kinds) == 3 * m + 1
        assert kinds[:min(m, 2 * (p - s) - 1)] == [(FORWARD, j) for j in range(min(m, 2 * (p - s) - 1))]
        assert kinds[min(m, 2 * (p - s) - 1)] == (INPUT, 0)
        for j in range(m):
            assert kinds.index((FORWARD, j)) < kinds.index((INPUT, j)) < kinds.index((WEIGHT, j))
        held = [sum(k == FORWARD for k, _ in kinds[:i + 1]) - sum(k == WEIGHT for k, _ in kinds[:i + 1])
                for i in range(len(kinds))]
        assert max(held) == min(m, 2 * p - 1)


# depth 8 at c = 0.5 is slow (make test-all): the closed forms scale with c at depths 2-4, and
# depth 8 is checked at c = 1
@pytest.mark.parametrize("p,m,c", [pytest.param(p, m, c, marks=pytest.mark.slow) if p == 8 and c == 0.5 else (p, m, c)
                                   for c in (1.0, 0.5) for p, m in [(2, 3), (2, 8), (3, 5), (4, 7), (4, 12), (8, 15), (8, 24)]])
def test_zbh2_bubble_and_memory_are_the_papers_closed_forms(p, m, c):
    """F = I = W = c, m >= 2p - 1 (Qi et al. 2024, table 1): ZB-H2's bubble per step is
    (p - 1)(F + I - 2W) = 0 without the update's barrier, so a step takes 3mc; with the barrier
    (clipping) it takes ZB-H1's 3mc + (p - 1)c. Every stage holds 2p - 1 microbatches (1F1B's
    first stage p) and one weight set."""
    prof = CostProfile.uniform(p, c, 2 * c, 0.0)
    plan = lambda: Plan(8, [SYNC] * 8)  # noqa: E731
    free = simulate(ScheduleSpec(p, m, "zbh2", barrier=False), plan(), prof, record=False)
    held = simulate(ScheduleSpec(p, m, "zbh2"), plan(), prof, record=False)
    zb1 = simulate(ScheduleSpec(p, m, "zbh1"), plan(), prof, record=False)
    one = simulate(ScheduleSpec(p, m, "1f1b"), plan(), prof, record=False)
    assert free.step_time == pytest.approx(3 * m * c) and free.bubble_fraction == pytest.approx(0.0, abs=1e-12)
    assert held.step_time == pytest.approx(3 * m * c + (p - 1) * c) == pytest.approx(zb1.step_time)
    assert free.peak_activations == held.peak_activations == [2 * p - 1] * p
    assert max(one.peak_activations) == p
    assert [d["peak_param_sets"] for d in free.memory] == [1] * p


@pytest.mark.parametrize("p,m", [(2, 1), (4, 2), (4, 4), (4, 6), (5, 3)])
def test_zbh2_with_fewer_microbatches_than_its_warm_up_is_no_slower_than_zbh1(p, m):
    prof = CostProfile.uniform(p, 1.0, 2.0, 0.0)
    for barrier in (True, False):
        zb2 = simulate(ScheduleSpec(p, m, "zbh2", barrier=barrier), Plan(6, [SYNC] * 6), prof, record=False)
        zb1 = simulate(ScheduleSpec(p, m, "zbh1"), Plan(6, [SYNC] * 6), prof, record=False)
        assert 3 * m <= zb2.step_time <= zb1.step_time
        assert zb2.peak_activations == [m] * p


def test_zbh2_ledger_bytes_on_the_executor_and_the_simulator():
    """The ledger's peak, driven by the stage executor (local runtime) and by the simulator: with
    m >= 2p, every stage at once holds one parameter set, one gradient accumulator, the optimizer
    state and 2p - 1 microbatches' activations, P + G + O + (2p - 1) A."""
    p, m, P, O, A = 2, 8, 1000.0, 2000.0, 10.0
    prof = CostProfile.uniform(p)
    prof.memory = {"params": [P] * p, "optimizer": [O] * p, "activation": [A] * p}
    assert prof.stage_bytes(0) == StageBytes(P, O, A)
    want = [2 * P + O + (2 * p - 1) * A] * p
    sim = simulate(ScheduleSpec(p, m, "zbh2", barrier=False), Plan(3, [SYNC] * 3), prof, record=False)
    assert [d["peak_bytes"] for d in sim.memory] == want
    assert [d["peak_activation_bytes"] for d in sim.memory] == [(2 * p - 1) * A] * p
    rt = local_runtime(p, m, [SYNC] * 3, make_data(3), sync="zbh2", clip=0.0, profile=prof, gcfg=one_block_per_stage(p))
    times = [rt.run_step(t).time_s for t in range(3)]
    assert [d["peak_bytes"] for d in rt.memory()] == want
    # the local runtime's clock overlaps the steps as the simulator does: 3m per step (F = 1, I = W = 1)
    assert times == pytest.approx(sim.update_end)
    assert times[2] - times[1] == pytest.approx(3 * m)
