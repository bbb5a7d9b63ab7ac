"""The training loop of ``adapipe train``: one experiment, start to summary.

Each step the runtime trains every stage up to the step's update; the loop then hands the step's
measurements to the heuristic, which decides the phase of a step ``lag`` steps ahead (the
pipeline needs phases that far in advance), logs the step, evaluates every ``train.eval_every``
steps and stops at ``train.max_steps``, ``train.max_time_s`` or, with ``train.stop_at_target``, at
the target perplexity.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import OmegaConf

from .. import checkpoint
from ..adaptive.base import Context, Decision, Observation
from ..config.validate import ConfigError, validate
from ..data import DataError, build_data
from ..runtime.base import Runtime, RunSpec, StepResult
from ..runtime.device import resolve_device
from ..runtime.errors import TrainingDiverged
from ..runtime.local import LocalRuntime, Replica
from ..runtime.replicas import replica_batch
from ..schedules import SYNC, Plan, ScheduleError
from ..simulator.clock import AllReduceModel, CostProfile, LinkModel
from ..simulator.simulate import steady_step_times
from . import build, fingerprint
from .guard import DivergenceGuard
from .metrics import RunLog
from .plots import plot_curves, plot_phases
from .progress import Console, Progress


@dataclass
class RunState:
    """What the loop knows about the run so far (saved with every checkpoint)."""

    steps: int = 0  # steps completed
    tokens: int = 0
    time_s: float = 0.0  # the run's clock, rollbacks' lost time included
    offset: float = 0.0  # time lost to rollbacks, added to the runtime's clock
    stopped: str = "max_steps"
    forced_until: int = 0  # the guard's sync cooldown: steps before this are decided sync
    wall_before: float = 0.0  # wall time of earlier sessions of a resumed run
    evals: list = field(default_factory=list)
    step_time: dict = field(default_factory=lambda: {0: 0.0})  # version -> time_s when it existed


def async_label(schedule) -> str:
    """The published name of the async schedule a config runs (``schedule=pipedream``/``2bw``, or
    adapipe's ``schedule.async``), with every mitigation named: ``pipedream`` (PipeDream, weight
    stashing), ``pipedream-latest``, ``2bw`` (PipeDream-2BW), ``pipedream+predict``, ..."""
    s = schedule
    base = s["async"] if s.name == "adapipe" else s.name
    name = "2bw" if base == "2bw" else ("pipedream" if s.weights == "stash" else f"pipedream-{s.weights}")
    return name + "".join(f"+{x}" for x in s.mitigation)


def method_label(cfg) -> str:
    """What a run is, in the field's names, wherever it shows (run log, summary.json, plots):
    ``1f1b``, ``gpipe``, ``pipedream``, ``2bw+predict``, ``adapipe-goodput(1f1b/pipedream+predict)``
    (AdaPipe: its heuristic, then the sync and async schedules it switches between)."""
    s = cfg.schedule
    if s.name in ("pipedream", "2bw"):
        return async_label(s)
    if s.name == "adapipe":
        return f"adapipe-{cfg.heuristic.name}({s.sync}/{async_label(s)})"
    return s.name


def runtime_kind(cfg) -> str:
    """``local`` or ``dist``: ``auto`` picks dist when there is a CUDA device for every worker
    (stage of each replica)."""
    if cfg.pipeline.runtime != "auto":
        return cfg.pipeline.runtime
    if cfg.schedule.name == "interleaved":  # (the dist runtime holds one chunk per worker)
        return "local"
    workers = cfg.pipeline.stages * cfg.pipeline.replicas
    return "dist" if torch.cuda.is_available() and torch.cuda.device_count() >= workers else "local"


class Trainer:
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
        self.micro = t.batch_size // (p.microbatches * p.replicas)  # each replica's microbatch
        train_tokens = getattr(self.data, "train_tokens", None)  # the token array of a finite corpus
        train_tokens = None if train_tokens is None else len(train_tokens)
        if train_tokens is not None and self.micro * (cfg.model.block_size + 1) > train_tokens:
            raise ConfigError(
                f"a microbatch of {self.micro} x {cfg.model.block_size + 1} tokens is larger than the {train_tokens} "
                f"training tokens of data={cfg.data.name}: lower train.batch_size or model.block_size")
        if cfg.model.vocab_size is not None and cfg.model.vocab_size < self.data.vocab_size:
            raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the data's {self.data.vocab_size} tokens")
        self.gcfg = build.model_config(cfg, self.data.vocab_size)
        self.choice = build.schedule_choice(cfg)
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
        # the local runtime's device (the dist runtime's workers place their own stages)
        self.device = resolve_device(p.device) if self.kind == "local" else torch.device("cpu")
        if self.kind == "local":
            self.runtime = self._local_runtime()
        else:  # the workers build their stages and measure their costs; the driver holds neither
            self.runtime = self._dist_runtime()
        try:
            sync_t, async_t, switch_t = steady_step_times(self.choice.spec, self.profile, self.link,
                                                          list(cfg.schedule.mitigation), self.allreduce)
            self.ctx = Context(p.stages, p.microbatches, t.max_steps, self.lag - 1, sync_t, async_t, switch_t,
                               lr_warmup=cfg.optim.warmup_steps,
                               extra={"optimizer": cfg.optim.name, "open_ended": bool(t.stop_at_target and t.target_ppl)})
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
        h = self.cfg.heuristic
        if self.choice.phase is not None or h.signal == "train":
            return None
        if h.signal != "heldout":
            raise ConfigError(f"unknown heuristic.signal={h.signal!r}: use heldout or train")
        x, y = self.data.val_batches(self.signal_rows())[0]
        device = resolve_device(self.cfg.pipeline.device) if self.kind == "local" else torch.device("cpu")
        return [(x.to(device), y.to(device))]

    def signal_rows(self) -> int:
        return max(1, self.cfg.heuristic.signal_tokens // self.cfg.model.block_size)

    def _local_runtime(self) -> Runtime:
        """Every stage in this process, on ``pipeline.device``; the profile measured here."""
        cfg, p, t = self.cfg, self.cfg.pipeline, self.cfg.train
        self.stages, self.optimizers = build.make_stages(cfg, self.gcfg, device=self.device)
        # R x m microbatches per step; replica r's are shares r*m .. r*m + m - 1 (runtime/replicas.py)
        self.batches = build.Batches(self.data, t.batch_size, p.microbatches * p.replicas, device=self.device)
        given = self._given_profile()
        self.profile = self._use_profile(given or build.measure_stage_profile(cfg, self.stages, *self.batches(0, 0)))
        self.link = LinkModel.choose(p.link_latency_s, p.link_bandwidth, self.profile)  # (a dist run's, if given)
        self.val = [(x.to(self.device), y.to(self.device)) for x, y in self.data.val_batches(self.micro)]
        policy = build.make_policy(cfg, self.plan)
        return LocalRuntime(
            self.stages, self.optimizers, self.choice.spec, self.plan, policy, self.batches,
            self.profile if self.clock == "profiled" else None, self.link, cfg.optim.grad_clip, cfg.seed,
            cfg.model.tie_embeddings, p.order, self.eval_at, self.val,
            precision=t.precision, device=self.device, replicas=self._replicas(policy), allreduce=self.allreduce)

    def _replicas(self, policy) -> list[Replica]:
        """Replicas 1 .. R-1 of the pipeline (``pipeline.replicas``): stages built from the same
        seed as replica 0's, their own optimizers and policy, their share of each step."""
        m = self.cfg.pipeline.microbatches
        out = []
        for r in range(1, self.cfg.pipeline.replicas):
            stages, optimizers = build.make_stages(self.cfg, self.gcfg, device=self.device)
            out.append(Replica(stages, optimizers, policy.replica(), replica_batch(self.batches, r, m)))
        return out

    def _dist_runtime(self) -> Runtime:
        """A worker process per stage (``pipeline.runtime=dist``, or ``auto`` with a CUDA device for
        every stage); without ``pipeline.profile`` each worker measures its own stage's costs."""
        from ..runtime.dist import DistRuntime

        given = self._given_profile()
        if given is not None:
            self._use_profile(given)  # (a refused resume starts no worker)
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
        n = build.virtual_stages(self.cfg)
        if prof.stages != n:
            chunks = f" x schedule.chunks={self.cfg.schedule.chunks}" if n != p.stages else ""
            raise ConfigError(f"pipeline.profile={path} has {prof.stages} stages but pipeline.stages={p.stages}"
                              f"{chunks}: use a profile measured for {n} stages")
        wrong = build.profile_mismatch(prof.meta, build.profile_meta(self.cfg, self.micro))
        if wrong:
            raise ConfigError(f"pipeline.profile={path} was measured for another run ({wrong}): "
                              f"measure one for this run (adapipe profile with the same overrides) or leave it out")
        return prof

    def _use_profile(self, prof: CostProfile) -> CostProfile:
        """Record ``prof`` as the run's profile; refused, on resume, when it differs from the
        checkpoint's."""
        self.fingerprints[fingerprint.PROFILE] = fingerprint.profile_fingerprint(prof)
        self._check_fingerprints()  # before profile.json is written: a refused resume changes nothing
        prof.save(self.dir / "profile.json")
        return prof

    def _check_fingerprints(self) -> None:
        """Refuse a resume whose data or cost profile differ from the checkpoint's (see :mod:`.fingerprint`)."""
        if self.resume:
            refusal = fingerprint.refusal(self.cfg, self.resume[0], self.resume[1], self.fingerprints)
            if refusal:
                raise ConfigError(refusal)

    # -- the loop ------------------------------------------------------------------------------
    def eval_at(self, t: int) -> bool:
        """Evaluate the weights after step ``t`` (t = -1: the initial weights)."""
        n = self.cfg.train.max_steps
        return t == -1 or (t + 1) % self.cfg.train.eval_every == 0 or t + 1 == n

    def run(self) -> dict:
        cfg, t, rt = self.cfg, self.cfg.train, self.runtime
        self.st = RunState()
        resume = self.resume
        try:
            self.log = RunLog(self.dir, cfg.logger, OmegaConf.to_container(cfg, resolve=True),
                              keep_lines=resume[1]["trainer_lines"] if resume else None)
        except BaseException:  # (wandb refused to start: the dist runtime's workers must still stop)
            rt.close()
            raise
        first_line = (f"adapipe: runtime={rt.name} backend={rt.backend or 'none'} clock={rt.clock_name} "
                      f"({self.clock}) "
                      + (f"device={self.device} " if rt.name == "local" else "") + f"precision={t.precision} "
                      f"stages={cfg.pipeline.stages} microbatches={cfg.pipeline.microbatches} "
                      + (f"replicas={cfg.pipeline.replicas} " if cfg.pipeline.replicas > 1 else "") +
                      f"schedule={method_label(cfg)} model={cfg.model.name} data={self.data.describe()}")
        self.console.say(first_line)
        self.wall0 = time.perf_counter()
        progress = Progress(t.max_steps, t.progress, self.console)
        try:
            if resume:
                self._restore(*resume)
                self.console.say(f"adapipe: resumed from {resume[0]} at step {self.st.steps}")
                # a run continued past its old train.max_steps has not decided the steps after it yet
                for u in range(self.plan.decided(), min(self.st.steps + self.lag, t.max_steps)):
                    self._decide(u)
            else:
                for u in range(min(self.lag, t.max_steps)):
                    self._decide(u)
                self._collect()
            progress.start_at(self.st.steps)
            step = self.st.steps
            while step < t.max_steps:
                res = rt.run_step(step)
                reason = self.guard.check(res.phase, res.loss)
                if reason:
                    step = self._rollback(step, res, reason)
                    continue
                if not math.isfinite(res.loss):
                    raise TrainingDiverged(f"training diverged at step {step} (loss {res.loss}): lower optim.lr or "
                                           f"schedule.async_lr_scale, or keep heuristic.guard=true")
                self.guard.accept(res.loss)
                ev = self._after_step(step, res)
                progress.update(res, ev, self.st.tokens / self.st.time_s if self.st.time_s > 0 else 0.0)
                step += 1
                if checkpoint.due(t, step, start=0):  # (step >= 1 here: never the resumed-from step)
                    self.save_checkpoint()
                if self.guard.due(step - 1):
                    self.guard.snapshots.append((step - 1, copy.deepcopy(self._full_state())))
                if ev and t.stop_at_target and ev["val_ppl"] <= t.target_ppl:
                    self.st.stopped = "target"
                    break
                if t.max_time_s and self.st.time_s >= t.max_time_s:
                    self.st.stopped = "max_time"
                    break
            if self.st.evals[-1]["step"] != self.st.steps:
                rt.evaluate_now(self.st.steps)
                self._collect()
            if checkpoint.due_at_end(t, self.st.steps):
                self.save_checkpoint()
            progress.close()
            summary = self._summary(self.log.records, self.st.evals, self.wall())
            self.log.summary(summary)
        finally:
            progress.close()
            rt.close()
            self.log.close()
        self._plots(self.log.records)
        self.console.say(final_line(summary))
        return summary

    def wall(self) -> float:
        return self.st.wall_before + time.perf_counter() - self.wall0

    def _after_step(self, step: int, res: StepResult) -> dict | None:
        """Account, observe, decide ahead, log and collect evaluations of a finished step."""
        st = self.st
        time_s = res.time_s + st.offset
        prev = st.time_s
        st.tokens, st.time_s, st.steps = st.tokens + self.tokens_per_step, time_s, step + 1
        st.step_time[step + 1] = time_s
        signal = self.runtime.evaluate(self.signal) if self.signal else res.loss
        self.heuristic.observe(Observation(step, res.phase, signal, time_s, time_s - prev, res.staleness_mean))
        if step + self.lag < self.cfg.train.max_steps:
            self._decide(step + self.lag)
        rec = self._step_record(res, time_s, st.tokens, self.wall())
        if self.signal:
            rec["signal"] = signal  # the held-out loss the heuristic follows
        self.log.write(rec)
        return self._collect()

    def _collect(self) -> dict | None:
        last = None
        for version, loss in self.runtime.evaluations():
            last = {"kind": "eval", "step": version, "val_loss": loss, "val_ppl": math.exp(min(loss, 50.0)),
                    "time_s": self.st.step_time[version], "wall_s": self.wall(), "tokens": version * self.tokens_per_step}
            self.log.write(last)
            self.st.evals.append(last)
        return last

    def _decide(self, u: int) -> None:
        if u < self.st.forced_until:
            d = Decision(SYNC, "divergence guard cooldown")
        else:
            d = self.heuristic.decide(u)
        prev = self.plan.phases[u - 1] if u > 0 else None
        self.runtime.decide(u, d.phase)
        if prev is not None and d.phase != prev:
            self.log.write({"kind": "event", "event": "switch", "step": u, "from": prev, "to": d.phase,
                            "reason": d.reason, "decided_after_step": u - self.lag, **d.info})
            self.console.say(f"adapipe: switch {prev} -> {d.phase} at step {u} ({d.reason})")
        elif d.info:  # a verdict that kept the phase: recorded too, with its estimates
            self.log.write({"kind": "event", "event": "verdict", "step": u, "phase": d.phase, "reason": d.reason,
                            "decided_after_step": u - self.lag, **d.info})

    # -- state: the divergence guard and checkpoints ----------------------------------------------
    def _full_state(self) -> dict:
        """The run at the current step boundary: the pipeline and everything the loop knows."""
        return {"pipeline": self.runtime.state_dict(), "trainer": self._trainer_state()}

    def _trainer_state(self) -> dict:
        run = copy.deepcopy(self.st.__dict__)
        run["wall_before"] = self.wall()
        return {"run": run, "phases": list(self.plan.phases),
                "heuristic": copy.deepcopy(self.heuristic.state_dict()), "guard": self.guard.state_dict(),
                "lines": len(self.log.records), "rng": torch.get_rng_state()}

    def _load_state(self, state: dict) -> None:
        tr = state["trainer"]
        self.plan.phases[:] = tr["phases"]
        self.heuristic.load_state_dict(copy.deepcopy(tr["heuristic"]))
        self.guard.load_state_dict(tr["guard"])
        torch.set_rng_state(tr["rng"])
        if "pipeline" in state:  # a guard snapshot (a checkpoint's pipeline parts are the runtime's to read)
            self.runtime.load_state_dict(state["pipeline"])

    def _rollback(self, step: int, res: StepResult, reason: str) -> int:
        """Restore the last good state after step ``step`` tripped the guard; returns the next step."""
        kept = self.guard.usable(step, self.lag)
        if kept is None:
            raise TrainingDiverged(f"training diverged at step {step} ({reason}) with no good state to go back to: "
                                   f"lower optim.lr or schedule.async_lr_scale")
        good, state = kept
        while self.guard.snapshots and self.guard.snapshots[-1][0] > good:  # later ones led here
            self.guard.snapshots.pop()
        lost = (res.time_s + self.st.offset) - state["trainer"]["run"]["time_s"]
        run = dict(state["trainer"]["run"], wall_before=self.st.wall_before)  # wall time runs on
        self._load_state(copy.deepcopy(state))
        self.st = RunState(**copy.deepcopy(run))
        self.st.offset += lost
        self.st.forced_until = self.plan.decided() + self.guard.cooldown
        self.guard.events += 1
        self.log.truncate(state["trainer"]["lines"])
        self.log.write({"kind": "event", "event": "guard", "step": step, "restored_step": good + 1, "reason": reason,
                        "lost_time_s": lost, "sync_until_step": self.st.forced_until})
        self.console.say(f"adapipe: step {step}: {reason}; restored step {good + 1}, sync until step {self.st.forced_until}")
        return good + 1

    def save_checkpoint(self) -> Path:
        steps = self.st.steps
        trainer = self._trainer_state()
        folder = checkpoint.begin(self.dir, steps)
        # the runtime writes the pipeline's parts (the dist runtime's workers one per stage) and
        # refuses weights that are not finite
        parts = self.runtime.write_checkpoint_parts(folder, steps)
        parts["trainer"] = checkpoint.write_part(folder, "trainer", trainer)
        meta = {"config": OmegaConf.to_container(self.cfg, resolve=True), "trainer_lines": trainer["lines"],
                "runtime": self.runtime.name, "fingerprints": self.fingerprints}
        return checkpoint.commit(self.dir, folder, steps, parts, meta, self.cfg.train.keep_checkpoints)

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

    def _restore(self, folder: Path, manifest: dict) -> None:
        state = {"trainer": checkpoint.read_part(folder, manifest, "trainer")}
        self._load_state(state)  # the phases first: the runtime regenerates its programs from them
        self.runtime.restore_checkpoint(folder, manifest, state["trainer"]["run"])
        self.st = RunState(**state["trainer"]["run"])

    def _step_record(self, r: StepResult, time_s: float, tokens: int, wall: float) -> dict:
        return {"kind": "step", "step": r.step, "phase": r.phase, "loss": r.loss, "lr": r.lr, "tokens": tokens,
                "time_s": time_s, "wall_s": wall, "staleness": r.staleness_mean, "staleness_max": r.staleness_max,
                "bubble": r.bubble, "grad_norm": r.grad_norm, "weight_versions": r.versions_max,
                "param_sets": r.param_sets_max, "activations": r.inflight_max,
                **({"lr_stages": r.lr_stages} if r.lr_stages else {})}

    def _summary(self, records: list[dict], evals: list[dict], wall: float) -> dict:
        cfg, t = self.cfg, self.cfg.train
        steps = [r for r in records if r.get("kind") == "step"]
        phases = {ph: {"steps": 0, "time_s": 0.0} for ph in ("sync", "async")}
        prev = 0.0
        for r in steps:
            phases[r["phase"]]["steps"] += 1
            phases[r["phase"]]["time_s"] += r["time_s"] - prev
            prev = r["time_s"]
        reached = [e for e in evals if t.target_ppl and e["val_ppl"] <= t.target_ppl]
        final = evals[-1]
        state = {"steps": self.st.steps, "tokens": self.st.tokens, "stopped": self.st.stopped}
        total = self.st.time_s
        return {
            "method": method_label(cfg), "schedule": cfg.schedule.name,
            # the schedule each phase ran as (adapipe: both; a plain schedule: its one phase)
            "phase_schedules": {"sync": cfg.schedule.sync if cfg.schedule.name == "adapipe" else
                                (cfg.schedule.name if self.choice.phase == SYNC else None),
                                "async": async_label(cfg.schedule) if self.choice.phase != SYNC else None},
            "heuristic": cfg.heuristic.name if cfg.schedule.name == "adapipe" else None,
            "runtime": self.runtime.name, "backend": self.runtime.backend, "clock": self.runtime.clock_name,
            "clock_mode": self.clock,
            "device": str(self.device) if self.runtime.name == "local" else None, "precision": t.precision,
            "model": cfg.model.name, "data": cfg.data.name, "optimizer": cfg.optim.name,
            "stages": cfg.pipeline.stages, "microbatches": cfg.pipeline.microbatches, "replicas": cfg.pipeline.replicas,
            "batch_size": t.batch_size, "seq_len": cfg.model.block_size, "seed": cfg.seed,
            "steps": state["steps"], "tokens": state["tokens"], "time_s": total, "wall_s": wall,
            "tokens_per_s": state["tokens"] / total if total > 0 else None,
            "final_val_loss": final["val_loss"], "final_val_ppl": final["val_ppl"],
            "best_val_ppl": min(e["val_ppl"] for e in evals),
            "target_ppl": t.target_ppl,
            "time_to_target_s": reached[0]["time_s"] if reached else None,
            "step_to_target": reached[0]["step"] if reached else None,
            "min_ppl": getattr(self.data, "min_ppl", None),
            "phases": phases, "async_fraction": phases["async"]["time_s"] / total if total > 0 else 0.0,
            "switches": sum(1 for r in records if r.get("event") == "switch"),
            "guard_events": sum(1 for r in records if r.get("event") == "guard"),
            "predicted": {"sync_step_time": self.ctx.sync_step_time, "async_step_time": self.ctx.async_step_time,
                          "switch_time": self.ctx.switch_time},
            "memory": self.runtime.memory(),
            "stopped": state["stopped"], "completed": True,
        }

    def _plots(self, records: list[dict]) -> None:
        title = f"{method_label(self.cfg)}, p={self.cfg.pipeline.stages}, m={self.cfg.pipeline.microbatches}"
        clock = "wall" if self.clock == "wall" else f"pipeline-{self.clock}"
        plot_curves(records, self.dir / "curves.png", self.cfg.train.target_ppl, clock, title)
        plot_phases(records, self.dir / "phases.png", self.cfg.train.target_ppl, clock, title)  # one span if no switch


def final_line(summary: dict) -> str:
    """``final val ppl 5.123 after 200 steps (12.34s pipeline time, time to ppl 6: 8.90s)``"""
    ttt = summary["time_to_target_s"]
    target = f", time to ppl {summary['target_ppl']:g}: {ttt:.2f}s" if ttt is not None else ""
    return (f"final val ppl {summary['final_val_ppl']:.3f} after {summary['steps']} steps "
            f"({summary['time_s']:.2f}s {summary['clock']} time{target})")


def train(cfg, run_dir: Path) -> dict:
    """Run one experiment into ``run_dir``; returns its summary."""
    return Trainer(cfg, run_dir).run()


__all__ = ["ConfigError", "DataError", "Trainer", "TrainingDiverged", "train"]
