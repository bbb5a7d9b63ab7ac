"""The vocabulary of a schedule: actions, phases and the phase plan.

Weight versions are numbered by updates: a stage holds version ``v`` after ``v`` optimizer updates,
and the update of step ``t`` turns version ``t`` into ``t + 1``. Every forward and backward action
names the version it computes with, so the numbers a schedule produces do not depend on when a
runtime happens to execute it.
"""

from __future__ import annotations

from typing import NamedTuple

SYNC, ASYNC = "sync", "async"
FORWARD, BACKWARD, UPDATE, EVAL = "F", "B", "U", "E"
# a backward split in two (zero-bubble schedules): the input gradient, sent upstream (on the
# critical path), and the weight gradient, which can wait
INPUT, WEIGHT = "I", "W"
BACKWARDS = (BACKWARD, INPUT, WEIGHT)


class Action(NamedTuple):
    """One unit of a stage's work.

    kind: F (forward of microbatch ``mb``), B (its backward), or the backward split into I (input
    gradient) and W (weight gradient), U (optimizer update of ``step``) or E (forward of the
    validation set with version ``version``; used where evaluation travels through the pipeline).
    mb: global microbatch index ``step * m + i`` (-1 for U and E).
    step: optimizer step (minibatch) the action belongs to.
    version: weight version the action computes with (U: the version it updates).
    phase: ``sync`` (flushed step; its update clips by the global gradient norm) or ``async``.
    """

    kind: str
    mb: int
    step: int
    version: int
    phase: str

    def __str__(self) -> str:
        if self.kind in (FORWARD, BACKWARD, INPUT, WEIGHT):
            return f"{self.kind}{self.mb}@v{self.version}"
        if self.kind == UPDATE:
            return f"U{self.step}"
        return f"E{self.version}"


class PlanError(RuntimeError):
    """A schedule asked for the phase of a step that has not been decided yet."""


class Plan:
    """The phase of every step, decided online (AdaPipe) or fixed in advance.

    Steps at or beyond ``max_steps`` have no phase: the pipeline drains there.
    """

    def __init__(self, max_steps: int, phases: list[str] | None = None):
        self.max_steps = max_steps
        self.phases: list[str] = list(phases or [])

    def phase(self, step: int) -> str | None:
        if step >= self.max_steps:
            return None
        if step < len(self.phases):
            return self.phases[step]
        raise PlanError(f"phase of step {step} is not decided yet (decided up to {len(self.phases) - 1})")

    def decide(self, step: int, phase: str) -> None:
        """Fix the phase of ``step``; steps are decided in order."""
        if phase not in (SYNC, ASYNC):
            raise ValueError(f"unknown phase {phase!r}")
        if step != len(self.phases):
            raise PlanError(f"step {step} decided out of order (next undecided step is {len(self.phases)})")
        self.phases.append(phase)

    def decided(self) -> int:
        return len(self.phases)

    def end(self, step: int) -> None:
        """Stop after step ``step - 1``: no further step is trained."""
        self.max_steps = min(self.max_steps, max(step, len(self.phases)))


def lookahead(stages: int, microbatches: int, chunks: int = 1) -> int:
    """Steps beyond ``t`` whose phase must be known to run every stage up to the update of step
    ``t``: the first stage runs ``p - 1`` microbatches ahead in a 1F1B stream, so
    ``ceil((p - 1) / m)``. With ``chunks = v > 1`` (the interleaved stream of :mod:`.interleaved`):
    ``1 + (2p - 1) // m``. Device 0 reaches its last ``U(t)`` (chunk 0's backward slot
    ``(t + 1) m v - 1``) after forward slot ``W_0 + (t + 1) m v - 1``, ``2p - 3`` microbatches past
    step ``t + 1``'s first; device ``d`` runs ``d`` backward slots further, to its cut of step ``t``,
    and a chunk's program reads ahead to its own next action: at most two microbatches more
    (tests/test_adapipe_interleaved.py measures it on the simulator).
    """
    if chunks > 1:
        return 1 + (2 * stages - 1) // microbatches
    return -(-(stages - 1) // microbatches)
