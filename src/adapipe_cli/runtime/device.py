"""Where the local runtime computes (``pipeline.device``) and in which precision (``train.precision``).

``cpu``, ``cuda``, ``cuda:N`` or ``auto`` (CUDA when there is one, else the CPU). ``bf16`` runs each
stage's forward under ``torch.autocast`` (bf16 matrix products, fp32 reductions and norms, as
autocast decides per op); the backward runs outside autocast in the dtypes the forward recorded,
as torch recommends. Parameters, gradients, optimizer state and every weight copy (stash, shadow,
prediction) stay fp32: master weights. ``fp32`` enters no autocast at all, so its numbers are
exactly those of a run without this option.
"""

from __future__ import annotations

import contextlib
import os
import re
import time

import torch

PRECISIONS = ("fp32", "bf16")
_DEVICE = re.compile(r"^(cpu|auto|cuda(:\d+)?)$")


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity, else the machine's count)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class DeviceError(ValueError):
    """A device that does not exist here; the message is one line saying what to change."""


def resolve_device(name: str) -> torch.device:
    """The ``torch.device`` that ``pipeline.device=name`` means on this machine, or DeviceError."""
    name = str(name).strip()
    if not _DEVICE.match(name):
        raise DeviceError(f"unknown pipeline.device={name!r}: use cpu, cuda, cuda:N or auto")
    if name == "cpu":
        return torch.device("cpu")
    cuda = torch.cuda.is_available()
    if name == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if not cuda:
        raise DeviceError(f"pipeline.device={name} asks for CUDA but this machine has no CUDA device "
                          f"(torch {torch.__version__}): use pipeline.device=cpu or auto")
    index = int(name.split(":")[1]) if ":" in name else torch.cuda.current_device()
    count = torch.cuda.device_count()
    if index >= count:
        raise DeviceError(f"pipeline.device={name}: this machine has {count} CUDA device(s), cuda:0 to "
                          f"cuda:{count - 1}: use one of those")
    return torch.device("cuda", index)


def autocast(device: torch.device | str, precision: str):
    """The context a forward of ``precision`` runs in: bf16 autocast, or nothing for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision == "bf16":
        return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
    raise ValueError(f"unknown precision {precision!r}: use fp32 or bf16")


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (CUDA kernels run asynchronously); no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class EventTimer:
    """Times a piece of GPU work with CUDA events: ``span(fn)`` is the seconds between an event
    recorded before ``fn`` and one after it, once the second has completed (synchronised), so
    the time is the GPU's, not the host's launch time."""

    def __init__(self, device: torch.device):
        self.device = device

    def span(self, fn) -> float:
        with torch.cuda.device(self.device):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(self.device)  # nothing queued before counts
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3

    def __call__(self) -> float:  # a plain clock too, for callers that only read times
        torch.cuda.synchronize(self.device)
        return time.perf_counter()
