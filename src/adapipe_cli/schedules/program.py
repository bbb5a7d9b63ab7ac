"""Per-stage action lists, generated lazily from the phase plan.

Training is a sequence of *segments*. Every synchronous step is a segment of its own (it ends with
a flush); consecutive asynchronous steps form one segment, a continuous 1F1B stream with no flush.
A phase switch is therefore a segment boundary: async -> sync drains the stream (cool-down of the
1F1B segment) before the sync step starts, sync -> async starts a new fill.

Within a segment of microbatches ``[a, b)`` stage ``s`` of ``p`` runs

- GPipe (sync only): ``F(a..b-1)``, then ``B(a..b-1)``;
- 1F1B: ``w = p - s - 1`` warm-up forwards, then ``F(a+w+i), B(a+i)`` pairs, then the remaining
  backwards (so stage ``s`` holds at most ``p - s`` microbatches in flight);
- ZB-H1 (sync only; Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): 1F1B with every
  backward split into its input gradient ``I`` (sent upstream at once) and its weight gradient
  ``W``, and stage ``s`` deferring each ``W`` by ``s`` microbatches: ``W(j)`` right after
  ``I(j + s)``, the last ``s`` of them after the last ``I``, where they fill the drain's idle time
  that 1F1B leaves. A microbatch's activations live until its ``W``, so every stage holds at most
  ``p`` microbatches, 1F1B's peak (stage 0's); with ``F = I = W`` the bubble falls from 1F1B's
  ``(p - 1)(F + I + W)`` to ``(p - 1)(F + I - W)`` per step.
- ZB-H2 (sync only; the same paper): the same split, with up to ``2(p - s) - 1`` warm-up forwards
  at stage ``s`` and the ``W`` deferred to the tail (:mod:`.zero_bubble`): every stage holds up to
  ``2p - 1`` microbatches, and without the update's barrier (``ScheduleSpec.barrier``) the bubble
  per step is ``(p - 1)(F + I - 2W)``, zero at ``F = I = W``.
- interleaved 1F1B (``chunks = v > 1``): stage ``s`` is one of ``p v`` virtual stages, on device
  ``s % p``; its list is its device's interleaved order restricted to it (:mod:`.interleaved`),
  and the runtimes run each device's virtual stages in that order. In an async segment (AdaPipe
  with ``sync=interleaved``) the order is the interleaved stream of :mod:`.interleaved`: PipeDream
  over the ``p v`` virtual stages, weight stashing only.

and the update ``U(t)`` right after the backward of the last microbatch of step ``t``.

Weight versions (see :mod:`.actions`); ``t0`` is the first step of the segment:

- sync: every action of step ``t`` uses version ``t``.
- ``stash`` (PipeDream): a forward uses the stage's latest version, which in a 1F1B stream is
  ``max(t0, floor((j - w) / m))`` for microbatch ``j``; its backward uses the same (stashed) one.
- ``latest`` (PipeMare, no stashing): forwards as ``stash``; a backward uses the latest version
  at the time it runs.
- ``vertical``: every stage uses the version the first stage used for that microbatch,
  ``max(t0, floor((j - p + 1) / m))``.
- ``2bw`` (PipeDream-2BW): every action of step ``t`` uses ``max(t0, t - 1)``: gradient delay one
  step at every stage. Feasible only when ``m >= p - 1`` (the first stage must have applied
  ``U(t-2)`` before it forwards step ``t``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

from .actions import ASYNC, BACKWARD, EVAL, FORWARD, INPUT, SYNC, UPDATE, WEIGHT, Action, Plan
from .interleaved import chunk_actions, stream_order
from .zero_bubble import zbh2_order

WEIGHT_RULES = ("stash", "latest", "vertical", "2bw")
SYNC_SCHEDULES = ("1f1b", "gpipe", "zbh1", "zbh2", "interleaved")
SPLIT_SCHEDULES = ("zbh1", "zbh2")  # sync schedules whose backward is split into I and W


class ScheduleError(ValueError):
    """A schedule that cannot run with the requested stages and microbatches."""


@dataclass(frozen=True)
class ScheduleSpec:
    """What the stage programs need to know: depth, microbatches and the two phases' kinds."""

    stages: int
    microbatches: int
    sync: str = "1f1b"  # 1f1b | gpipe | zbh1 | zbh2
    weights: str = "stash"  # async weight rule: stash | latest | vertical | 2bw
    # a sync update waits for every stage (the global gradient norm for clipping, the tied
    # embedding's sum); False (zbh2 without either) lets each stage update after its own last W
    barrier: bool = True
    chunks: int = 1  # model chunks per device (interleaved: p * chunks virtual stages)

    @property
    def virtual_stages(self) -> int:
        return self.stages * self.chunks

    def device_of(self, stage: int) -> int:
        """The device of virtual stage ``stage`` (itself when ``chunks`` is 1)."""
        return stage % self.stages

    def check(self) -> None:
        if self.sync not in SYNC_SCHEDULES:
            raise ScheduleError(f"unknown sync schedule {self.sync!r}: use {', '.join(SYNC_SCHEDULES)}")
        if self.chunks < 1 or (self.chunks > 1 and self.sync != "interleaved"):
            raise ScheduleError(f"schedule.chunks={self.chunks}: use 1, or more with schedule=interleaved")
        if self.sync == "interleaved" and self.microbatches % self.stages:
            raise ScheduleError(f"interleaved 1F1B needs pipeline.microbatches to be a multiple of pipeline.stages "
                                f"(= {self.stages}); got {self.microbatches}")
        if self.weights not in WEIGHT_RULES:
            raise ScheduleError(f"unknown weight rule {self.weights!r}: use stash, latest or vertical")
        if self.chunks > 1 and self.weights != "stash":
            raise ScheduleError(f"the async phase over interleaved chunks is PipeDream with weight stashing: use "
                                f"schedule.async=pipedream schedule.weights=stash (got weights={self.weights})")
        if self.weights == "2bw" and self.microbatches < self.stages - 1:
            raise ScheduleError(
                f"2bw needs pipeline.microbatches >= pipeline.stages - 1 (= {self.stages - 1}); "
                f"got {self.microbatches}: raise the microbatches or use schedule=pipedream"
            )


