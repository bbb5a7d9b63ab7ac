"""Fault injection, for tests: ``ADAPIPE_FAULT=RANK:STEP:KIND[,...]`` makes the worker of rank
RANK (stage RANK; with replicas, rank ``replica * p + stage``), right before its update of step
STEP, ``raise`` an exception, ``kill`` itself with SIGKILL, ``exit`` with status 3, or ``hang``
(sleep for an hour)."""

from __future__ import annotations

import os
import signal
import time


def inject_fault(rank: int, step: int) -> None:
    """Apply ``ADAPIPE_FAULT`` (see above) before ``U(step)`` of the worker of rank ``rank``."""
    spec = os.environ.get("ADAPIPE_FAULT")
    if not spec:
        return
    for item in spec.split(","):
        who, at, kind = item.split(":")
        if int(who) != rank or int(at) != step:
            continue
        if kind == "raise":
            raise RuntimeError(f"injected fault at step {step}")
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "exit":
            os._exit(3)
        if kind == "hang":
            time.sleep(3600)
