"""What a run reports about itself: its name in the field's words, its lines in ``metrics.jsonl``,
``summary.json`` (the final metrics), a dist run's ``profile_in_run.json``, the first and last lines it
prints, and its plots."""

from __future__ import annotations

import resource
from pathlib import Path

from ..runtime.action_times import in_run_profile
from ..runtime.base import Runtime, StepResult
from ..schedules import ASYNC, SYNC
from .plots import plot_curves, plot_phases
from .state import RunState


def interleaved_chunks(schedule) -> int:
    """AdaPipe's chunks per device with ``schedule.sync=interleaved`` (both phases hold them), else 1."""
    s = schedule
    return s.chunks if s.name == "adapipe" and s.sync == "interleaved" else 1


def async_label(schedule) -> str:
    """The published name of the async schedule a config runs (``schedule=pipedream``/``2bw``, or
    adapipe's ``schedule.async``), with every mitigation named: ``pipedream`` (PipeDream, weight
    stashing), ``pipedream-latest``, ``2bw`` (PipeDream-2BW), ``pipedream+predict``, ...;
    ``pipedream-v2``: PipeDream over the ``2p`` virtual stages of interleaved 1F1B's placement."""
    s = schedule
    base = s["async"] if s.name == "adapipe" else s.name
    name = "2bw" if base == "2bw" else ("pipedream" if s.weights == "stash" else f"pipedream-{s.weights}")
    v = interleaved_chunks(s)
    return name + (f"-v{v}" if v > 1 else "") + "".join(f"+{x}" for x in s.mitigation)


def method_label(cfg, sync: str | None = None) -> str:
    """What a run is, in the field's names, wherever it shows (run log, summary.json, plots):
    ``1f1b``, ``gpipe``, ``pipedream``, ``2bw+predict``, ``adapipe-goodput(zbh1/pipedream+predict)``
    (AdaPipe: its heuristic, then the sync and async schedules it switches between;
    ``adapipe-fixed(interleaved-v2/pipedream-v2)``: interleaved 1F1B with 2 chunks per device and
    PipeDream over the same ``2p`` virtual stages; ``adapipe-gain(auto:1f1b/pipedream+predict)``:
    ``schedule.sync=auto`` ran as ``sync``, the run's pick)."""
    s = cfg.schedule
    if s.name in ("pipedream", "2bw"):
        return async_label(s)
    if s.name == "adapipe":
        return f"adapipe-{cfg.heuristic.name}({sync_label(s, sync)}/{async_label(s)})"
    return s.name


def sync_label(schedule, sync: str | None = None) -> str:
    """AdaPipe's sync schedule: ``schedule.sync``, with its chunks when interleaved (``interleaved-v2``);
    ``auto:zbh1`` when ``schedule.sync=auto`` ran as ``sync`` (``auto`` before the run has picked)."""
    if schedule.sync == "auto":
        return f"auto:{sync}" if sync else "auto"
    v = interleaved_chunks(schedule)
    return schedule.sync + (f"-v{v}" if v > 1 else "")


def first_line(cfg, runtime: Runtime, clock: str, device, data: str, sync: str | None = None) -> str:
    """``adapipe: runtime=local backend=none clock=pipeline (profiled) device=cpu ... data=...``;
    ``sync``: the sync schedule the run picked (``schedule.sync=auto``), as in :func:`method_label`."""
    rt, t = runtime, cfg.train
    return (f"adapipe: runtime={rt.name} backend={rt.backend or 'none'} clock={rt.clock_name} "
            f"({clock}) "
            + (f"device={device} " if rt.name == "local" else "") + f"precision={t.precision} "
            f"stages={cfg.pipeline.stages} microbatches={cfg.pipeline.microbatches} "
            + (f"replicas={cfg.pipeline.replicas} " if cfg.pipeline.replicas > 1 else "") +
            f"schedule={method_label(cfg, sync)} model={cfg.model.name} data={data}")


def step_record(r: StepResult, time_s: float, tokens: int, wall: float) -> dict:
    """A step's line in ``metrics.jsonl``."""
    return {"kind": "step", "step": r.step, "phase": r.phase, "loss": r.loss, "lr": r.lr, "tokens": tokens,
            "time_s": time_s, "wall_s": wall, "staleness": r.staleness_mean, "staleness_max": r.staleness_max,
            "bubble": r.bubble, "grad_norm": r.grad_norm, "weight_versions": r.versions_max,
            "param_sets": r.param_sets_max, "activations": r.inflight_max,
            **({"lr_stages": r.lr_stages} if r.lr_stages else {})}


def phase_times(records: list[dict], start: float = 0.0) -> dict[str, dict]:
    """Steps and clock time by phase over ``records`` (``metrics.jsonl``'s, in order) from the clock
    at ``start``: each step record's ``time_s`` increment, and the time an event lost to a rollback
    or undone probe in the phases of the steps it discarded (its ``lost_by_phase``; the next step's
    increment holds that time, so it is taken off there)."""
    phases = {ph: {"steps": 0, "time_s": 0.0} for ph in (SYNC, ASYNC)}
    prev = start
    for r in records:
        if r.get("kind") == "step":
            phases[r["phase"]]["steps"] += 1
            phases[r["phase"]]["time_s"] += r["time_s"] - prev
            prev = r["time_s"]
        elif "lost_by_phase" in r:
            for ph, lost in r["lost_by_phase"].items():
                phases[ph]["time_s"] += lost
            prev += r["lost_time_s"]
    return phases


