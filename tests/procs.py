"""Helpers of the fault tests: the process tree under a pid (from /proc), and what a resumed run
says and leaves on disk."""

from __future__ import annotations

import os
from pathlib import Path

from adapipe_cli.train import checkpoint


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
