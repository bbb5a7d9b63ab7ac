"""AdaPipe's heuristics on synthetic observation streams with known efficiency: time to a target
loss for sync, async, rate, goodput and gain, relative to the better fixed phase.

The streams are those of tests/test_heuristics.py: a phase advances "progress" by its per-step
gain (sync 1, async E) at a step time (sync 1, async 0.5, so R = 2); async's E falls linearly
from e0 to e1 over ``span`` units of progress (a crossing when 2 e0 > 1 > 2 e1), and every
switch into async loses 3 steps of progress (its transient); the loss is 1 + 4 exp(-0.002
progress) plus Gaussian noise (sd 0.01). Each heuristic starts where ``heuristic.start=auto``
puts it and runs until the noise-free loss reaches the target.

    python scripts/bench_heuristics.py [--seeds 6] [--out docs/results/heuristics.md]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_heuristics import Crossing, time_to  # noqa: E402  (the streams the tests use)

STREAMS = [  # (e0, e1, span): what each stands for
    ((0.9, 0.2, 600), "crossing early: async 1.8x sync per second at first, 0.4x late"),
    ((0.8, 0.3, 1000), "crossing late: 1.6x to 0.6x"),
    ((0.9, 0.6, 800), "async dominates: 1.8x to 1.2x"),
    ((0.4, 0.2, 800), "sync dominates: 0.8x to 0.4x"),
    ((0.7, 0.7, 1), "async dominates, constant: 1.4x"),
    ((0.3, 0.8, 600), "rising: 0.6x at first, 1.6x late (sync early, async late)"),
]
METHODS = ["sync", "async", "rate", "goodput", "gain"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--targets", type=float, nargs="+", default=[2.0, 1.5, 1.3])
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    lines = ["| stream | target loss | " + " | ".join(METHODS[2:]) + " | best fixed |", "|---|---|---|---|---|---|"]
    for (e0, e1, span), what in STREAMS:
        for target in a.targets:
            ratios = {m: [] for m in METHODS[2:]}
            best_names = []
            for seed in range(a.seeds):
                t = {m: time_to(m, Crossing(e0, e1, span, seed=seed), target) for m in METHODS}
                best = min(t["sync"], t["async"])
                best_names.append("sync" if t["sync"] <= t["async"] else "async")
                for m in ratios:
                    ratios[m].append(t[m] / best)
            cells = [f"{statistics.median(r):.3f} ({min(r):.3f}-{max(r):.3f})" for r in ratios.values()]
            lines.append(f"| {what} | {target} | " + " | ".join(cells) + f" | {statistics.mode(best_names)} |")
            print(lines[-1], flush=True)
    text = ("Time to the target over the better fixed phase's (below 1: faster than both), median over "
            f"{a.seeds} seeds (min-max).\n\n" + "\n".join(lines) + "\n")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text)


if __name__ == "__main__":
    main()
