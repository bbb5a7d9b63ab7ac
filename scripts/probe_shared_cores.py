"""Do shared cores explain a distributed run's step? A diagnostic for runs with more workers than cores.

The simulator gives every stage a device of its own. With 4 workers on 2 cores (bench_dist's
4-stage runs on this machine) that is not so: while more stages compute than there are cores,
each computes slower, and the transport's threads (gloo's) take their share too. This script
predicts a finished dist run's steady step three ways and prints the measured step over each, and
where each rank's step went (its actions, its waits on its peers, the loop around them):

- ``own device, wall``: each action at its in-run wall time (``runtime.action_times.in_run_profile``),
  every stage on its own device: bench_dist's "at the run's own action costs";
- ``own core, CPU``: each action at its in-run main-thread CPU time (its work on one core, the
  waits for a core left out), every stage on its own core;
- ``shared``: the same CPU costs with the stages sharing ``--cores`` cores: the processor-sharing
  model of :mod:`adapipe_cli.simulator.shared` (``simulate_shared``), with the run's own
  other-thread CPU (``other_threads_cpu_s``, summed over the workers) a step as its background;
  the driver's CPU is not in a run's summary and is left out. (Until 2026-12-05 this script
  solved its own variant, each stage's factor the mean number of stages computing over the
  cores; the module's rate model is exact on one core, where that one was not.)

An AdaPipe run that followed the held-out signal is charged its forward after every update, as
bench_dist charges it. Replicas are refused.

    python scripts/probe_shared_cores.py RUN_DIR... [--cores 2]

RUN_DIR: a dist run's directory (its ``.hydra/config.yaml``, ``metrics.jsonl``, ``profile.json``
and ``summary.json`` with ``action_times``), e.g. the runs bench_dist keeps (``runs in DIR``).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

from omegaconf import OmegaConf

from adapipe_cli.runtime.action_times import in_run_profile
from adapipe_cli.schedules.choice import follows_held_out, microbatch_size, schedule_choice, signal_rows
from adapipe_cli.simulator.clock import CostProfile
from adapipe_cli.simulator.shared import simulate_shared
from adapipe_cli.simulator.simulate import simulate
from adapipe_cli.train.build import pick_sync

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_dist import finished_run  # noqa: E402  (the steady steps bench_dist measures)


def predict(run: Path, cores: float) -> dict:
    cfg = OmegaConf.load(run / ".hydra" / "config.yaml")
    if cfg.pipeline.get("replicas", 1) > 1:
        raise SystemExit(f"{run}: a run with pipeline.replicas > 1 is not modelled here; give a run of one pipeline")
    table = json.loads((run / "summary.json").read_text()).get("action_times")
    if not table or not table.get("actions"):
        raise SystemExit(f"{run}: its summary.json has no action_times (a dist run of a version that times its actions)")
    lo, hi, measured, prof, plan, link = finished_run(run)
    spec = pick_sync(schedule_choice(cfg), prof, link, cfg.schedule.mitigation).spec  # (as the run picked)

    # an AdaPipe run that follows the held-out loss evaluates it after every update (as bench_dist charges it)
    held_out = follows_held_out(cfg)

    def signal(costs: CostProfile) -> list[float] | None:
        return costs.signal_costs(signal_rows(cfg), microbatch_size(cfg)) if held_out else None

    def own_device(costs: CostProfile) -> float:
        sim = simulate(spec, plan, costs, link, record=False, mitigations=list(cfg.schedule.mitigation), signal=signal(costs))
        return (sim.update_end[hi] - sim.update_end[lo]) / (hi - lo)

    cpu_table = copy.deepcopy(table)
    for row in cpu_table["actions"]:
        row["run_s"] = row["cpu_s"]
    cpu = in_run_profile(cpu_table, prof)
    other = sum(r["other_threads_cpu_s"] for r in table["ranks"])
    shared = simulate_shared(spec, plan, cpu, cores, other_cpu_s=other, link=link,
                             mitigations=list(cfg.schedule.mitigation), signal=signal(cpu), window=(lo, hi))
    return {"run": str(run), "measured_s": measured, "own_device_wall_s": own_device(in_run_profile(table, prof)),
            "own_core_cpu_s": own_device(cpu), "shared_s": shared.step_time, "factors": shared.factors,
            "other_threads_cpu_s": other, "ranks": step_parts(table)}


def step_parts(table: dict) -> list[dict]:
    """Per rank, where its mean steady step went (seconds): ``compute`` (its actions, wall),
    ``wait`` (blocked on its peers' messages) and ``loop`` (the rest: between actions, reports, the
    driver's gate). In an asynchronous stream the slowest stage never waits if every action takes
    its mean time: what it waits is the stages' jitter (they take turns being the slowest), which a
    simulator of mean costs leaves out."""
    parts = []
    for r in table["ranks"]:
        compute = sum(a["count"] * a["run_s"] for a in table["actions"] if a["rank"] == r["rank"]) / r["steps"]
        parts.append({"rank": r["rank"], "step": r["step_s"], "compute": compute, "wait": r["wait_peer_s"],
                      "loop": r["between_s"] + r["report_s"] + r["wait_driver_s"]})
    return parts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--cores", type=float, default=2.0)
    a = ap.parse_args()
    for run in a.runs:
        r = predict(run, a.cores)
        m = r["measured_s"]
        print(f"{run}: measured {m * 1e3:.1f} ms; measured over predicted: own device, wall {m / r['own_device_wall_s']:.3f}; "
              f"own core, CPU {m / r['own_core_cpu_s']:.3f}; shared by {a.cores:g} cores {m / r['shared_s']:.3f} "
              f"(factors {' '.join(f'{f:.2f}' for f in r['factors'])}; other threads {r['other_threads_cpu_s'] * 1e3:.1f} ms a step); "
              "per rank, compute / waits on peers / loop (ms): "
              + " | ".join(f"{x['compute'] * 1e3:.1f} / {x['wait'] * 1e3:.1f} / {x['loop'] * 1e3:.1f}" for x in r["ranks"]),
              flush=True)


if __name__ == "__main__":
    main()
