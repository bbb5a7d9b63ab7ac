"""Building a run from its config: data, model, schedule, runtime, cost profile and heuristic.

:class:`RunSetup` is everything ``adapipe train`` does before its first step (the training loop,
:class:`.loop.Trainer`, is built on it). The order is the one that lets a refused run leave
nothing behind: a foreign checkpoint first, then the data's and the profile's fingerprints, each
before a worker starts or ``profile.json`` is written.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf

from .. import checkpoint
from ..config.validate import ConfigError, validate
from ..data import build_data
from ..data.batches import Batches
from ..model.build import make_stages, model_config
from ..runtime.base import Runtime, RunSpec
from ..runtime.device import resolve_device
from ..runtime.local import LocalRuntime, Replica
from ..runtime.profile_meta import measure_stage_profile, profile_meta, profile_mismatch
from ..runtime.replicas import replica_batch
from ..schedules import SYNC, Plan, ScheduleError
from ..schedules.choice import (chunks, follows_held_out, make_policy, microbatch_size, schedule_choice, signal_rows,
                                virtual_stages)
from ..simulator.clock import AllReduceModel, CostProfile, LinkModel
from ..simulator.simulate import steady_step_times
from . import build, fingerprint
from .guard import DivergenceGuard
from .progress import Console


def runtime_kind(cfg) -> str:
    """``local`` or ``dist``: ``auto`` picks dist when there is a CUDA device for every worker
    (stage of each replica)."""
    if cfg.pipeline.runtime != "auto":
        return cfg.pipeline.runtime
    if (cfg.schedule.name == "interleaved" or chunks(cfg) > 1) and cfg.pipeline.stages < 2:
        return "local"  # a worker does not send to itself
    workers = cfg.pipeline.stages * cfg.pipeline.replicas
    return "dist" if torch.cuda.is_available() and torch.cuda.device_count() >= workers else "local"


class RunSetup:
    """A run built from ``cfg`` in ``run_dir`` (a resumed run's own directory): its data, schedule,
    plan, runtime (which holds the stages), cost profile, predicted step times (``ctx``) and
    heuristic, and the checkpoint it resumes from, if any."""

    def __init__(self, cfg, run_dir: Path):
        # a resumed run continues in its own directory
        self.cfg, self.dir = cfg, Path(cfg.train.resume or run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.console = Console(self.dir)  # stderr, and the same lines in run.log
        validate(cfg)
        self.resume = self._checkpoint_to_resume()  # before anything else: a foreign checkpoint is refused
        if cfg.pipeline.threads > 0:
            torch.set_num_threads(cfg.pipeline.threads)
        torch.manual_seed(cfg.seed)
        t, p = cfg.train, cfg.pipeline
        self.data = build_data(cfg.data, cfg.model.block_size, cfg.seed)
        self.fingerprints = fingerprint.data_fingerprints(self.data)  # recorded in every checkpoint
        self._check_fingerprints()
        self.micro = microbatch_size(self.cfg)  # each replica's microbatch
        train_tokens = getattr(self.data, "train_tokens", None)  # the token array of a finite corpus
        train_tokens = None if train_tokens is None else len(train_tokens)
        if train_tokens is not None and self.micro * (cfg.model.block_size + 1) > train_tokens:
            raise ConfigError(
                f"a microbatch of {self.micro} x {cfg.model.block_size + 1} tokens is larger than the {train_tokens} "
                f"training tokens of data={cfg.data.name}: lower train.batch_size or model.block_size")
        if cfg.model.vocab_size is not None and cfg.model.vocab_size < self.data.vocab_size:
            raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the data's {self.data.vocab_size} tokens")
        self.gcfg = model_config(cfg, self.data.vocab_size)
        self.choice = schedule_choice(cfg)
        try:
            self.choice.spec.check()
        except ScheduleError as e:
            raise ConfigError(str(e)) from None
        self.plan = Plan(t.max_steps)
        self.lag = build.decision_lag(cfg)
        self.kind = runtime_kind(cfg)
        self.clock = build.clock_mode(cfg, self.kind)
        self.guard = self._guard()
        self.link = LinkModel(p.link_latency_s, p.link_bandwidth)
        self.allreduce = AllReduceModel(p.replicas, p.dp_bandwidth, p.dp_latency_s)
        self.tokens_per_step = t.batch_size * cfg.model.block_size
        self.signal = self._signal_batch()
        self._signal_warned = False
        # the local runtime's device (the dist runtime's workers place their own stages)
        self.device = resolve_device(p.device) if self.kind == "local" else torch.device("cpu")
        if self.kind == "local":
            self.runtime = self._local_runtime()
        else:  # the workers build their stages and measure their costs; the driver holds neither
            self.runtime = self._dist_runtime()
        try:
            sync_t, async_t, switch_t = steady_step_times(self.choice.spec, self.profile, self.link,
                                                          list(cfg.schedule.mitigation), self.allreduce,
                                                          self.signal_costs())
            self.ctx = build.heuristic_context(cfg, sync_t, async_t, switch_t)
            try:
                self.heuristic = build.make_heuristic(cfg, self.choice, self.ctx)
            except ValueError as e:  # a heuristic's own keys (heuristic.start, a user-written one's options)
                raise ConfigError(str(e)) from None
        except BaseException:
            self.runtime.close()
            raise

    def _guard(self) -> DivergenceGuard:
        """The divergence guard: only async phases are guarded."""
        guard = DivergenceGuard(self.cfg.heuristic)
        guard.enabled = guard.enabled and self.choice.phase != SYNC
        guard.keep_for(self.lag)
        return guard

    def _signal_batch(self):
        """The held-out batch whose loss the heuristic follows as its progress signal (None: the
        training loss). Training-batch losses vary with the batch far more than they fall in a few
        steps; a fixed batch's loss moves only with the weights."""
        if not follows_held_out(self.cfg):  # (heuristic.signal validated: train or heldout)
            return None
        x, y = self.data.val_batches(self.signal_rows())[0]
        device = resolve_device(self.cfg.pipeline.device) if self.kind == "local" else torch.device("cpu")
        return [(x.to(device), y.to(device))]

    def signal_rows(self) -> int:
        return signal_rows(self.cfg)

    def signal_costs(self) -> list[float] | None:
        """Per stage, the held-out signal's forward that the clock charges after each update (the
        heuristic's own work: on the clock), from the run's profile; None without a signal. Where
        the profile measured another number of rows it is scaled from them, which one warning
        line says (a forward's cost is not proportional to its rows: on one CPU thread 1 row took
        0.4x a 4-row training forward and 8 rows 1.7x)."""
        if not self.signal:
            return None
        rows, measured = self.signal_rows(), self.profile.meta.get("signal_rows")
        if self.profile.signal and measured != rows and not self._signal_warned:
            self._signal_warned = True
            print(f"adapipe: warning: the cost profile timed the held-out signal's forward at {measured} rows and "
                  f"this run's is {rows} (heuristic.signal_tokens={self.cfg.heuristic.signal_tokens}): its cost is "
                  f"scaled linearly, an estimate; measure a profile with this signal_tokens for its own", file=sys.stderr)
        return self.profile.signal_costs(rows, self.micro)

    def _local_runtime(self) -> Runtime:
        """Every stage in this process, on ``pipeline.device``; the profile measured here."""
        cfg, p, t = self.cfg, self.cfg.pipeline, self.cfg.train
        self.stages, self.optimizers = make_stages(cfg, self.gcfg, device=self.device)
        # R x m microbatches per step; replica r's are shares r*m .. r*m + m - 1 (runtime/replicas.py)
        self.batches = Batches(self.data, t.batch_size, p.microbatches * p.replicas, device=self.device)
        given = self._given_profile()
        self.profile = self._use_profile(given or measure_stage_profile(cfg, self.stages, *self.batches(0, 0), self.data))
        self.link = LinkModel.choose(p.link_latency_s, p.link_bandwidth, self.profile)  # (a dist run's, if given)
        self.choice = build.pick_sync(self.choice, self.profile, self.link, cfg.schedule.mitigation, self.allreduce)
        self.val = [(x.to(self.device), y.to(self.device)) for x, y in self.data.val_batches(self.micro)]
        policy = make_policy(cfg, self.plan)
        return LocalRuntime(
            self.stages, self.optimizers, self.choice.spec, self.plan, policy, self.batches,
            self.profile if self.clock == "profiled" else None, self.link, cfg.optim.grad_clip, cfg.seed,
            cfg.model.tie_embeddings, p.order, self.eval_at, self.val,
            precision=t.precision, device=self.device, replicas=self._replicas(policy), allreduce=self.allreduce,
            signal=self.signal_costs())

    def _replicas(self, policy) -> list[Replica]:
        """Replicas 1 .. R-1 of the pipeline (``pipeline.replicas``): stages built from the same
        seed as replica 0's, their own optimizers and policy, their share of each step."""
        m = self.cfg.pipeline.microbatches
        out = []
        for r in range(1, self.cfg.pipeline.replicas):
            stages, optimizers = make_stages(self.cfg, self.gcfg, device=self.device)
            out.append(Replica(stages, optimizers, policy.replica(), replica_batch(self.batches, r, m)))
        return out

    def _dist_runtime(self) -> Runtime:
        """A worker process per stage (``pipeline.runtime=dist``, or ``auto`` with a CUDA device for
        every stage); without ``pipeline.profile`` each worker measures its own stage's costs."""
        from ..runtime.dist import DistRuntime

        self._refuse_unbuilt_dist()
        given = self._given_profile()
        if given is not None:
            self._use_profile(given)  # (a refused resume starts no worker)
            link = LinkModel.choose(self.cfg.pipeline.link_latency_s, self.cfg.pipeline.link_bandwidth, given)
            self.choice = build.pick_sync(self.choice, given, link, self.cfg.schedule.mitigation, self.allreduce)
        elif self.choice.auto:  # (the workers measure the profile after they are given the schedule)
            raise ConfigError("schedule.sync=auto on pipeline.runtime=dist picks the sync phase from a profile before the "
                              "workers start: give pipeline.profile=FILE (adapipe profile ...), or schedule.sync=zbh1 or 1f1b")
        spec = RunSpec(self.cfg, self.plan, self.eval_at, self.dir, self.resume, schedule=self.choice.spec,
                       link=self.link, profile=given, clock=self.clock,
                       signal_rows=self.signal_rows() if self.signal else None,
                       snapshots_kept=self.guard.snapshots.maxlen if self.guard.enabled else 0)
        rt = DistRuntime(spec)
        try:
            # (a profile the workers measured carries the link they measured: DistRuntime puts it there)
            self.profile = given or self._use_profile(rt.profile)
            # the heuristic's predicted step times on the clock's link (as a local run given this profile)
            self.link = LinkModel.choose(self.cfg.pipeline.link_latency_s, self.cfg.pipeline.link_bandwidth, self.profile)
        except BaseException:
            rt.close()
            raise
        return rt

    def _refuse_unbuilt_dist(self) -> None:
        """What the dist runtime does not build for AdaPipe over interleaved chunks: its async stream
        has activations and gradients in flight between every pair of chunks at a gate, and the
        workers resend one chunk's (see runtime/worker.py), so no checkpoint and no rollback. Nor
        does it put off a checkpoint that falls due during a tentative probe (the workers write
        their parts at the gate of a due step), so no periodic checkpoints with undone probes."""
        if self.cfg.heuristic.get("undo_probes") and self.cfg.train.checkpoint_every and self.choice.phase is None:
            raise ConfigError("heuristic.undo_probes on pipeline.runtime=dist does not write periodic checkpoints yet: "
                              "use train.checkpoint_every=0 (train.save_final=true still works), or pipeline.runtime=local")
        if self.choice.spec.chunks == 1 or self.choice.phase == SYNC:
            return
        t, what = self.cfg.train, "schedule.sync=interleaved on pipeline.runtime=dist"
        if t.checkpoint_every or t.resume or t.save_final:
            raise ConfigError(f"{what} does not write or resume checkpoints yet: use train.checkpoint_every=0 "
                              f"train.save_final=false, or pipeline.runtime=local")
        if self.guard.enabled:
            raise ConfigError(f"{what} does not roll back yet: use heuristic.guard=false, or pipeline.runtime=local")
        if self.cfg.heuristic.get("undo_probes"):
            raise ConfigError(f"{what} does not undo probes yet: use heuristic.undo_probes=false, or pipeline.runtime=local")

    def _given_profile(self) -> CostProfile | None:
        """``pipeline.profile``, or a resumed run's own (None: measure one); refused when it was
        measured for another run (model, stages, microbatch size...)."""
        p = self.cfg.pipeline
        saved = self.dir / "profile.json"
        path = p.profile or (saved if self.cfg.train.resume and saved.is_file() else None)  # resume: the same clock
        if not path:
            return None
        try:
            prof = CostProfile.load(path)
        except ValueError as e:
            raise ConfigError(f"pipeline.profile={path}: {e}") from None
        n = virtual_stages(self.cfg)
        if prof.stages != n:
            chunks = f" x schedule.chunks={self.cfg.schedule.chunks}" if n != p.stages else ""
            raise ConfigError(f"pipeline.profile={path} has {prof.stages} stages but pipeline.stages={p.stages}"
                              f"{chunks}: use a profile measured for {n} stages")
        wrong = profile_mismatch(prof.meta, profile_meta(self.cfg, self.micro))
        if wrong:
            raise ConfigError(f"pipeline.profile={path} was measured for another run ({wrong}): "
                              f"measure one for this run (adapipe profile with the same overrides) or leave it out")
        return prof

    def _use_profile(self, prof: CostProfile) -> CostProfile:
        """Record ``prof`` as the run's profile; refused, on resume, when it differs from the
        checkpoint's."""
        self.fingerprints.update(fingerprint.profile_fingerprints(prof, fingerprint.link_configured(self.cfg)))
        self._check_fingerprints()  # before profile.json is written: a refused resume changes nothing
        prof.save(self.dir / "profile.json")
        return prof

    def _check_fingerprints(self) -> None:
        """Refuse a resume whose data or cost profile differ from the checkpoint's (see :mod:`.fingerprint`)."""
        if self.resume:
            refusal = fingerprint.refusal(self.cfg, self.resume[0], self.resume[1], self.fingerprints)
            if refusal:
                raise ConfigError(refusal)

    def eval_at(self, t: int) -> bool:
        """Evaluate the weights after step ``t`` (t = -1: the initial weights)."""
        n = self.cfg.train.max_steps
        return t == -1 or (t + 1) % self.cfg.train.eval_every == 0 or t + 1 == n

    def _checkpoint_to_resume(self) -> tuple[Path, dict] | None:
        if not self.cfg.train.resume:
            return None
        checkpoint.clean_partial(self.dir)
        folder, manifest = checkpoint.load_latest(self.dir, warn=self.console.say)
        current = OmegaConf.to_container(self.cfg, resolve=True)
        diff = checkpoint.config_differences(manifest["config"], current, checkpoint.resume_free_keys(manifest, current))
        if diff:
            raise ConfigError(f"checkpoint {folder} belongs to another run: {diff[0]}"
                              + (f" (and {len(diff) - 1} more)" if len(diff) > 1 else ""))
        written, now = manifest.get("runtime", "local"), runtime_kind(self.cfg)
        if written != now:  # (pipeline.runtime=auto may resolve differently on another machine)
            raise ConfigError(f"checkpoint {folder} was written by the {written} runtime, this run uses the {now} "
                              f"runtime: resume it with pipeline.runtime={written}")
        return folder, manifest
