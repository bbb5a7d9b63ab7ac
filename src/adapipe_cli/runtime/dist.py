"""The distributed runtime, driver side: one worker process per stage, driven by the Trainer.

``DistRuntime(spec)`` (a :class:`.base.RunSpec`) starts a TCPStore (the *board*, see
:mod:`.dist_transport`) on a free port, so that runs on one machine never collide, publishes
the run's spec there and starts one worker per stage (:mod:`.worker`; ``torch.multiprocessing``,
see :func:`worker_context`), each of which builds only its own stage from the spec. Under ``torchrun`` the board is
the job's store at MASTER_ADDR:MASTER_PORT, the other ranks' processes are the other workers,
and the driver (rank 0's process) spawns only stage 0's worker: the driver then never sits in a
collective, so it can watch, time out and abort the run whatever the workers do. With
``pipeline.replicas`` R, a worker per stage of each replica, R x p ranks (:mod:`.replicas`); a
"rank" below is one of those, board keys name ranks.

The Trainer drives it through the runtime interface (:class:`.base.Runtime`): ``decide`` writes a phase to the board;
``run_step(t)`` opens the gate of ``U(t)`` and waits for every stage's report of step ``t``;
``evaluations`` waits for the validation losses that step ``t`` scheduled; ``evaluate_now`` and
``close`` end the run at the next gate. Times are wall-clock seconds from a barrier that all
workers pass before their first action, minus the time spent evaluating; or, with
``pipeline.clock=profiled``, the local runtime's pipeline time of the same plan and profile
(:class:`..simulator.replay.Replay`). Without a given profile the workers measure it, each its own
stage where it runs. ``evaluate`` waits for the held-out signal the workers run after each
update; ``state_dict`` has the workers keep snapshots at the next gate, ``load_state_dict`` rolls
them back to one (see :mod:`.worker`).

Checkpoints: each worker writes its own stage's part, at the gate of the update after the
checkpoint's step (see :mod:`.worker` for where the cut is and what crosses it); the driver
names the temporary folder, writes the Trainer's part and then the manifest, last
(:meth:`DistRuntime.write_checkpoint_parts`). A resumed run's workers load their parts before
their first action; its clock continues from the checkpoint's time
(:meth:`DistRuntime.restore_checkpoint`).

Faults: a watchdog thread ends the run when a worker process dies, a worker reports an
exception, or the awaited reports make no progress for ``pipeline.timeout_s``; the other workers
are terminated and the Trainer gets a :class:`WorkerFailed` whose message is one line naming
the stage, the rank and the cause.
"""

from __future__ import annotations

import atexit
import math
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from omegaconf import OmegaConf

from ..config.validate import ConfigError
from .. import checkpoint
from ..simulator.clock import AllReduceModel, CostProfile, LinkModel, allreduce_times
from ..simulator.replay import Replay
from ..schedules.choice import chunks, microbatch_size
from .base import RunSpec, StepResult, global_norm, stage_lrs
from .device import usable_cores
from .dist_transport import Board
from .driver_link import verdict_value
from .errors import TrainingDiverged, WorkerFailed
from .lifeline import DRIVER_PID, start_forkserver, stop_helpers, stop_processes
from .action_times import action_table
from .profile import join_profiles
from .replicas import split_pipelines, where, who
from .watchdog import Collector, Watchdog
from .launch import spawn_main, torchrun_env

STARTUP_S = 120.0  # at least this long for workers to import torch, build their stage and connect


