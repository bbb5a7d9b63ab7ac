"""The documented weight semantics as a small simulation, written apart from the engine.

Every sync step and every maximal run of async steps is a 1F1B segment; a stage counts its own
updates; ``stash`` forwards with that count and backwards with the same, ``latest`` backwards
with the count current then, ``vertical`` uses the first stage's forward version, ``2bw`` uses
``max(t0, t - 1)``; a sync step t uses W(t). (schedules/program.py docstring, DESIGN.md "Weight
semantics".) Plans are strings: ``a`` an async step, ``s`` a sync step.
"""

from __future__ import annotations

PHASE = {"a": "async", "s": "sync"}


def segments(plan: str) -> list[tuple[int, int, str]]:
    """(first step, step after the last, phase): one per sync step, one per run of async steps."""
    out, t = [], 0
    while t < len(plan):
        end = t + 1
        if plan[t] == "a":
            while end < len(plan) and plan[end] == "a":
                end += 1
        out.append((t, end, PHASE[plan[t]]))
        t = end
    return out


def stage_order(s: int, p: int, m: int, plan: str, sync: str = "1f1b") -> list[tuple[str, int]]:
    """Stage ``s``'s (kind, microbatch) order: in each segment of microbatches [a, b), warm-up
    forwards w = min(p - s - 1, b - a) (GPipe sync steps: w = b - a), then F(a+w+i) B(a+i) pairs,
    then the remaining backwards; U(t) (microbatch -1, step in the second slot) right after the
    backward of step t's last one."""
    order = []
    for t0, t1, ph in segments(plan):
        a, b = t0 * m, t1 * m
        w = b - a if ph == "sync" and sync == "gpipe" else min(p - s - 1, b - a)
        seq = [("F", j) for j in range(a, a + w)]
        for i in range(b - a - w):
            seq += [("F", a + w + i), ("B", a + i)]
        seq += [("B", j) for j in range(b - w, b)]
        for kind, j in seq:
            order.append((kind, j))
            if kind == "B" and (j + 1) % m == 0:
                order.append(("U", j // m))
    return order


def expected_lists(p: int, m: int, plan: str, rule: str, sync: str = "1f1b") -> list[list[tuple]]:
    """Every stage's actions as (kind, mb, step, version, phase), versions from the rule."""
    seg_of = {t: (t0, ph) for t0, t1, ph in segments(plan) for t in range(t0, t1)}
    first_stage_f: dict[int, int] = {}  # microbatch -> version stage 0 forwarded it with
    out = []
    for s in range(p):
        updates, fwd, acts = 0, {}, []
        for kind, j in stage_order(s, p, m, plan, sync):
            if kind == "U":
                acts.append(("U", -1, j, j, PHASE[plan[j]]))
                updates += 1
                continue
            t = j // m
            t0, ph = seg_of[t]
            if s == 0 and kind == "F":
                first_stage_f[j] = updates
            if ph == "sync":
                v = t
            elif rule == "2bw":
                v = max(t0, t - 1)
                assert v <= updates, "2bw needs a version the stage does not have yet"
            elif rule == "vertical":
                v = first_stage_f[j]
            elif kind == "F":
                v = updates  # stash, latest: the stage's latest weights
            elif rule == "stash":
                v = fwd[j]
            else:  # latest: the backward differentiates at the weights current now
                v = updates
            if kind == "F":
                fwd[j] = v
            acts.append((kind, j, t, v, ph))
        out.append(acts)
    return out


def microbatch_versions(p: int, m: int, plan: str, rule: str) -> list[dict[int, tuple[int, int, int]]]:
    """Per stage, microbatch -> (forward version, backward version, updates the stage had made
    when it ran the forward)."""
    out = []
    for acts in expected_lists(p, m, plan, rule):
        updates, fwd, table = 0, {}, {}
        for kind, j, _, v, _ in acts:
            if kind == "U":
                updates += 1
            elif kind == "F":
                fwd[j] = (v, updates)
            else:
                table[j] = (fwd[j][0], v, fwd[j][1])
        out.append(table)
    return out
