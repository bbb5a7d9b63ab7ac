"""Mixed phase plans against a version table written from the semantics, not from the engine.

The expected lists come from two places that do not call :class:`StageProgram`: tables written
out by hand for small cases, and ``version_table.expected_lists``, a small simulation of the
documented semantics (schedules/program.py docstring, DESIGN.md "Weight semantics").
"""

from __future__ import annotations

import pytest

from adapipe_cli.schedules import Plan, ScheduleError, ScheduleSpec, StageProgram
from version_table import PHASE, expected_lists, segments

PLANS = ["aaasaaa", "saassaaa"]
DEPTHS = [(4, 1), (4, 2), (3, 4), (2, 1)]


def engine_lists(p: int, m: int, plan: str, rule: str, sync: str = "1f1b") -> list[list[tuple]]:
    phases = [PHASE[c] for c in plan]
    spec = ScheduleSpec(p, m, sync, rule)
    spec.check()
    out = []
    for s in range(p):
        prog, acts = StageProgram(s, spec, Plan(len(phases), phases)), []
        while (a := prog.pop()) is not None:
            acts.append(tuple(a))
        out.append(acts)
    return out


def text(acts: list[tuple]) -> str:
    return " ".join(f"U{step}" if k == "U" else f"{k}{mb}@{v}" for k, mb, step, v, _ in acts)


# -- tables written out by hand ------------------------------------------------------------------

HAND = {
    # p=2, m=1: stage 0 has one warm-up forward, so its forward of step t (async) sees t - 1 updates
    (2, 1, "aaasaaa", "stash"): [
        "F0@0 F1@0 B0@0 U0 F2@1 B1@0 U1 B2@1 U2 F3@3 B3@3 U3 F4@4 F5@4 B4@4 U4 F6@5 B5@4 U5 B6@5 U6",
        "F0@0 B0@0 U0 F1@1 B1@1 U1 F2@2 B2@2 U2 F3@3 B3@3 U3 F4@4 B4@4 U4 F5@5 B5@5 U5 F6@6 B6@6 U6",
    ],
    (2, 1, "aaasaaa", "latest"): [
        "F0@0 F1@0 B0@0 U0 F2@1 B1@1 U1 B2@2 U2 F3@3 B3@3 U3 F4@4 F5@4 B4@4 U4 F6@5 B5@5 U5 B6@6 U6",
        "F0@0 B0@0 U0 F1@1 B1@1 U1 F2@2 B2@2 U2 F3@3 B3@3 U3 F4@4 B4@4 U4 F5@5 B5@5 U5 F6@6 B6@6 U6",
    ],
    (2, 1, "aaasaaa", "vertical"): [
        "F0@0 F1@0 B0@0 U0 F2@1 B1@0 U1 B2@1 U2 F3@3 B3@3 U3 F4@4 F5@4 B4@4 U4 F6@5 B5@4 U5 B6@5 U6",
        "F0@0 B0@0 U0 F1@0 B1@0 U1 F2@1 B2@1 U2 F3@3 B3@3 U3 F4@4 B4@4 U4 F5@4 B5@4 U5 F6@5 B6@5 U6",
    ],
    (2, 1, "aaasaaa", "2bw"): [  # delay one at both stages; each async run restarts from the sync weights
        "F0@0 F1@0 B0@0 U0 F2@1 B1@0 U1 B2@1 U2 F3@3 B3@3 U3 F4@4 F5@4 B4@4 U4 F6@5 B5@4 U5 B6@5 U6",
        "F0@0 B0@0 U0 F1@0 B1@0 U1 F2@1 B2@1 U2 F3@3 B3@3 U3 F4@4 B4@4 U4 F5@4 B5@4 U5 F6@5 B6@5 U6",
    ],
    # p=4, m=1: the run of two async steps is shorter than stages 0 and 1's warm-up, so it drains
    # at once; the sync steps 3 and 4 run one microbatch through with W(t)
    (4, 1, "saassaaa", "stash"): [
        "F0@0 B0@0 U0 F1@1 F2@1 B1@1 U1 B2@1 U2 F3@3 B3@3 U3 F4@4 B4@4 U4 F5@5 F6@5 F7@5 B5@5 U5 B6@5 U6 B7@5 U7",
        "F0@0 B0@0 U0 F1@1 F2@1 B1@1 U1 B2@1 U2 F3@3 B3@3 U3 F4@4 B4@4 U4 F5@5 F6@5 F7@5 B5@5 U5 B6@5 U6 B7@5 U7",
        "F0@0 B0@0 U0 F1@1 F2@1 B1@1 U1 B2@1 U2 F3@3 B3@3 U3 F4@4 B4@4 U4 F5@5 F6@5 B5@5 U5 F7@6 B6@5 U6 B7@6 U7",
        "F0@0 B0@0 U0 F1@1 B1@1 U1 F2@2 B2@2 U2 F3@3 B3@3 U3 F4@4 B4@4 U4 F5@5 B5@5 U5 F6@6 B6@6 U6 F7@7 B7@7 U7",
    ],
}


