"""Training throughput on this machine, and adapipe's overhead over a bare PyTorch loop.

Prints tokens/s of gpt-nano and gpt-micro with 1 and 2 threads (adapipe, one stage), and the
ratio of adapipe's one-stage training step to a bare PyTorch loop over the same model and batch
(goal: at most 1.05), their steps alternating. Run: python scripts/bench_train.py [--steps N]
"""

from __future__ import annotations

import argparse

import torch

from _bench_common import adapipe_local, bare_loop, batches, gpt, interleaved_median_steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    print(f"{'model':<10} {'threads':>7} {'bare tok/s':>11} {'adapipe tok/s':>14} {'adapipe/bare':>13}")
    for name in ("gpt-nano", "gpt-micro"):
        cfg = gpt(name)
        data = batches(cfg, args.batch, 8)
        tokens = args.batch * cfg.block_size
        for threads in (1, 2):
            torch.set_num_threads(threads)
            # one step of each in turn: a drift in the machine's speed slows both alike
            t = interleaved_median_steps({"bare": bare_loop(cfg, data), "ours": adapipe_local(cfg, data, p=1, m=1)},
                                         args.steps)
            bare, ours = t["bare"], t["ours"]
            print(f"{name:<10} {threads:>7} {tokens / bare:>11,.0f} {tokens / ours:>14,.0f} {ours / bare:>13.3f}")


if __name__ == "__main__":
    main()
