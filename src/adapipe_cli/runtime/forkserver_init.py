"""Imported first by the forkserver of a distributed run, before torch (see :mod:`.lifeline`):
it ignores SIGINT (Ctrl-C is the driver's to report; the forkserver would print a traceback of
the import it interrupts) and dies with the driver. Imported by any process that is not a child
of the driver named in the environment, it does nothing."""

from __future__ import annotations

import os
import signal

from .lifeline import DRIVER_PID, die_with_parent

if os.environ.get(DRIVER_PID) == str(os.getppid()):
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked by start_forkserver until now
    die_with_parent()
