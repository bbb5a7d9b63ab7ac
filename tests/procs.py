"""Helpers of the runtime and fault tests: ``adapipe train`` in a subprocess, the process tree
under a pid (from /proc), and what a run (or a resumed one) says and leaves on disk."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from adapipe_cli import checkpoint

OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
ENV = {**os.environ, **OFFLINE}
# the per-step metrics two runs that should be the same are compared on
COMPARED = ("loss", "grad_norm", "lr", "staleness", "staleness_max", "activations", "phase")


def cli(args, env_extra=None) -> subprocess.Popen:
    """``adapipe train ARGS`` started in a subprocess, offline, its output piped."""
    exe = os.path.join(os.path.dirname(sys.executable), "adapipe")
    return subprocess.Popen([exe, "train", *args], env={**os.environ, **OFFLINE, **(env_extra or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def records(run_dir: Path) -> tuple[list[dict], list[tuple[int, float]]]:
    """A run's per-step metrics (the COMPARED keys) and its (step, validation loss) pairs."""
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [{k: r[k] for k in COMPARED} for r in recs if r["kind"] == "step"]
    return steps, [(r["step"], r["val_loss"]) for r in recs if r["kind"] == "eval"]


def run_ranks(procs: list, timeout_s: float) -> None:
    """Start ``procs`` (multiprocessing processes, one per rank), wait up to ``timeout_s`` for each
    and assert that every one exited with 0; a hung or failed rank is killed before this returns or
    raises, so that none outlives the test."""
    try:
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(timeout_s)
        assert [proc.exitcode for proc in procs] == [0] * len(procs), \
            f"a rank failed (exit code) or hung (None) for {timeout_s:g} s"
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)


def descendants(pid: int) -> set[int]:
    """Every process under ``pid``."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def check_resumed_from(stderr: str, candidates: set[str] | None) -> None:
    """The run resumed from one of ``candidates`` (checkpoint names), or (None) started afresh."""
    lines = [line for line in stderr.splitlines() if "resumed from" in line]
    if candidates is None:
        assert not lines
        return
    if lines:  # (a process killed very early may not have printed it yet)
        used = lines[0].split("resumed from ")[1].split()[0].rsplit("/", 1)[1]
        assert used in candidates, (used, candidates)


def verifies(folder) -> bool:
    try:
        checkpoint.verify(folder)
        return True
    except Exception:
        return False


def cut_at(whole: Path, cut: Path, stop: int) -> Path:
    """A copy of a finished run as if it had been stopped right after the checkpoint of ``stop``."""
    shutil.copytree(whole, cut)
    for folder in checkpoint.complete(cut):
        if int(folder.name.split("-")[1]) > stop:
            shutil.rmtree(folder)
    (cut / "summary.json").unlink()
    return cut