def worker_context():
    """The multiprocessing context that starts workers: ``forkserver`` where there is one, with
    torch and the worker's modules imported once in the server, else ``spawn``. Both start workers
    from a clean single-threaded process, never by forking the driver (whose threads and torch
    state a fork would copy); the forkserver saves each worker the seconds of importing torch
    (and torch._dynamo, which optimizers import, and torch's pipelining helpers, which the
    profile and a split backward import). Each worker takes the driver's environment of
    the moment it starts, not the server's."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    os.environ[DRIVER_PID] = str(os.getpid())  # read by forkserver_init in the server this context starts
    ctx.set_forkserver_preload(["adapipe_cli.runtime.forkserver_init", "torch", "torch.distributed", "torch._dynamo",
                                "torch.distributed.pipelining._backward", "adapipe_cli.runtime.launch", "adapipe_cli.data"])
    return ctx


def shared_cores(workers: int, threads: int, backend: str, cores: int) -> tuple[int, int] | None:
    """(threads, cores) where ``workers`` CPU workers on this node (gloo: CPUs) of ``threads`` each
    need more threads than the node has ``cores`` (they then take turns, unlike a pipeline with a
    device per stage), else None."""
    return (workers * threads, cores) if backend == "gloo" and workers * threads > cores else None


def choose_backend(cfg, launched: bool) -> tuple[str, list[str] | None]:
    """(backend, device of each rank or None for the default). ``auto``: NCCL when there is a CUDA
    device for every worker (stages x replicas; or, under torchrun, on each rank), gloo on CPUs
    otherwise."""
    p = cfg.pipeline
    n, R = p.stages * p.replicas, p.replicas
    devices = [str(d) for d in p.devices]
    if devices and len(devices) != n:
        if R == 1:
            raise ConfigError(f"pipeline.devices lists {len(devices)} devices for {p.stages} stages: give one per stage")
        raise ConfigError(f"pipeline.devices lists {len(devices)} devices for {p.stages} stages x {R} replicas: give one "
                          f"per worker, {n}, in rank order (replica r's stage s at r x {p.stages} + s)")
    backend = p.backend
    cuda = torch.cuda.is_available()
    if backend == "auto":
        if devices:
            backend = "nccl" if all(d.startswith("cuda") for d in devices) else "gloo"
        else:
            backend = "nccl" if cuda and (launched or torch.cuda.device_count() >= n) else "gloo"
    if backend == "nccl":
        if not cuda:
            raise ConfigError("pipeline.backend=nccl needs CUDA devices: use pipeline.backend=gloo on CPUs")
        if not devices and not launched:
            if torch.cuda.device_count() < n:
                what = f"{p.stages} stages" if R == 1 else f"{p.stages} stages x {R} replicas"
                raise ConfigError(f"pipeline.backend=nccl needs a GPU per {'stage' if R == 1 else 'worker'}: "
                                  f"{torch.cuda.device_count()} for {what} (use fewer stages{'' if R == 1 else ' or replicas'}, "
                                  f"or pipeline.backend=gloo)")
            devices = [f"cuda:{i}" for i in range(n)]
        if any(not d.startswith("cuda") for d in devices):
            raise ConfigError(f"pipeline.backend=nccl runs on CUDA devices, not {devices}: list cuda:N devices")
        if not launched and len(set(devices)) < len(devices):
            raise ConfigError(f"NCCL refuses two ranks on one GPU (pipeline.devices={devices}): list distinct GPUs")
    elif any(d != "cpu" for d in devices):
        raise ConfigError(f"pipeline.backend=gloo runs on CPUs here, not {devices}: use pipeline.backend=nccl for GPUs")
    return backend, devices or None


def worker_name(rank: int, stages: int, replicas: int) -> tuple[str, str]:
    """A worker's process name and its log's under ``workers/``: ``adapipe-stage{s}`` and
    ``stage{s}.log``; with replicas ``adapipe-r{r}s{s}`` (ps shows 15 characters) and
    ``replica{r}-stage{s}.log``."""
    r, s = where(rank, stages)
    if replicas <= 1:
        return f"adapipe-stage{s}", f"stage{s}.log"
    return f"adapipe-r{r}s{s}", f"replica{r}-stage{s}.log"


def nonfinite_part(entries: list, stages: int, replicas: int) -> tuple[int, int | None] | None:
    """(stage, replica) of the first worker whose checkpoint part reports non-finite weights (its
    entry ``{"nonfinite": c}``, c the chunk's virtual stage with interleaving; None: a worker
    that reported nothing, named by its rank); replica None with one. None when every part is finite."""
    for rank, e in enumerate(entries):
        if e is None or "nonfinite" in e:
            replica, stage = where(rank, stages)
            return (stage if e is None else e["nonfinite"]), (replica if replicas > 1 else None)
    return None


def link_model(pairs: list[dict]) -> dict:
    """One link for the simulator from the ping-pongs of each pair of neighbouring stages
    (:meth:`.dist_transport.DistTransport.measure_link`): their mean latency, bandwidth and CPU of
    the transport's threads per message end."""
    mean = lambda k: sum(x.get(k, 0.0) for x in pairs) / len(pairs)  # noqa: E731
    return {"latency_s": mean("latency_s"), "bandwidth": mean("bandwidth"), "thread_cpu_s": mean("thread_cpu_s"),
            "bytes": pairs[0]["bytes"],
            "pairs": pairs, "method": f"ping-pong between neighbouring stages at start-up, median of {pairs[0]['rounds']}"}


