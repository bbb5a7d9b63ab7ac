"""SIGTERM (what ``kill`` and job schedulers send) takes the path of Ctrl-C: the run stops its
workers, keeps its last complete checkpoint and exits with 128 + the signal's number."""

from __future__ import annotations

import signal


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived; a KeyboardInterrupt, so that every cleanup that Ctrl-C runs runs too."""


_received: list[int] = []


def _on_sigterm(signum, frame) -> None:
    if _received:  # once: a second signal must not cut the cleanup of the first short
        return
    _received.append(signum)
    raise Terminated()


def install():
    """Turn SIGTERM into :class:`Terminated` in the main thread; returns the previous handler
    (None where this is not the main thread, which cannot set handlers)."""
    _received.clear()
    try:
        return signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:
        return None


def restore(previous) -> None:
    if previous is not None:
        signal.signal(signal.SIGTERM, previous)


def received() -> bool:
    """Whether SIGTERM arrived (a worker killed by the same group signal may be reported first)."""
    return bool(_received)


def interrupt_exit(e: BaseException | None) -> tuple[str, int]:
    """(word, exit status) of an interrupted run: terminated 143 after SIGTERM, interrupted 130."""
    if isinstance(e, Terminated) or received():
        return "terminated", 128 + signal.SIGTERM
    return "interrupted", 128 + signal.SIGINT
