"""Interleaved 1F1B (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM", SC 2021): virtual stages.

The model is cut into ``p * v`` chunks; chunk ``c`` lives on device ``c % p`` (device ``d`` holds
chunks ``d, d + p, ..., d + (v - 1) p``, its local chunks ``j = 0..v-1``). A microbatch passes every
device ``v`` times. Device ``d`` runs, per step of ``m`` microbatches (``m`` a multiple of ``p``),
the ``k``-th of its ``m v`` forwards on local chunk ``(k // p) % v`` and microbatch
``(k // (p v)) p + k % p`` (microbatches in groups of ``p``, each group through every chunk), its
backwards in the same order over chunks ``v - 1 - (k // p) % v``: first
``min(m v, 2 (p - d - 1) + (v - 1) p)`` warm-up forwards, then forward-backward pairs, then the
remaining backwards, then one update per chunk.

With chunk costs ``F / v`` and ``B / v`` (the device's share cut in ``v``), the bubble per step is
``(p - 1)(F + B) / v``: 1F1B's divided by ``v``, for ``v`` times the point-to-point messages.

AdaPipe with ``schedule.sync=interleaved`` keeps this placement for the whole run (weights never
move), and its async phase is PipeDream (weight stashing, no flush) over the ``p v`` virtual
stages: a segment of consecutive async steps is one interleaved order over all its microbatches
(:func:`stream_order`), the same warm-up, pairs and cool-down as a step's, with each chunk's
update ``U(t)`` right after its backward of step ``t``'s last microbatch instead of at a flush.
A forward computes with its chunk's latest version, its backward with the same (stashed) one.
In a segment that starts at step ``t0`` (microbatches ``i`` counted from its first), the forward
of ``i`` on local chunk ``j`` of device ``d`` is the device's forward slot
``k = floor(i / p) p v + j p + i mod p``; the backward of a step's last microbatch on that chunk
is backward slot ``(t - t0 + 1) m v - j p - 1``, and backward slot ``b`` runs right after
forward slot ``W_d + b`` (``W_d = 2 (p - d - 1) + (v - 1) p``), so the forward uses version

    ``t0 + max(0, floor((k - W_d + j p) / (m v)))``

and its gradient is ``floor(i / m) - max(0, floor((k - W_d + j p) / (m v)))`` steps stale.
The order is deadlock-free whatever the segment's length (it is Megatron's order over that many
microbatches), so the drain at async -> sync is its cool-down, and the fill at sync -> async its
warm-up. Why this design: no weight moves at a switch (re-placing the chunks for a 1F1B stream
would send every chunk's weights and optimizer state), both phases keep one placement, message
pattern and memory ledger, and a switch stays a segment boundary as for the other sync
schedules. Its price: a device holds up to ``W_d + 1`` chunk activations in the stream, each a
``1 / v`` share (device 0: ``p + (p - 1) / v`` microbatches' worth, 1F1B's ``p`` and a little), and,
as in PipeDream, the first virtual stage's gradients are the stalest. In the steady state a step takes ``m (F + B)`` per device: no
bubble.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable, Iterator

from .actions import ASYNC, BACKWARD, FORWARD, SYNC, UPDATE

CUT = "C"  # a device's step boundary in :func:`device_order` (not an action)


def _chunk_and_mb(k: int, p: int, v: int, backward: bool) -> tuple[int, int]:
    j = (k // p) % v
    return (v - 1 - j if backward else j), (k // (p * v)) * p + k % p


def warmup(device: int, p: int, v: int, m: int) -> int:
    """Device ``device``'s warm-up forwards, before its forward-backward pairs:
    ``min(m v, 2 (p - d - 1) + (v - 1) p)``."""
    return min(m * v, 2 * (p - device - 1) + (v - 1) * p)


@lru_cache(maxsize=64)
def interleaved_order(p: int, v: int, m: int) -> tuple[tuple[tuple[str, int, int], ...], ...]:
    """Per device, its step's actions as ``(kind, local chunk, microbatch index in the step)``; an
    update is ``(U, j, -1)``, one per local chunk at the end."""
    out = []
    total = m * v
    for d in range(p):
        w = warmup(d, p, v, m)
        acts = [(FORWARD, *_chunk_and_mb(k, p, v, False)) for k in range(w)]
        for i in range(total - w):
            acts.append((FORWARD, *_chunk_and_mb(w + i, p, v, False)))
            acts.append((BACKWARD, *_chunk_and_mb(i, p, v, True)))
        acts += [(BACKWARD, *_chunk_and_mb(k, p, v, True)) for k in range(total - w, total)]
        acts += [(UPDATE, j, -1) for j in range(v)]
        out.append(tuple(acts))
    return tuple(out)


def stream_warmup(device: int, p: int, v: int) -> int:
    """Device ``device``'s warm-up forwards in an async segment (as long as the segment allows):
    ``W_d = 2 (p - d - 1) + (v - 1) p``."""
    return 2 * (p - device - 1) + (v - 1) * p


def stream_order(device: int, p: int, v: int, m: int, in_segment: Callable[[int], bool]) -> Iterator[tuple[str, int, int]]:
    """Device ``device``'s actions in an async segment, ``(kind, local chunk, microbatch index in
    the segment)``, read lazily: forward slot ``k`` runs only once ``in_segment`` says its
    microbatch is in the segment (the first that is not ends it: slots come in groups of ``p``
    microbatches of one step, ``m`` being a multiple of ``p``). ``U`` of a chunk follows its
    backward of each step's last microbatch. ``(CUT, -1, t)`` marks the device's cut of the
    segment's step ``t``: after backward slot ``(t + 1) m v - 1 + d`` (or the segment's end). The
    cuts of all devices are closed under the order's dependencies (what a device ran before its cut
    needs only what the others ran before theirs: backward slot ``b`` of device ``d`` needs slot
    ``b`` of ``d + 1``, or slot ``b - p`` of device 0 for ``d = p - 1``; forward slot ``k`` needs
    slot ``k`` of ``d - 1``, or slot ``k - p`` of device ``p - 1`` for ``d = 0``; and
    ``W_{d-1} = W_d + 2``, ``W_{p-1} = W_0 - 2 (p - 1)``), every chunk holds version ``t + 1`` there,
    and no update of ``t + 1`` precedes it (``d < p <= m v - (v - 1) p``). Returns the segment's
    microbatch count."""
    w = stream_warmup(device, p, v)
    k = 0
    while k < w and in_segment(_chunk_and_mb(k, p, v, False)[1]):
        yield (FORWARD, *_chunk_and_mb(k, p, v, False))
        k += 1
    b, cuts = 0, 0

    def backward(b: int) -> Iterator[tuple[str, int, int]]:
        nonlocal cuts
        j, i = _chunk_and_mb(b, p, v, True)
        yield BACKWARD, j, i
        if (i + 1) % m == 0:
            yield UPDATE, j, i
        if b == (cuts + 1) * m * v - 1 + device:
            yield CUT, -1, cuts
            cuts += 1

    if k == w:  # warm-up complete: forward-backward pairs while the segment lasts
        while in_segment(_chunk_and_mb(w + b, p, v, False)[1]):
            yield (FORWARD, *_chunk_and_mb(w + b, p, v, False))
            yield from backward(b)
            b += 1
        k = w + b
    total = k  # forward slots of the segment: its microbatches times v
    while b < total:
        yield from backward(b)
        b += 1
    for t in range(cuts, total // (m * v)):  # (the steps whose cut would fall past the segment's end)
        yield CUT, -1, t
    return total // v


def chunk_actions(chunk: int, p: int, v: int, m: int) -> list[tuple[str, int]]:
    """Virtual stage ``chunk``'s own actions in one step, ``(kind, i)``: its device's order
    restricted to it."""
    d, j = chunk % p, chunk // p
    return [(kind, i) for kind, jj, i in interleaved_order(p, v, m)[d] if jj == j]


def device_order(device: int, spec, plan) -> Iterator[tuple[str, int]]:
    """Device ``device``'s actions, ``(kind, virtual stage)``, step after step as the plan decides:
    a sync step's interleaved order (:func:`interleaved_order`), or an async segment's
    (:func:`stream_order`); after each step ``t``, at its cut, ``(CUT, t)``."""
    p, v, m = spec.stages, spec.chunks, spec.microbatches
    step = 0
    while (phase := plan.phase(step)) is not None:
        if phase == SYNC:
            for kind, j, _ in interleaved_order(p, v, m)[device]:
                yield kind, device + p * j
            yield CUT, step
            step += 1
            continue
        t0 = step
        order = stream_order(device, p, v, m, lambda i: plan.phase(t0 + i // m) == ASYNC)
        while True:
            try:
                kind, j, i = next(order)
            except StopIteration as end:
                step = t0 + end.value // m
                break
            yield (CUT, t0 + i) if kind == CUT else (kind, device + p * j)


class DevicePicks:
    """Which virtual stage each device runs next: its order of the plan (:func:`device_order`),
    generated as the runtimes ask, with the cuts before step ``until`` passed over (a run of step
    ``t`` stops each device at its cut of ``t``: :meth:`at_cut`). Without chunks every stage is its
    own device and always next. ``programs``: the virtual stages' programs at a saved position,
    whose training actions (all but evaluations) a device's position counts, fast-forwarded to it
    (a device whose programs are None is not: a worker knows only its own)."""

    def __init__(self, spec, plan, programs=None):  # a ScheduleSpec, a Plan, StagePrograms
        self.on = spec.chunks > 1
        self.p, self.v = spec.stages, spec.chunks
        self.orders = [device_order(d, spec, plan) for d in range(self.p)] if self.on else []
        self.next: list[tuple | None] = [None] * self.p
        self.pos = [0] * self.p  # training actions each device has run
        self.until = float("inf")
        for d in range(self.p if self.on and programs else 0):
            if programs[d] is None:
                continue
            n = sum(programs[d + self.p * j].trained for j in range(self.v))
            while self.pos[d] < n:  # (entry passes every cut here)
                self.entry(d)
                self.advance(d)

    def entry(self, d: int) -> tuple | None:
        """Device ``d``'s next entry, ``(kind, virtual stage)`` or ``(CUT, step)``, passing cuts before
        ``until``; None once its order has ended."""
        while True:
            if self.next[d] is None:
                self.next[d] = next(self.orders[d], None)
            e = self.next[d]
            if e is None or e[0] != CUT or e[1] >= self.until:
                return e
            self.next[d] = None

    def at_cut(self, d: int, step: int) -> bool:
        """Whether device ``d`` has run everything before its cut of ``step`` (or its whole order);
        ``until`` must be ``step``."""
        e = self.entry(d)
        return e is None or (e[0] == CUT and e[1] == step)

    def pass_cut(self, d: int) -> None:
        """Move device ``d`` past the cut it is at."""
        self.next[d] = None

    def next_is(self, s: int) -> bool:
        """Whether ``s`` is its device's next (or the device's order has ended: evaluations after the
        last step run in any order their channel allows)."""
        if not self.on:
            return True
        e = self.entry(s % self.p)
        return e is None or (e[0] != CUT and e[1] == s)

    def advance(self, s: int) -> list[int]:
        """Move device ``s % p`` past ``s``'s action; returns the device's virtual stages (to wake:
        one of them is next, found when asked, as the plan may not reach that far yet)."""
        if not self.on:
            return []
        d = s % self.p
        self.next[d] = None
        self.pos[d] += 1
        return [d + self.p * j for j in range(self.v)]

    def updates_after(self, s: int) -> list[int]:
        """At a sync update of ``s``: the virtual stages whose updates its device runs after it (one
        per later local chunk, the end of the step's order)."""
        if not self.on:
            return []
        return [s + self.p * j for j in range(1, self.v - s // self.p)]
