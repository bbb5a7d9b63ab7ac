"""ZB-H1 (zero-bubble, backward split into I and W): exact synchronous training at depths 2, 4 and
8, AdaPipe's sync phase, the simulator's bubble against the zero-bubble paper's closed form, and
the memory ledger (the same peak as 1F1B's first stage)."""

from __future__ import annotations

import pytest

from adapipe_cli.model import GPTConfig
from adapipe_cli.schedules import ASYNC, INPUT, SYNC, WEIGHT, Plan, ScheduleSpec, StageProgram
from adapipe_cli.simulator.clock import CostProfile
from adapipe_cli.simulator.simulate import simulate
from helpers import GCFG, local_runtime, make_data, rel_close, run_losses
from test_engine import reference_sync

STEPS = 5
DEEP = GPTConfig(**{**GCFG.__dict__, "n_layer": 8})  # eight blocks: one per stage at depth 8


@pytest.mark.parametrize("p,m", [(2, 1), (2, 3), (4, 2), (4, 4), (8, 1), (8, 8)])
def test_zbh1_equals_single_process_gradient_accumulation(p, m):
    gcfg = DEEP if p == 8 else GCFG
    data = make_data(STEPS)
    ref = reference_sync(data, m, clip=1.0, gcfg=gcfg, steps=STEPS)
    rt = local_runtime(p, m, [SYNC] * STEPS, data, sync="zbh1", gcfg=gcfg, clip=1.0)
    got = [rt.run_step(t) for t in range(STEPS)]
    assert rel_close([r.loss for r in got], ref, 1e-5), ([r.loss for r in got], ref)
    # and the same gradients as 1F1B's (the split changes where they are computed, not what)
    plain = local_runtime(p, m, [SYNC] * STEPS, data, sync="1f1b", gcfg=gcfg, clip=1.0)
    norms = [plain.run_step(t).grad_norm for t in range(STEPS)]
    assert rel_close([r.grad_norm for r in got], norms, 1e-5)


def test_adapipe_with_a_zbh1_sync_phase_drains_and_fills_like_1f1b():
    """Sync steps are flushed segments whatever their inner order: with ZB-H1 as AdaPipe's sync
    phase, a mixed plan trains the same numbers as with 1F1B (up to float rounding)."""
    phases = [SYNC, ASYNC, ASYNC, ASYNC, SYNC, SYNC, ASYNC, ASYNC]
    data = make_data(len(phases))
    zb = run_losses(local_runtime(4, 2, phases, data, sync="zbh1"), len(phases))
    base = run_losses(local_runtime(4, 2, phases, data, sync="1f1b"), len(phases))
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
