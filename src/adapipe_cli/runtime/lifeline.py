"""Processes that die with the driver: the forkserver and the workers of a distributed run.

A worker's parent is the forkserver, not the driver, and every forkserver child holds the
forkserver's "alive" pipe open, so neither outlives the other on its own: without these ties a
driver killed by a signal left a worker and the forkserver running until their TCPStore
connections timed out (minutes). The ties, on Linux:

- the forkserver gets SIGKILL when the driver dies (``PR_SET_PDEATHSIG``, set by
  :mod:`.forkserver_init`, the first module it preloads), and ignores SIGINT from its start
  (:func:`start_forkserver`) while it imports torch, so that a terminal's Ctrl-C to the whole group prints only the driver's one line;
- a worker gets SIGKILL when the forkserver dies (:func:`die_with_parent`), and a thread of its own
  ends it the moment the driver's process ends (:func:`watch_driver`, a pidfd), whoever its parent;
- :func:`stop_helpers` stops the forkserver and the resource tracker when the driver is
  interrupted, instead of leaving them to notice its exit; :func:`stop_processes` stops workers
  (SIGTERM, then SIGKILL after a grace).
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import threading
import time

DRIVER_PID = "ADAPIPE_DRIVER_PID"  # the driver's pid, in the environment the forkserver starts with
PR_SET_PDEATHSIG, PR_SET_NAME = 1, 15


def _libc():
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies, whatever the way."""
    parent = os.getppid()
    libc = _libc()
    if libc is not None and hasattr(libc, "prctl"):
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before the line above
        os._exit(1)


def set_name(name: str) -> None:
    """The process name that ps, top and /proc/PID/comm show."""
    libc = _libc()
    if libc is not None and hasattr(libc, "prctl"):
        libc.prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)


def watch_driver(pid: int) -> None:
    """End this process (exit status 1) as soon as process ``pid`` ends: a daemon thread that
    waits on a pidfd where there is one, else polls every 0.2 s."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = None
        if not _exists(pid):
            os._exit(1)

    def wait() -> None:
        if fd is not None:
            select.select([fd], [], [])  # readable once the process has exited
        else:
            while _exists(pid):
                time.sleep(0.2)
        os._exit(1)

    threading.Thread(target=wait, daemon=True, name="adapipe-lifeline").start()


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def start_forkserver() -> None:
    """Start this process's forkserver (and resource tracker) if it is not running, with SIGINT
    blocked: the mask passes through fork and exec, so that a Ctrl-C to the group while the
    server's Python starts stays pending until :mod:`.forkserver_init` ignores it."""
    from multiprocessing import forkserver, resource_tracker

    # first: starting the tracker unblocks SIGINT in this process when it is done
    resource_tracker.ensure_running()
    if not hasattr(signal, "pthread_sigmask"):
        forkserver.ensure_running()
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)  # a Ctrl-C meanwhile reaches the driver now


def stop_processes(procs, grace_s: float) -> None:
    """Stop ``procs`` (multiprocessing processes): SIGTERM to those alive, then SIGKILL to those
    still there after ``grace_s`` (one deadline for all)."""
    alive = [p for p in procs if p.is_alive()]
    for proc in alive:
        proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in alive:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in alive:
        if proc.is_alive():
            proc.kill()
            proc.join(5.0)


def stop_helpers() -> None:
    """Stop this process's forkserver (and so, through their death signal, its remaining
    children) and then its resource tracker, at once."""
    from multiprocessing import forkserver, resource_tracker

    server = forkserver._forkserver
    pid = getattr(server, "_forkserver_pid", None)
    if pid is not None:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            server._stop()
        except Exception:  # noqa: BLE001 - already gone, or another Python's internals
            pass
    tracker = resource_tracker._resource_tracker
    pid = getattr(tracker, "_pid", None)
    if pid is None:
        return
    # it exits when every copy of its pipe is closed (the workers' went with them); wait a second at most
    stopper = threading.Thread(target=tracker._stop, daemon=True)
    stopper.start()
    stopper.join(1.0)
    if stopper.is_alive():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


__all__ = ["DRIVER_PID", "die_with_parent", "set_name", "watch_driver", "start_forkserver", "stop_helpers"]