class StageProgram:
    """The action list of one stage, produced on demand.

    ``peek()`` returns the next action (or None at the end) without consuming it; ``pop()``
    consumes it. The program reads the plan only as far as the next action needs: to produce the
    actions up to ``U(t)`` it needs the phases of steps up to ``t + lookahead(p, m)``.

    ``eval_at(t)`` (optional) asks for an ``E`` action with version ``t + 1`` after step ``t``;
    ``E`` of version 0 comes first when ``eval_at(-1)``. An ``E`` is placed right before the
    forward that the first stage runs next after its ``U(t)`` (at every stage), so validation
    activations travel between stages in the same order as training activations.
    """

    def __init__(self, stage: int, spec: ScheduleSpec, plan: Plan, eval_at: Callable[[int], bool] | None = None):
        if eval_at is not None and spec.chunks > 1:  # (a device's cut is where both runtimes evaluate)
            raise ValueError("with chunks, evaluations run at each device's cut of a step, not in the stage programs")
        self.s, self.spec, self.plan = stage, spec, plan
        self.p, self.m = spec.stages, spec.microbatches
        self.eval_at = eval_at or (lambda t: False)
        self.updates = 0  # U actions emitted so far
        self.next_f = 0  # next microbatch this stage will forward
        self.seg_start = 0  # first step of the current segment
        self.seg_phase = SYNC  # and its phase
        self.pending_evals: list[tuple[int, int]] = []  # (forward index before which E goes, step)
        self._gen = self._generate()
        self._next: Action | None = None
        self._peeked = False
        self.popped = 0  # actions consumed so far: the program's position, for checkpoints
        self.trained = 0  # of them, training actions (not E): the device's count with chunks

    # -- public ------------------------------------------------------------------------------
    def peek(self) -> Action | None:
        if not self._peeked:
            self._next = next(self._gen, None)
            self._peeked = True
        return self._next

    def pop(self) -> Action | None:
        a = self.peek()
        self._peeked = False
        if a is not None:
            self.popped += 1
            self.trained += a.kind != EVAL
        return a

    def skip(self, n: int) -> None:
        """Consume the first ``n`` actions (a fresh program fast-forwarded to a saved position)."""
        while self.popped < n:
            if self.pop() is None:
                raise RuntimeError(f"stage {self.s}: the schedule ended before position {n}")

    def floor_version(self) -> int:
        """A lower bound on the version of every action not yet returned by ``pop``."""
        lo, nxt = self.updates, self._next
        if self._peeked and nxt is not None and nxt.version < lo:
            lo = nxt.version
        if self.seg_phase == ASYNC:  # (a flushed step computes with the live version only)
            rule, j = self.spec.weights, self.next_f
            if rule == "vertical":
                lo = min(lo, max(self.seg_start, (j - self.p + 1) // self.m))
            elif rule == "2bw":
                lo = min(lo, max(self.seg_start, j // self.m - 1))
        for _, t in self.pending_evals:
            lo = min(lo, t + 1)
        return lo

    # -- generation --------------------------------------------------------------------------
    def _generate(self) -> Iterator[Action]:
        if self.eval_at(-1):
            yield Action(EVAL, -1, -1, 0, SYNC)
        step = 0
        while True:
            phase = self.plan.phase(step)
            if phase is None:
                break
            self.seg_start, self.seg_phase = step, phase
            if phase == SYNC:
                yield from self._sync_step(step)
                step += 1
            else:
                step = yield from self._async_segment(step)
        for _, t in self.pending_evals:
            yield Action(EVAL, -1, t, t + 1, SYNC)
        self.pending_evals.clear()

    def _forward(self, j: int, version: int, phase: str) -> Iterator[Action]:
        # evaluations placed before this forward (see the class docstring)
        while self.pending_evals and self.pending_evals[0][0] <= j:
            _, t = self.pending_evals.pop(0)
            yield Action(EVAL, -1, t, t + 1, SYNC)
        self.next_f = j + 1
        yield Action(FORWARD, j, j // self.m, version, phase)

    def _update(self, step: int, phase: str, seg_end: int | None) -> Iterator[Action]:
        self.updates += 1
        yield Action(UPDATE, -1, step, step, phase)
        if self.eval_at(step):
            # the first stage's next forward after U(step): first(step+1) + w0 in a stream, or
            # the segment's end if it comes first
            nxt = (step + 1) * self.m + (self.p - 1 if phase == ASYNC else 0)
            self.pending_evals.append((nxt if seg_end is None else min(nxt, seg_end), step))

    def _sync_step(self, t: int) -> Iterator[Action]:
        a, m = t * self.m, self.m
        mbs = range(a, a + m)
        if self.spec.sync == "gpipe":
            for j in mbs:
                yield from self._forward(j, t, SYNC)
            for j in mbs:
                yield Action(BACKWARD, j, t, t, SYNC)
        elif self.spec.sync == "interleaved":
            for kind, i in chunk_actions(self.s, self.p, self.spec.chunks, m):
                if kind == FORWARD:
                    yield from self._forward(a + i, t, SYNC)
                elif kind == BACKWARD:
                    yield Action(BACKWARD, a + i, t, t, SYNC)
        elif self.spec.sync == "zbh2":
            for kind, i in zbh2_order(self.p, m)[self.s]:
                if kind == FORWARD:
                    yield from self._forward(a + i, t, SYNC)
                else:
                    yield Action(kind, a + i, t, t, SYNC)
        elif self.spec.sync == "zbh1":
            w, lag = min(self.p - self.s - 1, m), self.s  # warm-up forwards; how far each W trails its I
            for j in range(a, a + w):
                yield from self._forward(j, t, SYNC)
            for i in range(m):
                if i + w < m:
                    yield from self._forward(a + w + i, t, SYNC)
                yield Action(INPUT, a + i, t, t, SYNC)
                if i >= lag:
                    yield Action(WEIGHT, a + i - lag, t, t, SYNC)
            for j in range(a + max(0, m - lag), a + m):
                yield Action(WEIGHT, j, t, t, SYNC)
        else:
            w = min(self.p - self.s - 1, m)
            for j in range(a, a + w):
                yield from self._forward(j, t, SYNC)
            for i in range(m - w):
                yield from self._forward(a + w + i, t, SYNC)
                yield Action(BACKWARD, a + i, t, t, SYNC)
            for j in range(a + m - w, a + m):
                yield Action(BACKWARD, j, t, t, SYNC)
        yield from self._update(t, SYNC, (t + 1) * m)

    def _in_segment(self, j: int) -> bool:
        return self.plan.phase(j // self.m) == ASYNC

    def _async_segment(self, t0: int) -> Iterator[Action]:
        """A 1F1B stream over consecutive async steps from ``t0``; returns the step after it."""
        if self.spec.chunks > 1:
            return (yield from self._interleaved_segment(t0))
        m, w = self.m, self.p - self.s - 1
        a = t0 * m
        fwd_version: dict[int, int] = {}
        end: int | None = None  # first microbatch beyond the segment, once known

        def f_version(j: int) -> int:
            rule = self.spec.weights
            if rule == "vertical":
                return max(t0, (j - self.p + 1) // m)
            if rule == "2bw":
                v = max(t0, j // m - 1)
                if v > self.updates:  # ScheduleSpec.check rejects the configurations where this happens
                    raise ScheduleError(f"2bw: stage {self.s} needs version {v} before it exists")
                return v
            return self.updates  # stash, latest: the stage's latest weights

        def forward(j: int) -> Iterator[Action]:
            fwd_version[j] = f_version(j)
            yield from self._forward(j, fwd_version[j], ASYNC)

        def backward(j: int) -> Iterator[Action]:
            v = self.updates if self.spec.weights == "latest" else fwd_version[j]
            del fwd_version[j]
            yield Action(BACKWARD, j, j // m, v, ASYNC)
            if (j + 1) % m == 0:
                yield from self._update(j // m, ASYNC, end)

        j = a
        while j < a + w and self._in_segment(j):
            yield from forward(j)
            j += 1
        i = a
        if j == a + w:  # warm-up complete: steady state
            while self._in_segment(a + w + (i - a)):
                yield from forward(a + w + (i - a))
                yield from backward(i)
                i += 1
        # the first microbatch of a non-async step ends the segment, so it is a step boundary
        end = j if j < a + w else a + w + (i - a)
        # evaluations waiting for the first stage's next forward: it is at most the segment's end
        self.pending_evals = [(min(k, end), t) for k, t in self.pending_evals]
        while i < end:
            yield from backward(i)
            i += 1
        return end // m

    def _interleaved_segment(self, t0: int) -> Iterator[Action]:
        """PipeDream over the virtual stages (weight stashing): this chunk's part of its device's
        interleaved stream from step ``t0`` (:func:`.interleaved.stream_order`); returns the step
        after the segment."""
        m, a, p, v = self.m, t0 * self.m, self.p, self.spec.chunks
        d, j = self.s % p, self.s // p
        order = stream_order(d, p, v, m, lambda i: self._in_segment(a + i))
        fwd_version: dict[int, int] = {}
        while True:
            try:
                kind, jj, i = next(order)
            except StopIteration as stop:
                end = a + stop.value
                break
            if jj != j:
                continue
            if kind == FORWARD:
                fwd_version[a + i] = self.updates  # the chunk's latest weights
                yield from self._forward(a + i, self.updates, ASYNC)
            elif kind == BACKWARD:
                yield Action(BACKWARD, a + i, (a + i) // m, fwd_version.pop(a + i), ASYNC)
            else:
                yield from self._update((a + i) // m, ASYNC, None)
        # evaluations waiting for the first stage's next forward: it is at most the segment's end
        self.pending_evals = [(min(k, end), t) for k, t in self.pending_evals]
        return end // m
