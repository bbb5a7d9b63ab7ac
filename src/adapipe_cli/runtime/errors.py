"""What a runtime raises for the training loop to report: below both runtimes and the loop, so
that none of them imports another for its exceptions."""

from __future__ import annotations


class TrainingDiverged(RuntimeError):
    """The loss became non-finite (or spiked) and no guard recovered it."""


class WorkerFailed(RuntimeError):
    """A worker died, failed or hung; the message is one line naming its stage, rank and cause."""


__all__ = ["TrainingDiverged", "WorkerFailed"]
