"""What honest accounting changes: the simulated step times and memory of each method, with the
work of weight copies and predictions charged (today's clock) and left free (the clock before it),
and with the in-flight toll (``CostProfile.held``: an action's cost grows with the microbatches
its stage holds) and without it (the same profile's costs with its in-flight table dropped: not
the clock before 2026-12-04, whose profiles timed the plain forward and backward without the
in-flight timings beside them).

For each optimizer it measures one cost profile per depth (gpt-micro, microbatches of 4 sequences,
one thread; the same way a sweep does), then prints per depth and microbatch count the steady
sync (1F1B and ZB-H1) and async step times of PipeDream and 2BW, plain and with weight prediction, under
the three clocks, the sync/async ratio R that AdaPipe's decisions rest on, the first stage's
in-flight factors (forward and backward at 4 and at 8 microbatches; the profile measures 4, and
keeps its factor beyond) and the peak parameter sets and
MiB of the first stage. Run on a quiet machine: python scripts/bench_accounting.py
[--optims adamw muon] [--depths 2 4 8] [--micro 1 4] [--out docs/results/accounting.md]
"""

from __future__ import annotations

import argparse
import copy
import platform
from pathlib import Path

import torch

from adapipe_cli.cli.compose import compose_config
from adapipe_cli.data import build_data
from adapipe_cli.data.batches import Batches
from adapipe_cli.model.build import make_stages, model_config
from adapipe_cli.runtime.profile_meta import measure_stage_profile
from adapipe_cli.schedules import ASYNC, Plan, ScheduleSpec
from adapipe_cli.simulator.clock import CostProfile
from adapipe_cli.simulator.simulate import min_steady_steps, simulate, steady_step_times


def profile_for(optim: str, p: int, reps: int) -> CostProfile:
    cfg = compose_config(["model=gpt-micro", f"optim={optim}", f"pipeline.stages={p}", "pipeline.microbatches=1",
                          "train.batch_size=4", "pipeline.threads=1", f"pipeline.profile_reps={reps}"])
    data = build_data(cfg.data, cfg.model.block_size, cfg.seed)
    gcfg = model_config(cfg, data.vocab_size)
    stages, _ = make_stages(cfg, gcfg)
    x, y = Batches(data, 4, 1)(0, 0)
    return measure_stage_profile(cfg, stages, x, y)


def free_of_extras(prof: CostProfile) -> CostProfile:
    return CostProfile(prof.forward, prof.backward, prof.update, prof.act_bytes, prof.meta, memory=prof.memory)


def without_held(prof: CostProfile) -> CostProfile:
    """``prof`` with its extra work charged but no in-flight toll."""
    out = copy.deepcopy(prof)
    out.held = {}
    return out


def first_stage_memory(spec: ScheduleSpec, prof: CostProfile, mitigation: list[str]) -> tuple[int, float]:
    n = min_steady_steps(spec.stages, spec.microbatches) + 3
    mem = simulate(spec, Plan(n, [ASYNC] * n), prof, record=False, mitigations=mitigation).memory[0]
    return mem["peak_param_sets"], mem["peak_bytes"] / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--optims", nargs="+", default=["adamw", "muon"])
    ap.add_argument("--depths", nargs="+", type=int, default=[2, 4, 8])
    ap.add_argument("--micro", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=None, help="also write the table as Markdown to this file")
    args = ap.parse_args()
    torch.set_num_threads(1)
    head = ("| optim | p | m | sync ms (same mitigations) | zbh1 ms | method | async ms (charged) | async ms (no in-flight toll) "
            "| async ms (free) | R charged | R no toll | R free | stage-0 F, B at 4, 8 in flight | stage-0 param sets | stage-0 peak MiB |")
    lines = [f"Hardware: {platform.processor() or platform.machine()}, {torch.get_num_threads()} thread, "
             f"torch {torch.__version__}; gpt-micro, microbatches of 4 sequences of 64 tokens.", "",
             head, "|" + "---|" * (head.count("|") - 1)]
    print(lines[0])
    print(head)
    for optim in args.optims:
        for p in args.depths:
            prof = profile_for(optim, p, args.reps)
            free, untolled = free_of_extras(prof), without_held(prof)
            factors = " ".join(f"{prof.held_factor(0, k, d):.2f}" for k in ("F", "B") for d in (4, 8))
            for m in args.micro:
                for name, weights, mitigation in (("pipedream", "stash", []), ("pipedream+predict", "stash", ["predict"]),
                                                  ("2bw", "2bw", []), ("2bw+predict", "2bw", ["predict"])):
                    spec = ScheduleSpec(p, m, "1f1b", weights)
                    if weights == "2bw" and m < p - 1:
                        continue
                    s_c, a_c, _ = steady_step_times(spec, prof, None, mitigation)
                    s_u, a_u, _ = steady_step_times(spec, untolled, None, mitigation)
                    s_f, a_f, _ = steady_step_times(spec, free, None, mitigation)
                    sets, mib = first_stage_memory(spec, prof, mitigation)
                    zb, _, _ = steady_step_times(ScheduleSpec(p, m, "zbh1"), prof, None, mitigation)
                    row = (f"| {optim} | {p} | {m} | {1000 * s_c:.2f} | {1000 * zb:.2f} | {name} | {1000 * a_c:.2f} | {1000 * a_u:.2f} "
                           f"| {1000 * a_f:.2f} | {s_c / a_c:.3f} | {s_u / a_u:.3f} | {s_f / a_f:.3f} | {factors} | {sets} | {mib:.2f} |")
                    print(row, flush=True)
                    lines.append(row)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
