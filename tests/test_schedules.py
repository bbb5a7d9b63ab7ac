"""Schedules as data: the per-stage action lists and the versions they name."""

import pytest

from adapipe_cli.schedules import (ASYNC, BACKWARD, EVAL, FORWARD, SYNC, UPDATE, Plan, PlanError, ScheduleError,
                                   ScheduleSpec, StageProgram, lookahead)


def lists(p, m, phases, weights="stash", sync="1f1b", eval_at=None):
    plan = Plan(len(phases), phases)
    out = []
    for s in range(p):
        prog = StageProgram(s, ScheduleSpec(p, m, sync, weights), plan, eval_at)
        acts = []
        while (a := prog.pop()) is not None:
            acts.append(a)
        out.append(acts)
    return out


PHASES = {
    "sync": [SYNC] * 5,
    "async": [ASYNC] * 5,
    "mixed": [SYNC, ASYNC, ASYNC, SYNC, ASYNC],
}


@pytest.mark.parametrize("p,m", [(1, 1), (2, 1), (3, 2), (4, 4), (4, 1), (4, 8)])
@pytest.mark.parametrize("kind", PHASES)
@pytest.mark.parametrize("sync", ["1f1b", "gpipe"])
def test_every_microbatch_is_trained_exactly_once(p, m, kind, sync):
    phases = PHASES[kind]
    for s, acts in enumerate(lists(p, m, phases, sync=sync)):
        fs = [a.mb for a in acts if a.kind == FORWARD]
        bs = [a.mb for a in acts if a.kind == BACKWARD]
        us = [a.step for a in acts if a.kind == UPDATE]
        assert fs == list(range(len(phases) * m)), f"stage {s}"
        assert sorted(bs) == fs
        assert us == list(range(len(phases)))
        for a in acts:
            if a.kind == UPDATE:  # the update follows every backward of its step
                done = {b.mb for b in acts[: acts.index(a)] if b.kind == BACKWARD}
                assert set(range(a.step * m, (a.step + 1) * m)) <= done
            if a.kind in (FORWARD, BACKWARD):
                assert a.phase == phases[a.step]


@pytest.mark.parametrize("p,m", [(2, 2), (4, 4), (4, 2), (3, 6)])
def test_1f1b_in_flight_bound_and_sync_versions(p, m):
    for s, acts in enumerate(lists(p, m, [SYNC] * 3)):
        inflight, peak = set(), 0
        for a in acts:
            if a.kind == FORWARD:
                inflight.add(a.mb)
            elif a.kind == BACKWARD:
                inflight.remove(a.mb)
            peak = max(peak, len(inflight))
            if a.kind in (FORWARD, BACKWARD):
                assert a.version == a.step  # sync: every action of step t uses W(t)
        assert peak == min(p - s, m)


def test_gpipe_holds_every_microbatch():
    for acts in lists(3, 5, [SYNC] * 2, sync="gpipe"):
        kinds = "".join(a.kind for a in acts[:11])
        assert kinds == "FFFFFBBBBBU"


