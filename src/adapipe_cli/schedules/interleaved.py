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
"""

from __future__ import annotations

from functools import lru_cache

from .actions import BACKWARD, FORWARD, UPDATE


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


def chunk_actions(chunk: int, p: int, v: int, m: int) -> list[tuple[str, int]]:
    """Virtual stage ``chunk``'s own actions in one step, ``(kind, i)``: its device's order
    restricted to it."""
    d, j = chunk % p, chunk // p
    return [(kind, i) for kind, jj, i in interleaved_order(p, v, m)[d] if jj == j]


def device_picks(p: int, v: int, m: int) -> list[list[int]]:
    """Per device, the virtual stage of each of its actions in one step, in the order it runs them."""
    return [[d + p * j for _, j, _ in acts] for d, acts in enumerate(interleaved_order(p, v, m))]


class DevicePicks:
    """Which virtual stage each device runs next: its step's order, the same every step. Without
    chunks every stage is its own device and always next."""

    def __init__(self, spec):  # a ScheduleSpec
        self.on = spec.chunks > 1
        self.p = spec.stages
        self.order = device_picks(spec.stages, spec.chunks, spec.microbatches) if self.on else []
        self.pos = [0] * spec.stages

    def next_is(self, s: int) -> bool:
        if not self.on:
            return True
        d = s % self.p
        return self.order[d][self.pos[d]] == s

    def advance(self, s: int) -> list[int]:
        """Move device ``s % p`` past ``s``; returns its next virtual stage (to wake)."""
        if not self.on:
            return []
        d = s % self.p
        self.pos[d] = (self.pos[d] + 1) % len(self.order[d])
        return [self.order[d][self.pos[d]]]

    def updates_after(self, s: int) -> list[int]:
        """The virtual stages whose updates device ``s % p`` runs after ``s``'s: they end its step."""
        if not self.on:
            return []
        d = s % self.p
        return self.order[d][self.pos[d] + 1:]
