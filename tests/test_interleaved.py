"""Interleaved 1F1B (virtual stages, v model chunks per device): exact synchronous training at
depths 2 and 4 with v = 2, each device's order, the simulator's step time against Megatron-LM's
closed form (1F1B's bubble divided by v), the local runtime's clock, and an exact resume."""

from __future__ import annotations

import dataclasses

import pytest

from adapipe_cli.schedules import BACKWARD, FORWARD, SYNC, UPDATE, Plan, ScheduleError, ScheduleSpec, StageProgram
from adapipe_cli.schedules.interleaved import interleaved_order, warmup
from adapipe_cli.simulator.clock import CostProfile
from adapipe_cli.simulator.simulate import simulate
from helpers import local_runtime, make_data, rel_close, one_block_per_stage
from test_zero_bubble import STEPS, reference_of, steps_at


# (2, 2, 4, reverse, 0.0) is slow (make test-all): the reverse walk is (4, 2, 4)'s, no clipping
# (4, 2, 8)'s, and a depth-2 steady state (pairs after the warm-up) (2, 4, 4)'s
@pytest.mark.parametrize("p,v,m,order,clip", [(2, 2, 2, "forward", 1.0),
                                              pytest.param(2, 2, 4, "reverse", 0.0, marks=pytest.mark.slow),
                                              (2, 4, 4, "forward", 1.0), (4, 2, 4, "reverse", 1.0),
                                              (4, 2, 8, "forward", 0.0)])
def test_interleaved_equals_single_process_gradient_accumulation(p, v, m, order, clip):
    """The model cut into p v chunks (one block each), chunk c on device c % p: the losses and
    gradient norms of single-process training with gradient accumulation, whatever the walk's
    order (with 8 microbatches over 3 steps, as test_zero_bubble's)."""
    steps, gcfg = steps_at(p, m), one_block_per_stage(p * v)
    data = make_data(steps)
    ref_losses, ref_norms = reference_of(m, clip, gcfg, steps)
    rt = local_runtime(p, m, [SYNC] * steps, data, sync="interleaved", gcfg=gcfg, clip=clip, chunks=v, order=order)
    assert len(rt.executors) == p * v
    got = [rt.run_step(t) for t in range(steps)]
    assert rel_close([r.loss for r in got], ref_losses, 1e-5), ([r.loss for r in got], ref_losses)
    assert rel_close([r.grad_norm for r in got], ref_norms, 1e-5), ([r.grad_norm for r in got], ref_norms)


# (4, 2) is slow (make test-all): the embedding on device 0 and the head on device p - 1 as (2, 2)
@pytest.mark.parametrize("p,v", [(2, 2), pytest.param(4, 2, marks=pytest.mark.slow)])
def test_interleaved_with_tied_embeddings_across_devices(p, v):
    """The embedding on chunk 0 (device 0) and the head on chunk p v - 1 (device p - 1, not its first
    chunk to update) sum their gradients before the norm: single-process training of the tied model."""
    tied = dataclasses.replace(one_block_per_stage(p * v), tie_embeddings=True)
    data = make_data(STEPS)
    ref_losses, ref_norms = reference_of(4, 1.0, tied)
    rt = local_runtime(p, 4, [SYNC] * STEPS, data, sync="interleaved", gcfg=tied, chunks=v)
    got = [rt.run_step(t) for t in range(STEPS)]
    assert rel_close([r.loss for r in got], ref_losses, 1e-5), ([r.loss for r in got], ref_losses)
    assert rel_close([r.grad_norm for r in got], ref_norms, 1e-5), ([r.grad_norm for r in got], ref_norms)


