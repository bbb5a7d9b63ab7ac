"""Where a dist worker's process starts: spawned by the driver (:func:`spawn_main`), or as a rank
other than 0 under torchrun (:func:`torchrun_main`). Both join the process group and run the
stage's :class:`.worker.Worker`; an error is printed to the worker's log and reported to the
driver in one line (``error/{rank}`` on the board)."""

from __future__ import annotations

import datetime
import os
import signal
import sys
import time
import traceback
from typing import NoReturn

import torch
import torch.distributed as dist

from .dist_transport import Board
from .lifeline import die_with_parent, set_name, watch_driver
from .worker import Ended, Status, Worker


def workers(pipeline: dict) -> int:
    """The world size of a dist run: ``pipeline.stages x pipeline.replicas``."""
    return int(pipeline["stages"]) * int(pipeline.get("replicas", 1))


def torchrun_env() -> dict | None:
    """RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT when launched by torchrun (or an
    equivalent launcher), else None."""
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    if not all(k in os.environ for k in keys):
        return None
    env = {k: os.environ[k] for k in keys}
    env["prefix"] = f"adapipe/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    # torchrun's agent hosts the store at MASTER_ADDR:MASTER_PORT; without an agent, rank 0 does
    env["agent_store"] = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return env


def one_line(e: BaseException) -> str:
    """``Type: first line of the message``, without the C++ source location gloo puts first."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return f"{type(e).__name__}: {text}"[:300]


def report_error(board: Board | None, rank: int, e: BaseException) -> None:
    traceback.print_exc(file=sys.stderr)
    if board is None:
        return
    try:
        board.put(f"error/{rank}", {"time": time.time(), "message": one_line(e)})
        board.add("errors", 1)
    except Exception:  # the driver is gone: nobody to tell
        pass


# -- entry points ----------------------------------------------------------------------------------
def device_for(spec: dict, rank: int, local_rank: int) -> torch.device:
    if spec["devices"]:
        return torch.device(spec["devices"][rank])
    return torch.device(f"cuda:{local_rank}") if spec["backend"] == "nccl" else torch.device("cpu")


def serve(board: Board, rank: int, local_rank: int, status: Status, spec_timeout_s: float) -> int:
    """Join the process group and run stage ``rank``; returns the exit status."""
    try:
        board.wait(["spec"], spec_timeout_s)
        spec = board.get("spec")
        device = device_for(spec, rank, local_rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(spec["backend"], store=board.process_group_store(), rank=rank,
                                world_size=workers(spec["config"]["pipeline"]),
                                timeout=datetime.timedelta(seconds=spec["timeout_s"] + 60),
                                device_id=device if device.type == "cuda" else None)
        Worker(board, spec, rank, device, status).run()
        return 0
    except Ended:
        return 1  # the driver aborted the run and reports why
    except BaseException as e:  # noqa: BLE001 - reported to the driver, then the process ends
        report_error(board, rank, e)
        return 1


def spawn_main(host: str, port: int, prefix: str, rank: int, status_array, log_path: str | None, timeout_s: float,
               environ: dict, driver: int, name: str | None = None) -> None:
    """Entry point of a worker started by the driver (process ``driver``, see
    :func:`..dist.worker_context`); it ends when the driver's process ends (:mod:`.lifeline`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    die_with_parent()
    watch_driver(driver)
    os.environ.clear()
    os.environ.update(environ)
    set_name(name or f"adapipe-stage{rank}")
    if log_path:  # C++ warnings and tracebacks go to the run directory, not the driver's terminal
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    status = Status(status_array, rank)
    board = None
    try:
        board = Board(host, port, prefix, timeout_s=timeout_s + 60)
        code = serve(board, rank, rank, status, timeout_s + 60)
    except BaseException as e:  # noqa: BLE001
        report_error(board, rank, e)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # pending sends of dropped microbatches must not hold the process


def torchrun_main(timeout_s: float, spec_timeout_s: float = 3600.0) -> NoReturn:
    """Entry point of ranks other than 0 under torchrun: run that rank's stage of the job whose
    driver is rank 0 (which publishes the run's spec)."""
    env = torchrun_env()
    rank = int(env["RANK"])
    board = None
    try:
        # the driver publishes the spec once its data and cost profile are ready: wait that long
        board = Board(env["MASTER_ADDR"], int(env["MASTER_PORT"]), env["prefix"], timeout_s=spec_timeout_s)
        code = serve(board, rank, int(env["LOCAL_RANK"]), Status(None, rank), spec_timeout_s)
    except BaseException as e:  # noqa: BLE001
        report_error(board, rank, e)
        code = 1
    if code == 0:
        print(f"adapipe: rank {rank} done", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


__all__ = ["spawn_main", "torchrun_main", "torchrun_env", "one_line", "report_error", "workers"]
