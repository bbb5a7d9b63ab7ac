"""One runtime interface: both runtimes define every member of :class:`Runtime`, and the layers
below the training loop import neither it nor the CLI (imports run one way)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import adapipe_cli.runtime.base
from adapipe_cli.runtime.base import Runtime
from adapipe_cli.runtime.dist import DistRuntime
from adapipe_cli.runtime.local import LocalRuntime

MEMBERS = {"name", "backend", "clock_name", "snapshots", "heldout", "link", "decide", "run_step", "evaluations",
           "evaluate_now", "evaluate", "state_dict", "load_state_dict", "write_checkpoint_parts",
           "restore_checkpoint", "memory", "action_times", "close"}


def test_both_runtimes_define_the_whole_interface():
    declared = {n for n in dir(Runtime) if not n.startswith("_")} | set(Runtime.__annotations__)
    assert declared == MEMBERS
    for cls in (LocalRuntime, DistRuntime):
        missing = [n for n in MEMBERS if not hasattr(cls, n)]
        assert not missing, (cls.__name__, missing)
    assert (LocalRuntime.snapshots, LocalRuntime.heldout) == (True, True)
    assert (DistRuntime.snapshots, DistRuntime.heldout) == (True, True)
    assert LocalRuntime.link is None  # (the dist runtime's is measured when its workers start)


# the parts below the training loop, and those above it (sweep/ runs the CLI's train command)
BELOW_TRAIN = ("schedules", "optim", "checkpoint", "model", "data", "config", "runtime", "simulator", "adaptive")
ABOVE = ("train", "cli", "sweep")
PACKAGE = Path(adapipe_cli.runtime.base.__file__).parents[1]  # (adapipe_cli is a namespace package)


def imported_parts(path: Path, package: Path) -> list[tuple[int, str]]:
    """(line, part of adapipe_cli) of every import in the file at ``path``, at module level or in a
    function (a lazy import is an import all the same), relative ones resolved against ``package``."""
    pkg = path.relative_to(package.parent).parts[:-1]  # the package a relative import starts from
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = list(pkg[:len(pkg) - node.level + 1]) if node.level else []
            targets = [".".join(base + ([node.module] if node.module else []))]
            if not node.module:  # from .. import train
                targets = [f"{targets[0]}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        found += [(node.lineno, t.split(".")[1]) for t in targets if t.startswith("adapipe_cli.")]
    return found


def upward_imports(package: Path) -> list[str]:
    """``"runtime/worker.py:181 imports train"`` for each import of a part above the training loop's
    layer by a file below it."""
    bad = []
    for part in BELOW_TRAIN:
        files = sorted((package / part).rglob("*.py")) or sorted(package.glob(f"{part}.py"))  # a folder, or a file
        for f in files:
            bad += [f"{f.relative_to(package)}:{line} imports {to}" for line, to in imported_parts(f, package) if to in ABOVE]
    return bad


def test_nothing_below_the_training_loop_imports_it():
    """Imports run one way (schedules -> model/optim/checkpoint -> runtime/simulator -> adaptive ->
    train -> cli): no file below train/ names train/, the CLI or sweeps, not even in a function."""
    assert all((PACKAGE / part).is_dir() or (PACKAGE / f"{part}.py").is_file() for part in BELOW_TRAIN)
    assert upward_imports(PACKAGE) == []


def test_the_simulator_imports_no_runtime():
    """Within the runtime/simulator layer imports run one way too: the runtimes use the simulator's
    clock, and the simulator (which must run where no runtime can) names no runtime module."""
    files = sorted((PACKAGE / "simulator").rglob("*.py"))
    assert files
    assert [f"{f.name}:{line}" for f in files for line, to in imported_parts(f, PACKAGE) if to == "runtime"] == []


def test_the_import_scan_finds_a_lazy_upward_import(tmp_path):
    """The scan above sees what it must refuse: a lazy ``from ..train import build`` (as a worker had)."""
    pkg = tmp_path / "adapipe_cli"
    (pkg / "runtime").mkdir(parents=True)
    (pkg / "runtime" / "worker.py").write_text("import torch\nfrom . import stage\n\n\ndef build():\n"
                                               "    from ..train import build\n    from adapipe_cli.cli import main\n")
    (pkg / "model.py").write_text("from .schedules import Plan\nfrom . import sweep\n")
    assert upward_imports(pkg) == ["model.py:2 imports sweep", "runtime/worker.py:6 imports train",
                                   "runtime/worker.py:7 imports cli"]


@pytest.mark.slow  # a fresh interpreter importing torch (5 s); the static scan above is its fast twin
def test_importing_the_lower_layers_loads_no_train_nor_cli():
    """Importing the runtimes (the worker's modules included), the simulator and the layers below
    loads nothing of train/ nor of the CLI."""
    code = ("import sys, adapipe_cli.schedules, adapipe_cli.simulator.simulate, adapipe_cli.runtime.dist, "
            "adapipe_cli.runtime.local, adapipe_cli.runtime.launch, adapipe_cli.runtime.worker, adapipe_cli.optim, "
            "adapipe_cli.checkpoint, adapipe_cli.model.build, adapipe_cli.runtime.profile_meta; "
            "print(sorted(m for m in sys.modules if m.startswith(('adapipe_cli.train', 'adapipe_cli.cli'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
