"""How the driver of a distributed run waits for its workers and notices when one fails.

The :class:`Collector` waits on the board in a helper thread, so that the driver's main thread
waits on an Event, which Ctrl-C interrupts (a TCPStore wait is not interruptible). The
:class:`Watchdog` ends the run on the first of: a worker process that exits (its sentinel), an
exception a worker reports on the board, or no progress of the awaited reports for
``pipeline.timeout_s``; it names the first cause in one line.
"""

from __future__ import annotations

import multiprocessing.connection
import queue
import re
import signal
import threading
import time

from .dist_transport import Board
from .replicas import who
from .worker import COMPUTING, STATE_NAMES

PEER_LOST = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|communicator was aborted",
                       re.IGNORECASE)


class Pending:
    def __init__(self, keys: list[str]):
        self.keys, self.done = keys, threading.Event()
        self.values: list | None = None
        self.error: BaseException | None = None


class Collector:
    """Waits on the board in a helper thread. A TCPStore wait cannot be interrupted, so the
    driver's main thread waits on an Event instead, which Ctrl-C and the watchdog can break.
    ``stop`` wakes and joins the thread: a thread still inside a TCPStore call when Python exits
    aborts the process ("terminate called without an active exception")."""

    def __init__(self, board: Board):
        self.board = board.client(timeout_s=7 * 24 * 3600)
        self.requests: queue.Queue = queue.Queue()
        self.current: list[str] = []
        self.closing = False
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._serve, daemon=True, name="adapipe-collector")
        self.thread.start()

    def request(self, keys: list[str]) -> Pending:
        pend = Pending(keys)
        self.requests.put(pend)
        return pend

    def _serve(self) -> None:
        while (pend := self.requests.get()) is not None:
            with self.lock:
                if self.closing:
                    break
                self.current = pend.keys
            try:
                self.board.wait(pend.keys)
                pend.values = [self.board.get(k) for k in pend.keys]
            except Exception as e:  # noqa: BLE001 - handed to the main thread
                pend.error = e
            self.current = []
            pend.done.set()

    def stop(self, board: Board) -> None:
        with self.lock:
            self.closing = True
            keys = list(self.current)
        for key in keys:  # wake the wait in progress: nobody else will answer it
            if not board.has(key):
                board.put(key, None)
        self.requests.put(None)
        self.thread.join(10.0)


class Watchdog(threading.Thread):
    """Watches the workers: process exits (sentinels), reported exceptions (board) and progress
    of the reports the driver waits for. The first problem found ends the run."""

    POLL_S = 0.5

    def __init__(self, rt):
        super().__init__(daemon=True, name="adapipe-watchdog")
        self.rt = rt
        self.board = rt.board.client()
        self.stopped = threading.Event()
        self.tracked, self.present, self.last = None, 0, 0.0

    def run(self) -> None:
        next_poll = 0.0
        while not self.stopped.is_set():
            alive = [self.rt.procs[r].sentinel for r, code in self.rt.exitcodes().items() if code is None]
            if alive:
                multiprocessing.connection.wait(alive, timeout=0.2)
            else:
                self.stopped.wait(0.2)
            if self.stopped.is_set():
                return
            try:
                problem = self._exited()
                if problem is None and time.monotonic() >= next_poll:
                    next_poll = time.monotonic() + self.POLL_S
                    problem = self._reported() or self._stalled()
            except Exception as e:  # noqa: BLE001 - the board itself failed
                problem = f"the driver lost the board: {e}" if not self.stopped.is_set() else None
            if problem:
                self.rt._fail(problem)
                return

    def _exited(self) -> str | None:
        for code in self.rt.exitcodes().values():
            if code is not None and not (code == 0 and self.rt.ended):
                return self._culprit()
        return None

    def _reported(self) -> str | None:
        return self._culprit() if self.board.add("errors", 0) > 0 else None

    def _culprit(self) -> str:
        """The first cause among what went wrong: a process death that nobody reported (signal,
        exit) before a reported exception, before a neighbour's lost connection."""
        time.sleep(0.3)  # let the consequences (neighbours losing their peer) arrive too
        found, codes = [], self.rt.exitcodes()
        for r in range(self.rt.n):
            if self.board.has(f"error/{r}"):
                e = self.board.get(f"error/{r}")
                found.append((2 if PEER_LOST.search(e["message"]) else 1, e["time"], r, f"failed: {e['message']}"))
            elif codes.get(r) is not None and not (codes[r] == 0 and self.rt.ended):
                found.append((0, 0.0, r, _death(codes[r])))
        _, _, r, cause = min(found)
        log = self.rt.logs.get(r)
        return f"{self._who(r)} {cause}" + (f" (log: {log})" if log else "")

    def _stalled(self) -> str | None:
        waiting = self.rt.waiting
        if waiting is None:
            return None
        keys, since, allowance = waiting
        if self.tracked is not waiting:
            self.tracked, self.present, self.last = waiting, 0, since
        present = sum(self.board.has(k) for k in keys)
        now = time.monotonic()
        if present > self.present:
            self.present, self.last = present, now
        if now - self.last <= allowance:
            return None
        missing = [k for k in keys if not self.board.has(k)]
        return self._hang_message(missing, allowance)

    def _hang_message(self, missing: list[str], allowance: float) -> str:
        rt, st = self.rt, self.rt.status
        what = f"made no progress for {allowance:g}s (pipeline.timeout_s={rt.timeout_s:g})"
        busy = [r for r in rt.procs if st[2 * r] == COMPUTING]
        if len(busy) == 1:  # one stage computes while the others wait for it
            r = busy[0]
            return f"{self._who(r)} {what}: stuck at step {st[2 * r + 1]} while the other stages wait for it"
        r = _rank_of(missing[0], rt.p) if missing else 0
        states = ", ".join(f"{self._who(q).split(' (')[0]} {STATE_NAMES[st[2 * q]]}" for q in sorted(rt.procs))
        return f"{self._who(r)} {what} waiting for {missing[0] if missing else 'the workers'} ({states})"

    def _who(self, rank: int) -> str:
        return who(rank, self.rt.p, self.rt.R)


def _rank_of(key: str, stages: int) -> int:
    """The rank that writes board key ``key``: r for rep/t/r, ready/r, done/r, link/r, part/t/r;
    replica 0's last stage, p - 1, for eval/v and signal/v (v a version); replica 0's worker of
    virtual stage c, c % p, for grad_bytes/c."""
    kind, last = key.split("/", 1)[0], key.rsplit("/", 1)[1]
    if kind in ("eval", "signal"):
        return stages - 1
    return int(last) % stages if kind == "grad_bytes" else int(last)


def _death(code: int) -> str:
    if code < 0:
        name = signal.Signals(-code).name
        why = " (from outside, or out of memory)" if -code == signal.SIGKILL else ""
        return f"died: killed by signal {name}{why}"
    if code == 0:
        return "exited before the end of the run"
    return f"died: exited with status {code}"
