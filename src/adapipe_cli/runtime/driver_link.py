"""A worker's traffic with the driver, off its critical path: a thread with its own board
connection puts the worker's step reports (``rep/{t}/{rank}``) and then fetches the verdict of the
next gate (``go/{t + 1}``) ahead, so that neither a report nor a gate whose verdict is already on
the board waits a round trip through the driver's store (three per step before, with the phase
fetch, which the verdict now carries: :func:`verdict_value`).

Deadlock-free: the thread's work is in the main thread's order, a report before the fetch of the
gate after it; the driver posts ``go/{t + 1}`` only once it has every ``rep/{t}``, and the thread
blocks only in such a fetch, after putting every report queued before it.
"""

from __future__ import annotations

import queue
import threading

from .dist_transport import Board


def verdict_value(verdict: str, first: int, phases: list[str]) -> tuple[str, int, list[str]]:
    """The value of ``go/{t}`` for a ``go`` or ``snap`` verdict: with it, the phases of steps
    ``first, first + 1, ...`` decided so far, so that a worker needs no fetch of ``phase/{u}``
    for them (an ending or ``back`` is the bare string)."""
    return verdict, first, list(phases)


class DriverLink:
    """``report(t, value)`` puts rank ``rank``'s report of step ``t`` in the background and then
    fetches ``go/{t + 1}``; ``verdict(t)`` is that value (waiting for the fetch), or, where no
    fetch of ``go/{t}`` is pending (the first gate, the gate after a rollback), a fetch now;
    ``flush()`` waits until every report is on the board."""

    def __init__(self, board: Board, rank: int):
        self.board, self.rank = board, rank
        self.jobs: queue.Queue = queue.Queue()
        self.pending: dict[int, queue.Queue] = {}  # step -> where its fetched verdict arrives
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    def _serve(self) -> None:
        board = None
        while True:
            kind, key, arg = self.jobs.get()
            try:
                if self.error is None:
                    board = board or self.board.client()  # (a TCPStore connection serves one thread)
                    if kind == "put":
                        board.put(key, arg)
                    else:
                        arg.put(board.get(key))
                elif kind == "get":  # after an error: nothing more is fetched, no one waits for it
                    arg.put(None)
            except BaseException as e:  # noqa: BLE001 - raised again in the main thread
                self.error = e
                if kind == "get":
                    arg.put(None)
            finally:
                self.jobs.task_done()

    def _submit(self, job) -> None:
        if self.error is not None:
            raise self.error
        if self.thread is None:
            self.thread = threading.Thread(target=self._serve, name=f"driver-link-{self.rank}", daemon=True)
            self.thread.start()
        self.jobs.put(job)

    def report(self, step: int, value: dict) -> None:
        self._submit(("put", f"rep/{step}/{self.rank}", value))
        box: queue.Queue = queue.Queue(maxsize=1)
        self.pending[step + 1] = box
        self._submit(("get", f"go/{step + 1}", box))

    def verdict(self, step: int):
        box = self.pending.pop(step, None)
        if box is None:
            return self.board.get(f"go/{step}")
        value = box.get()
        if self.error is not None:
            raise self.error
        return value

    def flush(self) -> None:
        """Wait until the thread has done every job queued (at the run's end: its last fetch, of the
        ending's gate, has returned), raising its error if it had one."""
        if self.thread is not None:
            self.jobs.join()
        if self.error is not None:
            raise self.error
