"""``adapipe simulate``: time a schedule's action lists with the discrete-event simulator.

Takes the same config groups as ``adapipe train`` (``conf/simulate.yaml``), so the same overrides
work, plus the simulator's keys (``steps``, ``print``, uniform ``forward``/``backward``/``update``
costs and ``act_bytes``). Prints step time, bubble fraction and utilisation and a per-stage table
of peak activations and weight versions, and writes ``simulation.json`` and ``timeline.png`` to
the Hydra run directory.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from ..config.validate import ADAPIPE_SYNC, ASYNC_SCHEDULES, SCHEDULES
from .compose import HELP_FLAGS, compose_or_fail, one_job, run_composed, without_hydra
from .errors import fail

ACTIONS_PRINTED = 256  # per stage, with print=true
TABLE_WIDTH = 100  # characters: print=true wraps the action table into blocks this wide
RECORD_LIMIT = 2_000_000  # actions: beyond this the timeline is not recorded (memory) nor drawn


@dataclass
class Setup:
    spec: object  # ScheduleSpec
    plan: object  # Plan
    profile: object  # CostProfile
    link: object  # LinkModel
    source: str  # where the costs come from
    allreduce: object = None  # AllReduceModel of pipeline.replicas
    grad_bytes: list | None = None  # per stage, the bytes all-reduced (None: the profile's)
    signal: list | None = None  # per stage, AdaPipe's held-out signal's forward after each update (None: none)


def _need(cond: bool, msg: str) -> None:
    if not cond:
        fail(msg)


def phases(cfg, steps: int) -> list[str]:
    """The phase of every simulated step: one phase for a plain schedule; for ``schedule=adapipe``
    the fixed heuristic's ``heuristic.plan`` ([[phase, steps], ...], null = the rest; the last
    phase continues if the plan is shorter than ``steps``)."""
    from ..schedules.choice import schedule_choice

    choice = schedule_choice(cfg)
    if choice.phase is not None:
        return [choice.phase] * steps
    h = cfg.heuristic
    _need(h.name == "fixed", f"adapipe simulate needs heuristic=fixed (heuristic={h.name} decides from training "
                             f"measurements): give the phases as heuristic.plan=[[sync,4],[async,null]]")
    _need(len(h.plan) > 0, "heuristic.plan is empty: give e.g. heuristic.plan=[[sync,4],[async,null]]")
    out: list[str] = []
    for item in h.plan:
        item = list(item) if not isinstance(item, str) else [item]
        phase, n = item[0], (item[1] if len(item) > 1 else None)
        _need(phase in ("sync", "async"), f"heuristic.plan: unknown phase {phase!r}: use sync or async")
        _need(n is None or (isinstance(n, int) and n >= 1),
              f"heuristic.plan: the step count of {phase} must be a positive integer or null (got {n!r})")
        out += [phase] * (steps - len(out) if n is None else min(int(n), steps - len(out)))
    return out + [out[-1]] * (steps - len(out))


def prepare(cfg) -> Setup:
    """The spec, plan, costs and link of a simulation, or a one-line error (exit 2)."""
    from ..schedules import Plan, ScheduleError
    from ..simulator.clock import AllReduceModel, CostProfile, LinkModel
    from ..config.validate import SIGNALS
    from ..schedules.choice import follows_held_out, microbatch_size, schedule_choice, signal_rows
    from ..train.build import pick_sync

    p, s = cfg.pipeline, cfg.schedule
    _need(p.stages >= 1, f"pipeline.stages must be at least 1 (got {p.stages})")
    _need(p.microbatches >= 1, f"pipeline.microbatches must be at least 1 (got {p.microbatches})")
    _need(cfg.steps >= 1, f"steps must be at least 1 (got {cfg.steps})")
    _need(s.name in SCHEDULES, f"unknown schedule {s.name!r}: use one of {', '.join(SCHEDULES)}")
    if s.name == "adapipe":
        _need(s.sync in ADAPIPE_SYNC, f"unknown schedule.sync={s.sync!r}: use {', '.join(ADAPIPE_SYNC)}")
        _need(s["async"] in ASYNC_SCHEDULES, f"unknown schedule.async={s['async']!r}: use {' or '.join(ASYNC_SCHEDULES)}")
        _need(s.sync != "interleaved" or s.chunks >= 2,
              f"schedule.sync=interleaved needs schedule.chunks >= 2 (got {s.chunks}; with one chunk per device use schedule.sync=1f1b)")
    _need(p.replicas >= 1, f"pipeline.replicas must be at least 1 (got {p.replicas})")
    _need(p.dp_latency_s >= 0 and p.dp_bandwidth >= 0,
          "pipeline.dp_latency_s and pipeline.dp_bandwidth must be >= 0 (bandwidth 0 means infinite)")
    for key in ("forward", "backward", "update", "act_bytes", "grad_bytes"):
        _need(cfg[key] >= 0, f"{key} must be >= 0 (got {cfg[key]})")
    _need(p.link_latency_s >= 0 and p.link_bandwidth >= 0,
          "pipeline.link_latency_s and pipeline.link_bandwidth must be >= 0 (bandwidth 0 means infinite)")
    choice = schedule_choice(cfg)
    spec = choice.spec
    try:
        spec.check()
    except ScheduleError as e:
        fail(str(e))
    n, v = spec.virtual_stages, spec.chunks
    if p.profile:
        profile = _load_profile(p.profile)
        _need(profile.stages == n,
              f"pipeline.profile={p.profile} has {profile.stages} stages but the pipeline has {n}: "
              f"use a profile measured for {n} stages")
        source = p.profile
    else:  # (interleaved: a stage's costs shared by its v chunks)
        profile = CostProfile.uniform(n, cfg["forward"] / v, cfg["backward"] / v, cfg["update"] / v, cfg["act_bytes"])
        source = "uniform"
    steps = cfg.steps
    link = LinkModel.choose(p.link_latency_s, p.link_bandwidth, profile)
    allreduce = AllReduceModel(p.replicas, p.dp_bandwidth, p.dp_latency_s)
    # schedule.sync=auto: picked on the profile (its all-reduce from the profile's bytes, not grad_bytes)
    spec = pick_sync(choice, profile, link, s.mitigation, allreduce).spec
    # AdaPipe follows its held-out loss after every step, as a run of this config would: on the clock
    signal = None
    _need(cfg.heuristic.signal in SIGNALS, f"unknown heuristic.signal={cfg.heuristic.signal!r}: use train or heldout")
    if follows_held_out(cfg):
        signal = profile.signal_costs(signal_rows(cfg), microbatch_size(cfg))
    return Setup(spec, Plan(steps, phases(cfg, steps)), profile, link, source, allreduce,
                 [float(cfg.grad_bytes)] * p.stages if cfg.grad_bytes > 0 else None, signal)


def _load_profile(path: str):
    from ..simulator.clock import CostProfile

    try:
        prof = CostProfile.load(path)
    except FileNotFoundError:
        fail(f"pipeline.profile={path} does not exist: give a saved profile.json")
    except (ValueError, KeyError, TypeError, OSError) as e:
        fail(f"pipeline.profile={path} is not a cost profile ({type(e).__name__}: {e}): give a profile.json "
             f"written by adapipe train")
    _need(len(prof.backward) == len(prof.forward) == len(prof.update),
          f"pipeline.profile={path}: forward, backward and update must list one cost per stage")
    return prof


# -- output -------------------------------------------------------------------------------------
def _fmt(a) -> str:
    """``F3``/``B3``/``U1`` in a sync step; forwards and backwards of async ones carry their
    version, ``F3@v1``."""
    from ..schedules import ASYNC, UPDATE

    if a.kind == UPDATE:
        return f"U{a.step}"
    return str(a) if a.phase == ASYNC else f"{a.kind}{a.mb}"


def action_table(spec, plan, limit: int = ACTIONS_PRINTED, width: int = TABLE_WIDTH) -> str:
    """Every stage's action list, one row per stage, columns aligned (column i: each stage's i-th
    action), wrapped into blocks of at most ``width`` characters, at most ``limit`` actions per
    stage."""
    from ..schedules import Plan, StageProgram

    rows, more = [], []
    for s in range(spec.virtual_stages):  # (interleaved: each virtual stage's own list)
        prog = StageProgram(s, spec, Plan(plan.max_steps, list(plan.phases)))
        row, n = [], 0
        while (a := prog.pop()) is not None:
            n += 1
            if len(row) < limit:
                row.append(_fmt(a))
        rows.append(row)
        more.append(n - len(row))
    ncol = max(map(len, rows), default=0)
    widths = [max(len(r[i]) for r in rows if i < len(r)) for i in range(ncol)]
    prefix = [f"stage {s:>{len(str(spec.virtual_stages - 1))}} | " for s in range(spec.virtual_stages)]
    blocks, first = [], 0
    while first < ncol or not blocks:
        last, used = first, len(prefix[0])
        while last < ncol and (last == first or used + widths[last] <= width):
            used += widths[last] + 1
            last += 1
        block = []
        for s, row in enumerate(rows):
            cells = " ".join(c.ljust(w) for c, w in zip(row[first:last], widths[first:last])).rstrip()
            tail = f" ... (+{more[s]} more)" if more[s] and last == ncol else ""
            block.append(f"{prefix[s]}{cells}{tail}")
        blocks.append("\n".join(block))
        first = last
    return "\n\n".join(blocks)


def summary_text(name: str, setup: Setup, res) -> str:
    """Step time, bubble, utilisation and the per-stage memory table."""
    from ..simulator.simulate import min_steady_steps

    spec = setup.spec
    phases_used = sorted(set(setup.plan.phases), reverse=True)
    util = sum(res.utilization) / len(res.utilization)
    when = "steady state" if res.steady else "whole-run mean"
    lines = [
        f"schedule {name} ({'+'.join(phases_used)}): {spec.stages} stages x {spec.microbatches} microbatches, "
        f"{res.steps} steps, costs {setup.source}",
        f"step time        {res.step_time:.6g} s ({when})",
        f"bubble fraction  {res.bubble_fraction:.4f} ({when}); {res.run_bubble_fraction:.4f} over the whole run",
        f"utilization      {util:.4f} (mean over stages, whole run)",
        f"makespan         {res.makespan:.6g} s",
    ]
    if setup.signal:
        lines.append(f"held-out signal  {max(setup.signal):.6g} s after each update at the slowest stage (AdaPipe's "
                     f"heuristics follow the held-out loss: on the clock; heuristic.signal=train: none)")
    if res.replicas > 1:
        lines.append(f"all-reduce       {max(res.allreduce_s):.6g} s per update at the slowest stage "
                     f"({res.replicas} replicas, all_gather; counted in the bubble)")
    if spec.sync == "zbh2" and "sync" in phases_used:
        lines.append("note: zbh2's updates " + ("wait for every stage (clipping by the global norm or tied embeddings): "
                                                "optim.grad_clip=0 with untied embeddings lets its steps overlap"
                                                if spec.barrier else "do not wait for the other stages: its steps overlap"))
    if not res.steady:
        lines.append(f"note: {res.steps} steps are too few to leave out the fill and the drain; "
                     f"use steps={min_steady_steps(spec.stages, spec.microbatches, spec.chunks)} or more for the steady state")
    lines += ["", "stage  utilization  peak activations  weight versions  parameter sets  peak MiB"]
    for s in range(spec.virtual_stages):  # (interleaved: virtual stages, each with its device's utilization)
        mem = res.memory[s]
        mib = f"{mem['peak_bytes'] / 2**20:.3f}" if mem["peak_bytes"] else "-"
        lines.append(f"{s:>5}  {res.utilization[spec.device_of(s)]:>11.4f}  {res.peak_activations[s]:>16}  "
                     f"{res.weight_versions[s]:>15}  {mem['peak_param_sets']:>14}  {mib:>8}")
    if spec.chunks > 1:
        lines.append(f"(virtual stage s runs on device s % {spec.stages})")
    lines.append("(parameter sets: live, stashed and shadow copies, predictions; MiB needs a measured pipeline.profile)")
    return "\n".join(lines)


def run_simulation(cfg, run_dir: Path) -> dict:
    """Simulate ``cfg``, write ``simulation.json`` and ``timeline.png``, then print the summary."""
    from omegaconf import OmegaConf

    from ..simulator.simulate import simulate
    from ..simulator.timeline import draw_timeline

    from ..train.summary import method_label

    setup = prepare(cfg)
    spec, name = setup.spec, cfg.schedule.name
    shown = method_label(cfg, spec.sync)  # (names AdaPipe's sync and async schedules: adapipe-fixed(zbh1/pipedream+predict))
    actions = setup.plan.max_steps * spec.virtual_stages * (2 * spec.microbatches + 1)
    record = actions <= RECORD_LIMIT
    res = simulate(spec, setup.plan, setup.profile, setup.link, record=record, mitigations=list(cfg.schedule.mitigation),
                   allreduce=setup.allreduce, grad_bytes=setup.grad_bytes, signal=setup.signal)
    run_dir.mkdir(parents=True, exist_ok=True)
    written = ["simulation.json"]
    if record:
        title = (f"{shown}: {spec.stages} stages x {spec.microbatches} microbatches, "
                 + (f"{res.replicas} replicas (A: each stage's all-reduce), " if res.replicas > 1 else "") + f"{res.steps} steps; "
                 f"step {res.step_time:.4g} s, bubble {res.bubble_fraction:.1%}")
        timeline_note = draw_timeline(res.timeline, spec.stages, run_dir / "timeline.png", title)
        written.append("timeline.png")
    else:
        timeline_note = f"skipped: {actions} actions (more than {RECORD_LIMIT})"
    out = res.as_dict()
    out.update(
        schedule=name, sync=spec.sync, weights=spec.weights, phases=list(setup.plan.phases),
        costs=setup.source, profile={"forward": setup.profile.forward, "backward": setup.profile.backward,
                                     "update": setup.profile.update, "act_bytes": setup.profile.act_bytes},
        link={"latency_s": setup.link.latency, "bandwidth": setup.link.bandwidth}, timeline=timeline_note,
        config=OmegaConf.to_container(cfg, resolve=True),
    )
    (run_dir / "simulation.json").write_text(json.dumps(out, indent=2))
    try:
        print(summary_text(shown, setup, res))
        if cfg["print"]:
            print()
            print(f"each stage's actions in order, wrapped (at most {ACTIONS_PRINTED} per stage):")
            print(action_table(spec, setup.plan))
        print(f"\ntimeline.png: {timeline_note}")
        print(f"wrote {', '.join(written)}")
        print(f"results: {run_dir}")
        sys.stdout.flush()
    except BrokenPipeError:  # e.g. piped into head: the files are written, stop printing quietly
        sys.stdout = open(os.devnull, "w")
    return out


def _task(cfg) -> None:
    from hydra.core.hydra_config import HydraConfig

    run_simulation(cfg, Path(HydraConfig.get().runtime.output_dir))


def simulate_command(overrides: list[str]) -> int:
    import hydra

    from ..config import conf_dir
    from ..config.schema import register_simulate_config

    register_simulate_config()
    if any(a in ("-h", "--help") for a in overrides):
        from .train import help_text

        print(help_text(overrides, "simulate", "simulate"))
        return 0
    wants_help = any(a in HELP_FLAGS for a in overrides)
    multirun = any(a in ("-m", "--multirun") for a in overrides)
    composed = None  # a single simulation's config with Hydra's node: composed once, checked, then run
    if not wants_help and not multirun:  # one-line errors before Hydra makes a run directory
        composed = compose_or_fail([a for a in overrides if not a.startswith("-")], config_name="simulate",
                                   check=False, hydra=True, job_name="simulate")
        prepare(without_hydra(composed))
        if not one_job(composed, overrides):  # Hydra's own flags, mode or report: hydra.main's way
            composed = None
    try:
        if composed is not None:
            run_composed(composed, _task)
        else:
            sys.argv = ["adapipe simulate", *overrides]
            hydra.main(config_path=str(conf_dir()), config_name="simulate", version_base="1.3")(_task)()
    except SystemExit as e:
        return int(e.code or 0)
    return 0


__all__ = ["simulate_command", "run_simulation", "prepare", "action_table"]
