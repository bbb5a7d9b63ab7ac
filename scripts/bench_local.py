"""Local runtime overhead: a p-stage pipeline emulated in one process against one stage.

Prints the step time of the local runtime with p = 1, 2, 4, 8 stages of gpt-micro (8 blocks) on
one thread, sync 1F1B and async PipeDream, and the ratio to one stage (goal: at most 1.15 for
p = 4 and 8). The work is identical: the ratio is what splitting into stages and the engine's
bookkeeping cost. The four depths' steps alternate, one of each per round, so that a drift in the
machine's speed slows them alike. Run: python scripts/bench_local.py [--steps N] [--microbatches M]
"""

from __future__ import annotations

import argparse

import torch

from _bench_common import adapipe_local, batches, gpt, interleaved_median_steps

DEPTHS = (1, 2, 4, 8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = gpt("gpt-micro")
    data = batches(cfg, args.batch, 8)
    m = args.microbatches
    print(f"gpt-micro, batch {args.batch}, {m} microbatches, 1 thread")
    print(f"{'phase':<6} {'stages':>6} {'step ms':>8} {'vs 1 stage':>10}")
    for phase in ("sync", "async"):
        # the depths' steps alternate, one of each per round: the speed of a shared machine drifts
        # by more than the engine's overhead between runs a minute apart
        times = interleaved_median_steps({p: adapipe_local(cfg, data, p=p, m=m, phase=phase) for p in DEPTHS},
                                         args.steps)
        for p in DEPTHS:
            print(f"{phase:<6} {p:>6} {1000 * times[p]:>8.2f} {times[p] / times[1]:>10.3f}")


if __name__ == "__main__":
    main()