def run_summary(cfg, records: list[dict], evals: list[dict], st: RunState, wall: float, *, runtime: Runtime,
                clock: str, device, phase: str | None, ctx, min_ppl: float | None, sync: str | None = None) -> dict:
    """``summary.json`` of a finished run: ``records`` and ``evals`` as written to ``metrics.jsonl``,
    ``st`` the loop's final state, ``phase`` a plain schedule's one phase (None: adapipe), ``ctx`` the
    heuristic's context (its predicted step times); time in a phase is the sum of its steps'
    ``time_s`` increments and of the time lost in it to rollbacks and undone probes (their events'
    ``lost_by_phase``; ``steps`` counts the steps kept), ``async_fraction`` = async time / ``time_s``; ``driver_peak_rss_mb`` the
    peak resident memory of this process so far (the driver; on local it holds every stage); ``sync``
    the sync schedule the run picked (``schedule.sync=auto``), recorded as ``sync_schedule``."""
    t = cfg.train
    steps = [r for r in records if r.get("kind") == "step"]
    phases = phase_times(records)
    reached = [e for e in evals if t.target_ppl and e["val_ppl"] <= t.target_ppl]
    final = evals[-1]
    state = {"steps": st.steps, "tokens": st.tokens, "stopped": st.stopped}
    total = st.time_s
    return {
        "method": method_label(cfg, sync), "schedule": cfg.schedule.name,
        # the schedule each phase ran as (adapipe: both; a plain schedule: its one phase)
        "phase_schedules": {"sync": sync_label(cfg.schedule, sync) if cfg.schedule.name == "adapipe" else
                            (cfg.schedule.name if phase == SYNC else None),
                            "async": async_label(cfg.schedule) if phase != SYNC else None},
        "heuristic": cfg.heuristic.name if cfg.schedule.name == "adapipe" else None,
        "sync_schedule": sync if cfg.schedule.name == "adapipe" else None,  # (what schedule.sync=auto picked)
        "runtime": runtime.name, "backend": runtime.backend, "clock": runtime.clock_name,
        "clock_mode": clock,
        "device": str(device) if runtime.name == "local" else None, "precision": t.precision,
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
        "min_ppl": min_ppl,
        "phases": phases, "async_fraction": phases["async"]["time_s"] / total if total > 0 else 0.0,
        "switches": sum(1 for r in records if r.get("event") == "switch"),
        "guard_events": sum(1 for r in records if r.get("event") == "guard"),
        "undone_probes": sum(1 for r in records if r.get("event") == "undo"),
        "undone_time_s": sum(r["lost_time_s"] for r in records if r.get("event") == "undo"),
        "predicted": {"sync_step_time": ctx.sync_step_time, "async_step_time": ctx.async_step_time,
                      "switch_time": ctx.switch_time},
        "memory": runtime.memory(),
        "action_times": runtime.action_times(),  # (dist: the actions' seconds against the profile's)
        # (ru_maxrss is in KiB on Linux; the dist runtime's workers report theirs in memory)
        "driver_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "stopped": state["stopped"], "completed": True,
    }


def save_in_run_profile(table: dict | None, profile, folder: Path, warn) -> None:
    """A dist run's ``profile_in_run.json``: its profile with each stage's costs as its steady
    actions took them (:func:`..runtime.action_times.in_run_profile`), for a local run or
    ``adapipe simulate`` that should charge what this pipeline's actions cost in a run. A run
    without such a table (local, CUDA workers) leaves none, nor an earlier run's in the folder; a
    failure to make it is a warning (the run itself is done)."""
    path = folder / "profile_in_run.json"
    try:
        prof = in_run_profile(table, profile) if table and profile is not None else None
        if prof is None:
            path.unlink(missing_ok=True)
        else:
            prof.save(path)
    except Exception as e:  # noqa: BLE001 - a diagnostic output: the finished run stands
        warn(f"adapipe: warning: profile_in_run.json not written: {e}")


def final_line(summary: dict) -> str:
    """``final val ppl 5.123 after 200 steps (12.34s pipeline time, time to ppl 6: 8.90s)``"""
    ttt = summary["time_to_target_s"]
    target = f", time to ppl {summary['target_ppl']:g}: {ttt:.2f}s" if ttt is not None else ""
    return (f"final val ppl {summary['final_val_ppl']:.3f} after {summary['steps']} steps "
            f"({summary['time_s']:.2f}s {summary['clock']} time{target})")


def plot_run(cfg, clock: str, records: list[dict], folder: Path, sync: str | None = None) -> None:
    """``curves.png`` and ``phases.png`` (one span if no switch) of a run in ``folder``; ``sync`` as in
    :func:`method_label`."""
    title = f"{method_label(cfg, sync)}, p={cfg.pipeline.stages}, m={cfg.pipeline.microbatches}"
    axis = "wall" if clock == "wall" else f"pipeline-{clock}"
    plot_curves(records, folder / "curves.png", cfg.train.target_ppl, axis, title)
    plot_phases(records, folder / "phases.png", cfg.train.target_ppl, axis, title)