class DistRuntime:
    """One worker process per stage (:class:`.base.Runtime`), built from the run's spec; with
    ``pipeline.replicas`` R, one per stage of each replica: ``n = R x p`` workers, rank
    ``r * p + s`` (:func:`.replicas.where`). Steps, evaluations and the clock are replica 0's, but
    every rank reports and the loss is the mean over the replicas' last stages (as on local)."""

    name = "dist"
    backend: str | None = None  # gloo or nccl, chosen at start-up
    clock_name = "wall"  # or "pipeline" (``pipeline.clock=profiled``), chosen at start-up
    snapshots = True  # each worker keeps its stage's snapshots; the driver's state names them
    heldout = True  # each worker runs the held-out batch after each update
    link: dict | None = None  # measured by the workers at start-up (see link_model)

    def __init__(self, spec: RunSpec):
        cfg = self.cfg = spec.cfg
        self.p, self.timeout_s = cfg.pipeline.stages, float(cfg.pipeline.timeout_s)
        self.R = cfg.pipeline.replicas
        self.n = self.p * self.R  # workers
        self.chunks = chunks(cfg)  # model chunks per worker
        self.env = torchrun_env()
        self.backend, devices = choose_backend(cfg, self.env is not None)
        self.max_steps = cfg.train.max_steps
        self.eval_steps = {t for t in range(-1, self.max_steps) if spec.eval_at(t)}
        self.plan = spec.plan  # the Trainer reads its decisions back from it
        self.reports: dict[int, dict] = {}  # rank -> its latest report
        resume = spec.resume  # (folder, manifest) of the checkpoint a resumed run continues from
        self.start = resume[1]["step"] if resume else 0  # the first step of this session
        self.released = self.start  # go/{t} written for every t < released
        # versions whose evaluation is awaited (a resumed run has every one up to its checkpoint)
        self.due: list[int] = [0] if -1 in self.eval_steps and not resume else []
        self.base = 0.0  # the clock at this session's start: a resumed run's time so far
        self.prev_time, self.prev_busy = 0.0, 0.0
        self.ended = self.closed = False
        self.failure: str | None = None
        self.waiting: tuple | None = None  # (keys, since, allowance) while the main thread waits
        self.procs: dict[int, mp.Process] = {}
        self.logs: dict[int, Path] = {}
        self.snap_due = False  # the next gate keeps a snapshot (the divergence guard's)
        self.rollbacks = 0
        self.replay: Replay | None = None  # the pipeline clock, pipeline.clock=profiled
        self.profile: CostProfile | None = None
        self.windows: list[dict | None] = []  # each rank's ActionTimes window, from its done/{r}
        self._lock = threading.Lock()
        self._stopping = threading.RLock()  # the watchdog and the main thread both poll and stop workers
        if self.env is not None:
            world = int(self.env["WORLD_SIZE"])
            if world != self.n:
                what = f"pipeline.stages={self.p}" + (f" x pipeline.replicas={self.R}" if self.R > 1 else "")
                raise ConfigError(f"torchrun started {world} processes for {what}: start one process per "
                                  f"{'stage' if self.R == 1 else 'stage of each replica'} (nnodes x nproc-per-node = {self.n})")
            host, port, prefix = self.env["MASTER_ADDR"], int(self.env["MASTER_PORT"]), self.env["prefix"]
            self.board = Board(host, port, prefix, server=not self.env["agent_store"])
            local, per_node = [0], int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            split = split_pipelines(self.p, self.R, per_node) if world > per_node else []
            if split:  # (allowed: the ranks cannot keep every pipeline on one node)
                print(f"adapipe: warning: nproc-per-node={per_node} is not a multiple of pipeline.stages={self.p}: "
                      f"the stages of replica{'s' if len(split) > 1 else ''} {', '.join(map(str, split))} span nodes "
                      f"(their activations cross the network)", file=sys.stderr)
        else:
            self.board = Board("127.0.0.1", 0, "adapipe", server=True)
            local, per_node = list(range(self.n)), self.n
        cores = usable_cores()
        threads = cfg.pipeline.threads or max(1, cores // per_node)
        self.shared = shared_cores(per_node, threads, self.backend, cores)
        # (gloo: the CPUs the workers on this node compute on, which the start-up profile records)
        self.host = {"cores": cores, "workers": per_node, "threads": threads} if self.backend == "gloo" else None
        if self.shared:
            print(f"adapipe: warning: {per_node} workers x {threads} thread{'s' if threads > 1 else ''} share "
                  f"{self.shared[1]} cores: each computes part of the time, so the step times are not those of a "
                  f"pipeline with a device per stage (which the simulator and the start-up profile assume)",
                  file=sys.stderr)
        self.board.put("spec", {"config": OmegaConf.to_container(cfg, resolve=True), "backend": self.backend,
                                "eval_steps": sorted(self.eval_steps), "devices": devices, "timeout_s": self.timeout_s,
                                "threads": threads, "run_dir": str(spec.run_dir), "start": self.start,
                                "parts": self._parts(*resume) if resume else None,
                                "measure": spec.profile is None, "signal_rows": spec.signal_rows,
                                "snapshots_kept": spec.snapshots_kept,
                                "sync": spec.schedule.sync if spec.schedule else None})  # (schedule.sync=auto: the pick)
        self.collector = Collector(self.board)
        atexit.register(self._shutdown)  # when close() is never called
        try:
            self._start(local, Path(spec.run_dir) / "workers")
            self._collect([f"ready/{r}" for r in range(self.n)], max(self.timeout_s, STARTUP_S))
            self.link = link_model(self._collect([f"link/{r}" for r in range(self.p - 1)])) if self.p > 1 else None
            self.profile = spec.profile or self._measured_profile()
            if self.link and spec.profile is None:  # a given profile keeps its own link (or none), as on local
                self.profile.link = self.link
            if spec.clock == "profiled":
                self.clock_name = "pipeline"
                # the configured link, else the profile's (the given one's, or the one measured now):
                # the link a local run given this run's profile.json charges
                link = LinkModel.choose(spec.link.latency, spec.link.bandwidth, self.profile)
                # with replicas, the all-reduce (all_gather) of each stage's parameter bytes before its updates (as on local)
                ar = allreduce_times(AllReduceModel(self.R, cfg.pipeline.dp_bandwidth, cfg.pipeline.dp_latency_s),
                                     self._collect([f"grad_bytes/{s}" for s in range(self.p * self.chunks)]))
                # the held-out signal's forward after each update, as a local run charges it
                signal = self.profile.signal_costs(spec.signal_rows, microbatch_size(cfg)) if spec.signal_rows else None
                self.replay = Replay(spec.schedule, self.plan, self.profile, link, list(cfg.schedule.mitigation),
                                     allreduce=ar, signal=signal)
        except BaseException:
            self.close()
            raise

    def _measured_profile(self) -> CostProfile:
        """The cost profile the workers measured, each its own stage on its own device."""
        keys = [f"profile/{r}" for r in range(self.p)]
        parts = [CostProfile(**d) for d in self._collect(keys)]
        for key in keys:
            self.board.delete(key)
        prof = join_profiles(parts, rounds=self.cfg.pipeline.profile_reps, chunks=self.chunks, shared=self.shared)
        if self.host:  # what a prediction with the stages sharing the cores needs (simulator.shared)
            prof.meta["host"] = self.host
        return prof

    def _start(self, ranks: list[int], log_dir: Path) -> None:
        ctx = worker_context()
        if ctx.get_start_method() == "forkserver":
            start_forkserver()
        self.status = ctx.Array("i", 2 * self.n, lock=False)
        log_dir.mkdir(parents=True, exist_ok=True)
        b = self.board
        for r in ranks:
            name, log = worker_name(r, self.p, self.R)
            self.logs[r] = log_dir / log
            self.procs[r] = ctx.Process(target=spawn_main, name=name, daemon=True,
                                        args=(b.host, b.port, b.prefix, r, self.status, str(self.logs[r]),
                                              self.timeout_s, dict(os.environ), os.getpid(), name))
            self.procs[r].start()
        self.watchdog = Watchdog(self)
        self.watchdog.start()

    # -- the interface the training loop drives ------------------------------------------------
    def decide(self, step: int, phase: str) -> None:
        self.plan.decide(step, phase)
        self.board.put(f"phase/{step}", phase)

    def run_step(self, t: int) -> StepResult:
        """Let every stage apply ``U(t)`` and wait for their reports of step ``t``."""
        # (with the phases decided after t: the workers need no fetch of phase/{u} for them)
        self.board.put(f"go/{t}", verdict_value("snap" if self.snap_due else "go", t + 1, self.plan.phases[t + 1:]))
        self.snap_due = False
        self.released = t + 1
        if t > 0:
            self._forget(t - 1)
        reps = self._collect([f"rep/{t}/{r}" for r in range(self.n)])
        self.reports.update(enumerate(reps))
        if t in self.eval_steps:
            self.due.append(t + 1)
        return self._result(t, reps)

    def evaluations(self) -> list[tuple[int, float]]:
        """(version, mean validation loss) of the evaluations scheduled so far, waiting for them."""
        out = []
        for v in self.due:
            (losses,) = self._collect([f"eval/{v}"])
            self.board.delete(f"eval/{v}")
            out.append((v, sum(losses) / len(losses)))
        self.due = []
        return out

    def evaluate_now(self, version: int) -> None:
        """End the run after the steps trained so far, evaluating their final weights."""
        if version != self.released:
            raise RuntimeError(f"evaluate_now({version}) after {self.released} steps")
        self._end("eval")
        self.due.append(version)

    def write_checkpoint_parts(self, folder: Path, step: int) -> dict[str, dict]:
        """Have every worker write its stage's part of the checkpoint after ``step`` steps into
        ``folder``; their manifest entries by part name. The workers wait at the gate of
        ``U(step)``; at a checkpoint that the loop writes when the run ends, the gate is told so
        first (they learn of a final checkpoint only at the end of the run)."""
        if step != self.released:
            raise RuntimeError(f"a checkpoint after {step} steps while the workers are at step {self.released}")
        if not checkpoint.due(self.cfg.train, step, self.start):
            self._end("end")
        self.board.put(f"save/{step}", str(folder))
        keys = [f"part/{step}/{r}" for r in range(self.n)]
        entries = self._collect(keys)
        for key in (f"save/{step}", *keys):
            self.board.delete(key)
        refused = nonfinite_part(entries, self.p, self.R)
        if refused:
            shutil.rmtree(folder, ignore_errors=True)
            raise TrainingDiverged(checkpoint.refusal(step, *refused))
        for r, e in enumerate(entries):  # a worker on another machine writes to its own disk otherwise
            if not (folder / e["file"]).is_file() or (folder / e["file"]).stat().st_size != e["bytes"]:
                raise ConfigError(f"{who(r, self.p, self.R)} wrote its checkpoint part where the driver cannot read it: "
                                  f"under torchrun, put the run directory on a filesystem that every node shares")
        return {self._part_name(r): e for r, e in enumerate(entries)}

    def restore_checkpoint(self, folder: Path, manifest: dict, run: dict) -> None:
        """Continue a resumed run whose Trainer state (``run``: its RunState) is restored: the
        workers, which read their parts themselves (named in the spec), get the phases decided
        before the checkpoint; the clock goes on from the checkpoint's time (the pipeline clock's
        replays the steps before it, which gives that time)."""
        self.board.put("resume/phases", list(self.plan.phases))
        self.base = self.prev_time = run["time_s"] - run["offset"]
        if self.replay is not None:
            for t in range(self.start):
                self.prev_time, self.prev_busy = self.replay.run_step(t)

    def _parts(self, folder: Path, manifest: dict) -> dict[int, str]:
        """The file of each stage's part of a (verified) checkpoint."""
        names = [self._part_name(r) for r in range(self.n)]
        missing = [n for n in names if n not in manifest["parts"]]
        if missing:
            raise ConfigError(f"checkpoint {folder} has no part {missing[0]}: it was not written by this pipeline")
        return {r: str(Path(folder) / manifest["parts"][n]["file"]) for r, n in enumerate(names)}

    def evaluate(self, batches, signal: bool = False) -> float:
        """The held-out signal's loss of the current weights: ``batches`` must be the spec's
        (``signal_rows`` rows of the validation data), which every worker evaluates right after
        each update."""
        v = self.released
        (loss,) = self._collect([f"signal/{v}"])
        self.board.delete(f"signal/{v}")
        return loss

    def state_dict(self) -> dict:
        """A snapshot after the steps released so far: each worker keeps its stage's at the gate of
        the next update; the driver's part is the clock."""
        self.snap_due = True
        return {"steps": self.released, "time": self.prev_time, "busy": self.prev_busy,
                "replay": self.replay.state_dict() if self.replay is not None else None}

    def load_state_dict(self, state: dict) -> None:
        """Roll every worker back to the snapshot of :meth:`state_dict` ``state``, from the gate
        where they wait (after the step that tripped the guard). The plan already holds the phases
        decided at the snapshot. Once every worker is back, the discarded steps' keys are cleared
        and the workers continue. The wall clock runs on from the snapshot's time (the loop adds the
        lost time)."""
        to, now = state["steps"], self.released
        self.rollbacks += 1
        key = f"back/{self.rollbacks}"
        self.board.put(key, {"to": to, "phases": list(self.plan.phases)})
        self.board.put("back", self.rollbacks)
        if checkpoint.due(self.cfg.train, now, self.start):  # the workers wait for a folder there first
            self.board.put(f"save/{now}", "skip")
        self.board.put(f"go/{now}", "back")
        self._collect([f"{key}/done/{r}" for r in range(self.n)])
        stale = [f"go/{now - 1}", f"go/{now}", f"save/{now}", *(f"rep/{now - 1}/{r}" for r in range(self.n)),
                 *(f"{k}/{v}" for k in ("signal", "eval") for v in range(to + 1, now + 2)),
                 *(f"phase/{u}" for u in range(len(self.plan.phases), self.max_steps)),
                 *(f"{key}/{k}/{r}" for k in ("now", "expect", "done") for r in range(self.n))]
        for k in stale:
            self.board.delete(k)
        self.board.put(f"{key}/go", True)
        self.released, self.due, self.snap_due = to, [], False
        self.base -= self.prev_time - state["time"]
        self.prev_time = state["time"]
        if self.replay is not None:
            self.replay.load_state_dict(state["replay"])
            self.prev_busy = state["busy"]

    def memory(self) -> list[dict]:
        keys = ("peak_activations", "peak_weight_versions", "peak_param_sets", "peak_grad_sets", "peak_bytes",
                "peak_param_bytes", "peak_grad_bytes", "peak_activation_bytes", "optimizer_bytes",
                "peak_rss_mb", "peak_device_mb")
        out = []
        for r, rep in sorted(self.reports.items()):
            replica, _ = where(r, self.p)
            for c in rep["chunks"]:  # (one per virtual stage the worker holds)
                out.append({"stage": c["stage"], **({"replica": replica} if self.R > 1 else {}), "rank": r,
                            **({"node": rep["node"]} if self.env is not None else {}),
                            **{k: c.get(k, rep.get(k)) for k in keys}})
        return sorted(out, key=lambda row: (row.get("replica", 0), row["stage"]))

    def action_times(self) -> dict | None:
        """Per stage and action kind, the seconds the workers' actions took against what the
        run's profile charges, and each rank's overheads per step (:func:`.action_times.action_table`);
        after :meth:`close`, None before or on CUDA."""
        return action_table(self.windows, self.profile)

    def close(self) -> None:
        """End the run and wait for every worker to finish; when an exception is on its way (or a
        worker failed), stop the workers at once instead."""
        if self.closed:
            return
        self.closed = True
        failing = self.failure is not None or sys.exc_info()[0] is not None
        try:
            if not failing:
                self._end("end")
                ends = self._collect([f"done/{r}" for r in range(self.n)])
                self.windows = [end.get("action_times") for end in ends]
                for r, end in enumerate(ends):  # the workers' peaks at their ends (see Worker.run)
                    if r in self.reports:
                        self.reports[r].update({k: end[k] for k in ("peak_rss_mb", "peak_device_mb")})
                self._stop_watchdog()
                with self._stopping:
                    for proc in self.procs.values():
                        proc.join(timeout=10)
        finally:
            self._shutdown()

    # -- internals -----------------------------------------------------------------------------
    @staticmethod
    def _chunks(reps) -> list[tuple[dict, dict]]:
        """(rank's report, virtual stage's entry) per virtual stage, in stage order."""
        return sorted(((rep, c) for rep in reps for c in rep["chunks"]), key=lambda rc: rc[1]["stage"])

    def _result(self, t: int, reps: list[dict]) -> StepResult:
        # an evaluation holds up the whole pipeline for about as long as the stage that waits
        # longest in it (the last), so the largest evaluation time comes off the clock; so does
        # the time spent writing checkpoints (not the held-out signal's: the heuristic's own work)
        paused = max(r["eval_s"] + r["save_s"] for r in reps)
        now = max(self.base + max(r["t_end"] for r in reps) - paused, self.prev_time)
        busy, devices = sum(r["busy"] for r in reps), self.n
        if self.replay is not None:  # the pipeline clock: the local runtime's time for this step (replica 0's)
            (now, busy), devices = self.replay.run_step(t), self.p
        span = now - self.prev_time
        bubble = 1.0 - (busy - self.prev_busy) / (devices * span) if span > 0 else float("nan")
        self.prev_time, self.prev_busy = now, busy
        # the loss: the mean over the replicas of their last stage's; the rest is replica 0's (as on local)
        lasts = [reps[r * self.p + self.p - 1] for r in range(self.R)]
        losses = [sum(x["losses"]) / max(1, len(x["losses"])) for x in lasts]
        reps = reps[:self.p]
        delays = [d for r in reps for d in r["delays"]]
        last, stages = reps[-1], self._chunks(reps)
        return StepResult(
            step=t, phase=self.plan.phases[t], loss=sum(losses) / len(losses), time_s=now,
            staleness_mean=sum(delays) / max(1, len(delays)), staleness_max=max(delays, default=0),
            bubble=min(1.0, max(0.0, bubble)) if math.isfinite(bubble) else bubble,
            grad_norm=global_norm([c["grad_sq"] for _, c in stages]), lr=last["lr"],
            versions_max=max(r["versions"] for r in reps), inflight_max=max(r["inflight"] for r in reps),
            lr_stages=stage_lrs([c["lr_stage"] for _, c in stages]), param_sets_max=max(r["param_sets"] for r in reps))

    def _part_name(self, rank: int) -> str:
        replica, stage = where(rank, self.p)
        return checkpoint.stage_part(stage, replica)

    def _forget(self, t: int) -> None:
        """Drop step ``t``'s keys from the board (every stage is past ``U(t)``)."""
        for key in (f"go/{t}", f"phase/{t}", *(f"rep/{t}/{r}" for r in range(self.n))):
            self.board.delete(key)

    def _end(self, verdict: str) -> None:
        if self.ended:
            return
        self.ended = True
        self.board.put(f"go/{self.released}", verdict)
        if self.plan.decided() < self.max_steps:  # a program may wait for the next phase
            self.board.put(f"phase/{self.plan.decided()}", "end")

    def _collect(self, keys: list[str], allowance: float | None = None) -> list:
        """The values of ``keys``, once every one is on the board; raises :class:`WorkerFailed`."""
        if self.failure is None:
            pend = self.collector.request(keys)
            self.waiting = (keys, time.monotonic(), allowance or self.timeout_s)
            try:
                while not pend.done.wait(0.25) and self.failure is None:
                    pass
            finally:
                self.waiting = None
            if self.failure is None and pend.error is not None:
                self._fail(f"lost the connection to the board: {pend.error}")
        if self.failure is not None:
            self._terminate()
            raise WorkerFailed(self.failure)
        return pend.values

    def _fail(self, message: str) -> None:
        with self._lock:
            if self.failure is None:
                self.failure = message
        self._terminate()

    def exitcodes(self) -> dict[int, int | None]:
        """Each local worker's exit status (None while it runs). Only one thread at a time may
        ask: a forkserver child's status is read from a pipe, once."""
        with self._stopping:
            return {r: p.exitcode for r, p in self.procs.items()}

    def _terminate(self) -> None:
        """Stop the local workers: SIGTERM, then SIGKILL those still there after 3 s."""
        with self._stopping:
            stop_processes(self.procs.values(), 3.0)

    def _abort_board(self) -> None:
        """Tell workers elsewhere (torchrun) that the run is over."""
        if not self.ended:
            self.ended = True
            self.board.put(f"go/{self.released}", "abort")
            self.board.put(f"phase/{self.plan.decided()}", "abort")
        if not self.board.has(f"save/{self.released}"):  # nor wait for a checkpoint's folder
            self.board.put(f"save/{self.released}", None)

    def _stop_watchdog(self) -> None:
        if hasattr(self, "watchdog"):
            self.watchdog.stopped.set()
            if self.watchdog is not threading.current_thread():
                self.watchdog.join(5.0)

    def _shutdown(self) -> None:
        """Stop the driver's helper threads and the workers that are still there; on an interrupt
        (Ctrl-C, or SIGTERM, which the CLI turns into one) the forkserver and the resource tracker
        too, since the process is about to exit."""
        interrupted = isinstance(sys.exc_info()[1], KeyboardInterrupt)
        self._stop_watchdog()
        if interrupted:  # no grace: the workers' state is in the last checkpoint
            for proc in self.procs.values():
                if proc.is_alive():
                    proc.kill()
        self._terminate()
        try:
            self._abort_board()
            self.collector.stop(self.board)
        finally:
            atexit.unregister(self._shutdown)
            if interrupted:
                stop_helpers()


__all__ = ["DistRuntime", "WorkerFailed", "choose_backend"]
