"""scripts/bench_dist.py stopped by SIGTERM leaves no run behind: the child it waits on gets SIGTERM
(an ``adapipe train`` stops its workers on it), and SIGKILL if it outlives the grace period."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

# the benchmark's driver: scripts/bench_dist.py's entry point, around one child run
DRIVER = """
import sys
sys.path.insert(0, {tests!r})
from _scripts import load_script
from adapipe_cli.cli import signals
bench = load_script("bench_dist")
signals.install()
try:
    bench.run_child([sys.executable, "-c", {child!r}], grace_s={grace})
except KeyboardInterrupt as e:
    sys.exit(signals.interrupt_exit(e)[1])
"""

# a run that writes its pid and waits a minute; on SIGTERM it notes it and exits (as adapipe train
# stops its workers), or, stubborn, ignores it
CHILD = """
import os, signal, sys, time
def stop(*_):
    open({pidfile!r} + ".term", "w").close()
    sys.exit(0)
signal.signal(signal.SIGTERM, signal.SIG_IGN if {stubborn} else stop)
with open({pidfile!r} + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace({pidfile!r} + ".tmp", {pidfile!r})
time.sleep(60)
"""


def _gone(pid: int, within_s: float = 10.0) -> bool:
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("stubborn", [False, True])
def test_sigterm_stops_the_benchmark_and_the_run_it_waits_on(tmp_path, stubborn):
    pidfile = str(tmp_path / "child.pid")
    child = CHILD.format(stubborn=stubborn, pidfile=pidfile)
    driver = subprocess.Popen([sys.executable, "-c", DRIVER.format(tests=str(TESTS), child=child, grace=0.5)],
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        end = time.monotonic() + 120  # (the driver imports torch and the package first)
        while not os.path.exists(pidfile):
            assert driver.poll() is None and time.monotonic() < end, "the child run never started"
            time.sleep(0.05)
        pid = int(Path(pidfile).read_text())
        driver.send_signal(signal.SIGTERM)
        assert driver.wait(60) == 128 + signal.SIGTERM
        assert _gone(pid), f"the child run {pid} outlived the benchmark"
        # a run that stops on SIGTERM got the chance to (the stubborn one was killed after the grace)
        assert os.path.exists(pidfile + ".term") != stubborn
    finally:
        if driver.poll() is None:
            driver.kill()
        if os.path.exists(pidfile):
            try:
                os.kill(int(Path(pidfile).read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