@pytest.mark.parametrize("p,v,m", [(2, 2, 2), (2, 2, 4), (4, 2, 8), (4, 3, 4), (3, 2, 6)])
def test_interleaved_device_orders(p, v, m):
    """Device d: its m v forwards and m v backwards, each (chunk, microbatch) once; the first
    min(m v, 2(p - d - 1) + (v - 1) p) all forwards (warm-up), then forward-backward pairs, in groups of p microbatches through local
    chunks 0..v-1 (backwards through v-1..0); then one update per chunk. Each virtual stage's own
    list is its restriction: microbatches in order, its update last."""
    for d, acts in enumerate(interleaved_order(p, v, m)):
        fwd = [(j, i) for k, j, i in acts if k == FORWARD]
        bwd = [(j, i) for k, j, i in acts if k == BACKWARD]
        assert sorted(fwd) == sorted(bwd) == sorted((j, i) for j in range(v) for i in range(m))
        w = warmup(d, p, v, m)
        assert [k for k, _, _ in acts[:w]] == [FORWARD] * w
        assert w == m * v or [k for k, _, _ in acts[w:w + 4]] == [FORWARD, BACKWARD] * 2 or w + 1 == m * v
        assert fwd[:p] == [(0, i) for i in range(p)] and fwd[p:2 * p] == [(1, i) for i in range(p)]
        assert bwd[:p] == [(v - 1, i) for i in range(p)]
        assert [(k, j) for k, j, _ in acts[-v:]] == [(UPDATE, j) for j in range(v)]
    spec = ScheduleSpec(p, m, "interleaved", chunks=v)
    for c in range(p * v):
        prog = StageProgram(c, spec, Plan(1, [SYNC]))
        kinds = []
        while (a := prog.pop()) is not None:
            kinds.append((a.kind, a.mb))
        assert [mb for k, mb in kinds if k == FORWARD] == [mb for k, mb in kinds if k == BACKWARD] == list(range(m))
        assert kinds[-1] == (UPDATE, -1) and len(kinds) == 2 * m + 1


@pytest.mark.parametrize("p,v,m", [(2, 2, 2), (2, 2, 4), (4, 2, 4), (4, 2, 8), (4, 4, 8), (8, 2, 16), (3, 1, 6)])
def test_interleaved_step_time_is_megatrons_closed_form(p, v, m):
    """A stage's costs F = 1, B = 2 shared by its v chunks (F / v, B / v each): a step takes
    m (F + B) + (p - 1)(F + B) / v (Narayanan et al. 2021, section 2.2), 1F1B's bubble divided by
    v; at v = 1 exactly 1F1B's."""
    prof = CostProfile.uniform(p * v, 1.0 / v, 2.0 / v, 0.0)
    il = simulate(ScheduleSpec(p, m, "interleaved", chunks=v), Plan(6, [SYNC] * 6), prof, record=False)
    assert il.step_time == pytest.approx(3 * m + 3 * (p - 1) / v)
    assert il.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))
    assert len(il.utilization) == p and len(il.peak_activations) == p * v
    if v == 1:
        one = simulate(ScheduleSpec(p, m, "1f1b"), Plan(6, [SYNC] * 6), CostProfile.uniform(p), record=False)
        assert il.step_time == pytest.approx(one.step_time)


def test_the_local_runtimes_clock_is_the_simulators():
    p, v, m = 2, 2, 4
    prof = CostProfile.uniform(p * v, 0.5, 1.0, 0.0)
    sim = simulate(ScheduleSpec(p, m, "interleaved", chunks=v), Plan(3, [SYNC] * 3), prof, record=False)
    rt = local_runtime(p, m, [SYNC] * 3, make_data(3), sync="interleaved", gcfg=one_block_per_stage(p * v), chunks=v,
                       profile=prof)
    got = [rt.run_step(t) for t in range(3)]
    assert [r.time_s for r in got] == pytest.approx(sim.update_end)
    assert got[-1].bubble == pytest.approx(sim.bubble_fraction)


def test_interleaved_resumes_exactly():
    """A state taken at a step boundary and loaded into a fresh runtime continues with the numbers
    of the uninterrupted run (every device restarts its order)."""
    data, gcfg = make_data(STEPS), one_block_per_stage(2 * 2)
    rt = local_runtime(2, 4, [SYNC] * STEPS, data, sync="interleaved", gcfg=gcfg, chunks=2)
    whole = [rt.run_step(t).loss for t in range(STEPS)]
    first = local_runtime(2, 4, [SYNC] * STEPS, data, sync="interleaved", gcfg=gcfg, chunks=2)
    head = [first.run_step(t).loss for t in range(2)]
    state = first.state_dict()
    second = local_runtime(2, 4, [SYNC] * STEPS, data, sync="interleaved", gcfg=gcfg, chunks=2)
    second.load_state_dict(state)
    assert head + [second.run_step(t).loss for t in range(2, STEPS)] == whole


def test_interleaved_spec_errors():
    with pytest.raises(ScheduleError, match="multiple of pipeline.stages"):
        ScheduleSpec(4, 6, "interleaved", chunks=2).check()
    with pytest.raises(ScheduleError, match="schedule.chunks=2"):
        ScheduleSpec(4, 8, "1f1b", chunks=2).check()
    with pytest.raises(ScheduleError, match="weight stashing"):  # (async over chunks: tests/test_adapipe_interleaved.py)
        ScheduleSpec(2, 2, "interleaved", "latest", chunks=2).check()