@pytest.mark.parametrize("key", list(HAND), ids=lambda k: "-".join(map(str, k)))
def test_hand_written_tables(key):
    p, m, plan, rule = key
    assert [text(a) for a in engine_lists(p, m, plan, rule)] == HAND[key]
    assert [text(a) for a in expected_lists(p, m, plan, rule)] == HAND[key]  # the simulation agrees


# -- the whole grid against the simulation ---------------------------------------------------------

def rules_for(p: int, m: int) -> list[str]:
    return ["stash", "latest", "vertical"] + (["2bw"] if m >= p - 1 else [])


@pytest.mark.parametrize("sync", ["1f1b", "gpipe"])
@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("p,m", DEPTHS)
def test_engine_lists_equal_the_version_table(plan, p, m, sync):
    for rule in rules_for(p, m):
        got, want = engine_lists(p, m, plan, rule, sync), expected_lists(p, m, plan, rule, sync)
        for s in range(p):
            assert got[s] == want[s], f"{rule} stage {s}:\n got  {text(got[s])}\n want {text(want[s])}"


@pytest.mark.parametrize("p,m", [(4, 1), (4, 2)])
def test_2bw_is_refused_where_it_cannot_run(p, m):
    with pytest.raises(ScheduleError, match="microbatches"):
        engine_lists(p, m, PLANS[0], "2bw")


def closed_form(rule: str, p: int, s: int, m: int, j: int, t0: int, kind: str) -> int:
    """The docstring's formulas for an async microbatch j of step t in a segment from t0."""
    t = j // m
    if rule == "2bw":
        return max(t0, t - 1)
    if rule == "vertical":
        return max(t0, (j - p + 1) // m)
    if rule == "latest" and kind == "B":
        return t  # backwards run in order, so U(t - 1) has always landed
    return max(t0, (j - (p - s - 1)) // m)


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("p,m", DEPTHS)
def test_table_follows_the_closed_forms(plan, p, m):
    """The update counting above and the docstring's closed forms give the same versions."""
    seg_of = {t: t0 for t0, t1, _ in segments(plan) for t in range(t0, t1)}
    for rule in rules_for(p, m):
        for s, acts in enumerate(expected_lists(p, m, plan, rule)):
            for kind, j, t, v, ph in acts:
                if kind in "FB":
                    want = t if ph == "sync" else closed_form(rule, p, s, m, j, seg_of[t], kind)
                    assert v == want, (rule, s, kind, j)


@pytest.mark.parametrize("sync", ["1f1b", "gpipe"])
@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("p,m", DEPTHS)
def test_switches_drain_and_fill(plan, p, m, sync):
    """Properties that hold whatever the order: each microbatch is forwarded and backwarded once
    per stage, before its step's update; a sync step starts only after every earlier microbatch
    is finished (drain) and uses W(t); the first async step after a sync step starts from the
    flushed weights; no forward uses a version the stage has not reached."""
    n = len(plan) * m
    for rule in rules_for(p, m):
        for s, acts in enumerate(engine_lists(p, m, plan, rule, sync)):
            f = [a[1] for a in acts if a[0] == "F"]
            b = [a[1] for a in acts if a[0] == "B"]
            assert f == list(range(n)) and sorted(b) == list(range(n)), (rule, s)
            assert [a[2] for a in acts if a[0] == "U"] == list(range(len(plan)))
            done, updates = set(), 0
            for k, (kind, j, t, v, ph) in enumerate(acts):
                if kind == "U":
                    assert set(range(t * m, (t + 1) * m)) <= done
                    updates += 1
                    continue
                assert v <= updates and ph == PHASE[plan[t]]
                if kind == "B":
                    done.add(j)
                if ph == "sync":
                    assert v == t
                    if kind == "F" and j == t * m:
                        assert done == set(range(j)), f"{rule} stage {s}: sync step {t} before the drain"
                elif t > 0 and plan[t - 1] == "s" and j == t * m:
                    assert v == t, f"{rule} stage {s}: fill after sync step {t - 1}"


def check_runs(lists: list[list[tuple]], p: int) -> None:
    """A tiny pipeline: each stage runs its next action when its inputs are there (F(j) after F(j)
    upstream, B(j) after B(j) downstream, a sync U(t) when every stage has reached U(t)); fails on
    a deadlock."""
    pos, fwd, bwd = [0] * p, set(), set()
    while any(pos[s] < len(lists[s]) for s in range(p)):
        moved = False
        heads = [lists[s][pos[s]] if pos[s] < len(lists[s]) else None for s in range(p)]
        for s, a in enumerate(heads):
            if a is None:
                continue
            kind, j, t, _, ph = a
            if kind == "F":
                ok = s == 0 or (s - 1, j) in fwd
            elif kind == "B":
                ok = s == p - 1 or (s + 1, j) in bwd
            else:
                ok = ph == "async" or all(h is not None and h[0] == "U" and h[2] == t for h in heads)
            if ok:
                (fwd if kind == "F" else bwd).add((s, j))
                pos[s] += 1
                moved = True
        assert moved, f"deadlock at {heads}"


@pytest.mark.parametrize("sync", ["1f1b", "gpipe"])
@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("p,m", DEPTHS)
def test_lists_run_without_deadlock(plan, p, m, sync):
    for rule in rules_for(p, m):
        check_runs(engine_lists(p, m, plan, rule, sync), p)
