"""One runtime interface: both runtimes define every member of :class:`Runtime`, and the layers
below the training loop import neither it nor the CLI (imports run one way)."""

from __future__ import annotations

import subprocess
import sys

from adapipe_cli.runtime.base import Runtime
from adapipe_cli.runtime.dist import DistRuntime
from adapipe_cli.runtime.local import LocalRuntime

MEMBERS = {"name", "backend", "clock_name", "snapshots", "heldout", "link", "decide", "run_step", "evaluations",
           "evaluate_now", "evaluate", "state_dict", "load_state_dict", "write_checkpoint_parts",
           "restore_checkpoint", "memory", "close"}


def test_both_runtimes_define_the_whole_interface():
    declared = {n for n in dir(Runtime) if not n.startswith("_")} | set(Runtime.__annotations__)
    assert declared == MEMBERS
    for cls in (LocalRuntime, DistRuntime):
        missing = [n for n in MEMBERS if not hasattr(cls, n)]
        assert not missing, (cls.__name__, missing)
    assert (LocalRuntime.snapshots, LocalRuntime.heldout) == (True, True)
    assert (DistRuntime.snapshots, DistRuntime.heldout) == (True, True)
    assert LocalRuntime.link is None  # (the dist runtime's is measured when its workers start)


def test_imports_run_one_way():
    """schedules -> model/optim/checkpoint -> runtime/simulator -> ... -> train -> cli: importing the
    lower layers loads nothing of train/ (a worker builds its stage through train/build.py only
    when it starts) nor of the CLI."""
    code = ("import sys, adapipe_cli.schedules, adapipe_cli.simulator.simulate, adapipe_cli.runtime.dist, "
            "adapipe_cli.runtime.local, adapipe_cli.runtime.launch, adapipe_cli.optim, adapipe_cli.checkpoint; "
            "print(sorted(m for m in sys.modules if m.startswith(('adapipe_cli.train', 'adapipe_cli.cli'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