@pytest.mark.parametrize("p,m", [(4, 1), (4, 2), (3, 4), (5, 3)])
def test_pipedream_stash_versions_follow_the_closed_form(p, m):
    """A forward at stage s uses the latest weights; in a 1F1B stream that is
    max(t0, floor((j - (p - s - 1)) / m)) for microbatch j; the backward uses the same."""
    for s, acts in enumerate(lists(p, m, [ASYNC] * 6)):
        updates = 0
        fwd = {}
        for a in acts:
            if a.kind == FORWARD:
                assert a.version == updates == max(0, (a.mb - (p - s - 1)) // m)
                fwd[a.mb] = a.version
            elif a.kind == BACKWARD:
                assert a.version == fwd[a.mb]
            elif a.kind == UPDATE:
                updates += 1
        # stage s keeps p - s microbatches in flight, so its delay is floor((p - s - 1 + ...)/m)
    delays = [max(a.step - a.version for a in acts if a.kind == FORWARD) for acts in lists(p, m, [ASYNC] * 8)]
    assert delays == sorted(delays, reverse=True) and delays[-1] == 0


def test_latest_backward_uses_current_weights():
    for acts in lists(4, 1, [ASYNC] * 6, weights="latest"):
        updates = 0
        for a in acts:
            if a.kind == BACKWARD:
                assert a.version == updates
            updates += a.kind == UPDATE


def test_vertical_uses_the_first_stages_version():
    ls = lists(4, 2, [ASYNC] * 6, weights="vertical")
    first = {a.mb: a.version for a in ls[0] if a.kind == FORWARD}
    for acts in ls:
        for a in acts:
            if a.kind in (FORWARD, BACKWARD):
                assert a.version == first[a.mb]


@pytest.mark.parametrize("p,m", [(2, 1), (4, 3), (4, 4), (3, 8)])
def test_2bw_has_delay_one_everywhere(p, m):
    for acts in lists(p, m, [ASYNC] * 6, weights="2bw"):
        for a in acts:
            if a.kind in (FORWARD, BACKWARD):
                assert a.version == max(0, a.step - 1)


def test_2bw_needs_enough_microbatches():
    with pytest.raises(ScheduleError, match="microbatches"):
        ScheduleSpec(4, 2, "1f1b", "2bw").check()
    ScheduleSpec(4, 3, "1f1b", "2bw").check()
    with pytest.raises(ScheduleError):
        ScheduleSpec(2, 2, "zigzag", "stash").check()


def test_switch_drains_before_a_sync_step():
    """async -> sync: every microbatch of the async steps is finished at every stage before any
    forward of the sync step; sync -> async starts a new fill."""
    p, m = 4, 2
    for s, acts in enumerate(lists(p, m, [ASYNC, ASYNC, SYNC, ASYNC, ASYNC])):
        first_sync_f = next(i for i, a in enumerate(acts) if a.kind == FORWARD and a.step == 2)
        before = acts[:first_sync_f]
        assert {a.mb for a in before if a.kind == BACKWARD} == set(range(2 * m))
        assert all(a.version == 2 for a in acts if a.kind in (FORWARD, BACKWARD) and a.step == 2)
        # after the sync step the async segment restarts from the flushed weights W(3)
        assert [a.version for a in acts if a.kind == FORWARD and a.step == 3] == [3] * m


@pytest.mark.parametrize("phases", list(PHASES.values()))
def test_eval_travels_in_training_order(phases):
    """An evaluation sits, at every stage, before the same forward, so its activations cross each
    link in the same order as the training activations; it uses version t + 1."""
    p, m = 4, 2
    ls = lists(p, m, phases, eval_at=lambda t: t == -1 or t % 2 == 1 or t == len(phases) - 1)
    positions = []
    for s, acts in enumerate(ls):
        seq = [(a.kind, a.mb if a.kind == FORWARD else a.version) for a in acts if a.kind in (FORWARD, EVAL)]
        positions.append(seq)
        updates = 0
        for a in acts:
            if a.kind == EVAL:
                assert a.version <= updates and a.version == a.step + 1
            updates += a.kind == UPDATE
    assert all(seq == positions[0] for seq in positions)
    assert sum(1 for k, _ in positions[0] if k == EVAL) == 1 + sum(1 for t in range(len(phases)) if t % 2 == 1 or t == len(phases) - 1)


@pytest.mark.parametrize("p,m", [(4, 1), (4, 2), (8, 3), (2, 4)])
def test_lists_need_phases_only_lookahead_steps_ahead(p, m):
    """Producing every stage's actions up to U(t) reads phases up to t + lookahead(p, m) only."""
    for t in range(4):
        plan = Plan(20, [ASYNC] * (t + lookahead(p, m) + 1))
        for s in range(p):
            prog = StageProgram(s, ScheduleSpec(p, m), plan)
            while True:
                a = prog.pop()
                if a.kind == UPDATE and a.step == t:
                    break
        short = Plan(20, [ASYNC] * (t + lookahead(p, m)))
        if lookahead(p, m) > 0:
            with pytest.raises(PlanError):
                prog = StageProgram(0, ScheduleSpec(p, m), short)
                while not ((a := prog.pop()).kind == UPDATE and a.step == t):
                    pass


def test_plan_is_decided_in_order():
    plan = Plan(5)
    plan.decide(0, SYNC)
    with pytest.raises(PlanError):
        plan.decide(2, ASYNC)
    with pytest.raises(PlanError):
        plan.phase(1)
    assert plan.phase(7) is None
