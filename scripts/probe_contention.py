"""Do two workers computing at once slow each other? (issue 19's in-run / profiled gap)

Two processes, one thread each, stage r of bench_dist's 2-stage cut on rank r (gpt-nano, batch 16,
4 microbatches: a microbatch of 4 rows). Rounds alternate three modes: stage 0 alone (rank 1
blocked on a barrier, using no CPU), stage 1 alone, and both at once; in each round the active
ranks time ``--calls`` forwards, backwards and updates (profile.stage_work's, the profile's own
work; "both" runs the two ranks' updates at about the same moment, as a synchronous update does). For
each stage and kind: the median over calls of wall and thread-CPU time alone and together, and
their ratio (together / alone). CPU time is what a stage computes while it runs, so a CPU ratio
above 1 is contention (cache, memory bandwidth, a shared physical core, clocks), not preemption.
Not a benchmark of record. Run: python scripts/probe_contention.py [--rounds 30] [--calls 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

MODES = ("alone0", "alone1", "both")
KINDS = ("forward", "backward", "update")


def _rank(rank: int, args: dict, barrier, queue) -> None:
    from adapipe_cli.cli.compose import compose_config
    from adapipe_cli.data import build_data
    from adapipe_cli.model.build import make_stages, model_config
    from adapipe_cli.optim import StageOptimizer
    from adapipe_cli.runtime.profile import stage_work

    torch.set_num_threads(1)
    cfg = compose_config([f"model={args['model']}", "pipeline.stages=2", "pipeline.microbatches=4",
                          f"train.batch_size={args['batch']}"])
    data = build_data(cfg.data, cfg.model.block_size, cfg.seed)
    modules, _ = make_stages(cfg, model_config(cfg, data.vocab_size), which=[rank])
    x, y = data.train_batch(0, args["batch"] // 4)
    work, _ = stage_work(modules[0], lambda named: StageOptimizer(named, cfg.optim), x, y)
    for kind in KINDS:  # warm-up
        work[kind](time.perf_counter)
    times = {(m, k, c): [] for m in MODES for k in KINDS for c in ("wall", "cpu")}
    for i in range(args["rounds"] * len(MODES)):
        mode = MODES[i % len(MODES)]
        barrier.wait()
        if mode in ("both", f"alone{rank}"):
            for _ in range(args["calls"]):
                for kind in KINDS:  # (a backward's graph is built untimed inside, by the work's setup)
                    times[(mode, kind, "wall")].append(work[kind](time.perf_counter))
                    times[(mode, kind, "cpu")].append(work[kind](time.thread_time))
        barrier.wait()
    queue.put((rank, {"|".join(k): v for k, v in times.items()}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-nano")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--json", default=None, help="also write the per-call times here")
    args = vars(ap.parse_args())
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args, barrier, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(queue.get() for _ in procs)
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        sys.exit(f"a rank failed: {[p.exitcode for p in procs]}")
    if args["json"]:
        with open(args["json"], "w") as f:
            json.dump(got, f)
    print(f"{args['model']}, stage r of 2 on rank r, microbatch {args['batch'] // 4}, 1 thread each, "
          f"{args['rounds']} rounds x {args['calls']} calls per mode; ms alone -> together (x ratio), median | min")
    for rank in (0, 1):
        t = got[rank]
        for kind in KINDS:
            cols = []
            for c in ("wall", "cpu"):
                for name, f in (("median", statistics.median), ("min", min)):
                    a, b = (1e3 * f(t[f"{m}|{kind}|{c}"]) for m in (f"alone{rank}", "both"))
                    cols.append(f"{c} {name} {a:5.2f} -> {b:5.2f} ({b / a:.2f}x)")
            print(f"stage {rank} {kind:<8}  " + "  ".join(cols))


if __name__ == "__main__":
    main()
