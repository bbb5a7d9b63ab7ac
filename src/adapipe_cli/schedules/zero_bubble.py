"""The order of ZB-H2's actions (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, fig. 3).

ZB-H2 is the order that a pipeline with unit costs ``F = I = W`` and free links runs when every
stage, each time it is free, takes

1. the input gradient ``I`` of its oldest microbatch whose output gradient has arrived (the
   critical path), else
2. its next forward, if its input has arrived and the stage holds fewer than ``2p - 1``
   microbatches (forwarded, weight gradient not yet run), else
3. its oldest pending weight gradient ``W``.

So stage ``s`` starts with ``2(p - s) - 1`` forwards (its first ``I`` arrives after them), runs
``I`` as soon as each arrives, and the deferred ``W`` fill what 1F1B leaves idle, the tail
included: with ``m >= 2p - 1`` stage ``s`` is busy from ``s`` to ``s + 3m`` without a gap (a
parallelogram; 1F1B's step is a trapezoid). Every stage holds at most ``min(m, 2p - 1)``
microbatches, the paper's ``(2p - 1) M_B``. Without a barrier at the optimizer step (the paper's
section 4), consecutive steps' parallelograms tile and the bubble per step is
``(p - 1)(F + I - 2W)``: zero at ``F = I = W``.

An order that a dependency-respecting execution realises at one set of costs has no cyclic
waits, so the executors run it at any costs (only the timing changes).
"""

from __future__ import annotations

from functools import lru_cache

from .actions import FORWARD, INPUT, WEIGHT


def held_limit(stages: int) -> int:
    """Microbatches a ZB-H2 stage holds at most: ``2p - 1``."""
    return 2 * stages - 1


@lru_cache(maxsize=64)
def zbh2_order(stages: int, microbatches: int) -> tuple[tuple[tuple[str, int], ...], ...]:
    """Per stage, its step's actions as ``(kind, i)``, ``i`` the microbatch's index in the step."""
    p, m, limit = stages, microbatches, held_limit(stages)
    order: list[list[tuple[str, int]]] = [[] for _ in range(p)]
    n_f, n_i, n_w = [0] * p, [0] * p, [0] * p
    f_end: dict[tuple[int, int], int] = {}  # (stage, i) -> the unit time its F ends
    i_end: dict[tuple[int, int], int] = {}
    now = 0
    while any(n < m for n in n_w):
        for s in range(p):  # every stage takes one unit action at time ``now`` (or idles)
            j = n_i[s]
            if j < n_f[s] and (s == p - 1 or i_end.get((s + 1, j), now + 1) <= now):
                order[s].append((INPUT, j))
                i_end[(s, j)] = now + 1
                n_i[s] += 1
            elif (n_f[s] < m and n_f[s] - n_w[s] < limit
                  and (s == 0 or f_end.get((s - 1, n_f[s]), now + 1) <= now)):
                order[s].append((FORWARD, n_f[s]))
                f_end[(s, n_f[s])] = now + 1
                n_f[s] += 1
            elif n_w[s] < n_i[s]:
                order[s].append((WEIGHT, n_w[s]))
                n_w[s] += 1
        now += 1
    return tuple(tuple(o) for o in order)
