"""A dist worker's traffic with the driver (runtime/driver_link.py): reports put and the next
gate's verdict fetched by a thread, in the main thread's order, and the phases a verdict carries."""

from __future__ import annotations

import threading

import pytest

from adapipe_cli.runtime.dist_transport import Board
from adapipe_cli.runtime.driver_link import DriverLink, verdict_value
from adapipe_cli.runtime.worker import BoardPlan, Status


class Counting:
    """A board whose calls from the worker's main thread are counted (the link's thread uses its own client)."""

    def __init__(self, board: Board):
        self.inner, self.calls = board, []

    def client(self, timeout_s: float = 600.0) -> Board:
        return self.inner.client(timeout_s)

    def get(self, key):
        self.calls.append(key)
        return self.inner.get(key)


def test_reports_and_the_next_verdict_go_through_the_thread_in_order():
    """A driver that, as the real one, posts go/{t+1} only once it has rep/{t}: the worker's main
    thread reports and takes verdicts without a call of its own after the first gate's, and every
    report is on the board, in order, before the driver's verdict on the next step."""
    server = Board("127.0.0.1", 0, "link", server=True)
    steps, seen = 6, []

    def driver():
        board = server.client()
        board.put("go/0", verdict_value("go", 1, ["sync"]))
        for t in range(steps):
            board.wait([f"rep/{t}/0"])
            seen.append(board.get(f"rep/{t}/0"))
            board.put(f"go/{t + 1}", verdict_value("go", t + 2, []) if t + 1 < steps else "end")

    d = threading.Thread(target=driver)
    d.start()
    board = Counting(server.client())
    link = DriverLink(board, 0)
    verdicts = []
    for t in range(steps):
        verdicts.append(link.verdict(t))
        link.report(t, {"step": t})
    verdicts.append(link.verdict(steps))
    link.flush()
    d.join()
    assert board.calls == ["go/0"]  # the first gate had no fetch ahead; the others were the thread's
    assert seen == [{"step": t} for t in range(steps)]
    assert verdicts == [("go", 1, ["sync"]), *(("go", t + 2, []) for t in range(steps - 1)), "end"]


def test_an_error_in_the_thread_is_raised_in_the_main_thread():
    server = Board("127.0.0.1", 0, "link", server=True)

    class Broken(Counting):
        def client(self, timeout_s: float = 600.0):
            raise ConnectionError("board gone")

    link = DriverLink(Broken(server.client()), 0)
    link.report(0, {})
    with pytest.raises(ConnectionError, match="board gone"):
        link.verdict(1)


def test_a_plan_takes_the_phases_a_verdict_carries_without_fetching_them():
    server = Board("127.0.0.1", 0, "plan", server=True)
    board = Counting(server.client())
    plan = BoardPlan(10, board, Status(None, 0))
    plan.decide(0, "sync")
    plan.learn(1, ["sync", "async"])
    plan.learn(2, ["async", "async"])  # (step 2 is known already: kept)
    assert [plan.phase(u) for u in range(4)] == ["sync", "sync", "async", "async"]
    assert board.calls == []
    server.put("phase/4", "sync")
    assert plan.phase(4) == "sync" and board.calls == ["phase/4"]  # one not carried is fetched, as before
