"""The training loop of ``adapipe train``: one experiment, start to summary.

Each step the runtime trains every stage up to the step's update; the loop then hands the step's
measurements to the heuristic, which decides the phase of a step ``lag`` steps ahead (the
pipeline needs phases that far in advance), logs the step, evaluates every ``train.eval_every``
steps and stops at ``train.max_steps``, ``train.max_time_s`` or, with ``train.stop_at_target``, at
the target perplexity.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from ..adaptive.base import Context, Observation
from ..config.validate import ConfigError, validate
from ..data import DataError, build_data
from ..runtime.local import LocalRuntime, StepResult
from ..runtime.profile import measure_profile
from ..schedules import Plan, ScheduleError
from ..simulator.clock import CostProfile, LinkModel
from ..simulator.simulate import steady_step_times
from . import build
from .metrics import RunLog
from .optim import StageOptimizer
from .plots import plot_curves, plot_phases
from .progress import Progress


class TrainingDiverged(RuntimeError):
    """The loss became non-finite (or spiked) and no guard recovered it."""


def method_label(cfg) -> str:
    s = cfg.schedule
    if s.name == "pipedream":
        return f"pipedream-{s.weights}" + "".join(f"+{x}" for x in s.mitigation)
    if s.name == "2bw":
        return "2bw" + "".join(f"+{x}" for x in s.mitigation)
    if s.name == "adapipe":
        return f"adapipe-{cfg.heuristic.name}"
    return s.name


def runtime_kind(cfg) -> str:
    """``local`` or ``dist``: ``auto`` picks dist when there is a CUDA device for every stage."""
    if cfg.pipeline.runtime != "auto":
        return cfg.pipeline.runtime
    return "dist" if torch.cuda.is_available() and torch.cuda.device_count() >= cfg.pipeline.stages else "local"


class Trainer:
    def __init__(self, cfg, run_dir: Path):
        self.cfg, self.dir = cfg, Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        validate(cfg)
        if cfg.pipeline.threads > 0:
            torch.set_num_threads(cfg.pipeline.threads)
        torch.manual_seed(cfg.seed)
        t, p = cfg.train, cfg.pipeline
        self.data = build_data(cfg.data, cfg.model.block_size, cfg.seed)
        self.micro = t.batch_size // p.microbatches
        train_tokens = getattr(self.data, "train_tokens", None)
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
        self.stages, self.optimizers = build.make_stages(cfg, self.gcfg)
        self.batches = build.Batches(self.data, t.batch_size, p.microbatches)
        self.link = LinkModel(p.link_latency_s, p.link_bandwidth)
        self.profile = self._profile()
        sync_t, async_t, switch_t = steady_step_times(self.choice.spec, self.profile, self.link)
        self.ctx = Context(p.stages, p.microbatches, t.max_steps, self.lag - 1, sync_t, async_t, switch_t)
        self.heuristic = build.make_heuristic(cfg, self.choice, self.ctx)
        self.policy = build.make_policy(cfg, self.plan)
        self.val = self.data.val_batches(self.micro)
        self.tokens_per_step = t.batch_size * cfg.model.block_size
        self.runtime = self._make_runtime()

    def _make_runtime(self):
        """The local runtime, or the distributed one (``pipeline.runtime=dist``, or ``auto`` with a
        CUDA device for every stage)."""
        cfg, p = self.cfg, self.cfg.pipeline
        if runtime_kind(cfg) == "dist":
            from ..runtime.dist import DistRuntime

            return DistRuntime(self)
        return LocalRuntime(
            self.stages, self.optimizers, self.choice.spec, self.plan, self.policy, self.batches,
            self.profile if p.clock == "profiled" else None, self.link, cfg.optim.grad_clip, cfg.seed,
            cfg.model.tie_embeddings, p.order, self.eval_at, self.val)

    def _profile(self) -> CostProfile:
        p = self.cfg.pipeline
        if p.profile:
            prof = CostProfile.load(p.profile)
            if prof.stages != p.stages:
                raise ConfigError(f"pipeline.profile={p.profile} has {prof.stages} stages but pipeline.stages={p.stages}: "
                                  f"use a profile measured for {p.stages} stages")
        else:
            x, y = self.batches(0, 0)
            prof = measure_profile(self.stages, lambda named: StageOptimizer(named, self.cfg.optim), x, y,
                                   reps=p.profile_reps,
                                   meta={"model": self.cfg.model.name, "stages": p.stages, "microbatch_size": self.micro,
                                         "seq_len": self.cfg.model.block_size, "threads": torch.get_num_threads()})
        prof.save(self.dir / "profile.json")
        return prof

    # -- the loop ------------------------------------------------------------------------------
    def eval_at(self, t: int) -> bool:
        """Evaluate the weights after step ``t`` (t = -1: the initial weights)."""
        n = self.cfg.train.max_steps
        return t == -1 or (t + 1) % self.cfg.train.eval_every == 0 or t + 1 == n

    def run(self) -> dict:
        cfg, t = self.cfg, self.cfg.train
        log = RunLog(self.dir, cfg.logger, OmegaConf.to_container(cfg, resolve=True))
        rt = self.runtime
        first_line = (f"adapipe: runtime={rt.name} backend={rt.backend or 'none'} clock={rt.clock_name} "
                      f"({cfg.pipeline.clock if rt.clock_name == 'pipeline' else 'wall'}) "
                      f"stages={cfg.pipeline.stages} microbatches={cfg.pipeline.microbatches} "
                      f"schedule={method_label(cfg)} model={cfg.model.name} data={self.data.describe()}")
        print(first_line, file=sys.stderr)
        (self.dir / "run.log").write_text(first_line + "\n")
        wall0 = time.perf_counter()
        evals: list[dict] = []
        step_time = {0: 0.0}  # version (updates applied) -> time_s at which it existed
        state = {"tokens": 0, "time_s": 0.0, "stopped": "max_steps", "steps": 0}

        def collect() -> dict | None:
            last = None
            for version, loss in rt.evaluations():
                last = {"kind": "eval", "step": version, "val_loss": loss, "val_ppl": math.exp(min(loss, 50.0)),
                        "time_s": step_time[version], "wall_s": time.perf_counter() - wall0,
                        "tokens": version * self.tokens_per_step}
                log.write(last)
                evals.append(last)
            return last

        for u in range(min(self.lag, t.max_steps)):
            self._decide(u, log)
        progress = Progress(t.max_steps, t.progress)
        try:
            collect()
            for step in range(t.max_steps):
                res = rt.run_step(step)
                if not math.isfinite(res.loss):
                    raise TrainingDiverged(
                        f"training diverged at step {step} (loss {res.loss}): lower optim.lr or schedule.async_lr_scale")
                prev = state["time_s"]
                state.update(tokens=state["tokens"] + self.tokens_per_step, time_s=res.time_s, steps=step + 1)
                step_time[step + 1] = res.time_s
                self.heuristic.observe(Observation(step, res.phase, res.loss, res.time_s, res.time_s - prev, res.staleness_mean))
                if step + self.lag < t.max_steps:
                    self._decide(step + self.lag, log)
                log.write(self._step_record(res, state["tokens"], time.perf_counter() - wall0))
                ev = collect()
                progress.update(res, ev, state["tokens"] / res.time_s if res.time_s > 0 else 0.0)
                if ev and t.stop_at_target and ev["val_ppl"] <= t.target_ppl:
                    state["stopped"] = "target"
                    break
                if t.max_time_s and res.time_s >= t.max_time_s:
                    state["stopped"] = "max_time"
                    break
            if evals[-1]["step"] != state["steps"]:
                self.runtime.evaluate_now(state["steps"])
                collect()
            progress.close()
            summary = self._summary(log.records, evals, state, time.perf_counter() - wall0)
            log.summary(summary)
        finally:
            progress.close()
            rt.close()
            log.close()
        self._plots(log.records)
        return summary

    def _decide(self, u: int, log: RunLog) -> None:
        d = self.heuristic.decide(u)
        prev = self.plan.phases[u - 1] if u > 0 else None
        self.runtime.decide(u, d.phase)
        if prev is not None and d.phase != prev:
            log.write({"kind": "event", "event": "switch", "step": u, "from": prev, "to": d.phase,
                       "reason": d.reason, "decided_after_step": u - self.lag, **d.info})

    def _step_record(self, r: StepResult, tokens: int, wall: float) -> dict:
        return {"kind": "step", "step": r.step, "phase": r.phase, "loss": r.loss, "lr": r.lr, "tokens": tokens,
                "time_s": r.time_s, "wall_s": wall, "staleness": r.staleness_mean, "staleness_max": r.staleness_max,
                "bubble": r.bubble, "grad_norm": r.grad_norm, "weight_versions": r.versions_max,
                "activations": r.inflight_max}

    def _summary(self, records: list[dict], evals: list[dict], state: dict, wall: float) -> dict:
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
        total = state["time_s"]
        return {
            "method": method_label(cfg), "schedule": cfg.schedule.name,
            "heuristic": cfg.heuristic.name if cfg.schedule.name == "adapipe" else None,
            "runtime": self.runtime.name, "backend": self.runtime.backend, "clock": self.runtime.clock_name,
            "clock_mode": cfg.pipeline.clock if self.runtime.clock_name == "pipeline" else "wall",
            "model": cfg.model.name, "data": cfg.data.name, "optimizer": cfg.optim.name,
            "stages": cfg.pipeline.stages, "microbatches": cfg.pipeline.microbatches,
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
            "predicted": {"sync_step_time": self.ctx.sync_step_time, "async_step_time": self.ctx.async_step_time,
                          "switch_time": self.ctx.switch_time},
            "memory": self.runtime.memory(),
            "stopped": state["stopped"], "completed": True,
        }

    def _plots(self, records: list[dict]) -> None:
        title = f"{method_label(self.cfg)}, p={self.cfg.pipeline.stages}, m={self.cfg.pipeline.microbatches}"
        clock = self.runtime.clock_name
        plot_curves(records, self.dir / "curves.png", self.cfg.train.target_ppl, clock, title)
        if self.cfg.schedule.name == "adapipe" or any(r.get("event") == "switch" for r in records):
            plot_phases(records, self.dir / "phases.png", self.cfg.train.target_ppl, clock, title)


def train(cfg, run_dir: Path) -> dict:
    """Run one experiment into ``run_dir``; returns its summary."""
    return Trainer(cfg, run_dir).run()


__all__ = ["ConfigError", "DataError", "Trainer", "TrainingDiverged", "train"]
